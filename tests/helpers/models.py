"""Small models, data and helpers shared by the end-to-end tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_smartinf.core.streaming.backend import StreamingBackend
from lightning_smartinf.core.tiers.tiered import TieredBackend

VOCAB, SEQ, DIM = 61, 12, 32


class Block(nn.Module):
    """Pre-norm causal self-attention + MLP. The key projection has no bias: its gradient would be zero in exact
    arithmetic (softmax ignores it), leaving rounding noise that Adam turns into order-one updates."""

    def __init__(self, dim: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.norm1(x)
        q, k, v = (f(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


class TinyGPT(nn.Module):
    """A causal transformer with the parameter kinds of a real LM: embeddings, attention, MLP, norms, biases."""

    def __init__(self, dim: int = DIM, layers: int = 2, vocab: int = VOCAB) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(SEQ, dim) * 0.02)
        self.blocks = nn.Sequential(*(Block(dim) for _ in range(layers)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.norm(self.blocks(hidden)))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """GPT-style groups: weight decay on matrices, none on biases, norms and embeddings' positions."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "pos" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "pos" in n]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


OptimizerFactory = Callable[[nn.Module], tuple[torch.optim.Optimizer, Any]]


def adamw_factory(
    lr: float = 3e-3,
    *,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.1,
    cosine_steps: int | None = None,
    eta_min: float = 0.0,
    fused: bool = False,
) -> OptimizerFactory:
    """What ``LMModule`` calls in ``configure_optimizers``: AdamW over GPT-style param groups (:func:`param_groups`),
    with a cosine schedule over ``cosine_steps`` steps when given (stepped every step)."""

    def make(model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
        options: dict[str, Any] = {"lr": lr, "betas": betas, "eps": eps}
        if fused:  # the devices then run torch's fused CPU kernel too
            options["fused"] = True
        optimizer = torch.optim.AdamW(param_groups(model, weight_decay), **options)
        if cosine_steps is None:
            return optimizer, None
        return optimizer, torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cosine_steps, eta_min=eta_min)

    return make


def small_strategy(path: Any, **kwargs: Any) -> Any:
    """``SmartInfinityStrategy`` on one storage path with small sub-groups and chunks, so that a tiny model has many
    shards of several chunks each; ``kwargs`` override or add settings."""
    from lightning_smartinf import SmartInfinityStrategy

    return SmartInfinityStrategy(**{"storage_paths": [path], "sub_group_size": 3000, "chunk_size": 2048, **kwargs})


class LMModule(L.LightningModule):
    def __init__(self, make_optimizer: OptimizerFactory, seed: int = 0, **model_kwargs: Any) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = TinyGPT(**model_kwargs)
        self.make_optimizer = make_optimizer

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        logits = self.model(tokens)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer, scheduler = self.make_optimizer(self.model)
        if scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def token_loader(batches: int, batch_size: int = 4, seed: int = 1) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batches * batch_size, SEQ + 1), generator=generator)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch_size, shuffle=False)


class CaptureParams(L.Callback):
    """Records the full (gathered) fp32 copy of every parameter at the end of training."""

    def __init__(self) -> None:
        self.params: dict[str, torch.Tensor] = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        params = list(pl_module.named_parameters())
        if any(hasattr(p, "ds_id") for _, p in params):
            import deepspeed

            with deepspeed.zero.GatheredParameters([p for _, p in params]):
                self.params = {n: p.detach().float().clone() for n, p in params}
        else:
            self.params = {n: p.detach().float().clone() for n, p in params}


def fit(
    module: L.LightningModule,
    strategy: Any,
    *,
    steps: int,
    accumulate: int = 1,
    precision: str = "32-true",
    clip: float | None = None,
    batches: int | None = None,
    callbacks: list | None = None,
    accelerator: str = "cpu",
    devices: int = 1,
    loader: DataLoader | None = None,
    **trainer_kwargs: Any,
) -> tuple[L.Trainer, dict[str, torch.Tensor]]:
    """Train ``module`` for ``steps`` steps on ``loader`` (default: :func:`token_loader` of ``batches``, or of
    ``steps * accumulate``); return the Trainer and the trained parameters."""
    capture = CaptureParams()
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy,
        precision=precision,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks or ()),
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        use_distributed_sampler=False,
        callbacks=[capture, *(callbacks or [])],
        **trainer_kwargs,
    )
    trainer.fit(module, loader if loader is not None else token_loader(batches or steps * accumulate))
    return trainer, capture.params


def max_relative_error(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per parameter: max |ours - reference| / max |reference| (on the host: the two may live on different devices)."""
    assert ours.keys() == reference.keys()
    errors = {}
    for name in ours:
        mine, theirs = ours[name].cpu(), reference[name].cpu()
        errors[name] = float((mine - theirs).abs().max() / theirs.abs().max().clamp_min(1e-12))
    return errors


def assert_identical(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    """Every parameter bit for bit the reference's (the names of those that differ in the message)."""
    assert ours.keys() == reference.keys()
    differ = [n for n in reference if not torch.equal(ours[n], reference[n])]
    assert not differ, f"parameters differ from the reference: {differ}"


class Crash(Exception):
    """What :class:`CrashAt` raises."""


class CrashAt(L.Callback):
    """Ends the run with an exception as step ``step`` starts; its checkpoints so far stay where they are."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, index: int) -> None:
        if trainer.global_step == self.step:
            raise Crash(f"crash at step {self.step}")


def streaming_backend(trainer: L.Trainer) -> StreamingBackend:
    """The strategy's streaming backend (``cpu``, ``xrt``): the backend itself, or the one its tiers wrap."""
    backend = trainer.strategy.smart_update.backend
    if isinstance(backend, TieredBackend):
        backend = backend.inner
    assert isinstance(backend, StreamingBackend), type(backend)
    return backend
