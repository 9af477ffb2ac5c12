"""The memory tier and weighted placement in the core: real backends, real files and real memory.

A shard in host memory is updated by the same rule code through the same pipeline, so results are bitwise those of
all-on-device; its traffic counts under ``memory_*``; its saved record is the one a storage device saves.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from lightning_smartinf.core.backend import Backend, ShardSpec
from lightning_smartinf.core.build import tiers_over
from lightning_smartinf.core.format.layout import ChunkLayout
from lightning_smartinf.core.format.state_files import shard_file_name
from lightning_smartinf.core.io.storage import StorageError
from lightning_smartinf.core.placement import RoundRobin, TieredPlacement
from lightning_smartinf.core.rules import Adam, StepParams
from lightning_smartinf.core.tiers.host_memory import MemoryStateFile
from lightning_smartinf.core.tiers.tiered import TieredBackend
from lightning_smartinf.devices.cpu import CpuBackend
from tests.core.backends import FlatPartitions, read_masters, split_tier_arguments, with_tiers

CHUNK = 4096
SIZES = (2 * CHUNK + 100, CHUNK, 3 * CHUNK, 100, 5 * CHUNK)


def _bytes(n: int) -> int:
    return ChunkLayout(n, CHUNK, 2).file_bytes


def _specs(sizes=SIZES) -> list[ShardSpec]:
    return [ShardSpec(i, n, Adam(decoupled_weight_decay=True)) for i, n in enumerate(sizes)]


def _train(root: Path, steps: int = 3, **kwargs) -> tuple[Backend, list[torch.Tensor]]:
    """Steps as the controller takes them: tentative hand-offs where the backend takes them, then commits."""
    own, tiers = split_tier_arguments(kwargs)
    devices = CpuBackend([root / "d0", root / "d1"], chunk_elems=CHUNK, buffer_count=3, tentative_slots=True, **own)
    backend = with_tiers(devices, **tiers)
    backend.open(_specs())
    generator = torch.Generator().manual_seed(0)
    for i, n in enumerate(SIZES):
        backend.initialize(i, torch.randn(n, generator=generator))
    outs = [torch.empty(n) for n in SIZES]
    for t in range(1, steps + 1):
        hp = StepParams(step=t, lr=1e-2, weight_decay=0.1)
        early = [i for i in range(len(SIZES)) if backend.takes_hand_off(i)]
        grads = [torch.randn(n, generator=generator) for n in SIZES]
        handles = [backend.submit(i, grads[i], hp, outs[i], tentative=i in early) for i in range(len(SIZES))]
        for handle in handles:
            backend.result(handle)
        backend.commit(early)
    backend.wait()
    return backend, outs


def test_tiered_placement_fills_memory_in_index_order_then_weighs_the_disks() -> None:
    specs = _specs()
    # Room for shards 0 and 1 (shard 2 no longer fits, 3 does): backward reduces the first sub-groups last.
    room = _bytes(SIZES[0]) + _bytes(SIZES[1]) + _bytes(SIZES[3])
    assert TieredPlacement((1.0, 1.0), room, CHUNK).assign(specs, 3) == [2, 2, 0, 2, 1]
    # Equal weights and equal shards: round-robin.
    equal = _specs((CHUNK,) * 6)
    assert TieredPlacement((1.0, 1.0), 0, CHUNK).assign(equal, 2) == RoundRobin().assign(equal, 2)
    # Re-placing: shards stay where they are on ties, and move only where the shares need it.
    assert TieredPlacement((1.0, 1.0), 0, CHUNK, keep=(1, 0, 1, 0, 1, 0)).assign(equal, 2) == [1, 0, 1, 0, 1, 0]
    assert TieredPlacement((1.0, 1.0), 0, CHUNK, keep=(0,) * 6).assign(equal, 2) == [0, 1, 0, 1, 0, 1]
    # A 3x faster device takes 3 of every 4 equal shards.
    assert TieredPlacement((3.0, 1.0), 0, CHUNK).assign(_specs((CHUNK,) * 8), 2).count(0) == 6
    with pytest.raises(ValueError, match="2 storage device\\(s\\) and host memory, but the backend has 2 devices"):
        TieredPlacement((1.0, 1.0), 1, CHUNK).assign(specs, 2)
    for weights in [(), (0.0,), (float("inf"),), (-1.0, 1.0)]:
        with pytest.raises(ValueError, match="positive, finite"):
            TieredPlacement(weights)


def test_memory_tier_updates_bitwise_like_the_devices_and_counts_its_own_traffic(tmp_path) -> None:
    reference, expected = _train(tmp_path / "disk")
    budget = _bytes(SIZES[0]) + _bytes(SIZES[1])
    tiered, got = _train(tmp_path / "tier", memory_bytes=budget)
    try:
        assert tiered.num_devices == 3 and tiered.assignment.count(2) == 2
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), "the memory tier changed the update"
        assert all(torch.equal(a, b) for a, b in zip(read_masters(tiered, SIZES), read_masters(reference, SIZES)))
        disk, mem = reference.traffic_snapshot(), tiered.traffic_snapshot()
        assert (mem.link_write_bytes, mem.link_read_bytes) == (disk.link_write_bytes, disk.link_read_bytes)
        assert mem.memory_read_bytes + mem.storage_read_bytes == disk.storage_read_bytes
        assert mem.memory_write_bytes + mem.storage_write_bytes == disk.storage_write_bytes
        assert mem.memory_read_bytes > 0 and disk.memory_read_bytes == 0
        # Memory shards leave no file on the storage paths and keep one copy (no tentative slot).
        for i in (0, 1):
            assert not list(tmp_path.joinpath("tier").rglob(shard_file_name(i) + "*"))
            assert not list(tmp_path.joinpath("tier").rglob(shard_file_name(i, 1)))
            assert not tiered.takes_hand_off(i)
        with pytest.raises(ValueError, match="in host memory, which takes no tentative update"):
            tiered.submit(0, torch.zeros(SIZES[0]), StepParams(step=4, lr=1e-2), torch.empty(SIZES[0]), tentative=True)
    finally:
        reference.close()
        tiered.close()


def test_checkpoints_do_not_depend_on_the_tier(tmp_path) -> None:
    reference, _ = _train(tmp_path / "disk")
    tiered, _ = _train(tmp_path / "tier", steps=1, memory_bytes=10 * _bytes(SIZES[-1]))
    try:
        assert set(tiered.assignment) == {2}  # everything in memory
        reference.save(tmp_path / "from-disk")
        tiered.load(tmp_path / "from-disk")  # into memory
        assert all(torch.equal(a, b) for a, b in zip(read_masters(tiered, SIZES), read_masters(reference, SIZES)))
        tiered.save(tmp_path / "from-memory")  # out of memory: byte-identical files
        for i in range(len(SIZES)):
            name = shard_file_name(i)
            assert (tmp_path / "from-memory" / name).read_bytes() == (tmp_path / "from-disk" / name).read_bytes()
    finally:
        reference.close()
        tiered.close()


def test_memory_is_freed_with_the_storage_and_a_save_after_that_is_refused(tmp_path) -> None:
    backend, _ = _train(tmp_path, steps=1, memory_bytes=10 * _bytes(SIZES[-1]))
    assert isinstance(backend, TieredBackend)
    files = [f for shard in backend.inner.shards for f in shard.files if isinstance(f, MemoryStateFile)]
    assert len(files) == len(SIZES) and all(f.path.exists() for f in files)
    backend.close(keep_claims=True)
    backend.save(tmp_path / "after-close")  # the state outlives close until the storage is released
    backend.release_storage()
    assert not any(f.path.exists() for f in files), "memory files stay open after release"
    with pytest.raises(StorageError, match=r"in memory \(host or accelerator\), freed when the backend closed"):
        backend.save(tmp_path / "too-late")
    assert not (tmp_path / "too-late").exists()


def test_device_weights_share_the_disks_and_are_checked(tmp_path) -> None:
    backend = CpuBackend(
        [tmp_path / "fast", tmp_path / "slow"], chunk_elems=CHUNK, buffer_count=2, device_weights=[3.0, 1.0]
    )
    try:
        backend.open(_specs((CHUNK,) * 8))
        assert backend.assignment.count(0) == 6
        assert len(list((tmp_path / "fast").glob("*.state"))) == 6
    finally:
        backend.close()
    with pytest.raises(ValueError, match="`device_weights` has 1 weight\\(s\\) for 2 storage device"):
        CpuBackend([tmp_path / "a", tmp_path / "b"], chunk_elems=CHUNK, buffer_count=2, device_weights=[1.0])


def test_paths_on_different_filesystems_are_measured(tmp_path, caplog) -> None:
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        backend = CpuBackend([tmp_path / "disk", Path(shm) / "ram"], chunk_elems=CHUNK, buffer_count=2)
        try:
            with caplog.at_level("INFO", logger="lightning_smartinf.core.streaming.backend"):
                backend.open(_specs((CHUNK,) * 4))
            assert "measured its storage paths" in caplog.text
            assert "shard(s)" in caplog.text  # each device's share is logged
            assert not list(Path(shm).rglob(".smartinf-speed-probe*")) and not list(tmp_path.rglob(".smartinf-*probe*"))
        finally:
            backend.close()


def test_an_overflow_skip_leaves_both_tiers_untouched_and_the_next_step_updates_both(tmp_path) -> None:
    """The controller with fp16 partitions: backward hands off only the storage shards (memory shards wait for the
    step), an overflow skip rolls those back, and neither tier's state changes; the next step updates all of them."""

    from lightning_smartinf.core.controller import SmartUpdateController, SubGroup
    from lightning_smartinf.core.settings import SmartUpdateSettings

    sizes = [2048] * 4
    partitions = FlatPartitions(sizes, torch.float16, loss_scale=1024.0)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-2)
    memory = 2 * ChunkLayout(2048, 1024, 2).file_bytes
    devices = CpuBackend([tmp_path / "d0"], chunk_elems=1024, buffer_count=3, tentative_slots=True)
    backend = tiers_over(devices, memory_bytes=memory)
    sub_groups = [SubGroup(numel=n, param_group=0, segments=(n,)) for n in sizes]
    smart_update = SmartUpdateController(SmartUpdateSettings(), backend, optimizer, sub_groups, partitions)
    initial = torch.randn(sizes[0], generator=torch.Generator().manual_seed(0))
    for i in range(len(sizes)):
        smart_update.initialize(i, initial)  # the same masters and gradients everywhere: every tier must agree

    def masters() -> list[torch.Tensor]:
        out = [torch.empty(n) for n in sizes]
        for i, tensor in enumerate(out):
            backend.read_master(i, tensor)
        backend.wait()
        return out

    try:
        assert smart_update.placement == (1, 1, 0, 0)
        before = masters()
        partitions.grad_buffer.fill_(512.0)  # loss-scaled gradients of a backward
        for i in range(len(sizes)):
            smart_update.note_reduced(i, f"p{i}")
        smart_update.hand_off_ready(lambda: [{f"p{i}"} for i in range(len(sizes))])
        assert smart_update.hand_offs == [2, 3], "memory shards are updated after backward, never tentatively"
        smart_update.skip_step()
        assert all(torch.equal(a, b) for a, b in zip(masters(), before)), "a skipped step changed a tier's state"
        smart_update.step(grad_scale=1.0 / partitions.loss_scale)
        after = masters()
        assert all(not torch.equal(a, b) for a, b in zip(after, before)), "the step left a tier's state unchanged"
        assert torch.equal(after[0], after[2]), "the same update in memory and on the device"
    finally:
        backend.close()


