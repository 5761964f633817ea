"""``ait.tune``'s arguments reach :class:`TuneOptions` by name, each one: no ``**kwargs`` on the way
hides a name from ``help(ait.tune)``, from type checking, or from the forwarding."""

from __future__ import annotations

import inspect

import pytest
import torch

import aitune.torch as ait
from aitune.engine.options import TuneOptions

OWN = {"model_or_callable", "dataset", "manager"}
"""``ait.tune``'s arguments that are not options: what is tuned, on what, with which plugins."""


def _parameters(function) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(function).parameters)


def test_every_tune_option_is_a_named_parameter_with_the_same_default_on_both_sides():
    tune, options = _parameters(ait.tune), _parameters(TuneOptions.from_arguments)
    for name, parameters in (("ait.tune", tune), ("TuneOptions.from_arguments", options)):
        hidden = [p.name for p in parameters.values() if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        assert not hidden, f"{name} takes *{hidden}: every argument is named"
    assert set(tune) - OWN == set(options) - {"executors"}, "ait.tune and its options list the same names"
    assert {n: tune[n].default for n in set(tune) - OWN} == {n: options[n].default for n in set(tune) - OWN}


class Forwarded(Exception):
    """Raised by the spy in place of building the options: what ``ait.tune`` passed is all we need."""


def test_ait_tune_forwards_each_argument_under_its_own_name(monkeypatch):
    received: dict[str, object] = {}

    def spy(**arguments):
        received.update(arguments)
        raise Forwarded

    monkeypatch.setattr(TuneOptions, "from_arguments", staticmethod(spy))
    given = {name: object() for name in set(_parameters(ait.tune)) - OWN}
    with pytest.raises(Forwarded):
        ait.tune(ait.Module(torch.nn.Linear(2, 2), "m"), [torch.randn(1, 2)], **given)
    assert {name: received.get(name) for name in given} == given, "each value arrived as given, under its name"
