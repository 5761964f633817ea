"""Request bodies to named tensors and named tensors to response bodies.

Three body formats: JSON (an object from input name to nested lists), a ``.npy`` array (a model with
one input) and safetensors (any number of named tensors). Anything a client got wrong (a body that
does not parse, an unknown or missing name, a dtype or rank the tuned model does not take, ragged
lists) raises :class:`BadRequest` with the HTTP status and a message saying what to send instead.
A body is never unpickled: ``.npy`` is read with ``allow_pickle=False``.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping

import numpy as np
import torch

from aitune.torch.serving import ClientError, InputSpec

JSON = "application/json"
NPY = "application/x-npy"
SAFETENSORS = "application/safetensors"
FORMATS = (JSON, NPY, SAFETENSORS)


class BadRequest(ClientError):
    """What the client must change; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def body_format(content_type: str | None) -> str:
    """The format a ``Content-Type`` (or ``Accept``) names; JSON when none is given."""
    kind = (content_type or JSON).split(";")[0].strip().lower()
    if kind in ("", "*/*", "application/*"):
        return JSON
    if kind in FORMATS:
        return kind
    if kind in ("application/octet-stream", "application/npy"):
        return NPY
    raise BadRequest(415, f"unsupported body type {kind!r}; send one of: {', '.join(FORMATS)}")


def decode(body: bytes, content_type: str | None, specs: Mapping[str, InputSpec]) -> dict[str, torch.Tensor]:
    """The request's named tensors, checked against ``specs``."""
    kind = body_format(content_type)
    if kind == JSON:
        tensors = _from_json(body, specs)
    elif kind == NPY:
        tensors = _from_npy(body, specs)
    else:
        tensors = _from_safetensors(body)
    return check(tensors, specs)


def _from_json(body: bytes, specs: Mapping[str, InputSpec]) -> dict[str, torch.Tensor]:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(400, f"the body is not JSON ({exc}); send an object from input name to nested lists") from exc
    if not isinstance(data, dict):
        raise BadRequest(400, f"send a JSON object from input name to nested lists, like {_example(specs)}")
    out = {}
    for name, value in data.items():
        spec = specs.get(name)
        try:
            array = np.asarray(value)
        except ValueError as exc:  # ragged nested lists
            raise BadRequest(
                422, f"{name}: the nested lists are ragged ({exc}); every row needs the same length"
            ) from exc
        out[name] = _json_tensor(name, array, spec)
    return out


def _json_tensor(name: str, array: np.ndarray, spec: InputSpec | None) -> torch.Tensor:
    """JSON numbers as the tuned input's dtype: ints become floats, never the other way round."""
    if array.dtype == object or array.dtype.kind not in "biuf":
        raise BadRequest(422, f"{name}: expected numbers in nested lists of equal length, got {array.dtype} values")
    wanted = spec.dtype if spec is not None else None
    if wanted is None:
        return torch.from_numpy(array.astype(np.float32 if array.dtype.kind == "f" else array.dtype))
    if wanted.is_floating_point:
        ok = array.dtype.kind in "biuf"
    elif wanted == torch.bool:
        ok = array.dtype.kind == "b"
    else:
        ok = array.dtype.kind in "biu"
    if not ok:
        raise BadRequest(422, f"{name}: got {_kind(array)} values, this model takes {_name(wanted)}")
    return torch.from_numpy(array).to(wanted)


def _from_npy(body: bytes, specs: Mapping[str, InputSpec]) -> dict[str, torch.Tensor]:
    required = [s.name for s in specs.values() if s.required]
    if len(required) != 1:
        raise BadRequest(
            415, f"a .npy body carries one tensor; this model takes {', '.join(specs)}: send JSON or safetensors"
        )
    try:
        array = np.load(io.BytesIO(body), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise BadRequest(400, f"the body is not a .npy array ({exc})") from exc
    if array.dtype.kind not in "biuf":
        raise BadRequest(422, f"{required[0]}: a .npy of {array.dtype} cannot be a tensor; send numbers")
    return {required[0]: torch.from_numpy(np.ascontiguousarray(array))}


def _from_safetensors(body: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    try:
        return dict(load(body))
    except Exception as exc:  # safetensors raises its own SafetensorError, and others on truncated headers
        raise BadRequest(400, f"the body is not safetensors ({type(exc).__name__}: {exc})") from exc


def check(tensors: dict[str, torch.Tensor], specs: Mapping[str, InputSpec]) -> dict[str, torch.Tensor]:
    """Names, dtypes, ranks and one batch size across inputs; the tensors unchanged."""
    unknown = sorted(set(tensors) - set(specs))
    if unknown:
        raise BadRequest(422, f"unknown input {', '.join(map(repr, unknown))}; this model takes: {', '.join(specs)}")
    missing = [s.name for s in specs.values() if s.required and s.name not in tensors]
    if missing:
        raise BadRequest(422, f"missing input {', '.join(map(repr, missing))}; this model takes: {', '.join(specs)}")
    rows = {}
    for name, tensor in tensors.items():
        spec = specs[name]
        if spec.dtype is not None and tensor.dtype != spec.dtype:
            raise BadRequest(422, f"{name}: dtype {_name(tensor.dtype)}, this model takes {_name(spec.dtype)}")
        if spec.rank is not None and tensor.dim() != spec.rank:
            raise BadRequest(
                422,
                f"{name}: shape {tuple(tensor.shape)} has rank {tensor.dim()}, this model takes rank {spec.rank} "
                f"(the batch axis included: send one sample as a batch of one)",
            )
        if tensor.dim() <= spec.batch_axis or tensor.shape[spec.batch_axis] == 0:
            raise BadRequest(422, f"{name}: shape {tuple(tensor.shape)} holds no rows on batch axis {spec.batch_axis}")
        rows[name] = tensor.shape[spec.batch_axis]
    if len(set(rows.values())) > 1:
        raise BadRequest(422, f"the inputs disagree on the batch size: {rows}")
    return tensors


def encode(outputs: Mapping[str, torch.Tensor], accept: str | None) -> tuple[bytes, str]:
    """The response body in the format asked for (``Accept``), and its content type."""
    kind = body_format(accept)
    if kind == JSON:
        return json.dumps({name: _plain(t).tolist() for name, t in outputs.items()}).encode(), JSON
    if kind == NPY:
        if len(outputs) != 1:
            raise BadRequest(
                406, f"the model answers {len(outputs)} tensors ({', '.join(outputs)}); accept JSON or safetensors"
            )
        buffer = io.BytesIO()
        np.save(buffer, _plain(next(iter(outputs.values()))).numpy(), allow_pickle=False)
        return buffer.getvalue(), NPY
    from safetensors.torch import save

    return save({name: t.contiguous() for name, t in outputs.items()}), SAFETENSORS


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """On the CPU in a dtype numpy and JSON take (bfloat16 widened to float32)."""
    tensor = tensor.detach().cpu()
    return tensor.float() if tensor.dtype == torch.bfloat16 else tensor


def _kind(array: np.ndarray) -> str:
    return {"b": "boolean", "f": "floating-point"}.get(array.dtype.kind, "integer")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _example(specs: Mapping[str, InputSpec]) -> str:
    return json.dumps({name: [[0.0]] for name in specs})
