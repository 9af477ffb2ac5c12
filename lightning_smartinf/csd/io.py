"""Aligned host buffers and positional file I/O, direct (``O_DIRECT``) where the filesystem allows it.

``os.preadv``/``os.pwritev`` release the GIL, so one thread per in-flight request is enough to keep
reads and writes going while another thread computes.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import torch
from torch import Tensor

#: Alignment of buffer addresses, file offsets and transfer sizes; satisfies ``O_DIRECT`` on 4 KiB-sector disks.
IO_ALIGN = 4096


def aligned_empty(nbytes: int, dtype: torch.dtype = torch.uint8) -> Tensor:
    """An uninitialised CPU tensor of ``nbytes`` bytes whose data pointer is ``IO_ALIGN``-aligned."""
    raw = torch.empty(nbytes + IO_ALIGN, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % IO_ALIGN
    return raw[shift : shift + nbytes].view(dtype)


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


class StateFile:
    """One file of device state, opened for direct positional I/O when the filesystem supports it."""

    def __init__(self, path: Path, size: int, *, create: bool) -> None:
        self.path = path
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        self.direct = hasattr(os, "O_DIRECT")
        try:
            self._fd = os.open(path, flags | (os.O_DIRECT if self.direct else 0), 0o600)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            # tmpfs and some network filesystems refuse O_DIRECT: fall back to buffered I/O.
            self.direct = False
            self._fd = os.open(path, flags, 0o600)
        if create:
            os.ftruncate(self._fd, size)

    def read_into(self, buf: Tensor, offset: int) -> None:
        """Fill ``buf`` (contiguous, aligned) from ``offset``."""
        view = memoryview(buf.view(torch.uint8).numpy())
        done = 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n == 0:
                raise OSError(errno.EIO, f"unexpected end of state file {self.path} at byte {offset + done}")
            done += n

    def write_from(self, buf: Tensor, offset: int) -> None:
        """Write all of ``buf`` (contiguous, aligned) at ``offset``."""
        view = memoryview(buf.view(torch.uint8).numpy())
        done = 0
        while done < len(view):
            done += os.pwritev(self._fd, [view[done:]], offset + done)

    def sync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
