"""New weights into a tuned module without a rebuild: refit, checked against eager.

After ``load_state_dict`` with new weights, a new ``Parameter`` or an optimizer step (no call aitune
watches: torch's global hooks mark the module), an ONNX Runtime or AOTInductor winner keeps serving
(refitted, never eager) with eager's outputs under the new weights; ``ait.load(..., weights=)``
says whose weights a loaded model serves.
"""

from __future__ import annotations

import warnings
from typing import Any, ClassVar

import pytest
import torch

import aitune.torch as ait
from aitune.plugins import get_manager
from aitune.testing import assert_matches_eager
from aitune.testing.backends import ToyBackend

REFITTABLE = ("onnxruntime", "torch_inductor_aot")


def mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).eval()


def backend(name: str) -> Any:
    registry = get_manager().registry
    if name not in registry or registry.status(name).reason("cpu"):
        pytest.skip(f"{name} cannot run here")
    return registry.backend_class(name)()


def tuned(name: str) -> ait.Module:
    model = ait.Module(mlp(0), "mlp", strategy=ait.OneBackendStrategy(backend(name), performance_validation=False))
    ait.tune(model, [torch.randn(2, 8), torch.randn(6, 8)], end_to_end=False)
    assert model.state == "tuned"
    return model


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert float((a - b).abs().max()) <= 1e-5 + 1e-4 * float(b.abs().max())


def served_by_winner(model: ait.Module) -> list[int]:
    calls = [0]
    dispatcher = model._dispatcher
    dispatcher.routes = [(check, _counting(runner, calls)) for check, runner in dispatcher.routes]
    dispatcher._table.clear()
    return calls


def _counting(runner: Any, calls: list[int]) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return runner(*args, **kwargs)

    return run


@pytest.mark.parametrize("name", REFITTABLE)
def test_new_weights_are_refitted_and_the_winner_keeps_serving(name: str, tmp_path: Any) -> None:
    model = tuned(name)
    fresh = mlp(1)
    x = torch.randn(5, 8)  # a batch size no recorded call had
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "running this call eager"
        model.load_state_dict(fresh.state_dict())
        served = served_by_winner(model)
        with torch.no_grad():
            y = model(x)
    assert served[0] == 1 and model.stale_reason is None
    with torch.no_grad():
        same(y, fresh(x))
    winner = model.tuned_graphs[0].backend
    assert winner.build_info["refitted"] is True

    path = ait.save(model, tmp_path / "refitted.ait")  # its payload holds the old weights: load refits it
    loaded = ait.load(mlp(2), path, weights="artifact", trust_native_code=True)
    with torch.no_grad():
        same(loaded(x), fresh(x))
    assert loaded.stale_reason is None


