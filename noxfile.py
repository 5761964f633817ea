"""Sessions generated from the member folders: no hand-kept list of distributions.

* ``tests``: every member installed together, with transformers and diffusers, every test (the command CI runs);
* ``models``: the same install, only ``tests/models`` (real architectures from small configs);
* ``tests-<member>``: one member alone with core, its own tests (proves it installs by itself);
* ``lint``, ``typecheck``, ``build``;
* ``fuzz``: the artifact fuzzers with many examples (``AITUNE_FUZZ_EXAMPLES``), then the survival table;
* ``gpu``: the prepared GPU check (``scripts/gpu_check.py``), run on a machine with an NVIDIA GPU.
"""

from __future__ import annotations

import os
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
TORCH = "torch==2.13.0"  # the CPU wheel; a bare "torch" pulls a multi-GB CUDA build
DEV = ["pytest>=8", "hypothesis>=6.100"]
MODELS = ["transformers>=5.0", "diffusers>=0.35"]
"""What tests/models builds its architectures with (small configs, nothing downloaded)."""

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True


def _requirement(member: str) -> str:
    """``./member``, with its ``[test]`` extra when the member declares one."""
    meta = tomllib.loads((ROOT / member / "pyproject.toml").read_text())["project"]
    return f"./{member}[test]" if "test" in meta.get("optional-dependencies", {}) else f"./{member}"


def _install(session: nox.Session, *members: str) -> None:
    session.install(TORCH)
    session.install(*DEV)
    session.install(*(_requirement(m) for m in dict.fromkeys([CORE, *members])))


def _test_env(session: nox.Session) -> dict[str, str]:
    """A cache of the session's own, shared by its tests (compile caches stay warm across them)."""
    return {"AITUNE_CACHE_DIR": str(Path(session.virtualenv.location) / "aitune-cache")}


@nox.session
def tests(session: nox.Session) -> None:
    """Every distribution installed together; every member's tests and the cross-distribution tests."""
    _install(session, *MEMBERS)
    session.install(*MODELS)
    paths = [f"{m}/tests" for m in MEMBERS] + ["tests"]
    session.run("pytest", *paths, *session.posargs, env=_test_env(session))


@nox.session
def models(session: nox.Session) -> None:
    """Only the real-architecture layer (tests/models: transformers and diffusers), every member installed."""
    _install(session, *MEMBERS)
    session.install(*MODELS)
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
    """On an NVIDIA GPU machine: install the GPU runtimes into this environment, run every
    gpu-marked test and tune a CNN and a transformer layer with every GPU backend (one table)."""
    session.run("python", "scripts/gpu_check.py", *session.posargs)


@nox.session
def fuzz(session: nox.Session) -> None:
    """The artifact fuzzers at length (AITUNE_FUZZ_EXAMPLES per strategy, default 2000, fresh seeds), then the survival table."""
    _install(session)
    env = {**_test_env(session), "AITUNE_FUZZ_RANDOM": "1"}
    env["AITUNE_FUZZ_EXAMPLES"] = os.environ.get("AITUNE_FUZZ_EXAMPLES", "2000")
    session.run("pytest", f"{CORE}/tests/test_fuzz_artifact.py", *session.posargs, env=env)
    session.run("python", "-m", "aitune.survival", "--fuzz-examples", "1000", env=env)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and format check over the whole repository."""
    session.install("ruff>=0.5")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over aitune-core."""
    session.install(TORCH, "mypy>=1.10", f"./{CORE}")
    session.run("mypy", f"{CORE}/src/aitune")


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
