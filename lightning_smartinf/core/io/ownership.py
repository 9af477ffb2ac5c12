"""One owner per device directory: an exclusive lock for the life of a backend, and a record of who holds it.

A backend claims each of its device directories (:class:`DirectoryClaim`) before it creates or truncates any file in
them and keeps the claim until it closes, so a second training pointed at a directory in use stops before touching
it, with a :class:`~lightning_smartinf.core.io.storage.StorageError` naming the process that holds it.

The claim is an ``flock`` (through ``filelock``) on ``<directory>/.smartinf.lock``. The kernel drops it when the
holder exits, however it exits, so a killed run never blocks the next one. After taking the lock the holder writes
``<directory>/.smartinf-owner.json`` (host, pid, process start, command). That record only describes a lock found
held: a stale one left by a dead process changes no decision.

Temporary device directories (``storage_paths=None``) are temporaries of purpose ``run`` standing for
``smartinf-rank<r>`` in the system temporary directory (:func:`make_temp_device_dir`), so the leftovers' one rule
(:mod:`~lightning_smartinf.core.io.leftovers`) removes those that killed runs left behind
(:func:`remove_stale_temp_dirs`).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
from filelock import Timeout, UnixFileLock

from lightning_smartinf.core.io.leftovers import remove_leftovers, temporary_path
from lightning_smartinf.core.io.storage import StorageError, write_file_atomic

#: The lock file in each claimed directory. It stays after release: unlinking a lock file that another process may
#: be opening would let the two lock different inodes.
LOCK_FILE = ".smartinf.lock"
#: The holder's record in each claimed directory, written after the lock is taken and removed before it is released.
OWNER_FILE = ".smartinf-owner.json"
_OWNER_MAX_BYTES = 1 << 16
_COMMAND_MAX_CHARS = 200


@dataclass(frozen=True)
class Owner:
    """The process that holds a claim, as it recorded itself."""

    host: str
    pid: int
    #: Unix time the process started (with ``pid`` it tells a process from a later one given the same pid).
    started: float
    command: str

    @classmethod
    def current(cls) -> Owner:
        """This process."""
        command = " ".join(" ".join([os.path.basename(sys.executable), *sys.argv]).split())  # one line
        if len(command) > _COMMAND_MAX_CHARS:
            command = command[: _COMMAND_MAX_CHARS - 3] + "..."
        return cls(socket.gethostname(), os.getpid(), psutil.Process().create_time(), command)

    def describe(self) -> str:
        """``pid N on host 'h' (`command`, started YYYY-mm-dd HH:MM:SS)``."""
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on host {self.host!r} (`{self.command}`, started {started})"

    def is_this_process(self) -> bool:
        """Whether the record names this process."""
        return self.host == socket.gethostname() and self.pid == os.getpid()


class DirectoryClaim:
    """Exclusive ownership of ``directory`` by this object until :meth:`release` (or until the process ends).

    Exclusive across processes and hosts sharing the filesystem (where it supports ``flock``) and within a process:
    a second claim on the same directory fails even from the same thread.

    Args:
        directory: an existing directory; the lock file and the owner record are created in it.

    Raises:
        StorageError: the directory is held by another claim (message: the directory, the holder's host and pid, and
            what to do), its filesystem has no ``flock``, or the lock or record cannot be written.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self._lock: UnixFileLock | None = _acquire_lock(self.directory)
        try:
            self.owner = Owner.current()
            write_file_atomic(self.directory / OWNER_FILE, json.dumps(asdict(self.owner)).encode())
        except OSError as exc:
            self.release()
            raise StorageError(
                f"Cannot record the owner of {str(self.directory)!r} ({exc}). Check the filesystem has space and is "
                "writable.",
                path=self.directory,
                operation="claim",
                errno=exc.errno,
            ) from None
        except BaseException:
            self.release()
            raise

    @property
    def held(self) -> bool:
        """Whether this object still holds the directory."""
        return self._lock is not None

    def release(self) -> None:
        """Give the directory up: remove the owner record, then drop the lock. Idempotent."""
        lock, self._lock = self._lock, None
        if lock is None:
            return
        try:
            os.unlink(self.directory / OWNER_FILE)
        except OSError:
            pass  # already removed with the directory (a temporary one), or never written
        finally:
            lock.release(force=True)

    def __enter__(self) -> DirectoryClaim:
        return self

    def __exit__(self, *_: Any) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"DirectoryClaim({str(self.directory)!r}, held={self.held})"


def claim_directories(directories: Sequence[str | os.PathLike]) -> list[DirectoryClaim]:
    """Claim every directory, or none: on failure the claims already taken are released before the error propagates.

    Raises:
        StorageError: see :class:`DirectoryClaim`.
    """
    claims: list[DirectoryClaim] = []
    try:
        for directory in directories:
            claims.append(DirectoryClaim(directory))
    except BaseException:
        release_claims(claims)
        raise
    return claims


