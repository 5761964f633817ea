"""The JIT's machinery (the public face is :mod:`aitune.torch.jit`).

One job per file, each importing only those after it: ``hooks`` (switching on and off, the two
forward hooks), ``observe`` (recording a candidate's calls), ``decide`` (what becomes of a
candidate), ``admission`` (which modules become candidates), ``install`` (putting winners in
place), ``state`` (the JIT's state in this process); ``decision_store`` remembers decisions across
runs and ``settings`` holds what the user set.
"""
