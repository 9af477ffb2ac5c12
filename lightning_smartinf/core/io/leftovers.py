"""Temporary entries built beside their final place, and the removal of those a killed process left behind.

Every temporary entry the package creates (a file or directory written before its rename into place, an entry set
aside before it is deleted, a run's scratch directory) is named by :func:`temporary_path`::

    .<name>.<purpose>-<host>-<pid>.<start>-<random>

``name`` is the entry it stands for, ``purpose`` one of :data:`PURPOSES`, and ``pid`` and ``start`` (when the process
started, in clock ticks since boot) the process that made it. The name says which process made it, so one liveness
test serves every kind: an entry is left over when it was made on this host by a process that is gone
(:func:`is_left_over`); a process that has since taken the same pid (a restarted container's entrypoint is pid 1
again) started at another tick, so it does not keep its predecessor's leftovers. An entry of a live process, or of
another host sharing the filesystem (whose processes this one cannot see), is kept. :func:`remove_leftovers` removes
the left-over entries of one directory, except that an ``aside`` entry (what stood at a name while its replacement
moved in) whose name is empty is the only copy of that entry: it is put back at its name.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

#: What a temporary is for: ``tmp`` being written, ``old`` set aside to be deleted, ``aside`` what stood at a name
#: while its replacement moves in (whole until then, deleted after), ``run`` a run's scratch space.
PURPOSES = ("tmp", "old", "aside", "run")
#: ``start`` is missing from the names of earlier versions, whose processes are then told by their pid alone.
_NAME = re.compile(
    r"\.(?P<name>.+)\.(?P<purpose>tmp|old|aside|run)-(?P<host>.+)-(?P<pid>\d+)(?:\.(?P<start>\d+))?-[0-9a-f]{8}"
)


def temporary_path(target: str | os.PathLike, purpose: str = "tmp") -> Path:
    """A fresh hidden name beside ``target`` for a temporary of this process (nothing is created)."""
    if purpose not in PURPOSES:
        raise ValueError(f"`purpose={purpose!r}` is not one of {PURPOSES}.")
    target = Path(target)
    pid = os.getpid()
    process = f"{pid}.{start}" if (start := _start_ticks(pid)) is not None else str(pid)
    return target.with_name(f".{target.name}.{purpose}-{socket.gethostname()}-{process}-{secrets.token_hex(4)}")


def _start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat``'s 22nd field); ``None`` where
    it cannot be read (gone, hidden from this user, or no ``/proc``). Read from ``/proc`` because ``psutil`` offers
    it only as a float of seconds derived from the boot time, which two processes may compute a second apart."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold anything
        return int(fields[19])  # the fields after the name start at the 3rd
    except (OSError, IndexError, ValueError):
        return None


def is_left_over(name: str) -> bool:
    """Whether ``name`` is a temporary's (:func:`temporary_path`) made on this host by a process that is gone."""
    match = _NAME.fullmatch(name)
    if match is None or match["host"] != socket.gethostname():
        return False
    pid = int(match["pid"])
    if match["start"] is None:  # named by an earlier version
        return pid != os.getpid() and not psutil.pid_exists(pid)
    if (start := _start_ticks(pid)) is None:  # gone, or a process this user may not see (`hidepid`)
        return not psutil.pid_exists(pid)
    return start != int(match["start"])  # another process has the pid since


def remove_leftovers(
    directory: str | os.PathLike, name: str | None = None, *, in_use: Callable[[Path], bool] | None = None
) -> list[Path]:
    """Remove the left-over temporaries in ``directory`` (only those standing for ``name``, if given); return those
    removed. A link among them is removed itself, never what it points to; one this user may not remove is kept, and
    so is one for which ``in_use(path)`` holds (a lock a live process holds on it, whatever its name says).
    A left-over ``aside`` entry whose name is empty (a replacement killed between its two renames) is put back."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    removed = []
    for entry in entries:
        match = _NAME.fullmatch(entry.name)
        if match is None or (name is not None and match["name"] != name) or not is_left_over(entry.name):
            continue
        if in_use is not None and in_use(Path(entry.path)):
            continue
        original = os.path.join(directory, match["name"])
        if match["purpose"] == "aside" and not os.path.lexists(original):
            try:
                os.rename(entry.path, original)
                continue
            except OSError:  # taken meanwhile (by a save of a live process): this one is obsolete
                pass
        remove_entry(entry.path, missing_ok=True)
        if not os.path.lexists(entry.path):
            removed.append(Path(entry.path))
    return removed


@contextmanager
def scratch_directory(name: str, within: str | os.PathLike | None = None) -> Iterator[Path]:
    """A new private (0700) directory of this process for ``name``'s scratch work in ``within`` (default: the system
    temporary directory), named as :func:`temporary_path` names a run's; removed with everything in it on leaving.
    One that a killed process left is removed by :func:`remove_leftovers` of ``within``: for the system temporary
    directory, every run of the strategy does it (``remove_stale_temp_dirs``)."""
    directory = temporary_path(Path(tempfile.gettempdir() if within is None else within) / name, "run")
    directory.mkdir(mode=0o700)
    try:
        yield directory
    finally:
        remove_entry(directory, missing_ok=True)


def remove_entry(path: str | os.PathLike, *, missing_ok: bool = False) -> None:
    """Remove ``path`` whatever it is (a directory tree, a file, a symlink), never following a link."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=missing_ok)
    else:
        Path(path).unlink(missing_ok=missing_ok)  # also when it vanished since the check above
