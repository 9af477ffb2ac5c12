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
import mmap
import os
import shutil
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from deepspeed.runtime.swap_tensor.utils import AIO_ALIGNED_BYTES, MIN_AIO_BYTES

from lightning_smartinf.core.io.leftovers import remove_leftovers, temporary_path
from lightning_smartinf.core.io.storage import (
    GIB,
    StorageError,
    disk_full_error,
    free_bytes,
    is_disk_full,
    readable_size,
)
from lightning_smartinf.core.traffic import Traffic

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


def full_numel(param: torch.Tensor) -> int:
    """Elements of ``param`` whole, also once ZeRO-3 has partitioned it (its ``numel()`` is then 0)."""
    return int(getattr(param, "ds_numel", param.numel()))


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
            for numel in (_partition_numel(full_numel(p), world_size) for p in module.parameters(recurse=False))
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
        nbytes = _partition_numel(full_numel(p), world_size) * element_size
        total += math.ceil(nbytes / ALIGNMENT) * ALIGNMENT
    return total


def check_param_space(
    directory: Path, params_bytes: int, gradient_bytes: int, state_bytes: int, residual_bytes: int = 0
) -> None:
    """Raise :class:`StorageError` unless ``directory``'s filesystem holds the parameters, the gradients' file (the
    kernel writes it only under memory pressure, but then it needs the room), the error-feedback residual's file and
    the state placed there.

    Checked before the engine writes anything: the parameters are written first, at set-up. A model built in
    ``configure_model`` has written its parameters already (``params_bytes=0``); the rest is checked before it is.
    """
    free = shutil.disk_usage(directory).free
    needed = params_bytes + gradient_bytes + state_bytes + residual_bytes
    if free < needed:
        residual = f", {readable_size(residual_bytes)} of error-feedback residual" if residual_bytes else ""
        params = f"{readable_size(params_bytes)} of" if params_bytes else "the (already written)"
        raise disk_full_error(
            directory.parent,
            f"`offload_parameters='storage'` ({params} 16-bit parameters, {readable_size(gradient_bytes)} for their "
            f"gradients{residual} and {readable_size(state_bytes)} of optimizer state)",
            needed,
            "Nothing was written. Free space, add `storage_paths`, or choose a larger disk.",
            free=free,
        )


class CountingHandle:
    """An aio handle that counts the bytes each ``async_pread``/``async_pwrite`` moves as parameter traffic; the rest
    passes through."""

    def __init__(self, handle: Any, traffic: Traffic) -> None:
        self._handle = handle
        self._traffic = traffic

    def async_pread(self, buffer: torch.Tensor, path: str, offset: int = 0) -> int:
        self._traffic.add(param_read_bytes=buffer.nbytes)
        return self._handle.async_pread(buffer, path, offset)

    def async_pwrite(self, buffer: torch.Tensor, path: str, offset: int = 0) -> int:
        self._traffic.add(param_write_bytes=buffer.nbytes)
        return self._handle.async_pwrite(buffer, path, offset)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


