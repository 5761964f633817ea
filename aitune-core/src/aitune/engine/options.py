"""What a user asked of one tune: ``ait.tune``'s arguments as one frozen, validated value.

:class:`TuneOptions` is built once, at the top of ``ait.tune`` (:meth:`TuneOptions.from_arguments`
fills what was left None from ``ait.config`` and the environment, and refuses bad values with the
error naming the argument, the executor included, before ``ait.tune`` changes anything), and is
carried on the run from then on, so no step re-checks or re-passes a setting.
The JIT builds its run from one too. :class:`AccuracyRule` is the user's accuracy measure and how
far it may fall (``metric`` and ``accuracy_budget``), given to ``ait.tune`` or ``ait.Module``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from .. import distributed
from ..backend import Tolerance
from ..errors import ConfigError, InputError
from ..executor import chosen
from .settings import settings

if TYPE_CHECKING:
    from ..executor import ExecutorRegistry

Metric = Callable[[Any, Any, Any], float]
"""``fn(tuned_outputs, eager_outputs, batch) -> float``, 1.0 when the candidate answered as eager did."""

BATCH_ONE_SIZES = (1, 2)
"""What ``batch_sizes=None`` means for data of batch-1 items, as in AITune."""

END_TO_END_S = 10.0
"""The end-to-end figure's time budget with ``end_to_end=True``."""


def check_budget(budget: float | None) -> float | None:
    """``budget`` checked: a number in [0, 1] (the metric may fall that far below 1.0), or None."""
    if budget is not None and (
        isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 <= budget <= 1
    ):
        raise ValueError(
            f"accuracy_budget must be a number in [0, 1] (how far the metric may fall below 1), got {budget!r}"
        )
    return None if budget is None else float(budget)


@attrs.frozen
class AccuracyRule:
    """The user's accuracy measure and how far it may fall below 1.0: one candidate passes when the
    metric's mean over the recorded calls is at least :attr:`floor`. No metric: the numeric bound decides."""

    metric: Metric | None = None
    budget: float | None = attrs.field(default=None, converter=check_budget)

    @property
    def floor(self) -> float:
        """The lowest mean metric a candidate may have: ``1 - budget``."""
        return 1.0 - (self.budget or 0.0)

    def over(self, default: AccuracyRule) -> AccuracyRule:
        """This rule (a module's) where it says something, ``default`` (the tune's) for the rest."""
        return AccuracyRule(self.metric or default.metric, self.budget if self.budget is not None else default.budget)


