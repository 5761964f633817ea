"""The artifact loader against hostile files: every mutation ends in an aitune error, never another.

Valid artifacts are mutated (flipped bytes, truncation, reordered, renamed, dropped, duplicated or
compressed members, lying zip headers, overlapping members, hostile manifests, type paths and
backend configs, and digest lists whose sums are recomputed so the loader reads deep into them)
and both ``ait.load`` and ``verify`` must either succeed or raise an
:class:`~aitune.errors.AituneError`, within a deadline, importing no module the file names. The suite runs a fast
slice; ``nox -s fuzz`` runs ``AITUNE_FUZZ_EXAMPLES`` examples per strategy.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import struct
import subprocess
import sys
import tempfile
import tracemalloc
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from aitune_testkit.doubles import SlowModule
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aitune.torch as ait
from aitune.artifact.reader import verify
from aitune.errors import AituneError, ConfigError
from aitune.plugins import AituneManager
from aitune.testing import backends
from aitune.testing.backends import ToyBackend, ToyConfig
from aitune.torch.task.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig

EXAMPLES = int(os.environ.get("AITUNE_FUZZ_EXAMPLES", "300"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=5000,  # a hang is a failure
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=os.environ.get("AITUNE_FUZZ_RANDOM", "") == "",
    database=None,
)
SUMS, MANIFEST = "SHA256SUMS", "manifest.json"


# -- the target -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def manager():
    """The installed plugins and the toy backends, on a manager of this module's own (passed as ``manager=``)."""
    manager = AituneManager()
    manager.load_entry_points()
    manager.register(backends, name="aitune.testing.backends", distribution="aitune-core")
    return manager


def _fresh() -> ait.Module:
    return ait.Module(SlowModule(delay_s=0.0), "m")


@pytest.fixture(scope="module")
def valid(manager, tmp_path_factory) -> bytes:
    """A real artifact: a tuned module with a toy payload and its weights."""
    strategy = ait.OneBackendStrategy(
        ToyBackend(ToyConfig()),
        profiling_config=ProfilingConfig(
            measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=5, warmup=1, window=5), extend_s=0.0
        ),
    ).enable_performance_validation(False)
    model = ait.Module(SlowModule(delay_s=0.0), "m", strategy=strategy)
    ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8)], manager=manager)
    path = tmp_path_factory.mktemp("valid") / "model.ait"
    ait.save(model, path, manager=manager)
    return path.read_bytes()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def must_end_cleanly(data: bytes, folder: Path, manager: AituneManager) -> None:
    """Load and verify ``data`` with ``manager``'s plugins: success or an AituneError, nothing else escapes."""
    fd, name = tempfile.mkstemp(suffix=".ait", dir=folder)
    path = Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        for attempt in (lambda: ait.load(_fresh(), path, manager=manager), lambda: verify(path, manager=manager)):
            with contextlib.suppress(AituneError):
                attempt()
    finally:
        path.unlink(missing_ok=True)


# -- rebuilding archives --------------------------------------------------------------------------


def members(data: bytes) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return [(i.filename, z.read(i)) for i in z.infolist()]


def pack(items: list[tuple[str, bytes]], compress: set[int] = frozenset()) -> bytes:  # type: ignore[assignment]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for index, (name, body) in enumerate(items):
            info = zipfile.ZipInfo(name)
            info.compress_type = zipfile.ZIP_DEFLATED if index in compress else zipfile.ZIP_STORED
            z.writestr(info, body)
    return out.getvalue()


