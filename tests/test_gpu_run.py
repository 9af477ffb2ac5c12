"""The prepared run for a lent GPU (``scripts/gpu_run.py``) runs here on the CPU with small sizes, so that it cannot
rot between the sessions that have a GPU. Its single-GPU checks run in the main suite already (``tests/cuda``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT
from helpers.launch import worker_env

SCRIPT = REPO_ROOT / "scripts" / "gpu_run.py"


def _run_small_on_a_cpu(out: Path, parts: str) -> dict:
    """``parts`` of the GPU run, small, on this CPU, into ``out``: the record, once the run passed."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--device", "cpu", "--parts", parts],
        env=worker_env(), capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert (out / "record.json").is_file(), f"exit {done.returncode}, no record written:\n{done.stderr[-3000:]}"
    record = json.loads((out / "record.json").read_text())
    assert done.returncode == 0, json.dumps(record, indent=1)[-6000:] + done.stderr[-3000:]
    return record


@pytest.mark.slow
def test_the_journey_the_step_and_activation_offload_run_small_on_a_cpu(tmp_path):
    record = _run_small_on_a_cpu(tmp_path, "journey,step,activations")
    parts = record["parts"]
    assert [parts[name]["status"] for name in ("journey", "step", "activations")] == ["passed"] * 3
    journey = parts["journey"]
    # Killed (SIGKILL) after step 4's checkpoint, resumed from last.ckpt for steps 5 and 6, exported, reloaded.
    assert len(journey["killed"]["losses"]) == 4 and len(journey["resumed"]["losses"]) == 2
    assert journey["reloaded"]["dtype"] == "torch.bfloat16" and journey["reloaded"]["generated"]
    assert journey["killed"]["peak_rss_bytes"] > 0 and journey["killed"]["peak_gpu_bytes"] is None
    results = parts["step"]["bench_step"]["results"]
    assert {"smart_infinity", "zero_infinity_pipelined", "smart_infinity_mem50"} <= set(results)
    # The planner's prediction from a profile calibrated on the same path, beside each measured step it models.
    planner = parts["step"]["planner"]
    assert planner["status"] == "passed" and planner["params"] == pytest.approx(parts["step"]["params"], rel=0.01)
    assert planner["calibrated"]["storage"][0]["read_gbps"] > 0 and planner["profile"] == "step-machine"
    assert set(parts["step"]["planner_over_measured"]) == {"smart_infinity", "zero_infinity_pipelined"}
    assert "chosen" in json.dumps(parts["activations"]["bench_activations"])
    assert record["machine"]["gpu"] is None and record["size"] == "tiny"


@pytest.mark.slow
def test_the_state_formats_step_runs_small_on_a_cpu(tmp_path):
    """The part a GPU run does only when asked (``--parts formats``): every state format's run of the step, once."""
    part = _run_small_on_a_cpu(tmp_path, "formats")["parts"]["formats"]
    results = part["bench_step"]["results"]
    assert set(results) == {
        "smart_infinity",
        "smart_infinity_int8",
        "smart_infinity_int8_split",
        "smart_infinity_mem50_int8",
        "smart_infinity_mem50_int8_split",
        "zero_infinity_pipelined",
    }
    assert all("train_step_mean_s" in r for r in results.values())

    def disk(run: str) -> float:
        return results[run]["disk_read_bytes_per_param_step"] + results[run]["disk_write_bytes_per_param_step"]

    # Each smaller form of the state moves fewer bytes (the counts themselves are tested elsewhere).
    assert disk("smart_infinity_int8_split") < disk("smart_infinity_int8") < disk("smart_infinity")
    assert disk("smart_infinity_mem50_int8_split") < disk("smart_infinity_mem50_int8") < disk("smart_infinity_int8")


def test_without_a_gpu_the_gpu_run_is_refused_with_the_reason(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path)], env=worker_env(), capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "--device cuda: this machine has no CUDA GPU" in done.stderr and "use --device cpu" in done.stderr
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--device", "cpu", "--parts", "journey,nope"],
        env=worker_env(), capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 2 and "unknown ['nope']" in done.stderr
