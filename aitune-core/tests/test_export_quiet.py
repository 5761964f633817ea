"""What an exporter prints while aitune traces the user's module goes to aitune's log at DEBUG,
never to the user's terminal; other threads' output is left alone."""

from __future__ import annotations

import logging
import sys
import threading

import pytest
import torch

from aitune.tracer_output import captured


class DataDependent(torch.nn.Module):
    """A Python ``if`` on a tensor's value: torch.export fails on it and prints its partial graph."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if h.sum() > 0:
            h = h * 2
        return self.b(h)


def _tune_with_onnx_runtime() -> None:
    pytest.importorskip("onnxscript", reason="the dynamo ONNX exporter needs onnxscript")
    backend = pytest.importorskip("aitune_backend_onnxruntime.backend", reason="needs aitune-backend-onnxruntime")
    import aitune.torch as ait

    model = ait.Module(
        DataDependent().eval(),
        "dd",
        strategy=ait.FirstWinsStrategy([backend.ONNXRuntimeBackend()], performance_validation=False),
    )
    report = ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8)], show_progress=False, end_to_end=False)
    (candidate,) = report.modules[0].graphs[0].candidates
    assert candidate.status == "failed" and "data-dependent" in (candidate.reason or ""), candidate.reason


def test_a_failed_export_prints_no_graph_dump(capfd: pytest.CaptureFixture[str]) -> None:
    _tune_with_onnx_runtime()
    out, err = capfd.readouterr()
    assert "def forward" not in err and "GraphModule" not in err, err[:2000]
    assert "def forward" not in out, out[:2000]


def test_the_graph_dump_is_in_aitunes_log_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="aitune")
    _tune_with_onnx_runtime()
    dumps = [r for r in caplog.records if r.levelno == logging.DEBUG and "def forward" in r.getMessage()]
    assert dumps, [r.getMessage()[:200] for r in caplog.records]
    assert dumps[0].name.startswith("aitune.")
    assert "tracing DataDependent printed" in dumps[0].getMessage()
    assert "if h.sum() > 0" in dumps[0].getMessage()  # the dump itself, with the line that stopped the trace


def test_another_threads_output_is_not_captured(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="aitune")
    inside, printed = threading.Event(), threading.Event()

    def other() -> None:
        inside.wait()
        print("the progress line", file=sys.stderr)
        print("a serving thread's answer")
        printed.set()

    thread = threading.Thread(target=other)
    thread.start()
    with captured("tracing Something"):
        print("partial graph", file=sys.stderr)
        inside.set()
        printed.wait()
        print("[torch.onnx] progress")
    thread.join()
    out, err = capsys.readouterr()
    assert "the progress line" in err and "a serving thread's answer" in out
    assert "partial graph" not in err and "[torch.onnx]" not in out
    logged = [r.getMessage() for r in caplog.records if "tracing Something printed" in r.getMessage()]
    assert len(logged) == 1 and "partial graph" in logged[0] and "[torch.onnx] progress" in logged[0]
    assert "the progress line" not in logged[0]


def test_the_streams_are_put_back_after_the_last_capture(capsys: pytest.CaptureFixture[str]) -> None:
    before = sys.stdout, sys.stderr
    with captured("outer"):
        with captured("inner"):
            assert sys.stderr is not before[1]
        assert sys.stderr is not before[1]
    assert (sys.stdout, sys.stderr) == before
