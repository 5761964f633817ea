"""aitune serve's own Prometheus metrics: counted in plain integers on the request path, made into
metric families only when ``/metrics`` is scraped (prometheus_client's custom collector).

A ``Histogram.observe`` takes a lock and walks the buckets in Python; on a served model's path,
whose caches the requests between two of its own have cooled, the three a lone request made cost
about 2% of its time at one client (benchmarks/README.md, "Issue 51: the lone request's path").
Counting in a ``collections.Counter`` is a dict update in C. One model call runs at a time
(:class:`~.batching.Batcher`), so one writer at a time; a scrape reads copies.

The families, each labelled ``model_name``: ``aitune_serve_batch_rows`` and
``aitune_serve_requests_per_call`` (histograms), ``aitune_serve_calls_total`` (also by tuned module
and backend), ``aitune_serve_padding_rows_total`` and ``aitune_serve_eager_fallbacks_total`` (also by
module). Models served under one name add up.
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from typing import TypeVar

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from aitune.torch.serving import Call

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""Upper bounds of the rows-per-call histogram (padding included)."""
JOINED_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
"""Upper bounds of the requests-per-call histogram."""

K = TypeVar("K", bound=Hashable)


class ServingCounts:
    """One served model's counts since it loaded, written by its calls (:meth:`call`, :meth:`batch`) and
    scraped for as long as it lives."""

    __slots__ = ("__weakref__", "eager", "joined", "name", "padding_rows", "routes", "rows")

    def __init__(self, name: str) -> None:
        self.name = name
        self.rows: collections.Counter[int] = collections.Counter()  # call size -> calls
        self.joined: collections.Counter[int] = collections.Counter()  # requests joined -> calls
        self.padding_rows = 0
        self.routes: collections.Counter[tuple[str, str]] = collections.Counter()  # (module, backend) -> calls
        self.eager: collections.Counter[str] = collections.Counter()  # module -> calls it ran eager
        _COLLECTOR.add(self)

    def batch(self, requests: int) -> None:
        """A model call was made for this many requests."""
        self.joined[requests] += 1

    def call(self, call: Call) -> None:
        """A model call returned: its size, its padding, each tuned module's route."""
        self.rows[call.size] += 1
        if call.size > call.rows:
            self.padding_rows += call.size - call.rows
        for route in call.routes:
            self.routes[route.module, route.backend] += 1
            if route.reason:
                self.eager[route.module] += 1


class _Collector:
    """The families of every live :class:`ServingCounts`, summed per model name, at scrape time."""

    def __init__(self) -> None:
        self._counts: weakref.WeakSet[ServingCounts] = weakref.WeakSet()
        self._lock = threading.Lock()

    def add(self, counts: ServingCounts) -> None:
        with self._lock:
            self._counts.add(counts)

    def describe(self) -> Iterator[Metric]:
        """The families without samples: what the registry reserves the names by."""
        return iter(_families([]))

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            live = list(self._counts)
        return iter(_families(live))


def _families(live: Sequence[ServingCounts]) -> list[Metric]:
    rows = HistogramMetricFamily(
        "aitune_serve_batch_rows", "Rows per model call, padding included", labels=["model_name"]
    )
    joined = HistogramMetricFamily(
        "aitune_serve_requests_per_call", "Requests joined into one model call", labels=["model_name"]
    )
    padding = CounterMetricFamily(
        "aitune_serve_padding_rows", "Rows added to reach a tuned batch size", labels=["model_name"]
    )
    calls = CounterMetricFamily(
        "aitune_serve_calls",
        "Model calls per tuned module and the backend that served it",
        labels=["model_name", "module", "backend"],
    )
    eager = CounterMetricFamily(
        "aitune_serve_eager_fallbacks", "Calls where a tuned module ran eager", labels=["model_name", "module"]
    )
    by_name: dict[str, list[ServingCounts]] = collections.defaultdict(list)
    for counts in live:
        by_name[counts.name].append(counts)
    for name, same in sorted(by_name.items()):
        rows.add_metric([name], *_histogram((dict(c.rows) for c in same), ROW_BUCKETS))
        joined.add_metric([name], *_histogram((dict(c.joined) for c in same), JOINED_BUCKETS))
        padding.add_metric([name], sum(c.padding_rows for c in same))
        for (module, backend), n in sorted(_summed(dict(c.routes) for c in same).items()):
            calls.add_metric([name, module, backend], n)
        for module, n in sorted(_summed(dict(c.eager) for c in same).items()):
            eager.add_metric([name, module], n)
    return [rows, joined, padding, calls, eager]


def _summed(copies: Iterable[Mapping[K, int]]) -> dict[K, int]:
    total: collections.Counter[K] = collections.Counter()
    for copy in copies:
        total.update(copy)
    return dict(total)


def _histogram(copies: Iterable[dict[int, int]], bounds: Sequence[int]) -> tuple[list[tuple[str, float]], float]:
    """A histogram's cumulative buckets (``+Inf`` last) and its sum, from exact counts per value."""
    counts = _summed(copies)
    buckets = [(str(float(bound)), float(sum(n for v, n in counts.items() if v <= bound))) for bound in bounds]
    buckets.append(("+Inf", float(sum(counts.values()))))
    return buckets, float(sum(v * n for v, n in counts.items()))


_COLLECTOR = _Collector()
REGISTRY.register(_COLLECTOR)
