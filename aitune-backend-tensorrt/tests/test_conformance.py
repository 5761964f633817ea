"""The backend contract, as every backend must pass it (the build part runs on a CUDA machine)."""

from aitune.testing import BackendConformance


class TestTensorRTBackendConformance(BackendConformance):
    backend_name = "tensorrt"
    device = "cuda"
