"""The backend contract, as every backend must pass it."""

from aitune.testing import BackendConformance


class TestTorchInductorJitBackendConformance(BackendConformance):
    backend_name = "torch_inductor_jit"


class TestTorchInductorAotBackendConformance(BackendConformance):
    backend_name = "torch_inductor_aot"
