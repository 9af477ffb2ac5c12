"""Storage paths: checks and preparation (existence or creation, permissions, free space), the disk they are on,
fsyncs, atomic writes."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path

from lightning_smartinf.core.io.leftovers import remove_leftovers, temporary_path

GIB = 1024**3


BINARY_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
#: Decimal units, as disks are sold and rated (terabytes written).
DECIMAL_UNITS = (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3))


def readable_size(nbytes: float, *, decimal: bool = False) -> str:
    """``nbytes`` with three significant digits, in binary units (``"9.61 GiB"``, ``"257 KiB"``, ``"12 B"``) or
    ``decimal`` ones (``"96.4 GB"``)."""
    for unit, scale in DECIMAL_UNITS if decimal else BINARY_UNITS:
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


class StorageError(RuntimeError, OSError):
    """A storage path cannot hold or serve the device state.

    Also an :class:`OSError`, so code written for I/O errors handles it. An error of a device's storage says what
    failed in ``path`` (the state file or the device directory), ``operation`` (``"read"``, ``"write"``,
    ``"stat"``, ...) and ``errno`` (``errno.ETIMEDOUT`` for a device that stopped answering); each is ``None``
    where it does not apply (a disk found too small before anything was written).
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike | None = None,
        operation: str | None = None,
        errno: int | None = None,
    ) -> None:
        super().__init__(message)
        self.path = None if path is None else Path(path)
        self.operation = operation
        self.errno = errno

    def __str__(self) -> str:
        # OSError would print "[Errno N] ..." from its fields; the message already names them.
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple:
        return type(self), self.args, {"path": self.path, "operation": self.operation, "errno": self.errno}

    @staticmethod
    def errno_label(code: int | None) -> str:
        """``code`` as its name and number, e.g. ``EIO (5)``."""
        if code is None:
            return "no errno"
        return f"{errno.errorcode.get(code, 'E?')} ({code})"

    @classmethod
    def from_os_error(cls, exc: OSError, *, path: str | os.PathLike, operation: str, where: str = "") -> StorageError:
        """The error of a system call that failed on a device's storage, with what to do about it.

        ``where`` adds to the path (e.g. ``" at byte 4096"``).
        """
        return cls(
            f"Device {operation} of {str(path)!r}{where} failed with {cls.errno_label(exc.errno)}: "
            f"{exc.strerror or exc}. The storage under the device state failed (a failing disk, a full "
            "thin-provisioned or copy-on-write filesystem, a path that vanished), so the state there may be torn. "
            "Fix the storage, then resume from the last checkpoint.",
            path=path,
            operation=operation,
            errno=exc.errno,
        )


def validate_storage_path(
    path: str | os.PathLike, argument: str = "storage_paths", *, missing_ok: bool = False
) -> Path:
    """Return ``path`` resolved, or raise a :class:`ValueError` saying what is wrong and how to fix it.

    ``missing_ok``: a path that does not exist yet is accepted when :func:`create_storage_path` can create it (its
    parent is an existing directory this user may write to); nothing is created here.
    """
    try:
        resolved = Path(path).expanduser().resolve()
    except (RuntimeError, OSError) as exc:  # RuntimeError: Python < 3.13's "Symlink loop from ..."
        if isinstance(exc, RuntimeError) or exc.errno == errno.ELOOP:
            raise ValueError(
                f"`{argument}` entry {str(path)!r} goes through a symbolic link loop (links that lead back to one "
                "another). Remove a link of the loop or fix the path."
            ) from None
        raise
    if not resolved.exists():
        if not missing_ok:
            raise ValueError(f"`{argument}` entry {str(path)!r} does not exist. Create the directory or fix the path.")
        if problem := _not_creatable(resolved):
            via = "" if str(resolved) == str(path) else f" (resolved: {str(resolved)!r})"
            raise ValueError(f"`{argument}` entry {str(path)!r}{via} does not exist and cannot be created: {problem}")
        return resolved
    if not resolved.is_dir():
        raise ValueError(
            f"`{argument}` entry {str(path)!r} is not a directory. Pass the mount point or a folder on it."
        )
    if not os.access(resolved, os.W_OK | os.X_OK):
        raise ValueError(
            f"`{argument}` entry {str(path)!r} is not writable by this user. "
            "Choose a directory you own or fix its permissions."
        )
    return resolved


