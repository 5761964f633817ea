"""AITune 0.6-style code runs unchanged: the snippets of its guides, as a user would paste them.

Only the backend is a toy (``aitune.testing.backends``) so the tests are fast on any CPU; the
calls around it are written exactly as AITune's documentation writes them.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from aitune_testkit.doubles import SlowModule

import aitune.torch as ait
from aitune.errors import ArtifactError, InputError
from aitune.testing import assert_matches_eager
from aitune.testing.backends import ToyBackend, ToyConfig
from aitune.torch.task.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig

pytestmark = pytest.mark.busy  # tuned on a busy machine: no test here may need to win a timing race

QUICK = ProfilingConfig(
    measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=10, warmup=1, window=5), extend_s=0.0
)


def build_model() -> torch.nn.Module:
    """Eager sleeps 10 ms a call and the toy backend not at all: a gap no load spike closes (at 2 ms a
    busy CI machine once timed both at 7 ms and the gate kept eager)."""
    return SlowModule(delay_s=0.01)


def no_fallback(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Call ``module`` for inference; any eager fallback (outside what was tuned) fails the test."""
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("error", RuntimeWarning)
        return module(x)


@pytest.fixture
def backend(toy_backends):
    return ToyBackend(ToyConfig())


def test_tune_save_then_load_into_a_new_model(backend, tmp_path):
    model = build_model()
    strategy = ait.OneBackendStrategy(backend=backend, profiling_config=QUICK)
    model = ait.Module(model, "my-model", strategy=strategy)
    input_data = [torch.randn(1, 8) for _ in range(6)]  # AITune's dataset: samples of batch 1
    report = ait.tune(model, input_data, batch_sizes=[1, 2, 4, 8, 16])
    [candidate] = report.modules[0].graphs[0].candidates
    assert [p.batch_size for p in candidate.profiles] == [1, 2, 4, 8, 16]
    ait.save(model, tmp_path / "model.ait")

    model = ait.load(build_model(), tmp_path / "model.ait")
    assert isinstance(model, ait.Module) and model.state == "tuned"
    [(graph, _)] = model.tuned_graphs
    assert (graph.batch.min, graph.batch.max) == (1, 16)
    x = torch.randn(16, 8)
    assert_matches_eager(no_fallback(model, x), SlowModule()(x))
    no_fallback(model, torch.randn(3, 8))


def test_batch_sizes_none_tunes_batch_one_samples_for_batches_one_and_two(backend):
    model = ait.Module(build_model(), "m", strategy=ait.OneBackendStrategy(backend=backend, profiling_config=QUICK))
    ait.tune(model, [torch.randn(1, 8) for _ in range(4)])
    [(graph, _)] = model.tuned_graphs
    assert (graph.batch.min, graph.batch.max) == (1, 2)
    no_fallback(model, torch.randn(2, 8))
    with pytest.warns(RuntimeWarning, match="outside what was tuned"), torch.inference_mode():
        model(torch.randn(3, 8))


def test_batches_of_the_model_stay_batches(backend):
    """Items that already are batches (not of size 1) are tuned for the sizes they have."""
    model = ait.Module(build_model(), "m", strategy=ait.OneBackendStrategy(backend=backend, profiling_config=QUICK))
    ait.tune(model, [torch.randn(4, 8), torch.randn(8, 8)])
    [(graph, _)] = model.tuned_graphs
    assert (graph.batch.min, graph.batch.max) == (4, 8)


