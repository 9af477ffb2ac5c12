"""ZeRO-3's 16-bit parameter partitions on the storage paths (``offload_parameters="storage"``).

DeepSpeed's own partitioned-parameter swapper (``offload_param: nvme``) keeps each parameter partition in a file and
reads it into one of ``buffer_count`` pinned buffers of ``buffer_size`` elements when forward or backward gathers
the parameter. Its users meet "Not enough buffers" when a gather or a prefetch wants more buffers than the config
gave it. Here the buffers are sized from the model before the engine is built (:func:`swap_buffer_settings`):

- ``buffer_size`` is the largest parameter partition that will live on storage;
- ``buffer_count`` covers the most stored parameters one module gathers, times :data:`GATHERS_IN_FLIGHT`;
  parameters are never kept gathered for reuse (``stage3_max_reuse_distance=0``), so a module's buffers are released
  when it is done. DeepSpeed's read-ahead of stored partitions takes only free buffers.

Invariants:

- A partition smaller than :data:`MIN_SWAPPED_BYTES` stays in host memory (DeepSpeed does not swap it), so it needs
  no buffer.
- Every byte the swapper moves after set-up passes a :class:`CountingHandle` (:func:`prepare_swapper`).
"""

from __future__ import annotations

import math
import shutil
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from deepspeed.runtime.swap_tensor.utils import AIO_ALIGNED_BYTES, MIN_AIO_BYTES

from lightning_smartinf.csd.storage import GIB, StorageError

#: DeepSpeed keeps partitions smaller than this in host memory even with ``offload_param: nvme``.
MIN_SWAPPED_BYTES = MIN_AIO_BYTES
#: Each partition's file is padded to a multiple of this.
ALIGNMENT = AIO_ALIGNED_BYTES
#: Modules whose stored partitions may hold buffers at once: the one computing, the one DeepSpeed reads ahead (its
#: read-ahead takes only free buffers) and one released late where hooks fire out of order.
GATHERS_IN_FLIGHT = 3
#: Buffers beyond that need, so that a read-ahead never leaves a gather without one.
SPARE_BUFFERS = 2


def _partition_numel(numel: int, world_size: int) -> int:
    return math.ceil(numel / world_size)


def swap_buffer_settings(
    modules: Iterable[torch.nn.Module], *, world_size: int, element_size: int, block_size: int
) -> dict[str, int]:
    """``offload_param`` settings that let DeepSpeed's swapper serve every gather of ``modules``' parameters.

    Args:
        modules: every module of the model (``model.modules()``); each gathers its own direct parameters.
        world_size: ranks the parameters are partitioned over.
        element_size: bytes per element of the training dtype.
        block_size: the aio block size (partitions below ``max(1 MiB, block_size)`` stay in memory).
    """
    threshold = max(MIN_SWAPPED_BYTES, block_size)
    largest = threshold // element_size  # elements of the largest stored partition
    per_module = 1  # stored partitions one module gathers at once
    for module in modules:
        stored = [
            numel
            for numel in (_partition_numel(p.numel(), world_size) for p in module.parameters(recurse=False))
            if numel * element_size >= threshold
        ]
        if stored:
            largest = max(largest, *stored)
            per_module = max(per_module, len(stored))
    return {"buffer_size": int(largest), "buffer_count": int(GATHERS_IN_FLIGHT * per_module + SPARE_BUFFERS)}


def stored_param_bytes(parameters: Iterable[torch.nn.Parameter], *, world_size: int, element_size: int) -> int:
    """At most the bytes one rank's files of ``parameters``' partitions take (each padded to the swapper's 1 KiB
    alignment; partitions too small to swap are counted too, though they stay in memory)."""
    total = 0
    for p in parameters:
        nbytes = _partition_numel(p.numel(), world_size) * element_size
        total += math.ceil(nbytes / ALIGNMENT) * ALIGNMENT
    return total


