"""DeepSpeed's asynchronous direct-I/O op (libaio, ``O_DIRECT``) as an I/O engine for the emulated devices."""

from __future__ import annotations

import atexit
import contextlib
import errno
import logging
import os
import re
import resource
import sys
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_smartinf.core.io.direct import IOEngine, StateFile

# DeepSpeed's `sync_pwrite` logs a one-time warning through Python from inside a C++ `std::call_once` while
# holding the GIL. Two threads making their first write at once deadlock: the second waits in `call_once`
# with the GIL, the first needs the GIL to finish logging. So writes go one at a time until one has returned.
_first_write = threading.Lock()
_first_write_done = False

# A handle still alive when the interpreter finalises can abort the process as it joins its I/O threads
# ("terminate called without an active exception": 7 exits in 40 here). Engines are closed before that.
_open_engines: weakref.WeakSet[DeepSpeedAIO] = weakref.WeakSet()


@atexit.register
def _close_open_engines() -> None:
    # Only the handles: a daemon thread may still hold a locked buffer, and the OS reclaims memory at exit anyway.
    for engine in list(_open_engines):
        engine._drop_handles()


_CAP_IPC_LOCK = 14  # bit of CapEff in /proc/self/status


def _status_field(name: str) -> str | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def lockable_bytes() -> int | None:
    """Bytes of memory this process may still page-lock; ``None`` when nothing limits it.

    DeepSpeed's async_io moves data through page-locked memory only: buffers locked once, or a bounce buffer it
    locks for each transfer. Without ``CAP_IPC_LOCK`` the ``RLIMIT_MEMLOCK`` soft limit (``ulimit -l``, often
    8 MiB for ordinary users) caps that, and a lock that fails aborts the process inside DeepSpeed.
    """
    caps = _status_field("CapEff")
    if caps is not None and int(caps, 16) >> _CAP_IPC_LOCK & 1:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return None
    locked = _status_field("VmLck")  # e.g. "1024 kB"
    return max(0, soft - (int(locked.split()[0]) * 1024 if locked else 0))


def memlock_error(nbytes: int, limit: int) -> str:
    """Why ``nbytes`` of page-locked memory cannot be had, and the fixes."""
    return (
        f"DeepSpeed's async_io needs {nbytes / 2**20:.1f} MiB of page-locked memory but this process may lock only "
        f"{limit / 2**20:.1f} MiB more (`ulimit -l`, RLIMIT_MEMLOCK). Raise the limit (`ulimit -l unlimited`, or "
        "`memlock` in /etc/security/limits.conf), lower `buffer_count` or `chunk_size`, or use `io_engine='threads'`."
    )


#: Where ``scripts/setup.sh`` pre-builds DeepSpeed's JIT ops (``cpu_adam``, ``async_io`` with ``pin_memory``, and the
#: CPU accelerator's ``deepspeed_shm_comm``): inside the virtual environment, so a first run does not compile them.
PREBUILT_OPS_DIR = Path(sys.prefix) / "torch_extensions"

# Held while `TORCH_EXTENSIONS_DIR` is set by `prebuilt_ops`: the variable is process-wide, and a block of one thread
# must not remove it while another thread's block is loading an op.
_prebuilt_ops_lock = threading.RLock()


@contextlib.contextmanager
def prebuilt_ops() -> Iterator[None]:
    """Within the block, DeepSpeed's JIT ops load from :data:`PREBUILT_OPS_DIR` when ``TORCH_EXTENSIONS_DIR`` is unset.

    DeepSpeed's ``OpBuilder.load`` passes torch no build directory, and torch then takes it from the
    ``TORCH_EXTENSIONS_DIR`` environment variable or builds under ``~/.cache/torch_extensions`` (minutes per op). So
    the variable is set for the block and removed when it ends: importing the package leaves the environment alone,
    and a ``TORCH_EXTENSIONS_DIR`` of the user's always wins. Wrap exactly the calls that load ops: our
    :func:`load_aio_op`, and ``deepspeed.init_distributed`` (its ``TorchBackend`` loads the shared-memory comm op on
    the CPU accelerator). Blocks nest; blocks of different threads run one at a time.
    """
    with _prebuilt_ops_lock:
        if "TORCH_EXTENSIONS_DIR" in os.environ or not PREBUILT_OPS_DIR.is_dir():
            yield
            return
        os.environ["TORCH_EXTENSIONS_DIR"] = str(PREBUILT_OPS_DIR)
        try:
            yield
        finally:
            os.environ.pop("TORCH_EXTENSIONS_DIR", None)


