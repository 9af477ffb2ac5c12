"""A directory this process cannot write to, also when the tests run as root (as CI does)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from helpers.machine import tmpfs


@contextlib.contextmanager
def unwritable_dir(directory: Path) -> Iterator[bool]:
    """Create ``directory`` so that this process cannot write into it; yields whether it is a read-only filesystem.

    Others get mode 0500. Root writes through permission bits, so it gets a read-only tmpfs mounted there instead.
    """
    directory.mkdir()
    if os.geteuid() != 0:
        os.chmod(directory, 0o500)
        try:
            yield False
        finally:
            os.chmod(directory, 0o700)
        return
    with tmpfs(directory, "64k", readonly=True):
        yield True
