"""DeepSpeed ZeRO-3 optimizer whose sub-group updates run on near-storage devices (SmartUpdate).

Stock ZeRO-3 with ``offload_optimizer: nvme`` keeps an empty fp32 placeholder per sub-group and swaps
master weights, moments and gradients between host and disk around a host-side update. This
subclass keeps the placeholders but never swaps: the backend owns master weights and states on its
storage, receives each sub-group's reduced gradient in the training dtype, and writes the updated
low-precision partition straight into ZeRO's flat parameter buffer.

Invariants:
- Sub-group ``i`` is backend shard ``i``; its gradient is the slice of ``grad_partitions_flat_buffer``
  starting at the sum of the earlier sub-groups' partition sizes (ZeRO builds both in the same order).
- The host never holds fp32 master weights or states, nor extra gradient copies: devices read each
  gradient straight from ZeRO's buffer and round it to the training dtype as it crosses the link.
- An overflowing (fp16) or non-finite step returns before any submission: device state is untouched,
  and so is the compression residual.
- With compression and error feedback, ``residual + what was sent`` equals the sum of all gradients so
  far (in the current loss scale's units): the residual is added before selection, cleared where sent.
- Early hand-off (``smartinf_overlap``): a sub-group whose every gradient partition on this rank is final goes
  to its device during backward as a *tentative* update, with the step's hyperparameters as they stand and no
  clipping. ``step`` keeps it only if nothing changed since (hyperparameters, loss scale, clipping factor, no
  gradient reduced again, the step not skipped); otherwise the update is rolled back and redone or skipped,
  so the result is always the one a step without hand-off gives.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.utils import combine_grad_norm_groups, is_invalid_grad_norm
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from torch import Tensor

from lightning_smartinf.csd import Backend, Handle, ShardSpec
from lightning_smartinf.csd.compression import TopKCompression, compress_topk
from lightning_smartinf.csd.rules import StepParams
from lightning_smartinf.csd.torch_optim import rule_for_group, step_params

BackendFactory = Callable[[], Backend]


def _group_hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's JSON-serialisable settings (everything but the parameters; tensors as floats)."""
    out: dict[str, Any] = {}
    for key, value in group.items():
        if key == "params":
            continue
        if isinstance(value, Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, tuple):
            value = list(value)
        if value is None or isinstance(value, (bool, int, float, str, list)):
            out[key] = value
    return out


class DeviceSwapper:
    """Stands where ZeRO-3 expects its NVMe optimizer swapper; routes the initial masters to the backend.

    ZeRO calls only the methods below on the SmartUpdate path; every other swapper call would mean a
    DeepSpeed code path we did not account for, so it fails loudly instead of silently swapping.
    """

    def __init__(self, optimizer: SmartUpdateZeroOptimizer, swap_folder: str) -> None:
        self._optimizer = optimizer
        #: The engine copies this (empty) folder into checkpoints; device state is saved by the strategy.
        self.swap_folder = swap_folder

    def is_swappable_tensor(self, param: Tensor | None = None, numel: int | None = None) -> bool:
        return True

    def initialize_parameters(self, parameters: list[Tensor], src_tensors: list[Tensor]) -> None:
        placeholders = self._optimizer.fp32_partitioned_groups_flat
        for placeholder, src in zip(parameters, src_tensors):
            shard = next(i for i, p in enumerate(placeholders) if p is placeholder)
            self._optimizer.smartinf_backend.initialize(shard, src)
        self._optimizer.smartinf_backend.wait()

    def init_timers(self) -> None: ...

    def log_timers(self) -> None: ...

    def pre_backward(self) -> None: ...

    def post_backward(self) -> None: ...

    def purge_state(self) -> None: ...

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(
            f"DeepSpeed called `optimizer_swapper.{name}`, which SmartUpdate does not implement; this DeepSpeed "
            "version takes a code path lightning_smartinf was not tested with. Use a supported DeepSpeed version."
        )


