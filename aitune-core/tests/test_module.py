"""ait.Module as a drop-in wrapper, the per-call dispatch, pipelines and ait.tune's inputs."""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch
from aitune_testkit.doubles import SlowModule

import aitune.torch as ait
from aitune import tree
from aitune.errors import InputError, UnsupportedCallError
from aitune.report import TuneReport
from aitune.testing import assert_matches_eager
from aitune.testing.backends import ToyBackend, ToyConfig
from aitune.torch.task.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig

pytestmark = pytest.mark.busy  # tuned on a busy machine: no test here may need to win a timing race

QUICK = ProfilingConfig(
    measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=10, warmup=1, window=5), extend_s=0.0
)


def fast(**kw) -> ait.TuneStrategy:
    return ait.OneBackendStrategy(ToyBackend(ToyConfig(**kw)), profiling_config=QUICK)


def test_wrapper_is_a_drop_in():
    inner = SlowModule(delay_s=0)
    model = torch.nn.Sequential(ait.Module(inner, "layer"))
    assert list(model.state_dict()) == ["0.fc.weight", "0.fc.bias"]
    model.load_state_dict({"0.fc.weight": torch.eye(8), "0.fc.bias": torch.zeros(8)})
    assert torch.equal(inner.fc.weight, torch.eye(8))
    wrapper = model[0]
    assert wrapper.fc is inner.fc and wrapper.delay_s == 0
    seen = []
    wrapper.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    model(torch.randn(2, 8))
    assert seen == [torch.Size([2, 8])]
    assert wrapper.eval() is wrapper and not inner.training
    assert wrapper.state == "recording"
    with pytest.raises(TypeError, match="already wrapped"):
        ait.Module(wrapper)


def test_tuned_module_routes_calls_and_falls_back_outside_the_range(toy_backends):
    model = ait.Module(SlowModule(), "m", strategy=fast())
    ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8)])
    [(_, backend)] = model.tuned_graphs
    before = backend.calls
    x = torch.randn(3, 8)
    with torch.no_grad():  # inference: tuned backends compute no gradients
        assert_matches_eager(model(x), model.module(x))
        assert backend.calls == before + 1
        with pytest.warns(
            RuntimeWarning,
            match=r"outside what was tuned \(x: axis 0 \(batch\) is 9, tuned for 2..4; record a call of that size "
            r"while tuning, or widen the range: dynamic_shapes=\{'x': \{0: ait.BatchDim\(min=2, max=9\)\}\}\)",
        ):
            model(torch.randn(9, 8))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once per reason
            model(torch.randn(9, 8))
        assert backend.calls == before + 1, "out-of-range calls run eager"
        with pytest.warns(RuntimeWarning, match=r"x has rank 3 \(1, 3, 8\), tuned with rank 2; to cover it, record"):
            model(torch.randn(3, 8, dtype=torch.float64).float().unsqueeze(0))


def test_strict_mode_raises_instead_of_falling_back(toy_backends):
    model = ait.Module(SlowModule(), "m", strategy=fast(), strict=True)
    ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8)])
    with torch.no_grad(), pytest.raises(UnsupportedCallError, match="batch\\) is 16"):
        model(torch.randn(16, 8))


def test_batch_sizes_widen_the_tuned_range(toy_backends):
    # the gate off: at batch 16 the toy's lead is a few percent, which a busy machine can hide
    model = ait.Module(SlowModule(), "m", strategy=fast().enable_performance_validation(False))
    ait.tune(model, [torch.randn(4, 8)], batch_sizes=[1, 16])
    [(graph, backend)] = model.tuned_graphs
    assert (graph.batch.min, graph.batch.max) == (1, 16)
    model(torch.randn(16, 8))
    assert backend.calls > 0


