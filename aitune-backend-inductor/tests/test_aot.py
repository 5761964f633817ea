"""TorchInductorAotBackend on CPU: dynamic dims, structured inputs, a load that compiles nothing."""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from aitune.backend import LoadContext
from aitune.converter import unstructure
from aitune.errors import BuildError, SerializationError
from aitune.graph import Sample
from aitune.testing import assert_matches_eager
from aitune.testing.conformance import run_in_fresh_process
from aitune.validation import validate
from aitune_backend_inductor.aot import TorchInductorAotBackend
from aitune_backend_inductor.package import compatibility_problem


class Scaled(torch.nn.Module):
    """A positional input, a keyword-only input and a dict output: the structure must survive."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.fc = torch.nn.Linear(16, 8)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        y = torch.relu(self.fc(x)) * scale
        return {"y": y, "total": y.sum(dim=1)}


def samples(*batches: int, seed: int = 1) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    return [Sample((torch.randn(b, 16, generator=g),), {"scale": torch.rand(b, 1, generator=g)}) for b in batches]


@pytest.fixture(scope="module")
def built(build):
    module = Scaled().eval()
    backend, graph = build(TorchInductorAotBackend(), module, samples(1, 8))
    return backend, graph, module


@pytest.fixture
def payload(built, tmp_path: Path) -> tuple[Path, dict]:
    backend, _, _ = built
    folder = tmp_path / "payload"
    folder.mkdir()
    return folder, backend.save(folder)


def test_exports_the_graph_range_with_batch_min_one(built) -> None:
    backend, graph, _ = built
    assert (graph.batch.min, graph.batch.max) == (1, 8)
    assert backend.build_info["exported_dims"] == {"batch": [1, 8]}
    assert backend.build_info["traced_at"] == {"batch": 2}
    assert backend.build_info["export_s"] > 0, "the report's time breakdown counts the export apart from the compile"


def test_dynamic_batch_and_structure_match_eager(built) -> None:
    backend, graph, module = built
    for sample in samples(3, 1, seed=5):
        got = backend.infer(*sample.args, **sample.kwargs)
        want = module(*sample.args, **sample.kwargs)
        assert set(got) == {"y", "total"}
        assert_matches_eager(got, {k: v.detach() for k, v in want.items()})
    with torch.no_grad():
        report = validate(backend, module, samples(1, 8), graph)
    assert report.passed, report.reason


def test_payload_is_one_package_with_a_compiled_library(payload) -> None:
    folder, metadata = payload
    assert [p.name for p in folder.iterdir()] == ["model.pt2"]
    assert metadata["package"] == "model.pt2" and metadata["exported_dims"] == {"batch": [1, 8]}
    with zipfile.ZipFile(folder / "model.pt2") as archive:
        assert any(n.endswith(".so") for n in archive.namelist())
    json.dumps(metadata)


def test_load_in_a_fresh_process_without_a_compiler(built, payload, tmp_path: Path) -> None:
    """No C++ compiler is reachable there, so a load that tried to compile would fail."""
    backend, graph, _ = built
    _, metadata = payload
    (tmp_path / "graph.json").write_text(json.dumps(unstructure(graph)))
    (tmp_path / "metadata.json").write_text(json.dumps(metadata))
    sample = samples(5, seed=9)[0]
    want = backend.infer(*sample.args, **sample.kwargs)
    empty = tmp_path / "empty-path"
    empty.mkdir()
    env = {**os.environ, "PATH": str(empty), "CXX": str(empty / "c++"), "CC": str(empty / "cc")}

    got = run_in_fresh_process(
        f"""
        import json, sys, torch
        from pathlib import Path
        from aitune.backend import LoadContext
        from aitune.converter import structure
        from aitune.graph import GraphSpec
        from aitune_backend_inductor.aot import TorchInductorAotBackend

        tmp = Path({str(tmp_path)!r})
        graph = structure(json.loads((tmp / "graph.json").read_text()), GraphSpec)
        context = LoadContext(graph, torch.device("cpu"), json.loads((tmp / "metadata.json").read_text()), tmp)
        backend = TorchInductorAotBackend()
        backend.load(torch.nn.Identity(), tmp / "payload", context)
        g = torch.Generator().manual_seed(9)
        x, scale = torch.randn(5, 16, generator=g), torch.rand(5, 1, generator=g)
        out = backend.infer(x, scale=scale)
        print(json.dumps({{
            "y": out["y"].tolist(), "total": out["total"].tolist(),
            "compiled_on_load": backend.build_info["compiled_on_load"],
            "inductor_compiler_imported": "torch._inductor.compile_fx" in sys.modules,
        }}))
        """,
        env=env,
    )
    assert got["compiled_on_load"] is False
    assert got["inductor_compiler_imported"] is False
    assert_matches_eager(torch.tensor(got["y"]), want["y"])
    assert_matches_eager(torch.tensor(got["total"]), want["total"])


def test_load_then_save_again(built, payload, tmp_path: Path) -> None:
    _, graph, _ = built
    folder, metadata = payload
    loaded = TorchInductorAotBackend()
    loaded.load(torch.nn.Identity(), folder, LoadContext(graph, torch.device("cpu"), metadata, tmp_path))
    again = tmp_path / "again"
    again.mkdir()
    assert loaded.save(again)["exported_dims"] == {"batch": [1, 8]}
    assert (again / "model.pt2").read_bytes() == (folder / "model.pt2").read_bytes()


def test_isolated_build_compiles_in_a_worker_from_the_exported_file_alone(built, tmp_path: Path) -> None:
    """export here, ``build_exported`` in ``python -m aitune.builds.worker``, load here: what tuning does by default."""
    from aitune.backend import BuildContext
    from aitune.executor import run_worker

    _, graph, _ = built

    class OnlyHere(Scaled):
        """Defined in this test: a worker that needed the module object could not even import its class."""

    module = OnlyHere().eval()
    backend = TorchInductorAotBackend()
    context = BuildContext(graph, samples(1, 8), torch.device("cpu"), tmp_path, tmp_path / "cache")
    folder = tmp_path / "isolated"
    (folder / "exported").mkdir(parents=True)
    with torch.no_grad():
        notes = backend.export(module, context, folder / "exported")
    assert notes is not None and json.loads(json.dumps(notes)) == notes
    assert notes["exported_dims"] == {"batch": [1, 8]}
    assert [p.name for p in (folder / "exported").iterdir()] == ["program.pt2"]

    metadata = run_worker(backend, notes, context, folder)  # a real subprocess, given JSON and that file

    assert [p.name for p in (folder / "payload").iterdir()] == ["model.pt2"]
    assert metadata == {
        "format": 1,
        "package": "model.pt2",
        "torch": torch.__version__,
        "exported_dims": {"batch": [1, 8]},
        "traced_at": {"batch": 2},
    }
    loaded = TorchInductorAotBackend()
    loaded.load(module, folder / "payload", LoadContext(graph, torch.device("cpu"), metadata, tmp_path))
    for sample in samples(3, 1, 8, seed=7):
        got = loaded.infer(*sample.args, **sample.kwargs)
        with torch.no_grad():
            want = module(*sample.args, **sample.kwargs)
        assert_matches_eager(got, want)


def _rewrite(package: Path, extra: dict[str, bytes], drop_suffix: str | None = None) -> None:
    original = package.with_suffix(".orig")
    shutil.move(package, original)
    with zipfile.ZipFile(original) as src, zipfile.ZipFile(package, "w") as dst:
        root = src.namelist()[0].split("/")[0]
        for item in src.infolist():
            if drop_suffix is None or not item.filename.endswith(drop_suffix):
                dst.writestr(item, src.read(item))
        for name, data in extra.items():
            dst.writestr(f"{root}/{name}", data)


def test_a_worker_build_that_lost_a_dynamic_axis_costs_only_its_candidate(built, tmp_path, monkeypatch) -> None:
    """A package that ignores the batch axis (seen after torch.export.save/load) is refused in the worker."""
    import torch._inductor

    from aitune.backend import BuildContext
    from aitune_backend_inductor import aot

    _, graph, module = built
    program, _ = aot._export(module, BuildContext(graph, samples(2), torch.device("cpu"), tmp_path, tmp_path), False)
    reference = program.module()

    def at_batch_two(*flat):  # what the broken package did: every call answered at the traced batch
        return reference(*(t[:1].expand(2, *t.shape[1:]) for t in flat))

    monkeypatch.setattr(torch._inductor, "aoti_load_package", lambda path: at_batch_two)
    with pytest.raises(BuildError, match="lost a dynamic axis; build in-process instead"):
        aot._agrees_with_program(program, tmp_path / "model.pt2", graph)
    monkeypatch.setattr(torch._inductor, "aoti_load_package", lambda path: reference)
    aot._agrees_with_program(program, tmp_path / "model.pt2", graph)  # a package that agrees passes


@pytest.mark.parametrize(
    ("extra", "drop", "message"),
    [
        ({"models/model.json": b"{}"}, None, "never contains"),
        ({"data/weights/weight_0": b"\x80\x04K\x01."}, None, "never contains"),
        ({"../evil.so": b""}, None, "escapes the package"),
        ({}, ".so", "no compiled library"),
    ],
    ids=["exported-program", "pickled-weight", "path-escape", "sources-only"],
)
def test_load_refuses_a_package_it_would_have_to_unpickle_or_compile(built, payload, tmp_path, extra, drop, message):
    _, graph, _ = built
    folder, metadata = payload
    _rewrite(folder / "model.pt2", extra, drop)
    with pytest.raises(SerializationError, match=message):
        TorchInductorAotBackend().load(
            torch.nn.Identity(), folder, LoadContext(graph, torch.device("cpu"), metadata, tmp_path)
        )


def test_load_refuses_another_torch_minor(built, payload, tmp_path: Path) -> None:
    _, graph, _ = built
    folder, metadata = payload
    with pytest.raises(SerializationError, match="rebuild the artifact with this torch"):
        TorchInductorAotBackend().load(
            torch.nn.Identity(),
            folder,
            LoadContext(graph, torch.device("cpu"), {**metadata, "torch": "1.0.0"}, tmp_path),
        )


def test_load_refuses_a_package_name_that_leaves_the_payload(built, payload, tmp_path: Path) -> None:
    _, graph, _ = built
    folder, metadata = payload
    with pytest.raises(SerializationError, match=r"plain \.pt2 file name"):
        TorchInductorAotBackend().load(
            torch.nn.Identity(),
            folder,
            LoadContext(graph, torch.device("cpu"), {**metadata, "package": "../x.pt2"}, tmp_path),
        )


def test_compatibility_problems_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert "machine" in compatibility_problem({"AOTI_MACHINE": "not-this-machine"}, cpu)
    assert "device_key" in compatibility_problem({"AOTI_DEVICE_KEY": "cuda"}, cpu)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert "AVX512" in compatibility_problem({"AOTI_CPU_ISA": "AVX512 AVX512_VNNI"}, cpu)
    assert compatibility_problem({"AOTI_CPU_ISA": "AVX2"}, cpu) is None


@pytest.mark.gpu
def test_cuda_build_save_load(tmp_path: Path) -> None:
    from aitune.backend import BuildContext
    from aitune.graph import infer_graph

    module = Scaled().eval().cuda()
    cuda_samples = [
        Sample(tuple(a.cuda() for a in s.args), {k: v.cuda() for k, v in s.kwargs.items()}) for s in samples(1, 8)
    ]
    with torch.no_grad():
        graph = infer_graph(cuda_samples, ["x"], outputs=[module(*s.args, **s.kwargs) for s in cuda_samples])
        backend = TorchInductorAotBackend()
        backend.build(module, BuildContext(graph, cuda_samples, torch.device("cuda"), tmp_path, tmp_path / "cache"))
        report = validate(backend, module, cuda_samples, graph)
        assert report.passed, report.reason
        (tmp_path / "payload").mkdir()
        metadata = backend.save(tmp_path / "payload")
        loaded = TorchInductorAotBackend()
        loaded.load(module, tmp_path / "payload", LoadContext(graph, torch.device("cuda"), metadata, tmp_path))
        s = cuda_samples[1]
        assert_matches_eager(loaded.infer(*s.args, **s.kwargs), backend.infer(*s.args, **s.kwargs))
