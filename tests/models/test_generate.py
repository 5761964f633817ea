"""Greedy ``generate()`` with transformers' static KV cache, tuned: the decode step is one graph
whose cache tensors a backend updates in place; the prefill fills the cache and runs eager.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import aitune.torch as ait

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.busy  # tokens and routes must not depend on a timing race

NEW_TOKENS = 6


def gpt2() -> tuple[torch.nn.Module, str]:
    config = transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config).eval(), "transformer"


def llama() -> tuple[torch.nn.Module, str]:
    return transformers.LlamaForCausalLM(decoder_config(transformers.LlamaConfig)).eval(), "model"


def generate(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation="static")


def counted(wrapper: Any) -> list[int]:
    """Counts the calls the tuned routes of ``wrapper`` serve (eager fallbacks are not counted)."""
    calls = [0]
    routes = wrapper._dispatcher.routes

    def counting(runner: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return runner(*args, **kwargs)

        return run

    wrapper._dispatcher.routes = [(check, counting(runner)) for check, runner in routes]
    wrapper._dispatcher._table.clear()  # calls seen already (the end-to-end timing) resolved to the old runners
    return calls


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama"])
def test_greedy_generate_with_a_static_cache(flow, build, tmp_path):
    torch.manual_seed(0)
    model, body = build()
    g = torch.Generator().manual_seed(3)
    recorded = [torch.randint(1, 100, (1, 8), generator=g) for _ in range(2)]
    unseen = torch.randint(1, 100, (1, 8), generator=g)  # new tokens, the prompt length tuned for
    with torch.no_grad():
        expected = [generate(model, ids) for ids in [*recorded, unseen]]
    # the gate off: the decode step is tuned whichever wins the timing race on a busy machine
    strategy = flow.strategy("torch_inductor_jit", "onnxruntime").enable_performance_validation(False)
    ait.wrap(model, [body], strategy=strategy)
    report = ait.tune(lambda ids: generate(model, ids), recorded, end_to_end=False)  # timed in the default-cache test

    graphs = report.modules[0].graphs
    prefill = [g for g in graphs if "not filled yet" in (g.reason or "")]
    decode = [g for g in graphs if g.graph and g.graph.get("mutated")]
    assert prefill and prefill[0].decision == "torch_eager", "the prefill fills the cache: eager, with the reason"
    (step,) = decode
    assert step.decision == "torch_inductor_jit", step.reason
    ort = [c for c in step.candidates if c.backend == "onnxruntime"]
    assert all(c.stage == "availability" and "in place" in c.reason for c in ort)

    served = counted(getattr(model, body))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no call of the decode step may fall back to eager
        tokens = [generate(model, ids) for ids in [*recorded, unseen]]
    for got, want in zip(tokens, expected):
        assert torch.equal(got, want), "greedy tokens differ from eager's"
    assert served[0] == 3 * (NEW_TOKENS - 1), "every decode step ran the tuned backend"

    path = ait.save(model, tmp_path / "generate.ait")
    torch.manual_seed(0)
    fresh, _ = build()
    ait.load(fresh, path)
    assert torch.equal(generate(fresh, unseen), expected[-1])


def whisper() -> torch.nn.Module:
    config = transformers.WhisperConfig(
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        vocab_size=100,
        num_mel_bins=16,
        max_source_positions=16,
        max_target_positions=32,
        decoder_start_token_id=1,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=1,
    )
    return transformers.WhisperForConditionalGeneration(config).eval()


def test_whisper_generate_tunes_its_encoder_and_its_decode_step(flow):
    """An encoder-decoder cache: the decoder's own static cache is updated in place, the cross-attention
    one is filled by the first decoder call and read after; the encoder runs once per generate().
    Called with its default cache, which ait.tune switches to the static one."""
    torch.manual_seed(0)
    model = whisper()
    g = torch.Generator().manual_seed(4)
    features = [torch.randn(1, 16, 32, generator=g) for _ in range(3)]

    def transcribe(f: torch.Tensor) -> torch.Tensor:
        return model.generate(f, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)

    with torch.no_grad():
        expected = [transcribe(f) for f in features]
    # the encoder by ONNX Runtime (a 2 s build; Inductor's took 30 s), the decode step by the backend
    # that writes the cache in place
    ait.wrap(model, ["model.encoder"], strategy=flow.strategy("onnxruntime").enable_performance_validation(False))
    ait.wrap(
        model, ["model.decoder"], strategy=flow.strategy("torch_inductor_jit").enable_performance_validation(False)
    )
    report = ait.tune(transcribe, features[:2], end_to_end=False)
    assert model.generation_config.cache_implementation == "static" and report.changes
    decisions = {m.name: [g.decision for g in m.graphs] for m in report.modules}
    assert decisions["model.encoder"] != ["torch_eager"], decisions
    reasons = [g.reason for m in report.modules for g in m.graphs]
    assert decisions["model.decoder"] == ["torch_eager", "torch_inductor_jit"], (
        f"prefill eager, decode step tuned: {reasons}"
    )
    served = counted(model.model.decoder)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for f, want in zip(features, expected):  # the third was never recorded
            assert torch.equal(transcribe(f), want)
    assert served[0] == 3 * (NEW_TOKENS - 1)


def decoder_config(cls: Any, **extra: Any) -> Any:
    return cls(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=100,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
        **extra,
    )


def mistral() -> tuple[torch.nn.Module, str]:
    """A window of 10 tokens: prompt 8 + 6 new, so the decode steps fill the window and then slide it."""
    config = decoder_config(transformers.MistralConfig, sliding_window=10)
    return transformers.MistralForCausalLM(config).eval(), "model"


def qwen2() -> tuple[torch.nn.Module, str]:
    return transformers.Qwen2ForCausalLM(decoder_config(transformers.Qwen2Config)).eval(), "model"


def gemma2() -> tuple[torch.nn.Module, str]:
    """A hybrid cache: a sliding-window layer (window 10) and a full-attention one."""
    config = decoder_config(transformers.Gemma2Config, head_dim=16, sliding_window=10, pad_token_id=0)
    return transformers.Gemma2ForCausalLM(config).eval(), "model"


def prompts(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, 100, (1, 8), generator=g) for _ in range(n)]


def decode_steps(report: Any) -> list[Any]:
    return [g for m in report.modules for g in m.graphs if g.graph and g.graph.get("mutated")]


@pytest.mark.parametrize("build", [mistral, gemma2, qwen2], ids=["mistral-sliding-window", "gemma2-hybrid", "qwen2"])
def test_the_decode_step_is_one_tuned_graph(flow, build):
    """Mistral's sliding-window layers (and Gemma 2's, next to full-attention ones) count their tokens
    in a Python int that grows every step: still one decode graph, serving every step with eager's tokens."""
    torch.manual_seed(0)
    model, body = build()
    recorded, unseen = prompts(2), prompts(3)[2]
    with torch.no_grad():
        expected = [generate(model, ids) for ids in [*recorded, unseen]]
    strategy = flow.strategy("torch_inductor_jit").enable_performance_validation(False)
    ait.wrap(model, [body], strategy=strategy)
    report = ait.tune(lambda ids: generate(model, ids), recorded, end_to_end=False)

    (step,) = decode_steps(report)
    assert step.decision == "torch_inductor_jit", step.reason
    served = counted(getattr(model, body))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no decode step runs eager, none compiles again and again
        tokens = [generate(model, ids) for ids in [*recorded, unseen]]
    for got, want in zip(tokens, expected):
        assert torch.equal(got, want), "greedy tokens differ from eager's"
    assert served[0] == 3 * (NEW_TOKENS - 1), "every decode step ran the tuned backend"


