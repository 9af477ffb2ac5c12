"""Full fp32 parameters from the device state of every rank of a checkpoint: what export and evaluation read.

Each rank's ``host_state.json`` lists, per shard, the parameter partitions the shard holds in order; the masters are
the first tensor of every chunk record of its shard files (:func:`~.state_files.saved_shard_masters`, checked
against the manifest), or come from wherever the rank's device kind kept them (a :data:`MastersReader`). Rank ``r``
holds elements ``[r * partition_numel, (r + 1) * partition_numel)`` of each flattened parameter, the last padded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from torch import Tensor

from lightning_smartinf.core.format.rank_state import HOST_STATE, full_parameter, param_partitions
from lightning_smartinf.core.format.state_files import (
    MANIFEST,
    read_json,
    read_manifest,
    saved_shard_masters,
    shard_file_name,
)

__all__ = ["MastersReader", "consolidate_masters", "host_state", "rank_masters"]

#: Reads the fp32 masters of every shard of one rank's device state kept elsewhere than its shard files (on remote
#: servers), by shard index, from the rank's device-state directory.
MastersReader = Callable[[Path], list[Tensor]]


def host_state(directory: Path) -> dict:
    """One rank's ``host_state.json``: which parameter partitions each of its shards holds."""
    return read_json(Path(directory) / HOST_STATE, "the device state", ("rank", "world_size", "shards"))


def rank_masters(directory: Path, shards: int, *, verify: bool, elsewhere: MastersReader | None) -> list[Tensor]:
    """The fp32 masters of each of one rank's ``shards``: from its shard files, or through ``elsewhere`` where the
    directory holds no shard files (no manifest: the state was kept on the rank's devices, e.g. remote servers)."""
    if not (Path(directory) / MANIFEST).is_file():
        if elsewhere is None:
            raise ValueError(
                f"{directory} holds no {MANIFEST}: the device state was kept on the devices (remote device servers) "
                "and must be read through them (evaluate with the strategy's settings for those devices, or "
                "`smartinf export --remote-devices HOST:PORT ... --remote-token-file FILE`), or the checkpoint is "
                "incomplete."
            )
        masters = elsewhere(directory)
    else:
        manifest = read_manifest(directory)
        if len(manifest["shards"]) != shards:
            raise ValueError(f"{directory}: host state lists {shards} shards, the manifest {len(manifest['shards'])}.")
        masters = [saved_shard_masters(directory, i, verify=verify, manifest=manifest) for i in range(shards)]
    if len(masters) != shards:
        raise ValueError(f"{directory}: host state lists {shards} shards, the devices hold {len(masters)}.")
    return masters


def consolidate_masters(
    rank_dirs: Sequence[Path], *, verify: bool = True, elsewhere: MastersReader | None = None
) -> dict[str, Tensor]:
    """Full fp32 master weights of every trainable parameter, by name, from each rank's device-state directory (in
    rank order). ``verify``: check every shard file's size and CRC-32 against its manifest first."""
    size = len(rank_dirs)
    pieces: dict[str, list[Tensor | None]] = {}
    shapes: dict[str, list[int]] = {}
    for rank, directory in enumerate(rank_dirs):
        host = host_state(directory)
        if host.get("world_size") != size or host.get("rank") != rank:
            raise ValueError(
                f"{Path(directory) / HOST_STATE} belongs to rank {host.get('rank')} of {host.get('world_size')}."
            )
        masters = rank_masters(directory, len(host["shards"]), verify=verify, elsewhere=elsewhere)
        for index, params in enumerate(host["shards"]):
            try:
                for param, part in param_partitions(params, masters[index]):
                    pieces.setdefault(param["name"], [None] * size)[rank] = part
                    shapes.setdefault(param["name"], list(param["shape"]))
            except ValueError as exc:
                raise ValueError(f"{Path(directory) / shard_file_name(index)}: {exc}") from None
    state: dict[str, Tensor] = {}
    for name, slots in pieces.items():
        missing = [r for r, t in enumerate(slots) if t is None]
        if missing:
            raise ValueError(f"Parameter {name!r} has no partition on rank(s) {missing} of the checkpoint.")
        state[name] = full_parameter(name, [t for t in slots if t is not None], shapes[name])
    return state
