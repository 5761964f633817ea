"""The end-to-end figure on a busy machine: does it hold, or say it was not measured?

``python -m benchmarks.busy_machine``: with one core kept busy by another process (a spin loop),
the demo classifier (ONNX Runtime and Inductor JIT) and a small BERT encoder (ONNX Runtime) are
tuned in one process and saved; a fresh process loads each artifact and measures the end-to-end
figure again, under the same load. Each line says both figures and whether their intervals
overlap; a figure too noisy to state says "not measured".
"""

import json
import multiprocessing
import os
import subprocess
import sys
import tempfile


def spin(stop: "multiprocessing.synchronize.Event") -> None:
    while not stop.is_set():
        pass


TUNE = r"""
import json, sys, torch, aitune.torch as ait
from aitune.plugins import get_manager
case, path = sys.argv[1], sys.argv[2]
reg = get_manager().registry
if case == "demo":
    from aitune.demo import model_and_data
    model, data = model_and_data()
    ait.wrap(model, ["features", "head"], strategy=ait.MaxThroughputStrategy([reg.backend_class(n)() for n in ("onnxruntime", "torch_inductor_jit")]))
else:
    import transformers
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=32, max_position_embeddings=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=100)
    model = transformers.BertModel(cfg).eval()
    ait.wrap(model, ["encoder"], strategy=ait.MaxThroughputStrategy([reg.backend_class("onnxruntime")()]))
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, 100, (b, s), generator=g), "attention_mask": torch.ones(b, s, dtype=torch.long)} for b, s in ((1, 8), (3, 16))]
report = ait.tune(model, data)
ait.save(model, path)
torch.save(data, path + ".data")
e = report.end_to_end
print(json.dumps({"speedup": e.speedup, "low": e.speedup_low, "high": e.speedup_high, "measured": e.measured, "text": e.describe(), "load": report.environment.get("load_average_end")}))
"""
MEASURE = r"""
import json, sys, torch, aitune.torch as ait
from aitune.engine import end_to_end
case, path = sys.argv[1], sys.argv[2]
if case == "demo":
    from aitune.demo import model_and_data
    model, _ = model_and_data()
else:
    import transformers
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=32, max_position_embeddings=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=100)
    model = transformers.BertModel(cfg).eval()
model = ait.load(model, path, weights="artifact", trust_native_code=True)
data = torch.load(path + ".data")
call = (lambda item: model(**item)) if isinstance(data[0], dict) else model
e = end_to_end.measure(call, data, [], budget_s=10.0)
print(json.dumps({"speedup": e.speedup, "low": e.speedup_low, "high": e.speedup_high, "measured": e.measured, "text": e.describe()}))
"""


def main() -> int:
    stop = multiprocessing.Event()
    busy = multiprocessing.Process(target=spin, args=(stop,), daemon=True)
    busy.start()
    try:
        for case in ("demo", "bert"):
            path = os.path.join(tempfile.mkdtemp(), f"{case}.ait")
            done = subprocess.run([sys.executable, "-c", TUNE, case, path], capture_output=True, text=True)
            if done.returncode:
                print(case, "tune failed:", done.stderr[-1500:])
                continue
            tuned = json.loads(done.stdout.strip().splitlines()[-1])
            again = json.loads(
                subprocess.run([sys.executable, "-c", MEASURE, case, path], capture_output=True, text=True, check=True)
                .stdout.strip()
                .splitlines()[-1]
            )
            overlap = tuned["low"] <= again["high"] and again["low"] <= tuned["high"]
            print(
                case,
                "| reported:",
                tuned["text"],
                "| fresh process:",
                again["text"],
                "| overlap:",
                overlap,
                "| load",
                tuned["load"],
            )
    finally:
        stop.set()
    return 0


if __name__ == "__main__":
    sys.exit(main())
