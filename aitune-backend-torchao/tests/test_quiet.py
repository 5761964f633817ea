"""torchao's notices about kernel libraries it cannot load stay out of an aitune user's output."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

from aitune_backend_torchao import quiet

NOTICE = "Failed to load /venv/site-packages/torchao/_C_cutlass_90a.abi3.so: Could not load this library: ..."


def _record(message: str, level: int = logging.WARNING) -> logging.LogRecord:
    return logging.LogRecord("torchao", level, __file__, 1, message, None, None)


def test_the_filter_drops_kernel_notices_and_keeps_everything_else():
    notices = quiet.KernelNotices()
    assert not notices.filter(_record(NOTICE))
    assert notices.filter(_record("Skipping import of cpp extensions due to incompatible torch version"))
    assert notices.filter(_record(NOTICE, logging.ERROR)), "only the WARNING notice is dropped"


def test_the_notices_show_again_when_torchaos_logger_is_at_debug():
    logger = logging.getLogger("torchao")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        assert quiet.KernelNotices().filter(_record(NOTICE))
    finally:
        logger.setLevel(level)


def test_install_puts_one_filter_however_often_it_is_called():
    quiet.install()
    quiet.install()
    assert sum(isinstance(f, quiet.KernelNotices) for f in logging.getLogger("torchao").filters) == 1


def _stderr(code: str) -> str:
    script = "import logging; logging.basicConfig(level=logging.WARNING)\n" + textwrap.dedent(code)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stderr


def test_importing_torchao_through_aitune_prints_no_kernel_notices():
    quieted = _stderr("from aitune_backend_torchao import quiet; quiet.import_torchao()")
    assert "Failed to load" not in quieted, quieted
    assert "is an Enum subclass" not in quieted, quieted


def test_once_aitune_loaded_its_plugins_another_library_importing_torchao_prints_no_kernel_notices():
    quieted = _stderr(
        "from aitune.plugins import get_manager; get_manager().load_entry_points(); import torchao  # as transformers does"
    )
    assert "Failed to load" not in quieted, quieted
