"""The kserve ``Model``: ``load()`` builds the model and ``ait.load``s the artifact into it, the
metadata comes from the tuned graphs, and ``predict`` answers Open Inference Protocol v2 requests
(REST, JSON or binary tensors, and gRPC) through aitune's batcher.

Everything around it (routes, health and readiness, the protocol's codecs, Prometheus metrics,
graceful shutdown) is kserve's own ``ModelServer``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy
import torch

import aitune.torch as ait
from aitune.torch.serving import (
    Answer,
    BatchPlan,
    BatchRunner,
    ClientError,
    Factory,
    InputSpec,
    Padding,
    input_specs,
    model_graph,
    resolve_factory,
    tuned_threads,
)

from ._kserve import InferOutput, InferRequest, InferResponse, InvalidInput, Model, ModelNotReady
from .batching import Batcher, Stopping
from .limits import ROW_ELEMENTS_SLACK, row_element_caps
from .metrics import ServingCounts
from .plan import NUMPY_DATATYPES, OutputSpec, input_datatype, input_metadata, output_specs
from .protocol import UnprocessableInput

logger = logging.getLogger("aitune.serve")

ROWS_PER_BATCH = 8
"""The default row cap of one request, in largest tuned batches: a bigger request would hold the
requests queued behind it for that many model calls."""


class TunedModel(Model):
    """``factory()`` loaded with ``artifact``, served under ``name`` on kserve's ``ModelServer``.

    ``eager=True`` serves the factory's model with the artifact's weights, inputs and batching but
    none of its tuned backends (the A/B baseline). ``max_rows`` caps one request's rows (default
    eight largest tuned batches). ``pad`` (input name -> pad value) adds to the padding the artifact
    declares (``ait.tune(pad=...)``): with padding known, requests of different lengths join one call
    (:class:`aitune.torch.serving.Padding`).
    """

    def __init__(
        self,
        name: str,
        factory: Factory | str,
        artifact: str | Path,
        *,
        load_options: ait.LoadOptions | Mapping[str, Any] | None = None,
        threads: int | None = None,
        eager: bool = False,
        max_rows: int | None = None,
        pad: Mapping[str, float] | None = None,
    ) -> None:
        super().__init__(name)
        self.factory = factory
        self.artifact = Path(artifact)
        self.load_options = ait.LoadOptions.of(load_options)
        self.threads = threads or tuned_threads(artifact) or torch.get_num_threads()
        self.eager = eager
        self._max_rows = max_rows
        self.pad = dict(pad or {})
        self.padding = Padding(reason="not loaded yet")
        self._padding_text = self.padding.describe()
        self.plan = BatchPlan(())
        self.inputs: dict[str, InputSpec] = {}
        self.outputs: dict[str, OutputSpec] = {}
        self.batcher: Batcher | None = None
        self.row_caps: dict[str, int] = {}
        self._datatypes: dict[str, str | None] = {}  # per input, its protocol datatype (None: any), read per request
        self._required: tuple[str, ...] = ()  # the inputs every request sends, in order
        self._warm_up: dict[str, torch.Tensor] | None = None
        self.counts: ServingCounts | None = None
        """What its calls did, for ``/metrics`` (:mod:`.metrics`); made by ``load()``."""
        self._said = ""

    @property
    def max_rows(self) -> int:
        return self._max_rows or ROWS_PER_BATCH * self.plan.max_batch_size

    def load(self) -> bool:
        """Build, ``ait.load``, warm up (a call at the smallest tuned batch size), then ready. Once
        loaded, a second call changes nothing: kserve calls ``load()`` inside a request whenever the
        model reads not ready, where a rebuild would stall the server; a model whose health call failed
        stays not ready, and its log says why."""
        if self.batcher is None:
            self._load()
        return self.ready

    def _load(self) -> None:
        torch.set_num_threads(self.threads)
        build = resolve_factory(self.factory)
        model = ait.load(build(), self.artifact, options=self.load_options)
        model.eval()
        self.plan = BatchPlan.of(model)
        inputs = input_specs(model)
        self._take_inputs(inputs, row_element_caps(model, inputs))
        padding = Padding.of(model, self.inputs, self.pad)
        warm_up = _warm_up_request(model, self.plan)
        served = model
        if self.eager:  # the baseline: the same weights, batching and inputs, none of the tuned backends
            served = build().eval()
            served.load_state_dict(model.state_dict())
        graph = model_graph(model)
        if padding.active and graph is not None:  # which outputs follow the length, and that padding holds
            plain = BatchRunner(served, self.plan, self.inputs)
            smallest = self.plan.ranges[0][0] if self.plan.ranges else None
            padding = padding.probe(lambda request: _answered(plain.run([request])[0]), graph, smallest)
        self.padding = padding
        self._padding_text = padding.describe()  # in every answer: made once
        self.counts = counts = ServingCounts(self.name)
        runner = BatchRunner(served, self.plan, self.inputs, on_call=counts.call, padding=padding)
        self.batcher = Batcher(
            runner,
            setup_thread=lambda: torch.set_num_threads(self.threads),
            on_batch=counts.batch,
        )
        self._warm_up = warm_up
        if warm_up is not None:
            [answer] = self.batcher.run_now([warm_up])
            if isinstance(answer, ClientError):
                raise RuntimeError(f"the warm-up call failed: {answer}")
            self.outputs = output_specs(model, answer.outputs)
            arrays = _arrays(warm_up)
            if arrays is not None:  # the lane of host arrays for these inputs made (or found none) before ready
                self.batcher.run_now([arrays])
        logger.info(
            "serving %s as %r%s: inputs %s, tuned batch sizes %s, %d threads, padding %s",
            self.artifact,
            self.name,
            " (eager)" if self.eager else "",
            list(self.inputs),
            self.plan.ranges,
            self.threads,
            self._padding_text,
        )
        self.ready = True

    def _take_inputs(self, inputs: Mapping[str, InputSpec], row_caps: Mapping[str, int]) -> None:
        """The inputs requests are checked against, and what each request reads of them, made once."""
        self.inputs = dict(inputs)
        self._datatypes = {n: None if spec.dtype is None else input_datatype(spec) for n, spec in self.inputs.items()}
        self._required = tuple(n for n, spec in self.inputs.items() if spec.required)
        self.row_caps = dict(row_caps)

    async def healthy(self) -> bool:
        """Ready (kserve's readiness and health probes ask this): loaded, and the batcher's
        :meth:`~.batching.Batcher.healthy` (not stopping, and the model answers)."""
        if not self.ready or self.batcher is None:
            return False
        healthy = self.batcher.healthy(self._warm_up)
        if not healthy and self._said != self.batcher.unhealthy_reason:
            self._said = self.batcher.unhealthy_reason  # once per reason: this is asked before every request
            logger.warning("%s reads not ready: %s", self.name, self._said)
        return healthy

    def stop(self) -> None:
        if self.batcher is not None:
            self.batcher.close()
        super().stop()

    def get_input_types(self) -> list[dict[str, Any]]:
        """The tuned inputs, and any other the forward requires (optional ones the artifact never saw,
        like a BERT's ``position_ids``, are left out)."""
        return [input_metadata(spec) for spec in self.inputs.values() if spec.dtype is not None or spec.required]

    def get_output_types(self) -> list[dict[str, Any]]:
        return [spec.metadata() for spec in self.outputs.values()]

    async def predict(
        self, payload: Any, headers: dict[str, str] | None = None, response_headers: dict[str, str] | None = None
    ) -> InferResponse:
        if not isinstance(payload, InferRequest):
            raise InvalidInput(
                f"send an Open Inference Protocol v2 request: POST /v2/models/{self.name}/infer with "
                f'{{"inputs": [{{"name": ..., "shape": [...], "datatype": ..., "data": [...]}}]}}'
            )
        assert self.batcher is not None, "load() runs before the server starts"
        wanted = self._requested(payload)
        arrays = self.decode(payload)
        try:
            answer = await self.batcher.submit(arrays)
        except ClientError as exc:  # the model (eager) refused the values of a request that fits its inputs
            raise UnprocessableInput(str(exc)) from None
        except Stopping:
            raise ModelNotReady(self.name, "The server is stopping: send it to another replica.") from None
        return self._response(payload, answer, wanted)

    def decode(self, request: InferRequest) -> dict[str, numpy.ndarray[Any, Any]]:
        """The request's arrays, checked against the tuned inputs (InvalidInput says what to send). They
        stay numpy arrays: calls that fit a backend running host arrays are answered from them, and
        the runner makes tensors of them for any other call (:class:`BatchRunner`)."""
        arrays: dict[str, numpy.ndarray[Any, Any]] = {}
        rows: dict[str, int] = {}
        for item in request.inputs:
            spec = self.inputs.get(item.name)
            if spec is None:
                raise InvalidInput(f"unknown input {item.name!r}; this model takes: {self._described()}")
            if item.name in arrays:
                raise InvalidInput(f"input {item.name!r} is sent twice; send each input once")
            wanted = self._datatypes[item.name]
            if wanted is not None and item.datatype != wanted:
                raise InvalidInput(f"{item.name}: datatype {item.datatype}, this model takes {wanted} for {item.name}")
            try:
                array = item.as_numpy()
            except (ValueError, TypeError, OverflowError) as exc:
                raise InvalidInput(
                    f"{item.name}: the data does not make a {item.datatype} tensor of shape {list(item.shape)} ({exc}); "
                    f"send shape[0] x shape[1] x ... values"
                ) from None
            if array.dtype == object:
                raise InvalidInput(f"{item.name}: this model takes numbers ({input_datatype(spec)}), not BYTES")
            # checked on the array: each torch call on this path costs microseconds in a server whose
            # caches the requests between two of its own have cooled
            rows[item.name] = self._rows(item.name, spec, array.shape, array.size)
            arrays[item.name] = array
        missing = [name for name in self._required if name not in arrays]
        if missing:
            raise InvalidInput(f"missing input {', '.join(map(repr, missing))}; this model takes: {self._described()}")
        if len(rows) > 1 and len(set(rows.values())) > 1:
            raise InvalidInput(f"the inputs disagree on the batch size: {rows}")
        if rows and max(rows.values()) > self.max_rows:
            raise InvalidInput(
                f"{max(rows.values())} rows in one request; this server takes at most {self.max_rows} "
                f"(the largest tuned batch is {self.plan.max_batch_size}): send fewer rows per request"
            )
        return arrays

    def _rows(self, name: str, spec: InputSpec, shape: tuple[int, ...], size: int) -> int:
        """The rows of input ``name`` of ``shape`` (``size`` elements), checked against its rank,
        batch axis and per-row cap (InvalidInput says what to send)."""
        if spec.rank is not None and len(shape) != spec.rank:
            raise InvalidInput(
                f"{name}: shape {list(shape)} has rank {len(shape)}, this model takes {list(spec.shape or ())} "
                f"(-1: any size; the batch axis included: send one sample as a batch of one)"
            )
        if len(shape) <= spec.batch_axis or shape[spec.batch_axis] == 0:
            raise InvalidInput(f"{name}: shape {list(shape)} holds no rows on batch axis {spec.batch_axis}")
        rows = shape[spec.batch_axis]
        cap = self.row_caps.get(name)
        if cap is not None and size > cap * rows:
            raise InvalidInput(
                f"{name}: shape {list(shape)} holds {size // rows} elements per row; this server takes at most "
                f"{cap} ({ROW_ELEMENTS_SLACK}x the largest row it was tuned for): send shorter rows"
            )
        return rows

    def _requested(self, request: InferRequest) -> list[str]:
        names = [o.name for o in request.request_outputs or []]
        unknown = [n for n in names if n not in self.outputs]
        if unknown and self.outputs:
            raise InvalidInput(
                f"unknown output {', '.join(map(repr, unknown))}; this model answers: {', '.join(self.outputs)}"
            )
        return names

    def _response(self, request: InferRequest, answer: Answer, wanted: Sequence[str]) -> InferResponse:
        outputs = []
        for name, tensor in answer.outputs.items():
            if wanted and name not in wanted:
                continue
            array = _host_array(tensor)
            outputs.append(
                InferOutput(name=name, shape=list(array.shape), datatype=NUMPY_DATATYPES[array.dtype], data=array)
            )
        parameters: dict[str, Any] = {
            "aitune_backend": ", ".join(answer.backends) or "eager (no tuned module ran)",
            "aitune_batch_size": max(answer.batch_sizes),
            "aitune_requests_joined": answer.joined,
            # kserve's model metadata has fixed fields (REST and gRPC), so each answer says how requests
            # of different lengths are padded, or why they are not
            "aitune_padding": self._padding_text,
        }
        if answer.padded_to:
            parameters["aitune_padded_to"] = ", ".join(f"{dim}={n}" for dim, n in answer.padded_to.items())
        if answer.eager_reasons:
            parameters["aitune_eager_reason"] = "; ".join(answer.eager_reasons)
        return InferResponse(
            response_id=request.id or "",
            model_name=self.name,
            infer_outputs=outputs,
            parameters=parameters,
            # gRPC answers numpy outputs as raw contents anyway; kserve's to_grpc() with this flag set
            # tests an array's truth value and fails (kserve 0.21), so it is REST's flag only
            use_binary_outputs=request.use_binary_outputs and not request.from_grpc,
            requested_outputs=request.request_outputs,
        )

    def _described(self) -> str:
        return ", ".join(f"{s.name} ({input_datatype(s)} {list(s.shape or [-1])})" for s in self.inputs.values())


def _warm_up_request(model: torch.nn.Module, plan: BatchPlan) -> dict[str, torch.Tensor] | None:
    """Inputs for one call at the smallest tuned batch size, drawn from what tuning recorded."""
    graph = model_graph(model)
    if graph is None:
        return None
    batch = plan.ranges[0][0] if plan.ranges else None
    sample = graph.example("opt", batch_size=batch)
    return dict(zip([t.path for t in graph.inputs], sample.tensors()))


def _arrays(request: Mapping[str, torch.Tensor]) -> dict[str, numpy.ndarray[Any, Any]] | None:
    """``request`` as the numpy arrays a decoded request holds; None where one has no numpy dtype."""
    try:
        return {name: tensor.numpy() for name, tensor in request.items()}
    except (RuntimeError, TypeError):
        return None


def _answered(answer: Answer | ClientError) -> Answer:
    if isinstance(answer, ClientError):
        raise RuntimeError(f"the padding check's call failed: {answer}")
    return answer


def _host_array(tensor: torch.Tensor | numpy.ndarray[Any, Any]) -> numpy.ndarray[Any, Any]:
    """``tensor`` as a numpy array on the host in a dtype the protocol takes (bfloat16 widened to
    float32). An array (an answer from host arrays) is taken as it is, and a tensor on the host (the
    usual case) handed over by ``numpy()`` alone: each torch call on this path costs microseconds in
    a busy server."""
    if isinstance(tensor, numpy.ndarray):
        return tensor
    try:
        return tensor.numpy()  # raises for a tensor off the host, in bfloat16 or needing grad
    except (RuntimeError, TypeError):
        tensor = tensor.detach().cpu()
        return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()
