"""Streaming backends: shard state in files of chunk records, streamed through a fixed pool of buffers per device.

A :class:`StreamingBackend` owns the shards, their state files and slots, tentative updates, the pending work, the
device timeout and failure latch, save, load and prefetch. Its devices (:class:`StreamingDevice`) run the chunk
pipeline: a worker thread serves requests in submission order, one reader and one writer pool move chunk records,
reads run ahead of the update, write-back trails behind it, and a device with no request to serve reads ahead the
shards it was told come next. Host memory of the update path is fixed by ``buffer_count`` and ``chunk_elems``,
whatever the model size.

A new kind of device implements the two hooks:

- :meth:`StreamingBackend.make_device`: build device ``index`` over its directory;
- :meth:`StreamingDevice.allocate` and :meth:`StreamingDevice.update_work`: its buffers, and what one update does
  to each chunk (plus :meth:`StreamingDevice.initialize_link_bytes` where :meth:`~StreamingBackend.initialize`
  moves other bytes than the masters over the link).
"""

from __future__ import annotations

import errno
import functools
import itertools
import logging
import math
import os
import queue
import stat
import statistics
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from lightning_smartinf.csd.accelerator import (
    Fence,
    HostLink,
    current_accelerator,
    on_cuda,
    record_fence,
    side_stream,
    start_thread,
    thread_pool,
)
from lightning_smartinf.csd.backend import Backend, BackendStats, DeviceStats, Handle, ShardSpec
from lightning_smartinf.csd.checkpoint import ShardState, load_state, save_state, shard_file_name
from lightning_smartinf.csd.compression import SparseGrad
from lightning_smartinf.csd.io import IOEngine, StateFile, aligned_empty
from lightning_smartinf.csd.layout import ChunkLayout
from lightning_smartinf.csd.ownership import claim_directories, release_claims
from lightning_smartinf.csd.pipeline import (
    ChunkPool,
    ChunkRead,
    ChunkWork,
    DropPrefetch,
    PrefetchAdvice,
    PrefetchedChunk,
    PrefetchPlan,
    PrefetchTarget,
    ReadAheadWindow,
    Request,
    Shard,
)
from lightning_smartinf.csd.placement import (
    Fixed,
    Placement,
    RoundRobin,
    Tiered,
    check_assignment,
    measure_write_read,
    memory_share,
)
from lightning_smartinf.csd.rules import StepParams
from lightning_smartinf.csd.storage import StorageError, check_free_space, ensure_private_dir
from lightning_smartinf.csd.traffic import Traffic
from lightning_smartinf.csd.update_model import best_share, memory_candidates, update_tail

log = logging.getLogger(__name__)
#: Change in a storage device's share of the measured update rate (in share points: 0.1 is from 50% to below 40% or
#: above 60%) that makes :meth:`StreamingBackend.replan` move shards.
REPLAN_DRIFT = 0.1
#: Steps of backward timings (:meth:`StreamingBackend.note_backward`) kept for the next re-plan.
BACKWARD_SAMPLES = 20
#: Bytes copied at a time when a shard moves between devices.
MOVE_BLOCK = 4 << 20
#: Seconds an idle device waits for a request before it retries taking a buffer for a prefetch.
PREFETCH_POLL_S = 0.002


@dataclass
class DeviceCounters:
    """Seconds a device spent on each kind of work (summed over its threads), and bytes it prefetched."""

    read_s: float = 0.0
    write_s: float = 0.0
    compute_s: float = 0.0
    #: Bytes read ahead of their request by :meth:`StreamingBackend.prefetch`: used by it, or dropped unused.
    prefetch_used_bytes: int = 0
    prefetch_dropped_bytes: int = 0
    #: Wall seconds the worker spent serving updates, and the state bytes they read and wrote: the device's rate.
    update_s: float = 0.0
    update_bytes: int = 0


@dataclass(frozen=True)
class Replan:
    """What :meth:`StreamingBackend.replan` decided for the memory tier, and from what."""

    #: Bytes of state the memory tier may hold from now on (its share of its budget).
    memory_share: int
    #: The update phase predicted for that share, and for the placement the re-plan found (seconds after the step
    #: began: :func:`~lightning_smartinf.csd.update_model.update_tail`).
    predicted_s: float
    current_s: float
    #: The rate of each device the prediction used (state bytes per second; measured, or estimated before a device
    #: updated), by device index.
    rates: dict[int, float]
    #: Seconds before the step began that backward completed each shard's gradient (medians over the steps since
    #: the last re-plan; missing: at the step).
    ready: dict[int, float]


@dataclass(frozen=True)
class _Transfer:
    """A chunk transfer in flight, for timeout messages."""

    operation: str
    path: Path
    offset: int
    started: float


def check_device_timeout(device_timeout_s: object) -> float | None:
    """``device_timeout_s`` as seconds, or ``None`` (wait forever); ``ValueError`` naming the fix otherwise."""
    if device_timeout_s is None:
        return None
    if (
        isinstance(device_timeout_s, bool)
        or not isinstance(device_timeout_s, (int, float))
        or not math.isfinite(device_timeout_s)
        or device_timeout_s <= 0
    ):
        raise ValueError(
            f"`device_timeout_s={device_timeout_s!r}` must be a positive, finite number of seconds (int or float), "
            "or None to wait for a device forever. Pass e.g. `device_timeout_s=300`."
        )
    return float(device_timeout_s)


