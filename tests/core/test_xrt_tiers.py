"""The memory tier beside SmartSSDs (``backend="xrt"`` on the software model of pyxrt, which runs the C simulation of
``hls_kernels/``): host cores update memory's share with the rule's own torch code while the FPGAs update theirs.

- Results are bitwise those of all-on-SmartSSD (with the kernels' IEEE sqrt where torch's is not), and checkpoints
  move between the placements.
- Memory starts as one more SmartSSD, then :meth:`replan` gives it the share that finishes with the SmartSSDs at the
  rates it measured, within its budget, and the moves are exact.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from helpers.ieee import TORCH_SQRT_IS_IEEE, ieee_sqrt

from lightning_smartinf.core import registry
from lightning_smartinf.core.backend import Backend, ShardSpec
from lightning_smartinf.core.build import tiers_over
from lightning_smartinf.core.compression import compress_topk
from lightning_smartinf.core.format.layout import ChunkLayout
from lightning_smartinf.core.placement import memory_share
from lightning_smartinf.core.rules import Adam, StepParams
from lightning_smartinf.core.tiers.host_memory import MemoryDevice
from lightning_smartinf.core.tiers.update_model import TIE, update_tail
from lightning_smartinf.devices.xrt import XrtBackend, forget_platform, write_model_xclbin
from tests.core.backends import SlowMemoryTiers, split_tier_arguments, with_tiers

CHUNK = 4096
SIZES = (CHUNK * 2,) * 9  # 9 equal shards: memory's share moves in ninths


def _bytes(n: int) -> int:
    return ChunkLayout(n, CHUNK, 2).file_bytes


STATE = sum(_bytes(n) for n in SIZES)


@pytest.fixture
def xclbin(tmp_path, csim_library) -> Iterator[Path]:
    path = write_model_xclbin(tmp_path / "smartinf.json", csim_library, devices=2, dram_root=tmp_path / "ddr")
    yield path
    forget_platform(path)


def _open(backends: list, root: Path, xclbin: Path, tiers: Callable = tiers_over, **kwargs) -> Backend:
    own, arguments = split_tier_arguments(kwargs)
    devices = XrtBackend([root / "ssd0", root / "ssd1"], xclbin=xclbin, chunk_elems=CHUNK, buffer_count=2, **own)
    backend = with_tiers(devices, tiers, devices_compute=registry.kind("xrt").devices_compute, **arguments)
    backends.append(backend)
    backend.open([ShardSpec(i, n, Adam(decoupled_weight_decay=True)) for i, n in enumerate(SIZES)])
    for i, n in enumerate(SIZES):
        backend.initialize(i, torch.linspace(-1, 1, n) * (i + 1))
    backend.wait()
    return backend


def _sqrt() -> contextlib.AbstractContextManager:
    """The kernels' sqrt is IEEE: so is the reference's (and the memory tier's torch code) in these tests."""
    return contextlib.nullcontext() if TORCH_SQRT_IS_IEEE else ieee_sqrt()


def _steps(backend: XrtBackend, outs: list[torch.Tensor], first: int, last: int, sparse: bool = False) -> None:
    with _sqrt():
        for t in range(first, last + 1):
            hp = StepParams(step=t, lr=1e-2, weight_decay=0.1)
            for i, n in enumerate(SIZES):
                grad = torch.sin(torch.arange(n, dtype=torch.float32) * (0.01 * t + i)).bfloat16()
                sent = compress_topk(grad.float(), 0.05, None, value_dtype=torch.bfloat16) if sparse else grad
                backend.result(backend.submit(i, sent, hp, outs[i]))
        backend.wait()


def _masters(backend: XrtBackend) -> list[torch.Tensor]:
    out = [torch.empty(n) for n in SIZES]
    for i, tensor in enumerate(out):
        backend.read_master(i, tensor)
    backend.wait()
    return out


def test_memory_beside_smartssds_updates_bitwise_like_them_and_checkpoints_move_between_them(
    tmp_path, xclbin, backends
) -> None:
    reference = _open(backends, tmp_path / "ref", xclbin)
    tiered = _open(backends, tmp_path / "tier", xclbin, memory_bytes=STATE)
    # Memory counts as a third SmartSSD until it is measured: a third of the state, the first shards.
    assert tiered.num_devices == 3 and tiered.assignment[:3] == (2, 2, 2) and 2 not in tiered.assignment[3:]
    assert isinstance(tiered.inner.devices[2], MemoryDevice)
    expected, got = (
        [torch.empty(n, dtype=torch.bfloat16) for n in SIZES],
        [torch.empty(n, dtype=torch.bfloat16) for n in SIZES],
    )
    for sparse in (False, True):
        _steps(reference, expected, 1 + 2 * sparse, 2 + 2 * sparse, sparse)
        _steps(tiered, got, 1 + 2 * sparse, 2 + 2 * sparse, sparse)
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), f"sparse={sparse}"
    assert all(torch.equal(a, b) for a, b in zip(_masters(tiered), _masters(reference)))
    mem, ssd = tiered.traffic_snapshot(), reference.traffic_snapshot()
    # Initialize, then 4 steps, on 3 shards.
    assert mem.memory_read_bytes == mem.memory_write_bytes == (1 + 4) * 3 * _bytes(SIZES[0])
    assert mem.memory_read_bytes + mem.storage_read_bytes == ssd.storage_read_bytes
    # A checkpoint saved with a third in memory resumes on SmartSSDs alone, and back.
    tiered.save(tmp_path / "ckpt")
    alone = _open(backends, tmp_path / "alone", xclbin)
    alone.load(tmp_path / "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(_masters(alone), _masters(reference)))
    alone.save(tmp_path / "ckpt2")
    again = _open(backends, tmp_path / "again", xclbin, memory_bytes=STATE)
    again.load(tmp_path / "ckpt2")
    _steps(again, got, 5, 5)
    _steps(reference, expected, 5, 5)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("cls", [tiers_over, SlowMemoryTiers], ids=["measured", "slow-memory"])
def test_replan_gives_memory_the_share_that_finishes_with_the_smartssds(tmp_path, xclbin, backends, cls) -> None:
    """Memory's new share is the one the update model predicts shortest at the rates measured (no longer than the
    pooled balance of :func:`memory_share`, to the nearest shard), capped by the budget; every shard that moves
    moves exactly."""
    budget = 6 * _bytes(SIZES[0])
    backend = _open(backends, tmp_path / "tier", xclbin, cls, memory_bytes=budget)
    reference = _open(backends, tmp_path / "ref", xclbin)
    before, placement = backend.assignment.count(2), backend.assignment
    assert before == 3
    outs, expected = (
        [torch.empty(n, dtype=torch.bfloat16) for n in SIZES],
        [torch.empty(n, dtype=torch.bfloat16) for n in SIZES],
    )
    _steps(backend, outs, 1, 3)
    moved = backend.replan()
    rates = backend.update_rates
    share = memory_share(budget, STATE, rates[2], rates[0] + rates[1])
    held = backend.assignment.count(2) * _bytes(SIZES[0])
    plan = backend.last_replan
    assert plan is not None and plan.ready == {}, "SmartSSDs take no hand-offs: nothing hides behind backward"
    # Memory takes the share whose update phase the model predicts shortest when that is predicted more than 10%
    # shorter than the current placement's, and otherwise keeps what it holds (CI measured rates whose balance was
    # 4.2 shards, a prediction within 10% of the 3 held: nothing moved, rightly).
    if plan.predicted_s < 0.9 * plan.current_s:
        assert moved and held <= plan.memory_share, (rates, backend.assignment)
        # The pooled balance of the rates, to the nearest shard, is the optimum only where the SmartSSDs split the
        # rest exactly; the model times each device's own whole shards, so its choice may lie further from the
        # balance (CI: rates of 73M and 49M B/s beside memory's 98M, a balance of 4.0 shards, 5 chosen). What holds
        # at any rates: the choice is predicted no longer than the balance placed the same way (up to the tie).
        nearest = min(round(share / _bytes(SIZES[0])), 6) * _bytes(SIZES[0])
        specs = [s.spec for s in backend.inner.shards]
        early = [backend.inner.tentative_slots and not d.in_memory for d in backend.inner.devices]
        device_rates = [plan.rates[d] for d in range(3)]
        balanced = backend._split(specs, nearest, keep=placement)
        balanced_s = update_tail(balanced, [_bytes(n) for n in SIZES], device_rates, early, plan.ready)
        assert plan.predicted_s <= balanced_s * (1 + TIE) + 1e-9, (rates, balanced, backend.assignment)
    else:
        assert held == before * _bytes(SIZES[0]), (rates, plan, backend.assignment)
    # The measured and the slowed memory tier go opposite ways.
    if cls is SlowMemoryTiers:
        assert backend.assignment.count(2) < before, rates
    _steps(backend, outs, 4, 6)
    _steps(reference, expected, 1, 6)
    assert all(torch.equal(a, b) for a, b in zip(outs, expected))
    assert all(torch.equal(a, b) for a, b in zip(_masters(backend), _masters(reference)))


def test_three_tiers_beside_smartssds_update_bitwise_like_them(tmp_path, xclbin, backends) -> None:
    """The accelerator tier (run here on the host's torch device: no GPU has been lent) fills first, then memory's
    share, then the SmartSSDs."""
    reference = _open(backends, tmp_path / "ref", xclbin)
    tiered = _open(
        backends,
        tmp_path / "tier",
        xclbin,
        memory_bytes=STATE,
        accelerator_bytes=2 * _bytes(SIZES[0]),
        accelerator_device="cpu",
    )
    assert [d.tier for d in tiered.inner.devices] == ["storage", "storage", "memory", "accelerator"]
    # Memory: a third of the 7 shards the accelerator leaves.
    assert tiered.assignment[:2] == (3, 3) and tiered.assignment.count(2) == 2, tiered.assignment
    expected, got = (
        [torch.empty(n, dtype=torch.bfloat16) for n in SIZES],
        [torch.empty(n, dtype=torch.bfloat16) for n in SIZES],
    )
    _steps(reference, expected, 1, 3)
    _steps(tiered, got, 1, 3)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert all(torch.equal(a, b) for a, b in zip(_masters(tiered), _masters(reference)))
    assert tiered.traffic_snapshot().accelerator_write_bytes == (1 + 3) * 2 * _bytes(SIZES[0])


def test_device_weights_share_out_the_smartssds(tmp_path, xclbin, backends) -> None:
    """``device_weights`` reaches the SmartSSDs too (it was accepted and ignored before): 3:1 of 8 equal shards."""
    backend = XrtBackend(
        [tmp_path / "fast", tmp_path / "slow"], xclbin=xclbin, chunk_elems=CHUNK, buffer_count=2, device_weights=[3, 1]
    )
    backends.append(backend)
    backend.open([ShardSpec(i, CHUNK, Adam()) for i in range(8)])
    assert backend.assignment.count(0) == 6 and backend.assignment.count(1) == 2, backend.assignment
