"""The default validator: finite garbage, NaN, shapes, dtypes, mutation and tolerances."""

from __future__ import annotations

import torch

from aitune.backend import Tolerance
from aitune.graph import Sample, infer_graph
from aitune.testing import TinyMLP, tiny_samples
from aitune.testing.backends import MutatingBackend, NaNBackend, ToyBackend, WrongBackend
from aitune.validation import DEFAULT_TOLERANCES, validate


class Fn(ToyBackend):
    """Runs a function instead of the module."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def infer(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def setup():
    module = TinyMLP().eval()
    samples = tiny_samples((2, 4))
    with torch.no_grad():
        graph = infer_graph(samples, ["x"], outputs=[module(*x.args) for x in samples])
    return module, samples, graph


def built(backend, module):
    backend.module = module
    return backend


def test_a_correct_backend_passes_and_reports_figures():
    module, samples, graph = setup()
    report = validate(built(ToyBackend(), module), module, samples, graph)
    assert report.passed, report.reason
    assert report.samples_checked == 5  # two samples + batch min + batch max + batch 3, never recorded
    assert report.checks == [
        "min shapes (batch=2)",
        "max shapes (batch=4)",
        "unrecorded batch sizes [3] (others at opt)",
    ]
    [out] = report.outputs
    assert out.max_abs_error == 0.0 and out.cosine_similarity > 0.9999


def test_finite_garbage_fails():
    module, samples, graph = setup()
    report = validate(built(WrongBackend(), module), module, samples, graph)
    assert not report.passed and "off by" in report.reason
    assert report.outputs[0].max_rel_error > 0.05


def test_nan_and_mutation_fail():
    module, samples, graph = setup()
    assert "NaN/Inf" in validate(built(NaNBackend(), module), module, samples, graph).reason
    assert "modified input" in validate(built(MutatingBackend(), module), module, samples, graph).reason


def test_shape_dtype_and_structure_are_checked():
    module, samples, graph = setup()
    assert "shape" in validate(Fn(lambda x: module(x)[:, :4]), module, samples, graph).reason
    assert "dtype" in validate(Fn(lambda x: module(x).double()), module, samples, graph).reason
    assert "structure" in validate(Fn(lambda x: (module(x),)), module, samples, graph).reason


def test_a_crash_while_running_is_a_failed_validation():
    module, samples, graph = setup()

    def boom(x):
        if x.shape[0] == 4:
            raise RuntimeError("kernel missing for batch 4")
        return module(x)

    report = validate(Fn(boom), module, samples, graph)
    assert not report.passed and "kernel missing for batch 4" in report.reason


def test_small_numeric_noise_passes_and_the_user_can_tighten_the_bound():
    module, samples, graph = setup()
    noisy = Fn(lambda x: module(x) * (1 + 1e-4))
    assert validate(noisy, module, samples, graph).passed
    tight = {"float32": Tolerance(atol=0.0, rtol=1e-6)}
    assert not validate(noisy, module, samples, graph, tight).passed


def test_backend_declared_tolerance_is_used():
    module, samples, graph = setup()

    class Quantizing(Fn):
        def tolerance(self, dtype):
            return Tolerance(atol=0.0, rtol=0.2, min_cosine=0.9)

    assert validate(Quantizing(lambda x: module(x) * 1.05), module, samples, graph).passed
    assert not validate(Fn(lambda x: module(x) * 1.05), module, samples, graph).passed


def test_integer_outputs_must_match_exactly():
    samples = [Sample((torch.tensor([[0.1, 0.9], [0.8, 0.2]]),))]
    graph = infer_graph(samples, ["x"])
    report = validate(Fn(lambda x: x.argmin(-1)), lambda x: x.argmax(-1), samples, graph)
    assert not report.passed and "differs from eager in 2 of 2 elements" in report.reason


def test_default_bounds_loosen_with_lower_precision():
    assert DEFAULT_TOLERANCES["float32"].rtol < DEFAULT_TOLERANCES["float16"].rtol < DEFAULT_TOLERANCES["bfloat16"].rtol
