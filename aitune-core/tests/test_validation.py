"""The default validator: finite garbage, NaN, shapes, dtypes, mutation and tolerances."""

from __future__ import annotations

import pytest
import torch
from aitune_testkit.doubles import MutatingBackend, NaNBackend, WrongBackend

from aitune.backend import Tolerance
from aitune.graph import Sample, infer_graph
from aitune.testing import TinyMLP, tiny_samples
from aitune.testing.backends import ToyBackend
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


# -- TF32: the eager reference on a GPU in full fp32 unless the candidate computes TF32 -------------


class _Precision(Fn):
    def __init__(self, fn, tf32):
        super().__init__(fn)
        self.tf32 = tf32

    def computes_tf32(self):
        return self.tf32


def _flags():
    return (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision)


def test_on_a_gpu_the_eager_reference_runs_in_full_fp32_and_the_flags_come_back(monkeypatch):
    """The flags are process-wide: switched for the reference only, restored after, even on error."""
    from aitune import validation

    if not hasattr(torch.backends.cudnn, "conv"):
        pytest.skip("torch before 2.9 has no fp32_precision")
    monkeypatch.setattr(validation, "_on_cuda", lambda sample: True)  # the samples stand for CUDA tensors
    module, samples, graph = setup()
    seen = []

    def reference(x):
        seen.append(_flags())
        assert validation._TF32_FLAGS.locked(), "switched under the lock"
        return module(x)

    before = _flags()
    torch.backends.cuda.matmul.fp32_precision = torch.backends.cudnn.conv.fp32_precision = "tf32"
    try:
        report = validate(_Precision(module, tf32=False), reference, samples, graph)
        assert report.passed and "eager reference in full fp32" in report.checks
        assert seen and set(seen) == {("ieee", "ieee")}
        assert _flags() == ("tf32", "tf32"), "restored afterwards"

        seen.clear()
        report = validate(_Precision(module, tf32=True), reference, samples, graph)
        assert set(seen) == {("tf32", "tf32")}, "a TF32 candidate is compared with eager under the user's flags"

        def broken(x):
            raise RuntimeError("eager fails")

        assert not validate(_Precision(module, tf32=False), broken, samples, graph).passed
        assert _flags() == ("tf32", "tf32") and not validation._TF32_FLAGS.locked()
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = before


def test_before_torch_2_9_the_allow_tf32_flags_are_switched(monkeypatch):
    from types import SimpleNamespace

    from aitune import validation

    fake = SimpleNamespace(
        cuda=SimpleNamespace(matmul=SimpleNamespace(allow_tf32=True)), cudnn=SimpleNamespace(allow_tf32=True)
    )
    monkeypatch.setattr(torch, "backends", fake)
    with validation.full_fp32():
        assert (fake.cuda.matmul.allow_tf32, fake.cudnn.allow_tf32) == (False, False)
    assert (fake.cuda.matmul.allow_tf32, fake.cudnn.allow_tf32) == (True, True)


def test_a_tf32_candidate_gets_tf32s_bound_on_a_gpu_only(monkeypatch):
    from aitune import validation

    module, samples, graph = setup()

    def tf32_like(x):  # fp32 outputs off by TF32's rounding, beyond fp32's bound
        return module(x) * (1 + 2e-3)

    assert not validate(_Precision(tf32_like, tf32=True), module, samples, graph).passed, "on CPU: fp32's bound"
    monkeypatch.setattr(validation, "_on_cuda", lambda sample: True)
    assert validate(_Precision(tf32_like, tf32=True), module, samples, graph).passed
    assert not validate(_Precision(tf32_like, tf32=False), module, samples, graph).passed
    assert validation.tolerance_for(torch.float16, ToyBackend(), None, tf32=True) == DEFAULT_TOLERANCES["float16"]


def test_by_default_a_backend_follows_torchs_tf32_flags():
    if not hasattr(torch.backends.cudnn, "conv"):
        pytest.skip("torch before 2.9 has no fp32_precision")
    before = _flags()
    try:
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        torch.backends.cudnn.conv.fp32_precision = "tf32"  # torch's default for convolutions
        assert ToyBackend().computes_tf32()
        torch.backends.cudnn.conv.fp32_precision = "ieee"
        assert not ToyBackend().computes_tf32()
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        assert ToyBackend().computes_tf32()
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = before


@pytest.mark.gpu
def test_on_a_gpu_a_full_fp32_candidate_meets_fp32s_bound_against_a_full_fp32_reference():
    cuda = torch.device("cuda")
    conv = torch.nn.Conv2d(64, 64, 3, padding=1).to(cuda).eval()
    samples = [Sample((torch.randn(b, 64, 32, 32, device=cuda),)) for b in (2, 4)]
    with torch.no_grad():
        graph = infer_graph(samples, ["x"], outputs=[conv(*s.args) for s in samples])

    def ieee(x):
        from aitune.validation import full_fp32

        with full_fp32():
            return conv(x)

    with torch.no_grad():
        report = validate(_Precision(ieee, tf32=False), conv, samples, graph)
    assert report.passed, report.reason
    assert report.outputs[0].max_rel_error < 1e-4, "both sides computed in IEEE fp32"


def test_the_full_fp32_reference_covers_cudnn_rnns_and_restores_their_flag():
    """torch 2.13 runs fp32 LSTM and GRU in TF32 by default (``cudnn.rnn.fp32_precision``): an
    eager reference that switched only matmuls and convolutions judged candidates against TF32."""
    from aitune import validation

    rnn = getattr(torch.backends.cudnn, "rnn", None)
    if not hasattr(rnn, "fp32_precision"):
        pytest.skip("this torch has no cudnn.rnn.fp32_precision")
    before = (*_flags(), rnn.fp32_precision)
    try:
        torch.backends.cuda.matmul.fp32_precision = torch.backends.cudnn.conv.fp32_precision = "ieee"
        rnn.fp32_precision = "tf32"
        with validation.full_fp32():
            assert rnn.fp32_precision == "ieee" and _flags() == ("ieee", "ieee")
        assert rnn.fp32_precision == "tf32", "restored afterwards"
        with pytest.raises(RuntimeError), validation.full_fp32():
            raise RuntimeError("eager fails")
        assert rnn.fp32_precision == "tf32" and not validation._TF32_FLAGS.locked()
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision, rnn.fp32_precision = before
