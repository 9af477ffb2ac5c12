"""Activation offload to storage (after SSDTrain): the Lightning-free core.

:class:`ActivationOffloader` installs ``torch.autograd.graph.saved_tensors_hooks``. During forward, the pack
hook hands every saved activation above ``threshold_bytes`` to a writer thread, which copies it into an aligned
buffer and writes it to its own file on one of the storage paths (striped round-robin). The hook returns a
small handle; the tensor is dropped as soon as its write completes, so the memory is released while forward
goes on. During backward, each unpack triggers reads of the next records in reverse pack order (the order the
backward pass needs them), bounded by ``max_inflight_bytes``, so disk reads overlap backward compute. Each file
is unlinked the moment its bytes are back in memory, and every file of the run is removed on any exception.

Details that matter:

* Deduplication: a saved tensor is identified by its storage (``untyped_storage()`` data pointer, storage
  offset, shape, stride, dtype) and checked against a weak reference to the storage object, so several autograd
  nodes saving the same tensor (or different Python views of it) share one record, written once, and a freed
  address that the allocator reuses is never mistaken for the old tensor.
* Forwarding: a record whose write is still pending when backward needs it is served from the tensor the
  writer still holds; no read is issued.
* Keep-last: the activations of the last ``keep_last`` layers (and everything after them: head, loss) stay in
  memory, since backward needs them first. Layers are found from the model (the longest ``ModuleList`` /
  ``Sequential`` of same-type modules with parameters) and tracked with forward hooks. A model without such
  layers falls back to a size-only policy, with a warning.
* Parameters (leaf tensors requiring grad), tensors packed during backward (activation recomputation),
  overlapping views (``expand``) and tensors below the threshold are kept in memory untouched.
* Back-pressure: bytes held by pending writes + reads in flight + prefetched buffers not yet consumed never
  exceed ``max_inflight_bytes`` (a single tensor larger than the budget is let through alone); the pack hook
  waits for writes to finish before going over.
* Files live in ``<path>/smartinf-activations/<host>-<pid>-<n>/`` (0700). Directories left by a process of this
  host that is no longer alive are removed when an offloader starts.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import shutil
import socket
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_smartinf.csd.accelerator import SideStreams, on_cuda, pinned_empty, record_fence
from lightning_smartinf.csd.io import IO_ALIGN, IOEngine, StateFile, ThreadedIO, aligned_empty, round_up
from lightning_smartinf.csd.storage import (
    StorageError,
    create_storage_path,
    ensure_private_dir,
    validate_storage_path,
)

__all__ = ["ActivationOffloader", "OffloadStats", "find_layers", "cleanup_stale_dirs", "ROOT_DIR_NAME"]

ROOT_DIR_NAME = "smartinf-activations"
_run_counter = itertools.count()

# Record states
_KEPT, _WRITING, _ON_DISK, _READING, _RESIDENT, _FREED = "kept", "writing", "on_disk", "reading", "resident", "freed"


@dataclass
class OffloadStats:
    """Counters of one offloader (cumulative unless said otherwise). Bytes are tensor bytes, not padded."""

    bytes_written: int = 0
    bytes_read: int = 0
    tensors_offloaded: int = 0
    tensors_kept: int = 0
    dedup_hits: int = 0
    forwarded: int = 0  # unpacked while its write was still pending: served from memory, no read
    sync_reads: int = 0  # unpacked before its prefetch was issued: backward waited for the whole read
    waited_reads: int = 0  # unpacked while its prefetch was still in flight: backward waited for part of it
    resident_bytes: int = 0  # now: bytes of saved activations held in memory by the hooks
    peak_resident_bytes: int = 0  # since the last reset_peak()
    peak_staging_bytes: int = 0  # aligned write buffers allocated (in use + pooled for reuse), at most the budget
    files_created: int = 0
    files_removed: int = 0


class _Record:
    __slots__ = (
        "key",
        "storage_ref",
        "nbytes",
        "shape",
        "stride",
        "dtype",
        "device",
        "state",
        "tensor",
        "refs",
        "seq",
        "path",
        "future",
        "unpacked",
        "error",
        "charged",
        "produced",
        "side_allocated",
    )

    def __init__(self, key: tuple, tensor: Tensor, nbytes: int, seq: int) -> None:
        self.key = key
        self.storage_ref = weakref.ref(tensor.untyped_storage())
        self.nbytes = nbytes
        self.shape, self.stride, self.dtype, self.device = tensor.shape, tensor.stride(), tensor.dtype, tensor.device
        self.state = _KEPT
        self.tensor: Tensor | None = tensor
        self.refs = 0
        self.seq = seq
        self.path: Path | None = None
        self.future: Future | None = None
        self.unpacked = 0
        self.error: BaseException | None = None
        self.charged = 0  # bytes charged to the in-flight budget
        # CUDA only: an event after the kernels of the user's stream that produced the tensor (the write waits for
        # it on a side stream), and whether the tensor read back was allocated on a side stream.
        self.produced: Any = None
        self.side_allocated = False


class _Handle:
    """What autograd stores instead of the tensor. Releases its share of the record when dropped unused."""

    __slots__ = ("release", "record", "used", "__weakref__")

    def __init__(self, release: Callable[[_Record], None], record: _Record) -> None:
        self.release, self.record, self.used = release, record, False

    def __del__(self) -> None:
        if not self.used:
            with contextlib.suppress(Exception):  # never raise from a finaliser (interpreter shutdown)
                self.release(self.record)


def _dense_span(t: Tensor) -> bool:
    """True if ``t`` covers exactly ``numel`` consecutive elements of its storage (a permuted contiguous layout)."""
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def find_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated layers of ``model``: the longest ``ModuleList``/``Sequential`` of ≥ 2 same-type modules with
    parameters (a transformer's blocks). Empty when there is none."""
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            children = list(module.children())
            if (
                len(children) >= 2
                and len({type(c) for c in children}) == 1
                and all(any(True for _ in c.parameters()) for c in children)
                and len(children) > len(best)
            ):
                best = children
    return best


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale_dirs(storage_path: Path) -> list[Path]:
    """Remove run directories under ``storage_path/smartinf-activations`` left by dead processes of this host."""
    root = Path(storage_path) / ROOT_DIR_NAME
    removed = []
    if not root.is_dir():
        return removed
    host = socket.gethostname()
    for entry in root.iterdir():
        parts = entry.name.rsplit("-", 2)
        if len(parts) != 3 or parts[0] != host or not parts[1].isdigit() or not entry.is_dir():
            continue
        pid = int(parts[1])
        if pid != os.getpid() and not _pid_alive(pid):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


