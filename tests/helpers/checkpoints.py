"""Reading what a checkpoint holds, for tests that compare device state with what it should be."""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_smartinf.core.format import checkpoint_folder
from lightning_smartinf.core.format.state_files import read_manifest, saved_layout, shard_file_name


def device_states(checkpoint: Path, rank: int = 0) -> dict[int, dict[str, torch.Tensor]]:
    """Per shard of ``rank``, its saved fp32 tensors by name: ``"master"``, then each state of its rule."""
    directory = checkpoint_folder.rank_state_dir(checkpoint, rank)
    manifest = read_manifest(directory)
    shards: dict[int, dict[str, torch.Tensor]] = {}
    for entry in manifest["shards"]:
        names = ["master", *entry["states"]]
        layout = saved_layout(entry, int(manifest["chunk_elems"]))
        raw = (directory / shard_file_name(int(entry["index"]))).read_bytes()
        tensors = {name: torch.empty(layout.numel) for name in names}
        for k in range(layout.num_chunks):
            start, n = layout.chunk_range(k)
            offset = layout.record_offset(k)
            record = torch.frombuffer(bytearray(raw[offset : offset + layout.record_bytes(k)]), dtype=torch.uint8)
            for name, tensor in zip(names, layout.unpack(record, k, entry["states"])):
                tensors[name][start : start + n] = tensor[:n]
        shards[int(entry["index"])] = tensors
    return shards


def assert_converted(before: Path, after: Path) -> None:
    """``after`` holds ``before``'s device state converted to another rule: every master and every state of the same
    name bit for bit, every other state at zero (where the supported rules' states start)."""
    old, new = device_states(before), device_states(after)
    assert old.keys() == new.keys()
    for index, tensors in new.items():
        for name, value in tensors.items():
            expected = old[index].get(name, torch.zeros_like(value))
            assert torch.equal(value, expected), f"shard {index}: {name}"