def test_relocating_shards_between_steps_is_exact(tmp_path) -> None:
    """Moved between memory and either disk after step 2, the shards end step 4 bitwise where unmoved ones do; the
    old files are gone, the new ones where the devices keep them, and the copies count as the tiers' traffic."""
    reference, expected = _train(tmp_path / "still", steps=4)
    budget = _bytes(SIZES[0]) + _bytes(SIZES[1])
    moving, _ = _train(tmp_path / "moving", steps=2, memory_bytes=budget)
    try:
        assert moving.assignment == (2, 2, 0, 1, 1)
        before = moving.traffic_snapshot()
        moved = moving.relocate([1, 0, 2, 2, 1])  # memory -> disks, disks -> memory, one shard stays
        assert moved == [0, 1, 2, 3] and moving.assignment == (1, 0, 2, 2, 1)
        delta = moving.traffic_snapshot() - before
        out_of_memory, into_memory = _bytes(SIZES[0]) + _bytes(SIZES[1]), _bytes(SIZES[2]) + _bytes(SIZES[3])
        assert (delta.memory_read_bytes, delta.storage_write_bytes) == (out_of_memory, out_of_memory)
        assert (delta.storage_read_bytes, delta.memory_write_bytes) == (into_memory, into_memory)
        root = tmp_path / "moving"
        names = {i: {shard_file_name(i), shard_file_name(i, 1)} for i in range(len(SIZES))}
        assert {p.name for p in (root / "d0").glob("*.state")} == names[1]
        assert {p.name for p in (root / "d1").glob("*.state")} == names[0] | names[4]
        generator = torch.Generator().manual_seed(0)  # replay the reference's random stream to step 3
        for n in SIZES:
            torch.randn(n, generator=generator)
        for _ in range(2):
            for n in SIZES:
                torch.randn(n, generator=generator)
        outs = [torch.empty(n) for n in SIZES]
        for t in (3, 4):
            hp = StepParams(step=t, lr=1e-2, weight_decay=0.1)
            early = [i for i in range(len(SIZES)) if moving.takes_hand_off(i)]
            grads = [torch.randn(n, generator=generator) for n in SIZES]
            for i in range(len(SIZES)):
                moving.result(moving.submit(i, grads[i], hp, outs[i], tentative=i in early))
            moving.commit(early)
        assert all(torch.equal(a, b) for a, b in zip(outs, expected)), "a move changed the state"
        assert all(torch.equal(a, b) for a, b in zip(read_masters(moving, SIZES), read_masters(reference, SIZES)))
    finally:
        reference.close()
        moving.close()


