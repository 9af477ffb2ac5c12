"""Saving and loading the device state of a backend: one file per shard plus a manifest, crash-consistent.

Layout of a saved state directory (one per rank)::

    <directory>/shard00000.state   chunk records [master | state_1 | ... ] fp32, see ``layout.py``
    <directory>/shard00001.state   ...
    <directory>/manifest.json      format, chunk_elems, per shard: index, numel, rule, states, bytes, crc32c

Save is cheap where it can be: a state file whose every record's CRC-32C the devices kept as they wrote it is cloned
(``FICLONE``, else ``copy_file_range``, else copied; see :mod:`~lightning_smartinf.core.io.clone`) and its checksum
combined from the records' CRCs, never read back. Any other file (state in memory, records not yet written since the
file was opened) is copied through this process, its CRC-32C computed on the way.

Save is atomic: the files are written into a temporary sibling directory, each file and the directory are
fsynced, the manifest is written (and fsynced) last, and only then is the directory renamed into place
(an existing one is swapped out atomically with ``renameat2(RENAME_EXCHANGE)`` and removed afterwards).
A process killed at any moment leaves either the previous complete directory or the new complete one,
plus at most a temporary sibling (:mod:`~lightning_smartinf.core.io.leftovers`), which the next save removes.

Load checks the manifest against this run, then the size and CRC-32 of every file *before* it touches the
live state files, and names the missing, truncated or corrupt file in a :class:`ValueError`. Files are named
by shard index, never by anything read from the manifest, so loading cannot reach outside the directory.
Shards are flat files, so a state saved with N storage paths loads onto any other number of paths.

A state saved by any of ``adam``, ``ef_adam`` and ``ef_adafactor`` loads into the others (turning compression on or
off, or changing its rule, between runs): the records are rewritten chunk by chunk, states of the same name carried
over, a state the saved rule lacks starting at its initial value (:data:`CONVERSIONS`). ``ef_adafactor`` keeps its
second moment on the host, so a rule that keeps one on the device starts it from zero; the controller then restarts
the bias correction of those param groups (``SmartUpdateController.restore``).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import functools
import json
import logging
import mmap
import os
import shutil
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_smartinf.core.backend import ShardSpec
from lightning_smartinf.core.format.layout import ChunkLayout, saved_form
from lightning_smartinf.core.io import checksum
from lightning_smartinf.core.io.checksum import CRC32C, checksum_of, combine, file_checksum
from lightning_smartinf.core.io.clone import CLONE, COPY, KERNEL_COPY, clone_file
from lightning_smartinf.core.io.leftovers import remove_entry, remove_leftovers, temporary_path
from lightning_smartinf.core.io.storage import (
    StorageError,
    disk_full_error,
    ensure_private_dir,
    fsync_dir,
    fsync_file,
    is_disk_full,
    write_file_atomic,  # looked up here at each call: tests/scripts/crash_worker.py replaces it in this module
)
from lightning_smartinf.core.progress import Progress
from lightning_smartinf.core.state_formats import FORMATS, ROOT_CODE

MANIFEST = "manifest.json"
#: How :func:`save_state` moved a file whose masters it rebuilt whole from split ones (:class:`SaveStats`).
REBUILT = "rebuilt"
FORMAT = "lightning_smartinf.state/4"
#: Formats this version loads: ``state/2`` differs only in its checksum (zlib's CRC-32 under ``crc32``), ``state/3``
#: and ``state/2`` in their ``"int8"`` state, whose second moment they hold in another code (square roots in E4M3, not
#: :data:`~lightning_smartinf.core.state_formats.ROOT_CODE`): a manifest of theirs that has any is refused.
READABLE_FORMATS = ("lightning_smartinf.state/2", "lightning_smartinf.state/3", FORMAT)
#: Bytes per read/write/checksum block when copying state files (CRC-32 runs at ~4 GB/s, above the disk).
BLOCK = 8 << 20
#: Keys of a manifest's shard entry that hold its checksum (one of them), not a property of the shard.
CHECKSUM_KEYS = (checksum.CRC32C, checksum.CRC32)
#: (saved rule, this run's rule) pairs whose states convert (states matched by name; see the module docstring).
CONVERSIONS = frozenset(
    (saved, wanted)
    for saved in ("adam", "ef_adam", "ef_adafactor")
    for wanted in ("adam", "ef_adam", "ef_adafactor")
    if saved != wanted
)

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted or read; the message names the file and what is wrong with it."""


