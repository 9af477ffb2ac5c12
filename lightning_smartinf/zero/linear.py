"""A linear layer's weight gradient computed where ZeRO-3 keeps it, instead of in a new tensor copied there.

ZeRO-3 replaces ``torch.nn.functional.linear`` with its own autograd function (``LinearFunctionForZeroStage3``, while
``zero.Init``'s ``mem_efficient_linear`` is on, its default). Its backward computes each weight's gradient into a new
tensor; ZeRO then copies it into its flat gradient buffer (``partition_grads``) and frees it. On a host every such
tensor is a fresh mapping whose pages fault in one by one, and the copy is one more pass over every gradient: at
1.54B parameters on two cores, computing the weight gradients and copying them took 0.88 s a step where computing
them into the buffer takes 0.37.

:class:`LinearIntoGradientBuffer` is ZeRO's function with one change: where the optimizer that owns the weight offers
the weight's place in its buffer (:func:`offer_gradient_buffer`), the weight's gradient is computed there. It is then
the buffer's view that autograd accumulates into ``weight.grad``, and ZeRO's copy finds it already in place.

Invariants:

- The values are ZeRO's: the same matrix product (``torch.matmul`` with ``out=``, the kernel ZeRO's own call runs),
  written elsewhere.
- A weight without an offer (another engine's, or one the optimizer declines: see
  :meth:`~lightning_smartinf.zero.optimizer.SmartUpdateZeroOptimizer.gradient_destination`) runs ZeRO's backward
  unchanged, so installing the function (:func:`install`, process-wide, as ZeRO's own replacement is) changes no other
  engine.
- The optimizer hands out a weight's place once per micro-batch: a weight used twice in one graph gets a new tensor
  the second time, and autograd sums the two as it would any others.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero import linear as zero_linear
from deepspeed.runtime.zero.utils import is_zero_param
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["LinearIntoGradientBuffer", "ZeroLinear", "install", "offer_gradient_buffer", "withdraw_gradient_buffer"]

#: Where a weight's gradient may go: ``(weight, the gradient's dtype, its device) -> a tensor there, shaped like the
#: weight, or None``.
Destination = Callable[[Tensor, torch.dtype, torch.device], Tensor | None]

#: ZeRO's own function (:func:`install` replaces its module's name with the subclass below).
ZeroLinear = zero_linear.LinearFunctionForZeroStage3
#: Each offered parameter's destination, by the parameter's identity (a tensor's ``==`` compares its values).
_offers: WeakIdKeyDictionary = WeakIdKeyDictionary()


def offer_gradient_buffer(params: Iterable[Tensor], destination: Destination) -> None:
    """Let each of ``params``' weight gradients be computed where ``destination`` says (each call of it hands out a
    place; ``None``: compute it as ZeRO does). An offer lasts as long as its parameter; a later offer replaces it."""
    for param in params:
        _offers[param] = destination


def withdraw_gradient_buffer(params: Iterable[Tensor], destination: Destination) -> None:
    """End ``destination``'s offers of ``params`` (their gradients are computed as ZeRO does from now on); an offer
    another has made since stays."""
    for param in params:
        if _offers.get(param) is destination:
            del _offers[param]


def install() -> None:
    """Make ZeRO's replacement of ``torch.nn.functional.linear`` run :class:`LinearIntoGradientBuffer` (idempotent).

    ZeRO's wrapper looks its function up by name in its module at each call, so every linear layer ZeRO wraps, built
    before or after, runs it from the next forward on."""
    zero_linear.LinearFunctionForZeroStage3 = LinearIntoGradientBuffer


class LinearIntoGradientBuffer(ZeroLinear):
    """ZeRO-3's linear function whose backward computes an offered weight's gradient in its place (module docstring).

    Forward notes the weight and its offer on the context, so that backward decides without unpacking the saved
    tensors: they unpack once (activation offload's hooks free each saved tensor at its first unpacking)."""

    @staticmethod
    def setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: Tensor) -> None:
        ZeroLinear.setup_context(ctx, inputs, output)
        input, weight = inputs[0], inputs[1]
        offer = _offers.get(weight)
        # The parameter itself, a leaf that outlives the graph (only its offer needs it): no cycle through the graph.
        ctx.gradient_offer = None if offer is None else (offer, weight, input.dtype)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        destination = _destination(ctx, grad_output)
        if destination is None:
            return ZeroLinear.backward(ctx, grad_output)
        input, weight, bias = ctx.saved_tensors
        # As ZeRO's backward where forward ran without autocast (the only case offered): autocast off, the weight
        # gathered for the product if it was released since.
        device_type = get_accelerator().device_name()
        with torch.autocast(device_type=device_type, enabled=False):
            released = is_zero_param(weight) and getattr(weight.ds_status, "name", None) == "NOT_AVAILABLE"
            if released:
                weight.all_gather()
            try:
                grad_input = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
                rows = grad_output.reshape(-1, grad_output.shape[-1])
                torch.matmul(rows.t(), input.reshape(-1, input.shape[-1]), out=destination)
                grad_bias = None
                if bias is not None and ctx.needs_input_grad[2]:
                    grad_bias = grad_output.sum(list(range(grad_output.dim() - 1)))
                return grad_input, destination, grad_bias
            finally:
                if released:
                    weight.partition()


def _destination(ctx: torch.autograd.function.FunctionCtx, grad_output: Tensor) -> Tensor | None:
    """The place offered for this backward's weight gradient, where it can be computed there exactly as ZeRO's
    backward would compute it (a matrix product in the inputs' dtype, without autocast or a graph of its own)."""
    noted = getattr(ctx, "gradient_offer", None)
    if noted is None or not ctx.needs_input_grad[1] or grad_output.dim() < 2 or torch.is_grad_enabled():
        return None
    if ctx._fwd_used_autocast:  # ZeRO's backward then casts under autocast: its dtype is autocast's
        return None
    offer, weight, input_dtype = noted
    if input_dtype != grad_output.dtype:
        return None
    destination = offer(weight, grad_output.dtype, grad_output.device)
    if destination is not None:
        shape = weight.ds_shape if is_zero_param(weight) else weight.shape
        assert destination.shape == shape and destination.dtype == grad_output.dtype, "a place for its values"
        assert destination.device == grad_output.device, "a place where the product runs"
    return destination
