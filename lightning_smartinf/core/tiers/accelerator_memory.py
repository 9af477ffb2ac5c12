"""The accelerator tier: shard state kept in accelerator (GPU) memory and updated there by the rule's own torch code.

An :class:`AcceleratorDevice` is the memory tier's design on another torch device. Its state files are byte tensors
in accelerator memory (:class:`AcceleratorStateFile`), each chunk record is updated where it lies (``view``), and the
gradient chunk crosses to the accelerator once. ZeRO leaves the accelerator idle while the optimizer steps, so the
tier uses what the user budgets of its memory then (``state_accelerator_budget``).

The torch device is a parameter: ``"cuda"`` in training, and any torch device in tests, which run every line of this
module on the host where no GPU is lent.

Invariants:

- A file holds exactly its shard's record bytes on the device, zeroed when made.
- As in the memory tier, a shard has one slot and is never updated tentatively (the controller submits it after
  backward), so updating a record in place is exact.
- Every chunk's work runs on the device threads' own side stream (never the default stream, where it would queue
  behind training's kernels) and has completed when the chunk is done: a write-back, a read or a checkpoint never
  sees a record mid-update, and the training thread never waits for it.
- A checkpoint reads and writes a file through a host copy (:meth:`AcceleratorStateFile.stage`) made for the save or
  load and freed after it: host memory must hold the tier's state while a checkpoint is written or read.
- Every write into a file (a write-back, the initial state, a load's copy back) is fenced on the stream that queued
  it; staging a host copy and freeing the memory first wait for those fences, so a checkpoint right after set-up
  copies the records written, and no write lands in freed memory.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from lightning_smartinf.core.accelerator import StreamFences, record_fence
from lightning_smartinf.core.compression import SparseGrad
from lightning_smartinf.core.io.direct import StateFile
from lightning_smartinf.core.tiers.host_memory import MemoryDevice, MemoryStateFile, TensorStateFile
from lightning_smartinf.core.traffic import Traffic

__all__ = ["AcceleratorDevice", "AcceleratorStateFile"]


class AcceleratorStateFile(TensorStateFile):
    """One shard's state in accelerator memory: ``size`` bytes on ``device``.

    :attr:`path` names a host copy while one is staged (:meth:`stage`), for code that opens files by path
    (checkpoint save and load); otherwise it only labels the state in messages.
    """

    needs_host_copy = True

    def __init__(self, name: str, size: int, device: torch.device) -> None:  # noqa: D107 - the class says it
        self.name, self.size, self.device = name, size, device
        self._bytes = torch.zeros(size, dtype=torch.uint8, device=device)
        self._host: MemoryStateFile | None = None
        self._writes = StreamFences()

    @property
    def path(self) -> Path:  # type: ignore[override]
        if self._host is not None:
            return self._host.path
        return Path(f"<{self.device} memory>") / self.name

    def write_from(self, buf: Tensor, offset: int) -> None:
        super().write_from(buf, offset)
        self._writes.note(self.device)  # queued on the writing thread's stream: fenced for the readers of the file

    def stage(self, *, copy: bool) -> None:
        """Give :attr:`path` a host copy of the state (``copy=False``: of its size only, for a load to fill)."""
        self._writes.settle()
        if self._host is None:
            self._host = MemoryStateFile(self.name, self.size)
        if copy:
            self._host.view(0, self.size).copy_(self.view(0, self.size))

    def unstage(self, *, copy_back: bool = False) -> None:
        """Free the host copy; ``copy_back``: make its bytes the state first (after a load). Idempotent."""
        host, self._host = self._host, None
        if host is None:
            return
        try:
            if copy_back:
                self.view(0, self.size).copy_(host.view(0, self.size))
                self._writes.note(self.device)
                self._writes.settle()  # landed before the host copy goes and the device threads read the state
        finally:
            host.discard()

    def discard(self) -> None:
        """Give the memory back; idempotent. Reads and writes fail afterwards."""
        self._writes.settle()
        self._bytes = None
        self.unstage()


class AcceleratorDevice(MemoryDevice):
    """The accelerator tier as a device: the memory tier's device with its state in ``device`` memory, updated there.

    Its chunk buffers and gradient chunk are in accelerator memory too; host memory holds one fp32 gradient chunk,
    where a gradient is rounded and decompressed as it crosses the link.
    """

    tier = "accelerator"
    read_counter = "accelerator_read_bytes"
    write_counter = "accelerator_write_bytes"

    def __init__(
        self,
        index: int,
        traffic: Traffic,
        *,
        chunk_elems: int,
        buffer_count: int,
        device: torch.device | str,
        capacity: int | None = None,
    ) -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # this rank's GPU, fixed now: worker threads have their own
            device = torch.device("cuda", torch.cuda.current_device())
        self.torch_device = device
        super().__init__(index, traffic, chunk_elems=chunk_elems, buffer_count=buffer_count, capacity=capacity)
        self._host_grad: Tensor | None = None

    @property
    def label(self) -> str:
        return f"accelerator memory ({self.torch_device})"

    def create_file(self, name: str, size: int) -> StateFile:
        return AcceleratorStateFile(name, size, self.torch_device)

    def allocate(self, tensors_per_record: int) -> None:
        """Chunk buffers and a gradient chunk on the accelerator; one fp32 gradient chunk on the host."""
        record_elems = self.chunk_elems * tensors_per_record
        for _ in range(self.buffer_count):
            self.pool.add(torch.empty(record_elems, dtype=torch.float32, device=self.torch_device))
        self._grad_chunk = torch.empty(self.chunk_elems, dtype=torch.float32, device=self.torch_device)
        self._host_grad = torch.empty(self.chunk_elems, dtype=torch.float32)
        self.allocated_bytes = self.chunk_elems * 4  # host bytes only: the pool lives in the accelerator's memory

    def load_gradient(self, g: Tensor, grad: Tensor | SparseGrad, start: int, link_dtype: torch.dtype) -> None:
        """Fill ``g`` (fp32, on the accelerator) with ``grad``'s chunk as it crossed the link, via the host chunk."""
        n = g.numel()
        if isinstance(grad, Tensor) and grad.device == self.torch_device:
            g.copy_(grad[start : start + n].to(link_dtype))  # already in this memory: crosses no link, only rounds
            return
        assert self._host_grad is not None
        host = self._host_grad[:n]
        super().load_gradient(host, grad, start, link_dtype)
        g.copy_(host)

    def run_compute(self, work: Callable[[], None]) -> None:
        work()
        # Done before the chunk is: its write-back, a later read and the parameters copied out see it whole. The
        # worker sleeps on the event rather than spinning a core the host's devices update with.
        if (done := record_fence(self.torch_device)) is not None:
            done.synchronize()

    def close(self, timeout: float | None = None) -> bool:
        settled = super().close(timeout)
        self._host_grad = None
        return settled
