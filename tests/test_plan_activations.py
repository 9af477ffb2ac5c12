"""The activation-offload cost model (plan/activations.py) and the automatic settings it chooses (tuning.py)."""

from __future__ import annotations

import pytest

from lightning_smartinf.activations.costs import (
    AUTO_OVERHEAD,
    HOST_CPU_FACTOR,
    PREDICTION_MARGIN,
    IOCosts,
    offload_overhead,
)
from lightning_smartinf.activations.tuning import MIN_BUDGET, MIN_THRESHOLD, tune

MB = 1 << 20
LAYERS = 8
FORWARD = [0.02] * LAYERS  # seconds per layer
NBYTES = [30 * MB] * LAYERS
FAST = IOCosts(write_bytes_per_s=1e12, read_bytes_per_s=1e12)


def test_fast_io_costs_nothing_and_keeping_layers_offloads_less():
    for keep in range(LAYERS + 1):
        o = offload_overhead(FORWARD, NBYTES, keep, FAST, budget=2 * 30 * MB)
        assert o.forward_stall_s == pytest.approx(0, abs=1e-6) and o.backward_stall_s == pytest.approx(0, abs=1e-6)
        assert o.offloaded_bytes == (LAYERS - keep) * 30 * MB
    assert offload_overhead(FORWARD, NBYTES, LAYERS, FAST, budget=MB).total_s == pytest.approx(0, abs=1e-9)


def test_slow_writes_stall_forward_and_slow_reads_stall_backward():
    step = sum(FORWARD) * 3
    # Writing 7 layers at 30 MB per 0.04 s takes twice forward: forward waits, beyond the budget.
    slow_write = IOCosts(write_bytes_per_s=30 * MB / 0.04, read_bytes_per_s=1e12)
    o = offload_overhead(FORWARD, NBYTES, 1, slow_write, budget=30 * MB)
    assert o.forward_stall_s > 0.05 and o.backward_stall_s == pytest.approx(0, abs=1e-6)
    # A bigger budget absorbs some of it.
    assert offload_overhead(FORWARD, NBYTES, 1, slow_write, budget=120 * MB).forward_stall_s < o.forward_stall_s
    # Reads at a layer per 0.1 s, backward 0.04 s per layer: backward waits at least the difference per layer.
    slow_read = IOCosts(write_bytes_per_s=1e12, read_bytes_per_s=30 * MB / 0.1)
    o = offload_overhead(FORWARD, NBYTES, 1, slow_read, budget=60 * MB)
    assert o.backward_stall_s >= 7 * 0.1 - step and o.forward_stall_s == pytest.approx(0, abs=1e-6)
    assert o.share == pytest.approx(o.total_s / step)


def test_cpu_cost_counts_only_where_compute_shares_the_cores():
    on_host = IOCosts(write_bytes_per_s=1e12, read_bytes_per_s=1e12, cpu_s_per_byte=1e-10, compute_on_host=True)
    o = offload_overhead(FORWARD, NBYTES, 2, on_host, budget=60 * MB)
    moved = 2 * 6 * 30 * MB  # written and read back
    assert o.cpu_s == pytest.approx(HOST_CPU_FACTOR * 1e-10 * moved)
    gpu = IOCosts(write_bytes_per_s=1e12, read_bytes_per_s=1e12, cpu_s_per_byte=1e-10, compute_on_host=False)
    assert offload_overhead(FORWARD, NBYTES, 2, gpu, budget=60 * MB).cpu_s == 0


def test_bytes_still_being_written_when_backward_starts_are_not_read():
    slow_write = IOCosts(write_bytes_per_s=30 * MB / 0.5, read_bytes_per_s=1e12, cpu_s_per_byte=1e-9)
    o = offload_overhead(FORWARD, NBYTES, 0, slow_write, budget=1 << 40)
    written = o.offloaded_bytes
    assert o.cpu_s < HOST_CPU_FACTOR * 1e-9 * 2 * written  # some of it never comes back from disk


def test_mismatched_inputs_are_refused():
    with pytest.raises(ValueError, match="2 layer times for 3"):
        offload_overhead([0.1, 0.1], [1, 2, 3], 0, FAST, budget=MB)


def _sizes(layers: int = LAYERS) -> list[list[int]]:
    return [[6 * MB, 6 * MB, 2 * MB, 2 * MB, 100 * 1024] for _ in range(layers)]