@pytest.mark.parametrize("name", REFITTABLE)
def test_load_serves_the_models_own_weights_when_asked(name: str, tmp_path: Any) -> None:
    path = ait.save(tuned(name), tmp_path / "base.ait")
    checkpoint = mlp(7)  # a fine-tune of the same architecture
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = checkpoint(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = ait.load(mlp(7), path, weights="model", trust_native_code=True)
        served = served_by_winner(model)
        with torch.no_grad():
            same(model(x), expected)
    assert served[0] == 1

    with pytest.warns(RuntimeWarning, match="differ from the artifact's; ait.load serves the artifact's"):
        ait.load(mlp(7), path, trust_native_code=True)


class ClaimsToRefit(ToyBackend):
    """Says it loaded the new weights, but its copy of the module keeps the old ones."""

    name = "toy_claims_refit"

    def refit(self, weights: Any) -> bool:
        return True


def test_a_refit_that_does_not_take_is_caught_and_the_module_runs_eager(toy_backends: Any) -> None:
    model = ait.Module(mlp(0), "mlp", strategy=ait.OneBackendStrategy(ClaimsToRefit(), performance_validation=False))
    ait.tune(model, [torch.randn(2, 8), torch.randn(6, 8)], end_to_end=False)
    fresh = mlp(1)
    model.load_state_dict(fresh.state_dict())
    assert model.stale_reason is not None and "differs from eager" in model.stale_reason
    x = torch.randn(3, 8)
    with pytest.warns(RuntimeWarning, match="running this call eager"), torch.no_grad():
        same(model(x), fresh(x))


def test_a_backend_without_refit_says_so(toy_backends: Any) -> None:
    model = ait.Module(mlp(0), "mlp", strategy=ait.OneBackendStrategy(ToyBackend(), performance_validation=False))
    ait.tune(model, [torch.randn(2, 8), torch.randn(6, 8)], end_to_end=False)
    model.load_state_dict(mlp(1).state_dict())
    assert "cannot load new weights" in (model.stale_reason or "")


class RecordsRefit(ToyBackend):
    """Refits by copying the new weights into its module; records every call, as a native runtime would see it."""

    name = "toy_records_refit"
    seen: ClassVar[list[dict[str, Any]]] = []

    def refit(self, weights: Any) -> bool:
        RecordsRefit.seen.append({k: (v.dtype, tuple(v.shape)) for k, v in weights.items()})
        return True


def test_weights_of_another_dtype_never_reach_refit_and_the_module_runs_eager(toy_backends: Any) -> None:
    """``.double()`` on a tuned module: the payload was built for float32, so nothing is refitted
    (AOTInductor's load_constants crashed on float64) and calls run eager with the reason."""
    RecordsRefit.seen.clear()
    model = ait.Module(mlp(0), "mlp", strategy=ait.OneBackendStrategy(RecordsRefit(), performance_validation=False))
    ait.tune(model, [torch.randn(2, 8), torch.randn(6, 8)], end_to_end=False)
    model.double()
    assert RecordsRefit.seen == [], "a float64 weight reached refit"
    assert "float64" in (model.stale_reason or "") and "nothing was refitted" in (model.stale_reason or "")
    x = torch.randn(3, 8, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="float64"), torch.no_grad():
        assert model(x).dtype == torch.float64

    strict = ait.Module(
        mlp(0), "mlp", strict=True, strategy=ait.OneBackendStrategy(RecordsRefit(), performance_validation=False)
    )
    ait.tune(strict, [torch.randn(2, 8), torch.randn(6, 8)], end_to_end=False)
    strict.module[0].weight.data = torch.zeros(32, 9)  # another shape, in place of the old tensor
    strict.eval()
    assert RecordsRefit.seen == [] and "[32, 9]" in (strict.stale_reason or "")
    from aitune.errors import StaleWeightsError

    with pytest.raises(StaleWeightsError), torch.no_grad():
        strict(torch.randn(3, 8))


@pytest.mark.parametrize("name", REFITTABLE)
def test_a_float64_model_with_weights_model_refits_nothing_and_runs_eager(name: str, tmp_path: Any) -> None:
    path = ait.save(tuned(name), tmp_path / "base.ait")
    with pytest.warns(RuntimeWarning, match="float64"):
        model = ait.load(mlp(7).double(), path, weights="model", trust_native_code=True)
    x = torch.randn(3, 8, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="running this call eager"), torch.no_grad():
        same(model(x), mlp(7).double()(x))

    tuned_model = tuned(name)
    tuned_model.double()  # reached load_constants with float64 tensors before: a crash
    assert "float64" in (tuned_model.stale_reason or "")


def test_a_deep_copy_of_a_tuned_module_runs_and_follows_its_own_weights() -> None:
    """``copy.deepcopy`` of an ONNX-Runtime-tuned module raised TypeError (its session cannot be
    pickled). The copy shares the session, watches its own weights, and outlives the original."""
    import copy
    import gc

    model = tuned("onnxruntime")
    x = torch.randn(3, 8)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        same(twin(x), mlp(0)(x))
    del model
    gc.collect()  # the original's payload folder goes with it; the copy has its own
    fresh = mlp(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refitted, no eager fallback
        twin.load_state_dict(fresh.state_dict())
        served = served_by_winner(twin)
        with torch.no_grad():
            same(twin(x), fresh(x))
    assert served[0] == 1 and twin.stale_reason is None
    twin.module[0].register_forward_hook(lambda m, i, o: o * 0)  # the copy sees hooks added to it
    with pytest.warns(RuntimeWarning, match="hooks were added"), torch.no_grad():
        assert float(twin(x).abs().max()) > 0 and twin._dispatcher.guard.hooks.changed


def test_a_strict_module_refuses_weights_of_another_dtype_at_load(tmp_path: Any) -> None:
    from aitune.errors import ArtifactError

    model = ait.Module(
        mlp(0),
        "mlp",
        strict=True,
        strategy=ait.OneBackendStrategy(backend("onnxruntime"), performance_validation=False),
    )
    ait.tune(model, [torch.randn(2, 8), torch.randn(6, 8)], end_to_end=False)
    path = ait.save(model, tmp_path / "strict.ait")
    target = mlp(7).double()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ArtifactError, match="float64"):
        ait.load(target, path, weights="model")
    assert all(torch.equal(target.state_dict()[k], v) for k, v in before.items())
    assert not isinstance(target[0], ait.Module)


def _new_parameter(model: ait.Module) -> None:
    torch.manual_seed(3)
    model.module[0].weight = torch.nn.Parameter(torch.randn(32, 8))


def _optimizer_step(model: ait.Module) -> None:
    """One SGD step in eval mode, grads set by hand (ait.tune froze the parameters; an optimizer steps anyway)."""
    torch.manual_seed(3)
    opt = torch.optim.SGD(model.module.parameters(), lr=0.5)
    for p in model.module.parameters():
        p.grad = torch.randn_like(p)
    opt.step()


@pytest.mark.parametrize("change", [_new_parameter, _optimizer_step], ids=["new-parameter", "optimizer-step-in-eval"])
@pytest.mark.parametrize("name", REFITTABLE)
def test_weights_changed_without_a_watched_call_are_refitted_before_the_next_call(name: str, change: Any) -> None:
    """Issue 49: a new Parameter with no eval() after it, or an optimizer step in eval mode, was served
    with the old weights an ONNX Runtime or AOTInductor payload baked in (off by 4.78 and 41.5), without
    a word."""
    model = tuned(name)
    x = torch.randn(5, 8)
    with torch.no_grad():
        before = model(x)
    change(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refitted and checked: no eager fallback
        served = served_by_winner(model)
        with torch.no_grad():
            y = model(x)
            expected = model.module(x)
    assert served[0] == 1 and model.stale_reason is None
    assert_matches_eager(y, expected)
    assert float((expected - before).abs().max()) > 0.1, "the change matters: the old payload would be off"
    assert model.tuned_graphs[0].backend.build_info["refitted"] is True


def test_a_deep_copys_new_parameter_refits_the_copy_only() -> None:
    import copy

    model = tuned("onnxruntime")
    twin = copy.deepcopy(model)
    _new_parameter(twin)
    x = torch.randn(3, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        served = served_by_winner(model)
        with torch.no_grad():
            assert_matches_eager(twin(x), twin.module(x))
            assert_matches_eager(model(x), mlp(0)(x))
    assert served[0] == 1 and "refitted" not in model.tuned_graphs[0].backend.build_info
    assert twin.tuned_graphs[0].backend.build_info["refitted"] is True


class ConvNorm(torch.nn.Module):
    """Conv -> BatchNorm: both exporters fold the norm into the convolution's weight and bias."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.conv(x))).mean((2, 3)))


class TransposedMatmul(torch.nn.Module):
    """``x @ W.t()`` and ``@ W`` (a tied weight) past the exporter's folding limits: the graph keeps
    Transpose(W), which ONNX Runtime folds when it opens the session."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(96, 2800) / 50)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight.t()) @ self.weight


def _seeded(cls: Any, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = cls().eval()
    for module in model.modules():  # statistics far from the defaults, so a stale fold shows
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.normal_()
            module.running_var.uniform_(0.5, 2.0)
            torch.nn.init.normal_(module.weight)
            torch.nn.init.normal_(module.bias)
    return model


@pytest.mark.parametrize(
    ("cls", "shape"), [(ConvNorm, (3, 8, 8)), (TransposedMatmul, (2800,))], ids=["conv-batchnorm", "transposed-matmul"]
)
def test_weights_folded_by_the_exporter_or_onnx_runtime_are_refitted(cls: Any, shape: tuple[int, ...]) -> None:
    """Issue 55: new weights went in through SessionOptions.add_initializer, which ONNX Runtime ignores
    for what it folds (a transposed weight), and the exporter had folded the batch norm into the
    convolution: the refit's check failed and every later call ran eager."""
    model = ait.Module(
        _seeded(cls, 0), "m", strategy=ait.OneBackendStrategy(backend("onnxruntime"), performance_validation=False)
    )
    ait.tune(model, [torch.randn(2, *shape), torch.randn(6, *shape)], end_to_end=False)
    fresh = _seeded(cls, 1)
    x = torch.randn(5, *shape)
    with torch.no_grad():
        old, expected = model(x), fresh(x)
    assert float((old - expected).abs().max()) > 0.1, "the new weights matter: the old payload would be off"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refitted and checked: no eager fallback
        model.load_state_dict(fresh.state_dict())
        served = served_by_winner(model)
        with torch.no_grad():
            y = model(x)
    assert model.stale_reason is None and served[0] == 1, "served by ONNX Runtime, not eager"
    assert_matches_eager(y, expected)
    assert model.tuned_graphs[0].backend.build_info["refitted"] is True
