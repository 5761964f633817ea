"""A tuned module never answers differently from eager without saying so.

Training mode, autograd and weights changed after tuning each make a call run eager (one warning,
or an error in strict mode). The toy backend copies the module when it builds, as engines copy
the weights, so it shows what a stale engine would return.
"""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch

import aitune.torch as ait
from aitune.backend import Backend
from aitune.engine.install import install
from aitune.errors import ArtifactError, InferenceOnlyError, InputError, StaleWeightsError
from aitune.module_code import code_digest, reads_training
from aitune.testing import assert_matches_eager
from aitune.testing.backends import ToyBackend


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
    ).eval()


def tuned(strict: bool = False, freeze: bool = False) -> ait.Module:
    """Tuned, its parameters left trainable (``freeze=False``) unless asked: the guard's cases need them."""
    strategy = ait.FirstWinsStrategy([ToyBackend()], performance_validation=False)
    model = ait.Module(mlp(), "mlp", strategy=strategy, strict=strict)
    ait.tune(model, [torch.randn(4, 8), torch.randn(6, 8)], freeze=freeze)
    assert model.state == "tuned"
    return model


def routed(model: ait.Module) -> int:
    return sum(backend.calls for _, backend in model.tuned_graphs)


# -- autograd and training mode --------------------------------------------------------------


def test_backward_through_a_tuned_module_gives_eagers_gradients(toy_backends) -> None:
    model = tuned()
    eager = mlp()
    pre = torch.nn.Linear(8, 8)  # the input is an activation (not a leaf) that needs gradients
    x = torch.randn(5, 8)
    with pytest.warns(RuntimeWarning, match="grad mode is on and an input or a parameter requires grad"):
        model(pre(x)).square().sum().backward()
    eager(pre(x)).square().sum().backward()
    for (name, mine), theirs in zip(model.module.named_parameters(), eager.parameters()):
        assert mine.grad is not None, f"{name} got no gradient"
        torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-5, rtol=1e-4)
    assert pre.weight.grad is not None


def test_frozen_parameters_and_no_grad_run_the_winner(toy_backends) -> None:
    model = tuned()
    before = routed(model)
    with torch.no_grad():
        model(torch.randn(5, 8))
    for p in model.parameters():
        p.requires_grad_(False)  # frozen weights, plain input: nothing needs a gradient
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.randn(5, 8))
    assert routed(model) == before + 2


def test_plain_calls_run_the_winner_because_tune_freezes_the_parameters(toy_backends, tmp_path) -> None:
    """The usual first script: parameters from from_pretrained require grad, and no torch.no_grad()."""
    model = tuned(freeze=True)
    assert not any(p.requires_grad for p in model.parameters())
    assert model.report.frozen == [name for name, _ in mlp().named_parameters()]
    before = routed(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "running this call eager"
        model(torch.randn(5, 8))
    assert routed(model) == before + 1
    path = ait.save(model, tmp_path / "mlp.ait")
    loaded = ait.load(ait.Module(mlp(), "mlp"), path)
    assert not any(p.requires_grad for p in loaded.parameters()), "ait.load freezes as ait.tune does"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded(torch.randn(5, 8))
    kept = ait.load(ait.Module(mlp(), "mlp"), path, freeze=False)
    assert all(p.requires_grad for p in kept.parameters())
    # fine-tuning again: a parameter that requires grad sends calls eager, with the warning
    model.module[0].weight.requires_grad_(True)
    with pytest.warns(RuntimeWarning, match="grad mode is on"):
        model(torch.randn(5, 8))


def test_freeze_false_keeps_the_parameters_trainable(toy_backends) -> None:
    model = tuned(freeze=False)
    assert all(p.requires_grad for p in model.parameters()) and model.report.frozen == []


def test_training_mode_gives_eagers_training_outputs(toy_backends) -> None:
    model = tuned()
    eager = mlp().train()
    x = torch.randn(5, 8)
    model.train()
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="training mode"):
        y = model(x)
    assert_matches_eager(y, eager(x))
    assert_matches_eager(model.module[1].running_mean, eager[1].running_mean)  # statistics updated too


def test_strict_mode_raises_for_training_and_autograd(toy_backends) -> None:
    model = tuned(strict=True)
    with pytest.raises(InferenceOnlyError, match="grad mode is on"):
        model(torch.randn(5, 8))
    model.train()
    with torch.no_grad(), pytest.raises(InferenceOnlyError, match="training mode"):
        model(torch.randn(5, 8))


def test_tune_refuses_a_training_model_or_switches_it_to_eval(toy_backends, caplog) -> None:
    strategy = ait.FirstWinsStrategy([ToyBackend()], performance_validation=False)
    model = ait.Module(mlp().train(), "mlp", strategy=strategy)
    with pytest.raises(InputError, match=r"mlp: in training mode.*model.eval\(\).*set_eval=True"):
        ait.tune(model, [torch.randn(4, 8)])
    stats = model.module[1].running_mean.clone()
    with caplog.at_level("WARNING", logger="aitune"):
        ait.tune(model, [torch.randn(4, 8), torch.randn(6, 8)], set_eval=True)
    assert "switched mlp to eval mode" in caplog.text
    assert not model.module.training and model.state == "tuned"
    assert torch.equal(model.module[1].running_mean, stats), "tuning never updates running statistics"


def test_training_mode_is_irrelevant_when_no_code_reads_it(toy_backends) -> None:
    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())  # never put in eval mode
    model = ait.Module(inner, "plain", strategy=ait.FirstWinsStrategy([ToyBackend()], performance_validation=False))
    ait.tune(model, [torch.randn(2, 8), torch.randn(3, 8)])
    with torch.no_grad():
        model(torch.randn(3, 8))
    assert routed(model) > 0