def prepare_swapper(swapper: Any) -> Traffic:
    """Make DeepSpeed's ``AsyncPartitionedParameterSwapper`` dependable here (once); return the counters of what it
    moves.

    - Its reads and writes pass through :class:`CountingHandle` objects.
    - ``swap_in`` takes each parameter once. DeepSpeed's read-ahead (``__prefetch_nvme_param_partitions``) lists a
      parameter twice when the trace uses it twice in a row (the last layer ends forward and starts backward), and
      the swapper then fails with "param N already assigned swap buffer".
    - A gather of more stored partitions than the pool has free buffers, or a partition larger than the pool's
      buffers (while a model is built, before the pool is sized for it), uses a buffer of its own, freed on release,
      instead of failing with "Not enough buffers".
    """
    traffic = getattr(swapper, "smartinf_traffic", None)
    if traffic is not None:
        return traffic
    traffic = swapper.smartinf_traffic = Traffic()
    swapper.aio_read_handle = CountingHandle(swapper.aio_read_handle, traffic)
    swapper.aio_write_handle = CountingHandle(swapper.aio_write_handle, traffic)
    swap_in, get_buffer, release = swapper.swap_in, swapper.get_buffer, swapper.remove_partition_and_release_buffers
    own: set[int] = set()  # ids of the parameters that hold a buffer of their own

    def swap_in_once(params: list[Any], async_op: bool = True, swap_in_buffers: Any = None) -> None:
        if swap_in_buffers is not None:
            swap_in(params, async_op=async_op, swap_in_buffers=swap_in_buffers)
            return
        params = list({id(p): p for p in params}.values())
        fits = [p for p in params if p.ds_tensor.ds_numel <= swapper.elements_per_buffer]
        pooled = fits[: swapper.available_swap_in_buffers()]
        pooled_ids = {id(p) for p in pooled}
        extra = [p for p in params if id(p) not in pooled_ids]
        if pooled:
            swap_in(pooled, async_op=async_op)
        if extra:
            buffers = [take_own(p, int(p.ds_tensor.ds_numel)) for p in extra]
            swap_in(extra, async_op=async_op, swap_in_buffers=buffers)

    def take_own(param: Any, numel: int) -> torch.Tensor:
        """A buffer of ``param``'s own for ``numel`` elements, outside the pool (a whole model under
        ``GatheredParameters``, as export and users' saving code do, or a partition larger than the pool's buffers)."""
        own.add(param.ds_id)
        swapper.param_id_to_numel[param.ds_id] = numel
        buffer = torch.empty(_aligned(swapper, numel), dtype=swapper.dtype)
        # Where `_swap_out` finds what to write when the partition changed (`GatheredParameters(modifier_rank=0)`).
        swapper.param_id_to_swap_buffer[param.ds_id] = buffer
        return buffer

    def get_buffer_or_own(param: Any, numel: int) -> torch.Tensor:
        if numel <= swapper.elements_per_buffer and swapper.available_swap_in_buffers() > 0:
            return get_buffer(param, numel)
        return take_own(param, numel).narrow(0, 0, numel)

    def release_own_too(params: list[Any]) -> None:
        for param in params:
            if param.ds_id in own:
                own.discard(param.ds_id)
                swapper.param_id_to_swap_buffer.pop(param.ds_id, None)
        release(params)

    swapper.swap_in = swap_in_once
    swapper.get_buffer = get_buffer_or_own
    swapper.remove_partition_and_release_buffers = release_own_too
    return traffic


def resize_pool(swapper: Any, *, buffer_count: int, buffer_size: int) -> None:
    """Give ``swapper`` a pool of ``buffer_count`` buffers of ``buffer_size`` elements, replacing the one it was built
    with (for a model built before its sizes were known). Nothing may hold a pooled buffer: call it between steps."""
    if swapper.param_id_to_buffer_id or swapper.inflight_params or swapper.reserved_buffer_ids:
        raise RuntimeError("The parameter swapper's pool is in use; it can only be resized when no partition is read.")
    aligned = _aligned(swapper, buffer_size)
    old = swapper.buffers
    swapper.buffers = swapper.aio_read_handle.new_cpu_locked_tensor(
        aligned * buffer_count, torch.empty(0, dtype=swapper.dtype)
    )
    swapper.aio_read_handle.free_cpu_locked_tensor(old)
    swapper.elements_per_buffer = buffer_size
    swapper.aligned_elements_per_buffer = aligned
    swapper.param_buffer_count = buffer_count
    swapper.available_buffer_ids = list(range(buffer_count))