class StreamingDevice(ABC):
    """One streaming device: a directory, a chunk-buffer pool, a worker thread and reader and writer threads.

    The worker serves the requests of :meth:`enqueue` in order (:meth:`_serve`); its read-ahead state is a
    :class:`~lightning_smartinf.csd.pipeline.ReadAheadWindow` and its prefetch state a
    :class:`~lightning_smartinf.csd.pipeline.PrefetchPlan`, both touched by the worker only.
    """

    #: Whether the state lives in memory (the memory or accelerator tier), not in files on a storage path.
    in_memory = False
    #: The tier this device's state is in: ``"storage"``, ``"memory"`` or ``"accelerator"``.
    tier = "storage"
    #: The traffic counters of this device's state reads and writes (its tier's).
    read_counter = "storage_read_bytes"
    write_counter = "storage_write_bytes"

    def __init__(
        self,
        index: int,
        directory: Path,
        traffic: Traffic,
        io: IOEngine,
        *,
        chunk_elems: int,
        buffer_count: int,
        io_threads: int = 1,
    ) -> None:
        self.index = index
        self.directory = directory
        self.io = io
        self.stats = DeviceCounters()
        self.pool = ChunkPool()
        #: The worker's copies to and from accelerator memory (gradients in, parameters out), off the training stream.
        self.link = HostLink()
        #: Host bytes of the buffers this device allocated (see :meth:`allocate`).
        self.allocated_bytes = 0
        #: ``time.monotonic()`` of the last sign of life: new work, or a chunk read, written or updated.
        self.progress_at = time.monotonic()
        self._traffic = traffic
        self._chunk_elems = chunk_elems
        self._buffer_count = buffer_count
        self._trailing: list[Future] = []
        self._link_chunks: dict[torch.dtype, Tensor] = {}
        self._requests: queue.SimpleQueue[Request | PrefetchAdvice | DropPrefetch | None] = queue.SimpleQueue()
        self._transfers: dict[int, _Transfer] = {}
        self._transfer_keys = itertools.count()
        self.window = ReadAheadWindow()
        # More reads than ``buffer_count - 1`` are never in flight (one buffer is always the one updating).
        readers = max(1, min(io_threads, buffer_count - 1))
        # Prefetched chunks leave the request being served room for ``readers`` reads and never take the pool's
        # last two buffers (one updating, one reading), so its reads never wait on chunks no one consumes yet.
        self.prefetch_plan = PrefetchPlan(min(buffer_count - 2, max(1, buffer_count - 1 - readers)))
        # The threads run on the accelerator of the thread that built the device (this rank's GPU), and on CUDA on a
        # side stream of their own: whatever CUDA work they do (the accelerator tier's updates) stays off the default.
        accelerator = current_accelerator()
        stream = side_stream(accelerator) if accelerator is not None and accelerator.type == "cuda" else None
        self._reader = thread_pool(readers, f"csd{index}-read", accelerator, stream)
        self._writer = thread_pool(io_threads, f"csd{index}-write", accelerator, stream)
        self._worker = start_thread(self._serve, f"csd{index}-update", accelerator, stream)

    @property
    def chunk_elems(self) -> int:
        """Elements per streamed chunk."""
        return self._chunk_elems

    @property
    def buffer_count(self) -> int:
        """Chunk buffers in the pool (at least 2: one updating, one reading or writing)."""
        return self._buffer_count

    @property
    def trailing(self) -> tuple[Future, ...]:
        """Write-backs submitted by the last requests and not yet settled by :meth:`drain`."""
        return tuple(self._trailing)

    @property
    def running(self) -> bool:
        """Whether the worker thread still serves requests (until :meth:`close`)."""
        return self._worker.is_alive()

    # ------------------------------------------------------------------------------------------ hooks

    @abstractmethod
    def allocate(self, tensors_per_record: int) -> None:
        """Fill :attr:`pool` with ``buffer_count`` records of up to ``tensors_per_record`` fp32 tensors.

        Set :attr:`allocated_bytes` to the bytes taken (:func:`~lightning_smartinf.csd.layout.pool_bytes` for
        the pool, plus the device's own scratch).
        """

    @abstractmethod
    def update_work(
        self, shard: Shard, grad: Tensor | SparseGrad, hp: StepParams, out: Tensor, link_dtype: torch.dtype
    ) -> ChunkWork:
        """The work of one update of ``shard`` (see :meth:`Backend.submit`): per chunk, and its link bytes.

        Called on the host thread after the sizes were checked; raise ``ValueError`` for what the device cannot
        run. The compute runs on the worker, chunk by chunk, in order.
        """

    def initialize_link_bytes(self, shard: Shard, master: Tensor) -> int:
        """Link bytes of :meth:`Backend.initialize`: the masters as given.

        A device that writes whole records from the host counts those instead.
        """
        return master.numel() * master.element_size()

    def run_compute(self, work: Callable[[], None]) -> None:
        """Run one chunk's ``work`` (an update, a fill, a read of the master) on this device's worker thread."""
        work()

    def create_file(self, name: str, size: int) -> StateFile:
        """A new state file ``name`` of ``size`` bytes for a shard this device holds (in :attr:`directory`)."""
        return StateFile(self.directory / name, size, create=True)

    def link_chunk(self, n: int, dtype: torch.dtype) -> Tensor:
        """Scratch for one gradient chunk as it crosses the link (allocated once per dtype)."""
        chunk = self._link_chunks.get(dtype)
        if chunk is None:
            chunk = self._link_chunks[dtype] = torch.empty(self._chunk_elems, dtype=dtype)
            self.allocated_bytes += chunk.numel() * chunk.element_size()
        return chunk[:n]

    # ------------------------------------------------------------------------------------------ host side

    def enqueue(self, request: Request) -> Handle:
        handle = request.future
        handle.device = self
        handle.what = f"the {request.kind} of shard {request.shard.spec.index}"
        self.progress_at = time.monotonic()
        self._requests.put(request)
        return handle

    def prefetch(self, targets: Sequence[PrefetchTarget]) -> None:
        """Advise that the next requests read ``targets`` first, in this order."""
        self.progress_at = time.monotonic()
        self._requests.put(PrefetchAdvice(tuple(targets)))

    def drop_prefetched(self) -> Future:
        """Drop every chunk read ahead; the returned future resolves once no prefetch read is in flight."""
        message = DropPrefetch()
        self.progress_at = time.monotonic()
        self._requests.put(message)
        return message.done

    def close(self, timeout: float | None = None) -> bool:
        """Stop the threads and free the buffers; False if a transfer still had not finished after ``timeout`` s.

        Then the threads a hung transfer holds are left behind and the I/O engine stays open: its buffers may
        still be written by the transfer.
        """
        self._requests.put(None)
        deadline = None if timeout is None else time.monotonic() + timeout
        self._worker.join(timeout)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        settled = not self._worker.is_alive() and self.pool.wait_idle(left)
        self._reader.shutdown(wait=settled, cancel_futures=True)
        self._writer.shutdown(wait=settled, cancel_futures=True)
        if settled:
            self.io.close()
            self.link.close()
        else:
            log.warning(
                "Device %d at %r: %s still pending %s s after `close`; its threads are left behind and the process "
                "may not exit until the storage answers.",
                self.index,
                str(self.directory),
                self._describe_transfers(),
                timeout,
            )
        # Free the memory now, even if something still references this device object.
        self.pool.clear()
        self._link_chunks.clear()
        self.allocated_bytes = 0
        return settled

    def drain(self, timeout: float | None = None) -> BaseException | None:
        """Wait for all trailing write-back; return the first error, if any (``timeout``: see :meth:`wait_for`)."""
        trailing, self._trailing = self._trailing, []
        errors = (self.wait_for(f, "the state write-back", timeout) for f in trailing)
        return next((exc for exc in errors if exc is not None), None)

    def stalled_s(self) -> float:
        """Seconds since this device last showed a sign of life (:attr:`progress_at`)."""
        return time.monotonic() - self.progress_at

    def wait_for(self, future: Future, what: str, timeout: float | None) -> BaseException | None:
        """Block until ``future`` (work of this device, described by ``what``) is done; return its error, if any.

        With a ``timeout``, raise :class:`StorageError` once the device has shown no sign of life (no new work, no
        chunk read, written or updated) for ``timeout`` seconds while ``future`` is pending: it stopped answering.
        A long queue of work that moves never times out.
        """
        if timeout is None:
            return future.exception()
        while True:
            try:
                return future.exception(timeout=max(0.0, timeout - self.stalled_s()))
            except FutureTimeoutError:
                if self.stalled_s() >= timeout:
                    raise self._timeout_error(what, timeout) from None

    def _timeout_error(self, what: str, timeout: float) -> StorageError:
        transfers = sorted(list(self._transfers.values()), key=lambda t: t.started)
        operation, path = (transfers[0].operation, transfers[0].path) if transfers else ("update", self.directory)
        return StorageError(
            f"Device {self.index} at {str(self.directory)!r} showed no progress for {timeout:g} s "
            f"(`device_timeout_s={timeout!r}`) while the host waited for {what}; pending: "
            f"{self._describe_transfers()}. Its storage stopped answering (a hung disk, an unresponsive network "
            "mount), so the state there may be torn. Fix the storage, then resume from the last checkpoint; raise "
            "`device_timeout_s` if the device is only slow.",
            path=path,
            operation=operation,
            errno=errno.ETIMEDOUT,
        )

    def _describe_transfers(self) -> str:
        now = time.monotonic()
        transfers = sorted(list(self._transfers.values()), key=lambda t: t.started)
        if not transfers:
            return "no chunk transfer in flight (the update of a chunk has not returned)"
        return "; ".join(
            f"{t.operation} of {str(t.path)!r} at byte {t.offset} (for {now - t.started:.1f} s)" for t in transfers
        )

    # ------------------------------------------------------------------------------------------ worker side

    def _transfer(self, operation: str, file: StateFile, record: Tensor, offset: int) -> None:
        """Read or write one chunk record through the engine, raising a :class:`StorageError` for an OSError.

        The error names the file, the operation and the errno; the engine raises only once no piece is in flight.
        """
        key = next(self._transfer_keys)
        self._transfers[key] = _Transfer(operation, file.path, offset, time.monotonic())
        try:
            if operation == "read":
                self.io.read(file, record, offset)
            else:
                self.io.write(file, record, offset)
        except StorageError:
            raise
        except OSError as exc:
            where = f" at byte {offset}"
            raise StorageError.from_os_error(exc, path=file.path, operation=operation, where=where) from exc
        finally:
            del self._transfers[key]
            self.progress_at = time.monotonic()

    def _serve(self) -> None:
        """The worker: serve the window's first request, taking the next off the queue when the window is empty."""
        window = self.window
        try:
            while True:
                if not window.requests:
                    if window.closing:
                        return
                    request = self._next_queued()
                    if request is None:
                        return
                    window.push(request, self._adopt_prefetched(request))
                request = window.serving
                started = time.perf_counter()
                try:
                    self._stream(request)
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting host thread
                    request.future.set_exception(exc)
                else:
                    if request.read and request.write:
                        self.stats.update_s += time.perf_counter() - started
                        self.stats.update_bytes += 2 * request.shard.layout.file_bytes
                    self._traffic.add(link_write_bytes=request.link_write, link_read_bytes=request.link_read)
                    request.future.set_result(None)
                finally:
                    window.pop_served()
        finally:
            self._drop_prefetched()

    def _next_queued(self) -> Request | None:
        """Block for the next request (None: close), prefetching advised chunks into free buffers meanwhile."""
        while True:
            self._issue_prefetch()
            try:
                if self.prefetch_plan.wants_buffer:
                    item = self._requests.get(timeout=PREFETCH_POLL_S)
                else:
                    item = self._requests.get()
            except queue.Empty:
                continue  # a write-back may have freed a buffer for the next prefetch
            if not self._control(item):
                return item  # type: ignore[return-value]

    def _control(self, item: Request | PrefetchAdvice | DropPrefetch | None) -> bool:
        """Act on a prefetch message taken off the queue; False if ``item`` is a request or the close sentinel."""
        if isinstance(item, PrefetchAdvice):
            self._drop_prefetched()  # new advice replaces the old
            self.prefetch_plan.advise(item.targets)
            return True
        if isinstance(item, DropPrefetch):
            self._drop_prefetched()
            item.done.set_result(None)
            return True
        return False

    def _issue_prefetch(self) -> None:
        """Start reads of advised chunks while the cap allows and a buffer is free; never blocks."""
        plan = self.prefetch_plan
        while (entry := plan.next_entry()) is not None:
            if (buf := self.pool.try_acquire()) is None:
                return  # write-back holds the pool; retried when the queue poll times out
            k, entry.next_chunk = entry.next_chunk, entry.next_chunk + 1
            pending = self._reader.submit(self._read, entry.shard, entry.slot, k, buf, count=False)
            plan.held.append(PrefetchedChunk(entry.shard, entry.slot, k, buf, pending))

    def _adopt_prefetched(self, request: Request) -> int:
        """Hand ``request`` the chunks read ahead for its shard, as its first reads; drop them if they do not fit.

        From now on the request reads its shard itself, so it leaves the plan. Returns the number of chunks
        adopted (the request's next chunk to read). Their bytes count as read now, with the request that
        uses them, so per-step traffic stays exact.
        """
        mine = self.prefetch_plan.take(request.shard)
        if not mine:
            return 0
        fits = request.read and all(c.slot == request.read_slot and c.k == i for i, c in enumerate(mine))
        if not fits:
            self._drop(mine)
            return 0
        for chunk in mine:
            self.window.reads.append(ChunkRead(request, chunk.k, chunk.buf, chunk.pending))
            nbytes = chunk.shard.layout.record_bytes(chunk.k)
            self._traffic.add(**{self.read_counter: nbytes})
            self.stats.prefetch_used_bytes += nbytes
        return len(mine)

    def _drop_prefetched(self) -> None:
        """Forget the advice and release every chunk read ahead (waiting for their reads)."""
        self._drop(self.prefetch_plan.clear())

    def _drop(self, chunks: list[PrefetchedChunk]) -> None:
        for chunk in chunks:
            if chunk.pending.exception() is None:  # a read that happened is traffic, used or not
                nbytes = chunk.shard.layout.record_bytes(chunk.k)
                self._traffic.add(**{self.read_counter: nbytes})
                self.stats.prefetch_dropped_bytes += nbytes
            self.pool.release(chunk.buf)

    def _next_read(self) -> tuple[Request, int] | None:
        """The next (request, chunk) to read, in request order, taking queued requests into the window as needed."""
        window = self.window
        while True:
            target = window.next_read()
            if target is not None:
                return target.request, target.k
            if not window.exhausted or window.closing:
                return None
            try:
                queued = self._requests.get_nowait()
            except queue.Empty:
                return None
            if self._control(queued):
                continue
            if queued is None:
                window.closing = True
                return None
            window.push(queued, self._adopt_prefetched(queued))  # type: ignore[arg-type]

    def _issue_reads(self) -> None:
        """Keep up to ``buffer_count - 1`` chunk reads in flight, across request boundaries.

        The last buffer is the one being updated; write-back returns buffers to the pool, so ``acquire``
        blocking here is the back-pressure that keeps reads from running further ahead than the pool allows.
        Reads for a later request only take a buffer that is free now: the current request's parameters
        must never wait for a write-back on behalf of a request behind it.
        """
        window = self.window
        # Prefetched chunks hold buffers too: with them counted (at most the plan's cap), one buffer is always
        # free or being written back, so ``acquire`` cannot wait on reads only the worker itself would consume.
        while (
            len(window.reads) + len(self.prefetch_plan.held) < self._buffer_count - 1
            and (target := self._next_read()) is not None
        ):
            request, k = target
            if request is window.serving:
                buf = self.pool.acquire()
            elif (free := self.pool.try_acquire()) is not None:
                buf = free
            else:
                window.unclaim()  # retried at the next chunk boundary
                return
            pending = self._reader.submit(self._read, request.shard, request.read_slot, k, buf)
            window.reads.append(ChunkRead(request, k, buf, pending))

    def _read(self, shard: Shard, slot: int, k: int, buf: Tensor, *, count: bool = True) -> Tensor:
        """Read chunk ``k`` of ``shard``'s ``slot`` into ``buf``; a prefetch (``count=False``) is counted later."""
        record = buf[: shard.layout.padded_len(k) * shard.layout.tensors_per_record]
        previous_write = shard.writes.get((slot, k))
        if previous_write is not None:
            previous_write.result()  # the record's last update must be on disk before we read it back
        t0 = time.perf_counter()
        offset = shard.layout.record_offset(k)
        in_place = shard.files[slot].view(offset, record.numel() * 4)
        if in_place is None:
            self._transfer("read", shard.files[slot], record, offset)
        else:
            record = in_place.view(torch.float32)  # updated where it lies; its write-back is then no copy
        self.stats.read_s += time.perf_counter() - t0
        if count:
            self._traffic.add(**{self.read_counter: shard.layout.record_bytes(k)})
        return record

    def _write(self, file: StateFile, offset: int, buf: Tensor, record: Tensor) -> None:
        try:
            t0 = time.perf_counter()
            self._transfer("write", file, record, offset)
            self.stats.write_s += time.perf_counter() - t0
        finally:
            self.pool.release(buf)  # the engine returns or raises only once no piece of ``record`` is in flight

    def _chunk_record(self, request: Request, k: int) -> tuple[Tensor, Tensor]:
        """The buffer and record of chunk ``k`` to update: read (waiting for its read) or zeroed."""
        layout = request.shard.layout
        if not request.read:
            buf = self.pool.acquire()
            record = buf[: layout.padded_len(k) * layout.tensors_per_record]
            record.zero_()
            return buf, record
        read = self.window.reads.popleft()
        assert read.request is request and read.k == k, "reads are issued in request and chunk order"
        try:
            return read.buf, read.pending.result()
        except BaseException:
            self.pool.release(read.buf)
            raise

    def _stream(self, request: Request) -> None:
        """Run one request over all chunks of its shard: read ahead, update, write behind.

        Reads run up to ``buffer_count - 1`` chunks ahead, into the next queued requests when this one has
        no chunk left to read, so the disk does not idle at request boundaries. The request completes when
        its last chunk is updated (the parameters in ``out`` are ready); write-back of the last chunks
        trails, ordered before any later read of the same chunk.
        """
        shard, layout = request.shard, request.shard.layout
        self._trailing = [f for f in self._trailing if not f.done() or f.exception() is not None]
        try:
            for k in range(layout.num_chunks):
                self._issue_reads()
                buf, record = self._chunk_record(request, k)
                if k == 0 and request.ready is not None:
                    request.ready.synchronize()
                padded = layout.padded_len(k)
                start, n = layout.chunk_range(k)
                master = record[:n]
                states = [record[(j + 1) * padded : (j + 1) * padded + n] for j in range(layout.num_states)]
                t0 = time.perf_counter()
                try:
                    self.run_compute(functools.partial(request.compute, record, master, states, start, n))
                except BaseException:
                    self.pool.release(buf)
                    raise
                self.stats.compute_s += time.perf_counter() - t0
                self.progress_at = time.monotonic()
                if request.write:
                    file = shard.files[request.write_slot]
                    write = self._writer.submit(self._write, file, layout.record_offset(k), buf, record)
                    shard.writes[(request.write_slot, k)] = write
                    self._trailing.append(write)
                    self._traffic.add(**{self.write_counter: record.numel() * 4})
                else:
                    self.pool.release(buf)
        finally:
            # Parameters copied to accelerator memory have landed before the request is reported done (or failed).
            self.link.settle()
            # A failed request drops its remaining reads; reads already issued for later requests stay theirs.
            reads = self.window.reads
            while reads and reads[0].request is request:
                read = reads.popleft()
                read.pending.exception()
                self.pool.release(read.buf)


