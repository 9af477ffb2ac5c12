"""Kernels in C for host cores, built with the system's C compiler on first use and loaded with :mod:`ctypes`.

Each kernel gives the bytes of its plain-torch reference bit for bit (its tests compare them); it exists because the
reference takes several passes over memory where one does. Without a C compiler the reference runs instead (the
same bytes, slower), and :func:`state_format_kernels` says why once.

A library is built once per machine into :func:`kernels_dir` (``$SMARTINF_KERNELS_DIR``, by default
``$XDG_CACHE_HOME/lightning_smartinf/kernels``), named by a hash of its source, the compiler and its flags; a build
is written beside its final name and renamed into place, so processes building at once never load half a file.
The C functions take raw pointers; ctypes releases the GIL around each call, so device workers run them at once.

``set-up`` (``scripts/setup.sh``) builds them; ``python -m lightning_smartinf.core.native`` builds them and prints
where.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from importlib import resources
from pathlib import Path

from lightning_smartinf.core.io.leftovers import remove_entry, remove_leftovers, temporary_path
from lightning_smartinf.core.renamed import old_names

__all__ = [
    "KernelBuildError",
    "build",
    "compiler_flags",
    "kernels_dir",
    "state_format_kernels",
    "sum_squares_kernels",
]

log = logging.getLogger(__name__)


def compiler_flags(machine: str) -> tuple[str, ...]:
    """Flags of every build on a CPU of architecture ``machine`` (``platform.machine()``): fast, for this machine's CPU
    (its vector units; on x86 at their full width where it has AVX-512, which compilers otherwise use at half width:
    the "int8" Adam kernel ran 10-17% faster so; the flag exists only on x86), position-independent, and no
    contraction of a multiplication and an addition into one rounding (the references round each operation). The
    width changes how many elements an instruction takes, never an element's operations: the bytes stay the same. The
    library's name changes with the CPU's features, so a home directory shared by other machines never loads
    another's."""
    x86 = machine.lower() in ("x86_64", "amd64", "i386", "i686")
    wide = ("-mprefer-vector-width=512",) if x86 else ()
    return ("-O3", "-march=native", *wide, "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno", "-std=c99")


#: This machine's build flags (:func:`compiler_flags`).
CFLAGS = compiler_flags(platform.machine())


class KernelBuildError(RuntimeError):
    """A kernel library could not be built (no compiler, or the compiler failed)."""


