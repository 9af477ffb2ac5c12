"""Shard placement: a ``Placement`` decides which device holds each shard, and nothing else changes.

Results, traffic and checkpoints do not depend on where a shard lives; state files land on the device it names.
Real backends, real files.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from lightning_smartinf.core.backend import ShardSpec
from lightning_smartinf.core.format.state_files import shard_file_name
from lightning_smartinf.core.placement import Placement, RoundRobin
from lightning_smartinf.core.rules import Adam, StepParams
from lightning_smartinf.devices.cpu import CpuBackend

CHUNK = 4096
SIZES = (2 * CHUNK + 100, CHUNK, 3 * CHUNK, 100)


class AllOn:
    """Every shard on one device (a placement by hand, as a tier or speed-weighted one would decide)."""

    def __init__(self, device: int) -> None:
        self.device = device

    def assign(self, shards: Sequence[ShardSpec], num_devices: int) -> list[int]:
        return [self.device] * len(shards)

    def __repr__(self) -> str:
        return f"AllOn({self.device})"


def _train(root: Path, placement: Placement, steps: int = 3) -> tuple[CpuBackend, list[torch.Tensor]]:
    backend = CpuBackend(
        [root / "dev0", root / "dev1"], chunk_elems=CHUNK, buffer_count=3, placement=placement, tentative_slots=True
    )
    backend.open([ShardSpec(i, n, Adam(decoupled_weight_decay=True)) for i, n in enumerate(SIZES)])
    generator = torch.Generator().manual_seed(0)
    for i, n in enumerate(SIZES):
        backend.initialize(i, torch.randn(n, generator=generator))
    backend.wait()
    outs = [torch.empty(n) for n in SIZES]
    for t in range(1, steps + 1):
        hp = StepParams(step=t, lr=1e-2, weight_decay=0.1)
        handles = [backend.submit(i, torch.randn(n, generator=generator), hp, outs[i]) for i, n in enumerate(SIZES)]
        for handle in handles:
            backend.result(handle)
    backend.wait()
    return backend, outs


def test_a_placement_moves_shards_and_nothing_else(tmp_path) -> None:
    default, expected = _train(tmp_path / "rr", RoundRobin())
    placed, got = _train(tmp_path / "one", AllOn(1))
    try:
        assert default.assignment == (0, 1, 0, 1) and placed.assignment == (1, 1, 1, 1)
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), "placement changed the update"
        assert placed.traffic_snapshot() == default.traffic_snapshot()
        for i in range(len(SIZES)):
            assert (tmp_path / "one" / "dev1" / shard_file_name(i)).is_file()
            assert not (tmp_path / "one" / "dev0" / shard_file_name(i)).exists()
        # A checkpoint of placed shards loads onto the round-robin layout: the record does not depend on placement.
        placed.save(tmp_path / "ckpt")
        default.load(tmp_path / "ckpt")
        masters = [torch.empty(n) for n in SIZES]
        for i, out in enumerate(masters):
            default.read_master(i, out)
        default.wait()
        assert all(torch.equal(a, b) for a, b in zip(masters, got))
        stats = placed.stats()
        assert stats.devices[0].compute_s == 0.0 < stats.devices[1].compute_s  # device 0 held nothing
    finally:
        default.close()
        placed.close()


@pytest.mark.parametrize(
    ("placement", "match"),
    [(AllOn(2), r"AllOn\(2\) put shard 0 on device 2; devices are 0..1"), (AllOn(-1), r"on device -1")],
)
def test_a_placement_naming_a_missing_device_is_refused(tmp_path, placement, match) -> None:
    backend = CpuBackend([tmp_path / "dev0", tmp_path / "dev1"], chunk_elems=CHUNK, buffer_count=2, placement=placement)
    try:
        with pytest.raises(ValueError, match=match):
            backend.open([ShardSpec(i, n, Adam()) for i, n in enumerate(SIZES)])
        assert not list(tmp_path.rglob("*.state")), "no state file was created before the placement was checked"
    finally:
        backend.close()


def test_a_storage_path_that_fewer_sub_groups_leave_without_state_is_warned_of(tmp_path: Path) -> None:
    """Two paths, one sub-group (a small model under the default `sub_group_size`): the second drive would sit idle
    without a word. Enough sub-groups: no warning."""
    import re
    import warnings

    said: dict[int, list[str]] = {}
    for shards in (1, 2):
        backend = CpuBackend([tmp_path / f"{shards}a", tmp_path / f"{shards}b"], chunk_elems=CHUNK, buffer_count=2)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                backend.open([ShardSpec(i, 5000, Adam()) for i in range(shards)])
        finally:
            backend.close()
        said[shards] = [str(w.message) for w in caught if "holds no optimizer state" in str(w.message)]
    assert said[2] == []
    [warning] = said[1]
    assert re.match(
        r"SmartUpdate holds no optimizer state on '.*1b': this rank's 5,000 elements make 1 sub-group\(s\), fewer "
        r"than its 2 storage paths .* Lower `sub_group_size` to at most 2,500 ",
        warning,
    ), warning
