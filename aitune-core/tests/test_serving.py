"""``aitune.torch.serving``, what every serving engine shares: the tuned batch sizes and inputs, and
the runner that joins requests into calls of those sizes (no server: the engines test their own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
import zipfile

import pytest
import torch
from aitune_testkit.doubles import SlowModule

import aitune.torch as ait
from aitune.artifact import FORMAT_VERSION, Manifest
from aitune.artifact.archive import MANIFEST, Writer
from aitune.converter import unstructure
from aitune.testing.backends import ToyBackend
from aitune.torch.serving import (
    BatchPlan,
    BatchRunner,
    ClientError,
    InputSpec,
    input_specs,
    intersect,
    merge,
    model_graph,
    named_outputs,
    resolve_factory,
    tuned_threads,
)

# -- the plan -----------------------------------------------------------------------------------------


def test_calls_are_split_above_and_padded_below_the_tuned_batch_sizes():
    plan = BatchPlan(((2, 4),))
    assert plan.max_batch_size == 4
    assert plan.chunks(1) == [(1, 2)]
    assert plan.chunks(3) == [(3, 3)]
    assert plan.chunks(9) == [(4, 4), (4, 4), (1, 2)]


def test_a_gap_between_ranges_is_padded_to_the_next_range():
    plan = BatchPlan(((1, 2), (8, 16)))
    assert plan.chunks(5) == [(5, 8)]
    assert plan.chunks(17) == [(16, 16), (1, 1)]


def test_without_a_tuned_batch_axis_a_request_is_one_call_as_sent():
    assert BatchPlan(()).chunks(7) == [(7, 7)]
    assert BatchPlan(()).max_batch_size == 1


def test_every_module_must_cover_a_batch_size():
    assert merge([(4, 8), (1, 2), (3, 3)]) == ((1, 8),)
    assert intersect(((1, 8),), ((2, 4), (6, 16))) == ((2, 4), (6, 8))


def test_an_input_spec_takes_a_shape_or_a_rank():
    assert InputSpec("x", True, torch.float32, (-1, 8), 0).rank == 2
    assert InputSpec("x", True, torch.float32, 3).shape == (-1, -1, -1)
    assert InputSpec("x", False).rank is None


def test_outputs_are_named_by_their_structure():
    t = torch.zeros(1)
    assert list(named_outputs(t)) == ["output"]
    assert list(named_outputs((t, {"logits": t, "n": 3}))) == ["output_0", "output_1.logits"]


# -- from a tuned model -------------------------------------------------------------------------------------


@pytest.fixture
def tuned(toy_backends) -> ait.Module:
    """A small MLP (``x``, and an optional ``mask``) tuned with the toy backend for 2 to 4 rows of 8 features."""
    strategy = ait.FirstWinsStrategy([ToyBackend()], performance_validation=False)
    model = ait.Module(SlowModule(delay_s=0).eval(), "mlp", strategy=strategy)
    ait.tune(model, [torch.randn(rows, 8) for rows in (2, 4)])
    return model


def test_the_plan_and_the_inputs_come_from_the_tuned_graphs(tuned):
    model = tuned
    assert BatchPlan.of(model).ranges == ((2, 4),)
    assert model_graph(model) is not None
    # the batch axis varies, the features are tuned static; the optional mask was never sent
    assert input_specs(model) == {
        "x": InputSpec("x", True, torch.float32, (-1, 8), 0),
        "mask": InputSpec("mask", False),
    }
    assert BatchPlan.of(SlowModule()).ranges == () and input_specs(SlowModule())["x"].dtype is None


def _runner(model: torch.nn.Module, plan: BatchPlan | None = None) -> tuple[BatchRunner, list]:
    calls: list = []
    specs = input_specs(model)
    return BatchRunner(model, plan or BatchPlan.of(model), specs, on_call=calls.append), calls


def test_joined_requests_answer_as_eager_and_every_call_stays_in_the_tuned_range(tuned):
    model = tuned
    runner, calls = _runner(model)
    eager = SlowModule(delay_s=0).eval()
    requests = [{"x": torch.randn(rows, 8)} for rows in (1, 2, 1, 5, 4)]
    answers = runner.run(requests)
    for request, answer in zip(requests, answers):
        assert not isinstance(answer, ClientError)
        with torch.no_grad():
            assert torch.allclose(answer.outputs["output"], eager(request["x"]), atol=1e-5)
        assert answer.backends == ("mlp=toy",) and answer.eager_reasons == () and answer.joined == 5
    assert [(c.rows, c.size) for c in calls] == [(4, 4), (4, 4), (4, 4), (1, 2)]  # the last one padded
    assert answers[3].batch_sizes == (4, 4)  # its 5 rows spanned two calls


def test_requests_of_another_shape_run_in_a_call_of_their_own(tuned):
    model = tuned
    runner, calls = _runner(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        wide, narrow = runner.run([{"x": torch.randn(2, 8)}, {"x": torch.randn(1, 8), "mask": torch.ones(1, 8)}])
    assert not isinstance(wide, ClientError) and not isinstance(narrow, ClientError)
    assert wide.joined == narrow.joined == 1 and len(calls) == 2


def test_a_request_the_model_cannot_take_fails_alone_as_a_client_error(tuned):
    model = tuned
    runner, _ = _runner(model)
    good = {"x": torch.randn(1, 8)}
    with pytest.warns(RuntimeWarning, match="outside what was tuned"):
        bad, answered = runner.run([{"x": torch.randn(1, 5)}, good])
    assert isinstance(bad, ClientError) and "the model cannot take this input" in str(bad)
    assert "RuntimeError" in str(bad), bad
    assert not isinstance(answered, ClientError) and answered.outputs["output"].shape == (1, 8)


def test_an_engine_answers_a_refused_request_with_its_own_error(tuned):
    class Refused(ClientError):
        pass

    class MyRunner(BatchRunner):
        def client_error(self, message: str) -> Refused:
            return Refused(message)

    model = tuned
    runner = MyRunner(model, BatchPlan.of(model), input_specs(model))
    with pytest.warns(RuntimeWarning):
        [bad] = runner.run([{"x": torch.randn(1, 5)}])
    assert isinstance(bad, Refused)


def test_a_failure_of_the_server_itself_is_not_blamed_on_the_request():
    class Broken(torch.nn.Module):
        def forward(self, x):
            raise MemoryError("out of memory")

    runner = BatchRunner(Broken(), BatchPlan(((2, 4),)), {"x": InputSpec("x", True, torch.float32, 2)})
    with pytest.raises(MemoryError):
        runner.run([{"x": torch.randn(2, 8)}])


def test_outputs_must_hold_the_calls_rows_on_axis_0():
    class Summed(torch.nn.Module):
        def forward(self, x):
            return x.sum()

    runner = BatchRunner(Summed(), BatchPlan(()), {"x": InputSpec("x", True)})
    with pytest.raises(RuntimeError, match="splits a batched call's outputs on axis 0"):
        runner.run([{"x": torch.randn(2, 8)}])


# -- the model the server runs --------------------------------------------------------------------------------


def test_a_factory_is_a_callable_or_an_import_path():
    assert resolve_factory(SlowModule) is SlowModule
    assert resolve_factory("aitune_testkit.doubles:SlowModule") is SlowModule
    for bad, words in [
        ("no_colon", "'package.module:name'"),
        ("no_such_package:build", "cannot import the model factory"),
        ("aitune_testkit.doubles:__doc__", "is not callable"),
    ]:
        with pytest.raises(ValueError, match=words):
            resolve_factory(bad)


def test_the_threads_come_from_the_manifest_bounded_by_the_cores(tmp_path):
    def artifact(environment: dict[str, object]) -> str:
        path = tmp_path / "a.ait"
        manifest = Manifest(FORMAT_VERSION, "2026-01-01T00:00:00Z", "0", {}, environment)
        writer = Writer(path)
        writer.add_bytes(MANIFEST, json.dumps(unstructure(manifest)).encode())
        writer.commit()
        return str(path)

    assert tuned_threads(artifact({"threads": 1})) == 1
    assert tuned_threads(artifact({"threads": 10_000})) == (os.cpu_count() or 1)
    assert tuned_threads(artifact({"threads": True})) is None
    assert tuned_threads(artifact({})) is None
    assert tuned_threads(tmp_path / "missing.ait") is None
    (tmp_path / "junk.ait").write_bytes(b"not a zip")
    assert tuned_threads(tmp_path / "junk.ait") is None
    # a manifest no digest list vouches for is not read: ait.load would refuse the file
    with zipfile.ZipFile(tmp_path / "unlisted.ait", "w") as archive:
        archive.writestr(MANIFEST, json.dumps({"environment": {"threads": 1}}))
    assert tuned_threads(tmp_path / "unlisted.ait") is None


def test_importing_it_imports_no_server():
    code = (
        "import sys, aitune.torch.serving\n"
        "heavy = ('ray', 'kserve', 'starlette', 'fastapi', 'uvicorn', 'prometheus_client', 'grpc', 'safetensors')\n"
        "print(','.join(h for h in heavy if h in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
