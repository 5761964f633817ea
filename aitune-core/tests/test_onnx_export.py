"""ONNX export: names, dynamic axes, nested IO, external data, both exporters, and the errors."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch

onnx = pytest.importorskip("onnx", reason="ONNX export needs onnx, which aitune-core does not depend on")
pytest.importorskip("onnxscript", reason="the dynamo ONNX exporter needs onnxscript")

from aitune.converter import structure  # noqa: E402
from aitune.errors import BuildError, ConfigError  # noqa: E402
from aitune.graph import Sample, infer_graph  # noqa: E402
from aitune.onnx_export import ONNXExportConfig, export_onnx, onnx_name  # noqa: E402

EXPORTERS = ["dynamo", "torchscript"]


def _graph(module, samples, arg_names):
    with torch.no_grad():
        outputs = [module(*s.args, **s.kwargs) for s in samples]
    return infer_graph(samples, arg_names, outputs=outputs)


def _run(export, feed):
    ort = pytest.importorskip("onnxruntime", reason="running the exported model needs onnxruntime")
    session = ort.InferenceSession(str(export.path), providers=["CPUExecutionProvider"])
    arrays = session.run(list(export.output_names), {k: v.numpy() for k, v in feed.items()})
    return [torch.from_numpy(a) for a in arrays]


def _dims(path: Path, which: str = "input"):
    model = onnx.load(str(path), load_external_data=False)
    values = model.graph.input if which == "input" else model.graph.output
    return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in values}


class MLP(torch.nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(width, 32), torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Nested(torch.nn.Module):
    """Tuple and dict inputs, a dict output holding a tuple with a constant, and an ignored input."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, inputs, unused):
        h = self.proj(x) * inputs["mask"].unsqueeze(-1)
        return {"hidden": h, "extra": (h.sum(-1) + inputs["bias"][0], None)}


