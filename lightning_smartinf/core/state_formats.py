"""The precisions an optimizer's per-element state can be kept in on the devices, and the one reference of each.

A format says how a state tensor of ``n`` elements is stored (:meth:`StateFormat.stored_bytes`), how fp32 values
become those bytes (:meth:`StateFormat.store`) and back (:meth:`StateFormat.load`). :func:`update_chunk` is the
reference of an update in a format: load every state to fp32, run the rule's fp32 arithmetic
(:mod:`lightning_smartinf.core.rules`), store every state back. Every device that holds a format must give the
bytes this module gives on the same inputs. Master weights are fp32 in every format.

Formats (``state_precision``):

* ``"fp32"``: the state as it is, 4 bytes per element. The reference of every other device; bit-identical to
  ``torch.optim``.
* ``"bf16"``: each element rounded to bfloat16 (round to nearest, ties to even), 2 bytes per element. The stored
  value ``x'`` of ``x`` satisfies ``|x' - x| <= 2**-8 * |x|``.
* ``"int8"``: one byte per element plus one fp32 scale per block of :data:`BLOCK` elements (1.016 bytes per
  element, a partial last block counted whole). An element's byte is the FP8 E4M3 code (``torch.float8_e4m3fn``:
  3 mantissa bits, round to nearest, ties to even) of the element divided by its block's scale, the block's largest
  magnitude over :data:`E4M3_MAX`. The largest element of a block is stored exactly, any other ``x`` as ``x'`` with
  ``|x' - x| <= 2**-4 * |x| + 2**-10 * scale`` (the second term where ``x / scale`` is below E4M3's normal range,
  ``2**-6``), and a non-zero ``x`` keeps its sign or becomes zero. A state that is never negative
  (:data:`NON_NEGATIVE`: Adam's ``exp_avg_sq``, Adagrad's ``sum``) is stored by its square root, which halves the
  range of magnitudes a block must span in the code: an element stays non-zero down to about ``2**-38`` of its
  block's largest, and where its square root is in the normal range, ``|v' - v| <= (2 * 2**-4 + 2**-8) * v``.
"""

from __future__ import annotations

import ctypes
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy
import torch
from torch import Tensor

from lightning_smartinf.core.native import int8_kernels
from lightning_smartinf.core.rules import StepParams, UpdateRule

__all__ = [
    "BLOCK",
    "E4M3_MAX",
    "FORMATS",
    "NON_NEGATIVE",
    "StateFormat",
    "check_format_for_rule",
    "reference_format",
    "state_format",
    "update_chunk",
]

#: Elements per fp32 scale of an ``"int8"`` state. A record's states are padded to 1024 elements, a multiple of it.
BLOCK = 256
#: Largest finite magnitude of FP8 E4M3 (``float8_e4m3fn``): a block's largest element maps to it.
E4M3_MAX = 448.0
#: States that are never negative: ``"int8"`` stores their square root.
NON_NEGATIVE = frozenset({"exp_avg_sq", "max_exp_avg_sq", "sum"})
#: The value of each FP8 E4M3 code, by code (0x7F and 0xFF are NaN, which no finite state is stored as).
_E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
_HOST = torch.device("cpu")


class StateFormat(ABC):
    """How a state tensor is stored on a device (see the module docstring)."""

    #: The format's name: the strategy's ``state_precision``.
    name: str

    @abstractmethod
    def stored_bytes(self, numel: int) -> int:
        """Bytes a state of ``numel`` elements takes."""

    @abstractmethod
    def elements(self, nbytes: int) -> int:
        """Elements a stored state of ``nbytes`` holds, padding included (the inverse of :meth:`stored_bytes`)."""

    @abstractmethod
    def store(self, values: Tensor, out: Tensor, state: str, *, consume: bool = False) -> None:
        """Write fp32 ``values`` of state ``state`` into ``out`` (``uint8``, :meth:`stored_bytes` long). With
        ``consume``, ``values`` may be overwritten on the way (a copy is then spared)."""

    @abstractmethod
    def load(self, raw: Tensor, out: Tensor, state: str) -> None:
        """Read state ``state`` from ``raw`` (``uint8``, :meth:`stored_bytes` long) into fp32 ``out``."""

    def bytes_per_element(self, num_states: int) -> float:
        """Bytes per element on the device of an fp32 master and ``num_states`` states in this format."""
        return 4 + num_states * self.stored_bytes(1 << 20) / (1 << 20)


