"""Serving under load: a closed loop of HTTP clients against Ray Serve on localhost.

``python -m benchmarks.serving [--artifact demo.ait] [--clients 8] [--requests 400] [--out r.json]``.
The same Ray Serve setup serves, one after the other: (a) the eager model, one call per request;
(b) the eager model with the tuned artifact's batching; (c) the tuned artifact with it. Each client
sends one-row ``.npy`` requests back to back (a fixed number in all, so a run stops by itself) and
times each; the table gives throughput, p50/p99 latency and the share of model calls served by a
tuned backend (from the replicas' own metrics). Then the kill run: two replicas of (c), one killed
by ``ray.kill`` a third of the way through; every request is answered, or fails with an error
that a retry (up to 30 s) answers; a request neither answered nor retried to an answer is lost.

Without ``--artifact``, the demo model (``aitune.demo``) is tuned for batches of 4 and 8 with
MaxThroughput over ONNX Runtime, and saved to a temporary folder.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import io
import json
import os
import platform
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

FACTORY = "aitune.demo:build_model"
APP = "bench"


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


def _body() -> bytes:
    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, np.random.default_rng(0).standard_normal((1, 3, 32, 32), dtype=np.float32))
    return buffer.getvalue()


def load(url: str, clients: int, total: int, on_progress: Any = None, retry: bool = False) -> dict[str, Any]:
    """``total`` requests from ``clients`` closed-loop clients; latencies, and what failed and why."""
    import requests

    body = _body()
    headers = {"content-type": "application/x-npy"}
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
    wall = time.perf_counter() - start
    ms = sorted(x * 1000 for x in latencies)
    return {
        "requests": total,
        "answered": len(latencies),
        "wall_s": wall,
        "throughput_rps": len(latencies) / wall,
        "p50_ms": statistics.median(ms) if ms else None,
        "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))] if ms else None,
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


def run_setup(url: str, artifact: Path, args: argparse.Namespace, replicas: int = 1, **options: Any) -> dict[str, Any]:
    from ray import serve

    import aitune_serve_ray

    app = aitune_serve_ray.deployment(FACTORY, artifact, replicas=replicas, threads=args.threads, **options)
    serve.run(app, name=APP, route_prefix="/")
    load(url, args.clients, args.warmup)  # warm-up, not counted
    result = load(url, args.clients, args.requests)
    stats = _stats()
    result["tuned_share"] = _tuned_share(stats)
    sizes = [s for replica in stats for s in replica["batch_sizes"]]
    result["mean_batch_size"] = statistics.mean(sizes) if sizes else None
    serve.delete(APP)
    return result


def run_kill(url: str, artifact: Path, args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray import serve

    import aitune_serve_ray

    serve.run(
        aitune_serve_ray.deployment(FACTORY, artifact, replicas=2, threads=args.threads), name=APP, route_prefix="/"
    )
    load(url, args.clients, args.warmup)
    killed: list[str] = []

    def kill_at_a_third(n: int) -> None:
        if n == args.requests // 3 and not killed:
            [name, *_] = sorted(
                a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "SERVE_REPLICA" in a["name"]
            )
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
            killed.append(name)

    result = load(url, args.clients, args.requests, on_progress=kill_at_a_third, retry=True)
    result["killed"] = killed
    serve.delete(APP)
    return result


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"Machine: {results['machine']}; {results['clients']} clients, {results['requests']} one-row requests "
        f"per setup after {results['warmup']} warm-up ones; {results['threads']} torch thread(s) per replica.",
        "",
        "| setup | throughput (req/s) | p50 (ms) | p99 (ms) | mean batch (rows) | calls on a tuned backend |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results["setups"].items():
        share = "-" if r["tuned_share"] is None else f"{100 * r['tuned_share']:.0f}%"
        lines.append(
            f"| {name} | {r['throughput_rps']:.1f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
            f"{r['mean_batch_size']:.2f} | {share} |"
        )
    kill = results.get("kill")
    if kill:
        kinds: dict[str, int] = {}
        for failure in kill["failures"]:
            kinds[failure] = kinds.get(failure, 0) + 1
        lines += [
            "",
            f"Replica kill (2 replicas of (c), one killed after {results['requests'] // 3} requests): "
            f"{kill['answered']} answered at once, {len(kill['failures'])} failed and then "
            f"{kill['answered_on_retry']} answered on retry, {kill['lost']} lost.",
        ]
        lines += [f"- {n} x `{text}`" for text, n in sorted(kinds.items(), key=lambda kv: -kv[1])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, help="A tuned demo artifact (aitune demo's classifier.ait).")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1, help="Torch threads per replica.")
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 2, help="CPUs Ray may use.")
    parser.add_argument("--no-kill", action="store_true", help="Skip the replica-kill run.")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    import ray
    from ray import serve

    folder = Path(tempfile.mkdtemp(prefix="aitune-serving-"))
    artifact = args.artifact or tune_demo(folder)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}/"
    results: dict[str, Any] = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.1f} at start",
        "clients": args.clients,
        "requests": args.requests,
        "warmup": args.warmup,
        "threads": args.threads,
        "setups": {},
    }
    try:
        setups = {
            "(a) eager, one call per request": {"eager": True, "batching": False},
            "(b) eager, the artifact's batching": {"eager": True},
            "(c) tuned artifact, its batching": {},
        }
        for name, options in setups.items():
            results["setups"][name] = run_setup(url, artifact, args, **options)
            print(name, json.dumps({k: v for k, v in results["setups"][name].items() if k != "failures"}), flush=True)
        if not args.no_kill:
            results["kill"] = run_kill(url, artifact, args)
    finally:
        serve.shutdown()
        ray.shutdown()
    results["load_average_end"] = os.getloadavg()[0]
    print(markdown(results))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
