"""The CUDA suite (``-m cuda``): each check of ``gpu_checks.py`` in a process of its own, on the GPU.

Without CUDA the GPU tests skip with "needs CUDA"; the checks themselves still run here on the CPU
(:func:`test_check_runs_on_cpu`), so a broken check cannot hide until the first GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("gpu_checks.py")
ROOT = Path(__file__).resolve().parents[2]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def run_check(check: str, device: str, out: Path, timeout: int = 900) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if device == "cuda":
        env["DS_ACCELERATOR"] = "cuda"  # the README's test command sets `cpu` for the rest of the suite
    done = subprocess.run(
        [sys.executable, str(SCRIPT), check, "--device", device, "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    report = out / f"{check}.json"
    return json.loads(report.read_text()) if report.exists() else {}


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("check", ["equivalence", "fp16_compression", "overlap_backward", "activations"])
def test_on_cuda(tmp_path, check) -> None:
    report = run_check(check, "cuda", tmp_path)
    assert report, "the check wrote its figures"


@pytest.mark.cuda
@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 CUDA devices" if torch.cuda.is_available() else "needs CUDA"
)
def test_two_gpus_with_nccl(tmp_path) -> None:
    run_check("one_gpu", "cuda", tmp_path)
    report = run_check("two_gpus", "cuda", tmp_path)
    assert report["process_group_backend"] == "nccl"


@pytest.mark.parametrize("check", ["equivalence", "overlap_backward", "activations"])
def test_check_runs_on_cpu(tmp_path, check) -> None:
    report = run_check(check, "cpu", tmp_path)
    assert report, "the check wrote its figures"
