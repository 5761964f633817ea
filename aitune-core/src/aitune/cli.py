"""The ``aitune`` command line: one typer app, one function per command.

The commands share one way of printing tables, so piped and terminal output read alike.

The commands use the process's plugin manager, or the one given as click's context object:
``app(obj=manager)``, or ``CliRunner().invoke(app, args, obj=manager)`` in a test.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from .plugins import AituneManager

app = typer.Typer(help="aitune: tune PyTorch modules across inference backends.", no_args_is_help=True)


@app.callback()
def _root(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log every step, also in a terminal.")) -> None:
    """aitune: tune PyTorch modules across inference backends."""
    _setup_logging(verbose)


def _manager(ctx: typer.Context) -> AituneManager:
    """The manager this invocation was given as its context object, else the process's."""
    from .plugins import AituneManager, get_manager

    return ctx.obj if isinstance(ctx.obj, AituneManager) else get_manager()


def _setup_logging(verbose: bool) -> None:
    """Plain step lines when output is not a terminal (CI logs); live progress when it is.

    Third-party notices that say nothing actionable to an aitune user (torch deprecations raised
    from its own internals, torchao's optional GPU kernels failing to load on a CPU machine) are
    kept out of the way; ``--verbose`` shows everything.
    """
    import logging
    import warnings

    interactive = sys.stderr.isatty()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("aitune").setLevel(logging.INFO if verbose or not interactive else logging.WARNING)
    if verbose:
        return
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(torch|copyreg|torchao)")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(torch\.|torchao)")
    for noisy in ("torchao", "torch.utils._pytree", "torch._dynamo", "torch._inductor"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def _backend_rows(manager: AituneManager) -> list[dict[str, Any]]:
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


def printable(text: str) -> str:
    """``text`` with every non-printable character escaped (``\\x1b``): names read from a file must not
    move the cursor or rewrite a line of what aitune prints."""
    return "".join(c if c.isprintable() or c == " " else c.encode("unicode_escape").decode("ascii") for c in text)


def print_table(
    columns: Sequence[str],
    rows: Sequence[Sequence[str]],
    title: str | None = None,
    colours: dict[str, str] | None = None,
) -> None:
    """A table in a terminal, wrapping long cells; piped, tab-separated lines under a header line.

    Nothing is ever cut, so ``aitune backends | grep inductor`` finds the full names; ``colours``
    styles cells with exactly that text, in a terminal only.
    """
    if not sys.stdout.isatty():
        for line in (columns, *rows):
            typer.echo("\t".join(" ".join(printable(str(cell)).split()) for cell in line))
        return
    console = Console()
    cells = [[printable(str(c)) for c in row] for row in rows]
    widths = [max((len(row[i]) for row in cells), default=0) for i in range(len(columns))]
    prose = [any(len(row[i].split()) > 2 for row in cells) for i in range(len(columns))]
    # names keep their full width when the prose columns still get 20 characters each; else all wrap
    named = sum(w for w, p in zip(widths, prose) if not p) + 3 * len(columns) + 1
    keep = named + 20 * sum(prose) <= console.width
    table = Table(title=title)
    for column, width, is_prose in zip(columns, widths, prose):
        table.add_column(column, overflow="fold", min_width=width if keep and not is_prose else None)
    for row in cells:
        table.add_row(*(Text(c, style=(colours or {}).get(c, "")) for c in row))
    console.print(table)


@app.command()
def backends(ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts.")) -> None:
    """List the installed backends, whether each can run here, and why not."""
    rows = _backend_rows(_manager(ctx))
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    cells = []
    for row in rows:
        devices = ", ".join(f"{d} ✓" if r is None else f"{d} ✗" for d, r in row["devices"].items())
        reasons = {r: [d for d, x in row["devices"].items() if x == r] for r in row["devices"].values() if r}
        why = "; ".join(f"{'/'.join(ds)}: {r}" for r, ds in reasons.items()) or (row["reason"] or "")
        cells.append([row["backend"], row["distribution"], row["version"], row["status"], devices, why])
    print_table(
        ("backend", "distribution", "version", "status", "devices", "why not"),
        cells,
        "aitune backends",
        {"available": "green", "unavailable": "yellow", "failed to load": "red"},
    )
    if sys.stdout.isatty():  # piped, the output stays one table of backends (`aitune executors` lists these)
        _print_executors(_executor_rows(_manager(ctx)))


def _executor_rows(manager: AituneManager) -> list[dict[str, Any]]:
    """Every installed executor, whether it can run here, and what it sees (a cluster's resources)."""
    from .executor import chosen

    executors = manager.executors
    rows: list[dict[str, Any]] = []
    for name in executors.names():
        reason = executors.reason(name)
        row: dict[str, Any] = {
            "executor": name,
            "distribution": executors.distribution(name),
            "selected": name == chosen(),
            "status": "available" if reason is None else "unavailable",
            "reason": reason,
            "resources": {},
        }
        if reason is None:
            try:
                row["resources"] = executors.executor_class(name).describe()
            except Exception as exc:  # describing must not take the listing down
                row["reason"] = f"cannot describe it: {type(exc).__name__}: {exc}"
        rows.append(row)
    return rows


def _print_executors(rows: list[dict[str, Any]]) -> None:
    cells = []
    for row in rows:
        name = f"{row['executor']} (selected)" if row["selected"] else row["executor"]
        facts = ", ".join(f"{k}: {_resource(v)}" for k, v in row["resources"].items()) or (row["reason"] or "")
        cells.append([name, row["distribution"], row["status"], facts])
    print_table(
        ("executor", "distribution", "status", "resources"),
        cells,
        "aitune executors (where isolated builds run; AITUNE_EXECUTOR picks one)",
        {"available": "green", "unavailable": "yellow"},
    )


def _resource(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


@app.command()
def executors(
    ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts.")
) -> None:
    """List where isolated builds can run (local, ray...) and the resources each one sees."""
    rows = _executor_rows(_manager(ctx))
    if as_json:
        typer.echo(json.dumps(rows, indent=2, default=str))
    else:
        _print_executors(rows)


@app.command()
def verify(
    ctx: typer.Context,
    artifact: Path = typer.Argument(..., help="The .ait file."),
    sha256: str | None = typer.Option(None, "--sha256", help="Expected SHA-256 of the whole file."),
    key: list[Path] = typer.Option(
        [],
        "--key",
        help="A public key (PEM) you trust; checked against the signature inside the file, else ARTIFACT.sig.",
    ),
    signature: Path | None = typer.Option(None, "--signature", help="The signature, if not beside the artifact."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts."),
) -> None:
    """Check an artifact's digests, its signature (--key), and whether it can run here (exit 1 if not)."""
    from .artifact import verify as verify_artifact

    result = verify_artifact(artifact, sha256, trusted_keys=key or None, signature=signature, manager=_manager(ctx))
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        typer.echo(
            f"{printable(str(artifact))}: integrity ok (the file is whole; its digests alone do not prove who wrote it)"
        )
        typer.echo(f"trust: {printable(result['trust'])}")
        for where in result["native_payloads"]:
            typer.echo(f"native code: {printable(where)}")
        for problem in result["problems"]:
            typer.echo(f"cannot run here: {printable(problem)}")
        if result["runnable_here"]:
            typer.echo("every payload can run here")
    if not result["runnable_here"]:
        raise typer.Exit(1)


@app.command()
def sign(
    artifact: Path = typer.Argument(..., help="The .ait file."),
    key: Path = typer.Option(..., "--key", help="Your private key (PEM, elliptic curve)."),
    certificate: Path | None = typer.Option(None, "--certificate", help="The signing certificate (PEM), if any."),
    chain: list[Path] = typer.Option([], "--chain", help="Certificates of its chain (PEM)."),
    signature: Path | None = typer.Option(None, "--signature", help="Where to write the signature (ARTIFACT.sig)."),
) -> None:
    """Sign an artifact (OpenSSF model-signing, offline) so ait.load(..., trusted_keys=[...]) can trust it."""
    from .artifact.signing import sign as sign_artifact

    out = sign_artifact(artifact, key, certificate=certificate, chain=chain, signature=signature)
    typer.echo(f"signed {artifact}: {out}")


@app.command()
def show(
    artifact: Path = typer.Argument(..., help="The .ait file."),
    as_json: bool = typer.Option(False, "--json", help="Print the manifest as JSON."),
) -> None:
    """Show an artifact's modules, graphs, backends, sizes and where it was tuned."""
    from .artifact.archive import open_artifact
    from .artifact.reader import read_manifest
    from .converter import unstructure

    with open_artifact(artifact) as reader:
        manifest = read_manifest(reader)
        sizes = {name: info.file_size for name, info in reader.infos.items()}
    if as_json:
        typer.echo(json.dumps(unstructure(manifest), indent=2))
        return
    env = manifest.environment
    typer.echo(
        printable(
            f"{artifact}: format {manifest.format_version}, aitune {manifest.aitune_version}, {manifest.created_at}"
        )
    )
    typer.echo(
        printable(f"tuned on: torch {env.get('torch')}, {env.get('gpu') or env.get('cpu')}, CUDA {env.get('cuda')}")
    )
    rows = []
    for module in manifest.modules:
        rows.append([module.name, "weights", "", "", _size(sizes.get(module.weights, 0))])
        for i, graph in enumerate(module.graphs):
            inputs = ", ".join(
                f"{t.path}({', '.join(d or str(s) for s, d in zip(t.shape, t.dims))})" for t in graph.graph.inputs
            )
            payload = sum(sizes.get(f"{graph.payload}/{f}", 0) for f in graph.files)
            rows.append([module.name, str(i), graph.backend, inputs, _size(payload)])
    print_table(("module", "graph", "backend", "inputs", "payload"), rows)


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
    from .builtin import buildcache

    data = buildcache.info()
    typer.echo(json.dumps(data) if as_json else f"{data['path']}: {data['entries']} builds, {_size(data['bytes'])}")


@cache_app.command("clear")
def cache_clear() -> None:
    """Delete every cached build."""
    from .builtin import buildcache

    typer.echo(f"removed {buildcache.clear()} cached builds")


def _load_target(target: str) -> tuple[Any, list[Any]]:
    """Import ``package.module:factory`` and call it: it returns ``(model, dataset)``."""
    import importlib

    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise typer.BadParameter("TARGET must look like package.module:factory", param_hint="TARGET")
    sys.path.insert(0, str(Path.cwd()))
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise typer.BadParameter(f"cannot import {target}: {exc}", param_hint="TARGET") from exc
    result = factory()
    if isinstance(result, dict):
        return result["model"], list(result["dataset"])
    if not (isinstance(result, tuple) and len(result) == 2):
        raise typer.BadParameter(f"{target}() must return (model, dataset)", param_hint="TARGET")
    return result[0], list(result[1])


STRATEGIES = ("max-throughput", "min-latency", "first-wins", "one-backend", "latency-budget")


def _strategy(name: str, backends: list[Any], budget_ms: float | None) -> Any:
    import aitune.torch as ait

    chosen = backends or None
    if name == "max-throughput":
        return ait.MaxThroughputStrategy(backends=chosen)
    if name == "min-latency":
        return ait.MinLatencyStrategy(backends=chosen)
    if name == "first-wins":
        return ait.FirstWinsStrategy(backends=chosen)
    if name == "one-backend":
        if len(backends) != 1:
            raise typer.BadParameter("one-backend needs exactly one --backend", param_hint="--strategy")
        return ait.OneBackendStrategy(backends[0])
    if name == "latency-budget":
        if budget_ms is None:
            raise typer.BadParameter("latency-budget needs --budget-ms", param_hint="--strategy")
        return ait.LatencyBudgetStrategy(budget_ms, backends=chosen)
    raise typer.BadParameter(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}", param_hint="--strategy")


def _backends(names: list[str], manager: AituneManager) -> list[Any]:
    registry = manager.registry
    return [registry.backend_class(n)() for n in names]


def _write_reports(
    report: Any, report_path: Path | None, html_path: Path | None, markdown: bool, quiet: bool = False
) -> None:
    """Write the reports asked for; ``quiet`` keeps stdout to the JSON printed before."""
    from .files import write_file
    from .render import render_html, render_markdown

    if report_path is not None:
        report.save(report_path)
        if not quiet:
            typer.echo(f"report: {report_path}")
    if html_path is not None:
        write_file(html_path, render_html(report))
        if not quiet:
            typer.echo(f"HTML report: {html_path}")
    if markdown:
        typer.echo(render_markdown(report))


def _print_summary(report: Any) -> None:
    """The modules, failed ones first, after a line naming them: a failure must not hide in a table."""
    from .render.tables import failures, time_spent

    failed = failures(report)
    if failed:
        typer.echo(f"aitune: {failed}")
    modules = sorted(report.modules, key=lambda m: m.status != "failed")
    rows = [[m.name, m.status, m.summary.partition(": ")[2] or m.error or ""] for m in modules]
    print_table(("module", "status", "result"), rows, "aitune: tuned modules")
    if report.time_spent:
        typer.echo(f"time spent: {time_spent(report)}")


THREADS_HELP = (
    "Torch intra-op threads to tune (and time) with; default: torch's. On a busy or shared machine, "
    "fewer threads than cores give steadier timings."
)


def _set_threads(threads: int | None) -> None:
    """Apply ``--threads`` before anything is timed; the report records what timing ran under."""
    if threads is None:
        return
    import torch

    torch.set_num_threads(threads)


@app.command()
def tune(
    ctx: typer.Context,
    target: str = typer.Argument(..., help="package.module:factory returning (model, dataset)."),
    strategy: str = typer.Option("max-throughput", help=f"One of: {', '.join(STRATEGIES)}."),
    backend: list[str] = typer.Option([], "--backend", "-b", help="Backend name (repeat); default: all available."),
    batch_size: list[int] = typer.Option([], "--batch-size", help="Batch sizes to build for and profile (repeat)."),
    device: str | None = typer.Option(None, help="Tune device (default: where the model's weights are)."),
    module: list[str] = typer.Option(
        [], "--module", "-m", help="Submodule path to wrap (repeat); default: the whole model."
    ),
    budget_ms: float | None = typer.Option(None, help="Latency budget for --strategy latency-budget."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Write the tuned artifact here (.ait)."),
    report_path: Path | None = typer.Option(None, "--report", help="Write the JSON report here."),
    html: Path | None = typer.Option(None, "--html", help="Write the HTML report here."),
    as_json: bool = typer.Option(False, "--json", help="Print the JSON report instead of a table."),
    threads: int | None = typer.Option(None, "--threads", min=1, help=THREADS_HELP),
    time_budget: float | None = typer.Option(
        None, "--time-budget", min=0.001, help="Seconds the tune may take; candidates not built by then are skipped."
    ),
) -> None:
    """Tune a model from a factory, save the artifact and the reports."""
    import aitune.torch as ait

    _set_threads(threads)
    manager = _manager(ctx)
    model, dataset = _load_target(target)
    chosen = _strategy(strategy, _backends(backend, manager), budget_ms)
    from .engine.module import wrapped_modules

    if module:
        ait.wrap(model, module, strategy=chosen)
    elif not wrapped_modules(model):
        model = ait.Module(model, type(model).__name__, strategy=chosen)
    report = ait.tune(
        model, dataset, batch_sizes=batch_size or None, device=device, time_budget=time_budget, manager=manager
    )
    if output is not None:
        ait.save(model, output, manager=manager)
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=2, default=str))
    else:
        _print_summary(report)
        if output is not None:
            typer.echo(f"artifact: {output}")
    _write_reports(report, report_path, html, False, quiet=as_json)
    if any(m.status == "failed" for m in report.modules):
        raise typer.Exit(1)


@app.command("inspect")
def inspect_command(
    target: str = typer.Argument(..., help="package.module:factory returning (model, dataset)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts."),
    graph_breaks: bool = typer.Option(True, help="Ask torch._dynamo about graph breaks of candidate modules."),
) -> None:
    """Show where a model spends its time and which modules are worth tuning."""
    import aitune.torch as ait

    model, dataset = _load_target(target)
    result = ait.inspect(model, dataset, detect_graph_breaks=graph_breaks)
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    else:
        typer.echo(result.describe())


@app.command()
def report(
    source: Path = typer.Argument(
        ..., help="A JSON report written by ait.tune, its journal (an interrupted run), or an .ait artifact."
    ),
    html: Path | None = typer.Option(None, "--html", help="Write the HTML report here."),
    markdown: bool = typer.Option(False, "--markdown", help="Print the report as markdown."),
) -> None:
    """Render a tuning report (from a run's JSON, its journal, or an artifact) as markdown or HTML.

    A run that was stopped before it wrote its report left a journal beside the report path:
    give either, and the report shows what finished (a cut-off module says ``interrupted``).
    """
    from .builtin.journal import SUFFIX, journal_path, partial_report
    from .errors import AituneError
    from .report import TuneReport

    if source.suffix == ".ait":
        from .artifact.reader import read_report

        loaded = read_report(source)
    elif source.name.endswith(SUFFIX) or (not source.exists() and journal_path(source).is_file()):
        try:
            loaded = partial_report(source)
        except AituneError as exc:
            raise typer.BadParameter(str(exc), param_hint="SOURCE") from exc
        typer.echo(f"{source}: read from the tuning journal; what is shown is what finished", err=True)
    else:
        try:
            loaded = TuneReport.read(source)
        except (OSError, ValueError) as exc:
            raise typer.BadParameter(f"{source} is not a readable report: {exc}", param_hint="SOURCE") from exc
    if not html and not markdown:
        markdown = True
    _write_reports(loaded, None, html, markdown)


@app.command()
def demo(
    ctx: typer.Context,
    output_dir: Path = typer.Option(Path("aitune-demo"), "--output-dir", help="Where the artifact and reports go."),
    as_json: bool = typer.Option(False, "--json", help="Print the JSON report instead of a table."),
    threads: int | None = typer.Option(None, "--threads", min=1, help=THREADS_HELP),
) -> None:
    """Tune a built-in small model with every backend available here; write the artifact and HTML report."""
    import aitune.torch as ait

    _set_threads(threads)
    from . import demo as demo_model

    model: Any
    model, dataset = demo_model.model_and_data()
    manager = _manager(ctx)
    backends = demo_model.demo_backends(manager.registry)
    Console(stderr=as_json).print(
        f"[bold]aitune demo[/]: a CNN + MLP classifier, candidates: {', '.join(b.name for b in backends)} (and eager)"
    )
    model.features = ait.Module(model.features, "features", strategy=ait.MaxThroughputStrategy(backends=backends))
    model.head = ait.Module(model.head, "head", strategy=ait.MaxThroughputStrategy(backends=backends))
    result = ait.tune(model, dataset, manager=manager)
    ait.save(model, output_dir / "classifier.ait", manager=manager)  # makes the folder, 0700 (aitune.files)
    if as_json:
        typer.echo(json.dumps(result.to_json(), indent=2, default=str))
    else:
        _print_summary(result)
        typer.echo(f"artifact: {output_dir / 'classifier.ait'}")
    _write_reports(result, output_dir / "report.json", output_dir / "report.html", False, quiet=as_json)


ENGINES = {"kserve": "aitune-serve-kserve", "ray": "aitune-serve-ray"}
"""``aitune serve``'s engines and the distribution each one needs (core imports neither)."""


def _engine_missing(engine: str, exc: ModuleNotFoundError) -> NoReturn:
    """The engine's distribution is not installed: say which ``pip install`` adds it."""
    if not (exc.name or "").startswith(ENGINES[engine].replace("-", "_")):
        raise exc
    typer.echo(f"aitune serve --engine {engine} needs {ENGINES[engine]}: pip install {ENGINES[engine]}", err=True)
    raise typer.Exit(1) from None


@app.command()
def serve(
    artifacts: list[Path] = typer.Argument(
        ...,
        help="The .ait file (at the same path on every node of a cluster); kserve serves several in one server.",
    ),
    factories: list[str] = typer.Option(
        ...,
        "--factory",
        help="package.module:build_model, returning the model freshly built (as ait.load takes it): once for "
        "every artifact, or once per artifact, in order.",
    ),
    engine: str = typer.Option(
        "kserve",
        "--engine",
        help="kserve: KServe's ModelServer on this machine (Open Inference Protocol v2, REST and gRPC); "
        "ray: Ray Serve, for clusters.",
    ),
    name: str | None = typer.Option(
        None, "--name", help="The model's name in the protocol (default: the artifact's stem)."
    ),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="The HTTP port."),
    host: str = typer.Option("127.0.0.1", "--host", help="The HTTP address to listen on (0.0.0.0: every interface)."),
    threads: int | None = typer.Option(
        None, "--threads", min=1, help="Torch threads per replica; default: what the artifact was tuned with."
    ),
    eager: bool = typer.Option(
        False, "--eager", help="Serve the same model eager (no tuned backends), same batching: the A/B baseline."
    ),
    grpc_port: int | None = typer.Option(
        None, "--grpc-port", min=1, max=65535, help="kserve: also serve gRPC on this port (every interface)."
    ),
    max_rows: int | None = typer.Option(
        None, "--max-rows", min=1, help="The most rows one request may send (default 8 largest tuned batches)."
    ),
    grace_s: int = typer.Option(
        30, "--grace-s", min=0, help="kserve: seconds SIGTERM waits for in-flight requests before stopping."
    ),
    pad: list[str] = typer.Option(
        [],
        "--pad",
        help="How inputs are padded, NAME=VALUE,... (e.g. input_ids=0,attention_mask=0), over what "
        "ait.tune(pad=...) recorded: requests of different lengths then join one call.",
    ),
    max_body_mb: float = typer.Option(
        64,
        "--max-body-mb",
        min=0.001,
        help="The largest request body in MiB (413 past it, read as it streams).",
    ),
    read_timeout_s: float = typer.Option(
        10,
        "--read-timeout-s",
        min=0.1,
        help="A request body that sends nothing for this long is dropped (408).",
    ),
    replicas: int = typer.Option(1, "--replicas", min=1, help="ray: how many replicas serve it."),
    address: str | None = typer.Option(None, "--address", help="ray: an existing Ray cluster (default: a local Ray)."),
    metrics_port: int | None = typer.Option(
        None,
        "--metrics-port",
        min=1,
        max=65535,
        help="ray: where the local Ray exports Prometheus metrics (default: a free port Ray picks, printed at "
        "start). kserve serves /metrics on --port.",
    ),
    dashboard_port: int | None = typer.Option(
        None,
        "--dashboard-port",
        min=1,
        max=65535,
        help="ray: run Ray's dashboard on this port (serve status reads it).",
    ),
    sha256: str | None = typer.Option(None, "--sha256", help="Expected SHA-256 of the artifact (pins it)."),
    key: list[Path] = typer.Option(
        [],
        "--key",
        help="A public key (PEM) you trust; checked against the signature inside the file, else ARTIFACT.sig.",
    ),
    trust_native_code: bool = typer.Option(False, "--trust-native-code", help="Run native payloads unverified."),
    signature: Path | None = typer.Option(
        None, "--signature", help="The detached signature of ARTIFACT (default: ARTIFACT.sig beside it)."
    ),
    check: bool | None = typer.Option(
        None,
        "--check/--no-check",
        help="Run each payload against eager before serving (default: when the artifact is neither pinned nor signed).",
    ),
    fallback: str | None = typer.Option(
        None, "--fallback", help="eager: serve a module eager (warned) when its payload cannot run or fails the check."
    ),
    weights: str | None = typer.Option(
        None, "--weights", help="artifact (the saved weights) or model (the factory's own, refitted into the payloads)."
    ),
    device: str | None = typer.Option(None, "--device", help="Load every module onto this device (default: as saved)."),
) -> None:
    """Serve a tuned artifact over HTTP, batched within the batch sizes it was tuned for: on KServe's
    ModelServer (one machine, the default) or Ray Serve (--engine ray, clusters)."""
    if engine not in ENGINES:
        raise typer.BadParameter(f"{engine!r}: choose one of {', '.join(ENGINES)}", param_hint="--engine")
    ray_only = [
        (flag, given)
        for flag, given in (
            ("--replicas", replicas != 1),
            ("--address", address is not None),
            ("--metrics-port", metrics_port is not None),
            ("--dashboard-port", dashboard_port is not None),
        )
        if given
    ]
    if engine == "kserve" and ray_only:
        raise typer.BadParameter(
            f"{', '.join(f for f, _ in ray_only)}: Ray Serve's: add --engine ray (kserve serves one process on this "
            "machine, its metrics at /metrics on --port)",
            param_hint=ray_only[0][0],
        )
    if engine == "ray" and grpc_port is not None:
        raise typer.BadParameter(
            "--grpc-port is the kserve engine's (Ray Serve serves the protocol over REST): drop it or leave out "
            "--engine ray",
            param_hint="--engine",
        )
    if len(factories) not in (1, len(artifacts)):
        raise typer.BadParameter(
            f"{len(artifacts)} artifacts and {len(factories)} --factory: give one --factory for all, or one per artifact",
            param_hint="--factory",
        )
    if len(artifacts) > 1:
        several = [
            flag for flag, given in (("--name", name), ("--sha256", sha256), ("--signature", signature)) if given
        ]
        if engine == "ray":
            raise typer.BadParameter(
                "--engine ray serves one artifact per command; serve several from a Serve config file "
                "(import_path: aitune_serve_ray:app, one application each; docs/serving.md)",
                param_hint="ARTIFACT",
            )
        if several:
            raise typer.BadParameter(
                f"{', '.join(several)} name one artifact; with several, each is served under its stem "
                "(use --key to trust them)",
                param_hint=several[0],
            )
    models = list(zip(factories * len(artifacts) if len(factories) == 1 else factories, artifacts))
    factory, artifact = models[0]
    from .torch.serving import parse_pad

    try:
        declared_pad = parse_pad(pad)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--pad") from None
    for missing in [a for a in artifacts if not a.is_file()]:
        raise typer.BadParameter(f"{missing}: no such file", param_hint="ARTIFACT")
    from .artifact.options import LoadOptions

    try:
        load_options = LoadOptions(
            device_map=device,
            fallback=fallback,
            expected_sha256=sha256,
            trusted_keys=key or None,
            signature=signature,
            trust_native_code=trust_native_code,
            check=check,
            weights=weights,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    try:
        if engine == "kserve":
            try:
                from aitune_serve_kserve.launch import serve_models
            except ModuleNotFoundError as exc:
                _engine_missing(engine, exc)
            serve_models(
                [(f, a, name) for f, a in models],
                host=host,
                port=port,
                grpc_port=grpc_port,
                threads=threads,
                eager=eager,
                max_rows=max_rows,
                pad=declared_pad,
                grace_s=grace_s,
                max_body_bytes=int(max_body_mb * 1024 * 1024),
                read_timeout_s=read_timeout_s,
                load_options=load_options,
            )
        else:
            try:
                from aitune_serve_ray.launch import serve_until_interrupted
            except ModuleNotFoundError as exc:
                _engine_missing(engine, exc)
            serve_until_interrupted(
                factory,
                artifact,
                name=name,
                replicas=replicas,
                port=port,
                host=host,
                address=address,
                threads=threads,
                eager=eager,
                max_rows=max_rows,
                pad=declared_pad or None,
                max_body_bytes=int(max_body_mb * 1024 * 1024),
                read_timeout_s=read_timeout_s,
                load_options=load_options,
                dashboard_port=dashboard_port,
                metrics_port=metrics_port or None,
            )
    except ValueError as exc:  # a factory that does not import: the user's to fix, no traceback
        from .errors import AituneError

        if isinstance(exc, AituneError):  # the artifact's or the load's: main() prints it as an error
            raise
        raise typer.BadParameter(str(exc), param_hint="--factory") from exc


def main() -> None:
    try:
        app()
    except Exception as exc:  # an aitune error is a message for the user, not a traceback
        from .errors import AituneError

        if isinstance(exc, AituneError):
            # as the text it is (no markup: a message may hold "[...]"), one line however wide
            Console(stderr=True).print(Text.assemble(("error: ", "red"), str(exc)), soft_wrap=True)
            sys.exit(1)
        raise


if __name__ == "__main__":
    main()