def _int_at_least_one(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InputError(f"{attribute.name} must be an int >= 1, got {value!r}")


def _seconds(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
        raise InputError(f"time_budget must be a number of seconds > 0, got {value!r}")


def _metric_for_budget(instance: Any, attribute: attrs.Attribute[Any], value: AccuracyRule) -> None:
    if value.budget is not None and value.metric is None:
        raise InputError(
            "accuracy_budget needs a metric to spend it on: pass metric=aitune.metrics.top1_agreement (or "
            "cosine_similarity, relative_accuracy, or a function of your own)"
        )


def _rank_decision(instance: Any, attribute: attrs.Attribute[Any], value: str) -> None:
    if value not in distributed.RANK_DECISIONS:
        raise ConfigError(f"rank_decision must be one of {', '.join(distributed.RANK_DECISIONS)}, got {value!r}")


def _as_tuple(values: Sequence[int] | None) -> tuple[int, ...] | None:
    return tuple(values) if values is not None else None


def _as_device(value: str | torch.device | None) -> torch.device | None:
    return torch.device(value) if value is not None else None


MAX_PAD_INPUTS = 64
"""The most inputs one padding declaration may name (a file's is bounded before use)."""
MAX_PAD_VALUE = 2**53
"""Pad values are kept as floats (JSON numbers): integers up to this size are exact."""


def check_pad(pad: Mapping[str, Any] | None, what: str = "pad") -> dict[str, float]:
    """A padding declaration checked: ``{input name: the value its padded positions take}``, each name
    a non-empty string, each value a finite number (a bool is 0 or 1) that a float holds exactly.

    ``ait.tune(pad=...)`` stores it in the artifact, ``aitune serve --pad`` adds to it, and the
    server pads requests of different lengths with it (:mod:`aitune.torch.serving`). Values are kept
    as floats: an integer input takes them back as integers."""
    if pad is None:
        return {}
    if not isinstance(pad, Mapping):
        raise InputError(f"{what} must map input names to pad values, e.g. {{'input_ids': 0, 'attention_mask': 0}}")
    if len(pad) > MAX_PAD_INPUTS:
        raise InputError(f"{what} names {len(pad)} inputs; at most {MAX_PAD_INPUTS}")
    out: dict[str, float] = {}
    for name, value in pad.items():
        if not isinstance(name, str) or not name or len(name) > 256:
            raise InputError(f"{what}: {name!r} is not an input name (a non-empty string of at most 256 characters)")
        if not isinstance(value, (bool, int, float)) or not abs(value) <= MAX_PAD_VALUE:
            raise InputError(
                f"{what}[{name!r}] is {value!r}: give the number its padded positions take (0 for token ids "
                f"padded with id 0 and for an attention mask), finite and at most {MAX_PAD_VALUE} in size"
            )
        out[name] = float(value)
    return out


@attrs.frozen(kw_only=True)
class TuneOptions:
    """``ait.tune``'s arguments, validated (see its docstring for what each means). The defaults are
    the plain ones (the JIT's); ``ait.tune`` fills what the user left None from ``ait.config``."""

    batch_sizes: tuple[int, ...] | None = attrs.field(default=None, converter=_as_tuple)
    batch_one_sizes: tuple[int, ...] | None = attrs.field(default=BATCH_ONE_SIZES, converter=_as_tuple)
    """What ``batch_sizes=None`` means for a graph whose recorded calls all have batch 1 (the JIT: None,
    the recorded sizes)."""
    device: torch.device | None = attrs.field(default=None, converter=_as_device)
    """None: the device of the first wrapped module with weights."""
    max_samples: int = attrs.field(default=8, validator=_int_at_least_one)
    fail_fast: bool = False
    report_path: Path | None = attrs.field(default=None, converter=attrs.converters.optional(Path))
    tolerances: Mapping[str, Tolerance] | None = None
    show_progress: bool | None = False
    """Live progress lines; None: when stderr is a terminal."""
    dry_run: bool = False
    set_eval: bool = False
    executor: str | None = None
    """Where isolated builds run: an executor's name, which :meth:`from_arguments` checks against the
    tune's plugin manager; None (the JIT's): ``AITUNE_EXECUTOR``, else local, when builds start."""
    rank_decision: str = attrs.field(default="rank0", validator=_rank_decision)
    freeze: bool = False
    threads: int | None = attrs.field(default=None, validator=attrs.validators.optional(_int_at_least_one))
    accuracy: AccuracyRule = attrs.field(factory=AccuracyRule, validator=_metric_for_budget)
    end_to_end_s: float = 0.0
    """The end-to-end figure's time budget; 0 measures nothing."""
    time_budget: float | None = attrs.field(default=None, validator=_seconds)
    static_cache: bool = True
    pad: dict[str, float] | None = attrs.field(
        default=None, converter=attrs.converters.optional(lambda v: check_pad(v, "ait.tune(pad=...)"))
    )
    """How the model's inputs are padded (see :func:`check_pad`); None: not declared."""

    @classmethod
    def from_arguments(
        cls,
        *,
        batch_sizes: Sequence[int] | None = None,
        device: str | torch.device | None = None,
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
        metric: Metric | None = None,
        accuracy_budget: float | None = None,
        end_to_end: bool | float = True,
        time_budget: float | None = None,
        static_cache: bool = True,
        pad: Mapping[str, float] | None = None,
        executors: ExecutorRegistry | None = None,
    ) -> TuneOptions:
        """The options of ``ait.tune``, its keyword arguments by the same names (typed, so a name
        ``ait.tune`` forwards wrongly is a type error, not a value lost): None taken from ``ait.config``
        (the executor and the rank decision from their environment variables), AITune's spellings
        mapped to aitune's, every value checked once. ``executors``, the tune's plugin manager's, is
        what the executor's name is checked against: an unknown one, or one that cannot run here, is
        refused now."""
        if max_num_batches_per_batch_size is not None:
            raise InputError(
                "ait.tune(max_num_batches_per_batch_size=...) is not supported: aitune forms each batch size "
                "from the recorded dataset items; bound how many are recorded with max_samples=N instead"
            )
        if ignore_failing_modules is not None:
            if fail_fast is not None and fail_fast == ignore_failing_modules:
                raise InputError(
                    f"ait.tune(fail_fast={fail_fast}, ignore_failing_modules={ignore_failing_modules}) contradict "
                    "each other: give only one of them"
                )
            fail_fast = not ignore_failing_modules
        return cls(
            batch_sizes=batch_sizes,
            device=device,
            max_samples=settings.max_samples if max_samples is None else max_samples,
            fail_fast=settings.fail_fast if fail_fast is None else fail_fast,
            report_path=report_path,
            tolerances=tolerances,
            show_progress=settings.show_progress if show_progress is None else show_progress,
            dry_run=dry_run,
            set_eval=set_eval,
            executor=_checked_executor(chosen(executor), executors),
            rank_decision=distributed.rank_decision(rank_decision),
            freeze=settings.freeze if freeze is None else freeze,
            threads=threads,
            accuracy=AccuracyRule(metric, accuracy_budget),
            end_to_end_s=_end_to_end_budget(end_to_end),
            time_budget=time_budget,
            static_cache=static_cache,
            pad=pad,
        )


def _checked_executor(name: str, executors: ExecutorRegistry | None) -> str:
    """``name`` when ``executors`` holds it and it can run here; else a ConfigError saying what exists."""
    if executors is not None:
        reason = executors.reason(name)  # an unknown name raises, listing the installed ones
        if reason:
            raise ConfigError(f"the {name} executor cannot run here: {reason}")
    return name


def _end_to_end_budget(value: bool | float) -> float:
    if value is True:
        return END_TO_END_S
    if value is False:
        return 0.0
    if isinstance(value, (int, float)) and value >= 0:
        return float(value)
    raise InputError(f"end_to_end must be True, False or a time budget in seconds >= 0, got {value!r}")
