"""What a strategy works with: one graph of one module, and the candidates built for it.

:class:`GraphTuning` wraps the hook calls (build, validate, profile) so strategies read as their
rules: ``build``, ``validate``, ``profile``, ``decide``. Every step writes into the candidate's
report entry as it happens, and observers hear about each candidate as soon as it is complete:
when it fails (at any step), when it has been profiled, or, for a correct candidate the strategy
never profiled, when the graph's decision is made.

Profiling times the candidates and eager in alternating windows (one interleaved round per
batch size), so all are measured under the same load; the figures those rounds give (the
speedup against eager, the dispatch cost) are computed in :mod:`.figures`.
"""

from __future__ import annotations

import collections
import copy
import itertools
import logging
import math
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from .. import state
from ..backend import EXPORT_S, WAIT_S, Backend, BuildContext, Tolerance
from ..builtin.eager import TorchEagerBackend
from ..errors import ConfigError, NotApplicableError, SerializationError
from ..graph import BATCH, DimRange, GraphSpec, Sample, assemble
from ..profiling import NumStepsMeasuringStopStrategy, ProfilingConfig
from ..report import (
    MAX_NOISE,
    CandidateReport,
    CandidateStatus,
    GraphReport,
    ProfileResult,
    RouteReport,
    ValidationReport,
)
from ..session import Session
from . import recording
from .figures import Comparison, ProfileOutcome, SharedFigures, compare, measure_dispatch_ms, with_dispatch
from .options import AccuracyRule
from .progress import TuneProgress

logger = logging.getLogger("aitune")


_NOT_BUILT = (CandidateStatus.FAILED, CandidateStatus.NOT_APPLICABLE, CandidateStatus.SKIPPED)


@attrs.define(eq=False)
class Candidate:
    """One backend for one graph: the built object (if it built) and its report entry."""

    backend: Backend
    report: CandidateReport
    error: BaseException | None = None
    reported: bool = False
    """Observers have heard its result (``aitune_candidate_result`` fires once per candidate)."""

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def static_batch(self) -> int | None:
        """The one batch size it was built for (static shapes, see :meth:`GraphTuning.pinned`), else None."""
        return self.report.static_batch

    @property
    def ok(self) -> bool:
        return self.error is None and self.report.status not in _NOT_BUILT

    def profile_at(self, batch_size: int) -> ProfileResult | None:
        return next((p for p in self.report.profiles if p.batch_size == batch_size), None)


class _RunnerFailed(Exception):
    """A runner raised (anything but out-of-memory) while being profiled."""

    def __init__(self, key: str, error: Exception) -> None:
        super().__init__(key)
        self.key = key
        self.error = error


@attrs.frozen
class Route:
    """One batch range of a graph and the candidate that serves it (None: eager)."""

    batch_min: int
    batch_max: int
    candidate: Candidate | None


def narrow(graph: GraphSpec, batch_min: int, batch_max: int) -> GraphSpec:
    """``graph`` with its batch dimension limited to ``batch_min..batch_max``."""
    full = graph.dims[BATCH]
    opt = min(max(full.opt, batch_min), batch_max)
    return attrs.evolve(graph, dims={**graph.dims, BATCH: DimRange(batch_min, opt, batch_max)})


