"""Copies between accelerator (CUDA) memory and the host buffers of device workers, off the training stream.

A device worker reads gradient chunks from wherever the engine keeps them and writes updated low-precision parameters
into the engine's partitions, which may live in GPU memory. On a GPU a plain ``copy_`` from a worker thread runs on
the default stream: it queues behind every kernel of backward and makes each transfer synchronous.
:class:`AcceleratorCopies` moves those chunks on a stream of its own through pinned staging buffers instead.

Invariants:

- A CUDA copy never runs on the training stream: each :class:`AcceleratorCopies` has its own streams, created on
  first use.
- A gradient chunk is read only after the fence the host handed with it (:func:`record_fence`, recorded on the
  stream that produced the gradient) has completed: the worker waits for it, the training thread never does.
- A parameter chunk written to accelerator memory has landed when :meth:`AcceleratorCopies.settle` returns (from the
  host through staging, or within one memory on the caller's stream, fenced there); a device settles before it
  reports a request done, so a request's handle completing means its parameters are in place for every stream.
- A staging slot is refilled only after the copy that last read it has completed.
- Host and non-CUDA tensors are copied directly (synchronously): correct on any stream, and the only copies a
  machine without CUDA makes.
- Every thread this project starts runs on the accelerator device of the thread that made it
  (:func:`thread_pool`, :func:`start_thread`): a CUDA call on it never creates a context on GPU 0 from another
  rank's process.
- Every event a thread waits on is a blocking one (:func:`cuda_event`): the waiting thread sleeps instead of spinning
  a core that the ``cpu`` backend updates with.
- Side streams come from torch's high-priority pool (:func:`side_stream`), which neither DeepSpeed nor Lightning
  draws from, so a copy of ours never queues behind their work on a stream that happens to be shared.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch
from torch import Tensor

from lightning_smartinf.core.io.direct import IO_ALIGN

__all__ = [
    "Fence",
    "AcceleratorCopies",
    "StreamFences",
    "PinnedRing",
    "SideStreams",
    "bind_thread",
    "cuda_event",
    "current_accelerator",
    "on_cuda",
    "pinned_empty",
    "record_fence",
    "runs_async",
    "side_stream",
    "start_thread",
    "thread_device",
    "thread_pool",
]

#: The priority of this project's side streams: torch's high-priority pool (see the module's invariants).
SIDE_STREAM_PRIORITY = -1

_bound = threading.local()


class Fence(Protocol):
    """Something a worker thread can block on until the work it stands for has completed (a CUDA event)."""

    def synchronize(self) -> None:
        """Block the calling thread until the fenced work has completed."""


def runs_async(device: torch.device) -> bool:
    """Whether copies and kernels on ``device`` run asynchronously to the host (CUDA), so that work queued on one
    stream must be fenced before another stream or the host reads what it writes."""
    return device.type == "cuda"


def on_cuda(tensor: Tensor) -> bool:
    """Whether ``tensor`` lives in CUDA memory (the copies :class:`AcceleratorCopies` moves off the training stream)."""
    return runs_async(tensor.device)


def cuda_event() -> torch.cuda.Event:
    """A CUDA event whose ``synchronize`` puts the waiting thread to sleep (``blocking=True``); with a default event
    the waiting thread may spin a core until the work completes."""
    return torch.cuda.Event(blocking=True)


def side_stream(device: torch.device | str | int | None = None) -> torch.cuda.Stream:
    """A CUDA stream on ``device`` for this project's copies, apart from DeepSpeed's and Lightning's streams."""
    return torch.cuda.Stream(device=device, priority=SIDE_STREAM_PRIORITY)


def record_fence(device: torch.device | str | None = None) -> Fence | None:
    """A fence after the work queued so far on ``device``'s current CUDA stream; ``None`` without CUDA work.

    The host calls it where it hands tensors written on that stream to a worker thread: the worker waits for the
    fence, so the thread that launches kernels never blocks on them.
    """
    if device is None:
        if not torch.cuda.is_available():
            return None
    elif not runs_async(torch.device(device)):
        return None
    event = cuda_event()
    event.record(torch.cuda.current_stream(device))
    return event


