"""A software model of the part of ``pyxrt`` the XRT backend uses, running the real kernels from their C simulation.

It exists so the XRT host code can be run and tested on machines without XRT or a SmartSSD. Its "xclbin" is a
JSON manifest (:func:`write_model_xclbin`) naming the g++ build of ``hls_kernels/``
(``build/libsmartinf_kernels.so``), the kernels the xclbin "contains", the device memory banks and the devices
of the modelled machine. Passing such a manifest as ``xclbin`` is what selects the model
(:func:`lightning_smartinf.devices.xrt.load_pyxrt`); a real ``.xclbin`` imports the real ``pyxrt``.

What is modelled, and how faithfully:

- ``device(index | "BDF")``, ``enumerate_devices()``, ``device.load_xclbin``, ``device.get_info(bdf)``.
- ``xclbin(path)`` with ``get_kernels()``/``get_mems()``/``get_uuid()``; ``kernel(device, uuid, name[, mode])``
  raises for a name the xclbin lacks, as XRT does; ``kernel.group_id(i)`` (one DDR bank, as on a SmartSSD).
- ``bo(device, size, flags, group)``: ``normal`` buffers have a host copy and a separate device copy, so a
  missing ``sync`` gives wrong results exactly as on hardware; ``p2p`` buffers are one shared memory, a
  ``mmap`` of a file in the device's DRAM directory (the PCIe BAR of the real device), that ``pread``/``pwrite``
  on the SSD's ``O_DIRECT`` file reach without a host bounce buffer. ``bo(parent, size, offset)`` sub-buffers.
  Allocation beyond the device's DDR size fails, like XRT's ``bad_alloc``.
- ``run(kernel)``, ``set_arg``, ``start``, ``wait``, and ``kernel(*args)``: the entry point of the C-simulation
  library is called through ``ctypes`` (it releases the GIL) after the model checks every buffer is large enough
  for the beats the kernel touches.
- Byte counters per device and path (:class:`PathCounters`): host→device and device→host DMA of normal buffers,
  and any host sync of a P2P buffer (state crossing the host path; the backend must never cause one).

Not modelled: timing, DMA engines, queueing of runs (``start`` runs the kernel to completion), multiple memory
banks, the actual PCIe P2P mechanics (SSD→BAR transfers are plain ``pread`` into the mapped file here).
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import hashlib
import json
import mmap
import os
import shutil
import subprocess
import tempfile
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from filelock import FileLock

from lightning_smartinf.core.io.leftovers import temporary_path
from lightning_smartinf.devices.xrt.abi import (
    KERNEL_TYPES,
    STATE_PORTS,
    all_kernel_names,
    arg_to_f32,
    kernel_elems,
    kernel_signature,
    load_csim_library,
    padded_elems,
    parse_kernel_name,
    state_port_bytes,
)

#: ``format`` of a model xclbin manifest.
MODEL_FORMAT = "lightning_smartinf.xrt-model/1"
#: DDR of one SmartSSD (KU15P card): 4 GiB.
SMARTSSD_DDR_BYTES = 4 << 30
SMARTSSD_PLATFORM = "xilinx_u2_gen3x4_xdma_gc_2_202110_1"
_ITEMSIZE = {name: dtype.itemsize for dtype, name in KERNEL_TYPES.items()}
HLS_DIR = Path(__file__).resolve().parents[3] / "hls_kernels"


# ------------------------------------------------------------------------------------------------- manifests


def write_model_xclbin(
    path: Path,
    library: Path,
    *,
    kernels: Sequence[str] | None = None,
    devices: int | Sequence[str] = 1,
    ddr_bytes: int = SMARTSSD_DDR_BYTES,
    dram_root: Path | None = None,
) -> Path:
    """Write a model "xclbin": a JSON manifest the software pyxrt model loads in place of a device binary.

    Args:
        path: where to write it (must end in ``.json``).
        library: the C-simulation build of ``hls_kernels/`` (``make -C hls_kernels csim``).
        kernels: entry points the xclbin contains (default: all of them,
            :func:`~lightning_smartinf.devices.xrt.abi.all_kernel_names`).
        devices: number of modelled SmartSSDs, or their PCIe BDFs (default BDFs ``0000:<i+1>:00.1``).
        ddr_bytes: device memory (one DDR bank) of each device.
        dram_root: where the files backing P2P buffers live (default: a fresh temporary directory per device).
    """
    path = Path(path)
    if path.suffix != ".json":
        raise ValueError(f"A model xclbin manifest must end in `.json`, got {str(path)!r}.")
    names = list(kernels) if kernels is not None else all_kernel_names()
    for name in names:
        parse_kernel_name(name)
    bdfs = [f"0000:{i + 1:02x}:00.1" for i in range(devices)] if isinstance(devices, int) else list(devices)
    manifest = {
        "format": MODEL_FORMAT,
        "platform": SMARTSSD_PLATFORM,
        "library": str(Path(library).resolve()),
        "kernels": names,
        "mems": [{"tag": "DDR[0]", "size_kb": ddr_bytes // 1024, "used": True}],
        "devices": [{"bdf": bdf} for bdf in bdfs],
        "dram_root": str(dram_root) if dram_root is not None else None,
    }
    path.write_text(json.dumps(manifest, indent=1))
    return path


def is_model_xclbin(path: Path | str) -> bool:
    """Whether ``path`` is a model manifest (a ``.json`` file whose ``format`` is :data:`MODEL_FORMAT`)."""
    path = Path(path)
    if path.suffix != ".json" or not path.is_file():
        return False
    try:
        return json.loads(path.read_text()).get("format") == MODEL_FORMAT
    except (ValueError, UnicodeDecodeError, AttributeError):
        return False


def csim_library_path(hls_dir: Path = HLS_DIR) -> Path:
    """Where ``make -C hls_kernels csim`` puts the library that matches torch's arithmetic on this CPU.

    torch's vectorised CPU kernels fuse ``a*b+c``; only its non-vectorised DEFAULT path does not, and the kernels
    are then built with ``-DSMARTINF_TORCH_FMA=0`` (see ``hls_kernels/README.md``, "Exactness").
    """
    import torch

    fma = torch.backends.cpu.get_cpu_capability().upper() != "DEFAULT"
    return hls_dir / ("build" if fma else "build/nofma") / "libsmartinf_kernels.so"


def build_csim_library(hls_dir: Path = HLS_DIR) -> Path:
    """Build (``make csim``, incremental) and return the C-simulation library; ``RuntimeError`` if it fails."""
    missing = [tool for tool in ("make", "g++") if shutil.which(tool) is None]
    if missing:
        raise RuntimeError(f"Building the HLS C simulation needs {' and '.join(missing)} on PATH.")
    library = csim_library_path(hls_dir)
    args = [] if library.parent.name == "build" else ["CSIM_DIR=build/nofma", "CSIM_DEFINES=-DSMARTINF_TORCH_FMA=0"]
    library.parent.mkdir(parents=True, exist_ok=True)
    # One build at a time into a directory (processes of a parallel test run build the same one).
    with FileLock(str(library.parent / ".build.lock"), thread_local=False):
        proc = subprocess.run(
            ["make", "-C", str(hls_dir), "csim", *args], capture_output=True, text=True, timeout=600, check=False
        )
    if proc.returncode != 0:
        raise RuntimeError(f"`make -C {hls_dir} csim` failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return library


# ------------------------------------------------------------------------------------------------- counters


@dataclass
class PathCounters:
    """Bytes one modelled device moved, per path.

    Attributes:
        host_to_device_bytes: DMA of normal buffers, host memory → device DDR (``sync`` to device).
        device_to_host_bytes: DMA of normal buffers, device DDR → host memory (``sync`` from device).
        p2p_host_sync_bytes: ``sync`` of P2P buffers, i.e. bytes the host asked to move over its own path for a
            buffer that should only be reached by the SSD; the XRT backend keeps this at zero.
        kernel_runs: completed kernel executions.
    """

    host_to_device_bytes: int = 0
    device_to_host_bytes: int = 0
    p2p_host_sync_bytes: int = 0
    kernel_runs: int = 0


class xclBOSyncDirection(enum.Enum):  # noqa: N801 - pyxrt's spelling
    XCL_BO_SYNC_BO_TO_DEVICE = 0
    XCL_BO_SYNC_BO_FROM_DEVICE = 1


class ert_cmd_state(enum.Enum):  # noqa: N801 - pyxrt's spelling
    ERT_CMD_STATE_NEW = 1
    ERT_CMD_STATE_COMPLETED = 4
    ERT_CMD_STATE_ERROR = 5


class xrt_info_device(enum.Enum):  # noqa: N801 - pyxrt's spelling
    bdf = 0


class _BoFlags(enum.Enum):
    normal = 0
    p2p = 1 << 30


class _CuAccessMode(enum.Enum):
    shared = 1


# ------------------------------------------------------------------------------------------------- the model


class _DeviceState:
    """One modelled SmartSSD FPGA: DDR accounting, the directory of P2P backing files, counters."""

    def __init__(self, index: int, bdf: str, ddr_bytes: int, dram_root: Path | None) -> None:
        self.index = index
        self.bdf = bdf
        self.ddr_bytes = ddr_bytes
        if dram_root is not None:
            Path(dram_root).mkdir(parents=True, exist_ok=True)
        self.dram_dir = temporary_path(Path(dram_root or tempfile.gettempdir()) / f"smartinf-xrt-dev{index}", "run")
        self.dram_dir.mkdir(mode=0o700)
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.dram_dir), True)
        self.ddr_used = 0
        self.counters = PathCounters()
        self.lock = threading.Lock()
        self.xclbin: Any = None
        self._next_bo = 0

    def reserve(self, size: int) -> int:
        with self.lock:
            if self.ddr_used + size > self.ddr_bytes:
                raise RuntimeError(
                    f"bad_alloc: cannot allocate a {size} B buffer on device {self.index} ({self.bdf}): "
                    f"{self.ddr_used} of {self.ddr_bytes} B of DDR in use"
                )
            self.ddr_used += size
            self._next_bo += 1
            return self._next_bo

    def release(self, size: int) -> None:
        with self.lock:
            self.ddr_used -= size

    def count(self, **nbytes: int) -> None:
        with self.lock:
            for name, n in nbytes.items():
                setattr(self.counters, name, getattr(self.counters, name) + n)


def _aligned_bytes(size: int) -> np.ndarray:
    """``size`` zero bytes on a 4096-byte boundary (XRT buffers are page aligned)."""
    raw = np.zeros(size + 4096, dtype=np.uint8)
    shift = (-raw.ctypes.data) % 4096
    return raw[shift : shift + size]


class _P2PMemory:
    """A file in the device's DRAM directory, mapped shared: what the host and the SSD see of a P2P buffer."""

    def __init__(self, state: _DeviceState, bo_id: int, size: int) -> None:
        self.path = state.dram_dir / f"p2p-bo{bo_id}.mem"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self.mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self.mmap, dtype=np.uint8)

    def close(self) -> None:
        self.array = None  # type: ignore[assignment]  # drop the export before closing the map
        with contextlib.suppress(BufferError):
            self.mmap.close()
        self.path.unlink(missing_ok=True)