def check_param_space(directory: Path, params_bytes: int, state_bytes: int) -> None:
    """Raise :class:`StorageError` unless ``directory``'s filesystem holds the parameters and the state placed there.

    Checked before the engine writes anything: the parameters are written first, at set-up.
    """
    free = shutil.disk_usage(directory).free
    if free < params_bytes + state_bytes:
        raise StorageError(
            f"Storage path {str(directory.parent)!r} has {free / GIB:.2f} GiB free but `offload_parameters='storage'` "
            f"needs {(params_bytes + state_bytes) / GIB:.2f} GiB there: {params_bytes / GIB:.2f} GiB of 16-bit "
            f"parameters and {state_bytes / GIB:.2f} GiB of optimizer state. Free space, add `storage_paths`, or "
            "choose a larger disk."
        )


class CountingHandle:
    """An aio handle that counts the bytes each ``async_pread``/``async_pwrite`` moves; the rest passes through."""

    def __init__(self, handle: Any, counts: ParamTraffic, *, read: bool) -> None:
        self._handle = handle
        self._counts = counts
        self._read = read

    def async_pread(self, buffer: torch.Tensor, path: str, offset: int = 0) -> int:
        self._counts.add(read=buffer.numel() * buffer.element_size())
        return self._handle.async_pread(buffer, path, offset)

    def async_pwrite(self, buffer: torch.Tensor, path: str, offset: int = 0) -> int:
        self._counts.add(written=buffer.numel() * buffer.element_size())
        return self._handle.async_pwrite(buffer, path, offset)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


class ParamTraffic:
    """Bytes of parameters read from and written to storage (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.read = 0
        self.written = 0

    def add(self, *, read: int = 0, written: int = 0) -> None:
        with self._lock:
            self.read += read
            self.written += written

    def snapshot(self) -> tuple[int, int]:
        with self._lock:
            return self.read, self.written


def prepare_swapper(swapper: Any) -> ParamTraffic:
    """Make DeepSpeed's ``AsyncPartitionedParameterSwapper`` dependable here; return the counters of what it moves.

    - Its reads and writes pass through :class:`CountingHandle` objects.
    - ``swap_in`` takes each parameter once. DeepSpeed's read-ahead (``__prefetch_nvme_param_partitions``) lists a
      parameter twice when the trace uses it twice in a row (the last layer ends forward and starts backward), and
      the swapper then fails with "param N already assigned swap buffer".
    - A gather of more stored partitions than the pool has free buffers reads the rest into buffers of their own
      (:func:`own_buffer`) instead of failing with "Not enough buffers".
    """
    counts = ParamTraffic()
    swapper.aio_read_handle = CountingHandle(swapper.aio_read_handle, counts, read=True)
    swapper.aio_write_handle = CountingHandle(swapper.aio_write_handle, counts, read=False)
    swap_in = swapper.swap_in

    def swap_in_once(params: list[Any], async_op: bool = True, swap_in_buffers: Any = None) -> None:
        if swap_in_buffers is not None:
            swap_in(params, async_op=async_op, swap_in_buffers=swap_in_buffers)
            return
        params = list({id(p): p for p in params}.values())
        pooled, extra = params[: swapper.available_swap_in_buffers()], params[swapper.available_swap_in_buffers() :]
        if pooled:
            swap_in(pooled, async_op=async_op)
        if extra:
            swap_in(extra, async_op=async_op, swap_in_buffers=[own_buffer(swapper, p) for p in extra])

    swapper.swap_in = swap_in_once
    return counts


def own_buffer(swapper: Any, param: Any) -> torch.Tensor:
    """A buffer of ``param``'s own for a gather beyond the pool (a whole model under ``GatheredParameters``, as export
    and users' saving code do); it is freed when the swapper releases the partition."""
    numel = int(param.ds_tensor.ds_numel)
    swapper.param_id_to_numel[param.ds_id] = numel
    return torch.empty(swapper._io_aligned_numel(numel), dtype=swapper.dtype)
