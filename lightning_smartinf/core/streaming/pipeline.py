"""The chunk pipeline of a streaming device: its records, its buffer pool and the two read-ahead state machines.

A device (:class:`~lightning_smartinf.core.streaming.backend.StreamingDevice`) serves :class:`Request` objects one at a
time, in submission order, streaming each one's :class:`Shard` through a fixed :class:`ChunkPool`. Two state
machines run ahead of the request being served, both touched only by the device's worker thread:

- :class:`ReadAheadWindow`: chunk reads of the request being served, running on into the queued requests behind it;
- :class:`PrefetchPlan`: chunks of the shards advised to come next (:class:`PrefetchAdvice`), read while the device
  has no request to serve and adopted by the first request of their shard.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import Tensor

from lightning_smartinf.core.accelerator import Fence
from lightning_smartinf.core.backend import ShardSpec
from lightning_smartinf.core.format.layout import ChunkLayout
from lightning_smartinf.core.io.direct import StateFile
from lightning_smartinf.core.split_masters import SplitChunk

if TYPE_CHECKING:
    from lightning_smartinf.core.streaming.device import StreamingDevice

#: The work of a request on one chunk, called with (record view, master, states, chunk start, chunk length); the
#: master and state views lie inside the record, which is written back after the call when the request writes.
ChunkCompute = Callable[[Tensor, Tensor, list[Tensor], int, int], None]
#: The same work on a chunk whose masters are split, called with (record view, its :class:`SplitChunk`, states, chunk
#: start, chunk length): it reads and writes the masters through the split chunk itself (a fused kernel can do both in
#: its pass).
SplitChunkCompute = Callable[[Tensor, SplitChunk, list[Tensor], int, int], None]


class ChunkPool:
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

    def acquire(self, block: bool = True) -> Tensor | None:
        """A free buffer, waiting for one; without ``block``, None at once if every buffer is in use."""
        try:
            buf = self._free.get(block)
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
        """The most buffers in use at once since the previous call; the count starts again from those in use now."""
        with self._lock:
            peak, self.peak_in_use = self.peak_in_use, self.in_use
        return peak


@dataclass(eq=False)
class Shard:
    """A shard as its device keeps it: the spec, the chunk layout, the state files and their slots."""

    spec: ShardSpec
    layout: ChunkLayout
    #: Slot 0, and slot 1 when the backend keeps tentative updates: a tentative update reads the committed
    #: slot and writes the other, so the committed state stays intact until the backend commits it.
    files: tuple[StateFile, ...]
    #: The committed slot: every read starts from it (a tentative update, written to the other, awaits the backend's
    #: commit or rollback).
    slot: int = 0
    #: Latest write-back of each (slot, chunk); a later read of that record waits for it (write-back trails).
    writes: dict[tuple[int, int], Future] = field(default_factory=dict)

    @property
    def file(self) -> StateFile:
        """The committed state file."""
        return self.files[self.slot]


class RequestHandle(Future):
    """A request's :class:`~lightning_smartinf.core.backend.Handle`: also names its device and work, for timeouts."""

    #: Set by :meth:`StreamingDevice.enqueue`.
    device: StreamingDevice | None = None
    what = "a request"


@dataclass(frozen=True, kw_only=True)
class ChunkWork:
    """What one update does to every chunk of its shard, and the bytes it moves over the host link."""

    compute: ChunkCompute
    link_write: int
    link_read: int
    #: The work on a chunk of split masters, where it handles them itself (``None``: ``compute`` on rebuilt masters).
    compute_split: SplitChunkCompute | None = None


@dataclass(eq=False, kw_only=True)
class Request:
    """One request on a device: stream ``shard`` chunk by chunk, reading and/or writing its state."""

    shard: Shard
    read: bool
    write: bool
    compute: ChunkCompute
    future: RequestHandle = field(default_factory=RequestHandle)
    #: Link bytes, counted when the request completes.
    link_write: int = 0
    link_read: int = 0
    #: Slots read from and written to, fixed when the request is queued.
    read_slot: int = 0
    write_slot: int = 0
    #: Completes when the request's inputs (the gradient) have landed; the worker waits for it before the first
    #: compute (state reads start earlier).
    ready: Fence | None = None
    #: The shard's bf16 parameters, where its layout splits the masters: the other half of each master read (a
    #: chunk's are read before its compute, which may write them).
    params: Tensor | None = None
    #: Where a tentative update of split masters copies the parameters it overwrites, chunk by chunk before its
    #: compute: the committed half of the masters, which a roll-back puts back.
    params_aside: Tensor | None = None
    #: See :attr:`ChunkWork.compute_split`.
    compute_split: SplitChunkCompute | None = None

    @property
    def kind(self) -> str:
        """``update``, ``initialize`` or ``read_master``: what the request does, for messages."""
        return "update" if self.read and self.write else "initialize" if self.write else "read_master"


@dataclass(eq=False)
class PlanEntry:
    """An advised shard, the committed slot its next request will read, and its next chunk to prefetch.

    Made afresh for each advice; once queued (:class:`PrefetchAdvice`) only the worker touches it.
    """

    shard: Shard
    slot: int
    next_chunk: int = 0


@dataclass(frozen=True, eq=False)
class PrefetchAdvice:
    """On a device's queue: its next requests read these targets, in this order (replaces earlier advice)."""

    targets: tuple[PlanEntry, ...]


