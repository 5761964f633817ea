"""What a strategy works with: one graph of one module, and the candidates built for it.

:class:`GraphTuning` wraps the hook calls (build, validate, profile) so strategies read as their
rules: ``build``, ``validate``, ``profile``, ``decide``. Every step writes into the candidate's
report entry as it happens, and observers hear about each finished candidate.
"""

from __future__ import annotations

import logging
import shutil
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from ..backend import Backend, BuildContext, Tolerance
from ..builtin.eager import TorchEagerBackend
from ..errors import ConfigError, SerializationError
from ..graph import BATCH, DimRange, GraphSpec, Sample, assemble
from ..report import CandidateReport, GraphReport, ProfileResult, RouteReport
from . import progress, recording
from .task.profiling import ProfilingConfig

logger = logging.getLogger("aitune")


@attrs.define(eq=False)
class Candidate:
    """One backend for one graph: the built object (if it built) and its report entry."""

    backend: Backend
    report: CandidateReport
    error: BaseException | None = None

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def ok(self) -> bool:
        return self.error is None and self.report.status != "failed"

    def profile_at(self, batch_size: int) -> ProfileResult | None:
        return next((p for p in self.report.profiles if p.batch_size == batch_size), None)


@attrs.frozen
class Comparison:
    """A candidate against eager at one batch size."""

    speedup: float
    """Eager p50 over candidate p50."""
    low_speedup: float
    """A conservative speedup: the lower quartile of the per-window ratios (eager window p50 over
    the candidate's). A candidate clearly beats a bar only when it does so in at least three windows
    of four; otherwise the gap is inside the measured spread. Windows where eager was unlucky only
    raise the upper quartiles, so they cannot hide a real win."""


