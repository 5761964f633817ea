"""transformers architectures through inspect -> wrap -> tune -> run -> save -> load.

Each model is built from a small config (hidden 32, 2 layers, random weights, no download). The
full CPU backend sweep runs on BERT; the other models tune with ONNX Runtime and eager, which
keeps this layer to a few minutes on a 2-core machine.
"""

from __future__ import annotations

import pytest
import torch

import aitune.torch as ait

transformers = pytest.importorskip("transformers")

SMALL = {"num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64, "vocab_size": 100}


def bert() -> torch.nn.Module:
    config = transformers.BertConfig(hidden_size=32, max_position_embeddings=64, **SMALL)
    return transformers.BertModel(config).eval()


def gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config).eval()


def t5_encoder() -> torch.nn.Module:
    config = transformers.T5Config(d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, vocab_size=100)
    return transformers.T5EncoderModel(config).eval()


def vit() -> torch.nn.Module:
    config = transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8
    )
    return transformers.ViTModel(config).eval()


def clip_text() -> torch.nn.Module:
    config = transformers.CLIPTextConfig(hidden_size=32, max_position_embeddings=32, **SMALL)
    return transformers.CLIPTextModel(config).eval()


def wrap_submodule(name: str, strategy: ait.TuneStrategy):
    def wrap(model: torch.nn.Module) -> torch.nn.Module:
        ait.wrap(model, [name], strategy=strategy)
        return model

    return wrap


def wrap_whole(name: str, strategy: ait.TuneStrategy):
    return lambda model: ait.Module(model, name, strategy=strategy)


def by_keyword(model, item):
    return model(**item)


def test_inspect_finds_the_encoder_of_bert(flow):
    torch.manual_seed(0)
    model = bert()
    found = ait.inspect(model, flow.token_batches([(2, 8)]))
    assert "encoder" in found.describe()


def test_bert_encoder_every_cpu_backend(flow, tmp_path):
    backends = ("onnxruntime", "torch_inductor_jit", "torch_inductor_aot")
    data = flow.token_batches([(1, 8), (3, 16)])
    unseen = flow.token_batches([(2, 12)], seed=1)
    report = flow.round_trip(
        bert, wrap_submodule("encoder", flow.strategy(*backends)), by_keyword, data, unseen, tmp_path
    )
    tried = {c.backend for m in report.modules for g in m.graphs for c in g.candidates}
    assert tried == set(backends) & tried and "onnxruntime" in tried
    assert flow.chosen(report) != ["torch_eager"] or report.modules[0].graphs[0].reason


def test_gpt2_decoder_without_cache(flow, tmp_path):
    """The call that failed with "got multiple values for argument 'use_cache'"."""
    data = [{**item, "use_cache": False} for item in flow.token_batches([(1, 8), (3, 16)])]
    unseen = [{**item, "use_cache": False} for item in flow.token_batches([(2, 12)], seed=1)]
    report = flow.round_trip(
        gpt2, wrap_submodule("transformer", flow.strategy("onnxruntime")), by_keyword, data, unseen, tmp_path
    )
    assert report.modules[0].graphs[0].candidates[0].status != "failed"


def test_gpt2_with_a_cache_runs_that_graph_eager(flow):
    """A DynamicCache cannot be handed to a backend: that graph is eager, the report says why."""
    torch.manual_seed(0)
    model = gpt2()
    ait.wrap(model, ["transformer"], strategy=flow.strategy("onnxruntime"))
    ids = torch.randint(0, 100, (1, 6))
    report = ait.tune(model, [{"input_ids": ids, "use_cache": True}])
    (graph,) = report.modules[0].graphs
    assert graph.decision == "torch_eager" and "DynamicCache" in graph.reason
    out = model(input_ids=ids, use_cache=True)
    assert type(out).__name__ == "CausalLMOutputWithCrossAttentions" and out.past_key_values is not None


def test_t5_encoder(flow, tmp_path):
    data = flow.token_batches([(1, 8), (3, 16)])
    unseen = flow.token_batches([(2, 12)], seed=1)
    report = flow.round_trip(
        t5_encoder, wrap_submodule("encoder", flow.strategy("onnxruntime")), by_keyword, data, unseen, tmp_path
    )
    dims = {spec["path"]: tuple(spec["dims"]) for spec in report.modules[0].graphs[0].graph["inputs"]}
    assert dims["input_ids"] == dims["attention_mask"] == ("batch", "d0"), "one sequence axis, shared"


def test_vit_wrapped_whole(flow, tmp_path):
    images = [{"pixel_values": torch.randn(b, 3, 32, 32)} for b in (1, 4)]
    unseen = [{"pixel_values": torch.randn(2, 3, 32, 32)}]
    report = flow.round_trip(vit, wrap_whole("vit", flow.strategy("onnxruntime")), by_keyword, images, unseen, tmp_path)
    assert flow.chosen(report) != ["torch_eager"] or report.modules[0].graphs[0].reason


def test_clip_text_model(flow, tmp_path):
    data = flow.token_batches([(1, 8), (3, 16)])
    unseen = flow.token_batches([(2, 12)], seed=1)
    flow.round_trip(
        clip_text, wrap_whole("clip_text", flow.strategy("onnxruntime")), by_keyword, data, unseen, tmp_path
    )


def test_bert_torchscript_export_is_judged_and_kept(flow, tmp_path):
    """The TorchScript export of BERT freezes Python values where the tracer met sizes; judged on the
    other lengths and an all-ones mask instead of refused, it builds and answers as eager."""
    from aitune.onnx_export import ONNXExportConfig
    from aitune.torch.backend import ONNXRuntimeBackend, ONNXRuntimeBackendConfig

    flow.strategy("onnxruntime")  # skips where ONNX Runtime cannot run
    backend = ONNXRuntimeBackend(ONNXRuntimeBackendConfig(export=ONNXExportConfig(exporter="torchscript")))
    strategy = ait.FirstWinsStrategy([backend], performance_validation=False)
    data = flow.token_batches([(1, 8), (3, 16)])
    unseen = [*flow.token_batches([(2, 12)], seed=1), *flow.token_batches([(2, 10)], seed=2, padded=False)]
    report = flow.round_trip(bert, wrap_whole("bert", strategy), by_keyword, data, unseen, tmp_path)
    (candidate,) = report.modules[0].graphs[0].candidates
    assert candidate.status != "failed", candidate.reason
    judged = candidate.build_info.get("traced_branches")
    assert judged and all(b["other_side_checked"] for b in judged), judged