class SoftwarePyxrt:
    """The model, shaped like the ``pyxrt`` module: ``device``, ``xclbin``, ``kernel``, ``bo``, ``run`` and enums.

    One instance stands for one machine described by a manifest; :func:`platform_for` returns the same instance
    for the same manifest, so tests can read the counters of the devices a backend used.
    """

    def __init__(self, manifest_path: Path) -> None:
        self.manifest_path = Path(manifest_path)
        manifest = _read_manifest(self.manifest_path)
        ddr = sum(int(m["size_kb"]) * 1024 for m in manifest["mems"] if m.get("used", True))
        root = manifest.get("dram_root")
        self._states = [
            _DeviceState(i, d["bdf"], ddr, Path(root) if root else None) for i, d in enumerate(manifest["devices"])
        ]
        self._library_path = Path(manifest["library"])
        self._library: ctypes.CDLL | None = None
        self._library_lock = threading.Lock()
        self.xclBOSyncDirection = xclBOSyncDirection
        self.ert_cmd_state = ert_cmd_state
        self.xrt_info_device = xrt_info_device
        self.device = type("device", (_Device,), {"_platform": self})
        self.xclbin = type("xclbin", (_Xclbin,), {"_platform": self})
        self.kernel = type("kernel", (_Kernel,), {"_platform": self, "shared": _CuAccessMode.shared})
        self.bo = type(
            "bo", (_Bo,), {"_platform": self, "flags": _BoFlags, "normal": _BoFlags.normal, "p2p": _BoFlags.p2p}
        )
        self.run = type("run", (_Run,), {"_platform": self})

    def __repr__(self) -> str:
        return f"SoftwarePyxrt({str(self.manifest_path)!r}, devices={len(self._states)})"

    def enumerate_devices(self) -> int:
        return len(self._states)

    def counters(self, index: int) -> PathCounters:
        """A copy of the byte counters of device ``index``."""
        state = self._states[index]
        with state.lock:
            return PathCounters(**vars(state.counters))

    def device_state(self, index: int) -> _DeviceState:
        return self._states[index]

    def library(self) -> ctypes.CDLL:
        with self._library_lock:
            if self._library is None:
                if not self._library_path.is_file():
                    raise RuntimeError(
                        f"The model xclbin {str(self.manifest_path)!r} names the C-simulation library "
                        f"{str(self._library_path)!r}, which does not exist. Build it with `make -C hls_kernels csim`."
                    )
                self._library = load_csim_library(self._library_path)
            return self._library