def _nested_samples():
    g = torch.Generator().manual_seed(0)
    return [
        Sample(
            (
                torch.randn(b, s, 8, generator=g),
                {"mask": torch.rand(b, s, generator=g), "bias": (torch.ones(1),)},
                torch.ones(3),
            )
        )
        for b, s in [(2, 5), (4, 7)]
    ]


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_mlp_dynamic_batch_matches_eager_at_an_unseen_size(tmp_path, exporter):
    module = MLP().eval()
    samples = [Sample((torch.randn(b, 16),)) for b in (2, 8)]
    graph = _graph(module, samples, ["x"])
    export = export_onnx(
        module, graph, samples[0], tmp_path, ONNXExportConfig(exporter=exporter, fallback_to_torchscript=False)
    )

    assert export.exporter == exporter
    assert export.fallback_reason is None
    assert export.files == ("model.onnx",)
    assert export.path == tmp_path / "model.onnx"
    assert (export.input_names, export.output_names) == (("x",), ("output",))
    assert export.opset >= 17
    assert _dims(export.path)["x"] == ["batch", 16]
    x = torch.randn(5, 16)
    (got,) = _run(export, {"x": x})
    torch.testing.assert_close(got, module(x).detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_nested_inputs_and_outputs_are_flattened_to_named_tensors_and_restored(tmp_path, exporter):
    module = Nested().eval()
    samples = _nested_samples()
    graph = _graph(module, samples, ["x", "inputs", "unused"])
    export = export_onnx(
        module, graph, samples[0], tmp_path, ONNXExportConfig(exporter=exporter, fallback_to_torchscript=False)
    )

    assert export.input_names == ("x", "inputs_mask", "inputs_bias_0", "unused")
    assert export.output_names == ("hidden", "extra_0")
    inputs = _dims(export.path)
    assert list(inputs) == list(export.input_names), "every graph input is an ONNX input, in graph order"
    assert inputs["x"] == ["batch", "d0", 8] and inputs["inputs_mask"] == ["batch", "d0"]
    x, mask = torch.randn(3, 6, 8), torch.rand(3, 6)
    feed = dict(zip(export.input_names, [x, mask, torch.full((1,), 2.0), torch.ones(3)]))
    restored = graph.unflatten_outputs(_run(export, feed))
    expected = module(x, {"mask": mask, "bias": (torch.full((1,), 2.0),)}, torch.ones(3))
    assert restored["extra"][1] is None
    torch.testing.assert_close(restored["hidden"], expected["hidden"].detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(restored["extra"][0], expected["extra"][0].detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_external_data_lists_every_file_the_model_needs(tmp_path, exporter):
    module = MLP(width=256).eval()
    samples = [Sample((torch.randn(b, 256),)) for b in (2, 3)]
    graph = _graph(module, samples, ["x"])
    config = ONNXExportConfig(exporter=exporter, external_data=True, fallback_to_torchscript=False)
    export = export_onnx(module, graph, samples[0], tmp_path / "out", config)
    assert export.files == ("model.onnx", "model.onnx.data")

    moved = tmp_path / "moved"
    moved.mkdir()
    for name in export.files:
        shutil.copy(tmp_path / "out" / name, moved / name)
    shutil.rmtree(tmp_path / "out")
    x = torch.randn(4, 256)
    (got,) = _run(attrs.evolve(export, path=moved / "model.onnx"), {"x": x})
    torch.testing.assert_close(got, module(x).detach(), rtol=1e-4, atol=1e-5)


def test_small_models_stay_in_one_file_by_default(tmp_path):
    module = MLP(width=256).eval()
    samples = [Sample((torch.randn(2, 256),))]
    export = export_onnx(
        module, _graph(module, samples, ["x"]), samples[0], tmp_path, ONNXExportConfig(exporter="torchscript")
    )
    assert export.files == ("model.onnx",)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


def test_opset_is_configurable(tmp_path):
    module = MLP().eval()
    samples = [Sample((torch.randn(2, 16),))]
    config = ONNXExportConfig(exporter="torchscript", opset=17)
    export = export_onnx(module, _graph(module, samples, ["x"]), samples[0], tmp_path, config)
    assert export.opset == 17


class Cummax(torch.nn.Module):
    def forward(self, x):
        return torch.cummax(x, 0)[0]


class DataDependent(torch.nn.Module):
    def forward(self, x):
        return x * 2 if x.sum() > 0 else x - 1


class LoopsOverBatch(torch.nn.Module):
    def forward(self, x):
        return torch.stack([x[i] * i for i in range(x.shape[0])])


def test_an_unsupported_operator_is_named_by_both_exporters(tmp_path):
    samples = [Sample((torch.randn(3, 4),))]
    graph = _graph(Cummax(), samples, ["x"])
    with pytest.raises(BuildError) as info:
        export_onnx(Cummax(), graph, samples[0], tmp_path)
    message = str(info.value)
    assert "aten.cummax" in message and "aten::cummax" in message
    assert "dynamo exporter" in message and "torchscript exporter" in message


def test_the_torchscript_fallback_never_freezes_a_data_dependent_branch_unless_asked(tmp_path):
    """The tracer keeps only the branch its sample took: refused, unless the user opts in."""
    samples = [Sample((torch.rand(3, 4) + 0.1,))]
    graph = _graph(DataDependent(), samples, ["x"])
    with pytest.raises(BuildError, match="TorchScript tracer reports data-dependent control flow") as refused:
        export_onnx(DataDependent(), graph, samples[0], tmp_path)
    assert "trace_control_flow=True" in str(refused.value)

    opted = ONNXExportConfig(trace_control_flow=True)
    export = export_onnx(DataDependent(), graph, samples[0], tmp_path, opted)
    assert export.exporter == "torchscript"
    assert "data-dependent" in (export.fallback_reason or ""), "the report says why dynamo was not used"

    with pytest.raises(BuildError, match="data-dependent control flow"):
        export_onnx(DataDependent(), graph, samples[0], tmp_path, ONNXExportConfig(fallback_to_torchscript=False))


def test_the_torchscript_variant_on_data_dependent_control_flow_does_not_apply_and_says_why_in_whole_words(tmp_path):
    """By design, not a fault: the report lists the TorchScript-export variant as not applicable, and
    the tracer's words are cut after a whole word, never mid-word ("This means tha)")."""
    from aitune.errors import NotApplicableError

    samples = [Sample((torch.rand(3, 4) + 0.1,))]
    graph = _graph(DataDependent(), samples, ["x"])
    with pytest.raises(NotApplicableError, match="TorchScript tracer reports data-dependent control flow") as refused:
        export_onnx(DataDependent(), graph, samples[0], tmp_path, ONNXExportConfig(exporter="torchscript"))
    quoted = re.search(r"Python value at \S+: (.*?)\), so its graph", str(refused.value), re.S).group(1)
    assert quoted.endswith(("…", ".", "!")), quoted
    assert quoted.removesuffix("…").split()[-1] in {"means", "that", "the", "trace", "incorrect.", "future."}, quoted


def test_an_axis_the_exporter_fixes_is_refused_not_silently_static(tmp_path):
    samples = [Sample((torch.randn(b, 4),)) for b in (2, 4)]
    graph = _graph(LoopsOverBatch(), samples, ["x"])
    with pytest.raises(BuildError, match=r"fixed axis 0 of input 'x' \(dim 'batch'"):
        export_onnx(LoopsOverBatch(), graph, samples[0], tmp_path, ONNXExportConfig(fallback_to_torchscript=False))


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"exporter": "tflite"}, "exporter"),
        ({"opset": 3}, "opset"),
        ({"opset": "17"}, "opset"),
        ({"external_data": "yes"}, "external_data"),
        ({"check": None}, "check"),
        ({"fallback_to_torchscript": 1}, "fallback_to_torchscript"),
    ],
)
def test_bad_export_config_is_refused_with_the_field_named(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        ONNXExportConfig(**kwargs)


def test_export_config_from_json_refuses_unknown_keys():
    assert structure({"exporter": "torchscript", "opset": 17}, ONNXExportConfig) == ONNXExportConfig(
        exporter="torchscript", opset=17
    )
    with pytest.raises(ConfigError, match="opset_version"):
        structure({"opset_version": 17}, ONNXExportConfig)


def test_onnx_names_are_valid_identifiers():
    assert onnx_name("inputs.mask") == "inputs_mask"
    assert onnx_name("args.2") == "args_2"
    assert onnx_name("0", "output") == "output_0"
    assert onnx_name("", "output") == "output"


def test_importing_the_module_imports_no_onnx():
    code = (
        "import sys, aitune.onnx_export; print([m for m in ('onnx', 'onnxscript', 'onnxruntime') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_an_export_leaves_the_modules_modes_as_they_were(tmp_path):
    """The TorchScript exporter restores the mode of the wrapper it is handed; the user's model stays in eval."""
    samples = [Sample((torch.rand(3, 4) + 0.1,))]
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1)).eval()
    graph = _graph(module, samples, ["x"])
    for config in (ONNXExportConfig(exporter="torchscript"), ONNXExportConfig()):
        export_onnx(module, graph, samples[0], tmp_path, config)
        assert not any(m.training for m in module.modules()), config.exporter
    with pytest.raises(BuildError):
        export_onnx(DataDependent().eval(), _graph(DataDependent(), samples, ["x"]), samples[0], tmp_path / "f")
    branchy = DataDependent().eval()
    with pytest.raises(BuildError):
        export_onnx(branchy, graph, samples[0], tmp_path / "g", ONNXExportConfig(exporter="torchscript"))
    assert not branchy.training, "a refused export leaves the mode as it was too"


