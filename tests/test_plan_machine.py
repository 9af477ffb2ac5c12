"""Machine profiles (``"kind": "local-nvme"``): a GPU server with local NVMe paths and the ``cpu`` backend.

The planner's decisions for one (paths, host RAM for state, where the 16-bit parameters and gradients live, overlap,
disk space per path), its calibration, and what ``--json`` leaves on stdout. The snippets it prints are run in
``tests/test_plan_snippets.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
from conftest import REPO_ROOT

from lightning_smartinf.plan import PlanError, workload_from_model
from lightning_smartinf.plan.__main__ import main
from lightning_smartinf.plan.calibrate import TRAINING_TOKENS, training_fit
from lightning_smartinf.plan.cost_model import (
    UPDATE_COST_BY_PRECISION,
    Profile,
    Workload,
    fwd_bwd_time,
    gpu_link_bytes,
    gradient_link_bytes,
    iteration,
    zero_infinity,
)
from lightning_smartinf.plan.machine import Machine, load_any
from lightning_smartinf.plan.machine_plan import GRADIENT_ACCUMULATING_SHARE, GRADIENT_GPU_SHARE, plan_machine

GB = 1e9
EXAMPLE = "example-gpu80-2nvme"


def example(**changes) -> Machine:
    machine = load_any(EXAMPLE)
    assert isinstance(machine, Machine)
    return replace(machine, **changes)


def with_free(machine: Machine, free_gb: float) -> Machine:
    return replace(machine, storage=tuple(replace(p, free_gb=free_gb) for p in machine.storage))


def test_the_documented_server_keeps_the_state_in_ram_and_the_parameters_on_the_gpu():
    """docs/planner.md's example: 1 GPU of 80 GB, 2 NVMe (3.0 / 2.5 GB/s, 3.84 TB each), 256 GB RAM."""
    seven, thirteen = (plan_machine(workload_from_model(size), example()) for size in ("7B", "13B"))
    for plan, params in ((seven, 7e9), (thirteen, 13e9)):
        assert plan.paths == (0, 1) and plan.overlap_backward and plan.offload_parameters is False and plan.fits
        # The whole state (12 B/param) fits in the RAM the run leaves: the budget covers it, padding included.
        assert plan.placement.state_bytes == 12 * params
        assert 12 * params * 1.01 <= plan.memory_budget <= 12 * params * 1.01 + 2**30
        # Beside a GPU the devices' update overlaps backward: memory takes what finishes with the rest of theirs.
        assert 0.5 * 12 * params < plan.placement.memory_bytes < 12 * params
        assert plan.total_s < plan.all_on_disk_s / 4
        assert plan.strategy_args()["state_memory_budget"] == f"{plan.memory_budget // 2**30}GiB"
    # 7B's gradients (14 GB) take 21% of the 66 GB the parameters leave on the GPU; 13B's (26 GB) 48% of 54 GB.
    assert (seven.gradient_buffer, thirteen.gradient_buffer) == ("accelerator", "host")
    assert thirteen.host_memory["gradient partitions"] == 26e9
    # Disk on the first path: at most all the state, twice (overlap), plus a checkpoint kept and one being saved.
    first = seven.space[0]
    assert (first.at_most_bytes, first.checkpoint_bytes, first.needed_bytes) == (84e9, 168e9, 252e9)
    assert seven.space[1].checkpoint_bytes == 0 and seven.space[0].free_bytes == 3840e9


def test_disk_counts_parameters_on_storage_and_checkpoints_elsewhere(tmp_path):
    plan = plan_machine(
        workload_from_model("13B"),
        example(),
        params_on_storage=True,
        checkpoint_dir=str(tmp_path / "ckpt"),
        keep_checkpoints=2,
    )
    # 26 GB of gradients are more than a quarter of the GPU: with the parameters on storage, a file beside them.
    assert plan.offload_parameters == "storage" and plan.gradient_buffer == "host"
    assert [s.parameter_bytes for s in plan.space[:2]] == [52e9, 0.0]
    assert "gradient partitions" not in plan.host_memory
    assert [s.checkpoint_bytes for s in plan.space] == [0.0, 0.0, 3 * 156e9]
    assert plan.space[2].path == str(tmp_path / "ckpt") and plan.space[2].free_bytes is not None
    assert plan.param_write_s > 0


