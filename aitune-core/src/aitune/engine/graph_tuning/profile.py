"""Profile: correct candidates in, their timings at each batch size out (in their report entries).

Candidates and eager are timed in alternating windows, one interleaved round per batch size, so
all are measured under the same load; each candidate's result carries the eager windows of its
own round (its paired baseline) and the measured dispatch cost (:mod:`..figures`). Before the
first round nothing is timed next to a compiler (builds submitted ahead are waited for) and a
short probe of eager warns when the machine is too noisy to tell backends apart.
"""

from __future__ import annotations

import collections
import copy
import logging
from collections.abc import Sequence

import attrs
import torch

from ...graph import Sample
from ...profiling import NumStepsMeasuringStopStrategy, ProfilingConfig
from ...report import MAX_NOISE, ProfileResult, measured_at
from .. import recording
from ..figures import ProfileOutcome, SharedFigures, measure_dispatch_ms, with_dispatch
from .candidate import Candidate
from .ledger import Ledger
from .runners import RunnerFailed, guarded, runner

logger = logging.getLogger("aitune")

BUILDS_AHEAD = "builds ahead"
"""Whom the time breakdown charges the wait for builds of other graphs still running before profiling."""

NOISY_SPREAD = 0.2
"""Eager's p90 this far above its p50 before profiling makes the tuner warn about the machine."""