def with_sums(items: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    """Recompute the digest list, so a changed member passes the digest check and reaches the parser."""
    rest = [(n, b) for n, b in items if n != SUMS]
    sums = "".join(f"{hashlib.sha256(b).hexdigest()}  {n}\n" for n, b in sorted(rest))
    return [*rest, (SUMS, sums.encode())]


# -- hostile JSON ---------------------------------------------------------------------------------

DEEP = "\x00deep\x00"
hostile_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([-1, 0, 2**31, 2**63, -(2**63), 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["../../etc/passwd", "/abs", "a\\b", "modules/0/graphs/9", "", "x" * 5000, DEEP]),
    st.lists(st.integers(-5, 5), max_size=4),
    st.dictionaries(st.text(max_size=5), st.integers(-3, 3), max_size=3),
)


def paths_of(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += paths_of(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += paths_of(v, (*prefix, i))
    return out


def replaced(node: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(node, dict):
        return {**node, head: replaced(node[head], rest, value)}
    copy = list(node)
    copy[head] = replaced(copy[head], rest, value)
    return copy


def dumps(value: Any, depth: int) -> bytes:
    text = json.dumps(value, allow_nan=True)
    return text.replace(json.dumps(DEEP), "[" * depth + "]" * depth).encode()


# -- the fuzzers ----------------------------------------------------------------------------------


def test_the_valid_artifact_loads(manager, valid, scratch):
    path = scratch / "ok.ait"
    path.write_bytes(valid)
    model = ait.load(_fresh(), path, manager=manager)
    assert model.state == "tuned" and verify(path, manager=manager)["integrity"] == "ok"


@FUZZ
@given(flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)), min_size=1, max_size=8))
def test_flipped_bytes(manager, valid, scratch, flips):
    data = bytearray(valid)
    for where, mask in flips:
        data[int(where * len(data))] ^= mask
    must_end_cleanly(bytes(data), scratch, manager)


@FUZZ
@given(keep=st.floats(0, 1, exclude_max=True), tail=st.binary(max_size=64))
def test_truncated_or_padded(manager, valid, scratch, keep, tail):
    must_end_cleanly(valid[: int(keep * len(valid))] + tail, scratch, manager)


member_ops = st.one_of(
    st.tuples(
        st.just("rename"),
        st.integers(0, 99),
        st.sampled_from(
            ["x", "../x", "/x", "a\\b", "modules/0", "SHA256SUMS", "manifest.json", "modules/0/graphs/0/toy.txt/.."]
        ),
    ),
    st.tuples(st.just("drop"), st.integers(0, 99), st.none()),
    st.tuples(st.just("duplicate"), st.integers(0, 99), st.none()),
    st.tuples(st.just("compress"), st.integers(0, 99), st.none()),
    st.tuples(st.just("empty"), st.integers(0, 99), st.none()),
)


@FUZZ
@given(order=st.randoms(use_true_random=False), ops=st.lists(member_ops, max_size=4), resum=st.booleans())
def test_reordered_renamed_dropped_members(manager, valid, scratch, order, ops, resum):
    items = members(valid)
    order.shuffle(items)
    compress: set[int] = set()
    for op, index, arg in ops:
        if not items:
            break
        i = index % len(items)
        if op == "rename":
            items[i] = (arg, items[i][1])
        elif op == "drop":
            items.pop(i)
        elif op == "duplicate":
            items.append(items[i])
        elif op == "compress":
            compress.add(i)
        elif op == "empty":
            items[i] = (items[i][0], b"")
    if resum:
        items = with_sums(items)
    must_end_cleanly(pack(items, compress), scratch, manager)


@FUZZ
@given(data=st.data(), depth=st.sampled_from([1, 50, 5000, 200000]))
def test_hostile_manifests(manager, valid, scratch, data, depth):
    items = members(valid)
    manifest = json.loads(dict(items)[MANIFEST])
    edits = data.draw(st.lists(st.tuples(st.integers(0, 10**6), hostile_values), min_size=1, max_size=3))
    for pick, value in edits:
        paths = paths_of(manifest)
        manifest = replaced(manifest, paths[pick % len(paths)], value)
    body = dumps(manifest, depth)
    items = with_sums([(n, body if n == MANIFEST else b) for n, b in items])
    must_end_cleanly(pack(items), scratch, manager)


@FUZZ
@given(lines=st.lists(st.text(max_size=100), max_size=5), keep=st.booleans())
def test_hostile_digest_lists(manager, valid, scratch, lines, keep):
    items = members(valid)
    sums = dict(items)[SUMS].decode()
    text = (sums if keep else "") + "\n".join(lines)
    items = [(n, text.encode("utf-8", "surrogatepass") if n == SUMS else b) for n, b in items]
    must_end_cleanly(pack(items), scratch, manager)


@FUZZ
@given(
    which=st.integers(0, 99),
    field=st.sampled_from([(20, 4), (24, 4), (28, 2), (30, 2), (42, 4), (10, 2)]),
    value=st.sampled_from([0, 1, 0x7FFFFFFF, 0xFFFF, 0xFFFFFFFE, 0xFFFFFFFF]),
)
def test_lying_zip_headers(manager, valid, scratch, which, field, value):
    """Sizes, name lengths, offsets and compression methods in the central directory that lie."""
    data = bytearray(valid)
    starts = [i for i in range(len(data) - 4) if data[i : i + 4] == b"PK\x01\x02"]
    start = starts[which % len(starts)]
    offset, width = field
    data[start + offset : start + offset + width] = struct.pack(
        "<I" if width == 4 else "<H", value & (0xFFFFFFFF if width == 4 else 0xFFFF)
    )
    must_end_cleanly(bytes(data), scratch, manager)


def test_a_zip_bomb_is_refused_without_inflating_it(manager, valid, scratch):
    """A consistent archive (sums recomputed) whose weights member inflates to 256 MB: no blow-up."""
    items = members(valid)
    weights = next(n for n, _ in items if n.endswith("weights.safetensors"))
    bomb = bytes(256 * 1024 * 1024)
    items = with_sums([(n, bomb if n == weights else b) for n, b in items])
    del bomb
    data = pack(items, compress={i for i, (n, _) in enumerate(items) if n == weights})
    assert len(data) < 4 * 1024 * 1024
    tracemalloc.start()
    try:
        must_end_cleanly(data, scratch, manager)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024 * 1024, f"loading took {peak >> 20} MB for a {len(data) >> 10} kB file"


type_paths = st.one_of(
    st.sampled_from(
        [
            "this:X",
            "antigravity:X",
            "unittest.__main__:main",
            "aitune_testkit.imported_by_name:Anything",
            "os:system",
            "subprocess:Popen",
            "builtins:eval",
            "builtins:object",
            "collections:defaultdict",
            "collections:OrderedDict",
            "torch:Tensor",
            "aitune.testing.backends:ToyBackend",
            "os.path:join",
        ]
    ),
    st.text(max_size=30),
)
structure_nodes = st.fixed_dictionaries(
    {
        "kind": st.sampled_from(["namedtuple", "dataclass", "mapping", "pytree", "enum", "tuple", "tensor", "x"]),
        "type": type_paths,
        "keys": st.lists(st.text(max_size=5), max_size=3),
        "items": st.lists(st.just({"kind": "tensor"}), max_size=3),
        "name": st.one_of(st.text(max_size=5), st.integers()),
        "context": st.one_of(st.none(), st.lists(st.text(max_size=8), max_size=2), st.just(["os.abort", ["a"]])),
    }
)


@FUZZ
@given(node=structure_nodes, where=st.sampled_from(["structure", "output_structure"]))
def test_hostile_type_paths(manager, valid, scratch, node, where):
    """A structure naming any type: refused or rebuilt as data, and no module imported for it."""
    before = set(sys.modules)
    items = members(valid)
    manifest = json.loads(dict(items)[MANIFEST])
    manifest["modules"][0]["graphs"][0]["graph"][where] = node
    body = json.dumps(manifest).encode()
    must_end_cleanly(pack(with_sums([(n, body if n == MANIFEST else b) for n, b in items])), scratch, manager)
    assert not {"this", "antigravity", "aitune_testkit.imported_by_name", "unittest.__main__"} & (
        set(sys.modules) - before
    ), "a module was imported because the file named it"


def _typed(inner: Any) -> Any:
    """torchao-style typed objects (``{"_type", "_data"}``) naming anything, nested."""
    names = st.one_of(
        st.sampled_from(
            [
                "torch.dtype",
                "Int8WeightOnlyConfig",
                "PerRow",
                "MappingType",
                "os.system",
                "aitune.testing.hostile:probe",
            ]
        ),
        st.text(max_size=12),
    )
    return st.fixed_dictionaries({"_type": names, "_data": inner}, optional={"_version": st.integers(0, 3)})


typed_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-4, 4), st.sampled_from(["manual_seed", "float64", "save", "X"])),
    lambda inner: st.one_of(
        _typed(inner), _typed(st.dictionaries(st.text(max_size=6), inner, max_size=3)), st.lists(inner, max_size=2)
    ),
    max_leaves=8,
)
configs = st.fixed_dictionaries(
    # not torch_inductor_jit here: it compiles on load, which outlasts the deadline (its options are
    # fuzzed on their own below)
    {"backend": st.sampled_from(["toy", "torch_inductor_aot", "onnxruntime", "torchao", "nope", 3])},
    optional={
        "quantization": st.one_of(typed_values, st.sampled_from(["int8wo", "int8dq", "int3"])),
        "filter_fn": st.one_of(
            st.none(), st.dictionaries(st.sampled_from(["include", "types", "_type"]), typed_values)
        ),
        "speed": st.one_of(st.floats(allow_nan=True), st.text(max_size=4)),
        "options": st.dictionaries(
            st.sampled_from(["cpp.cxx", "cpp.inject_relu_bug_TESTING_ONLY", "max_autotune", "epilogue_fusion"]),
            st.one_of(st.booleans(), st.text(max_size=10), st.integers()),
            max_size=2,
        ),
        "provider_options": st.dictionaries(
            st.sampled_from(["trt_extra_plugin_lib_paths", "device_id", "trt_engine_cache_path"]),
            st.text(max_size=10),
            max_size=2,
        ),
        "mode": st.sampled_from(["default", "x"]),
    },
)


