"""The backend contract, as every backend must pass it."""

from aitune.testing import BackendConformance


class TestONNXRuntimeBackendConformance(BackendConformance):
    backend_name = "onnxruntime"