def load_aio_op() -> Any:
    """DeepSpeed's ``async_io`` op, built on first use; raises ``RuntimeError`` naming the fix if unavailable.

    The op is taken from :data:`PREBUILT_OPS_DIR` unless ``TORCH_EXTENSIONS_DIR`` names another place (see
    :func:`prebuilt_ops`).
    """
    from deepspeed.ops.op_builder import AsyncIOBuilder

    builder = AsyncIOBuilder()
    if not builder.is_compatible(verbose=False):
        raise RuntimeError(
            "DeepSpeed's async_io op is not available (it needs libaio: `apt-get install libaio-dev` or "
            "`yum install libaio-devel`, then a C++ compiler and ninja)."
        )
    with prebuilt_ops(), arch_list_deepspeed_parses():
        if not _is_built(builder.name):
            logging.getLogger(__name__).warning(
                "Building DeepSpeed's async_io op (it was not pre-built: scripts/setup.sh does that); this takes "
                "minutes, once. Pass `io_engine='threads'` to skip it."
            )
        return builder.load(verbose=False)


@contextlib.contextmanager
def arch_list_deepspeed_parses() -> Iterator[None]:
    """Within the block, ``TORCH_CUDA_ARCH_LIST`` without architecture suffixes (``9.0a`` reads ``9.0``).

    DeepSpeed 0.19's JIT builder derives nvcc flags from the list even for ops with no CUDA source (``async_io``), and
    fails on the suffixed names torch accepts (``ValueError: invalid literal for int() with base 10: '0a'``, seen on an
    H100 whose image sets ``9.0a``). The user's value is back when the block ends.
    """
    with _prebuilt_ops_lock:  # the environment is process-wide (see `prebuilt_ops`)
        value = os.environ.get("TORCH_CUDA_ARCH_LIST")
        if value is None:
            yield
            return
        os.environ["TORCH_CUDA_ARCH_LIST"] = re.sub(r"(\d+\.\d+)[a-z]+", r"\1", value)
        try:
            yield
        finally:
            os.environ["TORCH_CUDA_ARCH_LIST"] = value


def _is_built(name: str) -> bool:
    """Whether op ``name`` was installed with DeepSpeed or JIT-built where torch's extension loader looks for it."""
    from deepspeed.git_version_info import installed_ops
    from torch.utils.cpp_extension import get_default_build_root

    if installed_ops.get(name):
        return True
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return os.path.isfile(os.path.join(root, name, f"{name}.so"))


def _failure(operation: str, file: StateFile, offset: int, returned: int) -> OSError:
    """The error of a failed async_io transfer: DeepSpeed gives no errno, so open the file as it did to find one."""
    try:
        fd = os.open(file.path, os.O_RDONLY if operation == "read" else os.O_WRONLY)
    except OSError as exc:
        code = exc.errno if exc.errno is not None else errno.EIO
    else:
        os.close(fd)
        code = errno.EIO
    detail = f"{os.strerror(code)} (DeepSpeed async_io {operation} at byte {offset} returned {returned})"
    return OSError(code, detail, str(file.path))