def test_positional_and_keyword_calls_are_one_graph(toy_backends):
    model = ait.Module(SlowModule(), "m", strategy=fast())
    mask = torch.ones(2, 8)
    ait.tune(model, [((torch.randn(2, 8), mask), {}), ((torch.randn(2, 8),), {"mask": mask})])
    assert len(model.tuned_graphs) == 1
    [(graph, backend)] = model.tuned_graphs
    assert [t.path for t in graph.inputs] == ["x", "mask"]
    before = backend.calls
    with torch.no_grad():
        model(torch.randn(2, 8), mask=mask)
        model(torch.randn(2, 8), mask)
    assert backend.calls == before + 2


def test_each_input_structure_is_its_own_graph_with_its_own_strategy(toy_backends):
    strategies = [fast(), ait.OneBackendStrategy(ToyBackend(ToyConfig(speed=3.0)), profiling_config=QUICK)]
    model = ait.Module(SlowModule(), "m", strategies=strategies)
    report = ait.tune(model, [torch.randn(2, 8), (torch.randn(2, 8), torch.ones(2, 8))])
    graphs = report.modules[0].graphs
    assert [g.decision for g in graphs] == ["toy", "torch_eager"]
    assert "graph 0: toy" in report.modules[0].summary and "graph 1: eager" in report.modules[0].summary


def test_a_pipeline_with_two_wrapped_modules_tunes_both(toy_backends):
    class Pipeline:
        def __init__(self):
            self.encoder = ait.Module(SlowModule(), "encoder", strategy=fast())
            self.decoder = ait.Module(SlowModule(), "decoder", strategy=fast())

        def __call__(self, x):
            return self.decoder(self.encoder(x) * 2)

    pipe = Pipeline()
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = pipe.decoder.module(pipe.encoder.module(x) * 2)
    report = ait.tune(pipe, [torch.randn(2, 8), torch.randn(3, 8)])
    assert [m.name for m in report.modules] == ["encoder", "decoder"]
    assert pipe.encoder.state == pipe.decoder.state == "tuned"
    assert_matches_eager(pipe(x), expected)


def test_one_module_failing_leaves_it_eager_and_tunes_the_others(toy_backends):
    class Broken(ait.FirstWinsStrategy):
        def tune(self, tuning, defaults):
            raise ZeroDivisionError("strategy bug")

    a = ait.Module(SlowModule(), "a", strategy=Broken(backends=[]))
    b = ait.Module(SlowModule(), "b", strategy=fast())
    report = ait.tune(lambda x: b(a(x)), [torch.randn(2, 8)])
    assert [m.status for m in report.modules] == ["failed", "tuned"]
    assert "ZeroDivisionError: strategy bug" in report.modules[0].error
    assert a.state == "passthrough"
    with pytest.raises(ZeroDivisionError):
        ait.tune(lambda x: b(a(x)), [torch.randn(2, 8)], fail_fast=True)


def test_dataset_forms(toy_backends):
    model = ait.Module(SlowModule(), "m", strategy=fast())
    calls = [torch.randn(2, 8), (torch.randn(2, 8),), {"x": torch.randn(2, 8)}, ((torch.randn(2, 8),), {})]
    report = ait.tune(model, calls)
    assert len(report.modules[0].graphs) == 1


def test_tune_input_errors_say_what_to_do():
    with pytest.raises(InputError, match="dataset is empty"):
        ait.tune(ait.Module(SlowModule(), "m"), [])
    with pytest.raises(InputError, match="contains no ait.Module.*ait.wrap"):
        ait.tune(SlowModule(), [torch.randn(1, 8)])
    with pytest.raises(InputError, match="no ait.Module was called"):
        ait.tune(lambda x: x, [torch.randn(1, 8)])


