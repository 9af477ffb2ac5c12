"""Placement: which storage paths and XRT devices a rank drives, the device directories it keeps there, and which
of its devices holds each shard.

The paths (and XRT devices) given to a node are shared out among its ranks by one rule, :func:`rank_share`: local
rank ``r`` of ``n`` takes every ``n``-th entry from ``r``. A rank's device directories are
``<storage path>/smartinf/rank<global rank>``, so ranks of different nodes that share a filesystem never meet.
Within a rank, a :class:`Placement` assigns shards to devices when the backend opens them (:class:`RoundRobin` by
default). Checkpoints do not depend on it: a shard's saved record is the same on whichever device it lived.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

from lightning_smartinf.csd.ownership import check_unclaimed, make_temp_device_dir, remove_stale_temp_dirs
from lightning_smartinf.csd.settings import SmartUpdateSettings
from lightning_smartinf.csd.storage import create_storage_path, make_private_dirs

if TYPE_CHECKING:
    from lightning_smartinf.csd.backend import ShardSpec

__all__ = ["STATE_DIR", "Placement", "RoundRobin", "check_assignment", "rank_device_dirs", "rank_share"]

#: The folder of SmartUpdate's device state inside each storage path (one ``rank<NNN>`` folder per rank below it).
STATE_DIR = "smartinf"
log = logging.getLogger(__name__)
T = TypeVar("T")


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

    With ``settings.storage_paths=None`` that is one new temporary directory, owned (temporary directories of runs
    that died are removed first, and logged). Otherwise this rank's storage paths (:func:`rank_share`) that do not
    exist yet are created first (0700; logged), then ``smartinf/rank<global rank>`` in each, owned by none.

    Raises:
        ValueError: this rank gets no storage path (fewer paths than ranks per node).
        StorageError: a storage path cannot be created, a directory is in use by another training (nothing in it
            was touched), or a component below a storage path is a symbolic link or not a directory.
    """
    if settings.storage_paths is None:
        for stale in remove_stale_temp_dirs():
            log.info(f"SmartUpdate removed {str(stale)!r}, the temporary device directory of a run that died")
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