def read_json(path: Path, what: str, required: Iterable[str] = ()) -> dict[str, Any]:
    """A JSON object from ``path`` with ``required`` keys; a :class:`CheckpointError` naming the file otherwise."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: {what} is incomplete. Resume from another checkpoint.")
    try:
        content = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is corrupt: it is not valid JSON ({exc}).") from None
    if not isinstance(content, dict):
        raise CheckpointError(f"{path} is corrupt: it holds a {type(content).__name__}, not a JSON object.")
    if missing := [key for key in required if key not in content]:
        raise CheckpointError(f"{path} is corrupt: it lacks {', '.join(map(repr, missing))}.")
    return content


def shard_file_name(index: int, slot: int = 0) -> str:
    """Name of shard ``index``'s state file; ``slot`` 1 is the second copy kept for tentative updates."""
    return f"shard{index:05d}.state" if slot == 0 else f"shard{index:05d}.slot{slot}.state"


@dataclass(frozen=True)
class ShardState:
    """Where one shard's live state file is, and what it holds.

    ``checksums``: the CRC-32C of each record by byte offset as the device wrote it, where the file keeps them
    (``StateFile.checksums``); ``None`` for state in memory. ``params``: the shard's bf16 parameters where its
    layout splits the masters (the other half of each): a save rebuilds whole masters from them, a load sets them.
    """

    spec: ShardSpec
    layout: ChunkLayout
    path: Path
    checksums: Mapping[int, int] | None = None
    params: Tensor | None = None

    def file_crc32c(self) -> int | None:
        """The whole file's CRC-32C, combined from its records' (``None`` unless every record's is known)."""
        if self.checksums is None:
            return None
        crc = 0
        for k in range(self.layout.num_chunks):
            offset, size = self.layout.record_offset(k), self.layout.record_bytes(k)
            record_crc = self.checksums.get(offset)
            if record_crc is None:
                return None
            crc = record_crc if k == 0 else combine(crc, record_crc, size)
        return crc


@dataclass
class SaveStats:
    """How a save moved the state files: bytes by method (``clone``, ``kernel copy``, ``copy``, ``rebuilt``: whole
    masters from split ones) and files read to be checksummed (``checksummed_bytes``: state whose records' CRCs were
    not known)."""

    by_method: dict[str, int]
    checksummed_bytes: int = 0

    @property
    def cloned_bytes(self) -> int:
        return self.by_method.get(CLONE, 0)

    @property
    def copied_bytes(self) -> int:
        return self.by_method.get(KERNEL_COPY, 0) + self.by_method.get(COPY, 0) + self.by_method.get(REBUILT, 0)


def manifest_of(shards: Sequence[ShardState], *, chunk_elems: int, crcs: Mapping[int, int]) -> dict:
    """The manifest of a saved state directory holding ``shards``' files, whose CRC-32C are ``crcs`` by shard
    index."""
    described = [{**_describe(s), CRC32C: crcs[s.spec.index]} for s in shards]
    return {"format": FORMAT, "chunk_elems": chunk_elems, "shards": described}


def _describe(shard: ShardState) -> dict:
    """The manifest entry of ``shard``'s file as saved (with whole masters: a saved file never splits them)."""
    # fp32 is recorded by leaving the format out: manifests of fp32 state read as they did before formats existed.
    fmt = {"state_format": shard.spec.state_format} if shard.spec.state_format != "fp32" else {}
    return {
        "index": shard.spec.index,
        "numel": shard.spec.numel,
        "rule": shard.spec.rule.name,
        "states": list(shard.spec.rule.state_names),
        **fmt,
        "bytes": saved_form(shard.layout).file_bytes,
    }


def saved_layout(entry: Mapping[str, Any], chunk_elems: int) -> ChunkLayout:
    """The layout of a saved shard from its manifest ``entry``."""
    return ChunkLayout(int(entry["numel"]), chunk_elems, len(entry["states"]), str(entry.get("state_format", "fp32")))


# ------------------------------------------------------------------------------------------------ file helpers


