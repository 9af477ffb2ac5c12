"""Saving device state by cloning: checksums known from the writes, and each way a file reaches a checkpoint.

Real filesystems only: a loop-mounted XFS with reflinks (clones), this machine's ext4 (``copy_file_range`` copies
in the kernel) and a tmpfs beside it (a cross-filesystem copy, through this process).
"""

from __future__ import annotations

import json
import os
import random
import shutil

import crc32c as crc32c_package
import pytest
import torch

from lightning_smartinf.core.backend import ShardSpec
from lightning_smartinf.core.format.layout import ChunkLayout
from lightning_smartinf.core.format.state_files import (
    MANIFEST,
    ShardState,
    load_state,
    save_state,
    shard_file_name,
)
from lightning_smartinf.core.io.checksum import CRC32C, combine, crc32c
from lightning_smartinf.core.io.clone import CLONE, COPY, KERNEL_COPY, clone_file
from lightning_smartinf.core.rules import Adam

CHUNK = 4096


@pytest.mark.parametrize("sizes", [(0, 5), (5, 0), (1, 1), (4096, 12288), (1000, 77777), (3, 1 << 20)])
def test_combined_crc_equals_the_crc_of_the_concatenation(sizes) -> None:
    rng = random.Random(sum(sizes))
    a, b = (rng.randbytes(n) for n in sizes)
    assert combine(crc32c(a), crc32c(b), len(b)) == crc32c_package.crc32c(a + b)


def test_clone_file_clones_on_xfs_copies_in_the_kernel_on_ext4_and_through_the_process_across(
    tmp_path, reflink_fs, small_fs
) -> None:
    data = random.Random(1).randbytes(3 << 20)
    cases = [(reflink_fs, reflink_fs, CLONE), (tmp_path, tmp_path, KERNEL_COPY), (tmp_path, small_fs("8m"), COPY)]
    for i, (src_dir, dst_dir, how) in enumerate(cases):
        src, dst = src_dir / f"src{i}", dst_dir / f"dst{i}"
        src.write_bytes(data)
        assert clone_file(src, dst, len(data)) == how
        assert dst.read_bytes() == data
        assert os.stat(dst).st_mode & 0o777 == 0o600
    with open(reflink_fs / "src0", "r+b") as live:  # the live file moves on; the clone keeps the bytes it had
        live.write(b"x" * 4096)
    assert (reflink_fs / "dst0").read_bytes() == data
    with pytest.raises(FileExistsError):
        clone_file(tmp_path / "src1", tmp_path / "dst1", len(data))
    with pytest.raises(ValueError, match="holds 3145728 B, expected 5 B"):
        clone_file(tmp_path / "src1", tmp_path / "other", 5)
    assert not (tmp_path / "other").exists()


def _shards(directory, *, checksums: bool, sizes=(CHUNK + 5, 3 * CHUNK, 777)) -> list[ShardState]:
    """Live shard files of random records, with each record's CRC-32C as a device would have kept it."""
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    shards = []
    for i, numel in enumerate(sizes):
        layout = ChunkLayout(numel, CHUNK, 2)
        data = torch.randint(0, 256, (layout.file_bytes,), dtype=torch.uint8, generator=generator).numpy().tobytes()
        path = directory / shard_file_name(i)
        path.write_bytes(data)
        records = {
            layout.record_offset(k): crc32c(
                data[layout.record_offset(k) : layout.record_offset(k) + layout.record_bytes(k)]
            )
            for k in range(layout.num_chunks)
        }
        shards.append(ShardState(ShardSpec(i, numel, Adam()), layout, path, records if checksums else None))
    return shards


