"""``TrainingMonitor``: loss, tokens/s and link traffic per optimizer step, for loggers and the progress bar."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_smartinf.core import TrafficSnapshot
from lightning_smartinf.core.arguments import Problems, show
from lightning_smartinf.lightning.contract import SmartUpdateStrategy
from lightning_smartinf.plan.cost_model import FP32_GRAD_BYTES, FP32_STATE_BYTES

#: Bytes per trainable parameter per optimizer step that DeepSpeed ZeRO-Infinity's NVMe optimizer offload moves over
#: the host link: the fp32 gradient written in backward (4), master, m, v and gradient read (16), master, m, v
#: written (12). The planner's ``zero_infinity`` model and the demo use the same figure.
ZERO_INFINITY_LINK_BYTES_PER_PARAM = FP32_GRAD_BYTES + (FP32_STATE_BYTES + FP32_GRAD_BYTES) + FP32_STATE_BYTES


def count_tokens(batch: Any, token_key: str = "input_ids") -> int | torch.Tensor:
    """Tokens in one micro-batch: what :class:`TrainingMonitor` counts.

    A mapping counts ``attention_mask.sum()`` when it has an ``attention_mask`` (padding is not a token), else the
    elements of ``batch[token_key]``, else of its first tensor value; a tuple or list counts the elements of its
    first tensor; a tensor counts its elements. Anything else counts 0. A mask sum stays a tensor, so counting
    never waits for the accelerator.

    Example::

        >>> count_tokens((torch.zeros(4, 12, dtype=torch.long), torch.zeros(4, 12)))
        48
        >>> mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
        >>> int(count_tokens({"input_ids": torch.zeros(2, 5), "attention_mask": mask}))
        7
    """
    if isinstance(batch, torch.Tensor):
        return batch.numel()
    if isinstance(batch, Mapping):
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            return mask.sum()
        if isinstance(batch.get(token_key), torch.Tensor):
            return batch[token_key].numel()
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            if isinstance(item, torch.Tensor):
                return item.numel()
    return 0


class TrainingMonitor(Callback):
    """Per optimizer step: loss, tokens/s and, with ``strategy="smart_infinity"``, bytes per parameter on the link.

    Logged to every logger of the Trainer, once per optimizer step (so ``log_every_n_steps`` applies):

    - ``smartinf/loss``: the training loss of the step (mean over its accumulated micro-batches);
    - ``smartinf/tokens_per_s``, ``smartinf/step_ms``: tokens of the step (:func:`count_tokens`, times the number of
      ranks) over the wall time since the previous step ended (data loading included);
    - ``smartinf/link_bytes_per_param``, ``smartinf/storage_bytes_per_param``: host↔device link bytes (gradients in
      + parameters out) and in-device storage bytes of the step, per trainable parameter (this rank's bytes times the
      number of ranks, over all parameters: ZeRO shares parameters out equally);
    - ``smartinf/zero_infinity_link_bytes_per_param`` (32) and ``smartinf/zero_infinity_link_bytes_per_step``: what
      ZeRO-Infinity's NVMe optimizer offload moves over the link per step for this model, a constant logged each step
      as the reference to compare with.

    The strategy itself logs the raw per-step byte counts (``smartinf/link_write_bytes``, ...). On the progress bar
    (TQDM or Rich) it shows ``loss``, ``tok/s`` and ``link_MB`` (link megabytes of the step, all ranks).
    ``smartinf fit`` adds this callback by default.

    Args:
        token_key: the key of the token ids in mapping batches (see :func:`count_tokens`).
        progress_bar: show ``loss``, ``tok/s`` and ``link_MB`` on the progress bar.
    """

    def __init__(self, token_key: str = "input_ids", progress_bar: bool = True) -> None:
        problems = Problems("TrainingMonitor", MisconfigurationException)
        if not isinstance(token_key, str) or not token_key:
            problems.add(
                f"`token_key={show(token_key)}` is not a key name: it must be a non-empty str, the key of the token "
                "ids in mapping batches. Pass e.g. `token_key='input_ids'`."
            )
        problems.flag("progress_bar", progress_bar)
        problems.raise_if_any()
        self.token_key = token_key
        self.progress_bar = progress_bar
        self._params = 0
        self._last_step = 0
        self._window_start: float | None = None
        self._tokens: int | torch.Tensor = 0
        self._loss_sum: torch.Tensor | None = None
        self._traffic = TrafficSnapshot()

    @staticmethod
    def _smart_strategy(trainer: pl.Trainer) -> SmartUpdateStrategy | None:
        strategy = trainer.strategy
        return strategy if isinstance(strategy, SmartUpdateStrategy) else None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Under ZeRO-3 a parameter's own tensor is this rank's partition; `ds_numel` is the full size.
        self._params = sum(getattr(p, "ds_numel", p.numel()) for p in pl_module.parameters() if p.requires_grad)
        self._last_step = trainer.global_step
        self._window_start = None
        self._tokens, self._loss_sum = 0, None
        strategy = self._smart_strategy(trainer)
        self._traffic = strategy.traffic if strategy is not None else TrafficSnapshot()

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        if self._window_start is None:
            self._window_start = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._tokens = self._tokens + count_tokens(batch, self.token_key)
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor):
            # Lightning hands over the loss divided by `accumulate_grad_batches`: the sum is the step's mean.
            loss = loss.detach().float()
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        if trainer.global_step == self._last_step:
            return  # accumulating: no optimizer step on this batch
        self._last_step = trainer.global_step
        now = time.perf_counter()
        elapsed = now - (self._window_start or now)
        self._window_start = now
        ranks = max(1, trainer.world_size)
        tokens = float(self._tokens) * ranks
        metrics: dict[str, float | torch.Tensor] = {"smartinf/step_ms": elapsed * 1e3}
        if tokens and elapsed > 0:
            metrics["smartinf/tokens_per_s"] = tokens / elapsed
        if self._loss_sum is not None:
            metrics["smartinf/loss"] = self._loss_sum
        self._tokens, self._loss_sum = 0, None

        link_mb = None
        strategy = self._smart_strategy(trainer)
        if strategy is not None and self._params:
            traffic = strategy.traffic
            delta, self._traffic = traffic - self._traffic, traffic
            link = (delta.link_write_bytes + delta.link_read_bytes) * ranks
            storage = (delta.storage_read_bytes + delta.storage_write_bytes) * ranks
            metrics["smartinf/link_bytes_per_param"] = link / self._params
            metrics["smartinf/storage_bytes_per_param"] = storage / self._params
            # A constant, logged with every step so that each logger draws it as a reference line.
            metrics["smartinf/zero_infinity_link_bytes_per_param"] = float(ZERO_INFINITY_LINK_BYTES_PER_PARAM)
            metrics["smartinf/zero_infinity_link_bytes_per_step"] = float(
                ZERO_INFINITY_LINK_BYTES_PER_PARAM * self._params
            )
            link_mb = link / 1e6
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, prog_bar=False, logger=True)

        if self.progress_bar:
            shown = {"loss": "smartinf/loss", "tok/s": "smartinf/tokens_per_s"}
            bar = {label: metrics[key] for label, key in shown.items() if key in metrics}
            if link_mb is not None:
                bar["link_MB"] = link_mb
            pl_module.log_dict(bar, on_step=True, on_epoch=False, prog_bar=True, logger=False)
