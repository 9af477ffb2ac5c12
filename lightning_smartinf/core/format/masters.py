"""Full fp32 parameters from the device state of every rank of a checkpoint: what export and evaluation read.

Each rank's ``host_state.json`` lists, per shard, the parameter partitions the shard holds in order; the masters are
the first tensor of every chunk record of its shard files (:func:`~.state_files.read_shard_masters`, checked
against the manifest), or come from wherever the rank's device kind kept them (a :data:`MastersReader`). Rank ``r``
holds elements ``[r * partition_numel, (r + 1) * partition_numel)`` of each flattened parameter, the last padded.

:func:`saved_masters` reads them a few parameters at a time (:class:`Weights`), so an export holds one file's worth.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from lightning_smartinf.core.format.layout import ChunkLayout
from lightning_smartinf.core.format.rank_state import HOST_STATE, PartitionIndex, full_parameter
from lightning_smartinf.core.format.state_files import (
    MANIFEST,
    read_json,
    read_manifest,
    read_shard_masters,
    saved_layout,
    shard_file_name,
    verify_state_file,
)

__all__ = ["MastersReader", "Weights", "saved_masters"]

#: Reads the fp32 masters of every shard of one rank's device state kept elsewhere than its shard files (on remote
#: servers), by shard index, from the rank's device-state directory.
MastersReader = Callable[[Path], list[Tensor]]


@dataclass(frozen=True)
class Weights:
    """Full fp32 weights by name, read a few at a time: what export writes one file at a time from.

    ``read(names)`` yields ``(name, tensor)`` for each of ``names`` (in any order), each tensor made when it is
    yielded: a consumer that drops each one holds a single parameter of the source's making at a time.
    """

    #: Every weight's shape, by name, in the source's order.
    shapes: Mapping[str, tuple[int, ...]]
    read: Callable[[Sequence[str]], Iterator[tuple[str, Tensor]]]

    @classmethod
    def of(cls, state: Mapping[str, Tensor]) -> Weights:
        """The weights of an in-memory state dict (each read is a copy, as a source's fresh tensor is)."""
        return cls(
            {name: tuple(tensor.shape) for name, tensor in state.items()},
            lambda names: ((name, state[name].detach().clone()) for name in names),
        )

    def all(self) -> dict[str, Tensor]:
        """Every weight, in the order of :attr:`shapes`."""
        names = list(self.shapes)
        values = dict(self.read(names))
        return {name: values[name] for name in names}

    def under(self, prefix: str) -> Weights:
        """The weights whose names start with ``prefix``, named without it."""
        shapes = {name[len(prefix) :]: shape for name, shape in self.shapes.items() if name.startswith(prefix)}

        def read(names: Sequence[str]) -> Iterator[tuple[str, Tensor]]:
            for name, tensor in self.read([prefix + name for name in names]):
                yield name[len(prefix) :], tensor

        return Weights(shapes, read)

    def joined(self, other: Weights) -> Weights:
        """These weights and those of ``other`` these lack."""
        added = {name: shape for name, shape in other.shapes.items() if name not in self.shapes}

        def read(names: Sequence[str]) -> Iterator[tuple[str, Tensor]]:
            yield from self.read([name for name in names if name not in added])
            yield from other.read([name for name in names if name in added])

        return Weights({**self.shapes, **added}, read)


class _RankMasters:
    """One rank's saved masters, shard by shard: ranges read from its shard files, or held whole when they come
    from ``elsewhere`` (the only way to get them there)."""

    def __init__(
        self,
        directory: Path,
        shards: int,
        *,
        verify: bool,
        elsewhere: MastersReader | None,
        checked: Callable[[int], None] | None = None,
    ) -> None:
        self.directory = directory
        self.held: list[Tensor] = []
        self.layouts: list[ChunkLayout] = []
        if not (directory / MANIFEST).is_file():
            if elsewhere is None:
                raise ValueError(
                    f"{directory} holds no {MANIFEST}: the device state was kept on the devices (remote device "
                    "servers) and must be read through them (evaluate with the strategy's settings for those "
                    "devices, or on other devices with `saved_state_from={'backend': 'remote', 'remote_devices': "
                    "[...], 'remote_token_file': ...}`; export with `smartinf export --remote-devices HOST:PORT ... "
                    "--remote-token-file FILE`), or the checkpoint is incomplete."
                )
            self.held = elsewhere(directory)
            if len(self.held) != shards:
                raise ValueError(f"{directory}: host state lists {shards} shards, the devices hold {len(self.held)}.")
            self.numels = [master.numel() for master in self.held]
            return
        manifest = read_manifest(directory)
        if len(manifest["shards"]) != shards:
            raise ValueError(f"{directory}: host state lists {shards} shards, the manifest {len(manifest['shards'])}.")
        entries = {int(e["index"]): e for e in manifest["shards"]}
        for index in range(shards):
            if index not in entries:
                raise ValueError(f"{directory / MANIFEST} has no shard {index}.")
            entry = entries[index]
            if verify:
                verify_state_file(directory / shard_file_name(index), entry)
                if checked is not None:
                    checked(int(entry["bytes"]))
            self.layouts.append(saved_layout(entry, int(manifest["chunk_elems"])))
        self.numels = [layout.numel for layout in self.layouts]

    def read(self, shard: int, offset: int, numel: int) -> Tensor:
        """Elements ``[offset, offset + numel)`` of shard ``shard``'s masters (a view of a held shard)."""
        if self.held:
            return self.held[shard][offset : offset + numel]
        return read_shard_masters(self.directory / shard_file_name(shard), self.layouts[shard], offset, numel)


def saved_masters(
    rank_dirs: Sequence[Path],
    *,
    verify: bool = True,
    elsewhere: MastersReader | None = None,
    checked: Callable[[int], None] | None = None,
) -> Weights:
    """The fp32 master weights of every trainable parameter, by name, from each rank's device-state directory (in
    rank order), read a parameter at a time: only the elements of its partitions, from the chunk records they are in.

    ``verify``: check every shard file's size and CRC-32 against its manifest first; ``checked(nbytes)`` is called
    after each file (its size: all of it was read). A rank whose state was kept on its devices is read whole through
    ``elsewhere`` and held (remote servers send a rank's masters at once).
    """
    size = len(rank_dirs)
    ranks: list[_RankMasters] = []
    where: list[dict[str, tuple[int, int, int]]] = []  # per rank: name -> (shard, offset, numel)
    shapes: dict[str, tuple[int, ...]] = {}
    for rank, directory in enumerate(map(Path, rank_dirs)):
        host = read_json(directory / HOST_STATE, "the device state", ("rank", "world_size", "shards"))
        if host.get("world_size") != size or host.get("rank") != rank:
            raise ValueError(
                f"{directory / HOST_STATE} belongs to rank {host.get('rank')} of {host.get('world_size')}."
            )
        ranks.append(_RankMasters(directory, len(host["shards"]), verify=verify, elsewhere=elsewhere, checked=checked))
        index = PartitionIndex.of(host["shards"])
        where.append(index.where)
        for name, shape in index.shapes.items():
            shapes.setdefault(name, shape)
        for shard, (covered, held) in enumerate(zip(index.numels, ranks[rank].numels)):
            if covered != held:
                raise ValueError(
                    f"{directory / shard_file_name(shard)}: its parameters cover {covered} elements, the shard holds "
                    f"{held}."
                )
    for name in shapes:
        missing = [rank for rank in range(size) if name not in where[rank]]
        if missing:
            raise ValueError(f"Parameter {name!r} has no partition on rank(s) {missing} of the checkpoint.")

    def read(names: Sequence[str]) -> Iterator[tuple[str, Tensor]]:
        for name in names:  # the partitions are gone once joined: one parameter's worth at a time
            yield name, full_parameter(name, [ranks[r].read(*where[r][name]) for r in range(size)], shapes[name])

    return Weights(shapes, read)
