"""The host side of the ``hls_kernels/`` ABI: entry-point names, argument lists, derived scalars, flags, padding.

This is the Python twin of ``hls_kernels/include/smartinf_abi.h`` and ``smartinf_kernels.h``; the XRT host
(:mod:`lightning_smartinf.devices.xrt.backend`), the software pyxrt model and the C-simulation tests all use it, so
the three cannot disagree on an argument's position or a scalar's rounding.

Scalars are derived in double precision from :class:`~lightning_smartinf.core.rules.StepParams` and rounded to
fp32 once (by ``struct``/``ctypes``), where ``torch.optim`` rounds a Python float to the tensor dtype.
"""

from __future__ import annotations

import ctypes
import itertools
import struct
from dataclasses import replace
from pathlib import Path
from typing import Literal

import torch

from lightning_smartinf.core.rules import (
    FLAG_MAXIMIZE,
    FLAG_WEIGHT_DECAY,
    SGD,
    Adagrad,
    Adam,
    EFAdam,
    StepParams,
    UpdateRule,
    adam_kernel_scalars,
)
from lightning_smartinf.core.state_formats import BLOCK, FORMATS, state_format

# ---- `flags` bits (smartinf_abi.h; Adam's three are the core's) -------------------------------------------------
FLAG_MOMENTUM = 1 << 3
FLAG_FIRST_STEP = 1 << 4
FLAG_NESTEROV = 1 << 5

#: Every kernel port moves 512-bit beats; every buffer is allocated in whole beats.
BEAT_BYTES = 64

#: Kernel element type per torch dtype (gradient *and* parameter-output type of one entry point).
KERNEL_TYPES: dict[torch.dtype, str] = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
RULE_KERNELS = ("adam", "sgd", "adagrad", "efadam")
#: Scalar arguments (before ``flags``) of each rule's kernels.
SCALAR_COUNT = {"adam": 9, "sgd": 5, "adagrad": 4, "efadam": 8}
#: States after ``master`` of each rule's kernels.
STATE_PORTS = {"adam": 2, "sgd": 1, "adagrad": 1, "efadam": 1}
#: Ports of one state in each state format: an ``"int8"`` state has its codes and, in a second port, its scales.
PORTS_PER_STATE = {"fp32": 1, "bf16": 1, "int8": 2}

ArgKind = Literal["ptr", "u32", "f32"]


