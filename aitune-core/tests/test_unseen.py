"""What validation never saw: sizes no call had, hooks and weight edits after tuning, padded positions.

Each test is a way a tuned module used to answer differently from eager without a word; now it
gives eager's answer, runs eager with a warning, or says what it compared.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from aitune_testkit import unseen
from aitune_testkit.doubles import SlowModule

import aitune.torch as ait
from aitune.errors import HooksChangedError
from aitune.graph import DimRange, GraphSpec, Sample, infer_graph
from aitune.testing import assert_matches_eager
from aitune.testing.backends import ToyBackend, ToyConfig
from aitune.torch.task.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig
from aitune.validation import MAX_INTERIOR, interior_sizes

QUICK = ProfilingConfig(
    measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=5, warmup=1, window=5), extend_s=0.0
)


@pytest.fixture
def unseen_backends(toy_backends, register_plugin):
    return register_plugin(unseen, name="aitune_testkit.unseen", distribution="aitune-testkit")


def _strategy(*backends):
    return ait.FirstWinsStrategy(list(backends), performance_validation=False)


class Sequence(torch.nn.Module):
    """``[batch, length, 8]`` in and out."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.fc(x))


# -- sizes inside a range that no recorded call had --------------------------------------------------


def _graph(lengths, batch=2):
    samples = [Sample((torch.randn(batch, n, 8),)) for n in lengths]
    return infer_graph(samples, ["x"], outputs=[s.args[0] for s in samples]), samples


def test_every_size_of_a_narrow_range_is_checked():
    graph, samples = _graph([4, 8])
    [name] = [n for n, r in graph.dims.items() if r.min == 4]
    assert interior_sizes(graph, samples)[name] == [5, 6, 7]


def test_a_wide_range_is_checked_at_a_bounded_spread():
    graph, samples = _graph([4, 8])
    [name] = [n for n, r in graph.dims.items() if r.min == 4]
    wide = GraphSpec(graph.arg_names, graph.structure, graph.inputs, {name: DimRange(1, 64, 1000)})
    values = interior_sizes(wide, samples)[name]
    assert len(values) == MAX_INTERIOR and all(1 < v < 1000 for v in values)
    assert values == sorted(set(values)) and values[0] < 100 and values[-1] > 900, "spread over the range"


def test_a_backend_wrong_at_an_unrecorded_size_is_rejected(unseen_backends):
    model = ait.Module(Sequence().eval(), "seq", strategy=_strategy(unseen.WrongAtSixBackend(), ToyBackend()))
    report = ait.tune(model, [torch.randn(2, 4, 8), torch.randn(2, 8, 8)])
    wrong, right = report.modules[0].graphs[0].candidates
    assert wrong.status == "failed" and "=6" in (wrong.reason or ""), wrong.reason
    assert any("unrecorded" in check for check in right.validation.checks), right.validation.checks
    assert right.status == "selected"
    x = torch.randn(2, 6, 8)
    with torch.no_grad():
        assert_matches_eager(model(x), model.module(x))


def test_a_size_the_model_itself_refuses_is_skipped_not_failed(toy_backends):
    class EvenOnly(Sequence):
        def forward(self, x):
            if x.shape[1] % 2:
                raise ValueError("even lengths only")
            return super().forward(x)

    model = ait.Module(EvenOnly().eval(), "even", strategy=_strategy(ToyBackend()))
    report = ait.tune(model, [torch.randn(2, 4, 8), torch.randn(2, 8, 8)])
    candidate = report.modules[0].graphs[0].candidates[0]
    assert candidate.status == "selected", candidate.reason
    assert any("skipped, eager raises ValueError" in c for c in candidate.validation.checks)


# -- hooks added after tuning ---------------------------------------------------------------------------


def _tuned_slow(strict=False):
    model = ait.Module(SlowModule(delay_s=0.0), "m", strategy=_strategy(ToyBackend(ToyConfig())), strict=strict)
    ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8)])
    assert model.state == "tuned"
    return model


def test_a_hook_on_the_wrapper_runs_around_the_tuned_call(toy_backends):
    model = _tuned_slow()
    seen = []
    model.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    backend = model.tuned_graphs[0][1]
    calls = backend.calls
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no eager fallback, no warning
        model(torch.randn(3, 8))
    assert seen == [torch.Size([3, 8])] and backend.calls == calls + 1


