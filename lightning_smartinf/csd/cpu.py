"""The ``cpu`` backend: computational-storage devices emulated on host cores, one per storage path.

Each device owns a directory, a worker thread that runs requests in submission order, one reader and
one writer thread, and a fixed pool of aligned chunk buffers. A request streams its shard through
the pool chunk by chunk: reads run ahead of the update, write-back trails behind it, so the disk is
kept busy while the update computes. A device with no request to serve reads ahead the shards it was told
come next (:meth:`CpuBackend.prefetch`) into free buffers. Host memory of the update path is
``num_devices * buffer_count * chunk_bytes`` plus one fp32 gradient chunk per device, whatever the
model size.
"""

from __future__ import annotations

import errno
import itertools
import logging
import math
import os
import queue
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from lightning_smartinf.csd.backend import Backend, Handle, ShardSpec
from lightning_smartinf.csd.checkpoint import ShardState, load_state, save_state, shard_file_name
from lightning_smartinf.csd.compression import SparseGrad
from lightning_smartinf.csd.io import IOEngine, StateFile, ThreadedIO
from lightning_smartinf.csd.layout import ChunkLayout
from lightning_smartinf.csd.ownership import claim_directories, release_claims
from lightning_smartinf.csd.rules import StepParams
from lightning_smartinf.csd.storage import StorageError, check_free_space, ensure_private_dir
from lightning_smartinf.csd.traffic import Traffic


@dataclass
class DeviceStats:
    """Seconds a device spent on each kind of work (summed over its threads), and bytes it prefetched."""

    read_s: float = 0.0
    write_s: float = 0.0
    compute_s: float = 0.0
    #: Bytes read ahead of their request by :meth:`CpuBackend.prefetch`: used by it, or dropped unused.
    prefetch_used_bytes: int = 0
    prefetch_dropped_bytes: int = 0


class BufferPool:
    """A fixed set of aligned chunk buffers handed out and returned by a device's threads.

    ``acquire`` blocks while every buffer is in use, which is the back-pressure that keeps reads from
    running further ahead than the pool allows.
    """

    def __init__(self) -> None:
        self._free: queue.SimpleQueue[Tensor] = queue.SimpleQueue()
        self._lock = threading.Condition()
        self.size = 0
        self.in_use = 0
        #: Most buffers in use at once since the last :meth:`reset_peak`.
        self.peak_in_use = 0

    def add(self, buf: Tensor) -> None:
        self.size += 1
        self._free.put(buf)

    def acquire(self) -> Tensor:
        buf = self._free.get()
        with self._lock:
            self.in_use += 1
            self.peak_in_use = max(self.peak_in_use, self.in_use)
        return buf

    def try_acquire(self) -> Tensor | None:
        """A free buffer, or None at once if every buffer is in use."""
        try:
            buf = self._free.get_nowait()
        except queue.Empty:
            return None
        with self._lock:
            self.in_use += 1
            self.peak_in_use = max(self.peak_in_use, self.in_use)
        return buf

    def release(self, buf: Tensor) -> None:
        """Give ``buf`` back; only once no transfer into or out of it is in flight (another may start at once)."""
        with self._lock:
            self.in_use -= 1
            self._free.put(buf)
            if self.in_use == 0:
                self._lock.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no buffer is in use (so no transfer is in flight); False if ``timeout`` s passed first."""
        with self._lock:
            return self._lock.wait_for(lambda: self.in_use == 0, timeout)

    def clear(self) -> None:
        """Drop every free buffer (call only when no request can run any more)."""
        while not self._free.empty():
            self._free.get_nowait()
        self.size = self.in_use

    def reset_peak(self) -> int:
        with self._lock:
            peak, self.peak_in_use = self.peak_in_use, self.in_use
        return peak


@dataclass
class _Shard:
    spec: ShardSpec
    layout: ChunkLayout
    #: Slot 0, and slot 1 when the backend keeps tentative updates: a tentative update reads the committed
    #: slot and writes the other, so the committed state stays intact until :meth:`CpuBackend.commit`.
    files: list[StateFile]
    #: The committed slot: every read starts from it.
    slot: int = 0
    #: An update written to the other slot awaits :meth:`CpuBackend.commit` or :meth:`CpuBackend.rollback`.
    tentative: bool = False
    #: Latest write-back of each (slot, chunk); a later read of that record waits for it (write-back trails).
    writes: dict[tuple[int, int], Future] = field(default_factory=dict)

    @property
    def file(self) -> StateFile:
        """The committed state file."""
        return self.files[self.slot]


class _RequestHandle(Future):
    """A request's :class:`~lightning_smartinf.csd.backend.Handle`: also names its device and work, for timeouts."""

    #: Set by :meth:`EmulatedDevice.enqueue`.
    device: EmulatedDevice | None = None
    what = "a request"