#: Smallest allowed value of each integer setting.
_MINIMUM = {"threshold_bytes": 0, "keep_last": 0, "max_inflight_bytes": 1, "io_threads": 1}


def check_settings(owner: str, **settings: int) -> None:
    """Raise ``ValueError`` naming the first setting that is not an integer at or above its minimum."""
    for name, value in settings.items():
        low = _MINIMUM[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            where = f"{owner}({name}={value!r})" if owner else f"{name}={value!r}"
            raise ValueError(f"`{where}` must be an integer >= {low}.")


class ActivationOffloader:
    """Offload saved activations to files on ``storage_paths`` during forward, read them back during backward.

    Use as a context manager around forward *and* backward of one micro-batch::

        off = ActivationOffloader([path], threshold_bytes=1 << 20).attach(model)
        with off:
            loss = model(x).sum()
            loss.backward()
        off.close()

    Args:
        storage_paths: directories to stripe files over (round-robin per tensor).
        threshold_bytes: tensors of fewer bytes stay in memory.
        keep_last: activations of the last ``keep_last`` layers (and of everything after them) stay in memory.
        max_inflight_bytes: bound on memory held by pending writes, reads in flight and prefetched buffers.
        io_threads: concurrent file transfers (each may be split further by the I/O engine).
        enabled: ``False`` keeps every saved tensor in memory but still counts bytes (a baseline to compare with).
    """

    def __init__(
        self,
        storage_paths: Sequence[str | os.PathLike],
        threshold_bytes: int = 1 << 20,
        keep_last: int = 1,
        max_inflight_bytes: int = 64 << 20,
        io_threads: int = 4,
        io: IOEngine | None = None,
        enabled: bool = True,
    ) -> None:
        if isinstance(storage_paths, (str, os.PathLike)):
            storage_paths = [storage_paths]
        if not storage_paths:
            raise ValueError("`storage_paths=[]` is empty. Pass at least one directory to write activations to.")
        check_settings(
            "",
            threshold_bytes=threshold_bytes,
            keep_last=keep_last,
            max_inflight_bytes=max_inflight_bytes,
            io_threads=io_threads,
        )
        self.threshold_bytes = threshold_bytes
        self.keep_last = keep_last
        self.max_inflight_bytes = max_inflight_bytes
        self.enabled = enabled
        self.stats = OffloadStats()

        self._run = f"{socket.gethostname()}-{os.getpid()}-{next(_run_counter)}"
        self._dirs: list[Path] = []
        for p in storage_paths:
            base = validate_storage_path(p, "storage_paths", missing_ok=True)
            create_storage_path(base)  # as the strategy does: a missing path under a writable parent is made 0700
            ensure_private_dir(base / ROOT_DIR_NAME)
            cleanup_stale_dirs(base)
            run_dir = base / ROOT_DIR_NAME / self._run
            ensure_private_dir(run_dir)
            self._dirs.append(run_dir)

        self._own_io = io is None
        self._io = io or ThreadedIO(block_size=1 << 20, queue_depth=max(2, io_threads))
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="smartinf-act")
        self._cond = threading.Condition(threading.RLock())
        self._records: dict[tuple, _Record] = {}
        self._order: list[_Record] = []  # offloaded records in pack order
        self._cursor = -1  # next index of _order to prefetch (descending)
        self._inflight = 0
        self._seq = 0
        self._file_seq = itertools.count()
        self._error: BaseException | None = None
        # Reused aligned staging buffers for writes (no page faults on the hot path), at most the budget in total.
        self._free_bufs: dict[tuple[int, bool], list[Tensor]] = {}  # (bytes, pinned) -> staging buffers
        self._streams = SideStreams()
        self._pooled = 0
        self._staging_total = 0

        self._layers: list[nn.Module] = []
        self._hook_handles: list[Any] = []
        self._cur_layer = -1
        self._backward = False
        self._ctx: torch.autograd.graph.saved_tensors_hooks | None = None
        self._closed = False

    # ----------------------------------------------------------------------------------------------- setup
    def attach(self, model: nn.Module, layers: Sequence[nn.Module] | None = None) -> ActivationOffloader:
        """Find (or take) the model's layers and register forward hooks that track which layer is running."""
        self.detach()
        self._layers = list(layers) if layers is not None else find_layers(model)
        if not self._layers:
            warnings.warn(
                f"ActivationOffloader found no repeated layers in {type(model).__name__} (a ModuleList/Sequential of "
                "same-type modules with parameters); falling back to a size-only policy: every saved tensor of at "
                f"least `threshold_bytes={self.threshold_bytes}` is offloaded and `keep_last` is ignored. Pass "
                "`layers=` to attach() to name the layers.",
                UserWarning,
                stacklevel=2,
            )
        for i, layer in enumerate(self._layers):
            self._hook_handles.append(layer.register_forward_pre_hook(self._make_pre_hook(i)))
        return self

    def _make_pre_hook(self, index: int):  # noqa: ANN202
        def hook(module: nn.Module, args: Any) -> None:
            self._cur_layer = index

        return hook

    def detach(self) -> None:
        for h in self._hook_handles:
            h.remove()
        self._hook_handles.clear()

    @property
    def layers(self) -> list[nn.Module]:
        return self._layers

    @property
    def run_dirs(self) -> list[Path]:
        return list(self._dirs)

    # ------------------------------------------------------------------------------------ context manager
    def __enter__(self) -> ActivationOffloader:
        self.begin()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.end(failed=exc_type is not None)

    def begin(self) -> None:
        """Start one micro-batch: install the hooks (forward and backward must both run before :meth:`end`)."""
        if self._closed:
            raise RuntimeError("This ActivationOffloader is closed; create a new one.")
        if self._ctx is not None:
            return
        self._cur_layer = -1
        self._backward = False
        with self._cond:
            self._order = [r for r in self._order if r.state != _FREED]
            self._cursor = len(self._order) - 1
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()

    def end(self, failed: bool = False) -> None:
        """End the micro-batch: remove the hooks; on failure (or leftovers) drop every record and file."""
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            ctx.__exit__(None, None, None)
        if failed:
            self.clear()
            return
        # Records already consumed but still being written are freed by their write; wait for those writes, so
        # no file of this micro-batch outlives it.
        with self._cond:
            pending = [r.future for r in self._records.values() if r.refs <= 0 and r.future is not None]
        for future in pending:
            with contextlib.suppress(BaseException):  # a write error is recorded in `_error`, raised below
                future.result()
        self._raise_pending_error()

    def close(self) -> None:
        """Remove the hooks, every file and the run directories; stop the I/O threads."""
        if self._closed:
            return
        self.end(failed=True)
        self.detach()
        self._pool.shutdown(wait=True)
        self._free_bufs.clear()
        if self._own_io:
            self._io.close()
        for d in self._dirs:
            shutil.rmtree(d, ignore_errors=True)
        self._closed = True

    def clear(self) -> None:
        """Wait for I/O, then forget every record and delete its file (handles still alive become invalid)."""
        with self._cond:
            futures = [r.future for r in self._records.values() if r.future is not None]
        for f in futures:
            with contextlib.suppress(BaseException):  # we are cleaning up
                f.result()
        with self._cond:
            for rec in list(self._records.values()):
                self._free(rec)
            self._records.clear()
            self._order.clear()
            self._cursor = -1
            self._error = None
        for d in self._dirs:
            for f in d.glob("*"):
                f.unlink(missing_ok=True)

    def reset_peak(self) -> None:
        self.stats.peak_resident_bytes = self.stats.resident_bytes

    # ------------------------------------------------------------------------------------------ accounting
    def _charge_resident(self, delta: int) -> None:
        s = self.stats
        s.resident_bytes += delta
        s.peak_resident_bytes = max(s.peak_resident_bytes, s.resident_bytes)

    def _raise_pending_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    # ------------------------------------------------------------------------------------------------ pack
    def _pack(self, t: Tensor) -> Any:
        if (t.requires_grad and t.is_leaf) or t.is_sparse or t.layout != torch.strided or t.numel() == 0:
            return t  # parameters and exotic tensors: autograd keeps them as usual
        self._raise_pending_error()
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)
        with self._cond:
            rec = self._records.get(key)
            if rec is not None and rec.storage_ref() is storage and rec.state != _FREED:
                rec.refs += 1
                self.stats.dedup_hits += 1
                return _Handle(self._release, rec)
            nbytes = t.numel() * t.element_size()
            self._seq += 1
            rec = _Record(key, t, nbytes, self._seq)
            rec.refs = 1
            self._records[key] = rec
            self._charge_resident(nbytes)
            if self._should_offload(t, nbytes):
                rec.produced = record_fence(t.device)  # the user's current stream, whichever it is
                self._start_write(rec)
            else:
                self.stats.tensors_kept += 1
        return _Handle(self._release, rec)

    def _should_offload(self, t: Tensor, nbytes: int) -> bool:
        if not self.enabled or self._backward or nbytes < self.threshold_bytes or not _dense_span(t):
            return False
        return not (self._layers and self._cur_layer >= len(self._layers) - self.keep_last)

    def _start_write(self, rec: _Record) -> None:
        # Back-pressure: wait until the budget has room (a tensor bigger than the budget goes alone).
        padded = round_up(rec.nbytes, IO_ALIGN)
        while self._inflight > 0 and self._inflight + padded > self.max_inflight_bytes:
            self._cond.wait()
            self._raise_pending_error()
        self._inflight += padded
        rec.charged = padded
        rec.state = _WRITING
        n = next(self._file_seq)
        rec.path = self._dirs[n % len(self._dirs)] / f"{n}.act"
        self._order.append(rec)
        self._cursor = len(self._order) - 1
        self.stats.tensors_offloaded += 1
        rec.future = self._pool.submit(self._write, rec)

    def _write(self, rec: _Record) -> None:
        try:
            t = rec.tensor
            assert t is not None and rec.path is not None
            span = t.as_strided((t.numel(),), (1,))  # dense: exactly the bytes of the tensor, any permutation
            padded = rec.charged
            cuda = on_cuda(t)
            buf = self._staging(padded, pinned=cuda)
            try:
                if cuda:
                    stream = self._streams.stream(t.device, "out")
                    self._streams.copy(buf[: rec.nbytes], span.view(torch.uint8), stream, after=rec.produced)
                else:
                    buf[: rec.nbytes].copy_(span.view(torch.uint8))
                file = StateFile(rec.path, padded, create=True)
                try:
                    self._io.write(file, buf, 0)
                finally:
                    file.close()
            finally:
                self._give_back(buf, pinned=cuda)
            del buf, span, t
        except BaseException as exc:  # noqa: BLE001 - surfaced to the training thread
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                exc = StorageError(
                    f"Storage path {str(rec.path.parent.parent.parent)!r} is full: cannot write an activation of "
                    f"{rec.nbytes} bytes. Free space, add storage paths, or raise `threshold_bytes`/`keep_last`. "
                    "The step was aborted before the optimizer ran, so the training state is untouched."
                )
            with self._cond:
                rec.error = exc
                self._error = exc
                rec.state = _KEPT  # the tensor is still held: nothing is lost
                self._inflight -= rec.charged
                rec.charged = 0
                if rec.path is not None:
                    rec.path.unlink(missing_ok=True)
                    rec.path = None
                self._cond.notify_all()
            return
        with self._cond:
            self.stats.bytes_written += rec.nbytes
            self.stats.files_created += 1
            self._inflight -= rec.charged
            rec.charged = 0
            if rec.state == _WRITING and self._backward:
                # Backward has started and may need it soon: keep the tensor (already counted), drop the file.
                rec.state = _RESIDENT
                rec.path.unlink(missing_ok=True)
                self.stats.files_removed += 1
                rec.path = None
            elif rec.state == _WRITING:
                rec.state = _ON_DISK
                rec.tensor = None
                self._charge_resident(-rec.nbytes)
            if rec.refs <= 0:  # consumed (forwarded) or dropped while the write was pending
                self._free(rec)
            self._cond.notify_all()

    # ---------------------------------------------------------------------------------------------- unpack
    def _staging(self, nbytes: int, pinned: bool = False) -> Tensor:
        """An aligned host buffer of ``nbytes``: page-locked for copies to and from CUDA memory."""
        with self._cond:
            bufs = self._free_bufs.get((nbytes, pinned))
            if bufs:
                self._pooled -= nbytes
                return bufs.pop()
            self._staging_total += nbytes
            self.stats.peak_staging_bytes = max(self.stats.peak_staging_bytes, self._staging_total)
        return pinned_empty(nbytes) if pinned else aligned_empty(nbytes)

    def _give_back(self, buf: Tensor, pinned: bool = False) -> None:
        with self._cond:
            if self._pooled + buf.numel() <= self.max_inflight_bytes:
                self._free_bufs.setdefault((buf.numel(), pinned), []).append(buf)
                self._pooled += buf.numel()
            else:
                self._staging_total -= buf.numel()

    def _unpack(self, handle: Any) -> Tensor:
        if not isinstance(handle, _Handle):
            return handle
        rec = handle.record
        if handle.used:
            raise RuntimeError(
                "A saved activation was unpacked twice (backward with `retain_graph=True`, or double backward); "
                "ActivationOffloader frees each activation after its first use. Disable activation offload for "
                "this model or run backward once per forward."
            )
        with self._cond:
            self._backward = True
            self._raise_pending_error()
            fut = None
            if rec.state == _FREED:
                raise RuntimeError("A saved activation was used after its offload run was cleared or closed.")
            if rec.state == _WRITING:
                self.stats.forwarded += 1  # still in memory: no read
                out = rec.tensor
            elif rec.state in (_KEPT, _RESIDENT):
                out = rec.tensor
            else:
                if rec.state == _ON_DISK:
                    self.stats.sync_reads += 1
                    self._start_read(rec, force=True)
                elif not rec.future.done():
                    self.stats.waited_reads += 1
                fut = rec.future
            self._prefetch()
        if fut is not None:
            fut.result()
            with self._cond:
                self._raise_pending_error()
                out = rec.tensor
        assert out is not None
        if rec.side_allocated:
            # Allocated on a side stream, used on the caller's: its memory is not reused until the caller is done.
            out.record_stream(torch.cuda.current_stream(out.device))
        handle.used = True
        with self._cond:
            self._release(rec)
            self._prefetch()
        return out

    def _start_read(self, rec: _Record, force: bool = False) -> bool:
        padded = round_up(rec.nbytes, IO_ALIGN)
        if not force and self._inflight > 0 and self._inflight + padded > self.max_inflight_bytes:
            return False
        self._inflight += padded
        rec.charged = padded
        rec.state = _READING
        self._charge_resident(rec.nbytes)
        rec.future = self._pool.submit(self._read, rec)
        return True

    def _read(self, rec: _Record) -> None:
        try:
            assert rec.path is not None
            cuda = rec.device.type == "cuda"
            buf = self._staging(rec.charged, pinned=True) if cuda else aligned_empty(rec.charged)
            file = StateFile(rec.path, rec.charged, create=False)
            try:
                self._io.read(file, buf, 0)
            finally:
                file.close()
            rec.path.unlink(missing_ok=True)  # the bytes are in memory: the file is no longer needed
            out = buf[: rec.nbytes].view(rec.dtype).as_strided(rec.shape, rec.stride)
            if cuda:
                stream = self._streams.stream(rec.device, "in")
                with torch.cuda.stream(stream):
                    host, out = out, torch.empty_strided(rec.shape, rec.stride, dtype=rec.dtype, device=rec.device)
                self._streams.copy(out, host, stream)
                rec.side_allocated = True
                del host
                self._give_back(buf, pinned=True)
            elif rec.device.type != "cpu":
                out = out.to(rec.device, non_blocking=False)
        except BaseException as exc:  # noqa: BLE001 - surfaced to the training thread
            with self._cond:
                self._error = exc
                self._cond.notify_all()
            raise
        with self._cond:
            rec.path = None
            self.stats.bytes_read += rec.nbytes
            self.stats.files_removed += 1
            rec.tensor = out
            if rec.state == _READING:
                rec.state = _RESIDENT
            # Reads stay charged to the budget until consumed (prefetched buffers are in-flight memory).
            if rec.refs <= 0:
                self._free(rec)
            self._cond.notify_all()

    def _prefetch(self) -> None:
        """Issue reads for the next offloaded records in reverse pack order while the budget allows."""
        while self._cursor >= 0:
            rec = self._order[self._cursor]
            if rec.state == _ON_DISK and not self._start_read(rec):
                return
            self._cursor -= 1

    # ------------------------------------------------------------------------------------------- release
    def _release(self, rec: _Record) -> None:
        with self._cond:
            rec.refs -= 1
            if rec.refs <= 0 and rec.state in (_KEPT, _RESIDENT, _ON_DISK):
                self._free(rec)

    def _free(self, rec: _Record) -> None:
        """Drop the record's memory and file (caller holds the lock; I/O on it must be finished)."""
        if rec.state == _FREED:
            return
        if rec.state in (_WRITING, _READING) and rec.future is not None and not rec.future.done():
            return  # the I/O completion frees it (refs <= 0)
        if rec.tensor is not None:
            self._charge_resident(-rec.nbytes)
            rec.tensor = None
        if rec.charged:
            self._inflight -= rec.charged
            rec.charged = 0
            self._cond.notify_all()
        if rec.path is not None:
            try:
                rec.path.unlink()
                self.stats.files_removed += 1
            except FileNotFoundError:
                pass
            rec.path = None
        rec.state = _FREED
        if self._records.get(rec.key) is rec:
            del self._records[rec.key]

    def files(self) -> list[Path]:
        """Activation files on disk now (for tests and diagnostics)."""
        return [f for d in self._dirs if d.exists() for f in d.iterdir()]

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
