"""One TensorRT engine served from 8 threads, each on its own CUDA stream: every call gets its own answer.

The execution contexts, their bound addresses and the CUDA graphs are shared by all callers; the
runner's lock and stream ordering must keep calls apart. ``gpu``-marked: skips visibly without CUDA.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from aitune.backend import BuildContext
from aitune.graph import Sample, infer_graph

pytestmark = pytest.mark.gpu
THREADS, CALLS = 8, 200


@pytest.mark.parametrize("use_cuda_graphs", [False, True])
def test_eight_threads_on_their_own_streams_get_their_own_outputs(tmp_path: Path, use_cuda_graphs: bool) -> None:
    from aitune_backend_tensorrt import TensorRTBackend, TensorRTBackendConfig

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16)).eval().cuda()
    samples = [Sample((torch.randn(b, 32, device="cuda"),)) for b in (2, 8)]
    with torch.no_grad():
        graph = infer_graph(samples, ["x"], outputs=[module(*s.args) for s in samples])
    (tmp_path / "work").mkdir()
    backend = TensorRTBackend(TensorRTBackendConfig(use_cuda_graphs=use_cuda_graphs, tf32=False))
    with torch.no_grad():
        backend.build(module, BuildContext(graph, samples, torch.device("cuda"), tmp_path / "work", tmp_path / "c"))
    inputs = [torch.randn(2 + i % 7, 32, device="cuda") for i in range(THREADS)]
    with torch.no_grad():
        expected = [module(x) for x in inputs]
    wrong: list[str] = []

    def serve(i: int) -> None:
        stream = torch.cuda.Stream()
        with torch.inference_mode(), torch.cuda.stream(stream):
            for call in range(CALLS):
                y = backend.infer(inputs[i])
                stream.synchronize()
                if float((y - expected[i]).abs().max()) > 1e-3 * float(expected[i].abs().max()) + 1e-5:
                    wrong.append(f"thread {i} call {call}")
                    return

    threads = [threading.Thread(target=serve, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []
