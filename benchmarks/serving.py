"""Serving under load: a closed loop of clients against ``aitune serve``'s engines on localhost.

``python -m benchmarks.serving [--engines ray,kserve] [--artifact demo.ait] [--clients 8] [--requests 400] [--out r.json]``.
The same Ray Serve setup serves, one after the other: (a) the eager model, one call per request;
(b) the eager model with the tuned artifact's batching; (c) the tuned artifact with it; (g) the
ceiling: a deployment that reads the body and answers, no model. Then ``aitune serve`` on KServe's
ModelServer (a process of its own) serves (d) the tuned artifact and (e) the same with ``--eager``,
and, for the BERT case, (f) the yardstick: the same graph written by hand, a kserve ``Model``
running an ONNX Runtime session on a TorchScript export, one call per request, and, with
``--pytriton-python``, (h) Triton Inference Server through PyTriton around the same session, its
dynamic batcher joining up to 8 rows (PyTriton needs ``numpy<2``, so it runs in an interpreter of
its own). Both engines answer the Open Inference Protocol, and every setup is driven by Triton's
own HTTP client with binary tensors: each client sends one-row requests back to back (a fixed
number in all, so a run stops by itself) and times each; the table gives throughput, p50/p99
latency and the share of model calls served by a tuned backend. Then the kill run: two replicas of (c), one killed by ``ray.kill`` a
third of the way through; every request is answered, or fails with an error that a retry (up to
30 s) answers; a request neither answered nor retried to an answer is lost.

Without ``--artifact``, the demo model (``aitune.demo``) is tuned for batches of 4 and 8 with
MaxThroughput over ONNX Runtime, and saved to a temporary folder.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import platform
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

APP = "bench"
SEQ = 32
"""The BERT case's sequence length (tuned static; every request has it)."""


def _figures(total: int, latencies: list[float], wall: float) -> dict[str, Any]:
    """What every closed-loop run reports: requests, answers, throughput, p50 and p99 (ms)."""
    ms = sorted(x * 1000 for x in latencies)
    return {
        "requests": total,
        "answered": len(latencies),
        "wall_s": wall,
        "throughput_rps": len(latencies) / wall,
        "p50_ms": statistics.median(ms) if ms else None,
        "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))] if ms else None,
    }


def tune_demo(folder: Path) -> Path:
    """The demo model tuned with ONNX Runtime for batches of 4 and 8 (MaxThroughput, eager kept if faster)."""
    import aitune.torch as ait
    from aitune import demo
    from aitune.torch.backend import ONNXRuntimeBackend

    model, data = demo.model_and_data()
    model.features = ait.Module(model.features, "features", strategy=ait.MaxThroughputStrategy([ONNXRuntimeBackend()]))
    model.head = ait.Module(model.head, "head", strategy=ait.MaxThroughputStrategy([ONNXRuntimeBackend()]))
    ait.tune(model, data)
    path = folder / "classifier.ait"
    ait.save(model, path)
    return path


def build_bert() -> Any:
    """A 2-layer BERT from a small config (nothing downloaded): the ``bert`` case's factory."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512, vocab_size=100
    )
    return transformers.BertModel(config).eval()


def _tokens(batch: int, seed: int) -> dict[str, Any]:
    """``input_ids`` and a mask with a few padded positions at the end of each row."""
    import torch

    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, SEQ, dtype=torch.long)
    for row in range(batch):
        mask[row, SEQ - 1 - row % 4 :] = 0
    return {"input_ids": torch.randint(0, 100, (batch, SEQ), generator=g), "attention_mask": mask}


def tune_bert(folder: Path) -> Path:
    """The BERT case tuned as a whole for batches of 1 to 8 (MaxThroughput over ONNX Runtime): a lone
    batch-1 request runs at its own size, not padded up to the smallest tuned one."""
    import aitune.torch as ait
    from aitune.torch.backend import ONNXRuntimeBackend

    model = ait.Module(build_bert(), "bert", strategy=ait.MaxThroughputStrategy([ONNXRuntimeBackend()]))
    ait.tune(model, [_tokens(1, 0), _tokens(4, 1), _tokens(8, 2)])
    path = folder / "bert.ait"
    ait.save(model, path)
    return path


def _triton_request(case: str) -> tuple[list[Any], list[Any]]:
    """One request of the case in Triton's client: its inputs as binary tensors, and the one output
    every setup asks for (binary too)."""
    import tritonclient.http as httpclient

    inputs = []
    for name, array in _kserve_inputs(case).items():
        tensor = httpclient.InferInput(name, list(array.shape), "FP32" if array.dtype.kind == "f" else "INT64")
        tensor.set_data_from_numpy(array, binary_data=True)
        inputs.append(tensor)
    return inputs, [httpclient.InferRequestedOutput(KSERVE_OUTPUTS[case], binary_data=True)]


def _oip_body(case: str) -> tuple[bytes, dict[str, str]]:
    """One request of the case as the protocol's binary body (what Triton's client sends), for the
    kill run's plain HTTP client, which retries."""
    import tritonclient.http as httpclient

    inputs, outputs = _triton_request(case)
    body, json_size = httpclient.InferenceServerClient.generate_request_body(inputs, outputs=outputs)
    headers = {"Content-Type": "application/octet-stream"}
    if json_size is not None:
        headers["Inference-Header-Content-Length"] = str(json_size)
    return body, headers


CASES = {
    "demo": ("aitune.demo:build_model", tune_demo),
    "bert": ("benchmarks.serving:build_bert", tune_bert),
}
"""Per case: the factory every replica imports, and how to tune it."""


def load(url: str, case: str, clients: int, total: int, on_progress: Any = None, retry: bool = False) -> dict[str, Any]:
    """``total`` requests from ``clients`` closed-loop clients; latencies, and what failed and why."""
    import requests

    body, headers = _oip_body(case)
    latencies: list[float] = []
    failures: list[str] = []
    retried_ok = 0
    lost = 0
    counter = iter(range(total))
    lock = threading.Lock()

    def client() -> None:
        nonlocal retried_ok, lost
        session = requests.Session()
        while True:
            with lock:
                n = next(counter, None)
            if n is None:
                return
            if on_progress is not None:
                on_progress(n)
            start = time.perf_counter()
            error = _send(session, url, body, headers)
            if error is None:
                with lock:
                    latencies.append(time.perf_counter() - start)
                continue
            with lock:
                failures.append(error)
            if retry:
                answered = _retry(session, url, body, headers)
                with lock:
                    retried_ok += answered
                    lost += not answered
            else:
                with lock:
                    lost += 1

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(client) for _ in range(clients)]:
            future.result()
    return {
        **_figures(total, latencies, time.perf_counter() - start),
        "failures": failures,
        "answered_on_retry": retried_ok,
        "lost": lost,
    }


def _send(session: Any, url: str, body: bytes, headers: dict[str, str]) -> str | None:
    """None when answered (200), else what the client saw."""
    import requests

    try:
        answer = session.post(url, data=body, headers=headers, timeout=60)
    except requests.RequestException as exc:
        return f"{type(exc).__name__}"
    if answer.status_code == 200:
        return None
    return f"HTTP {answer.status_code}: {answer.text[:160]}"


def _retry(session: Any, url: str, body: bytes, headers: dict[str, str], within_s: float = 30.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if _send(session, url, body, headers) is None:
            return True
        time.sleep(0.2)
    return False


def _stats() -> list[dict[str, Any]]:
    """Every replica's stats, through its handle (each call reaches one replica; ask until all answered)."""
    from ray import serve

    handle = serve.get_app_handle(APP)
    seen: dict[int, dict[str, Any]] = {}
    for _ in range(20):
        stats = handle.stats.remote().result(timeout_s=60)
        seen[stats["pid"]] = stats
    return list(seen.values())


def _tuned_share(stats: list[dict[str, Any]]) -> float | None:
    """The share of tuned-module calls a tuned backend (not eager) served."""
    counts: dict[str, int] = {}
    for replica in stats:
        for key, n in replica["batches_by_backend"].items():
            counts[key] = counts.get(key, 0) + n
    total = sum(counts.values())
    tuned = sum(n for key, n in counts.items() if not key.endswith("=torch_eager"))
    return tuned / total if total else None


def run_setup(url: str, case: str, artifact: Path, args: argparse.Namespace, **options: Any) -> dict[str, Any]:
    """One Ray Serve setup, driven as the kserve engine is: Triton's client, binary tensors."""
    from ray import serve

    import aitune_serve_ray

    app = aitune_serve_ray.deployment(CASES[case][0], artifact, threads=args.threads, **options)
    serve.run(app, name=APP, route_prefix="/")
    address, model = url.removeprefix("http://").rstrip("/"), artifact.stem
    load_kserve(address, model, case, args.clients, args.warmup)  # warm-up, not counted
    result = load_kserve(address, model, case, args.clients, args.requests)
    stats = _stats()
    result["tuned_share"] = _tuned_share(stats)
    sizes = [s for replica in stats for s in replica["batch_sizes"]]
    result["mean_batch_size"] = statistics.mean(sizes) if sizes else None
    serve.delete(APP)
    return result


NOOP_ANSWER = b'{"model_name":"noop","outputs":[{"name":"output","datatype":"FP32","shape":[1,1],"data":[0.0]}]}'
"""What the ceiling's deployment answers every request: a valid protocol answer, one number."""


def run_noop(url: str, case: str, args: argparse.Namespace) -> dict[str, Any]:
    """(g) the ceiling: plain Ray Serve, a deployment that reads the body and answers a canned protocol
    answer, no model and no codec, driven like the others. No server on Ray Serve answers faster."""
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import Response

    @serve.deployment(max_ongoing_requests=64, ray_actor_options={"num_cpus": args.threads})
    class Noop:
        async def __call__(self, request: Request) -> Response:
            await request.body()
            return Response(NOOP_ANSWER, media_type="application/json")

    serve.run(Noop.bind(), name=APP, route_prefix="/")
    address = url.removeprefix("http://").rstrip("/")
    load_kserve(address, "noop", case, args.clients, args.warmup)  # warm-up, not counted
    result = load_kserve(address, "noop", case, args.clients, args.requests)
    serve.delete(APP)
    return result


def run_kill(url: str, artifact: Path, args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray import serve

    import aitune_serve_ray

    app = aitune_serve_ray.deployment(CASES["demo"][0], artifact, replicas=2, threads=args.threads)
    serve.run(app, name=APP, route_prefix="/")
    url = f"{url}v2/models/{artifact.stem}/infer"
    load(url, "demo", args.clients, args.warmup)
    killed: list[str] = []

    def kill_at_a_third(n: int) -> None:
        if n == args.requests // 3 and not killed:
            [name, *_] = sorted(
                a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "SERVE_REPLICA" in a["name"]
            )
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
            killed.append(name)

    result = load(url, "demo", args.clients, args.requests, on_progress=kill_at_a_third, retry=True)
    result["killed"] = killed
    serve.delete(APP)
    return result


KSERVE_OUTPUTS = {"demo": "output", "bert": "pooler_output"}
"""The output each case's kserve requests ask for (output selection, as a client would)."""


def _kserve_inputs(case: str) -> dict[str, Any]:
    """One request's tensors as numpy arrays, named as the model's forward parameters."""
    import numpy as np

    if case == "demo":
        return {"images": np.random.default_rng(0).standard_normal((1, 3, 32, 32), dtype=np.float32)}
    return {name: t.numpy() for name, t in _tokens(1, 3).items()}


def load_kserve(url: str, model: str, case: str, clients: int, total: int) -> dict[str, Any]:
    """``total`` binary requests from ``clients`` closed-loop Triton HTTP clients; latencies and what
    each answer's parameters say (the backend, the size of the model call)."""
    import tritonclient.http as httpclient

    latencies: list[float] = []
    failures: list[str] = []
    backends: list[str] = []
    sizes: list[int] = []
    counter = iter(range(total))
    lock = threading.Lock()

    def client() -> None:
        connection = httpclient.InferenceServerClient(url, network_timeout=60)
        inputs, outputs = _triton_request(case)
        try:
            while True:
                with lock:
                    n = next(counter, None)
                if n is None:
                    return
                start = time.perf_counter()
                try:
                    result = connection.infer(model, inputs, outputs=outputs)
                except Exception as exc:  # counted, not raised: the table says what failed
                    with lock:
                        failures.append(f"{type(exc).__name__}: {str(exc)[:160]}")
                    continue
                elapsed = time.perf_counter() - start
                parameters = result.get_response().get("parameters", {})
                with lock:
                    latencies.append(elapsed)
                    backends.append(parameters.get("aitune_backend", ""))
                    sizes.append(int(parameters.get("aitune_batch_size", 1)))
        finally:
            connection.close()

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(client) for _ in range(clients)]:
            future.result()
    wall = time.perf_counter() - start
    routes = [route.strip() for served in backends for route in served.split(",") if "=" in route]
    return {
        **_figures(total, latencies, wall),
        "failures": failures,
        "lost": len(failures),
        "tuned_share": sum(not r.endswith("=torch_eager") for r in routes) / len(routes) if routes else None,
        "mean_batch_size": statistics.mean(sizes) if sizes else None,
    }


def export_bert_by_hand(folder: Path) -> Path:
    """The BERT case as a user would export it without aitune: TorchScript ONNX export, batch axis dynamic."""
    import torch

    bert = build_bert()

    class Outputs(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            out = self.bert(input_ids=input_ids, attention_mask=attention_mask)
            return out.last_hidden_state, out.pooler_output

    tokens = _tokens(1, 3)
    path = folder / "bert.onnx"
    names = ["input_ids", "attention_mask", "last_hidden_state", "pooler_output"]
    torch.onnx.export(
        Outputs().eval(),
        (tokens["input_ids"], tokens["attention_mask"]),
        str(path),
        input_names=names[:2],
        output_names=names[2:],
        dynamic_axes={name: {0: "batch"} for name in names},
        dynamo=False,
    )
    return path


def serve_by_hand(onnx_path: str, port: int, threads: int) -> None:
    """A kserve ``Model`` written by hand around an ONNX Runtime session (one call per request); blocks."""
    import sys

    import onnxruntime as ort

    sys.argv = sys.argv[:1]  # kserve.model_server parses the command line when imported
    from kserve import Model, ModelServer
    from kserve.protocol.infer_type import InferOutput, InferResponse

    class ByHand(Model):
        def load(self) -> bool:
            options = ort.SessionOptions()
            options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
            self.session = ort.InferenceSession(onnx_path, options, providers=["CPUExecutionProvider"])
            self.names = [o.name for o in self.session.get_outputs()]
            self.ready = True
            return True

        def predict(self, payload: Any, headers: Any = None) -> Any:
            wanted = [o.name for o in payload.request_outputs or []] or self.names
            arrays = self.session.run(wanted, {i.name: i.as_numpy() for i in payload.inputs})
            outputs = [
                InferOutput(name=n, shape=list(a.shape), datatype="FP32", data=a) for n, a in zip(wanted, arrays)
            ]
            return InferResponse(
                response_id=payload.id or "",
                model_name=self.name,
                infer_outputs=outputs,
                use_binary_outputs=payload.use_binary_outputs,
                requested_outputs=payload.request_outputs,
            )

    model = ByHand("bert")
    model.load()
    ModelServer(http_port=port, enable_grpc=False, workers=1, enable_latency_logging=False).start([model])


def serve_pytriton_by_hand(onnx_path: str, port: int, threads: int) -> None:
    """Triton Inference Server through PyTriton, written by hand around the same ONNX Runtime session:
    its dynamic batcher joins what queued, up to 8 rows, with no queue delay (issue 51's fastest
    Triton setup). Runs in an interpreter of its own (``--pytriton-python``): PyTriton 0.7.0 requires
    ``numpy<2``, which kserve's environment cannot hold. Blocks."""
    import signal

    import numpy as np
    import onnxruntime as ort
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import DEFAULT_PROTECTED_ENDPOINTS, Triton, TritonConfig, TritonSecurityConfig

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(onnx_path, options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]

    def infer(requests: list[Any]) -> list[dict[str, Any]]:
        """The requests Triton's batcher joined, as one session call for only the outputs they ask for
        (PyTriton's ``@batch`` would hand over every output), split back per request."""
        wanted = list(dict.fromkeys(n for r in requests for n in (r.requested_output_names or names)))
        rows = [len(r["input_ids"]) for r in requests]
        feed = {k: np.concatenate([r[k] for r in requests]) for k in requests[0]}
        arrays = session.run(wanted, feed)
        answers, start = [], 0
        for n in rows:
            answers.append({name: a[start : start + n] for name, a in zip(wanted, arrays)})
            start += n
        return answers

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # leaves the with block below, which stops Triton's server

    signal.signal(signal.SIGTERM, stop)
    config = TritonConfig(http_port=port, grpc_port=_free_port(), metrics_port=_free_port(), log_verbose=0)
    # the statistics open to the benchmark, which reads the rows per model call from them
    security = TritonSecurityConfig(restricted_endpoints=[e for e in DEFAULT_PROTECTED_ENDPOINTS if e != "statistics"])
    with Triton(config=config, security_config=security) as triton:
        triton.bind(
            model_name="bert",
            infer_func=infer,
            inputs=[
                Tensor(name="input_ids", dtype=np.int64, shape=(-1,)),
                Tensor(name="attention_mask", dtype=np.int64, shape=(-1,)),
            ],
            outputs=[
                Tensor(name="last_hidden_state", dtype=np.float32, shape=(-1, -1)),
                Tensor(name="pooler_output", dtype=np.float32, shape=(-1,)),
            ],
            config=ModelConfig(max_batch_size=8, batcher=DynamicBatcher(max_queue_delay_microseconds=0)),
            strict=False,
        )
        triton.serve()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(
    case: str,
    artifact: Path,
    args: argparse.Namespace,
    port: int,
    eager: bool = False,
    by_hand: Path | None = None,
    hand: str = "kserve",
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of ``aitune serve`` (the kserve engine), or of a server written
    by hand (``hand``: "kserve" for :func:`serve_by_hand`, "triton" for :func:`serve_pytriton_by_hand`,
    run by ``args.pytriton_python``)."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    if by_hand is None:
        command = [sys.executable, "-m", "aitune", "serve", str(artifact), "--factory", CASES[case][0]]
        return [*command, "--port", str(port), "--threads", str(args.threads), *(["--eager"] if eager else [])], env
    python = sys.executable if hand == "kserve" else args.pytriton_python
    command = [python, "-m", "benchmarks.serving", f"--serve-{hand}-by-hand", str(by_hand), "--port", str(port)]
    if hand == "triton":  # PyTriton's stub links libpython: under pyenv, the interpreter's own
        libdir = subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [libdir, os.environ.get("LD_LIBRARY_PATH")]))
    return [*command, "--threads", str(args.threads)], env


@contextlib.contextmanager
def _server(
    case: str,
    artifact: Path,
    args: argparse.Namespace,
    eager: bool = False,
    by_hand: Path | None = None,
    hand: str = "kserve",
) -> Iterator[tuple[str, str]]:
    """The server of :func:`server_command` in a process group of its own, ready: its URL and model
    name; SIGTERM to the group at the end (Triton's server is a child of PyTriton's process)."""
    import signal
    import subprocess

    port = _free_port()
    command, env = server_command(case, artifact, args, port, eager, by_hand, hand)
    url, model = f"127.0.0.1:{port}", artifact.stem
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            _wait_ready(server, log, url, model)
            yield url, model
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()


def _triton_batches(url: str, model: str) -> tuple[int, int]:
    """Triton's own count of rows inferred and model calls made (its statistics extension)."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url)
    try:
        [stats] = client.get_inference_statistics(model)["model_stats"]
    finally:
        client.close()
    return int(stats["inference_count"]), int(stats["execution_count"])


def run_kserve(
    case: str, artifact: Path, args: argparse.Namespace, eager: bool, by_hand: Path | None = None, hand: str = "kserve"
) -> dict[str, Any]:
    """``aitune serve`` (the kserve engine), or a server written by hand, in a process of its own:
    warm-up, the counted run, SIGTERM. Triton's rows per model call are read from its statistics."""
    with _server(case, artifact, args, eager, by_hand, hand) as (url, model):
        load_kserve(url, model, case, args.clients, args.warmup)  # warm-up, not counted
        if hand != "triton" or by_hand is None:
            return load_kserve(url, model, case, args.clients, args.requests)
        rows, calls = _triton_batches(url, model)
        result = load_kserve(url, model, case, args.clients, args.requests)
        rows_after, calls_after = _triton_batches(url, model)
        return {**result, "mean_batch_size": (rows_after - rows) / max(calls_after - calls, 1)}


def run_interleaved(case: str, artifact: Path, by_hand: Path, args: argparse.Namespace) -> dict[str, Any]:
    """(d) and (f) up at once, with a second process of (f) (and (h), with ``--pytriton-python``), one
    client sending each request to each in turn, the order rotating: all are timed under the same
    conditions, so a busy machine slows them alike and their ratios hold where the separate runs'
    figures do not. The second (f) is the method's floor: how far two processes of the same server
    drift apart (caches, placement)."""
    import tritonclient.http as httpclient

    wanted = [
        (INTERLEAVED[0], None, "kserve"),
        (INTERLEAVED[1], by_hand, "kserve"),
        (INTERLEAVED[2], by_hand, "kserve"),
    ]
    if args.pytriton_python:
        wanted.append((INTERLEAVED_TRITON, by_hand, "triton"))
    with contextlib.ExitStack() as stack:
        servers = {
            name: stack.enter_context(_server(case, artifact, args, False, path, hand)) for name, path, hand in wanted
        }
        clients = {
            name: stack.enter_context(contextlib.closing(httpclient.InferenceServerClient(url, network_timeout=60)))
            for name, (url, _) in servers.items()
        }
        inputs, outputs = _triton_request(case)
        latencies: dict[str, list[float]] = {name: [] for name in servers}
        names = list(servers)
        for i in range(args.warmup + args.requests):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                start = time.perf_counter()
                clients[name].infer(servers[name][1], inputs, outputs=outputs)
                if i >= args.warmup:
                    latencies[name].append(time.perf_counter() - start)
    results = {}
    for name, times in latencies.items():
        results[name] = {
            **_figures(len(times), times, sum(times)),  # one client: throughput is 1 / the mean latency
            "failures": [],
            "lost": 0,
            "tuned_share": None,
            "mean_batch_size": 1.0,
        }
    return results


INTERLEAVED = (
    "(d) kserve, tuned, interleaved with (f)",
    "(f) kserve by hand, interleaved with (d)",
    "(f) again, a second process: the method's floor",
)
"""The setups of :func:`run_interleaved`, as the table names them."""
INTERLEAVED_TRITON = "(h) Triton by hand, interleaved with (d)"
TRITON_BY_HAND = "(h) Triton (PyTriton) by hand, dynamic batcher up to 8, no queue delay"


def _wait_ready(server: Any, log: Any, url: str, model: str, within_s: float = 300) -> None:
    import tritonclient.http as httpclient

    probe = httpclient.InferenceServerClient(url)
    deadline = time.monotonic() + within_s
    try:
        while True:
            if server.poll() is not None:
                log.seek(0)
                said = log.read()[-2000:].decode(errors="replace")
                raise RuntimeError(f"aitune serve exited {server.returncode}: {said}")
            try:
                if probe.is_model_ready(model):
                    return
            except Exception:  # not listening yet
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"aitune serve was not ready within {within_s:.0f} s")
            time.sleep(0.5)
    finally:
        probe.close()


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"Machine: {results['machine']}; {results['clients']} clients, {results['requests']} one-row requests "
        f"per setup after {results['warmup']} warm-up ones; {results['threads']} torch thread(s) per replica.",
        "",
        "| model | setup | throughput (req/s) | p50 (ms) | p99 (ms) | mean model call (rows) | calls on a tuned backend |",
        "|---|---|---|---|---|---|---|",
    ]
    for case, setups in results["setups"].items():
        for name, r in setups.items():
            share = "-" if r["tuned_share"] is None else f"{100 * r['tuned_share']:.0f}%"
            lines.append(
                f"| {case} | {name} | {r['throughput_rps']:.1f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
                f"{r['mean_batch_size']:.2f} | {share} |"
            )
    kill = results.get("kill")
    if kill:
        kinds: dict[str, int] = {}
        for failure in kill["failures"]:
            kinds[failure] = kinds.get(failure, 0) + 1
        lines += [
            "",
            f"Replica kill (demo, 2 replicas of (c), one killed after {results['requests'] // 3} requests): "
            f"{kill['answered']} answered at once, {len(kill['failures'])} failed and then "
            f"{kill['answered_on_retry']} answered on retry, {kill['lost']} lost.",
        ]
        lines += [f"- {n} x `{text}`" for text, n in sorted(kinds.items(), key=lambda kv: -kv[1])]
    return "\n".join(lines)


SETUPS = {
    "(a) eager, one call per request": {"eager": True, "batching": False},
    "(b) eager, the artifact's batching": {"eager": True},
    "(c) tuned artifact, its batching": {},
}
"""The Ray Serve setups."""
KSERVE_SETUPS = {"(d) kserve, tuned artifact": False, "(e) kserve, --eager": True}
"""The kserve engine's setups (``aitune serve``, the default engine): whether each serves eager."""


def _keep(results: dict[str, Any], case: str, name: str, result: dict[str, Any]) -> None:
    """One setup's figures into the results, and printed as they come (without the failures' texts)."""
    results["setups"][case][name] = result
    print(case, name, json.dumps({k: v for k, v in result.items() if k != "failures"}), flush=True)


def run_ray(cases: list[str], artifacts: dict[str, Path], args: argparse.Namespace, results: dict[str, Any]) -> None:
    """The Ray Serve setups (a) to (c) per case, then the replica-kill run, on one local Ray."""
    import ray
    from ray import serve

    port = _free_port()
    # the replicas import the bert factory from this checkout
    path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    ray.init(
        num_cpus=args.cpus, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": path}}
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}/"
    try:
        for case in cases:
            for name, options in SETUPS.items():
                result = run_setup(url, case, artifacts[case], args, **options)
                _keep(results, case, name, result)
            name = "(g) Ray Serve, a deployment that does nothing (the ceiling)"
            result = run_noop(url, case, args)
            _keep(results, case, name, result)
        if not args.no_kill and "demo" in cases:
            results["kill"] = run_kill(url, artifacts["demo"], args)
    finally:
        serve.shutdown()
        ray.shutdown()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="demo,bert", help="Comma-separated cases: demo, bert.")
    parser.add_argument("--artifact", type=Path, help="A tuned demo artifact (aitune demo's classifier.ait).")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1, help="Torch threads per replica.")
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 2, help="CPUs Ray may use.")
    parser.add_argument("--no-kill", action="store_true", help="Skip the replica-kill run.")
    parser.add_argument(
        "--interleaved",
        action="store_true",
        help="For the BERT, also run (d), (f) and a second process of (f) at once, one client sending each "
        "request to each in turn (ratios a busy machine moves less; the second (f) shows the method's floor).",
    )
    parser.add_argument("--engines", default="ray,kserve", help="Comma-separated engines: ray, kserve.")
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--pytriton-python",
        help="For the BERT, also (h): Triton through PyTriton by hand, run by this interpreter (one with "
        "nvidia-pytriton, onnxruntime and numpy<2, which kserve's environment cannot hold).",
    )
    parser.add_argument("--serve-kserve-by-hand", type=Path, help=argparse.SUPPRESS)  # (f)'s own process
    parser.add_argument("--serve-triton-by-hand", type=Path, help=argparse.SUPPRESS)  # (h)'s own process
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_kserve_by_hand:
        serve_by_hand(str(args.serve_kserve_by_hand), args.port, args.threads)
        return {}
    if args.serve_triton_by_hand:
        serve_pytriton_by_hand(str(args.serve_triton_by_hand), args.port, args.threads)
        return {}
    cases = [c for c in args.models.split(",") if c]
    unknown = set(cases) - set(CASES)
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; choose from {', '.join(CASES)}")

    engines = [e for e in args.engines.split(",") if e]
    if set(engines) - {"ray", "kserve"}:
        parser.error(f"unknown engines {sorted(set(engines) - {'ray', 'kserve'})}; choose from ray, kserve")

    folder = Path(tempfile.mkdtemp(prefix="aitune-serving-"))
    artifacts = {c: args.artifact if c == "demo" and args.artifact else CASES[c][1](folder) for c in cases}
    results: dict[str, Any] = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.1f} at start",
        "clients": args.clients,
        "requests": args.requests,
        "warmup": args.warmup,
        "threads": args.threads,
        "setups": {case: {} for case in cases},
    }
    if "ray" in engines:
        run_ray(cases, artifacts, args, results)
    if "kserve" in engines:
        for case in cases:
            for name, eager in KSERVE_SETUPS.items():
                result = run_kserve(case, artifacts[case], args, eager)
                _keep(results, case, name, result)
            if case == "bert":
                name = "(f) kserve, the same graph by hand"
                by_hand = export_bert_by_hand(folder)
                result = run_kserve(case, artifacts[case], args, False, by_hand=by_hand)
                _keep(results, case, name, result)
                if args.pytriton_python:
                    result = run_kserve(case, artifacts[case], args, False, by_hand=by_hand, hand="triton")
                    _keep(results, case, TRITON_BY_HAND, result)
                if args.interleaved:
                    for name, result in run_interleaved(case, artifacts[case], by_hand, args).items():
                        _keep(results, case, name, result)
    results["load_average_end"] = os.getloadavg()[0]
    print(markdown(results))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
