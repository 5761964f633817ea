"""A default candidate another one supersedes (``Backend.superseded_by``) is built only when that one
is not correct: its build could not win, only cost time (``torch.compile`` beside AOTInductor on the
CPU). A strategy that lists its backends builds every one listed.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from aitune_testkit.doubles import SlowModule, WrongBackend

import aitune.torch as ait
from aitune import hookimpl
from aitune.plugins import AituneManager
from aitune.registry import BackendRegistry
from aitune.testing.backends import ToyBackend, register


class Covered(ToyBackend):
    """Declared first, so the tune's order lists it first; the covering backend supersedes it on the CPU."""

    name = "toy_covered"
    builds: ClassVar[list[str]] = []

    def superseded_by(self, device: torch.device) -> tuple[str, ...]:
        return ("toy_covering",) if device.type == "cpu" else ()

    def build(self, module: torch.nn.Module, context: Any) -> None:
        Covered.builds.append(context.module_name)
        super().build(module, context)


class Covering(ToyBackend):
    name = "toy_covering"


class WrongCovering(WrongBackend):
    """The covering backend, but its answers are 10% off: it fails validation."""

    name = "toy_covering"


def _manager(covering: type[ToyBackend]) -> AituneManager:
    class Candidates:
        @hookimpl
        def aitune_register_backends(self, registry: BackendRegistry) -> None:
            register(registry, (Covered, covering), __name__, default_candidate=True)

    manager = AituneManager()
    manager.register(Candidates(), name="candidates", distribution="test-plugin")
    return manager


def _tune(covering: type[ToyBackend], strategy: ait.TuneStrategy | None = None) -> Any:
    return _report(covering, strategy).modules[0].graphs[0]


def _report(covering: type[ToyBackend], strategy: ait.TuneStrategy | None = None) -> Any:
    Covered.builds.clear()
    model = ait.Module(SlowModule(delay_s=0.01).eval(), "m", strategy=strategy or ait.MaxThroughputStrategy())
    return ait.tune(model, [torch.randn(2, 8)], end_to_end=False, manager=_manager(covering))


def test_a_default_candidate_is_not_built_when_the_one_that_supersedes_it_is_correct(aitune_cache_dir):
    graph = _tune(Covering)
    assert Covered.builds == [], "its build could not win: not built"
    assert [(c.backend, c.status) for c in graph.candidates] == [
        ("toy_covered", "superseded"),
        ("toy_covering", "selected"),
    ], "listed in the strategy's order, though tried last"
    assert "toy_covering built and passed validation" in graph.candidates[0].reason
    assert graph.decision == "toy_covering"


def test_it_is_built_when_the_one_that_supersedes_it_fails_validation(aitune_cache_dir):
    graph = _tune(WrongCovering)
    assert Covered.builds == ["m"]
    statuses = {c.backend: c.status for c in graph.candidates}
    assert statuses == {"toy_covered": "selected", "toy_covering": "failed"}
    assert graph.decision == "toy_covered"


def test_a_strategy_that_lists_both_builds_both(aitune_cache_dir):
    strategy = ait.MaxThroughputStrategy(backends=[Covered(), Covering()])
    graph = _tune(Covering, strategy)
    assert Covered.builds == ["m"], "listed by the user: built"
    assert {c.backend: c.status for c in graph.candidates}.keys() == {"toy_covered", "toy_covering"}
    assert all(c.profiles for c in graph.candidates), "both measured"


def test_the_reports_show_the_superseded_candidate_and_why(aitune_cache_dir):
    from aitune.render.html import render_html
    from aitune.render.markdown import render_markdown

    report = _report(Covering)
    assert "| toy_covered | superseded |" in render_markdown(report)
    html = render_html(report)
    assert '<tr class="superseded"><td>toy_covered</td>' in html, "greyed out like a candidate not built"
    assert "toy_covering built and passed validation" in html