@contextlib.contextmanager
def _mapped(fd: int, size: int) -> Iterator[memoryview]:
    """A read-only view of the first ``size`` bytes of ``fd`` through a shared mapping, read ahead sequentially."""
    if size == 0:
        yield memoryview(b"")
        return
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mapping:
        if hasattr(mmap, "MADV_SEQUENTIAL"):
            mapping.madvise(mmap.MADV_SEQUENTIAL)
        with memoryview(mapping) as view:
            yield view


def copy_with_crc(
    src: Path,
    dst: Path,
    *,
    expected_bytes: int | None = None,
    fsync: bool = True,
    exclusive: bool = True,
    algorithm: str = CRC32C,
) -> int:
    """Copy ``src`` to ``dst`` (mode 0600) in ``BLOCK``-sized pieces; return the checksum (``algorithm``) of the bytes
    copied.

    ``exclusive``: ``dst`` must not exist yet (a fresh checkpoint file); otherwise it is overwritten in place
    and truncated to the copied length. Raises ``ValueError`` if ``src`` does not hold ``expected_bytes``.
    """
    update = checksum.UPDATERS[algorithm]
    crc = 0
    flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else 0)
    with open(src, "rb", buffering=0) as fin:
        total = os.fstat(fin.fileno()).st_size
        if expected_bytes is not None and total != expected_bytes:
            raise ValueError(f"State file {src} holds {total} B, expected {expected_bytes} B (truncated?).")
        out = os.open(dst, flags, 0o600)
        try:
            # Written from a mapping of the source, then checksummed where it lies: one copy of each byte in this
            # process (a read into a buffer and a write from it made two, which is most of what this costs).
            with _mapped(fin.fileno(), total) as source:
                for start in range(0, total, BLOCK):
                    with source[start : start + BLOCK] as piece:
                        done = 0
                        while done < len(piece):
                            with piece[done:] as rest:
                                done += os.write(out, rest)
                        crc = update(piece, crc)
            if not exclusive:
                os.ftruncate(out, total)
            if fsync:
                os.fsync(out)
        finally:
            os.close(out)
    return crc


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


@functools.cache
def _renameat2() -> Callable[..., int] | None:
    """libc's ``renameat2``, or ``None`` where this libc has none (glibc < 2.28, musl, macOS)."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (Linux ``renameat2(RENAME_EXCHANGE)``); False if unsupported."""
    if (renameat2 := _renameat2()) is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (0, errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, f"renameat2({a}, {b}, RENAME_EXCHANGE) failed: {os.strerror(err)}")


def install_directory(tmp: Path, directory: Path) -> None:
    """Move the complete ``tmp`` directory to ``directory``, atomically replacing whatever is at that name.

    An existing entry (directory, file or symlink, never followed) is exchanged with ``tmp`` in one
    ``renameat2(RENAME_EXCHANGE)`` and then removed. Without that call (not Linux, or a filesystem that refuses it,
    such as NFS) the old entry is renamed aside first: a kill in between leaves no entry at the name, and the old one
    survives whole as ``.<name>.aside-*``, which the next :func:`remove_leftovers` of the folder puts back. Once the
    new entry is at the name, an old one that cannot be deleted is left with a warning (a later
    :func:`remove_leftovers` of the folder deletes it): the replacement has happened, and it stands.
    """
    if not os.path.lexists(directory):
        os.rename(tmp, directory)
        fsync_dir(directory.parent)
        return
    if _exchange(tmp, directory):
        old = tmp  # now holds the previous entry
    else:
        aside = temporary_path(directory, "aside")
        os.rename(directory, aside)
        os.rename(tmp, directory)
        old = temporary_path(directory, "old")
        os.rename(aside, old)  # no longer the only copy of anything: never to be put back
    fsync_dir(directory.parent)
    try:
        remove_entry(old)
    except OSError as exc:
        warnings.warn(
            f"{str(directory)!r} is in place, but the entry it replaced, set aside as {str(old)!r}, could not be "
            f"deleted ({exc}); a later save in that folder deletes it once this process has ended.",
            stacklevel=2,
        )


