"""The backend contract, as every backend must pass it."""

from aitune.testing import BackendConformance


class TestTensorRTBackendConformance(BackendConformance):
    backend_name = "tensorrt"
