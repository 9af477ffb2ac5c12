"""Helpers of the core's tests: the engine's partitions as flat buffers, and backends' state read back."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from lightning_smartinf.core.backend import Backend
from lightning_smartinf.core.host_buffer import InMemoryBuffer
from lightning_smartinf.core.streaming.backend import StreamingBackend
from lightning_smartinf.core.streaming.device import StreamingDevice
from lightning_smartinf.core.tiers.memory import MemoryDevice
from lightning_smartinf.core.tiers.tiered import TieredBackend

#: The arguments of :class:`TieredBackend` beside the backend it wraps.
TIER_ARGUMENTS = ("memory_bytes", "accelerator_bytes", "accelerator_device", "measure_memory_share")


class FlatPartitions:
    """One rank's parameters and gradients as flat buffers, sub-group by sub-group (the ``Partitions`` protocol)."""

    def __init__(self, sizes: list[int], dtype: torch.dtype, loss_scale: float) -> None:
        self.sizes = sizes
        self.flat_params = [torch.zeros(n, dtype=dtype) for n in sizes]
        self.grad_buffer = torch.zeros(sum(sizes), dtype=dtype)
        self.loss_scale = loss_scale

    def params(self, sub_group: int) -> Tensor:
        return self.flat_params[sub_group]

    def params_changed(self, sub_group: int) -> None: ...

    @property
    def param_dtype(self) -> torch.dtype:
        return self.grad_buffer.dtype

    staged_limit: int | None = None

    def param_bytes(self) -> tuple[int, int]:
        return (0, 0)

    def host_buffer(self, numel: int) -> InMemoryBuffer:
        return InMemoryBuffer(torch.zeros(numel, dtype=torch.float32))

    def prepare_for_update(self) -> None: ...

    def finish_update(self) -> None: ...

    def restore_loss_scale(self, scale: float) -> None:
        self.loss_scale = scale

    def gradient_fence(self) -> None:
        return None  # host tensors: nothing is in flight

    def layout(self) -> list[list[dict[str, Any]]]:
        return [[{"name": f"p{i}", "shape": [n], "partition_numel": n}] for i, n in enumerate(self.sizes)]

    rank = 0
    world_size = 1


def read_masters(backend: Backend, sizes: list[int]) -> list[torch.Tensor]:
    """Every shard's fp32 master weights, as ``backend`` holds them now."""
    out = [torch.empty(n) for n in sizes]
    for i, tensor in enumerate(out):
        backend.read_master(i, tensor)
    backend.wait()
    return out


class SlowMemoryDevice(MemoryDevice):
    """The memory tier on a host with too few cores to spare: each chunk's update takes 20 ms longer."""

    def run_compute(self, work) -> None:  # noqa: ANN001
        time.sleep(0.02)
        super().run_compute(work)


class SlowMemoryTiers(TieredBackend):
    """Tiers whose memory device is a :class:`SlowMemoryDevice`."""

    def make_memory_device(self, index: int, backend: StreamingBackend) -> StreamingDevice:
        return SlowMemoryDevice(
            index, backend.traffic, chunk_elems=backend.chunk_elems, buffer_count=2, capacity=self.memory_bytes
        )


def split_tier_arguments(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``kwargs`` as (the backend's arguments, the tiers' :data:`TIER_ARGUMENTS`)."""
    backend = {k: v for k, v in kwargs.items() if k not in TIER_ARGUMENTS}
    return backend, {k: v for k, v in kwargs.items() if k in TIER_ARGUMENTS}


def with_tiers(backend: Backend, tiers: type[TieredBackend] = TieredBackend, **arguments: Any) -> Backend:
    """``backend`` wrapped in tiers where ``arguments`` give one a budget (as set-up wraps it), else as it is."""
    if not (arguments.get("memory_bytes") or arguments.get("accelerator_bytes")):
        return backend
    return tiers(backend, **arguments)
