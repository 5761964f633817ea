"""The tuning report: one JSON document per tune, written through the cattrs converter.

Every module, graph and candidate is recorded with what happened to it and why, so a person can
see why a backend won and a script can compare runs. ``SCHEMA_VERSION`` changes whenever a field
changes meaning.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from .converter import structure, unstructure

SCHEMA_VERSION = 2


@attrs.define
class OutputComparison:
    """How one output tensor of a candidate compares with eager, worst over the samples."""

    path: str
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    """``max|y - y_eager| / max|y_eager|``: error against the scale of the output."""
    cosine_similarity: float = 1.0


@attrs.define
class ValidationReport:
    passed: bool
    reason: str | None = None
    samples_checked: int = 0
    outputs: list[OutputComparison] = attrs.field(factory=list)
    checks: list[str] = attrs.field(factory=list)
    """What was checked beyond the recorded samples, e.g. ``batch=min (1)``."""
    closeness_only: bool = False
    """Failed only on closeness: the outputs had eager's structure, shapes and dtypes and were finite
    (the user's metric may still accept such a candidate)."""

    @property
    def max_rel_error(self) -> float:
        return max((o.max_rel_error for o in self.outputs), default=0.0)

    @property
    def min_cosine(self) -> float:
        return min((o.cosine_similarity for o in self.outputs), default=1.0)


@attrs.define
class ProfileResult:
    """Latency figures of one runner at one batch size."""

    batch_size: int
    steps: int
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    std_ms: float
    min_ms: float
    throughput: float
    """Samples per second: ``batch_size / p50``, from the same outlier-robust latency decisions use."""
    window_p50_ms: list[float] = attrs.field(factory=list)
    """Median latency of each measuring window, for judging noise between alternating runners."""
    baseline_p50_ms: float | None = None
    """Eager's p50 measured in the same interleaved session: the baseline this result is paired with."""
    baseline_window_p50_ms: list[float] = attrs.field(factory=list)
    """Eager's window medians from that session, window for window against ``window_p50_ms``."""
    dispatch_ms: float = 0.0
    """The measured per-call cost of the ``ait.Module`` dispatcher, included in every latency above."""


MAX_NOISE = 0.10
"""A speed-up is shown as a number only when its interval's half-width is at most this share of it
(±10%); a wider one is shown by the bound it still clears ("at least 2.10x (noise ±132%)") or, when
its interval straddles 1, as "not measured: noise ±N%". ``ProfilingConfig(max_noise=...)``."""


def noise_of(speedup: float, low: float, high: float) -> float:
    """The half-width of a speed-up's interval as a share of the speed-up."""
    return (high - low) / (2 * speedup) if speedup > 0 else float("inf")


def format_speedup(speedup: float, low: float | None, high: float | None, measured: bool = True) -> str:
    """``1.72x [1.65-1.80]``; for an interval too wide to show as a figure, the end of it that
    still says which side of eager it is on (``at least 2.10x (noise ±132%)``, ``at most 0.80x
    (...)``), or ``not measured: noise ±34%`` when the interval straddles 1.

    Under load the interval is wide but honest: a 5x gain whose windows all beat eager by at least
    2.1x is worth saying, while a point figure inside that interval would promise too much.
    """
    if low is None or high is None:
        return f"{speedup:.2f}x"
    if measured:
        return f"{speedup:.2f}x [{low:.2f}-{high:.2f}]"
    noise = f"noise ±{noise_of(speedup, low, high):.0%}"
    if low > 1.0:
        return f"at least {low:.2f}x ({noise})"
    if high < 1.0:
        return f"at most {high:.2f}x ({noise})"
    return f"not measured: {noise}"


_BATCH = "batch"
"""The batch dimension's name in a graph (``aitune.graph.BATCH``)."""
_AUTO_NAME = re.compile(r"d[0-9]+")
"""The names ``aitune.graph.infer_graph`` gives axes the user did not name (``d0``, ``d1``...)."""


def measured_at(graph: Any, size: int) -> str:
    """The size a figure was measured at, named by the axis it is the size of (``graph``: a
    :class:`~aitune.graph.GraphSpec` or its JSON, :attr:`GraphReport.graph`).

    ``batch 8`` where the graph has a batch axis (profiling batches the recorded calls to each
    size). Without one, the recorded calls run as they are and the size is that of their first
    input's leading axis (``GraphTuning.default_batch_sizes``), so it is named by that axis: its
    ``DynamicDim`` name (``patches = 16``), else the input and axis (``pixel_values axis 0 = 16``),
    and a patch count never reads as a batch. A graph not known (an empty JSON) says ``batch N``.
    """

    def field(obj: Any, name: str) -> Any:
        return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)

    inputs = field(graph, "inputs") or ()
    if _BATCH in (field(graph, "dims") or {}) or not inputs:
        return f"batch {size}"
    first = inputs[0]
    names = field(first, "dims") or ()
    if not names:
        return "the recorded inputs"  # a scalar first: no axis to name
    if names[0] is not None and not _AUTO_NAME.fullmatch(names[0]):
        return f"{names[0]} = {size}"
    return f"{field(first, 'path')} axis 0 = {size}"


