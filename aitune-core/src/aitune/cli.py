"""The ``aitune`` command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="aitune: tune PyTorch modules across inference backends.", no_args_is_help=True)


@app.callback()
def _root() -> None:
    """aitune: tune PyTorch modules across inference backends."""


def _backend_rows() -> list[dict[str, Any]]:
    from .plugins import get_manager

    manager = get_manager()
    rows: list[dict[str, Any]] = []
    for name in manager.registry.names():
        status = manager.registry.status(name)
        rows.append(
            {
                "backend": name,
                "distribution": status.distribution,
                "version": status.version,
                "status": "available" if status.available else "unavailable",
                "reason": status.reason(),
                "devices": status.devices,
            }
        )
    for plugin in manager.failed_plugins():
        rows.append(
            {
                "backend": plugin.name,
                "distribution": plugin.distribution,
                "version": plugin.version,
                "status": "failed to load",
                "reason": plugin.error,
                "devices": {},
            }
        )
    return rows


@app.command()
def backends(as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts.")) -> None:
    """List the installed backends, whether each can run here, and why not."""
    rows = _backend_rows()
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    table = Table(title="aitune backends")
    for column in ("backend", "distribution", "version", "status", "devices"):
        table.add_column(column)
    for row in rows:
        style = {"available": "green", "unavailable": "yellow"}.get(row["status"], "red")
        status = row["status"] if not row["reason"] else f"{row['status']}: {row['reason']}"
        devices = ", ".join(f"{d} ✓" if r is None else f"{d} ✗" for d, r in row["devices"].items())
        table.add_row(row["backend"], row["distribution"], row["version"], f"[{style}]{status}[/]", devices)
    Console().print(table)


@app.command()
def verify(
    artifact: Path = typer.Argument(..., help="The .ait file."),
    sha256: str | None = typer.Option(None, "--sha256", help="Expected SHA-256 of the whole file."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts."),
) -> None:
    """Check an artifact's integrity and whether it can run on this machine (exit 1 if not)."""
    from .artifact import verify as verify_artifact

    result = verify_artifact(artifact, sha256)
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        typer.echo(f"{artifact}: integrity ok")
        for problem in result["problems"]:
            typer.echo(f"cannot run here: {problem}")
        if result["runnable_here"]:
            typer.echo("every payload can run here")
    if not result["runnable_here"]:
        raise typer.Exit(1)


@app.command()
def show(
    artifact: Path = typer.Argument(..., help="The .ait file."),
    as_json: bool = typer.Option(False, "--json", help="Print the manifest as JSON."),
) -> None:
    """Show an artifact's modules, graphs, backends, sizes and where it was tuned."""
    from .artifact.archive import open_artifact
    from .artifact.load import read_manifest
    from .converter import unstructure

    with open_artifact(artifact) as reader:
        manifest = read_manifest(reader)
        sizes = {name: info.file_size for name, info in reader.infos.items()}
    if as_json:
        typer.echo(json.dumps(unstructure(manifest), indent=2))
        return
    console = Console()
    console.print(f"[bold]{artifact}[/] format {manifest.format_version}, aitune {manifest.aitune_version}, {manifest.created_at}")
    env = manifest.environment
    console.print(f"tuned on: torch {env.get('torch')}, {env.get('gpu') or env.get('cpu')}, CUDA {env.get('cuda')}")
    table = Table()
    for column in ("module", "graph", "backend", "inputs", "payload"):
        table.add_column(column)
    for module in manifest.modules:
        table.add_row(module.name, "weights", "", "", _size(sizes.get(module.weights, 0)))
        for i, graph in enumerate(module.graphs):
            inputs = ", ".join(
                f"{t.path}({', '.join(d or str(s) for s, d in zip(t.shape, t.dims))})" for t in graph.graph.inputs
            )
            payload = sum(sizes.get(f"{graph.payload}/{f}", 0) for f in graph.files)
            table.add_row("", str(i), graph.backend, inputs, _size(payload))
    console.print(table)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


cache_app = typer.Typer(help="The build cache.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")


@cache_app.command("info")
def cache_info(as_json: bool = typer.Option(False, "--json")) -> None:
    """Where the build cache is, how many builds it holds and their size."""
    from . import buildcache

    data = buildcache.info()
    typer.echo(json.dumps(data) if as_json else f"{data['path']}: {data['entries']} builds, {_size(data['bytes'])}")


@cache_app.command("clear")
def cache_clear() -> None:
    """Delete every cached build."""
    from . import buildcache

    typer.echo(f"removed {buildcache.clear()} cached builds")


def main() -> None:
    try:
        app()
    except Exception as exc:  # an aitune error is a message for the user, not a traceback
        from .errors import AituneError

        if isinstance(exc, AituneError):
            Console(stderr=True).print(f"[red]error:[/] {exc}")
            sys.exit(1)
        raise


if __name__ == "__main__":
    main()
