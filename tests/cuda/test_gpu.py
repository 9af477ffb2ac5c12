"""The GPU suite (``-m cuda``): each check of ``gpu_checks.py`` in processes of its own, on the GPU.

Without CUDA the GPU tests skip with "needs CUDA"; the checks that can also run on the CPU do so here
(:func:`test_check_runs_on_cpu`), so a broken check cannot hide until the first GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_checks import CHECKS, run_check  # noqa: E402
from helpers.launch import RENDEZVOUS, worker_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
#: Checks that are another's reference only (run with it).
REFERENCES = {check.after for check in CHECKS.values() if check.after}
TIMEOUT_S = 900
#: On the CPU a check takes 5-40 s here; a hang (ranks that disagree) ends at this instead.
CPU_TIMEOUT_S = 300


@pytest.fixture(autouse=True)
def _repository_on_path(monkeypatch) -> None:
    """The checks' processes: this one's environment without its rendezvous, the repository on the path."""
    for name, value in worker_env().items():
        monkeypatch.setenv(name, value)
    for name in RENDEZVOUS:
        monkeypatch.delenv(name, raising=False)


def _checks(gpus: int, cpu: bool = False) -> list[str]:
    return [n for n, c in CHECKS.items() if n not in REFERENCES and c.gpus == gpus and (c.on_cpu or not cpu)]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("check", _checks(1))
def test_on_cuda(tmp_path, check) -> None:
    passed, output = run_check(check, "cuda", tmp_path, TIMEOUT_S)
    assert passed, output


@pytest.mark.cuda
@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 CUDA devices" if torch.cuda.is_available() else "needs CUDA"
)
@pytest.mark.parametrize("check", _checks(2))
def test_on_two_gpus(tmp_path, check) -> None:
    passed, output = run_check(check, "cuda", tmp_path, TIMEOUT_S)
    assert passed, output


#: Checks whose path the main suite already covers on the CPU (test_equivalence, test_param_storage, ...): here they
#: prove only the check itself, so they run with the slow suite.
COVERED_ON_CPU = {
    "equivalence",
    "overlap_backward",
    "params_on_storage",
    "compression_host_buffer",
    "activations_zero3",
    "two_gpus",  # test_multirank trains two gloo ranks against one
    "checkpoint_resume",  # test_checkpoint, test_checkpoint_workflows; the save's collective: test_collectives
    "overflow_on_one_rank",  # not covered elsewhere on the CPU, but two processes for 35 s: with the slow suite
    "activations",  # test_activation_offload.py
    "gradient_norms",  # test_gradient_reduction.py
}


@pytest.mark.parametrize(
    "check",
    [
        *(pytest.param(name, marks=[pytest.mark.slow] * (name in COVERED_ON_CPU)) for name in _checks(1, cpu=True)),
        *(
            pytest.param(name, marks=[pytest.mark.multiprocess, *[pytest.mark.slow] * (name in COVERED_ON_CPU)])
            for name in _checks(2, cpu=True)
        ),
    ],
)
def test_check_runs_on_cpu(tmp_path, check) -> None:
    """The check itself, on DeepSpeed's CPU accelerator (two ranks with gloo where it needs two GPUs)."""
    passed, output = run_check(check, "cpu", tmp_path, CPU_TIMEOUT_S)
    assert passed, output
