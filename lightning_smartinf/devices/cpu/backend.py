"""The ``cpu`` backend: computational-storage devices emulated on host cores, one per storage path."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from lightning_smartinf.core.arguments import Problems
from lightning_smartinf.core.io.direct import IOEngine, ThreadedIO
from lightning_smartinf.core.placement import Placement
from lightning_smartinf.core.streaming.backend import StreamingBackend
from lightning_smartinf.core.streaming.device import HostCoreDevice

__all__ = ["CpuBackend"]


class CpuBackend(StreamingBackend):
    """Emulated computational-storage devices, one per directory in ``device_dirs``.

    Args:
        buffer_count: chunk buffers per device (at least 2: one updating, one reading or writing). Below
            ``2 * io_threads + 2`` a write in flight holds a buffer a read is waiting for: on the reference VM disk
            4 gave ~2.5x the optimizer step of 12 and more (``benchmarks/bench_step.py``, ``docs/benchmarks.md``).
        io_factory: builds one I/O engine per device (default: :class:`ThreadedIO` with 1 MiB blocks, depth 8).
        io_threads: chunk transfers each device keeps in flight per direction (reads also at most
            ``buffer_count - 1``). Disks reward concurrency: on the reference VM disk 3 gave ~1.6x the state
            bandwidth of 1 (``benchmarks/bench_streaming.py``).
        device_dirs, chunk_elems, owned_dirs, tentative_slots, prefetch_state, device_timeout_s, placement,
            device_weights: as :class:`StreamingBackend`.

    Host-memory and accelerator tiers wrap it: :class:`~lightning_smartinf.core.tiers.tiered.TieredBackend`.

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
        device_weights: Sequence[float] | None = None,
    ) -> None:
        problems = Problems(type(self).__name__)
        problems.integer("io_threads", io_threads, low=1, why="chunk transfers in flight per device", example=3)
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
            device_weights=device_weights,
            problems=problems,
        )

    def make_device(self, index: int, directory: Path) -> HostCoreDevice:
        """An emulated device over ``directory`` with its own I/O engine from ``io_factory``."""
        return HostCoreDevice(
            index,
            directory,
            self.traffic,
            self._io_factory(),
            chunk_elems=self.chunk_elems,
            buffer_count=self.buffer_count,
            io_threads=self.io_threads,
        )
