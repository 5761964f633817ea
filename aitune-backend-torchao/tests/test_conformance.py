"""The backend contract, as every backend must pass it."""

from aitune.testing import BackendConformance


class TestTorchAOBackendConformance(BackendConformance):
    backend_name = "torchao"
