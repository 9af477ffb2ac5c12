"""SmartComp through the strategy: equivalence at ratio 1, exact compressed traffic, warm-up, checkpoints, bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers.launch import SCRIPTS, torchrun
from helpers.models import LMModule, TinyGPT, adamw_factory, fit, max_relative_error, small_strategy
from helpers.references import topk_adamw
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from scripts.ckpt_common import EVERY, train

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.core.compression import kept_count
from lightning_smartinf.core.format.checkpoint_folder import CheckpointError
from lightning_smartinf.lightning.callbacks import CompressionWarmup

STEPS = 8


adamw = adamw_factory(betas=(0.9, 0.95), cosine_steps=STEPS)


class StepMetrics(L.Callback):
    """Per optimizer step: the strategy's ``smartinf/*`` metrics and the sub-group sizes."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.numels: list[int] = []
        self.segments: list[int] = []

    def on_train_batch_end(self, trainer: L.Trainer, *_: object) -> None:
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("smartinf/")})
        optimizer = trainer.strategy.deepspeed_engine.optimizer
        self.numels = [int(n) for n in optimizer.fp16_partitioned_groups_flat_numel]
        self.segments = [n for group in optimizer.smart_update.segments for n in group]  # parameter partitions

    def sent(self, ratio: float) -> int:
        """Entries layer-wise top-k sends: each parameter's partition keeps its own share."""
        return sum(kept_count(n, ratio) for n in self.segments)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_ratio_one_is_the_uncompressed_path(tmp_path, precision) -> None:
    """Compression on but keeping everything (error feedback on) trains to bit-identical parameters with the
    optimizer's own rule (EF-Adam, the default for AdamW, is compared with its dense twin in test_ef_adam.py)."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    kwargs = dict(steps=STEPS, accumulate=2, clip=0.5, precision=precision)
    # Compressed runs add micro-batches in the training dtype (DeepSpeed's default): the dense twin does too.
    same_sums = {"config": {"data_types": {"grad_accum_dtype": "bf16"}}} if precision == "bf16-mixed" else {}
    _, dense = fit(LMModule(adamw), small_strategy(tmp_path / "a", **same_sums), **kwargs)
    metrics = StepMetrics()
    compression = {"ratio": 1.0, "rule": "optimizer"}
    trainer, ours = fit(
        LMModule(adamw), small_strategy(tmp_path / "b", compression=compression), callbacks=[metrics], **kwargs
    )
    assert trainer.global_step == STEPS
    assert dense.keys() == ours.keys()
    assert all(torch.equal(ours[n], dense[n]) for n in dense), "ratio 1.0 must reproduce the dense update exactly"
    # Every entry went out as an (index, value) pair: the compressed path really ran.
    link = trainer.precision_plugin.link_dtype.itemsize
    total = sum(metrics.numels)
    assert metrics.steps[-1]["smartinf/link_write_bytes"] == total * (4 + link)
    assert metrics.steps[-1]["smartinf/kept_ratio"] == 1.0


def test_one_percent_bf16_traffic_is_exact_and_under_2_1_bytes_per_param(tmp_path) -> None:
    metrics = StepMetrics()
    trainer, params = fit(
        LMModule(adamw, dim=64),
        small_strategy(tmp_path, compression=0.01),
        steps=4,
        precision="bf16-mixed",
        callbacks=[metrics],
    )
    total = sum(metrics.numels)
    sent = metrics.sent(0.01)
    assert sent > sum(kept_count(n, 0.01) for n in metrics.numels)  # several parameters per sub-group
    for step in metrics.steps:
        assert step["smartinf/link_write_bytes"] == sent * (4 + 2)  # int32 index + bf16 value per kept entry
        assert step["smartinf/link_read_bytes"] == total * 2  # updated bf16 parameters come back dense
        assert step["smartinf/kept_ratio"] == pytest.approx(sent / total)
        assert step["smartinf/compression_ratio"] == pytest.approx(total * 2 / (sent * 6))
        per_param = (step["smartinf/link_write_bytes"] + step["smartinf/link_read_bytes"]) / total
        assert per_param <= 2.1
    residual = trainer.strategy.smart_update.residual
    assert residual is not None and residual.dtype == torch.float32 and bool(residual.abs().sum() > 0)
    assert all(torch.isfinite(p).all() for p in params.values())


def test_error_feedback_off_keeps_no_residual_and_whole_subgroup_selection(tmp_path) -> None:
    metrics = StepMetrics()
    compression = {"ratio": 0.05, "error_feedback": False, "layerwise": False}
    trainer, _ = fit(LMModule(adamw), small_strategy(tmp_path, compression=compression), steps=2, callbacks=[metrics])
    assert trainer.strategy.smart_update.residual is None
    sent = sum(kept_count(n, 0.05) for n in metrics.numels)
    assert metrics.steps[-1]["smartinf/link_write_bytes"] == sent * (4 + 4)


def test_warmup_dense_then_dgc_schedule_then_target(tmp_path) -> None:
    metrics = StepMetrics()
    warmup = CompressionWarmup(dense_steps=2, schedule="dgc", steps_per_stage=1)
    fit(LMModule(adamw), small_strategy(tmp_path, compression=0.01), steps=7, callbacks=[warmup, metrics])
    total = sum(metrics.numels)
    # What docs/compression.md promises for "dgc": 25%, 6.25%, 1.5625% (0.39% is not above the 1% target), then 1%.
    expected = [None, None, 0.25, 0.0625, 0.015625, 0.01, 0.01]
    assert [warmup.ratio_at(s) for s in range(7)] == expected
    for step, ratio in zip(metrics.steps, expected):
        if ratio is None:  # dense: the plain fp32 gradient bytes, nothing else
            assert step["smartinf/link_write_bytes"] == total * 4
            assert step["smartinf/compression_ratio"] == 1.0
        else:
            assert step["smartinf/link_write_bytes"] == metrics.sent(ratio) * (4 + 4)


@pytest.mark.slow
@pytest.mark.parametrize("clip", [None, 0.05], ids=["no-clip", "clip"])
def test_resume_with_residual_is_bit_identical(tmp_path, clip) -> None:
    """With clipping the residual is held in the units of the step that last added to it; resuming restores them."""
    comp = {"strategy_kwargs": {"compression": 0.05}, "gradient_clip_val": clip}
    expected = train(tmp_path / "ref", steps=2 * EVERY, **comp)
    checkpoint = tmp_path / "ref" / "ckpts" / f"step={EVERY}.ckpt"
    residual = checkpoint / "checkpoint" / "smartinf" / "rank000" / "residual.safetensors"
    host_state = json.loads((residual.parent / "host_state.json").read_text())
    assert residual.is_file() and host_state["residual"]["bytes"] == residual.stat().st_size
    resumed = train(tmp_path / "resumed", steps=2 * EVERY, ckpt_path=checkpoint, every=None, **comp)
    differ = [n for n in expected if not torch.equal(resumed[n], expected[n])]
    assert not differ, f"resumed run differs in {differ}"

    # The residual carries state worth saving: gradient mass not yet sent.
    from safetensors.torch import load_file

    assert float(load_file(str(residual))["residual"].abs().sum()) > 0
    if clip is not None:
        assert host_state["residual_loss_scale"] > 1.0  # every step clipped: a scale of its own
        return
    broken = bytearray(residual.read_bytes())
    broken[-1] ^= 0xFF
    residual.write_bytes(bytes(broken))
    with pytest.raises(CheckpointError, match=r"residual\.safetensors is corrupt"):
        train(tmp_path / "corrupt", steps=2 * EVERY, ckpt_path=checkpoint, every=None, **comp)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("rule", ["auto", pytest.param("ef_adafactor", marks=pytest.mark.slow)])
def test_two_ranks_each_compress_their_own_partition(tmp_path, free_port, rule) -> None:
    """`Trainer(devices=2)` under `torch.distributed.run`: each rank sends the top 5% of each of its own parameter
    partitions (counted from the model's shapes alone), and training ends where the same per-partition top-k, error
    feedback and EF-Adam written in plain PyTorch end; with `ef_adafactor` each rank also factors its own partition."""
    storage = [tmp_path / "ssd0", tmp_path / "ssd1"]
    for path in storage:
        path.mkdir()
    extra = json.dumps({"compression": {"ratio": 0.05, "rule": rule}})
    paths = ",".join(map(str, storage))
    torchrun(SCRIPTS / "train_two_ranks.py", tmp_path, paths, "4", "none", extra, port=free_port())
    partitions = [math.ceil(p.numel() / 2) for p in TinyGPT().parameters()]  # each parameter split over 2 ranks
    sent = sum(kept_count(n, 0.05) for n in partitions)
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # The initial fp32 masters of its partitions, then 4 steps of fp32 (index, value) pairs.
        assert report["traffic"]["link_write_bytes"] == sum(partitions) * 4 + 4 * sent * 8
        assert report["moment_updates"] == (4 if rule == "ef_adafactor" else None)
    params = torch.load(tmp_path / "params.pt", weights_only=True)
    if rule == "auto":  # EF-Adam: AdamW without its first moment, the script's schedule and clipping
        reference = topk_adamw(adamw_factory(betas=(0.0, 0.999), cosine_steps=8), 4, 0.05, clip=0.5, ranks=2)
        errors = max_relative_error(params, reference)
        assert max(errors.values()) < 1e-5, errors
    assert all(torch.isfinite(p).all() for p in params.values())


# ------------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("compression", "message"),
    [
        (0.0, "0 < ratio <= 1"),
        (1.5, "0 < ratio <= 1"),
        (-0.01, "0 < ratio <= 1"),
        ({"ratio": 0.01, "feedback": True}, "unknown key"),
        ({"ratio": 0.01, "error_feedback": "yes"}, "must be True or False"),
        ({"ratio": 0.01, "layerwise": 1}, "must be True or False"),
    ],
)
def test_bad_compression_argument(compression, message) -> None:
    with pytest.raises(MisconfigurationException, match=message) as info:
        SmartInfinityStrategy(compression=compression)
    assert "`compression" in str(info.value)  # `compression=...`, or `compression['key']` for a dict


def test_amsgrad_with_compression_is_refused(tmp_path) -> None:
    def amsgrad(model):
        return torch.optim.Adam(model.parameters(), lr=1e-3, amsgrad=True), None

    with pytest.raises(MisconfigurationException, match="amsgrad"):
        fit(LMModule(amsgrad), small_strategy(tmp_path, compression=0.01), steps=1)


def test_warmup_longer_than_training(tmp_path) -> None:
    with pytest.raises(MisconfigurationException, match="lasts 6 optimizer steps .* only 4"):
        fit(
            LMModule(adamw),
            small_strategy(tmp_path, compression=0.01),
            steps=4,
            callbacks=[CompressionWarmup(dense_steps=2, schedule=[0.5, 0.1], steps_per_stage=2)],
        )


def test_warmup_without_compression(tmp_path) -> None:
    with pytest.raises(MisconfigurationException, match="compression, which is off"):
        fit(LMModule(adamw), small_strategy(tmp_path), steps=2, callbacks=[CompressionWarmup(dense_steps=1)])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dense_steps": -1}, "dense_steps"),
        ({"steps_per_stage": 0}, "steps_per_stage"),
        ({"schedule": "fast"}, "'dgc'"),
        ({"schedule": [0.5, 2.0]}, "0 < ratio <= 1"),
    ],
)
def test_bad_warmup_arguments(kwargs, message) -> None:
    with pytest.raises(MisconfigurationException, match=message):
        CompressionWarmup(**kwargs)


def test_preset_and_set_kept_ratio() -> None:
    trainer = L.Trainer(strategy="smart_infinity_comp", accelerator="cpu", devices=1, logger=False)
    assert trainer.strategy.settings.compression.ratio == 0.01 and trainer.strategy.settings.compression.error_feedback
    with pytest.raises(MisconfigurationException, match="0 < ratio <= 1"):
        trainer.strategy.set_kept_ratio(0.0)
    with pytest.raises(MisconfigurationException, match="compression is off"):
        SmartInfinityStrategy().set_kept_ratio(0.1)


# The records' recipes re-run in fp32: the records themselves are bf16, whose matmuls this CPU emulates about 20x
# slower (15-20 minutes a run on one core), while fp32 takes 2-3 minutes. The compressed run is trained here; its dense
# reference is the fp32 dense run recorded in tests/records/ (same recipe, same code path: bench_compression.py
# refuses a record of another run), since dense training is proven against torch.optim by the main suite. The bf16
# link bytes are asserted exactly by test_one_percent_bf16_traffic_is_exact_and_under_2_1_bytes_per_param.
RECORD_TIMEOUT_S = 1200
#: Link bytes per parameter per step at 1% in fp32: 1% of the entries as (int32 index, fp32 value), fp32 back dense.
FP32_LINK_BYTES = 4.1


def _convergence_record(tmp_path: Path, name: str, argv: list[str]) -> dict:
    """Run benchmarks/bench_compression.py (1% top-k on real text against the recorded dense run, fp32, validation
    every 50 steps: the last at the final step that is compared) and return its JSON record."""
    import importlib.util

    path = Path(__file__).parents[1] / "benchmarks" / "bench_compression.py"
    spec = importlib.util.spec_from_file_location("bench_compression", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / name
    dense = Path(__file__).parent / "records" / f"compression-fp32-{name}.json"
    argv = [*argv, "--precision", "32-true", "--val-every", "50", "--dense-from", str(dense), "--out", str(out)]
    assert bench.main(argv) == 0
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads(out.with_suffix(".json").read_text())


def test_a_dense_record_of_another_recipe_is_refused_before_training(tmp_path) -> None:
    """The records' dense reference must be the run this one would have made: another step count, optimizer or
    precision is refused, naming both, before anything trains."""
    import importlib.util

    path = Path(__file__).parents[1] / "benchmarks" / "bench_compression.py"
    spec = importlib.util.spec_from_file_location("bench_compression", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    record = Path(__file__).parent / "records" / "compression-fp32-sgd.json"
    for argv, named in (
        (["--steps", "300", "--optimizer", "sgd", "--precision", "32-true"], "steps: 400 there, 300 here"),
        (["--steps", "400", "--optimizer", "adamw", "--precision", "32-true"], "optimizer: 'sgd' there, 'adamw' here"),
        (["--steps", "400", "--optimizer", "sgd"], "precision: '32-true' there, 'bf16-mixed' here"),
    ):
        with pytest.raises(SystemExit, match=named):
            bench.main([*argv, "--dense-from", str(record), "--out", str(tmp_path / "x")])
    assert not list(tmp_path.iterdir()), "nothing trained, nothing written"


@pytest.mark.slow
@pytest.mark.timeout(RECORD_TIMEOUT_S)
def test_one_percent_with_sgd_momentum_converges_within_5_percent_of_dense(tmp_path) -> None:
    """The convergence record of docs/compression.md, re-run in fp32: real text, 400 steps, dense vs 1% top-k
    (recorded in bf16: +3.1%; fp32 here: +3.2%)."""
    result = _convergence_record(tmp_path, "sgd", ["--steps", "400", "--optimizer", "sgd"])
    assert result["relative_difference"] < 0.05, result
    assert result["link_bytes_per_param_per_step_compressed"] <= FP32_LINK_BYTES


@pytest.mark.slow
@pytest.mark.timeout(RECORD_TIMEOUT_S)
def test_one_percent_adamw_fine_tuning_stays_within_3_percent_of_dense(tmp_path) -> None:
    """docs/compression.md's fine-tuning record, re-run in fp32: AdamW (EF-Adam on the devices) on Python source
    after dense English pre-training. Recorded in bf16: +2.0%, fp32 here: +1.8%; the margin absorbs other CPUs'
    rounding."""
    result = _convergence_record(tmp_path, "finetune", ["--finetune", "--steps", "200"])
    assert result["optimizer"] == "adamw" and result["pretrain_steps"] == 400 and result["rule"] == "auto"
    assert result["relative_difference"] < 0.03, result
    assert result["link_bytes_per_param_per_step_compressed"] <= FP32_LINK_BYTES
    assert result["storage_bytes_per_param_per_step_compressed"] < 16.1  # EF-Adam: master + exp_avg_sq, read + write


@pytest.mark.slow
@pytest.mark.timeout(RECORD_TIMEOUT_S)
def test_one_percent_adamw_from_scratch_stays_within_3_percent_of_dense(tmp_path) -> None:
    """docs/compression.md's AdamW pre-training record with EF-Adam, re-run in fp32 (recorded in bf16: +0.3%, fp32
    here: +0.4%; the optimizer's own rule lost 8.8% in bf16)."""
    result = _convergence_record(tmp_path, "adamw", ["--steps", "400"])
    assert result["optimizer"] == "adamw" and result["rule"] == "auto"
    assert result["relative_difference"] < 0.03, result
    assert result["link_bytes_per_param_per_step_compressed"] <= FP32_LINK_BYTES