def _not_creatable(path: Path) -> str | None:
    """Why the missing directory ``path`` (resolved) cannot be created, or ``None`` if it can be."""
    parent = path.parent
    if not parent.exists():
        ancestor = parent
        while not ancestor.exists() and ancestor != ancestor.parent:
            ancestor = ancestor.parent
        if not ancestor.is_dir():
            return f"{str(ancestor)!r} is a file, not a directory, so nothing can be created below it. Fix the path."
        return (
            f"its parent {str(parent)!r} does not exist (only the last component of a storage path is created). "
            "Mount the disk or create the parent, or fix the path."
        )
    if not parent.is_dir():
        return f"its parent {str(parent)!r} is a file, not a directory. Fix the path."
    if not os.access(parent, os.W_OK | os.X_OK):
        try:
            read_only = bool(os.statvfs(parent).f_flag & os.ST_RDONLY)
        except OSError:
            read_only = False
        return (
            f"its parent {str(parent)!r} is on a read-only filesystem. Remount it read-write or choose another path."
            if read_only
            else f"its parent {str(parent)!r} is not writable by this user. Create the directory yourself (e.g. "
            "with sudo, then chown it), fix the parent's permissions, or choose another path."
        )
    return None


def create_storage_path(path: str | os.PathLike) -> bool:
    """Create the storage path ``path`` (one directory, 0700) unless it exists; return whether this call created it.

    Safe against other ranks and nodes creating it at the same time: a directory that appears meanwhile is used as
    it is. An existing directory is never modified (its mode stays the user's).

    Raises:
        StorageError: ``path`` cannot be created (parent missing or not writable, read-only filesystem) or
            something other than a directory is in the way. The message names the path and why.
    """
    path = Path(path)
    if path.is_dir():
        return False
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        if path.is_dir():
            return False  # created by another rank or node in the meantime
        raise StorageError(
            f"Storage path {str(path)!r} exists but is not a directory (a file or a broken symbolic link is in the "
            "way). Move it away or choose another storage path.",
            path=path,
            operation="mkdir",
            errno=errno.EEXIST,
        ) from None
    except OSError as exc:
        raise StorageError(
            f"Cannot create storage path {str(path)!r} ({exc.strerror}). Create it yourself, make "
            f"{str(path.parent)!r} writable by this user, or choose another storage path.",
            path=path,
            operation="mkdir",
            errno=exc.errno,
        ) from None
    # mkdir's mode is masked by the umask; make it private through a descriptor, following no link.
    make_private_dirs(path.parent, (path.name,))
    return True


