"""Sessions generated from the member folders: no hand-kept list of distributions.

* ``tests``: every member installed together, with the example plugin built and installed as its
  own wheel and with transformers and diffusers, every test and the benchmark harness's own tests;
  CI runs ``lint``, ``typecheck`` and ``tests`` (``.ci/run``);
* ``models``: the same install, only ``tests/models`` (real architectures from small configs);
* ``tests-<member>``: one member alone with core, its own tests (proves it installs by itself);
* ``lint`` (ruff and the import-linter contracts), ``typecheck`` (mypy over every distribution), ``build``;
* ``fuzz``: the artifact fuzzers with many examples (``AITUNE_FUZZ_EXAMPLES``), then the survival table;
* ``gpu``: the prepared GPU check (``scripts/gpu_check.py``), run on a machine with an NVIDIA GPU.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import nox

if sys.version_info >= (3, 11):
    import tomllib
else:  # nox depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).parent
MEMBERS = sorted(p.parent.name for p in ROOT.glob("aitune-*/pyproject.toml"))
CORE = "aitune-core"
EXAMPLE = "examples/aitune-backend-example"  # a third-party plugin: tested here, never published with the members
TESTKIT = "testkit"  # aitune's own fault backends and survival table: installed for tests, never published
TORCH = "torch==2.13.0"  # the CPU wheel; a bare "torch" pulls a multi-GB CUDA build
CONSTRAINTS = ("-c", str(ROOT / "constraints.txt"))
"""Every install passes these: torch and the torchvision built for it (constraints.txt), so nothing a
session installs (transformers, diffusers, timm) replaces torch or pairs it with another torchvision."""
DEV = ["pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6.100", "grimp>=3.4"]
"""pytest-xdist: the ``tests`` session runs the suite on two workers (:data:`WORKERS`), the serving
and Ray folders whole on one of them (the repository's ``conftest.py``)."""
WORKERS = ("-n", "2", "--dist", "loadgroup")
"""The ``tests`` session's default: two workers for CI's two cores (17-21 minutes from a fresh clone
in four runs, against 25 in one process). Arguments after ``--`` come after these, so ``nox -s tests
-- -n 0`` runs one process."""
GPU_MEMBERS = ("aitune-backend-tensorrt", "aitune-backend-torchtrt")
"""Members whose GPU runtimes are real dependencies (TensorRT and ModelOpt; Torch-TensorRT through its
per-torch extras): CPU sessions install them with ``--no-deps``, then their requirements that carry
no platform marker and their ``[test]`` extra, so CI never downloads TensorRT or swaps its CPU torch."""
MODELS = ["transformers>=5.0", "diffusers>=0.35"]
"""What tests/models builds its architectures with (small configs, nothing downloaded)."""

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True


def _requirement(member: str) -> str:
    """``./member``, with its ``[test]`` extra when the member declares one."""
    meta = tomllib.loads((ROOT / member / "pyproject.toml").read_text())["project"]
    return f"./{member}[test]" if "test" in meta.get("optional-dependencies", {}) else f"./{member}"


def _cpu_requirements(member: str) -> list[str]:
    """What a GPU member needs on a CPU: its unmarked requirements (not core, installed from here) and ``[test]``."""
    meta = tomllib.loads((ROOT / member / "pyproject.toml").read_text())["project"]
    plain = [r for r in meta.get("dependencies", []) if ";" not in r and not r.startswith(CORE)]
    return plain + list(meta.get("optional-dependencies", {}).get("test", []))


def _local_dependencies(member: str) -> list[str]:
    """The members ``member`` requires (aitune-serve-ray builds on aitune-serve-kserve), theirs first:
    installed from here, since pip would look for them on an index."""
    meta = tomllib.loads((ROOT / member / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0] for r in meta.get("dependencies", [])}
    found = [m for m in MEMBERS if m in names and m != CORE]
    return [d for m in found for d in [*_local_dependencies(m), m]]


def _install(session: nox.Session, *members: str) -> None:
    session.install(*CONSTRAINTS, TORCH)
    session.install(*CONSTRAINTS, *DEV)
    wanted = list(dict.fromkeys([CORE, *(d for m in members for d in [*_local_dependencies(m), m])]))
    session.install(*CONSTRAINTS, *(_requirement(m) for m in wanted if m not in GPU_MEMBERS))
    for member in (m for m in wanted if m in GPU_MEMBERS):
        session.install("--no-deps", f"./{member}")
        session.install(*CONSTRAINTS, *_cpu_requirements(member))
    session.install("--no-deps", f"./{TESTKIT}")


def _test_env(session: nox.Session) -> dict[str, str]:
    """A cache of the session's own, shared by its tests (compile caches stay warm across them)."""
    return {"AITUNE_CACHE_DIR": str(Path(session.virtualenv.location) / "aitune-cache")}


def _install_example(session: nox.Session) -> None:
    """The example plugin as a third party ships it: its own wheel, installed next to aitune-core."""
    wheels = Path(session.create_tmp()) / "example-wheel"
    shutil.rmtree(wheels, ignore_errors=True)
    session.run_install(
        "python", "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(wheels), f"./{EXAMPLE}", silent=True
    )
    [wheel] = wheels.glob("aitune_backend_example-*.whl")
    session.install("--no-deps", "--force-reinstall", str(wheel))


@nox.session
def tests(session: nox.Session) -> None:
    """Every distribution and the example plugin installed together; every member's tests, the
    example's, the cross-distribution tests and the benchmark harness's own tests."""
    _install(session, *MEMBERS)
    _install_example(session)
    session.install(*CONSTRAINTS, *MODELS)
    # the cross-distribution tests first: their real models, the slowest tests, start while there is work to pair them with
    paths = ["tests"] + [f"{m}/tests" for m in MEMBERS] + [f"{EXAMPLE}/tests", "benchmarks/test_benchmarks.py"]
    session.run("pytest", *paths, *WORKERS, *session.posargs, env=_test_env(session))


@nox.session
def models(session: nox.Session) -> None:
    """Only the real-architecture layer (tests/models: transformers and diffusers), every member installed."""
    _install(session, *MEMBERS)
    session.install(*CONSTRAINTS, *MODELS)
    session.run("pytest", "tests/models", *session.posargs, env=_test_env(session))


def _member_session(member: str) -> None:
    @nox.session(name=f"tests-{member}")
    def member_tests(session: nox.Session) -> None:
        _install(session, member)
        session.run("pytest", f"{member}/tests", *session.posargs, env=_test_env(session))

    member_tests.__doc__ = f"{member} installed alone with aitune-core; its own tests."


for _member in MEMBERS:
    _member_session(_member)


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """On an NVIDIA GPU machine, with the container's Python and torch: install the GPU runtimes into
    ``.gpu-venv`` (it sees that torch and never replaces it), run every member's gpu-marked tests
    and tune a CNN and an encoder layer with every GPU backend; one table (scripts/README.md)."""
    session.run("python", "scripts/gpu_check.py", *session.posargs, external=True)


@nox.session
def fuzz(session: nox.Session) -> None:
    """The artifact fuzzers at length (AITUNE_FUZZ_EXAMPLES per strategy, default 2000, fresh seeds), then the survival table."""
    _install(session)
    env = {**_test_env(session), "AITUNE_FUZZ_RANDOM": "1"}
    env["AITUNE_FUZZ_EXAMPLES"] = os.environ.get("AITUNE_FUZZ_EXAMPLES", "2000")
    session.run("pytest", f"{CORE}/tests/test_fuzz_artifact.py", *session.posargs, env=env)
    session.run("python", "-m", "aitune_testkit.survival", "--fuzz-examples", "1000", env=env)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and format check over the whole repository; the architecture contracts of
    .importlinter (import-linter reads the sources from the src folders, installing nothing)."""
    session.install("ruff>=0.5", "import-linter>=2.1")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    sources = [str(ROOT / m / "src") for m in MEMBERS] + [str(ROOT / EXAMPLE / "src")]
    session.run("lint-imports", env={"PYTHONPATH": os.pathsep.join(sources)})


TYPES = ["numpy>=1.24", "onnx>=1.16", "pytest>=8", "ray[serve]>=2.40", "prometheus-client>=0.20"]
"""What the distributions import besides core's own requirements that mypy reads types from: numpy
(the serving engines, TensorRT), onnx (core's export, ONNX Runtime, TensorRT), pytest (aitune.testing),
Ray and its Serve (the Ray executor and aitune-serve-ray, which ship type hints), prometheus-client
(aitune-serve-kserve's metrics). kserve ships no type hints (no py.typed): pyproject.toml's mypy
overrides type it as Any, so it is not installed here. The other optional
runtimes (ONNX Runtime, TensorRT, Torch-TensorRT, torchao, ModelOpt) and core's report and signing
extras are not installed: pyproject.toml's mypy overrides type them as Any."""


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over every distribution, the example plugin and the test kit (settings in pyproject.toml)."""
    session.install(*CONSTRAINTS, TORCH, "mypy>=1.10", *TYPES, f"./{CORE}")
    session.run("mypy", *(f"{m}/src" for m in [*MEMBERS, EXAMPLE, TESTKIT]))


@nox.session
def build(session: nox.Session) -> None:
    """A wheel and an sdist of every member, into dist/."""
    session.install("build>=1.2")
    for member in MEMBERS:
        session.run("python", "-m", "build", "--outdir", "dist", member)


@nox.session
def bench(session: nox.Session) -> None:
    """The performance harness (benchmarks/): every member installed; ``nox -s bench -- --quick --out r.json``."""
    _install(session, *MEMBERS)
    session.run("python", "-m", "benchmarks", *(session.posargs or ["--quick"]))
