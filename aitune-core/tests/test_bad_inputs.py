"""Bad input, good errors: each mistake gets a message that names the problem and the fix.

docs/errors.md lists every case below with its message.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from aitune_testkit.doubles import SlowModule

import aitune.torch as ait
from aitune.engine.tuner import check_devices
from aitune.errors import InputError
from aitune.testing.backends import ToyBackend, ToyConfig
from aitune.torch.task.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig

QUICK = ProfilingConfig(
    measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=10, warmup=1, window=5), extend_s=0.0
)


def _model(inner: torch.nn.Module | None = None, **kwargs) -> ait.Module:
    strategy = ait.OneBackendStrategy(ToyBackend(ToyConfig()), profiling_config=QUICK).enable_performance_validation(
        False
    )
    return ait.Module(inner if inner is not None else SlowModule(), "m", strategy=strategy, **kwargs)


def test_an_empty_dataset(toy_backends):
    with pytest.raises(InputError, match="the dataset is empty: give ait.tune at least one input batch"):
        ait.tune(_model(), [])


def test_items_of_mismatched_structure_name_the_item(toy_backends):
    data = [torch.randn(2, 8), {"x": torch.randn(2, 8), "weird": 1}]
    with pytest.raises(
        InputError,
        match=r"the model raised on dataset item 1 \(TypeError: .*weird.*\)\. It has another "
        r"structure than item 0; give every item the structure the model takes\.",
    ) as info:
        ait.tune(_model(), data)
    assert isinstance(info.value.__cause__, TypeError), "the model's own error stays attached"


def test_a_model_error_on_a_well_formed_item_still_names_the_item(toy_backends):
    with pytest.raises(
        InputError, match=r"dataset item 0 \(RuntimeError: .*shapes cannot be multiplied.*\)\. Check that"
    ):
        ait.tune(_model(), [torch.randn(2, 5)])


def test_inputs_that_require_grad_tune_and_then_run_eager_with_gradients(toy_backends):
    model = _model()
    data = [torch.randn(2, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)]
    report = ait.tune(model, data)
    assert report.modules[0].status == "tuned", "recorded samples are detached copies"
    x = torch.randn(3, 8, requires_grad=True)
    with pytest.warns(
        RuntimeWarning,
        match=r"running this call eager: grad mode is on and an input or a parameter requires grad.*"
        r"call it under torch.inference_mode\(\) or torch.no_grad\(\)",
    ):
        y = model(x)
    y.sum().backward()
    assert x.grad is not None, "gradients flow through the eager fallback"
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x)  # under no_grad the tuned backend runs, silently


def test_a_model_split_across_devices():
    inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    inner[1].to("meta")
    with pytest.raises(InputError, match="some weights are on the meta device"):
        check_devices(ait.Module(inner, "split"))


def test_a_model_split_across_devices_names_the_devices(monkeypatch):
    """Two real devices need two devices; the check sees only the device names, so fake them."""

    class Fake:
        def __init__(self, device):
            self.device = torch.device(device)

    module = ait.Module(torch.nn.Linear(4, 4), "split")
    monkeypatch.setattr(module.module, "parameters", lambda: iter([Fake("cpu"), Fake("cuda:1")]))
    with pytest.raises(
        InputError,
        match=r"split: its weights are split across devices \(cpu, cuda:1\); aitune tunes a "
        r"module on one device: move it with .to\(device\), or wrap the part on each device",
    ):
        check_devices(module)


def test_a_model_with_weights_on_meta_is_refused_before_running_the_dataset(toy_backends):
    model = _model()
    model.module.to("meta")
    with pytest.raises(
        InputError, match=r"m: some weights are on the meta device \(not loaded yet\): load the weights"
    ):
        ait.tune(model, [torch.randn(2, 8)])


def test_nan_in_the_inputs(toy_backends):
    x = torch.randn(2, 8)
    x[0, 3] = float("nan")
    model = _model()
    with pytest.warns(RuntimeWarning, match=r"m: tuning failed, so it runs eager \(no speed-up\): .*holds NaN"):
        report = ait.tune(model, [x])
    assert report.modules[0].status == "failed"
    assert "input 'x' holds NaN values" in report.modules[0].error
    assert "give ait.tune finite inputs" in report.modules[0].error
    assert model.state == "passthrough", "the module still runs, eager"
    with pytest.raises(InputError, match="holds NaN values"):
        ait.tune(_model(), [x], fail_fast=True)


def test_inf_in_the_inputs_is_allowed(toy_backends):
    """Attention masks use -inf: infinities are real values, only NaN is refused."""
    x = torch.randn(2, 8)
    mask = torch.zeros(2, 8)
    mask[0, 0] = float("-inf")
    report = ait.tune(_model(), [((x, mask.exp()), {})])
    assert report.modules[0].status == "tuned"


@dataclasses.dataclass
class Result:
    logits: torch.Tensor


class ReturnsDataclass(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return Result(self.fc(x))


def test_a_dataclass_output_comes_back_as_that_dataclass(toy_backends):
    model = _model(ReturnsDataclass())
    report = ait.tune(model, [torch.randn(2, 8)])
    assert report.modules[0].status != "failed", report.modules[0].error
    assert isinstance(model(torch.randn(2, 8)).logits, torch.Tensor)
    assert type(model(torch.randn(2, 8))) is Result


class ReturnsStringAndNone(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x), "logits", None


def test_string_and_none_outputs_are_kept(toy_backends):
    model = _model(ReturnsStringAndNone())
    report = ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8)])
    assert report.modules[0].status == "tuned"
    y, label, nothing = model(torch.randn(3, 8))
    assert y.shape == (3, 8) and label == "logits" and nothing is None


# -- a failure is never silent ------------------------------------------------------------------------


def _failing(name: str, **kwargs) -> ait.Module:
    """A module whose tuning fails: its dynamic_shapes contradict the data."""
    return (
        _model(dynamic_shapes={"x": (1, 9)}, **kwargs)
        if name == "m"
        else ait.Module(SlowModule(), name, strategy=_model().strategy, dynamic_shapes={"x": (1, 9)}, **kwargs)
    )


def test_a_module_whose_tuning_fails_warns_once_with_the_reason_and_the_fix(toy_backends):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's own filter: what a user who set nothing sees
        report = ait.tune(_failing("m"), [torch.randn(1, 8)])
    assert report.modules[0].status == "failed"
    [warned] = [w for w in caught if "tuning failed" in str(w.message)]
    assert warned.category is RuntimeWarning
    assert "axis 1 is 9" in str(warned.message) and "fail_fast=True" in str(warned.message)


def test_a_strict_module_or_fail_fast_raises_its_tuning_failure(toy_backends):
    with pytest.raises(InputError, match="axis 1 is 9"):
        ait.tune(_failing("m", strict=True), [torch.randn(1, 8)])
    with pytest.raises(InputError, match="axis 1 is 9"):
        ait.tune(_failing("m"), [torch.randn(1, 8)], fail_fast=True)


def test_an_unsafe_cache_folder_raises_from_ait_tune(toy_backends, tmp_path, monkeypatch):
    """An error about the environment is no module's failure: it raises, never a silent eager run."""
    import os

    from aitune.errors import ConfigError

    if not hasattr(os, "getuid"):
        pytest.skip("POSIX modes only")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("AITUNE_CACHE_DIR", str(shared))
    model = _model()
    with pytest.raises(ConfigError, match="not yours alone"):
        ait.tune(model, [torch.randn(1, 8)])
    assert model.state != "tuned"


def test_the_report_and_the_cli_summary_lead_with_a_failure(toy_backends, capsys):
    from aitune.cli import _print_summary
    from aitune.render import render_markdown

    class Pipe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.good = _model(SlowModule())
            self.bad = _failing("bad")

        def forward(self, x):
            return self.bad(self.good(x))

    with pytest.warns(RuntimeWarning, match="bad: tuning failed"):
        report = ait.tune(Pipe(), [torch.randn(1, 8)])
    markdown = render_markdown(report)
    first_row = [line for line in markdown.splitlines() if line.startswith("| ")][2]  # after the header rows
    assert "1 module(s) failed to tune and run eager: bad (" in first_row, markdown
    _print_summary(report)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("aitune: 1 module(s) failed to tune and run eager: bad (")
    names = [line.split("\t")[0] for line in out]
    assert names.index("bad") < names.index("m"), "the failed module is listed first"
