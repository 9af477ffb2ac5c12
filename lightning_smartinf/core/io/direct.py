"""Aligned host buffers and positional file I/O, direct (``O_DIRECT``) where the filesystem allows it.

``os.preadv``/``os.pwritev`` release the GIL, so one thread per in-flight request is enough to keep
reads and writes going while another thread computes.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import torch
from torch import Tensor

#: Alignment of buffer addresses, file offsets and transfer sizes; satisfies ``O_DIRECT`` on 4 KiB-sector disks.
IO_ALIGN = 4096
#: A transparent huge page (x86-64 and most arm64 kernels): buffers of at least this size are aligned to it and asked
#: to be backed by huge pages (see :func:`aligned_empty`).
HUGE_PAGE = 2 << 20


def aligned_empty(nbytes: int, dtype: torch.dtype = torch.uint8, *, huge_pages: bool = False) -> Tensor:
    """An uninitialised CPU tensor of ``nbytes`` bytes whose data pointer is ``IO_ALIGN``-aligned.

    ``huge_pages``: one of at least :data:`HUGE_PAGE` bytes is then ``HUGE_PAGE``-aligned memory of its own, which
    Linux is asked to back with transparent huge pages (``MADV_HUGEPAGE``; honoured where THP is ``madvise`` or
    ``always``, the distributions' defaults). A direct transfer takes one segment per physically contiguous piece of
    its buffer: from 4 KiB pages a 1 MiB request needs 256, more than many disks take in one request
    (``/sys/block/<disk>/queue/max_segments``: 254 on a virtio disk, fewer on NVMe drives), so the kernel splits it,
    and pins every page on every transfer. From huge pages it is one segment: a device's step on a virtio disk moved
    its state 1.6x as fast. For buffers kept for a run (a device's pool): the first touch of a
    huge page may wait for the kernel to compact memory, and up to a huge page more than ``nbytes`` is in use. Where
    huge pages are not given, the buffer is ordinary pages. Its memory goes with the last view of the tensor.
    """
    if huge_pages and nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        with contextlib.suppress(OSError):  # a kernel built without THP: ordinary pages
            mapping.madvise(mmap.MADV_HUGEPAGE)
        raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping until the tensor's memory is freed
        shift = (-raw.data_ptr()) % HUGE_PAGE
    else:
        raw = torch.empty(nbytes + IO_ALIGN, dtype=torch.uint8)
        shift = (-raw.data_ptr()) % IO_ALIGN
    return raw[shift : shift + nbytes].view(dtype)


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def supports_direct_io(directory: Path) -> bool:
    """Whether files in ``directory`` can be opened with ``O_DIRECT`` (tmpfs and some network filesystems refuse)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / ".smartinf-direct-io-probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    probe.unlink(missing_ok=True)
    return True


class StateFile:
    """One file of device state, opened for direct positional I/O when the filesystem supports it."""

    #: Whether the state is in memory rather than on storage (see :mod:`lightning_smartinf.core.tiers.host_memory`).
    in_memory = False
    #: Whether code that opens the state by :attr:`path` (checkpoints) needs a host copy staged first.
    needs_host_copy = False
    #: Whether :attr:`checksums` is kept: a checkpoint clones such a file instead of reading it (memory has no clone).
    keeps_checksums = True

    def __init__(self, path: Path, size: int, *, create: bool) -> None:
        self.path = path
        #: CRC-32C of each chunk record as the device last wrote it, by byte offset. An offset is absent while its
        #: record is unknown (never written through a device since the file was opened) or being written.
        self.checksums: dict[int, int] = {}
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        self.direct = hasattr(os, "O_DIRECT")
        try:
            self._fd = os.open(path, flags | (os.O_DIRECT if self.direct else 0), 0o600)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            # tmpfs and some network filesystems refuse O_DIRECT: fall back to buffered I/O.
            self.direct = False
            self._fd = os.open(path, flags, 0o600)
        if create:
            try:
                os.ftruncate(self._fd, size)
                if size and hasattr(os, "posix_fallocate"):
                    # Reserve the blocks now: a full disk fails here, before training, never in the middle of a step.
                    os.posix_fallocate(self._fd, 0, size)
            except BaseException:
                os.close(self._fd)  # an open descriptor would keep the blocks it got after the caller removes the file
                raise

    def read_into(self, buf: Tensor, offset: int) -> None:
        """Fill ``buf`` (contiguous, aligned) from ``offset``."""
        view = memoryview(buf.view(torch.uint8).numpy())
        done = 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n == 0:
                raise OSError(errno.EIO, f"unexpected end of state file {self.path} at byte {offset + done}")
            done += n

    def write_from(self, buf: Tensor, offset: int) -> None:
        """Write all of ``buf`` (contiguous, aligned) at ``offset``."""
        view = memoryview(buf.view(torch.uint8).numpy())
        done = 0
        while done < len(view):
            done += os.pwritev(self._fd, [view[done:]], offset + done)

    def view(self, offset: int, nbytes: int) -> Tensor | None:
        """The bytes at ``offset`` in place, where the state is in memory; ``None`` for a file on storage."""
        return None

    def reserve(self, size: int) -> None:
        """Grow the file to at least ``size`` bytes, reserving the blocks: a full disk fails here, not in a write."""
        current = os.fstat(self._fd).st_size
        if size > current:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(self._fd, current, size - current)  # also extends the file
            else:
                os.ftruncate(self._fd, size)

    def sync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def discard(self) -> None:
        """Close the file and give its storage back (the state in it is gone)."""
        self.close()
        self.path.unlink(missing_ok=True)

    def stage(self, *, copy: bool) -> None:
        """Make :attr:`path` name a host copy of the state (``copy=False``: of its size only); a file is its own."""

    def unstage(self, *, copy_back: bool = False) -> None:
        """Free the copy :meth:`stage` made (``copy_back``: its bytes become the state first); a file has none."""


class IOEngine(ABC):
    """Moves whole aligned buffers between a :class:`StateFile` and memory; blocking, thread-safe.

    An engine may split a transfer into ``block_size`` requests and keep ``queue_depth`` of them in
    flight; callers only see a transfer that is complete when the call returns. A failed transfer raises
    :class:`OSError` (with its ``errno``), and only once none of its requests is in flight any more: the caller
    reuses the buffer as soon as the call returns or raises.
    """

    #: Shown to users so they know which I/O path serves their devices.
    name: str

    def __init__(self, block_size: int = 1 << 20, queue_depth: int = 8) -> None:
        if block_size <= 0 or block_size % IO_ALIGN:
            raise ValueError(
                f"`io_block_size={block_size}` must be a positive multiple of {IO_ALIGN} bytes (the direct-I/O unit)."
            )
        if queue_depth < 1:
            raise ValueError(f"`io_queue_depth={queue_depth}` must be at least 1 (requests in flight per device).")
        self.block_size = block_size
        self.queue_depth = queue_depth

    def empty(self, nbytes: int) -> Tensor:
        """An aligned ``uint8`` buffer this engine transfers without an extra copy, on huge pages where the OS gives
        them (:func:`aligned_empty`); valid until :meth:`close`."""
        return aligned_empty(nbytes, huge_pages=True)

    @abstractmethod
    def read(self, file: StateFile, buf: Tensor, offset: int) -> None:
        """Fill ``buf`` from ``file`` at ``offset``."""

    @abstractmethod
    def write(self, file: StateFile, buf: Tensor, offset: int) -> None:
        """Write all of ``buf`` to ``file`` at ``offset``."""

    @abstractmethod
    def close(self) -> None:
        """Release threads or handles."""


class ThreadedIO(IOEngine):
    """``pread``/``pwrite`` on a pool of ``queue_depth`` threads, one ``block_size`` piece per request."""

    name = "threads (pread/pwrite)"

    def __init__(self, block_size: int = 1 << 20, queue_depth: int = 8) -> None:
        super().__init__(block_size, queue_depth)
        self._pool = ThreadPoolExecutor(queue_depth, thread_name_prefix="csd-io")

    def _run(self, fn, buf: Tensor, offset: int) -> None:  # noqa: ANN001 - a bound StateFile method
        flat = buf.view(torch.uint8)
        pieces = [(flat[at : at + self.block_size], offset + at) for at in range(0, flat.numel(), self.block_size)]
        if len(pieces) == 1:
            fn(*pieces[0])
            return
        futures = []
        try:
            for piece, at in pieces:
                futures.append(self._pool.submit(fn, piece, at))
        finally:
            # Every piece settles before the first error is raised: the caller may hand ``buf`` to other I/O
            # as soon as this returns, so none of its pieces may still be in flight.
            wait(futures)
        for future in futures:
            future.result()

    def read(self, file: StateFile, buf: Tensor, offset: int) -> None:
        self._run(file.read_into, buf, offset)

    def write(self, file: StateFile, buf: Tensor, offset: int) -> None:
        self._run(file.write_from, buf, offset)

    def close(self) -> None:
        self._pool.shutdown()


class RateLimitedIO(IOEngine):
    """Another engine's transfers, at most ``bytes_per_s`` of reads and writes together: to leave a disk's bandwidth
    to other work, or to run a device as a slower disk would (``benchmarks/bench_pools.py``).

    Each transfer reserves the next slot of the device's one channel, runs, and returns when its slot ends.
    :attr:`bytes_per_s` may change at any time; later transfers take the new rate.
    """

    def __init__(self, inner: IOEngine, bytes_per_s: float) -> None:
        super().__init__(inner.block_size, inner.queue_depth)
        if not bytes_per_s > 0:
            raise ValueError(f"`bytes_per_s={bytes_per_s!r}` must be positive.")
        self.name = f"{inner.name}, at most {bytes_per_s / 1e6:.0f} MB/s"
        self.bytes_per_s = bytes_per_s
        self._inner = inner
        self._lock = threading.Lock()
        self._free_at = time.monotonic()

    def empty(self, nbytes: int) -> Tensor:
        return self._inner.empty(nbytes)

    def _run(self, transfer, file: StateFile, buf: Tensor, offset: int) -> None:  # noqa: ANN001 - the inner method
        with self._lock:
            self._free_at = max(self._free_at, time.monotonic()) + buf.numel() * buf.element_size() / self.bytes_per_s
            done_at = self._free_at
        transfer(file, buf, offset)
        time.sleep(max(0.0, done_at - time.monotonic()))

    def read(self, file: StateFile, buf: Tensor, offset: int) -> None:
        self._run(self._inner.read, file, buf, offset)

    def write(self, file: StateFile, buf: Tensor, offset: int) -> None:
        self._run(self._inner.write, file, buf, offset)

    def close(self) -> None:
        self._inner.close()
