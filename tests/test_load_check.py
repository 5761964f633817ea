"""``ait.load(check=...)``: a payload from an artifact nobody pinned or signed is run against eager
with the artifact's own weights at the graph's min, opt and max sizes, on inputs drawn from the
values recorded while tuning, so a swapped ONNX graph, reordered outputs, a graph that differs only
off the opt batch size or on some token, a NaN weight and a manifest whose opt is 0 are refused,
while a whole BERT with a padded attention mask loads tuned.

Each crafted artifact is made as an attacker would: members edited inside the zip, the digest list
computed again, the signature (which they cannot make) dropped."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

import aitune.torch as ait
from aitune.errors import ArtifactError
from aitune.plugins import get_manager


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """A build cache per test: twins of one class and weights must never share a cached build."""
    monkeypatch.setenv("AITUNE_CACHE_DIR", str(tmp_path_factory.mktemp("aitune-cache")))


def _onnxruntime() -> Any:
    registry = get_manager().registry
    if "onnxruntime" not in registry or registry.status("onnxruntime").reason("cpu"):
        pytest.skip("onnxruntime cannot run here")
    return registry.backend_class("onnxruntime")()


def mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()


class TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"first": self.a(x), "second": self.b(x)}


def saved(module: torch.nn.Module, path: Path, data: list[Any] | None = None) -> Path:
    model = ait.Module(module, "m", strategy=ait.OneBackendStrategy(_onnxruntime(), performance_validation=False))
    ait.tune(model, data if data is not None else [torch.randn(2, 8), torch.randn(4, 8)], end_to_end=False)
    return ait.save(model, path)


def read(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as z:
        # the digest list is made again by write(); a signature, which they cannot make, is dropped
        return {n: z.read(n) for n in z.namelist() if n not in ("SHA256SUMS", "SIGNATURE")}


def write(members: dict[str, bytes], path: Path) -> Path:
    sums = "".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n" for n, d in sorted(members.items()))
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
        z.writestr("SHA256SUMS", sums)
    return path


def test_a_swapped_onnx_graph_is_refused(tmp_path: Path) -> None:
    mine = read(saved(mlp(0), tmp_path / "mine.ait"))
    other = read(saved(mlp(1), tmp_path / "other.ait"))
    graphs = [n for n in mine if n.endswith(".onnx")]
    assert graphs and all(n in other for n in graphs)
    swapped = write({**mine, **{n: other[n] for n in graphs}}, tmp_path / "swapped.ait")
    model = mlp(5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ArtifactError, match="does not answer as eager does"):
        ait.load(model, swapped, weights="artifact")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    loaded = ait.load(mlp(5), tmp_path / "mine.ait", weights="artifact")  # the faithful one passes
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), mlp(0)(x), rtol=1e-4, atol=1e-5)


def test_reordered_outputs_are_refused(tmp_path: Path) -> None:
    members = read(saved(TwoHeads().eval(), tmp_path / "heads.ait"))
    manifest = json.loads(members["manifest.json"])
    structure = manifest["modules"][0]["graphs"][0]["graph"]["output_structure"]
    assert structure["keys"] == ["first", "second"]
    structure["keys"] = ["second", "first"]  # each name now gets the other head's tensor
    members["manifest.json"] = json.dumps(manifest).encode()
    bad = write(members, tmp_path / "reordered.ait")
    with pytest.raises(ArtifactError, match="does not answer as eager does"):
        ait.load(TwoHeads().eval(), bad)
    with pytest.warns(RuntimeWarning, match="does not answer as eager does"):
        assert ait.load(TwoHeads().eval(), bad, fallback="eager").state == "passthrough"


def swap_graphs(mine: Path, other: Path, out: Path) -> Path:
    """``mine`` with the ONNX graphs of ``other`` (tuned on the same shapes): what an attacker ships."""
    members, theirs = read(mine), read(other)
    graphs = [n for n in members if n.endswith(".onnx")]
    assert graphs and all(n in theirs for n in graphs)
    return write({**members, **{n: theirs[n] for n in graphs}}, out)


def refused(build: Any, path: Path, **load: Any) -> str:
    """``path`` is refused by ait.load, and with fallback="eager" runs eager with a warning; the reason."""
    with pytest.raises(ArtifactError) as info:
        ait.load(build(), path, weights="artifact", **load)
    with pytest.warns(RuntimeWarning, match="runs eager for that graph"):
        assert ait.load(build(), path, weights="artifact", fallback="eager", **load).state == "passthrough"
    return str(info.value)


def test_a_manifest_whose_opt_is_0_is_refused(tmp_path: Path) -> None:
    """(a) an opt of 0 made the old check's example empty, so a swapped graph passed it."""
    swapped = swap_graphs(
        saved(mlp(0), tmp_path / "mine.ait"), saved(mlp(1), tmp_path / "other.ait"), tmp_path / "s.ait"
    )
    members = read(swapped)
    manifest = json.loads(members["manifest.json"])
    dims = manifest["modules"][0]["graphs"][0]["graph"]["dims"]
    assert dims["batch"]["min"] >= 1
    dims["batch"]["min"] = dims["batch"]["opt"] = 0
    members["manifest.json"] = json.dumps(manifest).encode()
    bad = write(members, tmp_path / "opt0.ait")
    assert "opt 0" in refused(lambda: mlp(5), bad)


