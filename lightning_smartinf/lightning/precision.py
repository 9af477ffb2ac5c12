"""Precision plugin of the ``smart_infinity`` strategy."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, get_args

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.plugins.precision.deepspeed import DeepSpeedPrecision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_smartinf.zero.optimizer import SmartUpdateZeroOptimizer

#: The precisions SmartUpdate trains in: those of Lightning's ``DeepSpeedPrecision``, each with a link dtype below.
PrecisionInput = Literal["32-true", "16-true", "bf16-true", "16-mixed", "bf16-mixed"]

_LINK_DTYPES: dict[str, torch.dtype] = {
    "32-true": torch.float32,
    "16-true": torch.float16,
    "16-mixed": torch.float16,
    "bf16-true": torch.bfloat16,
    "bf16-mixed": torch.bfloat16,
}


class SmartInfinityPrecision(DeepSpeedPrecision):
    """DeepSpeed precision for SmartUpdate: the training dtype is also what crosses the host-device link.

    Gradients go to the devices and updated parameters come back in :attr:`link_dtype`; fp32 master
    weights and optimizer states never leave the devices, whatever the precision.

    Args:
        precision: ``"bf16-mixed"`` (recommended), ``"16-mixed"`` (dynamic loss scaling), ``"32-true"``,
            ``"bf16-true"`` or ``"16-true"``.

    Raises:
        ValueError: if ``precision`` is not one of those.
    """

    def __init__(self, precision: PrecisionInput) -> None:
        supported = get_args(PrecisionInput)
        if precision not in supported:
            raise ValueError(
                f"`Trainer(strategy='smart_infinity', precision={precision!r})` is not supported. "
                f"`precision` must be one of: {', '.join(map(repr, supported))}."
            )
        super().__init__(precision)
        #: Whether :meth:`optimizer_step` is running: a backward inside it is the last of its accumulation window.
        self._stepping = False

    @property
    def link_dtype(self) -> torch.dtype:
        """Element type of gradients sent to and parameters returned from the devices."""
        return _LINK_DTYPES[self.precision]

    @override
    def backward(self, tensor: Tensor, model: pl.LightningModule, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        """Back-propagate through DeepSpeed's engine, dividing by the accumulation steps exactly once.

        Lightning's automatic optimization already divides the loss by ``accumulate_grad_batches``; the engine
        would divide it again (``scale_wrt_gas``), training with gradients ``accumulate_grad_batches`` times too
        small. Manual optimization does not divide, so there the engine keeps doing it.

        Under automatic optimization Lightning ends the accumulation windows (the strategy does not handle
        accumulation): a backward ends one exactly when it runs in the closure of :meth:`optimizer_step`, the
        micro-batches before it run theirs outside. The engine is told so, or it would end windows by its own count
        of micro-batches, which runs on across epochs whose last window is shorter.
        """
        if model.automatic_optimization:
            engine: Any = model.trainer.model
            engine.set_gradient_accumulation_boundary(self._stepping)
        kwargs.setdefault("scale_wrt_gas", not model.automatic_optimization)
        super().backward(tensor, model, optimizer, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Run the closure (forward and the window's last backward) and the engine's step; see :meth:`backward`."""
        self._stepping = True
        try:
            return super().optimizer_step(optimizer, model, closure, **kwargs)
        finally:
            self._stepping = False

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip the coming step's gradient to global norm ``clip_val``, as ``torch.nn.utils.clip_grad_norm_`` would.

        ``LightningModule.clip_gradients`` lands here: from ``Trainer(gradient_clip_val=...)``, from an overridden
        ``configure_gradient_clipping``, and from a manual-optimization ``training_step``. DeepSpeed's plugin ignores
        it (its engine clips only by its config); here the devices' step takes it as a scale of the whole gradient.
        Clipping by value is refused: no rank holds the whole gradient to clip element by element before it leaves.
        """
        if isinstance(clip_val, float) and math.isnan(clip_val):
            raise ValueError(f"`gradient_clip_val={clip_val!r}` must be a positive number (or 0 for no clipping).")
        if clip_val <= 0 or math.isinf(clip_val):  # torch's clip_grad_norm_ leaves the gradient as it is
            return
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            raise MisconfigurationException(
                f"`gradient_clip_algorithm='value'` (with `gradient_clip_val={clip_val!r}`): `smart_infinity` clips "
                "the gradient by its global norm only, as the devices scale it while they update. Use "
                "`gradient_clip_algorithm='norm'`."
            )
        zero = getattr(optimizer, "_optimizer", optimizer)  # manual optimization hands a `LightningOptimizer`
        if not isinstance(zero, SmartUpdateZeroOptimizer):
            raise TypeError(
                f"`clip_gradients` got the optimizer `{type(zero).__name__}`: pass the one `self.optimizers()` returns "
                "(the strategy's SmartUpdate optimizer)."
            )
        zero.clip_next_step(float(clip_val))
