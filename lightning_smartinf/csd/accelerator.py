"""Copies between accelerator (CUDA) memory and the host buffers of device workers, off the training stream.

A device worker reads gradient chunks from wherever the engine keeps them and writes updated low-precision parameters
into the engine's partitions, which may live in GPU memory. On a GPU a plain ``copy_`` from a worker thread runs on
the default stream: it queues behind every kernel of backward and makes each transfer synchronous. :class:`HostLink`
moves those chunks on a stream of its own through pinned staging buffers instead.

Invariants:

- A CUDA copy never runs on the training stream: each :class:`HostLink` has its own streams, created on first use.
- A gradient chunk is read only after the fence the host handed with it (:func:`record_fence`, recorded on the
  stream that produced the gradient) has completed: the worker waits for it, the training thread never does.
- A parameter chunk written to accelerator memory has landed when :meth:`HostLink.settle` returns; a device settles
  before it reports a request done, so a request's handle completing means its parameters are in place for every
  stream.
- A staging slot is refilled only after the copy that last read it has completed.
- Host and non-CUDA tensors are copied directly (synchronously): correct on any stream, and the only copies a
  machine without CUDA makes.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from lightning_smartinf.csd.io import IO_ALIGN

__all__ = ["Fence", "HostLink", "SideStreams", "on_cuda", "pinned_empty", "record_fence"]


class Fence(Protocol):
    """Something a worker thread can block on until the work it stands for has completed (a CUDA event)."""

    def synchronize(self) -> None:
        """Block the calling thread until the fenced work has completed."""


def on_cuda(tensor: Tensor) -> bool:
    """Whether ``tensor`` lives in CUDA memory (the copies :class:`HostLink` moves off the training stream)."""
    return tensor.device.type == "cuda"


def record_fence(device: torch.device | str | None = None) -> Fence | None:
    """A fence after the work queued so far on ``device``'s current CUDA stream; ``None`` without CUDA work.

    The host calls it where it hands tensors written on that stream to a worker thread: the worker waits for the
    fence, so the thread that launches kernels never blocks on them.
    """
    if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def pinned_empty(nbytes: int, dtype: torch.dtype = torch.uint8) -> Tensor:
    """Uninitialised page-locked host memory of ``nbytes`` bytes, ``IO_ALIGN``-aligned (CUDA copies it
    asynchronously; direct I/O reads and writes it)."""
    raw = torch.empty(nbytes + IO_ALIGN, dtype=torch.uint8, pin_memory=True)
    shift = (-raw.data_ptr()) % IO_ALIGN
    return raw[shift : shift + nbytes].view(dtype)


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
            stream = self._streams.setdefault(key, torch.cuda.Stream(device=device))
        return stream

    def copy(self, dst: Tensor, src: Tensor, stream: torch.cuda.Stream, after: Fence | None = None) -> None:
        """``dst.copy_(src)`` on ``stream``, once ``after`` (an event of the stream that wrote ``src``) has completed;
        returns when the copy has."""
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()


class _Slot:
    """One pinned staging buffer and the event of the last copy that read or wrote it."""

    def __init__(self) -> None:
        self.buffer: Tensor | None = None
        self.event: torch.cuda.Event | None = None

    def take(self, n: int, dtype: torch.dtype) -> Tensor:
        """The first ``n`` elements of the buffer as ``dtype``, once the copy that last used it has completed."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        nbytes = n * dtype.itemsize
        if self.buffer is None or self.buffer.numel() < nbytes:
            self.buffer = pinned_empty(nbytes)
        return self.buffer[:nbytes].view(dtype)


class HostLink:
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

    def to_host(self, src: Tensor) -> Tensor:
        """``src`` readable on the host: ``src`` itself, or for CUDA memory its bytes in pinned staging.

        From CUDA memory the bytes cross in ``src``'s dtype on this link's stream; only the calling (worker) thread
        waits for them. The staging view stays valid until the next call.
        """
        if not on_cuda(src):
            return src
        staging = self._fetch_slot.take(src.numel(), src.dtype)
        self._streams.copy(staging, src, self._streams.stream(src.device, "in"))
        return staging

    def put(self, dst: Tensor, src: Tensor) -> None:
        """``dst`` (anywhere, usually low precision) gets ``src`` (host), rounded to ``dst``'s dtype.

        Into CUDA memory the chunk is rounded into a pinned staging slot on the host and copied asynchronously on
        this link's stream; it has landed after :meth:`settle`.
        """
        if not on_cuda(dst):
            dst.copy_(src)
            return
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        staging = slot.take(src.numel(), dst.dtype)
        staging.copy_(src)
        stream = self._streams.stream(dst.device, "out")
        with torch.cuda.stream(stream):
            dst.copy_(staging, non_blocking=True)
            slot.event = torch.cuda.Event()
            slot.event.record(stream)

    def settle(self) -> None:
        """Block until every :meth:`put` so far has landed."""
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
