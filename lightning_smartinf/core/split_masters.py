"""Split masters: an fp32 master weight kept as the bf16 parameter the host holds plus a 17-bit correction.

Under round to nearest, ties to even (torch's conversion, and the devices'), the bf16 rounding ``p`` of an fp32
master ``m`` has the bits of ``m``'s high half ``h``, or ``h + 1`` where the rounding carried (as 16-bit patterns: the
sign stays, the magnitude carries into the exponent, up to infinity). So every master that is not NaN is, bit for bit,

    m = ((p - carry) << 16) | low

with ``low`` its low 16 bits and ``carry`` one bit. Sixteen bits alone are not enough: an even ``p`` is the rounding
of both ties at its edges, whose high halves differ. Where the parameters live in host memory in bf16, a device then
keeps 2.125 bytes per master instead of 4, and reads and writes 3.75 bytes fewer per parameter and step.

A record's split master region of ``padded`` elements (a multiple of 8) holds ``padded`` low halves (``uint16``), then
``padded / 8`` bytes of carry bits, element ``i`` in bit ``i % 8`` of byte ``i // 8`` (:func:`region_bytes`). The
C kernels (``native/state_formats.c``) and the plain-torch reference here write the same bytes.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_smartinf.core.native import state_format_kernels
from lightning_smartinf.core.native.pieces import in_pieces

__all__ = ["BYTES_PER_ELEMENT", "SplitChunk", "decode", "encode", "parts", "region_bytes"]

#: Bytes per master on the devices: a low half and a carry bit.
BYTES_PER_ELEMENT = 2.125
#: Elements of the smallest part of a chunk the kernels take on one thread (whole carry bytes, and 1 KiB of them).
UNIT = 8192

_BIT_WEIGHTS = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8)


@dataclass(frozen=True)
class SplitChunk:
    """One chunk's split masters: its bf16 ``params`` (the high halves, near enough), the record's ``region`` of low
    halves and carry bits, and ``aside``, where a tentative update copies the parameters it overwrites (or ``None``)."""

    params: Tensor
    region: Tensor
    aside: Tensor | None = None

    def load(self, out: Tensor) -> None:
        """The masters into ``out`` (fp32), the parameters aside on the way."""
        decode(self.params, self.region, out, self.aside)

    def store(self, master: Tensor) -> None:
        """``master`` (fp32) back: its low halves and carry bits into the region, its rounding into the parameters."""
        encode(master, self.region, self.params)


def region_bytes(padded: int) -> int:
    """Bytes of the split masters of ``padded`` elements (a multiple of 8)."""
    if padded % 8:
        raise ValueError(f"A split master region holds a multiple of 8 elements, got {padded}.")
    return padded * 2 + padded // 8


def parts(region: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """The low halves (``int16``) and carry bytes (``uint8``) of the first ``n`` elements of ``region`` (``uint8``,
    :func:`region_bytes` of its padded length)."""
    padded = region.numel() * 8 // 17
    if region.dtype != torch.uint8 or region_bytes(padded) != region.numel() or n > padded:
        raise ValueError(f"Not a split master region of at least {n} elements: {region.numel()} {region.dtype} bytes.")
    return region[: 2 * padded].view(torch.int16)[:n], region[2 * padded :][: -(-n // 8)]


#: In :func:`_native`'s arguments: the count of elements of each piece.
_COUNT = object()
#: The C type of a pointer into a tensor, by its bytes per element (fp32 masters, 16-bit halves, carry bytes).
_CTYPES = {4: ctypes.c_float, 2: ctypes.c_uint16, 1: ctypes.c_uint8}


def _native(kernel: str, n: int, *arguments: Any) -> bool:
    """Run C kernel ``kernel`` over ``n`` elements in pieces of :data:`UNIT` where the kernels are built and every
    tensor of ``arguments`` is a contiguous host one; ``False`` (nothing done) otherwise. Each tensor is passed as a
    pointer to the piece's first element, ``None`` as a null pointer and :data:`_COUNT` as the piece's length."""
    tensors = [a for a in arguments if isinstance(a, Tensor)]
    kernels = state_format_kernels() if all(t.device.type == "cpu" and t.is_contiguous() for t in tensors) else None
    if kernels is None:
        return False

    def pointer(tensor: Tensor | None, first: int) -> Any:
        if tensor is None:
            return None
        size = tensor.element_size()
        offset = first // 8 if size == 1 else first * size  # carry bytes: 8 elements a byte
        return ctypes.cast(tensor.data_ptr() + offset, ctypes.POINTER(_CTYPES[size]))

    def piece(first: int, end: int) -> None:
        getattr(kernels, kernel)(*(end - first if a is _COUNT else pointer(a, first) for a in arguments))

    in_pieces(piece, n, UNIT)
    return True


def encode(master: Tensor, region: Tensor, params: Tensor | None = None) -> None:
    """Store the low halves and carry bits of ``master`` (fp32, ``n`` elements) in the first ``n`` elements of
    ``region``, and its bf16 rounding in ``params`` if given; a last carry byte's bits past ``n`` become zero, the rest
    of the region is left as it is."""
    n = master.numel()
    low, carry = parts(region, n)
    _check_params("params", params, n)
    if _native("smartinf_split_encode", n, master, _COUNT, low, carry, params):
        return
    bits = master.reshape(-1).view(torch.int32)
    low.copy_(bits.to(torch.int16))  # the low 16 bits (a narrowing conversion wraps)
    rounded = master.reshape(-1).to(torch.bfloat16)
    carried = (rounded.view(torch.int16) != (bits >> 16).to(torch.int16)).to(torch.uint8)
    padded = torch.zeros(carry.numel() * 8, dtype=torch.uint8)
    padded[:n] = carried
    carry.copy_((padded.view(-1, 8) * _BIT_WEIGHTS).sum(1, dtype=torch.uint8))
    if params is not None:
        params.copy_(rounded.reshape(params.shape))


def decode(params: Tensor, region: Tensor, out: Tensor, aside: Tensor | None = None) -> None:
    """Rebuild ``out`` (fp32, ``n`` elements), the masters whose bf16 roundings are ``params`` and whose low halves and
    carry bits are the first ``n`` of ``region``; copy ``params`` into ``aside`` too, if given (the same pass)."""
    n = out.numel()
    _check_params("params", params, n)
    _check_params("aside", aside, n)
    low, carry = parts(region, n)
    if _native("smartinf_split_decode", n, params, low, carry, _COUNT, out, aside):
        return
    if aside is not None:
        aside.copy_(params)
    carried = ((carry.unsqueeze(1) & _BIT_WEIGHTS) != 0).reshape(-1)[:n].to(torch.int32)
    high = (params.reshape(-1).view(torch.int16).to(torch.int32) - carried) & 0xFFFF
    bits = (high << 16) | (low.to(torch.int32) & 0xFFFF)
    out.copy_(bits.view(torch.float32).reshape(out.shape))


def _check_params(name: str, tensor: Tensor | None, n: int) -> None:
    if tensor is not None and (tensor.dtype != torch.bfloat16 or tensor.numel() != n):
        raise ValueError(f"`{name}` must hold {n} bf16 parameters, got {tensor.numel()} {tensor.dtype}.")
