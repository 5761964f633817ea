"""The ``aitune`` command line."""

from __future__ import annotations

import json
import sys
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
