"""The aitune command line."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from aitune.cli import app


def test_backends_json_lists_every_installed_backend_with_status(aitune_manager):
    result = CliRunner().invoke(app, ["backends", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["backend"]: row for row in json.loads(result.output)}
    assert rows["torch_eager"]["status"] == "available"
    assert rows["torch_eager"]["distribution"] == "aitune-core"
    assert rows["torch_eager"]["devices"]["cpu"] is None
    assert set(rows) == set(aitune_manager.registry.names())


def test_backends_table_shows_failed_plugins(fake_distribution, monkeypatch):
    from aitune.plugins import AituneManager

    fake_distribution("broken-aitune-plugin", "broken_plugin", "raise ImportError('libfoo missing')")
    with __import__("pytest").warns(RuntimeWarning):
        manager = AituneManager()
        manager.load_entry_points()
    result = CliRunner().invoke(app, ["backends"], env={"COLUMNS": "200"}, obj=manager)
    assert result.exit_code == 0
    assert "broken_plugin" in result.output and "failed to load" in result.output
    assert "libfoo missing" in result.output


def test_backends_table_keeps_install_hints_intact(aitune_manager):
    result = CliRunner().invoke(app, ["backends"], env={"COLUMNS": "300"})
    assert result.exit_code == 0
    if "tensorrt" in aitune_manager.registry.names() and aitune_manager.registry.status("tensorrt").reason():
        assert "aitune-backend-tensorrt[runtime,cu1" in result.output, "rich markup must not eat '[runtime,cu13]'"


def test_piped_output_keeps_full_names_one_row_per_line(aitune_manager, tmp_path):
    """``aitune backends | grep inductor`` must find whole names, whatever the terminal width."""
    from aitune.builtin import buildcache

    result = CliRunner().invoke(app, ["backends"], env={"COLUMNS": "40"})
    assert result.exit_code == 0, result.output
    header, *lines = result.output.splitlines()
    assert header.split("\t") == ["backend", "distribution", "version", "status", "devices", "why not"]
    rows = {line.split("\t")[0]: line.split("\t") for line in lines}
    assert set(rows) == set(aitune_manager.registry.names())
    for name in aitune_manager.registry.names():
        status = aitune_manager.registry.status(name)
        assert rows[name][1:3] == [status.distribution, status.version]
    info = CliRunner().invoke(app, ["cache", "info"], env={"COLUMNS": "20"})
    assert info.output.startswith(str(buildcache.info()["path"]) + ":")


def test_every_command_that_prints_a_table_has_json():
    import typer.main

    command = typer.main.get_command(app)
    tables = {"backends", "show", "tune", "inspect", "demo", "verify"}
    for name in tables:
        assert "--json" in [o for p in command.commands[name].params for o in p.opts], name
    cache = command.commands["cache"]
    assert "--json" in [o for p in cache.commands["info"].params for o in p.opts]


@pytest.mark.parametrize(
    ("engine", "package"),
    [([], "aitune_serve_kserve"), (["--engine", "ray"], "aitune_serve_ray")],
    ids=["kserve", "ray"],
)
def test_serve_without_the_engine_names_what_to_install(monkeypatch, tmp_path, engine, package):
    import sys

    monkeypatch.setitem(sys.modules, package, None)  # as if not installed: importing it fails
    monkeypatch.setitem(sys.modules, f"{package}.launch", None)
    artifact = tmp_path / "model.ait"
    artifact.write_bytes(b"")
    result = CliRunner().invoke(app, ["serve", str(artifact), "--factory", "mymodels:build", *engine])
    assert result.exit_code == 1
    assert f"pip install {package.replace('_', '-')}" in result.output


def test_serve_refuses_the_other_engines_options(tmp_path):
    artifact = tmp_path / "model.ait"
    artifact.write_bytes(b"")
    result = CliRunner().invoke(app, ["serve", str(artifact), "--factory", "m:b", "--replicas", "2"])
    assert result.exit_code == 2 and "--engine ray" in result.output
    result = CliRunner().invoke(
        app, ["serve", str(artifact), "--factory", "m:b", "--engine", "ray", "--grpc-port", "9"]
    )
    assert result.exit_code == 2 and "kserve engine" in result.output
