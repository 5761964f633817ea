"""A tiny random BERT that both engines' tests serve (``--factory kserve_bert:build``): tuned whole
with ONNX Runtime for 1 to 4 rows of 4 to 16 tokens, its padding declared (``pad=``), nothing
downloaded, saved as the README's install saves it (unsigned), so ``ait.load``'s check against eager
runs wherever it is served."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import torch

PAD = {"input_ids": 0, "attention_mask": 0}
_TUNED: list[Path] = []


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


def eager(request: dict[str, Any]) -> dict[str, torch.Tensor]:
    """What the untuned model answers to ``request`` (arrays or tensors by input name)."""
    with torch.no_grad():
        out = build()(**{k: torch.as_tensor(v) for k, v in request.items()})
    return {"last_hidden_state": out.last_hidden_state, "pooler_output": out.pooler_output}


def tune(path: str | Path) -> Path:
    """Tune and save to ``path``, unsigned (``sign=False``: what a user without the ``[signing]`` extra
    gets), so every ``ait.load`` of it checks the payload against eager. Tuned with one torch thread:
    a server's default threads, and a Ray replica's CPU request, follow the artifact's, so it fits
    the tests' two-CPU Ray on a machine of any size."""
    import aitune.torch as ait
    from aitune.torch.backend import ONNXRuntimeBackend

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = ait.Module(
            build(), "bert", strategy=ait.FirstWinsStrategy([ONNXRuntimeBackend()], performance_validation=False)
        )
        ait.tune(model, [tokens(1, 4), tokens(4, 16, seed=1, padded=3)], pad=PAD, end_to_end=False)
        return ait.save(model, path, sign=False)
    finally:
        torch.set_num_threads(threads)


def tuned(tmp_path_factory: Any) -> Path:
    """:func:`tune`'s artifact, tuned once per test run: both engines' tests serve the same file."""
    if not _TUNED or not _TUNED[0].is_file():
        _TUNED[:] = [tune(tmp_path_factory.mktemp("bert") / "bert.ait")]
    return _TUNED[0]


def signed(path: Path) -> bool:
    """The artifact carries a signature inside it (``aitune.artifact.seal``), which would switch
    ``ait.load``'s check off by default."""
    from aitune.artifact.seal import MEMBER

    with zipfile.ZipFile(path) as z:
        return MEMBER in z.namelist()
