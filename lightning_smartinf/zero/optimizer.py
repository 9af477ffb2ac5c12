"""DeepSpeed ZeRO-3 optimizer whose sub-group updates run on near-storage devices (SmartUpdate).

Stock ZeRO-3 with ``offload_optimizer: nvme`` keeps an empty fp32 placeholder per sub-group and swaps master
weights, moments and gradients between host and disk around a host-side update. This subclass keeps the
placeholders but never swaps: the :class:`~lightning_smartinf.core.controller.SmartUpdateController`'s devices own
master weights and states, receive each sub-group's reduced gradient in the training dtype, and write the updated
low-precision partition straight into ZeRO's flat parameter buffer.

This is the one module that uses DeepSpeed's private ZeRO-3 methods; everything else reaches them through
:class:`ZeroPartitions` and the controller. Invariants:

- Sub-group ``i`` is controller sub-group ``i`` and backend shard ``i``; ZeRO builds ``fp16_partitioned_groups_flat``
  and ``grad_partitions_flat_buffer`` in the same order.
- The host never holds fp32 master weights or states, nor extra gradient copies: devices read each gradient straight
  from ZeRO's buffer and round it to the training dtype as it crosses the link.
- An overflowing (fp16) or non-finite step returns before any submission (:meth:`SmartUpdateController.skip_step`).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.swap_tensor.partitioned_param_swapper import PartitionedParamStatus
from deepspeed.runtime.utils import combine_grad_norm_groups, is_invalid_grad_norm
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from torch import Tensor

from lightning_smartinf.core.accelerator import Fence, PinnedRing, record_fence
from lightning_smartinf.core.controller import SmartUpdateController, SubGroup
from lightning_smartinf.core.float64_norm import PartitionNorm
from lightning_smartinf.core.host_buffer import HostBuffer, InMemoryBuffer
from lightning_smartinf.core.traffic import Traffic
from lightning_smartinf.zero.gradient_buffer import gradient_buffer_device
from lightning_smartinf.zero.host_heap import return_free_heap
from lightning_smartinf.zero.linear import install, offer_gradient_buffer, withdraw_gradient_buffer
from lightning_smartinf.zero.param_storage import FileBuffer, check_parameter_files, prepare_swapper

if TYPE_CHECKING:
    from lightning_smartinf.zero.install import ControllerFactory

#: While ZeRO moves the parameter partitions into its flat host buffer, the C heap's free pages go back to the
#: system each time this many bytes have moved (:meth:`SmartUpdateZeroOptimizer._move_to_flat_buffer`).
RETURN_FREED_EVERY_BYTES = 256 * 2**20


class ZeroPartitions:
    """ZeRO-3's partitions as the controller sees them (:class:`~lightning_smartinf.core.controller.Partitions`).

    Sub-groups whose parameters live on storage (``offload_parameters="storage"``: ZeRO keeps no flat buffer for
    them) are updated through staging buffers: one per sub-group between :meth:`params` and :meth:`params_changed`,
    which stores it and frees it. At most :attr:`staged_limit` are asked for at once.
    """

    def __init__(self, optimizer: SmartUpdateZeroOptimizer, param_traffic: Traffic | None = None) -> None:
        self._optimizer = optimizer
        self._param_traffic = param_traffic
        self._staged: dict[int, Tensor] = {}

    @property
    def grad_buffer(self) -> Tensor:
        return self._optimizer.grad_partitions_flat_buffer

    def params(self, sub_group: int) -> Tensor:
        flat = self._optimizer.fp16_partitioned_groups_flat[sub_group]
        if flat is not None:
            return flat
        staged = self._staged.get(sub_group)
        if staged is None:
            numel = self._optimizer.fp16_partitioned_groups_flat_numel[sub_group]
            staged = self._staged[sub_group] = torch.empty(numel, dtype=self.param_dtype)
        return staged

    def params_changed(self, sub_group: int) -> None:
        # Every caller is done with the sub-group's gradient by now (its update finished, or was discarded).
        if self._optimizer.gradient_file is not None:
            ends = list(itertools.accumulate(self._optimizer.fp16_partitioned_groups_flat_numel, initial=0))
            self._optimizer.gradient_file.discard(ends[sub_group], ends[sub_group + 1])
        staged = self._staged.pop(sub_group, None)
        if staged is None:
            self._optimizer._unflatten_partitioned_parameters(sub_group)
        else:
            self._optimizer.store_params(sub_group, staged)

    @property
    def param_dtype(self) -> torch.dtype:
        return self._optimizer.dtype

    @property
    def staged_limit(self) -> int | None:
        if self._param_traffic is None:
            return None
        # Two per device keeps every device busy while the host stores the parameters of the one before.
        return 2 * self._optimizer.smart_update.backend.num_devices

    def param_bytes(self) -> tuple[int, int]:
        if self._param_traffic is None:
            return (0, 0)
        snapshot = self._param_traffic.snapshot()
        return snapshot.param_read_bytes, snapshot.param_write_bytes

    def host_buffer(self, numel: int) -> HostBuffer:
        gradients = self._optimizer.gradient_file
        if gradients is not None:  # the gradients live in a file: so does what is kept beside them
            return FileBuffer(gradients.directory, numel, torch.float32, what="the error-feedback residual")
        return InMemoryBuffer(torch.zeros(numel, dtype=torch.float32, device=self.grad_buffer.device))

    def prepare_for_update(self) -> None:
        self._optimizer._partition_all_parameters()

    def finish_update(self) -> None:
        self._optimizer._post_step(set())  # the same refresh of persistent and secondary copies as after a step

    @property
    def loss_scale(self) -> float:
        return float(self._optimizer.loss_scale)

    def restore_loss_scale(self, scale: float) -> None:
        if self._optimizer.dynamic_loss_scale:
            self._optimizer.loss_scaler.cur_scale = scale

    def gradient_fence(self) -> Fence | None:
        ring = self._optimizer.gradient_ring
        if ring is not None:  # the partitions queued so far are in the file once the ring has moved them there
            return ring.fence()
        accelerator = get_accelerator()
        if accelerator.is_synchronized_device():
            return None
        # Called on the stream that reduced and copied the partitions (ZeRO's reduce stream during backward).
        fence = record_fence(accelerator.current_device_name())
        if fence is None:  # an accelerator without CUDA events: wait here, as ZeRO would before a host step
            accelerator.current_stream().synchronize()
        return fence

    def layout(self) -> list[list[dict[str, Any]]]:
        """Per shard, the parameters whose partitions it holds, in order: enough to rebuild full fp32 weights.

        Parameter ``p`` is split into ``world_size`` equal partitions of ``partition_numel`` elements (the last
        padded); rank ``r`` holds elements ``[r * partition_numel, (r + 1) * partition_numel)`` of ``p.view(-1)``.
        """
        names = self._optimizer.param_names
        return [
            [
                {
                    "name": names.get(param, f"param{param.ds_id}"),
                    "shape": list(param.ds_shape),
                    "partition_numel": int(param.partition_numel()),
                }
                for param in sub_group
            ]
            for sub_group in self._optimizer.fp16_groups
        ]

    @property
    def rank(self) -> int:
        return dist.get_rank(group=self._optimizer.dp_process_group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(group=self._optimizer.dp_process_group)


class DeviceSwapper:
    """Stands where ZeRO-3 expects its NVMe optimizer swapper; routes the initial masters to the devices.

    ZeRO calls only the methods below on the SmartUpdate path; every other swapper call would mean a DeepSpeed code
    path we did not account for, so it fails loudly instead of silently swapping.
    """

    def __init__(self, optimizer: SmartUpdateZeroOptimizer, swap_folder: str) -> None:
        self._optimizer = optimizer
        #: The engine copies this (empty) folder into checkpoints; device state is saved by the strategy.
        self.swap_folder = swap_folder

    def is_swappable_tensor(self, param: Tensor | None = None, numel: int | None = None) -> bool:
        return True

    def initialize_parameters(self, parameters: list[Tensor], src_tensors: list[Tensor]) -> None:
        placeholders = self._optimizer.fp32_partitioned_groups_flat
        masters = [
            (next(i for i, p in enumerate(placeholders) if p is placeholder), src)
            for placeholder, src in zip(parameters, src_tensors)
        ]
        self._optimizer.smart_update.initialize_all(masters)

    def _nothing_to_do(self) -> None:
        """ZeRO's timers and its hooks around backward: nothing is timed or swapped here."""

    init_timers = log_timers = pre_backward = post_backward = purge_state = _nothing_to_do

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(
            f"DeepSpeed called `optimizer_swapper.{name}`, which SmartUpdate does not implement; this DeepSpeed "
            "version takes a code path lightning_smartinf was not tested with. Use a supported DeepSpeed version."
        )


