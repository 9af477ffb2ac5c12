"""The planner's placement of optimizer state over host memory and devices (``smartinf plan --memory-budget``)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace

import pytest

from lightning_smartinf.plan import PlanError, load_profile, workload_from_model
from lightning_smartinf.plan.__main__ import main
from lightning_smartinf.plan.cost_model import Profile, Workload, cpu_backward_time
from lightning_smartinf.plan.tier_placement import cpu_overlap, memory_share, place_state


def test_emulated_devices_fill_the_budget_and_halve_the_update_at_half_the_state() -> None:
    work, prof = workload_from_model("336M"), load_profile("devvm-2cpu")
    state = 12 * work.params
    half = place_state(work, prof, 1, state / 2)
    assert half.memory_bytes == state / 2 and half.device_bytes == (state / 2,)
    assert half.all_on_device_s / half.update_s == pytest.approx(2.0, rel=0.05)
    none = place_state(work, prof, 1, 0)
    assert none.memory_bytes == 0 and none.update_s == none.all_on_device_s
    assert place_state(work, prof, 1, 10 * state).memory_bytes == state  # a budget beyond the state holds all of it


def test_cpu_overlap_stretches_backward_by_the_devices_share_of_the_cores() -> None:
    # Two cores; the devices stream 1 GB/s of state at 0.5 ns of one core per byte: a quarter of the cores.
    assert cpu_overlap(3.0, 100e9, 1e9, 0.5e-9, 2) == pytest.approx((4.0, 1.0))
    # State they finish within backward: all of their arithmetic, over the cores.
    assert cpu_overlap(3.0, 2e9, 1e9, 0.5e-9, 2) == pytest.approx((3.5, 0.5))
    # Devices that would take every core: all of their arithmetic stretches backward too.
    assert cpu_overlap(3.0, 10e9, 4e9, 0.5e-9, 2) == pytest.approx((5.5, 2.5))
    # Cores not known, or no backward to overlap: nothing stretches.
    assert cpu_overlap(3.0, 100e9, 1e9, 0.5e-9, None) == (3.0, 0.0)
    assert cpu_overlap(0.0, 100e9, 1e9, 0.5e-9, 2) == (0.0, 0.0)


def test_training_on_the_cpu_the_devices_stream_during_backward_on_its_cores() -> None:
    """CPU training with ``overlap_backward``: the devices stream their state from the start of the last
    micro-batch's backward, and their arithmetic there lengthens it by their share of the cores."""
    prof = replace(load_profile("devvm-2cpu"), cpu_training_tflops=0.5, cpu_reduce_s_per_gparam=1.0, cpu_cores=2)
    work = Workload(1.5e9, batch=1, seq=16, flops_per_param_token=6, accumulate=4)
    state = 12 * work.params
    backward = cpu_backward_time(work, prof)
    assert backward == pytest.approx(4 * 1.5e9 * 16 / 0.5e12 + 1.5)  # the last micro-batch's: its FLOPs and passes
    after = place_state(work, prof, 1, 0, overlap_backward=False)
    assert after.backward_s == after.shared_cores_s == 0
    rate = state / after.update_s  # state bytes per second
    seconds_per_byte = 1 / (prof.device_update_gparams_per_s * 1e9 * 12)
    overlapped = place_state(work, prof, 1, 0)
    expected = cpu_overlap(backward, state, rate, seconds_per_byte, 2)
    assert (overlapped.backward_s, overlapped.shared_cores_s) == pytest.approx(expected)
    assert overlapped.shared_cores_s == pytest.approx(overlapped.backward_s - backward)
    assert overlapped.shared_cores_s > 0
    assert overlapped.update_s == pytest.approx(after.update_s - overlapped.backward_s + overlapped.shared_cores_s)
    assert overlapped.all_on_device_s == pytest.approx(overlapped.update_s)
    assert "backward's longer on the cores the devices share" in overlapped.describe("none")
    # Half of the state in memory (filled on the CPU): the devices hide the same backward behind less state.
    half = place_state(work, prof, 1, state / 2)
    assert half.memory_bytes == state / 2 and half.backward_s == pytest.approx(overlapped.backward_s)
    # Cores not in the profile: their sharing is not modelled.
    assert place_state(work, replace(prof, cpu_cores=None), 1, 0).shared_cores_s == 0
    # A profile's cores that are not a count: refused with the key, before anything is planned.
    for bad, said in (("two", "is a str"), (0, "is too small")):
        with pytest.raises(PlanError, match=rf"`cpu_cores={bad!r}` {said}: it must be an int >= 1, or None"):
            Profile.from_dict({**prof.to_dict(), "cpu_cores": bad})


