"""TorchAOBackend on CPU: accuracy within the declared budget, rejection beyond it, saving without pickle."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from aitune.backend import BuildContext, LoadContext, Tolerance
from aitune.errors import BuildError, ConfigError, SerializationError
from aitune.graph import GraphSpec, Sample, infer_graph
from aitune.testing import (
    TinyMLP,  # noqa: F401 - named in MODULES
    config_from_json,
    config_to_json,
)
from aitune.testing.conformance import run_in_fresh_process
from aitune.validation import validate
from aitune_backend_torchao.backend import TorchAOBackend
from aitune_backend_torchao.config import ModuleFilter, TorchAOBackendConfig

MODULES = {
    "mlp": "TinyMLP()",
    "encoder": "torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)",
}
"""Constructors as source, so the fresh process builds the same architecture."""


def make(kind: str) -> tuple[torch.nn.Module, list[Sample]]:
    torch.manual_seed(0)
    module = eval(MODULES[kind]).eval()
    g = torch.Generator().manual_seed(1)
    shape = (16,) if kind == "mlp" else (6, 32)
    return module, [Sample((torch.randn(b, *shape, generator=g),)) for b in (2, 4)]


def graph_of(module: torch.nn.Module, samples: list[Sample]) -> GraphSpec:
    with torch.no_grad():
        return infer_graph(samples, ["x"], outputs=[module(*s.args) for s in samples])


def build(module: torch.nn.Module, samples: list[Sample], tmp_path: Path, **config: object) -> TorchAOBackend:
    config.setdefault("compile", False)
    backend = TorchAOBackend(TorchAOBackendConfig(**config))  # type: ignore[arg-type]
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    backend.build(module, BuildContext(graph_of(module, samples), samples, torch.device("cpu"), work, tmp_path))
    return backend


def outputs(backend: TorchAOBackend, samples: list[Sample]) -> list[torch.Tensor]:
    return [backend.infer(*s.args, **s.kwargs) for s in samples]


CASES = [(kind, preset) for kind in MODULES for preset in ("int8wo", "int8dq")]


@pytest.mark.parametrize(("kind", "preset"), CASES)
def test_validation_passes_within_the_declared_tolerance(kind: str, preset: str, tmp_path: Path) -> None:
    module, samples = make(kind)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    backend = build(module, samples, tmp_path, quantization=preset)

    report = validate(backend, module, samples, graph_of(module, samples))
    assert report.passed, report.reason
    accuracy = backend.build_info["accuracy"]
    assert 0 < accuracy["max_rel_error"] <= backend.build_info["tolerance"]["rtol"]
    # the build measured the same error validation finds; two quantized runs agree only to a few
    # digits across CPUs (kernels differ with and without AVX-512), so to 5%, not to 1e-6
    assert accuracy["max_rel_error"] == pytest.approx(report.max_rel_error, rel=0.05)
    assert backend.build_info["quantized_tensors"] == 2  # torchao leaves attention's out_proj alone
    for k, v in module.state_dict().items():  # the user's module is not quantized in place
        assert type(v) is torch.Tensor and torch.equal(v, before[k]), k


@pytest.mark.parametrize(("kind", "preset"), CASES)
def test_validation_rejects_when_the_user_tightens_the_tolerance(kind: str, preset: str, tmp_path: Path) -> None:
    module, samples = make(kind)
    measured = build(module, samples, tmp_path, quantization=preset).build_info["accuracy"]["max_rel_error"]
    tight = Tolerance(atol=0.0, rtol=measured / 2, min_cosine=0.0)
    backend = build(module, samples, tmp_path, quantization=preset, tolerance=tight)

    assert backend.tolerance(torch.float32) == tight
    report = validate(backend, module, samples, graph_of(module, samples))
    assert not report.passed
    assert "above the bound" in (report.reason or "")


SUBPROCESS = """
    import json, torch
    from pathlib import Path
    from safetensors.torch import load_file, save_file
    from aitune.backend import LoadContext
    from aitune.testing import config_from_json
    from aitune.graph import GraphSpec
    from aitune.converter import structure
    from aitune.testing import TinyMLP
    from aitune_backend_torchao.backend import TorchAOBackend

    root = Path({root!r})
    saved = json.loads((root / "saved.json").read_text())
    module = eval({module!r}).eval()
    module.load_state_dict(load_file(root / "eager.safetensors"))
    graph = structure(saved["graph"], GraphSpec)
    backend = TorchAOBackend(config_from_json(saved["config"]))
    backend.load(module, root / "payload", LoadContext(graph, torch.device("cpu"), saved["metadata"], root))
    inputs = load_file(root / "inputs.safetensors")
    out = {{k: backend.infer(v) for k, v in inputs.items()}}
    save_file(out, root / "loaded.safetensors")
    print(json.dumps(backend.build_info))
