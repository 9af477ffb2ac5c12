"""Native kernels over a chunk in pieces, at once on helper threads: the pieces of one chunk are independent, so the
bytes do not depend on how it is split.

A device's worker runs a chunk's kernel; where the host has cores to spare (torch's intra-op threads say how many the
reference would use), the pieces after the first go to this process's helper threads and the worker takes the first.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["PIECE", "in_pieces"]

#: Elements of the smallest piece: below it, handing a piece to a thread costs more than its update (about 0.2 ms per
#: 64K elements on one core).
PIECE = 1 << 16
_pool: tuple[int, ThreadPoolExecutor] | None = None
_pool_lock = threading.Lock()


def in_pieces(run: Callable[[int, int], None], numel: int, unit: int) -> None:
    """``run(first, end)`` over ``[0, numel)`` in pieces of whole ``unit``s, at once on up to torch's intra-op threads
    (``torch.get_num_threads()``, as the reference's torch operations would use), the calling thread taking the first;
    returns when every piece is done, raising the first piece's error."""
    if numel <= 0:
        return
    pieces = max(1, min(torch.get_num_threads(), numel // PIECE))
    step = -(-numel // (pieces * unit)) * unit
    bounds = [(first, min(first + step, numel)) for first in range(0, numel, step)]
    if len(bounds) == 1:
        run(*bounds[0])
        return
    pool = _helpers()
    others = [pool.submit(run, first, end) for first, end in bounds[1:]]
    try:
        run(*bounds[0])
    finally:
        for future in others:
            future.exception()  # every piece has finished before the chunk's buffers can be reused
    for future in others:
        future.result()


def _helpers() -> ThreadPoolExecutor:
    """The process's helper threads (made again in a forked child, whose copy has none)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            workers = max(1, (os.cpu_count() or 2) - 1)
            _pool = (os.getpid(), ThreadPoolExecutor(workers, thread_name_prefix="smartinf-state-update"))
        return _pool[1]
