"""The API strategies are written against: one graph of one module, and its steps in order.

:class:`GraphTuning` owns no step's logic: it holds what the steps share (the :class:`Target`, the
:class:`Ledger`, eager's candidate) and hands each call to the module of its step.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import torch

from ...backend import Backend, Tolerance
from ...graph import GraphSpec, Sample
from ...profiling import ProfilingConfig
from ...registry import BackendRegistry
from ...report import GraphReport, ProfileResult
from ...session import Session
from ..figures import Comparison, SharedFigures
from ..options import AccuracyRule
from ..progress import TuneProgress
from . import build as building
from . import decide
from .candidate import Candidate, Route
from .ledger import Ledger
from .profile import Profiler
from .target import Target
from .validate import Validator


class GraphTuning:
    """The tuning of one graph of one module: build, validate, profile, decide."""

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
        self.target = Target(
            module_name=module_name,
            module=module,
            graph=graph,
            samples=samples,
            device=device,
            session=session,
            batch_sizes=tuple(batch_sizes) if batch_sizes else None,
        )
        self.ledger = Ledger(self.target, report, progress if progress is not None else TuneProgress(False))
        accuracy = accuracy if accuracy is not None else AccuracyRule()
        if accuracy.metric is not None:
            report.accuracy_floor = accuracy.floor
        self.validator = Validator(self.ledger, tolerances, masked_by, accuracy)
        self.eager = building.eager(self.target)
        """Eager PyTorch as a candidate: the baseline, and the answer when no candidate wins."""
        self.profiler = Profiler(self.ledger, self.eager, shared)

    # -- the steps, in the order a strategy takes them ------------------------------------------

    def build(self, template: Backend) -> Candidate:
        """Build a fresh copy of ``template`` for this graph; failures are recorded, not raised (:mod:`.build`)."""
        return building.build(self.ledger, template)

    def builds_beside(self, template: Backend) -> bool:
        """Whether ``template``'s build runs in a worker beside this process (sent ahead at the start)."""
        return building.beside(self.target, template)

    def supersede(self, template: Backend, by: Candidate) -> Candidate:
        """Record ``template`` as not built: ``by`` is correct and runs what it would, with less per call."""
        return building.supersede(self.ledger, template, by)

    def list_in_order(self, candidates: Sequence[Candidate]) -> None:
        """The report lists ``candidates`` in this order, whatever order they were built in."""
        self.ledger.reorder(candidates)

    def validate(self, candidate: Candidate) -> bool:
        """Compare with eager on every sample; a failure marks the candidate failed (:mod:`.validate`)."""
        return self.validator.validate(candidate)

    def profile(
        self, candidates: Sequence[Candidate], config: ProfilingConfig, with_eager: bool, batch_sizes: Sequence[int]
    ) -> list[int]:
        """Time candidates (and eager) at each batch size; returns the sizes measured (:mod:`.profile`)."""
        return self.profiler.profile(candidates, config, with_eager, batch_sizes)

    def finish(self, candidate: Candidate | None, reason: str, batch_size: int | None = None) -> None:
        """Record the decision: ``candidate`` wins, or eager when None (:mod:`.decide`)."""
        decide.finish(self.ledger, self.eager, candidate, reason, batch_size)

    def finish_routes(self, routes: list[Route], reason: str) -> None:
        """Record a decision that serves batch ranges with different candidates."""
        decide.finish_routes(self.ledger, self.eager, routes, reason)

    # -- what a strategy reads and writes on the way ---------------------------------------------

    def pinned(self, batch_size: int) -> GraphTuning:
        """The tuning of this graph with its batch axis pinned to ``batch_size``: what static-shape
        builds are built, validated and profiled on. It shares this tuning's report, session and
        progress; its samples are the recorded calls of that batch size (else ones batched to it)."""
        child = copy.copy(self)
        child.target = self.target.pinned(batch_size)
        child.ledger = self.ledger.sharing(child.target)
        child.validator = self.validator.pinned(child.ledger)
        child.profiler = self.profiler.pinned(child.ledger)
        return child

    def order(self, templates: Sequence[Backend]) -> list[Backend]:
        """The order to build ``templates`` in: with a time budget, the cheapest first."""
        return building.order(templates, self.progress)

    def annotate(self, batch_size: int | None) -> None:
        """Write every candidate's speedup and interval at ``batch_size``: the figures the report shows."""
        decide.annotate(self.ledger, batch_size, self.max_noise)

    def versus_eager(self, candidate: Candidate, batch_size: int) -> Comparison | None:
        """``candidate`` against the eager windows of its own profiling round at ``batch_size``."""
        return decide.versus_eager(self.report, candidate, batch_size)

    def eager_profile(self, batch_size: int) -> ProfileResult | None:
        return decide.eager_profile(self.report, batch_size)

    def failures(self) -> str:
        """``backend: reason`` of every candidate that failed, then those skipped for the time budget."""
        return decide.failures(self.report)

    def default_batch_sizes(self, config: ProfilingConfig, every_recorded: bool = False) -> list[int]:
        """The batch sizes to profile: the config's, else tune's, else the recorded ones."""
        return self.target.default_batch_sizes(config, every_recorded)

    def dispatch_cost_ms(self, config: ProfilingConfig) -> float:
        """What a call through ``ait.Module`` adds to a tuned backend (measured once per graph)."""
        return self.profiler.dispatch_cost_ms(config)

    def recorded_batch_sizes(self) -> list[int]:
        return self.target.recorded_batch_sizes()

    def inputs_at(self, batch_size: int) -> list[Sample]:
        return self.target.inputs_at(batch_size)

    def note(self, text: str) -> None:
        self.ledger.note(text)

    def who(self, candidate: Candidate) -> str:
        return self.ledger.who(candidate)

    # -- what the tuning works on, read-only -----------------------------------------------------

    @property
    def module_name(self) -> str:
        return self.target.module_name

    @property
    def module(self) -> torch.nn.Module:
        return self.target.module

    @property
    def graph(self) -> GraphSpec:
        """The graph tuned (for a pinned tuning: narrowed to its one batch size)."""
        return self.target.graph

    @property
    def samples(self) -> list[Sample]:
        """The recorded calls of the graph (for a pinned tuning: those of its batch size)."""
        return self.target.samples

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def session(self) -> Session:
        """The plugin session every hook call is handed."""
        return self.target.session

    @property
    def registry(self) -> BackendRegistry:
        return self.target.session.registry

    @property
    def batch_sizes(self) -> tuple[int, ...] | None:
        """The batch sizes ``ait.tune`` was asked for, else None."""
        return self.target.batch_sizes

    @property
    def static_batch(self) -> int | None:
        """The batch size this tuning's graph is pinned to (:meth:`pinned`), else None."""
        return self.target.static_batch

    @property
    def report(self) -> GraphReport:
        return self.ledger.report

    @property
    def built(self) -> list[Candidate]:
        """Every candidate built for this graph, in order (their report entries are in ``report``)."""
        return self.ledger.built

    @property
    def progress(self) -> TuneProgress:
        return self.ledger.progress

    @property
    def shared(self) -> SharedFigures | None:
        """Several ranks deciding on shared figures, or None: this process's figures are the ones."""
        return self.profiler.shared

    @property
    def max_noise(self) -> float:
        """The widest interval shown as a figure: the latest profiling config's."""
        return self.profiler.max_noise