class GraphTuning:
    """The tuning of one graph of one module: the API strategies are written against."""

    static_batch: int | None = None
    """The batch size this tuning's graph is pinned to (:meth:`pinned`), else None."""

    def __init__(
        self,
        *,
        module_name: str,
        module: torch.nn.Module,
        graph: GraphSpec,
        samples: list[Sample],
        device: torch.device,
        session: Session,
        batch_sizes: Sequence[int] | None,
        tolerances: Mapping[str, Tolerance] | None,
        report: GraphReport,
        shared: SharedFigures | None = None,
        progress: TuneProgress | None = None,
        masked_by: str | None = None,
        accuracy: AccuracyRule | None = None,
    ) -> None:
        self.module_name = module_name
        self.module = module
        self.graph = graph
        self.samples = samples
        self.device = device
        self.session = session
        """The plugin session every hook call is handed."""
        self.hook = session.hook
        self.registry = session.registry
        self.progress = progress if progress is not None else TuneProgress(False)
        self.batch_sizes = tuple(batch_sizes) if batch_sizes else None
        self.tolerances = tolerances
        self.masked_by = masked_by
        """The input holding the attention mask when only unmasked positions are compared, else None."""
        self.accuracy = accuracy if accuracy is not None else AccuracyRule()
        """The user's metric and accuracy budget; without a metric the numeric bound decides."""
        self._eager_outputs: list[Any] | None = None
        if self.accuracy.metric is not None:
            report.accuracy_floor = self.accuracy.floor
        self.report = report
        self.shared = shared
        """Several ranks deciding on shared figures, or None: this process's figures are the ones."""
        self.eager = Candidate(TorchEagerBackend(), CandidateReport("torch_eager", {"backend": "torch_eager"}))
        self.eager.backend.build(module, self._context(Path(tempfile.gettempdir())))
        self.built: list[Candidate] = []
        """Every candidate built for this graph, in order (their report entries are in ``report``)."""
        self._dispatch_ms: float | None = None
        self._noise_checked = False
        self.max_noise = MAX_NOISE
        """The widest interval (half-width, share of the speed-up) shown as a figure: the latest profiling config's."""

    # -- steps ------------------------------------------------------------------------------

    def build(self, template: Backend) -> Candidate:
        """Build a fresh copy of ``template`` for this graph; failures are recorded, not raised."""
        backend = template.clone()
        try:
            config = self.registry.config_to_json(backend.config, backend.name)
        except (ConfigError, SerializationError):
            config = {"backend": backend.name}
        variant = ", ".join(filter(None, [backend.variant(), _static_label(self.static_batch)])) or None
        candidate = Candidate(
            backend, CandidateReport(backend.name, config, variant=variant, static_batch=self.static_batch)
        )
        self.report.candidates.append(candidate.report)
        self.built.append(candidate)
        reason = self.registry.unavailable(backend, self.device, self.graph)
        if reason:
            return self._fail(candidate, "availability", reason, None)
        if self.progress.out_of_time():
            return self._skip(candidate, self.progress.budget_text())
        workdir = Path(tempfile.mkdtemp(prefix=f"aitune-{backend.name}-"))
        what = f"{self.module_name}: build {_label(candidate)}"
        step = None
        try:
            with self.progress.step(what) as step, torch.no_grad(), recording.bypass():
                built = self.hook.aitune_build(
                    backend=backend, module=self.module, context=self._context(workdir), session=self.session
                )
            candidate.backend = built if built is not None else backend
        except NotApplicableError as exc:  # by design, not a fault: no build-error observers
            candidate.report.build_time_s = step.seconds if step is not None else None
            return self._not_applicable(candidate, str(exc), exc)
        except Exception as exc:
            candidate.report.build_time_s = step.seconds if step is not None else None
            self.hook.aitune_build_error(
                module_name=self.module_name, graph=self.graph, backend=backend, error=exc, session=self.session
            )
            return self._fail(candidate, "build", f"{type(exc).__name__}: {exc}", exc)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            if step is not None and step.seconds is not None:
                self._charge_build(candidate, step.seconds)
        candidate.report.build_time_s = step.seconds
        candidate.report.build_info = dict(candidate.backend.build_info)
        candidate.report.from_cache = bool(candidate.backend.build_info.get("from_cache", False))
        return candidate

    def validate(self, candidate: Candidate) -> bool:
        """Compare with eager on every sample; a failure marks the candidate failed."""
        what = f"{self.module_name}: validate {_label(candidate)}"
        with (
            self.progress.step(what, "validate", [self.who(candidate)]) as step,
            torch.no_grad(),
            recording.bypass(),
        ):
            result = self.hook.aitune_validate(
                backend=candidate.backend,
                reference=self.module,
                samples=self.samples,
                graph=self.graph,
                tolerances=self.tolerances,
                masked_by=self.masked_by,
                session=self.session,
            )
        candidate.report.validation = result
        candidate.report.validate_time_s = step.seconds
        if self.accuracy.metric is not None and (result.passed or result.closeness_only):
            reason = self._judge_by_metric(candidate, result)
            if reason is not None:
                self._fail(candidate, "validate", reason, None)
                return False
        elif not result.passed:  # the build cache drops a cached build that fails here (it observes the result)
            self._fail(candidate, "validate", result.reason or "outputs differ from eager", None)
            return False
        return True

    def _judge_by_metric(self, candidate: Candidate, result: ValidationReport) -> str | None:
        """The user's metric over the recorded calls decides: why it rejects ``candidate``, or None.

        A candidate outside the numeric bound whose outputs have eager's form (an int8 one) is
        accepted when the metric holds, and its report says so.
        """
        metric, floor = self.accuracy.metric, self.accuracy.floor
        assert metric is not None
        values = []
        with torch.no_grad(), recording.bypass():
            if self._eager_outputs is None:  # once per graph, whatever the number of candidates
                fresh = [s.fresh() for s in self.samples]
                self._eager_outputs = [self.module(*s.args, **s.kwargs) for s in fresh]
            for sample, eager in zip(self.samples, self._eager_outputs):
                mine = sample.fresh()
                tuned = candidate.backend.infer(*mine.args, **mine.kwargs)
                values.append(float(metric(tuned, eager, sample)))
        value = sum(values) / len(values) if values else 1.0
        candidate.report.metric = value
        if not math.isfinite(value):
            return f"the metric returned {value} for some recorded call, which measures nothing, so the candidate fails"
        if value < floor:
            return f"the metric is {value:.4g} over the recorded calls, below {floor:.4g} (1 - accuracy_budget)"
        if not result.passed:
            result.checks.append(f"outside the numeric bound ({result.reason}); accepted by the metric ({value:.4g})")
            result.passed, result.reason = True, None
        return None

    def profile(
        self, candidates: Sequence[Candidate], config: ProfilingConfig, with_eager: bool, batch_sizes: Sequence[int]
    ) -> list[int]:
        """Measure candidates (and eager) in alternating windows at each batch size; returns the sizes measured.

        Every runner cycles through the recorded samples, batched to the size. Each candidate's
        result carries the eager windows of its own round (its paired baseline) and the measured
        dispatch cost. The report keeps one eager result per batch size, from the latest round
        (so FirstWins shows the baseline its winner was judged against). A candidate that raises
        while profiled fails (stage ``profile``) and the others go on; an out-of-memory error at
        one batch size ends the sweep and keeps what was measured.
        """
        self.max_noise = config.max_noise
        self._wait_for_builds()
        if not self._noise_checked and batch_sizes:
            self._noise_checked = True
            self._check_noise(config, batch_sizes[0])
        dispatch_ms = self.dispatch_cost_ms(config)
        measured: list[int] = []
        for batch_size in batch_sizes:
            inputs = self.inputs_at(batch_size)
            results = self._profile_round(candidates, config, with_eager, batch_size, inputs)
            if results is None:
                break
            if not any(c is not self.eager for c in results):
                break  # every candidate failed to profile: nothing left to compare
            eager = results.get(self.eager)
            for candidate, result in results.items():
                if candidate is self.eager:  # the latest round's: the one FirstWins' winner was paired with
                    self.report.eager_profiles = [p for p in self.report.eager_profiles if p.batch_size != batch_size]
                    self.report.eager_profiles.append(result)
                    continue
                result = with_dispatch(result, dispatch_ms)
                if eager is not None and result.baseline_p50_ms is None:  # shared figures come paired already
                    result = attrs.evolve(
                        result, baseline_p50_ms=eager.p50_ms, baseline_window_p50_ms=list(eager.window_p50_ms)
                    )
                candidate.report.profiles.append(result)
            self._describe_inputs(batch_size, inputs)
            measured.append(batch_size)
            histories = [self.report.eager_profiles] if with_eager else []
            histories += [c.report.profiles for c in candidates if c.ok]
            if histories and all(config.profiling_stop_strategy.should_stop(h) for h in histories):
                break
        for candidate in candidates:
            if candidate.ok and candidate.report.profiles:
                self._complete(candidate)
        return measured

    def _profile_round(
        self,
        candidates: Sequence[Candidate],
        config: ProfilingConfig,
        with_eager: bool,
        batch_size: int,
        inputs: list[Sample],
    ) -> dict[Candidate, ProfileResult] | None:
        """One round of interleaved timing windows at one batch size; None when it ran out of memory."""
        while True:
            contenders = ([self.eager] if with_eager else []) + [c for c in candidates if c.ok]
            keys = [f"{c.name}#{i}" for i, c in enumerate(contenders)]
            restore = bool(self.graph.mutated)
            calls = {k: _guarded(k, _runner(c.backend, inputs, restore)) for k, c in zip(keys, contenders)}
            what = f"{self.module_name}: profile {', '.join(_label(c) for c in contenders)} at batch {batch_size}"
            step = None
            try:
                with self.progress.step(what, "profile", [self.who(c) for c in contenders]) as step, recording.bypass():
                    results = self.hook.aitune_profile(
                        runners=calls, batch_size=batch_size, config=config, device=self.device, session=self.session
                    )
                outcome = ProfileOutcome(results, baseline_key=keys[0] if with_eager else None)
            except torch.OutOfMemoryError:
                outcome = ProfileOutcome(out_of_memory=True)
            except _RunnerFailed as failed:
                outcome = ProfileOutcome(failed_key=failed.key, error=failed.error)
            if step is not None and step.seconds is not None:  # an interleaved round: each runner its share
                for c in contenders:
                    c.report.profile_time_s = (c.report.profile_time_s or 0.0) + step.seconds / len(contenders)
            if self.shared is not None:
                outcome = self.shared.profiles(what, outcome)
            if outcome.out_of_memory:
                logger.warning(
                    "%s: out of memory at batch size %d; profiling stops there", self.module_name, batch_size
                )
                return None
            if outcome.failed_key is not None:
                error = outcome.error or RuntimeError("raised while profiled")
                culprit = contenders[keys.index(outcome.failed_key)]
                if culprit is self.eager:
                    raise error from None
                self._fail(
                    culprit,
                    "profile",
                    f"raised while profiled at batch {batch_size}: {type(error).__name__}: {error}",
                    error,
                )
                continue
            assert outcome.results is not None
            return {c: outcome.results[k] for k, c in zip(keys, contenders)}

    def _wait_for_builds(self) -> None:
        """Nothing is timed next to a compiler: wait until no build submitted ahead is running."""
        builds = self.session.builds
        if builds is None or not builds.pending():
            return
        with self.progress.step(f"{self.module_name}: wait for the builds submitted ahead", "waiting", [BUILDS_AHEAD]):
            builds.wait_idle()

    def dispatch_cost_ms(self, config: ProfilingConfig) -> float:
        """What a call through ``ait.Module`` adds to a tuned backend (measured once per graph)."""
        if config.dispatch_cost_ms is not None:
            return config.dispatch_cost_ms
        if self._dispatch_ms is None:
            measured = measure_dispatch_ms(self.graph, self.samples[0])
            if self.shared is not None:
                measured = self.shared.cost_ms(f"{self.module_name}: dispatch cost", measured)
            self._dispatch_ms = measured
        return self._dispatch_ms

    def versus_eager(self, candidate: Candidate, batch_size: int) -> Comparison | None:
        """``candidate`` against the eager windows of its own profiling round at ``batch_size``."""
        mine = candidate.profile_at(batch_size)
        if mine is None:
            return None
        if mine.baseline_p50_ms is None:
            eager = self.eager_profile(batch_size)
            return compare(mine, eager) if eager is not None else None
        return compare(mine)

    def annotate(self, batch_size: int | None) -> None:
        """Write every candidate's speedup and interval at ``batch_size``: the figures the report shows."""
        for c in self.built:
            cmp = self.versus_eager(c, batch_size) if batch_size is not None else None
            c.report.speedup = cmp.speedup if cmp else None
            c.report.speedup_low = cmp.low_speedup if cmp else None
            c.report.speedup_high = cmp.high_speedup if cmp else None
            c.report.measured = cmp.measured(self.max_noise) if cmp else None

    def note(self, text: str) -> None:
        if text not in self.report.notes:
            self.report.notes.append(text)

    def recorded_batch_sizes(self) -> list[int]:
        """The batch size of each recorded sample, in recorded order (empty without a batch axis)."""
        for i, spec in enumerate(self.graph.inputs):
            axis = spec.batch_axis
            if axis is not None:
                return [int(s.tensors()[i].shape[axis]) for s in self.samples]
        return []

    def inputs_at(self, batch_size: int) -> list[Sample]:
        """The data profiling rotates through: a batch of ``batch_size`` starting at each recorded sample.

        Each batch is made as AITune makes one (successive recorded samples concatenated, see
        :func:`aitune.graph.assemble`), so batch-1 data is timed on real rows at every size.
        """
        if self.graph.batch is None:
            return list(self.samples)
        n = len(self.samples)
        return [assemble(self.graph, self.samples[k:] + self.samples[:k], {BATCH: batch_size}) for k in range(n)]

    def _describe_inputs(self, batch_size: int, inputs: list[Sample]) -> None:
        shapes = collections.Counter(tuple(tuple(t.shape) for t in s.tensors()) for s in inputs)
        paths = [spec.path for spec in self.graph.inputs]
        described = "; ".join(
            ", ".join(f"{p}[{', '.join(map(str, shape))}]" for p, shape in zip(paths, key))
            + (f" x{n}" if len(shapes) > 1 else "")
            for key, n in shapes.items()
        )
        label = f"batch {batch_size}" if self.graph.batch is not None else "recorded size (no batch axis)"
        line = f"{label}: {described} ({len(inputs)} recorded sample{'s' if len(inputs) != 1 else ''}, rotated)"
        if line not in self.report.profiled_inputs:
            self.report.profiled_inputs.append(line)

    def _check_noise(self, config: ProfilingConfig, batch_size: int) -> None:
        """Time eager briefly before profiling; warn when its spread already hides 20% differences."""
        probe = attrs.evolve(
            config,
            measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=10, warmup=1, window=5),
            extend_s=0.0,
        )
        key = "torch_eager#probe"
        with recording.bypass():
            result = self.hook.aitune_profile(
                runners={key: _runner(self.eager.backend, self.inputs_at(batch_size), bool(self.graph.mutated))},
                batch_size=batch_size,
                config=probe,
                device=self.device,
                session=self.session,
            )[key]
        spread = (result.p90_ms - result.p50_ms) / result.p50_ms if result.p50_ms > 0 else 0.0
        if spread > NOISY_SPREAD:
            text = (
                f"the machine is noisy: eager's p90 is {spread:.0%} above its p50 before profiling, so small "
                "differences between backends are not measurable; close other programs, pin the threads "
                "(aitune tune --threads N, or OMP_NUM_THREADS=N with OMP_WAIT_POLICY=PASSIVE), or profile longer "
                "(ProfilingConfig(measurement_stop_strategy=CvMeasuringStopStrategy()))"
            )
            logger.warning("%s: %s", self.module_name, text)
            self.note(text)

    def finish_routes(self, routes: list[Route], reason: str) -> None:
        """Record a decision that serves batch ranges with different candidates."""
        for route in routes:
            if route.candidate is not None:
                route.candidate.report.status = CandidateStatus.SELECTED
        self.report.routes = [
            RouteReport(
                r.batch_min,
                r.batch_max,
                r.candidate.name if r.candidate else "torch_eager",
                static=r.candidate is not None and r.candidate.static_batch is not None,
            )
            for r in routes
        ]
        self.finish(None, reason)
        self.report.decision = ", ".join(
            f"{r.backend}{' static' if r.static else ''} (batch {r.batch_min}..{r.batch_max})"
            for r in self.report.routes
        )

    def pinned(self, batch_size: int) -> GraphTuning:
        """The tuning of this graph with its batch axis pinned to ``batch_size``: what static-shape
        builds are built, validated and profiled on. It shares this tuning's report, session and
        progress; its samples are the recorded calls of that batch size (else ones batched to it)."""
        sizes = self.recorded_batch_sizes()
        recorded = [s for s, size in zip(self.samples, sizes) if size == batch_size]
        child = copy.copy(self)
        child.samples = recorded or self.inputs_at(batch_size)
        child.graph = narrow(self.graph, batch_size, batch_size)
        child.static_batch = batch_size
        child.built = []
        child._eager_outputs = None
        return child

    def eager_profile(self, batch_size: int) -> ProfileResult | None:
        return next((p for p in self.report.eager_profiles if p.batch_size == batch_size), None)

    def default_batch_sizes(self, config: ProfilingConfig, every_recorded: bool = False) -> list[int]:
        """The batch sizes to profile: the config's, else tune's, else the recorded ones.

        Throughput strategies ask for ``every_recorded`` size; the eager gate of OneBackend and
        FirstWins takes the most common recorded size (ties: the larger).
        """
        batch = self.graph.batch
        if batch is None:
            return [self._leading_size()]
        wanted = config.batch_sizes or self.batch_sizes
        inside = sorted({b for b in wanted or () if b in batch})
        if inside:
            return inside
        recorded = self.recorded_batch_sizes() or [batch.opt]
        if every_recorded:
            return sorted(set(recorded))
        counts = collections.Counter(recorded)
        top = max(counts.values())
        return [max(b for b, n in counts.items() if n == top)]

    def finish(self, candidate: Candidate | None, reason: str, batch_size: int | None = None) -> None:
        """Record the decision: ``candidate`` wins, or eager when None."""
        for c in self.report.candidates:
            if c.status == "pending":
                c.status = CandidateStatus.REJECTED
        if candidate is not None and candidate is not self.eager:
            candidate.report.status = CandidateStatus.SELECTED
        self.report.decision = candidate.name if candidate is not None else "torch_eager"
        self.report.reason = reason
        self.report.selected_batch_size = batch_size
        for built in self.built:
            self._complete(built)

    # -- helpers ----------------------------------------------------------------------------

    def who(self, candidate: Candidate) -> str:
        """Whom the report's time breakdown charges ``candidate``'s seconds to: ``module: backend (variant)``."""
        return f"{self.module_name}: {_label(candidate)}"

    def _charge_build(self, candidate: Candidate, seconds: float) -> None:
        """Split a build step's seconds into the export, the wait for a build that ran elsewhere,
        and the build itself, as the backend (``export_s``) and the isolation (``wait_s``) state them.
        A build-cache hit only loaded: its stored figures are those of the build that made it."""
        info = {} if candidate.backend.build_info.get("from_cache") else candidate.backend.build_info
        export = _within(info.get(EXPORT_S), seconds)
        waiting = _within(info.get(WAIT_S), seconds - export)
        who = self.who(candidate)
        for stage, part in (("export", export), ("waiting", waiting), ("build", seconds - export - waiting)):
            if part or stage == "build":
                self.progress.charge(who, stage, part)

    def _context(self, workdir: Path) -> BuildContext:
        from ..cachedir import cache_dir

        return BuildContext(self.graph, self.samples, self.device, workdir, cache_dir(), self.module_name)

    def _fail(self, candidate: Candidate, stage: str, reason: str, error: BaseException | None) -> Candidate:
        candidate.report.status = CandidateStatus.FAILED
        candidate.report.stage = stage
        candidate.report.reason = reason
        candidate.error = error
        logger.info("%s: %s failed at %s: %s", self.module_name, candidate.name, stage, reason)
        self._complete(candidate)
        return candidate

    def order(self, templates: Sequence[Backend]) -> list[Backend]:
        """With a time budget, the cheapest builds first (``Backend.build_cost``; ties keep their
        order, the priority given), so the budget is spent where it buys the most candidates."""
        if self.progress.time_budget is None:
            return list(templates)
        return sorted(templates, key=lambda b: b.build_cost)

    def _skip(self, candidate: Candidate, reason: str) -> Candidate:
        candidate.report.status = CandidateStatus.SKIPPED
        candidate.report.reason = reason
        logger.info("%s: %s skipped: %s", self.module_name, _label(candidate), reason)
        self._complete(candidate)
        return candidate

    def _not_applicable(self, candidate: Candidate, reason: str, error: BaseException) -> Candidate:
        candidate.report.status = CandidateStatus.NOT_APPLICABLE
        candidate.report.stage = "build"
        candidate.report.reason = reason
        candidate.error = error
        logger.info("%s: %s does not apply: %s", self.module_name, candidate.name, reason)
        self._complete(candidate)
        return candidate

    def failures(self) -> str:
        """``backend: reason`` of every candidate that failed, joined, then those skipped for the time
        budget; not applicable ones are left out (the detailed report lists them)."""
        parts = [
            f"{c.backend}{f' ({c.variant})' if c.variant else ''}: {c.reason}"
            for c in self.report.candidates
            if c.status == CandidateStatus.FAILED
        ]
        skipped = [c.backend for c in self.report.candidates if c.status == CandidateStatus.SKIPPED]
        if skipped:
            parts.append(f"{', '.join(skipped)} skipped: the time budget was spent")
        return "; ".join(parts)

    def _complete(self, candidate: Candidate) -> None:
        """Tell observers ``candidate``'s result, once: its status is ``failed``, or still ``pending``
        (complete, awaiting the graph's decision) unless the decision is made already."""
        if candidate.reported or candidate is self.eager:
            return
        candidate.reported = True
        self.hook.aitune_candidate_result(
            module_name=self.module_name, graph=self.graph, candidate=candidate.report, session=self.session
        )

    def _leading_size(self) -> int:
        first = self.graph.inputs[0] if self.graph.inputs else None
        return first.shape[0] if first is not None and first.rank else 1


