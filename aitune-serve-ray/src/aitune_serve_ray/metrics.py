"""A replica's serving metrics, exported through Ray Serve's metrics (Prometheus on the Ray metrics
port; Serve adds the deployment, replica and application tags) and kept as a snapshot for
:meth:`TunedModel.stats`."""

from __future__ import annotations

import collections
from typing import Any

from aitune.torch.serving import Call

SIZE_BOUNDARIES: list[float] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
QUEUE_MS_BOUNDARIES: list[float] = [0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000]
KEPT = 10_000
"""Batch sizes kept for the snapshot (the newest); the exported histogram counts them all."""


def reason_class(reason: str) -> str:
    """A fallback reason without its sizes and names, so the metric's label has few values."""
    return reason.split(" (")[0].split(":")[0].strip()[:80]


class Metrics:
    """Batches by backend, batch sizes, eager fallbacks by reason, time queued before a batch."""

    def __init__(self) -> None:
        from ray.serve.metrics import Counter, Histogram

        # ray.serve.metrics annotates tag_keys as Tuple[str] (one key); it takes several, as ray.util.metrics says
        self._batches = Counter(
            "aitune_serve_batches",
            "Model calls per tuned module and the backend that served it",
            ("module", "backend"),  # type: ignore[arg-type]
        )
        self._sizes = Histogram("aitune_serve_batch_size", "Rows per model call, padding included", SIZE_BOUNDARIES)
        self._padding = Counter("aitune_serve_padding_rows", "Rows added to reach a tuned batch size")
        self._fallbacks = Counter(
            "aitune_serve_eager_fallbacks",
            "Calls a tuned module ran eager, by reason",
            ("module", "reason"),  # type: ignore[arg-type]
        )
        self._queue = Histogram(
            "aitune_serve_queue_ms", "Milliseconds a request waited before its batch ran", QUEUE_MS_BOUNDARIES
        )
        self.backends: collections.Counter[str] = collections.Counter()
        self.sizes: collections.deque[int] = collections.deque(maxlen=KEPT)
        self.fallbacks: collections.Counter[str] = collections.Counter()
        self.padding = 0
        self.requests = 0

    def call(self, call: Call) -> None:
        self.sizes.append(call.size)
        self._sizes.observe(call.size, {})
        if call.size > call.rows:
            self.padding += call.size - call.rows
            self._padding.inc(call.size - call.rows, {})
        for route in call.routes:
            self.backends[f"{route.module}={route.backend}"] += 1
            self._batches.inc(1, {"module": route.module, "backend": route.backend})
            if route.reason:
                self.fallbacks[f"{route.module}: {route.reason}"] += 1
                self._fallbacks.inc(1, {"module": route.module, "reason": reason_class(route.reason)})

    def queued(self, seconds: float) -> None:
        self.requests += 1
        self._queue.observe(seconds * 1000, {})

    def snapshot(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "batches_by_backend": dict(self.backends),
            "batch_sizes": list(self.sizes),
            "padding_rows": self.padding,
            "eager_fallbacks": dict(self.fallbacks),
        }
