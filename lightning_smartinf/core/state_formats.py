"""The precisions an optimizer's per-element state can be kept in on the devices, and the one reference of each.

A format says how a state tensor of ``n`` elements is stored (:meth:`StateFormat.stored_bytes`), how fp32 values
become those bytes (:meth:`StateFormat.store`) and back (:meth:`StateFormat.load`). :func:`update_chunk` is the
reference of an update in a format: load every state to fp32, run the rule's fp32 arithmetic
(:mod:`lightning_smartinf.core.rules`; in ``"bf16"`` and ``"int8"`` with square roots correctly rounded, as every
device takes them), store every state back. Every device that holds a format must give the bytes this module gives
on the same inputs. Master weights are fp32 in every format. On host cores, Adam and AdamW (the single-tensor
arithmetic) run fused with ``"bf16"`` and ``"int8"`` in C kernels (:meth:`StateFormat.fused_update`): one pass over a
chunk instead of the reference's dozen, the same bytes.

Formats (``state_precision``):

* ``"fp32"``: the state as it is, 4 bytes per element. The reference of every other device; bit-identical to
  ``torch.optim``.
* ``"bf16"``: each element rounded to bfloat16 (round to nearest, ties to even), 2 bytes per element. The stored
  value ``x'`` of ``x`` satisfies ``|x' - x| <= 2**-8 * |x|``.
* ``"int8"``: one byte per element plus one fp32 scale per block of :data:`BLOCK` elements (1.016 bytes per
  element, a partial last block counted whole). An element's byte is an 8-bit float code of the element divided by
  its block's scale, the block's largest magnitude over the code's largest value; round to nearest, ties to even.
  A signed state (Adam's ``exp_avg``) takes FP8 E4M3 (``torch.float8_e4m3fn``: 3 mantissa bits; largest
  :data:`E4M3_MAX`): the largest element of a block is stored exactly, any other ``x`` as ``x'`` with
  ``|x' - x| <= 2**-4 * |x| + 2**-10 * scale`` (the second term where ``x / scale`` is below E4M3's normal range,
  ``2**-6``), and a non-zero ``x`` keeps its sign or becomes zero.

  A state that is never negative (:data:`NON_NEGATIVE`: Adam's ``exp_avg_sq``, Adagrad's ``sum``) is stored by its
  square root in UE4M4 (:data:`ROOT_CODE`), an unsigned 8-bit float: the sign bit given to the mantissa, 4 exponent
  bits (bias 7) and 4 mantissa bits, with subnormals, no infinity or NaN; values ``2**-10`` to 496. Its precision is
  what keeps an average of squares moving: ``exp_avg_sq`` changes by a few percent a step (``1 - beta2``; its square
  root by half that), and a code whose half-step is larger rounds such changes away, so that the stored average stops
  following the gradients and drifts from the true one step after step. With E4M3's 3 mantissa bits (half a step is
  3.1-6.3% of a value) it did: that second moment cost 5% of final validation loss on the GPT-2 task; with UE4M4's 4
  (1.6-3.1%) int8 ends within 0.5% of fp32 there, 0.3% below on average over two seeds (``docs/benchmarks.md``). Its
  range is E4M3's: a square root in UE4M4's normal range, ``2**-6`` to 496 times its block's scale (down to about
  ``2**-15`` of the block's largest), is within ``2**-5`` of its value, so ``|v' - v| <= (2 * 2**-5 + 2**-10) * v``;
  below it the codes count multiples of ``2**-10`` of the scale. A non-zero element is never stored as zero (below
  half the smallest code it takes that code): a zero second moment beside a non-zero first would turn Adam's step into
  ``exp_avg / eps``.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_smartinf.core import split_masters
from lightning_smartinf.core.native import state_format_kernels
from lightning_smartinf.core.native.pieces import PIECE, in_pieces
from lightning_smartinf.core.rules import Adam, StepParams, UpdateRule, adam_kernel_scalars, correctly_rounded_sqrt

__all__ = [
    "BLOCK",
    "E4M3_MAX",
    "FORMATS",
    "NON_NEGATIVE",
    "PIECE",
    "ROOT_CODE",
    "StateFormat",
    "UnsignedFloat8",
    "check_format_for_rule",
    "reference_format",
    "state_format",
    "update_chunk",
]

#: Elements per fp32 scale of an ``"int8"`` state. A record's states are padded to 1024 elements, a multiple of it.
BLOCK = 256
#: Largest finite magnitude of FP8 E4M3 (``float8_e4m3fn``): a signed block's largest element maps to it.
E4M3_MAX = 448.0
#: States that are never negative: ``"int8"`` stores their square root, in :data:`ROOT_CODE`.
NON_NEGATIVE = frozenset({"exp_avg_sq", "max_exp_avg_sq", "sum"})
#: The value of each FP8 E4M3 code, by code (0x7F and 0xFF are NaN, which no finite state is stored as).
_E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
_HOST = torch.device("cpu")
#: A fused kernel's arguments for Adam's two stored states, for the elements ``[first, end)`` of a chunk.
StateArguments = Callable[[int, int], tuple[Any, ...]]


class UnsignedFloat8:
    """An unsigned 8-bit float: ``exponent_bits`` of exponent (bias ``2**(exponent_bits - 1) - 1``), the other bits
    mantissa, with subnormals and no infinity or NaN. ``UnsignedFloat8(3)`` is UE3M5.

    Code ``c`` is exponent field ``e = c >> mantissa_bits`` and mantissa ``m``: ``m * 2**(1 - bias - mantissa_bits)``
    where ``e`` is 0, else ``(1 + m / 2**mantissa_bits) * 2**(e - bias)``; every value is exact in fp32.
    """

    def __init__(self, exponent_bits: int) -> None:
        if not 1 <= exponent_bits <= 7:
            raise ValueError(f"`exponent_bits={exponent_bits!r}`: an 8-bit code has 1 to 7 of them.")
        self.exponent_bits, self.mantissa_bits = exponent_bits, 8 - exponent_bits
        self.bias = 2 ** (exponent_bits - 1) - 1
        m, bias = self.mantissa_bits, self.bias
        self.name = f"UE{exponent_bits}M{m}"
        #: The value of each code, by code.
        self.values = torch.tensor(
            [
                mantissa * 2.0 ** (1 - bias - m) if e == 0 else (1 + mantissa / 2**m) * 2.0 ** (e - bias)
                for e in range(2**exponent_bits)
                for mantissa in range(2**m)
            ],
            dtype=torch.float32,
        )
        #: The largest value (code 255): a never-negative block's largest square root maps to it.
        self.largest = float(self.values[255])

    def __repr__(self) -> str:
        return f"UnsignedFloat8({self.exponent_bits})  # {self.name}"

    def encode(self, values: Tensor, out: Tensor) -> None:
        """``out`` (``uint8``) = the codes of ``values`` (fp32, not negative, contiguous): round to nearest, ties to
        even; values from half a step above the largest code, infinity and NaN saturate to code 255 (a NaN state makes
        its block's scale NaN, and so every element of the block on load); a non-zero value below the smallest code
        takes that code, never zero."""
        m, bias = self.mantissa_bits, self.bias
        dropped = 23 - m
        # NaN's bits taken as infinity's: both saturate, and the sums below stay within int32.
        magnitude = (values.view(torch.int32) & 0x7FFFFFFF).clamp_(max=0x7F800000)
        # A normal: keep m of fp32's 23 mantissa bits, rounding the dropped ones to nearest, ties to even; a carry
        # moves into the exponent, which the codes continue. fp32's exponent bias is 127.
        half = (1 << (dropped - 1)) - 1
        codes = ((magnitude + half + ((magnitude >> dropped) & 1)) >> dropped) - ((127 - bias) << m)
        # Below the smallest normal, 2**(1 - bias), the codes count multiples of 2**(1 - bias - m): |x| times its
        # inverse is exact (a power of two), and adding 2**23 rounds it to an integer, to nearest with ties to even,
        # in the low bits.
        shifted = (magnitude.view(torch.float32) * 2.0 ** (bias - 1 + m) + 8388608.0).view(torch.int32) - 0x4B000000
        codes = torch.where(magnitude < ((128 - bias) << 23), shifted, codes).clamp_(max=255)
        codes = torch.where((codes == 0) & (magnitude != 0), 1, codes)
        out.copy_(codes)


#: The code of a never-negative state's square root in ``"int8"``.
ROOT_CODE = UnsignedFloat8(4)


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

    def bytes_per_element(self, num_states: int, *, split: bool = False) -> float:
        """Bytes per element on the device of a master (fp32, or split: :data:`.split_masters.BYTES_PER_ELEMENT`)
        and ``num_states`` states in this format."""
        master = split_masters.BYTES_PER_ELEMENT if split else 4
        return master + num_states * self.stored_bytes(1 << 20) / (1 << 20)

    def fused_update(
        self,
        rule: UpdateRule,
        master: Tensor,
        grad: Tensor,
        stored: Sequence[Tensor],
        hp: StepParams,
        split: split_masters.SplitChunk | None = None,
        *,
        params: Tensor | None = None,
        grad_scale: float = 1.0,
    ) -> bool:
        """Run :func:`update_chunk` as one native pass where this format has a kernel for ``rule`` and the tensors
        (see :func:`_fused_adam_arguments`); ``False`` where it has none and nothing was done: the reference runs.
        With ``split`` the masters are read from and written to it (``master`` is only scratch of their size).

        The pass can also take what a device does around the update: ``grad`` in bf16 as it crossed the link
        (``grad.float()``), times ``grad_scale`` (one fp32 rounding, as ``g.mul_(grad_scale)``), and the updated
        masters' bf16 roundings written to ``params`` (whole masters only: split ones write their parameters)."""
        kernel = self._fused_kernel(master.numel(), stored)
        if kernel is None:
            return False
        count, state_arguments = kernel
        arguments = _fused_adam_arguments(rule, master, grad, stored, hp, self.stored_bytes(count), split, params)
        if arguments is None:
            return False
        kernels, scalars, flags = arguments
        # The format's kernels are named after it: smartinf_adam_bf16, smartinf_adam_int8_split, ...
        whole, over_split = (getattr(kernels, f"smartinf_adam_{self.name}{suffix}") for suffix in ("", "_split"))
        master_at, scalars_at = master.data_ptr(), scalars.data_ptr()

        def piece(first: int, end: int) -> None:  # elements [first, end), whole blocks
            states = (
                *_gradient_pointers(grad, first, grad_scale),
                *state_arguments(first, end),
                _pointer(scalars_at, ctypes.c_float),
                flags,
            )
            if split is None:
                at_params = None if params is None else _pointer(params.data_ptr() + 2 * first, ctypes.c_uint16)
                whole(_pointer(master_at + 4 * first, ctypes.c_float), at_params, *states)
            else:
                over_split(*_split_pointers(split, first), *states)

        in_pieces(piece, count, BLOCK)
        return True

    def _fused_kernel(self, numel: int, stored: Sequence[Tensor]) -> tuple[int, StateArguments] | None:
        """How :meth:`fused_update`'s kernel runs over a chunk of ``numel`` stored in ``stored``: the elements it runs
        over (whole blocks), and its arguments for Adam's two states for elements ``[first, end)``. ``None``: this
        format has no kernel, or ``stored`` cannot take one (the reference runs)."""
        return None


class FloatFormat(StateFormat):
    """A state in a float ``dtype``: fp32 as it is, bf16 rounded to nearest, ties to even (and loaded back exactly).

    ``native``: bf16 updates Adam with the C kernel of :mod:`lightning_smartinf.core.native` where it applies (the
    same bytes); ``False``: the plain-torch reference, always.
    """

    def __init__(self, name: str, dtype: torch.dtype, native: bool = True) -> None:
        self.name, self.dtype, self.native = name, dtype, native

    def stored_bytes(self, numel: int) -> int:
        return self.dtype.itemsize * numel

    def elements(self, nbytes: int) -> int:
        return nbytes // self.dtype.itemsize

    def store(self, values: Tensor, out: Tensor, state: str, *, consume: bool = False) -> None:
        out.view(self.dtype).copy_(values)

    def load(self, raw: Tensor, out: Tensor, state: str) -> None:
        out.copy_(raw.view(self.dtype))

    def _fused_kernel(self, numel: int, stored: Sequence[Tensor]) -> tuple[int, StateArguments] | None:
        if self.dtype != torch.bfloat16 or not self.native:
            return None

        def state_arguments(first: int, end: int) -> tuple[Any, ...]:  # 2 bytes an element in each state
            return (end - first, *(_pointer(raw.data_ptr() + 2 * first, ctypes.c_uint16) for raw in stored))

        return numel, state_arguments


class Int8(StateFormat):
    """The codes of whole blocks first (one byte per element; zero past the last element), then one fp32 scale per
    block of :data:`BLOCK` elements.

    ``native``: convert with the C kernels of :mod:`lightning_smartinf.core.native` where they build (one pass over
    memory, the same bytes); ``False``: the plain-torch reference, always. ``root_code``: the code of a never-negative
    state's square root, :data:`ROOT_CODE` (another, for a study of codes, only with the reference: the kernels and
    devices hold :data:`ROOT_CODE`).
    """

    name = "int8"

    def __init__(self, native: bool = True, root_code: UnsignedFloat8 = ROOT_CODE) -> None:
        if native and root_code is not ROOT_CODE:
            raise ValueError(f"`root_code={root_code!r}` runs only in the reference (`native=False`).")
        self.native, self.root_code = native, root_code

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
        return state_format_kernels() if self.native and fits else None

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
        root = state in NON_NEGATIVE
        if root:
            correctly_rounded_sqrt(values, work[:n])
        elif work is not values:
            work[:n].copy_(values)
        rows = work.view(blocks, BLOCK)
        magnitudes = torch.abs(work, out=_scratch(blocks * BLOCK, "abs", device=device))
        scale = magnitudes.view(blocks, BLOCK).amax(dim=1).div_(self.root_code.largest if root else E4M3_MAX)
        # An all-zero block keeps scale 0 (zeroed bytes are zeros stored), its codes divided by 1.
        rows.div_(scale.masked_fill(scale == 0, 1.0)[:, None])
        if root:
            self.root_code.encode(work, out[: blocks * BLOCK])
        else:
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
                _pointer(out.data_ptr(), ctypes.c_float),
            )
            return
        n, blocks, device = out.numel(), _blocks(out.numel()), out.device
        scale = raw[blocks * BLOCK :].view(torch.float32)
        values = out if n == blocks * BLOCK else _scratch(blocks * BLOCK, "load", device=device)
        # Decoded through a table of the 256 codes' values (exact, and faster than torch's float8 conversion).
        codes = _scratch(blocks * BLOCK, "codes", torch.int32, device)
        codes.copy_(raw[: blocks * BLOCK])
        table = _on_device(self.root_code.values if state in NON_NEGATIVE else _E4M3_VALUES, device)
        torch.index_select(table, 0, codes, out=values)
        values.view(blocks, BLOCK).mul_(scale[:, None])
        if state in NON_NEGATIVE:
            values.square_()
        if values is not out:
            out.copy_(values[:n])

    def _fused_kernel(self, numel: int, stored: Sequence[Tensor]) -> tuple[int, StateArguments] | None:
        padded = self.elements(stored[0].numel()) if stored else 0
        if not self.native or padded < numel:
            return None

        def state_arguments(first: int, end: int) -> tuple[Any, ...]:  # each state's codes, then its scales
            m_at, v_at = (raw.data_ptr() for raw in stored)
            scales = padded + 4 * (first // BLOCK)
            return (
                min(max(numel - first, 0), end - first),
                end - first,
                _pointer(m_at + first, ctypes.c_uint8),
                _pointer(m_at + scales, ctypes.c_float),
                _pointer(v_at + first, ctypes.c_uint8),
                _pointer(v_at + scales, ctypes.c_float),
            )

        return padded, state_arguments


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
    fmt = state_format(name)
    if isinstance(fmt, FloatFormat):
        return FloatFormat(fmt.name, fmt.dtype, native=False)
    return Int8(native=False)


def check_format_for_rule(name: str, rule: UpdateRule) -> None:
    """Refuse a format other than ``"fp32"`` for a rule that keeps no state on the devices (nothing to store)."""
    state_format(name)
    if name != "fp32" and not rule.state_names:
        raise ValueError(
            f"`state_precision={name!r}`: the {rule.name!r} update keeps no per-element state on the devices (only "
            "the fp32 master weights), so there is nothing to store in fewer bytes. Leave `state_precision='fp32'`."
        )


def update_chunk(
    rule: UpdateRule,
    fmt: StateFormat,
    master: Tensor,
    grad: Tensor,
    stored: Sequence[Tensor],
    hp: StepParams,
    split: split_masters.SplitChunk | None = None,
) -> None:
    """The update of one chunk in format ``fmt``: ``stored`` holds each of ``rule``'s states (``uint8``, at least
    ``fmt.stored_bytes(master.numel())`` each; elements past the master's are padding, kept as they are), updated in
    place with ``master``. ``grad`` may be overwritten. With ``split`` the masters are split
    (:mod:`lightning_smartinf.core.split_masters`): loaded from it into ``master`` (scratch) and stored back to it.

    The reference loads every state to fp32, runs the rule (square roots correctly rounded in a format other than
    ``"fp32"``: see :mod:`lightning_smartinf.core.rules`) and stores every state back; a format with a native kernel
    for the rule (:meth:`StateFormat.fused_update`) does the same in one pass, giving the same bytes."""
    if fmt.fused_update(rule, master, grad, stored, hp, split):
        return
    if split is not None:
        split.load(master)
    names, n = rule.state_names, master.numel()
    states = [_scratch(fmt.elements(raw.numel()), f"state{j}", device=master.device) for j, raw in enumerate(stored)]
    for name, raw, state in zip(names, stored, states):
        fmt.load(raw, state, name)
    rule.apply(master, grad, [state[:n] for state in states], hp, ieee_sqrt=fmt.name != "fp32")
    for name, raw, state in zip(names, stored, states):
        fmt.store(state, raw, name, consume=True)
    if split is not None:
        split.store(master)


#: torch's CPU kernels that round as the native Adam does: they fuse ``lerp``, ``addcmul`` and ``add(alpha=)`` into one
#: rounding each (an FMA); its ``"default"`` kernels do not, and there the reference runs.
_FMA_CAPABILITIES = frozenset({"AVX2", "AVX512"})


def _fused_adam_arguments(
    rule: UpdateRule,
    master: Tensor,
    grad: Tensor,
    stored: Sequence[Tensor],
    hp: StepParams,
    state_bytes: int,
    split: split_masters.SplitChunk | None = None,
    params: Tensor | None = None,
) -> tuple[ctypes.CDLL, Tensor, int] | None:
    """The kernels, fp32 scalars and flags of a native fused Adam over these tensors, or ``None`` where it does not
    apply: a rule other than the single-tensor Adam or AdamW without ``amsgrad`` (torch's fused kernel has an
    arithmetic of its own), a torch whose CPU kernels round otherwise, tensors that are not contiguous host ones
    (``master`` fp32, ``grad`` fp32 or bf16 of as many elements, ``params`` bf16 of as many, beside whole masters
    only) and ``uint8`` (each state at least ``state_bytes``), split masters whose tensors are not contiguous host ones
    of as many elements, or no kernels."""
    applies = (
        type(rule) is Adam
        and not rule.fused
        and not rule.amsgrad
        and len(stored) == 2
        and master.device.type == "cpu"
        and master.dtype == torch.float32
        and grad.dtype in (torch.float32, torch.bfloat16)
        and (
            params is None
            or (
                split is None
                and params.device.type == "cpu"
                and params.dtype == torch.bfloat16
                and params.is_contiguous()
                and params.numel() == master.numel()
            )
        )
        and master.is_contiguous()
        and grad.is_contiguous()
        and grad.device.type == "cpu"
        and grad.numel() >= master.numel()
        and all(
            raw.device.type == "cpu" and raw.dtype == torch.uint8 and raw.is_contiguous() and raw.numel() >= state_bytes
            for raw in stored
        )
        and (split is None or _split_applies(split, master.numel()))
        and torch.backends.cpu.get_cpu_capability() in _FMA_CAPABILITIES
    )
    kernels = state_format_kernels() if applies else None
    if kernels is None:
        return None
    numbers, flags = adam_kernel_scalars(hp, rule.decoupled_weight_decay)  # type: ignore[attr-defined]
    scalars = torch.tensor(numbers, dtype=torch.float32)  # each rounded once, as torch rounds them
    return kernels, scalars, flags


def _split_applies(split: split_masters.SplitChunk, numel: int) -> bool:
    """Whether a native kernel can take ``split``'s tensors for a chunk of ``numel`` elements."""
    tensors = [split.params, split.region] + ([] if split.aside is None else [split.aside])
    return (
        all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
        and split.params.dtype == torch.bfloat16
        and split.params.numel() == numel
        and (split.aside is None or (split.aside.dtype == torch.bfloat16 and split.aside.numel() == numel))
        and split.region.dtype == torch.uint8
        and split_masters.region_bytes(-(-numel // 8) * 8) <= split.region.numel()
    )


def _split_pointers(split: split_masters.SplitChunk, first: int) -> tuple[Any, Any, Any, Any]:
    """The kernel's pointers to ``split``'s parameters, low halves, carry bits and aside copy from element ``first``
    (a multiple of 8: whole carry bytes)."""
    low, carry = split_masters.parts(split.region, split.params.numel())
    return (
        _pointer(split.params.data_ptr() + 2 * first, ctypes.c_uint16),
        _pointer(low.data_ptr() + 2 * first, ctypes.c_uint16),
        _pointer(carry.data_ptr() + first // 8, ctypes.c_uint8),
        None if split.aside is None else _pointer(split.aside.data_ptr() + 2 * first, ctypes.c_uint16),
    )


def _gradient_pointers(grad: Tensor, first: int, scale: float) -> tuple[Any, Any, ctypes.c_float]:
    """The kernels' gradient from element ``first``: fp32 or (the other ``NULL``) bf16, and its factor in fp32."""
    at = grad.data_ptr() + grad.element_size() * first
    if grad.dtype == torch.float32:
        return _pointer(at, ctypes.c_float), None, ctypes.c_float(scale)
    return None, _pointer(at, ctypes.c_uint16), ctypes.c_float(scale)


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


@functools.cache  # by (table, device); tensors hash by identity, and the cache keeps each table it saw alive
def _on_device(table: Tensor, device: torch.device) -> Tensor:
    """``table`` (a code's values, on the host) on ``device``: each device decodes from a copy in its own memory."""
    return table if device == _HOST else table.to(device)
