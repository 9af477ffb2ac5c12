"""The ``cpu`` backend: computational-storage devices emulated on host cores, one per storage path.

Each device is a :class:`~lightning_smartinf.csd.streaming.StreamingDevice` whose chunk buffers are aligned host
memory from its I/O engine and whose update runs :meth:`UpdateRule.apply` on a host core. The streaming pipeline
(read-ahead, write-behind, prefetch) is :mod:`lightning_smartinf.csd.streaming`'s. Host memory of the update path
is ``num_devices * buffer_count * chunk_bytes`` plus one fp32 gradient chunk per device, whatever the model size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from lightning_smartinf.csd.compression import SparseGrad
from lightning_smartinf.csd.io import IOEngine, ThreadedIO
from lightning_smartinf.csd.layout import pool_bytes
from lightning_smartinf.csd.pipeline import ChunkWork, Shard
from lightning_smartinf.csd.placement import Placement
from lightning_smartinf.csd.rules import StepParams
from lightning_smartinf.csd.streaming import StreamingBackend, StreamingDevice, check_device_timeout

__all__ = ["CpuBackend", "EmulatedDevice", "check_device_timeout", "link_bytes"]


def link_bytes(grad: Tensor | SparseGrad, link_dtype: torch.dtype) -> int:
    """Bytes ``grad`` takes on the link: its pairs for a top-k gradient, every element in ``link_dtype`` else."""
    return grad.link_bytes(link_dtype) if isinstance(grad, SparseGrad) else grad.numel() * link_dtype.itemsize


class EmulatedDevice(StreamingDevice):
    """One emulated computational-storage device: a directory, a host buffer pool and three kinds of threads."""

    _grad_chunk: Tensor | None = None

    def allocate(self, tensors_per_record: int) -> None:
        """Allocate the buffer pool for records of up to ``tensors_per_record`` fp32 tensors, and a gradient chunk."""
        record_bytes = self.chunk_elems * 4 * tensors_per_record
        for _ in range(self.buffer_count):
            self.pool.add(self.io.empty(record_bytes).view(torch.float32))
        self._grad_chunk = torch.empty(self.chunk_elems, dtype=torch.float32)
        self.allocated_bytes = pool_bytes(1, self.buffer_count, self.chunk_elems, tensors_per_record)
        self.allocated_bytes += self.chunk_elems * 4

    def grad_chunk(self, n: int) -> Tensor:
        """The fp32 gradient of the chunk being updated (scratch, one per device)."""
        assert self._grad_chunk is not None
        return self._grad_chunk[:n]

    def update_work(
        self, shard: Shard, grad: Tensor | SparseGrad, hp: StepParams, out: Tensor, link_dtype: torch.dtype
    ) -> ChunkWork:
        """Load the chunk's gradient as it crosses the link (scattering a top-k one), apply the rule, copy out."""
        rule = shard.spec.rule

        def update(record: Tensor, m: Tensor, states: list[Tensor], start: int, n: int) -> None:
            g = self.grad_chunk(n)
            self.load_gradient(g, grad, start, link_dtype)
            if hp.grad_scale != 1.0:
                g.mul_(hp.grad_scale)
            rule.apply(m, g, states, hp)
            self.link.put(out[start : start + n], m)

        return ChunkWork(
            compute=update, link_write=link_bytes(grad, link_dtype), link_read=out.numel() * out.element_size()
        )

    def load_gradient(self, g: Tensor, grad: Tensor | SparseGrad, start: int, link_dtype: torch.dtype) -> None:
        """Fill ``g`` (fp32, on the host) with elements ``[start, start + len(g))`` of ``grad`` as they cross the link:
        rounded to ``link_dtype``, and scattered (decompressed) for a top-k gradient."""
        n = g.numel()
        if isinstance(grad, SparseGrad):
            grad.scatter_chunk(g, start, via=link_dtype)  # decompression, inside the transfer pipeline
            return
        chunk = self.link.to_host(grad[start : start + n])
        if link_dtype != grad.dtype:
            g.copy_(self.link_chunk(n, link_dtype).copy_(chunk))
        else:
            g.copy_(chunk)

    def close(self, timeout: float | None = None) -> bool:
        settled = super().close(timeout)
        self._grad_chunk = None
        return settled