class StreamFences:
    """The last fence of each stream that wrote some memory: what a reader on another stream, or the host, waits for
    (:meth:`settle`) before it reads that memory.

    Invariant: a fence is recorded, under the lock, after the write it follows, so the last one of a stream follows
    every write any thread queued there before it; :meth:`settle` waits for the last of each stream.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[object, Fence] = {}

    def note(self, device: torch.device) -> None:
        """Fence the writes queued so far on the calling thread's current stream of ``device`` (none where work on
        ``device`` is synchronous)."""
        if not runs_async(device):
            return
        with self._lock:
            stream = torch.cuda.current_stream(device)
            event = cuda_event()
            event.record(stream)
            self._last[stream] = event

    def settle(self) -> None:
        """Block until every write fenced so far has completed."""
        with self._lock:
            fences, self._last = list(self._last.values()), {}
        for fence in fences:
            fence.synchronize()


def pinned_empty(nbytes: int, dtype: torch.dtype = torch.uint8) -> Tensor:
    """Uninitialised page-locked host memory of ``nbytes`` bytes, ``IO_ALIGN``-aligned (CUDA copies it
    asynchronously; direct I/O reads and writes it).

    Exactly ``nbytes`` are asked for: torch's pinned allocator rounds every request up to a power of two and hands out
    page-aligned blocks, so padding a power-of-two request for alignment would double it.
    """
    raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    if raw.data_ptr() % IO_ALIGN == 0:
        return raw.view(dtype)
    raw = torch.empty(nbytes + IO_ALIGN, dtype=torch.uint8, pin_memory=True)  # an allocator without page alignment
    shift = (-raw.data_ptr()) % IO_ALIGN
    return raw[shift : shift + nbytes].view(dtype)


# ---------------------------------------------------------------------------------------------------------- threads


def current_accelerator() -> torch.device | None:
    """The accelerator device of the calling thread: the one it was bound to (:func:`bind_thread`), else CUDA's
    current device where this process uses CUDA; ``None`` otherwise.

    CUDA is not initialised here: a process that trains on the CPU of a machine with GPUs never touches them.
    """
    bound = getattr(_bound, "device", None)
    if bound is not None:
        return bound
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def thread_device() -> torch.device | None:
    """The device the calling thread was bound to by :func:`bind_thread` (``None``: never bound)."""
    return getattr(_bound, "device", None)


def bind_thread(device: torch.device | None, stream: torch.cuda.Stream | None = None) -> None:
    """Make ``device`` the calling thread's accelerator and, on CUDA, ``stream`` (if given) its current stream.

    A thread starts on CUDA device 0 whatever its process chose: without this, its first CUDA call (an event's
    ``synchronize``, leaving ``torch.cuda.stream``) would create a context on GPU 0 from every rank.
    """
    _bound.device = device
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)
        if stream is not None:
            torch.cuda.set_stream(stream)


def thread_pool(
    workers: int, name: str, device: torch.device | None, stream: torch.cuda.Stream | None = None
) -> ThreadPoolExecutor:
    """A thread pool whose threads run on ``device`` (and ``stream``): see :func:`bind_thread`."""
    return ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=bind_thread, initargs=(device, stream))


def start_thread(
    target: Callable[[], None], name: str, device: torch.device | None, stream: torch.cuda.Stream | None = None
) -> threading.Thread:
    """Start a daemon thread that runs ``target`` on ``device`` (and ``stream``): see :func:`bind_thread`."""

    def run() -> None:
        bind_thread(device, stream)
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


class SideStreams:
    """CUDA streams of one owner's threads, one per device and direction, apart from every stream of training.

    :meth:`copy` blocks only the calling thread: the thread that launches training's kernels never waits on it.
    """

    def __init__(self) -> None:
        self._streams: dict[tuple[torch.device, str], torch.cuda.Stream] = {}

    def stream(self, device: torch.device, direction: str) -> torch.cuda.Stream:
        """The stream for copies of ``direction`` (``"in"`` or ``"out"``) to or from ``device``."""
        key = (device, direction)
        stream = self._streams.get(key)
        if stream is None:
            # dict.setdefault is atomic under the GIL: two threads racing here share the stream one of them made.
            stream = self._streams.setdefault(key, side_stream(device))
        return stream

    def copy(self, dst: Tensor, src: Tensor, stream: torch.cuda.Stream, after: Fence | None = None) -> None:
        """``dst.copy_(src)`` on ``stream``, once ``after`` (an event of the stream that wrote ``src``) has completed;
        returns when the copy has."""
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            dst.copy_(src, non_blocking=True)
            done = cuda_event()
            done.record(stream)
        done.synchronize()


class _Slot:
    """One pinned staging buffer and the event of the last copy that read or wrote it."""

    def __init__(self) -> None:
        self.buffer: Tensor | None = None
        self.event: torch.cuda.Event | None = None  # always a blocking one (cuda_event)

    def take(self, n: int, dtype: torch.dtype) -> Tensor:
        """The first ``n`` elements of the buffer as ``dtype``, once the copy that last used it has completed."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        nbytes = n * dtype.itemsize
        if self.buffer is None or self.buffer.numel() < nbytes:
            self.buffer = pinned_empty(nbytes)
        return self.buffer[:nbytes].view(dtype)