class SmartUpdateZeroOptimizer(DeepSpeedZeroOptimizer_Stage3):
    """ZeRO-3 optimizer whose every sub-group update is delegated to the :class:`SmartUpdateController`.

    Not built directly: :func:`lightning_smartinf.zero.install.smart_update_optimizer` binds the controller factory
    and installs a subclass for the duration of ``deepspeed.initialize``.
    """

    #: Set on the subclass that :func:`smart_update_optimizer` installs.
    controller_factory: ControllerFactory
    #: The controller that runs this optimizer's steps on the devices (built with the optimizer).
    smart_update: SmartUpdateController
    #: With parameters on storage and gradients in host memory: their buffer, in a file on the storage path.
    gradient_file: FileBuffer | None = None
    #: With that file beside an accelerator: how the reduced partitions reach it (:meth:`partition_grads`).
    gradient_ring: PinnedRing | None = None
    _gradients_in_file = False
    #: Bytes of parameter partitions moved into ZeRO's flat buffer since the heap's free pages last went back.
    _moved_bytes = 0
    #: The norm :meth:`clip_next_step` asked the coming step to clip to; ``None``: the config's alone.
    _next_step_max_norm: float | None = None
    #: What this optimizer offered linear layers for their weight gradients (:meth:`_offer_gradient_buffer`).
    _gradient_offer: Callable[[Tensor, torch.dtype, torch.device], Tensor | None] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._partition_norm = PartitionNorm()
        #: The parameters whose gradient place :meth:`gradient_destination` handed out this micro-batch.
        self._destinations_out: set[int] = set()
        super().__init__(*args, **kwargs)

    def _configure_tensor_swapping(self, offload_optimizer_config: Any, aio_config: Any) -> None:
        # Only the parameters' own swapper moves them to and from storage from here on.
        param_traffic = None
        if self.params_in_nvme_and_cpu:
            swapper = self.fp16_groups[0][0].nvme_swapper
            check_parameter_files(swapper)  # ZeRO wrote every partition by now, and reports no failed write
            param_traffic = prepare_swapper(swapper)
        sub_groups = [
            SubGroup(
                numel=int(numel),
                param_group=self.sub_group_to_group_id[i],
                segments=tuple(int(p.partition_numel()) for p in self.fp16_groups[i]),
            )
            for i, numel in enumerate(self.fp16_partitioned_groups_flat_numel)
        ]
        self.smart_update = type(self).controller_factory(
            self.optimizer, sub_groups, ZeroPartitions(self, param_traffic)
        )
        self.optimizer_swapper = DeviceSwapper(self, str(offload_optimizer_config.nvme_path))

    def _move_to_flat_buffer(
        self, param_list: list[Tensor], flat_buffer: Tensor | None, avoid_copy: bool = False
    ) -> None:
        # ZeRO copies each partition of the sub-group into `flat_buffer` and frees it. Partitions made before
        # `map_large_allocations` (a model built in `__init__`) are on the heap: hand their pages back as it goes, or
        # the RSS peaks at twice the parameters' bytes and keeps the holes for the run.
        super()._move_to_flat_buffer(param_list, flat_buffer, avoid_copy=avoid_copy)
        if flat_buffer is None or avoid_copy:
            return
        self._moved_bytes += flat_buffer.nbytes
        if self._moved_bytes >= RETURN_FREED_EVERY_BYTES:
            self._moved_bytes = 0
            return_free_heap()

    def _setup_for_real_optimizer(self) -> None:
        settings = self.smart_update.settings
        numel = sum(int(p.partition_numel()) for p in itertools.chain.from_iterable(self.fp16_groups))
        residual = 4 if settings.compression is not None and settings.compression.error_feedback else 0
        element_size = self.gradient_accumulation_dtype.itemsize
        device = gradient_buffer_device(
            settings.gradient_buffer, numel * (element_size + residual), int(self.gradient_accumulation_steps)
        )
        in_file = self._gradients_in_file = device is None and self.params_in_nvme_and_cpu
        if device is not None or in_file:
            # ZeRO pins the gradient buffer it makes (`offload_optimizer.pin_memory`, true by default) and we replace
            # it below: pinning would fail on CUDA for the "meta" buffer of `in_file`, and otherwise leave a whole
            # model's page-locked buffer (2-4 B/param) cached in CUDA's host allocator for nothing.
            self.offload_optimizer_pin_memory = False
        return_free_heap()  # what the last partitions moved into the flat buffer left behind
        host = self.device
        try:
            super()._setup_for_real_optimizer()
        finally:
            self.device = host
        if device is not None:
            # ZeRO then copies each reduced partition (and accumulates micro-batches) within the accelerator, takes
            # the norm and checks for overflow there; a device reads each gradient chunk across the link once.
            self._replace_gradient_buffer(torch.zeros(numel, dtype=self.gradient_accumulation_dtype, device=device))
        elif in_file:
            directory = Path(self.fp16_groups[0][0].nvme_swapper.swap_folder)
            self.gradient_file = FileBuffer(directory, numel, self.gradient_accumulation_dtype)
            self._replace_gradient_buffer(self.gradient_file.tensor)
            accelerator = get_accelerator()
            if not accelerator.is_synchronized_device():
                # Backward's partitions reach the file through pinned staging and a thread of its own: a copy into
                # the file's pageable pages would block the thread that launches backward, once per partition.
                self.gradient_ring = PinnedRing(device=torch.device(accelerator.current_device_name()))
        self._offer_gradient_buffer()

    def _offer_gradient_buffer(self) -> None:
        """Offer linear layers the buffer's places for their weight gradients (:mod:`~lightning_smartinf.zero.linear`)
        where training runs on the host, the buffer is plain host memory and the reduce leaves each gradient as it
        is: there, ZeRO's copy of a new gradient tensor into the buffer is a pass over memory and a fresh mapping's
        page faults per gradient. (Beside an accelerator the gradients are computed there, not in the buffer.)"""
        buffer = self.grad_partitions_flat_buffer
        training_on = torch.device(get_accelerator().current_device_name()).type
        if training_on != "cpu" or buffer.device.type != "cpu" or self.gradient_file is not None:
            return
        params = [p for p in itertools.chain.from_iterable(self.fp16_groups) if p.requires_grad]
        if not params or self.zenflow or not self._reduce_is_identity(params[:1]):
            return
        install()
        optimizer = weakref.ref(self)

        def destination(param: Tensor, dtype: torch.dtype, device: torch.device) -> Tensor | None:
            owner = optimizer()
            return None if owner is None else owner.gradient_destination(param, dtype, device)

        offer_gradient_buffer(params, destination)
        self._gradient_offer = destination

    def gradient_destination(self, param: Tensor, dtype: torch.dtype, device: torch.device) -> Tensor | None:
        """``param``'s place in the gradient buffer, shaped like it, for its gradient of this micro-batch in ``dtype``
        computed on ``device``; ``None`` where it must come as a tensor of its own: after the first micro-batch
        (accumulation adds to the place), in another dtype or on another device than the buffer's, where the reduce
        is not the identity, where this rank holds part of it, or when its place was handed out already this
        micro-batch (a weight used twice in the graph)."""
        views = self._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition
        place = views.get(param.ds_id)
        if (
            place is None
            or self.micro_step_id != 0
            or dtype != self.gradient_accumulation_dtype
            or place.device != device
            or param.ds_id in self._destinations_out
            or param.partition_numel() != param.ds_numel
            or not self._reduce_is_identity([param])
        ):
            return None
        self._destinations_out.add(param.ds_id)
        return place.narrow(0, 0, param.ds_numel).view(param.ds_shape)

    def _replace_gradient_buffer(self, buffer: Tensor) -> None:
        """Keep the reduced gradient partitions in ``buffer`` instead of ZeRO's pinned host buffer: the per-parameter
        views are rebuilt over it in ZeRO's order (``fp16_groups``, flattened)."""
        views = self._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition
        offset = 0
        for param in itertools.chain.from_iterable(self.fp16_groups):
            views[param.ds_id] = buffer.narrow(0, offset, param.partition_numel())
            offset += param.partition_numel()
        assert offset == buffer.numel(), "every parameter's partition has a view over the whole buffer"
        self.grad_partitions_flat_buffer = buffer
        # ZeRO's fp16 overflow check ORs `isinf(buffer).any()` into this flag in place: it must live where the buffer
        # does (ZeRO made it on the offload device, the host; a GPU buffer would meet a host flag).
        self.inf_or_nan_tracker = self.inf_or_nan_tracker.to(buffer.device)

    def store_params(self, sub_group: int, values: Tensor) -> None:
        """Write ``values``, the flat low-precision partition of ``sub_group``, where its parameters live.

        Partitions kept in memory (too small for the swapper) are copied into; the others are written to their files
        through the parameters' swapper, bit for bit, and the write is complete on return: the next gather reads them.
        """
        stored, sources = [], []
        offset = 0
        for param, partition in zip(self.fp16_groups[sub_group], self.fp16_partitioned_groups[sub_group]):
            source = values.narrow(0, offset, partition.ds_numel)
            offset += partition.ds_numel
            if partition.final_location != OffloadDeviceEnum.nvme:
                partition.data.copy_(source)
            else:
                stored.append(param)
                sources.append(source)
        if stored:
            swapper = stored[0].nvme_swapper
            # DeepSpeed may have read some of them ahead for the next forward: those copies are stale now.
            if any(p.ds_tensor.status != PartitionedParamStatus.NOT_AVAILABLE for p in stored):
                swapper.synchronize_reads()
                swapper.remove_partition_and_release_buffers(stored)
            swapper.swap_out_partitioned_params(dst_fp16_params=stored, src_fp32_params=sources)
            swapper.synchronize_writes()

    def initialize_optimizer_states(self) -> None:
        # Device states were initialised with the masters (DeviceSwapper.initialize_parameters).
        if self._gradients_in_file:
            # ZeRO allocates (and zeroes) a whole-model host gradient buffer next, on `self.device`; on "meta" it takes
            # no memory. `_setup_for_real_optimizer` puts the device back and the buffer in a file.
            self.device = "meta"

    def _reduce_is_identity(self, params: list[Tensor]) -> bool:
        """Whether ZeRO's averaging reduce-scatter gives ``params``' gradients back as they are: one rank in their
        partition group and nothing to scale them by (a pre-divide factor, an expert group's averaging, sequence
        parallelism)."""
        group = self._get_param_partition_group(params[0])
        scaled = self.postscale_gradients and self.gradient_predivide_factor != 1.0
        return (
            dist.get_world_size(group=group) == 1
            and not scaled
            and self._gradient_averaging_world_size(params, 1) == 1
            and self.sequence_parallel_size == 1
        )

    def _gradients_stay_put(self, params: list[Tensor]) -> bool:
        """Whether ``params``' gradients skip ZeRO's bucket: in host memory, where the bucket's copy costs the cores
        backward runs on, and reduced by the identity (:meth:`_reduce_is_identity`), where the bucket serves no
        collective. On an accelerator the bucket keeps its memory unfragmented, as ZeRO intends."""
        return (
            not self.zenflow
            and all(p.grad is not None and p.grad.device.type == "cpu" for p in params)
            and self._reduce_is_identity(params)
        )

    def _reduced_as_they_are(self, params: list[Tensor], communication_data_type: torch.dtype) -> list[Tensor]:
        """The reduced partitions of ``params`` where the reduce is the identity: each gradient, flat, cast as ZeRO
        casts it (to the communication dtype, then the accumulation dtype)."""
        self._assert_same_partition_group(params)
        return [p.grad.to(communication_data_type).to(self.gradient_accumulation_dtype).reshape(-1) for p in params]

    def _DeepSpeedZeroOptimizer_Stage3__add_grad_to_ipg_bucket(self, param: Tensor) -> None:  # noqa: N802
        """ZeRO's copy of a gradient into its bucket, for one collective over the bucket; where the gradient stays
        put (:meth:`_gradients_stay_put`), the bucket only counts it, and its reduction reads it where autograd left
        it (:meth:`_DeepSpeedZeroOptimizer_Stage3__avg_scatter_contiguous_grads`): a pass over every gradient less on
        a host (at 1.54B on a 2-core VM, backward took 0.83-0.95 of its time)."""
        if not self._gradients_stay_put([param]):
            super()._DeepSpeedZeroOptimizer_Stage3__add_grad_to_ipg_bucket(param)
            return
        bucket = self.ipg_buckets[self.get_param_comm_dtype(param)]
        bucket.params.append(param)
        bucket.process_group = self._get_param_partition_group(param)
        bucket.elements += param.grad.numel()

    def _DeepSpeedZeroOptimizer_Stage3__avg_scatter_contiguous_grads(  # noqa: N802 (ZeRO's private method)
        self, buffer_to_reduce: Tensor, communication_data_type: torch.dtype
    ) -> list[Tensor]:
        """ZeRO's reduce-scatter of a bucket's contiguous buffer (taken with ``reduce_scatter`` off); a bucket whose
        gradients stayed put holds none of them in its buffer: they are reduced where they are."""
        params = self.ipg_buckets[communication_data_type].params
        if self._gradients_stay_put(params):
            return self._reduced_as_they_are(params, communication_data_type)
        return super()._DeepSpeedZeroOptimizer_Stage3__avg_scatter_contiguous_grads(
            buffer_to_reduce, communication_data_type
        )

    def _DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads(  # noqa: N802 (ZeRO's private method, by its mangled name)
        self, params_to_reduce: list[Tensor], communication_data_type: torch.dtype
    ) -> list[Tensor]:
        """ZeRO's averaging reduce-scatter of a bucket of gradients; with one rank in the group, the gradients.

        Over one rank the reduce-scatter is the identity and the average a division by one, yet ZeRO copies the bucket
        into a new flat tensor, divides it in place and passes it through the collective: three passes over every
        gradient, a third of backward on a CPU. The same values come back here without them: each gradient (a view of
        ZeRO's bucket, or the gradient itself where it stayed put), cast as ZeRO casts it. Any scaling ZeRO would
        apply (a pre-divide factor, an expert group's averaging) takes ZeRO's path.
        """
        if not self._reduce_is_identity(params_to_reduce):
            return super()._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads(params_to_reduce, communication_data_type)
        return self._reduced_as_they_are(params_to_reduce, communication_data_type)

    def partition_grads(self, params_to_release: list[Tensor], grad_partitions: list[Tensor]) -> list[Tensor]:
        """ZeRO's copy of each reduced gradient partition into the gradient buffer, without a copy training does not
        need where the buffer is host memory (ZeRO's pinned buffer, or a file through :attr:`gradient_ring`).

        The link carries, per micro-batch, what accumulation needs and nothing more:

        - the first micro-batch of a step: each partition once to the host (in the buffer's dtype), and its norm is
          taken on the accelerator from the partition itself. ZeRO also copies the host buffer back to the
          accelerator each time, for a norm only the last micro-batch takes;
        - each later micro-batch: ZeRO's accumulation, on the accelerator (the buffer's partition comes over, the
          micro-batch is added, the sum goes back); the ring is flushed first.

        A buffer on the accelerator is ZeRO's own path, unchanged. Mirrors ``DeepSpeedZeroOptimizer_Stage3.
        partition_grads`` of DeepSpeed 0.19.8 otherwise.
        """
        ring = self.gradient_ring
        if ring is not None and self.micro_step_id != 0:
            ring.flush()
        buffer = self.grad_partitions_flat_buffer
        if self.micro_step_id != 0 or (ring is None and get_accelerator().on_accelerator(buffer)):
            return super().partition_grads(params_to_release, grad_partitions)
        views = self._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition
        offload_fp32_gradients: dict = {}
        offload_fp32_offsets: dict = {}
        buffers = []
        for param, grad_partition in zip(params_to_release, grad_partitions):
            if param.partition_numel() * self._get_param_partition_rank(param) >= param.ds_numel:
                param.grad = None  # this rank's partition of it is padding only
                continue
            self._offload_boundary_param_ids.add(param.ds_id)
            grad_buffer = views[param.ds_id].narrow(0, 0, grad_partition.numel())
            buffers.append(grad_buffer)
            # In the buffer's dtype on the accelerator (what ZeRO's copy would round it to), queued on this stream.
            on_device = grad_partition.to(self.gradient_accumulation_dtype).view(grad_buffer.shape)
            self._destinations_out.discard(param.ds_id)
            if ring is not None:
                ring.copy(grad_buffer, on_device)
            elif on_device.data_ptr() != grad_buffer.data_ptr():  # (computed in its place: `gradient_destination`)
                grad_buffer.copy_(on_device, non_blocking=True)
            if self.is_gradient_accumulation_boundary():
                self._offload_grad_partition_at_boundary(param, on_device, offload_fp32_gradients, offload_fp32_offsets)
            if param.grad is not None and not get_accelerator().is_synchronized_device():
                param.grad.record_stream(get_accelerator().current_stream())
            param.grad = None
        self._swap_out_offload_fp32_gradients(offload_fp32_gradients, offload_fp32_offsets)
        return buffers

    def _constant_buffered_norm2(self, input: Tensor, buffer_size: int = 0) -> Tensor:
        # Every gradient norm ZeRO takes: the same float64 sum of squares without a float64 copy of the partition.
        return self._partition_norm(input)

    def _offload_grad_partition_at_boundary(
        self, param: Tensor, grad_buffer: Tensor, offload_fp32_gradients: dict, offload_fp32_offsets: dict
    ) -> None:
        # Only the norm is needed now; the gradient stays in ZeRO's flat buffer until the step submits it.
        param_id = self.get_param_id(param)
        self.norm_for_param_grads[param_id] = self._constant_buffered_norm2(grad_buffer)
        if self.smart_update.settings.overlap:
            self.smart_update.note_reduced(self.grad_position[param_id][0], param.ds_id)

    def _swap_out_offload_fp32_gradients(self, offload_fp32_gradients: dict, offload_fp32_offsets: dict) -> None:
        # Called after each bucket of gradient partitions: hand off the sub-groups it completed.
        self.smart_update.hand_off_ready(self._expected)
        if self.gradient_file is not None:
            self.gradient_file.release()

    def _expected(self) -> list[set[Hashable]]:
        """Per sub-group, the parameters that have gradient elements on this rank (the others send nothing)."""
        return [
            {p.ds_id for p in group if p.partition_numel() * self._get_param_partition_rank(p) < p.ds_numel}
            for group in self.fp16_groups
        ]

    def clip_next_step(self, max_norm: float) -> None:
        """Clip the coming step's gradient to global L2 norm ``max_norm`` (Lightning's ``clip_gradients``).

        As ``torch.nn.utils.clip_grad_norm_`` on the gradients before the step, for that step only. With the config's
        ``gradient_clipping`` also set, the smaller of the two holds: clipping to one norm and then to another clips to
        the smaller."""
        self._next_step_max_norm = max_norm

    def _take_max_norm(self) -> float:
        """The norm this step's gradient is clipped to (0: none), consuming :meth:`clip_next_step`'s."""
        limits = [n for n in (self.clip_grad, self._next_step_max_norm) if n is not None and n > 0.0]
        self._next_step_max_norm = None
        return min(limits, default=0.0)

    def _clip_divisor(self, total_norm: Tensor, max_norm: float) -> float:
        """What clipping divides this step's gradient by (1 without clipping); ``unscale_and_clip_grads``'s formula."""
        if max_norm <= 0.0:
            return 1.0
        return max(((float(total_norm) / self.loss_scale) + 1e-6) / max_norm, 1.0)

    def _link_overflows(self, clip_factor: float) -> bool:
        """Whether this step's gradient plus the error-feedback residual overflows the link on any rank.

        Each rank checks only its own partition and residual; the ranks must agree, as they do on ZeRO's own overflow
        check, because a rank that steps while another skips enters collectives the other never joins. So the flag
        is reduced (MAX) over the data-parallel group whenever error feedback is configured (the same on every rank,
        whatever the data); it is read on the host once per step.
        """
        flag = self.smart_update.link_overflows(clip_factor)
        compression = self.smart_update.settings.compression
        if compression is not None and compression.error_feedback and self.partition_count > 1:
            flag = flag.to(device=get_accelerator().current_device_name(), dtype=torch.uint8).reshape(1)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.dp_process_group)
        return bool(flag)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        self._destinations_out.clear()  # places handed out to a backward that reduced nothing (it raised)
        if self.gradient_ring is not None:
            self.gradient_ring.flush()  # ZeRO's overflow check and the compression read the buffer on the host
        max_norm = self._take_max_norm()
        self._pre_step()
        self._partition_all_parameters()
        self._overflow_check_and_loss_scale_update(update_scale=False)
        total_norm = None
        if not self.overflow:
            total_norm = combine_grad_norm_groups(self._get_norm_groups())
            # Error feedback may have accumulated beyond the link dtype (fp16): an overflow like any other. The
            # clipping factor alone (1 without clipping) scales this step's gradient and no other step's.
            if is_invalid_grad_norm(total_norm) or self._link_overflows(1.0 / self._clip_divisor(total_norm, max_norm)):
                self.overflow = True
        if self._loss_scale_update_and_overflow_cleanup():
            # Skipped step: nothing was sent, or only tentative updates, now undone; device state is as it was.
            self.smart_update.skip_step()
            return
        self._global_grad_norm = total_norm / self.loss_scale
        self.smart_update.step(grad_scale=1.0 / (float(self.loss_scale) * self._clip_divisor(total_norm, max_norm)))
        # torch's LR schedulers warn unless the wrapped optimizer's own step ran; the devices ran it.
        self.optimizer._opt_called = True
        self._post_step(set())

    def reset_swap_buffers(self) -> None:
        # `engine.load_checkpoint` calls this (NVMe-offload path) to swap restored state back in. The device state is
        # restored by the controller instead (`SmartUpdateController.restore`): nothing to swap.
        return None

    def destroy(self) -> None:
        if self._gradient_offer is not None:
            withdraw_gradient_buffer(itertools.chain.from_iterable(self.fp16_groups), self._gradient_offer)
        try:
            if self.gradient_ring is not None:
                self.gradient_ring.close()
            super().destroy()
        finally:
            # The storage stays claimed: whoever built the backend decides when to give it up (`release_storage`).
            self.smart_update.backend.close(keep_claims=True)
