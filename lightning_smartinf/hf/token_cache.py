"""Tokenised data files cached on disk as flat arrays of token ids, read back through memory maps.

One entry per data file and way of reading it, a directory ``<file stem>-<identity>-<version>`` in the cache
directory::

    tokens.bin     the file's token ids in order: uint16 for a vocabulary of at most 65536 tokens, else uint32
    examples.bin   (prompt/response data only) int64 rows (first token, tokens, prompt tokens, line of the file)
    meta.json      what was tokenised and how; lengths of the two arrays

``identity`` hashes the file's resolved path, the tokenizer (its whole serialisation, not its name) and the
reading settings; ``version`` the file's size and modification time, so an edited file gets a new entry and the
entry of its previous version is removed. An entry is built in a private temporary sibling, fsynced, and renamed
into place complete: a crash leaves at most that sibling, which no reader opens and the next build on the same
host removes once its process is gone. Builders of the same entry at the same time (ranks, nodes sharing the
directory) each finish their own sibling; the first rename wins and the others are dropped.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lightning_smartinf.core.io.leftovers import remove_leftovers, temporary_path
from lightning_smartinf.core.io.storage import (
    StorageError,
    disk_full_error,
    fsync_dir,
    is_disk_full,
    make_private_dirs,
    nearest_existing,
    write_file_atomic,
)
from lightning_smartinf.core.progress import Progress

#: Bump when the layout or the tokenisation of an entry changes: entries of other versions are never read.
FORMAT_VERSION = 1
TOKENS, EXAMPLES, META = "tokens.bin", "examples.bin", "meta.json"
#: Columns of ``examples.bin``.
EXAMPLE_COLUMNS = ("start", "length", "prompt_length", "line")

#: A batch of tokenised records: their token ids and, for prompt/response data, ``(prompt_length, line)`` of each.
Batch = tuple[Sequence[Sequence[int]], Sequence[tuple[int, int]] | None]


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/lightning_smartinf/tokens``, by default ``~/.cache/lightning_smartinf/tokens``."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lightning_smartinf" / "tokens"


def make_cache_dir(path: Path, argument: str, owner: str) -> Path:
    """``path``, created private (0700) where missing, the components this call creates included; an existing
    directory is used as it is (every entry inside is private anyway).

    Raises:
        ValueError: ``path`` cannot be created or is not a directory; the message names ``argument``.
    """
    existing = nearest_existing(path)
    try:
        if existing != path:
            make_private_dirs(existing, path.relative_to(existing).parts)
    except StorageError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise ValueError(
            f"`{owner}({argument}={str(path)!r})`: cannot create the token cache directory ({reason}). Give a "
            f"writable directory as `{argument}`."
        ) from None
    if not path.is_dir():
        raise ValueError(
            f"`{owner}({argument}={str(path)!r})` is not a directory. Give a directory for the token cache as "
            f"`{argument}`."
        )
    return path


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of everything that decides a tokenizer's ids: for a fast tokenizer its serialisation (normaliser,
    pre-tokeniser, model, added tokens, post-processor), for a slow one its class and vocabulary; and its special
    tokens. The truncation and padding a previous call left switched on are not part of it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        spec.pop("truncation", None)
        spec.pop("padding", None)
    else:
        spec = {"class": type(tokenizer).__name__, "vocab": sorted(tokenizer.get_vocab().items())}
    special = [len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]
    return hashlib.sha256(json.dumps([spec, special], sort_keys=True).encode()).hexdigest()


class TokenCache:
    """A complete entry. ``tokens`` and ``examples`` are read-only memory maps, opened on first use; a pickled
    entry (a DataLoader worker's copy) carries its directory only and opens its own maps.

    Raises:
        ValueError: the entry's files do not have the lengths its ``meta.json`` records (damaged after it was
            written); the message names the directory to delete.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.meta: dict[str, Any] = json.loads((self.directory / META).read_text())
        self.dtype = np.dtype(self.meta["dtype"])
        self._check(TOKENS, self.meta["tokens"] * self.dtype.itemsize)
        if self.meta["examples"] is not None:
            self._check(EXAMPLES, self.meta["examples"] * len(EXAMPLE_COLUMNS) * 8)

    def _check(self, name: str, expected: int) -> None:
        path = self.directory / name
        size = path.stat().st_size if path.is_file() else None
        if size != expected:
            raise ValueError(
                f"Token cache entry {str(self.directory)!r} is damaged: {name} holds {size} bytes, its meta.json says "
                f"{expected}. Delete that directory; the next run tokenises the file again."
            )

    @functools.cached_property
    def tokens(self) -> np.ndarray:
        """Every token id of the file, in order (1-D, ``uint16`` or ``uint32``)."""
        return _map(self.directory / TOKENS, self.dtype, (self.meta["tokens"],))

    @functools.cached_property
    def examples(self) -> np.ndarray:
        """Prompt/response data: one int64 row per example, columns :data:`EXAMPLE_COLUMNS`."""
        count = self.meta["examples"]
        assert count is not None, f"{self.directory} holds a token stream, not examples"
        return _map(self.directory / EXAMPLES, np.dtype(np.int64), (count, len(EXAMPLE_COLUMNS)))

    def __getstate__(self) -> dict[str, Any]:
        return {"directory": self.directory}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["directory"])


