"""Activation offload to storage (after SSDTrain): the Lightning-free core.

:class:`SavedTensorOffloader` installs ``torch.autograd.graph.saved_tensors_hooks``. During forward, the pack
hook hands every saved activation above ``threshold_bytes`` to a writer thread, which writes it into the spill file
of one of the storage paths (striped round-robin; :mod:`~lightning_smartinf.activations.spill`). A CPU tensor is
written from where it lies, with ``O_DIRECT`` over the whole pages it spans (no copy); a GPU tensor goes through a
pinned staging buffer. The hook returns a small handle; the tensor is dropped as soon as its write completes, so the
memory is released while forward goes on. During backward, each unpack triggers reads of the next records in
reverse pack order (the order the backward pass needs them), bounded by ``max_inflight_bytes``, so disk reads
overlap backward compute; read buffers are recycled within backward. A record's space in the spill file is free
once its bytes are back in memory, and the spill files are removed on any exception and at :meth:`close`.

The settings left to ``None`` are chosen after measured micro-batches (:mod:`~lightning_smartinf.activations.tuning`).

Details that matter:

* Deduplication: a saved tensor is identified by its storage (``untyped_storage()`` data pointer, storage
  offset, shape, stride, dtype) and checked against a weak reference to the storage object, so several autograd
  nodes saving the same tensor (or different Python views of it) share one record, written once, and a freed
  address that the allocator reuses is never mistaken for the old tensor.
* Forwarding: a record whose write is still pending when backward needs it is served from the tensor the
  writer still holds; no read is issued. A write that has not started when backward begins is not done at all.
* Keep-last: the activations of the last ``keep_last`` layers (and everything after them: head, loss) stay in
  memory, since backward needs them first. Layers are found from the model (the longest ``ModuleList`` /
  ``Sequential`` of same-type modules with parameters) and tracked with forward hooks. A model without such
  layers falls back to a size-only policy, with a warning.
* Parameters (leaf tensors requiring grad), tensors packed during backward (activation recomputation),
  overlapping views (``expand``) and tensors below the threshold are kept in memory untouched.
* Back-pressure: bytes held by pending writes + reads in flight + prefetched buffers not yet consumed never
  exceed ``max_inflight_bytes`` (a single tensor larger than the budget is let through alone); the pack hook
  waits for writes to finish before going over.
* Spill files live in ``<path>/smartinf-activations/<host>-<pid>-<n>/`` (0700). Directories left by a process of this
  host that is no longer alive are removed when an offloader starts.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import logging
import os
import shutil
import statistics
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import Tensor, nn

from lightning_smartinf.activations.costs import HOST_CPU_FACTOR, OVERHEAD_BUDGET, IOCosts
from lightning_smartinf.activations.spill import SpillFiles
from lightning_smartinf.activations.tuning import (
    DEFAULTS,
    MEASURE_AT,
    MEASURE_COUNT,
    RECHECK_COUNT,
    LayerMeter,
    Tuning,
    tune,
)
from lightning_smartinf.core.accelerator import SideStreams, bind_thread, on_cuda, pinned_empty, record_fence
from lightning_smartinf.core.arguments import Problems
from lightning_smartinf.core.io.direct import IO_ALIGN, IOEngine, ThreadedIO, aligned_empty, round_up
from lightning_smartinf.core.io.leftovers import remove_leftovers, temporary_path
from lightning_smartinf.core.io.storage import (
    create_storage_path,
    disk_full_error,
    ensure_private_dir,
    is_disk_full,
    validate_storage_path,
)
from lightning_smartinf.core.renamed import old_names

__all__ = ["SavedTensorOffloader", "OffloadStats", "find_layers", "cleanup_stale_dirs", "ROOT_DIR_NAME"]

ROOT_DIR_NAME = "smartinf-activations"
log = logging.getLogger(__name__)
#: The bandwidth assumed for a direction the measured micro-batch did not use.
FALLBACK_BYTES_PER_S = 1e9


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds if nbytes > 0 and seconds > 0 else FALLBACK_BYTES_PER_S


# Record states: a tensor in memory (kept there, read back, or not written after all) or where its bytes go
_IN_MEMORY, _WRITING, _ON_DISK, _READING, _FREED = "in_memory", "writing", "on_disk", "reading", "freed"


@dataclass
class OffloadStats:
    """Counters of one offloader (cumulative unless said otherwise). Bytes are tensor bytes, not padded."""

    bytes_written: int = 0
    bytes_read: int = 0
    tensors_offloaded: int = 0
    tensors_kept: int = 0
    dedup_hits: int = 0
    forwarded: int = 0  # unpacked while its write was still pending: served from memory, no read
    writes_skipped: int = 0  # backward began before the write did: kept in memory, never written
    sync_reads: int = 0  # unpacked before its prefetch was issued: backward waited for the whole read
    waited_reads: int = 0  # unpacked while its prefetch was still in flight: backward waited for part of it
    resident_bytes: int = 0  # now: bytes of saved activations held in memory by the hooks
    peak_resident_bytes: int = 0  # since the last reset_peak()
    peak_staging_bytes: int = 0  # aligned write buffers allocated (in use + pooled for reuse), at most the budget
    peak_pooled_bytes: int = 0  # read buffers no tensor uses, kept for the next reads of backward; at most the budget
    pooled_reads: int = 0  # reads into a pooled buffer (no fresh memory)
    # Where the time goes (seconds). The first two are the training thread blocked; the rest is I/O-thread time,
    # summed over threads, so it may exceed the step's wall time.
    forward_wait_s: float = 0.0  # pack hook waiting for room in the in-flight budget
    backward_wait_s: float = 0.0  # unpack waiting for a read
    copy_s: float = 0.0  # copying tensors into write buffers
    write_s: float = 0.0  # writing files
    read_s: float = 0.0  # reading files (allocation of the buffer included)
    write_busy_s: float = 0.0  # wall seconds with at least one write in flight
    read_busy_s: float = 0.0  # wall seconds with at least one read in flight
    io_cpu_s: float = 0.0  # CPU seconds of the I/O threads in their transfers (mostly the kernel's block I/O)


@dataclass(eq=False, repr=False, slots=True)
class _Record:
    """One saved tensor (a storage, offset, shape, stride, dtype and device) and where its bytes are."""

    key: tuple
    storage_ref: weakref.ref
    nbytes: int
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    tensor: Tensor | None
    state: str = _IN_MEMORY
    refs: int = 1  # the handle of the pack that created it
    slot: tuple[int, int] | None = None  # (spill file, offset) while the bytes are in a spill file
    future: Future | None = None
    charged: int = 0  # bytes charged to the in-flight budget
    # CUDA only: an event after the kernels of the user's stream that produced the tensor (the write waits for it on
    # a side stream), and whether the tensor read back was allocated on a side stream.
    produced: Any = None
    side_allocated: bool = False
    head: int = 0  # where the tensor's bytes start in its file


class _Handle:
    """What autograd stores instead of the tensor. Releases its share of the record when dropped unused."""

    __slots__ = ("release", "record", "used", "__weakref__")

    def __init__(self, release: Callable[[_Record], None], record: _Record) -> None:
        self.release, self.record, self.used = release, record, False

    def __del__(self) -> None:
        if not self.used:
            with contextlib.suppress(Exception):  # never raise from a finaliser (interpreter shutdown)
                self.release(self.record)


def _pages(t: Tensor, head: int, nbytes: int) -> Tensor:
    """The ``nbytes`` of memory from ``head`` bytes before ``t``'s first byte, as a ``uint8`` tensor over the same
    memory (no copy). The caller keeps ``t`` alive while it is used; the bytes outside ``t`` are only read, and are
    in the same pages as ``t``'s own, so they are mapped."""
    return torch.frombuffer((ctypes.c_ubyte * nbytes).from_address(t.data_ptr() - head), dtype=torch.uint8)


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
    lists = (list(m.children()) for m in model.modules() if isinstance(m, (nn.ModuleList, nn.Sequential)))
    repeated = [
        children
        for children in lists
        if len(children) >= 2
        and len({type(c) for c in children}) == 1
        and all(any(True for _ in c.parameters()) for c in children)
    ]
    return max(repeated, key=len, default=[])  # the first of the longest


