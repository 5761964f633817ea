"""The member distributions, really installed, are found through their entry points."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
MEMBERS = sorted(p.parent for p in ROOT.glob("aitune-*/pyproject.toml"))


def test_there_are_members():
    assert {m.name for m in MEMBERS} >= {"aitune-core", "aitune-backend-onnxruntime", "aitune-backend-inductor"}


@pytest.mark.parametrize("member", MEMBERS, ids=lambda p: p.name)
def test_member_is_installed_with_its_own_version_readme_and_changelog(member):
    meta = tomllib.loads((member / "pyproject.toml").read_text())["project"]
    assert importlib.metadata.version(meta["name"])
    assert (member / "README.md").read_text().strip()
    assert (member / "CHANGELOG.md").read_text().strip()
    if meta["name"] != "aitune-core":
        deps = meta["dependencies"]
        assert any(d.replace(" ", "").startswith("aitune-core>=0.1,<0.2") for d in deps), deps


PLUGINS = [m for m in MEMBERS if m.name != "aitune-core" and not m.name.startswith("aitune-serve-")]
"""Members that plug into a tune (backends, executors); ``aitune-serve-*`` serve an artifact instead."""


@pytest.mark.parametrize("member", PLUGINS, ids=lambda p: p.name)
def test_backend_member_registers_through_its_entry_point(member):
    from aitune.plugins import AituneManager

    meta = tomllib.loads((member / "pyproject.toml").read_text())["project"]
    [(ep_name, target)] = meta["entry-points"]["aitune"].items()
    installed = {ep.name: ep for ep in importlib.metadata.entry_points(group="aitune")}
    assert installed[ep_name].value == target
    assert installed[ep_name].dist.name == meta["name"]
    manager = AituneManager()
    manager.load_entry_points()
    if member.name.startswith("aitune-executor-"):
        executors = [n for n in manager.executors.names() if manager.executors.distribution(n) == meta["name"]]
        assert executors, f"{meta['name']} registered no executor"
        return
    provided = [n for n in manager.registry.names() if manager.registry.distribution(n) == meta["name"]]
    assert provided, f"{meta['name']} registered no backend"
    for name in provided:
        status = manager.registry.status(name)
        assert status.available or status.reason(), "an unavailable backend says why"


def _pins() -> dict[str, str]:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    return dict(line.split("==") for line in lines if line and not line.startswith("#"))


def test_the_constraints_pin_torch_and_the_torchvision_built_for_it():
    pins = _pins()
    torch_minor = int(pins["torch"].split(".")[1])
    vision_minor = int(pins["torchvision"].split(".")[1])
    assert pins["torch"].startswith("2.") and vision_minor == torch_minor + 15, (
        f"torchvision {pins['torchvision']} is not built for torch {pins['torch']} (0.N pairs with 2.(N - 15))"
    )


def test_the_quick_start_and_the_test_sessions_install_with_the_constraints():
    pins = _pins()
    noxfile = (ROOT / "noxfile.py").read_text()
    assert f'TORCH = "torch=={pins["torch"]}"' in noxfile, "the sessions' torch is the constraints' torch"
    installs = [line.strip() for line in noxfile.splitlines() if "session.install(" in line and "--no-deps" not in line]
    unconstrained = [
        line for line in installs if "CONSTRAINTS" not in line and "ruff" not in line and "build>=" not in line
    ]
    assert not unconstrained, f"installs that may pull torch or torchvision without the constraints: {unconstrained}"
    readme = (ROOT / "README.md").read_text()
    quick_start = next(
        line for line in readme.splitlines() if line.startswith("python3 -m venv .venv") and "torch" in line
    )
    assert "pip install -c constraints.txt torch " in quick_start, quick_start


@pytest.mark.parametrize("member", [m for m in MEMBERS if m.name.startswith("aitune-serve-")], ids=lambda p: p.name)
def test_serving_member_is_reached_by_aitune_serve_and_core_stays_free_of_ray(member):
    """``aitune serve`` imports it when run; importing core's command line imports neither it nor Ray."""
    import subprocess

    import typer.main

    from aitune.cli import app

    meta = tomllib.loads((member / "pyproject.toml").read_text())["project"]
    assert "aitune" not in meta.get("entry-points", {}), "a serving member is not a tuning plugin"
    assert "serve" in typer.main.get_command(app).commands
    package = meta["name"].replace("-", "_")
    check = f"import sys, aitune.cli, aitune.torch; assert not {{'ray', '{package}'}} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", check], check=True, timeout=120)
