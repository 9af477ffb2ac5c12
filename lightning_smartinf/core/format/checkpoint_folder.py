"""A SmartUpdate checkpoint directory as one unit: staged, sealed, swapped in whole, verified before loading.

A checkpoint is a directory (DeepSpeed's files, Lightning's client state inside them, and every rank's device
state under ``checkpoint/smartinf/rankNNN``). It is written into a private staging sibling (a temporary of
:mod:`~lightning_smartinf.core.io.leftovers`), sealed, and only then moved to its name, replacing whatever was there
in one ``renameat2(RENAME_EXCHANGE)``. A process killed at any instant leaves the previous checkpoint or the new one at
the name, never a mix; staging and retired siblings left by a kill are removed by the next save in that folder.

The seal (``checkpoint/smartinf/seal.json``, written last inside the staging directory) records the global step,
the world size, and the size and CRC-32 of every file of the checkpoint. Shard files are recorded with the
checksums of their rank's manifest, which the seal covers in turn, so the state is not read twice to seal it.

Before anything is loaded, :func:`verify` checks the seal against the directory: no symlinks, no file missing,
added, resized or changed (shard files are checked by size here and by CRC-32 when their rank loads them).
Pickled files are read with :func:`safe_torch_load` only (``torch.load(weights_only=True)``), so loading never
runs code from a checkpoint. Neither Lightning nor DeepSpeed is imported here.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from lightning_smartinf.core.format.rank_state import HOST_STATE
from lightning_smartinf.core.format.state_files import (
    MANIFEST,
    CheckpointError,
    install_directory,
    read_json,
    read_manifest,
    shard_file_name,
    write_file_atomic,
)
from lightning_smartinf.core.format.torch_files import safe_torch_load
from lightning_smartinf.core.io.checksum import CRC32, CRC32C, checksum_of, file_checksum
from lightning_smartinf.core.io.leftovers import temporary_path
from lightning_smartinf.core.io.storage import fsync_dir, fsync_file

#: Where the seal lives, relative to the checkpoint directory.
SEAL = PurePosixPath("checkpoint/smartinf/seal.json")
SEAL_FORMAT = "lightning_smartinf.checkpoint/2"
#: Seals this version reads: ``checkpoint/1`` records zlib's CRC-32 (``crc32``) of every file, ``checkpoint/2`` the
#: CRC-32C (``crc32c``), which a state file's manifest knows from the device's writes.
READABLE_SEALS = ("lightning_smartinf.checkpoint/1", SEAL_FORMAT)
#: DeepSpeed's tag for Lightning checkpoints: the one subdirectory ``latest`` may name.
TAG = "checkpoint"
STATE_DIR = PurePosixPath(TAG) / "smartinf"
#: DeepSpeed's ZeRO-3 file holding the module and Lightning's client state, under ``TAG``.
MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"
#: Scripts DeepSpeed copies into every checkpoint it saves. They rebuild the weights from DeepSpeed's optimizer
#: files, which hold none of the state here (it is in the devices' files), and fail on these checkpoints, so a save
#: removes them; ``smartinf export`` is what rebuilds the weights of a SmartUpdate checkpoint.
DEEPSPEED_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


def rank_state_dir(root: str | os.PathLike, rank: int) -> Path:
    """Rank ``rank``'s device-state directory inside checkpoint ``root``."""
    return Path(root) / STATE_DIR / f"rank{rank:03d}"


# ------------------------------------------------------------------------------------------------------- saving


def seal(root: Path, *, global_step: int, world_size: int) -> dict[str, Any]:
    """Write the seal of the staged checkpoint ``root``: its step, world size and every file's size and checksum.

    Directories below ``root`` are made private (0700) on the way. Returns the seal.
    """
    files: dict[str, dict[str, int]] = {}
    for directory, dirnames, filenames in os.walk(root):
        here = Path(directory)
        os.chmod(here, 0o700)
        relative = PurePosixPath(here.relative_to(root).as_posix())
        manifest_entries = _manifest_entries(here) if MANIFEST in filenames and HOST_STATE in filenames else {}
        for name in sorted(filenames):
            key = str(relative / name) if str(relative) != "." else name
            if key == str(SEAL):
                continue
            if name in manifest_entries:  # a shard file: its rank's manifest (sealed below) holds its checksum
                algorithm, value = checksum_of(manifest_entries[name], here / MANIFEST)
                files[key] = {"bytes": int(manifest_entries[name]["bytes"]), algorithm: int(value)}
            else:  # forced to disk first: a seal must not outlive what it describes
                fsync_file(here / name, os.O_NOFOLLOW)
                size, crc = file_checksum(here / name, CRC32C)
                files[key] = {"bytes": size, CRC32C: crc}
        dirnames.sort()
    content = {"format": SEAL_FORMAT, "global_step": int(global_step), "world_size": int(world_size), "files": files}
    write_file_atomic(root / SEAL, json.dumps(content, indent=1, sort_keys=True).encode())
    return content


