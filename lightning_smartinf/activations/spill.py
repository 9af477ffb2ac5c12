"""The files activations are written to: one per storage path, records at aligned offsets, reused every step.

One file per path instead of one per tensor: creating, reserving and unlinking a file per tensor cost the kernel
about as much CPU as moving its bytes (measured in ``docs/benchmarks.md``), and on a machine whose cores also run the
model that time comes out of the step.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

from lightning_smartinf.core.io.direct import IO_ALIGN, StateFile, round_up

__all__ = ["SpillFiles", "SPILL_FILE_NAME"]

SPILL_FILE_NAME = "activations.bin"
#: A file grows by at least this much at a time (it grows only while the first micro-batches find its size).
GROW_BYTES = 16 << 20


class SpillFiles:
    """One :class:`~lightning_smartinf.core.io.direct.StateFile` per directory; space is taken by raising its top.

    Invariants:

    * Records go to the files round-robin, each at an ``IO_ALIGN``-aligned offset; two live records never overlap.
    * Space is given back all at once, by :meth:`rewind`, which the owner calls only when no record holds bytes in
      the files. A micro-batch's records are all read or dropped by its end, so each micro-batch starts at offset 0
      and the files stay as large as the largest micro-batch needed.
    * A file grows only through :meth:`reserve`, which reserves the blocks (``posix_fallocate``): a full disk fails
      there, before any byte of the record is written.

    Thread-safe: writer threads reserve concurrently; :meth:`allocate` and :meth:`rewind` are called under the
    owner's lock.
    """

    def __init__(self, directories: Sequence[Path]) -> None:
        self._paths = [Path(d) / SPILL_FILE_NAME for d in directories]
        self._files: list[StateFile | None] = [None] * len(self._paths)
        self._sizes = [0] * len(self._paths)
        self._tops = [0] * len(self._paths)
        self._next = 0
        self._lock = threading.Lock()

    def allocate(self, nbytes: int) -> tuple[int, int]:
        """Take ``nbytes`` (rounded up to ``IO_ALIGN``) in the next file: returns ``(file index, offset)``."""
        index = self._next % len(self._paths)
        self._next += 1
        offset = self._tops[index]
        self._tops[index] = offset + round_up(nbytes, IO_ALIGN)
        return index, offset

    def reserve(self, index: int, end: int) -> StateFile:
        """File ``index``, at least ``end`` bytes long with its blocks reserved; created on first use."""
        with self._lock:
            file = self._files[index]
            if file is None:
                file = self._files[index] = StateFile(self._paths[index], 0, create=True)
            if end > self._sizes[index]:
                size = max(end, round_up(end, GROW_BYTES))
                file.reserve(size)
                self._sizes[index] = size
            return file

    def file(self, index: int) -> StateFile:
        """File ``index``, which holds at least one record (it was reserved)."""
        file = self._files[index]
        assert file is not None
        return file

    def rewind(self) -> None:
        """Give back all space: every later record starts again at offset 0 (no record may hold bytes now)."""
        self._tops = [0] * len(self._paths)
        self._next = 0

    def discard(self) -> None:
        """Close and delete every file (their bytes are gone); the next record creates them again."""
        with self._lock:
            for i, file in enumerate(self._files):
                if file is not None:
                    file.discard()
                self._files[i] = None
                self._sizes[i] = 0
        self.rewind()
