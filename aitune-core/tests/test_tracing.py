"""A trace of the user's module never catches, nor stops, another thread's calls (issue 50).

``torch.export`` swaps the traced module's parameters for fake tensors and patches
``torch.nn.Module.__call__``/``__getattr__`` for the whole process while it traces. Under
``aitune.tracing.exclusive(module)`` it traces a detached copy, and the patches act in the tracing
thread alone: a serving thread that calls the same (shared) submodules mid-trace gets eager's
answers and never waits. The trace below stops in the middle until the other thread has made its
calls, so the test needs no timing: with the old lock it would wait forever (and time out), and
without the copy the other thread would compute with fake weights.
"""

from __future__ import annotations

import threading
from typing import ClassVar

import torch

from aitune import tracing
from aitune.testing import assert_matches_eager

CALLS = 5


class Pausing(torch.nn.Module):
    """A model whose forward, when traced in the tracing thread, waits for the other thread's calls
    (the control lives on the class: a module holding an Event would not deep-copy)."""

    tracer: ClassVar[list[int]] = []
    done: ClassVar[threading.Event] = threading.Event()

    def __init__(self, shared: torch.nn.Module) -> None:
        super().__init__()
        self.body = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if Pausing.tracer and threading.get_ident() == Pausing.tracer[0]:
            Pausing.tracer.clear()  # once: the export may run forward more than once
            assert Pausing.done.wait(60), "the other thread's calls did not finish while the trace was paused"
        return self.body(x).relu()


def test_another_threads_calls_run_eager_and_unblocked_in_the_middle_of_an_export():
    torch.manual_seed(0)
    body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    reference.load_state_dict(body.state_dict())
    Pausing.tracer[:] = [threading.get_ident()]
    done = Pausing.done
    done.clear()
    paused = Pausing(body)
    served = torch.nn.Sequential(body)  # the program's own model: it shares `body` with what is traced
    answers: list[tuple[torch.Tensor, torch.Tensor]] = []
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            with torch.inference_mode():
                for _ in range(CALLS):
                    x = torch.randn(3, 8)
                    answers.append((served(x), reference(x)))
        except BaseException as exc:  # reported below, in the test's own thread
            errors.append(exc)
        finally:
            done.set()

    server = threading.Thread(target=serve)
    original_forward = Pausing.forward

    def start_serving_then_trace(self: Pausing, x: torch.Tensor) -> torch.Tensor:
        if not server.is_alive() and not done.is_set():
            server.start()  # mid-trace: the fake weights and the patched Module methods are in place now
        return original_forward(self, x)

    Pausing.forward = start_serving_then_trace  # type: ignore[method-assign]
    try:
        with torch.no_grad(), tracing.exclusive(paused) as traced:
            assert traced is not paused and traced.body is not body, "the trace got the program's own modules"
            assert traced.body[0].weight is body[0].weight, "the copy shares the weights: nothing is copied"
            program = torch.export.export(traced, (torch.randn(2, 8),))
    finally:
        Pausing.forward = original_forward  # type: ignore[method-assign]
    server.join(60)
    assert not errors, f"a call made while the export traced failed: {errors[0]!r}"
    assert len(answers) == CALLS
    for mine, eager in answers:
        assert_matches_eager(mine, eager)
    x = torch.randn(2, 8)
    assert_matches_eager(program.module()(x), reference(x).relu())


def test_a_module_that_cannot_be_copied_is_traced_itself_under_the_lock():
    class Locked(torch.nn.Linear):
        def __init__(self) -> None:
            super().__init__(4, 4)
            self.guard = threading.Lock()  # deepcopy refuses a lock

    module = Locked()
    with tracing.exclusive(module) as traced:
        assert traced is module and tracing.held_here()
    assert not tracing.held_here()
