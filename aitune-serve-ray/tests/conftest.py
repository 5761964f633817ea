from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

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


@pytest.fixture(scope="session")
def ray_address() -> Iterator[str]:
    """The address of one local Ray (2 CPUs) started in this process for the tests that attach to a
    running cluster (``aitune serve --address``, ``serve run --address``, the in-process Serve
    tests), each of which would otherwise start and stop a Ray of its own (seconds each). Stopped
    after this folder's last test, not at the end of the whole run.

    The tests that prove what ``aitune serve`` does with the local Ray it starts (Ctrl-C, SIGTERM,
    the dashboard and metrics ports) start their own. Ray Serve tries a replica's constructor once
    here, not three times: each try starts a replica process (seconds), and the tests that make the
    constructor fail need its error once. Ray's token (its default for a local Ray) is put in this
    process's environment by ``ray.init``, so the commands started from here send it.
    """
    ray = pytest.importorskip("ray")
    # a folder of its own under /tmp: nox points TMPDIR into the virtualenv, too long for Ray's sockets
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT", "1")  # read by Serve's controller, started below
        context = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=temp)

    def stop() -> None:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)

    _STOPS.append(stop)
    yield context.address_info["gcs_address"]
    _stop_shared_ray()


@pytest.fixture
def attach(ray_address: str) -> str:
    """:func:`ray_address`, with Serve down on it: a command that starts Serve there gets the HTTP
    port it asks for (a running Serve keeps the ``http_options`` it started with)."""
    from ray import serve

    serve.shutdown()
    return ray_address


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
