"""Translation of ``torch.optim`` optimizers and their param groups into device update rules."""

from __future__ import annotations

from typing import Any

import torch

from lightning_smartinf.core.compression import TopKCompression, compressed_rule
from lightning_smartinf.core.rules import SGD, Adagrad, Adam, StepParams, UpdateRule
from lightning_smartinf.core.state_formats import state_format

#: Optimizers whose update the devices run, as users write them in ``configure_optimizers``.
SUPPORTED_OPTIMIZERS = ("torch.optim.Adam", "torch.optim.AdamW", "torch.optim.SGD", "torch.optim.Adagrad")


def rule_for_group(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], compression: TopKCompression | None = None
) -> UpdateRule:
    """The update rule the devices run for ``optimizer``'s step on the params of ``group``.

    Without ``compression`` (or with ``rule='optimizer'``) it reproduces the optimizer's step; with it, Adam and AdamW
    may become :class:`~lightning_smartinf.core.rules.EFAdam` or :class:`~lightning_smartinf.core.rules.EFAdafactor`
    (:func:`~lightning_smartinf.core.compression.compressed_rule`).

    Raises:
        ValueError: the optimizer (or one of its options) has no device implementation.
    """
    return compressed_rule(_optimizer_rule(optimizer, group), compression, float(group.get("weight_decay", 0.0)))


def _optimizer_rule(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> UpdateRule:
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        # AdamW subclasses Adam in recent torch and sets `decoupled_weight_decay` itself; older torch did not.
        decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))
        return Adam(
            decoupled_weight_decay=decoupled,
            amsgrad=bool(group.get("amsgrad", False)),
            fused=bool(group.get("fused", False)),
        )
    if isinstance(optimizer, torch.optim.SGD):
        return SGD(with_momentum=group.get("momentum", 0.0) != 0.0)
    if isinstance(optimizer, torch.optim.Adagrad):
        return Adagrad(initial_accumulator_value=float(group.get("initial_accumulator_value", 0.0)))
    raise ValueError(
        f"The optimizer `{type(optimizer).__module__}.{type(optimizer).__qualname__}` has no near-storage update "
        f"rule. `configure_optimizers` must return one of: {', '.join(SUPPORTED_OPTIMIZERS)}."
    )


def step_params(group: dict[str, Any], *, step: int, grad_scale: float) -> StepParams:
    """The hyper-parameters of ``group`` as they stand now (after any LR scheduler ran)."""
    betas = group.get("betas", (0.9, 0.999))
    return StepParams(
        step=step,
        lr=float(group["lr"]),
        grad_scale=grad_scale,
        weight_decay=float(group.get("weight_decay", 0.0)),
        betas=(float(betas[0]), float(betas[1])),
        eps=float(group.get("eps", 1e-8)),
        momentum=float(group.get("momentum", 0.0)),
        dampening=float(group.get("dampening", 0.0)),
        nesterov=bool(group.get("nesterov", False)),
        lr_decay=float(group.get("lr_decay", 0.0)),
        maximize=bool(group.get("maximize", False)),
    )


def state_bytes(
    optimizer: torch.optim.Optimizer,
    compression: TopKCompression | None = None,
    state_precision: str = "fp32",
    *,
    split_masters: bool = False,
) -> int:
    """Bytes of master weights (fp32, or ``split_masters``' 2.125 bytes) and optimizer states (stored in
    ``state_precision``) of ``optimizer``'s trainable parameters on the devices.

    A ZeRO-3 parameter counts at its full size (``ds_numel``), not its partition on this rank.
    """
    fmt = state_format(state_precision)
    total = 0.0
    for group in optimizer.param_groups:
        rule = rule_for_group(optimizer, group, compression)
        per_element = fmt.bytes_per_element(len(rule.state_names), split=split_masters)
        total += sum(getattr(p, "ds_numel", p.numel()) * per_element for p in group["params"] if p.requires_grad)
    return int(total)