def _static_label(batch_size: int | None) -> str | None:
    return f"static batch {batch_size}" if batch_size is not None else None


def _within(value: Any, most: float) -> float:
    """A stated number of seconds, kept between 0 and ``most`` (0 when not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return 0.0
    return min(max(float(value), 0.0), max(most, 0.0))


def _label(candidate: Candidate) -> str:
    """``onnxruntime (torchscript export)``: the backend and, when it has several, its variant."""
    variant = candidate.report.variant
    return f"{candidate.name} ({variant})" if variant else candidate.name


BUILDS_AHEAD = "builds ahead"
"""Whom the time breakdown charges the wait for builds of other graphs still running before profiling."""

NOISY_SPREAD = 0.2
"""Eager's p90 this far above its p50 before profiling makes the tuner warn about the machine."""


def _runner(backend: Backend, samples: Sequence[Sample], restore: bool = False) -> Callable[[], Any]:
    """Calls ``backend`` on each of ``samples`` in turn, as recorded.

    With ``restore`` (a graph that updates its inputs in place, as a KV cache's decode step
    does), each call gets inputs as they were recorded: ``prepare`` copies them back before the
    call, outside the timed region, so a measured call never runs past its cache's end.
    """
    if restore:
        return _RestoringRunner(backend, samples)
    calls = itertools.cycle([(s.args, s.kwargs) for s in samples])
    infer = backend.infer

    def run() -> Any:
        args, kwargs = next(calls)
        return infer(*args, **kwargs)

    return run