class AcceleratorCopies:
    """One worker thread's copies between accelerator memory and the host, on streams of their own (one each way).

    Args:
        slots: pinned staging buffers for parameter chunks; up to ``slots`` copies to the accelerator are in flight
            while the worker updates the next chunks.
    """

    def __init__(self, slots: int = 2) -> None:
        if slots < 1:
            raise ValueError(f"`slots={slots}` must be at least 1 (staging buffers for copies to the accelerator).")
        self._slots = [_Slot() for _ in range(slots)]
        self._fetch_slot = _Slot()
        self._next = 0
        self._streams = SideStreams()
        self._same_memory = StreamFences()

    def to_host(self, src: Tensor, after: Fence | None = None) -> Tensor:
        """``src`` readable on the host: ``src`` itself, or for CUDA memory its bytes in pinned staging.

        From CUDA memory the bytes cross in ``src``'s dtype on this link's stream, once ``after`` (a fence of the stream
        that wrote ``src``) has completed; only the calling (worker) thread waits for them. The staging view stays
        valid until the next call.
        """
        if not on_cuda(src):
            return src
        staging = self._fetch_slot.take(src.numel(), src.dtype)
        self._streams.copy(staging, src, self._streams.stream(src.device, "in"), after=after)
        return staging

    def put(self, dst: Tensor, src: Tensor) -> None:
        """``dst`` (anywhere, usually low precision) gets ``src`` (host, or already in ``dst``'s memory), rounded to
        ``dst``'s dtype.

        From the host into CUDA memory the chunk is rounded into a pinned staging slot on the host and copied
        asynchronously on this link's stream; it has landed after :meth:`settle`. Within one memory it is copied on
        the calling thread's current stream, fenced there: it has landed after :meth:`settle` too.
        """
        if not on_cuda(dst) or dst.device == src.device:
            dst.copy_(src)
            self._same_memory.note(dst.device)
            return
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        staging = slot.take(src.numel(), dst.dtype)
        staging.copy_(src)
        stream = self._streams.stream(dst.device, "out")
        with torch.cuda.stream(stream):
            dst.copy_(staging, non_blocking=True)
            slot.event = cuda_event()
            slot.event.record(stream)

    def settle(self) -> None:
        """Block until every :meth:`put` so far has landed."""
        self._same_memory.settle()
        for slot in self._slots:
            if slot.event is not None:
                slot.event.synchronize()
                slot.event = None

    def close(self) -> None:
        """Settle, then free the staging buffers (the link can be used again; it allocates anew)."""
        self.settle()
        for slot in (*self._slots, self._fetch_slot):
            slot.buffer = None
        self._streams = SideStreams()