def test_steps_measured_end_to_end_set_the_devices_share_of_the_cores_and_the_memory_tiers_time() -> None:
    """A profile with a real device step's CPU time and the memory tier's step time per format uses them: the
    devices' arithmetic beside backward is the step's CPU time, the memory tier's update its measured time; a format
    the profile does not list, or a profile without them, falls back to the update rates, as before."""
    base = replace(load_profile("devvm-2cpu"), cpu_training_tflops=0.5, cpu_reduce_s_per_gparam=1.0, cpu_cores=2)
    work = Workload(1.5e9, batch=1, seq=16, flops_per_param_token=6, state_precision="int8")
    per_param = work.state_bytes
    # Without the measured steps, the fallbacks are the update rates' figures.
    cost = base.update_cost("int8")
    assert base.device_cpu_seconds("int8") == pytest.approx(cost / (base.device_update_gparams_per_s * 1e9))
    assert base.memory_update_rate("int8") == pytest.approx(base.host_update_gparams_per_s * 1e9 / cost)
    # A real step costs the cores more than its update alone (I/O calls, hand-offs): here twice as much.
    device_s = 2 * base.device_cpu_seconds("int8") * 1e9
    measured = replace(
        base,
        device_step_cpu_s_per_gparam_by_precision={"int8": device_s, "fp32": 7.0},
        memory_step_s_per_gparam_by_precision={"int8": 2.0},
    )
    assert measured.device_cpu_seconds("int8") == pytest.approx(device_s / 1e9)
    assert measured.memory_update_rate("int8") == pytest.approx(0.5e9)
    assert measured.memory_update_rate("bf16") == base.memory_update_rate("bf16")  # not listed: the fallback
    state = per_param * work.params
    before, after = place_state(work, base, 1, 0), place_state(work, measured, 1, 0)
    rate = state / place_state(work, measured, 1, 0, overlap_backward=False).update_s
    expected = cpu_overlap(cpu_backward_time(work, measured), state, rate, device_s / 1e9 / per_param, 2)
    assert (after.backward_s, after.shared_cores_s) == pytest.approx(expected)
    assert after.shared_cores_s > before.shared_cores_s
    # Half of the state in memory: the tier's update takes its measured time (and the devices' half hides behind
    # backward, which it stretches).
    half = place_state(work, measured, 1, state / 2)
    memory_s = work.params / 2 * 2.0 / 1e9
    assert half.update_s - half.shared_cores_s == pytest.approx(memory_s)
    # A profile's measured steps that are not a map of formats to positive numbers: refused with the key.
    for key in ("device_step_cpu_s_per_gparam_by_precision", "memory_step_s_per_gparam_by_precision"):
        for bad, said in (({"fp64": 1.0}, "fp64"), ({"int8": -1.0}, "['int8']=-1.0` is out of range"), ("x", "a str")):
            with pytest.raises(PlanError, match=re.escape(key) + ".*" + re.escape(said)):
                Profile.from_dict({**measured.to_dict(), key: bad})


