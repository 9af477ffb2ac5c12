"""Device state saved under one layout, loaded under another: ranks, ``sub_group_size`` and ``chunk_size`` changed.

The saved checkpoints are written here the way ZeRO-3 partitions parameters (rank ``r`` of ``W`` holds elements
``[r * P, (r + 1) * P)`` of each flattened parameter, ``P = ceil(numel / W)``, zero padding; sub-groups filled in
parameter order up to ``sub_group_size``), from full master and moment tensors; after re-sharding, every live
record must hold exactly the elements that partitioning gives under the new layout.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from lightning_smartinf.core.backend import ShardSpec
from lightning_smartinf.core.format.layout import ChunkLayout
from lightning_smartinf.core.format.rank_state import HOST_STATE
from lightning_smartinf.core.format.reshard import Reshard, same_layout
from lightning_smartinf.core.format.state_files import (
    FORMAT,
    MANIFEST,
    CheckpointError,
    ShardState,
    shard_file_name,
)
from lightning_smartinf.core.io.checksum import CRC32C, file_checksum
from lightning_smartinf.core.rules import SGD, Adam

SHAPES = {"embed": (50, 8), "a.weight": (37,), "b.weight": (5, 7), "c.bias": (3,), "d.weight": (1000,)}
STATES = ("master", "exp_avg", "exp_avg_sq")


def full_tensors(seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: {state: torch.randn(math.prod(shape), generator=generator) for state in STATES}
        for name, shape in SHAPES.items()
    }


def partition(flat: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    size = -(-flat.numel() // world)
    padded = torch.zeros(size * world)
    padded[: flat.numel()] = flat
    return padded[rank * size : (rank + 1) * size]


def layout_of(rank: int, world: int, sub_group: int) -> list[list[dict]]:
    """Per shard, its parameters (name, shape, partition_numel), sub-groups filled as ZeRO-3 fills them."""
    shards: list[list[dict]] = [[]]
    held = 0
    for name, shape in SHAPES.items():
        numel = -(-math.prod(shape) // world)
        if held >= sub_group:
            shards.append([])
            held = 0
        shards[-1].append({"name": name, "shape": list(shape), "partition_numel": numel})
        held += numel
    return shards


def records(tensors: list[torch.Tensor], chunk: int) -> bytes:
    """A shard file's bytes: chunk records ``[t0 | t1 | ...]``, each part padded (see ``ChunkLayout``)."""
    layout = ChunkLayout(tensors[0].numel(), chunk, len(tensors) - 1)
    out = bytearray(layout.file_bytes)
    for k in range(layout.num_chunks):
        start, n = layout.chunk_range(k)
        record = torch.zeros(len(tensors), layout.padded_len(k))
        for i, t in enumerate(tensors):
            record[i, :n] = t[start : start + n]
        offset = layout.record_offset(k)
        out[offset : offset + layout.record_bytes(k)] = record.numpy().tobytes()
    return bytes(out)


def expected_shards(full, rank: int, world: int, sub_group: int) -> list[list[torch.Tensor]]:
    return [
        [torch.cat([partition(full[p["name"]][state], rank, world) for p in params]) for state in STATES]
        for params in layout_of(rank, world, sub_group)
    ]


def save_checkpoint(root: Path, full, world: int, sub_group: int, chunk: int) -> list[Path]:
    dirs = []
    for rank in range(world):
        directory = root / f"rank{rank:03d}"
        directory.mkdir(parents=True)
        entries = []
        for index, tensors in enumerate(expected_shards(full, rank, world, sub_group)):
            path = directory / shard_file_name(index)
            path.write_bytes(records(tensors, chunk))
            entries.append(
                {"index": index, "numel": tensors[0].numel(), "rule": "adam", "states": list(STATES[1:]),
                 "bytes": path.stat().st_size, CRC32C: file_checksum(path)[1]}
            )  # fmt: skip
        manifest = {"format": FORMAT, "chunk_elems": chunk, "shards": entries}
        (directory / MANIFEST).write_text(json.dumps(manifest))
        host = {"rank": rank, "world_size": world, "shards": layout_of(rank, world, sub_group)}
        (directory / HOST_STATE).write_text(json.dumps(host))
        dirs.append(directory)
    return dirs


def live_shards(directory: Path, rank: int, world: int, sub_group: int, chunk: int, rule=None) -> list[ShardState]:
    directory.mkdir(parents=True, exist_ok=True)
    shards = []
    for index, params in enumerate(layout_of(rank, world, sub_group)):
        numel = sum(p["partition_numel"] for p in params)
        spec = ShardSpec(index, numel, rule or Adam())
        layout = ChunkLayout(numel, chunk, len(spec.rule.state_names))
        path = directory / shard_file_name(index)
        path.write_bytes(b"\x7f" * layout.file_bytes)  # state the load must replace
        shards.append(ShardState(spec, layout, path))
    return shards