def test_aitune_dynamic_shapes_per_parameter_tuples(backend, tmp_path):
    seq = ait.DynamicDim("seq", 1, 64)  # one name on two inputs: one shared dimension
    model = ait.Module(
        build_model(),
        "m",
        strategy=ait.OneBackendStrategy(backend=backend, profiling_config=QUICK),
        dynamic_shapes={
            "x": (ait.BatchDim("batch", 1, 8), seq, 8),
            "mask": (ait.BatchDim("batch", 1, 8), seq, 1),
        },
    )
    data = [{"x": torch.randn(1, s, 8), "mask": torch.ones(1, s, 1)} for s in (5, 9, 5)]
    ait.tune(model, data)
    [(graph, _)] = model.tuned_graphs
    assert {n: (r.min, r.max) for n, r in graph.dims.items()} == {"batch": (1, 8), "seq": (1, 64)}
    ait.save(model, tmp_path / "m.ait")
    loaded = ait.load(build_model(), tmp_path / "m.ait")
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("error", RuntimeWarning)
        assert loaded(torch.randn(8, 64, 8), mask=torch.ones(8, 64, 1)).shape == (8, 64, 8)
    with pytest.warns(RuntimeWarning, match="outside what was tuned"), torch.inference_mode():
        loaded(torch.randn(2, 7, 8), mask=torch.ones(2, 1, 1))  # the shared dimension must agree


def test_inspect_get_modules_wrap_tune(backend, tmp_path):
    class Pipeline(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = SlowModule(delay_s=0.004)
            self.head = torch.nn.Linear(8, 2)

        def forward(self, x):
            return self.head(self.encoder(x))

    pipe = Pipeline()
    input_data = [torch.randn(1, 8) for _ in range(3)]
    result = ait.inspect(pipe, input_data)
    modules = result.get_modules()
    shares = [m.share for m in modules]
    assert shares == sorted(shares, reverse=True) and modules[0].name == "encoder"
    assert [m.name for m in result.get_modules(min_execution_ratio=0.5)] == ["encoder"]
    assert len(result.get_modules(limit=2)) == 2

    ait.wrap(
        pipe, result.get_modules(limit=1), strategy=ait.OneBackendStrategy(backend=backend, profiling_config=QUICK)
    )
    assert isinstance(pipe.encoder, ait.Module) and pipe.encoder.name == "encoder"
    ait.tune(pipe, input_data)
    assert pipe.encoder.state == "tuned"
    ait.save(pipe, tmp_path / "pipe.ait")
    fresh = ait.load(Pipeline(), tmp_path / "pipe.ait")
    assert fresh.encoder.state == "tuned"


def test_strategy_names_of_the_overview():
    assert ait.HighestThroughputStrategy is ait.MaxThroughputStrategy
    for name in ("OneBackendStrategy", "FirstWinsStrategy", "MinLatencyStrategy", "LatencyBudgetStrategy"):
        assert hasattr(ait, name)


def test_aitune_tune_keywords_work_or_say_what_to_use(backend, tmp_path):
    def broken():  # dynamic_shapes that contradict the data: tuning this module fails
        return ait.Module(
            build_model(), "m", strategy=ait.MaxThroughputStrategy([backend]), dynamic_shapes={"x": (1, 9)}
        )

    data = [torch.randn(1, 8)]
    with pytest.warns(RuntimeWarning, match="m: tuning failed"):
        report = ait.tune(broken(), data, ignore_failing_modules=True)
    assert report.modules[0].status == "failed"
    with pytest.raises(InputError, match="axis 1 is 9"):
        ait.tune(broken(), data, ignore_failing_modules=False)

    model = ait.Module(build_model(), "m", strategy=ait.MaxThroughputStrategy([backend]))
    report = ait.tune(model, data, batch_sizes=[1, 4], dry_run=True)
    assert report.modules[0].status == "dry run" and report.modules[0].graphs[0].candidates == []
    assert report.modules[0].graphs[0].graph["dims"]["batch"]["max"] == 4
    with pytest.raises(ArtifactError, match="never tuned"):
        ait.save(model, tmp_path / "unused.ait")

    ait.tune(model, data)
    ait.tune(model, data, batch_sizes=[1, 4], dry_run=True)
    assert model.state == "tuned"  # a dry run of a tuned model leaves it tuned

    with pytest.raises(InputError, match="max_samples"):
        ait.tune(model, data, max_num_batches_per_batch_size=4)
