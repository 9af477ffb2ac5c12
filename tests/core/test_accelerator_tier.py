"""The accelerator tier in the core: state in a torch device's memory, updated there by the rule's own code.

No GPU is lent to this project's CI, so these tests put the tier on the host's torch device: every line of
``core/tiers/accelerator_memory.py`` runs (placement, in-place updates, the gradient crossing, checkpoint staging,
moves), with CPU tensors where a GPU would hold CUDA ones. ``test_on_cuda`` runs the same training on a GPU where
there is one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_smartinf.core.backend import Backend, ShardSpec
from lightning_smartinf.core.compression import compress_topk
from lightning_smartinf.core.format.layout import ChunkLayout
from lightning_smartinf.core.format.state_files import shard_file_name
from lightning_smartinf.core.placement import TieredPlacement
from lightning_smartinf.core.rules import Adam, StepParams
from lightning_smartinf.core.tiers.accelerator_memory import AcceleratorStateFile
from lightning_smartinf.core.tiers.host_memory import MemoryStateFile
from lightning_smartinf.devices.cpu import CpuBackend
from tests.core.backends import split_tier_arguments, with_tiers

CHUNK = 4096
SIZES = (2 * CHUNK + 100, CHUNK, 3 * CHUNK, 100, 5 * CHUNK)


def _bytes(n: int) -> int:
    return ChunkLayout(n, CHUNK, 2).file_bytes


def _specs(sizes=SIZES, fused: bool = False) -> list[ShardSpec]:
    return [ShardSpec(i, n, Adam(decoupled_weight_decay=True, fused=fused)) for i, n in enumerate(sizes)]


def _train(
    root: Path, steps: int = 3, *, sparse: bool = False, fused: bool = False, **kwargs
) -> tuple[Backend, list[torch.Tensor]]:
    """Steps as the controller takes them: tentative hand-offs where the backend takes them, then commits; bf16
    parameters out, gradients in bf16 (dense) or as top-10% pairs (``sparse``)."""
    kwargs.setdefault("accelerator_device", "cpu")
    own, tiers = split_tier_arguments(kwargs)
    devices = CpuBackend([root / "d0", root / "d1"], chunk_elems=CHUNK, buffer_count=3, tentative_slots=True, **own)
    backend = with_tiers(devices, **tiers)
    backend.open(_specs(fused=fused))
    generator = torch.Generator().manual_seed(0)
    for i, n in enumerate(SIZES):
        backend.initialize(i, torch.randn(n, generator=generator))
    outs = [torch.empty(n, dtype=torch.bfloat16) for n in SIZES]
    for t in range(1, steps + 1):
        hp = StepParams(step=t, lr=1e-2, weight_decay=0.1)
        early = [i for i in range(len(SIZES)) if backend.takes_hand_off(i)]
        grads = [torch.randn(n, generator=generator).bfloat16() for n in SIZES]
        if sparse:
            grads = [compress_topk(g, 0.1, None, value_dtype=torch.bfloat16) for g in grads]
        handles = [
            backend.submit(i, grads[i], hp, outs[i], tentative=i in early, link_dtype=torch.bfloat16)
            for i in range(len(SIZES))
        ]
        for handle in handles:
            backend.result(handle)
        backend.commit(early)
    backend.wait()
    return backend, outs


def _masters(backend: CpuBackend) -> list[torch.Tensor]:
    out = [torch.empty(n) for n in SIZES]
    for i, tensor in enumerate(out):
        backend.read_master(i, tensor)
    backend.wait()
    return out


def test_the_accelerator_fills_first_then_memory_then_the_disks() -> None:
    specs = _specs()
    accelerator = _bytes(SIZES[0]) + _bytes(SIZES[3])  # shard 1 no longer fits beside 0, 3 does
    memory = _bytes(SIZES[1]) + _bytes(SIZES[2])
    # Devices: two disks (0, 1), host memory (2), the accelerator (3).
    assert TieredPlacement((1.0, 1.0), memory, CHUNK, accelerator).assign(specs, 4) == [3, 2, 2, 3, 0]
    assert TieredPlacement((1.0, 1.0), 0, CHUNK, accelerator).assign(specs, 3) == [2, 0, 1, 2, 0]
    with pytest.raises(ValueError, match=r"2 storage device\(s\) and accelerator memory, but the backend has 4"):
        TieredPlacement((1.0, 1.0), 0, CHUNK, accelerator).assign(specs, 4)
    with pytest.raises(ValueError, match="`accelerator_bytes=-1` must be >= 0"):
        TieredPlacement((1.0,), 0, CHUNK, -1)


@pytest.mark.parametrize("sparse, fused", [(False, False), (False, True), (True, False)])
def test_three_tiers_update_bitwise_like_the_devices_and_count_their_own_traffic(tmp_path, sparse, fused) -> None:
    reference, expected = _train(tmp_path / "disk", sparse=sparse, fused=fused)
    tiered, got = _train(
        tmp_path / "tiers",
        sparse=sparse,
        fused=fused,
        memory_bytes=_bytes(SIZES[1]),
        accelerator_bytes=_bytes(SIZES[0]) + _bytes(SIZES[3]),
    )
    try:
        assert tiered.num_devices == 4 and tiered.assignment == (3, 2, 0, 3, 1)
        assert [d.tier for d in tiered.inner.devices] == ["storage", "storage", "memory", "accelerator"]
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), "a tier changed the update"
        assert all(torch.equal(a, b) for a, b in zip(_masters(tiered), _masters(reference)))
        disk, tiers = reference.traffic_snapshot(), tiered.traffic_snapshot()
        assert (tiers.link_write_bytes, tiers.link_read_bytes) == (disk.link_write_bytes, disk.link_read_bytes)
        reads = tiers.accelerator_read_bytes + tiers.memory_read_bytes + tiers.storage_read_bytes
        writes = tiers.accelerator_write_bytes + tiers.memory_write_bytes + tiers.storage_write_bytes
        assert (reads, writes) == (disk.storage_read_bytes, disk.storage_write_bytes)
        # Each accelerator shard's record, exactly: written at the start and by each step, read by each step and by
        # the read of the masters above.
        per_step = _bytes(SIZES[0]) + _bytes(SIZES[3])
        assert (tiers.accelerator_read_bytes, tiers.accelerator_write_bytes) == (4 * per_step, 4 * per_step)
        for i in (0, 3):
            assert (
                isinstance(tiered.inner.shards[i].file, AcceleratorStateFile) and len(tiered.inner.shards[i].files) == 1
            )
            assert not list(tmp_path.joinpath("tiers").rglob(shard_file_name(i) + "*"))
            assert not tiered.takes_hand_off(i)
        with pytest.raises(
            ValueError, match=r"Shard 0 is in accelerator memory \(cpu\), which takes no tentative update"
        ):
            tiered.submit(0, torch.zeros(SIZES[0]), StepParams(step=4, lr=1e-2), torch.empty(SIZES[0]), tentative=True)
    finally:
        reference.close()
        tiered.close()


def test_checkpoints_go_through_a_host_copy_and_do_not_depend_on_the_tier(tmp_path) -> None:
    reference, _ = _train(tmp_path / "disk")
    tiered, _ = _train(tmp_path / "tier", steps=1, accelerator_bytes=10 * _bytes(SIZES[-1]))
    try:
        assert set(tiered.assignment) == {2}  # everything on the accelerator
        files = [shard.file for shard in tiered.inner.shards]
        reference.save(tmp_path / "from-disk")
        tiered.load(tmp_path / "from-disk")  # into accelerator memory, through host copies
        assert all(torch.equal(a, b) for a, b in zip(_masters(tiered), _masters(reference)))
        tiered.save(tmp_path / "from-accelerator")  # out of it: byte-identical files
        for i in range(len(SIZES)):
            name = shard_file_name(i)
            assert (tmp_path / "from-accelerator" / name).read_bytes() == (tmp_path / "from-disk" / name).read_bytes()
        assert all(str(f.path).startswith("<cpu memory>") for f in files), "a host copy outlived the checkpoint"
    finally:
        reference.close()
        tiered.close()


def test_a_failed_load_leaves_the_accelerator_state_and_frees_the_host_copies(tmp_path) -> None:
    tiered, _ = _train(tmp_path / "tier", steps=1, accelerator_bytes=10 * _bytes(SIZES[-1]))
    try:
        before = _masters(tiered)
        tiered.save(tmp_path / "saved")
        (tmp_path / "saved" / shard_file_name(2)).write_bytes(b"broken")
        with pytest.raises(Exception, match=shard_file_name(2)):
            tiered.load(tmp_path / "saved")
        assert all(torch.equal(a, b) for a, b in zip(_masters(tiered), before)), "a failed load changed the state"
        assert all(str(shard.file.path).startswith("<cpu memory>") for shard in tiered.inner.shards)
    finally:
        tiered.close()


def test_relocating_between_the_accelerator_memory_and_the_disks_is_exact(tmp_path) -> None:
    reference, expected = _train(tmp_path / "still", steps=2)
    budget = _bytes(SIZES[0]) + _bytes(SIZES[1])
    moving, _ = _train(tmp_path / "moving", steps=1, accelerator_bytes=budget, memory_bytes=_bytes(SIZES[2]))
    try:
        assert moving.assignment == (3, 3, 2, 0, 1)
        before = moving.traffic_snapshot()
        assert moving.relocate([0, 2, 3, 3, 1]) == [0, 1, 2, 3]
        delta = moving.traffic_snapshot() - before
        assert delta.accelerator_read_bytes == budget and delta.accelerator_write_bytes == _bytes(SIZES[2]) + _bytes(
            SIZES[3]
        )
        with pytest.raises(ValueError, match=r"in accelerator memory \(cpu\) \(device 3\), over its budget"):
            moving.relocate([3] * len(SIZES))
        generator = torch.Generator().manual_seed(0)  # replay the reference's random stream to step 2
        for n in SIZES:
            torch.randn(n, generator=generator)
        for n in SIZES:
            torch.randn(n, generator=generator)
        outs = [torch.empty(n, dtype=torch.bfloat16) for n in SIZES]
        hp = StepParams(step=2, lr=1e-2, weight_decay=0.1)
        early = [i for i in range(len(SIZES)) if moving.takes_hand_off(i)]
        grads = [torch.randn(n, generator=generator).bfloat16() for n in SIZES]
        for i in range(len(SIZES)):
            moving.result(moving.submit(i, grads[i], hp, outs[i], tentative=i in early, link_dtype=torch.bfloat16))
        moving.commit(early)
        assert all(torch.equal(a, b) for a, b in zip(outs, expected)), "a move changed the state"
    finally:
        reference.close()
        moving.close()


def test_accelerator_memory_is_freed_with_the_storage(tmp_path) -> None:
    backend, _ = _train(tmp_path, steps=1, accelerator_bytes=_bytes(SIZES[0]), memory_bytes=10 * _bytes(SIZES[-1]))
    files = [shard.file for shard in backend.inner.shards]
    assert [type(f) for f in files] == [AcceleratorStateFile] + [MemoryStateFile] * (len(SIZES) - 1)
    backend.close(keep_claims=True)
    backend.save(tmp_path / "after-close")  # the state outlives close until the storage is released
    backend.release_storage()
    for file in files[:2]:
        with pytest.raises(OSError, match="was freed"):
            file.view(0, 4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda(tmp_path) -> None:
    """The same training with the tier in GPU memory: equal to the host's within rounding (a GPU may fuse a
    multiply-add that the host rounds twice), and the parameters come back to host memory."""
    reference, expected = _train(tmp_path / "disk", fused=True)
    tiered, got = _train(
        tmp_path / "gpu", fused=True, accelerator_bytes=10 * _bytes(SIZES[-1]), accelerator_device="cuda"
    )
    try:
        assert all(shard.file.view(0, 4).is_cuda for shard in tiered.inner.shards)
        for a, b in zip(_masters(tiered), _masters(reference)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)
    finally:
        reference.close()
        tiered.close()


def test_a_write_back_is_fenced_before_a_checkpoint_copies_or_the_memory_is_freed(asynchronous_host) -> None:
    """The tier's write-backs are queued on the device threads' stream: a save's host copy (``stage``) and freeing
    the memory (``discard``) wait for them first. Host memory here behaves as an accelerator's for fencing."""
    state = AcceleratorStateFile("shard", 4096, torch.device("cpu"))
    record = torch.arange(1024, dtype=torch.float32)
    state.write_from(record, 0)  # a write-back, as a device thread makes one
    written = [event for what, event in asynchronous_host if what == "record"]
    assert written, "no fence after the write-back"
    state.stage(copy=True)
    assert ("wait", written[-1]) in asynchronous_host, "the checkpoint's copy did not wait for the write-back"
    staged = torch.empty(1024, dtype=torch.float32)
    MemoryStateFile.read_into(state._host, staged, 0)
    assert torch.equal(staged, record)
    state.unstage()
    state.write_from(record, 0)
    last = [event for what, event in asynchronous_host if what == "record"][-1]
    state.discard()
    assert asynchronous_host[-1] == ("wait", last), "the memory was freed under a write"