class PinnedRing:
    """Copies into host memory that is not page-locked (a file mapping), from anywhere, without blocking the thread
    that queues them.

    CUDA copies into pageable memory synchronously: ``dst.copy_(src, non_blocking=True)`` from a GPU tensor returns
    only once the copy, and everything queued before it on the stream, has run. Here each piece crosses into one of
    ``slots`` pinned buffers on the current stream instead, and the ring's one thread moves it into ``dst`` once it
    has landed. The caller blocks only when every slot still waits for the thread (back-pressure).

    Invariants:

    - The thread moves pieces in the order they were queued; a slot is refilled only after its last piece moved out.
    - :meth:`fence` completes once every piece queued before it is in its destination (the last one is, and so all
      before it); :meth:`flush` waits for that now. A piece that failed fails every later fence and flush.
    - Host sources (a machine without CUDA) go through the same slots and thread, so this code runs everywhere.

    Args:
        slots: staging buffers (pinned where ``device`` is a GPU), each of ``slot_bytes``.
        device: the accelerator the ring's thread runs on (:func:`bind_thread`).
    """

    def __init__(self, *, slots: int = 4, slot_bytes: int = 8 << 20, device: torch.device | None = None) -> None:
        pinned = device is not None and device.type == "cuda"
        self._buffers = [
            pinned_empty(slot_bytes) if pinned else torch.empty(slot_bytes, dtype=torch.uint8) for _ in range(slots)
        ]
        self._moved: list[Future | None] = [None] * slots
        self._next = 0
        self._last: Future | None = None
        self._error: BaseException | None = None
        self._thread = thread_pool(1, "smartinf-ring", device)

    def copy(self, dst: Tensor, src: Tensor) -> None:
        """Queue ``dst.copy_(src)``, ``src`` in ``dst``'s dtype and shape."""
        src, dst = src.reshape(-1), dst.view(-1)
        per_slot = max(1, self._buffers[0].numel() // src.element_size())
        for start in range(0, src.numel(), per_slot):
            n = min(per_slot, src.numel() - start)
            index = self._next
            self._next = (self._next + 1) % len(self._buffers)
            moved = self._moved[index]
            if moved is not None:
                moved.result()  # the thread moved the slot's last piece out (its error is kept in `_error`)
            staging = self._buffers[index][: n * src.element_size()].view(src.dtype)
            copied = None
            if on_cuda(src):
                staging.copy_(src[start : start + n], non_blocking=True)
                copied = cuda_event()
                copied.record(torch.cuda.current_stream(src.device))
            else:
                staging.copy_(src[start : start + n])
            self._last = self._moved[index] = self._thread.submit(self._move, copied, staging, dst[start : start + n])

    def _move(self, copied: Fence | None, staging: Tensor, target: Tensor) -> None:
        try:
            if copied is not None:
                copied.synchronize()
            target.copy_(staging)
        except BaseException as exc:  # noqa: BLE001 - raised by every later fence
            self._error = self._error or exc

    def fence(self) -> Fence:
        """A fence that completes once every piece queued so far is in its destination."""
        return _Moved(self, self._last)

    def flush(self) -> None:
        """Block until every piece queued so far is in its destination (raising a piece's error, if any)."""
        self.fence().synchronize()

    def close(self) -> None:
        """Flush, then stop the thread; the ring is not used again."""
        try:
            self.flush()
        finally:
            self._thread.shutdown(wait=True)


class _Moved:
    """A fence over the pieces a :class:`PinnedRing` queued before it: the last of them has moved."""

    def __init__(self, ring: PinnedRing, last: Future | None) -> None:
        self._ring = ring
        self._last = last

    def synchronize(self) -> None:
        if self._last is not None:
            self._last.result()
        if self._ring._error is not None:
            raise RuntimeError("A gradient copy into host memory failed") from self._ring._error