def kernels_dir() -> Path:
    """Where the kernel libraries are built: ``$SMARTINF_KERNELS_DIR``, else
    ``$XDG_CACHE_HOME/lightning_smartinf/kernels`` (by default under ``~/.cache``)."""
    if os.environ.get("SMARTINF_KERNELS_DIR"):
        return Path(os.environ["SMARTINF_KERNELS_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lightning_smartinf" / "kernels"


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise KernelBuildError("no C compiler on PATH (cc, gcc or clang; or set CC): `apt-get install gcc`")


def _cpu_features() -> bytes:
    """What ``-march=native`` builds for: the CPU's feature flags (Linux), else its name."""
    try:
        with open("/proc/cpuinfo", "rb") as info:
            for line in info:
                if line.startswith((b"flags", b"Features")):
                    return line
    except OSError:
        pass
    return platform.processor().encode()


def build(name: str) -> Path:
    """The library of kernel ``name`` (``<name>.c`` in this package), built if this machine has not built it yet."""
    source = resources.files(__package__).joinpath(f"{name}.c").read_bytes()
    compiler = _compiler()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"`{compiler} --version` failed: {exc}") from exc
    identity = [source, version, " ".join(CFLAGS).encode(), platform.machine().encode(), _cpu_features()]
    key = hashlib.sha256(b"\0".join(identity))
    library = kernels_dir() / f"{name}-{key.hexdigest()[:16]}.so"
    remove_leftovers(library.parent)  # what builds killed midway left (their process is gone)
    if library.is_file():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    staged = temporary_path(library)
    source_file = temporary_path(library.with_suffix(".c"))
    try:
        source_file.write_bytes(source)
        compiled = subprocess.run(
            [compiler, *CFLAGS, "-x", "c", str(source_file), "-o", str(staged), "-lm"],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if compiled.returncode != 0:
            raise KernelBuildError(f"`{compiler}` failed to build {name}.c:\n{compiled.stderr[-4000:]}")
        os.replace(staged, library)  # whole, or not there: a process building at once replaces it with the same
    finally:
        remove_entry(source_file, missing_ok=True)
        remove_entry(staged, missing_ok=True)
    return library


def _load(name: str, without: str, argtypes: dict[str, list]) -> ctypes.CDLL | None:
    """Kernel library ``name`` with the argument types of its kernels (none returns a value), or ``None`` where it
    cannot be built, said with ``without`` (what runs instead)."""
    try:
        library = ctypes.CDLL(str(build(name)))
    except (KernelBuildError, OSError) as exc:
        log.warning("%s: its C kernels did not build here (%s).", without, exc)
        return None
    for kernel_name, types in argtypes.items():
        kernel = getattr(library, kernel_name)
        kernel.argtypes = types
        kernel.restype = None
    return library


@functools.cache
def state_format_kernels() -> ctypes.CDLL | None:
    """The state formats' kernels (``state_formats.c``: the ``"int8"`` conversions, Adam fused with ``"int8"`` and
    ``"bf16"``, split masters' conversions), or ``None`` (said once) where they cannot be built: the plain-torch
    reference then runs."""
    f32, u8, u16 = (ctypes.POINTER(t) for t in (ctypes.c_float, ctypes.c_uint8, ctypes.c_uint16))
    i64 = ctypes.c_int64
    # The gradient of the Adam kernels: fp32 or (when that is NULL) bf16, and the factor it is multiplied by.
    grad = [f32, u16, ctypes.c_float]
    # After the gradient, in "int8": n, padded, exp_avg's codes and scales, exp_avg_sq's codes and scales, scalars,
    # flags; in "bf16": n, exp_avg, exp_avg_sq, scalars, flags.
    int8_states = [i64, i64, u8, f32, u8, f32, f32, ctypes.c_int]
    bf16_states = [i64, u16, u16, f32, ctypes.c_int]
    argtypes = {
        "smartinf_int8_store": [f32, i64, ctypes.c_int, u8, f32],
        "smartinf_int8_load": [u8, f32, i64, ctypes.c_int, f32],
        # Whole masters first: the masters and the parameters written (or NULL).
        "smartinf_adam_int8": [f32, u16, *grad, *int8_states],
        "smartinf_adam_bf16": [f32, u16, *grad, *bf16_states],
        # split masters: masters, n, low halves, carry bits, parameters; parameters, low halves, carry bits, n,
        # masters, aside
        "smartinf_split_encode": [f32, i64, u16, u8, u16],
        "smartinf_split_decode": [u16, u16, u8, i64, f32, u16],
        # Adam over split masters first: parameters, low halves, carry bits, aside.
        "smartinf_adam_int8_split": [u16, u16, u8, u16, *grad, *int8_states],
        "smartinf_adam_bf16_split": [u16, u16, u8, u16, *grad, *bf16_states],
    }
    without = "The optimizer state's formats run their slower plain-torch reference (the same bytes)"
    return _load("state_formats", without, argtypes)


@functools.cache
def sum_squares_kernels() -> ctypes.CDLL | None:
    """The float64 sums of squares of a gradient's norm (``sum_squares.c``), or ``None`` (said once) where they cannot
    be built: the plain-torch reference then runs."""
    without = "Gradient norms are taken by their slower plain-torch reference (the same bytes)"
    args = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]  # values, their number, the lanes
    return _load("sum_squares", without, {"smartinf_sum_squares_f32": args, "smartinf_sum_squares_bf16": args})


__getattr__ = old_names(__name__, {"int8_kernels": "state_format_kernels"})
