"""The host half of EF-Adafactor: Adafactor's factored second moment of the dense gradient, and the update it sends.

Under top-k with error feedback an entry leaves the host with the sum of the steps it waited. A second moment kept
on the device sees only those bursts, so it grows with their square and the step shrinks with the wait
(``docs/compression.md``). The host, which holds every step's dense gradient, keeps Adafactor's second moment
instead: per matrix, exponential averages of the row and column sums of the squared gradient, ``O(rows + cols)``
floats. It divides what it sends by that moment, and the device applies the result
(:class:`~lightning_smartinf.core.rules.EFAdafactor`).

Invariants:

- A parameter of two or more dimensions is a matrix of ``shape[0]`` rows; this rank's partition of it covers the
  rows its elements touch. ``R`` and ``C`` average ``(g * grad_scale) ** 2`` summed over those elements by row and
  by column, and ``v_hat[i, j] = R[i] * C[j] / sum(R)``. A vector keeps Adam's per-element average.
- Moments are bias-corrected by their own update count, so moments that start from zero (a fresh run, or a resume
  from a checkpoint of another rule) give ``g ** 2`` on their first update.
- Padding past a parameter's last element is never read or normalised (it stays as sent: zero).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from lightning_smartinf.core.compression import SparseGrad
from lightning_smartinf.core.rules import StepParams


@dataclass(frozen=True)
class _Segment:
    """One parameter's partition inside a shard, and where its moments lie in the flat moment buffer."""

    offset: int  # first element in the shard
    valid: int  # elements of the parameter in this partition (the rest is padding)
    lead: int  # for a matrix: elements of the first touched row before the partition starts
    rows: int  # for a matrix: rows touched; 0 for a vector
    cols: int  # for a matrix: elements per row
    moment: int  # first float of its moments in the buffer

    @property
    def moment_size(self) -> int:
        return self.rows + self.cols if self.rows else self.valid


def _segments(params: Sequence[Mapping[str, Any]], rank: int, first_moment: int) -> list[_Segment]:
    segments, offset, moment = [], 0, first_moment
    for param in params:
        shape, size = list(param["shape"]), int(param["partition_numel"])
        numel = math.prod(shape)
        start = rank * size  # rank r holds elements [r * size, (r + 1) * size) of the flat parameter
        valid = max(0, min(size, numel - start))
        rows = cols = lead = 0
        if len(shape) >= 2 and valid:
            cols = numel // shape[0]
            first_row = start // cols
            lead = start - first_row * cols
            rows = (start + valid - 1) // cols - first_row + 1
        segment = _Segment(offset, valid, lead, rows, cols, moment)
        segments.append(segment)
        offset += size
        moment += segment.moment_size
    return segments


class _Table:
    """One shard's segments as tensors on the gradients' device, so that :meth:`FactoredMoments.normalise` finds each
    element's segment there (``searchsorted``) instead of cutting the shard into segments on the host."""

    def __init__(self, segments: Sequence[_Segment], device: torch.device) -> None:
        def column(values: list[int]) -> Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        self.start = column([seg.offset for seg in segments])
        self.valid = column([seg.valid for seg in segments])
        self.lead = column([seg.lead for seg in segments])
        self.rows = column([seg.rows for seg in segments])
        self.cols = column([max(1, seg.cols) for seg in segments])
        self.moment = column([seg.moment for seg in segments])
        self.factored = self.rows > 0