class SmartUpdateZeroOptimizer(DeepSpeedZeroOptimizer_Stage3):
    """ZeRO-3 optimizer with the update of every sub-group delegated to a near-storage backend.

    Not built directly: :func:`lightning_smartinf.zero.install.smart_update_optimizer` binds the
    backend factory and installs a subclass for the duration of ``deepspeed.initialize``.
    """

    #: Set on the subclass that :func:`smart_update_optimizer` installs.
    _smartinf_backend_factory: BackendFactory

    def _configure_tensor_swapping(self, offload_optimizer_config: Any, aio_config: Any) -> None:
        if self.params_in_nvme_and_cpu:
            raise ValueError("SmartUpdate does not support `offload_param` to NVMe; offload parameters to `cpu`.")
        self.smartinf_backend = type(self)._smartinf_backend_factory()
        self.smartinf_group_steps: dict[int, int] = {}
        #: Seconds the host spent blocked on devices for updated parameters (cumulative).
        self.smartinf_wait_s = 0.0
        #: Set by the strategy; ``None`` sends dense gradients.
        self.smartinf_compression: TopKCompression | None = None
        #: Kept ratio of the next step; ``None`` means dense (a warm-up phase), even with compression set.
        self.smartinf_kept_ratio: float | None = None
        #: Gradient entries sent and in total in the last step (equal when it was dense).
        self.smartinf_last_kept: tuple[int, int] = (0, 0)
        self.smartinf_residual: Tensor | None = None
        self._smartinf_residual_scale = 1.0
        #: Set by the strategy: hand sub-groups to their devices during backward (needs a tentative backend).
        self.smartinf_overlap = False
        #: Sub-groups handed off during backward and kept by the step, and those rolled back (cumulative).
        self.smartinf_early_kept = 0
        self.smartinf_early_rolled_back = 0
        # Tentative updates of this step's backward, by sub-group: (handle, hyperparameters they used).
        self._smartinf_early: dict[int, tuple[Handle, StepParams]] = {}
        # Sub-groups whose gradient was reduced again after their hand-off (their update is stale).
        self._smartinf_stale: set[int] = set()
        self._smartinf_reduced: list[set[int]] = [set() for _ in self.fp16_groups]
        self._smartinf_touched: set[int] = set()
        self._smartinf_expected: list[set[int]] | None = None
        offsets = [0]
        for numel in self.fp16_partitioned_groups_flat_numel:
            offsets.append(offsets[-1] + int(numel))
        self._smartinf_grad_offsets = offsets
        #: Per sub-group, the partition sizes of its parameters in order (layer-wise top-k selects within each).
        self.smartinf_segments = [[int(p.partition_numel()) for p in group] for group in self.fp16_groups]
        shards = []
        for i, numel in enumerate(self.fp16_partitioned_groups_flat_numel):
            group = self.optimizer.param_groups[self.sub_group_to_group_id[i]]
            shards.append(ShardSpec(index=i, numel=int(numel), rule=rule_for_group(self.optimizer, group)))
        self.smartinf_backend.open(shards)
        self.optimizer_swapper = DeviceSwapper(self, str(offload_optimizer_config.nvme_path))

    def initialize_optimizer_states(self) -> None:
        # Device states were initialised with the masters (DeviceSwapper.initialize_parameters).
        self._smartinf_link_dtype = self.fp16_partitioned_groups_flat[0].dtype

    def _offload_grad_partition_at_boundary(
        self, param: Tensor, grad_buffer: Tensor, offload_fp32_gradients: dict, offload_fp32_offsets: dict
    ) -> None:
        # Only the norm is needed now; the gradient stays in ZeRO's flat buffer until the step submits it.
        param_id = self.get_param_id(param)
        self.norm_for_param_grads[param_id] = self._constant_buffered_norm2(grad_buffer)
        if self.smartinf_overlap:
            i = self.grad_position[param_id][0]
            if i in self._smartinf_early:
                self._smartinf_stale.add(i)
            self._smartinf_reduced[i].add(param.ds_id)
            self._smartinf_touched.add(i)

    def _swap_out_offload_fp32_gradients(self, offload_fp32_gradients: dict, offload_fp32_offsets: dict) -> None:
        # Called after each bucket of gradient partitions: hand off the sub-groups it completed.
        touched, self._smartinf_touched = self._smartinf_touched, set()
        if not touched:
            return None
        expected = self._smartinf_expected_params()
        ready = sorted(i for i in touched if i not in self._smartinf_early and self._smartinf_reduced[i] >= expected[i])
        if ready and not get_accelerator().is_synchronized_device():
            # The partitions were copied to host memory asynchronously; devices read them from other threads.
            get_accelerator().current_stream().synchronize()
        for i in ready:
            steps = self.smartinf_group_steps.get(self.sub_group_to_group_id[i], 0) + 1
            # The step's own scale unless it clips or rescales.
            hp = self._smartinf_step_params(i, steps, grad_scale=1.0 / float(self.loss_scale))
            handle = self.smartinf_backend.submit(
                i,
                self._grad_slice(i),
                hp,
                self.fp16_partitioned_groups_flat[i],
                link_dtype=self._smartinf_link_dtype,
                tentative=True,
            )
            self._smartinf_early[i] = (handle, hp)
        return None

    def _smartinf_step_params(self, sub_group: int, step: int, grad_scale: float) -> StepParams:
        """The hyperparameters of ``sub_group``'s param group as they stand now, for its ``step``-th update."""
        group = self.optimizer.param_groups[self.sub_group_to_group_id[sub_group]]
        return step_params(group, step=step, grad_scale=grad_scale)

    def _smartinf_expected_params(self) -> list[set[int]]:
        """Per sub-group, the parameters that have gradient elements on this rank (the others send nothing)."""
        if self._smartinf_expected is None:
            self._smartinf_expected = [
                {p.ds_id for p in group if p.partition_numel() * self._get_param_partition_rank(p) < p.ds_numel}
                for group in self.fp16_groups
            ]
        return self._smartinf_expected

    def _smartinf_take_early(self) -> tuple[dict[int, tuple[Handle, StepParams]], set[int]]:
        """This backward's tentative updates and the stale ones among them; resets the hand-off bookkeeping."""
        early, self._smartinf_early = self._smartinf_early, {}
        stale, self._smartinf_stale = self._smartinf_stale, set()
        for reduced in self._smartinf_reduced:
            reduced.clear()
        self._smartinf_touched.clear()
        return early, stale

    def _smartinf_roll_back(self, shards: list[int], *, restore_params: bool) -> None:
        """Discard tentative updates; ``restore_params`` puts the committed parameters back in ZeRO's partitions."""
        if not shards:
            return
        backend = self.smartinf_backend
        backend.rollback(shards)
        self.smartinf_early_rolled_back += len(shards)
        if restore_params:
            for i in shards:
                backend.read_master(i, self.fp16_partitioned_groups_flat[i])
            backend.wait()
            for i in shards:
                self._unflatten_partitioned_parameters(i)

    def smartinf_discard_early(self) -> None:
        """Roll back hand-offs of a backward that no step followed (the parameters go back as they were)."""
        early, _ = self._smartinf_take_early()
        self._smartinf_roll_back(sorted(early), restore_params=True)

    def _combined_scale(self, total_norm: Tensor) -> float:
        """Loss scale times the clipping factor; same formula as ``unscale_and_clip_grads``."""
        combined = float(self.loss_scale)
        if self.clip_grad > 0.0:
            clip = ((float(total_norm) / self.loss_scale) + 1e-6) / self.clip_grad
            combined *= max(clip, 1.0)
        return combined

    def _smartinf_step_ratio(self) -> float | None:
        """The kept ratio for this step (``None``: dense); prepares the residual for it."""
        compression = self.smartinf_compression
        if compression is None:
            return None
        ratio = self.smartinf_kept_ratio
        if not compression.error_feedback:
            return ratio
        if self.smartinf_residual is None:
            if ratio is None:
                return None
            # fp32 even for bf16 gradients: it sums up to ~1/ratio steps of small gradients, which bf16 would lose.
            self.smartinf_residual = torch.zeros_like(self.grad_partitions_flat_buffer, dtype=torch.float32)
            self._smartinf_residual_scale = float(self.loss_scale)
        elif float(self.loss_scale) != self._smartinf_residual_scale:
            # The residual holds loss-scaled gradients; keep it in the units of this step's gradients.
            self.smartinf_residual.mul_(float(self.loss_scale) / self._smartinf_residual_scale)
            self._smartinf_residual_scale = float(self.loss_scale)
        # A dense step with a residual left over sends everything, so the residual is flushed, not lost.
        return 1.0 if ratio is None else ratio

    def _residual_slice(self, sub_group: int) -> Tensor | None:
        if self.smartinf_residual is None:
            return None
        start, end = self._smartinf_grad_offsets[sub_group], self._smartinf_grad_offsets[sub_group + 1]
        return self.smartinf_residual[start:end]

    def _grad_slice(self, sub_group: int) -> Tensor:
        start, end = self._smartinf_grad_offsets[sub_group], self._smartinf_grad_offsets[sub_group + 1]
        return self.grad_partitions_flat_buffer[start:end]

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        self._pre_step()
        self._partition_all_parameters()
        early, stale = self._smartinf_take_early()

        self._overflow_check_and_loss_scale_update(update_scale=False)
        total_norm = None
        if not self.overflow:
            total_norm = combine_grad_norm_groups(self._get_norm_groups())
            if is_invalid_grad_norm(total_norm):
                self.overflow = True
        if self._loss_scale_update_and_overflow_cleanup():
            # Skipped step: nothing was sent, or only tentative updates, now undone; device state is as it was.
            self._smartinf_roll_back(sorted(early), restore_params=True)
            return
        self._global_grad_norm = total_norm / self.loss_scale
        grad_scale = 1.0 / self._combined_scale(total_norm)

        for group_id in set(self.sub_group_to_group_id.values()):
            self.smartinf_group_steps[group_id] = self.smartinf_group_steps.get(group_id, 0) + 1

        backend = self.smartinf_backend
        backend.check_storage()
        ratio = self._smartinf_step_ratio()
        hps = [
            self._smartinf_step_params(i, self.smartinf_group_steps[self.sub_group_to_group_id[i]], grad_scale)
            for i in range(len(self.fp16_groups))
        ]
        # A tentative update stands only if it is exactly the update this step would submit.
        kept_early = {
            i: handle for i, (handle, hp) in early.items() if ratio is None and i not in stale and hp == hps[i]
        }
        self._smartinf_roll_back(sorted(set(early) - set(kept_early)), restore_params=False)
        self.smartinf_early_kept += len(kept_early)
        # Every sub-group is queued at once (devices take them in order); the host waits only for the
        # parameters of each in turn. Gradients cross the link in the training dtype.
        handles = []
        kept = total = 0
        for i in range(len(self.fp16_groups)):
            grad: Any = self._grad_slice(i)
            total += grad.numel()
            if i in kept_early:
                handles.append(kept_early[i])
                kept += grad.numel()
                continue
            hp = hps[i]
            out = self.fp16_partitioned_groups_flat[i]
            if ratio is None:
                kept += grad.numel()
            else:
                grad = compress_topk(
                    grad,
                    ratio,
                    self._residual_slice(i),
                    value_dtype=self._smartinf_link_dtype,
                    segments=self.smartinf_segments[i] if self.smartinf_compression.layerwise else None,
                )
                grad = grad.cpu()  # only the kept pairs leave the accelerator, when the gradient is on one
                kept += grad.k
            handles.append(backend.submit(i, grad, hp, out, link_dtype=self._smartinf_link_dtype))
        self.smartinf_last_kept = (kept, total)
        for i, handle in enumerate(handles):
            started = time.perf_counter()
            backend.result(handle)  # the device timeout applies; a device error stops the backend
            self.smartinf_wait_s += time.perf_counter() - started
            self._unflatten_partitioned_parameters(i)
        if kept_early:
            backend.commit(kept_early)
        # No backend.wait(): state write-back trails into the next forward; the devices order it before re-reads.
        # The next backward hands sub-groups off in this backward's order: devices read their state whenever
        # they would otherwise wait for one.
        backend.prefetch(list(early) + [i for i in range(len(self.fp16_groups)) if i not in early])
        # torch's LR schedulers warn unless the wrapped optimizer's own step ran; the devices ran it.
        self.optimizer._opt_called = True
        self._post_step(set())

    def smartinf_layout(self) -> list[list[dict[str, Any]]]:
        """Per shard, the parameters whose partitions it holds, in order: enough to rebuild full fp32 weights.

        Parameter ``p`` is split into ``world_size`` equal partitions of ``partition_numel`` elements (the last
        padded); rank ``r`` holds elements ``[r * partition_numel, (r + 1) * partition_numel)`` of ``p.view(-1)``.
        """
        names = self.param_names
        return [
            [
                {
                    "name": names.get(param, f"param{param.ds_id}"),
                    "shape": list(param.ds_shape),
                    "partition_numel": int(param.partition_numel()),
                }
                for param in sub_group
            ]
            for sub_group in self.fp16_groups
        ]

    def smartinf_state_dict(self) -> dict[str, Any]:
        """Host-side state that travels with the device state in checkpoints."""
        return {
            "group_steps": {str(k): v for k, v in self.smartinf_group_steps.items()},
            "loss_scale": float(self.loss_scale),
            "num_shards": len(self.fp16_groups),
            "rank": dist.get_rank(group=self.dp_process_group),
            "world_size": dist.get_world_size(group=self.dp_process_group),
            "shards": self.smartinf_layout(),
            # ZeRO's own optimizer checkpoint is skipped with NVMe offload, so the param groups' hyperparameters
            # (lr as moved by a scheduler, betas, weight decay, ...) travel here; chainable schedulers need them.
            "param_groups": [_group_hyperparameters(g) for g in self.optimizer.param_groups],
            "residual_loss_scale": self._smartinf_residual_scale if self.smartinf_residual is not None else None,
        }

    def load_smartinf_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_shards"] != len(self.fp16_groups):
            raise ValueError(
                f"The checkpoint holds {state['num_shards']} sub-groups on this rank but the model has "
                f"{len(self.fp16_groups)}. Resume with the same model, `sub_group_size` and number of ranks."
            )
        groups = state.get("param_groups")
        if groups is not None and len(groups) != len(self.optimizer.param_groups):
            raise ValueError(
                f"The checkpoint holds {len(groups)} optimizer param groups but this run has "
                f"{len(self.optimizer.param_groups)}. Resume with the same `configure_optimizers`."
            )
        self.smartinf_group_steps = {int(k): int(v) for k, v in state["group_steps"].items()}
        for group, saved in zip(self.optimizer.param_groups, groups or []):
            for key, value in saved.items():
                group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
        if self.dynamic_loss_scale:
            self.loss_scaler.cur_scale = state["loss_scale"]

    def load_smartinf_residual(self, residual: Tensor | None, loss_scale: float | None) -> None:
        """Restore (or, with ``None``, clear) the compression residual saved with a checkpoint."""
        if residual is None:
            self.smartinf_residual = None
            return
        if residual.shape != self.grad_partitions_flat_buffer.shape:
            raise ValueError(
                f"The checkpoint's compression residual has {residual.numel()} elements but this rank's gradient "
                f"partition has {self.grad_partitions_flat_buffer.numel()}. Resume with the same model and ranks."
            )
        self.smartinf_residual = residual.to(dtype=torch.float32, device=self.grad_partitions_flat_buffer.device)
        self._smartinf_residual_scale = float(loss_scale) if loss_scale is not None else float(self.loss_scale)

    def reset_swap_buffers(self) -> None:
        # `engine.load_checkpoint` calls this (NVMe-offload path) to swap restored state back in. The device state
        # is restored by the strategy instead (`backend.load`, then `smartinf_refresh_params`): nothing to swap.
        return None

    def smartinf_refresh_params(self) -> None:
        """Copy every shard's fp32 master weights into ZeRO's low-precision partitions (after ``backend.load``)."""
        self._partition_all_parameters()
        backend = self.smartinf_backend
        for i, flat in enumerate(self.fp16_partitioned_groups_flat):
            backend.read_master(i, flat)
        backend.wait()
        for i in range(len(self.fp16_groups)):
            self._unflatten_partitioned_parameters(i)
        self._post_step(set())  # the same refresh of persistent and secondary copies as after a step

    def destroy(self) -> None:
        try:
            super().destroy()
        finally:
            # The storage stays claimed: whoever built the backend decides when to give it up (`release_storage`).
            self.smartinf_backend.close(keep_claims=True)
