"""On-disk layout of one shard's state: a file of chunk records.

Chunk ``k`` of a shard covers elements ``[k*C, min(n, (k+1)*C))`` and is stored as one contiguous
record ``[master | state_1 | ... | state_S]`` (fp32 each), so one read brings everything the update of
that chunk needs. Every record starts at ``k * C * 4 * (1+S)``; only the last one may be shorter, and
each state inside a record is padded to ``ELEM_ALIGN`` elements so records stay ``O_DIRECT``-aligned.
Padding elements are zero and never updated.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_smartinf.core.io.direct import IO_ALIGN, round_up

#: fp32 elements per alignment unit.
ELEM_ALIGN = IO_ALIGN // 4


@dataclass(frozen=True)
class ChunkLayout:
    """Where chunk records of one shard live in its state file."""

    numel: int
    chunk_elems: int
    num_states: int

    def __post_init__(self) -> None:
        if self.chunk_elems <= 0 or self.chunk_elems % ELEM_ALIGN:
            raise ValueError(f"chunk_elems={self.chunk_elems} must be a positive multiple of {ELEM_ALIGN}.")

    @property
    def tensors_per_record(self) -> int:
        return 1 + self.num_states

    @property
    def num_chunks(self) -> int:
        return max(1, -(-self.numel // self.chunk_elems))

    def chunk_range(self, k: int) -> tuple[int, int]:
        """``(start, length)`` of chunk ``k`` in the shard's elements."""
        start = k * self.chunk_elems
        return start, max(0, min(self.numel - start, self.chunk_elems))

    def padded_len(self, k: int) -> int:
        """Elements per tensor in record ``k`` (chunk length rounded up to the alignment)."""
        return max(ELEM_ALIGN, round_up(self.chunk_range(k)[1], ELEM_ALIGN))

    def record_offset(self, k: int) -> int:
        return k * self.chunk_elems * 4 * self.tensors_per_record

    def record_bytes(self, k: int) -> int:
        return self.padded_len(k) * 4 * self.tensors_per_record

    @property
    def file_bytes(self) -> int:
        last = self.num_chunks - 1
        return self.record_offset(last) + self.record_bytes(last)


#: fp32 tensors per element in a device's buffer pool when the optimizer is not known yet: the master weight and
#: Adam's two states, the largest record of the supported rules without ``amsgrad``.
POOL_TENSORS = 3


def pool_bytes(devices: int, buffer_count: int, chunk_elems: int, tensors_per_record: int = POOL_TENSORS) -> int:
    """Host bytes of the chunk-buffer pools of ``devices`` devices: ``buffer_count`` records of fp32 tensors each.

    The one formula for pool memory: settings checks, the ``BufferPool`` callback's budget, the page-lock check of
    the aio engine and the devices' own allocation all use it. A device also keeps one fp32 gradient chunk
    (``chunk_elems * 4`` bytes) beside its pool.
    """
    return devices * buffer_count * chunk_elems * 4 * tensors_per_record