def test_relocate_is_refused_before_anything_moves(tmp_path) -> None:
    backend, _ = _train(tmp_path, steps=1, memory_bytes=_bytes(SIZES[0]))
    try:
        placed = backend.assignment
        with pytest.raises(ValueError, match=r"in host memory \(device 2\), over its budget"):
            backend.relocate([2] * len(SIZES))
        with pytest.raises(ValueError, match="devices are 0..2"):
            backend.relocate([3] * len(SIZES))
        backend.submit(4, torch.zeros(SIZES[4]), StepParams(step=2, lr=1e-2), torch.empty(SIZES[4]), tentative=True)
        with pytest.raises(RuntimeError, match=r"Shards \[4\] hold tentative updates"):
            backend.relocate([0] * len(SIZES))
        backend.rollback([4])
        assert backend.assignment == placed
    finally:
        backend.close()


def test_replan_moves_shards_only_when_a_share_drifts_past_its_hysteresis() -> None:
    """Rates measured from updates are noisy (a fifth from step to step here): equal paths measured up to 1.4x apart
    keep their shards; a path at a quarter of the other's speed loses them."""
    from lightning_smartinf.core.streaming.backend import shares_drifted

    assert not shares_drifted((1.0, 1.4), (1.0, 1.0))
    assert not shares_drifted((5e6, 4e6, 6e6), (1.0, 1.0, 1.0))
    assert shares_drifted((1.0, 4.0), (1.0, 1.0))
    assert shares_drifted((1.0, 1.0), (3.0, 1.0))
    assert not shares_drifted((3.2, 1.0), (3.0, 1.0))


