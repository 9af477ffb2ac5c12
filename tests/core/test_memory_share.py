"""The memory tier's share from measurements (``measure_memory_share``): the update-phase model, and real backends
that move state between memory and storage when the model says the other split finishes sooner.

The model (:mod:`lightning_smartinf.core.tiers.update_model`) is checked on cases worked by hand. The backends are real
(:class:`CpuBackend` with files and host memory); the backward timings they are given stand for a backward on a GPU,
which this machine does not have, and the moves they make are checked bitwise against a run that never moved.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lightning_smartinf.core.backend import Backend, ShardSpec
from lightning_smartinf.core.build import tiers_over
from lightning_smartinf.core.format.layout import ChunkLayout
from lightning_smartinf.core.rules import Adam, StepParams
from lightning_smartinf.core.tiers.tiered import TieredBackend
from lightning_smartinf.core.tiers.update_model import best_share, memory_candidates, update_tail
from lightning_smartinf.devices.cpu import CpuBackend
from tests.core.backends import SlowMemoryTiers, read_masters, split_tier_arguments, with_tiers

CHUNK = 4096
SIZES = (4 * CHUNK,) * 8
SHARD = ChunkLayout(SIZES[0], CHUNK, 2).file_bytes
STATE = SHARD * len(SIZES)


# ----------------------------------------------------------------------------------------------------- the model


def test_without_hand_offs_the_phase_is_the_slowest_devices_work() -> None:
    # Device 0 at 4 B/s holds 4 + 4 bytes (2 * 8 / 4 = 4 s), memory at 8 B/s holds 4 bytes (1 s).
    assert update_tail([0, 0, 1], [4, 4, 4], [4.0, 8.0], [True, False], {}) == 4.0
    # Memory never starts early, even with a timeline.
    assert update_tail([1, 1], [4, 4], [4.0, 8.0], [True, False], {0: 9.0, 1: 9.0}) == 2.0


def test_hand_offs_hide_what_fits_before_the_step() -> None:
    # Two 4-byte shards at 4 B/s take 2 s each. Ready 3 s and 1 s before the step: the first ends at -1, the second
    # starts at -1 and ends at +1.
    assert update_tail([0, 0], [4, 4], [4.0], [True], {0: 3.0, 1: 1.0}) == pytest.approx(1.0)
    # Both ready 10 s before: all of it hid.
    assert update_tail([0, 0], [4, 4], [4.0], [True], {0: 10.0, 1: 10.0}) == 0.0
    # Work queues in order of readiness, whatever the shard index.
    assert update_tail([0, 0], [4, 4], [4.0], [True], {0: 1.0, 1: 3.0}) == pytest.approx(1.0)


def test_candidates_are_the_prefixes_within_the_budget() -> None:
    assert memory_candidates([3, 3, 3], 7) == [0, 3, 6, 7]
    assert memory_candidates([3, 3, 3], 9) == [0, 3, 6, 9]
    assert memory_candidates([3, 3, 3], 0) == [0]
    # Thousands of sub-groups: every k-th prefix, so that a re-plan predicts a bounded number of shares.
    assert memory_candidates([1] * 1000, 1000, limit=10) == list(range(0, 1001, 100))
    assert memory_candidates([1] * 1000, 995, limit=10) == [*range(0, 901, 100), 995]


def test_best_share_prefers_the_current_share_among_equals() -> None:
    phases = {0: 1.0, 3: 0.5, 6: 0.505, 9: 2.0}
    assert best_share(list(phases), phases.__getitem__, current=6) == (6, 0.505)
    assert best_share(list(phases), phases.__getitem__, current=0) == (3, 0.5)
    assert best_share([0, 3], {0: 0.0, 3: 0.0}.__getitem__, current=0) == (0, 0.0)
    assert best_share([0, 3], {0: 0.0, 3: 0.0}.__getitem__, current=9) == (3, 0.0)


# ------------------------------------------------------------------------------------------------- the backends


def _specs() -> list[ShardSpec]:
    return [ShardSpec(i, n, Adam(decoupled_weight_decay=True)) for i, n in enumerate(SIZES)]


def _open(backend: Backend) -> Backend:
    backend.open(_specs())
    for i, n in enumerate(SIZES):
        backend.initialize(i, torch.linspace(-1, 1, n) * (i + 1))
    return backend


def _steps(backend: Backend, outs: list[torch.Tensor], first: int, last: int, ready: dict[int, float]) -> None:
    """Steps as the controller takes them: the backward's timing, hand-offs where the backend takes them, commits."""
    for t in range(first, last + 1):
        hp = StepParams(step=t, lr=1e-2, weight_decay=0.1)
        backend.note_backward(ready)
        early = [i for i in range(len(SIZES)) if backend.takes_hand_off(i)]
        grads = [torch.full((n,), 1e-3 * t * (i + 1)) for i, n in enumerate(SIZES)]
        handles = [backend.submit(i, grads[i], hp, outs[i], tentative=i in early) for i in range(len(SIZES))]
        for handle in handles:
            backend.result(handle)
        backend.commit(early)
    backend.wait()


