"""Hook specifications: the whole contract between aitune-core and its plugins.

Plugins are modules named by entry points in the ``aitune`` group; they implement some of these
hooks with the :data:`aitune.hookimpl` marker. Core ships its own defaults as the plugin
:mod:`aitune.builtin.operations`, registered ``trylast``, so a plugin can pre-empt an operation
(return a result first) or wrap it (``@hookimpl(wrapper=True)``).

There are three kinds of hooks:

* **registration**: ``aitune_register_backends`` and ``aitune_register_executors``, called once for
  each plugin as the manager registers it (also one registered late), with a registrar bound to
  the plugin's distribution;
* **operations**: ``aitune_build``, ``aitune_validate``, ``aitune_profile``, ``aitune_serialize``,
  ``aitune_deserialize``; each is *firstresult*: the first non-None result wins and the rest are
  not called;
* **observers**: ``aitune_tune_started``, ``aitune_build_error``, ``aitune_candidate_result``,
  ``aitune_tune_finished``;
  for reports, logging and progress; their return values are ignored.

Every operation and observer hook is also handed ``session`` (:class:`aitune.session.Session`): the
run it belongs to, with the hook relay, the registries, the run's builds and a ``stash`` for a
plugin's per-run state. An implementation takes it by naming the parameter, as pytest's hooks take
``config``; one that does not need it leaves it out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import torch

    from .backend import Backend, BuildContext, LoadContext
    from .executor import ExecutorRegistrar
    from .graph import GraphSpec, Sample
    from .profiling import ProfileResult, ProfilingConfig
    from .registry import BackendRegistrar
    from .report import CandidateReport, TuneReport, ValidationReport
    from .session import Session

hookspec = pluggy.HookspecMarker("aitune")


# -- registration -------------------------------------------------------------------------------


@hookspec
def aitune_register_backends(registry: BackendRegistrar) -> None:
    """Declare this plugin's backends with ``registry.add(BackendSpec(...))``.

    Called once for this plugin, when the manager registers it (also after discovery), with a
    :class:`~aitune.registry.BackendRegistrar` bound to its distribution and entry point; a
    registration that raises takes back every backend it added. A name another distribution
    already registered raises :class:`~aitune.errors.DuplicateBackendError` naming both; a spec
    whose Backend class cannot be imported or disagrees with it (name, config class, devices), or
    whose name does not match its entry point, raises :class:`~aitune.errors.PluginError`.
    """


@hookspec
def aitune_register_executors(registry: ExecutorRegistrar) -> None:
    """Declare where isolated builds can run, with ``registry.add(ExecutorSpec(...))``.

    An executor (:class:`~aitune.executor.Executor`) takes exported build jobs (JSON and files,
    never a pickled module) and runs them: core's ``local`` one in worker processes here,
    ``aitune-executor-ray``'s as Ray tasks. Users pick one with ``ait.tune(..., executor=NAME)`` or
    ``AITUNE_EXECUTOR``. Called once for this plugin, when the manager registers it, with an
    :class:`~aitune.executor.ExecutorRegistrar` bound to its distribution.
    """


# -- operations ---------------------------------------------------------------------------------


@hookspec(firstresult=True)
def aitune_build(backend: Backend, module: torch.nn.Module, context: BuildContext, session: Session) -> Backend | None:
    """Build ``backend`` for ``context.graph`` of ``module`` and return the backend ready to infer.

    Return None to leave the build to the next implementation. Stops at the first non-None
    result. The default calls ``backend.build(module, context)``. Build caches and isolated
    worker processes wrap this hook.
    """


@hookspec(firstresult=True)
def aitune_validate(
    backend: Backend,
    reference: Callable[..., Any],
    samples: Sequence[Sample],
    graph: GraphSpec,
    tolerances: Mapping[str, Any] | None,
    masked_by: str | None,
    session: Session,
) -> ValidationReport | None:
    """Compare ``backend``'s outputs with ``reference`` (eager) on ``samples`` and report.

    ``tolerances`` maps a dtype name (``"float16"``) to a user override of the bound; ``masked_by``
    names the input holding an attention mask when only unmasked positions are to be compared
    (``ait.Module(..., compare="unmasked")``), else None. Return None
    to leave validation to the next implementation. Stops at the first non-None result. The
    default checks structure, shape, dtype, NaN/Inf, closeness, input mutation and the min/max of
    every dynamic axis.
    """


@hookspec(firstresult=True)
def aitune_profile(
    runners: Mapping[str, Callable[[], Any]],
    batch_size: int,
    config: ProfilingConfig,
    device: torch.device,
    session: Session,
) -> Mapping[str, ProfileResult] | None:
    """Measure every runner (a call on prepared inputs of ``batch_size``) and return its figures.

    The runners are measured in alternating windows so machine drift hits them alike; the first
    is the baseline the others are paired with (eager, when profiled). Return None to leave
    profiling to the next implementation. Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def aitune_serialize(backend: Backend, directory: Path, session: Session) -> dict[str, Any] | None:
    """Write ``backend``'s payload into ``directory`` and return its JSON-able metadata.

    Return None to leave it to the next implementation. Stops at the first non-None result. The
    default calls ``backend.save(directory)``.
    """


@hookspec(firstresult=True)
def aitune_deserialize(
    backend: Backend, module: torch.nn.Module, directory: Path, context: LoadContext, session: Session
) -> Backend | None:
    """Restore ``backend`` (fresh, from its saved config) from ``directory``; return it ready to infer.

    Return None to leave it to the next implementation. Stops at the first non-None result. The
    default calls ``backend.load(module, directory, context)``.
    """


# -- observers ----------------------------------------------------------------------------------


@hookspec
def aitune_tune_started(report: TuneReport, report_path: Path | None, session: Session) -> None:
    """``ait.tune`` recorded the dataset and starts tuning; ``report`` fills in as modules finish.

    ``report_path`` is where the finished report will be written (None when not asked for), so
    an observer can keep progress beside it. Return value ignored.
    """


@hookspec
def aitune_build_error(
    module_name: str, graph: GraphSpec, backend: Backend, error: BaseException, session: Session
) -> None:
    """A candidate failed to build (not called for one that does not apply, ``NotApplicableError``);
    called before the strategy moves on. Return value ignored."""


@hookspec
def aitune_candidate_result(module_name: str, graph: GraphSpec, candidate: CandidateReport, session: Session) -> None:
    """A candidate is complete, told once and at once: when it fails at any step (status ``failed``,
    ``stage`` says where) or does not apply (``not applicable``), when it has been profiled, or, for a correct candidate the strategy never
    profiles, when the graph's decision is made. Until then its status is ``pending``; the decision
    is in the module report (``aitune_tune_finished``). Return value ignored."""


@hookspec
def aitune_tune_finished(report: TuneReport, session: Session) -> None:
    """``ait.tune`` finished; ``report`` holds every module, graph and candidate. Return value ignored."""


@hookspec
def aitune_tune_failed(report: TuneReport, error: BaseException, session: Session) -> None:
    """``ait.tune`` raised ``error`` after ``aitune_tune_started`` (``fail_fast``, a strategy that raises,
    Ctrl-C); ``report`` holds the modules finished before it. ``aitune_tune_finished`` is not called.
    Return value ignored."""