def named_layers(model: nn.Module, name: str) -> list[nn.Module]:
    """The children of ``model``'s submodule ``name``, a ``ModuleList`` or ``Sequential`` (``layers="..."``).

    Raises:
        ValueError: ``model`` has no such submodule, or it holds no layers.
    """
    try:
        holder = model.get_submodule(name)
    except AttributeError:
        holder = None
    if not isinstance(holder, (nn.ModuleList, nn.Sequential)) or len(holder) == 0:
        found = "no such submodule" if holder is None else f"a {type(holder).__name__}, not a list of layers"
        lists = [n for n, m in model.named_modules() if n and isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m)]
        listed = ", ".join(map(repr, lists[:8])) + (", ..." if len(lists) > 8 else "")
        raise ValueError(
            f"`layers={name!r}`: {type(model).__name__} has {found}. Name the ModuleList or Sequential that holds "
            f"the repeated layers (found: {listed or 'none'}), or leave `layers=None` to find them."
        )
    return list(holder.children())


def cleanup_stale_dirs(storage_path: str | os.PathLike) -> list[Path]:
    """Remove the run directories under ``storage_path/smartinf-activations`` that dead processes left; return them."""
    return remove_leftovers(Path(storage_path) / ROOT_DIR_NAME)


def check_arguments(problems: Problems, arguments: Mapping[str, Any]) -> None:
    """Check those of the offload settings (of :class:`SavedTensorOffloader` and of the Lightning callback
    ``ActivationOffload``) that ``arguments`` holds. ``None`` leaves ``threshold_bytes``, ``keep_last`` and
    ``max_inflight_bytes`` to :func:`~lightning_smartinf.activations.tuning.tune`, and ``storage_paths`` to the
    callback, which takes the strategy's."""
    if "storage_paths" in arguments:
        problems.paths("storage_paths", arguments["storage_paths"], optional=True)
    if arguments.get("layers") is not None:
        problems.instance("layers", arguments["layers"], str, "the name of the module list of layers, or None")
    for name, low, example in (("threshold_bytes", 0, 1 << 20), ("max_inflight_bytes", 1, 64 << 20)):
        if name in arguments:
            problems.integer(name, arguments[name], low=low, unit="bytes", example=example, optional=True)
    if "keep_last" in arguments:
        problems.integer("keep_last", arguments["keep_last"], why="layers", example=1, optional=True)
    if "io_threads" in arguments:
        problems.integer("io_threads", arguments["io_threads"], low=1, high=1024, example=4)
    if "log_stats" in arguments:
        problems.flag("log_stats", arguments["log_stats"])
    if "overhead_budget" in arguments:
        why = "the share of the step activation offload may add, e.g. 0.1 for 10%"
        problems.number("overhead_budget", arguments["overhead_budget"], low=0, high=10, above=True, why=why)