def _per_device(
    shards: Sequence[ShardState],
    work: Callable[[ShardState], object],
    progress: Progress | None = None,
    file_bytes: Callable[[ShardState], int] = lambda shard: saved_form(shard.layout).file_bytes,
) -> dict[int, object]:
    """Run ``work`` for every shard, the shards of each device (the directory of their live file) one after another,
    devices in parallel; each shard done adds ``file_bytes`` of it (its file's as this run saves it) to
    ``progress``."""
    groups: dict[Path, list[ShardState]] = {}
    for shard in shards:
        groups.setdefault(shard.path.parent, []).append(shard)

    def run(group: list[ShardState]) -> list[tuple[int, object]]:
        done = []
        for shard in group:
            done.append((shard.spec.index, work(shard)))
            if progress is not None:
                progress.update(file_bytes(shard))
        return done

    if len(groups) <= 1:
        return {index: result for group in groups.values() for index, result in run(group)}
    with ThreadPoolExecutor(len(groups), thread_name_prefix="csd-ckpt") as pool:
        futures = [pool.submit(run, group) for group in groups.values()]
    # Leaving the pool waited for every device: the first error is raised only once all of them have stopped.
    return {index: result for future in futures for index, result in future.result()}


# ------------------------------------------------------------------------------------------------ save / load


def save_state(shards: Sequence[ShardState], directory: Path, *, chunk_elems: int) -> SaveStats:
    """Clone or copy every shard's state file into ``directory`` (0700) atomically, with a checksummed manifest.

    The space check counts every byte of state even where files are cloned: a clone shares the live file's blocks
    only until the next step rewrites them, and that step must not find the disk full.

    Raises :class:`StorageError` if the filesystem of ``directory`` is (or becomes) full; the previous
    contents of ``directory``, if any, are then left untouched and no temporary files remain.
    """
    directory = Path(directory)
    parent = directory.parent
    parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(parent, directory.name)  # left by a save that was killed
    sizes = {s.spec.index: saved_form(s.layout).file_bytes for s in shards}
    needed = sum(sizes.values()) + 4096 * (len(shards) + 2)

    def full(when: str) -> StorageError:
        return disk_full_error(
            directory,
            "the checkpoint's device state",
            needed,
            f"{when} The previous checkpoint there, if any, is untouched. Free space on that filesystem or save the "
            "checkpoint elsewhere.",
        )

    if shutil.disk_usage(parent).free < needed:
        raise full("Nothing was written.")
    tmp = temporary_path(directory)
    try:
        ensure_private_dir(tmp)

        def copy(shard: ShardState) -> tuple[int, str, bool]:
            """The file's CRC-32C, how it was moved, and whether its bytes were read to checksum them."""
            dst, size = tmp / shard_file_name(shard.spec.index), shard.layout.file_bytes
            if shard.layout.split_masters:
                return _write_whole_masters(shard, dst), REBUILT, True
            crc = shard.file_crc32c()
            if crc is not None:  # known from the writes: the bytes need not pass through this process
                return crc, clone_file(shard.path, dst, size, fsync=False), False
            return copy_with_crc(shard.path, dst, expected_bytes=size, fsync=False), COPY, True

        with Progress("saving the optimizer state", sum(sizes.values()), per_rank=True) as progress:
            done = _per_device(shards, copy, progress)
        # Forced to disk once all are copied (before the manifest): a flush per file would idle the disk between them.
        _per_device(shards, lambda shard: fsync_file(tmp / shard_file_name(shard.spec.index)))
        manifest = manifest_of(shards, chunk_elems=chunk_elems, crcs={i: crc for i, (crc, _, _) in done.items()})
        write_file_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
        install_directory(tmp, directory)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(exc):
            raise full("The filesystem filled up while it was written; what was written is gone.") from exc
        raise
    stats = SaveStats(by_method={})
    for shard in shards:
        (_, how, checksummed), size = done[shard.spec.index], sizes[shard.spec.index]
        stats.checksummed_bytes += size if checksummed else 0
        stats.by_method[how] = stats.by_method.get(how, 0) + size
    return stats