#: Opens a directory itself, never the target of a symbolic link in its place.
_NOFOLLOW_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def make_private_dirs(base: str | os.PathLike, parts: Sequence[str]) -> Path:
    """Create ``base/parts[0]/.../parts[-1]`` one component at a time, each private (0700); return the leaf.

    Every component below ``base`` ends as a directory of this user with mode 0700, whether it was created now or
    existed. No symbolic link below ``base`` is followed: components are opened relative to their parent's
    descriptor with ``O_NOFOLLOW`` and chmodded through that descriptor. ``base`` itself (the user's storage path,
    resolved once by the caller) is used as it is and not modified.

    Raises:
        ValueError: a part is empty, ``.``, ``..`` or contains a path separator.
        StorageError: ``base`` is not a directory; or a component is a symbolic link, is not a directory, or cannot
            be created or made private (another user's, read-only filesystem). The message names the component.
    """
    for part in parts:
        if part in ("", ".", "..") or os.sep in part or (os.altsep is not None and os.altsep in part):
            raise ValueError(f"`parts` entry {part!r} must be one path component (not empty, `.`, `..` or with `/`).")
    base = Path(base)
    try:
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise StorageError(
            f"Storage path {str(base)!r} cannot be opened as a directory ({exc.strerror}). Pass an existing directory.",
            path=base,
            operation="open",
            errno=exc.errno,
        ) from None
    path = base
    try:
        for part in parts:
            path = path / part
            try:
                os.mkdir(part, 0o700, dir_fd=fd)
            except FileExistsError:
                pass
            except OSError as exc:
                # Some filesystems report EROFS or EACCES before EEXIST: an existing component is still usable.
                try:
                    os.lstat(part, dir_fd=fd)
                except OSError:
                    raise StorageError(
                        f"Cannot create directory {str(path)!r} ({exc.strerror}). Make {str(path.parent)!r} writable "
                        "by this user or choose another storage path.",
                        path=path,
                        operation="mkdir",
                        errno=exc.errno,
                    ) from None
            try:
                child = os.open(part, _NOFOLLOW_DIR, dir_fd=fd)
            except OSError as exc:
                raise _not_a_private_dir(path, part, fd, exc) from None
            os.close(fd)
            fd = child
            try:
                os.fchmod(fd, 0o700)
            except OSError as exc:
                raise StorageError(
                    f"Directory {str(path)!r} cannot be made private to this user ({exc.strerror}; it belongs to "
                    f"uid {os.fstat(fd).st_uid}, this process runs as uid {os.geteuid()}). Remove it or choose "
                    "another storage path.",
                    path=path,
                    operation="chmod",
                    errno=exc.errno,
                ) from None
    finally:
        os.close(fd)
    return path


def _not_a_private_dir(path: Path, part: str, parent_fd: int, exc: OSError) -> StorageError:
    try:
        mode = os.lstat(part, dir_fd=parent_fd).st_mode
    except OSError:
        mode = None
    if mode is not None and stat.S_ISLNK(mode):
        return StorageError(
            f"{str(path)!r} is a symbolic link where SmartUpdate keeps a private directory; links below the storage "
            "path are never followed (they could send the optimizer state elsewhere). Remove the link, or pass the "
            "directory it points to as the storage path.",
            path=path,
            operation="open",
        )
    if mode is not None and not stat.S_ISDIR(mode):
        return StorageError(
            f"{str(path)!r} exists but is not a directory, and SmartUpdate keeps a private directory there. Move it "
            "away or choose another storage path.",
            path=path,
            operation="open",
        )
    return StorageError(
        f"Cannot open directory {str(path)!r} ({exc.strerror}). Check its permissions.",
        path=path,
        operation="open",
        errno=exc.errno,
    )