@pytest.mark.parametrize("where", ["wrapped", "submodule"])
def test_a_hook_added_after_tuning_runs_eager_until_removed(toy_backends, where):
    model = _tuned_slow()
    target = model.module if where == "wrapped" else model.module.fc
    seen = []

    def double(module, args, out):
        seen.append(1)
        return out * 2

    backend = model.tuned_graphs[0][1]
    handle = target.register_forward_hook(double)
    x = torch.randn(3, 8)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="hooks were added"):
        y = model(x)
    with torch.no_grad():
        expected = model.module(x)  # eager, with the hook
    assert seen and torch.allclose(y, expected)
    calls = backend.calls
    handle.remove()
    with torch.no_grad():
        model(x)
    assert backend.calls == calls + 1, "the tuned backend serves again once the hook is gone"


def test_strict_mode_raises_on_a_hook_added_after_tuning(toy_backends):
    model = _tuned_slow(strict=True)
    model.module.fc.register_forward_pre_hook(lambda module, args: None)
    with torch.no_grad(), pytest.raises(HooksChangedError, match="hooks were added"):
        model(torch.randn(3, 8))


def test_a_module_with_hooks_still_pickles_and_copies(toy_backends):
    import copy
    import pickle

    model = _tuned_slow()
    handle = model.module.fc.register_forward_hook(lambda *a: None)
    handle.remove()
    clone = copy.deepcopy(model.module)
    assert type(clone.fc._forward_hooks) is type(torch.nn.Linear(1, 1)._forward_hooks)
    assert pickle.loads(pickle.dumps(model.module.fc)).weight.shape == (8, 8)


# -- weight edits through .data ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m.fc.weight.data.mul_(2),
        lambda m: setattr(m.fc.weight, "data", m.fc.weight.data * 2),
        lambda m: setattr(m.fc, "weight", torch.nn.Parameter(m.fc.weight.detach() * 2)),
        lambda m: m.fc.weight.data.copy_(m.fc.weight.data.flip(0)),  # the same values in another order
    ],
    ids=["data-in-place", "data-assigned", "new-parameter", "rows-swapped-through-data"],
)
def test_edits_through_data_are_seen_at_eval(toy_backends, edit):
    model = _tuned_slow()
    with torch.no_grad():
        edit(model.module)
    assert model.stale_reason is None, "nothing has looked yet"
    model.eval()
    assert model.stale_reason is not None and "weights changed" in model.stale_reason
    x = torch.randn(3, 8)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="weights changed"):
        y = model(x)
    with torch.no_grad():
        assert_matches_eager(y, model.module(x))


# -- weights changed without a call aitune watches ------------------------------------------------


def _optimizer_step(module):
    """One SGD step over every weight, taken in eval mode with grads set by hand."""
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    for p in module.parameters():
        p.grad = torch.full_like(p, 0.25)
    opt.step()


def _new_linear(module):
    torch.manual_seed(1)
    module.fc = torch.nn.Linear(8, 8)


@pytest.mark.parametrize(
    "change",
    [
        lambda m: setattr(m.fc, "weight", torch.nn.Parameter(m.fc.weight.detach().flip(0))),
        _new_linear,
        _optimizer_step,
    ],
    ids=["new-parameter", "new-submodule", "optimizer-step-in-eval-mode"],
)
def test_weights_changed_without_a_watched_call_run_eager_with_one_warning(toy_backends, change):
    """No eval(), no load_state_dict: torch's global hooks mark the guard, and the next call looks."""
    model = _tuned_slow()
    backend = model.tuned_graphs[0][1]
    x = torch.randn(3, 8)
    with torch.no_grad():
        before = model(x)
    change(model.module)
    calls = backend.calls
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="weights changed since it was tuned"):
        y = model(x)
    with torch.no_grad():
        expected = model.module(x)
    assert_matches_eager(y, expected)
    assert float((expected - before).abs().max()) > 0.05, "the change matters: the baked weights would be wrong"
    assert backend.calls == calls, "the toy backend baked the old weights and cannot refit"
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning, not one per call
        assert_matches_eager(model(x), model.module(x))


def _count_looks(monkeypatch):
    from aitune.engine import guard

    looks = [0]
    stamp = guard.weights_stamp

    def counted(module):
        looks[0] += 1
        return stamp(module)

    monkeypatch.setattr(guard, "weights_stamp", counted)
    return looks


def test_another_models_parameters_and_optimizer_leave_a_tuned_module_alone(toy_backends, monkeypatch):
    model = _tuned_slow()
    backend = model.tuned_graphs[0][1]
    looks = _count_looks(monkeypatch)
    other = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))  # new Parameters and buffers
    _optimizer_step(other)
    calls = backend.calls
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.randn(3, 8))
    assert looks[0] == 0 and backend.calls == calls + 1