def _with_details(figure: str, details: str) -> str:
    """``figure (details)``, inside the figure's own parenthesis when it has one (``(noise ±N%; details)``)."""
    return f"{figure[:-1]}; {details})" if figure.endswith(")") else f"{figure} ({details})"


def slower_beyond_interval(speedup: float | None, high: float | None) -> bool:
    """The whole interval is below 1: slower than eager whatever the noise."""
    return speedup is not None and high is not None and high < 1.0


def _label(backend: str, variant: str | None) -> str:
    """How every view names a candidate: the backend and, when it has several, its variant."""
    return f"{backend} ({variant})" if variant else backend


class _Status(str, enum.Enum):
    """A status that is its own JSON string, so reports read and compare as plain text."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class CandidateStatus(_Status):
    PENDING = "pending"
    SELECTED = "selected"
    REJECTED = "rejected"
    """Correct, but not chosen."""
    FAILED = "failed"
    NOT_APPLICABLE = "not applicable"
    """The candidate's variant does not apply to this module: listed in the detailed report, left out
    of summaries and failure lists."""
    SKIPPED = "skipped"
    """Never built: ``ait.tune(time_budget=...)`` ran out of time first (reason ``time budget``)."""
    SUPERSEDED = "superseded"
    """Never built: a default candidate that runs the same compiled code with less per call built and
    passed validation first (:meth:`aitune.backend.Backend.superseded_by`; the reason names it)."""
    BASELINE = "baseline"
    """Eager's own row in a rendered table (never a candidate's status in a report)."""


class ModuleStatus(_Status):
    PENDING = "pending"
    TUNED = "tuned"
    EAGER = "eager"
    """Tuning kept the module eager."""
    FAILED = "failed"
    """Tuning raised; the module runs eager."""
    DRY_RUN = "dry run"
    """``ait.tune(dry_run=True)``: graphs recorded, nothing built."""
    INTERRUPTED = "interrupted"
    """Read back from the journal of a tune that stopped before this module finished."""


@attrs.define
class CandidateReport:
    backend: str
    config: dict[str, Any]
    status: CandidateStatus = attrs.field(default=CandidateStatus.PENDING, converter=CandidateStatus)
    """Checked when set: a string that names no :class:`CandidateStatus` raises."""
    stage: str | None = None
    """Where a failed (or not applicable) candidate stopped: ``availability``, ``build``, ``validate`` or
    ``profile``."""
    reason: str | None = None
    build_time_s: float | None = None
    """Wall time of the build (the export, compile and session start; ``build_info`` breaks some
    of it down, e.g. ONNX Runtime's ``export_s`` and ``session_s``)."""
    validate_time_s: float | None = None
    """Wall time of the comparison with eager (the validate hook)."""
    profile_time_s: float | None = None
    """Its share of the interleaved profiling rounds it ran in (each round's time over its runners)."""
    from_cache: bool = False
    build_info: dict[str, Any] = attrs.field(factory=dict)
    validation: ValidationReport | None = None
    profiles: list[ProfileResult] = attrs.field(factory=list)
    speedup: float | None = None
    """Eager p50 over this candidate's (dispatch included), at the batch size the decision used:
    the figure candidates are ranked and gated by."""
    speedup_low: float | None = None
    """Lower end of the speedup's interval: the lower quartile of per-window ratios against eager."""
    speedup_high: float | None = None
    """Upper end of the speedup's interval: the upper quartile of those ratios."""
    measured: bool | None = None
    """False when the interval is wider than the profiling config's ``max_noise``: the speed-up is
    then shown by the bound its interval clears ("at least 2.10x (noise ±N%)"), or as "not
    measured: noise ±N%" when that interval straddles 1, never as a point figure (None: no speed-up)."""
    variant: str | None = None
    """Which of the backend's variants this candidate is (``"torchscript export"``), when it has several."""
    static_batch: int | None = None
    """The one batch size this build was made for (``MaxThroughputStrategy(static_shapes=True)``), else None:
    what the other ranks rebuild a static route from."""
    metric: float | None = None
    """The user's metric (``ait.tune(metric=...)``) over the recorded calls, 1.0 meaning eager's answers."""

    @property
    def label(self) -> str:
        """``onnxruntime (torchscript export)``: the backend and, when it has several, its variant."""
        return _label(self.backend, self.variant)

    def speedup_text(self) -> str:
        """The speed-up as every view shows it ("" when there is none)."""
        if self.speedup is None:
            return ""
        return format_speedup(self.speedup, self.speedup_low, self.speedup_high, self.measured is not False)


@attrs.define
class RouteReport:
    """A batch range of a graph served by one backend (``MaxThroughputStrategy(per_batch_size=True)``)."""

    batch_min: int
    batch_max: int
    backend: str
    static: bool = False
    """Served by a build for this one batch size (``MaxThroughputStrategy(static_shapes=True)``); such a
    route comes before the ranges it overlaps, which serve every other call."""
    variant: str | None = None
    """The serving candidate's :attr:`CandidateReport.variant`, where its backend has several."""

    @property
    def label(self) -> str:
        """``onnxruntime (torchscript export)``, ``toy static``: who serves the range, told apart from
        another variant of the same backend (a static build's variant says it is one)."""
        if self.static and not self.variant:
            return f"{self.backend} static"
        return _label(self.backend, self.variant)


@attrs.define
class GraphReport:
    graph_key: str
    graph: dict[str, Any]
    candidates: list[CandidateReport] = attrs.field(factory=list)
    eager_profiles: list[ProfileResult] = attrs.field(factory=list)
    decision: str | None = None
    reason: str | None = None
    selected_batch_size: int | None = None
    routes: list[RouteReport] = attrs.field(factory=list)
    """Empty when one backend serves the whole graph."""
    profiled_inputs: list[str] = attrs.field(factory=list)
    """The input shapes that were timed at each profiled batch size, and how many recorded samples."""
    notes: list[str] = attrs.field(factory=list)
    """What a reader should know about the figures: a noisy machine, a missing batch axis, extra memory."""
    accuracy_floor: float | None = None
    """With the user's metric: the lowest metric a candidate may have (``1 - accuracy_budget``)."""


@attrs.define
class ModuleReport:
    name: str
    strategy: str
    """The strategy's identity (``TuneStrategy.identity()``): its class and every parameter, as
    canonical JSON; empty for a module whose run was interrupted."""
    status: ModuleStatus = attrs.field(default=ModuleStatus.PENDING, converter=ModuleStatus)
    """Checked when set: a string that names no :class:`ModuleStatus` raises."""
    error: str | None = None
    graphs: list[GraphReport] = attrs.field(factory=list)
    summary: str = ""
    frozen: list[str] = attrs.field(factory=list)
    """Parameters ``ait.tune`` made inference-only (``requires_grad_(False)``) so plain calls run the
    winner; empty when none required grad or with ``freeze=False``."""


@attrs.define
class BaselineFigure:
    """The tuned passes against another eager baseline timed in the same rounds (``generate()``
    with the static cache aitune switched to, next to the user's own cache)."""

    baseline: str
    """What the eager passes ran as, e.g. ``eager with the static cache``."""
    speedup: float
    speedup_low: float
    speedup_high: float
    measured: bool
    eager_ms: float

    def describe(self) -> str:
        figure = format_speedup(self.speedup, self.speedup_low, self.speedup_high, self.measured)
        return f"against {self.baseline}: {_with_details(figure, f'{self.eager_ms:.3g} ms per pass')}"


@attrs.define
class EndToEndReport:
    """The whole callable ``ait.tune`` was given, eager against tuned, over its dataset: the figure
    a user judges a tuner by (a partial wrap can win per module and gain nothing here)."""

    speedup: float | None = None
    """Eager's median pass over the dataset items over the tuned model's; None when not timed."""
    speedup_low: float | None = None
    """The lower quartile of the per-round ratios (eager pass over tuned pass, timed back to back)."""
    speedup_high: float | None = None
    measured: bool = False
    """False when the interval is wider than ``max_noise`` (or nothing was timed): shown by the bound
    the interval clears ("at least 2.10x"), or as "not measured" when it straddles 1."""
    eager_ms: float | None = None
    tuned_ms: float | None = None
    rounds: int = 0
    items: int = 0
    shares: dict[str, float] = attrs.field(factory=dict)
    """Each wrapped module's share of the eager pass's time: the most tuning it can save (Amdahl)."""
    reason: str | None = None
    """Why there is no figure (a call that raised), or what to know about it (some tuned calls ran
    eager while timed), or None."""
    baseline: str = "eager"
    """What the eager passes of the figure ran as: the model as the user gave it (``generate()``
    with the cache the user asked for, not the static one aitune switched to)."""
    other_baselines: list[BaselineFigure] = attrs.field(factory=list)
    """The same tuned passes against other eager baselines (the static cache aitune switched to)."""
    not_kept: str | None = None
    """Why the winners timed here were taken back (slower than eager beyond the interval), or None."""

    def describe(self) -> str:
        if self.speedup is None:
            return f"not measured: {self.reason}" if self.reason else "not measured"
        text = format_speedup(self.speedup, self.speedup_low, self.speedup_high, self.measured)
        passes = f"{self.baseline} {self.eager_ms:.3g} ms, tuned {self.tuned_ms:.3g} ms per pass of {self.items} items"
        text = _with_details(text, passes)
        for other in self.other_baselines:
            text += f"; {other.describe()}"
        text += f"; {self.reason}" if self.reason else ""
        return text + (f"; not kept: {self.not_kept}" if self.not_kept else "")


@attrs.define
class TuneReport:
    schema_version: int = SCHEMA_VERSION
    aitune_version: str = ""
    device: str = ""
    started_at: str = ""
    duration_s: float = 0.0
    environment: dict[str, Any] = attrs.field(factory=dict)
    modules: list[ModuleReport] = attrs.field(factory=list)
    end_to_end: EndToEndReport | None = None
    """Set by ``ait.tune`` after installing the winners (``end_to_end=False``, dry runs and ranks of a
    distributed job have none)."""
    time_spent: dict[str, float] = attrs.field(factory=dict)
    """Where the time went: seconds per stage (``recording``, ``export``, ``build``, ``validate``,
    ``profile``, ``waiting``, ``end to end``, and ``other`` for the rest of ``duration_s``): they add
    up to ``duration_s``."""
    time_by_candidate: dict[str, dict[str, float]] = attrs.field(factory=dict)
    """The per-candidate stages of ``time_spent`` (``export``, ``build``, ``validate``, ``profile``,
    ``waiting``) by whom they were spent on: ``module: backend (variant)``, ``module: torch_eager``
    (its share of each profiling round) and ``builds ahead`` (profiling waiting for builds of
    other graphs). For each of those stages the entries add up to its ``time_spent``."""
    time_budget: float | None = None
    """``ait.tune(time_budget=...)``, seconds; candidates not built in it are ``skipped``."""
    changes: list[str] = attrs.field(factory=list)
    """What ``ait.tune`` changed on the user's objects besides installing winners (a model's
    generation config switched to a static KV cache), one sentence each."""

    def to_json(self) -> dict[str, Any]:
        return unstructure(self)

    def save(self, path: str | Path) -> Path:
        from .files import write_file

        return write_file(Path(path), json.dumps(self.to_json(), indent=2, default=str))

    @classmethod
    def from_json(cls, data: Any) -> TuneReport:
        return structure(data, cls, "report")

    @classmethod
    def read(cls, path: str | Path) -> TuneReport:
        return cls.from_json(json.loads(Path(path).read_text()))
