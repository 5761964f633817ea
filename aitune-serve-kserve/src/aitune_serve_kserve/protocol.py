"""The Open Inference Protocol's REST side, kserve's own, for an ASGI server other than kserve's
``ModelServer``: Ray Serve's ingress (``aitune-serve-ray``) serves a :class:`~.model.TunedModel`
through it, so both engines answer the same routes with the same codecs, metadata and errors.

- :class:`ProtocolDataPlane`: kserve's ``DataPlane``, reading what its v2 decoder does not (a JSON
  body sent without a ``Content-Type``, as Triton's client sends it; a body that is not the protocol
  is the client's error, 400, not 500);
- :func:`v2_app`: a FastAPI app with kserve's v2 routes (health, readiness, metadata, infer) and its
  exception handlers (``{"error": ...}`` with the status kserve gives each error) over some models;
- :class:`UnprocessableInput`: a request the protocol takes whose values the model refuses, a 422
  (:func:`add_unprocessable_handler` teaches an app that status).

kserve parses ``sys.argv`` when it is imported: :mod:`._kserve` imports it first, with a clean one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ._kserve import INFERENCE_CONTENT_LENGTH_HEADER, DataPlane, InferRequest, InvalidInput, Model

__all__ = ["ProtocolDataPlane", "UnprocessableInput", "add_unprocessable_handler", "v2_app"]


class UnprocessableInput(InvalidInput):
    """A well-formed request whose values the model refuses where eager raises (a token id outside its
    embedding's rows): HTTP 422 (Unprocessable Content), where a request that does not fit the model's
    inputs is kserve's 400. Over gRPC it is ``INVALID_ARGUMENT``, as every ``InvalidInput``."""


async def _unprocessable(_: Any, exc: Exception) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=422, content={"error": str(exc)})


def add_unprocessable_handler(app: Any) -> None:
    """Answer :class:`UnprocessableInput` with 422 on ``app`` (a handler for the subclass wins over
    kserve's for ``InvalidInput``: Starlette looks handlers up along the exception's MRO)."""
    app.add_exception_handler(UnprocessableInput, _unprocessable)


class ProtocolDataPlane(DataPlane):
    """kserve's data plane, reading what its v2 decoder does not: a body it cannot parse is the client's
    error (400), not 500; a body without ``Inference-Header-Content-Length`` is all JSON, as the
    protocol's binary extension says (Triton's client sends JSON requests without a Content-Type,
    which kserve then takes for a binary one missing that header)."""

    def decode_inference_request(self, body: Any, headers: Any, model_name: str) -> Any:
        try:
            if isinstance(body, bytes) and INFERENCE_CONTENT_LENGTH_HEADER not in (headers or {}):
                return InferRequest.from_bytes(body, len(body), model_name)
            return super().decode_inference_request(body, headers, model_name)
        except InvalidInput:
            raise
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise InvalidInput(
                f"the body is not an Open Inference Protocol v2 request ({type(exc).__name__}: {exc}); send "
                f'{{"inputs": [{{"name", "shape", "datatype", "data"}}]}}, or binary tensors whose '
                f"parameters.binary_data_size and Inference-Header-Content-Length match the body"
            ) from None


def v2_app(models: Iterable[Model]) -> Any:
    """A FastAPI app answering the protocol's REST routes for ``models`` (loaded kserve ``Model``\\ s):
    ``GET /v2/health/live``, ``/v2/health/ready``, ``/v2/models``, ``/v2/models/{name}`` (metadata),
    ``/v2/models/{name}/ready`` and ``POST /v2/models/{name}/infer``, kserve's own handlers and
    exception handlers (what kserve's ``RESTServer`` registers for v2, without its v1 routes, its
    model repository extension and ``/metrics``: the server around it has its own)."""
    import fastapi
    from kserve import errors
    from kserve.model_repository import ModelRepository
    from kserve.protocol.rest.v2_endpoints import register_v2_endpoints

    repository = ModelRepository()
    for model in models:
        repository.update(model)
    app = fastapi.FastAPI(title="aitune", openapi_url=None, docs_url=None, redoc_url=None)
    register_v2_endpoints(app, ProtocolDataPlane(model_registry=repository), None)
    handlers: list[tuple[type[Exception], Any]] = [
        (errors.InvalidInput, errors.invalid_input_handler),
        (errors.InferenceError, errors.inference_error_handler),
        (errors.ModelNotFound, errors.model_not_found_handler),
        (errors.ModelNotReady, errors.model_not_ready_handler),
        (NotImplementedError, errors.not_implemented_error_handler),
        (errors.UnsupportedProtocol, errors.unsupported_protocol_error_handler),
        (errors.ServerNotLive, errors.server_not_live_handler),
        (errors.ServerNotReady, errors.server_not_ready_handler),
        (Exception, errors.generic_exception_handler),
    ]
    for kind, handler in handlers:
        app.add_exception_handler(kind, handler)
    add_unprocessable_handler(app)
    return app
