"""The backend contract, as every backend must pass it."""

from aitune.testing import BackendConformance


class TestTorchTensorRTJitBackendConformance(BackendConformance):
    backend_name = "torch_tensorrt_jit"


class TestTorchTensorRTAotBackendConformance(BackendConformance):
    backend_name = "torch_tensorrt_aot"
