"""``ChannelsLastBackend``: the user's CNN in channels-last memory format, BatchNorm folded away.

Convolutions on CPU (oneDNN) and on tensor-core GPUs run fastest on NHWC data, and a BatchNorm
after a Conv costs a full pass over the activations that inference does not need. The build is a
copy of the module with each ``Conv2d -> BatchNorm2d`` pair of an ``nn.Sequential`` folded into one
Conv2d and every parameter stored channels-last; calls convert 4-D inputs to channels-last. The
transform is deterministic, so the payload holds no weights: loading repeats it on the module the
artifact restores, and checks that it folded the same layers.
"""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path
from typing import Any

import attrs
import torch
from torch.nn.utils.fusion import fuse_conv_bn_eval

from aitune.plugin import Backend, BackendConfig, BuildContext, GraphSpec, LoadContext, SerializationError

PAYLOAD = "channels_last.json"


@attrs.frozen(kw_only=True)
class ChannelsLastConfig(BackendConfig):
    """``fold_batchnorm``: fold BatchNorm2d into the Conv2d before it (eval-mode modules only).
    ``contiguous_outputs``: hand 4-D outputs back in the usual NCHW layout, so callers' ``.view``
    keeps working (one copy per output)."""

    fold_batchnorm: bool = True
    contiguous_outputs: bool = True


class ChannelsLastBackend(Backend):
    name = "channels_last"
    config_class = ChannelsLastConfig
    devices = ("cpu", "cuda")  # aitune reports cuda unavailable on a machine without a CUDA device
    config: ChannelsLastConfig

    def __init__(self, config: ChannelsLastConfig | None = None) -> None:
        super().__init__(config)  # clone() calls type(self)(self.config): keep this signature
        self.module: torch.nn.Module | None = None

    def unsupported_reason(self, graph: GraphSpec, device: torch.device) -> str | None:
        if not any(spec.rank == 4 for spec in graph.inputs):
            return "channels-last changes only 4-D (N, C, H, W) inputs and this graph has none"
        return None

    def build(self, module: torch.nn.Module, context: BuildContext) -> None:
        prepared = copy.deepcopy(module)  # never change the user's module
        folded = _fold_batchnorm(prepared) if self.config.fold_batchnorm and not prepared.training else []
        # Module.to takes memory_format (its docstring) though torch's overloads leave it out
        self.module = prepared.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        self.build_info["folded"] = folded

    def infer(self, *args: Any, **kwargs: Any) -> Any:
        if self.module is None:
            raise RuntimeError("ChannelsLastBackend.infer called before build or load")
        args = _map_tensors(args, _to_channels_last)
        kwargs = _map_tensors(kwargs, _to_channels_last)
        out = self.module(*args, **kwargs)
        return _map_tensors(out, _to_contiguous) if self.config.contiguous_outputs else out

    def save(self, directory: Path) -> dict[str, Any]:
        # Nothing to store but what the build did: the artifact keeps the module's own weights.
        (directory / PAYLOAD).write_text(json.dumps({"folded": self.build_info["folded"]}))
        return {"folded": self.build_info["folded"]}

    def load(self, module: torch.nn.Module, directory: Path, context: LoadContext) -> None:
        saved = json.loads((directory / PAYLOAD).read_text())["folded"]
        self.build(module, BuildContext(context.graph, [], context.device, directory, context.cache_dir))
        if self.build_info["folded"] != saved:
            raise SerializationError(
                f"the artifact folded BatchNorm into {saved} but this module folds {self.build_info['folded']}; "
                "load the artifact into the model it was tuned for"
            )


def _fold_batchnorm(module: torch.nn.Module) -> list[str]:
    """Fold every ``Conv2d -> BatchNorm2d`` pair inside an ``nn.Sequential``; returns the Conv names."""
    folded = []
    for owner_name, owner in module.named_modules():
        if not isinstance(owner, torch.nn.Sequential):
            continue
        names = list(owner._modules)
        for first, second in itertools.pairwise(names):
            conv, bn = owner._modules[first], owner._modules[second]
            if (
                isinstance(conv, torch.nn.Conv2d)
                and isinstance(bn, torch.nn.BatchNorm2d)
                and bn.track_running_stats
                and bn.num_features == conv.out_channels
            ):
                owner._modules[first] = fuse_conv_bn_eval(conv, bn)
                owner._modules[second] = torch.nn.Identity()
                folded.append(f"{owner_name}.{first}" if owner_name else first)
    return folded


def _to_channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 and t.is_floating_point() else t


def _to_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous() if t.dim() == 4 else t


def _map_tensors(value: Any, fn: Any) -> Any:
    """Apply ``fn`` to the tensors in plain tuples, lists and dicts; anything else passes untouched."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if type(value) in (tuple, list):
        return type(value)(_map_tensors(v, fn) for v in value)
    if type(value) is dict:
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value