def test_a_training_loop_never_reads_the_weights_until_a_call_would_run_tuned(toy_backends, monkeypatch):
    model = _tuned_slow()
    model.module.requires_grad_(True)
    opt = torch.optim.SGD(model.module.parameters(), lr=0.1)
    looks = _count_looks(monkeypatch)
    x = torch.randn(3, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the one "grad mode is on" warning
        for _ in range(3):
            model(x).sum().backward()  # needs grad: eager, and the weights are not read
            opt.step()
            opt.zero_grad()
    assert looks[0] == 0, "steps only mark the guard"
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="weights changed since it was tuned"):
        y = model(x)
    assert looks[0] == 1, "read once, by the first call that would have run tuned"
    with torch.no_grad():
        assert_matches_eager(y, model.module(x))


def test_the_global_hooks_are_registered_once_and_hold_guards_weakly(toy_backends):
    import gc
    import weakref

    from torch.nn.modules import module as nn_module
    from torch.optim import optimizer

    from aitune.engine import guard

    first, second = _tuned_slow(), _tuned_slow()
    registries = [
        (nn_module._global_parameter_registration_hooks, guard._registered),
        (nn_module._global_buffer_registration_hooks, guard._registered),
        (nn_module._global_module_registration_hooks, guard._registered),
        (optimizer._global_optimizer_post_hooks, guard._stepped),
    ]
    assert all(list(hooks.values()).count(hook) == 1 for hooks, hook in registries)
    watched = weakref.ref(first._dispatcher.guard)
    assert watched() in guard._WATCHED
    del first
    gc.collect()
    assert watched() is None, "the hooks keep no tuned module alive"
    assert second._dispatcher.guard in guard._WATCHED


# -- padded positions -----------------------------------------------------------------------------


def _padded(left: bool, lengths=(5, 3), width=6):
    x = torch.randn(len(lengths), width, 8)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        if left:
            mask[row, width - n :] = 1
        else:
            mask[row, :n] = 1
    return {"x": x, "attention_mask": mask}


@pytest.mark.parametrize("left", [True, False], ids=["left-padded", "right-padded"])
def test_padded_positions_are_compared_only_when_asked_not_to_be(unseen_backends, left):
    data = [_padded(left), _padded(left, (4, 4, 2), 8)]
    everything = ait.Module(unseen.MaskedEncoder().eval(), "all", strategy=_strategy(unseen.GarblesPaddingBackend()))
    report = ait.tune(everything, data)
    candidate = report.modules[0].graphs[0].candidates[0]
    assert candidate.status == "failed" and "off by" in candidate.reason, "padded positions differ from eager"

    unmasked = ait.Module(
        unseen.MaskedEncoder().eval(),
        "unmasked",
        strategy=_strategy(unseen.GarblesPaddingBackend()),
        compare="unmasked",
    )
    report = ait.tune(unmasked, data)
    candidate = report.modules[0].graphs[0].candidates[0]
    assert candidate.status == "selected", candidate.reason
    assert any("unmasked positions only" in c for c in candidate.validation.checks)
    batch = _padded(left, (6, 1), 6)
    with torch.no_grad():
        hidden, pooled = unmasked(**batch)
        want_hidden, want_pooled = unmasked.module(**batch)
    keep = batch["attention_mask"].bool()
    assert_matches_eager(hidden[keep], want_hidden[keep])
    assert_matches_eager(pooled, want_pooled)  # [batch, 8]: compared whole


def test_compare_takes_only_known_modes():
    with pytest.raises(ValueError, match="compare must be one of"):
        ait.Module(SlowModule(), "m", compare="masked")


# -- the user's metric ----------------------------------------------------------------------------


def _classifier_tuned(**kwargs):
    model = ait.Module(
        SlowModule(delay_s=0.0),
        "classifier",
        strategy=_strategy(unseen.Int8LikeBackend(ToyConfig()), ToyBackend(ToyConfig())),
    )
    report = ait.tune(model, [torch.randn(4, 8), torch.randn(8, 8)], **kwargs)
    return model, report.modules[0].graphs[0].candidates


