"""The CUDA-graph replay policy on CPU: a graph is replayed only while its context keeps the shape it
was captured at (A-B-A recaptures A), and at most ``max_graphs`` are kept."""

from __future__ import annotations

from aitune_backend_tensorrt.graphs import CapturedGraph, GraphCache


class Context:
    """One profile's execution context: its binding count rises whenever its shape changes."""

    def __init__(self) -> None:
        self.shape: tuple[int, ...] | None = None
        self.binding = 0

    def set(self, shape: tuple[int, ...]) -> None:
        if shape != self.shape:
            self.shape, self.binding = shape, self.binding + 1


def _call(cache: GraphCache, context: Context, profile: int, shape: tuple[int, ...], log: list[str]) -> None:
    """What ``EngineRunner._replay`` does, the CUDA calls left out: replay a current graph or capture."""
    key = (profile, shape)
    if cache.current(key, context.binding) is None:
        context.set(shape)  # the capture binds the context to this shape
        cache.add(key, CapturedGraph(f"graph{shape}", [], [], context.binding))
        log.append(f"capture {shape}")
    else:
        log.append(f"replay {shape}")


def test_a_graph_is_recaptured_after_its_context_was_set_to_another_shape():
    cache, context, log = GraphCache(8), Context(), []
    for shape in [(4,), (4,), (8,), (4,), (4,)]:
        _call(cache, context, 0, shape, log)
    assert log == ["capture (4,)", "replay (4,)", "capture (8,)", "capture (4,)", "replay (4,)"]
    assert cache.recaptures == 1


def test_shapes_on_profiles_of_their_own_keep_their_graphs():
    cache, contexts, log = GraphCache(8), {0: Context(), 1: Context()}, []
    for profile, shape in [(0, (4,)), (1, (8,)), (0, (4,)), (1, (8,))]:
        _call(cache, contexts[profile], profile, shape, log)
    assert log == ["capture (4,)", "capture (8,)", "replay (4,)", "replay (8,)"]
    assert cache.recaptures == 0


def test_at_most_max_graphs_are_kept_least_recently_used_out_first():
    cache, contexts, log = GraphCache(2), [Context() for _ in range(3)], []
    for profile, shape in [(0, (1,)), (1, (2,)), (0, (1,)), (2, (3,))]:
        _call(cache, contexts[profile], profile, shape, log)
    assert cache.kept() == [(0, (1,)), (2, (3,))]  # (1, (2,)) was the least recently used
    assert cache.recaptures == 0
