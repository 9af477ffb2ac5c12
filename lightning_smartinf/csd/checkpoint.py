"""Saving and loading the device state of a backend: one file per shard plus a manifest.

Files are named by shard index, never by anything read from the manifest, so loading cannot reach
outside the checkpoint directory.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lightning_smartinf.csd.backend import ShardSpec
from lightning_smartinf.csd.layout import ChunkLayout
from lightning_smartinf.csd.storage import ensure_private_dir

MANIFEST = "manifest.json"
FORMAT = "lightning_smartinf.state/1"


def shard_file_name(index: int) -> str:
    return f"shard{index:05d}.state"


@dataclass(frozen=True)
class ShardState:
    """Where one shard's live state file is, and what it holds."""

    spec: ShardSpec
    layout: ChunkLayout
    path: Path


def _describe(shard: ShardState) -> dict:
    return {
        "index": shard.spec.index,
        "numel": shard.spec.numel,
        "rule": shard.spec.rule.name,
        "states": list(shard.spec.rule.state_names),
        "bytes": shard.layout.file_bytes,
    }


def save_state(shards: Sequence[ShardState], directory: Path, *, chunk_elems: int) -> None:
    """Copy every shard's state file into ``directory`` (created 0700) and write the manifest last."""
    ensure_private_dir(directory)
    for shard in shards:
        shutil.copyfile(shard.path, directory / shard_file_name(shard.spec.index))
    manifest = {"format": FORMAT, "chunk_elems": chunk_elems, "shards": [_describe(s) for s in shards]}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1))


def load_state(shards: Sequence[ShardState], directory: Path, *, chunk_elems: int) -> None:
    """Replace every shard's state file with the saved copy, after checking the copy matches this run."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(f"No device-state manifest at {manifest_path}; was the checkpoint saved by us?")
    manifest = json.loads(manifest_path.read_text())
    expected = [_describe(s) for s in shards]
    found = manifest.get("shards", [])
    if manifest.get("format") != FORMAT or manifest.get("chunk_elems") != chunk_elems or found != expected:
        raise ValueError(
            f"Device state in {directory} does not match this model and optimizer: it holds {found} "
            f"(chunk_elems={manifest.get('chunk_elems')}), this run needs {expected} "
            f"(chunk_elems={chunk_elems}). Resume with the same model, optimizer and `chunk_size`."
        )
    for shard in shards:
        src = directory / shard_file_name(shard.spec.index)
        if not src.is_file() or src.stat().st_size != shard.layout.file_bytes:
            raise ValueError(f"State file {src} is missing or truncated (expected {shard.layout.file_bytes} B).")
    for shard in shards:
        shutil.copyfile(directory / shard_file_name(shard.spec.index), shard.path)