def test_a_metric_within_budget_accepts_an_int8_like_candidate_and_a_tighter_one_rejects_it(unseen_backends):
    from aitune import metrics

    model, candidates = _classifier_tuned()
    assert candidates[0].status == "failed" and "off by" in candidates[0].reason, "outside the fp32 bound"

    model, candidates = _classifier_tuned(metric=metrics.top1_agreement, accuracy_budget=0.01)
    assert candidates[0].status == "selected" and candidates[0].metric == 1.0
    assert any("accepted by the metric" in c for c in candidates[0].validation.checks)
    assert "metric 1" in model.report.summary

    model, candidates = _classifier_tuned(metric=metrics.relative_accuracy, accuracy_budget=0.01)
    int8, fp32 = candidates
    assert int8.status == "failed" and "below 0.99 (1 - accuracy_budget)" in int8.reason and int8.metric < 0.99
    assert fp32.status == "selected" and fp32.metric == 1.0, "the next candidate serves"

    model, candidates = _classifier_tuned(metric=metrics.relative_accuracy, accuracy_budget=0.05)
    assert candidates[0].status == "selected" and 0.95 < candidates[0].metric < 0.99


def test_a_modules_own_metric_and_budget_win_over_ait_tunes(unseen_backends):
    """Each half of the rule on its own: a module's budget spends ait.tune's metric, a module's metric
    is held to ait.tune's budget."""
    from aitune import metrics

    def tuned(**module_rule):
        model = ait.Module(
            SlowModule(delay_s=0.0),
            "classifier",
            strategy=_strategy(unseen.Int8LikeBackend(ToyConfig()), ToyBackend(ToyConfig())),
            **module_rule,
        )
        data = [torch.randn(4, 8), torch.randn(8, 8)]
        graph = ait.tune(model, data, metric=metrics.relative_accuracy, accuracy_budget=0.01).modules[0].graphs[0]
        return graph.accuracy_floor, graph.candidates[0]

    floor, int8 = tuned()
    assert floor == pytest.approx(0.99) and int8.status == "failed", (
        "ait.tune's rule alone rejects the int8-like candidate"
    )
    floor, int8 = tuned(accuracy_budget=0.05)
    assert floor == pytest.approx(0.95) and int8.status == "selected" and 0.95 < int8.metric < 0.99
    floor, int8 = tuned(metric=metrics.top1_agreement)
    assert floor == pytest.approx(0.99) and int8.status == "selected" and int8.metric == 1.0


def test_a_budget_needs_a_metric_and_stays_in_range(toy_backends):
    from aitune.errors import InputError

    with pytest.raises(InputError, match="accuracy_budget needs a metric"):
        ait.tune(ait.Module(SlowModule(), "m"), [torch.randn(2, 8)], accuracy_budget=0.01)
    with pytest.raises(ValueError, match="accuracy_budget must be a number in"):
        ait.Module(SlowModule(), "m", accuracy_budget=2)


def test_quantizing_variants_join_the_defaults_only_with_a_budget():
    from aitune.engine.plan import default_backends
    from aitune.plugins import get_manager

    registry = get_manager().registry
    if "onnxruntime" not in registry or registry.unavailable("onnxruntime", torch.device("cpu")):
        pytest.skip("onnxruntime cannot run here")
    plain = [b.variant() for b in default_backends(registry, torch.device("cpu")) if b.name == "onnxruntime"]
    budget = [b.variant() for b in default_backends(registry, torch.device("cpu"), True) if b.name == "onnxruntime"]
    assert "dynamic int8" not in plain and "dynamic int8" in budget


def test_the_html_report_draws_the_speed_accuracy_frontier(unseen_backends):
    """Each candidate's speed-up against the metric, the chosen one marked, the floor drawn (read from the SVG)."""
    pytest.importorskip("matplotlib")
    from aitune import metrics
    from aitune.render.html import render_html

    strategy = ait.MaxThroughputStrategy([unseen.Int8LikeBackend(ToyConfig()), ToyBackend(ToyConfig(speed=0.5))], QUICK)
    model = ait.Module(SlowModule(delay_s=0.002), "classifier", strategy=strategy)
    report = ait.tune(
        model, [torch.randn(4, 8), torch.randn(8, 8)], metric=metrics.relative_accuracy, accuracy_budget=0.05
    )
    graph = report.modules[0].graphs[0]
    assert graph.accuracy_floor == pytest.approx(0.95)
    assert all(c.metric is not None and c.speedup is not None for c in graph.candidates)
    page = render_html(report)
    assert "speed-accuracy frontier" in page
    assert 'id="point-selected"' in page and 'id="point-candidate"' in page and 'id="accuracy-floor"' in page
    assert "toy_int8_like" in page


# -- a call outside what was tuned says what differs and what would cover it ---------------------------


