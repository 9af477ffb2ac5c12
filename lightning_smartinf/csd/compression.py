"""SmartComp: top-k gradient compression on the host side, decompression on the device side.

A compressed gradient is a :class:`SparseGrad`: ``k`` strictly ascending int32 element indices into a
shard of ``numel`` elements and the ``k`` values kept there, in the training precision. It is the wire
format of the link (``k * (4 + value bytes)`` bytes) and the input format of the HLS ``*_topk_*``
kernels (uint32 indices, ascending). Decompression is a scatter into a zeroed chunk, done by the
device inside its transfer pipeline (:meth:`SparseGrad.scatter_chunk`).

Selection keeps the ``k = ceil(ratio * numel)`` entries of largest magnitude with ``torch.topk`` (no
full sort; only the ``k`` chosen indices are sorted). With error feedback the dropped part of the
gradient is kept in a residual of the shard's size and added to the next step's gradient before
selection, so nothing is lost, only delayed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

#: Index dtype on the link and in the kernels (the kernels read the same bits as uint32).
INDEX_DTYPE = torch.int32


@dataclass(frozen=True)
class SparseGrad:
    """A top-k compressed gradient of one shard.

    Attributes:
        indices: int32, strictly ascending, each in ``[0, numel)``.
        values: the kept gradient values (same length as ``indices``), in the link's precision.
        numel: elements of the dense gradient (the shard).
    """

    indices: Tensor
    values: Tensor
    numel: int

    def __post_init__(self) -> None:
        if self.indices.dtype != INDEX_DTYPE or self.indices.dim() != 1:
            raise ValueError(f"`SparseGrad.indices` must be a 1-D int32 tensor, got {self.indices.dtype} "
                             f"of shape {tuple(self.indices.shape)}.")
        if self.values.shape != self.indices.shape or not self.values.is_floating_point():
            raise ValueError(
                f"`SparseGrad.values` must be a floating tensor shaped like `indices` {tuple(self.indices.shape)}, "
                f"got {self.values.dtype} of shape {tuple(self.values.shape)}."
            )

    @property
    def k(self) -> int:
        return self.indices.numel()

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    def link_bytes(self, value_dtype: torch.dtype | None = None) -> int:
        """Bytes this gradient takes on the link (indices plus values in ``value_dtype``, default their own)."""
        return self.k * (self.indices.element_size() + (value_dtype or self.values.dtype).itemsize)

    def chunk_bounds(self, start: int, n: int) -> tuple[int, int]:
        """Positions ``[lo, hi)`` of the pairs whose index lies in ``[start, start + n)``."""
        bounds = torch.searchsorted(self.indices, torch.tensor([start, start + n], dtype=INDEX_DTYPE))
        return int(bounds[0]), int(bounds[1])

    def scatter_chunk(self, out: Tensor, start: int) -> Tensor:
        """Decompress the elements ``[start, start + len(out))`` into ``out`` (zeroed, then scattered)."""
        lo, hi = self.chunk_bounds(start, out.numel())
        out.zero_()
        if hi > lo:
            out.index_copy_(0, (self.indices[lo:hi] - start).long(), self.values[lo:hi].to(out.dtype))
        return out

    def to_dense(self, dtype: torch.dtype | None = None) -> Tensor:
        dense = torch.zeros(self.numel, dtype=dtype or self.values.dtype, device=self.values.device)
        dense.index_copy_(0, self.indices.long(), self.values.to(dense.dtype))
        return dense


def kept_count(numel: int, ratio: float) -> int:
    """Number of entries a shard of ``numel`` elements keeps at ``ratio`` (at least one when ``numel > 0``)."""
    if numel == 0:
        return 0
    return min(numel, max(1, math.ceil(ratio * numel)))