def _manifest_entries(directory: Path) -> dict[str, Mapping[str, Any]]:
    manifest = read_manifest(directory)
    return {shard_file_name(int(e["index"])): e for e in manifest.get("shards", [])}


def install(staging: Path, target: Path) -> None:
    """Move the sealed ``staging`` directory to ``target``, atomically replacing what is there (if anything)."""
    install_directory(staging, target)


def retire(target: Path) -> None:
    """Remove checkpoint ``target`` so that no kill leaves part of it at its name: rename it away, then delete."""
    if not os.path.lexists(target):
        return
    if os.path.islink(target) or not target.is_dir():
        target.unlink()
        fsync_dir(target.parent)
        return
    aside = temporary_path(target, "old")
    os.rename(target, aside)
    fsync_dir(target.parent)
    shutil.rmtree(aside, ignore_errors=True)


# ------------------------------------------------------------------------------------------------------ loading


def is_sealed(root: str | os.PathLike) -> bool:
    """Cheap check (no checksums) that ``root`` holds a complete, sealed checkpoint: its seal exists and parses."""
    try:
        _read_seal(Path(root))
    except (OSError, CheckpointError):
        return False
    return True


def enclosing(path: str | os.PathLike) -> Path | None:
    """The checkpoint directory at or above ``path`` (resolved: links followed), or ``None``: the nearest directory
    holding a seal file. Nothing may be written there: the seal lists every file, so one more makes it unloadable."""
    resolved = Path(path).resolve()
    return next((p for p in (resolved, *resolved.parents) if os.path.isfile(p / SEAL)), None)


def _read_seal(root: Path) -> dict[str, Any]:
    path = root / SEAL
    if not root.exists() and (aside := sorted(root.parent.glob(f".{glob.escape(root.name)}.aside-*"))):
        raise CheckpointError(
            f"Checkpoint {str(root)!r} is missing, but {str(aside[-1])!r} is the checkpoint that stood there: a save "
            "over it was interrupted on a filesystem without atomic exchange (`renameat2`). Rename it back to "
            f"{root.name!r} and resume from it (the next save in that folder puts it back itself)."
        )
    if not root.is_dir():
        raise CheckpointError(
            f"Checkpoint {str(root)!r} is not a directory. A `strategy='smart_infinity'` checkpoint is a directory "
            "(e.g. `epoch=0-step=100.ckpt/`); pass that path."
        )
    if not path.is_file():
        if (checkpoint := enclosing(root.parent)) is not None:
            raise CheckpointError(
                f"{str(root)!r} is a folder inside the checkpoint {str(checkpoint)!r}: pass the checkpoint directory "
                f"itself, {str(checkpoint)!r}."
            )
        raise CheckpointError(
            f"{path} is missing: {str(root)!r} is not a complete SmartUpdate checkpoint (its save was interrupted, "
            "or it was written by another strategy or an earlier lightning_smartinf). Resume from or export another "
            "checkpoint."
        )
    content = read_json(path, "the checkpoint")  # its messages for a corrupt file (not JSON, not an object)
    problems = []
    if content.get("format") not in READABLE_SEALS:
        problems.append(f"format {content.get('format')!r} (this version reads {' and '.join(READABLE_SEALS)})")
    for key in ("global_step", "world_size"):
        if not isinstance(content.get(key), int) or isinstance(content.get(key), bool) or content[key] < 0:
            problems.append(f"`{key}` is {content.get(key)!r}, expected an integer >= 0")
    files = content.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and isinstance(v, dict) and "bytes" in v and set(v) & {CRC32, CRC32C}
        for k, v in files.items()
    ):
        problems.append("`files` is not a map of file name to {bytes, crc32c (or crc32)}")
    if problems:
        raise CheckpointError(f"{path} is corrupt: " + "; ".join(problems) + ".")
    return content