def test_beside_backward_the_devices_keep_the_share_of_their_rate_calibration_measured() -> None:
    """CPU training: the devices' step run beside a training replay kept a measured share of its rate alone; during
    backward the devices stream at that share (and take that much less of the cores), and after it at their full
    rate. A format the profile does not list, no overlap, or a share of 1 leave the plan as it was."""
    prof = replace(load_profile("devvm-2cpu"), cpu_training_tflops=0.5, cpu_reduce_s_per_gparam=1.0, cpu_cores=2)
    work = Workload(1.5e9, batch=1, seq=16, flops_per_param_token=6, state_precision="int8")
    state = work.state_bytes * work.params
    full = place_state(work, prof, 1, 0)
    slowed_prof = replace(prof, device_rate_share_training_by_precision={"int8": 0.8, "fp32": 0.5})
    assert slowed_prof.device_rate_share_training("int8") == 0.8 and prof.device_rate_share_training("int8") == 1
    slowed = place_state(work, slowed_prof, 1, 0)
    rate = state / place_state(work, slowed_prof, 1, 0, overlap_backward=False).update_s
    seconds_per_byte = prof.device_cpu_seconds("int8") / work.state_bytes
    expected = cpu_overlap(cpu_backward_time(work, prof), state, 0.8 * rate, seconds_per_byte, 2)
    assert (slowed.backward_s, slowed.shared_cores_s) == pytest.approx(expected)
    assert slowed.backward_rate_share == 0.8 and full.backward_rate_share == 1
    assert slowed.update_s == pytest.approx(state / rate - 0.8 * slowed.backward_s + slowed.shared_cores_s)
    assert slowed.update_s > full.update_s and slowed.all_on_device_s == pytest.approx(slowed.update_s)
    assert "at 80% of their rate" in slowed.describe("none") and "of their rate" not in full.describe("none")
    # Not this format's share, a share of 1, or no overlap with backward: as before.
    assert place_state(work, replace(prof, device_rate_share_training_by_precision={"fp32": 0.5}), 1, 0) == full
    assert place_state(work, replace(prof, device_rate_share_training_by_precision={"int8": 1.0}), 1, 0) == full
    after = place_state(work, slowed_prof, 1, 0, overlap_backward=False)
    assert after == place_state(work, prof, 1, 0, overlap_backward=False) and after.backward_rate_share == 1
    # A share above 1 or not above 0: refused with the key.
    for bad in (1.5, 0.0):
        with pytest.raises(PlanError, match=r"device_rate_share_training_by_precision.*int8.*out of range"):
            Profile.from_dict({**slowed_prof.to_dict(), "device_rate_share_training_by_precision": {"int8": bad}})


def test_after_backward_the_devices_and_the_memory_tier_wait_for_the_cores_they_share() -> None:
    """After backward the devices' arithmetic left and the memory tier's step run on the same cores: where their CPU
    seconds over the cores exceed the slower tier's time, the update takes that long. The memory tier's CPU seconds are
    measured (else its update on one core); SmartSSDs compute on their own and are not bound by the host's cores."""
    prof = replace(
        load_profile("devvm-2cpu"),
        cpu_training_tflops=0.5,
        cpu_reduce_s_per_gparam=0.05,
        cpu_cores=2,
        device_update_gparams_per_s=10.0,
        ssd_read_gbps=20.0,
        ssd_write_gbps=20.0,
        device_storage_ceiling_gbps=None,
        memory_step_s_per_gparam_by_precision={"int8": 1.0},
    )
    work = Workload(1.5e9, batch=1, seq=16, flops_per_param_token=6, state_precision="int8")
    state = work.state_bytes * work.params
    assert prof.memory_cpu_seconds("int8") == pytest.approx(1e-9)  # not measured: its wall time on one core
    cheap = place_state(work, prof, 1, state / 2, overlap_backward=False)
    assert cheap.update_s == pytest.approx(work.params / 2 * 1.0 / 1e9)  # the memory tier's wall time: no cores bound
    # A memory tier that costs 3 CPU seconds per 1e9 elements and devices at 2: the cores bound the update, the two
    # tiers' CPU seconds over 2 cores.
    busy = replace(
        prof,
        memory_step_cpu_s_per_gparam_by_precision={"int8": 3.0},
        device_step_cpu_s_per_gparam_by_precision={"int8": 2.0},
    )
    bound = place_state(work, busy, 1, state / 2, overlap_backward=False)
    cores_s = (work.params / 2 * 2.0 + work.params / 2 * 3.0) / 1e9 / 2
    assert bound.update_s == pytest.approx(cores_s) and cores_s > cheap.update_s
    said = "after backward the host's cores bound it"
    assert bound.cores_after_s == pytest.approx(cores_s) and said in bound.describe("1GB")
    assert said not in cheap.describe("1GB")
    # The devices streaming during backward finish within it here: only the memory tier's CPU seconds are left.
    overlapped = place_state(work, busy, 1, state / 2)
    assert overlapped.update_s == pytest.approx(work.params / 2 * 3.0 / 1e9 / 2 + overlapped.shared_cores_s)
    # SmartSSDs (their gradient staged on their own SSD) compute on their own: no cores bound.
    smart = place_state(work, replace(busy, gradient_staged_on_ssd=True), 1, state / 2, overlap_backward=False)
    assert smart.update_s < cores_s
    # A profile's memory CPU seconds that are not positive numbers per format: refused with the key.
    with pytest.raises(PlanError, match=r"memory_step_cpu_s_per_gparam_by_precision.*int8.*out of range"):
        Profile.from_dict({**busy.to_dict(), "memory_step_cpu_s_per_gparam_by_precision": {"int8": 0.0}})