"""


def save_and_load_elsewhere(
    backend: TorchAOBackend, module: torch.nn.Module, kind: str, samples: list[Sample], tmp_path: Path
) -> dict:
    from aitune.converter import unstructure

    payload = tmp_path / "payload"
    payload.mkdir()
    metadata = backend.save(payload)
    save_file(module.state_dict(), tmp_path / "eager.safetensors")
    save_file({str(i): s.args[0] for i, s in enumerate(samples)}, tmp_path / "inputs.safetensors")
    saved = {
        "config": config_to_json(backend.config),
        "metadata": metadata,
        "graph": unstructure(graph_of(module, samples)),
    }
    (tmp_path / "saved.json").write_text(json.dumps(saved))
    info = run_in_fresh_process(SUBPROCESS.format(root=str(tmp_path), module=MODULES[kind]))
    loaded = load_file(tmp_path / "loaded.safetensors")
    for i, want in enumerate(outputs(backend, samples)):
        torch.testing.assert_close(loaded[str(i)], want, rtol=0, atol=0)
    return {"metadata": metadata, "info": info, "files": sorted(p.name for p in payload.iterdir())}


@pytest.mark.parametrize(("kind", "preset"), CASES)
def test_save_then_load_in_a_fresh_process_gives_the_same_outputs(kind: str, preset: str, tmp_path: Path) -> None:
    module, samples = make(kind)
    backend = build(module, samples, tmp_path, quantization=preset)

    result = save_and_load_elsewhere(backend, module, kind, samples, tmp_path)
    assert result["metadata"]["weights"] == "safetensors"
    assert result["files"] == ["quantized.safetensors"]  # quantized weights only, no pickle
    assert result["info"]["weights"] == "safetensors"


def test_compiled_build_loads_compiled_in_a_fresh_process(tmp_path: Path) -> None:
    module, samples = make("mlp")
    backend = build(module, samples, tmp_path, quantization="int8dq", compile=True)
    assert backend.build_info["compiled"] is True
    assert validate(backend, module, samples, graph_of(module, samples)).passed

    result = save_and_load_elsewhere(backend, module, "mlp", samples, tmp_path)
    assert result["info"]["compiled"] is True


def test_weights_torchao_cannot_flatten_are_requantized_at_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchao.prototype.safetensors import safetensors_utils

    module, samples = make("mlp")
    backend = build(module, samples, tmp_path, quantization="int8dq")
    monkeypatch.setattr(safetensors_utils, "ALLOWED_TENSORS_SUBCLASSES", [])
    payload = tmp_path / "payload"
    payload.mkdir()
    metadata = backend.save(payload)
    assert metadata["weights"] == "requantize"
    assert list(payload.iterdir()) == []

    fresh = TorchAOBackend(backend.config)
    fresh.load(module, payload, LoadContext(graph_of(module, samples), torch.device("cpu"), metadata, tmp_path))
    for got, want in zip(outputs(fresh, samples), outputs(backend, samples)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("preset", ["int4wo", "fp8dq"])
def test_gpu_presets_are_unavailable_on_cpu_with_a_reason(preset: str) -> None:
    module, samples = make("mlp")
    backend = TorchAOBackend(TorchAOBackendConfig(quantization=preset))
    reason = backend.unsupported_reason(graph_of(module, samples), torch.device("cpu"))
    assert reason and "CUDA" in reason and "int8dq" in reason


def test_fp8_weight_only_runs_on_cpu(tmp_path: Path) -> None:
    module, samples = make("mlp")
    backend = TorchAOBackend(TorchAOBackendConfig(quantization="fp8wo", compile=False))
    assert backend.unsupported_reason(graph_of(module, samples), torch.device("cpu")) is None
    backend = build(module, samples, tmp_path, quantization="fp8wo")
    assert validate(backend, module, samples, graph_of(module, samples)).passed


def test_custom_torchao_config_round_trips_through_json(tmp_path: Path) -> None:
    from torchao.quantization import Int8WeightOnlyConfig, PerTensor

    config = TorchAOBackendConfig(quantization=Int8WeightOnlyConfig(granularity=PerTensor()), compile=False)
    assert config.quantization["_type"] == "Int8WeightOnlyConfig"
    assert config_from_json(json.loads(json.dumps(config_to_json(config)))) == config

    module, samples = make("mlp")
    backend = build(module, samples, tmp_path, quantization=config.quantization)
    assert backend.tolerance(torch.float32) == TorchAOBackend(TorchAOBackendConfig(quantization="int8wo")).tolerance(
        torch.float32
    )
    assert validate(backend, module, samples, graph_of(module, samples)).passed
    result = save_and_load_elsewhere(backend, module, "mlp", samples, tmp_path)
    assert result["metadata"]["weights"] == "safetensors"


def test_custom_config_without_a_json_form_runs_but_refuses_to_save(tmp_path: Path) -> None:
    import dataclasses

    from torchao.quantization import Int8WeightOnlyConfig

    @dataclasses.dataclass
    class MyConfig(Int8WeightOnlyConfig):  # outside torchao's modules: config_from_dict cannot find it
        pass

    config = TorchAOBackendConfig(quantization=MyConfig(), compile=False)
    assert isinstance(config.quantization, MyConfig)
    with pytest.raises(SerializationError, match="no JSON form"):
        TorchAOBackend(config).save(tmp_path)


def test_callable_filter_quantizes_but_refuses_to_save(tmp_path: Path) -> None:
    module, samples = make("mlp")
    backend = build(module, samples, tmp_path, filter_fn=lambda m, fqn: fqn == "fc1")
    assert backend.build_info["quantized_tensors"] == 1
    with pytest.raises(SerializationError, match="ModuleFilter"):
        backend.save(tmp_path)


def test_module_filter_selects_by_name_and_type_and_saves(tmp_path: Path) -> None:
    module, samples = make("encoder")
    config = TorchAOBackendConfig(filter_fn={"exclude": ["linear2"]})
    assert config.filter_fn == ModuleFilter(exclude=("linear2",))
    assert config_from_json(json.loads(json.dumps(config_to_json(config)))) == config

    backend = build(module, samples, tmp_path, filter_fn=ModuleFilter(exclude=["linear2"]))
    assert backend.build_info["quantized_tensors"] == 1  # linear1 only
    # attention reads out_proj.weight directly, which torchao's int8 tensor does not support
    with pytest.raises(BuildError, match="fails to run: NotImplementedError"):
        build(module, samples, tmp_path, filter_fn=ModuleFilter(types=["NonDynamicallyQuantizableLinear"]))
    with pytest.raises(BuildError, match="quantized no weight"):
        build(module, samples, tmp_path, filter_fn=ModuleFilter(types=["Conv2d"]))


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="unknown preset 'int3'"):
        TorchAOBackendConfig(quantization="int3")
    with pytest.raises(ConfigError, match="_type"):
        TorchAOBackendConfig(quantization={"group_size": 32})
    with pytest.raises(ConfigError, match="filter_fn"):
        TorchAOBackendConfig(filter_fn=42)
    assert ModuleFilter(include="encoder.*").include == ("encoder.*",)


def test_tolerance_is_the_presets_and_never_tighter_than_the_dtypes() -> None:
    int8dq = TorchAOBackend(TorchAOBackendConfig(quantization="int8dq"))
    assert int8dq.tolerance(torch.float32) == Tolerance(atol=1e-4, rtol=0.05, min_cosine=0.995)
    bf16 = int8dq.tolerance(torch.bfloat16)
    assert bf16 is not None and bf16.atol >= 1e-2 and bf16.min_cosine <= 0.99
    assert int8dq.tolerance(torch.int64) is None  # integer outputs must match exactly


def test_config_and_presets_import_no_torchao() -> None:
    code = textwrap.dedent(
        """
        import sys
        import aitune_backend_torchao.backend, aitune_backend_torchao.config, aitune_backend_torchao.plugin
        print("torchao" in sys.modules)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_int8_weight_only_is_chosen_under_a_top1_budget_and_a_tighter_budget_rejects_it(toy_backends) -> None:
    """The user's metric decides: int8 weight-only keeps 99% of a classifier's top-1 answers, not 99.9% of its scale."""
    import aitune.torch as ait
    from aitune import metrics
    from aitune.testing.backends import ToyBackend

    def classifier() -> ait.Module:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 100)).eval()
        int8 = TorchAOBackend(TorchAOBackendConfig(quantization="int8wo", compile=False))
        strategy = ait.FirstWinsStrategy([int8, ToyBackend()], performance_validation=False)
        return ait.Module(net, "classifier", strategy=strategy)

    g = torch.Generator().manual_seed(1)
    data = [torch.randn(16, 64, generator=g), torch.randn(32, 64, generator=g)]
    report = ait.tune(classifier(), data, metric=metrics.top1_agreement, accuracy_budget=0.01)
    int8 = report.modules[0].graphs[0].candidates[0]  # FirstWins: the first accepted candidate serves
    assert int8.backend == "torchao" and int8.status == "selected" and int8.metric >= 0.99, int8.reason
    report = ait.tune(classifier(), data, metric=metrics.relative_accuracy, accuracy_budget=0.001)
    int8, fp32 = report.modules[0].graphs[0].candidates
    assert int8.status == "failed" and "accuracy_budget" in int8.reason and int8.metric < 0.999
    assert fp32.status == "selected", "the next candidate serves"