class FloatFormat(StateFormat):
    """A state in a float ``dtype``: fp32 as it is, bf16 rounded to nearest, ties to even (and loaded back exactly)."""

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name, self.dtype = name, dtype

    def stored_bytes(self, numel: int) -> int:
        return self.dtype.itemsize * numel

    def elements(self, nbytes: int) -> int:
        return nbytes // self.dtype.itemsize

    def store(self, values: Tensor, out: Tensor, state: str, *, consume: bool = False) -> None:
        out.view(self.dtype).copy_(values)

    def load(self, raw: Tensor, out: Tensor, state: str) -> None:
        out.copy_(raw.view(self.dtype))


class Int8(StateFormat):
    """The codes of whole blocks first (one byte per element; zero past the last element), then one fp32 scale per
    block of :data:`BLOCK` elements.

    ``native``: convert with the C kernels of :mod:`lightning_smartinf.core.native` where they build (one pass over
    memory, the same bytes); ``False``: the plain-torch reference, always.
    """

    name = "int8"

    def __init__(self, native: bool = True) -> None:
        self.native = native

    def _kernels(self, values: Tensor, raw: Tensor) -> ctypes.CDLL | None:
        """The C kernels, for fp32 ``values`` and ``uint8`` ``raw`` laid out as they read and write them (contiguous,
        ``raw`` exactly :meth:`stored_bytes` long: they trust pointers and lengths); else ``None``, and the
        reference takes the call, with its own errors for what does not fit."""
        fits = (
            values.device.type == "cpu"
            and values.dtype == torch.float32
            and raw.dtype == torch.uint8
            and values.is_contiguous()
            and raw.is_contiguous()
            and raw.numel() == self.stored_bytes(values.numel())
        )
        return int8_kernels() if self.native and fits else None

    def stored_bytes(self, numel: int) -> int:
        return _blocks(numel) * (BLOCK + 4)

    def elements(self, nbytes: int) -> int:
        return nbytes // (BLOCK + 4) * BLOCK

    def store(self, values: Tensor, out: Tensor, state: str, *, consume: bool = False) -> None:
        kernels = self._kernels(values, out)
        if kernels is not None:
            n = values.numel()
            codes = out.data_ptr()
            scales = codes + _blocks(n) * BLOCK
            kernels.smartinf_int8_store(
                _pointer(values.data_ptr(), ctypes.c_float),
                n,
                int(state in NON_NEGATIVE),
                _pointer(codes, ctypes.c_uint8),
                _pointer(scales, ctypes.c_float),
            )
            return
        n, blocks, device = values.numel(), _blocks(values.numel()), values.device
        work = values if consume and n == blocks * BLOCK else _scratch(blocks * BLOCK, "store", device=device)
        work[n:].zero_()
        if state in NON_NEGATIVE:
            _ieee_sqrt(values, work[:n])
        elif work is not values:
            work[:n].copy_(values)
        rows = work.view(blocks, BLOCK)
        magnitudes = torch.abs(work, out=_scratch(blocks * BLOCK, "abs", device=device))
        scale = magnitudes.view(blocks, BLOCK).amax(dim=1).div_(E4M3_MAX)
        # An all-zero block keeps scale 0 (zeroed bytes are zeros stored), its codes divided by 1.
        rows.div_(scale.masked_fill(scale == 0, 1.0)[:, None])
        out[: blocks * BLOCK].view(torch.float8_e4m3fn).copy_(work)  # round to nearest, ties to even
        out[blocks * BLOCK :].view(torch.float32).copy_(scale)

    def load(self, raw: Tensor, out: Tensor, state: str) -> None:
        kernels = self._kernels(out, raw)
        if kernels is not None:
            n = out.numel()
            codes = raw.data_ptr()
            kernels.smartinf_int8_load(
                _pointer(codes, ctypes.c_uint8),
                _pointer(codes + _blocks(n) * BLOCK, ctypes.c_float),
                n,
                int(state in NON_NEGATIVE),
                _pointer(_E4M3_VALUES.data_ptr(), ctypes.c_float),
                _pointer(out.data_ptr(), ctypes.c_float),
            )
            return
        n, blocks, device = out.numel(), _blocks(out.numel()), out.device
        scale = raw[blocks * BLOCK :].view(torch.float32)
        values = out if n == blocks * BLOCK else _scratch(blocks * BLOCK, "load", device=device)
        # Decoded through a table of the 256 codes' values (exact, and faster than torch's float8 conversion).
        codes = _scratch(blocks * BLOCK, "codes", torch.int32, device)
        codes.copy_(raw[: blocks * BLOCK])
        torch.index_select(_e4m3_values(device), 0, codes, out=values)
        values.view(blocks, BLOCK).mul_(scale[:, None])
        if state in NON_NEGATIVE:
            values.square_()
        if values is not out:
            out.copy_(values[:n])


