"""Loading device state saved under another layout: another number of ranks, ``sub_group_size`` or ``chunk_size``.

Every rank's ``host_state.json`` lists, per shard, the parameter partitions the shard holds in order (name, shape,
``partition_numel``); rank ``r`` of ``W`` holds elements ``[r * P, (r + 1) * P)`` of each flattened parameter, with
``P = ceil(numel / W)`` and the last rank's tail padding. So each element of this run's shards (its own partitions
under its own sub-groups) has exactly one place in the saved shard files, whatever the saved layout was:
:func:`plan_reshard` maps this run's shards to runs of saved elements (:class:`Piece`), and :meth:`Reshard.write`
builds each live shard file record by record from them, every state of the update rule alike. Masters and moments
move as bytes: nothing is summed, so the state after the load is bit for bit the saved state.

Invariants:

- Every saved file a piece reads is checked against its manifest (size and checksum) before any live file is
  written; a rank's host state must list the same parameters with the same shapes as this run's model.
- Elements past a parameter's end (the last rank's padding) hold 0 as master and each state's initial value, as a
  fresh run's do; they never reach a parameter.
- Nothing is held in memory beyond one chunk record and the pieces of one shard.
- A state the saved rule lacks starts at the rule's initial value (as :func:`~.state_files.convert_state_file`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

from lightning_smartinf.core.format.layout import ChunkLayout
from lightning_smartinf.core.format.rank_state import HOST_STATE, PartitionIndex
from lightning_smartinf.core.format.state_files import (
    MANIFEST,
    CheckpointError,
    ShardState,
    read_json,
    read_manifest,
    require_state_files,
    saved_layout,
    shard_file_name,
    verify_state_file,
)
from lightning_smartinf.core.progress import Progress

__all__ = ["Fetch", "Piece", "Reshard", "SavedRank", "plan_reshard", "same_layout"]


@dataclass(frozen=True)
class Piece:
    """Elements ``[dest, dest + count)`` of a live shard are elements ``[src, src + count)`` of saved shard ``shard``
    of saved rank ``rank``."""

    dest: int
    rank: int
    shard: int
    src: int
    count: int


@dataclass
class SavedRank:
    """One saved rank's device state: where each parameter's partition lies in its shard files."""

    directory: Path
    #: Where each parameter's partition lies in the rank's shards, and its whole shape.
    partitions: PartitionIndex
    layouts: list[ChunkLayout] = field(default_factory=list)
    entries: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def read(cls, directory: Path, rank: int, world_size: int) -> SavedRank:
        directory = Path(directory)
        host = read_json(directory / HOST_STATE, "the device state", ("rank", "world_size", "shards"))
        if (host.get("rank"), host.get("world_size")) != (rank, world_size):
            raise CheckpointError(
                f"{directory / HOST_STATE} belongs to rank {host.get('rank')} of {host.get('world_size')}, not rank "
                f"{rank} of {world_size}: the checkpoint's ranks come from different saves."
            )
        require_state_files(directory)
        try:
            manifest = read_manifest(directory)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
        entries = {int(e["index"]): e for e in manifest["shards"]}
        saved = cls(directory, PartitionIndex.of(host["shards"]))
        chunk = int(manifest["chunk_elems"])
        for index, covered in enumerate(saved.partitions.numels):
            entry = entries.get(index)
            if entry is None:
                raise CheckpointError(f"{directory / MANIFEST} has no shard {index}; its host state lists it.")
            saved.entries.append(entry)
            saved.layouts.append(saved_layout(entry, chunk))
            if covered != int(entry["numel"]):
                raise CheckpointError(
                    f"{directory / shard_file_name(index)}: its parameters cover {covered} elements, the manifest "
                    f"says the shard holds {entry['numel']}."
                )
        return saved


def same_layout(saved: Mapping[str, Any], layout: Sequence[Sequence[Mapping[str, Any]]], rank: int, world: int) -> bool:
    """Whether a rank's saved host state has this run's shards exactly (then its files load as they are)."""
    return (saved.get("rank"), saved.get("world_size")) == (rank, world) and _plain(saved.get("shards")) == _plain(
        layout
    )


def _plain(shards: Any) -> Any:
    if not isinstance(shards, (list, tuple)):
        return shards
    return [
        [{"name": p["name"], "shape": [int(n) for n in p["shape"]], "partition_numel": int(p["partition_numel"])}
         for p in params]
        for params in shards
    ]  # fmt: skip


def plan_reshard(
    saved: Sequence[SavedRank], layout: Sequence[Sequence[Mapping[str, Any]]], rank: int, world_size: int
) -> list[list[Piece]]:
    """Per shard of this run (``layout``: its parameters per shard, as the controller lists them), the saved
    elements that fill it, in order. Raises :class:`CheckpointError` naming a parameter the checkpoint lacks or
    holds with another shape."""
    old_world = len(saved)
    shapes: dict[str, list[int]] = {}
    for r in saved:
        for name, shape in r.partitions.shapes.items():
            shapes.setdefault(name, list(shape))
    plan: list[list[Piece]] = []
    for params in layout:
        pieces: list[Piece] = []
        base = 0
        for param in params:
            name, shape, new_p = param["name"], [int(n) for n in param["shape"]], int(param["partition_numel"])
            if name not in shapes:
                raise CheckpointError(
                    f"The checkpoint holds no optimizer state for parameter {name!r} of this model. Resume with the "
                    "model it was saved with."
                )
            if shapes[name] != shape:
                raise CheckpointError(
                    f"The checkpoint holds parameter {name!r} with shape {shapes[name]}, this model's is {shape}. "
                    "Resume with the model it was saved with."
                )
            numel = math.prod(shape)
            old_p = -(-numel // old_world)
            low, high = rank * new_p, min((rank + 1) * new_p, numel)  # this rank's real elements of the parameter
            for r in range(low // old_p, min(old_world, -(-high // old_p))) if low < high else ():
                a, b = max(low, r * old_p), min(high, (r + 1) * old_p)
                if name not in saved[r].partitions.where:
                    raise CheckpointError(
                        f"{saved[r].directory / HOST_STATE} lists no partition of parameter {name!r}; the checkpoint "
                        "is incomplete or comes from another model."
                    )
                shard, offset, held = saved[r].partitions.where[name]
                if held != old_p:
                    raise CheckpointError(
                        f"{saved[r].directory / HOST_STATE} holds {held} elements of {name!r}, a partition over "
                        f"{old_world} ranks has {old_p}."
                    )
                pieces.append(Piece(base + a - low, r, shard, offset + a - r * old_p, b - a))
            base += new_p
        plan.append(pieces)
    return plan


#: Writes saved shard ``index`` of saved rank ``rank`` to ``path``, for state files kept elsewhere (remote servers).
Fetch = Callable[[int, int, Path], None]


@dataclass
class Reshard:
    """This run's shards filled from a checkpoint saved under another layout (see the module docstring).

    ``fetch``: where the saved ranks' directories hold manifests but not yet the state files (their devices kept
    them), brings each file the plan reads to its place before it is verified and read.
    """

    saved: list[SavedRank]
    plan: list[list[Piece]]
    fetch: Fetch | None = None
    #: The saved record read last in a format other than fp32, unpacked: ``((file, chunk), tensors)``.
    _last_unpacked: tuple[tuple[str, int], list[torch.Tensor]] | None = None

    @classmethod
    def of(
        cls,
        rank_dirs: Sequence[Path],
        layout: Sequence[Sequence[Mapping[str, Any]]],
        rank: int,
        world_size: int,
        *,
        fetch: Fetch | None = None,
    ) -> Reshard:
        """The plan for this rank (``rank`` of ``world_size``, shards ``layout``) from the saved ranks' directories."""
        saved = [SavedRank.read(directory, r, len(rank_dirs)) for r, directory in enumerate(rank_dirs)]
        return cls(saved, plan_reshard(saved, layout, rank, world_size), fetch)

    def only(self, shards: Sequence[int]) -> Reshard:
        """The plan of this run's ``shards`` alone, in that order (for a backend that holds those)."""
        return Reshard(self.saved, [self.plan[i] for i in shards], self.fetch)

    def describe(self) -> str:
        """What is loaded from where, for a log line."""
        first = self.saved[0]
        return (
            f"{len(self.saved)} rank(s), {sum(len(r.layouts) for r in self.saved)} shard(s) of chunk "
            f"{first.layouts[0].chunk_elems if first.layouts else '-'} elements"
        )

    def write(self, shards: Sequence[ShardState], *, then: Callable[[ShardState], None] | None = None) -> None:
        """Verify every saved file the plan reads, then rewrite each of ``shards``' files from the pieces (created if
        missing), calling ``then(shard)`` after each (a caller that sends each file elsewhere keeps one at a time)."""
        if len(shards) != len(self.plan):
            raise CheckpointError(f"The plan fills {len(self.plan)} shards, this run has {len(shards)}.")
        for shard, pieces in zip(shards, self.plan):
            expected = sum(p.count for p in pieces)
            if expected > shard.spec.numel:
                raise CheckpointError(
                    f"Shard {shard.spec.index} holds {shard.spec.numel} elements, the plan {expected}."
                )
        needed = sorted({(p.rank, p.shard) for pieces in self.plan for p in pieces})
        for rank, index in needed:
            saved = self.saved[rank]
            path = saved.directory / shard_file_name(index)
            if self.fetch is not None and not path.exists():
                self.fetch(rank, index, path)
            try:
                verify_state_file(path, saved.entries[index])
            except ValueError as exc:
                raise CheckpointError(str(exc)) from None
        files: dict[tuple[int, int], BinaryIO] = {}
        total = sum(s.layout.file_bytes for s in shards)
        try:
            with Progress("re-sharding the optimizer state", total, per_rank=True) as progress:
                for shard, pieces in zip(shards, self.plan):
                    self._write_shard(shard, pieces, files)
                    if then is not None:
                        then(shard)
                    progress.update(shard.layout.file_bytes)
        finally:
            for f in files.values():
                f.close()

    def _unpacked(self, source: BinaryIO, layout: ChunkLayout, k: int, states: list[str]) -> list[torch.Tensor]:
        """Saved record ``k`` of ``source`` as fp32 tensors (the last one read is kept: pieces go through in order)."""
        key = (source.name, k)
        if self._last_unpacked is None or self._last_unpacked[0] != key:
            raw = torch.empty(layout.record_bytes(k), dtype=torch.uint8)
            source.seek(layout.record_offset(k))
            if source.readinto(memoryview(raw.numpy())) != raw.numel():
                raise CheckpointError(f"{source.name} ended early in chunk {k}.")
            self._last_unpacked = (key, layout.unpack(raw, k, states))
        return self._last_unpacked[1]

    def _write_shard(self, shard: ShardState, pieces: list[Piece], files: dict[tuple[int, int], BinaryIO]) -> None:
        rule, layout = shard.spec.rule, shard.layout
        names = list(rule.state_names)
        pieces = sorted(pieces, key=lambda p: p.dest)
        first = 0
        with open(os.open(shard.path, os.O_RDWR | os.O_CREAT, 0o600), "r+b", buffering=0) as out:
            out.truncate(layout.file_bytes)
            for k in range(layout.num_chunks):
                start, n = layout.chunk_range(k)
                record = torch.zeros(layout.tensors_per_record, layout.padded_len(k), dtype=torch.float32)
                for i, name in enumerate(names, start=1):
                    record[i, :n] = rule.initial_state_value(name)
                while first < len(pieces) and pieces[first].dest + pieces[first].count <= start:
                    first += 1
                for piece in pieces[first:]:
                    if piece.dest >= start + n:
                        break
                    low, high = max(piece.dest, start), min(piece.dest + piece.count, start + n)
                    self._fill(record, low - start, high - low, piece, piece.src + low - piece.dest, names, files)
                params = None if shard.params is None else shard.params[start : start + n]
                out.seek(layout.record_offset(k))
                out.write(memoryview(layout.pack(list(record), k, names, params_out=params).numpy()).cast("B"))

    def _fill(
        self,
        record: torch.Tensor,
        at: int,
        count: int,
        piece: Piece,
        src: int,
        names: list[str],
        files: dict[tuple[int, int], BinaryIO],
    ) -> None:
        """Copy ``count`` saved elements from ``src`` of the piece's shard into ``record[:, at:]``, every tensor."""
        saved = self.saved[piece.rank]
        layout, states = saved.layouts[piece.shard], list(saved.entries[piece.shard]["states"])
        if (piece.rank, piece.shard) not in files:  # opened once, closed by `write`
            files[(piece.rank, piece.shard)] = open(saved.directory / shard_file_name(piece.shard), "rb", buffering=0)  # noqa: SIM115
        source = files[(piece.rank, piece.shard)]
        # (row in this run's record, row in the saved record): the master, then the states both rules have.
        rows = [(0, 0)] + [(i, 1 + states.index(name)) for i, name in enumerate(names, start=1) if name in states]
        done = 0
        while done < count:
            element = src + done
            k = element // layout.chunk_elems
            first, n = layout.chunk_range(k)
            run = min(count - done, first + n - element)
            padded = layout.padded_len(k)
            if layout.state_format != "fp32":  # the saved record, whole, read in its format
                saved_record = self._unpacked(source, layout, k, states)
                for row, saved_row in rows:
                    record[row, at + done : at + done + run] = saved_record[saved_row][element - first :][:run]
                done += run
                continue
            for row, saved_row in rows:
                target = record[row, at + done : at + done + run]
                source.seek(layout.record_offset(k) + (saved_row * padded + element - first) * 4)
                view = memoryview(target.numpy()).cast("B")
                if source.readinto(view) != run * 4:
                    raise CheckpointError(f"{source.name} ended early in chunk {k}.")
            done += run