def read_records(shard: ShardState) -> list[torch.Tensor]:
    layout, data = shard.layout, shard.path.read_bytes()
    parts = [[] for _ in range(layout.tensors_per_record)]
    for k in range(layout.num_chunks):
        _, n = layout.chunk_range(k)
        offset = layout.record_offset(k)
        record = torch.frombuffer(bytearray(data[offset : offset + layout.record_bytes(k)]), dtype=torch.float32)
        record = record.view(layout.tensors_per_record, layout.padded_len(k))
        for i in range(layout.tensors_per_record):
            parts[i].append(record[i, :n])
            assert not record[i, n:].any(), "record padding is zero"
    return [torch.cat(p) for p in parts]


# (saved world, sub-group, chunk) -> (loaded world, sub-group, chunk)
CHANGES = {
    "sub_group_size": ((1, 200, 1024), (1, 60, 1024)),
    "chunk_size": ((1, 200, 1024), (1, 200, 2048)),
    "ranks 2 to 1": ((2, 100, 1024), (1, 100, 1024)),
    "ranks 1 to 4": ((1, 100, 1024), (4, 30, 1024)),
    "ranks 2 to 4 and all else": ((2, 40, 1024), (4, 500, 2048)),
    "ranks 4 to 3": ((4, 30, 1024), (3, 80, 1024)),
}


@pytest.mark.parametrize("change", CHANGES)
def test_every_element_lands_where_the_new_layout_puts_it(tmp_path, change) -> None:
    (old_world, old_group, old_chunk), (world, group, chunk) = CHANGES[change]
    full = full_tensors()
    dirs = save_checkpoint(tmp_path / "ckpt", full, old_world, old_group, old_chunk)
    for rank in range(world):
        layout = layout_of(rank, world, group)
        saved_host = json.loads((dirs[0] / HOST_STATE).read_text())
        assert same_layout(saved_host, layout, rank, world) == (change == "chunk_size")  # then only the records differ
        shards = live_shards(tmp_path / f"live{rank}", rank, world, group, chunk)
        Reshard.of(dirs, layout, rank, world).write(shards)
        for shard, want in zip(shards, expected_shards(full, rank, world, group)):
            got = read_records(shard)
            for state, a, b in zip(STATES, got, want):
                assert torch.equal(a, b), f"rank {rank}, shard {shard.spec.index}, {state}"


def test_a_state_the_saved_rule_lacks_starts_at_its_initial_value(tmp_path) -> None:
    """SGD with momentum takes the master, and starts its momentum at zero (Adam saved no ``momentum_buffer``)."""
    full = full_tensors()
    dirs = save_checkpoint(tmp_path / "ckpt", full, 2, 100, 1024)
    shards = live_shards(tmp_path / "live", 0, 1, 60, 1024, rule=SGD())
    Reshard.of(dirs, layout_of(0, 1, 60), 0, 1).write(shards)
    for shard, want in zip(shards, expected_shards(full, 0, 1, 60)):
        master, momentum = read_records(shard)
        assert torch.equal(master, want[0]) and not momentum.any()


def test_refusals_name_the_file_or_parameter_and_touch_nothing(tmp_path) -> None:
    full = full_tensors()
    dirs = save_checkpoint(tmp_path / "ckpt", full, 2, 100, 1024)
    shards = live_shards(tmp_path / "live", 0, 1, 100, 1024)
    before = [s.path.read_bytes() for s in shards]
    other = [dict(p) for p in layout_of(0, 1, 100)[0]]
    other[0] = {**other[0], "shape": [51, 8], "partition_numel": 408}
    with pytest.raises(CheckpointError, match=r"parameter 'embed' with shape \[50, 8\], this model's is \[51, 8\]"):
        Reshard.of(dirs, [other, *layout_of(0, 1, 100)[1:]], 0, 1)
    unknown = [[{"name": "new.weight", "shape": [4], "partition_numel": 4}]]
    with pytest.raises(CheckpointError, match="no optimizer state for parameter 'new.weight'"):
        Reshard.of(dirs, unknown, 0, 1)
    corrupt = dirs[1] / shard_file_name(0)
    data = bytearray(corrupt.read_bytes())
    data[10] ^= 1
    corrupt.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"rank001/shard00000.state is corrupt"):
        Reshard.of(dirs, layout_of(0, 1, 100), 0, 1).write(shards)
    (dirs[1] / HOST_STATE).write_text(json.dumps({"rank": 0, "world_size": 2, "shards": []}))
    with pytest.raises(CheckpointError, match="belongs to rank 0 of 2, not rank 1 of 2"):
        Reshard.of(dirs, layout_of(0, 1, 100), 0, 1)
    assert [s.path.read_bytes() for s in shards] == before