def _write_whole_masters(shard: ShardState, dst: Path) -> int:
    """Write ``shard``'s live file, whose masters are split, to ``dst`` (new, 0600) with whole masters rebuilt from
    its parameters, record by record; return the CRC-32C of what was written."""
    assert shard.params is not None, "split masters are saved with their parameters"
    layout, saved, names = shard.layout, saved_form(shard.layout), shard.spec.rule.state_names
    update, crc = checksum.UPDATERS[CRC32C], 0
    with (
        open(shard.path, "rb", buffering=0) as fin,  # first: a source that will not open leaves no descriptor behind
        open(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb", buffering=0) as fout,
    ):
        for k in range(layout.num_chunks):
            start, n = layout.chunk_range(k)
            raw = bytearray(layout.record_bytes(k))
            fin.seek(layout.record_offset(k))
            if fin.readinto(raw) != len(raw):
                raise ValueError(f"State file {shard.path} ended early in chunk {k}.")
            tensors = layout.unpack(torch.frombuffer(raw, dtype=torch.uint8), k, names, shard.params[start : start + n])
            record = memoryview(saved.pack(tensors, k, names).numpy()).cast("B")
            fout.write(record)
            crc = update(record, crc)
    return crc


class MissingStateFiles(CheckpointError, FileNotFoundError):
    """A directory of saved device state without its manifest (also a ``FileNotFoundError``)."""


def require_state_files(directory: Path) -> None:
    """Raise :class:`MissingStateFiles` unless ``directory`` holds saved state files (a manifest): a directory of a
    backend that kept its state on its devices (remote servers) holds none, and this host cannot read it."""
    if not (Path(directory) / MANIFEST).is_file():
        raise MissingStateFiles(
            f"{directory} holds no {MANIFEST}: the device state of this checkpoint was kept by the devices that saved "
            "it (remote device servers), not in files here, and this run cannot reach them. Resume it with "
            "`backend='remote'` and `remote_devices` that include the servers that hold it, or on this run's devices "
            "with `saved_state_from={'backend': 'remote', 'remote_devices': [...], 'remote_token_file': ...}` "
            "(either: any number of ranks, `sub_group_size` or `chunk_size`)."
        )


def read_manifest(directory: Path) -> dict:
    """The parsed manifest of a saved state directory (``FileNotFoundError`` / ``ValueError`` if absent or bad)."""
    manifest_path = Path(directory) / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(f"No device-state manifest at {manifest_path}; was the checkpoint saved by us?")
    return parse_manifest(manifest_path.read_bytes(), manifest_path)


def parse_manifest(data: bytes, manifest_path: Path) -> dict:
    """The manifest in ``data``, read from ``manifest_path`` (``ValueError`` if it is not one this version reads):
    for a caller that must check the very bytes it parses (a digest)."""
    try:
        manifest = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"Device-state manifest {manifest_path} is corrupt ({exc}).") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in READABLE_FORMATS:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise ValueError(
            f"Device-state manifest {manifest_path} has format {found!r}; this version reads "
            f"{' and '.join(map(repr, READABLE_FORMATS))}. "
            "Resume with the lightning_smartinf version that saved it."
        )
    shards = manifest.get("shards")
    if (
        manifest["format"] != FORMAT
        and isinstance(shards, list)
        and any(isinstance(entry, dict) and entry.get("state_format") == "int8" for entry in shards)
    ):
        raise ValueError(
            f"Device-state manifest {manifest_path} holds `state_precision='int8'` state saved by an earlier "
            f"version ({manifest['format']!r}), which coded the second moment in E4M3; this version codes it "
            f"in {ROOT_CODE.name}, and reading the old codes as new ones would be wrong. Resume with the version "
            "that saved it, and to carry the state over, save it there with `state_precision='fp32'` or "
            "`'bf16'` (a resume converts between formats), then resume here."
        )
    return manifest


def verify_state_file(path: Path, entry: dict) -> None:
    """Raise ``ValueError`` naming ``path`` unless it has the size and checksum the manifest ``entry`` records."""
    if not path.is_file():
        raise ValueError(f"State file {path} is missing from the checkpoint.")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise ValueError(
            f"State file {path} is truncated or has the wrong size: {size} B, expected {entry['bytes']} B."
        )
    algorithm, recorded = checksum_of(entry, path.parent / MANIFEST)
    _, crc = file_checksum(path, algorithm)
    if crc != recorded:
        raise ValueError(
            f"State file {path} is corrupt: {algorithm.upper()} {crc:#010x}, the manifest records {recorded:#010x}."
        )