def test_replan_moves_shards_off_a_path_that_slowed_down(tmp_path) -> None:
    """Two paths on different filesystems (the disk and /dev/shm) at one speed; the disk's then drops to an eighth.
    The next re-plan measures it from the updates and moves most of its shards away; results stay bitwise those of an
    unmoved run. (Whether equal paths keep their shards is the hysteresis test above: rates measured from real
    updates vary too much, with other tests on the machine, to assert that here.)"""
    import tempfile

    from lightning_smartinf.core.io.direct import RateLimitedIO, ThreadedIO

    shard = CHUNK * 4
    sizes = (shard,) * 8
    engines: list[RateLimitedIO] = []

    def engine() -> RateLimitedIO:
        engines.append(RateLimitedIO(ThreadedIO(), 100e6))
        return engines[-1]

    def steps(backend: CpuBackend, outs: list[torch.Tensor], first: int, last: int) -> None:
        for t in range(first, last + 1):
            grad = torch.full((sizes[0],), 1e-3 * t)
            for i in range(len(sizes)):
                backend.result(backend.submit(i, grad, StepParams(step=t, lr=1e-2), outs[i]))
        backend.wait()

    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        # One chunk per shard: each transfer is a shard's whole state, long enough under the limits below that the
        # limit, not the disk's own latency (which jumps when other tests share the disk), sets the update time.
        backend = CpuBackend(
            [tmp_path / "disk", Path(shm) / "ram"], chunk_elems=shard, buffer_count=3, io_factory=engine
        )
        reference = CpuBackend([tmp_path / "ref"], chunk_elems=shard, buffer_count=3)
        try:
            for b in (backend, reference):
                b.open(_specs(sizes))
                for i in range(len(sizes)):
                    b.initialize(i, torch.linspace(-1, 1, sizes[i]))
            assert 2 <= backend.assignment.count(0) <= 6, backend.assignment  # probed about equal
            for e in engines:
                e.bytes_per_s = 4e6
            outs, expected = [torch.empty(n) for n in sizes], [torch.empty(n) for n in sizes]
            steps(backend, outs, 1, 2)
            backend.replan()  # from the probed speeds to the rates the updates show, if they drifted
            engines[0].bytes_per_s = 0.5e6
            steps(backend, outs, 3, 3)
            moved = backend.replan()
            assert moved and backend.assignment.count(0) <= 2, backend.assignment
            steps(backend, outs, 4, 4)
            steps(reference, expected, 1, 4)
            assert all(torch.equal(a, b) for a, b in zip(outs, expected))
            assert all(torch.equal(a, b) for a, b in zip(read_masters(backend, sizes), read_masters(reference, sizes)))
        finally:
            backend.close()
            reference.close()