# -- a config read from a file --------------------------------------------------------------------

HOSTILE_FORMS = [
    {"_type": "torch.dtype", "_data": "manual_seed"},  # torchao's reader returns torch.manual_seed for this
    {
        "_type": "Int8WeightOnlyConfig",
        "_version": 2,
        "_data": {"group_size": {"_type": "torch.dtype", "_data": "save"}},
    },
    {"_type": "Int8WeightOnlyConfig", "_data": {"granularity": {"_type": "PerRow", "_data": {"dim": {"_type": "x"}}}}},
    {"_type": "IntxWeightOnlyConfig", "_data": {}},  # a torchao config, but none of the presets'
    {"_type": "Int8WeightOnlyConfig", "_data": {"granularity": {"_type": "MappingType", "_data": "__class__"}}},
    {"_type": "Int8WeightOnlyConfig", "_data": {"layout": "torchao.dtypes:PlainLayout"}},
]


@pytest.mark.parametrize("form", HOSTILE_FORMS, ids=range(len(HOSTILE_FORMS)))
def test_a_saved_config_naming_anything_off_the_lists_is_refused_before_torchao_sees_it(form, monkeypatch) -> None:
    """``config_from_dict`` is never called: a saved form is read by aitune from closed lists, and
    anything else is refused when the config is read, in the user's code as from a file."""
    import torchao.core.config

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("config_from_dict was called")

    monkeypatch.setattr(torchao.core.config, "config_from_dict", never)
    with pytest.raises(ConfigError, match="quantization"):
        config_from_json({"backend": "torchao", "quantization": form}, from_file=True)
    with pytest.raises(ConfigError, match="quantization"):
        TorchAOBackendConfig(quantization=form)