def load_state(
    shards: Sequence[ShardState], directory: Path, *, chunk_elems: int, manifest: dict | None = None
) -> None:
    """Replace every shard's live state file with the saved copy, after checking the whole copy first.

    Nothing live is touched unless the manifest matches this run and every file has the recorded size
    and checksum. ``manifest``: the directory's manifest as the caller read (and checked) it; read here otherwise.
    """
    directory = Path(directory)
    if manifest is None:
        require_state_files(directory)
        manifest = read_manifest(directory)
    expected = [_describe(s) for s in shards]
    found = manifest.get("shards", [])
    found_plain = [{k: v for k, v in e.items() if k not in CHECKSUM_KEYS} for e in found if isinstance(e, dict)]
    if difference := _difference(found_plain, expected, manifest.get("chunk_elems"), chunk_elems):
        raise ValueError(
            f"Device state in {directory} does not match this model and optimizer: {difference}. Resume with the "
            "model and the optimizer it was saved with (through the strategy, the number of ranks, `sub_group_size` "
            "and `chunk_size` may change)."
        )
    entries = {e["index"]: e for e in found}
    # Files are looked up by index (never by a name from the manifest): the checkpoint cannot point elsewhere.
    _per_device(shards, lambda s: verify_state_file(directory / shard_file_name(s.spec.index), entries[s.spec.index]))

    # Shards of a rule without per-element state (`ef_adafactor`) hold no state to convert.
    formats = {
        (e.get("state_format", "fp32"), w.get("state_format", "fp32"))
        for e, w in zip(found_plain, expected)
        if e.get("states") and e.get("state_format", "fp32") != w.get("state_format", "fp32")
    }
    for saved_format, wanted_format in sorted(formats):
        # fp32 holds every value of the other formats as the devices decode them; bf16 does not hold int8's (a code
        # times an fp32 block scale), so any conversion but into fp32 rounds.
        exact = wanted_format == "fp32"
        (log.info if exact else log.warning)(
            "Device state in %s was saved in %s; converting it to %s (%s).",
            directory,
            saved_format,
            wanted_format,
            "exactly" if exact else "rounded: the optimizer state loses precision",
        )
    if converted := sorted({(e["rule"], w["rule"]) for e, w in zip(found_plain, expected) if e["rule"] != w["rule"]}):
        log.warning(
            "Device state in %s was saved by update rule %s; converting it to %s (states of the same name carried "
            "over, the others starting fresh).",
            directory,
            ", ".join(sorted({a for a, _ in converted})),
            ", ".join(sorted({b for _, b in converted})),
        )

    def copy_back(shard: ShardState) -> None:
        src = directory / shard_file_name(shard.spec.index)
        saved = entries[shard.spec.index]
        algorithm, recorded = checksum_of(saved, directory / MANIFEST)
        layout = saved_layout(saved, chunk_elems)
        if layout != shard.layout or saved["states"] != list(shard.spec.rule.state_names):
            crc = convert_state_file(src, layout, saved["states"], shard, algorithm=algorithm)
        else:
            crc = copy_with_crc(
                src,
                shard.path,
                expected_bytes=shard.layout.file_bytes,
                fsync=False,
                exclusive=False,
                algorithm=algorithm,
            )
        if crc != recorded:
            raise ValueError(
                f"State file {src} changed while it was loaded ({algorithm.upper()} {crc:#010x}, expected "
                f"{recorded:#010x}); the live state is now invalid. Load again."
            )

    def read_bytes(shard: ShardState) -> int:  # the saved file's, in its own format (a conversion reads that)
        return saved_layout(entries[shard.spec.index], chunk_elems).file_bytes

    with Progress("loading the optimizer state", sum(map(read_bytes, shards)), per_rank=True) as progress:
        _per_device(shards, copy_back, progress, read_bytes)


def _difference(found: list[dict], expected: list[dict], saved_chunk: Any, chunk_elems: int) -> str | None:
    """The first way saved shards ``found`` differ from this run's ``expected`` ones, in words; ``None`` where they
    load into them: equal, or equal but for convertible rules (and so their states and sizes) or state formats."""
    if saved_chunk != chunk_elems:
        return f"it was saved in chunks of {saved_chunk} elements, this run's are {chunk_elems}"
    if len(found) != len(expected):
        return f"it holds {len(found)} shards, this run has {len(expected)}"
    loadable = True
    for saved, wanted in zip(found, expected):
        if saved == wanted:
            continue
        if saved.get("numel") != wanted["numel"]:
            return f"its shard {wanted['index']} holds {saved.get('numel')} elements, this run's {wanted['numel']}"
        same_rule = saved.get("rule") == wanted["rule"] and saved.get("states") == wanted["states"]
        if not same_rule and (saved.get("rule"), wanted["rule"]) not in CONVERSIONS:
            held = ", ".join(map(str, saved.get("states") or ())) or "no state"
            needed = ", ".join(wanted["states"]) or "no state"
            return (
                f"it holds the state of the update rule {saved.get('rule')!r} ({held}), this run's optimizer updates "
                f"with {wanted['rule']!r} ({needed})"
            )
        if saved.get("state_format", "fp32") not in FORMATS:
            return f"its shard {wanted['index']} is in state format {saved.get('state_format')!r}, unknown here"
        loadable = loadable and saved.get("index") == wanted["index"]
    return None if loadable else f"it holds {found}, this run needs {expected}"


