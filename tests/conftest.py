"""Shared test setup: environment for DeepSpeed's JIT ops and CPU accelerator, plus small fixtures."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

# Must be set before deepspeed/torch build or load any JIT op: scripts/setup.sh pre-builds them here.
_VENV = Path(os.environ.get("SMARTINF_VENV", REPO_ROOT / ".venv"))
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(_VENV / "torch_extensions"))
os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))

import torch  # noqa: E402  (after the environment above)

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def find_free_port() -> int:
    """Return a TCP port on localhost that is free right now (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def free_port() -> Callable[[], int]:
    """The port finder itself: call ``free_port()`` for a fresh port each time (one per process group)."""
    return find_free_port


@pytest.fixture(scope="session")
def csim_library() -> Path:
    """The C simulation of hls_kernels/ that the xrt backend's pyxrt model runs (built once if missing or stale)."""
    from lightning_smartinf.csd.xrt import build_csim_library

    try:
        return build_csim_library()
    except RuntimeError as exc:
        pytest.skip(f"the xrt backend's software model needs the HLS C simulation: {exc}")


def pytest_report_header(config: pytest.Config) -> list[str]:
    import deepspeed
    import lightning

    return [
        f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, lightning {lightning.__version__}",
        f"TORCH_EXTENSIONS_DIR={os.environ['TORCH_EXTENSIONS_DIR']}, DS_ACCELERATOR={os.environ.get('DS_ACCELERATOR')}",
    ]