def test_a_manifest_graph_with_opt_0_is_refused_before_anything_runs() -> None:
    from aitune.artifact.bounds import graph_problem
    from aitune.graph import DimRange, GraphSpec, TensorSpec

    def graph(lo: int, opt: int, hi: int) -> GraphSpec:
        spec = TensorSpec("x", "float32", "cpu", (opt, 8), ("batch", None))
        return GraphSpec(("x",), {}, (spec,), {"batch": DimRange(lo, opt, hi)})

    assert graph_problem(graph(1, 2, 4)) is None
    assert "below 1" in (graph_problem(graph(0, 0, 4)) or "")
    assert "0 <= min <= opt <= max" in (graph_problem(graph(2, 5, 4)) or "")
    assert graph_problem(graph(0, 0, 0)) is None  # an axis that is always empty: nothing to check anyway


class Negated(torch.nn.Module):
    """mlp(0), negated whenever the batch is not 1."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = mlp(0)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        y = self.inner(input)
        rows = torch.ones_like(input[:, 0]).sum()
        return y * torch.where(rows == 1, 1.0, -1.0)


def test_a_graph_that_differs_only_off_the_opt_batch_size_is_refused(tmp_path: Path) -> None:
    """(c) batch-1 data tunes for batches 1 and 2 with opt 1: the old check ran batch 1 alone."""
    data = [torch.randn(1, 8) for _ in range(3)]
    mine = saved(mlp(0), tmp_path / "mine.ait", data)
    evil = saved(Negated().eval(), tmp_path / "evil.ait", data)
    dims = json.loads(read(mine)["manifest.json"])["modules"][0]["graphs"][0]["graph"]["dims"]
    assert dims["batch"]["opt"] == 1 and dims["batch"]["max"] > 1
    bad = swap_graphs(mine, evil, tmp_path / "negated.ait")
    assert "does not answer as eager does" in refused(lambda: mlp(5), bad)
    assert ait.load(mlp(5), mine, weights="artifact").state == "tuned"  # the faithful one passes


class Tokens(torch.nn.Module):
    """Token ids [batch, 6] -> [batch, 4]: an embedding and a head."""

    def __init__(self, rows_from: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = torch.nn.Embedding(100, 8), torch.nn.Linear(8, 4)
        if rows_from is not None:  # the rows a real call uses, replaced
            with torch.no_grad():
                self.embed.weight[rows_from:] = torch.randn(100 - rows_from, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x).mean(1))


class Triggered(Tokens):
    """Tokens, with a row of 1000.0 added where x[:, 0] == 42."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 1000.0 * (x[:, :1] == 42)


def ids(low: int, high: int) -> list[torch.Tensor]:
    """Two batches of ids (2 and 4 rows) spanning exactly ``low..high``."""
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(low, high + 1, (2, 6), generator=g), torch.randint(low, high + 1, (4, 6), generator=g)]
    data[0][0, 0], data[0][1, 0] = low, high
    return data


@pytest.mark.parametrize(
    "low, high",
    [(0, 42), (38, 45)],
    ids=["the-trigger-is-the-largest-id-tuned", "a-range-no-wider-than-the-rows-checked"],
)
def test_a_graph_with_a_trigger_on_a_token_id_is_refused(tmp_path: Path, low: int, high: int) -> None:
    """(d) a row of 1000.0 where x[:, 0] == 42: the old check's ids were all zero. The check sweeps
    each position through the recorded range from both ends inward, so the ends are always drawn
    and a range no wider than the rows checked (8 here: batches 2, 2 and 4) is drawn whole."""
    data = ids(low, high)
    mine = saved(Tokens().eval(), tmp_path / "mine.ait", data)
    bad = swap_graphs(mine, saved(Triggered().eval(), tmp_path / "evil.ait", data), tmp_path / "42.ait")
    assert "does not answer as eager does" in refused(lambda: Tokens().eval(), bad)
    loaded = ait.load(Tokens().eval(), mine)
    assert loaded.state == "tuned"
    x = torch.full((3, 6), 42)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), Tokens().eval()(x), rtol=1e-4, atol=1e-5)