def padded_elems(n: int, itemsize: int) -> int:
    """``n`` rounded up to a whole 64-byte beat of ``itemsize``-byte elements (at least one beat)."""
    per_beat = BEAT_BYTES // itemsize
    return max(1, -(-n // per_beat)) * per_beat


def kernel_elems(n: int, state_precision: str) -> int:
    """Elements a kernel call over ``n`` elements touches in every port of one element per lane (master, states,
    dense gradient, parameters): whole 16-lane vectors in fp32, whole beats of a bf16 state, whole 256-element
    blocks of an int8 one (``State<S>::vecs`` in ``smartinf_kernel.h``, times 16)."""
    unit = {"fp32": 16, "bf16": 32, "int8": BLOCK}[state_format(state_precision).name]
    return max(1, -(-n // unit)) * unit


def state_port_bytes(state_precision: str, n: int) -> list[int]:
    """Bytes a kernel call over ``n`` elements touches in the port(s) of one state: the state's, or an ``"int8"``
    state's codes and then its scales in whole beats (the extents the software model checks)."""
    elems = kernel_elems(n, state_precision)
    if state_format(state_precision).name == "int8":
        return [elems, padded_elems(elems // BLOCK, 4) * 4]
    return [elems * state_format(state_precision).stored_bytes(1)]


def state_port_extents(state_precision: str, offset: int, padded: int) -> list[tuple[int, int]]:
    """``(byte offset, bytes)`` of each kernel port of one state stored at ``offset`` of a record whose tensors are
    ``padded`` elements long (a multiple of 1024, so a call over them touches the state's bytes exactly; the record's
    4 KiB alignment leaves room for an int8 state's last beat of scales)."""
    sizes = state_port_bytes(state_precision, padded)
    return list(zip(itertools.accumulate(sizes[:-1], initial=offset), sizes))


def _state_suffix(state_precision: str) -> str:
    return "" if state_precision == "fp32" else f"_state_{state_precision}"


def all_kernel_names() -> list[str]:
    """The seventy-two entry points ``smartinf_<rule>[_topk]_<T>[_state_<F>]``: four rules, dense or top-k, three
    gradient types, three state formats (fp32 state: no ``_state_`` part)."""
    return [
        f"smartinf_{rule}{'_topk' if topk else ''}_{suffix}{_state_suffix(fmt)}"
        for fmt in FORMATS
        for rule in RULE_KERNELS
        for topk in (False, True)
        for suffix in KERNEL_TYPES.values()
    ]


def rule_kernel(rule: UpdateRule) -> str:
    """``"adam"``, ``"sgd"``, ``"adagrad"`` or ``"efadam"``; ``ValueError`` for what the kernels cannot run."""
    if isinstance(rule, Adam):
        if rule.amsgrad:
            raise ValueError(
                "`Adam(amsgrad=True)` is not supported by `backend='xrt'`: the kernels in hls_kernels/ have no "
                "`max_exp_avg_sq` port. Use `amsgrad=False`, or `backend='cpu'`."
            )
        return "adam"
    if isinstance(rule, SGD):
        return "sgd"
    if isinstance(rule, Adagrad):
        return "adagrad"
    if isinstance(rule, EFAdam):
        return "efadam"
    raise ValueError(
        f"Update rule {type(rule).__name__!r} has no kernel in hls_kernels/; `backend='xrt'` runs Adam, AdamW, SGD "
        "and Adagrad. Use one of them, or `backend='cpu'`."
    )


def kernel_type(dtype: torch.dtype) -> str:
    if dtype not in KERNEL_TYPES:
        raise ValueError(
            f"dtype {dtype} has no kernel in hls_kernels/: gradients and parameters must be one of "
            f"{', '.join(map(str, KERNEL_TYPES))}."
        )
    return KERNEL_TYPES[dtype]


def kernel_name(rule: UpdateRule, dtype: torch.dtype, *, topk: bool, state_precision: str = "fp32") -> str:
    """The entry point that updates ``rule``'s state, stored in ``state_precision``, with a gradient (and parameter
    output) of ``dtype``."""
    state_format(state_precision)
    return f"smartinf_{rule_kernel(rule)}{'_topk' if topk else ''}_{kernel_type(dtype)}{_state_suffix(state_precision)}"


def parse_kernel_name(name: str) -> tuple[str, bool, str, str]:
    """``(rule, topk, type suffix, state format)`` of an entry point name; ``ValueError`` for anything else."""
    parts = name.split("_")
    fmt = "fp32"
    if len(parts) >= 5 and parts[-2] == "state" and parts[-1] in FORMATS and parts[-1] != "fp32":
        fmt, parts = parts[-1], parts[:-2]
    topk = len(parts) == 4 and parts[2] == "topk"
    shape_ok = (len(parts) == 3 or topk) and parts[0] == "smartinf"
    if shape_ok and parts[1] in RULE_KERNELS and parts[-1] in KERNEL_TYPES.values():
        return parts[1], topk, parts[-1], fmt
    raise ValueError(
        f"{name!r} is not a smartinf kernel name (smartinf_<rule>[_topk]_<type>[_state_<format>], rule one of "
        f"{RULE_KERNELS}, type one of {tuple(KERNEL_TYPES.values())}, format one of {FORMATS[1:]})."
    )


def kernel_signature(name: str) -> list[ArgKind]:
    """Argument kinds of an entry point, in order (see ``smartinf_kernels.h``)."""
    rule, topk, _, fmt = parse_kernel_name(name)
    ptrs: list[ArgKind] = ["ptr"] * (1 + STATE_PORTS[rule] * PORTS_PER_STATE[fmt] + (2 if topk else 1) + 1)
    counts: list[ArgKind] = ["u32", "u32"] if topk else ["u32"]
    return ptrs + counts + ["f32"] * SCALAR_COUNT[rule] + ["u32"]


# ---- derived scalars (mirror of smartinf_abi.h) ----------------------------------------------------------------


def adam_scalars(hp: StepParams, decoupled: bool) -> tuple[list[float], int]:
    scalars, flags = adam_kernel_scalars(hp, decoupled)
    return [hp.grad_scale, *scalars], flags


def efadam_scalars(hp: StepParams, decoupled: bool) -> tuple[list[float], int]:
    """Adam's scalars with ``beta1 = 0``, less the lerp weight: ``-lr / (1 - 0^t)`` is ``-lr``."""
    scalars, flags = adam_scalars(replace(hp, betas=(0.0, hp.betas[1])), decoupled)
    del scalars[3]  # lerp_w: no first moment
    return scalars, flags


def sgd_scalars(hp: StepParams, with_momentum: bool) -> tuple[list[float], int]:
    use_momentum = with_momentum and hp.momentum != 0.0
    scalars = [hp.grad_scale, hp.weight_decay, hp.momentum, 1.0 - hp.dampening, -hp.lr]
    flags = (FLAG_MAXIMIZE if hp.maximize else 0) | (FLAG_WEIGHT_DECAY if hp.weight_decay != 0.0 else 0)
    if use_momentum:
        flags |= FLAG_MOMENTUM | (FLAG_FIRST_STEP if hp.step == 1 else 0) | (FLAG_NESTEROV if hp.nesterov else 0)
    return scalars, flags


def adagrad_scalars(hp: StepParams) -> tuple[list[float], int]:
    clr = hp.lr / (1.0 + (hp.step - 1) * hp.lr_decay)
    scalars = [hp.grad_scale, hp.weight_decay, hp.eps, -clr]
    flags = (FLAG_MAXIMIZE if hp.maximize else 0) | (FLAG_WEIGHT_DECAY if hp.weight_decay != 0.0 else 0)
    return scalars, flags


def derive_scalars(rule: UpdateRule, hp: StepParams) -> tuple[list[float], int]:
    """The fp32 scalar arguments (as Python floats, still unrounded) and ``flags`` of one update."""
    kind = rule_kernel(rule)  # ValueError for what the kernels cannot run
    if isinstance(rule, SGD):
        return sgd_scalars(hp, rule.with_momentum)
    if isinstance(rule, EFAdam):
        return efadam_scalars(hp, rule.decoupled_weight_decay)
    if isinstance(rule, Adam):
        return adam_scalars(hp, rule.decoupled_weight_decay)
    assert kind == "adagrad"
    return adagrad_scalars(hp)


# ---- scalar encodings ------------------------------------------------------------------------------------------


def f32_arg(x: float) -> int:
    """``x`` rounded to fp32, as the signed 32-bit pattern ``pyxrt.run.set_arg`` takes for a scalar."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


def u32_arg(x: int) -> int:
    """A uint32 scalar as the signed 32-bit int ``pyxrt.run.set_arg`` takes."""
    if not 0 <= x < 1 << 32:
        raise ValueError(f"kernel scalar {x} does not fit uint32")
    return x - (1 << 32) if x >= 1 << 31 else x


def arg_to_f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<i", bits))[0]


# ---- the C-simulation library ----------------------------------------------------------------------------------


def load_csim_library(path: Path) -> ctypes.CDLL:
    """Load ``libsmartinf_kernels.so`` (``make -C hls_kernels csim``) with the argument types of every entry point."""
    cdll = ctypes.CDLL(str(path))
    ctype = {"ptr": ctypes.c_void_p, "u32": ctypes.c_uint32, "f32": ctypes.c_float}
    for name in all_kernel_names():
        fn = getattr(cdll, name)
        fn.argtypes = [ctype[kind] for kind in kernel_signature(name)]
        fn.restype = None
    return cdll
