"""The ``xrt`` backend: Samsung SmartSSDs driven through XRT's Python bindings (``pyxrt``), running ``hls_kernels/``.

Per SmartSSD (one per storage path) the host opens ``pyxrt.device``, loads the xclbin and keeps a fixed set of
device buffers, allocated once at :meth:`XrtBackend.open`:

- ``buffer_count`` **P2P** record buffers (``bo.flags.p2p``), each one chunk record ``[master | states]`` of the
  on-disk layout. The SSD's ``O_DIRECT`` state file is ``pread`` into, and ``pwrite`` from, the buffer's host
  mapping, which is the FPGA's PCIe BAR: the NVMe controller moves the state to and from FPGA DDR without a host
  bounce buffer, so the state never crosses the shared link. The kernel's master and state ports are sub-buffers
  of the record.
- three normal buffers for the link: the gradient (or top-k values), the top-k indices and the parameter output,
  synced to and from the device per chunk.

The chunk pipeline (read-ahead, update, write-behind, per-chunk write ordering, the buffer pool as back-pressure)
is the streaming device's, :class:`~lightning_smartinf.core.streaming.backend.StreamingDevice`, as for the CPU backend;
only the buffers and the update step differ: it runs the kernel instead of :meth:`UpdateRule.apply`.

Kernel type: each entry point takes the gradient and writes the parameters in one type T. T is the link dtype when
it equals the output dtype (always the case under the strategy: both are the training precision); otherwise the
fp32 kernel runs, the gradient is widened on the host (exact) and the parameters are rounded on the host
(bit-identical to the kernel's own rounding) -- and the link then carries 4 B per element, which the traffic
counters report.

Traffic: ``link_*`` counts what crosses the host link (for the strategy's path exactly what the CPU backend counts:
the gradient in the link dtype or ``SparseGrad.link_bytes``, the parameters in their dtype; :meth:`initialize`
writes whole fp32 records through the BAR and counts them); ``storage_*`` counts state bytes on the
device-internal SSD <-> FPGA path only.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_smartinf.core.arguments import MIB
from lightning_smartinf.core.backend import ShardSpec
from lightning_smartinf.core.compression import SparseGrad
from lightning_smartinf.core.format.layout import pool_bytes
from lightning_smartinf.core.io.direct import ThreadedIO
from lightning_smartinf.core.io.storage import GIB
from lightning_smartinf.core.rules import StepParams
from lightning_smartinf.core.streaming.backend import StreamingBackend
from lightning_smartinf.core.streaming.device import StreamingDevice, link_bytes
from lightning_smartinf.core.streaming.pipeline import ChunkWork, Shard
from lightning_smartinf.core.traffic import Traffic
from lightning_smartinf.devices.xrt.abi import (
    derive_scalars,
    f32_arg,
    kernel_name,
    kernel_type,
    padded_elems,
    parse_kernel_name,
    rule_kernel,
    state_port_extents,
    u32_arg,
)
from lightning_smartinf.devices.xrt.software_xrt import SoftwarePyxrt, is_model_xclbin, platform_for

_BDF = re.compile(r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")
#: Normal (host-synced) buffers per device: gradient or top-k values, top-k indices, parameter output.
STAGING_BUFFERS = 3

_INSTALL_HINT = (
    "Install XRT (https://xilinx.github.io/XRT/, the `xrt` package for your distribution, 2.12 or later) and run "
    "`source /opt/xilinx/xrt/setup.sh` in this shell so `import pyxrt` works. To run without XRT, pass a model "
    "xclbin (`lightning_smartinf.devices.xrt.write_model_xclbin`, see docs/smartssd.md)."
)


# ---------------------------------------------------------------------------------------------- settings


def check_xrt_settings(
    xclbin: str | os.PathLike | None,
    xrt_devices: Sequence[int | str] | None,
    storage_paths: Sequence[str | os.PathLike] | None,
) -> Path:
    """Check the ``backend='xrt'`` arguments without touching XRT; return the xclbin path.

    Raises:
        FileNotFoundError: ``xclbin`` does not exist.
        ValueError: any other bad value; the message names the argument, the value, what is allowed and the fix.
    """
    if xclbin is None:
        raise ValueError(
            "`xclbin=None`: `backend='xrt'` needs the device binary. Pass `xclbin=` the `.xclbin` built with "
            "`make -C hls_kernels xclbin` (or a model manifest from `write_model_xclbin` to run without hardware)."
        )
    path = Path(xclbin)
    if not path.is_file():
        raise FileNotFoundError(
            f"`xclbin={str(xclbin)!r}` does not exist or is not a file. Build it with `make -C hls_kernels xclbin` "
            "(it lands in hls_kernels/build_dir.hw/smartinf.xclbin) and pass that path."
        )
    if path.suffix != ".xclbin" and not is_model_xclbin(path):
        raise ValueError(
            f"`xclbin={str(xclbin)!r}` is neither an `.xclbin` file nor a model manifest (a `.json` written by "
            "`write_model_xclbin`). Pass the `.xclbin` built from hls_kernels/."
        )
    if xrt_devices is not None:
        if not isinstance(xrt_devices, (list, tuple)) or not xrt_devices:
            raise ValueError(f"`xrt_devices={xrt_devices!r}` must be a non-empty list of device indices or BDFs.")
        for ident in xrt_devices:
            if isinstance(ident, bool) or not (
                (isinstance(ident, int) and ident >= 0) or (isinstance(ident, str) and _BDF.match(ident))
            ):
                raise ValueError(
                    f"`xrt_devices` entry {ident!r} is neither a device index (int >= 0) nor a PCIe BDF like "
                    "'0000:3b:00.1'. List the SmartSSD FPGAs with `xbutil examine`."
                )
        if len(set(map(str, xrt_devices))) != len(xrt_devices):
            raise ValueError(f"`xrt_devices={list(xrt_devices)!r}` names a device twice; each path needs its own.")
        paths = 1 if storage_paths is None else len(storage_paths)
        if paths != len(xrt_devices):
            raise ValueError(
                f"`xrt_devices={list(xrt_devices)!r}` names {len(xrt_devices)} device(s) for {paths} storage "
                f"path(s) (`storage_paths={None if storage_paths is None else [str(p) for p in storage_paths]!r}`): "
                "each storage path is the SSD of one SmartSSD, so the lists must pair up one to one. Pass one "
                "device per storage path, or `xrt_devices=None` to pair them by PCIe topology."
            )
    return path


def load_pyxrt(xclbin: str | os.PathLike) -> Any:
    """The ``pyxrt`` to use for ``xclbin``: the software model for a model manifest, else the real module.

    Raises:
        RuntimeError: the real ``pyxrt`` cannot be imported (with how to install XRT).
    """
    if is_model_xclbin(xclbin):
        return platform_for(xclbin)
    try:
        import pyxrt  # noqa: PLC0415 - ships with XRT, not on PyPI: imported only when a real xclbin is used
    except ImportError as exc:
        raise RuntimeError(
            f"`backend='xrt'` with `xclbin={str(xclbin)!r}` cannot import `pyxrt` ({exc}). {_INSTALL_HINT}"
        ) from None
    return pyxrt


# ---------------------------------------------------------------------------------------------- device pairing


def _switch(sysfs_path: Path) -> Path | None:
    """The PCI device two levels above the nearest one on the way from the root complex to ``sysfs_path`` (where a
    SmartSSD's switch has its upstream port), or ``None``."""
    chain = [p for p in reversed([sysfs_path, *sysfs_path.parents]) if _BDF.match(p.name)]  # nearest last
    return chain[-3] if len(chain) >= 3 else None


def pair_by_pcie(storage_paths: Sequence[Path], bdfs: Sequence[str], sysfs: Path = Path("/sys")) -> list[str]:
    """For each storage path, the BDF (of ``bdfs``) of the FPGA on the same SmartSSD.

    A SmartSSD is a PCIe switch with the NVMe SSD behind one downstream port and the FPGA behind another, so the
    SSD's controller and the FPGA share the switch's upstream port, two levels up from each endpoint. The SSD of a
    path is found from the path's block device (``/sys/dev/block/MAJ:MIN``).

    Raises:
        ValueError: a path's SSD is not behind a switch with exactly one of ``bdfs``.
    """
    fpga_switch = {bdf: _switch((sysfs / "bus" / "pci" / "devices" / bdf).resolve()) for bdf in bdfs}
    paired = []
    for path in storage_paths:
        st = os.stat(path)
        block = (sysfs / "dev" / "block" / f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}").resolve()
        switch = _switch(block)
        found = [bdf for bdf, s in fpga_switch.items() if switch is not None and s == switch]
        if len(found) != 1:
            raise ValueError(
                f"Cannot pair storage path {str(path)!r} (block device {block}) with a SmartSSD FPGA: "
                f"{len(found)} of the XRT devices {list(bdfs)} sit behind its PCIe switch. Pass `xrt_devices=` "
                "explicitly, one BDF per storage path (see `xbutil examine` and `lspci -tv`)."
            )
        paired.append(found[0])
    return paired


# ---------------------------------------------------------------------------------------------- the device


class XrtDevice(StreamingDevice):
    """One SmartSSD: the streaming chunk pipeline, with P2P record buffers and the update run by a kernel."""

    def __init__(
        self,
        index: int,
        directory: Path,
        traffic: Traffic,
        *,
        chunk_elems: int,
        buffer_count: int,
        pyxrt: Any,
        handle: Any,
        uuid: Any,
        kernel_names: frozenset[str],
        xclbin_path: Path,
    ) -> None:
        super().__init__(index, directory, traffic, ThreadedIO(), chunk_elems=chunk_elems, buffer_count=buffer_count)
        self.pyxrt = pyxrt
        self.handle = handle
        self.uuid = uuid
        self.bdf = str(handle.get_info(pyxrt.xrt_info_device.bdf))
        #: The kernels of the loaded xclbin, and its path (for messages).
        self.kernel_names = kernel_names
        self.xclbin_path = xclbin_path
        self._kernels: dict[str, Any] = {}
        #: data_ptr of each pool buffer -> the P2P bo it maps (the pool hands out tensors over the mappings).
        self._records: dict[int, Any] = {}
        #: (record data_ptr, byte offset, bytes) -> the sub-bo of that extent of the record.
        self._subs: dict[tuple[int, int, int], Any] = {}
        self._staging: dict[str, tuple[Any, Tensor]] = {}

    def kernel(self, name: str) -> Any:
        if name not in self._kernels:
            self._kernels[name] = self.pyxrt.kernel(self.handle, self.uuid, name, self.pyxrt.kernel.shared)
        return self._kernels[name]

    def device_bytes(self, tensors_per_record: int) -> int:
        """Device DDR the buffers take: the P2P records plus the staging buffers."""
        return (
            pool_bytes(1, self.buffer_count, self.chunk_elems, tensors_per_record)
            + STAGING_BUFFERS * self.chunk_elems * 4
        )

    def allocate(self, tensors_per_record: int) -> None:
        pyxrt = self.pyxrt
        group = self.kernel(min(self.kernel_names)).group_id(0)  # every port is in the one DDR bank
        record_bytes = self.chunk_elems * 4 * tensors_per_record
        for _ in range(self.buffer_count):
            bo = pyxrt.bo(self.handle, record_bytes, pyxrt.bo.flags.p2p, group)
            record = torch.frombuffer(bo.map(), dtype=torch.float32)
            self._records[record.data_ptr()] = bo
            self.pool.add(record)
        for name in ("grad", "idx", "param"):
            bo = pyxrt.bo(self.handle, self.chunk_elems * 4, pyxrt.bo.flags.normal, group)
            self._staging[name] = (bo, torch.frombuffer(bo.map(), dtype=torch.uint8))
        self.allocated_bytes = self.device_bytes(tensors_per_record)

    def _record_bos(self, record: Tensor, extents: list[tuple[int, int]]) -> list[Any]:
        """Sub-buffers of ``record``'s P2P buffer at ``extents`` (``(byte offset, bytes)`` each), made once."""
        key = record.data_ptr()
        parent = self._records[key]
        if len(self._subs) > 64 * self.buffer_count:
            self._subs.clear()
        bos = []
        for offset, size in extents:
            sub = self._subs.get((key, offset, size))
            if sub is None:
                sub = self._subs[(key, offset, size)] = self.pyxrt.bo(parent, size, offset)
            bos.append(sub)
        return bos

    def _to_device(self, name: str, nbytes: int) -> Any:
        bo = self._staging[name][0]
        if nbytes:
            bo.sync(self.pyxrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE, nbytes, 0)
        return bo

    def run_update(
        self,
        name: str,
        scalars: list[int],
        record: Tensor,
        ports: list[tuple[int, int]],
        grad: Tensor | SparseGrad,
        link_dtype: torch.dtype,
        kind: torch.dtype,
        out: Tensor,
        start: int,
        n: int,
    ) -> None:
        """One kernel call on chunk ``[start, start + n)``: gradient in, state updated in place in DDR, params out.

        ``ports``: ``(byte offset, bytes)`` in ``record`` of the master and of each state port.
        """
        sync = self.pyxrt.xclBOSyncDirection
        itemsize = kind.itemsize
        state_bos = self._record_bos(record, ports)
        if name.startswith("smartinf_sgd") and len(ports) == 1:
            state_bos.append(state_bos[0])  # no momentum buffer: the kernel never touches the port (flag bit 3 off)
        grad_host = self._staging["grad"][1]
        if isinstance(grad, SparseGrad):
            lo, hi = grad.chunk_bounds(start, n)
            k = hi - lo
            # Indices rebased to the chunk, still strictly ascending (the kernels' precondition).
            self._staging["idx"][1].view(torch.int32)[:k].copy_(grad.indices[lo:hi]).sub_(start)
            self.store_link(grad_host.view(kind)[:k], grad.values[lo:hi], link_dtype)
            grad_args = [
                self._to_device("idx", padded_elems(k, 4) * 4 if k else 0),
                self._to_device("grad", padded_elems(k, itemsize) * itemsize if k else 0),
            ]
            counts = [u32_arg(n), u32_arg(k)]
        else:
            self.store_link(grad_host.view(kind)[:n], grad[start : start + n], link_dtype)
            grad_args = [self._to_device("grad", padded_elems(n, itemsize) * itemsize)]
            counts = [u32_arg(n)]
        param_bo, param_host = self._staging["param"]
        run = self.pyxrt.run(self.kernel(name))
        for i, arg in enumerate([*state_bos, *grad_args, param_bo, *counts, *scalars]):
            run.set_arg(i, arg)
        run.start()
        state = run.wait()
        if state != self.pyxrt.ert_cmd_state.ERT_CMD_STATE_COMPLETED:
            raise RuntimeError(f"Kernel {name} on device {self.index} ({self.bdf}) ended in state {state}.")
        param_bo.sync(sync.XCL_BO_SYNC_BO_FROM_DEVICE, padded_elems(n, itemsize) * itemsize, 0)
        self.copies.put(out[start : start + n], param_host.view(kind)[:n])

    def update_work(
        self, shard: Shard, grad: Tensor | SparseGrad, hp: StepParams, out: Tensor, link_dtype: torch.dtype
    ) -> ChunkWork:
        """One kernel call per chunk (:meth:`run_update`), in the kernel type of ``link_dtype`` and ``out``.

        Raises:
            ValueError: a dtype without a kernel type, or a kernel the xclbin does not have.
        """
        sparse = isinstance(grad, SparseGrad)
        kernel_type(link_dtype)
        kernel_type(out.dtype)
        kind = link_dtype if link_dtype == out.dtype else torch.float32
        rule = shard.spec.rule
        layout = shard.layout
        name = kernel_name(rule, kind, topk=sparse, state_precision=layout.state_format)
        if name not in self.kernel_names:
            raise ValueError(
                f"Kernel `{name}` (shard {shard.spec.index}: {rule.name}, {'top-k' if sparse else 'dense'} gradient "
                f"and parameters in {kind}, state in {layout.state_format}) is not in "
                f"`xclbin={str(self.xclbin_path)!r}`, which has: "
                f"{', '.join(sorted(self.kernel_names))}. Rebuild it with "
                f'`make -C hls_kernels xclbin KERNELS="{name} ..."`, or train in a precision it has.'
            )
        scalars, flags = derive_scalars(rule, hp)
        args = [f32_arg(s) for s in scalars] + [u32_arg(flags)]

        def update(record: Tensor, m: Tensor, states: list[Tensor], start: int, n: int) -> None:
            k = start // layout.chunk_elems
            padded = layout.padded_len(k)
            ports = [(0, padded * 4)]
            for offset, _ in layout.state_extents(k):
                ports += state_port_extents(layout.state_format, offset, padded)
            self.run_update(name, args, record, ports, grad, link_dtype, kind, out, start, n)

        return ChunkWork(compute=update, link_write=link_bytes(grad, kind), link_read=out.numel() * kind.itemsize)

    def initialize_link_bytes(self, shard: Shard, master: Tensor) -> int:
        """The host writes each whole record (zeros, master, initial states) through the P2P mapping once."""
        return shard.layout.file_bytes

    def close(self, timeout: float | None = None) -> bool:
        settled = super().close(timeout)
        if settled:  # else a hung transfer may still use a P2P mapping: keep its buffer objects alive
            self._subs.clear()
            self._records.clear()
            self._staging.clear()
            self._kernels.clear()
        return settled


# ---------------------------------------------------------------------------------------------- the backend


class XrtBackend(StreamingBackend):
    """Samsung SmartSSDs (or the software model of pyxrt), one per directory in ``device_dirs``.

    Args:
        device_dirs: one directory per SmartSSD, on that SmartSSD's SSD; state files are created inside.
        xclbin: the ``.xclbin`` built from ``hls_kernels/``, or a model manifest (:func:`write_model_xclbin`),
            which selects the software model of pyxrt instead of the real one.
        devices: the XRT device (index or PCIe BDF) of each directory; ``None`` pairs each directory with the FPGA
            behind the same PCIe switch as its SSD (the model pairs them in order).
        buffer_count: P2P record buffers per device (at least 2).
        device_timeout_s: seconds a SmartSSD may show no progress while the host waits for it before a
            :class:`~lightning_smartinf.core.io.storage.StorageError` stops the backend; ``None`` waits forever (see
            :class:`StreamingBackend`).
        device_weights: relative update throughput of each SmartSSD (``None``: equal).
        chunk_elems, owned_dirs, prefetch_state: as :class:`StreamingBackend`.

    Host-memory and accelerator tiers wrap it (:class:`~lightning_smartinf.core.tiers.tiered.TieredBackend`): since
    the SmartSSDs compute, the memory tier's share is measured by default.

    Raises:
        ValueError: bad arguments (see :func:`check_xrt_settings`), or more directories than XRT devices.
        FileNotFoundError: ``xclbin`` does not exist.
        RuntimeError: ``pyxrt`` is missing, or a device cannot be opened or programmed.
    """

    def __init__(
        self,
        device_dirs: Sequence[Path],
        *,
        xclbin: str | os.PathLike | None,
        devices: Sequence[int | str] | None = None,
        chunk_elems: int = 1 << 20,
        buffer_count: int = 4,
        owned_dirs: Sequence[Path] = (),
        prefetch_state: bool = True,
        device_timeout_s: float | None = 300.0,
        device_weights: Sequence[float] | None = None,
    ) -> None:
        self.xclbin_path = check_xrt_settings(xclbin, devices, [str(d) for d in device_dirs])
        self.pyxrt = load_pyxrt(self.xclbin_path)
        self.is_model = isinstance(self.pyxrt, SoftwarePyxrt)
        self._xclbin = self.pyxrt.xclbin(str(self.xclbin_path))
        self.kernel_names = frozenset(k.get_name() for k in self._xclbin.get_kernels())
        #: Device DDR per SmartSSD, from the memory banks of the xclbin.
        self.ddr_bytes = sum(m.get_size_kb() * 1024 for m in self._xclbin.get_mems() if m.get_used())
        self._xrt_devices = devices
        super().__init__(
            device_dirs,
            chunk_elems=chunk_elems,
            buffer_count=buffer_count,
            owned_dirs=owned_dirs,
            prefetch_state=prefetch_state,
            device_timeout_s=device_timeout_s,
            device_weights=device_weights,
        )

    @cached_property
    def device_idents(self) -> list[int | str]:
        """The XRT device (index or BDF) of each directory: as given, or paired with its SSD.

        Computed when :meth:`make_device` first needs it, once the directories are claimed.
        """
        if self._xrt_devices is not None:
            return list(self._xrt_devices)
        device_dirs = list(self.device_dirs)
        available = int(self.pyxrt.enumerate_devices())
        if len(device_dirs) > available:
            raise ValueError(
                f"`storage_paths` gives {len(device_dirs)} path(s) ({', '.join(map(str, device_dirs))}) to this rank, "
                f"but XRT sees only {available} device(s). Each storage path must be on its own SmartSSD: pass at "
                f"most {available} path(s) per node, or list the devices with `xrt_devices=`."
            )
        if self.is_model:
            return list(range(len(device_dirs)))  # the model has no PCIe topology: pair in order
        bdfs = [str(self.pyxrt.device(i).get_info(self.pyxrt.xrt_info_device.bdf)) for i in range(available)]
        return list(pair_by_pcie(device_dirs, bdfs))

    def make_device(self, index: int, directory: Path) -> XrtDevice:
        """Open XRT device ``index`` of :attr:`device_idents`, load the xclbin, and wrap it for ``directory``.

        Raises:
            RuntimeError: the device cannot be opened or programmed.
        """
        ident = self.device_idents[index]
        try:
            handle = self.pyxrt.device(ident)
            uuid = handle.load_xclbin(self._xclbin)
        except Exception as exc:  # noqa: BLE001 - XRT raises plain RuntimeErrors; name the device
            raise RuntimeError(
                f"Cannot open XRT device {ident!r} for storage path {str(directory)!r} and load "
                f"`xclbin={str(self.xclbin_path)!r}` ({exc}). Check `xbutil examine` lists it and that the "
                "xclbin was built for its platform."
            ) from None
        return XrtDevice(
            index,
            directory,
            self.traffic,
            chunk_elems=self.chunk_elems,
            buffer_count=self.buffer_count,
            pyxrt=self.pyxrt,
            handle=handle,
            uuid=uuid,
            kernel_names=self.kernel_names,
            xclbin_path=self.xclbin_path,
        )

    def open(self, shards: Sequence[ShardSpec]) -> None:
        needed = {(rule_kernel(s.rule), s.state_format) for s in shards}  # ValueError for rules without a kernel
        held = set()
        for name in self.kernel_names:
            with contextlib.suppress(ValueError):  # an xclbin may hold kernels of its own beside ours
                rule, _, _, fmt = parse_kernel_name(name)
                held.add((rule, fmt))
        for rule, fmt in sorted(needed - held):
            example = f"smartinf_{rule}_bf16" + ("" if fmt == "fp32" else f"_state_{fmt}")
            raise ValueError(
                f"`xclbin={str(self.xclbin_path)!r}` has no `smartinf_{rule}_*` kernel with the state in {fmt}, "
                f"needed by the optimizer's {rule!r} param groups with `state_precision={fmt!r}` (it has: "
                f"{', '.join(sorted(self.kernel_names))}). Rebuild it with "
                f'`make -C hls_kernels xclbin KERNELS="{example} {example.replace(rule, rule + "_topk", 1)}"` '
                "(one kernel per training dtype)."
            )
        tensors = max(
            (s.layout(self.chunk_elems).pool_tensors for s in shards),
            default=1,
        )
        need = self.devices[0].device_bytes(tensors)
        if need > self.ddr_bytes:
            fit = (self.ddr_bytes // (4 * (self.buffer_count * tensors + STAGING_BUFFERS))) // 1024 * 1024
            raise ValueError(
                f"`chunk_elems={self.chunk_elems}` with `buffer_count={self.buffer_count}` needs "
                f"{need / MIB:.0f} MiB of device memory per SmartSSD ({self.buffer_count} P2P records the size of "
                f"{tensors} fp32 chunks + {STAGING_BUFFERS} staging buffers of one chunk each), but the memory banks "
                f"of `xclbin={str(self.xclbin_path)!r}` hold {self.ddr_bytes / GIB:.2f} GiB. Lower `chunk_size` "
                f"(at most {fit} here) or `buffer_count`."
            )
        super().open(shards)