def test_a_graph_whose_embedding_rows_from_1_on_were_replaced_is_refused(tmp_path: Path) -> None:
    """(e) the old check's all-zero ids read row 0 alone."""
    data = ids(0, 60)
    mine = saved(Tokens().eval(), tmp_path / "mine.ait", data)
    bad = swap_graphs(mine, saved(Tokens(rows_from=1).eval(), tmp_path / "evil.ait", data), tmp_path / "rows.ait")
    assert "does not answer as eager does" in refused(lambda: Tokens().eval(), bad)


def with_weight(path: Path, out: Path, name: str, index: tuple[int, ...], value: float) -> Path:
    """``path`` with one element of one saved weight set to ``value`` (the payload left as it was)."""
    members = read(path)
    weights = load_tensors(members["modules/0/weights.safetensors"])
    assert name in weights
    weights[name][index] = value
    members["modules/0/weights.safetensors"] = save_tensors(weights)
    return write(members, out)


def test_a_nan_in_the_artifacts_weights_is_refused(tmp_path: Path) -> None:
    """(b) eager with the artifact's weights gives NaN where the payload (its own weights baked in)
    is finite: the old check left out every position where eager was not finite."""
    bad = with_weight(saved(mlp(0), tmp_path / "mine.ait"), tmp_path / "nan.ait", "0.weight", (0, 0), float("nan"))
    reason = refused(lambda: mlp(0), bad)
    assert "is not NaN or infinite" in reason and "where eager is" in reason


def test_a_nan_weight_no_checked_call_uses_is_refused(tmp_path: Path) -> None:
    """(b, item 7) a NaN in an embedding row of an id never tuned with: no checked call of eager shows
    it, so what the payload answers there was not compared; the artifact is refused all the same."""
    mine = saved(Tokens().eval(), tmp_path / "mine.ait", ids(0, 42))
    bad = with_weight(mine, tmp_path / "nan-row.ait", "embed.weight", (99, 3), float("nan"))
    assert "embed.weight holds NaN" in refused(lambda: Tokens().eval(), bad)
    assert ait.load(Tokens().eval(), mine).state == "tuned"


def test_a_whole_bert_with_a_padded_mask_loads_tuned_with_the_check_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old check's all-zero attention mask made eager and ONNX Runtime differ (by 0.148): a mask
    with no position to attend is a case neither is built for. The check's masks pad some positions
    of each row, never all, and its ids stay in the vocabulary range tuned with."""
    transformers = pytest.importorskip("transformers")
    from aitune.artifact import reader

    def bert() -> torch.nn.Module:
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

    g = torch.Generator().manual_seed(0)
    data = []
    for batch, seq in ((2, 8), (4, 8), (2, 12)):
        mask = torch.ones(batch, seq, dtype=torch.long)
        for row in range(batch):
            mask[row, seq - 1 - row % (seq // 2) :] = 0
        data.append({"input_ids": torch.randint(0, 100, (batch, seq), generator=g), "attention_mask": mask})
    model = ait.Module(bert(), "bert", strategy=ait.OneBackendStrategy(_onnxruntime(), performance_validation=False))
    ait.tune(model, data, end_to_end=False)
    assert model.state == "tuned"
    spec = {s.path: s for s in model.tuned_graphs[0].graph.inputs}
    assert spec["attention_mask"].values is not None and spec["attention_mask"].values.mask
    assert (
        spec["input_ids"].values is not None and 0 <= spec["input_ids"].values.low < spec["input_ids"].values.high < 100
    )
    path = ait.save(model, tmp_path / "bert.ait", sign=False)  # unsigned: the check is on by default

    checked: list[str | None] = []
    disagreement = reader._disagreement

    def spy(*args: Any) -> str | None:
        checked.append(disagreement(*args))
        return checked[-1]

    monkeypatch.setattr(reader, "_disagreement", spy)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        loaded = ait.load(bert(), path)
    assert loaded.state == "tuned" and checked == [None]
    item = {
        "input_ids": torch.randint(0, 100, (3, 10), generator=g),
        "attention_mask": torch.ones(3, 10, dtype=torch.long),
    }
    item["attention_mask"][1, 7:] = 0
    with torch.no_grad():
        got, want = loaded(**item).last_hidden_state, bert()(**item).last_hidden_state
    assert float((got - want).abs().max()) <= 1e-4 + 1e-3 * float(want.abs().max())