def compare(candidate: ProfileResult, eager: ProfileResult) -> Comparison:
    speedup = eager.p50_ms / candidate.p50_ms if candidate.p50_ms > 0 else float("inf")
    ratios = [e / c for e, c in zip(eager.window_p50_ms, candidate.window_p50_ms) if c > 0]
    if len(ratios) < 2:
        return Comparison(speedup, speedup)
    if len(ratios) < 4:
        return Comparison(speedup, min(ratios))
    return Comparison(speedup, statistics.quantiles(ratios, n=4, method="inclusive")[0])


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

    def __init__(
        self,
        module_name: str,
        module: torch.nn.Module,
        graph: GraphSpec,
        samples: list[Sample],
        device: torch.device,
        hook: Any,
        registry: Any,
        batch_sizes: Sequence[int] | None,
        tolerances: Mapping[str, Tolerance] | None,
        report: GraphReport,
    ) -> None:
        self.module_name = module_name
        self.module = module
        self.graph = graph
        self.samples = samples
        self.device = device
        self.hook = hook
        self.registry = registry
        self.batch_sizes = tuple(batch_sizes) if batch_sizes else None
        self.tolerances = tolerances
        self.report = report
        self.eager = Candidate(TorchEagerBackend(), CandidateReport("torch_eager", {"backend": "torch_eager"}))
        self.eager.backend.build(module, self._context(Path(tempfile.gettempdir())))

    # -- steps ------------------------------------------------------------------------------

    def build(self, template: Backend) -> Candidate:
        """Build a fresh copy of ``template`` for this graph; failures are recorded, not raised."""
        backend = template.clone()
        try:
            config = self.registry.config_to_json(backend.config, backend.name)
        except (ConfigError, SerializationError):
            config = {"backend": backend.name}
        candidate = Candidate(backend, CandidateReport(backend.name, config))
        self.report.candidates.append(candidate.report)
        reason = self._unavailable(backend)
        if reason:
            return self._fail(candidate, "availability", reason, None)
        workdir = Path(tempfile.mkdtemp(prefix=f"aitune-{backend.name}-"))
        start = time.perf_counter()
        try:
            with progress.step(f"{self.module_name}: build {backend.name}"), torch.no_grad(), recording.bypass():
                built = self.hook.aitune_build(backend=backend, module=self.module, context=self._context(workdir))
            candidate.backend = built if built is not None else backend
        except Exception as exc:
            candidate.report.build_time_s = time.perf_counter() - start
            self.hook.aitune_build_error(module_name=self.module_name, graph=self.graph, backend=backend, error=exc)
            return self._fail(candidate, "build", f"{type(exc).__name__}: {exc}", exc)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        candidate.report.build_time_s = time.perf_counter() - start
        candidate.report.build_info = dict(candidate.backend.build_info)
        candidate.report.from_cache = bool(candidate.backend.build_info.get("from_cache", False))
        return candidate

    def validate(self, candidate: Candidate) -> bool:
        """Compare with eager on every sample; a failure marks the candidate failed."""
        with progress.step(f"{self.module_name}: validate {candidate.name}"), torch.no_grad(), recording.bypass():
            result = self.hook.aitune_validate(
                backend=candidate.backend,
                reference=self.module,
                samples=self.samples,
                graph=self.graph,
                tolerances=self.tolerances,
            )
        candidate.report.validation = result
        if not result.passed:
            self._fail(candidate, "validate", result.reason or "outputs differ from eager", None)
            return False
        return True

    def profile(
        self, candidates: Sequence[Candidate], config: ProfilingConfig, with_eager: bool, batch_sizes: Sequence[int]
    ) -> list[int]:
        """Measure candidates (and eager) in alternating windows at each batch size; returns the sizes measured.

        An out-of-memory error at one batch size ends the sweep and keeps what was measured.
        """
        runners = ([self.eager] if with_eager else []) + [c for c in candidates if c.ok]
        measured: list[int] = []
        for batch_size in batch_sizes:
            sample = self._sample_at(batch_size)
            calls = {c.name + f"#{i}": _runner(c.backend, sample) for i, c in enumerate(runners)}
            names = ", ".join(c.name for c in runners)
            try:
                with progress.step(f"{self.module_name}: profile {names} at batch {batch_size}"), recording.bypass():
                    results = self.hook.aitune_profile(
                        runners=calls, batch_size=batch_size, config=config, device=self.device
                    )
            except torch.OutOfMemoryError:
                logger.warning(
                    "%s: out of memory at batch size %d; profiling stops there", self.module_name, batch_size
                )
                break
            for key, candidate in zip(calls, runners):
                target = self.report.eager_profiles if candidate is self.eager else candidate.report.profiles
                target.append(results[key])
            measured.append(batch_size)
            histories = [self.report.eager_profiles] if with_eager else []
            histories += [c.report.profiles for c in candidates if c.ok]
            if histories and all(config.profiling_stop_strategy.should_stop(h) for h in histories):
                break
        return measured

    def finish_routes(self, routes: list[Route], reason: str) -> None:
        """Record a decision that serves batch ranges with different candidates."""
        for route in routes:
            if route.candidate is not None:
                route.candidate.report.status = "selected"
        self.report.routes = [
            RouteReport(r.batch_min, r.batch_max, r.candidate.name if r.candidate else "torch_eager") for r in routes
        ]
        self.finish(None, reason)
        self.report.decision = ", ".join(
            f"{r.backend} (batch {r.batch_min}..{r.batch_max})" for r in self.report.routes
        )

    def eager_profile(self, batch_size: int) -> ProfileResult | None:
        return next((p for p in self.report.eager_profiles if p.batch_size == batch_size), None)

    def default_batch_sizes(self, config: ProfilingConfig) -> list[int]:
        """The batch sizes to profile: the config's, else tune's, else the most common recorded one."""
        batch = self.graph.batch
        wanted = config.batch_sizes or self.batch_sizes
        if batch is None:
            return [self._leading_size()]
        if not wanted:
            return [batch.opt]
        inside = [b for b in wanted if b in batch]
        return sorted(set(inside)) or [batch.opt]

    def finish(self, candidate: Candidate | None, reason: str, batch_size: int | None = None) -> None:
        """Record the decision: ``candidate`` wins, or eager when None."""
        for c in self.report.candidates:
            if c.status == "pending":
                c.status = "rejected"
        if candidate is not None and candidate is not self.eager:
            candidate.report.status = "selected"
        self.report.decision = candidate.name if candidate is not None else "torch_eager"
        self.report.reason = reason
        self.report.selected_batch_size = batch_size
        for c in self.report.candidates:
            self.hook.aitune_candidate_result(module_name=self.module_name, graph=self.graph, candidate=c)

    # -- helpers ----------------------------------------------------------------------------

    def _context(self, workdir: Path) -> BuildContext:
        from ..cache import cache_dir

        return BuildContext(self.graph, self.samples, self.device, workdir, cache_dir(), self.module_name)

    def _unavailable(self, backend: Backend) -> str | None:
        if backend.name in self.registry:
            reason = self.registry.status(backend.name).reason(self.device.type)
            if reason:
                return reason
        return backend.unsupported_reason(self.graph, self.device)

    def _fail(self, candidate: Candidate, stage: str, reason: str, error: BaseException | None) -> Candidate:
        candidate.report.status = "failed"
        candidate.report.stage = stage
        candidate.report.reason = reason
        candidate.error = error
        logger.info("%s: %s failed at %s: %s", self.module_name, candidate.name, stage, reason)
        return candidate

    def _leading_size(self) -> int:
        first = self.graph.inputs[0] if self.graph.inputs else None
        return first.shape[0] if first is not None and first.rank else 1

    def _sample_at(self, batch_size: int) -> Sample:
        if self.graph.batch is None:
            return self.samples[0]
        return assemble(self.graph, self.samples, {BATCH: batch_size})


def _runner(backend: Backend, sample: Sample) -> Any:
    args, kwargs = sample.args, sample.kwargs
    infer = backend.infer
    return lambda: infer(*args, **kwargs)
