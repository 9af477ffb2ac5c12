"""A streaming device: the chunk pipeline that moves one device's shard records through a fixed pool of buffers.

A :class:`StreamingDevice` has a worker thread that serves requests in submission order, one reader and one writer
pool that move chunk records, reads that run ahead of the update and write-back that trails behind it, and prefetch:
with no request to serve it reads ahead the shards it was told come next. Host memory of the update path is fixed by
``buffer_count`` and ``chunk_elems``, whatever the model size. The shards, their slots and the latch are the
backend's (:mod:`lightning_smartinf.core.streaming.backend`); a device only serves what it is given.

A new kind of device implements :meth:`StreamingDevice.allocate` and :meth:`StreamingDevice.update_work`: its buffers,
and what one update does to each chunk (plus :meth:`StreamingDevice.initialize_link_bytes` where initializing moves
other bytes than the masters over the link). :class:`HostCoreDevice`, at the end, is the device that updates on a
host core: the ``cpu`` kind's devices and the memory tiers are it.
"""

from __future__ import annotations

import errno
import functools
import itertools
import logging
import queue
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from lightning_smartinf.core import split_masters
from lightning_smartinf.core.accelerator import (
    AcceleratorCopies,
    current_accelerator,
    side_stream,
    start_thread,
    thread_pool,
)
from lightning_smartinf.core.backend import Handle
from lightning_smartinf.core.compression import SparseGrad
from lightning_smartinf.core.format.layout import pool_bytes
from lightning_smartinf.core.io.checksum import crc32c
from lightning_smartinf.core.io.clone import can_clone
from lightning_smartinf.core.io.direct import IOEngine, StateFile
from lightning_smartinf.core.io.storage import StorageError
from lightning_smartinf.core.rules import StepParams
from lightning_smartinf.core.split_masters import SplitChunk
from lightning_smartinf.core.state_formats import update_chunk
from lightning_smartinf.core.streaming.pipeline import (
    ChunkPool,
    ChunkRead,
    ChunkWork,
    DropPrefetch,
    PlanEntry,
    PrefetchAdvice,
    PrefetchedChunk,
    PrefetchPlan,
    ReadAheadWindow,
    Request,
    Shard,
)
from lightning_smartinf.core.traffic import Traffic

log = logging.getLogger(__name__)
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
class _Transfer:
    """A chunk transfer in flight, for timeout messages."""

    operation: str
    path: Path
    offset: int
    started: float