def construction_swapper(config: dict[str, Any]) -> Any:
    """A parameter swapper for ``zero.Init`` while a model is built (``config``'s ``offload_param`` says where), with
    the dtype ``zero.Init`` gives the parameters, ready (:func:`prepare_swapper`)."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import AsyncPartitionedParameterSwapper

    ds_config = DeepSpeedConfig(config)
    if ds_config.bfloat16_config.enabled:
        dtype = torch.bfloat16
    elif ds_config.float16_config.enabled:
        dtype = torch.float16
    else:
        dtype = torch.float32
    swapper = AsyncPartitionedParameterSwapper(ds_config, dtype)
    prepare_swapper(swapper)
    return swapper


def _aligned(swapper: Any, numel: int) -> int:
    """``numel`` rounded up to the swapper's I/O alignment (what its files and buffers hold per partition)."""
    return -(-numel // swapper.numel_alignment) * swapper.numel_alignment


def check_parameter_files(swapper: Any) -> None:
    """Raise :class:`StorageError` unless every parameter partition DeepSpeed's ``swapper`` wrote is whole on disk.

    DeepSpeed's asynchronous writes do not report a failed write: a partition written to a full disk leaves a short
    (often empty) file, and a later gather would read it as the parameter. Called once the model's partitions are
    written (after ZeRO-3's set-up), before anything reads them.
    """
    if swapper.pending_writes:
        swapper.synchronize_writes()
    element_size = swapper.swap_element_size
    short, expected = [], 0
    for param_id, path in swapper.id_to_path.items():
        numel = swapper.param_id_to_numel.get(param_id)
        if numel is None:
            continue  # never written (kept in memory)
        nbytes = numel * element_size
        expected += nbytes
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            size = 0
        if size < nbytes:
            short.append((path, nbytes - size))
    if not short:
        return
    missing = sum(n for _, n in short)
    directory = Path(short[0][0]).parent
    free = free_bytes(directory)
    if free is not None and free < missing + (1 << 20):
        raise disk_full_error(
            directory,
            f"the 16-bit parameters (`offload_parameters='storage'`; {len(short)} of their files are incomplete)",
            expected,
            "Free space on the first storage path and run again (each run writes them anew), or keep the parameters "
            "in memory (`offload_parameters=True`).",
        )
    raise StorageError(
        f"{len(short)} of the 16-bit parameter files in {str(directory)!r} are shorter than DeepSpeed wrote them "
        f"({missing} bytes missing, first {short[0][0]!r}), though the filesystem has room: a storage error. Check "
        "the disk, or keep the parameters in memory (`offload_parameters=True`).",
        path=short[0][0],
        operation="write",
    )


#: What a :class:`FileBuffer`'s file stands for (named by :func:`temporary_path`, unlinked as soon as it is open).
FILE_BUFFER = "smartinf-file-buffer"


class FileBuffer:
    """A flat buffer whose pages belong to a file on a storage path: this rank's reduced gradients, or the
    error-feedback residual, where the parameters live on storage.

    The file is shared-mapped and unlinked at once (nothing is left behind). Writes land in the page cache;
    :meth:`release` takes a range's pages out of this process once it is used (after each reduce bucket, after each
    sub-group's compression), so the kernel may write them to the file and evict them when memory runs short, and
    :meth:`discard` punches out a range whose contents are no longer needed, so they are never written back. The
    process itself holds only the pages in use.

    Invariants:

    - The file's blocks are reserved (``posix_fallocate``) when it is made and again after each punch: a write-back
      never finds the disk full, which a shared mapping could only report as ``SIGBUS``.
    - A new buffer, and a punched range, read as zeros: a parameter that gets no gradient in a step has a zero
      gradient (ZeRO's own buffer would keep the step before's).
    - :meth:`release` never changes a value: a released page is read back from the page cache or the file.
    """

    def __init__(self, directory: Path, numel: int, dtype: torch.dtype, *, what: str = "the gradients") -> None:
        self.element_size = dtype.itemsize
        #: The directory the file was made in.
        self.directory = Path(directory)
        nbytes = max(1, numel) * self.element_size
        remove_leftovers(directory, FILE_BUFFER)  # a process killed between making and unlinking its file
        name = temporary_path(Path(directory) / FILE_BUFFER)
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.unlink(name)
            os.posix_fallocate(fd, 0, nbytes)
            self._map = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            if is_disk_full(exc):
                raise disk_full_error(
                    directory,
                    f"the file of {what}",
                    nbytes,
                    "Free space on the storage path, or keep the parameters in memory (`offload_parameters=True`).",
                ) from None
            raise StorageError(
                f"Cannot reserve {nbytes / GIB:.2f} GiB for {what} in {str(directory)!r} ({exc}). Keep the parameters "
                "in memory (`offload_parameters=True`) or use another storage path.",
                path=directory,
                operation="fallocate",
                errno=exc.errno,
            ) from None
        self._fd = fd  # kept open to reserve punched ranges again; the blocks go with the last of it and the map
        weakref.finalize(self, os.close, fd)
        #: The buffer, ``numel`` elements of ``dtype`` over the mapping.
        self.tensor = torch.frombuffer(self._map, dtype=dtype, count=numel)

    def release(self, start: int = 0, end: int | None = None) -> None:
        """Take the pages holding elements ``[start, end)`` (default: all) out of this process; their contents stay
        in the file (the page cache)."""
        first = start * self.element_size // mmap.PAGESIZE * mmap.PAGESIZE
        last = len(self._map) if end is None else min(len(self._map), end * self.element_size)
        if last > first:
            self._map.madvise(mmap.MADV_DONTNEED, first, last - first)

    def discard(self, start: int, end: int) -> None:
        """Elements ``[start, end)`` are no longer needed: drop the whole pages among them, in memory and in the file,
        without writing them back.

        Where the filesystem cannot punch holes, the pages only leave this process.
        """
        first = -(-start * self.element_size // mmap.PAGESIZE) * mmap.PAGESIZE
        last = end * self.element_size // mmap.PAGESIZE * mmap.PAGESIZE
        if last <= first:
            return
        try:
            self._map.madvise(mmap.MADV_REMOVE, first, last - first)
        except OSError:
            self._map.madvise(mmap.MADV_DONTNEED, first, last - first)
            return
        os.posix_fallocate(self._fd, first, last - first)