def _map(path: Path, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    if not np.prod(shape):
        return np.empty(shape, dtype)  # an empty file cannot be mapped
    return np.memmap(path, dtype=dtype, mode="r", shape=shape)


def cached_tokens(
    source: Path,
    *,
    cache_dir: Path,
    fingerprint: str,
    vocab_size: int,
    settings: dict[str, Any],
    batches: Callable[[], Iterable[Batch]],
) -> TokenCache:
    """The entry of ``source`` read with ``settings`` and the tokenizer of ``fingerprint``, built if missing.

    ``batches()`` reads and tokenises the file, yielding batches of records (see :data:`Batch`); it runs only when
    the entry is missing. Records with ``(prompt_length, line)`` make an entry with ``examples``.

    Raises:
        RuntimeError: ``source`` changed while it was being tokenised (the entry is not kept).
    """
    stat = source.stat()
    name = _entry_name(source, fingerprint, settings, stat)
    entry = cache_dir / name
    if (entry / META).is_file():
        _remove_earlier_versions(cache_dir, name)  # left if the build that made this entry was killed right after
        return TokenCache(entry)
    remove_leftovers(cache_dir)  # staging directories of builds that were killed
    dtype = np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)
    staging = temporary_path(entry)
    staging.mkdir(mode=0o700)
    try:
        with Progress(f"tokenising {source.name} into the token cache", None, unit="tokens") as progress:
            meta = _write(staging, batches(), dtype, vocab_size, progress)
        if (source.stat().st_size, source.stat().st_mtime_ns) != (stat.st_size, stat.st_mtime_ns):
            raise RuntimeError(
                f"{str(source)!r} changed while it was being tokenised; its token cache was not kept. Run again once "
                "the file is complete."
            )
        meta |= {"version": FORMAT_VERSION, "source": str(source.resolve()), "size": stat.st_size}
        meta |= {"mtime_ns": stat.st_mtime_ns, "tokenizer": fingerprint, "settings": settings}
        write_file_atomic(staging / META, json.dumps(meta, indent=1).encode())  # then the directory is synced
        try:
            os.rename(staging, entry)
        except OSError:
            if not (entry / META).is_file():  # not a concurrent builder that finished first
                raise
        fsync_dir(cache_dir)
    except (_DiskFull, OSError) as exc:
        if not isinstance(exc, _DiskFull) and not is_disk_full(exc):
            raise
        raise disk_full_error(
            cache_dir,
            f"the token cache of {str(source)!r}",
            exc.written if isinstance(exc, _DiskFull) else 0,
            "Nothing was kept. Free space there, or give the data module a `cache_dir` on a filesystem with room "
            "(by default the cache is under $XDG_CACHE_HOME).",
            at_least=True,
        ) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone after the rename; after a failure, the partial entry
    _remove_earlier_versions(cache_dir, name)
    return TokenCache(entry)


def _remove_earlier_versions(cache_dir: Path, name: str) -> None:
    """Remove the entries of the same file and settings other than entry ``name`` (those of earlier versions)."""
    for old in cache_dir.glob(f"{name.rsplit('-', 1)[0]}-*"):
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)


def _entry_name(source: Path, fingerprint: str, settings: dict[str, Any], stat: os.stat_result) -> str:
    identity = json.dumps([FORMAT_VERSION, str(source.resolve()), fingerprint, settings], sort_keys=True)
    version = f"{stat.st_size}:{stat.st_mtime_ns}"
    stem = re.sub(r"[^A-Za-z0-9_.]+", "_", source.stem)[:40] or "data"
    return f"{stem}-{_hash(identity, 16)}-{_hash(version, 8)}"


def _hash(text: str, length: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


class _DiskFull(Exception):
    """The cache's filesystem is full: ``written`` bytes had been handed to the files (the last write included)."""

    def __init__(self, written: int) -> None:
        super().__init__(written)
        self.written = written


def _write(
    directory: Path, batches: Iterable[Batch], dtype: np.dtype, vocab_size: int, progress: Progress
) -> dict[str, Any]:
    total, examples, top = 0, None, np.iinfo(dtype).max
    attempted = 0
    with open(directory / TOKENS, "wb") as tokens, open(directory / EXAMPLES, "wb") as index:
        try:
            for records, extras in batches:
                lengths = np.fromiter((len(r) for r in records), np.int64, len(records))
                ids = np.fromiter((i for r in records for i in r), np.int64, int(lengths.sum()))
                if ids.size and (ids.min() < 0 or ids.max() > top):
                    bad = int(ids.min() if ids.min() < 0 else ids.max())
                    raise ValueError(
                        f"The tokenizer returned the token id {bad}, outside 0…{top}: its `len(tokenizer)` is "
                        f"{vocab_size}, so its ids were stored as {dtype.name}. Fix the tokenizer's vocabulary."
                    )
                attempted += ids.size * dtype.itemsize
                tokens.write(ids.astype(dtype).tobytes())
                if extras is not None:
                    starts = total + np.cumsum(lengths) - lengths
                    rows = np.column_stack([starts, lengths, np.asarray(extras, np.int64).reshape(-1, 2)])
                    attempted += rows.size * 8
                    index.write(rows.astype(np.int64).tobytes())
                    examples = (examples or 0) + len(records)
                total += int(lengths.sum())
                progress.update(int(lengths.sum()))
            for f in (tokens, index):
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            if is_disk_full(exc):
                raise _DiskFull(attempted) from exc
            raise
    if examples is None:
        (directory / EXAMPLES).unlink()
    return {"dtype": dtype.name, "tokens": total, "examples": examples}