class SavedTensorOffloader:
    """Offload saved activations to files on ``storage_paths`` during forward, read them back during backward.

    Use as a context manager around forward *and* backward of one micro-batch::

        off = SavedTensorOffloader([path], threshold_bytes=1 << 20).attach(model)
        with off:
            loss = model(x).sum()
            loss.backward()
        off.close()

    Args:
        storage_paths: directories to stripe records over (round-robin per tensor), one spill file in each.
        threshold_bytes: tensors of fewer bytes stay in memory.
        keep_last: activations of the last ``keep_last`` layers (and of everything after them) stay in memory.
        max_inflight_bytes: bound on memory held by pending writes, reads in flight and prefetched buffers.
        io_threads: concurrent file transfers (each may be split further by the I/O engine).
        io: the I/O engine (default: positional direct I/O, one request per tensor up to 64 MiB).
        enabled: ``False`` keeps every saved tensor in memory but still counts bytes (a baseline to compare with).
        overhead_budget: the share of the step offload may add (see :func:`~lightning_smartinf.activations.tuning.tune`
            and :meth:`_recheck`).

    ``None`` for ``threshold_bytes``, ``keep_last`` or ``max_inflight_bytes`` (the default) chooses it from the model
    and from measurements: the first micro-batches run with ``1 MiB``, ``1`` and ``64 MiB``; the micro-batch
    :data:`~lightning_smartinf.activations.tuning.MEASURE_AT` is measured (each layer's forward time and saved
    bytes, the I/O's bandwidth and CPU time), and :func:`~lightning_smartinf.activations.tuning.tune` sets the
    values from then on (:attr:`tuning` holds them and the predicted overhead; they are logged at INFO).
    """

    def __init__(
        self,
        storage_paths: Sequence[str | os.PathLike],
        threshold_bytes: int | None = None,
        keep_last: int | None = None,
        max_inflight_bytes: int | None = None,
        io_threads: int = 4,
        io: IOEngine | None = None,
        enabled: bool = True,
        overhead_budget: float = OVERHEAD_BUDGET,
    ) -> None:
        problems = Problems("SavedTensorOffloader")
        paths = problems.paths("storage_paths", storage_paths) or []  # `[]` only when a line was added
        self._requested = {
            "threshold_bytes": threshold_bytes,
            "keep_last": keep_last,
            "max_inflight_bytes": max_inflight_bytes,
        }
        check_arguments(problems, {**self._requested, "io_threads": io_threads, "overhead_budget": overhead_budget})
        problems.raise_if_any()
        self.overhead_budget = float(overhead_budget)
        self.threshold_bytes: int = DEFAULTS["threshold_bytes"] if threshold_bytes is None else threshold_bytes
        self.keep_last: int = DEFAULTS["keep_last"] if keep_last is None else keep_last
        self.max_inflight_bytes: int = (
            DEFAULTS["max_inflight_bytes"] if max_inflight_bytes is None else max_inflight_bytes
        )
        #: The settings chosen (or given) after measuring, with their prediction (``None`` before).
        self.tuning: Tuning | None = None
        #: The step's overhead measured once after the choice (``None`` before): see :meth:`_recheck`.
        self.measured_overhead: float | None = None
        self._tuned_io: IOCosts | None = None
        self._walls: list[float] = []  # micro-batches under the choice, for the re-check
        self._paused_walls: list[float] = []  # and those with offload paused beside them (see `_recheck`)
        self._recheck_from: OffloadStats | None = None
        self._rechecked = False
        self._comparing = False  # the re-check alternates paused and offloading micro-batches
        self._paused = False  # this micro-batch keeps every saved tensor in memory (a re-check's baseline)
        self._began_at = 0.0
        self._meter: LayerMeter | None = None
        self._micro_batches = 0
        self._measured_from: OffloadStats | None = None  # the counters when the micro-batch being measured began
        self._io_samples: list[IOCosts] = []  # one per measured micro-batch
        self._compute_device = "cpu"
        self._io_active = {"write": 0, "read": 0}
        self._io_since = {"write": 0.0, "read": 0.0}
        self.enabled = enabled
        self.stats = OffloadStats()

        self._dirs: list[Path] = []
        for p in paths:
            base = validate_storage_path(p, "storage_paths", missing_ok=True)
            create_storage_path(base)  # as the strategy does: a missing path under a writable parent is made 0700
            ensure_private_dir(base / ROOT_DIR_NAME)
            cleanup_stale_dirs(base)
            run_dir = temporary_path(base / ROOT_DIR_NAME / "activations", "run")
            ensure_private_dir(run_dir)
            self._dirs.append(run_dir)

        self._own_io = io is None
        # One request per tensor (up to 64 MiB): each extra request is a thread hand-off that preempts compute.
        self._io = io or ThreadedIO(block_size=64 << 20, queue_depth=max(2, io_threads))
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="smartinf-act")
        self._cond = threading.Condition(threading.RLock())
        self._records: dict[tuple, _Record] = {}
        self._order: list[_Record] = []  # offloaded records in pack order
        self._cursor = -1  # next index of _order to prefetch (descending)
        self._inflight = 0
        self._spill = SpillFiles(self._dirs)
        self._error: BaseException | None = None
        # Reused aligned staging buffers for writes (no page faults on the hot path), at most the budget in total.
        self._free_bufs: dict[tuple[int, bool], list[Tensor]] = {}  # (bytes, pinned) -> staging buffers
        self._streams = SideStreams()
        self._pooled = 0
        self._read_pool: dict[int, list[Tensor]] = {}  # bytes -> read buffers no tensor uses any more
        self._read_pooled = 0
        self._staging_total = 0

        self._layers: list[nn.Module] = []
        self._hook_handles: list[Any] = []
        self._cur_layer = -1
        self._backward = False
        self._ctx: torch.autograd.graph.saved_tensors_hooks | None = None
        self._closed = False

    # ----------------------------------------------------------------------------------------------- setup
    def attach(
        self,
        model: nn.Module,
        layers: Sequence[nn.Module] | str | None = None,
        *,
        warn: Callable[[str], object] | None = None,
    ) -> SavedTensorOffloader:
        """Find the model's layers, or take them (``layers``: the modules, or the name of the ``ModuleList`` or
        ``Sequential`` in ``model`` that holds them, e.g. ``"model.transformer.h"``), and register forward hooks
        that track which layer is running. Without layers, says so through ``warn`` (default: a ``UserWarning``)."""
        self.detach()
        self._layers = named_layers(model, layers) if isinstance(layers, str) else list(layers or find_layers(model))
        if not self._layers:
            (warn or functools.partial(warnings.warn, stacklevel=2))(
                f"Activation offload found no repeated layers in {type(model).__name__} (a ModuleList/Sequential of "
                "same-type modules with parameters); falling back to a size-only policy: every saved tensor of at "
                f"least `threshold_bytes={self.threshold_bytes}` is offloaded and `keep_last` is ignored. Pass "
                "`layers=` (the name of the module list that holds them, e.g. 'model.transformer.h') to name them."
            )
        # Measured whether or not settings were given: given ones are checked against the overhead budget.
        self._meter = LayerMeter(len(self._layers)) if self._layers and self.enabled else None
        for i, layer in enumerate(self._layers):
            self._hook_handles.append(layer.register_forward_pre_hook(functools.partial(self._pre_hook, i)))
            if self._meter is not None:
                self._hook_handles.append(layer.register_forward_hook(functools.partial(self._post_hook, i)))
        return self

    def _pre_hook(self, index: int, module: nn.Module, args: Any) -> None:
        self._cur_layer = index
        if self._metering and not self._backward:  # not a recomputation (activation checkpointing)
            self._meter.enter(index)

    def _post_hook(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        if self._metering and not self._backward:
            self._meter.leave(index)

    @property
    def _metering(self) -> bool:
        """Whether this micro-batch is the one measured for the automatic settings."""
        index = self._micro_batches + 1
        return self._meter is not None and self.tuning is None and MEASURE_AT <= index < MEASURE_AT + MEASURE_COUNT

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
    def __enter__(self) -> SavedTensorOffloader:
        self.begin()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.end(failed=exc_type is not None)

    def begin(self) -> None:
        """Start one micro-batch: install the hooks (forward and backward must both run before :meth:`end`)."""
        if self._closed:
            raise RuntimeError("This SavedTensorOffloader is closed; create a new one.")
        if self._ctx is not None:
            return
        self._cur_layer = -1
        self._backward = False
        if self._metering:
            self._meter.start()
            self._measured_from = dataclasses.replace(self.stats)
        with self._cond:
            self._order = [r for r in self._order if r.state != _FREED]
            self._cursor = len(self._order) - 1
            if all(r.slot is None for r in self._order):
                self._spill.rewind()  # nothing of earlier micro-batches is in the files: start again at offset 0
        # A re-check's baseline: every other micro-batch with offload paused, while the other ones offload.
        self._paused = self._comparing and len(self._paused_walls) <= len(self._walls) and not self._rechecked
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        self._began_at = time.perf_counter()

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
        self._wait_for(lambda r: r.refs <= 0)  # a write error is recorded in `_error`, raised below
        try:
            self._raise_pending_error()
        except BaseException:
            # A write that failed after backward read everything back ends the micro-batch as a failure: no record
            # or file of it outlives the error.
            self.clear()
            raise
        self._drop_read_pool()
        if self._metering:
            self._io_samples.append(self._io_costs())
        self._micro_batches += 1
        if self._meter is not None and self.tuning is None and self._micro_batches == MEASURE_AT + MEASURE_COUNT - 1:
            self._tune()
        elif self.tuning is not None and not self.tuning.given and not self._rechecked:
            wall = time.perf_counter() - self._began_at
            if self._recheck_from is None:  # the first micro-batch under the choice settles it: counted from here
                self._recheck_from = dataclasses.replace(self.stats)
                self._comparing = self._room_for_a_paused_micro_batch()
            elif self._paused:
                self._paused_walls.append(wall)
            else:
                self._walls.append(wall)
                if len(self._walls) == RECHECK_COUNT:
                    self._recheck()
        self._paused = False

    def settle_writes(self) -> None:
        """Block until every write started so far has finished: the activations it offloaded are then in their files
        and out of memory, and backward reads each of them back (raises a write's error, if any)."""
        self._wait_for(lambda r: r.state == _WRITING)  # a write error is recorded in `_error`, raised below
        self._raise_pending_error()

    def _wait_for(self, which: Callable[[_Record], bool]) -> None:
        """Wait for the I/O in flight of the records ``which`` picks now; its errors are the caller's to raise."""
        with self._cond:
            pending = [r.future for r in self._records.values() if r.future is not None and which(r)]
        for future in pending:
            with contextlib.suppress(BaseException):
                future.result()

    def _io_costs(self) -> IOCosts:
        """The I/O's bandwidths and CPU time per byte in the micro-batch that just ended."""
        s, before = self.stats, self._measured_from
        assert before is not None
        written, read = s.bytes_written - before.bytes_written, s.bytes_read - before.bytes_read
        return IOCosts(
            write_bytes_per_s=_rate(written, s.write_busy_s - before.write_busy_s),
            read_bytes_per_s=_rate(read, s.read_busy_s - before.read_busy_s),
            cpu_s_per_byte=(s.io_cpu_s - before.io_cpu_s) / max(1, written + read),
            compute_on_host=self._compute_device == "cpu",
        )

    def _tune(self) -> None:
        """Choose the settings left to ``None`` from the measured micro-batches (the median of each I/O cost: one
        micro-batch the machine was busy elsewhere does not decide)."""
        samples = self._io_samples
        costs = ("write_bytes_per_s", "read_bytes_per_s", "cpu_s_per_byte")
        io = dataclasses.replace(samples[-1], **{c: statistics.median(getattr(s, c) for s in samples) for c in costs})
        self._tuned_io = io
        self._apply(self._choose(io))

    def _choose(self, io: IOCosts, extra_s_per_byte: float = 0.0) -> Tuning:
        meter = self._meter
        assert meter is not None
        return tune(
            meter.forward_s, meter.tail_s, meter.sizes, io, **self._requested, budget=self.overhead_budget,
            extra_s_per_byte=extra_s_per_byte,
        )  # fmt: skip

    def _apply(self, tuning: Tuning, why: str = "") -> None:
        """Put ``tuning``'s settings in force and say once what was chosen and why."""
        self.tuning = tuning
        self.threshold_bytes, self.keep_last = tuning.threshold_bytes, tuning.keep_last
        self.max_inflight_bytes = tuning.max_inflight_bytes
        layers, described = len(self._layers), tuning.describe(len(self._layers))
        if tuning.given and tuning.predicted.share > tuning.budget:
            log.warning(
                "Activation offload: the settings given (%s) are predicted to add %.1f%% to the step, over its "
                "%.0f%% budget (`overhead_budget`). Kept as given; leave them to None to stay within the budget.",
                described, 100 * tuning.predicted.share, 100 * tuning.budget,
            )  # fmt: skip
        elif tuning.offloads_nothing and not tuning.given:
            log.warning(
                "Activation offload offloads nothing%s: on this machine no activation's write and read can hide "
                "behind compute within the %.0f%% overhead budget (`overhead_budget`); every activation stays in "
                "memory (%s).",
                why, 100 * tuning.budget, described,
            )  # fmt: skip
        elif tuning.held_back:
            log.warning(
                "Activation offload offloads less%s to stay within its %.0f%% overhead budget (`overhead_budget`): "
                "%s. A larger budget saves more memory: %d of %d layers kept.",
                why, 100 * tuning.budget, described, tuning.keep_last, layers,
            )  # fmt: skip
        else:
            log.info("Activation offload%s: %s.", why, described)

    def _room_for_a_paused_micro_batch(self) -> bool:
        """Whether memory holds a micro-batch's saved activations twice over (where compute runs): the re-check may
        then pause offload every other micro-batch to measure the step without it."""
        tuning = self.tuning
        assert tuning is not None
        needed = 2 * tuning.saved_bytes
        if self._compute_device == "cuda" and torch.cuda.is_available():
            free, _ = torch.cuda.mem_get_info()
            return free > needed
        return psutil.virtual_memory().available > needed

    def _recheck(self) -> None:
        """Once, after the first micro-batches under the chosen settings: the overhead they showed against the
        prediction. Where memory has room (:meth:`_room_for_a_paused_micro_batch`), measured directly: the median
        micro-batch offloading against the median one beside it with offload paused (every saved tensor in memory,
        as without offload). Otherwise from the offloader's own clocks: the training thread waiting on offload, and
        the I/O threads' CPU time where compute shares the cores, weighed as the model weighs it. More than half the
        budget above the prediction, the choice is made again with the difference charged to each offloaded byte, so
        less leaves memory. Never the other way: a step that seems cheaper is no room to offload more."""
        self._rechecked = True
        tuning = self.tuning
        assert tuning is not None and self._tuned_io is not None and self._recheck_from is not None
        wall = statistics.median(self._walls)
        if self._paused_walls:
            measured = wall / statistics.median(self._paused_walls) - 1
        else:
            s, before, count = self.stats, self._recheck_from, len(self._walls)
            waited = (s.forward_wait_s - before.forward_wait_s + s.backward_wait_s - before.backward_wait_s) / count
            cpu = (s.io_cpu_s - before.io_cpu_s) / count * (HOST_CPU_FACTOR if tuning.io.compute_on_host else 0.0)
            added = min(waited + cpu, wall)
            measured = added / (wall - added) if wall > added else float("inf")
        self.measured_overhead = measured
        off_by = measured - tuning.predicted.share
        if off_by <= tuning.budget / 2 or tuning.predicted.offloaded_bytes == 0:
            return
        # In the model's own step: the chosen settings would then be predicted at what they showed.
        extra = off_by * tuning.predicted.step_s / tuning.predicted.offloaded_bytes
        self._apply(
            self._choose(self._tuned_io, extra_s_per_byte=extra),
            f" (re-checked: the steps after the choice showed {measured:.1%} where {tuning.predicted.share:.1%} was "
            "predicted)",
        )

    def close(self) -> None:
        """Remove the hooks, every file and the run directories; stop the I/O threads."""
        if self._closed:
            return
        self.end(failed=True)
        self.detach()
        self._pool.shutdown(wait=True)
        self._free_bufs.clear()
        self._drop_read_pool()
        if self._own_io:
            self._io.close()
        for d in self._dirs:
            shutil.rmtree(d, ignore_errors=True)
        self._closed = True

    def clear(self) -> None:
        """Wait for I/O, then forget every record and delete its file (handles still alive become invalid)."""
        self._wait_for(lambda r: True)  # errors too: we are cleaning up
        with self._cond:
            for rec in list(self._records.values()):
                self._free(rec)
            self._records.clear()
            self._order.clear()
            self._cursor = -1
            self._error = None
        self._spill.discard()

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
        if on_cuda(t) and torch.cuda.is_current_stream_capturing():
            # A captured graph replays its kernels without this hook: writes and reads would not happen on replay.
            raise RuntimeError(
                "Activation offload cannot run while a CUDA graph is captured (`torch.compile(mode='reduce-overhead')` "
                "or `torch.cuda.graph`): the graph would replay without the offload's copies. Compile with another "
                "mode (e.g. `mode='default'` or 'max-autotune-no-cudagraphs'), or turn activation offload off."
            )
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
            rec = _Record(key, weakref.ref(storage), nbytes, t.shape, t.stride(), t.dtype, t.device, t)
            self._records[key] = rec
            self._charge_resident(nbytes)
            if self._should_offload(t, nbytes):
                rec.produced = record_fence(t.device)  # the user's current stream, whichever it is
                self._start_write(rec)
            else:
                self.stats.tensors_kept += 1
        return _Handle(self._release, rec)

    def _should_offload(self, t: Tensor, nbytes: int) -> bool:
        if not self.enabled or self._paused or self._backward or not _dense_span(t):
            return False
        if self._metering:
            self._meter.saved(self._cur_layer, nbytes)
            self._compute_device = t.device.type
        if nbytes < self.threshold_bytes:
            return False
        return not (self._layers and self._cur_layer >= len(self._layers) - self.keep_last)

    def _start_write(self, rec: _Record) -> None:
        t = rec.tensor
        assert t is not None
        # A CPU tensor is written from where it lies: the file holds the whole pages its bytes span, so the direct
        # transfer is aligned in memory and on disk; the tensor starts `head` bytes into the file.
        rec.head = t.data_ptr() % IO_ALIGN if t.device.type == "cpu" else 0
        padded = round_up(rec.head + rec.nbytes, IO_ALIGN)
        # Back-pressure: wait until the budget has room (a tensor bigger than the budget goes alone).
        if self._inflight > 0 and self._inflight + padded > self.max_inflight_bytes:
            start = time.perf_counter()
            while self._inflight > 0 and self._inflight + padded > self.max_inflight_bytes:
                self._cond.wait()
                self._raise_pending_error()
            self.stats.forward_wait_s += time.perf_counter() - start
        self._inflight += padded
        rec.charged = padded
        rec.state = _WRITING
        rec.slot = self._spill.allocate(padded)
        self._order.append(rec)
        self._cursor = len(self._order) - 1
        self.stats.tensors_offloaded += 1
        rec.future = self._pool.submit(self._write, rec)

    def _write(self, rec: _Record) -> None:
        with self._cond:
            if self._backward:  # the state is `_WRITING` until the write settles it
                # Backward started before this write did: the tensor stays in memory for it, no I/O at all.
                self._settle_write(rec, keep=True)
                self.stats.writes_skipped += 1
                return
        try:
            t = rec.tensor
            assert t is not None and rec.slot is not None
            bind_thread(t.device)  # this pool serves every device's tensors: CUDA calls go to the tensor's own
            start = time.perf_counter()
            if t.device.type == "cpu":
                buf, copied = _pages(t, rec.head, rec.charged), start
                self._write_file(rec, buf)
            else:
                cuda = on_cuda(t)
                span = t.as_strided((t.numel(),), (1,))  # dense: exactly the bytes of the tensor, any permutation
                buf = self._staging(rec.charged, pinned=cuda)
                try:
                    if cuda:
                        stream = self._streams.stream(t.device, "out")
                        self._streams.copy(buf[: rec.nbytes], span.view(torch.uint8), stream, after=rec.produced)
                    else:
                        buf[: rec.nbytes].copy_(span.view(torch.uint8))
                    copied = time.perf_counter()
                    self._write_file(rec, buf)
                finally:
                    self._give_back(buf, pinned=cuda)
                del span
            written = time.perf_counter()
            del buf, t
        except BaseException as exc:  # noqa: BLE001 - surfaced to the training thread
            if is_disk_full(exc):
                exc = disk_full_error(
                    self._dirs[rec.slot[0]],
                    "an activation offloaded during forward",
                    rec.nbytes,
                    "The step stopped before the optimizer ran: the training state is untouched. Free space, add "
                    "storage paths, or raise `threshold_bytes`/`keep_last`.",
                )
            with self._cond:
                self._error = exc
                self._settle_write(rec, keep=True)  # the tensor is still held: nothing is lost
            return
        with self._cond:
            self.stats.copy_s += copied - start
            self.stats.write_s += written - copied
            self.stats.bytes_written += rec.nbytes
            # Backward has started and may need it soon: keep the tensor (already counted), not the bytes on disk.
            self._settle_write(rec, keep=self._backward)

    def _write_file(self, rec: _Record, buf: Tensor) -> None:
        index, offset = rec.slot
        file = self._spill.reserve(index, offset + rec.charged)
        with self._io_clock("write"):
            self._io.write(file, buf, offset)

    @contextlib.contextmanager
    def _io_clock(self, kind: str) -> Iterator[None]:
        """Count the transfer's CPU time, and the wall time during which at least one ``kind`` transfer runs."""
        cpu = time.thread_time()
        with self._cond:
            if not self._io_active[kind]:
                self._io_since[kind] = time.perf_counter()
            self._io_active[kind] += 1
        try:
            yield
        finally:
            with self._cond:
                self._io_active[kind] -= 1
                if not self._io_active[kind]:
                    busy = f"{kind}_busy_s"
                    setattr(self.stats, busy, getattr(self.stats, busy) + time.perf_counter() - self._io_since[kind])
                self.stats.io_cpu_s += time.thread_time() - cpu

    def _settle_write(self, rec: _Record, keep: bool) -> None:
        """After the write of ``rec`` (or instead of it, or after it failed): its budget charge ends; the tensor stays
        in memory if ``keep``, else the file holds it (caller holds the lock)."""
        self._inflight -= rec.charged
        rec.charged = 0
        if keep:
            rec.state = _IN_MEMORY
            rec.slot = None
        else:
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

    def _lease(self, nbytes: int) -> Tensor:
        """An aligned buffer of ``nbytes`` for a read, whose memory returns to a pool when the last tensor using it is
        freed: memory already faulted in, so the read does not pay the kernel for fresh pages (measured: 40% less I/O
        CPU). The pool holds at most the in-flight budget, and is emptied when the micro-batch ends, so that forward
        does not run beside idle buffers."""
        with self._cond:
            free = self._read_pool.get(nbytes)
            if free:
                self._read_pooled -= nbytes
                self.stats.pooled_reads += 1
                buf = free.pop()
            else:
                buf = None
        if buf is None:
            buf = aligned_empty(nbytes)
        array = buf.numpy()  # a new array object: autograd's tensors keep it alive, its end returns `buf`
        weakref.finalize(array, self._return_lease, buf)
        return torch.from_numpy(array)

    def _drop_read_pool(self) -> None:
        with self._cond:
            self._read_pool.clear()
            self._read_pooled = 0

    def _return_lease(self, buf: Tensor) -> None:
        with self._cond:
            if not self._closed and self._read_pooled + buf.numel() <= self.max_inflight_bytes:
                self._read_pool.setdefault(buf.numel(), []).append(buf)
                self._read_pooled += buf.numel()
                self.stats.peak_pooled_bytes = max(self.stats.peak_pooled_bytes, self._read_pooled)

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
                "SavedTensorOffloader frees each activation after its first use. Disable activation offload for "
                "this model or run backward once per forward."
            )
        with self._cond:
            if not self._backward and self._metering:
                self._meter.backward_started()
            self._backward = True
            self._raise_pending_error()
            fut = None
            if rec.state == _FREED:
                raise RuntimeError("A saved activation was used after its offload run was cleared or closed.")
            if rec.state == _WRITING:
                self.stats.forwarded += 1  # still in memory: no read
                out = rec.tensor
            elif rec.state == _IN_MEMORY:
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
            start = time.perf_counter()
            fut.result()
            self.stats.backward_wait_s += time.perf_counter() - start
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
        padded = round_up(rec.head + rec.nbytes, IO_ALIGN)
        if not force and self._inflight > 0 and self._inflight + padded > self.max_inflight_bytes:
            return False
        self._inflight += padded
        rec.charged = padded
        rec.state = _READING
        self._charge_resident(rec.nbytes)
        rec.future = self._pool.submit(self._read, rec)
        return True

    def _read(self, rec: _Record) -> None:
        start = time.perf_counter()
        try:
            assert rec.slot is not None
            bind_thread(rec.device)  # this pool serves every device's tensors: CUDA calls go to the tensor's own
            index, offset = rec.slot
            cuda = rec.device.type == "cuda"
            buf = self._staging(rec.charged, pinned=True) if cuda else self._lease(rec.charged)
            with self._io_clock("read"):
                self._io.read(self._spill.file(index), buf, offset)
            out = buf[rec.head : rec.head + rec.nbytes].view(rec.dtype).as_strided(rec.shape, rec.stride)
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
            rec.slot = None  # the bytes are in memory: their space in the spill file is no longer needed
            self.stats.read_s += time.perf_counter() - start
            self.stats.bytes_read += rec.nbytes
            rec.tensor = out
            rec.state = _IN_MEMORY  # `_READING` until here: nothing else changes the state of a record being read
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
            if rec.refs <= 0 and rec.state in (_IN_MEMORY, _ON_DISK):
                self._free(rec)

    def _free(self, rec: _Record) -> None:
        """Drop the record's memory and file (caller holds the lock; I/O on it must be finished)."""
        if rec.state == _FREED:
            return
        if rec.state in (_WRITING, _READING) and not rec.future.done():
            return  # the I/O completion frees it (refs <= 0)
        if rec.tensor is not None:
            self._charge_resident(-rec.nbytes)
            rec.tensor = None
        if rec.charged:
            self._inflight -= rec.charged
            rec.charged = 0
            self._cond.notify_all()
        rec.slot = None
        rec.state = _FREED
        if self._records.get(rec.key) is rec:
            del self._records[rec.key]

    def files(self) -> list[Path]:
        """Files in the run directories now: the spill files, kept from one micro-batch to the next (for tests and
        diagnostics)."""
        return [f for d in self._dirs if d.exists() for f in d.iterdir()]

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


#: Renamed; the old name still resolves, with a ``DeprecationWarning``.
__getattr__ = old_names(__name__, {"ActivationOffloader": "SavedTensorOffloader"})
