"""Shared test setup: environment for DeepSpeed's JIT ops and CPU accelerator, plus small fixtures."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from filelock import FileLock
from helpers.machine import lacking, reflink_xfs, small_ext4, tmpfs

REPO_ROOT = Path(__file__).resolve().parents[1]

# Must be set before deepspeed/torch build or load any JIT op: scripts/setup.sh pre-builds them here.
_VENV = Path(os.environ.get("SMARTINF_VENV", REPO_ROOT / ".venv"))
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(_VENV / "torch_extensions"))
# Each of several test workers (pytest-xdist) computes on one core: the machine's cores are the workers'.
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
os.environ.setdefault("OMP_NUM_THREADS", "1" if WORKER else str(os.cpu_count() or 1))

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
    from lightning_smartinf.devices.xrt import build_csim_library

    try:
        return build_csim_library()
    except RuntimeError as exc:
        lacking(f"the xrt backend's software model needs the HLS C simulation (scripts/setup.sh builds it): {exc}")


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """``small_fs("4m")``: a tmpfs of that size of this test's own (``small_fs("1m", "other")`` for a second one),
    unmounted at its end (:func:`machine.tmpfs`)."""
    with contextlib.ExitStack() as mounted:
        yield lambda size, name="small": mounted.enter_context(tmpfs(tmp_path / name, size))


@pytest.fixture
def ext4_fs(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """``ext4_fs("24m")``: a loop-mounted ext4 of that size of this test's own (:func:`machine.small_ext4`)."""
    with contextlib.ExitStack() as mounted:
        yield lambda size, name="ext4": mounted.enter_context(small_ext4(tmp_path / name, size))


@pytest.fixture
def reflink_fs(tmp_path: Path) -> Iterator[Path]:
    """A directory on a filesystem that clones files (a loop-mounted XFS of this test's own, 400 MB sparse)."""
    with reflink_xfs(tmp_path / "reflink") as mounted:
        yield mounted


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory shared by every test of the run, across the workers of a parallel run."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if WORKER else base) / "shared"


def once(shared: Path, name: str, make: Callable[[Path], None]) -> Path:
    """``shared/name``, made by ``make(directory)`` once for the whole run: a test of any worker that needs it first
    makes it, the others wait for it and read it. A ``make`` that fails leaves nothing; the next test tries again."""
    directory = shared / name
    shared.mkdir(parents=True, exist_ok=True)
    with FileLock(str(shared / f"{name}.lock")):
        if not (directory / ".made").exists():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            make(directory)
            (directory / ".made").touch()
    return directory


def pytest_report_header(config: pytest.Config) -> list[str]:
    import deepspeed
    import lightning

    return [
        f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, lightning {lightning.__version__}",
        f"TORCH_EXTENSIONS_DIR={os.environ['TORCH_EXTENSIONS_DIR']}, DS_ACCELERATOR={os.environ.get('DS_ACCELERATOR')}",
    ]


@pytest.fixture(scope="session")
def checkpoint_reference(shared_dir: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """The uninterrupted run of ``scripts/ckpt_common.py`` (``TOTAL`` steps, ``step=4/8/12.ckpt`` kept under
    ``<root>/ckpts``), made once per test run, and its final parameters. Tests copy a checkpoint before changing it."""
    from scripts.ckpt_common import train

    def make(directory: Path) -> None:
        torch.save(train(directory), directory / "params.pt")

    root = once(shared_dir, "checkpoint-reference", make)
    return root, torch.load(root / "params.pt", weights_only=True)


def _user_env() -> dict[str, str]:
    """The environment a user's shell gives a command: this one's, without the rendezvous of fits run here and without
    a warnings filter of the test run's."""
    from helpers.launch import worker_env

    return {k: v for k, v in worker_env().items() if k != "PYTHONWARNINGS"}


@pytest.fixture(scope="session")
def demo_run(shared_dir: Path) -> str:
    """What ``smartinf demo --steps 6`` prints, run once per test run as a user runs it."""
    from helpers.launch import python

    def make(directory: Path) -> None:
        done = python("-m", "lightning_smartinf", "demo", "--steps", "6", cwd=directory, env=_user_env())
        (directory / "output.txt").write_text(done.stdout + done.stderr)

    return (once(shared_dir, "demo", make) / "output.txt").read_text()


#: ``smartinf fit`` arguments that keep a CPU recipe short: a few steps, one short validation.
SHORT_FIT = ["--trainer.max_steps", "3", "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "2"]


@pytest.fixture(scope="session")
def gpt2_recipe_run(shared_dir: Path) -> tuple[Path, str]:
    """``smartinf fit --config recipes/gpt2-pretrain-cpu.yaml`` (:data:`SHORT_FIT`), run once per test run in a
    directory laid out as the repository (the recipe's paths are relative to it): the directory and the output."""
    import sys

    from helpers.launch import run

    def make(directory: Path) -> None:
        (directory / "recipes").symlink_to(REPO_ROOT / "recipes")
        smartinf = Path(sys.executable).with_name("smartinf")
        command = [str(smartinf), "fit", "--config", "recipes/gpt2-pretrain-cpu.yaml", *SHORT_FIT]
        done = run(command, cwd=directory, env=_user_env())
        (directory / "output.txt").write_text(done.stdout + done.stderr)

    directory = once(shared_dir, "gpt2-recipe", make)
    return directory, (directory / "output.txt").read_text()
