from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import pytest
from aitune_testkit import serving

HERE = Path(__file__).parent
_STOPS: list[Callable[[], None]] = []


@pytest.fixture(scope="session")
def artifact(tmp_path_factory):
    """The tiny encoder with two outputs (``logits``, ``pooled``: a client can select one), tuned with
    ONNX Runtime for batches of 2 to 4 rows (about 10 s, once); served as model ``twoheads``.

    Skipped, visibly, where aitune-backend-onnxruntime is not installed (``nox -s
    tests-aitune-serve-ray`` installs this member alone with core and the kserve engine); ``nox -s
    tests`` runs them."""
    pytest.importorskip("aitune_backend_onnxruntime")
    return serving.tune(tmp_path_factory.mktemp("serve") / "twoheads.ait", factory=serving.build_two_heads)


@attrs.frozen
class SharedRay:
    """The Ray this folder's tests share, as a user's ``ray start --head`` would leave it."""

    address: str
    """Its GCS address (``host:port``), what ``--address`` and ``RAY_ADDRESS`` take."""
    dashboard: str
    """Its dashboard's URL (``http://127.0.0.1:PORT``), what ``serve status --address`` takes."""
    packages: Path
    """A folder on every worker's ``PYTHONPATH``: a module put there is one installed on every node
    (a config file's ``factory: mymodels:build_model``)."""


@pytest.fixture(scope="session")
def shared_ray() -> Iterator[SharedRay]:
    """One local Ray (2 CPUs) started in this process for the tests that attach to a running cluster
    (``aitune serve --address``, ``serve run --address``, the in-process Serve tests), each of which
    would otherwise start and stop a Ray of its own (seconds each). Stopped after this folder's last
    test, not at the end of the whole run.

    It runs Ray's dashboard, as ``ray start --head`` does where Ray's dashboard dependencies are
    installed (``ray.init`` leaves it out by default), so ``serve status`` reads it (about 5 s more
    at start, once). The tests that prove what ``aitune serve`` does with the local Ray it starts
    (Ctrl-C, SIGTERM, the dashboard and metrics ports) start their own. Ray Serve tries a replica's
    constructor once here, not three times: each try starts a replica process (seconds), and the
    tests that make the constructor fail need its error once. Ray's token (its default for a local
    Ray) is put in this process's environment by ``ray.init``, so the commands started from here
    send it.
    """
    ray = pytest.importorskip("ray")
    # a folder of its own under /tmp: nox points TMPDIR into the virtualenv, too long for Ray's sockets
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    packages = Path(temp) / "packages"
    packages.mkdir()
    with pytest.MonkeyPatch.context() as patch:
        # both read by the processes started below: Serve's controller, every worker
        patch.setenv("RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT", "1")
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(packages), os.environ.get("PYTHONPATH")])))
        context = ray.init(
            num_cpus=2,
            include_dashboard=True,
            dashboard_port=_free_port(),
            log_to_driver=False,
            _temp_dir=temp,
        )

    def stop() -> None:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)

    _STOPS.append(stop)
    yield SharedRay(context.address_info["gcs_address"], f"http://{context.dashboard_url}", packages)
    _stop_shared_ray()


@pytest.fixture(scope="session")
def ray_address(shared_ray: SharedRay) -> str:
    """:func:`shared_ray`'s GCS address."""
    return shared_ray.address


@pytest.fixture
def attach(ray_address: str) -> str:
    """:func:`ray_address`, with Serve down on it: a command that starts Serve there gets the HTTP
    port it asks for (a running Serve keeps the ``http_options`` it started with)."""
    from ray import serve

    serve.shutdown()
    return ray_address


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop_shared_ray() -> None:
    while _STOPS:
        _STOPS.pop()()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After this folder's last test (and its module fixtures' teardown), the shared Ray stops: the
    tests after it (other folders) run without its processes."""
    result = yield
    if nextitem is None or HERE not in Path(nextitem.path).parents:
        _stop_shared_ray()
    return result
