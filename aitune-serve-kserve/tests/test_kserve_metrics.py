"""aitune serve's Prometheus metrics: counted per call, exposed in Prometheus' text format when scraped."""

from __future__ import annotations

import gc

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from aitune.engine.dispatch import Route
from aitune.torch.serving import Call
from aitune_serve_kserve.metrics import ServingCounts


def _samples(model: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """This model's samples in a scrape of the default registry, by name and the labels beside its name."""
    found = {}
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for sample in family.samples:
            labels = dict(sample.labels)
            if labels.pop("model_name", None) == model:
                found[sample.name, tuple(sorted(labels.items()))] = sample.value
    return found


def test_calls_are_counted_and_scraped_as_histograms_and_counters_summed_per_model_name():
    first, second = ServingCounts("metrics-test"), ServingCounts("metrics-test")  # two replicas of one name
    first.batch(1)
    first.call(Call(1, 1, (Route("bert", "onnxruntime", None),)))
    first.batch(3)
    first.call(Call(4, 3, (Route("bert", "onnxruntime", None),)))  # three rows padded to a tuned four
    second.batch(1)
    second.call(Call(8, 5, (Route("bert", "eager", "input_ids holds a value outside 0..99"),)))
    seen = _samples("metrics-test")
    assert seen["aitune_serve_batch_rows_bucket", (("le", "1.0"),)] == 1
    assert seen["aitune_serve_batch_rows_bucket", (("le", "4.0"),)] == 2
    assert seen["aitune_serve_batch_rows_bucket", (("le", "8.0"),)] == 3
    assert seen["aitune_serve_batch_rows_bucket", (("le", "+Inf"),)] == 3
    assert seen["aitune_serve_batch_rows_count", ()] == 3 and seen["aitune_serve_batch_rows_sum", ()] == 13
    assert seen["aitune_serve_requests_per_call_bucket", (("le", "2.0"),)] == 2
    assert seen["aitune_serve_requests_per_call_sum", ()] == 5
    assert seen["aitune_serve_padding_rows_total", ()] == 1 + 3
    assert seen["aitune_serve_calls_total", (("backend", "onnxruntime"), ("module", "bert"))] == 2
    assert seen["aitune_serve_calls_total", (("backend", "eager"), ("module", "bert"))] == 1
    assert seen["aitune_serve_eager_fallbacks_total", (("module", "bert"),)] == 1


def test_a_model_that_made_no_call_is_scraped_with_zero_counts_and_one_dropped_is_not_scraped():
    idle = ServingCounts("metrics-idle")
    seen = _samples("metrics-idle")
    assert seen["aitune_serve_batch_rows_count", ()] == 0
    assert seen["aitune_serve_padding_rows_total", ()] == 0
    del idle  # the model was unloaded and collected
    gc.collect()
    assert _samples("metrics-idle") == {}