@dataclass
class _Request:
    shard: _Shard
    read: bool
    write: bool
    # Called with (record view, master, states, chunk start, chunk length) for every chunk.
    compute: Callable[[Tensor, Tensor, list[Tensor], int, int], None]
    future: _RequestHandle = field(default_factory=_RequestHandle)
    link_write: int = 0
    link_read: int = 0
    #: Slots read from and written to, fixed when the request is queued (:meth:`CpuBackend._enqueue`).
    read_slot: int = 0
    write_slot: int = 0


@dataclass
class _Prefetch:
    """Advice on a device's queue: its next requests read these (shard, committed slot) pairs, in order."""

    targets: list[tuple[_Shard, int]]


@dataclass
class _DropPrefetch:
    """On a device's queue: drop every chunk read ahead, then resolve ``done`` (the files may change after)."""

    done: Future = field(default_factory=Future)


_Queued = _Request | _Prefetch | _DropPrefetch | None

#: Seconds an idle device waits for a request before it retries taking a buffer for a prefetch.
_PREFETCH_POLL_S = 0.002


class EmulatedDevice:
    """One emulated computational-storage device: a directory, a buffer pool and three threads."""

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
        self.stats = DeviceStats()
        self._trailing: list[Future] = []
        self._traffic = traffic
        self._chunk_elems = chunk_elems
        self._buffer_count = buffer_count
        self.pool = BufferPool()
        self._grad_chunk: Tensor | None = None
        self._link_chunks: dict[torch.dtype, Tensor] = {}
        self.allocated_bytes = 0
        self._requests: queue.SimpleQueue[_Queued] = queue.SimpleQueue()
        #: ``time.monotonic()`` of the last sign of life: new work, or a chunk read, written or updated.
        self.progress_at = time.monotonic()
        # Chunk transfers in flight, by a unique key: (operation, file path, byte offset, monotonic start).
        self._transfers: dict[int, tuple[str, Path, int, float]] = {}
        self._transfer_keys = itertools.count()
        # Read-ahead state, touched only by the worker thread: the request being served first, then queued
        # requests already taken off ``_requests`` because reads ran ahead into them.
        self._window: deque[_Request] = deque()
        self._reads: deque[tuple[_Request, int, Tensor, Future]] = deque()
        self._cursor = 0  # index in ``_window`` of the request whose chunks are being read
        self._cursor_k = 0  # its next chunk to read
        self._closing = False  # the close sentinel was taken off ``_requests`` by read-ahead
        # Prefetch (worker only): per advised shard not yet requested, [shard, committed slot, next chunk]; and
        # chunks read ahead of any request. Invariant: no request has taken a prefetched chunk's shard since the
        # advice (the first that does adopts that shard's chunks or drops them), so none is stale.
        self._prefetch_plan: deque[list] = deque()
        self._prefetched: deque[tuple[_Shard, int, int, Tensor, Future]] = deque()
        # More reads than ``buffer_count - 1`` are never in flight (one buffer is always the one updating).
        readers = max(1, min(io_threads, buffer_count - 1))
        # Prefetched chunks leave the request being served room for ``readers`` reads and never take the pool's
        # last two buffers (one updating, one reading), so its reads never wait on chunks no one consumes yet.
        self._prefetch_cap = min(buffer_count - 2, max(1, buffer_count - 1 - readers))
        self._reader = ThreadPoolExecutor(readers, thread_name_prefix=f"csd{index}-read")
        self._writer = ThreadPoolExecutor(io_threads, thread_name_prefix=f"csd{index}-write")
        self._worker = threading.Thread(target=self._serve, name=f"csd{index}-update", daemon=True)
        self._worker.start()

    def allocate(self, tensors_per_record: int) -> None:
        """Allocate the buffer pool for records of up to ``tensors_per_record`` fp32 tensors."""
        record_bytes = self._chunk_elems * 4 * tensors_per_record
        for _ in range(self._buffer_count):
            self.pool.add(self.io.empty(record_bytes).view(torch.float32))
        self._grad_chunk = torch.empty(self._chunk_elems, dtype=torch.float32)
        self.allocated_bytes = (self._buffer_count * tensors_per_record + 1) * self._chunk_elems * 4

    def grad_chunk(self, n: int) -> Tensor:
        assert self._grad_chunk is not None
        return self._grad_chunk[:n]

    def link_chunk(self, n: int, dtype: torch.dtype) -> Tensor:
        """Scratch for one gradient chunk as it crosses the link (allocated once per dtype)."""
        chunk = self._link_chunks.get(dtype)
        if chunk is None:
            chunk = self._link_chunks[dtype] = torch.empty(self._chunk_elems, dtype=dtype)
            self.allocated_bytes += chunk.numel() * chunk.element_size()
        return chunk[:n]

    def enqueue(self, request: _Request) -> Handle:
        handle = request.future
        handle.device = self
        kind = "update" if request.read and request.write else "initialize" if request.write else "read_master"
        handle.what = f"the {kind} of shard {request.shard.spec.index}"
        self.progress_at = time.monotonic()
        self._requests.put(request)
        return handle

    def prefetch(self, targets: list[tuple[_Shard, int]]) -> None:
        """Advise that the next requests read ``targets`` (shard, committed slot) first, in this order."""
        self.progress_at = time.monotonic()
        self._requests.put(_Prefetch(targets))

    def drop_prefetched(self) -> Future:
        """Drop every chunk read ahead; the returned future resolves once no prefetch read is in flight."""
        message = _DropPrefetch()
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
        else:
            logging.getLogger(__name__).warning(
                "Device %d at %r: %s still pending %s s after `close`; its threads are left behind and the process "
                "may not exit until the storage answers.",
                self.index,
                str(self.directory),
                self._describe_transfers(),
                timeout,
            )
        # Free the memory now, even if something still references this device object.
        self.pool.clear()
        self._grad_chunk = None
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
        transfers = sorted(list(self._transfers.values()), key=lambda t: t[3])
        operation, path = (transfers[0][0], transfers[0][1]) if transfers else ("update", self.directory)
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
        transfers = sorted(list(self._transfers.values()), key=lambda t: t[3])
        if not transfers:
            return "no chunk transfer in flight (the update of a chunk has not returned)"
        return "; ".join(f"{op} of {str(path)!r} at byte {at} (for {now - t0:.1f} s)" for op, path, at, t0 in transfers)

    def _transfer(self, operation: str, file: StateFile, record: Tensor, offset: int) -> None:
        """Read or write one chunk record through the engine, raising a :class:`StorageError` for an OSError.

        The error names the file, the operation and the errno; the engine raises only once no piece is in flight.
        """
        key = next(self._transfer_keys)
        self._transfers[key] = (operation, file.path, offset, time.monotonic())
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
        try:
            while True:
                if not self._window:
                    if self._closing:
                        return
                    request = self._next_queued()
                    if request is None:
                        return
                    self._window.append(request)
                    self._cursor, self._cursor_k = 0, self._adopt_prefetched(request)
                request = self._window[0]
                try:
                    self._stream(request)
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting host thread
                    request.future.set_exception(exc)
                else:
                    self._traffic.add(link_write_bytes=request.link_write, link_read_bytes=request.link_read)
                    request.future.set_result(None)
                finally:
                    self._window.popleft()
                    if self._cursor == 0:  # reads had not left this request: the next one starts from its chunk 0
                        self._cursor_k = 0
                    else:
                        self._cursor -= 1
        finally:
            self._drop_prefetched()

    def _next_queued(self) -> _Request | None:
        """Block for the next request (None: close), prefetching advised chunks into free buffers meanwhile."""
        while True:
            self._issue_prefetch()
            waiting_for_buffer = bool(self._prefetch_plan) and len(self._prefetched) < self._prefetch_cap
            try:
                item = self._requests.get(timeout=_PREFETCH_POLL_S) if waiting_for_buffer else self._requests.get()
            except queue.Empty:
                continue  # a write-back may have freed a buffer for the next prefetch
            if not self._control(item):
                return item  # type: ignore[return-value]

    def _control(self, item: _Queued) -> bool:
        """Act on a prefetch message taken off the queue; False if ``item`` is a request or the close sentinel."""
        if isinstance(item, _Prefetch):
            self._drop_prefetched()  # new advice replaces the old
            if self._prefetch_cap > 0:
                self._prefetch_plan.extend([shard, slot, 0] for shard, slot in item.targets)
            return True
        if isinstance(item, _DropPrefetch):
            self._drop_prefetched()
            item.done.set_result(None)
            return True
        return False

    def _issue_prefetch(self) -> None:
        """Start reads of advised chunks while the cap allows and a buffer is free; never blocks."""
        while self._prefetch_plan and len(self._prefetched) < self._prefetch_cap:
            entry = self._prefetch_plan[0]
            shard, slot, k = entry
            if k == shard.layout.num_chunks:
                self._prefetch_plan.popleft()
                continue
            if (buf := self.pool.try_acquire()) is None:
                return  # write-back holds the pool; retried when the queue poll times out
            entry[2] += 1
            pending = self._reader.submit(self._read, shard, slot, k, buf, count=False)
            self._prefetched.append((shard, slot, k, buf, pending))

    def _adopt_prefetched(self, request: _Request) -> int:
        """Hand ``request`` the chunks read ahead for its shard, as its first reads; drop them if they do not fit.

        From now on the request reads its shard itself, so it leaves the plan. Returns the number of chunks
        adopted (the request's next chunk to read). Their bytes count as read now, with the request that
        uses them, so per-step traffic stays exact.
        """
        shard = request.shard
        if self._prefetch_plan:
            self._prefetch_plan = deque(entry for entry in self._prefetch_plan if entry[0] is not shard)
        mine = [entry for entry in self._prefetched if entry[0] is shard]
        if not mine:
            return 0
        self._prefetched = deque(entry for entry in self._prefetched if entry[0] is not shard)
        fits = request.read and all(slot == request.read_slot and k == i for i, (_, slot, k, _, _) in enumerate(mine))
        if not fits:
            self._drop(mine)
            return 0
        for _, _, k, buf, pending in mine:
            self._reads.append((request, k, buf, pending))
            nbytes = self._record_bytes(shard, k)
            self._traffic.add(storage_read_bytes=nbytes)
            self.stats.prefetch_used_bytes += nbytes
        return len(mine)

    def _drop_prefetched(self) -> None:
        """Forget the advice and release every chunk read ahead (waiting for their reads)."""
        self._prefetch_plan.clear()
        dropped, self._prefetched = list(self._prefetched), deque()
        self._drop(dropped)

    def _drop(self, entries: list[tuple[_Shard, int, int, Tensor, Future]]) -> None:
        for shard, _, k, buf, pending in entries:
            if pending.exception() is None:  # a read that happened is traffic, used or not
                nbytes = self._record_bytes(shard, k)
                self._traffic.add(storage_read_bytes=nbytes)
                self.stats.prefetch_dropped_bytes += nbytes
            self.pool.release(buf)

    @staticmethod
    def _record_bytes(shard: _Shard, k: int) -> int:
        return shard.layout.padded_len(k) * shard.layout.tensors_per_record * 4

    def _may_read_ahead(self, i: int) -> bool:
        """Whether chunks of ``window[i]`` may be read now: no earlier request in the window has its shard.

        An earlier request of the same shard has not yet handed all of its write-backs to the writer, so a
        read of that shard could overtake an update (reads only wait for write-backs already submitted).
        """
        shard = self._window[i].shard
        return all(self._window[j].shard is not shard for j in range(i))

    def _next_read(self) -> tuple[_Request, int] | None:
        """The next (request, chunk) to read, in request order, peeking at queued requests; None if none may go."""
        while True:
            request = self._window[self._cursor]
            if request.read and self._cursor_k < request.shard.layout.num_chunks:
                if self._cursor and not self._may_read_ahead(self._cursor):
                    return None
                self._cursor_k += 1
                return request, self._cursor_k - 1
            if self._cursor + 1 == len(self._window):
                if self._closing:
                    return None
                try:
                    queued = self._requests.get_nowait()
                except queue.Empty:
                    return None
                if self._control(queued):
                    continue
                if queued is None:
                    self._closing = True
                    return None
                self._window.append(queued)  # type: ignore[arg-type]
                self._cursor, self._cursor_k = self._cursor + 1, self._adopt_prefetched(queued)  # type: ignore[arg-type]
                continue
            self._cursor, self._cursor_k = self._cursor + 1, 0

    def _issue_reads(self) -> None:
        """Keep up to ``buffer_count - 1`` chunk reads in flight, across request boundaries.

        The last buffer is the one being updated; write-back returns buffers to the pool, so ``acquire``
        blocking here is the back-pressure that keeps reads from running further ahead than the pool allows.
        Reads for a later request only take a buffer that is free now: the current request's parameters
        must never wait for a write-back on behalf of a request behind it.
        """
        # Prefetched chunks hold buffers too: with them counted (at most ``_prefetch_cap``), one buffer is always
        # free or being written back, so ``acquire`` cannot wait on reads only the worker itself would consume.
        while (
            len(self._reads) + len(self._prefetched) < self._buffer_count - 1
            and (target := self._next_read()) is not None
        ):
            request, k = target
            if request is self._window[0]:
                buf = self.pool.acquire()
            elif (free := self.pool.try_acquire()) is not None:
                buf = free
            else:
                self._cursor_k -= 1  # retried at the next chunk boundary
                return
            pending = self._reader.submit(self._read, request.shard, request.read_slot, k, buf)
            self._reads.append((request, k, buf, pending))

    def _read(self, shard: _Shard, slot: int, k: int, buf: Tensor, *, count: bool = True) -> Tensor:
        """Read chunk ``k`` of ``shard``'s ``slot`` into ``buf``; a prefetch (``count=False``) is counted later."""
        record = buf[: shard.layout.padded_len(k) * shard.layout.tensors_per_record]
        previous_write = shard.writes.get((slot, k))
        if previous_write is not None:
            previous_write.result()  # the record's last update must be on disk before we read it back
        t0 = time.perf_counter()
        self._transfer("read", shard.files[slot], record, shard.layout.record_offset(k))
        self.stats.read_s += time.perf_counter() - t0
        if count:
            self._traffic.add(storage_read_bytes=self._record_bytes(shard, k))
        return record

    def _write(self, file: StateFile, offset: int, buf: Tensor, record: Tensor) -> None:
        try:
            t0 = time.perf_counter()
            self._transfer("write", file, record, offset)
            self.stats.write_s += time.perf_counter() - t0
        finally:
            self.pool.release(buf)  # the engine returns or raises only once no piece of ``record`` is in flight

    def _stream(self, request: _Request) -> None:
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
                if request.read:
                    owner, chunk, buf, pending = self._reads.popleft()
                    assert owner is request and chunk == k, "reads are issued in request and chunk order"
                    try:
                        record = pending.result()
                    except BaseException:
                        self.pool.release(buf)
                        raise
                else:
                    buf = self.pool.acquire()
                    record = buf[: layout.padded_len(k) * layout.tensors_per_record]
                    record.zero_()
                padded = layout.padded_len(k)
                start, n = layout.chunk_range(k)
                master = record[:n]
                states = [record[(j + 1) * padded : (j + 1) * padded + n] for j in range(layout.num_states)]
                t0 = time.perf_counter()
                try:
                    request.compute(record, master, states, start, n)
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
                    self._traffic.add(storage_write_bytes=record.numel() * 4)
                else:
                    self.pool.release(buf)
        finally:
            # A failed request drops its remaining reads; reads already issued for later requests stay theirs.
            while self._reads and self._reads[0][0] is request:
                _, _, buf, pending = self._reads.popleft()
                pending.exception()
                self.pool.release(buf)


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


