"""Optimizer update rules as the devices run them: fp32 master and states, chunk by chunk, in place.

Each rule reproduces the arithmetic of the matching ``torch.optim`` class (single-tensor path), so a
model trained through a device ends with the parameters a plain ``torch.optim`` run would give.
Rules are stateless descriptions; the state tensors live on the device and are passed in per chunk.

Square roots are torch's own by default (torch.optim's, rounding for rounding). With ``ieee_sqrt=True`` a rule
takes them correctly rounded (IEEE 754) instead, as every device does for a state kept in fewer bytes
(:func:`lightning_smartinf.core.state_formats.update_chunk`): torch's vectorised CPU sqrt is 1 ulp off for some inputs
on some builds (0.7% of them on an AVX-512 build), which no other device reproduces, while an IEEE sqrt is the same
on every host, accelerator and FPGA kernel.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy
import torch
from torch import Tensor


@dataclass(frozen=True)
class StepParams:
    """Hyper-parameters in effect for one shard in one optimizer step.

    Carried with every submitted gradient, so LR schedulers and per-group settings reach the device.

    Args:
        step: 1-based count of optimizer steps applied to this shard's param group, this one included.
        lr: learning rate in effect for this step.
        grad_scale: factor the raw gradient is multiplied by before the update: it folds loss-scale
            unscaling and gradient-norm clipping into one number.
        weight_decay: L2 (Adam, SGD, Adagrad) or decoupled (AdamW) weight decay.
        betas: Adam's ``(beta1, beta2)``.
        eps: Adam's and Adagrad's epsilon.
        momentum: SGD momentum.
        dampening: SGD dampening.
        nesterov: SGD Nesterov momentum.
        lr_decay: Adagrad learning-rate decay.
        maximize: maximise the objective instead of minimising it.
    """

    step: int
    lr: float
    grad_scale: float = 1.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    lr_decay: float = 0.0
    maximize: bool = False


class UpdateRule(ABC):
    """An optimizer update over a flat fp32 master tensor and its per-element state tensors."""

    #: Name used in manifests and error messages.
    name: ClassVar[str]

    @property
    @abstractmethod
    def state_names(self) -> tuple[str, ...]:
        """Names of the per-element fp32 state tensors, in their on-device order."""

    def initial_state_value(self, state: str) -> float:
        """Value every element of ``state`` holds before the first step."""
        return 0.0

    @abstractmethod
    def apply(
        self, master: Tensor, grad: Tensor, states: Sequence[Tensor], hp: StepParams, *, ieee_sqrt: bool = False
    ) -> None:
        """Update ``master`` and ``states`` in place.

        Args:
            master: fp32 master weights of one chunk.
            grad: fp32 gradient of the chunk, already multiplied by ``hp.grad_scale``; may be overwritten.
            states: fp32 state tensors of the chunk, in :attr:`state_names` order.
            hp: hyper-parameters of this step.
            ieee_sqrt: take square roots correctly rounded instead of torch's (see the module docstring). A fused
                :class:`Adam` runs torch's fused kernel, with its own square roots, either way.
        """

    @property
    def bytes_per_element(self) -> int:
        """Bytes of fp32 master plus state per trainable element held on the device."""
        return 4 * (1 + len(self.state_names))


#: Bits of the flags Adam's kernels take with :func:`adam_kernel_scalars` (the host's C kernels and the SmartSSD
#: kernels' ``smartinf_abi.h`` alike).
FLAG_MAXIMIZE = 1 << 0
FLAG_WEIGHT_DECAY = 1 << 1
FLAG_DECOUPLED_DECAY = 1 << 2


def adam_kernel_scalars(hp: StepParams, decoupled: bool) -> tuple[list[float], int]:
    """Adam's per-step numbers as a kernel takes them, each computed in double as torch computes the Python number it
    gives an fp32 tensor's operation (a kernel rounds each to fp32 once): the decoupled decay's multiplier, the L2
    decay, the ``lerp`` weight, ``beta2``, ``1 - beta2``, the square root of the second bias correction, ``eps`` and
    minus the step size; and the flags (:data:`FLAG_MAXIMIZE`, :data:`FLAG_WEIGHT_DECAY` for L2 decay,
    :data:`FLAG_DECOUPLED_DECAY`). ``decoupled``: AdamW."""
    beta1, beta2 = hp.betas
    decay = hp.weight_decay != 0.0
    scalars = [
        1.0 - hp.lr * hp.weight_decay if decay and decoupled else 1.0,
        hp.weight_decay if decay and not decoupled else 0.0,
        1.0 - beta1,
        beta2,
        1.0 - beta2,
        math.sqrt(1.0 - beta2**hp.step),
        hp.eps,
        -hp.lr / (1.0 - beta1**hp.step),
    ]
    flags = (FLAG_MAXIMIZE if hp.maximize else 0) | (FLAG_WEIGHT_DECAY if decay and not decoupled else 0)
    flags |= FLAG_DECOUPLED_DECAY if decay and decoupled else 0
    return scalars, flags


def correctly_rounded_sqrt(values: Tensor, out: Tensor) -> Tensor:
    """``out`` = the square root of ``values``, correctly rounded (IEEE 754), on their device; returns ``out``.

    On the host through numpy (C's ``sqrtf``): torch's vectorised CPU kernel is an approximation. CUDA's ``sqrt`` is
    IEEE's (torch is built without fast math), so there torch's own runs.
    """
    if values.device.type == "cpu":
        numpy.sqrt(values.numpy(), out=out.numpy())
        return out
    return torch.sqrt(values, out=out)


def _sqrt(values: Tensor, *, ieee: bool, into: Tensor | None = None) -> Tensor:
    """The square root of ``values``, correctly rounded where ``ieee``, else torch's (as torch.optim takes it): in
    ``into`` (a tensor of their shape, overwritten) or a new tensor."""
    if ieee:
        return correctly_rounded_sqrt(values, torch.empty_like(values) if into is None else into)
    return values.sqrt() if into is None else into.copy_(values).sqrt_()


def _sign_and_decay(master: Tensor, grad: Tensor, hp: StepParams, decoupled: bool = False) -> None:
    """torch's rules before their states: negate for ``maximize``, then decoupled decay of ``master`` (AdamW) or
    L2 decay into ``grad`` (Adam, SGD, Adagrad)."""
    if hp.maximize:
        grad.neg_()
    if hp.weight_decay != 0.0:
        if decoupled:
            master.mul_(1.0 - hp.lr * hp.weight_decay)
        else:
            grad.add_(master, alpha=hp.weight_decay)


@dataclass(frozen=True)
class Adam(UpdateRule):
    """``torch.optim.Adam`` (``decoupled_weight_decay=False``) and ``torch.optim.AdamW`` (``True``).

    With ``fused=True`` it reproduces the optimizer built with ``fused=True`` instead: torch's fused CPU
    kernel, one pass over memory instead of nine, 2.5-3x faster on host cores. It rounds a few elements
    in a thousand one bit differently from the single-tensor path, so it is chosen only when the user's
    optimizer is fused too (:func:`lightning_smartinf.core.torch_optim.rule_for_group`). The flag concerns
    host-core devices only: ``backend="xrt"`` runs the HLS kernel's arithmetic whatever it says.
    """

    decoupled_weight_decay: bool = False
    amsgrad: bool = False
    fused: bool = False
    name: ClassVar[str] = "adam"

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if self.amsgrad else ("exp_avg", "exp_avg_sq")

    def apply(
        self, master: Tensor, grad: Tensor, states: Sequence[Tensor], hp: StepParams, *, ieee_sqrt: bool = False
    ) -> None:
        exp_avg, exp_avg_sq = states[0], states[1]
        beta1, beta2 = hp.betas
        if self.fused:
            kernel = torch._fused_adamw_ if self.decoupled_weight_decay else torch._fused_adam_
            kernel(
                [master],
                [grad],
                [exp_avg],
                [exp_avg_sq],
                [states[2]] if self.amsgrad else [],
                # The kernel reads the step (on the master's device); torch.optim increments it before.
                [torch.tensor(float(hp.step), device=master.device)],
                lr=hp.lr,
                beta1=beta1,
                beta2=beta2,
                weight_decay=hp.weight_decay,
                eps=hp.eps,
                amsgrad=self.amsgrad,
                maximize=hp.maximize,
            )
            return
        _sign_and_decay(master, grad, hp, self.decoupled_weight_decay)
        exp_avg.lerp_(grad, 1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        bias_correction1 = 1.0 - beta1**hp.step
        bias_correction2_sqrt = math.sqrt(1.0 - beta2**hp.step)
        second = exp_avg_sq
        if self.amsgrad:
            second = states[2]
            second.copy_(second.maximum(exp_avg_sq))
        # ``grad`` is dead from here on: reuse it as the denominator to avoid an allocation.
        denom = _sqrt(second, ieee=ieee_sqrt, into=grad).div_(bias_correction2_sqrt).add_(hp.eps)
        master.addcdiv_(exp_avg, denom, value=-hp.lr / bias_correction1)


@dataclass(frozen=True)
class EFAdam(UpdateRule):
    """Adam/AdamW for error-feedback top-k gradients: the residual carries the first moment, the device the second.

    Error feedback already integrates every gradient until it is sent (an entry leaves with the sum of the steps
    it waited), so averaging the delivered values again in ``exp_avg`` only delays them: that double momentum is
    what cost AdamW 8.8% validation loss at 1% top-k (``docs/compression.md``). This rule drops the first moment
    and keeps Adam's second moment, bias correction and weight decay:

        v = beta2 * v + (1 - beta2) * g * g
        p = p - lr * g / (sqrt(v) / sqrt(1 - beta2^t) + eps)        (AdamW first scales p by 1 - lr * wd)

    which is ``torch.optim.Adam``/``AdamW`` with ``betas=(0, beta2)``, rounding for rounding (``lerp`` with weight
    1 returns the gradient exactly, and ``1 - 0^t = 1``). ``beta1`` of the param group is not used. One fp32 state
    per element instead of two: 8 B/param on the device instead of 12.
    """

    decoupled_weight_decay: bool = False
    name: ClassVar[str] = "ef_adam"

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("exp_avg_sq",)

    def apply(
        self, master: Tensor, grad: Tensor, states: Sequence[Tensor], hp: StepParams, *, ieee_sqrt: bool = False
    ) -> None:
        exp_avg_sq = states[0]
        beta2 = hp.betas[1]
        _sign_and_decay(master, grad, hp, self.decoupled_weight_decay)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        bias_correction2_sqrt = math.sqrt(1.0 - beta2**hp.step)
        denom = _sqrt(exp_avg_sq, ieee=ieee_sqrt).div_(bias_correction2_sqrt).add_(hp.eps)
        master.addcdiv_(grad, denom, value=-hp.lr)


@dataclass(frozen=True)
class SGD(UpdateRule):
    """``torch.optim.SGD`` with optional momentum, dampening, Nesterov momentum and weight decay.

    ``with_momentum`` fixes whether a momentum buffer is kept (decided by the param group's initial momentum).
    """

    with_momentum: bool = True
    name: ClassVar[str] = "sgd"

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.with_momentum else ()

    def apply(
        self, master: Tensor, grad: Tensor, states: Sequence[Tensor], hp: StepParams, *, ieee_sqrt: bool = False
    ) -> None:
        _sign_and_decay(master, grad, hp)
        update = grad
        if self.with_momentum and hp.momentum != 0.0:
            buf = states[0]
            if hp.step == 1:
                # torch creates the buffer as a copy of the first gradient (no dampening on step 1).
                buf.copy_(grad)
            else:
                buf.mul_(hp.momentum).add_(grad, alpha=1.0 - hp.dampening)
            update = grad.add_(buf, alpha=hp.momentum) if hp.nesterov else buf
        master.add_(update, alpha=-hp.lr)


@dataclass(frozen=True)
class EFAdafactor(SGD):
    """The device half of EF-Adafactor, AdamW for error-feedback top-k gradients with Adafactor's second moment.

    The host keeps the second moment, factored, from every step's dense gradient, and sends each kept entry already
    divided by it (:class:`~lightning_smartinf.core.factored.FactoredMoments`): ``u = g / (sqrt(v_hat) + eps)``, with
    the gradient scale and the sign of ``maximize`` applied. What remains for the device is AdamW's decoupled decay
    and the step,

        p = p - lr * (u + wd * p)        (= p * (1 - lr * wd) - lr * u)

    which is ``torch.optim.SGD`` without momentum, rounding for rounding, so the devices run their SGD kernels. No
    state besides the fp32 master: 4 B/param on the device, and 8 B/param/step of device traffic.
    """

    with_momentum: bool = False
    name: ClassVar[str] = "ef_adafactor"

    def __post_init__(self) -> None:
        if self.with_momentum:
            raise ValueError(
                "`EFAdafactor` keeps no momentum on the device: the error-feedback residual is its first moment."
            )


@dataclass(frozen=True)
class Adagrad(UpdateRule):
    """``torch.optim.Adagrad`` with learning-rate decay, weight decay and an initial accumulator value."""

    initial_accumulator_value: float = 0.0
    name: ClassVar[str] = "adagrad"

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("sum",)

    def initial_state_value(self, state: str) -> float:
        return self.initial_accumulator_value

    def apply(
        self, master: Tensor, grad: Tensor, states: Sequence[Tensor], hp: StepParams, *, ieee_sqrt: bool = False
    ) -> None:
        state_sum = states[0]
        _sign_and_decay(master, grad, hp)
        clr = hp.lr / (1.0 + (hp.step - 1) * hp.lr_decay)
        state_sum.addcmul_(grad, grad, value=1.0)
        std = _sqrt(state_sum, ieee=ieee_sqrt).add_(hp.eps)
        master.addcdiv_(grad, std, value=-clr)