@FUZZ
@given(config=configs)
def test_hostile_backend_configs(manager, valid, scratch, config):
    items = members(valid)
    manifest = json.loads(dict(items)[MANIFEST])
    graph = manifest["modules"][0]["graphs"][0]
    graph["config"] = config
    if isinstance(config["backend"], str):
        graph["backend"] = config["backend"]
    body = json.dumps(manifest).encode()
    must_end_cleanly(pack(with_sums([(n, body if n == MANIFEST else b) for n, b in items])), scratch, manager)


@FUZZ
@given(config=configs)
def test_hostile_configs_read_as_from_a_file(manager, config):
    """Every registered backend's config, read as an artifact's: a config or a ConfigError naming what it
    refuses; nothing imported, and no typed object (``_type``) kept unless aitune's own reader took it."""
    before = set(sys.modules)
    for backend in manager.registry.names():
        data = {**config, "backend": backend}
        try:
            read = manager.registry.config_from_json(data, "config", from_file=True)
        except ConfigError:
            continue
        options = data.get("options") or {}
        assert not {"cpp.cxx", "cpp.inject_relu_bug_TESTING_ONLY"} & set(options), f"{backend} took {options}"
        assert "trt_extra_plugin_lib_paths" not in (data.get("provider_options") or {}) or backend != "onnxruntime"
        if backend == "torchao" and isinstance(read.quantization, dict):
            from aitune_backend_torchao.config import CONFIG_CLASSES

            assert read.quantization["_type"] in CONFIG_CLASSES, read.quantization
    assert not {"aitune.testing.hostile", "antigravity"} & (set(sys.modules) - before)