@dataclass(frozen=True, eq=False)
class DropPrefetch:
    """On a device's queue: drop every chunk read ahead, then resolve ``done`` (the files may change after)."""

    done: Future = field(default_factory=Future)


@dataclass(frozen=True, eq=False)
class ChunkRead:
    """A read of chunk ``k`` of ``request``'s shard into ``buf``, in flight or done (``pending`` holds the record)."""

    request: Request
    k: int
    buf: Tensor
    pending: Future


@dataclass(frozen=True, eq=False)
class PrefetchedChunk:
    """A chunk read ahead of any request: chunk ``k`` of ``shard``'s ``slot`` into ``buf``."""

    shard: Shard
    slot: int
    k: int
    buf: Tensor
    pending: Future


class ReadAheadWindow:
    """The requests the worker took off its queue, the one being served first, and their chunk reads.

    Invariants (worker thread only): ``reads`` holds reads in request order, then chunk order, each of a request in
    ``requests``. ``cursor`` indexes the request whose chunks are being read and ``next_chunk`` is its next chunk
    to read: every earlier chunk of it, and every chunk of the requests before it, is read or in ``reads``. A
    request past the first is read only while no earlier request in the window has its shard (that one's
    write-backs are not all submitted yet). ``closing``: read-ahead took the close sentinel off the queue, so no
    request follows the window's last.
    """

    def __init__(self) -> None:
        self.requests: deque[Request] = deque()
        self.reads: deque[ChunkRead] = deque()
        self.cursor = 0
        self.next_chunk = 0
        self.closing = False

    @property
    def serving(self) -> Request:
        """The request being served (the window is not empty)."""
        return self.requests[0]

    def push(self, request: Request, adopted: int) -> None:
        """Append ``request``, taken off the queue once every earlier one's chunks were read or in ``reads``.

        ``adopted``: its first chunks, already in ``reads`` (prefetched); reading goes on from the next.
        """
        self.requests.append(request)
        self.cursor, self.next_chunk = len(self.requests) - 1, adopted

    def pop_served(self) -> None:
        """Forget the request just served (done or failed)."""
        self.requests.popleft()
        if self.cursor == 0:  # reads had not left this request: the next one starts from its chunk 0
            self.next_chunk = 0
        else:
            self.cursor -= 1

    def next_read(self) -> tuple[Request, int] | None:
        """Claim the next (request, chunk) of the window to read; None if none may go now.

        None also when the window has no chunk left to read (:attr:`exhausted`): then the next queued request may
        be pushed.
        """
        while True:
            request = self.requests[self.cursor]
            if request.read and self.next_chunk < request.shard.layout.num_chunks:
                # A request past the first waits while an earlier one has its shard: that one has not yet handed all
                # of its write-backs to the writer, and reads only wait for those submitted (one could overtake).
                if any(earlier.shard is request.shard for earlier in itertools.islice(self.requests, self.cursor)):
                    return None
                self.next_chunk += 1
                return request, self.next_chunk - 1
            if self.cursor + 1 == len(self.requests):
                return None
            self.cursor, self.next_chunk = self.cursor + 1, 0

    def unclaim(self) -> None:
        """Give back the chunk :meth:`next_read` claimed last (no buffer was free for it): it is claimed again next."""
        self.next_chunk -= 1

    @property
    def exhausted(self) -> bool:
        """Whether every chunk to read of every request in the window is read or in ``reads``."""
        request = self.requests[self.cursor]
        left = request.read and self.next_chunk < request.shard.layout.num_chunks
        return self.cursor + 1 == len(self.requests) and not left


class PrefetchPlan:
    """Chunks of advised shards still to read, and chunks read ahead of any request (worker thread only).

    Invariants: no request has taken a held chunk's shard since the advice (the first that does takes that shard's
    entry and chunks with :meth:`take`), so no held chunk is stale. At most ``cap`` chunks are held. ``entries`` are
    in the advised order, each past the chunks of its shard that are held.
    """

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.entries: deque[PlanEntry] = deque()
        self.held: deque[PrefetchedChunk] = deque()

    @property
    def wants_buffer(self) -> bool:
        """Whether advised chunks are left to read and the cap allows one more."""
        return bool(self.entries) and len(self.held) < self.cap

    def advise(self, targets: tuple[PlanEntry, ...]) -> None:
        """Plan to read ``targets``, in order, after what is planned (:meth:`clear` first to replace the advice)."""
        if self.cap > 0:
            self.entries.extend(targets)

    def next_entry(self) -> PlanEntry | None:
        """The entry whose ``next_chunk`` is the next to read, or None if none is left or the cap is reached."""
        while self.entries and len(self.held) < self.cap:
            entry = self.entries[0]
            if entry.next_chunk == entry.shard.layout.num_chunks:
                self.entries.popleft()
                continue
            return entry
        return None

    def take(self, shard: Shard) -> list[PrefetchedChunk]:
        """Take ``shard`` out of the plan and return its held chunks, in the order they were read.

        A request of ``shard`` reads it itself from now on: it adopts these chunks or drops them.
        """
        if self.entries:
            self.entries = deque(entry for entry in self.entries if entry.shard is not shard)
        mine = [chunk for chunk in self.held if chunk.shard is shard]
        if mine:
            self.held = deque(chunk for chunk in self.held if chunk.shard is not shard)
        return mine

    def clear(self) -> list[PrefetchedChunk]:
        """Forget the advice and return every held chunk (the caller releases their buffers)."""
        self.entries.clear()
        dropped, self.held = list(self.held), deque()
        return dropped
