"""The engine: everything between a user's ``ait.tune`` and a tuned module.

Recording real calls (``recording``), graphs and plans (``plan``), one graph's candidates
(``graph_tuning``), the strategies and the figures they decide on, the dispatcher and its guard,
the tuner, torch.distributed ranks and fan-out, and the JIT (``jit``). It sits below the public
facade (:mod:`aitune.torch`) and the artifact code, above the plugin contract.
"""
