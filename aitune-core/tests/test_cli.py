"""The aitune command line."""

from __future__ import annotations

import json

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
    from aitune.plugins import AituneManager, set_manager

    fake_distribution("broken-aitune-plugin", "broken_plugin", "raise ImportError('libfoo missing')")
    with __import__("pytest").warns(RuntimeWarning):
        manager = AituneManager()
        manager.load_entry_points()
    previous = set_manager(manager)
    try:
        result = CliRunner().invoke(app, ["backends"], env={"COLUMNS": "200"})
    finally:
        set_manager(previous)
    assert result.exit_code == 0
    assert "broken_plugin" in result.output and "failed to load" in result.output
    assert "libfoo missing" in result.output


def test_backends_table_keeps_install_hints_intact(aitune_manager):
    result = CliRunner().invoke(app, ["backends"], env={"COLUMNS": "300"})
    assert result.exit_code == 0
    if "tensorrt" in aitune_manager.registry.names() and aitune_manager.registry.status("tensorrt").reason():
        assert "aitune-backend-tensorrt[runtime]" in result.output, "rich markup must not eat '[runtime]'"