class DeepSpeedAIO(IOEngine):
    """Direct I/O through DeepSpeed's libaio handle: ``queue_depth`` requests of ``block_size`` in flight.

    A handle serves one caller at a time, so each calling thread (a device's reader and writer) gets its own.
    Buffers from :meth:`empty` are page-locked once, so transfers go straight to them; any other buffer costs
    DeepSpeed a locked bounce buffer and a copy per transfer. A transfer that would need more locked memory than
    the process may lock raises instead of aborting inside DeepSpeed (see :func:`lockable_bytes`).
    ``close`` frees the locked buffers and destroys every handle (joining its I/O threads); call it only when no
    thread is using the engine or its buffers. Engines still open at interpreter exit are closed by an ``atexit``
    hook.

    Errors: ``sync_pread``/``sync_pwrite`` return only after every request of the transfer completed, so a buffer
    never leaves a transfer with I/O in flight. DeepSpeed reports a failure only as ``-1`` without an errno (it
    could not open or size the file); the engine then opens the file itself to raise an :class:`OSError` with the
    real errno (``EIO`` if that works). DeepSpeed (0.19) does not check the result of each request, so an I/O
    error of the disk once the file is open goes unreported; use ``io_engine='threads'`` where that matters.
    """

    name = "DeepSpeed async_io (libaio, O_DIRECT)"

    def __init__(self, block_size: int = 1 << 20, queue_depth: int = 8, *, op: Any = None) -> None:
        super().__init__(block_size, queue_depth)
        self._op = op if op is not None else load_aio_op()
        self._local = threading.local()
        self._handles: list[Any] = []
        # Page-locked buffers handed out by `empty`, and the handle that allocated them (it frees them).
        self._locked: list[Tensor] = []
        self._allocator: Any = None

    def _handle(self) -> Any:
        handle = getattr(self._local, "handle", None)
        if handle is None:
            # (block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism)
            handle = self._op.aio_handle(self.block_size, self.queue_depth, False, True, 1)
            self._local.handle = handle
            self._handles.append(handle)
            _open_engines.add(self)
        return handle

    def empty(self, nbytes: int) -> Tensor:
        limit = lockable_bytes()
        if limit is not None and nbytes > limit:
            raise RuntimeError(memlock_error(nbytes, limit))
        if self._allocator is None:
            self._allocator = self._op.aio_handle(self.block_size, self.queue_depth, False, True, 1)
            _open_engines.add(self)
        buf = self._allocator.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
        self._locked.append(buf)
        return buf

    def _direct(self, handle: Any, buf: Tensor) -> Tensor:
        """``buf`` flat, after checking that DeepSpeed can lock a bounce buffer for it if it needs one."""
        if not handle.is_pinned(buf):
            limit = lockable_bytes()
            if limit is not None and buf.nbytes > limit:
                raise RuntimeError(memlock_error(buf.nbytes, limit))
        return buf.view(-1)

    def read(self, file: StateFile, buf: Tensor, offset: int) -> None:
        handle = self._handle()
        done = handle.sync_pread(self._direct(handle, buf), str(file.path), offset)
        if done < 0:
            raise _failure("read", file, offset, done)

    def write(self, file: StateFile, buf: Tensor, offset: int) -> None:
        global _first_write_done
        handle = self._handle()
        flat = self._direct(handle, buf)
        with contextlib.nullcontext() if _first_write_done else _first_write:  # waiting here releases the GIL
            done = handle.sync_pwrite(flat, str(file.path), offset)
            _first_write_done = True
        if done < 0:
            raise _failure("write", file, offset, done)

    def close(self) -> None:
        locked, self._locked = self._locked, []
        if self._allocator is not None:  # None after the exit hook dropped the handles: the OS reclaims the memory
            for buf in locked:
                self._allocator.free_cpu_locked_tensor(buf)
        self._drop_handles()

    def _drop_handles(self) -> None:
        # Both references go: the list and every thread's slot (a fresh `local` drops the old per-thread values).
        self._local = threading.local()
        self._handles.clear()
        self._allocator = None
        _open_engines.discard(self)