def test_unsupported_inputs_leave_the_module_eager_with_the_reason(toy_backends):
    class TakesAnything(torch.nn.Module):
        def forward(self, x, extra):
            return x * 2

    model = ait.Module(TakesAnything(), "odd", strategy=fast().enable_performance_validation(False))
    report = ait.tune(model, [((torch.randn(2, 2), object()), {}), ((torch.randn(2, 2), None), {})])
    assert report.modules[0].status == "tuned", "the graph with a describable call still tunes"
    eager, tuned = report.modules[0].graphs
    assert eager.decision == "torch_eager"
    assert "runs eager: unsupported value of type object at extra" in eager.reason
    assert tuned.decision == "toy"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the eager graph runs eager by design, without a warning
        assert model(torch.ones(1), object()).tolist() == [2.0]
    assert model(torch.ones(2, 2), None).shape == (2, 2)


def test_wrap_replaces_submodules_in_place():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(2, 2)))
    ait.wrap(model, ["0", "1.1"])
    assert isinstance(model[0], ait.Module) and model[0].name == "0"
    assert isinstance(model[1][1], ait.Module) and model[1][1].name == "1.1"
    with pytest.raises(InputError, match="cannot find '2'"):
        ait.wrap(model, ["2"])


def test_report_json_round_trip_and_log_line(toy_backends, tmp_path, caplog):
    model = ait.Module(SlowModule(), "encoder", strategy=fast())
    with caplog.at_level(logging.INFO, logger="aitune"):
        report = ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8)], report_path=tmp_path / "report.json")
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["schema_version"] == 2 and data["modules"][0]["graphs"][0]["decision"] == "toy"
    again = TuneReport.read(tmp_path / "report.json")
    assert again.modules[0].graphs[0].candidates[0].validation.passed
    timed = again.modules[0].graphs[0].candidates[0]  # the tune time per stage, per candidate
    assert timed.build_time_s is not None and timed.validate_time_s is not None and timed.validate_time_s >= 0
    assert report.environment["torch"] == torch.__version__
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("encoder: toy, "))
    measured = "] eager at batch" in line or "against eager at batch" in line  # timing decides which (noisy)
    assert measured and "(p50" in line and "max rel err" in line, line
    steps = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("encoder: build toy done in") for m in steps), "every step is logged"
    assert any(m.startswith("encoder: profile torch_eager, toy at batch") for m in steps)


def test_offloading_weights_requires_a_tuned_module():
    with pytest.raises(RuntimeError, match="only a tuned module"):
        ait.Module(SlowModule(), "m").offload_weights()


def test_config_sets_defaults_that_arguments_override(toy_backends, monkeypatch):
    from aitune.torch import config

    monkeypatch.setattr(config, "default_strategy", lambda: fast())
    monkeypatch.setattr(config, "max_samples", 1)
    model = ait.Module(SlowModule(), "m")
    report = ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8), torch.randn(3, 8)])
    assert report.modules[0].graphs[0].decision == "toy", "the configured default strategy was used"
    [(graph, _)] = model.tuned_graphs
    assert graph.batch is None, "one sample kept: no batch axis can be inferred"
    report = ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8)], max_samples=8)
    assert model.tuned_graphs[0][0].batch is not None, "the argument wins over the config"
    with pytest.raises(ValueError, match="ait.config.max_samples must be an int >= 1, got 0"):
        config.max_samples = 0
    with pytest.raises(InputError, match="max_samples must be an int >= 1"):
        ait.tune(model, [torch.randn(2, 8)], max_samples=0)


def test_shape_check_ties_named_dimensions_across_inputs():
    """The per-call shape check: ranges, static sizes, and a named size shared by several inputs
    (a mask beside the ids, a position vector of the sequence length) equal in every one of them."""
    from aitune.engine.dispatch import ShapeCheck
    from aitune.graph import Sample, infer_graph

    def call(b: int, s: int, pos: int | None = None, width: int = 4) -> dict[str, torch.Tensor]:
        return {
            "ids": torch.zeros(b, s),
            "mask": torch.ones(b, s),
            "pos": torch.zeros(s if pos is None else pos),
            "extra": torch.zeros(b, width),
        }

    graph = infer_graph([Sample((), call(1, 8)), Sample((), call(4, 16))], (), batch_sizes=[1, 4])
    check = ShapeCheck(graph)

    def fits(kwargs: dict[str, torch.Tensor]) -> bool:
        return check.fits(tree.flatten(((), kwargs))[0])

    assert fits(call(2, 12)) and fits(call(4, 8)) and fits(call(1, 16))
    assert not fits(call(5, 12)), "batch above the range"
    assert not fits(call(2, 17)), "sequence above the range"
    assert not fits(call(2, 12, pos=10)), "the position vector must have the ids' sequence length"
    assert not fits(call(2, 12, width=5)), "a static axis keeps its size"
    odd = call(2, 12)
    odd["mask"] = torch.ones(2, 10)  # within the range, yet not the ids' sequence length
    assert not fits(odd)
    odd["mask"] = torch.ones(3, 12)  # nor their batch
    assert not fits(odd)