def convert_state_file(
    src: Path, saved: ChunkLayout, saved_states: Sequence[str], shard: ShardState, *, algorithm: str = CRC32C
) -> int:
    """Rewrite ``src`` (records of ``saved_states``) as ``shard``'s live file; return the checksum (``algorithm``) of
    ``src``.

    Record by record: the master and every state ``shard``'s rule shares by name are copied (read in the saved
    format, stored in the live one), the others are set to the rule's initial value (padding stays zero). Where the
    live layout splits the masters, ``shard``'s parameters are set to their rounding (the masters' other half).
    """
    rule, layout = shard.spec.rule, shard.layout
    update = checksum.UPDATERS[algorithm]
    crc = 0
    with open(src, "rb", buffering=0) as fin, open(shard.path, "r+b", buffering=0) as fout:
        fout.truncate(layout.file_bytes)
        for k in range(saved.num_chunks):
            raw = bytearray(saved.record_bytes(k))
            if fin.readinto(raw) != len(raw):
                raise ValueError(f"State file {src} ended early in chunk {k}.")
            crc = update(raw, crc)
            old = saved.unpack(torch.frombuffer(raw, dtype=torch.uint8), k, saved_states)
            new = [old[0]]
            for name in rule.state_names:
                if name in saved_states:
                    new.append(old[1 + list(saved_states).index(name)])
                else:
                    new.append(torch.zeros(layout.padded_len(k)))
                    new[-1][: layout.chunk_range(k)[1]] = rule.initial_state_value(name)
            start, n = layout.chunk_range(k)
            params = None if shard.params is None else shard.params[start : start + n]
            fout.seek(layout.record_offset(k))
            fout.write(layout.pack(new, k, rule.state_names, params_out=params).numpy().tobytes())
    return crc


def read_shard_masters(path: Path, layout: ChunkLayout, start: int = 0, numel: int | None = None) -> Tensor:
    """The fp32 master weights of elements ``[start, start + numel)`` (default: all) of one saved shard file: read
    from the first tensor of each chunk record they fall in, and nothing else."""
    end = layout.numel if numel is None else start + numel
    if not 0 <= start <= end <= layout.numel:
        raise ValueError(f"State file {path}: elements [{start}, {end}) are outside its {layout.numel}.")
    out = torch.empty(end - start, dtype=torch.float32)
    view = memoryview(out.numpy()).cast("B")
    with open(path, "rb", buffering=0) as f:
        for k in range(start // layout.chunk_elems, -(-end // layout.chunk_elems)):
            first, n = layout.chunk_range(k)
            low, high = max(first, start), min(first + n, end)
            f.seek(layout.record_offset(k) + (low - first) * 4)
            got = f.readinto(view[(low - start) * 4 : (high - start) * 4])
            if got != (high - low) * 4:
                raise ValueError(f"State file {path} ended early in chunk {k}.")
    return out


def saved_shard_masters(directory: Path, index: int, *, manifest: dict[str, Any]) -> Tensor:
    """The fp32 masters of shard ``index`` of the state :func:`save_state` wrote under ``directory`` (whose manifest,
    as the caller read it, is ``manifest``), CRC-checked first."""
    entries = {int(e["index"]): e for e in manifest["shards"]}
    if index not in entries:
        raise ValueError(f"{directory / MANIFEST} has no shard {index}.")
    entry = entries[index]
    path = Path(directory) / shard_file_name(index)
    verify_state_file(path, entry)
    return read_shard_masters(path, saved_layout(entry, int(manifest["chunk_elems"])))