class MaskShortcut(torch.nn.Module):
    """A "mask all ones?" shortcut as transformers models have had: both sides give one answer on
    an all-ones mask, so a trace of the general (padded) side is right for every mask.
    ``wrong=True`` makes the shortcut answer otherwise, so no trace of one side is right."""

    def __init__(self, wrong: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 4)
        self.wrong = wrong

    def forward(self, x, attention_mask):
        y = self.fc(x)
        if attention_mask.all():  # nothing padded: skip the mask
            return y.sum(1) * (2.0 if self.wrong else 1.0)
        return (y * attention_mask.unsqueeze(-1)).sum(1)


def _masked(b: int, s: int, padded: bool) -> Sample:
    mask = torch.ones(b, s, dtype=torch.long)
    if padded:
        mask[-1, s // 2 :] = 0
    return Sample((torch.randn(b, s, 4), mask))


def test_a_traced_mask_shortcut_is_judged_on_the_other_side_and_kept(tmp_path):
    """Traced from a padded mask, the shortcut's branch takes the general side; an all-ones mask
    takes the other and the trace still answers as eager there: the trace is kept."""
    for samples in ([_masked(1, 6, False), _masked(3, 8, True)], [_masked(1, 6, False), _masked(2, 8, False)]):
        graph = _graph(MaskShortcut(), samples, ["x", "attention_mask"])
        torchscript = ONNXExportConfig(exporter="torchscript")
        export = export_onnx(MaskShortcut(), graph, samples[0], tmp_path, torchscript, samples=samples)
        (branch,) = export.traced_branches
        assert branch["kind"] == "value" and branch["other_side_checked"], branch
        assert branch["traced"] == ["False"] and branch["other_side"] == "recorded call 0", "all ones: the other side"
        assert branch["site"].startswith("test_onnx_export.py:")
        for probe in (_masked(2, 7, False), _masked(2, 7, True)):  # either side, a length not recorded
            x, mask = probe.args
            (out,) = _run(export, {"x": x, "attention_mask": mask})
            torch.testing.assert_close(out, MaskShortcut()(x, mask), rtol=1e-4, atol=1e-5)


def test_a_traced_branch_whose_other_side_differs_is_refused(tmp_path):
    samples = [_masked(1, 6, False), _masked(3, 8, True)]
    graph = _graph(MaskShortcut(wrong=True), samples, ["x", "attention_mask"])
    with pytest.raises(BuildError, match="data-dependent control flow") as refused:
        export_onnx(MaskShortcut(wrong=True), graph, samples[0], tmp_path, ONNXExportConfig(exporter="torchscript"), samples=samples)  # fmt: skip
    message = str(refused.value)
    assert "the trace differs from eager" in message and "test_onnx_export.py:" in message, message
    assert "trace_control_flow=True" in message


def test_a_value_branch_no_input_flips_stays_refused(tmp_path):
    samples = [Sample((torch.rand(3, 4) + 0.1,)), Sample((torch.rand(5, 4) + 0.1,))]
    graph = _graph(DataDependent(), samples, ["x"])
    with pytest.raises(BuildError, match="no input aitune could make takes the other side") as refused:
        export_onnx(DataDependent(), graph, samples[0], tmp_path, ONNXExportConfig(exporter="torchscript"), samples=samples)  # fmt: skip
    assert "[True]" in str(refused.value), "the value every input gave is named"


class RefusesUnpadded(MaskShortcut):
    def forward(self, x, attention_mask):
        if attention_mask.all():
            raise ValueError("pad the batch")
        return (self.fc(x) * attention_mask.unsqueeze(-1)).sum(1)


def test_an_input_the_model_refuses_judges_nothing(tmp_path):
    """The all-ones probe raises in eager: it is passed over, so the branch's other side stays unseen."""
    samples = [_masked(2, 6, True), _masked(3, 8, True)]
    graph = _graph(RefusesUnpadded(), samples, ["x", "attention_mask"])
    with pytest.raises(BuildError, match="no input aitune could make takes the other side"):
        export_onnx(RefusesUnpadded(), graph, samples[0], tmp_path, ONNXExportConfig(exporter="torchscript"), samples=samples)  # fmt: skip