def _read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads(Path(path).read_text())
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise RuntimeError(f"Cannot read the model xclbin {str(path)!r}: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MODEL_FORMAT:
        raise RuntimeError(f"{str(path)!r} is not a model xclbin (format {MODEL_FORMAT!r}).")
    return manifest


_PLATFORMS: dict[Path, SoftwarePyxrt] = {}
_PLATFORMS_LOCK = threading.Lock()


def platform_for(manifest_path: Path | str) -> SoftwarePyxrt:
    """The model machine of a manifest (one instance per resolved path, created on first use)."""
    key = Path(manifest_path).resolve()
    with _PLATFORMS_LOCK:
        if key not in _PLATFORMS:
            _PLATFORMS[key] = SoftwarePyxrt(key)
        return _PLATFORMS[key]


def forget_platform(manifest_path: Path | str) -> None:
    """Drop the cached model machine of a manifest (its P2P backing files go with the last reference)."""
    with _PLATFORMS_LOCK:
        _PLATFORMS.pop(Path(manifest_path).resolve(), None)


class _Device:
    _platform: SoftwarePyxrt

    def __init__(self, ident: int | str = 0) -> None:
        states = self._platform._states
        if isinstance(ident, str):
            found = [s for s in states if s.bdf == ident]
            if not found:
                raise RuntimeError(f"No device with BDF '{ident}' (the model has {[s.bdf for s in states]})")
            self._state = found[0]
        else:
            if not 0 <= ident < len(states):
                raise RuntimeError(f"Could not open device with index '{ident}' (the model has {len(states)})")
            self._state = states[ident]

    def load_xclbin(self, xclbin: _Xclbin | str) -> _Uuid:
        xbin = xclbin if isinstance(xclbin, _Xclbin) else self._platform.xclbin(xclbin)
        self._state.xclbin = xbin
        return xbin.get_uuid()

    def get_info(self, key: xrt_info_device) -> str:
        return self._state.bdf  # the one key the model has (``xrt_info_device.bdf``)


@dataclass(frozen=True)
class _Uuid:
    _text: str

    def to_string(self) -> str:
        return self._text


class _Named:
    def __init__(self, name: str) -> None:
        self._name = name

    def get_name(self) -> str:
        return self._name


class _Mem:
    def __init__(self, entry: dict) -> None:
        self._entry = entry

    def get_size_kb(self) -> int:
        return int(self._entry["size_kb"])

    def get_used(self) -> bool:
        return bool(self._entry.get("used", True))


class _Xclbin:
    _platform: SoftwarePyxrt

    def __init__(self, filename: str) -> None:
        manifest = _read_manifest(Path(filename))
        self._kernels = list(manifest["kernels"])
        self._mems = list(manifest["mems"])
        self._uuid = _Uuid(hashlib.sha256(Path(filename).read_bytes()).hexdigest()[:32])

    def get_kernels(self) -> list[_Named]:
        return [_Named(name) for name in self._kernels]

    def get_mems(self) -> list[_Mem]:
        return [_Mem(m) for m in self._mems]

    def get_uuid(self) -> _Uuid:
        return self._uuid


class _Kernel:
    _platform: SoftwarePyxrt

    def __init__(self, device: _Device, uuid: _Uuid, name: str, mode: _CuAccessMode = _CuAccessMode.shared) -> None:
        xbin = device._state.xclbin
        if xbin is None or xbin.get_uuid() != uuid:
            raise RuntimeError(f"No xclbin with uuid {uuid.to_string()} is loaded on device {device._state.index}")
        if name not in xbin._kernels:
            raise RuntimeError(f"No such compute unit '{name}' in the xclbin (it has {', '.join(xbin._kernels)})")
        self.name = name
        self.device = device
        self.signature = kernel_signature(name)

    def group_id(self, arg: int) -> int:
        if not 0 <= arg < len(self.signature) or self.signature[arg] != "ptr":
            raise RuntimeError(f"Kernel '{self.name}' argument {arg} is not a global memory argument")
        return 0  # one DDR bank on a SmartSSD

    def __call__(self, *args: Any) -> _Run:
        run = self._platform.run(self)
        for i, arg in enumerate(args):
            run.set_arg(i, arg)
        run.start()
        return run


class _Bo:
    _platform: SoftwarePyxrt

    def __init__(self, owner: Any, size: int, flags_or_offset: Any = _BoFlags.normal, group: int = 0) -> None:
        if isinstance(owner, _Bo):  # sub-buffer: bo(parent, size, offset)
            offset = int(flags_or_offset)
            if offset < 0 or offset + size > owner._size:
                raise RuntimeError(f"sub-buffer [{offset}, {offset + size}) outside its {owner._size} B parent")
            self._root: _Bo = owner._root
            self._offset = owner._offset + offset
            self._size = size
            self._state = owner._state
            return
        if not isinstance(owner, _Device):
            raise TypeError("bo(device, size, flags, group) or bo(parent, size, offset)")
        if size <= 0:
            raise RuntimeError(f"cannot allocate a buffer of {size} B")
        self._state = owner._state
        self._root, self._offset, self._size = self, 0, size
        self._flags = flags_or_offset
        bo_id = self._state.reserve(size)
        if self._flags == _BoFlags.p2p:
            self._p2p: _P2PMemory | None = _P2PMemory(self._state, bo_id, size)
            self._host = self._device = self._p2p.array  # one memory: the BAR *is* device DDR
            finalizer_args: tuple = (self._p2p.close,)
        else:
            self._p2p = None
            self._host = _aligned_bytes(size)
            self._device = _aligned_bytes(size)
            finalizer_args = ()
        weakref.finalize(self, _free, self._state, size, *finalizer_args)

    @property
    def is_p2p(self) -> bool:
        return self._root._p2p is not None

    @property
    def backing_file(self) -> Path | None:
        """The file behind a P2P buffer (model only)."""
        return self._root._p2p.path if self._root._p2p is not None else None

    def size(self) -> int:
        return self._size

    def address(self) -> int:
        return int(self._root._device.ctypes.data) + self._offset

    def map(self) -> memoryview:
        return memoryview(self._root._host[self._offset : self._offset + self._size])

    def sync(self, direction: xclBOSyncDirection, size: int | None = None, offset: int = 0) -> None:
        size = self._size - offset if size is None else size
        if offset < 0 or size < 0 or offset + size > self._size:
            raise RuntimeError(f"transfer [{offset}, {offset + size}) outside the {self._size} B buffer")
        if self.is_p2p:
            self._state.count(p2p_host_sync_bytes=size)
            return
        lo, hi = self._offset + offset, self._offset + offset + size
        if direction == xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE:
            self._root._device[lo:hi] = self._root._host[lo:hi]
            self._state.count(host_to_device_bytes=size)
        else:
            self._root._host[lo:hi] = self._root._device[lo:hi]
            self._state.count(device_to_host_bytes=size)


def _free(state: _DeviceState, size: int, *closers: Any) -> None:
    for close in closers:
        close()
    state.release(size)


class _Run:
    _platform: SoftwarePyxrt

    def __init__(self, kernel: _Kernel) -> None:
        self._kernel = kernel
        self._args: dict[int, Any] = {}
        self._state = ert_cmd_state.ERT_CMD_STATE_NEW

    def set_arg(self, index: int, value: Any) -> None:
        signature = self._kernel.signature
        if not 0 <= index < len(signature):
            raise RuntimeError(f"Kernel '{self._kernel.name}' has no argument {index}")
        if (signature[index] == "ptr") != isinstance(value, _Bo):
            raise TypeError(f"argument {index} of '{self._kernel.name}' takes a {signature[index]}, got {value!r}")
        if isinstance(value, _Bo) and value._state is not self._kernel.device._state:
            raise RuntimeError(f"argument {index}: buffer belongs to another device")
        if not isinstance(value, _Bo) and not -(1 << 31) <= int(value) < 1 << 31:
            raise TypeError(f"argument {index}: scalar {value} does not fit a 32-bit int")
        self._args[index] = value

    def start(self) -> None:
        kernel, signature = self._kernel, self._kernel.signature
        missing = [i for i in range(len(signature)) if i not in self._args]
        if missing:
            raise RuntimeError(f"Kernel '{kernel.name}': arguments {missing} were not set")
        self._check_extents()
        call: list[Any] = []
        for i, kind in enumerate(signature):
            value = self._args[i]
            if kind == "ptr":
                call.append(value.address())
            elif kind == "u32":
                call.append(int(value) & 0xFFFFFFFF)
            else:
                call.append(arg_to_f32(int(value)))
        try:
            getattr(self._platform.library(), kernel.name)(*call)
        except BaseException:
            self._state = ert_cmd_state.ERT_CMD_STATE_ERROR
            raise
        self._state = ert_cmd_state.ERT_CMD_STATE_COMPLETED
        kernel.device._state.count(kernel_runs=1)

    def _check_extents(self) -> None:
        """Every buffer must hold the whole beats the kernel touches (see hls_kernels/README.md, "Buffers")."""
        rule, topk, suffix, fmt = parse_kernel_name(self._kernel.name)
        itemsize = _ITEMSIZE[suffix]
        ptrs = [i for i, kind in enumerate(self._kernel.signature) if kind == "ptr"]
        n = int(self._args[len(ptrs)]) & 0xFFFFFFFF
        k = int(self._args[len(ptrs) + 1]) & 0xFFFFFFFF if topk else 0
        flags = int(self._args[len(self._kernel.signature) - 1])
        elems = kernel_elems(n, fmt)
        states = STATE_PORTS[rule] * state_port_bytes(fmt, n)
        if rule == "sgd" and not flags & (1 << 3):
            states = [0] * len(states)  # no momentum buffer: the kernel never touches it
        needs = [elems * 4, *states]
        needs += (
            [padded_elems(k, 4) * 4, padded_elems(k, itemsize) * itemsize]
            if topk
            else [padded_elems(elems, itemsize) * itemsize]
        )
        needs.append(padded_elems(elems, itemsize) * itemsize)  # param_out
        assert len(needs) == len(ptrs)
        for i, need in zip(ptrs, needs):
            if self._args[i].size() < need:
                raise RuntimeError(
                    f"Kernel '{self._kernel.name}' argument {i}: buffer of {self._args[i].size()} B, the kernel "
                    f"touches {need} B (n={n}, k={k})"
                )

    def wait(self, timeout_ms: int = 0) -> ert_cmd_state:
        return self._state