def test_tight_disks_keep_the_budget_in_ram_then_give_up_the_second_copy_then_say_so(capsys):
    work = workload_from_model("7B")  # 84 GB of state
    fill = plan_machine(work, with_free(example(), 50), keep_checkpoints=0)
    assert (fill.overlap_backward, fill.fill) == (True, True) and fill.fits
    assert fill.strategy_args()["state_memory_share"] == "fill" and fill.space[0].at_most_bytes == 0
    budget = 40 * 10**9  # RAM keeps 40 GB: 44 GB on the paths, 22 GB each, twice with overlap
    overlapped = plan_machine(work, with_free(example(), 50), memory_budget=budget, keep_checkpoints=0)
    assert (overlapped.overlap_backward, overlapped.fill) == (True, True)
    one_copy = plan_machine(work, with_free(example(), 30), memory_budget=budget, keep_checkpoints=0)
    assert (one_copy.overlap_backward, one_copy.fill) == (False, True) and one_copy.fits
    assert one_copy.space[0].at_most_bytes == pytest.approx(22e9)
    assert "would not fit" in one_copy.reasons["overlap_backward"]
    full = plan_machine(work, with_free(example(), 10), memory_budget=budget, keep_checkpoints=0)
    assert not full.fits
    from lightning_smartinf.plan.machine_plan import format_machine_plan

    text = format_machine_plan(full, "python:", "yaml:")
    assert "DOES NOT FIT" in text and "Too little space" in text


def test_a_second_path_on_a_disk_is_used_only_where_its_update_thread_helps():
    def three_paths(device_rate: float) -> Machine:
        paths = [
            {"path": "/a0", "read_gbps": 3.0, "write_gbps": 2.5, "disk": "A"},
            {"path": "/a1", "read_gbps": 3.0, "write_gbps": 2.5, "disk": "A"},
            {"path": "/b0", "read_gbps": 3.0, "write_gbps": 2.5, "disk": "B"},
        ]
        return Machine.from_dict(
            {
                "kind": "local-nvme",
                "name": "three",
                "storage": paths,
                "host_memory_gb": 32,
                "device_update_gparams_per_s": device_rate,
                "host_update_gparams_per_s": 1.0,
            }
        )

    work = workload_from_model("7B")
    fast = three_paths(1.0)  # bound by the disks: a second path on disk A adds nothing
    assert fast.path_order() == [0, 2, 1]
    assert fast.aggregate_gbps([0, 1]) == fast.storage[0].state_gbps  # one disk: one disk's bandwidth
    plan = plan_machine(work, fast)
    assert plan.paths == (0, 2) and "adds no bandwidth" in plan.reasons["storage_paths"]
    slow = plan_machine(work, three_paths(0.02))  # bound by the update threads: a third one helps
    assert slow.paths == (0, 2, 1) and "1 more on a disk already used" in slow.reasons["storage_paths"]
    # All paths measured at once at half their disks' sum: every subset is scaled by it.
    shared = replace(fast, together_read_write_gbps=fast.storage[0].state_gbps)
    assert shared.aggregate_gbps([0, 2]) == pytest.approx(fast.storage[0].state_gbps)
    assert shared.to_profile([0, 2]).device_storage_ceiling_gbps == pytest.approx(fast.storage[0].state_gbps)


def test_large_models_move_the_parameters_to_host_ram_then_to_storage():
    assert plan_machine(workload_from_model("40B"), example()).offload_parameters is True  # 80 GB > half the GPU
    huge = plan_machine(workload_from_model("70B"), example())  # 280 GB of parameters and gradients: no room
    assert huge.offload_parameters == "storage" and huge.space[0].parameter_bytes > 0


def test_without_a_gpu_host_ram_holds_the_parameters_and_memory_fills_its_budget(capsys):
    machine = example(gpu=None)
    plan = plan_machine(workload_from_model("7B"), machine)
    assert plan.offload_parameters is False and plan.gradient_buffer is None
    assert "gradient_buffer" not in plan.strategy_args()
    assert plan.placement.memory_bytes == pytest.approx(84e9)  # CPU training: the memory tier fills its budget
    assert plan.space[0].at_most_bytes == 0  # so the paths hold only the rest, here nothing
    with pytest.raises(PlanError, match="has no GPU"):
        plan_machine(workload_from_model("7B"), machine, accelerator_budget=10**9)


