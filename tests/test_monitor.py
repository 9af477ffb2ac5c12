"""TrainingMonitor: token counting, the step's loss and throughput, exact link bytes, progress-bar entries."""

from __future__ import annotations

import csv

import lightning as L
import pytest
import torch
from helpers.cli_models import RandomTokens, TinyLM
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger

from lightning_smartinf import SmartInfinityStrategy, TrainingMonitor
from lightning_smartinf.commands.demo import ZERO_INFINITY_LINK_BYTES_PER_PARAM as DEMO_FIGURE
from lightning_smartinf.lightning.monitor import ZERO_INFINITY_LINK_BYTES_PER_PARAM, count_tokens
from lightning_smartinf.plan.cost_model import Profile, Workload, load_profile, profile_names, zero_infinity

TOKENS = torch.zeros(4, 12, dtype=torch.long)


@pytest.mark.parametrize(
    ("batch", "kwargs", "expected"),
    [
        (torch.zeros(3, 5), {}, 15),
        ((TOKENS, TOKENS), {}, 48),
        ({"input_ids": torch.zeros(2, 7), "labels": torch.zeros(2, 7)}, {}, 14),
        ({"input_ids": torch.zeros(2, 5), "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])}, {}, 7),
        ({"labels": torch.zeros(9), "ids": torch.zeros(2, 3)}, {"token_key": "ids"}, 6),
        ({"text": ["a", "b"], "ids": torch.zeros(2, 3)}, {}, 6),  # no `input_ids`: the first tensor
        (["no", "tensors"], {}, 0),
    ],
    ids=["tensor", "tuple", "dict", "attention-mask", "token-key", "first-tensor", "none"],
)
def test_count_tokens(batch, kwargs, expected):
    assert int(count_tokens(batch, **kwargs)) == expected


def test_zero_infinity_figure_matches_demo_and_planner():
    assert ZERO_INFINITY_LINK_BYTES_PER_PARAM == DEMO_FIGURE == 32
    profile: Profile = load_profile(profile_names()[0])
    # ZeRO-Infinity's storage traffic is all host traffic: every byte to or from the SSDs crosses the link.
    assert zero_infinity(Workload(params=1000), profile, 2).storage_bytes == 32 * 1000


class RecordingLM(TinyLM):
    """Keeps every micro-batch's loss, to check the step loss the monitor reports."""

    def __init__(self) -> None:
        super().__init__(dim=32)
        self.losses: list[float] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss))
        return loss


def trainer(tmp_path, strategy, precision: str, bar, logger: bool = True) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        precision=precision,
        max_steps=3,
        accumulate_grad_batches=2,
        log_every_n_steps=1,
        limit_val_batches=0,
        logger=CSVLogger(tmp_path, name="run") if logger else False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[TrainingMonitor(), bar],
    )


def test_step_loss_and_tokens_under_accumulation_on_any_strategy(tmp_path):
    """Without smart_infinity: loss and tokens/s per optimizer step, no traffic, Rich progress bar."""
    module = RecordingLM()
    run = trainer(tmp_path, "auto", "32-true", RichProgressBar())
    run.fit(module, RandomTokens(batches=6, batch_size=4))

    with (tmp_path / "run" / "version_0" / "metrics.csv").open() as handle:
        rows = [r for r in csv.DictReader(handle) if r["smartinf/loss"]]
    assert [int(r["step"]) for r in rows] == [0, 1, 2]  # one row per optimizer step, not per micro-batch
    step_losses = [(a + b) / 2 for a, b in zip(module.losses[0::2], module.losses[1::2])]
    assert [float(r["smartinf/loss"]) for r in rows] == pytest.approx(step_losses, rel=1e-6)
    tokens = [float(r["smartinf/tokens_per_s"]) * float(r["smartinf/step_ms"]) / 1e3 for r in rows]
    assert tokens == pytest.approx([2 * 4 * 12] * 3, rel=1e-4)  # 2 micro-batches of 4 x 12 tokens
    assert not any(key.startswith("smartinf/link") for key in rows[0])

    shown = run.progress_bar_callback.get_metrics(run, module)
    assert shown["loss"] == pytest.approx(step_losses[-1], rel=1e-6)
    assert shown["tok/s"] > 0
    assert "link_MB" not in shown


def test_link_bytes_per_step_are_exact_on_the_progress_bar(tmp_path):
    """With smart_infinity: bf16 gradients in and parameters out, 2 + 2 B per parameter per optimizer step."""
    module = RecordingLM()
    params = sum(p.numel() for p in module.parameters())
    strategy = SmartInfinityStrategy(storage_paths=[tmp_path], io_engine="threads")
    run = trainer(tmp_path, strategy, "bf16-mixed", TQDMProgressBar(), logger=False)
    run.fit(module, RandomTokens(batches=6, batch_size=4))

    metrics = run.callback_metrics
    assert float(metrics["smartinf/link_bytes_per_param"]) == 4.0
    assert float(metrics["smartinf/zero_infinity_link_bytes_per_step"]) == 32.0 * params
    shown = run.progress_bar_callback.get_metrics(run, module)
    assert shown["link_MB"] == pytest.approx(4 * params / 1e6, rel=1e-6)
    assert {"loss", "tok/s"} <= shown.keys()
    # The per-step figures add up to the strategy's cumulative counters (less the initial upload of the weights).
    traffic = run.strategy.traffic
    assert traffic.link_write_bytes + traffic.link_read_bytes - 2 * params == 3 * 4 * params
