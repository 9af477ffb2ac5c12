"""Plain-PyTorch references: the codec and the update rules written out on a plain module, on the data ``fit`` uses,
for the end-to-end tests to compare the strategy with."""

from __future__ import annotations

import math

import torch

from helpers.models import LMModule, OptimizerFactory, token_loader
from lightning_smartinf.core.compression import kept_count


def topk_adamw(
    make_optimizer: OptimizerFactory,
    steps: int,
    ratio: float,
    *,
    clip: float | None = None,
    clip_when_sent: bool = False,
    ranks: int = 1,
) -> dict[str, torch.Tensor]:
    """Top-k of each parameter partition with an fp32 error-feedback residual, then ``make_optimizer``'s update.

    ZeRO-3 splits each parameter over ``ranks`` equal partitions (the last padded with zeros); each rank selects the
    ``kept_count(partition, ratio)`` largest entries of its own. With ``clip``, each step's gradient is clipped by its
    own global norm before it joins the residual (``clip_when_sent``: the earlier behaviour, where what is sent was
    scaled by the clipping of the step that sent it). The batches are ``token_loader(steps)``'s, which two ranks of
    ``tests/scripts/train_two_ranks.py`` see split between them.
    """
    module = LMModule(make_optimizer)
    model = module.model
    optimizer, scheduler = make_optimizer(model)
    residual = {p: torch.zeros(math.ceil(p.numel() / ranks) * ranks) for p in model.parameters()}
    for tokens, targets in token_loader(steps):
        loss = torch.nn.functional.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten())
        loss.backward()
        factor = 1.0
        if clip is not None:
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
            factor = min(1.0, clip / (float(norm) + 1e-6))
        for p in model.parameters():
            acc = residual[p]
            acc[: p.numel()].add_(p.grad.view(-1) * (1.0 if clip_when_sent else factor))
            sent = torch.zeros_like(acc)
            for part, out in zip(acc.chunk(ranks), sent.chunk(ranks)):
                keep = torch.topk(part.abs(), kept_count(part.numel(), ratio)).indices
                out[keep] = part[keep]
                part[keep] = 0.0
            p.grad = (sent[: p.numel()] * (factor if clip_when_sent else 1.0)).view_as(p)
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return {f"model.{n}": p.detach().clone() for n, p in model.named_parameters()}