def test_call_keys_tell_device_types_dtypes_and_ranks_apart():
    x = torch.zeros(2, 3)
    key = tree.call_key((x,), [])
    assert key == (tuple, ((torch.float32, 2, "cpu"),))
    assert tree.call_key((x.to("meta"),), []) == (tuple, ((torch.float32, 2, "meta"),))
    assert tree.call_key((x.double(),), []) != key and tree.call_key((x[0],), []) != key
    leaves: list[torch.Tensor] = []
    tree.call_key(([x, {"m": x[0]}], {"k": x}), leaves)
    assert [t.shape for t in leaves] == [(2, 3), (3,), (2, 3)]


def test_a_shape_is_checked_against_the_tuned_ranges_once_and_out_of_range_still_runs_eager(toy_backends, monkeypatch):
    from aitune.engine import dispatch

    model = ait.Module(SlowModule(), "m", strategy=fast())
    ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8)], end_to_end=False)
    [(_, backend)] = model.tuned_graphs
    checked = []
    real_fits = dispatch.ShapeCheck.fits
    monkeypatch.setattr(dispatch.ShapeCheck, "fits", lambda self, leaves: checked.append(1) or real_fits(self, leaves))
    before = backend.calls
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(3, 8))
        assert (len(checked), backend.calls) == (1, before + 3), "one check for the shape, then remembered"
        with pytest.warns(RuntimeWarning, match="outside what was tuned"):
            model(torch.randn(9, 8))
        model(torch.randn(9, 8))
        assert backend.calls == before + 3, "an out-of-range shape runs eager every time, remembered or not"
    monkeypatch.setattr(dispatch, "MAX_SHAPES", 2)
    with torch.no_grad():
        model(torch.randn(2, 8))  # a third shape: the remembered ones are dropped, none grows without bound
    (_, _, _, fitted) = next(iter(model._dispatcher._table.values()))
    assert list(fitted) == [(torch.Size([2, 8]),)]


def test_a_tuned_call_skips_torchs_call_path_yet_hooks_on_the_wrapper_and_global_hooks_still_run(
    toy_backends, monkeypatch
):
    model = ait.Module(SlowModule(), "m", strategy=fast())
    ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8)], end_to_end=False)
    [(_, backend)] = model.tuned_graphs
    slow_path = []
    real_call_impl = torch.nn.Module._call_impl
    monkeypatch.setattr(
        torch.nn.Module, "_call_impl", lambda self, *a, **k: slow_path.append(self) or real_call_impl(self, *a, **k)
    )
    x = torch.randn(3, 8)
    with torch.no_grad():
        model(x)
        assert model not in slow_path and backend.calls, "no hooks anywhere: straight to the dispatcher"
        seen = []
        handle = model.register_forward_hook(lambda module, args, out: seen.append(out.shape))
        out = model(x)
        handle.remove()
        glob = torch.nn.modules.module.register_module_forward_hook(
            lambda module, args, out: seen.append("global") if module is model else None
        )
        try:
            model(x)
        finally:
            glob.remove()
    assert seen == [out.shape, "global"] and slow_path.count(model) == 2, "a hook takes torch's path, which runs it"
    assert_matches_eager(out, model.module(x))
