"""SmartComp: top-k gradient compression on the host side, decompression on the device side.

A compressed gradient is a :class:`SparseGrad`: ``k`` strictly ascending int32 element indices into a
shard of ``numel`` elements and the ``k`` values kept there, in the training precision. It is the wire
format of the link (``k * (4 + value bytes)`` bytes) and the input format of the HLS ``*_topk_*``
kernels (uint32 indices, ascending). Decompression is a scatter into a zeroed chunk, done by the
device inside its transfer pipeline (:meth:`SparseGrad.scatter_chunk`).

Selection keeps the ``k = ceil(ratio * numel)`` entries of largest magnitude with ``torch.topk`` (no
full sort; only the ``k`` chosen indices are sorted). Ties at the threshold go to the lowest positions, so the
selection is the same on every device and torch version (``torch.topk`` breaks ties differently on a CPU and a GPU,
and bf16 gradients tie often). With error feedback the dropped part of the
gradient is kept in a residual of the shard's size and added to the next step's gradient before
selection, so nothing is lost, only delayed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from lightning_smartinf.core.rules import Adam, EFAdafactor, EFAdam, UpdateRule

#: Index dtype on the link and in the kernels (the kernels read the same bits as uint32).
INDEX_DTYPE = torch.int32
#: Values of :attr:`TopKCompression.rule`.
RULE_CHOICES = ("auto", "optimizer", "ef_adam", "ef_adafactor")
#: The choices that are for Adam and AdamW only, and take the error-feedback residual as their first moment.
EF_RULES = ("ef_adam", "ef_adafactor")


def ef_rule_needs_feedback(rule: str) -> str:
    """Why ``rule`` (one of :data:`EF_RULES`) is refused without error feedback (the strategy's check says the same)."""
    return (
        f"`compression` rule {rule!r} needs `error_feedback=True`: the residual is its first moment. Turn error "
        "feedback on, or use `rule='optimizer'`."
    )


@dataclass(frozen=True)
class TopKCompression:
    """How gradients are compressed on their way to the devices.

    Args:
        ratio: fraction of each shard's gradient entries sent per step (``0 < ratio <= 1``); 0.01 sends the
            largest 1%, as ``k * (4 + value bytes)`` bytes instead of ``numel * value bytes``.
        error_feedback: add what was not sent to the next step's gradient (an fp32 residual the size of the
            gradient partition, kept where the partition is: 4 bytes per parameter of this rank's partition).
            ``False`` drops it, as the Smart-Infinity paper does.
        layerwise: select the top ``ratio`` of every parameter's partition separately (Deep Gradient
            Compression's choice: no layer is starved); ``False`` selects over the whole sub-group at once.
        rule: what the devices run on the decompressed gradients. ``"ef_adam"``: for ``torch.optim.Adam`` and
            ``AdamW``, :class:`~lightning_smartinf.core.rules.EFAdam`, which lets the error-feedback residual carry
            the first moment (within 1% of dense AdamW at 1% where the optimizer's own rule loses 9%,
            ``docs/compression.md``). ``"ef_adafactor"``: for AdamW (and Adam without weight decay),
            :class:`~lightning_smartinf.core.rules.EFAdafactor`: the host keeps Adafactor's factored second moment of
            the dense gradient and sends normalised values, and the devices keep only the master weights.
            ``"optimizer"``: the optimizer's own rule. ``"auto"`` (default): ``"ef_adam"`` for Adam and AdamW with
            error feedback, ``"optimizer"`` otherwise (``"ef_adafactor"`` is not the default: without Adafactor's
            update clipping it was unstable at 5% on GPT-2, ``docs/compression.md``).
    """

    ratio: float
    error_feedback: bool = True
    layerwise: bool = True
    rule: Literal["auto", "optimizer", "ef_adam", "ef_adafactor"] = "auto"

    def __post_init__(self) -> None:
        check_ratio(self.ratio)
        for name in ("error_feedback", "layerwise"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}={getattr(self, name)!r}` must be True or False.")
        if not isinstance(self.rule, str) or self.rule not in RULE_CHOICES:
            raise ValueError(
                f"`compression` rule {self.rule!r} is invalid: it must be one of {', '.join(map(repr, RULE_CHOICES))} "
                "('auto' runs 'ef_adam' for Adam and AdamW with error feedback, the optimizer's own rule otherwise)."
            )
        if self.rule in EF_RULES and not self.error_feedback:
            raise ValueError(ef_rule_needs_feedback(self.rule))


def compressed_rule(rule: UpdateRule, compression: TopKCompression | None, weight_decay: float = 0.0) -> UpdateRule:
    """The rule the devices run for an optimizer whose own rule is ``rule`` under ``compression``.

    ``weight_decay`` is the param group's: ``'ef_adafactor'`` decays the weights after the host's normalisation,
    which is AdamW's decoupled decay but not Adam's L2 decay.

    Raises:
        ValueError: an EF rule was asked for an optimizer other than Adam/AdamW, with ``amsgrad``, or
            ``'ef_adafactor'`` for Adam with L2 weight decay.
    """
    if compression is None or compression.rule == "optimizer":
        return rule
    chosen = compression.rule
    if not isinstance(rule, Adam):
        if chosen in EF_RULES:
            raise ValueError(
                f"`compression` rule {chosen!r} is for torch.optim.Adam and AdamW; this optimizer runs {rule.name!r}. "
                "Use `rule='auto'` or `rule='optimizer'` for it."
            )
        return rule
    if rule.amsgrad:
        if chosen in EF_RULES:
            raise ValueError(
                f"`compression` rule {chosen!r} has no `amsgrad`: it keeps one second moment. Use `amsgrad=False`."
            )
        return rule
    if not compression.error_feedback:
        return rule
    if chosen == "ef_adafactor":
        if not rule.decoupled_weight_decay and weight_decay != 0.0:
            raise ValueError(
                f"`compression` rule 'ef_adafactor' decays the weights as AdamW does, not with Adam's L2 "
                f"`weight_decay={weight_decay!r}`. Use torch.optim.AdamW, `weight_decay=0`, or `rule='ef_adam'`."
            )
        return EFAdafactor()
    return EFAdam(decoupled_weight_decay=rule.decoupled_weight_decay)


def check_sparse_supported(rule: UpdateRule) -> None:
    """Raise ``ValueError`` if the devices' top-k kernels cannot run ``rule`` (they lack Adam's amsgrad)."""
    if isinstance(rule, Adam) and rule.amsgrad:
        raise ValueError(
            "Gradient compression runs on the devices' top-k update kernels, which do not implement Adam's "
            "`amsgrad=True`. Use `amsgrad=False`, or train without `compression`."
        )


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
            raise ValueError(
                f"`SparseGrad.indices` must be a 1-D int32 tensor, got {self.indices.dtype} "
                f"of shape {tuple(self.indices.shape)}."
            )
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

    def scatter_chunk(self, out: Tensor, start: int, via: torch.dtype | None = None) -> Tensor:
        """Decompress elements ``[start, start + len(out))`` into ``out``: zero it, scatter the pairs there.

        ``via``: the dtype the values crossed the link in, when it differs from theirs (they are rounded to it).
        """
        lo, hi = self.chunk_bounds(start, out.numel())
        out.zero_()
        if hi > lo:
            values = self.values[lo:hi]
            if via is not None and via != values.dtype:
                values = values.to(via)
            out.index_copy_(0, (self.indices[lo:hi] - start).long(), values.to(out.dtype))
        return out

    def cpu(self, non_blocking: bool = False) -> SparseGrad:
        """This gradient in host memory (itself if it is there already).

        ``non_blocking``: from an accelerator, the pairs are copied into page-locked memory on the current stream and
        the host does not wait; they have landed once a fence recorded after this call has completed.
        """
        if self.indices.device.type == "cpu" and self.values.device.type == "cpu":
            return self
        if not non_blocking:
            return SparseGrad(self.indices.cpu(), self.values.cpu(), self.numel)
        indices = torch.empty(self.indices.shape, dtype=self.indices.dtype, pin_memory=True)
        values = torch.empty(self.values.shape, dtype=self.values.dtype, pin_memory=True)
        indices.copy_(self.indices, non_blocking=True)
        values.copy_(self.values, non_blocking=True)
        return SparseGrad(indices, values, self.numel)

    def to_dense(self, dtype: torch.dtype | None = None) -> Tensor:
        dense = torch.zeros(self.numel, dtype=dtype or self.values.dtype, device=self.values.device)
        dense.index_copy_(0, self.indices.long(), self.values.to(dense.dtype))
        return dense


def kept_count(numel: int, ratio: float) -> int:
    """Number of entries a shard of ``numel`` elements keeps at ``ratio`` (at least one when ``numel > 0``)."""
    if numel == 0:
        return 0
    return min(numel, max(1, math.ceil(ratio * numel)))


#: Shards at least this large select through a sampled threshold first (see :func:`topk_indices`).
SAMPLED_SELECTION_MIN_NUMEL = 1 << 16
#: Elements sampled to estimate the threshold, and how many more candidates than ``k`` it aims for.
_SAMPLE_SIZE = 1 << 14
_OVERSELECT = 1.3


def topk_indices(magnitude: Tensor, k: int) -> Tensor:
    """Ascending int64 positions of the ``k`` largest entries of ``magnitude`` (NaN counts as larger than anything).

    Ties at the ``k``-th largest value go to the lowest positions, so the result depends on the values alone, not on
    the device or the torch version. Large inputs in host memory are not fully ranked: a threshold estimated from a
    strided sample keeps a candidate set somewhat larger than ``k``, and only those are ranked. If the estimate keeps
    fewer than ``k`` candidates, the whole input is ranked. The positions come back sorted, which the device kernels
    require.
    """
    n = magnitude.numel()
    if k >= n:
        return torch.arange(n, device=magnitude.device)
    if k == 0:
        return torch.empty(0, dtype=torch.long, device=magnitude.device)
    # On an accelerator the input is ranked whole: the sample's candidate count is data-dependent, and reading it
    # would make the host wait for the accelerator once per segment.
    if magnitude.device.type == "cpu" and n >= SAMPLED_SELECTION_MIN_NUMEL and k * _OVERSELECT < n / 4:
        stride = max(1, n // _SAMPLE_SIZE)
        sample = magnitude[::stride].float()
        keep = min(sample.numel(), max(1, math.ceil(sample.numel() * k * _OVERSELECT / n)))
        threshold = torch.topk(sample, keep, sorted=True).values[-1]
        # In position order; every entry at least as large as the k-th largest is among them (NaN is not < anything).
        candidates = torch.nonzero(~(magnitude < threshold)).squeeze(1)
        if candidates.numel() >= k:
            return candidates[_first_largest(magnitude[candidates], k)]
    return _first_largest(magnitude, k)


def _first_largest(magnitude: Tensor, k: int) -> Tensor:
    """Ascending positions of the ``k`` largest entries of ``magnitude`` (``0 < k < numel``), ties to the lowest
    positions; no host synchronisation on an accelerator."""
    # The k-th largest value does not depend on how topk breaks ties; NaN ranks above inf.
    threshold = torch.topk(magnitude, k, sorted=False).values.nan_to_num(nan=math.inf, posinf=math.inf).min()
    above = ~(magnitude <= threshold)  # NaN included
    ties = magnitude == threshold
    room = k - above.sum()
    chosen = above | (ties & (ties.cumsum(0, dtype=torch.int32) <= room))
    # Exactly k are chosen (more only when over k entries are NaN: then the first k of them).
    return torch.nonzero_static(chosen, size=k).squeeze(1)


def compress_topk(
    grad: Tensor,
    ratio: float,
    residual: Tensor | None = None,
    value_dtype: torch.dtype | None = None,
    segments: Sequence[int] | None = None,
    *,
    check_range: bool = True,
    residual_factor: float = 1.0,
) -> SparseGrad:
    """Keep the ``kept_count(grad.numel(), ratio)`` largest-magnitude entries of a flat gradient.

    With ``segments`` (lengths that sum to ``grad.numel()``, e.g. the parameters of a ZeRO sub-group), each
    segment keeps its own ``kept_count(length, ratio)`` entries, so a layer with small gradients is not starved
    by one with large ones (layer-wise selection, as in Deep Gradient Compression).

    With ``residual`` (error feedback), ``residual = residual * residual_factor + grad`` is compressed instead and
    afterwards holds exactly what was not delivered: the dropped entries, and at the kept positions what rounding the
    values to ``value_dtype`` lost (zero when no rounding happens). So ``sent + residual == old residual *
    residual_factor + grad`` up to the residual's own precision, which is why it should be fp32 even when gradients
    are bf16. ``residual_factor`` brings the residual into the units of this step's gradient (its loss scale and
    clipping changed). ``grad`` is never modified. Values are returned in ``value_dtype`` (default: the gradient's
    dtype).

    Raises:
        LinkOverflowError: with a residual, an accumulated entry would not be finite in a ``value_dtype`` of
            narrower range than the residual's (fp16); raised before anything changes (see :func:`link_overflows`).
            ``check_range=False`` skips that pass over the gradient, for a caller that checked the whole buffer.
    """
    if grad.dim() != 1:
        raise ValueError(f"`grad` must be a flat (1-D) tensor, got shape {tuple(grad.shape)}.")
    check_ratio(ratio)
    source = grad
    if residual is not None:
        narrow = value_dtype is not None and has_narrower_range(value_dtype, residual.dtype)
        if check_range and narrow and link_overflows(grad, residual, value_dtype, residual_factor):
            raise LinkOverflowError(
                f"Gradient plus error-feedback residual exceeds the range of {value_dtype} "
                f"({torch.finfo(value_dtype).max:g}); nothing was compressed and the residual is unchanged. Skip the "
                "step and lower the loss scale."
            )
        if residual_factor == 1.0:
            source = residual.add_(grad)
        else:
            source = torch.add(grad, residual, alpha=residual_factor, out=residual)
    magnitude = source.abs()
    if segments is None:
        positions = topk_indices(magnitude, kept_count(source.numel(), ratio))
    else:
        if sum(segments) != source.numel():
            raise ValueError(f"`segments` sum to {sum(segments)}, the gradient has {source.numel()} elements.")
        parts, offset = [], 0
        for length in segments:
            part = topk_indices(magnitude[offset : offset + length], kept_count(length, ratio))
            parts.append(part + offset)
            offset += length
        positions = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=source.device)
    kept = source[positions]
    values = kept.to(value_dtype or grad.dtype)
    if residual is not None:
        residual.index_copy_(0, positions, kept - values.to(kept.dtype))
    return SparseGrad(positions.to(INDEX_DTYPE), values, source.numel())


class LinkOverflowError(OverflowError):
    """Gradient plus error-feedback residual does not fit the dtype values cross the link in (fp16's 65504)."""


def has_narrower_range(value_dtype: torch.dtype, accumulator_dtype: torch.dtype) -> bool:
    """Whether a finite ``accumulator_dtype`` sum can be out of ``value_dtype``'s range: fewer exponent bits (fp16
    against fp32). bf16 shares fp32's exponent range: there only sums that are not finite anyway fail, and the
    engine's own overflow check catches those."""
    return torch.finfo(value_dtype).max < torch.finfo(accumulator_dtype).max / 2


def link_overflows(
    grad: Tensor, residual: Tensor, value_dtype: torch.dtype, residual_factor: float = 1.0, block: int = 1 << 20
) -> Tensor:
    """Whether ``residual * residual_factor + grad`` holds an entry that is not finite once cast to ``value_dtype``.

    Error feedback sends an entry's accumulated gradient in one step; in fp16 a sum beyond 65504 would cross the link
    as inf and leave ``-inf`` in the residual for good. Works through ``block`` elements at a time (no copy of the
    whole residual); neither tensor is changed.

    Returns:
        A 0-dim bool tensor on ``grad``'s device: no block waits for the host; the caller reads it once (``bool()``).
    """
    if residual.shape != grad.shape:
        raise ValueError(f"`residual` has shape {tuple(residual.shape)}, the gradient {tuple(grad.shape)}.")
    found = torch.zeros((), dtype=torch.bool, device=grad.device)
    for start in range(0, grad.numel(), block):
        accumulated = residual[start : start + block] * residual_factor + grad[start : start + block]
        found |= ~torch.isfinite(accumulated.to(value_dtype)).all()
    return found


def check_ratio(ratio: float) -> None:
    """Raise ``ValueError`` unless ``0 < ratio <= 1``."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < ratio <= 1.0:
        raise ValueError(
            f"The kept ratio {ratio!r} is invalid: it must be a number with 0 < ratio <= 1 (e.g. 0.01 keeps "
            "the largest 1% of gradient entries; 1.0 keeps all)."
        )
