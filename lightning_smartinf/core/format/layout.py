"""On-disk layout of one shard's state: a file of chunk records.

Chunk ``k`` of a shard covers elements ``[k*C, min(n, (k+1)*C))`` and is stored as one contiguous
record ``[master | state_1 | ... | state_S]``, so one read brings everything the update of that chunk needs. The
master is fp32, or split (:mod:`lightning_smartinf.core.split_masters`: its low halves and carry bits, the rest being
the bf16 parameters, which live elsewhere); each state is stored in the shard's state format
(:mod:`lightning_smartinf.core.state_formats`: fp32, bf16 or int8). The master and each state are padded to
``ELEM_ALIGN`` elements, and the split master's and each state's bytes to ``IO_ALIGN``, so records stay
``O_DIRECT``-aligned; every record but the last has the same size, ``R = master_span(C) + S * round_up(stored_bytes(C),
IO_ALIGN)`` (``master_span(C)``: ``C * 4``, or ``round_up(region_bytes(C), IO_ALIGN)`` split), and starts at ``k * R``.
Padding is zero and never updated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from lightning_smartinf.core import split_masters
from lightning_smartinf.core.io.direct import IO_ALIGN, round_up
from lightning_smartinf.core.state_formats import StateFormat, state_format

#: fp32 elements per alignment unit.
ELEM_ALIGN = IO_ALIGN // 4

#: How a record holds its masters: whole (``"fp32"``), or ``"split"`` (beside the bf16 parameters).
MASTER_FORMATS = ("fp32", "split")


@dataclass(frozen=True)
class ChunkLayout:
    """Where chunk records of one shard live in its state file."""

    numel: int
    chunk_elems: int
    num_states: int
    #: How the states are stored (one of :data:`~lightning_smartinf.core.state_formats.FORMATS`).
    state_format: str = "fp32"
    #: How the masters are stored (one of :data:`MASTER_FORMATS`).
    master_format: str = "fp32"

    def __post_init__(self) -> None:
        if self.chunk_elems <= 0 or self.chunk_elems % ELEM_ALIGN:
            raise ValueError(f"chunk_elems={self.chunk_elems} must be a positive multiple of {ELEM_ALIGN}.")
        state_format(self.state_format)
        if self.master_format not in MASTER_FORMATS:
            raise ValueError(f"master_format={self.master_format!r} is not one of {MASTER_FORMATS}.")

    @property
    def split_masters(self) -> bool:
        return self.master_format == "split"

    @property
    def format(self) -> StateFormat:
        return state_format(self.state_format)

    @property
    def tensors_per_record(self) -> int:
        return 1 + self.num_states

    @property
    def pool_tensors(self) -> int:
        """fp32 tensors of ``chunk_elems`` a buffer needs to hold one record: :attr:`tensors_per_record` in fp32,
        fewer where the states take fewer bytes (a device's pool is sized by it)."""
        return -(-self._record_bytes(self.chunk_elems) // (4 * self.chunk_elems))

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
        return k * self._record_bytes(self.chunk_elems)

    def record_bytes(self, k: int) -> int:
        return self._record_bytes(self.padded_len(k))

    def _record_bytes(self, padded: int) -> int:
        return self._master_span(padded) + self.num_states * self._state_span(padded)

    def _master_span(self, padded: int) -> int:
        """Bytes from a record's start to its first state's."""
        return round_up(split_masters.region_bytes(padded), IO_ALIGN) if self.split_masters else padded * 4

    def master_region(self, record: Tensor, k: int) -> Tensor:
        """The split masters of ``record`` (chunk ``k``'s, any dtype) as ``uint8`` bytes (split layouts only)."""
        assert self.split_masters, "only a split layout has a master region"
        return record.view(torch.uint8)[: split_masters.region_bytes(self.padded_len(k))]

    def _state_span(self, padded: int) -> int:
        """Bytes between the starts of two states of a record: a state's bytes, rounded up to ``IO_ALIGN``."""
        return round_up(self.format.stored_bytes(padded), IO_ALIGN)

    def state_extents(self, k: int) -> list[tuple[int, int]]:
        """``(byte offset, bytes)`` of each state inside record ``k`` (the masters come first)."""
        padded = self.padded_len(k)
        size, span, first = self.format.stored_bytes(padded), self._state_span(padded), self._master_span(padded)
        return [(first + j * span, size) for j in range(self.num_states)]

    def states_of(self, record: Tensor, k: int, n: int) -> list[Tensor]:
        """The states inside ``record`` (chunk ``k``'s, of ``n`` elements): fp32 views of their ``n`` elements in the
        fp32 format, else the ``uint8`` bytes of each whole padded state, to load and store through the format."""
        if self.state_format == "fp32":
            return [record[offset // 4 :][:n] for offset, _ in self.state_extents(k)]
        raw = record.view(torch.uint8)
        return [raw[offset:][:size] for offset, size in self.state_extents(k)]

    def unpack(self, record: Tensor, k: int, names: Sequence[str], params: Tensor | None = None) -> list[Tensor]:
        """The master and the states (called ``names``) of record ``k``, given as its bytes (``uint8``), as fp32
        tensors of the record's padded length. A split layout rebuilds the masters from ``params``, the chunk's bf16
        parameters."""
        padded = self.padded_len(k)
        record = record[: self.record_bytes(k)]
        if self.split_masters:
            if params is None:
                raise ValueError("A record of split masters is read with its chunk's parameters: pass `params`.")
            tensors = [torch.zeros(padded, dtype=torch.float32)]
            split_masters.decode(params, self.master_region(record, k), tensors[0][: params.numel()])
        else:
            tensors = [record[: padded * 4].view(torch.float32).clone()]
        for name, raw in zip(names, self.states_of(record.view(torch.float32), k, padded), strict=True):
            tensors.append(torch.empty(padded, dtype=torch.float32))
            self.format.load(raw, tensors[-1], name)
        return tensors

    def pack(self, tensors: Sequence[Tensor], k: int, names: Sequence[str], params_out: Tensor | None = None) -> Tensor:
        """Record ``k`` (``uint8``) of fp32 ``tensors`` of its padded length: the master, then the states called
        ``names``. A split layout keeps the masters' other half in ``params_out``, the chunk's bf16 parameters, which
        it sets to their rounding."""
        padded = self.padded_len(k)
        record = torch.zeros(self.record_bytes(k) // 4, dtype=torch.float32)
        if self.split_masters:
            if params_out is None:
                raise ValueError("A record of split masters is written with its chunk's parameters: pass `params_out`.")
            n = params_out.numel()
            split_masters.encode(tensors[0][:n], self.master_region(record, k))
            params_out.copy_(tensors[0][:n])
        else:
            record[:padded].copy_(tensors[0])
        for name, raw, value in zip(names, self.states_of(record, k, padded), tensors[1:], strict=True):
            self.format.store(value, raw, name)
        return record.view(torch.uint8)

    @property
    def file_bytes(self) -> int:
        last = self.num_chunks - 1
        return self.record_offset(last) + self.record_bytes(last)


def saved_form(layout: ChunkLayout) -> ChunkLayout:
    """``layout`` as a checkpoint holds it: with whole masters (a checkpoint stands on its own, without the
    parameters that hold half of a split master)."""
    return replace(layout, master_format="fp32")


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