@pytest.fixture
def backends():
    opened: list[Backend] = []
    yield opened
    for backend in opened:
        backend.close()


def _backend(
    backends: list[Backend], root: Path, tiers: Callable[..., TieredBackend] = tiers_over, **kwargs
) -> Backend:
    own, arguments = split_tier_arguments(kwargs)
    backend = with_tiers(
        CpuBackend([root], chunk_elems=CHUNK, buffer_count=3, tentative_slots=True, **own), tiers, **arguments
    )
    backends.append(backend)
    return _open(backend)


def test_devices_that_hide_behind_backward_take_the_state_from_memory(tmp_path, backends) -> None:
    """All the state fits the budget and starts in memory. Backward completes every gradient long before the step
    (as a long backward on a GPU does), so the storage device, measured by its probe since it holds nothing yet,
    would update all of it before the step: the re-plan moves every shard there, exactly."""
    backend = _backend(backends, tmp_path / "tier", memory_bytes=STATE, measure_memory_share=True)
    reference = _backend(backends, tmp_path / "ref")
    assert backend.assignment == (1,) * len(SIZES)
    outs, expected = [torch.empty(n) for n in SIZES], [torch.empty(n) for n in SIZES]
    ready = {i: 60.0 for i in range(len(SIZES))}
    _steps(backend, outs, 1, 2, ready)
    moved = backend.replan()
    plan = backend.last_replan
    assert plan is not None and plan.memory_share == 0 and plan.predicted_s == 0.0 < plan.current_s
    assert sorted(moved) == list(range(len(SIZES))) and backend.assignment == (0,) * len(SIZES)
    assert 0 < plan.rates[0] <= plan.rates[1], "the device's estimate is at most memory's rate"
    assert plan.ready == ready
    _steps(backend, outs, 3, 5, ready)
    assert backend.traffic_snapshot().storage_read_bytes > 0
    _steps(reference, expected, 1, 5, ready)
    assert all(torch.equal(a, b) for a, b in zip(outs, expected))
    assert all(torch.equal(a, b) for a, b in zip(read_masters(backend, SIZES), read_masters(reference, SIZES)))


def test_without_overlap_a_slow_memory_tier_gives_up_what_the_device_finishes_sooner(tmp_path, backends) -> None:
    """No gradient was complete before the step, so nothing hides; memory, slowed to 20 ms a chunk, is slower than
    the device. The re-plan keeps in memory only what finishes with the device, by the model and the rates it
    measured, and the moves are exact."""
    budget = STATE // 2
    backend = _backend(backends, tmp_path / "tier", SlowMemoryTiers, memory_bytes=budget, measure_memory_share=True)
    reference = _backend(backends, tmp_path / "ref")
    assert backend.assignment.count(1) == len(SIZES) // 2
    outs, expected = [torch.empty(n) for n in SIZES], [torch.empty(n) for n in SIZES]
    _steps(backend, outs, 1, 2, {})
    moved = backend.replan()
    plan = backend.last_replan
    assert plan is not None and plan.ready == {}
    assert plan.rates[1] < plan.rates[0], "the slowed memory tier is the slower"
    # The share the model finds shortest: memory and device finish together, within one shard.
    balance = STATE * plan.rates[1] / (plan.rates[0] + plan.rates[1])
    assert abs(plan.memory_share - balance) <= SHARD, plan
    assert moved and backend.assignment.count(1) * SHARD <= plan.memory_share < budget
    assert plan.predicted_s < 0.9 * plan.current_s
    _steps(backend, outs, 3, 4, {})
    _steps(reference, expected, 1, 4, {})
    assert all(torch.equal(a, b) for a, b in zip(outs, expected))
    assert all(torch.equal(a, b) for a, b in zip(read_masters(backend, SIZES), read_masters(reference, SIZES)))


def test_emulated_devices_fill_the_budget_unless_asked_to_measure(tmp_path, backends) -> None:
    """The default for emulated devices (a CPU-only run, where they share the host cores with training): the budget
    is filled and re-plans leave it, whatever backward's timing."""
    backend = _backend(backends, tmp_path / "tier", memory_bytes=STATE)
    assert not backend.measures_memory_share
    outs = [torch.empty(n) for n in SIZES]
    _steps(backend, outs, 1, 2, {i: 60.0 for i in range(len(SIZES))})
    assert backend.replan() == [] and backend.last_replan is None
    assert backend.assignment == (1,) * len(SIZES)
