"""A tiny random BERT the padding tests serve (``--factory kserve_bert:build``): tuned whole with ONNX
Runtime for 1 to 4 rows of 4 to 16 tokens, its padding declared (``pad=``), nothing downloaded."""

from __future__ import annotations

from pathlib import Path

import torch

PAD = {"input_ids": 0, "attention_mask": 0}


def build() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=100,
        max_position_embeddings=64,
    )
    return transformers.BertModel(config).eval()


def tokens(rows: int, length: int, seed: int = 0, padded: int = 1) -> dict[str, torch.Tensor]:
    """Token ids and a mask with the last ``padded`` positions of each row padded (0: none)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(rows, length, dtype=torch.long)
    if padded:
        mask[:, -padded:] = 0
    return {"input_ids": torch.randint(1, 100, (rows, length), generator=g), "attention_mask": mask}


def tune(path: str | Path) -> Path:
    import aitune.torch as ait
    from aitune.torch.backend import ONNXRuntimeBackend

    model = ait.Module(
        build(), "bert", strategy=ait.FirstWinsStrategy([ONNXRuntimeBackend()], performance_validation=False)
    )
    ait.tune(model, [tokens(1, 4), tokens(4, 16, seed=1, padded=3)], pad=PAD, end_to_end=False)
    ait.save(model, path)
    return Path(path)