def test_the_presets_forms_read_back_equal_without_torchaos_reader(monkeypatch) -> None:
    import torchao.core.config
    from torchao.core.config import config_to_dict
    from torchao.quantization import Int8WeightOnlyConfig, PerGroup

    from aitune_backend_torchao.config import from_json_form
    from aitune_backend_torchao.presets import PRESETS

    monkeypatch.setattr(torchao.core.config, "config_from_dict", None)
    for preset in PRESETS.values():
        made = preset.make()
        assert from_json_form(json.loads(json.dumps(config_to_dict(made)))) == made, preset.name
    config = TorchAOBackendConfig(quantization=Int8WeightOnlyConfig(granularity=PerGroup(32)), compile=False)
    data = json.loads(json.dumps(config_to_json(config)))
    assert config_from_json(data, from_file=True) == config


def test_saved_quantized_weights_naming_a_torch_function_as_dtype_are_refused(tmp_path: Path) -> None:
    from aitune_backend_torchao import weights

    module, samples = make("mlp")
    backend = build(module, samples, tmp_path, quantization="int8wo")
    payload = tmp_path / "payload"
    payload.mkdir()
    metadata = backend.save(payload)
    path = payload / weights.FILE
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        header, flat = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    name = next(k for k in header if k != "tensor_names")
    text = header[name]
    assert '"torch.dtype"' in text, "the metadata names dtypes (the test needs one to replace)"
    hostile = json.loads(text)

    def poison(node: object) -> None:
        if isinstance(node, dict):
            if node.get("_type") == "torch.dtype":
                node["_data"] = "manual_seed"
            for value in node.values():
                poison(value)
        elif isinstance(node, list):
            for value in node:
                poison(value)

    poison(hostile)
    save_file(flat, str(path), metadata={**header, name: json.dumps(hostile)})
    fresh = TorchAOBackend(backend.config)
    with pytest.raises(SerializationError, match="manual_seed"):
        fresh.load(module, payload, LoadContext(graph_of(module, samples), torch.device("cpu"), metadata, tmp_path))
