"""Placement: which storage paths and XRT devices a rank drives, the device directories it keeps there, and which
of its devices holds each shard.

The paths (and XRT devices) given to a node are shared out among its ranks by one rule, :func:`rank_share`: local
rank ``r`` of ``n`` takes every ``n``-th entry from ``r``. A rank's device directories are
``<storage path>/smartinf/rank<global rank>``, so ranks of different nodes that share a filesystem never meet.
Within a rank, a :class:`Placement` assigns shards to devices when the backend opens them (:class:`RoundRobin` by
default). :class:`TieredPlacement` puts shards in host memory up to a budget and spreads the rest over storage
devices in proportion to their speed (given, or measured by :func:`measure_write_read`). Checkpoints do not depend
on placement: a shard's saved record is the same on whichever device it lived.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

from torch import Tensor

from lightning_smartinf.core.io.direct import IOEngine, StateFile
from lightning_smartinf.core.io.leftovers import remove_leftovers, temporary_path
from lightning_smartinf.core.io.ownership import check_unclaimed, make_temp_device_dir, remove_stale_temp_dirs
from lightning_smartinf.core.io.storage import create_storage_path, make_private_dirs
from lightning_smartinf.core.renamed import old_names
from lightning_smartinf.core.settings import SmartUpdateSettings

if TYPE_CHECKING:
    from lightning_smartinf.core.backend import ShardSpec

__all__ = [
    "STATE_DIR",
    "Fixed",
    "Placement",
    "RoundRobin",
    "TieredPlacement",
    "by_holder",
    "check_assignment",
    "measure_write_read",
    "memory_share",
    "rank_device_dirs",
    "rank_share",
]

#: The folder of SmartUpdate's device state inside each storage path (one ``rank<NNN>`` folder per rank below it).
STATE_DIR = "smartinf"
log = logging.getLogger(__name__)
T = TypeVar("T")


def by_holder(where: Sequence[tuple[T, int]], shards: Iterable[int]) -> dict[T, list[int]]:
    """``shards`` grouped by what holds each (``where[shard]``: the holder and the shard's index there), in each
    holder's numbering, in order. Holders are keyed by identity (no backend defines ``__eq__``)."""
    grouped: dict[T, list[int]] = {}
    for shard in shards:
        holder, index = where[shard]
        grouped.setdefault(holder, []).append(index)
    return grouped


def rank_share(items: Sequence[T], local_rank: int, ranks_per_node: int) -> list[T]:
    """Local rank ``local_rank``'s share of a node's ``items``: ``items[local_rank::ranks_per_node]``.

    ``ranks_per_node`` below 1 counts as 1 (a strategy not yet told its devices runs one rank). The share is empty
    when there are fewer items than ranks.

    Example::

        >>> rank_share(["a", "b", "c", "d"], local_rank=1, ranks_per_node=2)
        ['b', 'd']
    """
    if local_rank < 0:
        raise ValueError(f"`local_rank={local_rank}` must be >= 0.")
    return list(items[local_rank :: max(1, ranks_per_node)])


def rank_device_dirs(
    settings: SmartUpdateSettings, *, global_rank: int, local_rank: int, ranks_per_node: int
) -> tuple[list[Path], list[Path]]:
    """Create this rank's device directories (0700); return them and those the backend must remove at the end.

    With ``settings.storage_paths=None`` that is one new temporary directory, owned (temporary and scratch
    directories of processes that died are removed first, and logged). Otherwise this rank's storage paths
    (:func:`rank_share`) that do not exist yet are created first (0700; logged), then ``smartinf/rank<global rank>``
    in each, owned by none.

    Raises:
        ValueError: this rank gets no storage path (fewer paths than ranks per node).
        StorageError: a storage path cannot be created, a directory is in use by another training (nothing in it
            was touched), or a component below a storage path is a symbolic link or not a directory.
    """
    if settings.storage_paths is None:
        for stale in remove_stale_temp_dirs():
            log.info(f"SmartUpdate removed {str(stale)!r}, a temporary of a process that died")
        directory = make_temp_device_dir(global_rank)
        return [directory], [directory]
    mine = rank_share(settings.storage_paths, local_rank, ranks_per_node)
    if not mine:
        raise ValueError(
            f"`SmartInfinityStrategy(storage_paths=...)` gives {len(settings.storage_paths)} path(s) to "
            f"{max(1, ranks_per_node)} ranks per node, so ranks would share a storage path. Pass at least "
            "one path per rank (directories on the same disk work, e.g. /mnt/nvme/r0 and /mnt/nvme/r1)."
        )
    for path in mine:
        # Checked when the settings were made (its parent is a writable directory); created only now, by its rank.
        if create_storage_path(path):
            log.info(f"SmartUpdate rank {global_rank} created storage path {str(path)!r} (mode 0700): it did not exist")
    directories = [make_private_dirs(path, (STATE_DIR, f"rank{global_rank:03d}")) for path in mine]
    # Fails before DeepSpeed's set-up; the backend's claim, taken when it is built, is what holds them.
    check_unclaimed(directories)
    return directories, []


class Placement(Protocol):
    """Which device of a backend holds each of its shards; asked once, when the backend opens them."""

    def assign(self, shards: Sequence[ShardSpec], num_devices: int) -> list[int]:
        """The device index (``0 <= i < num_devices``) of each shard, in shard order."""


@dataclass(frozen=True)
class RoundRobin:
    """Shard ``s`` on device ``s mod N``: equal devices get equal shares of equal sub-groups (the paper's layout)."""

    def assign(self, shards: Sequence[ShardSpec], num_devices: int) -> list[int]:
        return [shard.index % num_devices for shard in shards]


@dataclass(frozen=True)
class Fixed:
    """A placement given as its answer: shard ``i`` on device ``assignment[i]`` (a re-plan's, or a split's)."""

    assignment: tuple[int, ...]

    def assign(self, shards: Sequence[ShardSpec], num_devices: int) -> list[int]:
        return list(self.assignment)


def check_assignment(placement: Placement, shards: Sequence[ShardSpec], num_devices: int) -> tuple[int, ...]:
    """``placement``'s assignment of ``shards``, checked: one device index in range per shard.

    Raises:
        ValueError: naming the placement and what is wrong with its answer.
    """
    assignment = tuple(placement.assign(shards, num_devices))
    if len(assignment) != len(shards):
        raise ValueError(f"{placement!r} placed {len(assignment)} shards, but there are {len(shards)}.")
    if bad := [(i, d) for i, d in enumerate(assignment) if isinstance(d, bool) or not 0 <= d < num_devices]:
        raise ValueError(
            f"{placement!r} put shard {bad[0][0]} on device {bad[0][1]!r}; devices are 0..{num_devices - 1}."
        )
    return assignment


@dataclass(frozen=True)
class TieredPlacement:
    """Shards in accelerator memory up to ``accelerator_bytes`` of state, then in host memory up to ``memory_bytes``,
    the others over the storage devices by ``weights``.

    The devices are the storage devices (``len(weights)`` of them, in order), then the memory device when
    ``memory_bytes > 0``, then the accelerator device when ``accelerator_bytes > 0``. The accelerator takes shards in
    index order, skipping any that no longer fit, then memory does the same with the rest: the first sub-groups are
    the last whose gradients backward reduces, so the storage devices get those that can start during backward.
    Each other shard goes to the storage device that would finish its load soonest, its bytes over its weight (ties
    to the lowest index): equal weights and equal shards give round-robin.

    Args:
        weights: relative update throughput of each storage device (positive, finite).
        memory_bytes: bytes of shard state the memory tier may hold (``0``: no memory tier).
        chunk_elems: the backend's chunk size, which fixes each shard's record bytes.
        accelerator_bytes: bytes of shard state the accelerator tier may hold (``0``: no accelerator tier).
        keep: each shard's device now, when re-placing (``()``: none): a storage shard stays where it is when that
            device ties for the soonest finish, so a re-plan moves no more shards than its new shares need.
    """

    weights: tuple[float, ...]
    memory_bytes: int = 0
    chunk_elems: int = 1 << 20
    accelerator_bytes: int = 0
    keep: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.weights or not all(isinstance(w, (int, float)) and 0 < w < math.inf for w in self.weights):
            raise ValueError(f"`weights={self.weights!r}` must be positive, finite numbers, one per storage device.")
        for name in ("memory_bytes", "accelerator_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"`{name}={getattr(self, name)}` must be >= 0.")

    def state_bytes(self, shard: ShardSpec) -> int:
        """Bytes ``shard``'s state takes on any device: its record file."""
        return shard.layout(self.chunk_elems).file_bytes

    def assign(self, shards: Sequence[ShardSpec], num_devices: int) -> list[int]:
        storage = len(self.weights)
        memory, accelerator = self.memory_bytes > 0, self.accelerator_bytes > 0
        if num_devices != storage + memory + accelerator:
            named = "".join((" and host memory" if memory else "", " and accelerator memory" if accelerator else ""))
            raise ValueError(
                f"{self!r} places over {storage} storage device(s){named}, but the backend has {num_devices} devices."
            )
        sizes = [self.state_bytes(shard) for shard in shards]
        assignment = [-1] * len(shards)
        # The fastest tier first: each takes what fits of what is left, in index order.
        tiers = [(storage + memory, self.accelerator_bytes)] if accelerator else []
        tiers += [(storage, self.memory_bytes)] if memory else []
        for device, room in tiers:
            for i, size in enumerate(sizes):
                if assignment[i] < 0 and size <= room:
                    assignment[i] = device
                    room -= size
        load = [0] * storage
        keep = self.keep or (-1,) * len(shards)
        for i, size in enumerate(sizes):
            if assignment[i] < 0:
                best = min(range(storage), key=lambda d: ((load[d] + size) / self.weights[d], d != keep[i], d))
                assignment[i] = best
                load[best] += size
        return assignment


def memory_share(budget: float, state: float, memory_rate: float, storage_rate: float) -> float:
    """Bytes of ``state`` the memory tier holds when devices compute beside it: at most ``budget``, and no more than
    lets it finish with them. Memory holding ``x`` finishes in ``x / memory_rate``, the devices the rest in
    ``(state - x) / storage_rate`` (state bytes per second), together at ``x = state * m / (m + s)``.

    Example::

        >>> memory_share(budget=6, state=10, memory_rate=9.0, storage_rate=1.0)  # memory is fast: fill the budget
        6
        >>> memory_share(budget=10, state=10, memory_rate=1.0, storage_rate=3.0)  # fast devices: memory takes 1/4
        2.5
    """
    if budget <= 0 or state <= 0:
        return 0
    return min(budget, state * memory_rate / (memory_rate + storage_rate))


#: What the speed probe's file stands for (named by :func:`temporary_path`, so a killed probe's is a leftover).
SPEED_PROBE = "smartinf-speed-probe"


def measure_write_read(directory: Path, io: IOEngine, nbytes: int = 64 << 20, *, in_flight: int = 3) -> float:
    """Bytes per second ``io`` writes then reads back ``nbytes`` in ``directory`` as a device streams: 4 MiB records,
    ``in_flight`` at a time (a probe file, removed after).

    A device's update streams every record in and out once, so this one figure ranks devices by update throughput.
    A path that cannot take the probe (full) counts as 1 B/s: it gets the fewest shards, and its own free-space check
    explains itself when the shards are placed.
    """
    record = 4 << 20
    offsets = range(0, max(record, nbytes // record * record), record)
    remove_leftovers(directory, SPEED_PROBE)  # the probe files of processes killed while they measured
    path = temporary_path(directory / SPEED_PROBE)
    buffers = [io.empty(record) for _ in range(in_flight)]
    for buf in buffers:
        buf.fill_(1)
    try:
        file = StateFile(path, len(offsets) * record, create=True)
    except OSError as exc:
        path.unlink(missing_ok=True)  # a probe a full disk refused keeps the blocks it did get otherwise
        log.warning(f"SmartUpdate could not measure storage path {str(directory)!r} ({exc}); it gets the fewest shards")
        return 1.0
    try:
        with ThreadPoolExecutor(in_flight, thread_name_prefix="csd-probe") as pool:
            started = time.perf_counter()
            for transfer in (io.write, io.read):
                # Each thread moves its own records through its own buffer.
                work = [
                    pool.submit(_transfer_records, transfer, file, buffers[t], offsets[t::in_flight])
                    for t in range(in_flight)
                ]
                for future in work:
                    future.result()
            seconds = time.perf_counter() - started
    finally:
        file.close()
        path.unlink(missing_ok=True)
    return 2 * len(offsets) * record / max(seconds, 1e-9)


def _transfer_records(
    transfer: Callable[[StateFile, Tensor, int], None], file: StateFile, buf: Tensor, offsets: range
) -> None:
    """``transfer`` one record of ``file`` through ``buf`` at each of ``offsets``, in order."""
    for offset in offsets:
        transfer(file, buf, offset)


#: Renamed; the old name still resolves, with a ``DeprecationWarning``.
__getattr__ = old_names(__name__, {"Tiered": "TieredPlacement"})