def test_tune_derives_threshold_and_budget_from_the_model():
    t = tune(FORWARD, 0.01, _sizes(), FAST, None, None, None)
    assert t.threshold_bytes == max(MIN_THRESHOLD, 6 * MB // 16)  # the 100 KiB statistics stay in memory
    layer = 16 * MB
    assert t.max_inflight_bytes in {max(MIN_BUDGET, int(k * layer)) for k in (1.0, 1.5, 2.0)}
    assert t.keep_last == 0  # free I/O: everything leaves memory
    assert t.predicted.offloaded_bytes == LAYERS * layer


def test_tune_keeps_layers_when_io_costs_cpu_and_respects_given_settings():
    costly = IOCosts(write_bytes_per_s=3e9, read_bytes_per_s=2e9, cpu_s_per_byte=1e-10, compute_on_host=True)
    t = tune(FORWARD, 0.01, _sizes(), costly, None, None, None)
    # Less than everything leaves (layers kept or only the larger tensors), within the margin of the budget.
    assert t.held_back and (t.keep_last > 0 or t.threshold_bytes > 6 * MB // 16)
    assert 0 < t.predicted.offloaded_bytes < LAYERS * 16 * MB and t.predicted.share <= AUTO_OVERHEAD
    cheaper = tune(FORWARD, 0.01, _sizes(), costly, None, None, None, budget=0.6)
    assert cheaper.held_bytes <= t.held_bytes
    given = tune(FORWARD, 0.01, _sizes(), costly, 1 << 20, 2, 1 << 30)
    assert (given.threshold_bytes, given.keep_last, given.max_inflight_bytes) == (1 << 20, 2, 1 << 30)
    assert given.given and not given.held_back


def test_where_nothing_can_hide_nothing_is_offloaded():
    """Writes and reads far slower than compute: no setting keeps the budget but offloading nothing."""
    hopeless = IOCosts(write_bytes_per_s=1e6, read_bytes_per_s=1e6, cpu_s_per_byte=1e-6, compute_on_host=True)
    worst = tune(FORWARD, 0.01, _sizes(), hopeless, None, None, None)
    assert worst.offloads_nothing and worst.held_back and worst.predicted.share == 0
    assert worst.held_bytes == worst.saved_bytes and worst.saving == 0


@pytest.mark.parametrize("write_gbps", [0.02, 0.05, 0.2, 1.0, 10.0])
def test_the_budget_holds_and_a_larger_one_saves_more(write_gbps):
    """From a disk that hides almost nothing to one that hides everything: the prediction stays within the margin of
    each budget, the memory left falls as the budget grows, and the choice is held back where the budget binds."""
    io = IOCosts(write_bytes_per_s=write_gbps * 1e9, read_bytes_per_s=write_gbps * 1e9, cpu_s_per_byte=2e-11)
    held = []
    for budget in (0.02, 0.1, 0.3):
        t = tune(FORWARD, 0.01, _sizes(), io, None, None, None, budget=budget)
        assert t.predicted.share <= budget * PREDICTION_MARGIN + 1e-12
        held.append(t.held_bytes)
    assert held == sorted(held, reverse=True)
    most = tune(FORWARD, 0.01, _sizes(), IOCosts(1e15, 1e15), None, None, None)
    assert held[-1] >= most.held_bytes


def test_a_measured_step_slower_than_predicted_offloads_less():
    """The re-check's correction: seconds per offloaded byte the step took beyond the model make every offloading
    option dearer, so the choice leaves more in memory."""
    io = IOCosts(write_bytes_per_s=0.5e9, read_bytes_per_s=0.5e9, cpu_s_per_byte=1e-11)
    first = tune(FORWARD, 0.01, _sizes(), io, None, None, None)
    assert first.predicted.offloaded_bytes > 0
    extra = 0.05 * first.predicted.step_s / first.predicted.offloaded_bytes  # 5% more than predicted
    again = tune(FORWARD, 0.01, _sizes(), io, None, None, None, extra_s_per_byte=extra)
    assert again.held_bytes > first.held_bytes
    assert tune(FORWARD, 0.01, _sizes(), io, None, None, None, extra_s_per_byte=-extra).held_bytes <= first.held_bytes


def test_tune_with_nothing_big_enough_offloads_nothing():
    t = tune(FORWARD, 0.01, [[1024]] * LAYERS, FAST, None, None, None)
    assert t.predicted.offloaded_bytes == 0 and t.max_inflight_bytes == MIN_BUDGET
