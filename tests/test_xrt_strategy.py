"""``SmartInfinityStrategy(backend="xrt")`` trains to the parameters of plain torch.optim (fp32), on the software
model of pyxrt running the C simulation of ``hls_kernels/`` -- the SmartSSD host code end to end, without hardware.

Tolerance: max relative error < 1e-5 per parameter, as for ``backend="cpu"`` in test_equivalence.py. The kernels
are bitwise equal to torch's update arithmetic except for sqrt (IEEE here, 1 ulp off in torch's vectorised CPU
sqrt), which moves an Adam update by ~1e-7 of itself; SGD is bitwise.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from helpers.ieee import TORCH_SQRT_IS_IEEE, ieee_sqrt
from helpers.models import LMModule, adamw_factory, fit, max_relative_error, param_groups, streaming_backend
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.devices.xrt import forget_platform, platform_for, write_model_xclbin

STEPS = 8


@pytest.fixture(scope="module")
def model_xclbin(tmp_path_factory, csim_library) -> Path:
    root = tmp_path_factory.mktemp("xrt")
    path = write_model_xclbin(root / "smartinf.json", csim_library, devices=2, dram_root=root / "ddr")
    yield path
    forget_platform(path)


adamw_cosine = adamw_factory(betas=(0.9, 0.95), cosine_steps=STEPS, eta_min=3e-4)


def sgd_momentum(model: torch.nn.Module):
    groups = param_groups(model, 1e-3)
    groups[1]["momentum"] = 0.5  # per-group momentum must reach the kernel too
    optimizer = torch.optim.SGD(groups, lr=5e-2, momentum=0.9, dampening=0.1)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("make_optimizer", "accumulate", "clip", "budget"),
    [
        pytest.param(adamw_cosine, 2, 0.5, None, id="adamw-cosine-clip-accumulate"),
        pytest.param(sgd_momentum, 1, None, None, id="sgd-momentum-steplr"),
        # Host cores update a share of the state in RAM beside the SmartSSDs (the memory tier).
        pytest.param(adamw_cosine, 2, 0.5, "1MiB", id="adamw-memory-tier"),
    ],
)
def test_fp32_matches_torch_optim(tmp_path, model_xclbin, make_optimizer, accumulate, clip, budget):
    _, reference = fit(LMModule(make_optimizer), "auto", steps=STEPS, accumulate=accumulate, clip=clip)
    paths = [tmp_path / "ssd0", tmp_path / "ssd1"]
    for path in paths:
        path.mkdir()
    strategy = SmartInfinityStrategy(
        backend="xrt",
        xclbin=model_xclbin,
        storage_paths=paths,
        sub_group_size=3000,
        chunk_size=2048,
        buffer_count=3,
        state_memory_budget=budget,
    )
    platform = platform_for(model_xclbin)
    before = [platform.counters(i) for i in range(2)]
    trainer, ours = fit(LMModule(make_optimizer), strategy, steps=STEPS, accumulate=accumulate, clip=clip)

    assert trainer.global_step == STEPS
    errors = max_relative_error(ours, reference)
    assert max(errors.values()) < 1e-5, errors
    # The comparison is meaningful: training moved every parameter at least 20x the tolerance.
    initial = {n: p.detach().clone() for n, p in LMModule(make_optimizer).named_parameters()}
    assert min(max_relative_error(reference, initial).values()) > 2e-4
    # Both SmartSSDs ran kernels; no state ever took the host path; the state moved SSD <-> device only.
    after = [platform.counters(i) for i in range(2)]
    assert all(a.kernel_runs > b.kernel_runs for a, b in zip(after, before))
    assert all(a.p2p_host_sync_bytes == 0 for a in after)
    traffic = strategy.traffic
    assert (traffic.memory_write_bytes > 0) == (budget is not None)
    numel = sum(p.numel() for p in LMModule(make_optimizer).parameters())
    assert traffic.link_read_bytes == STEPS * numel * 4  # fp32 parameters out, nothing else
    # State read ahead after the last step is never used; teardown counts it when it drops it.
    used, dropped = streaming_backend(trainer).prefetch_stats()
    assert used > 0
    reads = traffic.storage_read_bytes - dropped
    assert traffic.storage_write_bytes - reads == reads // STEPS  # init


def test_bad_xrt_settings_fail_at_construction(tmp_path, model_xclbin):
    with pytest.raises(MisconfigurationException, match=r"backend='xrt'.*`xclbin=None`"):
        SmartInfinityStrategy(backend="xrt", storage_paths=[tmp_path])
    with pytest.raises(MisconfigurationException, match=r"missing\.xclbin.*does not exist"):
        SmartInfinityStrategy(backend="xrt", xclbin=tmp_path / "missing.xclbin", storage_paths=[tmp_path])
    (tmp_path / "a").mkdir()
    with pytest.raises(MisconfigurationException, match=r"names 1 device\(s\) for 2 storage path\(s\)"):
        SmartInfinityStrategy(
            backend="xrt", xclbin=model_xclbin, xrt_devices=[0], storage_paths=[tmp_path, tmp_path / "a"]
        )


def _strategy(tmp_path: Path, backend: str, model_xclbin: Path, **settings) -> SmartInfinityStrategy:
    """The strategy of one of two runs to compare: two storage paths of its own, small sub-groups and chunks."""
    paths = [tmp_path / backend / "ssd0", tmp_path / backend / "ssd1"]
    for path in paths:
        path.mkdir(parents=True)
    extra = {"xclbin": model_xclbin} if backend == "xrt" else {}
    return SmartInfinityStrategy(
        backend=backend, storage_paths=paths, sub_group_size=3000, chunk_size=2048, **extra, **settings
    )


@pytest.mark.slow
@pytest.mark.parametrize(("rule", "runs_as"), [("auto", "EFAdam"), ("ef_adafactor", "EFAdafactor")])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_compressed_adamw_runs_the_ef_kernels_as_the_cpu_backend_runs_the_rule(
    tmp_path, model_xclbin, precision, rule, runs_as
):
    """1% top-k: both backends run the EF rule (xrt: the `smartinf_efadam_topk_*` kernels for EF-Adam, the
    `smartinf_sgd_topk_*` ones for EF-Adafactor's device half), to the same parameters."""
    runs = {}
    for backend in ("cpu", "xrt"):
        strategy = _strategy(tmp_path, backend, model_xclbin, compression={"ratio": 0.01, "rule": rule})
        trainer, runs[backend] = fit(LMModule(adamw_cosine), strategy, steps=STEPS, precision=precision)
        rules = {type(s.spec.rule).__name__ for s in streaming_backend(trainer).shards}
        assert rules == {runs_as}
    errors = max_relative_error(runs["xrt"], runs["cpu"])
    assert max(errors.values()) < 1e-5, errors
    initial = {n: p.detach().clone() for n, p in LMModule(adamw_cosine).named_parameters()}
    assert min(max_relative_error(runs["cpu"], initial).values()) > 2e-4


@pytest.mark.slow
@pytest.mark.parametrize("state_precision", ["bf16", "int8"])
def test_a_smaller_state_trains_on_the_smartssds_as_on_host_cores(tmp_path, model_xclbin, state_precision):
    """``state_precision`` with ``backend="xrt"``: the `*_state_<format>` kernels convert next to the SSD and train
    to the parameters the ``cpu`` backend gives, bit for bit once both take the square root IEEE's way (torch's
    vectorised CPU sqrt may be 1 ulp off, which a rounding of the state to bf16 or E4M3 can then amplify)."""
    runs = {}
    for backend in ("cpu", "xrt"):
        strategy = _strategy(tmp_path, backend, model_xclbin, state_precision=state_precision)
        with ieee_sqrt() if backend == "cpu" and not TORCH_SQRT_IS_IEEE else contextlib.nullcontext():
            trainer, runs[backend] = fit(LMModule(adamw_cosine), strategy, steps=STEPS, accumulate=2, clip=0.5)
        formats = {s.spec.state_format for s in streaming_backend(trainer).shards}
        assert formats == {state_precision}
    assert all(torch.equal(runs["xrt"][name], runs["cpu"][name]) for name in runs["cpu"])
    initial = {n: p.detach().clone() for n, p in LMModule(adamw_cosine).named_parameters()}
    assert min(max_relative_error(runs["cpu"], initial).values()) > 2e-4
