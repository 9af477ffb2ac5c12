"""The float64 norm of a gradient partition, taken in pieces instead of through a float64 copy of the whole of it.

ZeRO-3 takes each reduced gradient partition's norm in float64 (``_constant_buffered_norm2``) by converting the
partition to float64 first, up to 250M elements at once: 8 bytes per element written and read again, in a fresh
allocation each time. On a host (DeepSpeed's CPU accelerator) that allocation is a new mapping whose pages fault in
one by one, and the conversion and the norm are two more passes over memory; profiled at 0.4B parameters on two
cores, it was about 40% of backward. :class:`PartitionNorm` converts a piece at a time into one reused float64 buffer
that stays in the cache and takes each piece's sum of squares with a dot product.

Invariants:

- The same quantity as ZeRO's: float64 squares (exact for fp32, bf16 and fp16 values) summed in float64, so it
  differs from ZeRO's only in the order of the additions (a relative difference near 1e-16; ZeRO rounds the total to
  float32 before clipping with it). An infinite or NaN element gives an infinite or NaN norm, as ZeRO's does, which
  is what its overflow check reads.
- On an accelerator nothing is cached across calls: each piece is converted into a tensor of the caching allocator,
  which orders its reuse by stream; pieces are larger there, so a partition takes few kernel launches while the
  float64 temporary stays bounded (32 MiB instead of up to 2 GB).
- Host calls come from one thread (ZeRO's gradient hooks); the host buffer is not shared between instances.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ACCELERATOR_PIECE", "HOST_PIECE", "PartitionNorm"]

#: Elements converted at once on the host: a 2 MiB float64 buffer, inside a core's L2 cache on current server CPUs.
HOST_PIECE = 1 << 18
#: Elements converted at once on an accelerator: a 32 MiB float64 temporary.
ACCELERATOR_PIECE = 1 << 22


class PartitionNorm:
    """Callable: the L2 norm of a tensor of any floating dtype, as a 0-dim float64 tensor on the tensor's device."""

    def __init__(self) -> None:
        self._host_buffer: Tensor | None = None

    def __call__(self, values: Tensor) -> Tensor:
        flat = values.detach().reshape(-1)
        if flat.device.type != "cpu":
            total = torch.zeros((), dtype=torch.float64, device=flat.device)
            for piece in flat.split(ACCELERATOR_PIECE):
                wide = piece.to(torch.float64)
                total += torch.dot(wide, wide)
            return total.sqrt()
        if self._host_buffer is None:
            self._host_buffer = torch.empty(HOST_PIECE, dtype=torch.float64)
        total = torch.zeros((), dtype=torch.float64)
        for piece in flat.split(HOST_PIECE):
            wide = self._host_buffer[: piece.numel()]
            wide.copy_(piece)
            total += torch.dot(wide, wide)
        return total.sqrt()