class Scaled(torch.nn.Module):
    """``x`` with an optional mask and a keyword-only scale."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x, mask=None, *, scale=1.0):
        y = self.fc(x) * scale
        return y if mask is None else y * mask


def _tuned(module, data, **tune):
    model = ait.Module(module.eval(), "m", strategy=_strategy(ToyBackend(ToyConfig())))
    ait.tune(model, data, **tune)
    assert model.state == "tuned", model.report.summary
    return model


def _fallback_warning(model, *args, **kwargs):
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="outside what was tuned") as caught:
        model(*args, **kwargs)
    return str(caught[0].message)


def test_a_keyword_no_tuned_call_passed_is_named(toy_backends):
    model = _tuned(Scaled(), [torch.randn(2, 8), torch.randn(4, 8)])
    text = _fallback_warning(model, torch.randn(2, 8), mask=torch.ones(2, 8))
    assert "the keyword mask=<float32 tensor (2, 8)> was never passed while tuning" in text, text
    assert "record calls like this one" in text


def test_a_keyword_value_other_than_the_tuned_one_is_named(toy_backends):
    model = _tuned(Scaled(), [((torch.randn(2, 8),), {"scale": 2.0}), ((torch.randn(4, 8),), {"scale": 2.0})])
    text = _fallback_warning(model, torch.randn(2, 8), scale=3.0)
    assert "scale is 3.0, tuned with 2.0" in text, text


def test_a_dtype_other_than_the_tuned_one_is_named(toy_backends):
    class Casting(Scaled):
        def forward(self, x):
            return self.fc(x.float())

    model = _tuned(Casting(), [torch.randn(2, 8), torch.randn(4, 8)])
    text = _fallback_warning(model, torch.randn(2, 8, dtype=torch.float64))
    assert "x is float64, tuned with float32" in text, text


def test_an_axis_outside_its_range_names_the_axis_the_sizes_and_the_declaration_that_covers_it(toy_backends):
    model = _tuned(Sequence(), [torch.randn(2, 4, 8), torch.randn(2, 8, 8)])
    text = _fallback_warning(model, torch.randn(2, 12, 8))
    assert "x: axis 1 (d0) is 12, tuned for 4..8" in text, text
    assert "dynamic_shapes={'x': {1: ait.DynamicDim(min=4, max=12)}}" in text, text


class Image(torch.nn.Module):
    """A 1x1 convolution over ``[batch, 3, height, width]``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 4, 1)

    def forward(self, x):
        return self.conv(x)


def test_height_and_width_stay_two_dims_after_tuning_on_square_images(toy_backends):
    model = _tuned(Image(), [torch.randn(1, 3, 64, 64), torch.randn(1, 3, 96, 96)])
    [(graph, backend)] = model.tuned_graphs
    assert graph.inputs[0].dims[2] != graph.inputs[0].dims[3], graph.inputs[0].dims
    calls = backend.calls
    x = torch.randn(1, 3, 64, 96)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no eager fallback
        assert_matches_eager(model(x), model.module(x))
    assert backend.calls == calls + 1, "the tuned backend serves a 64x96 image"


def test_a_dynamic_dim_name_still_ties_height_and_width(toy_backends):
    side = ait.DynamicDim("side", 64, 96)
    model = ait.Module(
        Image().eval(), "m", strategy=_strategy(ToyBackend(ToyConfig())), dynamic_shapes={"x": {2: side, 3: side}}
    )
    ait.tune(model, [torch.randn(1, 3, 64, 64), torch.randn(1, 3, 96, 96)])
    text = _fallback_warning(model, torch.randn(1, 3, 64, 96))
    assert "x: axis 3 (side) is 96 but x axis 2 is 64" in text, text


def test_a_metric_that_returns_nan_fails_the_budget(unseen_backends):
    model, candidates = _classifier_tuned(metric=lambda tuned, eager, batch: float("nan"), accuracy_budget=0.5)
    assert all(c.status == "failed" and "measures nothing" in c.reason for c in candidates)
    assert model.state == "passthrough"


def test_relative_accuracy_scores_nan_and_zero_outputs_for_what_they_are():
    from aitune import metrics

    zeros = torch.zeros(4, 8)
    assert metrics.relative_accuracy(torch.full((4, 8), 5.0), zeros) == 0.0, "garbage against all-zero eager"
    assert metrics.relative_accuracy(zeros.clone(), zeros) == 1.0
    assert metrics.relative_accuracy(torch.full((4, 8), float("nan")), torch.ones(4, 8)) == 0.0
    assert metrics.relative_accuracy(torch.ones(4, 8), torch.full((4, 8), float("nan"))) == 0.0
    both = torch.tensor([float("nan"), 1.0])
    assert metrics.relative_accuracy(both.clone(), both) == 1.0, "eager's own NaN, repeated, agrees"