def test_a_bad_machine_profile_is_refused_with_every_problem(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(
        json.dumps(
            {
                "kind": "local-nvme",
                "name": "bad",
                "backend": "xrt",
                "storage": [{"path": "/a", "read_gbps": 3.0}, {"path": "/b", "read_gbps": -1, "write_gbps": 1}],
                "device_update_gparams_per_s": 0.3,
                "host_update_gparams_per_s": 1.0,
                "gpu": {"name": "x", "memory_gb": 80},
                "colour": "blue",
            }
        )
    )
    assert main(["--model", "7B", "--profile", str(path)]) == 2
    err = capsys.readouterr().err
    for text in (
        '`host_memory_gb` is missing: add e.g. `"host_memory_gb": 256`',
        "`backend='xrt'`",
        "`storage[0]` lacks the key 'write_gbps'",
        "`storage[1]['read_gbps']=-1` is out of range: it must be a finite number > 0",
        "`gpu` lacks the keys 'link_gbps', 'peak_tflops'",
        "`profile` has unknown key 'colour'",
    ):
        assert text in err, text
    assert main(["--model", "7B", "--profile", EXAMPLE, "--devices", "3"]) == 2
    assert "has 2 storage path(s). Pass 1 to 2" in capsys.readouterr().err


def test_device_weights_are_finite_numbers_above_0(capsys):
    """NaN planned `nan` everywhere and put `device_weights=[1.0, nan]` in the snippet (exit 0); a sum of 0 divided by
    zero."""
    for weights, said in (
        (["1", "nan"], "nan is not a finite number > 0"),
        (["1", "-1"], "-1 is not a finite number > 0"),
        (["0", "inf"], "0, inf are not finite numbers > 0"),
    ):
        assert main(["--model", "7B", "--profile", EXAMPLE, "--device-weights", *weights]) == 2
        captured = capsys.readouterr()
        assert f"`--device-weights {' '.join(weights)}`: {said}." in captured.err
        assert not captured.out  # no plan
    with pytest.raises(PlanError, match=r"`--device-weights 1 -1`: each weight must be a finite number > 0"):
        plan_machine(workload_from_model("7B"), example(), devices=2, device_weights=[1.0, -1.0])


def test_zero_infinitys_update_runs_at_its_own_rate_and_ours_at_the_memory_tiers():
    """DeepSpeed's CPU-Adam, not this project's rule code, updates ZeRO-Infinity's state: a profile that measured both
    predicts each side's step from its own rate (the comparison was ZeRO-Infinity's at the memory tier's rate)."""
    work = workload_from_model("7B")
    machine = example(gpu=None, state_memory_gb=0.0)
    fast = replace(machine, baseline_update_gparams_per_s=10 * machine.host_update_gparams_per_s)
    plan, faster_baseline = plan_machine(work, machine), plan_machine(work, fast)
    assert machine.baseline_update_gparams_per_s is None  # unset: the memory tier's rate, as before
    saved = work.params / (machine.host_update_gparams_per_s * 1e9) * (1 - 1 / 10)
    assert plan.zero_infinity_s - faster_baseline.zero_infinity_s == pytest.approx(saved)
    assert faster_baseline.total_s == plan.total_s and faster_baseline.all_on_disk_s == plan.all_on_disk_s
    data = {**machine.to_dict(), "baseline_update_gparams_per_s": 0}
    with pytest.raises(PlanError, match=r"`baseline_update_gparams_per_s=0` is out of range"):
        Machine.from_dict(data)


def test_the_gradient_share_is_the_strategys():
    from lightning_smartinf.zero.gradient_buffer import AUTO_ACCELERATOR_SHARE, AUTO_ACCUMULATING_SHARE

    assert GRADIENT_GPU_SHARE == AUTO_ACCELERATOR_SHARE
    assert GRADIENT_ACCUMULATING_SHARE == AUTO_ACCUMULATING_SHARE


def test_accumulation_counts_every_micro_batch_and_credits_overlap_to_the_last(capsys):
    """16 micro-batches of 2 x 2048 tokens at 8B: sixteen times the compute and tokens; the gradients are summed in
    fp32 (32 GB), which the GPU keeps (a host buffer would take them over PCIe and back 15 times); the devices'
    update overlaps only the last micro-batch's backward; tokens per second are reported for both methods."""
    plans = {}
    for accumulate in (1, 16):
        assert main(["--model", "8B", "--profile", EXAMPLE, "--batch", "2", "--seq", "2048", "--accumulate",
                     str(accumulate), "--json"]) == 0  # fmt: skip
        plans[accumulate] = json.loads(capsys.readouterr().out)
    one, sixteen = plans[1], plans[16]
    assert sixteen["step"]["tokens"] == 16 * one["step"]["tokens"] == 16 * 2 * 2048
    assert sixteen["step"]["tokens_per_s"] == pytest.approx(sixteen["step"]["tokens"] / sixteen["step"]["total"])
    assert sixteen["step"]["zero_infinity_tokens_per_s"] < sixteen["step"]["tokens_per_s"]
    # Both keep the parameters and gradients on the GPU: the link's bytes are the same, the compute is 16 times.
    micro_batch = fwd_bwd_time(Workload(8_000_000_000, batch=2, seq=2048), load_any(EXAMPLE).to_profile((0, 1)), 0)
    assert sixteen["step"]["fwd_bwd"] - one["step"]["fwd_bwd"] == pytest.approx(15 * micro_batch)
    assert one["strategy"]["gradient_buffer"] == "accelerator"  # 16 GB of bf16 gradients, 25% of what is left
    assert sixteen["strategy"]["gradient_buffer"] == "accelerator"
    assert sixteen["gpu_memory_bytes"]["fp32 gradient partitions"] == 4 * 8e9
    assert "16 micro-batches a step" in sixteen["reasons"]["gradient_buffer"]
    assert sixteen["placement"]["backward_s"] < one["placement"]["backward_s"]
    assert main(["--model", "8B", "--profile", EXAMPLE, "--accumulate", "0"]) == 2
    assert "`--accumulate=0` is too small: it must be an int >= 1" in capsys.readouterr().err


def test_the_link_carries_each_micro_batch_once_and_the_sums_where_host_memory_keeps_them():
    """Bytes per parameter per step across PCIe, as ZeRO-3's code copies them (counted on the CPU in
    test_gpu_path.py): a host buffer takes each micro-batch once (fp32 when accumulating) and, after the first, the
    partial sum over and back; the GPU keeps them otherwise and a device reads the sum once."""
    assert gradient_link_bytes("host") == 2
    assert gradient_link_bytes("host", accumulate=16) == 4 + 15 * 8
    assert gradient_link_bytes("accelerator", accumulate=16) == 2
    assert gradient_link_bytes("host", compression=0.01, accumulate=2) == pytest.approx(2 + 4 + 2 + 0.06)
    # Stock DeepSpeed also brings the first micro-batch back for the norm; each micro-batch fetches the parameters.
    assert gpu_link_bytes("zero_infinity", accumulate=4) == 4 * 4 + 2 + 2 + 3 * 4
    assert gpu_link_bytes("su_o", gradient_buffer="host", accumulate=4) == 4 * 4 + 4 + 3 * 8


@pytest.mark.slow  # a whole calibration of two paths (a minute or more here)
def test_calibrate_measures_every_path_alone_and_together(tmp_path, capsys):
    paths = [tmp_path / "p0", tmp_path / "p1"]
    for path in paths:
        path.mkdir()
    out = tmp_path / "server.json"
    assert main(["--calibrate", *map(str, paths), "--calibrate-mb", "8", "-o", str(out)]) == 0
    data = json.loads(out.read_text())
    machine = Machine.from_dict(data)
    assert [p.path for p in machine.storage] == [str(p) for p in paths]
    assert all(p.read_gbps > 0 and p.write_gbps > 0 and p.read_write_gbps > 0 for p in machine.storage)
    assert machine.storage[0].disk == machine.storage[1].disk  # one filesystem here
    assert machine.together_read_write_gbps > 0 and machine.host_memory_gb > 0
    # Each state precision's update measured against fp32's, which is 1 by definition.
    assert set(machine.update_cost_by_precision) == {"fp32", "bf16", "int8"}
    assert machine.update_cost_by_precision["fp32"] == 1.0 and machine.update_cost_by_precision["int8"] > 0
    assert machine.to_profile([0]).update_cost("int8") == machine.update_cost_by_precision["int8"]
    assert machine.gpu is None and data["measured"]["gpu"].startswith("none")  # this machine has no GPU
    # ZeRO-Infinity's host Adam is measured apart from the memory tier's rule code: fused, on every thread.
    assert machine.baseline_update_gparams_per_s == data["measured"]["fused_adamw_gparams_per_s"] > 0
    assert machine.to_profile([0]).baseline_update_gparams_per_s == machine.baseline_update_gparams_per_s
    assert data["measured"]["shared_bandwidth"] is True
    # All paths at once, at the start and at the end: the profile takes their mean.
    start, end = data["measured"]["together_gbps_start"], data["measured"]["together_gbps_end"]
    assert start > 0 and end > 0 and machine.together_read_write_gbps == pytest.approx((start + end) / 2, abs=1e-3)
    # And beside each, from buffers of ordinary pages (ZeRO-Infinity's): the comparison's disk rates scale by it.
    start, end = data["measured"]["baseline_together_gbps_start"], data["measured"]["baseline_together_gbps_end"]
    assert start > 0 and end > 0
    assert machine.baseline_together_read_write_gbps == pytest.approx((start + end) / 2, abs=1e-3)
    assert machine.to_profile([0]).baseline_storage_scale == pytest.approx(
        machine.baseline_together_read_write_gbps / machine.together_read_write_gbps
    )
    assert not list(paths[0].iterdir())  # the test files are gone
    # A fused optimizer's rates, measured apart: the planner takes them with --fused.
    assert machine.fused_update_gparams_per_s > 0 and set(machine.fused_update_cost_by_precision) == {
        "fp32",
        "bf16",
        "int8",
    }
    fused = machine.to_profile([0], fused=True)
    assert fused.device_update_gparams_per_s == fused.host_update_gparams_per_s == machine.fused_update_gparams_per_s
    assert fused.update_cost("int8") == machine.fused_update_cost_by_precision["int8"]
    # A device's step and the memory tier's, run for real per format: the planner takes them for the rule as recipes
    # build it, not for a fused one (measured without it).
    for key in (
        "device_step_cpu_s_per_gparam_by_precision",
        "device_rate_share_training_by_precision",
        "memory_step_s_per_gparam_by_precision",
        "memory_step_cpu_s_per_gparam_by_precision",
    ):
        assert set(getattr(machine, key)) == {"fp32", "bf16", "int8"} and all(v > 0 for v in data[key].values())
        assert getattr(machine.to_profile([0]), key) == data[key] and getattr(fused, key) == {}
    # Beside training a device keeps at most its rate alone.
    assert all(share <= 1 for share in machine.device_rate_share_training_by_precision.values())
    # CPU training timed over a short and a long micro-batch, in the precision faster over the long one: the rate
    # and the time per parameter whatever the tokens give both timings back.
    measured, stacked = data["measured"]["training_seconds"], data["measured"]["training_params"]
    faster = min(measured, key=lambda name: measured[name]["512"] / stacked[name])  # per parameter: stacks differ
    assert machine.cpu_training_tflops > 0 and machine.cpu_step_s_per_gparam >= 0
    # The replay's weights and gradients are at least twice the CPU's largest cache, as a large model's are.
    element = {"bf16": 2, "fp32": 4}
    cache = data["measured"]["cpu_cache_bytes"]
    assert cache > 0 and all(2 * element[name] * n >= 2 * cache for name, n in stacked.items())
    for tokens, seconds in measured[faster].items():
        modelled = 6 * stacked[faster] * int(tokens) / (machine.cpu_training_tflops * 1e12)
        modelled += machine.cpu_step_s_per_gparam * stacked[faster] / 1e9
        assert modelled == pytest.approx(seconds, rel=0.05, abs=2e-3)
    rates = data["measured"]["training_tflops"]  # over the long micro-batch alone: the faster is the one fitted
    assert faster == max(rates, key=rates.get)
    # ZeRO-3's passes over each gradient.
    passes = {k: v for k, v in data.items() if "cpu_reduce" in k}
    assert len(passes) == 5 and all(v > 0 for v in passes.values())
    assert machine.to_profile([0]).baseline_cpu_reduce_s_per_gparam == passes["baseline_cpu_reduce_s_per_gparam"]
    assert main(["--model", "100M", "--profile", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f'storage_paths=["{paths[0]}"' in printed and "not modelled" not in printed


def test_a_disk_whose_rate_moved_while_calibrating_is_named_in_the_plan(tmp_path, capsys):
    """A calibration that measured the paths at once 1.0 then 1.5 GB/s: the plan says so beside the paths, and that a
    disk-bound step may move as much; a rate that held, or a profile without the two measurements, says nothing."""
    said = "note: the paths' rate at once moved from 1.00 to 1.50 GB/s (+50%) while calibrating"
    for measured, shown in (({"together_gbps_start": 1.0, "together_gbps_end": 1.5}, True),
                            ({"together_gbps_start": 1.0, "together_gbps_end": 1.1}, False),
                            ({}, False)):  # fmt: skip
        profile = tmp_path / "machine.json"
        profile.write_text(json.dumps({**cpu_machine().to_dict(), "measured": measured}))
        assert main(["--model", "1B", "--profile", str(profile), "--batch", "1"]) == 0
        out = capsys.readouterr().out
        assert (said in out) is shown and ("calibrate again near the run" in out) is shown
    assert cpu_machine(measured={"together_gbps_start": 2.0, "together_gbps_end": 1.0}).disk_swing() == (2.0, 1.0)


def test_zero_infinitys_disk_is_what_its_buffers_of_ordinary_pages_reached():
    """ZeRO-Infinity swaps its state through buffers of ordinary pages; the devices' are huge pages. Where calibration
    saw the paths at once reach 60% as much from ordinary pages, the comparison's state traffic takes 1/0.6 as long,
    and nothing of ours changes; a profile without that measurement compares at the devices' rate, as before."""
    work = workload_from_model("7B")
    same = cpu_machine(together_read_write_gbps=2.0)
    slower = replace(same, baseline_together_read_write_gbps=1.2)
    assert same.to_profile([0]).baseline_storage_scale == 1.0
    assert slower.to_profile([0]).baseline_storage_scale == pytest.approx(0.6)
    ours = [iteration("su_o", work, m.to_profile([0]), 1) for m in (same, slower)]
    assert ours[0] == ours[1]
    base = [iteration("zero_infinity", work, m.to_profile([0]), 1) for m in (same, slower)]
    assert base[1].storage_io == pytest.approx(base[0].storage_io / 0.6)
    assert base[1].grad_transfer == pytest.approx(base[0].grad_transfer / 0.6)
    assert base[1].fwd_bwd == base[0].fwd_bwd and base[1].update == base[0].update
    # A profile written by hand is checked: the scale is a number above 0.
    for bad in (-1, 0, "fast"):
        with pytest.raises(PlanError, match="baseline_storage_scale"):
            Profile.from_dict({"name": "x", "baseline_storage_scale": bad})
    assert Profile.from_dict({"name": "x", "baseline_storage_scale": 0.6}).baseline_storage_scale == 0.6


def cpu_machine(**changes) -> Machine:
    """The example server without its GPU, with made-up CPU training figures (one number each, to check the sums)."""
    figures = {
        "cpu_training_tflops": 0.25,
        "cpu_reduce_s_per_gparam": 3.0,
        "cpu_reduce_accumulating_s_per_gparam": 2.0,
        "baseline_cpu_reduce_s_per_gparam": 9.0,
        "baseline_cpu_reduce_accumulating_s_per_gparam": 5.0,
    }
    return example(gpu=None, **{**figures, **changes})


def test_cpu_training_is_the_products_and_each_methods_gradient_passes():
    """Without a GPU, forward and backward are their FLOPs at the host's measured training rate, plus
    ZeRO-3's host passes over each gradient: the last micro-batch's once, each earlier one's, and stock ZeRO-3's
    (its averaging and float64 norm) for ZeRO-Infinity."""
    machine = cpu_machine()
    prof = machine.to_profile((0,))
    work = Workload(1_000_000_000, batch=1, seq=512, accumulate=8)
    products = 8 * 1e9 * 8 * 512 / 0.25e12  # 8 FLOPs per parameter and token (recompute), 4096 tokens
    assert fwd_bwd_time(work, prof) == pytest.approx(products + 3.0 + 7 * 2.0)
    assert zero_infinity(work, prof, 1).fwd_bwd == pytest.approx(products + 9.0 + 7 * 5.0)
    without_recompute = replace(work, flops_per_param_token=6.0)
    assert fwd_bwd_time(without_recompute, prof) == pytest.approx(products * 6 / 8 + 3.0 + 7 * 2.0)
    # An extra per-micro-batch term (a profile written by hand) adds to every micro-batch.
    extra = cpu_machine(cpu_step_s_per_gparam=1.0).to_profile((0,))
    assert fwd_bwd_time(work, extra) == pytest.approx(products + 3.0 + 7 * 2.0 + 8 * 1.0)
    plan = plan_machine(work, machine)
    assert plan.fwd_bwd_s == pytest.approx(fwd_bwd_time(work, prof))
    # Without the rate the FLOPs are not modelled: only the passes (none here) count.
    assert fwd_bwd_time(work, example(gpu=None).to_profile((0,))) == 0


def test_the_replayed_reduce_scatter_runs_over_a_group_of_its_own_and_leaves_a_callers_group_alone(tmp_path):
    """Stock ZeRO-3's reduce-scatter over one rank is replayed with torch.distributed's own call over a gloo group
    made for it and destroyed after (summing one rank's bucket leaves it as it was); where the caller has a group of
    its own, it is neither used nor destroyed, and a copy stands in. In a fresh interpreter: a test before this one in
    the same process may have left a group."""
    script = f"""
import torch
import torch.distributed as dist
from lightning_smartinf.plan.calibrate import _one_rank_collective

bucket = torch.randn(1 << 16).to(torch.bfloat16)
assert not dist.is_initialized()
with _one_rank_collective() as collective:
    assert dist.is_initialized() and dist.get_world_size() == 1
    assert torch.equal(collective(bucket.clone()), bucket)
assert not dist.is_initialized()
dist.init_process_group("gloo", init_method="file://{tmp_path / "store"}", rank=0, world_size=1)
group = dist.group.WORLD
with _one_rank_collective() as collective:
    out = collective(bucket)
    assert torch.equal(out, bucket) and out.data_ptr() != bucket.data_ptr()
assert dist.is_initialized() and dist.group.WORLD is group
dist.destroy_process_group()
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_the_training_fit_splits_a_micro_batch_into_its_flops_and_a_time_per_parameter():
    """Two timings of one block, 16 and 512 tokens: the rate of what the longer one adds, and the rest per 1e9
    parameters; timings whose noise would make the rest negative leave it 0."""
    params, rate, fixed = 50_000_000, 0.5, 0.2  # TFLOPS, seconds per 1e9 parameters
    seconds = [6 * params * tokens / (rate * 1e12) + fixed * params / 1e9 for tokens in TRAINING_TOKENS]
    assert training_fit(params, seconds) == pytest.approx((rate, fixed))
    flat = training_fit(params, [0.001, 0.1])  # the short one faster than its tokens' share: nothing left over
    assert flat[1] == 0 and flat[0] == pytest.approx(6 * params * 496 / 0.099 / 1e12)


def test_the_plan_says_when_cpu_training_is_not_modelled_and_what_it_assumed(tmp_path, capsys):
    measured, unmeasured = tmp_path / "measured.json", tmp_path / "unmeasured.json"
    measured.write_text(json.dumps(cpu_machine().to_dict()))
    unmeasured.write_text(json.dumps(example(gpu=None).to_dict()))
    assert main(["--model", "1B", "--profile", str(unmeasured), "--batch", "1", "--seq", "512"]) == 0
    assert "no `cpu_training_tflops` in the profile: forward and backward's FLOPs are not modelled" in (
        capsys.readouterr().out
    )
    assert main(["--model", "1B", "--profile", str(measured), "--batch", "1", "--seq", "512", "--no-recompute"]) == 0
    printed = capsys.readouterr().out
    assert "not modelled" not in printed and "batch 1 x seq 512, 6 FLOPs per parameter and token" in printed
    for key, value, message in (
        ("cpu_training_tflops", 0, "`cpu_training_tflops=0` is out of range: it must be a finite number > 0"),
        (
            "cpu_reduce_s_per_gparam",
            "fast",
            "`cpu_reduce_s_per_gparam='fast'` is a str: it must be a finite number >= 0",
        ),
        (
            "baseline_cpu_reduce_accumulating_s_per_gparam",
            -2,
            "`baseline_cpu_reduce_accumulating_s_per_gparam=-2` is out of range: it must be a finite number >= 0",
        ),
    ):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({**cpu_machine().to_dict(), key: value}))
        assert main(["--model", "1B", "--profile", str(bad)]) == 2
        assert message in capsys.readouterr().err
    assert main(["--calibrate", str(tmp_path / "missing")]) == 2
    assert f"`--calibrate {tmp_path / 'missing'}`: not a directory" in capsys.readouterr().err


def test_json_stdout_holds_json_only(capsys, monkeypatch):
    """Whatever is printed while planning (a library's warning) goes to stderr."""
    import lightning_smartinf.plan.__main__ as entry

    real = entry.workload_from_model

    def noisy(*args, **kwargs):
        print("[WARNING] a library's warning on stdout")
        return real(*args, **kwargs)

    monkeypatch.setattr(entry, "workload_from_model", noisy)
    assert main(["--model", "7B", "--profile", EXAMPLE, "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["strategy"]["state_memory_budget"] == "80GiB"
    assert "a library's warning" in captured.err


@pytest.mark.slow  # a whole calibration (about a minute here)
def test_a_calibration_without_an_output_file_is_part_of_the_json(tmp_path, capsys):
    assert main(["--calibrate", str(tmp_path), "--calibrate-mb", "8", "--model", "100M", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["calibrated_profile"]["kind"] == "local-nvme" and answer["kind"] == "local-nvme"


@pytest.mark.slow
def test_planning_in_a_fresh_process_imports_neither_deepspeed_nor_lightning():
    """`python -m lightning_smartinf.plan ... --json` prints parseable JSON, and a plan loads no DeepSpeed and no
    Lightning (torch: see docs/planner.md)."""
    argv = ["--model", "13B", "--profile", EXAMPLE, "--json"]
    run = subprocess.run(
        [sys.executable, "-m", "lightning_smartinf.plan", *argv], capture_output=True, text=True, cwd=REPO_ROOT
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["strategy"]["gradient_buffer"] == "host"
    script = (
        "import json, sys\n"
        "from lightning_smartinf.plan.__main__ import main\n"
        f"code = main({argv!r})\n"
        "loaded = sorted({m.split('.')[0] for m in sys.modules} & {'deepspeed', 'lightning', 'pytorch_lightning'})\n"
        "print(json.dumps({'code': code, 'loaded': loaded}), file=sys.stderr)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO_ROOT)
    assert run.returncode == 0, run.stderr
    json.loads(run.stdout)
    assert json.loads(run.stderr.strip().splitlines()[-1]) == {"code": 0, "loaded": []}


def test_the_docs_show_what_the_planner_prints(capsys):
    """docs/planner.md's worked example and validation table are the commands' output, figure for figure."""
    from benchmarks.validate_planner import validation_markdown
    from lightning_smartinf.plan.planner import PYTHON_HEADER

    doc = (REPO_ROOT / "docs" / "planner.md").read_text()
    assert validation_markdown() in doc
    for size in ("7B", "13B"):
        assert main(["--model", size, "--profile", EXAMPLE]) == 0
        report = capsys.readouterr().out.split(PYTHON_HEADER)[0].rstrip()
        assert f"$ smartinf plan --model {size} --profile {EXAMPLE}\n{report}\n```" in doc, size


def test_a_fused_optimizer_is_planned_at_its_own_update_rates(capsys):
    """`AdamW(fused=True)` runs torch's fused kernel on the devices and in the memory tier, several times the rate of
    the single-tensor rule: `--fused` plans with the rates the profile measured for it, each format's cost too."""
    machine = example(
        gpu=None,
        state_memory_gb=0.0,
        device_update_gparams_per_s=0.01,  # slow enough that the update, not the disk, is each device's time
        fused_update_gparams_per_s=0.1,
        fused_update_cost_by_precision={"fp32": 1.0, "bf16": 1.5, "int8": 4.0},
    )
    unfused, fused = machine.to_profile((0, 1)), machine.to_profile((0, 1), fused=True)
    assert (unfused.device_update_gparams_per_s, unfused.host_update_gparams_per_s) == (0.01, 1.5)
    assert (fused.device_update_gparams_per_s, fused.host_update_gparams_per_s) == (0.1, 0.1)
    assert fused.update_cost("int8") == 4.0 and unfused.update_cost("int8") == machine.update_cost_by_precision.get(
        "int8", UPDATE_COST_BY_PRECISION["int8"]
    )
    work = Workload(1_000_000_000, batch=1, seq=16)
    slow, fast = plan_machine(work, machine, devices=2), plan_machine(replace(work, fused=True), machine, devices=2)
    assert fast.placement.update_s == pytest.approx(slow.placement.update_s / 10)  # 10x the rate, update-bound
    # A profile that measured no fused rate plans a fused optimizer as it plans any other.
    assert example(gpu=None).to_profile((0,), fused=True) == example(gpu=None).to_profile((0,))
    assert main(["--model", "1B", "--profile", EXAMPLE, "--batch", "1", "--fused"]) == 0
    assert "batch 1 x seq 1024, a fused optimizer" in capsys.readouterr().out


def test_with_compression_the_machine_plan_counts_the_state_of_the_rule_the_strategy_runs():
    """With `compression`, rule "auto" runs EF-Adam for Adam/AdamW: the master and `exp_avg_sq`, 8 B per parameter
    in fp32, not Adam's 12. The plan counted 12 (state, disk, checkpoints, update) and named `exp_avg` on the disks."""
    from lightning_smartinf.plan.machine_plan import format_machine_plan

    work = workload_from_model("7B")
    compressed = plan_machine(work, example(), compression=0.01)
    assert compressed.work.state_bytes == 8 and compressed.precisions["fp32"][0] == 8 * work.params
    assert compressed.checkpoint_bytes == (8 + 4) * work.params  # and the fp32 error-feedback residual
    text = format_machine_plan(compressed, "python:", "yaml:")
    assert "state: 8 B/param, fp32 master, exp_avg_sq (EF-Adam)" in text and "exp_avg," not in text
    dense = plan_machine(work, example(), devices=len(compressed.paths))
    assert dense.work.state_bytes == 12 and "fp32 master, exp_avg, exp_avg_sq" in format_machine_plan(dense, "", "")
    assert compressed.placement.update_s < dense.placement.update_s
    adafactor = replace(work, rule="ef_adafactor").compressed(0.01)
    assert adafactor.state_bytes == 4  # the master only: the host keeps the factored second moment
