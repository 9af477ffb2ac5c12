"""Tentative updates of the ``cpu`` backend: the committed state is untouched until ``commit``; ``rollback`` undoes.

These back the adapter's early hand-off during backward (``overlap_backward``): a tentative update that the step
does not confirm must leave no trace in the device state, in memory or on disk.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_smartinf.core.backend import ShardSpec
from lightning_smartinf.core.format.state_files import shard_file_name
from lightning_smartinf.core.rules import Adam, StepParams
from lightning_smartinf.devices.cpu import CpuBackend

CHUNK = 4096
SIZES = (3 * CHUNK + 100, CHUNK)  # a multi-chunk shard with a short last chunk, and a one-chunk shard


def _backend(root: Path, *, slots: bool, devices: int = 2) -> CpuBackend:
    dirs = [root / f"dev{i}" for i in range(devices)]
    backend = CpuBackend(dirs, chunk_elems=CHUNK, buffer_count=3, tentative_slots=slots)
    backend.open([ShardSpec(i, n, Adam(decoupled_weight_decay=True)) for i, n in enumerate(SIZES)])
    return backend


def _masters(backend: CpuBackend) -> list[torch.Tensor]:
    outs = [torch.empty(n) for n in SIZES]
    for i, out in enumerate(outs):
        backend.read_master(i, out)
    backend.wait()
    return outs


def _step(backend: CpuBackend, t: int, grads: list[torch.Tensor], *, tentative: bool = False) -> list[torch.Tensor]:
    outs = [torch.empty(n) for n in SIZES]
    hp = StepParams(step=t, lr=1e-2, weight_decay=0.1)
    handles = [backend.submit(i, g, hp, out, tentative=tentative) for i, (g, out) in enumerate(zip(grads, outs))]
    for handle in handles:
        handle.result()
    return outs


@pytest.fixture
def pair(tmp_path):
    """A backend with tentative slots and a plain one, both holding the same initial masters."""
    torch.manual_seed(0)
    init = [torch.randn(n) for n in SIZES]
    backends = [_backend(tmp_path / "slots", slots=True), _backend(tmp_path / "plain", slots=False)]
    for backend in backends:
        for i, master in enumerate(init):
            backend.initialize(i, master)
        backend.wait()
    yield backends
    for backend in backends:
        backend.close()


def _grads(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) for n in SIZES]


def test_committed_tentative_updates_equal_in_place_updates(pair):
    slots, plain = pair
    for t in range(1, 4):
        ours = _step(slots, t, _grads(t), tentative=True)
        slots.commit(range(len(SIZES)))
        reference = _step(plain, t, _grads(t))
        for a, b in zip(ours, reference):
            assert torch.equal(a, b)
    for a, b in zip(_masters(slots), _masters(plain)):
        assert torch.equal(a, b)


def test_rollback_leaves_state_and_files_as_they_were(pair, tmp_path):
    slots, plain = pair
    _step(slots, 1, _grads(1), tentative=True)
    slots.commit(range(len(SIZES)))
    _step(plain, 1, _grads(1))
    slots.wait()
    committed = [s.file.path.read_bytes() for s in slots.shards]
    before = _masters(slots)

    _step(slots, 2, _grads(99), tentative=True)  # a step the host then refuses
    slots.rollback(range(len(SIZES)))
    assert [s.file.path.read_bytes() for s in slots.shards] == committed
    for a, b in zip(_masters(slots), before):
        assert torch.equal(a, b)

    # Step 2 again, now the real one: moments and masters as if the refused step never ran.
    for a, b in zip(_step(slots, 2, _grads(2), tentative=True), _step(plain, 2, _grads(2))):
        assert torch.equal(a, b)
    slots.commit(range(len(SIZES)))
    for a, b in zip(_masters(slots), _masters(plain)):
        assert torch.equal(a, b)


def test_in_place_update_after_rollback(pair):
    slots, plain = pair
    _step(slots, 1, _grads(99), tentative=True)
    slots.rollback([0, 1])
    for a, b in zip(_step(slots, 1, _grads(1)), _step(plain, 1, _grads(1))):
        assert torch.equal(a, b)


def test_save_and_load_use_the_committed_slot(pair, tmp_path):
    slots, plain = pair
    _step(slots, 1, _grads(1), tentative=True)
    slots.commit([0, 1])  # slot 1 is now the current state
    _step(plain, 1, _grads(1))
    slots.save(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("shard*")) == [shard_file_name(0), shard_file_name(1)]
    plain.load(tmp_path / "ckpt")
    for a, b in zip(_masters(slots), _masters(plain)):
        assert torch.equal(a, b)
    slots.load(tmp_path / "ckpt")
    for a, b in zip(_masters(slots), _masters(plain)):
        assert torch.equal(a, b)


def test_second_slot_files_and_disk_space(tmp_path):
    backend = _backend(tmp_path, slots=True)
    try:
        names = {p.name for p in (tmp_path / "dev0").iterdir() if not p.name.startswith(".")}  # not the lock
        assert names == {shard_file_name(0), shard_file_name(0, 1)}
        assert backend.supports_tentative
    finally:
        backend.close()


def test_misuse_is_refused(pair):
    slots, plain = pair
    with pytest.raises(ValueError, match="tentative_slots=True"):
        _step(plain, 1, _grads(1), tentative=True)
    assert not plain.supports_tentative
    with pytest.raises(RuntimeError, match="no tentative update to commit"):
        slots.commit([0])
    _step(slots, 1, _grads(1), tentative=True)
    with pytest.raises(RuntimeError, match="uncommitted tentative update"):
        _step(slots, 2, _grads(2))
    with pytest.raises(RuntimeError, match="uncommitted tentative update"):
        slots.load(Path("/nonexistent"))
    slots.rollback([0, 1])


def test_refused_open_names_the_doubled_space(tmp_path, monkeypatch):
    import shutil

    from lightning_smartinf.core.io.storage import StorageError

    usage = shutil.disk_usage(tmp_path)
    need_one_copy = sum(n * 12 for n in SIZES)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=need_one_copy + 2 * 4096 * 3))
    with pytest.raises(StorageError, match="overlap_backward=False"):
        _backend(tmp_path, slots=True, devices=1)
