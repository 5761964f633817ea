"""The examples of docs/huggingface.md, run as they are written (in a scratch folder), served by
the tuned backends: a call that ran eager would have warned, and none may."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

import aitune.torch as ait
from aitune.torch.task.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

PAGE = Path(__file__).resolve().parents[2] / "docs" / "huggingface.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)


def test_the_page_has_every_example():
    assert len(EXAMPLES) == 3
    assert "BertModel" in EXAMPLES[0] and "generate" in EXAMPLES[1] and "UNet2DConditionModel" in EXAMPLES[2]


class QuickMaxThroughput(ait.MaxThroughputStrategy):
    """The examples' strategy with short measurements and no eager gate (the code runs as written,
    only timed less, and its tuned backend serves whatever else the machine is doing)."""

    def __init__(self, backends=None, profiling_config=None, **kwargs):
        quick = ProfilingConfig(
            measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=20, warmup=2, window=5), extend_s=0.0
        )
        super().__init__(backends, profiling_config or quick, **kwargs)
        self.enable_performance_validation(False)  # the tuned backend serves, whoever wins on a busy machine


@pytest.mark.parametrize("index", range(len(EXAMPLES)), ids=["transformers", "generate", "diffusers"][: len(EXAMPLES)])
def test_example_runs(index, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ait, "MaxThroughputStrategy", QuickMaxThroughput)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        exec(compile(EXAMPLES[index], f"{PAGE.name}[{index}]", "exec"), {"__name__": f"docs_example_{index}"})
    eager = [str(w.message) for w in seen if "running this call eager" in str(w.message)]
    assert not eager, f"the example's calls ran eager, not the tuned backend: {eager}"
    printed = capsys.readouterr().out
    expected = [
        "BaseModelOutputWithPoolingAndCrossAttentions",
        "['torch_eager', 'torch_inductor_jit']",
        "torch.Size([2, 3, 8, 8])",
    ][index]
    assert expected in printed
    assert list(tmp_path.glob("*.ait")), "the example saved its artifact"
