"""``ait.tune``: run the pipeline, record every wrapped module, tune each one, report.

A module that fails to tune stays eager, with a warning, and the others go on (``fail_fast=True``
or a ``strict`` module raises instead; an error about the environment, such as an unsafe cache
folder or a broken plugin, always raises). Strategies whose documented behaviour is to raise (``raises_on_failure``: OneBackend's
original error, LatencyBudget's unmet budget) always propagate.

The flow reads top to bottom here: record, agree across ranks, tune and install each module,
report; each step it calls lives in its own module (docs/architecture.md names them).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import inspect
import logging
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .. import __version__, distributed
from ..backend import Tolerance
from ..builds.queue import build_queue
from ..envvars import check_switches
from ..errors import AituneError, ConfigError, DistributedTuneError, InputError, PluginError
from ..machine import environment, load_average
from ..plugins import AituneManager, get_manager
from ..report import (
    EndToEndReport,
    GraphReport,
    ModuleReport,
    ModuleStatus,
    TuneReport,
    format_speedup,
    measured_at,
    slower_beyond_interval,
)
from ..session import Session
from . import end_to_end, fanout, plan, ranks, recording
from .generation import StaticCacheSwitch
from .install import install, reset
from .module import Module, freeze_tuned, wrapped_modules
from .options import TuneOptions
from .plan import ModulePlan, TuneRun, default_backends, strategy_for, weights_device
from .progress import TuneProgress
from .winners import Winner, eager_only, winners_of

logger = logging.getLogger("aitune")


def call_with_item(fn: Callable[..., Any], sample: Any) -> Any:
    """Call ``fn`` with a dataset item: a tensor, a tuple, a dict, or ``(args, kwargs)``."""
    if (
        isinstance(sample, tuple)
        and len(sample) == 2
        and isinstance(sample[0], (tuple, list))
        and isinstance(sample[1], dict)
    ):
        return fn(*sample[0], **sample[1])
    if isinstance(sample, (tuple, list)):
        return fn(*sample)
    if isinstance(sample, dict):
        return fn(**sample)
    return fn(sample)


def _device_of(modules: Sequence[Module]) -> torch.device:
    """The device of the first wrapped module that has weights; CPU when none has."""
    found = (weights_device(m.module) for m in modules)
    return next((d for d in found if d is not None), torch.device("cpu"))


def tune(
    model_or_callable: Any,
    dataset: Iterable[Any],
    batch_sizes: Sequence[int] | None = None,
    device: str | torch.device | None = None,
    *,
    max_samples: int | None = None,
    fail_fast: bool | None = None,
    report_path: str | Path | None = None,
    tolerances: Mapping[str, Tolerance] | None = None,
    show_progress: bool | None = None,
    ignore_failing_modules: bool | None = None,
    dry_run: bool = False,
    max_num_batches_per_batch_size: int | None = None,
    set_eval: bool = False,
    executor: str | None = None,
    rank_decision: str | None = None,
    freeze: bool | None = None,
    threads: int | None = None,
    metric: Callable[[Any, Any, Any], float] | None = None,
    accuracy_budget: float | None = None,
    end_to_end: bool | float = True,
    time_budget: float | None = None,
    static_cache: bool = True,
    pad: Mapping[str, float] | None = None,
    manager: AituneManager | None = None,
) -> TuneReport:
    """Run ``model_or_callable`` over ``dataset``, then tune every ``ait.Module`` it called.

    A dataset item is one call of ``model_or_callable``. ``batch_sizes`` are the batch sizes to
    build for and profile; a batch of each size is formed by concatenating recorded items along
    their batch axis, so a list of batch-1 samples with ``batch_sizes=[1, 2, 4, 8]`` tunes for
    batches 1..8. Left None, items that all have batch 1 are tuned for AITune's default ``[1, 2]``,
    and other items for the batch sizes they have. ``device`` defaults to the device of the
    model's weights. ``ignore_failing_modules`` (AITune's name) is ``not fail_fast``;
    ``dry_run=True`` records and reports the graphs without building anything. Returns the
    tuning report (also written to ``report_path`` when given). ``show_progress`` (default: when
    stderr is a terminal) shows each step live; every step is logged on the ``aitune`` logger
    either way. ``executor`` names where isolated builds run (``"local"``, ``"ray"``; default
    ``AITUNE_EXECUTOR``, else local). ``rank_decision`` says who decides when the ranks of a
    ``torch.distributed`` job tune together: ``"rank0"`` (default; ``AITUNE_RANK_DECISION``) or
    ``"slowest"`` (every rank times its own builds; the slowest rank's figures count). Arguments
    left as None take their value from ``ait.config``.

    Tuning is for inference: a wrapped module in training mode whose code reads ``self.training``
    (Dropout, BatchNorm, ...) is refused, or with ``set_eval=True`` switched to eval mode (logged).
    ``freeze`` (default True) makes the parameters of every tuned module inference-only afterwards,
    so a plain ``model(x)`` (no ``torch.no_grad()``) runs the winner; the report lists them, and
    ``freeze=False`` keeps them trainable (such calls then run eager with a warning).

    Every candidate, eager included, runs under one thread budget: torch's intra-op thread count,
    which ``threads=N`` sets for the process (``torch.set_num_threads``) before anything is timed.
    Runtimes with pools of their own (ONNX Runtime) size them to it, in tuning and after load, so a
    speed-up is always one at equal threads; the report's environment states it.

    ``metric(tuned_outputs, eager_outputs, batch) -> float`` (1.0: eager's answers; ready-made ones
    in :mod:`aitune.metrics`) judges candidates over the recorded calls: one is accepted when the
    metric's mean is at least ``1 - accuracy_budget`` (default budget 0), also when it is outside
    the numeric bound but has eager's structure, shapes and dtypes (int8). With a budget, backends'
    quantizing variants (ONNX Runtime int8) join the default candidates. Each candidate's metric is
    in the report; a module's own ``metric``/``accuracy_budget`` win.

    ``end_to_end`` (default True) then times the whole of ``model_or_callable`` over the first
    dataset items, eager against tuned, interleaved, for up to 10 s (a number: that budget); the
    report and the log lead with it ("end to end 1.70x [1.61-1.79]"), next to each module's share
    of the eager time, so a partial wrap that barely moves the whole says so. Winners that make the
    whole slower than eager beyond that interval are not kept (their modules run eager, with a
    warning giving both figures) unless the strategy's eager gate is off. Where ``generate()`` was
    switched to a static cache, the figure is against eager with the default cache the user had,
    and the one against eager with the static cache is reported next to it.

    ``time_budget`` (seconds) bounds the tune: candidates are built cheapest first
    (``Backend.build_cost``; FirstWins keeps a list the user gave in its order), and once the budget
    is spent no further candidate is built: each is reported ``skipped`` with the reason, a build
    already running finishes, and what was built is still validated, profiled and decided on. Every
    build, validation and profile logs its start and, past 30 s, a line every 30 s; the report's
    ``time_spent`` (and each candidate's build, validate and profile seconds) says where the time went.
    ``static_cache`` (default True): a transformers model holding a wrapped module, whose
    ``generate()`` would use the default (dynamic) KV cache, generates with a static cache from
    now on (``generation_config.cache_implementation = "static"``, set before recording, logged
    and listed in the report's ``changes``), so its decode step can be tuned. It is put back when
    no recorded call used it, the tune fails or is a dry run; ``static_cache=False`` leaves it.
    ``pad`` declares how the model's inputs are padded: ``{"input_ids": 0, "attention_mask": 0}``
    (input name -> the value padded positions take). The artifact keeps it, so ``aitune serve`` joins
    requests of different lengths into one call, padded, and cuts each answer back. An input declared
    with pad value 0 that the dataset passes as a 0/1 mask with padding is also recorded unpadded (each
    such item is run once more with that mask all ones): models that drop an all-ones mask (transformers
    passes ``None`` on) call their wrapped modules another way then, and that graph is tuned too, so an
    unpadded call runs tuned; calls it makes that the dataset's own calls already cover are not recorded.
    ``manager``: the plugin manager whose backends, executors and hooks the tune uses (default: the
    process's, :func:`aitune.plugins.get_manager`).
    """
    check_switches()
    manager = get_manager() if manager is None else manager
    options = TuneOptions.from_arguments(  # refuses a bad argument before anything below changes
        batch_sizes=batch_sizes,
        device=device,
        max_samples=max_samples,
        fail_fast=fail_fast,
        report_path=report_path,
        tolerances=tolerances,
        show_progress=show_progress,
        ignore_failing_modules=ignore_failing_modules,
        dry_run=dry_run,
        max_num_batches_per_batch_size=max_num_batches_per_batch_size,
        set_eval=set_eval,
        executor=executor,
        rank_decision=rank_decision,
        freeze=freeze,
        threads=threads,
        metric=metric,
        accuracy_budget=accuracy_budget,
        end_to_end=end_to_end,
        time_budget=time_budget,
        static_cache=static_cache,
        pad=pad,
        executors=manager.executors,
    )
    if options.threads is not None:
        torch.set_num_threads(options.threads)
        logger.info("thread budget: %d (torch.set_num_threads) for eager and every candidate", options.threads)
    _inference_mode(wrapped_modules(model_or_callable), options.set_eval)
    kept = _kept_as_they_are(model_or_callable) if options.dry_run else contextlib.nullcontext()
    progress = TuneProgress(options.show_progress, options.time_budget)
    switch = StaticCacheSwitch.apply(model_or_callable) if options.static_cache else StaticCacheSwitch([])
    try:
        with progress, kept, build_queue(manager.executors, manager.registry, options.executor) as builds:
            report = _tune(
                model_or_callable=model_or_callable,
                dataset=dataset,
                options=options,
                session=manager.session(builds),
                progress=progress,
                switch=switch,
            )
    except BaseException:
        switch.restore()
        raise
    if options.dry_run:
        switch.restore()
    return report


@contextlib.contextmanager
def _kept_as_they_are(obj: Any) -> Iterator[None]:
    """A dry run records through every wrapper; afterwards each one routes calls as before."""
    before = [(m, m.state, list(m.tuned_graphs), m.report) for m in wrapped_modules(obj)]
    try:
        yield
    finally:
        for module, state, graphs, report in before:
            if state != "recording":
                install(module, graphs, report)


def _used_a_static_cache(recorded: recording.Recording[Any]) -> bool:
    """A recorded call updated a KV cache in place: ``generate()`` ran on a static cache."""
    graphs = (g for rec in recorded.modules.values() for g in rec.graphs.values())
    return any(g.mutated and g.samples and recording.holds_state(g.samples[0]) for g in graphs)


def _inference_mode(modules: Sequence[Module], set_eval: bool) -> None:
    """Refuse (or switch to eval) wrapped modules whose outputs depend on training mode."""
    from ..module_code import reads_training

    training = [m for m in modules if any(s.training for s in m.module.modules()) and reads_training(m.module)]
    if not training:
        return
    names = ", ".join(m.name for m in training)
    if not set_eval:
        raise InputError(
            f"{names}: in training mode, and its code reads self.training (Dropout, BatchNorm, ...): recording, "
            "validation and profiling would see training-mode outputs and update running statistics. Tuning is "
            "for inference: call model.eval() before ait.tune, or pass set_eval=True"
        )
    for module in training:
        module.eval()
    logger.warning("ait.tune switched %s to eval mode (set_eval=True): tuned modules serve inference", names)


def _tune(
    *,
    model_or_callable: Any,
    dataset: Iterable[Any],
    options: TuneOptions,
    session: Session,
    progress: TuneProgress,
    switch: StaticCacheSwitch,
) -> TuneReport:
    """Record, plan, tune every module and report: ``ait.tune`` once its options are checked."""
    started = time.perf_counter()
    group = distributed.coordinator()  # None in a single process
    with distributed.step(group, "recording") as outbox:
        recorded = _record(model_or_callable, dataset, options.max_samples, progress, options.pad or {})
        changes = switch.settle(_used_a_static_cache(recorded) and not options.dry_run)
        modules = [rec.module for rec in recorded.modules.values()]
        tune_device = options.device if options.device is not None else _device_of(modules)
        run = TuneRun(
            session=session,
            device=tune_device,
            defaults=default_backends(session.registry, tune_device, quantized=options.accuracy.budget is not None),
            options=options,
            shared=ranks.SlowestRank(group) if group is not None and options.rank_decision == "slowest" else None,
            progress=progress,
        )
        plans = list(plan.modules(run, recorded.modules.values()))
        if group is not None:
            outbox["plan"] = ranks.plan(plans, run)
    if group is not None:
        ranks.agree(group)
    report = TuneReport(
        aitune_version=__version__,
        device=str(tune_device),
        started_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        environment=environment(tune_device),
        changes=changes,
    )
    report_path = distributed.per_rank_path(options.report_path) if options.report_path is not None else None
    session.hook.aitune_tune_started(report=report, report_path=report_path, session=session)
    env = report.environment
    logger.info(
        "timing with %s intra-op and %s inter-op threads, OMP_WAIT_POLICY %s",
        env["threads"],
        env["interop_threads"],
        env["omp_wait_policy"],
    )

    def tune_all() -> None:
        if not options.dry_run:
            fanout.submit_ahead(plans, run)
        for module_plan in plans:
            module_report = tune_and_install(run, module_plan)
            report.modules.append(module_report)
            logger.info("%s", module_report.summary)

    try:
        if group is None:
            tune_all()
        else:
            ranks.tune_together(group, tune_all=tune_all, plans=plans, report=report, run=run)
    except BaseException as exc:
        report.duration_s = time.perf_counter() - started
        _time_spent(report, progress)
        session.hook.aitune_tune_failed(report=report, error=exc, session=session)
        raise
    if options.end_to_end_s and not options.dry_run and group is None:
        if session.builds is not None:  # a build submitted ahead that no strategy took: not next to the timing
            session.builds.wait_idle()
        with progress.step("end to end: eager against tuned", "end to end"):
            _end_to_end(model_or_callable, recorded, report, options.end_to_end_s, switch)
    if options.freeze and not options.dry_run:  # after the end-to-end check: winners it took back freeze nothing
        freeze_tuned(model_or_callable, report)
    if options.pad is not None and not options.dry_run:
        for module in wrapped_modules(model_or_callable):
            object.__setattr__(module, "pad", dict(options.pad))
    report.environment["load_average_end"] = load_average()
    report.duration_s = time.perf_counter() - started
    _time_spent(report, progress)
    session.hook.aitune_tune_finished(report=report, session=session)
    if report_path is not None:
        report.save(report_path)
    return report


def _time_spent(report: TuneReport, progress: TuneProgress) -> None:
    """Where the time went: seconds per stage, ``other`` for the rest of the run, and the per-candidate
    stages by candidate; the duration is read from the same clock, so the stages add up to it."""
    spent = {stage: round(seconds, 3) for stage, seconds in progress.spent.items()}
    total = progress.elapsed()
    report.duration_s = total
    spent["other"] = round(max(total - sum(progress.spent.values()), 0.0), 3)
    report.time_spent = spent
    report.time_by_candidate = {
        who: {stage: round(seconds, 3) for stage, seconds in stages.items()}
        for who, stages in progress.by_candidate.items()
    }
    report.time_budget = progress.time_budget
    if progress.time_budget is not None:
        skipped = [c for m in report.modules for g in m.graphs for c in g.candidates if c.status == "skipped"]
        if skipped:
            logger.warning(
                "time budget of %g s spent: %d candidate(s) not built (%s); raise ait.tune(time_budget=...) to try them",
                progress.time_budget,
                len(skipped),
                ", ".join(dict.fromkeys(c.backend for c in skipped)),
            )


def _record(
    model_or_callable: Any,
    dataset: Iterable[Any],
    max_samples: int,
    progress: TuneProgress,
    pad: Mapping[str, float] | None = None,
) -> recording.Recording[Module]:
    """Run the dataset through the model, recording every ait.Module it calls; with ``pad``, each item
    with a padded mask is run once more unpadded (:func:`unpadded`), recording only the graphs it adds."""
    known = wrapped_modules(model_or_callable)
    if isinstance(model_or_callable, torch.nn.Module) and not known:
        raise InputError(
            "the model contains no ait.Module: wrap the modules to tune, e.g. "
            "model = ait.Module(model, 'model') or ait.wrap(model, ['encoder'])"
        )
    for module in known:
        check_devices(module)
        reset(module)
    samples_seen = 0
    first: Any = None
    with progress.step("recording calls", "recording"), torch.no_grad(), recording.recording(max_samples) as recorded:
        for sample in dataset:
            first = sample if samples_seen == 0 else first
            if samples_seen < END_TO_END_ITEMS:
                recorded.items.append(sample)
            try:
                call_with_item(model_or_callable, sample)
            except AituneError:
                raise
            except Exception as exc:
                raise _item_error(samples_seen, sample, first, exc) from exc
            samples_seen += 1
            variant = unpadded(model_or_callable, sample, pad or {})
            if variant is not None:
                with recorded.made_up():
                    try:
                        call_with_item(model_or_callable, variant)
                    except AituneError:
                        raise
                    except Exception as exc:  # the model refuses a mask without padding: nothing to tune
                        logger.info(
                            "item %d with its mask all ones (unpadded) failed, not recorded: %s", samples_seen, exc
                        )
    if samples_seen == 0:
        raise InputError("the dataset is empty: give ait.tune at least one input batch")
    if not recorded.modules:
        raise InputError(
            "no ait.Module was called while running the dataset through the model: wrap the modules "
            "that the pipeline calls, or check that the dataset reaches them"
        )
    return recorded


def unpadded(fn: Any, item: Any, pad: Mapping[str, float]) -> Any:
    """``item`` with every input that ``pad`` declares padded with 0 and that holds a 0/1 mask with padding
    (integers or bools, both values present) set to all ones: the same call with nothing padded. None when
    the item has no such input (or its inputs cannot be named by ``fn``'s parameters)."""
    if not pad:
        return None
    masks = {name for name, value in pad.items() if value == 0}
    args, kwargs = _as_call(item)
    try:
        forward = fn.module.forward if isinstance(fn, Module) else fn.forward if isinstance(fn, torch.nn.Module) else fn
        bound = inspect.signature(forward).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    changed = False
    arguments = dict(bound.arguments)
    for name in masks & set(arguments):
        value = arguments[name]
        if isinstance(value, torch.Tensor) and _padded_mask(value):
            arguments[name] = torch.ones_like(value)
            changed = True
    if not changed:
        return None
    bound.arguments.update(arguments)
    return (tuple(bound.args), dict(bound.kwargs))


def _as_call(item: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A dataset item as the positional and keyword arguments :func:`call_with_item` passes."""
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], (tuple, list)) and isinstance(item[1], dict):
        return tuple(item[0]), dict(item[1])
    if isinstance(item, (tuple, list)):
        return tuple(item), {}
    if isinstance(item, dict):
        return (), dict(item)
    return (item,), {}


def _padded_mask(tensor: torch.Tensor) -> bool:
    """An integer or bool tensor of 0s and 1s, both present: a mask that pads some positions."""
    if tensor.is_floating_point() or tensor.is_complex() or tensor.numel() == 0:
        return False
    values = torch.unique(tensor.detach().to(torch.int64))
    return values.numel() == 2 and int(values[0]) == 0 and int(values[1]) == 1


END_TO_END_ITEMS = 8
"""Dataset items kept for the end-to-end figure (the first ones)."""


def _end_to_end(
    model_or_callable: Any, recorded: Any, report: TuneReport, budget_s: float, switch: StaticCacheSwitch
) -> None:
    """Time the whole call eager against tuned and log it first, with each module's share and figure;
    winners that make the whole slower than eager beyond the interval are taken back."""
    modules = [rec.module for rec in recorded.modules.values()]
    if not any(m.state == "tuned" for m in modules):
        return
    result = end_to_end.measure(
        lambda item: call_with_item(model_or_callable, item),
        recorded.items,
        modules,
        budget_s,
        users=_users_setup(switch),
    )
    report.end_to_end = result
    figures = {m.name: m for m in report.modules}
    shares = []
    for name, share in sorted(result.shares.items(), key=lambda kv: -kv[1]):
        chosen = (
            [c for g in figures[name].graphs for c in g.candidates if c.status == "selected"] if name in figures else []
        )
        own = f", {chosen[0].speedup_text()}" if len(chosen) == 1 and chosen[0].speedup is not None else ""
        shares.append(f"{name} {share:.0%} of eager time{own}")
    if slower_beyond_interval(result.speedup, result.speedup_high):
        _not_kept(modules, report, result, switch)
    logger.info("end to end %s%s", result.describe(), "; " + "; ".join(shares) if shares else "")


def _users_setup(switch: StaticCacheSwitch) -> end_to_end.UsersSetup | None:
    """Eager as the user set it up, where ``ait.tune`` switched ``generate()`` to a static cache: the
    baseline the end-to-end figure is against (the user would generate with the default cache)."""
    if not switch.models:
        return None
    models = list(switch.models)

    @contextlib.contextmanager
    def undone() -> Iterator[None]:
        before = [(m, m.generation_config.cache_implementation) for m in models]
        for model in models:
            model.generation_config.cache_implementation = None
        try:
            yield
        finally:
            for model, value in before:
                model.generation_config.cache_implementation = value

    return end_to_end.UsersSetup(undone, "eager with the default cache", "eager with the static cache")


def _not_kept(modules: Sequence[Module], report: TuneReport, result: EndToEndReport, switch: StaticCacheSwitch) -> None:
    """Take back every installed winner (the modules run eager) and the static-cache switch, because
    the tuned whole was slower than eager beyond its interval: warn with both figures, say so in the report."""
    tuned = [m for m in modules if m.state == "tuned"]
    ungated = [m.name for m in tuned if not _gated(m)]
    if ungated:  # the user turned the eager gate off: the winners serve, whatever they time
        logger.warning(
            "end to end the tuned model is slower than %s (%s); %s kept because performance validation is off",
            result.baseline,
            result.describe(),
            ", ".join(ungated),
        )
        tuned = [m for m in tuned if m.name not in ungated]
        if not tuned:
            return
    entries = {m.name: m for m in report.modules}
    own = []
    for module in tuned:
        entry = entries.get(module.name)
        chosen = [c for g in entry.graphs for c in g.candidates if c.status == "selected"] if entry else []
        figures = ", ".join(f"{c.backend} {c.speedup_text()}" for c in chosen if c.speedup is not None)
        own.append(f"{figures} for {module.name}" if figures else f"none for {module.name}")
    figure = format_speedup(result.speedup or 0.0, result.speedup_low, result.speedup_high, result.measured)
    whole = (
        f"end to end the tuned model was slower than {result.baseline}, {figure} ({result.baseline} "
        f"{result.eager_ms:.3g} ms, tuned {result.tuned_ms:.3g} ms per pass)"
    )
    names = ", ".join(m.name for m in tuned)
    runs = "runs" if len(tuned) == 1 else "run"
    why = f"while the modules' own figures were {', '.join(own)}; {names} {runs} eager"
    for module in tuned:
        _install_eager(module, entries.get(module.name), f"not kept: {whole}")
    if switch.models and not any(m.state == "tuned" for m in modules):
        models = [type(m).__name__ for m in switch.models]
        switch.restore()
        report.changes = [c for c in report.changes if not any(c.startswith(f"{n}.generation_config") for n in models)]
        why += "; generate() is back on its default cache"
    result.not_kept = f"slower than {result.baseline} beyond its interval, {why}"
    warnings.warn(f"{names}: winners not kept: {whole}, {why}", RuntimeWarning, stacklevel=4)


def _gated(module: Module) -> bool:
    """Every strategy of ``module`` gates on eager (``performance_validation`` on)."""
    chosen: list[Any] = [module.strategy] if module.strategy is not None else []
    if module.strategies is not None:
        values = module.strategies.values() if isinstance(module.strategies, Mapping) else module.strategies
        chosen += [s for s in values if s is not None]
    return all(getattr(s, "gated", True) for s in chosen or [strategy_for(module, 0, "")])


def _install_eager(module: Module, entry: ModuleReport | None, reason: str) -> None:
    """Route every graph of ``module`` to eager, and its report to say why."""
    from ..backend import BuildContext
    from ..builtin.eager import TorchEagerBackend
    from ..cachedir import cache_dir
    from ..report import CandidateStatus

    routes = list(module.tuned_graphs)
    eager = TorchEagerBackend()
    if routes:
        device = weights_device(module.module) or torch.device("cpu")
        workdir = Path(tempfile.gettempdir())
        eager.build(module.module, BuildContext(routes[0].graph, [], device, workdir, cache_dir(), module.name))
    install(module, [Winner(route.graph, eager) for route in routes], entry)
    if entry is None:
        return
    for graph in entry.graphs:
        chosen = [c for c in graph.candidates if c.status == CandidateStatus.SELECTED]
        for candidate in chosen:
            candidate.status = CandidateStatus.REJECTED
            candidate.reason = reason
        for route in graph.routes:
            route.backend, route.variant = TorchEagerBackend.name, None
        if chosen or graph.routes:
            graph.decision = TorchEagerBackend.name
            graph.reason = reason
    entry.status = ModuleStatus.EAGER
    entry.summary = summarize(entry)


def check_devices(module: Module) -> None:
    """Refuse a module whose weights are split across devices or not materialized (meta)."""
    devices = {str(t.device) for t in (*module.module.parameters(), *module.module.buffers())}
    if "meta" in devices:
        raise InputError(
            f"{module.name}: some weights are on the meta device (not loaded yet): load the weights "
            "(e.g. load_state_dict(..., assign=True) or .to_empty(device=...) then load) before ait.tune"
        )
    if len(devices) > 1:
        raise InputError(
            f"{module.name}: its weights are split across devices ({', '.join(sorted(devices))}); aitune tunes "
            "a module on one device: move it with .to(device), or wrap the part on each device as its own ait.Module"
        )


def _item_error(index: int, item: Any, first: Any, exc: Exception) -> Exception:
    """The model failed on dataset item ``index``: say which, and whether it looks unlike item 0."""
    from .. import tree

    hint = ""
    if index > 0:
        try:
            differs = tree.flatten(item)[1] != tree.flatten(first)[1]
        except AituneError:
            differs = True
        if differs:
            hint = " It has another structure than item 0; give every item the structure the model takes."
    return InputError(
        f"the model raised on dataset item {index} ({type(exc).__name__}: {exc}).{hint} "
        "Check that each item is what the model's forward takes: a tensor, a tuple of arguments, "
        "a dict of keyword arguments, or (args, kwargs)"
    )


ENVIRONMENT_ERRORS: tuple[type[Exception], ...] = (ConfigError, PluginError)
"""Errors about the environment (the cache folder, a plugin, the configuration), not about one module:
``ait.tune`` raises them rather than leaving the module eager, as every module would fail alike."""


def tune_and_install(run: TuneRun, module_plan: ModulePlan) -> ModuleReport:
    """Tune one planned module (:func:`tune_recorded`) and install its winners; a failed one runs eager."""
    report = module_report(module_plan.module)
    winners: list[Winner] | None = None
    try:
        winners = tune_recorded(run, module_plan, report)
    finally:  # a failure that propagates leaves the module eager too
        if winners is not None or report.status == ModuleStatus.FAILED:
            install(module_plan.module, winners or [], report)
    return report


def module_report(module: Module) -> ModuleReport:
    """The report :func:`tune_recorded` fills for ``module``."""
    return ModuleReport(name=module.name, strategy=strategy_for(module, 0, "").identity())


def tune_recorded(run: TuneRun, module_plan: ModulePlan, report: ModuleReport) -> list[Winner] | None:
    """Tune one planned module graph by graph into ``report``; the winners to install (also the JIT's entry point).

    Installs nothing: the caller installs what it returns, ``[]`` (eager) when tuning failed and
    None for a dry run, which stops once the graphs are known. A failure warns with a
    ``RuntimeWarning`` naming the error; with ``fail_fast``, for a ``strict`` module and for an
    error about the environment (:data:`ENVIRONMENT_ERRORS`) it is raised, ``report`` saying FAILED.
    """
    fail_fast, dry_run = run.options.fail_fast, run.options.dry_run
    module = module_plan.module
    winners: list[Winner] = []
    try:
        for graph_plan in module_plan.graphs:
            recorded = graph_plan.recorded
            if recorded.error:
                raise InputError(f"{module.name}: a recorded call cannot be tuned: {recorded.error}")
            if recorded.eager_reason:  # calls like these run eager; the other graphs still tune
                reason = f"runs eager: {recorded.eager_reason}"
                digest = hashlib.sha256(recorded.eager_reason.encode()).hexdigest()[:12]
                report.graphs.append(
                    GraphReport(graph_key=f"eager-{digest}", graph={}, decision="torch_eager", reason=reason)
                )
                continue
            graph = graph_plan.graph
            strategy = graph_plan.strategy
            graph_report = GraphReport(graph_key=graph.key, graph=_graph_json(graph))
            report.graphs.append(graph_report)
            if dry_run:
                continue
            tuning = graph_plan.tuning(graph_report)
            try:
                decision = strategy.tune(tuning, run.defaults)
            except Exception:
                if strategy.raises_on_failure:
                    fail_fast = True
                raise
            winners.extend(winners_of(graph, decision, tuning.eager.backend))
    except Exception as exc:
        report.status, report.error = ModuleStatus.FAILED, f"{type(exc).__name__}: {exc}"
        report.summary = f"{module.name}: tuning failed, running eager: {report.error}"
        # ranks out of step end the tune on every rank; the environment is no module's failure
        if fail_fast or module.strict or isinstance(exc, (DistributedTuneError, *ENVIRONMENT_ERRORS)):
            raise
        if not isinstance(exc, AituneError):
            logger.exception("%s: unexpected error while tuning", module.name)
        warnings.warn(
            f"{module.name}: tuning failed, so it runs eager (no speed-up): {report.error}. Fix what the error names "
            "and tune again; ait.tune(..., fail_fast=True) raises it with its traceback",
            RuntimeWarning,
            stacklevel=3,
        )
        return []
    if dry_run:
        report.status = ModuleStatus.DRY_RUN
        report.summary = f"{module.name}: dry run, {len(report.graphs)} graph(s), nothing built"
        return None
    report.status = ModuleStatus.EAGER if eager_only(winners) else ModuleStatus.TUNED
    report.summary = summarize(report)
    return winners


def summarize(report: ModuleReport) -> str:
    """One line a person can read, e.g. ``encoder: onnxruntime, 1.72x [1.65-1.80] eager at batch 8 (p50 1.04 ms vs 1.79 ms), max rel err 2e-07``;
    a graph with no batch axis names the axis whose size it was measured at (``at pixel_values axis 0 = 16``,
    :func:`aitune.graph.measured_at`)."""
    parts = []
    for g in report.graphs:
        if g.routes:
            parts.append(", ".join(f"{r.label} for batch {r.batch_min}..{r.batch_max}" for r in g.routes))
            continue
        chosen = next((c for c in g.candidates if c.status == "selected"), None)
        if chosen is None:
            parts.append(f"eager ({g.reason})" if g.reason else "eager")
            continue
        text = f"{chosen.backend} ({chosen.variant})" if chosen.variant else chosen.backend
        batch = g.selected_batch_size
        mine = next((p for p in chosen.profiles if p.batch_size == batch), None) if batch else None
        eager = next((p for p in g.eager_profiles if p.batch_size == batch), None) if batch else None
        if chosen.speedup is not None and mine is not None and eager is not None:
            base = mine.baseline_p50_ms if mine.baseline_p50_ms is not None else eager.p50_ms
            figure = chosen.speedup_text()
            against = "eager" if chosen.measured is not False else "against eager"
            at = measured_at(g.graph, mine.batch_size)
            text += f", {figure} {against} at {at} (p50 {mine.p50_ms:.3g} ms vs {base:.3g} ms)"
        if chosen.validation is not None:
            text += f", max rel err {chosen.validation.max_rel_error:.1g}"
        if chosen.metric is not None:
            text += f", metric {chosen.metric:.4g}"
        parts.append(text)
    if len(parts) == 1:
        return f"{report.name}: {parts[0]}"
    return f"{report.name}: " + " | ".join(f"graph {i}: {p}" for i, p in enumerate(parts))


def _graph_json(graph: Any) -> dict[str, Any]:
    from ..converter import unstructure

    return unstructure(graph)