def test_every_registered_backends_config_from_a_file_calls_and_imports_nothing(manager):
    """The conformance rule (:mod:`aitune.testing.hostile`) over every installed backend, at once."""
    from aitune.testing.hostile import config_problems

    problems = {name: config_problems(manager.registry, name) for name in manager.registry.names()}
    assert "torchao" in problems or not _installed("aitune_backend_torchao"), "torchao is installed but not registered"
    assert not {name: p for name, p in problems.items() if p}


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def test_an_artifact_whose_torchao_config_names_a_callable_is_neither_loaded_nor_runnable(manager, valid, scratch):
    """The first attack of issue 40: a TorchAO config that makes torchao look a name up and call it.
    ``ait.load`` refuses it (also with fallback="eager", since the config is not data), and ``verify``
    does not call the artifact runnable."""
    if "torchao" not in manager.registry:
        pytest.skip("aitune-backend-torchao is not installed")
    items = members(valid)
    manifest = json.loads(dict(items)[MANIFEST])
    graph = manifest["modules"][0]["graphs"][0]
    graph["backend"] = "torchao"
    graph["config"] = {
        "backend": "torchao",
        "quantization": {
            "_type": "Int8WeightOnlyConfig",
            "_data": {"group_size": {"_type": "torch.dtype", "_data": "save"}},
        },
        "compile": False,
    }
    body = json.dumps(manifest).encode()
    path = scratch / "torchao-hostile.ait"
    path.write_bytes(pack(with_sums([(n, body if n == MANIFEST else b) for n, b in items])))
    report = verify(path, manager=manager)
    assert not report["runnable_here"] and any("torch.dtype" in p or "dtype" in p for p in report["problems"])
    with pytest.raises(AituneError, match="dtype"):
        ait.load(_fresh(), path, manager=manager)
    with pytest.warns(RuntimeWarning, match="dtype"):
        model = ait.load(_fresh(), path, fallback="eager", manager=manager)
    assert model.state == "passthrough"


