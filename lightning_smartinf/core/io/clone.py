"""Copying a state file into a checkpoint as cheaply as its filesystem allows.

In order of preference:

1. ``clone``: ``ioctl(FICLONE)`` makes the new file share the old one's blocks (XFS with reflinks, btrfs, bcachefs,
   OCFS2): no byte is read or written and no space is used until either file changes; later writes to the live
   file go to new blocks (copy on write), so the checkpoint keeps the bytes as they were.
2. ``kernel copy``: ``copy_file_range`` copies inside the kernel (and still shares blocks where the filesystem can,
   e.g. NFS 4.2 server-side copy): the bytes never pass through this process.
3. ``copy``: reads and writes in user space, for filesystems that support neither (or another filesystem than the
   source's, on kernels that refuse a cross-filesystem ``copy_file_range``).

The caller knows the source's checksum already (its records' CRCs, kept as the devices wrote them): nothing here
reads the bytes to checksum them. The destination is created exclusively (mode 0600).
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from lightning_smartinf.core.io.leftovers import remove_leftovers, temporary_path

#: ``_IOW(0x94, 9, int)``: clone a whole file (Linux >= 4.5).
FICLONE = 0x40049409
CLONE, KERNEL_COPY, COPY = "clone", "kernel copy", "copy"
_BLOCK = 8 << 20
#: errnos by which a filesystem says it cannot do the faster method (then the next one is tried).
_UNSUPPORTED = {errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EBADF, errno.EPERM}


def clone_file(src: Path, dst: Path, size: int, *, fsync: bool = True) -> str:
    """Make ``dst`` (must not exist) a copy of the first ``size`` bytes of ``src``; return how: :data:`CLONE`,
    :data:`KERNEL_COPY` or :data:`COPY`. ``fsync=False`` leaves forcing ``dst`` to disk to the caller (who copies
    several files: one flush after all of them keeps the disk reading and writing meanwhile).

    Raises ``ValueError`` if ``src`` does not hold exactly ``size`` bytes, ``OSError`` for an I/O error (a full disk
    included); a failed ``dst`` is removed.
    """
    fin = os.open(src, os.O_RDONLY)
    try:
        actual = os.fstat(fin).st_size
        if actual != size:
            raise ValueError(f"State file {src} holds {actual} B, expected {size} B (truncated?).")
        out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            how = _clone(fin, out) or _kernel_copy(fin, out, size) or _copy(fin, out, size)
            if fsync:
                os.fsync(out)
        except BaseException:
            os.close(out)
            os.unlink(dst)
            raise
        os.close(out)
        return how
    finally:
        os.close(fin)


def _clone(fin: int, out: int) -> str | None:
    try:
        fcntl.ioctl(out, FICLONE, fin)
    except OSError as exc:
        if exc.errno in _UNSUPPORTED:
            return None
        raise
    return CLONE


def _kernel_copy(fin: int, out: int, size: int) -> str | None:
    done = 0
    try:
        while done < size:
            n = os.copy_file_range(fin, out, size - done, done, done)
            if n == 0:
                raise OSError(errno.EIO, f"copy_file_range stopped at byte {done} of {size}")
            done += n
    except OSError as exc:
        if done == 0 and exc.errno in _UNSUPPORTED:
            return None
        raise
    return KERNEL_COPY


def _copy(fin: int, out: int, size: int) -> str:
    buf = bytearray(min(_BLOCK, max(size, 1)))
    view = memoryview(buf)
    done = 0
    while done < size:
        n = os.preadv(fin, [view[: min(len(buf), size - done)]], done)
        if n == 0:
            raise OSError(errno.EIO, f"unexpected end of the source at byte {done} of {size}")
        written = 0
        while written < n:
            written += os.pwrite(out, view[written:n], done + written)
        done += n
    return COPY


#: What the clone probe's files stand for (named by :func:`temporary_path`, so a killed probe's are leftovers).
CLONE_PROBE = "smartinf-clone-probe"


def can_clone(directory: Path) -> bool:
    """Whether files in ``directory`` clone (``FICLONE`` between two files there works); probed with two empty
    files, removed again (those of a probe that was killed, first). ``False`` where the probe cannot even create
    them."""
    remove_leftovers(directory, CLONE_PROBE)
    src, dst = temporary_path(Path(directory) / CLONE_PROBE), temporary_path(Path(directory) / CLONE_PROBE)
    try:
        fin = os.open(src, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return False
    try:
        os.write(fin, b"\0" * 4096)
        out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            return _clone(fin, out) is not None
        finally:
            os.close(out)
    except OSError:
        return False
    finally:
        os.close(fin)
        src.unlink(missing_ok=True)
        dst.unlink(missing_ok=True)