def test_devices_with_compute_of_their_own_get_the_share_that_finishes_with_memory() -> None:
    work, prof = workload_from_model("7B"), load_profile("paper-a5000")  # SmartSSDs: gradients staged on their SSD
    placed = place_state(work, prof, 9, 1e15)
    memory_rate = prof.host_update_gparams_per_s * 1e9 * 12
    # Memory and the devices finish together: neither holds more than its share.
    device_rate = placed.state_bytes / placed.all_on_device_s / 9
    assert placed.memory_bytes / memory_rate == pytest.approx(placed.update_s, rel=1e-6)
    assert placed.device_bytes[0] / device_rate == pytest.approx(placed.update_s, rel=1e-6)
    assert 0 < placed.memory_bytes < placed.state_bytes
    assert placed.update_s < placed.all_on_device_s
    assert memory_share(6, 10, 9.0, 1.0) == 6 and memory_share(10, 10, 1.0, 3.0) == 2.5


def test_beside_remote_servers_memory_takes_one_more_servers_share() -> None:
    work, prof = workload_from_model("1.3B"), replace(load_profile("devvm-2cpu"), network_gbps=1.25)
    state = 12 * work.params
    placed = place_state(work, prof, 2, 1e15)  # as the strategy splits: what a third server would hold
    assert placed.memory_bytes == pytest.approx(state / 3)
    assert place_state(work, prof, 2, state / 10).memory_bytes == pytest.approx(state / 10)  # at most the budget
    memory_rate = prof.host_update_gparams_per_s * 1e9 * 12
    assert placed.update_s >= placed.memory_bytes / memory_rate


def test_weights_share_the_devices_in_proportion() -> None:
    work, prof = workload_from_model("336M"), load_profile("devvm-2cpu")
    placed = place_state(work, replace(prof, device_storage_ceiling_gbps=None), 2, 0, weights=[3, 1])
    assert placed.device_bytes[0] == pytest.approx(3 * placed.device_bytes[1])
    with pytest.raises(PlanError, match="needs 2 finite numbers > 0"):
        place_state(work, prof, 2, 0, weights=[1])
    with pytest.raises(PlanError, match="must be >= 0"):
        place_state(work, prof, 2, -1)


def test_weights_are_finite_numbers_above_0(capsys) -> None:
    """NaN passed `w <= 0` and placed NaN bytes; inf left the other devices a rate of 0 (`ZeroDivisionError`)."""
    work, prof = workload_from_model("336M"), load_profile("devvm-2cpu")
    for bad in (math.nan, math.inf, 0.0, -1.0):
        with pytest.raises(PlanError, match=r"needs 2 finite numbers > 0 \(one per device\)"):
            place_state(work, prof, 2, 0, weights=[1.0, bad])
    assert main(["--model", "7B", "--devices", "2", "--device-weights", "1", "inf"]) == 2
    err = capsys.readouterr().err
    assert "`--device-weights 1 inf`: inf is not a finite number > 0." in err
    assert "Pass finite numbers > 0, e.g. `--device-weights 1 1`." in err


