"""Writing your own strategy: one method, :meth:`Strategy.pick`, over the figures of every correct candidate.

A strategy decides, for each graph of a tuned module, which backend serves it. The built-in ones
(``ait.MaxThroughputStrategy`` and the others) drive the engine's graph tuning step by step; a
strategy of your own usually needs only the last step, the choice::

    import attrs
    from aitune.torch.strategies import Choice, Strategy, StrategyConfig

    @attrs.frozen(kw_only=True)
    class AccurateConfig(StrategyConfig):
        max_rel_error: float = 1e-4

    class FastestAccurate(Strategy[AccurateConfig]):
        def pick(self, candidates):
            fine = [c for c in candidates if c.max_rel_error <= self.config.max_rel_error and c.beats_eager]
            if not fine:
                return Choice(None, f"no candidate beats eager within {self.config.max_rel_error:g} error")
            best = max(fine, key=lambda c: c.speedup)
            return Choice(best, f"fastest within {self.config.max_rel_error:g} error: {best.backend}")

    ait.Module(model, "encoder", strategy=FastestAccurate(backends=[...], max_rel_error=1e-3))

:class:`Strategy` does the rest for you: it builds every candidate backend (cheapest first under
a time budget), validates each against eager, profiles the correct ones with eager in the same
interleaved rounds, hands their figures to ``pick``, and records your :class:`Choice` in the report
(the winner ``selected``, the others ``rejected``, your reason as the graph's reason). When no
candidate is correct it keeps eager without asking ``pick``.

Every parameter of the strategy is a field of its frozen attrs config (a :class:`StrategyConfig`
subclass, named as the type argument of ``Strategy[...]``): the strategy's identity, which keys the
JIT's remembered decisions and the ranks' agreement and names it in the report, is that config
serialized, and its repr shows it. A strategy keeps no other state that changes its decision.

For full control over which candidates are built and profiled (per-batch-size routes, stopping
early), subclass :class:`TuneStrategy` and implement ``tune`` as the built-in strategies do.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from typing import Any, Generic, TypeVar, cast

import attrs

from ..backend import Backend, BackendConfig
from ..engine.graph_tuning import Candidate, GraphTuning
from ..engine.strategies import PerformanceValidationMode, StrategyConfig, TuneStrategy
from ..profiling import ProfilingConfig

C = TypeVar("C", bound=StrategyConfig)


@attrs.frozen(eq=False)
class CandidateFigures:
    """One correct candidate as :meth:`Strategy.pick` sees it: what validation and profiling measured.

    Speed figures are at ``batch_size`` (the largest profiled), against eager timed in the same
    rounds; they are None when nothing was profiled (performance validation off and one candidate,
    or the candidate ran out of memory). Compared by identity: return one of the objects you were given.
    """

    backend: str
    """The backend's registry name (``onnxruntime``)."""
    variant: str | None
    """Which of the backend's variants it is (``torchscript export``), when it has several."""
    config: BackendConfig
    max_rel_error: float
    """The largest error against eager over the recorded calls, relative to the output's scale (0: exact)."""
    min_cosine: float
    """The lowest cosine similarity with eager's outputs (1: same direction)."""
    metric: float | None
    """The user's metric (``ait.tune(metric=...)``), 1.0 meaning eager's answers; None without one."""
    batch_size: int | None
    p50_ms: float | None
    """Median latency per call, the dispatch cost included."""
    throughput: float | None
    """Samples per second at ``batch_size``."""
    speedup: float | None
    """Eager's p50 over this candidate's (None: eager was not timed)."""
    speedup_low: float | None
    """Lower end of the speed-up's interval (the lower quartile of per-window ratios)."""
    speedup_high: float | None

    @property
    def beats_eager(self) -> bool:
        """Faster than eager beyond the measured spread: the rule the built-in strategies gate on."""
        return self.speedup is not None and self.speedup > 1.0 and (self.speedup_low or 0.0) > 1.0


@attrs.frozen
class Choice:
    """What :meth:`Strategy.pick` decided: one of the candidates it was given, or None for eager, and why.

    ``reason`` becomes the graph's reason in the report, so say it as a person would read it.
    """

    candidate: CandidateFigures | None
    reason: str