class CpuBackend(Backend):
    """Emulated computational-storage devices, one per directory in ``device_dirs``.

    Args:
        device_dirs: one private directory per device; state files are created inside.
        chunk_elems: elements per streamed chunk (a multiple of 1024).
        buffer_count: chunk buffers per device (at least 2: one updating, one reading or writing). Below
            ``2 * io_threads + 2`` a write in flight holds a buffer a read is waiting for: on the reference VM disk
            4 gave ~2.5x the optimizer step of 12 and more (``benchmarks/bench_step.py``, ``docs/benchmarks.md``).
        owned_dirs: directories the backend created and removes on :meth:`close`.
        io_factory: builds one I/O engine per device (default: :class:`ThreadedIO` with 1 MiB blocks, depth 8).
        io_threads: chunk transfers each device keeps in flight per direction (reads also at most
            ``buffer_count - 1``). Disks reward concurrency: on the reference VM disk 3 gave ~1.6x the state
            bandwidth of 1 (``benchmarks/bench_streaming.py``).
        tentative_slots: keep a second state file per shard so that :meth:`submit` can take ``tentative=True``
            updates, undone by :meth:`rollback` or made current by :meth:`commit`. Doubles the disk space of the
            state (not its traffic).
        prefetch_state: act on :meth:`prefetch` advice (``False`` ignores it: for comparisons).
        device_timeout_s: seconds a device may show no progress (no chunk read, written or updated) while the host
            waits for it, before :meth:`result`, :meth:`wait` and the others raise :class:`StorageError` and the
            backend stops (see :attr:`failure`). ``None`` waits forever.

    Device errors are final: the first one reported to the host (an I/O error, or a device that stopped answering)
    latches the backend as failed; see :attr:`failure`.
    """

    #: Whether a second state file per shard is kept for tentative updates (set by the constructor).
    tentative_slots = False
    #: Whether :meth:`prefetch` advice is acted on (set by the constructor).
    prefetch_state = True
    #: Seconds without progress before waiting on a device fails (set by the constructor; ``None``: forever).
    device_timeout_s: float | None = 300.0
    _failure: StorageError | None = None

    @property
    def supports_tentative(self) -> bool:
        return self.tentative_slots

    def __init__(
        self,
        device_dirs: Sequence[Path],
        *,
        chunk_elems: int = 1 << 20,
        buffer_count: int = 16,
        owned_dirs: Sequence[Path] = (),
        io_factory: Callable[[], IOEngine] = ThreadedIO,
        io_threads: int = 3,
        tentative_slots: bool = False,
        prefetch_state: bool = True,
        device_timeout_s: float | None = 300.0,
    ) -> None:
        super().__init__()
        if not device_dirs:
            raise ValueError("`device_dirs` must name at least one directory.")
        if buffer_count < 2:
            raise ValueError(f"`buffer_count={buffer_count}` must be at least 2 (one updating, one in I/O).")
        self.device_timeout_s = check_device_timeout(device_timeout_s)
        if io_threads < 1:
            raise ValueError(f"`io_threads={io_threads}` must be at least 1 (chunk transfers in flight per device).")
        ChunkLayout(1, chunk_elems, 0)  # validates chunk_elems
        self._chunk_elems = chunk_elems
        self.tentative_slots = tentative_slots
        self.prefetch_state = prefetch_state
        self._owned_dirs = [Path(d) for d in owned_dirs]
        self._shards: list[_Shard] = []
        self._pending: list[Future] = []
        self.devices: list[EmulatedDevice] = []
        self._closed = False
        # One owner per directory: claimed before any file in them is created or truncated, held until `close`.
        self._claims = claim_directories([ensure_private_dir(d) for d in device_dirs])
        try:
            for i, d in enumerate(device_dirs):
                device = EmulatedDevice(
                    i,
                    Path(d),
                    self.traffic,
                    io_factory(),
                    chunk_elems=chunk_elems,
                    buffer_count=buffer_count,
                    io_threads=io_threads,
                )
                self.devices.append(device)
        except BaseException:
            for device in self.devices:
                device.close()
            release_claims(self._claims, remove=self._owned_dirs)
            raise

    @property
    def num_devices(self) -> int:
        return len(self.devices)

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

    def _settle(self, future: Future, device: EmulatedDevice | None = None, what: str = "") -> BaseException | None:
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
        """Host bytes of all buffer pools and gradient chunks (fixed after :meth:`open`)."""
        return sum(device.allocated_bytes for device in self.devices)

    def device_of(self, shard: int) -> EmulatedDevice:
        return self.devices[shard % self.num_devices]

    def open(self, shards: Sequence[ShardSpec]) -> None:
        if self._shards:
            raise RuntimeError("`CpuBackend.open` was already called.")
        if [s.index for s in shards] != list(range(len(shards))):
            raise ValueError(
                f"`ShardSpec.index` values must be 0..{len(shards) - 1} in order, got {[s.index for s in shards]}."
            )
        layouts = [ChunkLayout(s.numel, self._chunk_elems, len(s.rule.state_names)) for s in shards]
        slots = 2 if self.tentative_slots else 1
        for device in self.devices:
            ensure_private_dir(device.directory)
            needed = slots * sum(
                lay.file_bytes for s, lay in zip(shards, layouts) if s.index % self.num_devices == device.index
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
        for spec, layout in zip(shards, layouts):
            directory = self.device_of(spec.index).directory
            files = [
                StateFile(directory / shard_file_name(spec.index, slot), layout.file_bytes, create=True)
                for slot in range(slots)
            ]
            self._shards.append(_Shard(spec, layout, files))
        tensors = max((lay.tensors_per_record for lay in layouts), default=1)
        for device in self.devices:
            device.allocate(tensors)

    def _enqueue(self, request: _Request, tentative: bool = False) -> Handle:
        shard = request.shard
        if shard.tentative:
            raise RuntimeError(
                f"Shard {shard.spec.index} has an uncommitted tentative update; `commit` or `rollback` it first."
            )
        if tentative and not self.tentative_slots:
            raise ValueError("`tentative=True` needs a backend built with `tentative_slots=True`.")
        request.read_slot = shard.slot
        request.write_slot = 1 - shard.slot if tentative else shard.slot
        shard.tentative = tentative
        handle = self.device_of(request.shard.spec.index).enqueue(request)
        # Keep unfinished and failed requests for `wait`; finished ones have nothing left to report.
        self._pending = [h for h in self._pending if not h.done() or h.exception() is not None]
        self._pending.append(handle)
        return handle

    def _shard(self, index: int, numel: int, what: str) -> _Shard:
        shard = self._shards[index]
        if numel != shard.spec.numel:
            raise ValueError(f"{what} of shard {index} has {numel} elements, expected {shard.spec.numel}.")
        return shard

    def initialize(self, shard: int, master: Tensor) -> Handle:
        self._refuse("initialize")
        entry = self._shard(shard, master.numel(), "`master`")
        rule = entry.spec.rule
        init_values = [rule.initial_state_value(name) for name in rule.state_names]

        def fill(record: Tensor, m: Tensor, states: list[Tensor], start: int, n: int) -> None:
            m.copy_(master[start : start + n])
            for state, value in zip(states, init_values):
                if value != 0.0:
                    state.fill_(value)

        link = self._initial_link_bytes(entry, master)
        return self._enqueue(_Request(entry, read=False, write=True, compute=fill, link_write=link))

    def _initial_link_bytes(self, shard: _Shard, master: Tensor) -> int:
        """Link bytes of :meth:`initialize`: the masters as given (a backend writing whole records counts those)."""
        return master.numel() * master.element_size()

    def check_storage(self) -> None:
        """Raise :class:`StorageError` if a device's directory has disappeared (unmounted, deleted).

        That latches :attr:`failure`: the state there can no longer be saved.
        """
        self._refuse("check_storage")
        for device in self.devices:
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
    ) -> Handle:
        self._refuse("submit")
        sparse = isinstance(grad, SparseGrad)
        entry = self._shard(shard, grad.numel if sparse else grad.numel(), "`grad`")
        self._shard(shard, out.numel(), "`out`")
        device = self.device_of(shard)
        rule = entry.spec.rule
        link_dtype = link_dtype or grad.dtype
        round_on_link = link_dtype != grad.dtype

        def load_dense(g: Tensor, start: int, n: int) -> None:
            if round_on_link:
                g.copy_(device.link_chunk(n, link_dtype).copy_(grad[start : start + n]))
            else:
                g.copy_(grad[start : start + n])

        def load_sparse(g: Tensor, start: int, n: int) -> None:
            grad.scatter_chunk(g, start, via=link_dtype)  # decompression, inside the transfer pipeline

        load = load_sparse if sparse else load_dense

        def update(record: Tensor, m: Tensor, states: list[Tensor], start: int, n: int) -> None:
            g = device.grad_chunk(n)
            load(g, start, n)
            if hp.grad_scale != 1.0:
                g.mul_(hp.grad_scale)
            rule.apply(m, g, states, hp)
            out[start : start + n].copy_(m)

        link_write = grad.link_bytes(link_dtype) if sparse else grad.numel() * link_dtype.itemsize
        request = _Request(
            entry,
            read=True,
            write=True,
            compute=update,
            link_write=link_write,
            link_read=out.numel() * out.element_size(),
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
        targets: list[list[tuple[_Shard, int]]] = [[] for _ in self.devices]
        for index in shards:
            shard = self._shards[index]
            if not shard.tentative:
                targets[index % self.num_devices].append((shard, shard.slot))
        for device, device_targets in zip(self.devices, targets):
            device.prefetch(device_targets)  # every device: new advice, even empty, replaces the old

    def prefetch_stats(self) -> tuple[int, int]:
        """Bytes prefetched so far, summed over devices: (used by their request, dropped unused)."""
        return (
            sum(d.stats.prefetch_used_bytes for d in self.devices),
            sum(d.stats.prefetch_dropped_bytes for d in self.devices),
        )

    def read_master(self, shard: int, out: Tensor) -> Handle:
        self._refuse("read_master")
        entry = self._shard(shard, out.numel(), "`out`")

        def copy_out(record: Tensor, m: Tensor, states: list[Tensor], start: int, n: int) -> None:
            out[start : start + n].copy_(m)

        link = out.numel() * 4
        return self._enqueue(_Request(entry, read=True, write=False, compute=copy_out, link_read=link))

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

    def save(self, directory: Path) -> None:
        """Write every shard's state under ``directory`` (waits first); refused after a device error.

        Works after :meth:`close` too (the state files stay on the storage): the directories are claimed again for
        the copy if :meth:`close` released them, so no other run can be writing them meanwhile.
        """
        self._refuse("save")
        self.wait()
        claims = []
        if self._closed and not self._claims:
            if self._owned_dirs:
                raise StorageError(
                    "The device state was in temporary directories that were removed when the backend closed; "
                    "save before closing it."
                )
            claims = claim_directories([device.directory for device in self.devices])
        try:
            save_state(self._state_files(), Path(directory), chunk_elems=self._chunk_elems)
        finally:
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
        for device, dropped in [(device, device.drop_prefetched()) for device in self.devices]:
            if (exc := self._settle(dropped, device, "dropping the state read ahead")) is not None:
                raise exc
        for shard in self._shards:
            for file in shard.files:
                file.close()
        try:
            load_state(self._state_files(), Path(directory), chunk_elems=self._chunk_elems)
        finally:
            for shard in self._shards:
                shard.files = [StateFile(f.path, shard.layout.file_bytes, create=False) for f in shard.files]

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
                    if shard.spec.index % self.num_devices in hung:
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
        release_claims(claims, remove=self._owned_dirs)