def test_a_move_onto_a_full_disk_leaves_the_shard_whole_and_a_replan_goes_on_as_placed(
    tmp_path, ext4_fs, monkeypatch
) -> None:
    """Moving a shard from memory onto a path on a real ext4 another job filled: refused before anything moves, or,
    when the disk fills once the space was checked, stopped with the new files removed; either way the shard stays
    where it was, bit for bit, with one error naming the path, what and the bytes. A re-plan meeting the same disk
    keeps the placement, says so once, and training goes on."""
    import shutil

    from lightning_smartinf.core.streaming import backend as streaming

    fs = ext4_fs("100m", name="root/d1")  # room for the 64 MiB speed probe: it gets shards
    backend, _ = _train(tmp_path / "root", steps=1, memory_bytes=_bytes(SIZES[0]))
    try:
        assert backend.assignment[0] == 2  # shard 0 is in memory
        # Every storage shard on d0, as weights of 100:1 for d0 would place them: where the paths' first measurement
        # found them about equal (a CI machine's), the shards were already spread as equal rates spread them, and the
        # re-plan below had nothing to move.
        backend.relocate([d if d == 2 else 0 for d in backend.assignment])
        placed = backend.assignment
        assert placed[1:] == (0,) * (len(SIZES) - 1)
        before = read_masters(backend, SIZES)

        def fill(leave: int) -> None:
            with open(fs / "ballast", "ab") as f:
                f.write(b"\0" * max(0, shutil.disk_usage(fs).free - leave))

        fill(4096)
        onto_d1 = [1, *placed[1:]]
        refused = (
            rf"No space left on the filesystem of '{fs}' for the optimizer state placed there: it needs [\d.]+ KiB "
            r"and the filesystem has [\d.]+ [KM]?i?B free"
        )
        with pytest.raises(StorageError, match=refused):
            backend.relocate(onto_d1)
        (fs / "ballast").unlink()
        os.sync()  # ext4 gives a deleted file's blocks back when its journal commits
        real = streaming.check_free_space

        def check_then_fill(directory, needed, *args, **kwargs):  # noqa: ANN001, ANN202 - passes, then it fills
            real(directory, needed, *args, **kwargs)
            fill(_bytes(SIZES[0]) // 2)

        streaming.check_free_space = check_then_fill
        try:
            with pytest.raises(StorageError, match=rf"No space left on the filesystem of '{fs}' for shard 0 moved "
                               r"there: .* The shard stays on .*, whole\."):  # fmt: skip
                backend.relocate(onto_d1)
        finally:
            streaming.check_free_space = real
        assert backend.assignment == placed
        assert not [p.name for p in fs.glob("*.state") if p.name.startswith(shard_file_name(0).split(".")[0])]
        assert all(torch.equal(a, b) for a, b in zip(read_masters(backend, SIZES), before))

        # A re-plan: the paths were measured (d1 is another filesystem) as if d0 had been 100 times faster; rates
        # showing them equal move shards onto d1, which is full again.
        inner = backend.inner if isinstance(backend, TieredBackend) else backend
        assert inner._measured_weights is not None, "paths on two filesystems are weighed by measuring them"
        fill(4096)
        said: list[logging.LogRecord] = []
        logger = logging.getLogger(streaming.__name__)
        handler = logging.Handler(logging.DEBUG)
        handler.emit = said.append  # type: ignore[method-assign]
        # Another library's logging set-up may have disabled the package's loggers (`disable_existing_loggers`).
        monkeypatch.setattr(logger, "disabled", False)
        monkeypatch.setattr(logger, "level", logging.DEBUG)
        logger.addHandler(handler)
        try:
            # The re-plan sees equal rates, given here: it measures them again from the devices' counters, which the
            # step's load sets and which once moved between a measurement here and the re-plan (a full suite's
            # failure). Equal rates against weights of 100:1 always drift, so every re-plan moves shards onto d1.
            equal = {d.index: 1e9 for d in inner.storage_devices}
            monkeypatch.setattr(inner, "measure_rates", lambda: dict(equal))
            for _ in range(2):
                inner._measured_weights = (100.0, 1.0)
                assert backend.replan() == []
        finally:
            logger.removeHandler(handler)
        said = [r for r in said if "keeps the shards where they are" in r.getMessage()]
        assert [r.levelname for r in said] == ["WARNING", "DEBUG"], [r.getMessage() for r in said]
        assert "No space left on the filesystem of" in said[0].getMessage()
        assert backend.assignment == placed
        assert all(torch.equal(a, b) for a, b in zip(read_masters(backend, SIZES), before))
    finally:
        backend.close()
