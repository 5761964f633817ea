"""The named quantization presets: which torchao config each builds, where it runs, how accurate it is.

The tolerances come from measurement against eager float32 (README, "Presets"): each is a few
times the worst error seen, so a correct build passes and a broken one does not. Importing this
module imports no torchao; :meth:`Preset.make` does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch

from aitune.plugin import Tolerance


def _int8wo() -> Any:
    from torchao.quantization import Int8WeightOnlyConfig

    return Int8WeightOnlyConfig(set_inductor_config=False)


def _int8dq() -> Any:
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig

    return Int8DynamicActivationInt8WeightConfig(set_inductor_config=False)


def _int4wo() -> Any:
    from torchao.quantization import Int4WeightOnlyConfig
    from torchao.quantization.quantize_.workflows import Int4PackingFormat

    # The tinygemm layout runs on torch's own CUDA kernel; the default layout needs the mslk package.
    return Int4WeightOnlyConfig(
        group_size=128, int4_packing_format=Int4PackingFormat.TILE_PACKED_TO_4D, set_inductor_config=False
    )


def _fp8wo() -> Any:
    from torchao.quantization import Float8WeightOnlyConfig

    return Float8WeightOnlyConfig(set_inductor_config=False)


def _fp8dq() -> Any:
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow

    return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)


@attrs.frozen
class Preset:
    name: str
    torchao_class: str
    """The torchao config class the preset builds; custom configs of that class share its tolerance."""
    make: Callable[[], Any]
    tolerance: Tolerance
    cuda_capability: tuple[int, int] | None
    """The lowest CUDA compute capability it needs; None when any CUDA device will do."""
    cpu_reason: str | None
    """Why it cannot run on CPU, or None when it can."""

    def unsupported_reason(self, device: torch.device) -> str | None:
        if device.type == "cpu":
            return self.cpu_reason
        if device.type != "cuda":
            return f"the {self.name} preset runs on cpu or cuda, not {device.type}"
        if not torch.cuda.is_available():
            return "no CUDA device is visible to torch"
        if self.cuda_capability is not None and torch.version.hip is None:
            have = torch.cuda.get_device_capability(device)
            if have < self.cuda_capability:
                need = ".".join(map(str, self.cuda_capability))
                return (
                    f"the {self.name} preset needs a GPU of compute capability {need} or newer; "
                    f"{torch.cuda.get_device_name(device)} has {have[0]}.{have[1]}"
                )
        return None


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "int8wo", "Int8WeightOnlyConfig", _int8wo, Tolerance(atol=1e-4, rtol=0.03, min_cosine=0.999), None, None
        ),
        Preset(
            "int8dq",
            "Int8DynamicActivationInt8WeightConfig",
            _int8dq,
            Tolerance(atol=1e-4, rtol=0.05, min_cosine=0.995),
            None,
            None,
        ),
        Preset(
            "int4wo",
            "Int4WeightOnlyConfig",
            _int4wo,
            Tolerance(atol=1e-3, rtol=0.15, min_cosine=0.98),
            (8, 0),
            "int4 weight-only runs on torch's tinygemm CUDA kernel (compute capability 8.0+, bfloat16 "
            "weights); there is no CPU kernel for it: use int8dq on CPU",
        ),
        Preset("fp8wo", "Float8WeightOnlyConfig", _fp8wo, Tolerance(atol=1e-4, rtol=0.1, min_cosine=0.995), None, None),
        Preset(
            "fp8dq",
            "Float8DynamicActivationFloat8WeightConfig",
            _fp8dq,
            Tolerance(atol=1e-3, rtol=0.1, min_cosine=0.99),
            (8, 9),
            "float8 dynamic activation quantization needs float8 matmuls: a CUDA GPU of compute "
            "capability 8.9+ (Ada, Hopper) or an MI300; use int8dq on CPU",
        ),
    )
}

CUSTOM_TOLERANCE = Tolerance(atol=1e-3, rtol=0.15, min_cosine=0.98)
"""The bound for a torchao config no preset describes: as loose as int4; set ``tolerance`` to tighten it."""


def for_torchao_class(name: str) -> Preset | None:
    return next((p for p in PRESETS.values() if p.torchao_class == name), None)