class FactoredMoments:
    """Adafactor's second moments of every shard this rank holds, and the normalisation of what is sent.

    The moments live where the gradients are (they follow the first gradient folded in): folding a gradient in and
    normalising what is sent run there, without waiting for the host.

    Args:
        layout: per shard, its parameters' ``shape`` and ``partition_numel`` in order (``Partitions.layout``).
        rank: this rank in the data-parallel group (which part of each parameter its partitions hold).
    """

    def __init__(self, layout: Sequence[Sequence[Mapping[str, Any]]], rank: int) -> None:
        self._shards: list[list[_Segment]] = []
        total = 0
        for params in layout:
            segments = _segments(params, rank, total)
            self._shards.append(segments)
            total += sum(s.moment_size for s in segments)
        #: Every shard's moments back to back, fp32 (a few floats per matrix row and column).
        self.moments = torch.zeros(total)
        #: Updates the moments have taken (their bias correction).
        self.updates = 0
        self._tables: dict[int, _Table] = {}

    def load(self, moments: Tensor | None, updates: int) -> None:
        """Restore saved moments (``None``: start again from zero, as after a resume from another rule)."""
        if moments is None:
            self.moments.zero_()
            self.updates = 0
            return
        if moments.shape != self.moments.shape:
            raise ValueError(
                f"The checkpoint's factored second moments hold {moments.numel()} floats but this rank's model needs "
                f"{self.moments.numel()}. Resume with the same model and ranks."
            )
        self.moments.copy_(moments)
        self.updates = int(updates)

    def begin_step(self) -> None:
        """Count one more update of every shard's moments (call once per optimizer step, before :meth:`update`)."""
        self.updates += 1

    def update(self, shard: int, grad: Tensor, grad_scale: float, beta2: float) -> None:
        """Fold this step's dense gradient of ``shard`` (times ``grad_scale``) into its moments (which move to the
        gradient's device the first time)."""
        if self.moments.device != grad.device:
            self.moments = self.moments.to(grad.device)
        for seg in self._shards[shard]:
            if not seg.valid:
                continue
            square = grad[seg.offset : seg.offset + seg.valid].to(torch.float32, copy=True).mul_(grad_scale).square_()
            moment = self.moments[seg.moment : seg.moment + seg.moment_size]
            if not seg.rows:
                moment.mul_(beta2).add_(square, alpha=1.0 - beta2)
                continue
            if seg.lead or seg.valid != seg.rows * seg.cols:
                full = square.new_zeros(seg.rows * seg.cols)
                full[seg.lead : seg.lead + seg.valid] = square
                square = full
            matrix = square.view(seg.rows, seg.cols)
            moment[: seg.rows].mul_(beta2).add_(matrix.sum(1), alpha=1.0 - beta2)
            moment[seg.rows :].mul_(beta2).add_(matrix.sum(0), alpha=1.0 - beta2)

    def normalise(
        self, shard: int, grad: Tensor | SparseGrad, hp: StepParams, link_dtype: torch.dtype
    ) -> Tensor | SparseGrad:
        """What the host sends for ``grad`` (raw, fp32 values): ``g * grad_scale / (sqrt(v_hat / bc2) + eps)``.

        Negated for ``maximize``, rounded once to ``link_dtype``, on the device ``grad`` is on. A dense gradient stays
        dense, a top-k one keeps its indices.
        """
        sparse = isinstance(grad, SparseGrad)
        values = grad.values if sparse else grad
        out = values.to(torch.float32, copy=True).mul_(-hp.grad_scale if hp.maximize else hp.grad_scale)
        segments = self._shards[shard]
        if out.numel() and any(seg.valid for seg in segments):
            positions = grad.indices.long() if sparse else torch.arange(out.numel(), device=out.device)
            table = self._table(shard, out.device)
            at = torch.searchsorted(table.start, positions, right=True) - 1  # each element's segment
            local = positions - table.start[at]
            v_hat = self._v_hat(shard, table, at, local)
            bc2 = 1.0 - hp.betas[1] ** self.updates
            normalised = out / v_hat.div_(bc2).sqrt_().add_(hp.eps)
            out = torch.where(local < table.valid[at], normalised, out)  # padding stays as sent
        if sparse:
            return SparseGrad(grad.indices, out.to(link_dtype), grad.numel)
        return out.to(link_dtype)

    def _table(self, shard: int, device: torch.device) -> _Table:
        table = self._tables.get(shard)
        if table is None or table.start.device != device:
            table = self._tables[shard] = _Table(self._shards[shard], device)
        return table

    def _v_hat(self, shard: int, table: _Table, at: Tensor, local: Tensor) -> Tensor:
        """``v_hat`` of each element: ``R[i] * C[j] / sum(R)`` in a matrix's segment, the element's own average in a
        vector's. Positions that fall elsewhere (padding) get a value that is never used."""
        moments = self.moments
        last = max(0, moments.numel() - 1)
        base = table.moment[at]
        flat = local + table.lead[at]
        cols = table.cols[at]
        row = moments[(base + flat // cols).clamp_(0, last)]
        col = moments[(base + table.rows[at] + flat % cols).clamp_(0, last)]
        # sum(R) per segment, each summed on its own as a matrix's rows are (no cumulative-sum rounding).
        sums = [
            moments[seg.moment : seg.moment + seg.rows].sum() if seg.rows else moments.new_ones(())
            for seg in self._shards[shard]
        ]
        total = torch.stack(sums).clamp_min_(torch.finfo(torch.float32).tiny)[at]
        factored = row.mul_(col).div_(total)
        own = moments[(base + local).clamp_(0, last)]
        return torch.where(table.factored[at], factored, own)


def device_step_params(hp: StepParams) -> StepParams:
    """What the device runs with once the host sent the normalised update: scale and sign are already applied."""
    return replace(hp, grad_scale=1.0, maximize=False, momentum=0.0, dampening=0.0, nesterov=False)