class Profiler:
    """Times the candidates of one target against its eager candidate."""

    def __init__(self, ledger: Ledger, eager: Candidate, shared: SharedFigures | None) -> None:
        self.ledger = ledger
        self.eager = eager
        self.shared = shared
        """Several ranks deciding on shared figures, or None: this process's figures are the ones."""
        self.max_noise = MAX_NOISE
        """The widest interval (half-width, share of the speed-up) shown as a figure: the latest profiling config's."""
        self._dispatch_ms: float | None = None
        self._noise_checked = False

    def pinned(self, ledger: Ledger) -> Profiler:
        """This profiler for a pinned target's ``ledger``, keeping what it measured once per graph."""
        child = copy.copy(self)
        child.ledger = ledger
        return child

    def profile(
        self, candidates: Sequence[Candidate], config: ProfilingConfig, with_eager: bool, batch_sizes: Sequence[int]
    ) -> list[int]:
        """Measure candidates (and eager) in alternating windows at each batch size; returns the sizes measured.

        Every runner cycles through the recorded samples, batched to the size. The report keeps one
        eager result per batch size, from the latest round (so FirstWins shows the baseline its
        winner was judged against). A candidate that raises while profiled fails (stage
        ``profile``) and the others go on; an out-of-memory error at one batch size ends the sweep
        and keeps what was measured.
        """
        report = self.ledger.report
        self.max_noise = config.max_noise
        self._wait_for_builds()
        if not self._noise_checked and batch_sizes:
            self._noise_checked = True
            self._check_noise(config, batch_sizes[0])
        dispatch_ms = self.dispatch_cost_ms(config)
        measured: list[int] = []
        for batch_size in batch_sizes:
            inputs = self.ledger.target.inputs_at(batch_size)
            results = self._round(candidates, config, with_eager, batch_size, inputs)
            if results is None:
                break
            if not any(c is not self.eager for c in results):
                break  # every candidate failed to profile: nothing left to compare
            eager = results.get(self.eager)
            for candidate, result in results.items():
                if candidate is self.eager:  # the latest round's: the one FirstWins' winner was paired with
                    report.eager_profiles = [p for p in report.eager_profiles if p.batch_size != batch_size]
                    report.eager_profiles.append(result)
                    continue
                result = with_dispatch(result, dispatch_ms)
                if eager is not None and result.baseline_p50_ms is None:  # shared figures come paired already
                    result = attrs.evolve(
                        result, baseline_p50_ms=eager.p50_ms, baseline_window_p50_ms=list(eager.window_p50_ms)
                    )
                candidate.report.profiles.append(result)
            self._describe_inputs(batch_size, inputs)
            measured.append(batch_size)
            histories = [report.eager_profiles] if with_eager else []
            histories += [c.report.profiles for c in candidates if c.ok]
            if histories and all(config.profiling_stop_strategy.should_stop(h) for h in histories):
                break
        for candidate in candidates:
            if candidate.ok and candidate.report.profiles:
                self.ledger.complete(candidate)
        return measured

    def _round(
        self,
        candidates: Sequence[Candidate],
        config: ProfilingConfig,
        with_eager: bool,
        batch_size: int,
        inputs: list[Sample],
    ) -> dict[Candidate, ProfileResult] | None:
        """One round of interleaved timing windows at one batch size; None when it ran out of memory."""
        ledger, target = self.ledger, self.ledger.target
        while True:
            contenders = ([self.eager] if with_eager else []) + [c for c in candidates if c.ok]
            keys = [f"{c.name}#{i}" for i, c in enumerate(contenders)]
            restore = bool(target.graph.mutated)
            calls = {k: guarded(k, runner(c.backend, inputs, restore)) for k, c in zip(keys, contenders)}
            at = measured_at(target.graph, batch_size)  # "batch 8", or the axis a graph without one varies
            what = f"{target.module_name}: profile {', '.join(c.label for c in contenders)} at {at}"
            step = None
            try:
                with (
                    ledger.progress.step(what, "profile", [ledger.who(c) for c in contenders]) as step,
                    recording.bypass(),
                ):
                    results = target.session.hook.aitune_profile(
                        runners=calls,
                        batch_size=batch_size,
                        config=config,
                        device=target.device,
                        session=target.session,
                    )
                outcome = ProfileOutcome(results, baseline_key=keys[0] if with_eager else None)
            except torch.OutOfMemoryError:
                outcome = ProfileOutcome(out_of_memory=True)
            except RunnerFailed as failed:
                outcome = ProfileOutcome(failed_key=failed.key, error=failed.error)
            if step is not None and step.seconds is not None:  # an interleaved round: each runner its share
                for c in contenders:
                    c.report.profile_time_s = (c.report.profile_time_s or 0.0) + step.seconds / len(contenders)
            if self.shared is not None:
                outcome = self.shared.profiles(what, outcome)
            if outcome.out_of_memory:
                logger.warning("%s: out of memory at %s; profiling stops there", target.module_name, at)
                return None
            if outcome.failed_key is not None:
                error = outcome.error or RuntimeError("raised while profiled")
                culprit = contenders[keys.index(outcome.failed_key)]
                if culprit is self.eager:
                    raise error from None
                why = f"raised while profiled at {at}: {type(error).__name__}: {error}"
                ledger.fail(culprit, "profile", why, error)
                continue
            assert outcome.results is not None
            return {c: outcome.results[k] for k, c in zip(keys, contenders)}

    def _wait_for_builds(self) -> None:
        """Nothing is timed next to a compiler: wait until no build submitted ahead is running."""
        target = self.ledger.target
        builds = target.session.builds
        if builds is None or not builds.pending():
            return
        what = f"{target.module_name}: wait for the builds submitted ahead"
        with self.ledger.progress.step(what, "waiting", [BUILDS_AHEAD]):
            builds.wait_idle()

    def _probe_spread(self, config: ProfilingConfig, batch_size: int) -> float:
        """How far eager's p90 lies above its p50 over ten calls at ``batch_size`` (a fraction of the p50)."""
        target = self.ledger.target
        probe = attrs.evolve(
            config,
            measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=10, warmup=1, window=5),
            extend_s=0.0,
        )
        key = "torch_eager#probe"
        with recording.bypass():
            result = target.session.hook.aitune_profile(
                runners={key: runner(self.eager.backend, target.inputs_at(batch_size), bool(target.graph.mutated))},
                batch_size=batch_size,
                config=probe,
                device=target.device,
                session=target.session,
            )[key]
        return (result.p90_ms - result.p50_ms) / result.p50_ms if result.p50_ms > 0 else 0.0

    def dispatch_cost_ms(self, config: ProfilingConfig) -> float:
        """What a call through ``ait.Module`` adds to a tuned backend (measured once per graph)."""
        if config.dispatch_cost_ms is not None:
            return config.dispatch_cost_ms
        if self._dispatch_ms is None:
            target = self.ledger.target
            measured = measure_dispatch_ms(target.graph, target.samples[0])
            if self.shared is not None:
                measured = self.shared.cost_ms(f"{target.module_name}: dispatch cost", measured)
            self._dispatch_ms = measured
        return self._dispatch_ms

    def _describe_inputs(self, batch_size: int, inputs: list[Sample]) -> None:
        """Say in the report what was timed at ``batch_size``: each input's shape and the samples rotated."""
        graph, report = self.ledger.target.graph, self.ledger.report
        shapes = collections.Counter(tuple(tuple(t.shape) for t in s.tensors()) for s in inputs)
        paths = [spec.path for spec in graph.inputs]
        described = "; ".join(
            ", ".join(f"{p}[{', '.join(map(str, shape))}]" for p, shape in zip(paths, key))
            + (f" x{n}" if len(shapes) > 1 else "")
            for key, n in shapes.items()
        )
        label = f"batch {batch_size}" if graph.batch is not None else "recorded size (no batch axis)"
        line = f"{label}: {described} ({len(inputs)} recorded sample{'s' if len(inputs) != 1 else ''}, rotated)"
        if line not in report.profiled_inputs:
            report.profiled_inputs.append(line)

    def _check_noise(self, config: ProfilingConfig, batch_size: int) -> None:
        """Time eager briefly before profiling; warn when its spread already hides 20% differences.

        A spread seen once is timed again: a model's first calls after recording still speed up
        call by call (caches, allocator, CPU clock), which one probe takes for noise on a quiet
        machine. Noise shows in both probes; a warm-up only in the first."""
        spread = self._probe_spread(config, batch_size)
        if spread > NOISY_SPREAD:
            spread = min(spread, self._probe_spread(config, batch_size))
        if spread > NOISY_SPREAD:
            text = (
                f"the machine is noisy: eager's p90 was {spread:.0%} or more above its p50 in two probes before "
                "profiling, so small "
                "differences between backends are not measurable; close other programs, pin the threads "
                "(aitune tune --threads N, or OMP_NUM_THREADS=N with OMP_WAIT_POLICY=PASSIVE), or profile longer "
                "(ProfilingConfig(measurement_stop_strategy=CvMeasuringStopStrategy()))"
            )
            logger.warning("%s: %s", self.ledger.target.module_name, text)
            self.ledger.note(text)
