"""The memory tier: shard state kept in host RAM and updated by host cores with the same rule code as a device.

A :class:`MemoryDevice` is an emulated device whose state files are anonymous memory (``memfd``), mapped into the
process: the same chunk pipeline, rules, checkpoints and counters as a storage device, but each chunk record is
updated where it lies (:meth:`MemoryStateFile.view`): no disk transfer and no copy through a pool buffer. Each file
also has a path (``/proc/<pid>/fd/<n>``), so a checkpoint copies it like any state file, and a saved record is the
same wherever the shard lived.

Invariants:

- A memory file holds exactly its shard's record bytes; its pages count in the process's RSS once written.
- A memory shard has one slot, so updating a record in place is exact: it never takes a tentative update (the
  controller submits it after backward, when the step is known to stand), and the tier holds the state once.
- Memory is freed only by :meth:`MemoryStateFile.discard` (the backend's release, or a move to another device), so
  a state closed for I/O can still be saved.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_smartinf.core.io.direct import IOEngine, StateFile
from lightning_smartinf.core.streaming.backend import StreamingBackend
from lightning_smartinf.core.streaming.device import HostCoreDevice, StreamingDevice
from lightning_smartinf.core.traffic import Traffic

__all__ = ["MemoryDevice", "MemoryIO", "MemoryStateFile", "MemoryTiers", "TensorStateFile"]


class TensorStateFile(StateFile):
    """One shard's state in memory: a byte tensor of :attr:`size` bytes, read, written and updated in place with
    torch's copies (which release the GIL). Subclasses say where the tensor lives and what :attr:`path` names."""

    in_memory = True
    keeps_checksums = False
    direct = False
    size = 0
    _bytes: Tensor | None = None

    def view(self, offset: int, nbytes: int) -> Tensor:
        if self._bytes is None:
            raise OSError(f"the memory of {self.path} was freed")
        if offset < 0 or offset + nbytes > self.size:
            raise OSError(f"bytes {offset}..{offset + nbytes} lie outside {self.path} ({self.size} B)")
        return self._bytes[offset : offset + nbytes]

    def read_into(self, buf: Tensor, offset: int) -> None:
        flat = buf.view(torch.uint8)
        flat.copy_(self.view(offset, flat.numel()))

    def write_from(self, buf: Tensor, offset: int) -> None:
        flat = buf.view(torch.uint8)
        target = self.view(offset, flat.numel())
        if target.data_ptr() != flat.data_ptr():  # a record updated in place (:meth:`view`) is already there
            target.copy_(flat)

    def sync(self) -> None:
        """Nothing to flush: the state is in memory."""

    def close(self) -> None:
        """Keep the memory (see :meth:`discard`): a closed state can still be saved."""


class MemoryStateFile(TensorStateFile):
    """One shard's state in host memory: a ``memfd`` of ``size`` bytes mapped shared into the process.

    :attr:`path` names the same memory for code that opens files by path (checkpoint save and load); it is valid in
    this process only.
    """

    def __init__(self, name: str, size: int) -> None:  # noqa: D107 - the class says it
        self._fd = os.memfd_create(f"smartinf-{name}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, size)
            self._map: mmap.mmap | None = mmap.mmap(self._fd, size)  # size > 0: a record is at least 4 KiB
        except BaseException:
            os.close(self._fd)
            raise
        self.path = Path(f"/proc/{os.getpid()}/fd/{self._fd}")
        self.size = size
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)

    def discard(self) -> None:
        """Give the memory back; idempotent. Reads and writes fail afterwards."""
        self._bytes = None
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class MemoryIO(IOEngine):
    """Moves records between memory files and buffers with one copy each, on the calling thread."""

    name = "host memory"

    def read(self, file: StateFile, buf: Tensor, offset: int) -> None:
        file.read_into(buf, offset)

    def write(self, file: StateFile, buf: Tensor, offset: int) -> None:
        file.write_from(buf, offset)

    def close(self) -> None:
        """Nothing to release."""


class MemoryDevice(HostCoreDevice):
    """The memory tier as a device: state in host RAM, updated by a host core (the rule's own code).

    Args:
        index: its device index in the backend it joins.
        traffic: that backend's counters.
        chunk_elems, buffer_count: as the backend's devices.
        capacity: bytes of shard state it may hold (the tier's budget).
    """

    in_memory = True
    tier = "memory"
    read_counter = "memory_read_bytes"
    write_counter = "memory_write_bytes"

    def __init__(
        self, index: int, traffic: Traffic, *, chunk_elems: int, buffer_count: int, capacity: int | None = None
    ) -> None:
        # Copies within one memory: one transfer in flight per direction (the default) keeps a core (or the
        # accelerator) busy enough.
        super().__init__(index, None, traffic, MemoryIO(), chunk_elems=chunk_elems, buffer_count=buffer_count)
        self.capacity = capacity

    def create_file(self, name: str, size: int) -> StateFile:
        return MemoryStateFile(name, size)


class MemoryTiers(StreamingBackend):
    """A streaming backend of the tiers' devices only (host memory, accelerator memory), attached after it is built:
    the tiers' shards beside a backend whose state is elsewhere
    (:class:`~lightning_smartinf.core.tiers.tiered.TieredBackend`).

    Takes the arguments of :class:`~lightning_smartinf.core.streaming.backend.StreamingBackend` but its directories:
    there are none.
    """

    needs_storage = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__([], **kwargs)

    def make_device(self, index: int, directory: Path) -> StreamingDevice:
        raise TypeError("MemoryTiers has no storage devices; its state lives in its memory tiers only.")