def test_generate_with_the_default_cache_ends_tuned(flow, tmp_path):
    """The user passes no cache_implementation: ait.tune switches the model to a static cache before
    recording (and says so), so the decode step is tuned; static_cache=False keeps the default."""
    torch.manual_seed(0)
    model, body = qwen2()
    recorded = prompts(2)

    def plain(ids: torch.Tensor) -> torch.Tensor:
        return model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)

    with torch.no_grad():
        expected = [plain(ids) for ids in recorded]
    assert model.generation_config.cache_implementation is None
    strategy = flow.strategy("torch_inductor_jit").enable_performance_validation(False)
    ait.wrap(model, [body], strategy=strategy)

    kept = ait.tune(plain, recorded, static_cache=False, dry_run=True)
    assert model.generation_config.cache_implementation is None and not kept.changes
    assert not decode_steps(kept), "the dynamic cache's decode step cannot be a graph"

    report = ait.tune(plain, recorded)  # the one generate() here timed end to end (10 s): the user's default call
    assert model.generation_config.cache_implementation == "static"
    assert any("static" in line and "static_cache=False" in line for line in report.changes), report.changes
    e2e = report.end_to_end
    assert e2e is not None and e2e.baseline == "eager with the default cache", e2e
    assert [b.baseline for b in e2e.other_baselines] == ["eager with the static cache"]
    (step,) = decode_steps(report)
    assert step.decision == "torch_inductor_jit", step.reason
    served = counted(getattr(model, body))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for ids, want in zip(recorded, expected):
            assert torch.equal(plain(ids), want)
    assert served[0] == 2 * (NEW_TOKENS - 1)

    path = ait.save(model, tmp_path / "qwen2.ait")
    torch.manual_seed(0)
    model, _ = qwen2()  # a fresh process's model: the default cache again; plain() calls this one now
    ait.load(model, path)
    assert model.generation_config.cache_implementation == "static", "ait.load switches it as ait.tune did"
    served = counted(getattr(model, body))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(plain(recorded[0]), expected[0])
    assert served[0] == NEW_TOKENS - 1


@pytest.mark.parametrize(
    ("layer", "said", "not_said"),
    [
        ("LinearAttentionLayer", "call the model with use_cache=False", "cache_implementation='static' to have"),
        ("DynamicLayer", "generate with cache_implementation='static'", "use_cache=False"),
    ],
)
def test_a_cache_aitune_cannot_run_is_told_the_fix_that_works(layer, said, not_said):
    """A Mamba-like cache (fixed-size recurrent states) is not told to use a static cache, which
    would keep the same layers; a growing one is (issue 53)."""
    from transformers import cache_utils

    from aitune import state
    from aitune.errors import UnsupportedValueError

    cache = cache_utils.Cache(layers=[getattr(cache_utils, layer)()])
    with pytest.raises(UnsupportedValueError) as raised:
        state.describe(cache, "past_key_values")
    assert said in str(raised.value) and not_said not in str(raised.value)