def release_claims(claims: Sequence[DirectoryClaim], *, remove: Sequence[str | os.PathLike] = ()) -> None:
    """Remove the directories in ``remove`` (best effort), then release ``claims`` in reverse order. Idempotent.

    Removing before releasing means no other process can claim a directory while it is half removed.
    """
    try:
        for directory in remove:
            shutil.rmtree(directory, ignore_errors=True)
    finally:
        for claim in reversed(claims):
            claim.release()


def check_unclaimed(directories: Sequence[str | os.PathLike]) -> None:
    """Raise :class:`StorageError` if a directory is claimed right now; hold nothing afterwards.

    For failing fast before expensive set-up; only a :class:`DirectoryClaim` guarantees the directory stays free.
    """
    for directory in directories:
        _acquire_lock(Path(directory)).release(force=True)


def read_owner(directory: str | os.PathLike) -> Owner | None:
    """The owner record in ``directory`` (``None`` if absent or unreadable). Describes a holder only while locked."""
    try:
        fd = os.open(Path(directory) / OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            data = json.loads(f.read(_OWNER_MAX_BYTES))
        return Owner(str(data["host"]), int(data["pid"]), float(data["started"]), str(data["command"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


# ------------------------------------------------------------------------------------------ temporary directories


def make_temp_device_dir(rank: int) -> Path:
    """A new private (0700) temporary device directory for ``rank`` in the system temporary directory."""
    directory = temporary_path(Path(tempfile.gettempdir()) / f"smartinf-rank{rank}", "run")
    directory.mkdir(mode=0o700)
    return directory


def remove_stale_temp_dirs(root: str | os.PathLike | None = None) -> list[Path]:
    """Remove the temporaries in ``root`` (default: the system temporary directory) that dead processes of this host
    left, temporary device directories among them; return those removed. A device directory whose claim is held is
    kept whatever its name says: its holder runs in another PID namespace (a container of the same host name sharing
    the directory), where its pid names another process or none."""
    return remove_leftovers(tempfile.gettempdir() if root is None else root, in_use=_claimed)


def _claimed(directory: Path) -> bool:
    """Whether ``directory`` holds a claim's lock file that a process holds now."""
    if os.path.islink(directory) or not (directory / LOCK_FILE).is_file():
        return False
    try:
        _acquire_lock(directory).release(force=True)
    except StorageError:
        return True  # held, or it cannot be locked: left alone either way
    return False


# ---------------------------------------------------------------------------------------------------- internals


def _acquire_lock(directory: Path) -> UnixFileLock:
    """The directory's lock, held. Raises :class:`StorageError` if another holder has it (the "in use" error naming
    the holder) or on other errors."""
    lock = UnixFileLock(directory / LOCK_FILE, timeout=0, thread_local=False, mode=0o600)
    try:
        lock.acquire()
    except Timeout:
        raise StorageError(_in_use_message(directory), path=directory, operation="claim") from None
    except OSError as exc:
        raise StorageError(
            f"Cannot lock {str(directory)!r} to claim it for this training ({exc}). Check the directory exists and is "
            "writable by this user.",
            path=directory,
            operation="claim",
            errno=exc.errno,
        ) from None
    if not isinstance(lock, UnixFileLock):
        # filelock fell back to an existence lock (no flock on this filesystem), which a killed run would leave held.
        lock.release(force=True)
        raise StorageError(
            f"The filesystem of {str(directory)!r} does not support `flock`, which SmartUpdate uses to keep two "
            "trainings off one storage path. Choose a storage path on a local filesystem.",
            path=directory,
            operation="claim",
        )
    return lock


def _in_use_message(directory: Path) -> str:
    owner = read_owner(directory)
    fix = "Wait for that training to finish, stop it, or choose another storage path."
    if owner is not None and owner.is_this_process():
        holder = f"this process (pid {owner.pid} on host {owner.host!r}): a backend on it is still open"
        fix = "Close that backend first, or give this one another directory."
    elif owner is not None and (owner.host != socket.gethostname() or _alive(owner)):
        holder = owner.describe()
    else:  # the record is missing or a dead process's: the holder took the lock but has not recorded itself yet
        holder = "another process, which has not recorded itself yet"
    return (
        f"Storage directory {str(directory)!r} is in use by {holder}. Two trainings on one directory would overwrite "
        f"each other's optimizer state, so this one stops before touching it. {fix}"
    )


def _alive(owner: Owner) -> bool:
    try:
        return abs(psutil.Process(owner.pid).create_time() - owner.started) < 1.0
    except psutil.Error:
        return False