@FUZZ
@given(moves=st.lists(st.tuples(st.integers(0, 99), st.integers(0, 99)), min_size=1, max_size=3))
def test_overlapping_members(manager, valid, scratch, moves):
    """Directory entries pointed at another member's bytes (the same bytes read many times over)."""
    data = bytearray(valid)
    starts = [i for i in range(len(data) - 4) if data[i : i + 4] == b"PK\x01\x02"]
    offsets = [struct.unpack("<I", data[s + 42 : s + 46])[0] for s in starts]
    for target, source in moves:
        s = starts[target % len(starts)]
        data[s + 42 : s + 46] = struct.pack("<I", offsets[source % len(offsets)])
    must_end_cleanly(bytes(data), scratch, manager)


def _raises_aitune_error(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except AituneError as exc:
        return str(exc)
    raise AssertionError("expected an AituneError")


def test_messages_say_what_happened(manager, valid, scratch):
    path = scratch / "cut.ait"
    path.write_bytes(valid[: len(valid) // 2])
    assert "not a readable .ait artifact (truncated or corrupt)" in _raises_aitune_error(
        lambda: ait.load(_fresh(), path, manager=manager)
    )


def test_the_survival_command_fuzz_batch_counts_every_outcome(manager, tmp_path):
    from aitune_testkit import survival

    rows = survival.fuzz_batch(tmp_path, per_kind=3, manager=manager)
    assert [kind for kind, *_ in rows] == list(survival.FUZZ_KINDS)
    assert all(counts["other"] == 0 for _, _, counts, _ in rows), rows
    bomb = rows[-1][2]
    assert bomb == {"loaded": 0, "aitune error": 1, "other": 0}


def test_the_survival_command_and_fault_backends_need_no_pytest():
    """README tells developers to run it: it must work in an install without test tools."""
    code = (
        "import runpy, sys\n"
        "sys.modules['pytest'] = None\n"  # any import of pytest now fails
        "from aitune.testing import assert_matches_eager, backends\n"
        "from aitune_testkit import faults\n"
        "sys.argv = ['survival', '--help']\n"
        "runpy.run_module('aitune_testkit.survival', run_name='__main__')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "python -m aitune_testkit.survival" in out.stdout
