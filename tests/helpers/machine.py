"""What a test needs of the machine, in one place: a size-limited filesystem of its own, and what to do when the
machine cannot give what a test needs.

Set-up (``scripts/setup.sh``) installs everything the suite uses, and CI runs as root, so on CI nothing is lacking:
``.ci/run`` sets ``SMARTINF_STRICT_MACHINE=1``, which turns every "the machine lacks" into a failure. Elsewhere (a
developer's laptop without root) such a test is skipped with the reason. Hardware nobody can lend here (CUDA) is
not this: those tests carry the ``cuda`` marker and skip everywhere without a GPU.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest

#: Set by ``.ci/run``: a lacking machine fails the test instead of skipping it.
STRICT = os.environ.get("SMARTINF_STRICT_MACHINE") == "1"


def lacking(reason: str) -> NoReturn:
    """This machine lacks what the test needs (``reason`` says what, and how to get it)."""
    if STRICT:
        pytest.fail(f"the machine lacks what this test needs, which set-up and CI provide: {reason}")
    pytest.skip(reason)


@contextlib.contextmanager
def tmpfs(directory: Path, size: str, *, readonly: bool = False) -> Iterator[Path]:
    """A tmpfs of ``size`` (e.g. ``"4m"``) mounted on ``directory`` (created, mode 0700), unmounted afterwards.

    Mounting needs root (CI runs as root).
    """
    directory.mkdir(parents=True, exist_ok=True)
    options = f"{'ro,' if readonly else ''}size={size},mode=0700"
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(directory)], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        lacking(f"mounting a {size} tmpfs needs the mount command and root ({exc})")
    if done.returncode != 0:
        lacking(f"mounting a {size} tmpfs needs root ({done.stderr.strip() or done.returncode})")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], capture_output=True, timeout=30)


@contextlib.contextmanager
def reflink_xfs(directory: Path, size: str = "400m") -> Iterator[Path]:
    """An XFS with reflinks (so ``FICLONE`` works) of ``size``, in a sparse image beside ``directory`` and
    loop-mounted on it (mode 0700), unmounted and deleted afterwards.

    Needs root and ``mkfs.xfs`` (set-up installs ``xfsprogs``); XFS is at least 300 MB.
    """
    with _loop_mounted(directory, size, "xfs", ["mkfs.xfs", "-q", "-f", "-m", "reflink=1"], "xfsprogs") as mounted:
        yield mounted


@contextlib.contextmanager
def small_ext4(directory: Path, size: str) -> Iterator[Path]:
    """An ext4 of ``size`` with no blocks reserved for root (the tests run as root: a reserve would let them write
    past the free space ``statvfs`` reports), loop-mounted on ``directory`` as :func:`reflink_xfs` is. Needs root,
    ``mkfs.ext4`` (set-up installs e2fsprogs where it is missing) and loop devices."""
    mkfs = ["mkfs.ext4", "-q", "-F", "-m", "0", "-E", "lazy_itable_init=0,lazy_journal_init=0"]
    with _loop_mounted(directory, size, "ext4", mkfs, "e2fsprogs") as mounted:
        (mounted / "lost+found").rmdir()
        yield mounted


@contextlib.contextmanager
def _loop_mounted(directory: Path, size: str, kind: str, mkfs: list[str], package: str) -> Iterator[Path]:
    """A filesystem made by ``mkfs`` in a sparse image of ``size`` beside ``directory``, loop-mounted on it (mode
    0700); unmounted and the image deleted afterwards."""
    directory.mkdir(parents=True, exist_ok=True)
    image = directory.with_name(f"{directory.name}.{kind}.img")
    steps = (
        ["truncate", "-s", size, str(image)],
        [*mkfs, str(image)],
        ["mount", "-o", "loop", str(image), str(directory)],
    )
    for command in steps:
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            image.unlink(missing_ok=True)
            lacking(f"a loop-mounted {kind} needs {command[0]} ({package}, util-linux) and root ({exc})")
        if done.returncode != 0:
            image.unlink(missing_ok=True)
            lacking(f"a loop-mounted {kind} needs root and loop devices: {' '.join(command)}: {done.stderr.strip()}")
    try:
        directory.chmod(0o700)
        yield directory
    finally:
        # Lazily: a file still open (a backend a later fixture closes) must not keep the filesystem mounted.
        subprocess.run(["umount", "-l", str(directory)], capture_output=True, timeout=60)
        image.unlink(missing_ok=True)


def aio_op() -> tuple[object, object]:
    """``lightning_smartinf.zero.aio`` and DeepSpeed's async_io op, loaded (set-up installs libaio and builds it)."""
    from lightning_smartinf.zero import aio

    try:
        return aio, aio.load_aio_op()
    except RuntimeError as exc:
        lacking(f"DeepSpeed's async_io op needs libaio (scripts/setup.sh installs it and builds the op): {exc}")


def proc_status(key: str) -> int:
    """A field of this process's ``/proc/self/status`` in bytes (``VmRSS``: now; ``VmHWM``: the peak since the last
    :func:`reset_peak`)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == key:
            return int(value.split()[0]) * 1024
    raise KeyError(key)


def reset_peak() -> int:
    """Make this process's peak RSS (``VmHWM``) its RSS now, and return that: what a measured step starts from."""
    Path("/proc/self/clear_refs").write_text("5")
    return proc_status("VmRSS")
