"""A directory this process cannot write to, also when the tests run as root (as CI does)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def unwritable_dir(directory: Path) -> Iterator[bool]:
    """Create ``directory`` so that this process cannot write into it; yields whether it is a read-only filesystem.

    Others get mode 0500. Root writes through permission bits, so it gets a read-only tmpfs mounted there instead
    (skipped, with the reason, only where this process may not mount).
    """
    directory.mkdir()
    if os.geteuid() != 0:
        os.chmod(directory, 0o500)
        try:
            yield False
        finally:
            os.chmod(directory, 0o700)
        return
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(directory)], capture_output=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"runs as root, which writes through permission bits, and cannot mount a read-only tmpfs ({exc})")
    if done.returncode != 0:
        pytest.skip(
            "runs as root, which writes through permission bits, and may not mount a read-only tmpfs here "
            f"({done.stderr.strip()})"
        )
    try:
        yield True
    finally:
        subprocess.run(["umount", str(directory)], check=True, timeout=30)
