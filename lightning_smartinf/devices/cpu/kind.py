"""The ``cpu`` kind: computational-storage devices emulated on host cores, one per storage path."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_smartinf.core.placement import rank_share
from lightning_smartinf.core.registry import BuildContext, DeviceKind, register
from lightning_smartinf.core.state_formats import FORMATS

if TYPE_CHECKING:
    from lightning_smartinf.core.backend import Backend
    from lightning_smartinf.core.settings import SmartUpdateSettings


class CpuKind(DeviceKind):
    """Emulated devices: their update runs on host cores, their pools are host memory, their I/O is this host's."""

    name = "cpu"
    takes_hand_offs = True
    uses_io_engine = True
    host_pools = True
    state_formats = FORMATS
    splits_masters = True

    def build(self, settings: SmartUpdateSettings, context: BuildContext) -> Backend:
        from lightning_smartinf.core.io.direct import ThreadedIO
        from lightning_smartinf.devices.cpu.backend import CpuBackend

        weights = rank_share(settings.device_weights or (), context.local_rank, context.ranks_per_node) or None
        return CpuBackend(
            context.device_dirs,
            chunk_elems=settings.chunk_size,
            buffer_count=settings.buffer_count,
            owned_dirs=context.owned_dirs,
            io_factory=context.io_factory or ThreadedIO,
            io_threads=settings.io_threads,
            tentative_slots=settings.overlap,
            prefetch_state=settings.prefetch_state,
            device_timeout_s=settings.device_timeout_s,
            device_weights=weights,
        )


register(CpuKind())