# -- weights that change ---------------------------------------------------------------------


def test_after_load_state_dict_outputs_follow_the_new_weights_with_a_warning(toy_backends) -> None:
    model = tuned()
    new = {k: v + 0.5 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    model.load_state_dict(new)
    eager = mlp()
    eager.load_state_dict(new)
    x = torch.randn(5, 8)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="weights changed since it was tuned.*toy baked"):
        y = model(x)
    assert_matches_eager(y, eager(x))
    assert "run ait.tune again" in model.stale_reason
    with pytest.raises(ArtifactError, match="weights changed since it was tuned"):
        ait.save(model, "never-written.ait")
    ait.tune(model, [torch.randn(4, 8), torch.randn(6, 8)])  # tuned again from the new weights
    assert model.stale_reason is None
    before = routed(model)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_matches_eager(model(x), eager(x))
    assert routed(model) == before + 1


def test_load_state_dict_on_a_parent_and_in_place_training_updates_are_seen(toy_backends) -> None:
    model = tuned(strict=True)
    parent = torch.nn.Sequential(model)
    parent.load_state_dict(parent.state_dict())  # the same values, written again
    with torch.no_grad(), pytest.raises(StaleWeightsError, match="weights changed"):
        model(torch.randn(5, 8))

    model = tuned(strict=True)
    parent = torch.nn.Sequential(model)
    parent.train()
    with torch.no_grad():
        model.module[0].weight.mul_(2)  # an optimizer step
    parent.eval()
    with torch.no_grad(), pytest.raises(StaleWeightsError):
        model(torch.randn(5, 8))


class LiveBackend(Backend):
    """Runs the module itself, as torch.compile does: it reads the live weights at every call."""

    name = "live"

    def build(self, module: torch.nn.Module, context: object) -> None:
        self.module = module

    def infer(self, *args: object, **kwargs: object) -> object:
        return self.module(*args, **kwargs)

    def follows_weights(self) -> bool:
        return True


def test_check_weights_catches_a_hand_edit_and_the_wrapped_model_still_pickles(toy_backends) -> None:
    model = tuned(strict=True)
    with torch.no_grad():
        model.module[3].bias.add_(1.0)  # no load_state_dict, no .to(), no eval(): unseen until asked
    model.check_weights()
    with torch.no_grad(), pytest.raises(StaleWeightsError):
        model(torch.randn(5, 8))
    copy = pickle.loads(pickle.dumps(model.module))  # the weights hook does not stop torch.save(model)
    copy.load_state_dict(model.module.state_dict())
    assert torch.equal(copy[3].bias, model.module[3].bias)


def test_a_winner_on_the_live_weights_follows_them_and_blocks_offloading(toy_backends) -> None:
    model = tuned()
    live = LiveBackend()
    live.build(model.module, None)
    install(model, [(graph, live) for graph, _ in model.tuned_graphs], None)
    x = torch.randn(5, 8)
    with torch.no_grad():
        model.module[0].weight.add_(1.0)
        model.load_state_dict(model.state_dict())
        assert model.stale_reason is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert_matches_eager(model(x), model.module(x))
    with pytest.raises(RuntimeError, match="live runs on them"):
        model.offload_weights()


def test_offloading_baked_weights_is_not_a_weight_change(toy_backends) -> None:
    model = tuned()
    x = torch.randn(5, 8)
    with torch.no_grad():
        expected = model(x)
        model.offload_weights()
        model.eval()
        assert_matches_eager(model(x), expected)
    assert model.stale_reason is None


# -- what is read from the code --------------------------------------------------------------


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * 1.0


def test_code_digest_sees_forward_and_reads_training_sees_dropout(monkeypatch) -> None:
    module = Scaled()
    before = code_digest(module)
    assert code_digest(Scaled()) == before
    monkeypatch.setattr(Scaled, "forward", lambda self, x: self.fc(x) * 2.0)
    assert code_digest(module) != before
    assert not reads_training(module)
    assert reads_training(torch.nn.Sequential(module, torch.nn.Dropout()))


def test_a_module_with_hooks_of_its_own_tunes_saves_and_loads_and_keeps_them(toy_backends, tmp_path) -> None:
    """Hooks that exist before tuning (transformers installs its own) are the module's: tuning,
    saving and loading keep them, and only a hook added later makes calls run eager."""

    def first_layer_hook(module: torch.nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        return output * 2  # changes the answer: a payload that dropped it would not match eager

    def hooked() -> torch.nn.Module:
        model = mlp()
        model[0].register_forward_hook(first_layer_hook)
        return model

    strategy = ait.FirstWinsStrategy([ToyBackend()], performance_validation=False)
    model = ait.Module(hooked(), "mlp", strategy=strategy)
    ait.tune(model, [torch.randn(4, 8), torch.randn(6, 8)])
    assert model.state == "tuned"
    x = torch.randn(5, 8)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("error")  # a hook the module had when it was tuned draws no warning
        assert_matches_eager(model(x), hooked()(x))
    path = ait.save(model, tmp_path / "hooked.ait")
    loaded = ait.load(hooked(), path)
    assert loaded.state == "tuned"
    with torch.inference_mode():
        assert_matches_eager(loaded(x), hooked()(x))
    loaded.module[2].register_forward_hook(lambda *_: None)
    with torch.inference_mode(), pytest.warns(RuntimeWarning, match="hooks were added"):
        loaded(x)
