"""Running Lightning's DeepSpeed strategy on DeepSpeed's CPU accelerator with gloo.

Lightning's ``DeepSpeedStrategy`` refuses non-CUDA accelerators, validates CUDA device indices and passes
``device_rank=None`` on CPU (training and inference engines); DeepSpeed itself trains ZeRO-3 on CPU. The
mixin replaces exactly those steps and leaves the CUDA path untouched.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from typing import Any

from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_smartinf.zero.aio import prebuilt_ops


class DeepSpeedOnCPUMixin:
    """Mix into a ``DeepSpeedStrategy`` subclass (before it) to train on ``accelerator="cpu"`` as well as CUDA."""

    #: DeepSpeed's accelerator before this run switched it to CPU, put back at teardown; ``None``: nothing switched.
    replaced_accelerator: Any = None

    @override
    def setup_environment(self: Any) -> None:
        if isinstance(self.accelerator, CUDAAccelerator):
            super().setup_environment()
            return
        if not isinstance(self.accelerator, CPUAccelerator):
            raise MisconfigurationException(
                f"`{type(self).__name__}` runs on `accelerator='cuda'` or `'cpu'`, not on "
                f"`{type(self.accelerator).__name__}`."
            )
        from deepspeed.accelerator import get_accelerator, set_accelerator
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        if get_accelerator().device_name() != "cpu":
            # DeepSpeed's accelerator is process-wide: switched for this run only, and switched back at teardown, so a
            # later CUDA run in the same process (a notebook, a test suite) gets DeepSpeed's CUDA accelerator again.
            self.replaced_accelerator = get_accelerator()
            set_accelerator(CPU_Accelerator())
        DDPStrategy.setup_environment(self)

    @override
    def setup_distributed(self: Any) -> None:
        if isinstance(self.accelerator, CUDAAccelerator):
            super().setup_distributed()
            return
        reset_seed()
        self.set_world_ranks()
        # `deepspeed.init_distributed` loads the CPU accelerator's shared-memory comm op, and prints that it did.
        with prebuilt_ops(), contextlib.redirect_stdout(io.StringIO()):
            self._init_deepspeed_distributed()

    @override
    def teardown(self: Any) -> None:
        engine = self.model if hasattr(self.model, "destroy") and hasattr(self.model, "optimizer") else None
        try:
            super().teardown()
            if engine is not None:
                # ZeRO-3's gradient hooks live on autograd nodes and close over the engine: a cycle through C++ that
                # the garbage collector cannot see. Removing them lets the engine and its buffers be freed.
                engine.destroy()
        finally:
            if (replaced := self.replaced_accelerator) is not None:
                from deepspeed.accelerator import set_accelerator

                set_accelerator(replaced)
                self.replaced_accelerator = None

    @override
    def _initialize_deepspeed_inference(self: Any, model: Module) -> None:
        # `validate`/`test`/`predict` without `fit`: Lightning passes `device_rank=None` on CPU. Same engine set-up
        # as Lightning's, with our device rank; no optimizer, so no optimizer offload either.
        if isinstance(self.accelerator, CUDAAccelerator):
            super()._initialize_deepspeed_inference(model)
            return
        import deepspeed
        from lightning.pytorch.strategies.deepspeed import remove_module_hooks

        config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        config.update({key: self.config[key] for key in ("fp16", "bf16") if key in self.config})
        if self.zero_stage_3:
            zero = {k: v for k, v in self.config["zero_optimization"].items() if k != "offload_optimizer"}
            config.update({"zero_allow_untested_optimizer": True, "zero_optimization": zero})
        remove_module_hooks(model)
        self.model, _, _, _ = deepspeed.initialize(
            args=self.deepspeed_args(),
            config=config,
            model=model,
            optimizer=None,
            lr_scheduler=None,
            model_parameters=[],
            dist_init_required=False,
        )

    def deepspeed_args(self: Any) -> argparse.Namespace:
        """The ``args`` for ``deepspeed.initialize``: CPU devices have no index, so the local rank stands in."""
        on_cuda = isinstance(self.accelerator, CUDAAccelerator)
        return argparse.Namespace(device_rank=self.root_device.index if on_cuda else self.local_rank)


class DeepSpeedCPUStrategy(DeepSpeedOnCPUMixin, DeepSpeedStrategy):
    """Stock Lightning ``DeepSpeedStrategy`` (any ZeRO stage and offload) that also runs on CPU.

    The baseline that benchmarks and equivalence tests compare ``smart_infinity`` with, e.g. ZeRO-Infinity
    (``offload_optimizer_device="nvme"``) or ``deepspeed_stage_3_offload`` on the same machine.
    """

    @override
    def _setup_model_and_optimizer(
        self, model: Module, optimizer: Optimizer | None, lr_scheduler: Any = None
    ) -> tuple[Any, Optimizer]:
        import deepspeed

        engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
            args=self.deepspeed_args(),
            config=self.config,
            model=model,
            model_parameters=filter(lambda p: p.requires_grad, model.parameters()),
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, deepspeed_optimizer
