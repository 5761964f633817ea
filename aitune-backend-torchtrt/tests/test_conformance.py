"""The backend contract, as every backend must pass it (build/save/load runs where CUDA and torch-tensorrt are)."""

from aitune.testing import BackendConformance


class TestTorchTensorRTJitBackendConformance(BackendConformance):
    backend_name = "torch_tensorrt_jit"
    device = "cuda"


class TestTorchTensorRTAotBackendConformance(BackendConformance):
    backend_name = "torch_tensorrt_aot"
    device = "cuda"