class Strategy(TuneStrategy, Generic[C]):
    """Base of a third-party strategy: implement :meth:`pick`; the engine does everything else.

    Subclass as ``Strategy[MyConfig]`` (``MyConfig`` a frozen attrs :class:`StrategyConfig`
    subclass holding your parameters): the config class is taken from that type argument, the
    constructor takes ``backends``, ``profiling_config``, ``performance_validation`` and your
    fields as keywords, and :attr:`config` is typed as ``MyConfig``. ``Strategy[StrategyConfig]``
    for a strategy with no parameters of its own.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "config_class" in vars(cls):
            return
        for base in getattr(cls, "__orig_bases__", ()):
            if typing.get_origin(base) is Strategy:
                [arg] = typing.get_args(base)
                if not (isinstance(arg, type) and issubclass(arg, StrategyConfig)):
                    raise TypeError(
                        f"{cls.__name__}: Strategy[...] takes a frozen attrs StrategyConfig subclass, got {arg!r}"
                    )
                cls.config_class = arg

    def __init__(
        self,
        backends: Sequence[Backend] | None = None,
        *,
        profiling_config: ProfilingConfig | None = None,
        performance_validation: bool | PerformanceValidationMode = True,
        **parameters: Any,
    ) -> None:
        """``backends``: the candidates (None: the tune's defaults); ``parameters``: your config's fields."""
        super().__init__(backends, profiling_config, performance_validation, **parameters)

    @property
    def config(self) -> C:
        """Every parameter of this strategy, as your config class; frozen."""
        return cast(C, self._config)

    def pick(self, candidates: Sequence[CandidateFigures]) -> Choice:
        """Choose the winner among the correct candidates (never empty), or None for eager, and say why."""
        raise NotImplementedError(f"{type(self).__name__} must implement pick(candidates) -> Choice")

    def tune(self, tuning: GraphTuning, default_backends: Sequence[Backend]) -> Candidate | None:
        """Build and validate every candidate, profile the correct ones, ask :meth:`pick`, record its choice."""
        correct = self.correct_candidates(tuning, default_backends)
        if not correct:
            why = tuning.failures() or "no candidate applies to this module"
            tuning.finish(None, f"no backend built and passed validation; running eager. {why}")
            return None
        batch = None
        if self.with_baseline or len(correct) > 1:
            sizes = tuning.default_batch_sizes(self.profiling_config)
            measured = tuning.profile(correct, self.profiling_config, self.with_baseline, sizes)
            batch = max(measured) if measured else None
            tuning.annotate(batch)
        pairs = [(_figures(tuning, c, batch), c) for c in correct if c.ok]
        shown = {id(f): c for f, c in pairs}
        figures = [f for f, _ in pairs]
        if not figures:
            tuning.finish(None, f"every correct backend failed while profiled; running eager. {tuning.failures()}")
            return None
        choice = self.pick(figures)
        if not isinstance(choice, Choice) or not isinstance(choice.reason, str) or not choice.reason:
            raise TypeError(
                f"{type(self).__name__}.pick must return Choice(candidate or None, reason) with a reason, got {choice!r}"
            )
        if choice.candidate is not None and id(choice.candidate) not in shown:
            raise ValueError(
                f"{type(self).__name__}.pick chose {choice.candidate!r}, which is not one of the candidates it was "
                "given; return one of them (or None for eager)"
            )
        winner = shown[id(choice.candidate)] if choice.candidate is not None else None
        tuning.finish(winner, choice.reason, batch)
        return winner


def _figures(tuning: GraphTuning, candidate: Candidate, batch: int | None) -> CandidateFigures:
    report = candidate.report
    profile = candidate.profile_at(batch) if batch is not None else None
    cmp = tuning.versus_eager(candidate, batch) if batch is not None else None
    return CandidateFigures(
        backend=candidate.name,
        variant=report.variant,
        config=candidate.backend.config,
        max_rel_error=report.validation.max_rel_error if report.validation else 0.0,
        min_cosine=report.validation.min_cosine if report.validation else 1.0,
        metric=report.metric,
        batch_size=batch if profile is not None else None,
        p50_ms=profile.p50_ms if profile else None,
        throughput=profile.throughput if profile else None,
        speedup=cmp.speedup if cmp else None,
        speedup_low=cmp.low_speedup if cmp else None,
        speedup_high=cmp.high_speedup if cmp else None,
    )


__all__ = ["CandidateFigures", "Choice", "PerformanceValidationMode", "Strategy", "StrategyConfig", "TuneStrategy"]
