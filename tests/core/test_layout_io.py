"""Chunk-record layout arithmetic, aligned buffers and direct positional file I/O."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from lightning_smartinf.core.format.layout import ELEM_ALIGN, ChunkLayout
from lightning_smartinf.core.io import direct as csd_io
from lightning_smartinf.core.io.direct import IO_ALIGN, StateFile, aligned_empty, round_up


def test_constants() -> None:
    assert IO_ALIGN == 4096
    assert ELEM_ALIGN == 1024


# numel, chunk_elems, num_states -> num_chunks, last chunk (start, length), last padded_len, file_bytes
LAYOUTS = [
    (0, 4096, 2, 1, (0, 0), 1024, 1024 * 4 * 3),
    (1, 4096, 2, 1, (0, 1), 1024, 1024 * 4 * 3),
    (1023, 4096, 1, 1, (0, 1023), 1024, 1024 * 4 * 2),
    (1024, 4096, 0, 1, (0, 1024), 1024, 1024 * 4),
    (1025, 4096, 1, 1, (0, 1025), 2048, 2048 * 4 * 2),
    (4096, 4096, 2, 1, (0, 4096), 4096, 4096 * 4 * 3),
    (4097, 4096, 2, 2, (4096, 1), 1024, 4096 * 4 * 3 + 1024 * 4 * 3),
    (3 * 4096 + 5, 4096, 3, 4, (3 * 4096, 5), 1024, 3 * 4096 * 16 + 1024 * 16),
    (10_000, 3072, 1, 4, (9216, 784), 1024, 3 * 3072 * 8 + 1024 * 8),
    (1 << 20, 1 << 18, 2, 4, (3 << 18, 1 << 18), 1 << 18, (1 << 20) * 12),
]


@pytest.mark.parametrize(("numel", "chunk", "states", "chunks", "last", "last_padded", "file_bytes"), LAYOUTS)
def test_chunk_layout(numel, chunk, states, chunks, last, last_padded, file_bytes) -> None:
    layout = ChunkLayout(numel, chunk, states)
    assert layout.tensors_per_record == 1 + states
    assert layout.num_chunks == chunks
    assert layout.chunk_range(chunks - 1) == last
    assert layout.padded_len(chunks - 1) == last_padded
    assert layout.file_bytes == file_bytes
    covered = 0
    for k in range(chunks):
        start, length = layout.chunk_range(k)
        assert start == covered  # chunks tile the shard in order, without gaps or overlaps
        covered += length
        assert layout.record_offset(k) % IO_ALIGN == 0
        assert layout.record_bytes(k) % IO_ALIGN == 0
        assert layout.padded_len(k) % ELEM_ALIGN == 0 and layout.padded_len(k) >= length
        assert layout.record_bytes(k) == layout.padded_len(k) * 4 * (1 + states)
        if k + 1 < chunks:
            assert layout.chunk_range(k)[1] == chunk
            assert layout.record_offset(k) + layout.record_bytes(k) == layout.record_offset(k + 1)
    assert covered == numel
    assert layout.record_offset(chunks - 1) + layout.record_bytes(chunks - 1) == layout.file_bytes


def test_chunk_range_past_end_is_empty() -> None:
    layout = ChunkLayout(5000, 4096, 1)
    assert layout.chunk_range(1) == (4096, 904)
    assert layout.chunk_range(2) == (8192, 0)


@pytest.mark.parametrize("chunk", [0, -1024, 1000, 1025, 4095])
def test_chunk_layout_rejects_bad_chunk(chunk) -> None:
    with pytest.raises(ValueError, match="chunk_elems"):
        ChunkLayout(10, chunk, 1)


def test_round_up() -> None:
    assert [round_up(n, 1024) for n in (0, 1, 1023, 1024, 1025, 2048)] == [0, 1024, 1024, 1024, 2048, 2048]


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("nbytes", [4096, 8192, 3 * 4096, 1 << 20])
def test_aligned_empty(nbytes, dtype) -> None:
    keep = []  # keep earlier allocations alive so later ones land at other addresses
    for _ in range(8):
        t = aligned_empty(nbytes, dtype)
        keep.append(t)
        assert t.data_ptr() % IO_ALIGN == 0
        assert t.dtype == dtype
        assert t.numel() * t.element_size() == nbytes
        assert t.is_contiguous()
        t.view(torch.uint8).fill_(7)  # the whole range is writable
    assert len({t.data_ptr() for t in keep}) == len(keep)


def test_aligned_empty_default_dtype() -> None:
    t = aligned_empty(4096)
    assert t.dtype == torch.uint8 and t.numel() == 4096


def _round_trip(path: Path) -> StateFile:
    size = 4 * IO_ALIGN
    f = StateFile(path, size, create=True)
    try:
        assert path.stat().st_size == size
        gen = torch.Generator().manual_seed(0)
        a = aligned_empty(IO_ALIGN, torch.float32)
        a.copy_(torch.randn(a.numel(), generator=gen))
        b = aligned_empty(2 * IO_ALIGN, torch.float32)
        b.copy_(torch.randn(b.numel(), generator=gen))
        f.write_from(a, 0)
        f.write_from(b, 2 * IO_ALIGN)
        f.sync()
        got = aligned_empty(4 * IO_ALIGN, torch.float32)
        f.read_into(got, 0)
        n = IO_ALIGN // 4
        assert torch.equal(got[:n], a)
        assert torch.count_nonzero(got[n : 2 * n]) == 0  # never written: zero
        assert torch.equal(got[2 * n :], b)
    finally:
        f.close()
    # Persisted: a second handle (create=False) reads the same bytes and does not truncate.
    g = StateFile(path, size, create=False)
    try:
        assert path.stat().st_size == size
        got = aligned_empty(2 * IO_ALIGN, torch.float32)
        g.read_into(got, 2 * IO_ALIGN)
        assert torch.equal(got, b)
        # Reading past the end is an error, not a silent short read.
        with pytest.raises(OSError, match="end of state file"):
            g.read_into(aligned_empty(2 * IO_ALIGN, torch.float32), 3 * IO_ALIGN)
    finally:
        g.close()
    return f


def _supports_o_direct(directory: Path) -> bool:
    probe = directory / ".o_direct_probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    finally:
        probe.unlink(missing_ok=True)
    os.close(fd)
    return True


def test_state_file_round_trip(tmp_path) -> None:
    f = _round_trip(tmp_path / "shard.state")
    assert f.direct == _supports_o_direct(tmp_path)
    assert f.path == tmp_path / "shard.state"


def test_state_file_round_trip_tmpfs(tmp_path, small_fs) -> None:
    """tmpfs refuses O_DIRECT before Linux 6.6 and accepts it after; the file works either way."""
    directory = small_fs("16m")
    f = _round_trip(directory / "shard.state")
    assert f.direct == _supports_o_direct(directory)


def test_state_file_falls_back_without_o_direct(tmp_path, monkeypatch) -> None:
    """A filesystem that refuses O_DIRECT (EINVAL at open, as tmpfs did before 6.6): buffered I/O, same data."""
    real_open = os.open

    def refuse_direct(path, flags, mode=0o777, **kwargs):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, mode, **kwargs)

    monkeypatch.setattr(csd_io.os, "open", refuse_direct)
    f = _round_trip(tmp_path / "shard.state")
    assert f.direct is False


def test_state_file_other_open_errors_propagate(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        StateFile(tmp_path / "missing.state", 4096, create=False)
    with pytest.raises(FileNotFoundError):
        StateFile(tmp_path / "no" / "dir.state", 4096, create=True)


def test_state_file_create_resizes_existing(tmp_path) -> None:
    path = tmp_path / "shard.state"
    path.write_bytes(b"x" * 100_000)
    StateFile(path, 8192, create=True).close()
    assert path.stat().st_size == 8192
    fresh = tmp_path / "fresh.state"
    StateFile(fresh, 4096, create=True).close()
    assert fresh.stat().st_mode & 0o077 == 0  # new state files are private to the user


def test_state_file_close_is_idempotent(tmp_path) -> None:
    f = StateFile(tmp_path / "s.state", 4096, create=True)
    f.close()
    f.close()
    with pytest.raises(OSError) as info:
        f.read_into(aligned_empty(4096), 0)
    assert info.value.errno == errno.EBADF


@pytest.mark.parametrize(("numel", "chunk", "states"), [row[:3] for row in LAYOUTS if row[0] > 1])
def test_read_shard_masters_reads_any_range_of_the_masters(tmp_path, numel, chunk, states) -> None:
    """A range of a shard's masters, read from its chunk records alone, is that range of the masters, wherever it
    starts and ends (inside a chunk, across chunks, empty); the states beside them and the padding are never read."""
    from lightning_smartinf.core.format.state_files import read_shard_masters

    layout = ChunkLayout(numel, chunk, states)
    masters = torch.arange(numel, dtype=torch.float32)
    raw = torch.full((layout.file_bytes // 4,), -1.0)  # the states and the padding: never a master's value
    for k in range(layout.num_chunks):
        start, length = layout.chunk_range(k)
        first = layout.record_offset(k) // 4
        raw[first : first + length] = masters[start : start + length]
    path = tmp_path / "shard00000.state"
    path.write_bytes(raw.numpy().tobytes())
    assert torch.equal(read_shard_masters(path, layout), masters)
    edges = sorted({0, 1, chunk - 1, chunk, chunk + 1, numel // 2, numel - 1, numel} & set(range(numel + 1)))
    for start in edges:
        for end in (e for e in edges if e >= start):
            assert torch.equal(read_shard_masters(path, layout, start, end - start), masters[start:end]), (start, end)
    with pytest.raises(ValueError, match=r"outside its"):
        read_shard_masters(path, layout, numel - 1, 2)