class _RestoringRunner:
    def __init__(self, backend: Backend, samples: Sequence[Sample]) -> None:
        self.infer = backend.infer
        self.work = [s.fresh() for s in samples]
        self.recorded = [s.tensors() for s in samples]
        self.slots = [state.counter_slots((w.args, w.kwargs)) for w in self.work]
        self.counts = [[getattr(o, n) for o, n in state.counter_slots((s.args, s.kwargs))] for s in samples]
        self.order = itertools.cycle(range(len(samples)))
        self.current: int | None = None

    def prepare(self) -> None:
        self.current = next(self.order)
        for mine, recorded in zip(self.work[self.current].tensors(), self.recorded[self.current]):
            mine.copy_(recorded)  # a step counter's leaf is a copy: its int is set back below
        for (layer, name), value in zip(self.slots[self.current], self.counts[self.current]):
            layer.__dict__[name] = value

    def __call__(self) -> Any:
        if self.current is None:
            self.prepare()
        assert self.current is not None
        sample, self.current = self.work[self.current], None
        return self.infer(*sample.args, **sample.kwargs)


def _guarded(key: str, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn``, with any error but out-of-memory tagged with the runner it came from."""

    def run() -> Any:
        try:
            return fn()
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            raise _RunnerFailed(key, exc) from exc

    run.prepare = getattr(fn, "prepare", None)  # type: ignore[attr-defined]
    return run
