"""Checks and preparation of storage paths: existence, permissions, free space."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

GIB = 1024**3


class StorageError(RuntimeError):
    """A storage path cannot hold or serve the device state."""


def validate_storage_path(path: str | os.PathLike, argument: str = "storage_paths") -> Path:
    """Return ``path`` resolved, or raise a :class:`ValueError` saying what is wrong and how to fix it."""
    resolved = Path(path).expanduser().resolve()
    if not resolved.exists():
        raise ValueError(f"`{argument}` entry {str(path)!r} does not exist. Create the directory or fix the path.")
    if not resolved.is_dir():
        raise ValueError(
            f"`{argument}` entry {str(path)!r} is not a directory. Pass the mount point or a folder on it."
        )
    if not os.access(resolved, os.W_OK | os.X_OK):
        raise ValueError(
            f"`{argument}` entry {str(path)!r} is not writable by this user. "
            "Choose a directory you own or fix its permissions."
        )
    return resolved


def ensure_private_dir(path: Path) -> None:
    """Create ``path`` (and parents) if needed; the leaf is private to the user (0700)."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)


def check_free_space(directory: Path, needed: int, reusable: Sequence[Path] = ()) -> None:
    """Raise :class:`StorageError` unless ``directory``'s filesystem can take ``needed`` more bytes.

    ``reusable`` files will be overwritten, so the blocks they already occupy count as free.
    """
    reclaimable = sum(p.stat().st_blocks * 512 for p in reusable if p.is_file())
    free = shutil.disk_usage(directory).free + reclaimable
    if free < needed:
        raise StorageError(
            f"Storage path {str(directory)!r} has {free / GIB:.2f} GiB free but the optimizer state placed there "
            f"needs {needed / GIB:.2f} GiB. Free space, add `storage_paths` to spread the state, "
            "or choose a larger disk."
        )
