"""The .pt2 check that stands between an artifact and torch.export.load: nothing in it may be unpickled."""

from __future__ import annotations

import io
import json
import os
import pickle
import pickletools
import zipfile

import pytest
import torch

from aitune.errors import SerializationError
from aitune_backend_torchtrt.archive import check_engine_pickle, check_pt2_archive, load_exported_program

REBUILDER = ("torch_tensorrt.dynamo.runtime._TRTEngine", "_reconstruct_trt_engine")


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo owned",))


def _unicode(text: str) -> bytes:
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw + b"\x94"  # SHORT_BINUNICODE, MEMOIZE


def engine_pickle_v4(module: str, name: str) -> bytes:
    """What Torch-TensorRT's opaque engine pickles look like at protocol 4: f(["engine", "info"])."""
    return (
        b"\x80\x04"
        + _unicode(module)
        + _unicode(name)
        + b"\x93\x94"  # STACK_GLOBAL
        + b"]\x94("
        + _unicode("engine")
        + _unicode("info")
        + b"e\x85\x94R\x94."
    )


def engine_pickle_v2(module: str, name: str) -> bytes:
    """The same at protocol 2 (what torch.export.save uses by default): GLOBAL with an inline name."""
    stand_in = pickle.dumps(_Evil(), protocol=2)
    inline = next(arg for op, arg, _ in pickletools.genops(stand_in) if op.name == "GLOBAL")
    return stand_in.replace(inline.replace(" ", "\n").encode() + b"\n", f"{module}\n{name}\n".encode())


@pytest.fixture(scope="module")
def program_bytes() -> bytes:
    program = torch.export.export(torch.nn.Linear(4, 3), (torch.randn(2, 4),))
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    return buffer.getvalue()


def rewrite(data: bytes, changes: dict[str, bytes | None]) -> bytes:
    """A copy of the archive with entries (paths below the root folder) replaced, added or removed."""
    source = zipfile.ZipFile(io.BytesIO(data))
    root = source.namelist()[0].split("/", 1)[0]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as target:
        for name in source.namelist():
            inner = name.split("/", 1)[1]
            if inner not in changes:
                target.writestr(name, source.read(name))
        for inner, content in changes.items():
            if content is not None:
                target.writestr(f"{root}/{inner}", content)
    return out.getvalue()


def read(data: bytes, inner: str) -> bytes:
    archive = zipfile.ZipFile(io.BytesIO(data))
    return archive.read(next(n for n in archive.namelist() if n.split("/", 1)[1] == inner))


def with_constant(data: bytes, path_name: str, content: bytes) -> bytes:
    config = {
        "config": {"engine": {"path_name": path_name, "is_param": False, "use_pickle": True, "tensor_meta": None}}
    }
    return rewrite(
        data,
        {
            "data/constants/model_constants_config.json": json.dumps(config).encode(),
            f"data/constants/{path_name}": content,
        },
    )


def test_a_plain_exported_program_passes_and_loads(program_bytes: bytes) -> None:
    check_pt2_archive(program_bytes)
    module = load_exported_program(program_bytes).module()
    assert module(torch.randn(2, 4)).shape == (2, 3)


def test_pickled_weights_are_refused(program_bytes: bytes) -> None:
    config = json.loads(read(program_bytes, "data/weights/model_weights_config.json"))
    first = next(iter(config["config"]))
    config["config"][first]["use_pickle"] = True
    tampered = rewrite(program_bytes, {"data/weights/model_weights_config.json": json.dumps(config).encode()})
    with pytest.raises(SerializationError, match="Python pickle"):
        check_pt2_archive(tampered)


def test_an_opaque_object_that_runs_code_is_refused(program_bytes: bytes) -> None:
    tampered = with_constant(program_bytes, "opaque_obj_0", pickle.dumps(_Evil(), protocol=2))
    with pytest.raises(SerializationError, match=r"system.*not a TensorRT engine"):
        check_pt2_archive(tampered)
    with pytest.raises(SerializationError):
        load_exported_program(tampered)  # refused before torch.export.load could unpickle it


@pytest.mark.parametrize("make", [engine_pickle_v2, engine_pickle_v4])
def test_an_engine_pickle_passes_the_static_check(program_bytes: bytes, make) -> None:
    check_engine_pickle(make(*REBUILDER))
    check_pt2_archive(with_constant(program_bytes, "opaque_obj_0", make(*REBUILDER)))
    with pytest.raises(SerializationError, match="not a TensorRT engine"):
        check_engine_pickle(make("builtins", "eval"))


def test_engine_pickles_may_not_set_state_or_compute_their_global() -> None:
    building = engine_pickle_v2(*REBUILDER)[:-1] + b"}b."  # EMPTY_DICT, BUILD: calls __setstate__
    with pytest.raises(SerializationError, match="BUILD"):
        check_engine_pickle(building)
    computed = (
        b"\x80\x04" + _unicode(REBUILDER[0]) + _unicode(REBUILDER[1]) + b"0h\x01h\x00\x93\x94)R."
    )  # POP, then fetch the strings from the memo before STACK_GLOBAL
    with pytest.raises(SerializationError, match="computes at run time"):
        check_engine_pickle(computed)
    with pytest.raises(SerializationError, match="malformed"):
        check_engine_pickle(b"\x80\x02garbage")


def test_torchbind_objects_go_to_torchscripts_unpickler_which_resolves_no_python_globals() -> None:
    """Why ``custom_obj_*`` entries are let through: their loader cannot call Python functions."""
    good = torch._C._pickle_save(["engine", "info"])
    assert torch._C._pickle_load_obj(good) == ["engine", "info"]
    archive = zipfile.ZipFile(io.BytesIO(good))
    evil = io.BytesIO()
    with zipfile.ZipFile(evil, "w") as out:
        for name in archive.namelist():
            payload = pickle.dumps(_Evil(), protocol=2) if name.endswith("data.pkl") else archive.read(name)
            out.writestr(name, payload)
    with pytest.raises(RuntimeError, match="system"):
        torch._C._pickle_load_obj(evil.getvalue())


def test_entries_torch_export_load_would_unpickle_or_execute_are_refused(program_bytes: bytes) -> None:
    for inner in ("data/aotinductor/model/model.so", "serialized_state_dict.pt", "data/weights/model.pt"):
        with pytest.raises(SerializationError):
            check_pt2_archive(rewrite(program_bytes, {inner: b"\0"}))
    with pytest.raises(SerializationError, match="pt2"):
        check_pt2_archive(rewrite(program_bytes, {"archive_format": b"zip"}))
    with pytest.raises(SerializationError, match="not a zip"):
        check_pt2_archive(b"not an archive")


def test_example_inputs_must_load_with_weights_only(program_bytes: bytes) -> None:
    evil = io.BytesIO()
    torch.save({"x": _Evil()}, evil)
    with pytest.raises(SerializationError, match="weights_only"):
        check_pt2_archive(rewrite(program_bytes, {"data/sample_inputs/model.pt": evil.getvalue()}))
    check_pt2_archive(rewrite(program_bytes, {"data/sample_inputs/model.pt": b""}))