class CpuBackend(StreamingBackend):
    """Emulated computational-storage devices, one per directory in ``device_dirs``.

    Args:
        device_dirs: one private directory per device; state files are created inside.
        chunk_elems: elements per streamed chunk (a multiple of 1024).
        buffer_count: chunk buffers per device (at least 2: one updating, one reading or writing). Below
            ``2 * io_threads + 2`` a write in flight holds a buffer a read is waiting for: on the reference VM disk
            4 gave ~2.5x the optimizer step of 12 and more (``benchmarks/bench_step.py``, ``docs/benchmarks.md``).
        owned_dirs: directories the backend created and removes on :meth:`close`.
        io_factory: builds one I/O engine per device (default: :class:`ThreadedIO` with 1 MiB blocks, depth 8).
        io_threads: chunk transfers each device keeps in flight per direction (reads also at most
            ``buffer_count - 1``). Disks reward concurrency: on the reference VM disk 3 gave ~1.6x the state
            bandwidth of 1 (``benchmarks/bench_streaming.py``).
        tentative_slots: keep a second state file per shard so that :meth:`submit` can take ``tentative=True``
            updates, undone by :meth:`rollback` or made current by :meth:`commit`. Doubles the disk space of the
            state (not its traffic).
        prefetch_state: act on :meth:`prefetch` advice (``False`` ignores it: for comparisons).
        device_timeout_s: seconds a device may show no progress (no chunk read, written or updated) while the host
            waits for it, before :meth:`result`, :meth:`wait` and the others raise
            :class:`~lightning_smartinf.csd.storage.StorageError` and the backend stops (see :attr:`failure`).
            ``None`` waits forever.
        placement: which device holds each shard (``None``: see :class:`StreamingBackend`).
        memory_bytes: bytes of shard state kept in host memory, updated by a host core (the memory tier).
        device_weights: relative speed of each device directory (``None``: equal, or measured across filesystems).
        accelerator_bytes: bytes of shard state kept in ``accelerator_device``'s memory and updated there (the
            accelerator tier, :mod:`lightning_smartinf.csd.accelerator_memory`).
        accelerator_device: the torch device of the accelerator tier (``"cuda"``: the current GPU).
        measure_memory_share: choose the memory tier's share of ``memory_bytes`` from measured rates (see
            :meth:`~lightning_smartinf.csd.streaming.StreamingBackend.replan`); ``None`` or ``False``: fill it.

    Device errors are final: the first one reported to the host (an I/O error, or a device that stopped answering)
    latches the backend as failed; see :attr:`failure`.
    """

    def __init__(
        self,
        device_dirs: Sequence[Path],
        *,
        chunk_elems: int = 1 << 20,
        buffer_count: int = 16,
        owned_dirs: Sequence[Path] = (),
        io_factory: Callable[[], IOEngine] = ThreadedIO,
        io_threads: int = 3,
        tentative_slots: bool = False,
        prefetch_state: bool = True,
        device_timeout_s: float | None = 300.0,
        placement: Placement | None = None,
        memory_bytes: int = 0,
        device_weights: Sequence[float] | None = None,
        accelerator_bytes: int = 0,
        accelerator_device: torch.device | str = "cuda",
        measure_memory_share: bool | None = None,
    ) -> None:
        if io_threads < 1:
            raise ValueError(f"`io_threads={io_threads}` must be at least 1 (chunk transfers in flight per device).")
        #: Chunk transfers each device keeps in flight per direction.
        self.io_threads = io_threads
        self._io_factory = io_factory
        super().__init__(
            device_dirs,
            chunk_elems=chunk_elems,
            buffer_count=buffer_count,
            owned_dirs=owned_dirs,
            tentative_slots=tentative_slots,
            prefetch_state=prefetch_state,
            device_timeout_s=device_timeout_s,
            placement=placement,
            memory_bytes=memory_bytes,
            device_weights=device_weights,
            accelerator_bytes=accelerator_bytes,
            accelerator_device=accelerator_device,
            measure_memory_share=measure_memory_share,
        )

    def make_device(self, index: int, directory: Path) -> EmulatedDevice:
        """An emulated device over ``directory`` with its own I/O engine from ``io_factory``."""
        return EmulatedDevice(
            index,
            directory,
            self.traffic,
            self._io_factory(),
            chunk_elems=self.chunk_elems,
            buffer_count=self.buffer_count,
            io_threads=self.io_threads,
        )