def ensure_private_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` and its missing parents, each private (0700), and make ``path`` private; return it.

    The existing ancestors are used as they are (their symbolic links followed); from the nearest one down, nothing
    is followed (see :func:`make_private_dirs`): in particular ``path`` must not be a symbolic link.
    """
    path = Path(os.path.abspath(path))
    base, missing = path.parent, [path.name]
    while not os.path.lexists(base) and base != base.parent:
        base, missing = base.parent, [base.name, *missing]
    return make_private_dirs(base, missing)


def disk_bytes(path: str | os.PathLike) -> int:
    """The blocks the filesystem holds for ``path`` (a file, a link or a whole directory tree; links are not
    followed), in bytes: the most that deleting it frees (less where its blocks are shared, as a clone's are)."""
    try:
        total = os.lstat(path).st_blocks * 512
    except OSError:
        return 0
    if os.path.isdir(path) and not os.path.islink(path):
        for directory, dirnames, filenames in os.walk(path):
            for name in dirnames + filenames:
                with contextlib.suppress(OSError):  # gone meanwhile
                    total += os.lstat(os.path.join(directory, name)).st_blocks * 512
    return total


def check_free_space(directory: Path, needed: int, reusable: Sequence[Path] = ()) -> None:
    """Raise :class:`StorageError` unless ``directory``'s filesystem can take ``needed`` more bytes.

    ``reusable`` files will be overwritten, so the blocks they already occupy count as free.
    """
    reclaimable = sum(p.stat().st_blocks * 512 for p in reusable if p.is_file())
    free = shutil.disk_usage(directory).free + reclaimable
    if free < needed:
        raise disk_full_error(
            directory,
            "the optimizer state placed there",
            needed,
            "Nothing was written. Free space, add `storage_paths` to spread the state, or choose a larger disk.",
            free=free,
        )


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` is a filesystem out of space (or of the user's quota)."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def disk_of(path: str | os.PathLike) -> Path | None:
    """The ``/sys/dev/block`` directory of the disk holding ``path``: a partition's whole disk, any other block device
    (a loop or device-mapper device) as it is; ``None`` where its filesystem is on none (tmpfs, overlay, network) or
    ``path`` cannot be read. The disk's name is the directory's, its ``major:minor`` in its ``dev`` file."""
    try:
        device = os.stat(path).st_dev
        block = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}").resolve(strict=True)
    except OSError:
        return None
    return block.parent if (block / "partition").exists() else block


def nearest_existing(path: str | os.PathLike) -> Path:
    """``path`` if it exists, else its nearest existing parent: where the rest of it would be created (``/``, or
    ``.`` for a relative path, at worst). A parent this user may not look into counts as missing."""
    path = Path(path)
    return next((p for p in (path, *path.parents) if os.path.exists(p)), Path(path.anchor or "."))


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes of the filesystem holding ``path`` (or its nearest existing parent); ``None`` when unknown."""
    try:
        return shutil.disk_usage(nearest_existing(os.path.abspath(path))).free
    except OSError:
        return None


def disk_full_error(
    path: str | os.PathLike,
    what: str,
    needed: int,
    fix: str,
    *,
    at_least: bool = False,
    free: int | None = None,
) -> StorageError:
    """The one error of a write a full filesystem refused (or would refuse): where, what was being written, the bytes
    it needs (``at_least``: more than that, where the whole is not known in advance) and the filesystem has free
    (``free``, or as it is now), and the fix. Raise it ``from`` the ``OSError`` when there was one."""
    free = free_bytes(path) if free is None else free
    has = "an unknown amount" if free is None else readable_size(free)
    needs = f"more than {readable_size(needed)}" if at_least else readable_size(needed)
    return StorageError(
        f"No space left on the filesystem of {str(path)!r} for {what}: it needs {needs} and the "
        f"filesystem has {has} free. {fix}",
        path=path,
        operation="write",
        errno=errno.ENOSPC,
    )


def fsync_file(path: Path, flags: int = 0) -> None:
    """Force a file's data and size to disk; ``flags`` are added to the read-only open (e.g. ``os.O_NOFOLLOW``)."""
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: Path) -> None:
    """Force a directory's entries (creations, renames) to disk."""
    fsync_file(directory, os.O_DIRECTORY)


def write_file_atomic(path: Path, data: bytes | Iterable[bytes | memoryview]) -> None:
    """Write ``data`` (bytes, or blocks of them in order) to ``path`` (mode 0600) through a fsynced temporary sibling
    and a rename: readers see old or new, whole. ``O_EXCL`` creates the sibling, so no link is ever written through.
    The siblings that killed writes of ``path`` left are removed first."""
    path = Path(path)
    remove_leftovers(path.parent, path.name)
    tmp = temporary_path(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        try:
            for block in [data] if isinstance(data, bytes) else data:
                view = memoryview(block).cast("B")
                done = 0
                while done < len(view):
                    done += os.write(fd, view[done:])
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
