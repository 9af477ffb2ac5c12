"""Consolidate the fp32 master weights of a SmartUpdate checkpoint into one state dict (like ``zero_to_fp32``).

A checkpoint saved with ``strategy="smart_infinity"`` keeps the fp32 masters on the devices, so DeepSpeed's
``zero_to_fp32.py`` cannot rebuild them. This module reads, for every rank,
``<ckpt>/checkpoint/smartinf/rankNNN/host_state.json`` (which parameter partitions each shard holds, in order)
and the master part of every chunk record of the shard files, checks sizes and checksums against the
manifest, and joins the ranks' partitions of each parameter (rank ``r`` holds elements
``[r * partition_numel, (r + 1) * partition_numel)`` of the flattened parameter, the last one padded).

Command line::

    python -m lightning_smartinf.export <checkpoint dir> <out.safetensors>
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch
from torch import Tensor

from lightning_smartinf.csd.checkpoint import read_manifest, shard_file_name, verify_state_file
from lightning_smartinf.csd.layout import ChunkLayout

STATE_DIR = Path("checkpoint") / "smartinf"
HOST_STATE = "host_state.json"


def rank_state_dir(checkpoint_path: str | os.PathLike, rank: int) -> Path:
    return Path(checkpoint_path) / STATE_DIR / f"rank{rank:03d}"


def _host_state(directory: Path) -> dict:
    path = directory / HOST_STATE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: the checkpoint was not saved with `strategy='smart_infinity'`, or its save did not "
            "complete (it is written last). Use an earlier checkpoint."
        )
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path} is corrupt ({exc}).") from None


def world_size(checkpoint_path: str | os.PathLike) -> int:
    return int(_host_state(rank_state_dir(checkpoint_path, 0))["world_size"])


def is_complete(checkpoint_path: str | os.PathLike) -> bool:
    """Whether every rank's device state of the checkpoint was written to the end (manifest and host state).

    Cheap (no checksums): it tells a checkpoint interrupted by a crash from a finished one. Loading still
    verifies every file.
    """
    try:
        size = world_size(checkpoint_path)
        for rank in range(size):
            directory = rank_state_dir(checkpoint_path, rank)
            host = _host_state(directory)
            read_manifest(directory)
            if host.get("rank") != rank or host.get("world_size") != size:
                return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


def _read_masters(path: Path, layout: ChunkLayout) -> Tensor:
    """The fp32 master weights of one shard file: the first tensor of every chunk record."""
    out = torch.empty(layout.numel, dtype=torch.float32)
    view = memoryview(out.numpy()).cast("B")
    with open(path, "rb", buffering=0) as f:
        for k in range(layout.num_chunks):
            start, n = layout.chunk_range(k)
            f.seek(layout.record_offset(k))
            got = f.readinto(view[start * 4 : (start + n) * 4])
            if got != n * 4:
                raise ValueError(f"State file {path} ended early in chunk {k}.")
    return out


def consolidate_fp32_state_dict(checkpoint_path: str | os.PathLike, *, verify: bool = True) -> dict[str, Tensor]:
    """Full fp32 master weights of every trainable parameter, by name, from a SmartUpdate checkpoint directory.

    ``verify``: check every shard file's size and CRC-32 against its manifest first (reads each file twice).
    """
    size = world_size(checkpoint_path)
    pieces: dict[str, list[Tensor | None]] = {}
    shapes: dict[str, list[int]] = {}
    for rank in range(size):
        directory = rank_state_dir(checkpoint_path, rank)
        host = _host_state(directory)
        manifest = read_manifest(directory)
        entries = {int(e["index"]): e for e in manifest["shards"]}
        if host.get("world_size") != size or host.get("rank") != rank:
            raise ValueError(
                f"{directory / HOST_STATE} belongs to rank {host.get('rank')} of {host.get('world_size')}."
            )
        if len(host["shards"]) != len(entries):
            raise ValueError(
                f"{directory}: host state lists {len(host['shards'])} shards, the manifest {len(entries)}."
            )
        for index, params in enumerate(host["shards"]):
            entry = entries[index]
            path = directory / shard_file_name(index)
            if verify:
                verify_state_file(path, entry)
            layout = ChunkLayout(int(entry["numel"]), int(manifest["chunk_elems"]), len(entry["states"]))
            masters = _read_masters(path, layout)
            offset = 0
            for param in params:
                name, n = param["name"], int(param["partition_numel"])
                slots = pieces.setdefault(name, [None] * size)
                shapes.setdefault(name, list(param["shape"]))
                slots[rank] = masters[offset : offset + n]
                offset += n
            if offset != layout.numel:
                raise ValueError(f"{path}: its parameters cover {offset} elements, the shard holds {layout.numel}.")
    state: dict[str, Tensor] = {}
    for name, slots in pieces.items():
        missing = [r for r, t in enumerate(slots) if t is None]
        if missing:
            raise ValueError(f"Parameter {name!r} has no partition on rank(s) {missing} of the checkpoint.")
        numel = math.prod(shapes[name])
        flat = torch.cat(slots)  # type: ignore[arg-type]
        if flat.numel() < numel:
            raise ValueError(f"Parameter {name!r}: the ranks hold {flat.numel()} elements, its shape needs {numel}.")
        state[name] = flat[:numel].clone().view(shapes[name])
    return state


def save_fp32(checkpoint_path: str | os.PathLike, out_file: str | os.PathLike) -> dict[str, Tensor]:
    """Write the consolidated fp32 weights of ``checkpoint_path`` to ``out_file`` (safetensors); return them."""
    from safetensors.torch import save_file

    state = consolidate_fp32_state_dict(checkpoint_path)
    save_file(state, str(out_file), metadata={"format": "pt", "source": str(checkpoint_path)})
    return state


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_smartinf.export",
        description="Consolidate the fp32 master weights of a SmartUpdate checkpoint into one safetensors file.",
    )
    parser.add_argument("checkpoint", help="checkpoint directory saved with strategy='smart_infinity'")
    parser.add_argument("output", help="output .safetensors file")
    args = parser.parse_args(argv)
    try:
        state = save_fp32(args.checkpoint, args.output)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    total = sum(t.numel() for t in state.values())
    print(f"wrote {len(state)} tensors ({total} parameters, fp32) to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