class StreamingBackend(Backend):
    """Shards streamed through devices, one per directory in ``device_dirs``; subclasses say what a device is.

    Args:
        device_dirs: one private directory per device; state files are created inside. May be empty when a memory or
            accelerator tier holds all the state (beside remote servers, :mod:`~lightning_smartinf.csd.local_tiers`).
        chunk_elems: elements per streamed chunk (a multiple of 1024).
        buffer_count: chunk buffers per device (at least 2: one updating, one reading or writing).
        owned_dirs: directories the backend created and removes on :meth:`close`.
        tentative_slots: keep a second state file per shard so that :meth:`submit` can take ``tentative=True``
            updates, undone by :meth:`rollback` or made current by :meth:`commit`. Doubles the disk space of the
            state (not its traffic).
        prefetch_state: act on :meth:`prefetch` advice (``False`` ignores it: for comparisons).
        device_timeout_s: seconds a device may show no progress (no chunk read, written or updated) while the host
            waits for it, before :meth:`result`, :meth:`wait` and the others raise :class:`StorageError` and the
            backend stops (see :attr:`failure`). ``None`` waits forever.
        placement: which device holds each shard, decided at :meth:`open`. ``None``: :class:`Tiered` over the
            storage devices (weighted by ``device_weights``, or by speeds measured at :meth:`open` when the paths
            are on different filesystems) and the memory tier; with neither, shard ``s`` on device ``s mod N``.
        memory_bytes: bytes of shard state the memory tier may hold in host RAM (``0``: none). Its device comes
            after the storage devices (:meth:`make_memory_device`); its shards never take tentative updates.
        accelerator_bytes: bytes of shard state the accelerator tier may hold in accelerator memory (``0``: none).
            Its device comes last (:meth:`make_accelerator_device`); like memory, it takes no tentative updates.
        device_weights: relative speed of each storage device (``None``: equal, or measured, see ``placement``).
        accelerator_device: the torch device of the accelerator tier (``"cuda"``: the current GPU).
        measure_memory_share: let :meth:`replan` choose the memory tier's share of its budget from measured rates and
            from how much of the storage devices' update hides behind backward (``False``: fill the budget). ``None``:
            when the storage devices compute (:attr:`storage_computes`).

    The constructor claims the directories, then builds device ``i`` with :meth:`make_device` for each, in order.
    Device errors are final: the first one reported to the host (an I/O error, or a device that stopped answering)
    latches the backend as failed; see :attr:`failure`.
    """

    #: Whether a second state file per shard is kept for tentative updates (set by the constructor).
    tentative_slots = False
    #: Whether :meth:`prefetch` advice is acted on (set by the constructor).
    prefetch_state = True
    #: Seconds without progress before waiting on a device fails (set by the constructor; ``None``: forever).
    device_timeout_s: float | None = 300.0
    #: Whether the storage devices update with compute of their own (SmartSSD FPGAs), beside the host cores that
    #: update the memory tier: memory then starts as one more of them, and its share is measured by default.
    storage_computes = False
    #: What the last :meth:`replan` decided for the memory tier (``None``: nothing yet, or nothing to decide).
    last_replan: Replan | None = None
    _failure: StorageError | None = None
    # Set by `release_storage`: the directories are no longer this backend's, and state in memory is freed.
    _released = False

    def __init__(
        self,
        device_dirs: Sequence[Path],
        *,
        chunk_elems: int,
        buffer_count: int,
        owned_dirs: Sequence[Path] = (),
        tentative_slots: bool = False,
        prefetch_state: bool = True,
        device_timeout_s: float | None = 300.0,
        placement: Placement | None = None,
        memory_bytes: int = 0,
        device_weights: Sequence[float] | None = None,
        accelerator_bytes: int = 0,
        accelerator_device: torch.device | str = "cuda",
        measure_memory_share: bool | None = None,
    ) -> None:
        super().__init__()
        if not device_dirs and not (memory_bytes > 0 or accelerator_bytes > 0):
            raise ValueError("`device_dirs` must name at least one directory (or give the state a memory tier).")
        if buffer_count < 2:
            raise ValueError(f"`buffer_count={buffer_count}` must be at least 2 (one updating, one in I/O).")
        self.device_timeout_s = check_device_timeout(device_timeout_s)
        ChunkLayout(1, chunk_elems, 0)  # validates chunk_elems
        self._chunk_elems = chunk_elems
        self._buffer_count = buffer_count
        self.tentative_slots = tentative_slots
        self.prefetch_state = prefetch_state
        self.placement = placement
        #: Bytes of shard state the memory tier may hold (``0``: no memory tier).
        self.memory_bytes = memory_bytes
        #: Bytes of shard state the accelerator tier may hold (``0``: no accelerator tier).
        self.accelerator_bytes = accelerator_bytes
        self._accelerator_device = torch.device(accelerator_device)
        if device_weights is not None and len(device_weights) != len(device_dirs):
            raise ValueError(
                f"`device_weights` has {len(device_weights)} weight(s) for {len(device_dirs)} storage device(s); give "
                "one weight per storage path."
            )
        self.device_weights = None if device_weights is None else tuple(device_weights)
        # Weights this backend measured for its placement (re-planned by `replan`), and its rate counters then.
        self._measured_weights: tuple[float, ...] | None = None
        self._rate_marks: dict[int, tuple[float, int]] = {}
        # Each device's last measured update rate (state bytes per second), and the memory tier's share now.
        self._rates: dict[int, float] = {}
        self._memory_share = memory_bytes
        #: Whether :meth:`replan` decides the memory tier's share from measurements (else it fills its budget).
        self.measures_memory_share = self.storage_computes if measure_memory_share is None else measure_memory_share
        self._backward: list[dict[int, float]] = []
        # Emulated storage devices' probed speeds (state bytes per second), for a device that has not updated yet.
        self._probed: dict[int, float] = {}
        #: The device index of each shard, fixed by :meth:`open` (changed by :meth:`relocate`).
        self.assignment: tuple[int, ...] = ()
        self._owned_dirs = [Path(d) for d in owned_dirs]
        self._shards: list[Shard] = []
        self._pending: list[Future] = []
        self.devices: list[StreamingDevice] = []
        self._closed = False
        # One owner per directory: claimed before any file in them is created or truncated, held until `close`.
        self._claims = claim_directories([ensure_private_dir(d) for d in device_dirs])
        #: The device directories, in device order.
        self.device_dirs = tuple(Path(d) for d in device_dirs)
        try:
            for i, directory in enumerate(self.device_dirs):
                self.devices.append(self.make_device(i, directory))
            if memory_bytes > 0:
                self.devices.append(self.make_memory_device(len(self.devices)))
            if accelerator_bytes > 0:
                self.devices.append(self.make_accelerator_device(len(self.devices)))
        except BaseException:
            for device in self.devices:
                device.close()
            release_claims(self._claims, remove=self._owned_dirs)
            raise

    @abstractmethod
    def make_device(self, index: int, directory: Path) -> StreamingDevice:
        """Build device ``index`` over ``directory`` (claimed already), with :attr:`chunk_elems`,
        :attr:`buffer_count` and :attr:`traffic`; the constructor calls it once per directory, in order.

        On an exception the devices built so far are closed and the directories released.
        """

    def make_memory_device(self, index: int) -> StreamingDevice:
        """The memory tier's device (:mod:`lightning_smartinf.csd.memory`), built when ``memory_bytes > 0``: state in
        host RAM, updated on a host core with the rule's own code, whatever the storage devices are."""
        from lightning_smartinf.csd.memory import MemoryDevice  # (memory builds on the emulated device)

        # Memory copies need no deep pool: one buffer updating, one read ahead, one written back.
        return MemoryDevice(index, self.traffic, chunk_elems=self.chunk_elems, buffer_count=min(self.buffer_count, 4))

    def make_accelerator_device(self, index: int) -> StreamingDevice:
        """The accelerator tier's device (:mod:`lightning_smartinf.csd.accelerator_memory`), built when
        ``accelerator_bytes > 0``: state in accelerator memory, updated there with the rule's own torch code."""
        from lightning_smartinf.csd.accelerator_memory import AcceleratorDevice  # (builds on the emulated device)

        return AcceleratorDevice(
            index,
            self.traffic,
            chunk_elems=self.chunk_elems,
            buffer_count=min(self.buffer_count, 4),
            device=self._accelerator_device,
        )

    @property
    def chunk_elems(self) -> int:
        """Elements per streamed chunk."""
        return self._chunk_elems

    @property
    def buffer_count(self) -> int:
        """Chunk buffers per device."""
        return self._buffer_count

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def shards(self) -> tuple[Shard, ...]:
        """The shards passed to :meth:`open`, in order, with their state files."""
        return tuple(self._shards)

    @property
    def supports_tentative(self) -> bool:
        return self.tentative_slots

    @property
    def failure(self) -> StorageError | None:
        """The device error that stopped this backend, or ``None``.

        Set by the first :class:`StorageError` reported to the host (by :meth:`result`, :meth:`wait`,
        :meth:`check_storage`, ...). From then on the state on the devices may be torn (some chunks updated, others
        not): :meth:`submit`, :meth:`initialize`, :meth:`read_master`, :meth:`commit`, :meth:`save` and :meth:`load`
        raise, :meth:`prefetch` does nothing, :meth:`wait` reports only errors not reported yet, and :meth:`close`
        still releases everything (waiting at most ``device_timeout_s`` for threads a hung transfer holds).
        Requests queued before the error was reported still run. The process must restart and resume from the
        last good checkpoint.
        """
        return self._failure

    def _latch(self, exc: BaseException) -> BaseException:
        """Remember the first storage error reported to the host; returns ``exc`` for raising."""
        if isinstance(exc, StorageError) and self._failure is None:
            self._failure = exc
        return exc

    def _refuse(self, method: str) -> None:
        """Raise if a device error stopped this backend (:attr:`failure`)."""
        failure = self._failure
        if failure is None:
            return
        raise StorageError(
            f"`{type(self).__name__}.{method}` refused: the backend stopped at an earlier device error and the state "
            "on the devices may be torn (some chunks updated, others not), so it takes no further update and saves "
            "nothing (a checkpoint of torn state is worse than none). Restart the process and, once the storage is "
            f"fixed, resume from the last good checkpoint. The error was: {failure}",
            path=failure.path,
            operation=failure.operation,
            errno=failure.errno,
        ) from failure

    def _settle(self, future: Future, device: StreamingDevice | None = None, what: str = "") -> BaseException | None:
        """Wait for ``future`` of ``device`` (a request's handle names both); its error, or ``None``.

        Raises (and latches) the :class:`StorageError` of a device that stopped answering.
        """
        device = device or getattr(future, "device", None)
        if device is None:
            return future.exception()
        try:
            return device.wait_for(future, what or getattr(future, "what", "a request"), self.device_timeout_s)
        except StorageError as exc:
            raise self._latch(exc)  # noqa: B904 - the timeout is the error, not a consequence of it

    def result(self, handle: Handle) -> None:
        """Wait for ``handle``; raise its error (a device error latches :attr:`failure`), or a timeout error.

        Raises:
            StorageError: the request's I/O failed, or its device showed no progress for ``device_timeout_s``.
        """
        exc = self._settle(handle)
        if exc is not None:
            self._pending = [h for h in self._pending if h is not handle]  # reported here: `wait` does not repeat it
            raise self._latch(exc)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of all devices' buffers: pools and scratch (fixed after :meth:`open`)."""
        return sum(device.allocated_bytes for device in self.devices)

    def prefetch_stats(self) -> tuple[int, int]:
        """Bytes prefetched so far, summed over devices: (used by their request, dropped unused)."""
        return (
            sum(d.stats.prefetch_used_bytes for d in self.devices),
            sum(d.stats.prefetch_dropped_bytes for d in self.devices),
        )

    def stats(self, *, reset_peaks: bool = False) -> BackendStats:
        """Traffic, buffer bytes, per-device seconds and pool use, and prefetched bytes (see :class:`BackendStats`)."""
        devices = tuple(
            DeviceStats(
                index=d.index,
                read_s=d.stats.read_s,
                write_s=d.stats.write_s,
                compute_s=d.stats.compute_s,
                pool_size=d.pool.size,
                pool_peak_in_use=d.pool.reset_peak() if reset_peaks else d.pool.peak_in_use,
            )
            for d in self.devices
        )
        used, dropped = self.prefetch_stats()
        return BackendStats(
            traffic=self.traffic_snapshot(),
            buffer_bytes=self.buffer_bytes,
            devices=devices,
            prefetch_used_bytes=used,
            prefetch_dropped_bytes=dropped,
        )

    def device_of(self, shard: int) -> StreamingDevice:
        """The device that holds ``shard`` (see :attr:`assignment`)."""
        return self.devices[self.assignment[shard]]

    def open(self, shards: Sequence[ShardSpec]) -> None:
        if self._shards:
            raise RuntimeError(f"`{type(self).__name__}.open` was already called.")
        if [s.index for s in shards] != list(range(len(shards))):
            raise ValueError(
                f"`ShardSpec.index` values must be 0..{len(shards) - 1} in order, got {[s.index for s in shards]}."
            )
        layouts = [ChunkLayout(s.numel, self._chunk_elems, len(s.rule.state_names)) for s in shards]
        placement = self.placement or self._default_placement(layouts)
        self.assignment = check_assignment(placement, shards, self.num_devices)
        self._check_memory(repr(placement), layouts, self.assignment)
        for device in self.devices:
            if not device.in_memory:
                self._check_space(device, shards, layouts, self._slots(device))
        try:
            for spec, layout in zip(shards, layouts):
                device = self.device_of(spec.index)
                files = tuple(
                    device.create_file(shard_file_name(spec.index, slot), layout.file_bytes)
                    for slot in range(self._slots(device))
                )
                self._shards.append(Shard(spec, layout, files))
        except BaseException:
            self._free_memory()
            raise
        if len(self.devices) > 1:
            self._log_shares(layouts)
        tensors = max((lay.tensors_per_record for lay in layouts), default=1)
        for device in self.devices:
            device.allocate(tensors)

    def _slots(self, device: StreamingDevice) -> int:
        """State files a shard keeps on ``device``: two for tentative updates, except in memory (never tentative)."""
        return 2 if self.tentative_slots and not device.in_memory else 1

    def _check_memory(self, what: str, layouts: Sequence[ChunkLayout], assignment: Sequence[int]) -> None:
        for tier, budget, where in (
            ("memory", self.memory_bytes, "host memory"),
            ("accelerator", self.accelerator_bytes, "accelerator memory"),
        ):
            held = sum(lay.file_bytes for lay, d in zip(layouts, assignment) if self.devices[d].tier == tier)
            if held > budget:
                raise ValueError(f"{what} puts {held} B of state in {where}, over `{tier}_bytes` ({budget} B).")

    def _drop_all_prefetched(self) -> None:
        """Drop what every device read ahead, once no prefetch read is in flight (before state files change)."""
        for device, dropped in [(device, device.drop_prefetched()) for device in self.devices]:
            if (exc := self._settle(dropped, device, "dropping the state read ahead")) is not None:
                raise exc

    def _default_placement(self, layouts: Sequence[ChunkLayout]) -> Placement:
        """:class:`Tiered` over the storage devices by their weights (given, or measured when the paths are on different
        filesystems: paths on one filesystem share its disk, so they are equal), with the memory tier filled up to its
        budget; round-robin when there is nothing to weigh.

        Filling the budget is the best guess before anything is measured for emulated devices: they run the same
        update on the same host cores plus their storage I/O. Where :attr:`measures_memory_share`, :meth:`replan`
        then decides from measurements, and beside storage devices that compute (:attr:`storage_computes`) memory
        starts as one more of them.
        """
        storage = [d for d in self.devices if not d.in_memory]
        weights = self.device_weights
        if weights is None and len({os.stat(d.directory).st_dev for d in storage}) > 1:
            weights = self._measured_weights = tuple(measure_write_read(d.directory, d.io) for d in storage)
            log.info("SmartUpdate measured its storage paths: %s", ", ".join(f"{w / 1e9:.2f} GB/s" for w in weights))
        if weights is None and not self.memory_bytes and not self.accelerator_bytes:
            return RoundRobin()
        if self.memory_bytes and self.storage_computes and self.measures_memory_share and storage:
            state = max(0, sum(lay.file_bytes for lay in layouts) - self.accelerator_bytes)  # (it fills first)
            self._memory_share = int(memory_share(self.memory_bytes, state, 1.0, len(storage)))
        return self._tiered(weights or (1.0,) * len(storage))

    def _tiered(self, weights: tuple[float, ...], memory: int | None = None) -> Tiered:
        """:class:`Tiered` by ``weights``, with the memory tier's share now (or ``memory``; at least 1 B while the tier
        exists: its device stays in the placement, holding what fits), keeping shards where they are on ties."""
        share = self._memory_share if memory is None else memory
        held = max(1, share) if self.memory_bytes else 0
        return Tiered(weights, held, self._chunk_elems, self.accelerator_bytes, keep=self.assignment)

    def _log_shares(self, layouts: list[ChunkLayout]) -> None:
        total = sum(lay.file_bytes for lay in layouts) or 1
        for device in self.devices:
            held = [i for i, d in enumerate(self.assignment) if d == device.index]
            nbytes = sum(layouts[i].file_bytes for i in held)
            log.info(
                "SmartUpdate device %d (%s): %d shard(s), %.1f MiB of state (%.0f%%)",
                device.index,
                str(device.directory).strip("<>"),  # a path, or "host memory", "cuda memory"
                len(held),
                nbytes / 2**20,
                100 * nbytes / total,
            )

    def note_backward(self, ready: Mapping[int, float]) -> None:
        """Seconds before this step began that backward completed each sub-group's gradient (see
        :meth:`Backend.note_backward`); :meth:`replan` takes each shard's median over the steps since it last ran."""
        if self.measures_memory_share:  # (only the memory share's model reads them)
            self._backward.append(dict(ready))
            del self._backward[:-BACKWARD_SAMPLES]

    def replan(self) -> list[int]:
        """Re-place the shards from the update rates the devices showed since the last call; returns the shards moved
        (see :meth:`relocate`: between steps only).

        Two shares are re-decided:

        - the storage paths' weights, when this backend chose them from speeds it measured (paths on different
          filesystems) and a path's share drifted by more than :data:`REPLAN_DRIFT` share points: given weights stay,
          and paths on one filesystem share its disk;
        - the memory tier's share, where :attr:`measures_memory_share`: of the shares its budget allows, the one
          whose update phase :func:`~lightning_smartinf.csd.update_model.update_tail` predicts shortest from the
          measured rates and from when backward completed each gradient (:meth:`note_backward`), when that phase is
          more than :data:`REPLAN_DRIFT` shorter than the current placement's.

        A storage device that has never updated gives no rate, so there is nothing to compare yet (an emulated one is
        measured by a write and read probe when only the memory share is to be decided); a memory tier that has never
        updated keeps its share. :attr:`last_replan` records what was decided.
        """
        if self._failure is not None or not self._shards:
            return []
        storage = [d for d in self.devices if not d.in_memory]
        memory = [d for d in self.devices if d.tier == "memory" and self.measures_memory_share and storage]
        if self._measured_weights is None and not memory:
            return []
        rates = self._measure_rates()
        ready, self._backward = _median_ready(self._backward), []
        weights = self._measured_weights or self.device_weights or (1.0,) * len(storage)
        new = weights
        if self._measured_weights is not None and all(d.index in rates for d in storage):
            measured = tuple(rates[d.index] for d in storage)
            if max(abs(n - o) for n, o in zip(_shares(measured), _shares(weights))) > REPLAN_DRIFT:
                new = measured
        share = self._memory_share
        plan = self._memory_plan(memory[0], new, rates, ready) if memory and memory[0].index in rates else None
        if plan is not None and plan.predicted_s < plan.current_s * (1 - REPLAN_DRIFT):
            share = plan.memory_share
        self.last_replan = plan
        if new == weights and share == self._memory_share:
            return []
        if self._measured_weights is not None:
            self._measured_weights = new
        self._memory_share = share
        specs = [s.spec for s in self._shards]
        moved = self.relocate(check_assignment(self._tiered(new), specs, self.num_devices))
        shown = plan.rates if plan is not None else rates  # (with the estimates of devices that never updated)
        speeds = [f"{shown[d.index] / 1e9:.2f} GB/s ({d.tier} {d.index})" for d in self.devices if d.index in shown]
        why = [f"the devices update at {', '.join(speeds)}"]
        if new != weights:
            why.append(f"storage shares were {', '.join(f'{o:.0%}' for o in _shares(weights))}")
        if plan is not None and share == plan.memory_share:
            why.append(f"the update phase is predicted {plan.predicted_s:.3g} s, was {plan.current_s:.3g} s")
        log.info("SmartUpdate re-placed %d shard(s): %s", len(moved), "; ".join(why))
        self._log_shares([s.layout for s in self._shards])
        return moved

    def _memory_plan(
        self, memory: StreamingDevice, weights: tuple[float, ...], rates: dict[int, float], ready: dict[int, float]
    ) -> Replan | None:
        """The memory share whose update phase is predicted shortest, beside the current placement's; ``None`` while a
        storage device has no rate and none can be estimated."""
        device_rates = [rates.get(d.index) or self._estimated_rate(d, rates[memory.index]) for d in self.devices]
        if any(r is None for r in device_rates):
            return None
        early = [self.tentative_slots and not d.in_memory for d in self.devices]
        sizes = [s.layout.file_bytes for s in self._shards]
        specs = [s.spec for s in self._shards]

        def tail(assignment: Sequence[int]) -> float:
            return update_tail(assignment, sizes, device_rates, early, ready)

        def placed(share: int) -> tuple[int, ...]:
            return check_assignment(self._tiered(weights, share), specs, self.num_devices)

        # The accelerator fills first: memory chooses among the rest, in index order.
        beside = [sizes[i] for i, d in enumerate(placed(0)) if self.devices[d].tier != "accelerator"]
        candidates = memory_candidates(beside, self.memory_bytes)
        share, predicted = best_share(candidates, lambda share: tail(placed(share)), self._memory_share)
        return Replan(
            memory_share=share,
            predicted_s=predicted,
            current_s=tail(self.assignment),
            rates={d.index: r for d, r in zip(self.devices, device_rates)},
            ready=ready,
        )

    def _estimated_rate(self, device: StreamingDevice, memory_rate: float) -> float | None:
        """A device that has not updated yet. An emulated storage device: the slower of its storage (a write and read
        probe, shared by the devices on its filesystem; measured once) and the memory tier's rate (the same update
        code on the same host cores). An accelerator tier that holds nothing: no time (memory's share cannot change
        that). ``None`` for any other: a device that computes has a rate of its own."""
        if device.tier == "accelerator" and device.index not in self.assignment:
            return math.inf
        if self.storage_computes or device.in_memory:
            return None
        if device.index not in self._probed:
            sharing = sum(
                os.stat(d.directory).st_dev == os.stat(device.directory).st_dev for d in self.devices if not d.in_memory
            )
            self._probed[device.index] = measure_write_read(device.directory, device.io) / sharing
        return min(self._probed[device.index], memory_rate)

    @property
    def update_rates(self) -> dict[int, float]:
        """Each device's update rate as :meth:`replan` last measured it: state bytes read and written per second of its
        worker's update time, by device index (empty before the first measure)."""
        return dict(self._rates)

    def _measure_rates(self) -> dict[int, float]:
        """Each device's update rate since the last call (state bytes read and written per second of its worker's
        update time); a device that updated nothing since keeps the rate it last showed."""
        for device in self.devices:
            mark = (device.stats.update_s, device.stats.update_bytes)
            seconds, nbytes = (now - then for now, then in zip(mark, self._rate_marks.get(device.index, (0.0, 0))))
            self._rate_marks[device.index] = mark
            if seconds > 0 and nbytes > 0:
                self._rates[device.index] = nbytes / seconds
        return self._rates

    def relocate(self, assignment: Sequence[int]) -> list[int]:
        """Move shards between devices so that shard ``i`` lives on device ``assignment[i]``; returns those moved.

        Between steps: waits for all work, and is refused while a shard holds a tentative update. Exact: a moved
        shard's committed record is copied byte for byte to its new device, then its old files are removed (or its
        memory freed); on an error the shard being moved stays where it was. Moved bytes count as state traffic of
        the tiers they leave and enter.

        Raises:
            ValueError: ``assignment`` names a missing device, or puts more state in memory than ``memory_bytes``
                (or in accelerator memory than ``accelerator_bytes``).
            StorageError: a device lacks the space, or a copy fails.
        """
        self._refuse("relocate")
        self.wait()
        if tentative := [s.spec.index for s in self._shards if s.tentative]:
            raise RuntimeError(f"Shards {tentative} hold tentative updates; commit or roll them back first.")
        fixed = check_assignment(Fixed(tuple(assignment)), [s.spec for s in self._shards], self.num_devices)
        self._check_memory("`relocate`", [s.layout for s in self._shards], fixed)
        moves = [(s, self.devices[d]) for s, d in zip(self._shards, fixed) if d != self.assignment[s.spec.index]]
        for device in {id(d): d for _, d in moves if not d.in_memory}.values():
            needed = sum(s.layout.file_bytes for s, d in moves if d is device)
            check_free_space(device.directory, self._slots(device) * needed)
        self._drop_all_prefetched()
        placed = list(self.assignment)
        for shard, device in moves:
            self._move(shard, self.device_of(shard.spec.index), device)
            placed[shard.spec.index] = device.index
            self.assignment = tuple(placed)
        return [shard.spec.index for shard, _ in moves]

    def _move(self, shard: Shard, source: StreamingDevice, target: StreamingDevice) -> None:
        size = shard.layout.file_bytes
        files = [
            target.create_file(shard_file_name(shard.spec.index, slot), size) for slot in range(self._slots(target))
        ]
        try:
            buf = aligned_empty(min(size, MOVE_BLOCK))
            for offset in range(0, size, MOVE_BLOCK):
                piece = buf[: min(MOVE_BLOCK, size - offset)]
                shard.file.read_into(piece, offset)
                files[0].write_from(piece, offset)
        except BaseException:
            for file in files:
                file.discard()
            raise
        self.traffic.add(**{source.read_counter: size, target.write_counter: size})
        for file in shard.files:
            file.discard()
        shard.files, shard.slot = tuple(files), 0
        shard.writes.clear()

    def hands_off_early(self, shard: int) -> bool:
        """Whether ``shard`` takes tentative updates during backward: not in the memory tier, which updates fast
        enough after backward and so keeps one copy of its state."""
        return self.tentative_slots and not self.device_of(shard).in_memory

    def _check_space(
        self, device: StreamingDevice, shards: Sequence[ShardSpec], layouts: list[ChunkLayout], slots: int
    ) -> None:
        ensure_private_dir(device.directory)
        needed = slots * sum(
            lay.file_bytes for s, lay in zip(shards, layouts) if self.assignment[s.index] == device.index
        )
        reusable = [device.directory / shard_file_name(s.index, slot) for s in shards for slot in range(slots)]
        try:
            check_free_space(device.directory, needed, reusable=reusable)
        except StorageError as exc:
            if slots == 1:
                raise
            raise StorageError(
                f"{exc} (Overlapping the update with backward keeps two copies of the state; "
                "`overlap_backward=False` needs half the space.)"
            ) from None

    def _enqueue(self, request: Request, tentative: bool = False) -> Handle:
        shard = request.shard
        if shard.tentative:
            raise RuntimeError(
                f"Shard {shard.spec.index} has an uncommitted tentative update; `commit` or `rollback` it first."
            )
        if tentative and not self.tentative_slots:
            raise ValueError("`tentative=True` needs a backend built with `tentative_slots=True`.")
        if tentative and len(shard.files) < 2:
            tier = self.device_of(shard.spec.index).tier
            where = "host memory" if tier == "memory" else f"{tier} memory"
            raise ValueError(f"Shard {shard.spec.index} is in {where}, which takes no tentative update.")
        request.read_slot = shard.slot
        request.write_slot = 1 - shard.slot if tentative else shard.slot
        shard.tentative = tentative
        handle = self.device_of(request.shard.spec.index).enqueue(request)
        # Keep unfinished and failed requests for `wait`; finished ones have nothing left to report.
        self._pending = [h for h in self._pending if not h.done() or h.exception() is not None]
        self._pending.append(handle)
        return handle

    def _shard(self, index: int, numel: int, what: str) -> Shard:
        shard = self._shards[index]
        if numel != shard.spec.numel:
            raise ValueError(f"{what} of shard {index} has {numel} elements, expected {shard.spec.numel}.")
        return shard

    def initialize(self, shard: int, master: Tensor) -> Handle:
        self._refuse("initialize")
        entry = self._shard(shard, master.numel(), "`master`")
        rule = entry.spec.rule
        init_values = [rule.initial_state_value(name) for name in rule.state_names]

        host_link = self.device_of(shard).link
        written = record_fence(master.device) if on_cuda(master) else None  # by the caller's stream, maybe not yet

        def fill(record: Tensor, m: Tensor, states: list[Tensor], start: int, n: int) -> None:
            m.copy_(host_link.to_host(master[start : start + n], after=written))
            for state, value in zip(states, init_values):
                if value != 0.0:
                    state.fill_(value)

        link = self.device_of(shard).initialize_link_bytes(entry, master)
        return self._enqueue(Request(shard=entry, read=False, write=True, compute=fill, link_write=link))

    def check_storage(self) -> None:
        """Raise :class:`StorageError` if a device's directory has disappeared (unmounted, deleted).

        That latches :attr:`failure`: the state there can no longer be saved.
        """
        self._refuse("check_storage")
        for device in self.devices:
            if device.in_memory:
                continue
            try:
                code = None if stat.S_ISDIR(os.stat(device.directory).st_mode) else errno.ENOTDIR
            except OSError as exc:
                code = exc.errno
            if code is not None:
                raise self._latch(
                    StorageError(
                        f"Storage path {str(device.directory)!r} of device {device.index} disappeared during training "
                        f"(unmounted or deleted): `stat` found {StorageError.errno_label(code)}. Restore it and "
                        "resume from the last checkpoint.",
                        path=device.directory,
                        operation="stat",
                        errno=code,
                    )
                )

    def submit(
        self,
        shard: int,
        grad: Tensor | SparseGrad,
        hp: StepParams,
        out: Tensor,
        link_dtype: torch.dtype | None = None,
        tentative: bool = False,
        ready: Fence | None = None,
    ) -> Handle:
        """See :meth:`Backend.submit`; the device's :meth:`~StreamingDevice.update_work` says what each chunk does."""
        self._refuse("submit")
        sparse = isinstance(grad, SparseGrad)
        entry = self._shard(shard, grad.numel if sparse else grad.numel(), "`grad`")
        self._shard(shard, out.numel(), "`out`")
        work = self.device_of(shard).update_work(entry, grad, hp, out, link_dtype or grad.dtype)
        request = Request(
            shard=entry,
            read=True,
            write=True,
            compute=work.compute,
            link_write=work.link_write,
            link_read=work.link_read,
            ready=ready,
        )
        return self._enqueue(request, tentative)

    def prefetch(self, shards: Sequence[int]) -> None:
        """Advice: each device's next requests are for its ``shards``, in this order.

        Whenever a device has no request to serve, it reads the next chunks of the advised shards not yet
        requested into free buffers: between steps, and while it waits for the next hand-off during backward.
        A request adopts the chunks of its shard as its first reads if they are of the state it reads; otherwise
        they are dropped, unused. At most ``buffer_count - 1 - io_threads`` chunks (at least 1) are held per
        device at once, so the pool's memory stays fixed and the request being served always has room to read.
        Shards with an uncommitted tentative update are skipped (their committed state may change). New advice
        replaces the old; :meth:`load` and :meth:`close` drop what was read ahead. Ignored after a device error
        (:attr:`failure`).
        """
        shards = list(shards)
        if unknown := [i for i in shards if not 0 <= i < len(self._shards)]:
            raise ValueError(
                f"`prefetch` names shard {unknown[0]}, but the shards are 0..{len(self._shards) - 1}: advise only "
                "shards passed to `open`."
            )
        if not self.prefetch_state or self._failure is not None:
            return
        targets: list[list[PrefetchTarget]] = [[] for _ in self.devices]
        for index in shards:
            shard = self._shards[index]
            if not shard.tentative and not shard.file.in_memory:  # memory is read where it lies
                targets[self.assignment[index]].append(PrefetchTarget(shard, shard.slot))
        for device, device_targets in zip(self.devices, targets):
            device.prefetch(device_targets)  # every device: new advice, even empty, replaces the old

    def read_master(self, shard: int, out: Tensor) -> Handle:
        self._refuse("read_master")
        entry = self._shard(shard, out.numel(), "`out`")
        host_link = self.device_of(shard).link

        def copy_out(record: Tensor, m: Tensor, states: list[Tensor], start: int, n: int) -> None:
            host_link.put(out[start : start + n], m)

        link = out.numel() * 4
        return self._enqueue(Request(shard=entry, read=True, write=False, compute=copy_out, link_read=link))

    def commit(self, shards: Iterable[int]) -> None:
        """Make the tentative updates of ``shards`` the current state (their handles need not be done yet)."""
        self._refuse("commit")
        for index in shards:
            shard = self._shards[index]
            if not shard.tentative:
                raise RuntimeError(f"Shard {index} has no tentative update to commit.")
            shard.slot, shard.tentative = 1 - shard.slot, False

    def rollback(self, shards: Iterable[int]) -> None:
        """Forget the tentative updates of ``shards``: waits for every request, then the committed state is as it was.

        The ``out`` tensors of those updates hold the discarded parameters; :meth:`read_master` restores them.
        """
        shards = list(shards)
        try:
            self.wait()
        finally:
            for index in shards:
                self._shards[index].tentative = False

    def wait(self) -> None:
        """Block until every request and write-back is done; raise the first error not reported yet.

        Raises:
            StorageError: a device's I/O failed, or a device showed no progress for ``device_timeout_s``; either
                latches :attr:`failure`.
        """
        pending, self._pending = self._pending, []
        errors = [exc for h in pending if (exc := self._settle(h)) is not None]
        for device in self.devices:
            try:
                if (exc := device.drain(self.device_timeout_s)) is not None:
                    errors.append(exc)
            except StorageError as exc:
                raise self._latch(exc)  # noqa: B904 - the timeout is the error
        if errors:
            raise self._latch(errors[0])

    def _state_files(self) -> list[ShardState]:
        return [ShardState(s.spec, s.layout, s.file.path) for s in self._shards]

    def _staged_files(self) -> list[StateFile]:
        """The state files a checkpoint reads and writes through a host copy (the accelerator tier's)."""
        return [file for shard in self._shards for file in shard.files if file.needs_host_copy]

    def save(self, directory: Path) -> None:
        """Write every shard's state under ``directory`` (waits first); refused after a device error.

        Works after :meth:`close` too (the state files stay on the storage): the directories are claimed again for
        the copy if :meth:`close` released them, so no other run can be writing them meanwhile.
        """
        self._refuse("save")
        self.wait()
        claims = []
        if self._released:
            if self._owned_dirs or self.memory_bytes or self.accelerator_bytes:
                raise StorageError(
                    "The device state was in temporary directories or in memory (host or accelerator), freed when the "
                    "backend closed; save before closing it (or close with `keep_claims=True`)."
                )
            claims = claim_directories([device.directory for device in self.devices if not device.in_memory])
        staged = self._staged_files()
        try:
            for file in staged:
                file.stage(copy=True)
            save_state(self._state_files(), Path(directory), chunk_elems=self._chunk_elems)
        finally:
            for file in staged:
                file.unstage()
            release_claims(claims)

    def load(self, directory: Path) -> None:
        """Replace every shard's state with the copy under ``directory``.

        Refused after a device error (:attr:`failure`), like :meth:`save`: threads may still hang on the failed
        storage and its files may be unusable, so the process must restart and resume there.
        """
        self._refuse("load")
        self.wait()
        # Refused before any file is closed, so the backend stays usable after the error.
        for shard in self._shards:
            if shard.tentative:
                raise RuntimeError(f"Shard {shard.spec.index} has an uncommitted tentative update; roll it back first.")
        # Chunks read ahead hold the state being replaced, and no read may be in flight while files change.
        self._drop_all_prefetched()
        on_disk = [shard for shard in self._shards if not shard.file.in_memory]
        for shard in on_disk:
            for file in shard.files:
                file.close()
        staged = self._staged_files()
        loaded = False
        try:
            for file in staged:
                file.stage(copy=False)
            load_state(self._state_files(), Path(directory), chunk_elems=self._chunk_elems)
            loaded = True
        finally:
            for file in staged:
                file.unstage(copy_back=loaded)
            for shard in on_disk:
                shard.files = tuple(StateFile(f.path, shard.layout.file_bytes, create=False) for f in shard.files)

    def close(self, *, keep_claims: bool = False) -> None:
        """Finish outstanding work and release buffers, threads and temporary storage.

        After a device error (:attr:`failure`) it only releases: it does not raise that error again, and waits at
        most ``device_timeout_s`` per device for threads a hung transfer holds (then leaves them behind).

        ``keep_claims``: keep owning the device directories (and the temporary ones, with the state in them) until
        :meth:`release_storage`, so that :meth:`save` can still copy the final state. Without it they are released
        now, and a later :meth:`save` claims them again for the copy. Closing again does nothing.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self._failure is None:
                self.wait()
        finally:
            try:
                # A device whose transfer still hangs keeps its files open: a piece not yet started must not reach
                # another file through a reused descriptor.
                hung = {device.index for device in self.devices if not device.close(self.device_timeout_s)}
                for shard in self._shards:
                    if self.assignment[shard.spec.index] in hung:
                        continue
                    for file in shard.files:
                        file.close()
            finally:
                if not keep_claims:
                    self.release_storage()

    def release_storage(self) -> None:
        """Give up the device directories: the owned (temporary) ones are removed first, while still held.

        Called by :meth:`close` unless it kept them; idempotent. Every state file is closed by then.
        """
        claims, self._claims = self._claims, []
        self._released = True
        self._free_memory()
        release_claims(claims, remove=self._owned_dirs)

    def _free_memory(self) -> None:
        # State on storage outlives the backend (its files are the state); state in memory ends with it.
        for shard in self._shards:
            for file in shard.files:
                if file.in_memory:
                    file.discard()


def _shares(values: Sequence[float]) -> list[float]:
    total = sum(values)
    return [v / total for v in values]


def _median_ready(samples: Sequence[Mapping[int, float]]) -> dict[int, float]:
    """Each shard's median of ``samples`` (a shard missing from a sample was ready only at that step: 0 s)."""
    shards = {shard for sample in samples for shard in sample}
    return {shard: statistics.median(sample.get(shard, 0.0) for sample in samples) for shard in shards}