def test_cli_shows_the_placement_and_puts_the_budget_in_the_strategy(capsys) -> None:
    argv = ["--model", "336M", "--profile", "devvm-2cpu", "--devices", "1", "--memory-budget", "2GB"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "placement with state_memory_budget=2GB: 2.0 of 4.0 GB of optimizer state in host memory (50%)" in out
    assert main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["strategy"]["state_memory_budget"] == "2GB" and plan["placement"]["memory_bytes"] == 2e9
    assert main([*argv[:-1], "lots"]) == 2
    assert "`--memory-budget='lots'` is not a size" in capsys.readouterr().err


def test_the_accelerator_tier_fills_first_and_is_bound_by_the_gpu_link(capsys) -> None:
    work, prof = workload_from_model("7B"), load_profile("paper-a100")
    state = 12 * work.params
    placed = place_state(work, prof, 1, state / 4, accelerator_budget=state / 2)
    assert placed.accelerator_bytes == state / 2 and placed.memory_bytes == state / 4
    assert sum(placed.device_bytes) == pytest.approx(state / 4)
    # Its update carries 2 + 2 B over the GPU link per 12 B of state.
    gpu_s = (state / 2) / (prof.gpu_link_gbps * 1e9 * 12 / 4)
    assert placed.update_s >= gpu_s and placed.update_s < placed.all_on_device_s
    assert place_state(work, prof, 1, 0, accelerator_budget=10 * state).accelerator_bytes == state
    with pytest.raises(PlanError, match="profile 'devvm-2cpu' has no GPU"):
        place_state(work, load_profile("devvm-2cpu"), 1, 0, accelerator_budget=1e9)
    with pytest.raises(PlanError, match="`--accelerator-budget` must be >= 0"):
        place_state(work, prof, 1, 0, accelerator_budget=-1)
    argv = ["--model", "7B", "--profile", "paper-a100", "--devices", "1", "--accelerator-budget", "21GB"]
    assert main(argv) == 0
    assert "state_accelerator_budget=21GB: 21.0 GB in GPU memory (25%)" in capsys.readouterr().out
    assert main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["strategy"]["state_accelerator_budget"] == "21GB" and plan["placement"]["accelerator_bytes"] == 21e9


def test_beside_a_gpu_emulated_devices_hide_part_of_their_update_behind_backward(capsys) -> None:
    """An NVMe server with a GPU (``backend="cpu"``): the devices update on host cores the GPU leaves free during
    backward, so memory takes only what finishes with the rest of their update, and none when all of it hides."""
    prof = replace(load_profile("paper-a100"), name="nvme-a100", gradient_staged_on_ssd=False)
    work = workload_from_model("7B")
    state = 12 * work.params
    placed = place_state(work, prof, 2, state)
    assert placed.backward_s > 0
    device_rate = state / (placed.all_on_device_s + placed.backward_s)  # both devices, state bytes per second
    memory_rate = prof.host_update_gparams_per_s * 1e9 * 12
    hidden = placed.backward_s * device_rate
    assert placed.memory_bytes == pytest.approx(memory_share(state, state - hidden, memory_rate, device_rate))
    assert 0 < placed.memory_bytes < state
    # Memory and what is left of the devices' update after backward finish together.
    assert placed.update_s == pytest.approx(placed.memory_bytes / memory_rate, rel=1e-6)
    assert placed.update_s == pytest.approx((state - placed.memory_bytes - hidden) / device_rate, rel=1e-6)
    # Filling the budget would leave memory the whole update after backward.
    assert placed.update_s < state / memory_rate
    # A backward long enough to hide all of it: the devices take everything.
    long = place_state(replace(work, batch=256), prof, 2, state)
    assert long.memory_bytes == 0 and long.update_s == 0.0 == long.all_on_device_s
    assert "overlaps its" in long.describe("84GB")


def test_fill_keeps_the_budget_and_without_overlap_nothing_hides_behind_backward() -> None:
    """`state_memory_share="fill"` and `overlap_backward=False` beside a GPU (the machine planner's fallbacks when
    the disks are short of space)."""
    prof = replace(load_profile("paper-a100"), name="nvme-a100", gradient_staged_on_ssd=False)
    work = workload_from_model("7B")
    state = 12 * work.params
    assert place_state(work, prof, 2, state / 2, fill=True).memory_bytes == state / 2
    overlapped = place_state(work, prof, 2, state)
    after = place_state(work, prof, 2, state, overlap_backward=False)
    assert after.backward_s == 0 and 0 < after.memory_bytes < state  # still the share that finishes with them
    assert after.memory_bytes > overlapped.memory_bytes and after.update_s > overlapped.update_s
    given = place_state(work, prof, 2, state, fwd_bwd_s=3.0)
    assert given.backward_s == pytest.approx(2.0)