def test_save_clones_files_whose_record_checksums_are_known(reflink_fs) -> None:
    shards = _shards(reflink_fs / "live", checksums=True)
    total = sum(s.layout.file_bytes for s in shards)
    free = shutil.disk_usage(reflink_fs).free
    stats = save_state(shards, reflink_fs / "ckpt", chunk_elems=CHUNK)
    assert (stats.cloned_bytes, stats.copied_bytes, stats.checksummed_bytes) == (total, 0, 0)
    assert free - shutil.disk_usage(reflink_fs).free < total // 2  # the clones share the live files' blocks
    manifest = json.loads((reflink_fs / "ckpt" / MANIFEST).read_text())
    for shard, entry in zip(shards, manifest["shards"]):
        saved = (reflink_fs / "ckpt" / shard_file_name(shard.spec.index)).read_bytes()
        assert saved == shard.path.read_bytes()
        assert entry[CRC32C] == crc32c_package.crc32c(saved) and "crc32" not in entry
    load_state(shards, reflink_fs / "ckpt", chunk_elems=CHUNK)  # verifies every file against the manifest


def test_save_copies_and_checksums_files_whose_records_are_not_all_known(tmp_path) -> None:
    shards = _shards(tmp_path / "live", checksums=True)
    unknown = dict(shards[1].checksums)
    unknown.pop(shards[1].layout.record_offset(1))  # a record written since, or not yet through a device
    shards[1] = ShardState(shards[1].spec, shards[1].layout, shards[1].path, unknown)
    shards[2] = ShardState(shards[2].spec, shards[2].layout, shards[2].path, None)  # state in memory
    stats = save_state(shards, tmp_path / "ckpt", chunk_elems=CHUNK)
    by_kernel = shards[0].layout.file_bytes
    checksummed = shards[1].layout.file_bytes + shards[2].layout.file_bytes
    assert stats.by_method == {KERNEL_COPY: by_kernel, COPY: checksummed}
    assert stats.checksummed_bytes == checksummed
    load_state(shards, tmp_path / "ckpt", chunk_elems=CHUNK)


def test_a_record_checksum_that_does_not_match_the_bytes_is_caught_at_load(reflink_fs) -> None:
    """The seal trusts the devices' record checksums; a wrong one (a write the table missed) cannot pass a load."""
    shards = _shards(reflink_fs / "live", checksums=True)
    with open(shards[0].path, "r+b") as live:  # bytes the recorded checksums do not describe
        live.seek(100)
        live.write(b"\xff" * 8)
    save_state(shards, reflink_fs / "ckpt", chunk_elems=CHUNK)
    before = [s.path.read_bytes() for s in shards]
    with pytest.raises(ValueError, match=r"shard00000.state is corrupt: CRC32C"):
        load_state(shards, reflink_fs / "ckpt", chunk_elems=CHUNK)
    assert [s.path.read_bytes() for s in shards] == before  # nothing live was touched


def test_devices_keep_record_checksums_only_where_their_files_clone(tmp_path, reflink_fs) -> None:
    """On ext4 a save reads the files anyway, so the devices spend nothing per write on checksums and the save
    checksums as it copies; on XFS with reflinks they keep them and the save clones."""
    from lightning_smartinf.devices.cpu import CpuBackend

    sizes = [CHUNK + 5, 3 * CHUNK]
    for root, clones in ((tmp_path, False), (reflink_fs, True)):
        backend = CpuBackend([root / "dev0", root / "dev1"], chunk_elems=CHUNK, buffer_count=4)
        try:
            backend.open([ShardSpec(i, n, Adam()) for i, n in enumerate(sizes)])
            assert [device.keeps_checksums for device in backend.devices] == [clones, clones]
            for i, n in enumerate(sizes):
                backend.initialize(i, torch.randn(n))
            backend.wait()
            backend.save(root / "ckpt")
            total = backend.checkpoint_bytes()
            stats = backend.last_save
            assert (stats.cloned_bytes, stats.checksummed_bytes) == ((total, 0) if clones else (0, total))
            assert not list((root / "dev0").glob(".smartinf-clone-probe*"))
        finally:
            backend.close()