class StreamingDevice(ABC):
    """One streaming device: a directory, a chunk-buffer pool, a worker thread and reader and writer threads.

    The worker serves the requests of :meth:`enqueue` in order (:meth:`_serve`); its read-ahead state is a
    :class:`~lightning_smartinf.core.streaming.pipeline.ReadAheadWindow` and its prefetch state a
    :class:`~lightning_smartinf.core.streaming.pipeline.PrefetchPlan`, both touched by the worker only.
    """

    #: Whether the state lives in memory (its files are memory, it has no :attr:`directory`), so that records are
    #: updated where they lie, in one slot: such a device takes no tentative update.
    in_memory = False
    #: Where this device's state is, for people: ``"storage"``, or the memory that holds it (``"memory"``,
    #: ``"accelerator"``).
    tier = "storage"
    #: Bytes of shard state this device may hold (``None``: what its storage has room for).
    capacity: int | None = None
    #: The traffic counters of this device's state reads and writes (its tier's).
    read_counter = "storage_read_bytes"
    write_counter = "storage_write_bytes"

    def __init__(
        self,
        index: int,
        directory: Path | None,
        traffic: Traffic,
        io: IOEngine,
        *,
        chunk_elems: int,
        buffer_count: int,
        io_threads: int = 1,
    ) -> None:
        self.index = index
        self.directory = directory
        #: Whether writes keep each record's CRC-32C: where the directory's files clone, so a checkpoint clones them
        #: instead of reading them. Elsewhere a save reads the files anyway, and the checksums would cost every step.
        self.keeps_checksums = directory is not None and can_clone(directory)
        self.io = io
        self.stats = DeviceCounters()
        self.pool = ChunkPool()
        #: The worker's copies to and from accelerator memory (gradients in, parameters out), off the training stream.
        self.copies = AcceleratorCopies()
        #: Host bytes of the buffers this device allocated (see :meth:`allocate`).
        self.allocated_bytes = 0
        #: ``time.monotonic()`` of the last sign of life: new work, or a chunk read, written or updated.
        self.progress_at = time.monotonic()
        self._traffic = traffic
        #: Elements per streamed chunk.
        self.chunk_elems = chunk_elems
        #: Chunk buffers in the pool (at least 2: one updating, one reading or writing).
        self.buffer_count = buffer_count
        self._trailing: list[Future] = []
        self._master_chunk: Tensor | None = None
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
    def label(self) -> str:
        """Where the state is, in messages: the directory, or the memory that holds it (host memory unless a device
        says otherwise)."""
        return str(self.directory) if self.directory is not None else "host memory"

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

        Set :attr:`allocated_bytes` to the bytes taken (:func:`~lightning_smartinf.core.format.layout.pool_bytes` for
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
        assert self.directory is not None, "a device whose state is in memory makes its own files"
        return StateFile(self.directory / name, size, create=True)

    def store_link(self, dst: Tensor, src: Tensor, link_dtype: torch.dtype) -> None:
        """``dst`` (host memory) filled with ``src`` as it arrives after crossing the link in ``link_dtype``."""
        src = self.copies.to_host(src)
        if src.dtype == link_dtype or dst.dtype == link_dtype:
            dst.copy_(src)  # one rounding (or none): copy_ rounds to nearest even like .to()
            return
        # Round to the link in scratch (a gradient chunk per dtype, allocated once), then widen (exact).
        if (link := self._link_chunks.get(link_dtype)) is None:
            link = self._link_chunks[link_dtype] = torch.empty(self.chunk_elems, dtype=link_dtype)
            self.allocated_bytes += link.numel() * link.element_size()
        dst.copy_(link[: src.numel()].copy_(src))

    # ------------------------------------------------------------------------------------------ host side

    def enqueue(self, request: Request) -> Handle:
        handle = request.future
        handle.device = self
        handle.what = f"the {request.kind} of shard {request.shard.spec.index}"
        self.progress_at = time.monotonic()
        self._requests.put(request)
        return handle

    def prefetch(self, targets: Sequence[PlanEntry]) -> None:
        """Advise that the next requests read ``targets`` first, in this order (the worker owns them from now on)."""
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
            self.copies.close()
        else:
            log.warning(
                "Device %d at %r: %s still pending %s s after `close`; its threads are left behind and the process "
                "may not exit until the storage answers.",
                self.index,
                self.label,
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

    def wait_for(self, future: Future, what: str, timeout: float | None) -> BaseException | None:
        """Block until ``future`` (work of this device, described by ``what``) is done; return its error, if any.

        With a ``timeout``, raise :class:`StorageError` once the device has shown no sign of life (no new work, no
        chunk read, written or updated) for ``timeout`` seconds while ``future`` is pending: it stopped answering.
        A long queue of work that moves never times out.
        """
        if timeout is None:
            return future.exception()
        while True:
            try:  # until ``timeout`` s past the last sign of life (:attr:`progress_at`), which may move meanwhile
                return future.exception(timeout=max(0.0, self.progress_at + timeout - time.monotonic()))
            except FutureTimeoutError:
                if time.monotonic() >= self.progress_at + timeout:
                    raise self._timeout_error(what, timeout) from None

    def _timeout_error(self, what: str, timeout: float) -> StorageError:
        transfers = sorted(list(self._transfers.values()), key=lambda t: t.started)
        operation, path = (transfers[0].operation, transfers[0].path) if transfers else ("update", self.directory)
        return StorageError(
            f"Device {self.index} at {self.label!r} showed no progress for {timeout:g} s "
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
            if (buf := self.pool.acquire(block=False)) is None:
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
            if (target := window.next_read()) is not None:
                return target
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
            len(window.reads) + len(self.prefetch_plan.held) < self.buffer_count - 1
            and (target := self._next_read()) is not None
        ):
            request, k = target
            if (buf := self.pool.acquire(block=request is window.serving)) is None:
                window.unclaim()  # retried at the next chunk boundary
                return
            pending = self._reader.submit(self._read, request.shard, request.read_slot, k, buf)
            window.reads.append(ChunkRead(request, k, buf, pending))

    def _read(self, shard: Shard, slot: int, k: int, buf: Tensor, *, count: bool = True) -> Tensor:
        """Read chunk ``k`` of ``shard``'s ``slot`` into ``buf``; a prefetch (``count=False``) is counted later."""
        record = buf[: shard.layout.record_bytes(k) // 4]
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
        """Write ``record`` back at ``offset``, keeping its CRC-32C in ``file.checksums`` (the checkpoint's seal)."""
        try:
            crc = None
            if file.keeps_checksums:
                file.checksums.pop(offset, None)  # unknown until the write has landed whole
                if self.keeps_checksums and record.device.type == "cpu":
                    crc = crc32c(memoryview(record.numpy()).cast("B"))
            t0 = time.perf_counter()
            self._transfer("write", file, record, offset)
            if crc is not None:
                file.checksums[offset] = crc
            self.stats.write_s += time.perf_counter() - t0
        finally:
            self.pool.release(buf)  # the engine returns or raises only once no piece of ``record`` is in flight

    def _chunk_record(self, request: Request, k: int) -> tuple[Tensor, Tensor]:
        """The buffer and record of chunk ``k`` to update: read (waiting for its read) or zeroed."""
        layout = request.shard.layout
        if not request.read:
            buf = self.pool.acquire()
            record = buf[: layout.record_bytes(k) // 4]
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
                start, n = layout.chunk_range(k)
                t0 = time.perf_counter()
                try:
                    if layout.split_masters:
                        self._split_compute(request, record, k, start, n)
                    else:
                        master, states = record[:n], layout.states_of(record, k, n)
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
            self.copies.settle()
            # A failed request drops its remaining reads; reads already issued for later requests stay theirs.
            reads = self.window.reads
            while reads and reads[0].request is request:
                read = reads.popleft()
                read.pending.exception()
                self.pool.release(read.buf)

    def _split_compute(self, request: Request, record: Tensor, k: int, start: int, n: int) -> None:
        """Run ``request``'s compute on chunk ``k`` of a layout of split masters: its own split compute where it has
        one, else its compute on the masters rebuilt in scratch from the record and the parameters before, stored
        back into the record after (where the request writes it)."""
        layout = request.shard.layout
        region, states = layout.master_region(record, k), layout.states_of(record, k, n)
        chunk = None
        if request.params is not None:  # (an initialize writes masters, and reads no parameters)
            aside = None if request.params_aside is None else request.params_aside[start : start + n]
            chunk = SplitChunk(request.params[start : start + n], region, aside)
        if request.compute_split is not None:
            assert chunk is not None, "an update of split masters writes their parameters"
            self.run_compute(functools.partial(request.compute_split, record, chunk, states, start, n))
            return
        master = self.master_chunk(n)

        def work() -> None:
            if request.read:
                assert chunk is not None, "a read of split masters needs their parameters"
                chunk.load(master)
            request.compute(record, master, states, start, n)
            if request.write:
                split_masters.encode(master, region)

        self.run_compute(work)

    def master_chunk(self, n: int) -> Tensor:
        """Scratch fp32 masters of the chunk being computed, where a layout splits them (one per device, made on
        first use)."""
        if self._master_chunk is None or self._master_chunk.numel() < n:
            self._master_chunk = torch.empty(max(n, self.chunk_elems), dtype=torch.float32)
        return self._master_chunk[:n]


def link_bytes(grad: Tensor | SparseGrad, link_dtype: torch.dtype) -> int:
    """Bytes ``grad`` takes on the link: its pairs for a top-k gradient, every element in ``link_dtype`` else."""
    return grad.link_bytes(link_dtype) if isinstance(grad, SparseGrad) else grad.numel() * link_dtype.itemsize


class HostCoreDevice(StreamingDevice):
    """One emulated computational-storage device: a directory, a host buffer pool and three kinds of threads."""

    #: The fp32 gradient of the chunk being updated (scratch, one per device, made by :meth:`allocate`).
    _grad_chunk: Tensor | None = None

    def allocate(self, tensors_per_record: int) -> None:
        """Allocate the buffer pool for records of up to ``tensors_per_record`` fp32 tensors, and a gradient chunk."""
        record_bytes = self.chunk_elems * 4 * tensors_per_record
        for _ in range(self.buffer_count):
            self.pool.add(self.io.empty(record_bytes).view(torch.float32))
        self._grad_chunk = torch.empty(self.chunk_elems, dtype=torch.float32)
        self.allocated_bytes = pool_bytes(1, self.buffer_count, self.chunk_elems, tensors_per_record)
        self.allocated_bytes += self.chunk_elems * 4

    def update_work(
        self, shard: Shard, grad: Tensor | SparseGrad, hp: StepParams, out: Tensor, link_dtype: torch.dtype
    ) -> ChunkWork:
        """Load the chunk's gradient as it crosses the link (scattering a top-k one), apply the rule, copy out."""
        rule = shard.spec.rule
        fmt = None if shard.layout.state_format == "fp32" else shard.layout.format
        # A format's native pass can take the gradient in bf16 as it crosses the link, and write the parameters to
        # host memory, saving a pass over each (a chunk's gradient in fp32 and its parameters copied out).
        raw_grad = fmt is not None and not isinstance(grad, SparseGrad) and grad.dtype == link_dtype == torch.bfloat16
        host_out = out.device.type == "cpu" and out.dtype == torch.bfloat16 and out.is_contiguous()

        def staged(m: Tensor, start: int, n: int) -> Tensor | None:
            """The gradient's chunk on the host as it crossed the link, where the format's native pass may take it (a
            dense bf16 gradient, masters in host memory): staged once, for whichever path then runs."""
            if not raw_grad or m.device.type != "cpu":
                return None
            return self.copies.to_host(grad[start : start + n])

        def gradient(start: int, n: int, link: Tensor | None) -> Tensor:
            """The chunk's gradient in fp32, scaled; from ``link`` where :func:`staged` brought it over already."""
            assert self._grad_chunk is not None
            g = self._grad_chunk[:n]
            if link is None:
                self.load_gradient(g, grad, start, link_dtype)
            else:
                g.copy_(link)
            if hp.grad_scale != 1.0:
                g.mul_(hp.grad_scale)
            return g

        def fused(m: Tensor, link: Tensor | None, states: list[Tensor], start: int, split: SplitChunk | None) -> bool:
            """The update in the format's native pass from the staged ``link``; ``False``: none ran."""
            if link is None:
                return False
            n = link.numel()
            params = out[start : start + n] if host_out and split is None else None
            if not fmt.fused_update(rule, m, link, states, hp, split, params=params, grad_scale=hp.grad_scale):
                return False
            if split is None and params is None:
                self.copies.put(out[start : start + n], m)
            return True

        def update(record: Tensor, m: Tensor, states: list[Tensor], start: int, n: int) -> None:
            link = staged(m, start, n)
            if fused(m, link, states, start, None):
                return
            g = gradient(start, n, link)
            if fmt is None:
                rule.apply(m, g, states, hp)
            else:
                update_chunk(rule, fmt, m, g, states, hp)
            self.copies.put(out[start : start + n], m)

        def update_split(record: Tensor, chunk: SplitChunk, states: list[Tensor], start: int, n: int) -> None:
            m = self.master_chunk(n)
            link = staged(m, start, n)
            if fused(m, link, states, start, chunk):
                return
            g = gradient(start, n, link)
            if fmt is None:
                chunk.load(m)
                rule.apply(m, g, states, hp)
                chunk.store(m)
            else:
                update_chunk(rule, fmt, m, g, states, hp, split=chunk)

        return ChunkWork(
            compute=update,
            link_write=link_bytes(grad, link_dtype),
            link_read=out.numel() * out.element_size(),
            compute_split=update_split if shard.layout.split_masters else None,
        )

    def load_gradient(self, g: Tensor, grad: Tensor | SparseGrad, start: int, link_dtype: torch.dtype) -> None:
        """Fill ``g`` (fp32, on the host) with elements ``[start, start + len(g))`` of ``grad`` as they cross the link:
        rounded to ``link_dtype``, and scattered (decompressed) for a top-k gradient."""
        if isinstance(grad, SparseGrad):
            grad.scatter_chunk(g, start, via=link_dtype)  # decompression, inside the transfer pipeline
        else:
            self.store_link(g, grad[start : start + g.numel()], link_dtype)

    def close(self, timeout: float | None = None) -> bool:
        settled = super().close(timeout)
        self._grad_chunk = None
        return settled
