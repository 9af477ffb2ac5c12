"""The planner knows each ``state_precision``: the state's bytes on the devices and on disk, the update's cost, the
table it prints, and the snippets it writes, for the ``cpu`` backend's machines and the SmartSSDs' alike."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from test_plan_snippets import MACHINE, machine_profile

from lightning_smartinf.core.state_formats import BLOCK, FORMATS
from lightning_smartinf.plan import PlanError, make_plan, plan_machine
from lightning_smartinf.plan.__main__ import main
from lightning_smartinf.plan.cost_model import (
    UPDATE_COST_BY_PRECISION,
    Profile,
    Workload,
    iteration,
    load_profile,
    state_bytes_per_param,
    zero_infinity,
)
from lightning_smartinf.plan.machine import Machine

#: The master (4 B) and Adam's two moments per parameter in each format: int8 is one byte per element plus one fp32
#: scale per block.
EXPECTED_BYTES = {"fp32": 12.0, "bf16": 8.0, "int8": 4 + 2 * (1 + 4 / BLOCK)}


def test_each_format_counts_its_own_bytes_on_the_devices_and_fp32_is_unchanged():
    prof = load_profile("devvm-2cpu")
    fp32 = Workload(2_000_000_000)
    for name in FORMATS:
        assert state_bytes_per_param(name) == EXPECTED_BYTES[name]
        work = replace(fp32, state_precision=name)
        step = iteration("su_o", work, prof, 2)
        # The state is read and written once a step; the gradient comes from host memory (nothing staged).
        assert step.storage_bytes == 2 * EXPECTED_BYTES[name] * work.params
        # ZeRO-Infinity keeps its own fp32 state whatever the strategy's precision.
        assert zero_infinity(work, prof, 2) == zero_infinity(fp32, prof, 2)
    assert iteration("su_o", fp32, prof, 2).storage_bytes == 24 * fp32.params


def test_the_update_costs_what_the_profile_measured_or_the_default():
    prof = load_profile("devvm-2cpu")
    work = Workload(2_000_000_000, state_precision="int8")
    serial = iteration("su", work, prof, 2)  # SU: the update is not hidden behind the I/O
    fp32 = iteration("su", replace(work, state_precision="fp32"), prof, 2)
    assert serial.update == pytest.approx(fp32.update * UPDATE_COST_BY_PRECISION["int8"])
    measured = replace(prof, update_cost_by_precision={"int8": 1.5})
    assert iteration("su", work, measured, 2).update == pytest.approx(fp32.update * 1.5)
    assert measured.update_cost("bf16") == UPDATE_COST_BY_PRECISION["bf16"]  # a format left out: the default


@pytest.mark.parametrize(
    ("costs", "message"),
    [
        ({"int4": 2.0}, "int4"),
        ({"int8": 0}, "update_cost_by_precision['int8']=0"),
        ({"bf16": "fast"}, "update_cost_by_precision['bf16']='fast'"),
        ([1.0], "update_cost_by_precision=[1.0]"),
    ],
)
def test_a_profile_with_bad_update_costs_is_refused_naming_them(costs, message, tmp_path):
    with pytest.raises(PlanError, match="update_cost_by_precision") as raised:
        Profile.from_dict({"name": "p", "update_cost_by_precision": costs})
    assert message in str(raised.value)
    with pytest.raises(PlanError, match="update_cost_by_precision") as raised:
        Machine.from_dict({**MACHINE, "update_cost_by_precision": costs})
    assert message.split("=")[0].split("[")[0] in str(raised.value)


def test_the_plan_compares_every_format_and_marks_the_one_asked_for(capsys):
    work = Workload(8_000_000_000, state_precision="bf16")
    plan = make_plan(work, load_profile("devvm-2cpu"))
    assert list(plan.precisions) == list(FORMATS)
    for name, (nbytes, seconds) in plan.precisions.items():
        assert nbytes == EXPECTED_BYTES[name] * work.params
        alike = replace(work, state_precision=name)
        assert seconds == iteration("su_o", alike, plan.profile, plan.devices, sub_group_size=plan.sub_group_size).total
    assert main(["--model", "8B", "--profile", "devvm-2cpu", "--state-precision", "bf16"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(tuple(f"  {n} " for n in FORMATS))]
    assert [row.split()[0] for row in rows] == list(FORMATS)
    assert [row for row in rows if row.endswith("<- this plan")] == [rows[1]]
    assert "96.0 GB of state" in rows[0] and "64.0 GB of state" in rows[1] and "48.2 GB of state" in rows[2]
    assert 'state_precision="bf16"' in out and "state_precision: bf16" in out
    assert main(["--model", "8B", "--profile", "devvm-2cpu", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["state_precision"]["int8"]["state_bytes"] == EXPECTED_BYTES["int8"] * 8e9
    assert "state_precision" not in answer["strategy"]  # fp32, the default, is not written out


def test_smartssd_profiles_plan_every_format_with_fewer_bytes_through_the_ssds(capsys):
    """The kernels hold every format; a SmartSSD's updater is bound by its state traffic, so fewer bytes of state
    give a shorter step there too."""
    prof = load_profile("paper-a5000")
    plan = make_plan(Workload(8_000_000_000, state_precision="int8"), prof)
    assert list(plan.precisions) == list(FORMATS)
    steps = [plan.precisions[name][1] for name in FORMATS]
    assert steps[0] > steps[1] > steps[2]
    assert prof.update_cost("int8") < prof.update_cost("bf16") < prof.update_cost("fp32")
    assert main(["--model", "8B", "--profile", "paper-a5000", "--state-precision", "int8"]) == 0
    out = capsys.readouterr().out
    assert "state_precision (" in out and 'state_precision="int8"' in out
    with pytest.raises(SystemExit) as exited:  # argparse's own choice check
        main(["--model", "8B", "--state-precision", "int4"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--state-precision" in err and "'fp32', 'bf16', 'int8'" in err


def test_a_machine_plan_sizes_its_disks_and_checkpoints_by_the_format(tmp_path, capsys):
    machine = Machine.from_dict(json.loads(machine_profile(tmp_path, {}).read_text()))
    fp32 = Workload(4_000_000_000)
    plans = {name: plan_machine(replace(fp32, state_precision=name), machine) for name in FORMATS}
    for name, plan in plans.items():
        assert plan.checkpoint_bytes == EXPECTED_BYTES[name] * fp32.params
        assert plan.precisions == plans["fp32"].precisions  # every plan compares the same three
        assert plan.precisions[name] == (EXPECTED_BYTES[name] * fp32.params, plan.total_s)
        assert plan.strategy_args().get("state_precision") == (None if name == "fp32" else name)
    assert plans["int8"].placement.state_bytes == EXPECTED_BYTES["int8"] * fp32.params
    profile = machine_profile(tmp_path, {})
    assert main(["--model", "4B", "--profile", str(profile), "--state-precision", "int8"]) == 0
    out = capsys.readouterr().out
    assert "disk (GB; state: 6.03 B/param, fp32 master, exp_avg, exp_avg_sq in int8" in out
    assert "<- this plan" in out


def test_split_masters_plan_2_125_bytes_per_master_and_whole_checkpoints(tmp_path, capsys):
    """``--split-masters``: 1.875 bytes fewer per parameter on the devices in every format, the parameters kept in
    host memory (and set aside during backward), checkpoints of whole masters, and the argument in the snippets."""
    for name in FORMATS:
        assert state_bytes_per_param(name, split_masters=True) == EXPECTED_BYTES[name] - 1.875
    machine = Machine.from_dict(json.loads(machine_profile(tmp_path, {}).read_text()))
    work = Workload(4_000_000_000, state_precision="int8")
    whole, split = plan_machine(work, machine), plan_machine(replace(work, split_masters=True), machine)
    assert split.placement.state_bytes == (EXPECTED_BYTES["int8"] - 1.875) * work.params
    assert split.checkpoint_bytes == whole.checkpoint_bytes == EXPECTED_BYTES["int8"] * work.params
    # The disk table counts the same whole-master checkpoints: the one kept and the one being saved.
    for plan in (whole, split):
        assert sum(s.checkpoint_bytes for s in plan.space) == 2 * plan.checkpoint_bytes
    # Beside the GPU the 16-bit parameters would stay there; split masters keep them in host memory, twice.
    assert whole.offload_parameters is False and split.offload_parameters is True
    assert split.strategy_args()["split_masters"] is True and "split_masters" not in whole.strategy_args()
    profile = machine_profile(tmp_path, {})
    assert main(["--model", "4B", "--profile", str(profile), "--state-precision", "int8", "--split-masters"]) == 0
    out = capsys.readouterr().out
    assert "disk (GB; state: 4.16 B/param, split master (2.125 B), exp_avg, exp_avg_sq in int8" in out
    assert "split_masters=True" in out and "split_masters: true" in out
    with pytest.raises(PlanError, match="`--params-on-storage` puts them on storage"):
        plan_machine(replace(work, split_masters=True), machine, params_on_storage=True)
    assert main(["--model", "8B", "--profile", "paper-a5000", "--split-masters"]) == 2
    assert "describes SmartSSDs or remote servers, which keep whole masters" in capsys.readouterr().err