_FORMATS: dict[str, StateFormat] = {
    f.name: f for f in (FloatFormat("fp32", torch.float32), FloatFormat("bf16", torch.bfloat16), Int8())
}
#: The names ``state_precision`` takes.
FORMATS = tuple(_FORMATS)


def state_format(name: str) -> StateFormat:
    """The format called ``name`` (one of :data:`FORMATS`), as the devices run it."""
    try:
        return _FORMATS[name]
    except KeyError:
        raise ValueError(f"`state_precision={name!r}` is not a state format; choose one of {FORMATS}.") from None


def reference_format(name: str) -> StateFormat:
    """The plain-torch reference of format ``name``: the bytes every device must give."""
    return Int8(native=False) if state_format(name).name == "int8" else state_format(name)


def check_format_for_rule(name: str, rule: UpdateRule) -> None:
    """Refuse a format other than ``"fp32"`` for a rule that keeps no state on the devices (nothing to store)."""
    state_format(name)
    if name != "fp32" and not rule.state_names:
        raise ValueError(
            f"`state_precision={name!r}`: the {rule.name!r} update keeps no per-element state on the devices (only "
            "the fp32 master weights), so there is nothing to store in fewer bytes. Leave `state_precision='fp32'`."
        )


def update_chunk(
    rule: UpdateRule, fmt: StateFormat, master: Tensor, grad: Tensor, stored: Sequence[Tensor], hp: StepParams
) -> None:
    """The reference update of one chunk in format ``fmt``: ``stored`` holds each of ``rule``'s states (``uint8``, at
    least ``fmt.stored_bytes(master.numel())`` each; elements past the master's are padding, kept as they are),
    updated in place with ``master``. ``grad`` may be overwritten."""
    names, n = rule.state_names, master.numel()
    states = [_scratch(fmt.elements(raw.numel()), f"state{j}", device=master.device) for j, raw in enumerate(stored)]
    for name, raw, state in zip(names, stored, states):
        fmt.load(raw, state, name)
    rule.apply(master, grad, [state[:n] for state in states], hp)
    for name, raw, state in zip(names, stored, states):
        fmt.store(state, raw, name, consume=True)


def _blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def _pointer(address: int, ctype: type) -> Any:
    return ctypes.cast(address, ctypes.POINTER(ctype))


_local = threading.local()


def _scratch(numel: int, purpose: str, dtype: torch.dtype = torch.float32, device: torch.device = _HOST) -> Tensor:
    """This thread's buffer on ``device`` for ``purpose``, of ``numel`` elements (its contents are whatever was left
    there). Kept between calls: a fresh chunk-sized allocation per call costs more than the format's arithmetic."""
    buffers: dict[tuple[str, torch.device], Tensor] = _local.__dict__.setdefault("buffers", {})
    buffer = buffers.get((purpose, device))
    if buffer is None or buffer.numel() < numel:
        buffer = buffers[(purpose, device)] = torch.empty(numel, dtype=dtype, device=device)
    return buffer[:numel]


def _ieee_sqrt(values: Tensor, out: Tensor) -> None:
    """``out`` = the square root of ``values``, correctly rounded (IEEE 754), on their device.

    On the host through numpy (C's ``sqrtf``): torch's vectorised CPU kernel is an approximation (one in six
    results differs in the last bit), which no other device could reproduce. CUDA's ``sqrt`` is IEEE's (torch is
    built without fast math), so there torch's own runs.
    """
    if values.device.type == "cpu":
        numpy.sqrt(values.numpy(), out=out.numpy())
    else:
        torch.sqrt(values, out=out)


#: The E4M3 code table by device: each device decodes from a copy in its own memory.
_E4M3_BY_DEVICE: dict[torch.device, Tensor] = {_HOST: _E4M3_VALUES}


def _e4m3_values(device: torch.device) -> Tensor:
    table = _E4M3_BY_DEVICE.get(device)
    if table is None:
        table = _E4M3_BY_DEVICE[device] = _E4M3_VALUES.to(device)
    return table
