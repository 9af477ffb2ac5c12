"""The float64 norm of a gradient partition, taken in one pass instead of through a float64 copy of the whole of it.

ZeRO-3 takes each reduced gradient partition's norm in float64 (``_constant_buffered_norm2``) by converting the
partition to float64 first, up to 250M elements at once: 8 bytes per element written and read again, in a fresh
allocation each time. On a host (DeepSpeed's CPU accelerator) that allocation is a new mapping whose pages fault in
one by one, and the conversion and the norm are two more passes over memory, each a parallel region that waits for
every core while the devices' threads share them; profiled at 0.4B parameters on two cores it was about 40% of
backward. :class:`PartitionNorm` reads a host tensor once, on the calling thread (``sum_squares.c``).

Invariants:

- The quantity is ZeRO's: float64 squares (exact for fp32, bf16 and fp16 values) summed in float64. Only the order of
  the additions differs: :data:`LANES` running sums, element ``i`` in lane ``i % LANES``, combined pairwise at the
  end. A running sum of ``n / LANES`` terms is within ``(n / LANES) * 2**-53`` of the exact one (relative; its worst
  case, equal squares: 2e-14 at 262K elements); on gradient-like values 1e-15 was measured, ZeRO's own 5e-14, and
  ZeRO rounds the total to float32 (6e-8) before clipping with it. An infinite or NaN element gives an infinite or
  NaN norm, as ZeRO's does, which is what its overflow check reads.
- On the host the C kernel and :func:`lane_sums` (the plain-torch reference, which runs where the kernels cannot be
  built and for other dtypes) give the same bytes.
- On an accelerator the partition is read in pieces of :data:`ACCELERATOR_PIECE` elements, each converted into a
  tensor of the caching allocator (which orders its reuse by stream) and summed by a dot product: the same quantity
  in another order, without a host synchronisation, with a float64 temporary of 32 MiB instead of up to 2 GB.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from lightning_smartinf.core.native import sum_squares_kernels

__all__ = ["ACCELERATOR_PIECE", "LANES", "HOST_PIECE", "PartitionNorm", "lane_sums"]

#: Running sums of squares per tensor (``LANES`` in ``sum_squares.c``).
LANES = 8
#: Elements the reference converts at once on the host: a 2 MiB float64 piece, inside a core's L2 cache.
HOST_PIECE = 1 << 18
#: Elements converted at once on an accelerator: a 32 MiB float64 temporary.
ACCELERATOR_PIECE = 1 << 22
#: The C kernel of each dtype it reads.
_KERNELS = {torch.float32: "smartinf_sum_squares_f32", torch.bfloat16: "smartinf_sum_squares_bf16"}


def lane_sums(values: Tensor, lanes: Tensor) -> Tensor:
    """The reference of ``sum_squares.c``: ``lanes`` (``LANES`` float64 sums so far) after adding the squares of
    ``values`` (flattened), element ``i``'s to lane ``i % LANES``, each lane in the elements' order."""
    squares = values.detach().reshape(-1).to(torch.float64).square()
    rows = torch.nn.functional.pad(squares, (0, -squares.numel() % LANES)).view(-1, LANES)  # + 0.0 changes no sum
    # A cumulative sum down each column adds its rows one after another, from the sums so far.
    return torch.cat([lanes.view(1, LANES), rows]).cumsum(0)[-1]


def combined(lanes: list[float]) -> float:
    """The lanes' total, pairwise in a fixed order."""
    while len(lanes) > 1:
        lanes = [lanes[k] + lanes[k + 1] for k in range(0, len(lanes), 2)]
    return lanes[0]


class PartitionNorm:
    """Callable: the L2 norm of a tensor of any floating dtype, as a 0-dim float64 tensor on the tensor's device.

    ``native=False`` takes the plain-torch reference on the host even where the C kernels are built (tests).
    """

    def __init__(self, *, native: bool = True) -> None:
        self._native = native  # the kernels are looked for at the first host tensor: a GPU run never needs them

    def __call__(self, values: Tensor) -> Tensor:
        flat = values.detach().reshape(-1)
        if flat.device.type != "cpu":
            total = torch.zeros((), dtype=torch.float64, device=flat.device)
            for piece in flat.split(ACCELERATOR_PIECE):
                wide = piece.to(torch.float64)
                total += torch.dot(wide, wide)
            return total.sqrt()
        lanes = torch.zeros(LANES, dtype=torch.float64)
        kernel = self._kernel(flat.dtype)
        if kernel is not None:
            flat = flat.contiguous()
            kernel(flat.data_ptr(), flat.numel(), lanes.data_ptr())
        else:
            for piece in flat.split(HOST_PIECE):
                lanes = lane_sums(piece, lanes)
        return torch.tensor(math.sqrt(combined(lanes.tolist())), dtype=torch.float64)

    def _kernel(self, dtype: torch.dtype) -> Callable[[int, int, int], None] | None:
        kernels = sum_squares_kernels() if self._native else None
        name = _KERNELS.get(dtype)
        return None if kernels is None or name is None else getattr(kernels, name)
