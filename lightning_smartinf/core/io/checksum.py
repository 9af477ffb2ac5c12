"""Checksums of state files: CRC-32C of each record as it is written, combined into the CRC-32C of a whole file.

A device computes the CRC-32C of every chunk record it writes (the ``crc32c`` package: the CPU's CRC instruction,
about 12 GB/s on one core, the GIL released, any buffer without a copy), so a checkpoint that clones a state file knows
the file's checksum without reading it again: :func:`combine` folds the records' CRCs in file order. Checkpoints
written before record checksums existed carry zlib's CRC-32 (:data:`CRC32`); :func:`file_checksum` computes either.

Invariant: for the reflected CRC-32C, ``crc(a + b) == combine(crc(a), crc(b), len(b))`` for any byte strings
``a`` and ``b`` (tested on random data).
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable
from pathlib import Path

from crc32c import crc32c  # crc32c(data, value=0): CRC-32C of data, continuing from value (the bytes before's)

#: The checksum a state file's manifest entry names by its key: ``crc32c`` now, ``crc32`` (zlib) in older checkpoints.
CRC32C = "crc32c"
CRC32 = "crc32"
#: Bytes read per call when a whole file is checksummed.
READ_BLOCK = 8 << 20

_POLY = 0x82F63B78  # CRC-32C (Castagnoli), reflected


#: The running-checksum function of each algorithm: ``update(bytes, previous) -> checksum``.
UPDATERS: dict[str, Callable[[memoryview, int], int]] = {CRC32C: crc32c, CRC32: zlib.crc32}


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the CRC polynomial, both in the reflected bit order of the CRC register."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


#: ``x^(2^n)`` modulo the polynomial, n = 0..31.
_X2N = [1 << 30]
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


@functools.lru_cache(maxsize=64)
def _shift_by(nbytes: int) -> int:
    """``x^(8 * nbytes)`` modulo the polynomial: the operator that appends ``nbytes`` to a CRC."""
    p, k = 1 << 31, 3
    while nbytes:
        if nbytes & 1:
            p = _multmodp(_X2N[k & 31], p)
        nbytes >>= 1
        k += 1
    return p


def combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32C of ``a + b`` from ``crc1 = crc32c(a)``, ``crc2 = crc32c(b)`` and ``len2 = len(b)``."""
    return _multmodp(_shift_by(len2), crc1) ^ crc2


def file_checksum(path: Path, algorithm: str = CRC32C) -> tuple[int, int]:
    """``(size, checksum)`` of the file at ``path`` with ``algorithm`` (:data:`CRC32C` or :data:`CRC32`)."""
    update = UPDATERS[algorithm]
    buf = bytearray(READ_BLOCK)
    view = memoryview(buf)
    crc = total = 0
    with open(path, "rb", buffering=0) as fin:
        while n := fin.readinto(buf):
            crc = update(view[:n], crc)
            total += n
    return total, crc


def checksum_of(entry: dict, where: object) -> tuple[str, int]:
    """``(algorithm, value)`` of a manifest or seal entry that records one; a ``ValueError`` naming ``where``."""
    for algorithm in (CRC32C, CRC32):
        if isinstance(entry.get(algorithm), int) and not isinstance(entry.get(algorithm), bool):
            return algorithm, entry[algorithm]
    raise ValueError(f"{where}: the entry {entry!r} records no checksum ({CRC32C!r} or {CRC32!r}).")
