"""Helpers of the core's tests: the optimizers backends are compared with, the engine's partitions as flat buffers,
and backends' state read back."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_smartinf.core.backend import Backend
from lightning_smartinf.core.build import tiers_over
from lightning_smartinf.core.host_buffer import InMemoryBuffer
from lightning_smartinf.core.rules import SGD, Adagrad, Adam, EFAdafactor, EFAdam, UpdateRule
from lightning_smartinf.core.streaming.backend import StreamingBackend
from lightning_smartinf.core.streaming.device import StreamingDevice
from lightning_smartinf.core.tiers.host_memory import MemoryDevice
from lightning_smartinf.core.tiers.tiered import AttachedTiers, TieredBackend

# name -> (rule, torch optimizer class, torch kwargs, StepParams kwargs beyond step/lr/grad_scale)
OPTIMIZERS: dict[str, tuple[UpdateRule, type, dict, dict]] = {
    "adamw": (
        Adam(decoupled_weight_decay=True),
        torch.optim.AdamW,
        {"betas": (0.9, 0.99), "eps": 1e-6, "weight_decay": 0.1},
        {"betas": (0.9, 0.99), "eps": 1e-6, "weight_decay": 0.1},
    ),
    "adam_amsgrad": (
        Adam(amsgrad=True),
        torch.optim.Adam,
        {"amsgrad": True, "weight_decay": 0.01},
        {"weight_decay": 0.01},
    ),
    "adam_l2_maximize": (
        Adam(),
        torch.optim.Adam,
        {"weight_decay": 0.01, "maximize": True},
        {"weight_decay": 0.01, "maximize": True},
    ),
    "sgd_nesterov": (
        SGD(),
        torch.optim.SGD,
        {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-3},
        {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-3},
    ),
    # EF-Adam is torch's Adam/AdamW with beta1 = 0; the step's own beta1 (0.9 here) must be ignored.
    "ef_adamw": (
        EFAdam(decoupled_weight_decay=True),
        torch.optim.AdamW,
        {"betas": (0.0, 0.99), "eps": 1e-6, "weight_decay": 0.1},
        {"betas": (0.9, 0.99), "eps": 1e-6, "weight_decay": 0.1},
    ),
    "ef_adam_l2_maximize": (
        EFAdam(),
        torch.optim.Adam,
        {"betas": (0.0, 0.999), "weight_decay": 0.01, "maximize": True},
        {"weight_decay": 0.01, "maximize": True},
    ),
    "sgd_plain": (SGD(with_momentum=False), torch.optim.SGD, {}, {}),
    # EF-Adafactor's device half: the host sent normalised values, the device runs torch's SGD (AdamW's decay).
    "ef_adafactor": (EFAdafactor(), torch.optim.SGD, {"weight_decay": 0.1}, {"weight_decay": 0.1}),
    "adagrad": (
        Adagrad(initial_accumulator_value=0.1),
        torch.optim.Adagrad,
        {"lr_decay": 0.01, "initial_accumulator_value": 0.1, "eps": 1e-10},
        {"lr_decay": 0.01, "eps": 1e-10},
    ),
}


def changing_lr(t: int) -> float:
    """A learning rate that changes every step, like a scheduler."""
    return 1e-2 * (0.8 ** (t - 1)) + 1e-3 * t


#: The arguments of :class:`TieredBackend` beside the backend it wraps.
TIER_ARGUMENTS = ("memory_bytes", "accelerator_bytes", "accelerator_device", "measure_memory_share")


class FlatPartitions:
    """One rank's parameters and gradients as flat buffers, sub-group by sub-group (the ``Partitions`` protocol)."""

    def __init__(self, sizes: list[int], dtype: torch.dtype, loss_scale: float) -> None:
        self.sizes = sizes
        self.flat_params = [torch.zeros(n, dtype=dtype) for n in sizes]
        self.grad_buffer = torch.zeros(sum(sizes), dtype=dtype)
        self.loss_scale = loss_scale

    def params(self, sub_group: int) -> Tensor:
        return self.flat_params[sub_group]

    def params_changed(self, sub_group: int) -> None: ...

    @property
    def param_dtype(self) -> torch.dtype:
        return self.grad_buffer.dtype

    staged_limit: int | None = None

    def param_bytes(self) -> tuple[int, int]:
        return (0, 0)

    def host_buffer(self, numel: int) -> InMemoryBuffer:
        return InMemoryBuffer(torch.zeros(numel, dtype=torch.float32))

    def prepare_for_update(self) -> None: ...

    def finish_update(self) -> None: ...

    def restore_loss_scale(self, scale: float) -> None:
        self.loss_scale = scale

    def gradient_fence(self) -> None:
        return None  # host tensors: nothing is in flight

    def layout(self) -> list[list[dict[str, Any]]]:
        return [[{"name": f"p{i}", "shape": [n], "partition_numel": n}] for i, n in enumerate(self.sizes)]

    rank = 0
    world_size = 1


def read_masters(backend: Backend, sizes: list[int]) -> list[torch.Tensor]:
    """Every shard's fp32 master weights, as ``backend`` holds them now."""
    out = [torch.empty(n) for n in sizes]
    for i, tensor in enumerate(out):
        backend.read_master(i, tensor)
    backend.wait()
    return out


class SlowMemoryDevice(MemoryDevice):
    """The memory tier on a host with too few cores to spare: each chunk's update takes 20 ms longer."""

    def run_compute(self, work) -> None:  # noqa: ANN001
        time.sleep(0.02)
        super().run_compute(work)


class SlowMemoryTiers(AttachedTiers):
    """Tiers whose memory device is a :class:`SlowMemoryDevice`."""

    def make_memory_device(self, index: int, backend: StreamingBackend) -> StreamingDevice:
        return SlowMemoryDevice(
            index, backend.traffic, chunk_elems=backend.chunk_elems, buffer_count=2, capacity=self.memory_bytes
        )


def split_tier_arguments(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``kwargs`` as (the backend's arguments, the tiers' :data:`TIER_ARGUMENTS`)."""
    backend = {k: v for k, v in kwargs.items() if k not in TIER_ARGUMENTS}
    return backend, {k: v for k, v in kwargs.items() if k in TIER_ARGUMENTS}


def with_tiers(backend: Backend, tiers: Callable[..., TieredBackend] = tiers_over, **arguments: Any) -> Backend:
    """``backend`` wrapped in tiers where ``arguments`` give one a budget (as set-up wraps it), else as it is."""
    if not (arguments.get("memory_bytes") or arguments.get("accelerator_bytes")):
        return backend
    return tiers(backend, **arguments)
