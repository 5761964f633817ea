"""transformers' output-capturing hooks on a tuned model (issue 53 item 2).

transformers 5 installs hooks on a model's layers the first time it is asked for
``output_hidden_states`` or ``output_attentions``; they record only on calls that ask. Such a call
runs eager (a tuned backend does not run hooks) and returns what eager returns; the plain calls
after it run the tuned backend again. A hook of the user's own still sends every call eager.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import aitune.torch as ait

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.busy  # routes must not depend on a timing race


def bert() -> torch.nn.Module:
    """The docs' BERT (docs/huggingface.md), with attention that can return its weights."""
    config = transformers.BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=100,
        attn_implementation="eager",
    )
    return transformers.BertModel(config).eval()


def served(model: torch.nn.Module, **kwargs: object) -> tuple[object, list[str], list[str]]:
    """The output of one call, the backends that answered it, and the eager warnings it gave."""
    with torch.no_grad(), ait.observe_routes() as routes, warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = model(**kwargs)
    eager = [str(w.message) for w in seen if "running this call eager" in str(w.message)]
    return out, [r.backend for r in routes], eager


def tuned(flow, wrap) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tuned copy of the docs' BERT (``wrap`` wraps it) and an eager one with the same weights."""
    torch.manual_seed(0)
    reference = bert()
    torch.manual_seed(0)
    strategy = flow.strategy("onnxruntime")
    strategy.enable_performance_validation(False)  # the tuned backend serves, whoever wins on a busy machine
    model = wrap(bert(), strategy)
    report = ait.tune(model, flow.token_batches([(1, 8), (4, 32)]))
    assert flow.chosen(report) == ["onnxruntime"]
    return model, reference


def test_a_call_for_hidden_states_runs_eager_and_later_plain_calls_run_tuned(flow):
    def wrap(model, strategy):
        ait.wrap(model, ["encoder"], strategy=strategy)
        return model

    model, reference = tuned(flow, wrap)
    (item,) = flow.token_batches([(2, 16)], seed=1)

    _, backends, eager = served(model, **item)
    assert backends == ["onnxruntime"] and not eager

    out, backends, eager = served(model, **item, output_hidden_states=True)
    assert backends == ["torch_eager"]
    assert len(eager) == 1 and "output_hidden_states" in eager[0]
    with torch.no_grad():
        expected = reference(**item, output_hidden_states=True)
    assert len(out.hidden_states) == len(expected.hidden_states) == 3
    flow.assert_same(out, expected, "a call for hidden states")

    for _ in range(2):  # the capture hooks are installed now, and inactive on plain calls
        out, backends, eager = served(model, **item)
        assert backends == ["onnxruntime"] and not eager
        assert out.hidden_states is None
    with torch.no_grad():
        flow.assert_same(out, reference(**item), "a plain call after it")

    out, backends, _ = served(model, **item, output_attentions=True)  # the other capture key
    assert backends == ["torch_eager"]
    with torch.no_grad():
        flow.assert_same(out, reference(**item, output_attentions=True), "a call for attentions")
    assert served(model, **item)[1] == ["onnxruntime"]

    handle = model.encoder.module.layer[0].register_forward_hook(lambda *_: None)  # a hook of the user's
    _, backends, eager = served(model, **item)
    assert backends == ["torch_eager"] and "hooks were added" in eager[0]
    handle.remove()
    assert served(model, **item)[1] == ["onnxruntime"]


def test_a_model_wrapped_whole_serves_plain_calls_tuned_after_a_call_for_hidden_states(flow):
    model, reference = tuned(flow, lambda model, strategy: ait.Module(model, "bert", strategy=strategy))
    (item,) = flow.token_batches([(2, 16)], seed=1)

    out, backends, _ = served(model, **item, output_hidden_states=True)
    assert backends == ["torch_eager"]
    with torch.no_grad():
        flow.assert_same(out, reference(**item, output_hidden_states=True), "a call for hidden states")

    out, backends, eager = served(model, **item)
    assert backends == ["onnxruntime"] and not eager
    with torch.no_grad():
        flow.assert_same(out, reference(**item), "a plain call after it")


def test_calls_for_hidden_states_in_the_dataset_still_get_them(flow):
    """Tuned on calls that ask for hidden states, the capture hooks exist before tuning: a tuned
    backend would return none, so those calls run eager and return eager's."""

    def wrap(model, strategy):
        ait.wrap(model, ["encoder"], strategy=strategy)
        return model

    torch.manual_seed(0)
    reference = bert()
    torch.manual_seed(0)
    strategy = flow.strategy("onnxruntime")
    strategy.enable_performance_validation(False)
    model = wrap(bert(), strategy)
    data = [{**item, "output_hidden_states": True} for item in flow.token_batches([(1, 8), (4, 32)])]
    ait.tune(model, data)
    (item,) = flow.token_batches([(2, 16)], seed=1)

    out, backends, _ = served(model, **item, output_hidden_states=True)
    assert backends == ["torch_eager"]
    with torch.no_grad():
        flow.assert_same(out, reference(**item, output_hidden_states=True), "a call for hidden states")
