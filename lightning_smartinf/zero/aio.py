"""DeepSpeed's asynchronous direct-I/O op (libaio, ``O_DIRECT``) as an I/O engine for the emulated devices."""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Any

from torch import Tensor

from lightning_smartinf.csd.io import IOEngine, StateFile

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
    for engine in list(_open_engines):
        engine.close()


def load_aio_op() -> Any:
    """DeepSpeed's ``async_io`` op, built on first use; raises ``RuntimeError`` naming the fix if unavailable."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    builder = AsyncIOBuilder()
    if not builder.is_compatible(verbose=False):
        raise RuntimeError(
            "DeepSpeed's async_io op is not available (it needs libaio: `apt-get install libaio-dev` or "
            "`yum install libaio-devel`, then a C++ compiler and ninja)."
        )
    logging.getLogger(__name__).warning(
        "Loading DeepSpeed's async_io op; if it was not pre-built (scripts/setup.sh does), this compiles it first "
        "and takes minutes. Pass `io_engine='threads'` to skip it."
    )
    return builder.load(verbose=False)


class DeepSpeedAIO(IOEngine):
    """Direct I/O through DeepSpeed's libaio handle: ``queue_depth`` requests of ``block_size`` in flight.

    A handle serves one caller at a time, so each calling thread (a device's reader and writer) gets its own.
    ``close`` destroys every handle (joining its I/O threads); call it only when no thread is using the engine.
    Engines still open at interpreter exit are closed by an ``atexit`` hook.
    """

    name = "DeepSpeed async_io (libaio, O_DIRECT)"

    def __init__(self, block_size: int = 1 << 20, queue_depth: int = 8, *, op: Any = None) -> None:
        super().__init__(block_size, queue_depth)
        self._op = op if op is not None else load_aio_op()
        self._local = threading.local()
        self._handles: list[Any] = []

    def _handle(self) -> Any:
        handle = getattr(self._local, "handle", None)
        if handle is None:
            # (block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism)
            handle = self._op.aio_handle(self.block_size, self.queue_depth, False, True, 1)
            self._local.handle = handle
            self._handles.append(handle)
            _open_engines.add(self)
        return handle

    def read(self, file: StateFile, buf: Tensor, offset: int) -> None:
        done = self._handle().sync_pread(buf.view(-1), str(file.path), offset)
        if done < 0:
            raise OSError(f"async_io read of {file.path} at byte {offset} failed ({done}).")

    def write(self, file: StateFile, buf: Tensor, offset: int) -> None:
        global _first_write_done
        if _first_write_done:
            done = self._handle().sync_pwrite(buf.view(-1), str(file.path), offset)
        else:
            with _first_write:  # waiting here releases the GIL
                done = self._handle().sync_pwrite(buf.view(-1), str(file.path), offset)
                _first_write_done = True
        if done < 0:
            raise OSError(f"async_io write of {file.path} at byte {offset} failed ({done}).")

    def close(self) -> None:
        # Both references go: the list and every thread's slot (a fresh `local` drops the old per-thread values).
        self._local = threading.local()
        self._handles.clear()
        _open_engines.discard(self)
