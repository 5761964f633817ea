"""Tune strategies: which candidates to build, and how to pick the winner.

The rules follow the product's strategy guide exactly:

* ``OneBackendStrategy``: one backend; a build or correctness failure raises the original error;
  correct but not at least ``1 + min_speedup_ratio`` times faster than eager falls back to eager.
* ``FirstWinsStrategy``: backends in order; the first that builds, is correct and passes that
  gate wins; if none does, the module runs eager and the report says why each failed.
* ``MaxThroughputStrategy`` / ``MinLatencyStrategy``: build and profile all; the best that
  strictly beats eager wins (ties go to eager). MinLatency profiles at batch size 1.
* ``LatencyBudgetStrategy``: the highest throughput (backend, batch size) within the budget;
  raises when no backend meets it.

One figure decides everything: the candidate's p50 latency (dispatch cost included) against the
p50 of eager timed in the same interleaved round, with the interval of the per-window ratios.
Candidates are ranked by it, gated on it, and the report shows it. Beyond the guide: a gap inside
the measured spread (the lower quartile of per-window speedups does not clear the bar) does not
count as beating eager, and the report says so. A candidate that raises while profiled fails
(stage ``profile``) and the others go on.

Every parameter of a strategy lives in one frozen attrs :class:`StrategyConfig` (a subclass per
strategy: :class:`GateStrategyConfig`, :class:`MaxThroughputConfig`, :class:`LatencyBudgetConfig`);
the strategy's attributes are properties over it, and setting one replaces the config.
:meth:`TuneStrategy.identity` is that config serialized canonically (backends by name, class and
config; floats as JSON numbers; keys sorted; never an object id), so that the JIT's remembered
decisions, the ranks' agreement and the report change whenever a parameter does; the repr is
derived from it.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import PurePath
from typing import Any, ClassVar

import attrs
import torch

from .. import payload
from ..backend import Backend, BackendConfig
from ..errors import BuildError, TuningError, ValidationError
from ..profiling import ProfilingConfig
from ..report import CandidateStatus, measured_at
from ..session import Session
from .figures import Comparison, lead
from .graph_tuning import Candidate, GraphTuning, Route
from .graph_tuning import build as building
from .progress import TuneProgress
from .specialise import specialise


class PerformanceValidationMode(enum.Enum):
    """How strategies use the eager baseline."""

    ENABLED = "enabled"
    """Profile eager too; a candidate must beat it (by the strategy's rule) to be chosen."""
    DISABLED = "disabled"
    """Skip the baseline; the best correct candidate wins."""
    DIAGNOSTIC = "diagnostic"
    """Profile eager and report speedups, but choose as if disabled."""


@attrs.frozen
class BackendRef:
    """A candidate backend as a strategy's identity sees it: its registry name, its class and its config."""

    name: str
    backend_class: str
    """``module.QualifiedName`` of the Backend class (two test doubles may share a registry name)."""
    config: BackendConfig

    @classmethod
    def of(cls, backend: Backend) -> BackendRef:
        kind = type(backend)
        return cls(backend.name, f"{kind.__module__}.{kind.__qualname__}", backend.config)


def _at_least(bound: float, strictly: bool = False) -> Any:
    """A validator with the message strategies have always raised (``min_speedup_ratio must be >= 0``)."""

    def check(_: Any, attribute: attrs.Attribute[Any], value: float) -> None:
        if value < bound or (strictly and value == bound):
            shown = f"{bound:g}"
            raise ValueError(f"{attribute.name} must be {'>' if strictly else '>='} {shown}, got {value}")

    return check


@attrs.frozen(kw_only=True)
class StrategyConfig:
    """Every parameter that can change a strategy's decision. Frozen: a strategy's setters replace it.

    Serialized canonically, it is the strategy's :meth:`~TuneStrategy.identity`, which keys the
    JIT's remembered decisions, the ranks' agreement and the report. A subclass adding a parameter
    adds it here (a subclass of this class named by the strategy's ``config_class``), never as a
    bare attribute, so that changing it gives another identity.
    """

    backends: tuple[BackendRef, ...] | None = None
    """None: the tune's default backends (their configs are keyed separately, as the run's candidates)."""
    profiling_config: ProfilingConfig = attrs.field(factory=ProfilingConfig)
    performance_validation: PerformanceValidationMode = PerformanceValidationMode.ENABLED


@attrs.frozen(kw_only=True)
class GateStrategyConfig(StrategyConfig):
    """OneBackend and FirstWins: the speed-up a candidate needs over eager."""

    min_speedup_ratio: float = attrs.field(default=0.01, converter=float, validator=_at_least(0.0))


@attrs.frozen(kw_only=True)
class MaxThroughputConfig(StrategyConfig):
    per_batch_size: bool | None = attrs.field(default=None, converter=lambda v: None if v is None else bool(v))
    static_shapes: bool = attrs.field(default=False, converter=bool)
    min_static_gain: float = attrs.field(default=0.03, converter=float, validator=_at_least(0.0))


@attrs.frozen(kw_only=True)
class LatencyBudgetConfig(StrategyConfig):
    latency_budget_ms: float = attrs.field(converter=float, validator=_at_least(0.0, strictly=True))


def canonical(value: Any, depth: int = 0) -> Any:
    """``value`` as plain JSON data that is the same in every process: attrs objects as their fields
    (nested ones tagged with their class), enums as their values, sets sorted, and never an object id
    or a ``repr`` that may hold one (an object of another kind is its class name and public state)."""
    if depth > 32:
        return _qualified(type(value))
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, enum.Enum):
        return canonical(value.value, depth + 1)
    if isinstance(value, BackendRef):
        return {"backend": value.name, "class": value.backend_class, "config": canonical(value.config, depth + 1)}
    if attrs.has(type(value)):
        fields = {f.name: canonical(getattr(value, f.name), depth + 1) for f in attrs.fields(type(value))}
        return {"type": _qualified(type(value)), **fields}
    if isinstance(value, Mapping):
        return {str(k): canonical(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [canonical(v, depth + 1) for v in value]
    if isinstance(value, (set, frozenset)):
        items = [canonical(v, depth + 1) for v in value]
        return sorted(items, key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, Backend):
        return canonical(BackendRef.of(value), depth)
    if isinstance(value, (PurePath, torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, type) or (callable(value) and hasattr(value, "__qualname__")):
        return _qualified(value)
    state = {k: v for k, v in getattr(value, "__dict__", {}).items() if not k.startswith("_")}
    return {"type": _qualified(type(value)), **canonical(state, depth + 1)}


def _qualified(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


class TuneStrategy:
    """Base of every strategy: the candidate backends, profiling settings and the eager gate.

    Every parameter lives in :attr:`config`, a frozen :class:`StrategyConfig` (of the class's
    ``config_class``); :meth:`identity` is that config serialized, and the repr is derived from it.
    """

    raises_on_failure: bool = False
    """True when a failure of this strategy must reach the user instead of leaving the module eager."""

    config_class: ClassVar[type[StrategyConfig]] = StrategyConfig

    def __init__(
        self,
        backends: Sequence[Backend] | None = None,
        profiling_config: ProfilingConfig | None = None,
        performance_validation: bool | PerformanceValidationMode = True,
        **parameters: Any,
    ) -> None:
        """``parameters``: the other fields of ``config_class`` (a subclass's own)."""
        chosen = self._checked(backends)
        self._backends = chosen
        self._config = self.config_class(
            backends=_refs(chosen),
            profiling_config=profiling_config or ProfilingConfig(),
            performance_validation=_mode(performance_validation),
            **parameters,
        )

    @property
    def config(self) -> StrategyConfig:
        """Every parameter of this strategy; frozen (the setters below replace it)."""
        return self._config

    def _replace(self, **changes: Any) -> None:
        self._config = attrs.evolve(self._config, **changes)

    @property
    def backends(self) -> list[Backend] | None:
        """The candidate backends (None: the tune's defaults). Assign a new list to change them."""
        return self._backends

    @backends.setter
    def backends(self, value: Sequence[Backend] | None) -> None:
        chosen = self._checked(value)
        self._replace(backends=_refs(chosen))
        self._backends = chosen

    def _checked(self, backends: Sequence[Backend] | None) -> list[Backend] | None:
        chosen = list(backends) if backends is not None else None
        for b in chosen or []:
            if not isinstance(b, Backend):
                raise TypeError(f"{type(self).__name__} takes Backend objects, got {b!r}")
        return chosen

    @property
    def profiling_config(self) -> ProfilingConfig:
        return self._config.profiling_config

    @profiling_config.setter
    def profiling_config(self, value: ProfilingConfig | None) -> None:
        self._replace(profiling_config=value or ProfilingConfig())

    @property
    def performance_validation(self) -> PerformanceValidationMode:
        return self._config.performance_validation

    @performance_validation.setter
    def performance_validation(self, value: bool | PerformanceValidationMode) -> None:
        self._replace(performance_validation=_mode(value))

    def enable_performance_validation(self, enabled: bool | PerformanceValidationMode = True) -> TuneStrategy:
        """Turn the eager baseline gate on or off, or to diagnostic mode (measure, report, do not gate)."""
        self.performance_validation = enabled
        return self

    def identity(self) -> str:
        """The strategy's class and config as one canonical JSON string: the same parameters give
        the same string in any process (no object ids, keys sorted), and changing any parameter
        changes it. It keys the JIT's remembered decisions and the ranks' agreement, and the
        report names the strategy by it."""
        return json.dumps(self.identity_data(), sort_keys=True, separators=(",", ":"))

    def identity_data(self) -> dict[str, Any]:
        """:meth:`identity` as JSON data (the ranks compare it field by field, to name a difference)."""
        data: dict[str, Any] = {"strategy": _qualified(type(self)), "config": canonical(self._config)}
        data["config"].pop("type", None)  # the strategy's class says which config class it is
        extra = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        if extra:  # a subclass's bare attributes: keyed too, though they belong in its config_class
            data["attributes"] = canonical(extra)
        return data

    @property
    def gated(self) -> bool:
        return self.performance_validation is PerformanceValidationMode.ENABLED

    @property
    def with_baseline(self) -> bool:
        return self.performance_validation is not PerformanceValidationMode.DISABLED

    def candidates(self, default: Sequence[Backend]) -> list[Backend]:
        """The backends this strategy tries (its own, else the tune's ``default``), as listed."""
        return list(self.backends) if self.backends is not None else list(default)

    def build_order(self, default: Sequence[Backend], progress: TuneProgress) -> list[Backend]:
        """:meth:`candidates` in the order :meth:`tune` builds them: the one place that order is
        decided, so the builds sent ahead (:meth:`builds_ahead`, given this list) are those tried
        first. With a time budget, the cheapest first (``Backend.build_cost``; ties keep their order)."""
        return building.order(self.candidates(default), progress)

    def builds_ahead(self, candidates: Sequence[Backend]) -> list[Backend]:
        """Of ``candidates`` (in :meth:`build_order`), the ones this strategy builds whatever the
        others do: when the tune's executor runs builds side by side, these are submitted at once,
        before :meth:`tune` asks for them. Every one by default; a strategy whose rules stop early
        names fewer (FirstWins: its first)."""
        return list(candidates)

    def correct_candidates(self, tuning: GraphTuning, default_backends: Sequence[Backend]) -> list[Candidate]:
        """Build and validate every candidate of :meth:`build_order`; the correct ones, in that order.

        The process builds its own first, while the builds sent ahead run in a worker beside it, then
        takes those; last comes a default candidate another one supersedes
        (:meth:`Backend.superseded_by`), not built when that one passed validation. The report lists
        them all in :meth:`build_order`."""
        order = self.build_order(default_backends, tuning.progress)
        names = {t.name for t in order}
        listed = self.backends is not None
        steps = [(i, t, set() if listed else set(t.superseded_by(tuning.device)) & names) for i, t in enumerate(order)]
        steps.sort(key=lambda step: (bool(step[2]), tuning.builds_beside(step[1])))  # stable
        correct: list[Candidate] = []
        made: dict[int, Candidate] = {}
        for i, template, covers in steps:
            by = next((c for c in correct if c.name in covers), None)
            if by is not None:
                made[i] = tuning.supersede(template, by)
                continue
            made[i] = candidate = tuning.build(template)
            if candidate.ok and tuning.validate(candidate):
                correct.append(candidate)
        tuning.list_in_order([made[i] for i in sorted(made)])
        return [made[i] for i in sorted(made) if made[i] in correct]  # in build_order, as decisions read them

    def tune(self, tuning: GraphTuning, default_backends: Sequence[Backend]) -> Candidate | list[Route] | None:
        """Pick the winner for one graph (None means eager), or one per batch range, recording the decision."""
        raise NotImplementedError

    def __repr__(self) -> str:
        """The class and its config: the backends by name, then every parameter not at its default."""
        names = [b.name for b in self._config.backends] if self._config.backends is not None else "default"
        shown = [f"backends={names}"]
        for field in attrs.fields(type(self._config)):
            if field.name == "backends":
                continue
            value = getattr(self._config, field.name)
            default: Any = field.default
            if hasattr(default, "factory"):  # attrs.Factory
                default = default.factory()
            if field.default is attrs.NOTHING or value != default:
                shown.append(f"{field.name}={value.value if isinstance(value, enum.Enum) else value!r}")
        return f"{type(self).__name__}({', '.join(shown)})"


def _refs(backends: Sequence[Backend] | None) -> tuple[BackendRef, ...] | None:
    return tuple(BackendRef.of(b) for b in backends) if backends is not None else None


def _mode(enabled: bool | PerformanceValidationMode) -> PerformanceValidationMode:
    if isinstance(enabled, PerformanceValidationMode):
        return enabled
    return PerformanceValidationMode.ENABLED if enabled else PerformanceValidationMode.DISABLED


class _GateStrategy(TuneStrategy):
    """OneBackend and FirstWins: a candidate must be ``1 + min_speedup_ratio`` times faster."""

    config_class = GateStrategyConfig
    _config: GateStrategyConfig

    def __init__(
        self,
        backends: Sequence[Backend] | None = None,
        profiling_config: ProfilingConfig | None = None,
        min_speedup_ratio: float = 0.01,
        performance_validation: bool | PerformanceValidationMode = True,
    ) -> None:
        super().__init__(backends, profiling_config, performance_validation, min_speedup_ratio=min_speedup_ratio)

    @property
    def min_speedup_ratio(self) -> float:
        return self._config.min_speedup_ratio

    @min_speedup_ratio.setter
    def min_speedup_ratio(self, value: float) -> None:
        self._replace(min_speedup_ratio=value)

    def _gate(self, tuning: GraphTuning, candidate: Candidate) -> tuple[bool, str, int | None]:
        """Whether ``candidate`` passes the eager gate, why, and the batch size it was judged at.

        The candidate is timed together with eager in one interleaved round, so each candidate
        has its own paired baseline even when FirstWins tries several in turn.
        """
        if not self.with_baseline:
            return True, "performance validation disabled", None
        sizes = tuning.default_batch_sizes(self.profiling_config)
        measured = tuning.profile([candidate], self.profiling_config, True, sizes)
        if not candidate.ok:
            return False, candidate.report.reason or "failed while profiled", None
        if not measured:
            return False, "could not be profiled (out of memory)", None
        batch = max(measured)
        cmp = tuning.versus_eager(candidate, batch)
        assert cmp is not None
        tuning.annotate(batch)
        bar = 1.0 + self.min_speedup_ratio
        figures = describe(tuning, candidate, batch, cmp)
        if not self.gated:
            return True, f"{figures}; diagnostic mode, not gated", batch
        if cmp.speedup < bar:
            return False, f"{figures}, below the required {bar:.2f}x", batch
        if cmp.low_speedup < bar:
            return False, f"{figures}, but inside the measured spread (low {cmp.low_speedup:.2f}x < {bar:.2f}x)", batch
        return True, figures, batch


def describe(tuning: GraphTuning, candidate: Candidate, batch: int, cmp: Comparison | None = None) -> str:
    """The figures of ``candidate`` at ``batch`` as the report shows them."""
    mine = candidate.profile_at(batch)
    assert mine is not None
    text = f"{candidate.name} at {measured_at(tuning.graph, batch)}: {mine.throughput:.1f} samples/s, p50 {mine.p50_ms:.3g} ms"
    cmp = cmp or tuning.versus_eager(candidate, batch)
    if cmp is not None and mine.baseline_p50_ms is not None:
        text += f", {versus_eager(cmp, tuning.max_noise)} (p50 {mine.baseline_p50_ms:.3g} ms)"
    return text


class OneBackendStrategy(_GateStrategy):
    """Exactly one backend: deterministic, raises on failure, falls back to eager when not faster."""

    raises_on_failure = True

    def __init__(
        self,
        backend: Backend,
        profiling_config: ProfilingConfig | None = None,
        min_speedup_ratio: float = 0.01,
        performance_validation: bool | PerformanceValidationMode = True,
    ) -> None:
        super().__init__([backend], profiling_config, min_speedup_ratio, performance_validation)

    @property
    def backend(self) -> Backend:
        assert self.backends is not None and len(self.backends) == 1
        return self.backends[0]

    @backend.setter
    def backend(self, value: Backend) -> None:
        self.backends = [value]

    def tune(self, tuning: GraphTuning, default_backends: Sequence[Backend]) -> Candidate | None:
        candidate = tuning.build(self.backend)
        if not candidate.ok:
            if candidate.error is not None:
                raise candidate.error
            raise BuildError(f"{tuning.module_name}: {candidate.name} cannot be used: {candidate.report.reason}")
        if not tuning.validate(candidate):
            raise ValidationError(
                f"{tuning.module_name}: {candidate.name} does not match eager: {candidate.report.reason}"
            )
        passed, why, batch = self._gate(tuning, candidate)
        if passed:
            tuning.finish(candidate, why, batch)
            return candidate
        if not candidate.ok:  # raised while profiled: that costs the candidate, not the module
            tuning.finish(None, f"{candidate.name} failed while profiled: {why}; falling back to eager", batch)
            return None
        candidate.report.status = CandidateStatus.REJECTED
        candidate.report.reason = why
        tuning.finish(None, f"{candidate.name} is correct but not faster: {why}; falling back to eager", batch)
        return None


class FirstWinsStrategy(_GateStrategy):
    """Backends in priority order; the first that builds, is correct and is faster wins."""

    def build_order(self, default: Sequence[Backend], progress: TuneProgress) -> list[Backend]:
        """A list the user gave is the priority this rule keeps, time budget or not; the defaults
        are ordered as by any strategy."""
        if self.backends is not None:
            return list(self.backends)
        return super().build_order(default, progress)

    def builds_ahead(self, candidates: Sequence[Backend]) -> list[Backend]:
        """Only the first: whether the next one is built at all depends on how the first one fares."""
        return list(candidates[:1])

    def tune(self, tuning: GraphTuning, default_backends: Sequence[Backend]) -> Candidate | None:
        reasons = []
        for template in self.build_order(default_backends, tuning.progress):
            candidate = tuning.build(template)
            if candidate.ok and tuning.validate(candidate):
                passed, why, batch = self._gate(tuning, candidate)
                if passed:
                    tuning.finish(candidate, f"first to pass: {why}", batch)
                    return candidate
                if candidate.ok:
                    candidate.report.status = CandidateStatus.REJECTED
                    candidate.report.reason = why
            if candidate.report.status != CandidateStatus.NOT_APPLICABLE:  # by design: the detailed report has it
                reasons.append(f"{candidate.name}: {candidate.report.reason}")
        if reasons:
            tuning.finish(None, "no backend passed; running eager. " + "; ".join(reasons))
        else:
            tuning.finish(None, "no backend applies to this module; running eager" if tuning.built else "no backends")
        return None


class _ProfilingStrategy(TuneStrategy):
    """Build and validate every backend, profile the correct ones, pick by a figure of merit."""

    def _batch_sizes(self, tuning: GraphTuning) -> list[int]:
        return tuning.default_batch_sizes(self.profiling_config, every_recorded=True)

    def _score(self, candidate: Candidate, batch: int) -> float:
        """Higher is better."""
        raise NotImplementedError

    def _allowed(self, tuning: GraphTuning, candidate: Candidate, batch: int) -> bool:
        """Whether (candidate, batch) may be chosen at all (LatencyBudget: within the budget)."""
        return True

    def _profile(self, tuning: GraphTuning, correct: list[Candidate]) -> list[int]:
        if not correct or (len(correct) == 1 and not self.with_baseline):
            return []
        return tuning.profile(correct, self.profiling_config, self.with_baseline, self._batch_sizes(tuning))

    def tune(self, tuning: GraphTuning, default_backends: Sequence[Backend]) -> Candidate | list[Route] | None:
        correct = self.correct_candidates(tuning, default_backends)
        measured = self._profile(tuning, correct)
        return self._decide(tuning, correct, measured)

    def _decide(self, tuning: GraphTuning, correct: list[Candidate], measured: list[int]) -> Candidate | None:
        if not correct:
            failures = tuning.failures() or "no candidate applies to this module"
            tuning.finish(None, f"no backend built and passed validation; running eager. {failures}")
            return None
        if len(correct) == 1 and not self.with_baseline:
            tuning.finish(correct[0], "the only correct backend (performance validation disabled)")
            return correct[0]
        ok = [c for c in correct if c.ok]
        if not ok or not measured:
            failures = "; ".join(f"{c.backend}: {c.reason}" for c in tuning.report.candidates if c.stage == "profile")
            tuning.finish(None, f"nothing could be profiled; running eager. {failures or 'out of memory'}")
            return None
        winner, batch, why = self._choose(tuning, ok, measured)
        tuning.annotate(batch)
        _explain_rejections(tuning, ok, winner, batch)
        tuning.finish(winner, why, batch)
        return winner

    def _choose(
        self, tuning: GraphTuning, ok: list[Candidate], measured: list[int]
    ) -> tuple[Candidate | None, int | None, str]:
        """The winner (None: eager), the batch size it was judged at, and why.

        The best (candidate, batch) by the strategy's figure among those that beat eager beyond
        the measured spread at that batch size (all of them when not gated). So a candidate listed
        as faster than the winner on the figure the report shows is one whose lead is inside its
        own interval, or that did not beat eager clearly.
        """
        pairs = [(c, b) for b in measured for c in ok if c.profile_at(b) is not None and self._allowed(tuning, c, b)]
        if not pairs:
            return None, None, "no correct backend qualifies at the profiled batch sizes; running eager"
        fastest = max(pairs, key=lambda p: self._score(*p))
        if not self.gated:
            c, b = fastest
            return c, b, f"best: {describe(tuning, c, b)} (performance validation off)"
        beating = [p for p in pairs if _beats_eager(tuning.versus_eager(*p))]
        if beating:
            c, b = max(beating, key=lambda p: self._score(*p))
            why = describe(tuning, c, b)
            if (c, b) != fastest:
                why += (
                    f"; {fastest[0].name} at {measured_at(tuning.graph, fastest[1])} ranks higher but does not beat "
                    "eager beyond the spread"
                )
            return c, b, why
        c, b = fastest
        cmp = tuning.versus_eager(c, b)
        figures = describe(tuning, c, b)
        if cmp is None or cmp.speedup <= 1.0:
            return None, b, f"eager is as fast or faster than the best backend ({figures})"
        return None, b, f"{figures}, but the gap is inside the measured spread; keeping eager"


def _explain_rejections(tuning: GraphTuning, ok: list[Candidate], winner: Candidate | None, batch: int | None) -> None:
    """Give each correct candidate that lost the figure it lost with, next to the winner's."""
    if batch is None:
        return
    chosen = tuning.versus_eager(winner, batch) if winner is not None else None
    against = f"{winner.name} ({versus_eager(chosen, tuning.max_noise)})" if winner is not None and chosen else "eager"
    for c in ok:
        cmp = tuning.versus_eager(c, batch)
        if c is winner or c.report.reason or cmp is None:
            continue
        c.report.reason = (
            f"{versus_eager(cmp, tuning.max_noise)} at {measured_at(tuning.graph, batch)}, not chosen over {against}"
        )


def versus_eager(cmp: Comparison, max_noise: float) -> str:
    """``1.84x [1.74-1.90] eager``, or ``speed-up against eager not measured: noise ±34%``."""
    if cmp.measured(max_noise):
        return f"{cmp.describe(max_noise)} eager"
    return f"speed-up against eager {cmp.describe(max_noise)}"


def _beats_eager(cmp: Comparison | None) -> bool:
    return cmp is not None and cmp.speedup > 1.0 and cmp.low_speedup > 1.0


class MaxThroughputStrategy(_ProfilingStrategy):
    """Profiles every backend at every recorded batch size and keeps the highest throughput that beats eager.

    ``per_batch_size`` routes calls by batch range to each profiled size's own winner (eager
    where none beats it; ranges split at the geometric mean of neighbouring sizes). ``None``
    (default) routes only where it pays: when at some profiled size another backend (or eager)
    leads the single winner beyond doubt (the 90% confidence bound of its lead over their paired
    windows above 1, see :func:`~aitune.engine.figures.lead`). ``True`` always routes, ``False`` always
    keeps one winner. With one profiled size there is one winner either way.

    ``static_shapes=True`` then builds the winner of each profiled batch size again for that size
    alone, where the backend can (:attr:`Backend.builds_static`: AOTInductor, ONNX Runtime), and
    keeps such a build only where it beats the dynamic one by ``min_static_gain`` beyond the
    measured spread; it serves calls of exactly its shapes (see :mod:`aitune.engine.specialise`).
    Off by default: each costs one more build per batch size, often without paying.
    """

    config_class = MaxThroughputConfig
    _config: MaxThroughputConfig

    def __init__(
        self,
        backends: Sequence[Backend] | None = None,
        profiling_config: ProfilingConfig | None = None,
        performance_validation: bool | PerformanceValidationMode = True,
        per_batch_size: bool | None = None,
        static_shapes: bool = False,
        min_static_gain: float = 0.03,
    ) -> None:
        super().__init__(
            backends,
            profiling_config,
            performance_validation,
            per_batch_size=per_batch_size,
            static_shapes=static_shapes,
            min_static_gain=min_static_gain,
        )

    @property
    def per_batch_size(self) -> bool | None:
        return self._config.per_batch_size

    @per_batch_size.setter
    def per_batch_size(self, value: bool | None) -> None:
        self._replace(per_batch_size=value)

    @property
    def static_shapes(self) -> bool:
        return self._config.static_shapes

    @static_shapes.setter
    def static_shapes(self, value: bool) -> None:
        self._replace(static_shapes=value)

    @property
    def min_static_gain(self) -> float:
        return self._config.min_static_gain

    @min_static_gain.setter
    def min_static_gain(self, value: float) -> None:
        self._replace(min_static_gain=value)

    def _score(self, candidate: Candidate, batch: int) -> float:
        p = candidate.profile_at(batch)
        return p.throughput if p else float("-inf")

    def _batch_sizes(self, tuning: GraphTuning) -> list[int]:
        sizes = super()._batch_sizes(tuning)
        batch = tuning.graph.batch
        if self.per_batch_size and batch is not None and len(sizes) == 1:
            return sorted({batch.min, batch.opt, batch.max})
        return sizes

    def tune(self, tuning: GraphTuning, default_backends: Sequence[Backend]) -> Candidate | list[Route] | None:
        correct = self.correct_candidates(tuning, default_backends)
        measured = self._profile(tuning, correct)
        answer = self._pick(tuning, correct, measured)
        if self.static_shapes and measured:
            return specialise(tuning, answer, measured, self.profiling_config, self.min_static_gain)
        return answer

    def _pick(
        self, tuning: GraphTuning, correct: list[Candidate], measured: list[int]
    ) -> Candidate | list[Route] | None:
        """The dynamic builds' decision: one winner, or one per batch range."""
        ok = [c for c in correct if c.ok]
        if self.per_batch_size is False or tuning.graph.batch is None or len(measured) < 2 or not ok:
            return self._decide(tuning, correct, measured)
        single, single_batch, single_why = self._choose(tuning, ok, measured)
        winners: list[tuple[int, Candidate | None, str]] = []
        pays = []
        for size in measured:
            best, _, why = self._choose(tuning, ok, [size])
            ahead = _pays(best, single, size, tuning) if best is not single else None
            if ahead is not None:
                pays.append(f"{size} ({ahead})")
            elif self.per_batch_size is None:  # not worth another backend here: the single winner serves it
                best, why = single, f"the single winner; {why}"
            winners.append(
                (size, best, f"{best.name if best else 'eager'} at {measured_at(tuning.graph, size)} ({why})")
            )
        if self.per_batch_size is None and not pays:
            tuning.annotate(single_batch)
            _explain_rejections(tuning, ok, single, single_batch)
            tuning.finish(
                single, single_why + "; no batch size where another backend beats it beyond the spread", single_batch
            )
            return single
        routes = _routes(tuning.graph.batch.min, tuning.graph.batch.max, winners)
        tuning.annotate(single_batch)
        tuning.finish_routes(routes, "per batch size: " + "; ".join(why for _, _, why in winners))
        if self.per_batch_size is None:
            tuning.note(
                "routing by batch size pays at batch "
                + ", ".join(pays)
                + f": the single winner would be {single.name if single else 'eager'}"
            )
        tuning.note(_extra_size(routes, single, tuning.session))
        return routes


def _pays(best: Candidate | None, other: Candidate | None, size: int, tuning: GraphTuning) -> str | None:
    """Why routing ``size`` to ``best`` (None: eager) pays over ``other`` (None: eager): its lead where
    that is beyond doubt, else None.

    Both are correct and profiled side by side, so a wrong split costs one more backend kept (which
    the report states) and a missed one costs the lead on every call: between two runners the split
    asks for the lead's 90% confidence bound above 1 (:func:`lead`), which more windows narrow,
    rather than the quartiles that gate a candidate against eager.
    """
    if other is None:  # the per-size winner passed the gate: it beats eager beyond the spread
        if best is None:
            return None
        cmp = tuning.versus_eager(best, size)
        return f"{best.label} {cmp.describe(tuning.max_noise)} eager" if cmp is not None else None
    theirs = other.profile_at(size)
    if theirs is None:
        return None
    if best is None:  # eager against the single winner, in the winner's own paired eager windows where it has them
        eager = theirs.baseline_window_p50_ms or getattr(tuning.eager_profile(size), "window_p50_ms", [])
        ahead = lead(eager, theirs.window_p50_ms)
    else:
        mine = best.profile_at(size)
        ahead = lead(mine.window_p50_ms, theirs.window_p50_ms) if mine is not None else None
    if ahead is None or ahead.low <= 1.0:
        return None
    return f"{best.label if best else 'eager'} {ahead.describe()} against {other.label}"


def _extra_size(routes: list[Route], single: Candidate | None, session: Session) -> str:
    """The memory and artifact size per-batch routing costs beyond one winner (each payload measured
    as the payload store writes it)."""
    kept = list(dict.fromkeys(r.candidate for r in routes if r.candidate is not None))
    sizes = {
        c: payload.size(c.backend, session) for c in dict.fromkeys([*kept, *([single] if single is not None else [])])
    }
    names = ", ".join(c.name for c in kept)
    if any(sizes[c] is None for c in kept):
        return f"routing keeps {len(kept)} backends loaded ({names}); their artifact size is unknown"
    total = sum(sizes[c] or 0 for c in kept)
    base = (sizes[single] or 0) if single is not None else 0
    listed = ", ".join(f"{c.name} {(sizes[c] or 0) / 1e6:.2f} MB" for c in kept)
    return (
        f"routing keeps {len(kept)} backends loaded ({listed}): about {max(total - base, 0) / 1e6:.2f} MB more "
        "artifact size and memory than one winner"
    )


def _routes(low: int, high: int, winners: list[tuple[int, Candidate | None, str]]) -> list[Route]:
    """Batch ranges from per-size winners: split at the geometric mean of neighbours, merge equal ones."""
    routes: list[Route] = []
    start = low
    for i, (size, candidate, _) in enumerate(winners):
        end = high if i == len(winners) - 1 else max(start, math.isqrt(size * winners[i + 1][0]))
        if routes and routes[-1].candidate is candidate:
            routes[-1] = Route(routes[-1].batch_min, end, candidate)
        else:
            routes.append(Route(start, end, candidate))
        start = end + 1
    return [r for r in routes if r.batch_min <= r.batch_max]


class MinLatencyStrategy(_ProfilingStrategy):
    """Profiles every backend at batch size 1 and keeps the lowest latency that beats eager.

    A graph without a batch axis (one recorded batch size, no ``batch_sizes``) can only run at
    its recorded size: it is profiled there and the report says so.
    """

    def _batch_sizes(self, tuning: GraphTuning) -> list[int]:
        batch = tuning.graph.batch
        if batch is None:
            size = tuning.default_batch_sizes(self.profiling_config)
            tuning.note(
                f"MinLatencyStrategy profiles at batch size 1, but this graph has no batch axis (every call had "
                f"leading size {size[0]}), so it was profiled at the recorded size; record calls of several batch "
                "sizes or pass batch_sizes=[1, ...] to ait.tune to tune for batch 1"
            )
            return size
        if 1 not in batch:
            raise TuningError(
                f"{tuning.module_name}: MinLatencyStrategy profiles at batch size 1, but the graph was tuned "
                f"for batch sizes {batch.min}..{batch.max}; record a batch of 1 or pass batch_sizes=[1, ...]"
            )
        return [1]

    def _score(self, candidate: Candidate, batch: int) -> float:
        p = candidate.profile_at(batch)
        return -p.p50_ms if p else float("-inf")


class LatencyBudgetStrategy(_ProfilingStrategy):
    """The highest throughput (backend, batch size) whose p50 latency stays within the budget.

    Raises when no user-provided backend meets the budget. When eager is kept (no backend beats
    it) but eager itself is over the budget at that batch size, the fastest backend within the
    budget is chosen instead and the report says why.
    """

    raises_on_failure = True
    config_class = LatencyBudgetConfig
    _config: LatencyBudgetConfig

    def __init__(
        self,
        latency_budget_ms: float,
        backends: Sequence[Backend] | None = None,
        profiling_config: ProfilingConfig | None = None,
        performance_validation: bool | PerformanceValidationMode = True,
    ) -> None:
        super().__init__(backends, profiling_config, performance_validation, latency_budget_ms=latency_budget_ms)

    @property
    def latency_budget_ms(self) -> float:
        return self._config.latency_budget_ms

    @latency_budget_ms.setter
    def latency_budget_ms(self, value: float) -> None:
        self._replace(latency_budget_ms=value)

    def _allowed(self, tuning: GraphTuning, candidate: Candidate, batch: int) -> bool:
        p = candidate.profile_at(batch)
        return p is not None and p.p50_ms <= self.latency_budget_ms

    def _profile(self, tuning: GraphTuning, correct: list[Candidate]) -> list[int]:
        """Always profile: even a lone backend must be shown to meet the budget."""
        if not correct:
            return []
        return tuning.profile(correct, self.profiling_config, self.with_baseline, self._batch_sizes(tuning))

    def _score(self, candidate: Candidate, batch: int) -> float:
        p = candidate.profile_at(batch)
        return p.throughput if p else float("-inf")

    def tune(self, tuning: GraphTuning, default_backends: Sequence[Backend]) -> Candidate | list[Route] | None:
        correct = self.correct_candidates(tuning, default_backends)
        measured = self._profile(tuning, correct)
        ok = [c for c in correct if c.ok]
        within = [(c, b) for b in measured for c in ok if self._allowed(tuning, c, b)]
        if not within:
            raise TuningError(
                f"{tuning.module_name}: no backend stays within the latency budget of {self.latency_budget_ms} ms "
                f"at the profiled batch sizes; best p50 per backend: "
                + (
                    ", ".join(
                        f"{c.backend} {min(p.p50_ms for p in c.profiles):.3g} ms"
                        for c in tuning.report.candidates
                        if c.profiles
                    )
                    or "none measured"
                )
                + ". Raise the budget or profile smaller batch sizes."
            )
        result = self._decide(tuning, correct, measured)
        batch = tuning.report.selected_batch_size
        eager = tuning.eager_profile(batch) if batch is not None else None
        if result is None and within and eager is not None and eager.p50_ms > self.latency_budget_ms:
            c, b = max(within, key=lambda p: self._score(*p))
            tuning.annotate(b)
            tuning.finish(
                c,
                f"eager is over the latency budget at batch {batch} (p50 {eager.p50_ms:.3g} ms > "
                f"{self.latency_budget_ms} ms), so the fastest backend within it is kept: {describe(tuning, c, b)}",
                b,
            )
            return c
        return result
