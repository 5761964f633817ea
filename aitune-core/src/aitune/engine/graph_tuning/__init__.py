"""Graph tuning: what a strategy works with, one graph of one module, as four small steps.

The steps, in the order a strategy takes them, each a module with one input and one output:

1. :mod:`.build`: a backend template in, a :class:`Candidate` out (built, or failed, skipped, not
   applicable; never raised), through the ``aitune_build`` hook.
2. :mod:`.validate`: a built candidate in, whether it may stand in for eager out (the
   ``aitune_validate`` hook, or the user's metric).
3. :mod:`.profile`: correct candidates in, their timings against eager's at each batch size out
   (interleaved rounds through the ``aitune_profile`` hook; the noise probe, the dispatch cost).
4. :mod:`.decide`: the strategy's answer in, the graph's report decided out (winner or routes,
   reasons, the figures shown).

They share a :class:`Target` (the module, the graph, its recorded calls; never changed while
tuned) and a :class:`Ledger` (the graph's report, the candidates built, observers told of each
once). :class:`GraphTuning` (:mod:`.tuning`) is the API strategies are written against: it holds
those and hands each call to its step. Which candidates to try and which wins is the strategy's
rule (:mod:`..strategies`); a strategy never installs anything.
"""

from __future__ import annotations

from ...graph import narrow
from .candidate import Candidate, Route
from .ledger import Ledger
from .profile import BUILDS_AHEAD, NOISY_SPREAD
from .target import Target
from .tuning import GraphTuning

__all__ = ["BUILDS_AHEAD", "NOISY_SPREAD", "Candidate", "GraphTuning", "Ledger", "Route", "Target", "narrow"]