def _inside(root: Path, name: str) -> Path:
    """``root / name`` for a relative, normalised name that stays inside ``root``; else :class:`CheckpointError`."""
    relative = PurePosixPath(name)
    if relative.is_absolute() or not relative.parts or any(p in ("", ".", "..") for p in relative.parts):
        raise CheckpointError(f"{root / SEAL} names {name!r}, which is not a file inside the checkpoint.")
    return root.joinpath(*relative.parts)


def verify(root: str | os.PathLike, *, checksum_shards: bool = False) -> dict[str, Any]:
    """Check checkpoint ``root`` against its seal before anything in it is read; return the seal.

    Refused, with a :class:`CheckpointError` naming the file: a symlink anywhere inside, a file the seal does not
    list or one it lists that is missing, of another size or (except shard files unless ``checksum_shards``) with
    another CRC-32, a ``latest`` tag other than ``checkpoint``, and a device-state manifest whose shard checksums
    differ from the seal's. ``root`` itself may be a link (``ModelCheckpoint(save_last="link")``): it is resolved
    once.
    """
    root = Path(root).resolve()
    content = _read_seal(root)
    listed: dict[str, Mapping[str, int]] = content["files"]
    present: set[str] = set()
    for directory, dirnames, filenames in os.walk(root):
        here = Path(directory)
        for name in dirnames + filenames:
            if os.path.islink(here / name):
                raise CheckpointError(
                    f"{here / name} is a symlink. A checkpoint never holds links (they could lead outside it); "
                    "copy the checkpoint with the links resolved, or use another one."
                )
        relative = here.relative_to(root).as_posix()
        present.update(name if relative == "." else f"{relative}/{name}" for name in filenames)
    present.discard(str(SEAL))
    if extra := sorted(present - set(listed)):
        raise CheckpointError(
            f"{root / extra[0]} is not part of the checkpoint as it was saved (the seal does not list it). Remove "
            "it, or resume from or export an untouched copy."
        )
    shard_names: set[str] = set()
    for state_dir in sorted({str(PurePosixPath(k).parent) for k in listed if k.endswith("/" + MANIFEST)}):
        shard_names.update(f"{state_dir}/{name}" for name in _sealed_manifest_entries(root, state_dir, listed))
    for name, entry in sorted(listed.items()):
        path = _inside(root, name)
        if not path.is_file():
            raise CheckpointError(f"{path} is missing from the checkpoint; the seal lists it. Use another checkpoint.")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(
                f"{path} has {size} bytes, the seal records {entry['bytes']}: the file is truncated or was replaced."
            )
        if name in shard_names and not checksum_shards:
            continue
        algorithm, recorded = checksum_of(dict(entry), root / SEAL)
        _, crc = file_checksum(path, algorithm)
        if crc != recorded:
            raise CheckpointError(
                f"{path} is corrupt or comes from another save: {algorithm.upper()} {crc:#010x}, the seal records "
                f"{recorded:#010x}. Resume from or export another checkpoint."
            )
    latest = root / "latest"
    if latest.is_file() and latest.read_text().strip() != TAG:
        raise CheckpointError(f"{latest} names tag {latest.read_text().strip()[:80]!r}; only {TAG!r} is allowed.")
    return content


def _sealed_manifest_entries(root: Path, state_dir: str, listed: Mapping[str, Mapping[str, int]]) -> list[str]:
    """The shard file names a sealed manifest lists, after checking their checksums agree with the seal."""
    directory = _inside(root, state_dir)
    try:
        entries = _manifest_entries(directory)
    except (OSError, ValueError) as exc:
        raise CheckpointError(str(exc)) from None
    for name, entry in entries.items():
        sealed = listed.get(f"{state_dir}/{name}")
        # The seal and the manifest must agree on the file's size and checksums.
        if sealed is None or any(sealed.get(key) != entry.get(key) for key in ("bytes", CRC32, CRC32C)):
            raise CheckpointError(
                f"{directory / name} does not match the checkpoint's seal ({directory / MANIFEST} and "
                f"{root / SEAL} disagree): the device state comes from another save. Use another checkpoint."
            )
    return list(entries)


__all__ = [
    "SEAL",
    "TAG",
    "CheckpointError",
    "fsync_dir",
    "install",
    "enclosing",
    "is_sealed",
    "rank_state_dir",
    "read_json",
    "retire",
    "safe_torch_load",
    "seal",
    "verify",
]
