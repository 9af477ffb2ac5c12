"""``SmartUpdateController``: the optimizer step of a data-parallel engine, run by near-storage devices.

The controller owns what the devices' update needs beyond one request: the backend and where shards live, the
hyperparameters of each step, the compression residual, the bookkeeping of updates handed off during backward, the
host's wait and early-hand-off counters, and the device-state checkpoint format. It knows nothing of DeepSpeed or
Lightning: the engine that owns the parameter partitions is reached through :class:`Partitions`, which the ZeRO
adapter implements (``lightning_smartinf/zero/optimizer.py``).

Invariants:

- Sub-group ``i`` is backend shard ``i``; its gradient is the slice of :attr:`Partitions.grad_buffer` that starts at
  the sum of the earlier sub-groups' sizes.
- An overflowing or non-finite step (:meth:`SmartUpdateController.skip_step`) submits nothing: device state is
  untouched, and so is the residual.
- With compression and error feedback, ``residual + what was sent`` equals the sum of all gradients so far (in the
  current loss scale's units): the residual is added before selection and cleared where sent.
- Early hand-off: a sub-group whose every gradient partition on this rank is final goes to its device during backward
  as a *tentative* update, with the hyperparameters as they stand and no clipping. :meth:`SmartUpdateController.step`
  keeps it only if it is exactly the update the step would submit (same hyperparameters and scale, no gradient
  reduced again); otherwise it is rolled back and redone, so the result is always the one a step without hand-off
  gives.
- A hand-off is a speculation that the step will not clip or rescale, and a miss costs a second pass over the state.
  So a backward hands off only while that speculation has held recently (:class:`_Speculation`): a miss stops it
  for twice as many steps as the last one did (up to :data:`MAX_PAUSE`), and a step that does not hand off updates
  once, after backward, moving the state's bytes once. A sub-group whose gradient was reduced again after its
  hand-off (a parameter used twice in one backward, tied weights) is never handed off again.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
import warnings
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_smartinf.core import registry
from lightning_smartinf.core.accelerator import Fence
from lightning_smartinf.core.backend import Backend, BackendStats, Handle, ShardSpec
from lightning_smartinf.core.compression import SparseGrad, compress_topk, has_narrower_range, link_overflows
from lightning_smartinf.core.factored import FactoredMoments, device_step_params
from lightning_smartinf.core.format.rank_state import load_host_tensors, save_device_state
from lightning_smartinf.core.format.reshard import Reshard, same_layout
from lightning_smartinf.core.format.safetensors_stream import SavedTensor
from lightning_smartinf.core.format.state_files import MANIFEST, read_manifest, require_state_files
from lightning_smartinf.core.host_buffer import HostBuffer
from lightning_smartinf.core.io.leftovers import scratch_directory
from lightning_smartinf.core.progress import Progress
from lightning_smartinf.core.renamed import old_names
from lightning_smartinf.core.rules import EFAdafactor, StepParams
from lightning_smartinf.core.settings import SmartUpdateSettings
from lightning_smartinf.core.torch_optim import rule_for_group, step_params
from lightning_smartinf.core.traffic import TrafficSnapshot


@dataclass(frozen=True)
class SubGroup:
    """One sub-group of this rank's parameter partitions: the unit a device updates.

    Args:
        numel: elements of the sub-group's flat partition.
        param_group: index of the optimizer param group its parameters belong to.
        segments: partition sizes of its parameters, in order (layer-wise top-k selects within each).
    """

    numel: int
    param_group: int
    segments: tuple[int, ...]


class Partitions(Protocol):
    """What the controller needs from the engine that owns the parameter and gradient partitions."""

    @property
    def grad_buffer(self) -> Tensor:
        """This rank's reduced gradients of every sub-group, flat, in sub-group order."""

    def params(self, sub_group: int) -> Tensor:
        """The flat low-precision parameter partition of ``sub_group``, which updates are written into.

        Where the parameters live on storage (:attr:`staged_limit` is not ``None``) this is a staging buffer, held
        from the first call until :meth:`params_changed`; its contents before a device writes it are undefined.
        """

    def params_changed(self, sub_group: int) -> None:
        """``params(sub_group)`` holds new values: make the module's parameters see them (or store them)."""

    @property
    def param_dtype(self) -> torch.dtype:
        """The training precision of the parameter partitions."""

    @property
    def staged_limit(self) -> int | None:
        """``None`` where every partition lives in memory; else how many sub-groups' parameters the controller may
        hold in staging buffers at once (:meth:`params`), for parameters that live on storage."""

    def param_bytes(self) -> tuple[int, int]:
        """Bytes of parameters read from and written to storage so far (``(0, 0)`` when they live in memory)."""

    def host_buffer(self, numel: int) -> HostBuffer:
        """A zeroed fp32 buffer of ``numel`` elements on :attr:`grad_buffer`'s device: in memory, or in a file on
        storage where the gradients are (so host memory does not grow with the model)."""

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without one)."""

    def restore_loss_scale(self, scale: float) -> None:
        """Resume with the loss scale a checkpoint saved (a no-op for a static scale)."""

    def prepare_for_update(self) -> None:
        """The partitions are about to be written outside a step (a load): gather nothing, partition everything."""

    def finish_update(self) -> None:
        """The partitions were written outside a step: refresh every copy derived from them, as after a step."""

    def gradient_fence(self) -> Fence | None:
        """A fence after the work queued so far that writes :attr:`grad_buffer`; ``None`` when none is pending.

        Devices wait for it on their own threads before reading a gradient, so the training thread never blocks.
        """

    def layout(self) -> list[list[dict[str, Any]]]:
        """Per sub-group, its parameters' names, shapes and partition sizes (enough to rebuild full weights)."""

    @property
    def rank(self) -> int:
        """This rank in the data-parallel group."""

    @property
    def world_size(self) -> int:
        """Ranks in the data-parallel group."""


log = logging.getLogger(__name__)

#: Elements of the residual copied at a time when it is loaded (64 MiB of fp32).
COPY_BLOCK = 16 << 20

#: Steps between two checks of the devices' measured rates against their placement (:meth:`Backend.replan`).
REPLAN_EVERY = 10
#: The most steps a missed speculation stops hand-offs for (:class:`_Speculation`): after it, one more miss at most
#: every ``MAX_PAUSE + 1`` steps, a second pass over the state at most once in that many steps.
MAX_PAUSE = 64


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


class SmartUpdateController:
    """The optimizer step of one rank, run by the devices of ``backend``.

    Args:
        settings: the SmartUpdate settings (compression, overlap with backward, ...); fixed for the controller's life.
        backend: the devices; opened here with one shard per sub-group.
        optimizer: the ``torch.optim`` optimizer whose param groups give each step's hyperparameters.
        sub_groups: this rank's sub-groups, in order.
        partitions: the engine's parameter and gradient partitions.
    """

    def __init__(
        self,
        settings: SmartUpdateSettings,
        backend: Backend,
        optimizer: torch.optim.Optimizer,
        sub_groups: Sequence[SubGroup],
        partitions: Partitions,
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.optimizer = optimizer
        self.sub_groups = tuple(sub_groups)
        self.partitions = partitions
        #: Optimizer steps taken per param group (the ``step`` each group's next update uses, minus one).
        self.group_steps: dict[int, int] = {}
        #: Seconds the host spent blocked on devices for updated parameters (cumulative).
        self.wait_s = 0.0
        #: Host seconds in :meth:`step` (hand-offs and waits), cumulative.
        self.step_s = 0.0
        #: Kept ratio of the next step; ``None`` sends dense gradients (a warm-up phase), even with compression set.
        self.kept_ratio: float | None = settings.kept_ratio
        #: Gradient entries sent and in total in the last step (equal when it was dense).
        self.last_kept: tuple[int, int] = (0, 0)
        self._residual_buffer: HostBuffer | None = None
        #: The units of the residual: the scale (loss scale times clipping) of the step that last added to it.
        self.residual_scale = 1.0
        #: Sub-groups handed off during backward and kept by the step, and those rolled back (cumulative).
        self.early_kept = 0
        self.early_rolled_back = 0
        self._hand_offs = _HandOffs(len(self.sub_groups))
        self._speculation = _Speculation()
        self._offsets = list(itertools.accumulate((s.numel for s in self.sub_groups), initial=0))
        specs = [
            ShardSpec(
                index=i,
                numel=s.numel,
                rule=rule_for_group(optimizer, optimizer.param_groups[s.param_group], settings.compression),
                state_format=settings.state_precision,
                master_format="split" if settings.split_masters else "fp32",
            )
            for i, s in enumerate(self.sub_groups)
        ]
        #: Shards whose updates the host normalises by Adafactor's second moment (rule ``ef_adafactor``).
        self._normalised = {spec.index for spec in specs if isinstance(spec.rule, EFAdafactor)}
        #: That second moment, on the host; ``None`` when no shard runs ``ef_adafactor``.
        self.moments = FactoredMoments(partitions.layout(), partitions.rank) if self._normalised else None
        backend.open(specs)
        self._specs = tuple(specs)
        if settings.split_masters:
            self._bind_split_masters()

    def _bind_split_masters(self) -> None:
        """Give the backend the parameters that hold half of each split master; refuse parameters that cannot."""
        partitions = self.partitions
        where = "on storage" if partitions.staged_limit is not None else None
        if where is None and partitions.param_dtype != torch.bfloat16:
            where = f"in {partitions.param_dtype}"
        if where is None and self.sub_groups and partitions.params(0).device.type != "cpu":
            where = f"on {partitions.params(0).device}"
        if where is not None:
            raise ValueError(
                f"`split_masters=True` keeps half of each master in the bf16 parameters in host memory, but they are "
                f"{where}. Train with `precision='bf16-mixed'` and the parameters in host memory "
                "(`offload_parameters=True` beside an accelerator, not `'storage'`), or drop `split_masters`."
            )
        self.backend.bind_parameters(partitions.params)

    # ------------------------------------------------------------------------------------------------- views

    @property
    def segments(self) -> list[tuple[int, ...]]:
        """Per sub-group, the partition sizes of its parameters."""
        return [s.segments for s in self.sub_groups]

    @property
    def link_dtype(self) -> torch.dtype:
        """The dtype gradients and parameters cross the link in: the training precision of the partitions."""
        return self.partitions.param_dtype

    def grad(self, sub_group: int) -> Tensor:
        """This step's gradient of ``sub_group``: its slice of the flat gradient buffer."""
        return self.partitions.grad_buffer[self._offsets[sub_group] : self._offsets[sub_group + 1]]

    def _residual_slice(self, sub_group: int) -> Tensor | None:
        if self.residual is None:
            return None
        return self.residual[self._offsets[sub_group] : self._offsets[sub_group + 1]]

    @property
    def residual(self) -> Tensor | None:
        """Error-feedback residual: gradient not yet sent, fp32, in the units of :attr:`residual_scale`."""
        return None if self._residual_buffer is None else self._residual_buffer.tensor

    def _new_residual(self) -> HostBuffer:
        self._residual_buffer = self.partitions.host_buffer(self.partitions.grad_buffer.numel())
        return self._residual_buffer

    def _release_residual(self, sub_group: int | None = None) -> None:
        """The residual of ``sub_group`` (default: all of it) is done with until the next step."""
        if self._residual_buffer is not None:
            if sub_group is None:
                self._residual_buffer.release()
            else:
                self._residual_buffer.release(self._offsets[sub_group], self._offsets[sub_group + 1])

    def step_params(self, sub_group: int, step: int, grad_scale: float) -> StepParams:
        """The hyperparameters of ``sub_group``'s param group as they stand now, for its ``step``-th update."""
        group = self.optimizer.param_groups[self.sub_groups[sub_group].param_group]
        return step_params(group, step=step, grad_scale=grad_scale)

    @property
    def placement(self) -> tuple[int, ...]:
        """The device index of each sub-group, as the backend placed them."""
        return self.backend.assignment

    @property
    def speculating(self) -> bool:
        """Whether the next backward hands sub-groups off (see the module's invariants)."""
        return self._speculation.on

    @property
    def hand_offs(self) -> list[int]:
        """Sub-groups handed to their devices during the current backward, not yet kept or rolled back by a step."""
        return sorted(self._hand_offs.early)

    def layout(self) -> list[list[dict[str, Any]]]:
        """Per shard, the parameters whose partitions it holds: names, shapes and partition sizes."""
        return self.partitions.layout()

    def traffic_snapshot(self) -> TrafficSnapshot:
        """Cumulative bytes moved by this rank's devices, and of its parameters to and from storage."""
        return self._with_parameters(self.backend.traffic_snapshot())

    def stats(self, *, reset_peaks: bool = False) -> BackendStats:
        """The backend's figures (per-device times and pool use; see :meth:`Backend.stats`), its traffic with the
        parameters' as in :meth:`traffic_snapshot`."""
        stats = self.backend.stats(reset_peaks=reset_peaks)
        return replace(stats, traffic=self._with_parameters(stats.traffic))

    def _with_parameters(self, traffic: TrafficSnapshot) -> TrafficSnapshot:
        read, written = self.partitions.param_bytes()
        return replace(traffic, param_read_bytes=read, param_write_bytes=written)

    # ------------------------------------------------------------------------------------------ the update

    def initialize(self, sub_group: int, master: Tensor) -> Handle:
        """Write the initial master weights of ``sub_group`` to its device (states start from the rule's values)."""
        return self.backend.initialize(sub_group, master)

    def initialize_all(self, masters: Sequence[tuple[int, Tensor]]) -> None:
        """Write the initial master weights of each ``(sub_group, master)`` and wait for every write, showing the
        progress in the state's bytes (announced first: before a large run's first step, this is its wait)."""
        total = sum(self._specs[i].state_bytes for i, _ in masters)
        devices = self.backend.num_devices
        what = f"writing the initial optimizer state on {devices} device{'s' if devices != 1 else ''}"
        with Progress(what, total, announce=True, per_rank=True) as progress:
            handles = [(i, self.backend.initialize(i, master)) for i, master in masters]
            for i, handle in handles:
                self.backend.result(handle)
                progress.update(self._specs[i].state_bytes)
            self.backend.wait()

    def note_reduced(self, sub_group: int, param: Hashable) -> None:
        """Backward reduced ``param``'s gradient partition into ``sub_group`` (only with overlap in effect)."""
        self._hand_offs.reduced(sub_group, param)

    def hand_off_ready(self, expected: Callable[[], list[set[Hashable]]]) -> None:
        """Hand every sub-group whose gradient is now complete to its device, as a tentative update.

        ``expected()`` lists, per sub-group, the parameters with gradient elements on this rank.
        """
        grad_scale = 1.0 / self.partitions.loss_scale  # the step's own scale unless it clips or rescales
        if self._hand_offs.taken is None:  # what a hand-off of this backward takes, to judge the speculation by
            self._hand_offs.taken = self._hyperparameters(grad_scale)
        complete = self._hand_offs.ready(expected)
        if not self._speculation.on:
            return
        # A normalised update needs the step's whole gradient for its second moment: those shards wait for the step.
        ready = [
            i
            for i in complete
            if self.backend.takes_hand_off(i) and i not in self._normalised and i not in self._hand_offs.reduced_twice
        ]
        staged = self.partitions.staged_limit
        if staged is not None:  # each hand-off holds a staging buffer until the step
            ready = ready[: max(0, staged - len(self._hand_offs.early))]
        if not ready:
            return
        fence = self.partitions.gradient_fence()  # devices read the gradient from other threads
        for i in ready:
            steps = self.group_steps.get(self.sub_groups[i].param_group, 0) + 1
            hp = self.step_params(i, steps, grad_scale)
            handle = self.backend.submit(
                i, self.grad(i), hp, self.partitions.params(i), link_dtype=self.link_dtype, tentative=True, ready=fence
            )
            self._hand_offs.early[i] = (handle, hp)

    def link_overflows(self, clip_factor: float = 1.0) -> Tensor:
        """Whether this step's gradient plus the error-feedback residual, in the units of this step (its loss scale,
        and ``clip_factor``, the clipping it will have), would not be finite on the link.

        In fp16 an entry that error feedback accumulated beyond 65504 would cross as inf. The engine treats a ``True``
        like a gradient overflow: it skips the step (:meth:`skip_step`) and lowers its loss scale, and the residual,
        held in loss-scaled units, shrinks with it before the next step. ``False`` without a residual, and for a link
        dtype with fp32's exponent range (bf16, fp32), where a finite sum always fits: no pass over the buffers then.

        Returns:
            A 0-dim bool tensor, on the gradients' device when a pass ran: reading it is the step's one host
            synchronisation for this check. It answers for this rank only; with several ranks the engine reduces it.
        """
        if self.residual is None or not has_narrower_range(self.link_dtype, self.residual.dtype):
            return torch.zeros((), dtype=torch.bool)
        factor = self.partitions.loss_scale / clip_factor / self.residual_scale
        try:
            return link_overflows(self.partitions.grad_buffer, self.residual, self.link_dtype, factor)
        finally:
            self._release_residual()

    def withdraw_hand_offs(self) -> None:
        """The parameters are about to be read (a forward) while hand-offs of the last backward wait for a step that
        did not come: manual optimization that accumulates runs several backwards per step. Roll them back, the
        parameters they wrote restored, and count the speculation as missed; nothing to do when none is out."""
        if self._hand_offs.early:
            self._speculation.judge(held=False)
            self.discard_early()

    def skip_step(self) -> None:
        """The step is skipped (overflow): undo this backward's hand-offs; device state stays as it was. A hand-off
        would not have stood: the speculation missed."""
        if self._hand_offs.taken is not None:
            self._speculation.judge(held=False)
        self.discard_early()

    def _hyperparameters(self, grad_scale: float) -> list[StepParams]:
        """Each param group's hyperparameters as they stand, with ``grad_scale`` (the step count aside)."""
        return [step_params(group, step=0, grad_scale=grad_scale) for group in self.optimizer.param_groups]

    def discard_early(self) -> None:
        """Roll back hand-offs of a backward that no step followed (the parameters go back as they were)."""
        early, _ = self._hand_offs.take()
        self._roll_back(sorted(early), restore_params=True)

    def step(self, grad_scale: float) -> None:
        """Update every sub-group with its gradient times ``grad_scale`` (loss scale and clipping folded in).

        With error feedback the residual is held in the units of the step's gradient (:attr:`residual_scale`, one
        over ``grad_scale``), so each step's gradient is clipped by its own norm, as dense clipping does: what a
        step holds back is not scaled again by the clipping of the step that sends it.

        Every sub-group is queued at once (devices take them in order); the host waits only for the parameters of
        each in turn. Gradients cross the link in the training dtype. The engine skips the step instead when
        :meth:`link_overflows` (checked before, like its own overflow check).
        """
        started = time.perf_counter()
        ready = {i: started - at for i, at in self._hand_offs.ready_at.items()}
        taken = self._hand_offs.taken
        early, stale = self._hand_offs.take()
        for group in {s.param_group for s in self.sub_groups}:
            self.group_steps[group] = self.group_steps.get(group, 0) + 1
        self.backend.check_storage()
        ratio, residual_factor = self._step_ratio(grad_scale)
        hps = [self.step_params(i, self.group_steps[s.param_group], grad_scale) for i, s in enumerate(self.sub_groups)]
        # A tentative update stands only if it is exactly the update this step would submit.
        kept_early = {
            i: handle for i, (handle, hp) in early.items() if ratio is None and i not in stale and hp == hps[i]
        }
        self._roll_back(sorted(set(early) - set(kept_early)), restore_params=False)
        self.early_kept += len(kept_early)
        if taken is not None:  # a backward that could hand off: did (or would) its hand-offs stand?
            self._speculation.judge(held=ratio is None and taken == self._hyperparameters(grad_scale))
        # Hand-offs the step undid hid nothing behind backward: the update ran after it.
        self.backend.note_backward(ready if len(kept_early) == len(early) else {})
        staged = self.partitions.staged_limit
        if staged is not None:  # kept hand-offs hold staging buffers that the other sub-groups need
            for i in sorted(kept_early):
                self._finish(i, kept_early[i])
        submissions = self._submit_all(
            hps, ratio, kept_early, include_kept=staged is None, residual_factor=residual_factor
        )
        # Without staging every sub-group is queued at once; with it, at most `staged` are in flight.
        pending = deque(itertools.islice(submissions, staged or len(self.sub_groups)))
        while pending:
            self._finish(*pending.popleft())
            pending.extend(itertools.islice(submissions, 1))
        if kept_early:
            self.backend.commit(kept_early)
        if max(self.group_steps.values()) % REPLAN_EVERY == 0:
            self.backend.replan()
        # No backend.wait(): state write-back trails into the next forward; the devices order it before re-reads.
        # The next backward hands sub-groups off in this backward's order: devices read their state whenever they
        # would otherwise wait for one.
        self.backend.prefetch(list(early) + [i for i in range(len(self.sub_groups)) if i not in early])
        self.step_s += time.perf_counter() - started

    def _finish(self, sub_group: int, handle: Handle) -> None:
        """Wait for ``sub_group``'s update and hand its parameters to the engine."""
        started = time.perf_counter()
        self.backend.result(handle)  # the device timeout applies; a device error stops the backend
        self.wait_s += time.perf_counter() - started
        self.partitions.params_changed(sub_group)

    def _submit_all(
        self,
        hps: list[StepParams],
        ratio: float | None,
        kept_early: dict[int, Handle],
        *,
        include_kept: bool,
        residual_factor: float = 1.0,
    ) -> Iterator[tuple[int, Handle]]:
        """Submit every sub-group not kept from backward, in order, as the caller draws them; yields each with its
        handle (the kept ones too where ``include_kept``). Counts what is sent in :attr:`last_kept`. The residual
        is brought into this step's units by ``residual_factor`` as each sub-group's gradient joins it."""
        compression = self.settings.compression
        ready = self.partitions.gradient_fence()
        kept = total = 0
        if self.moments is not None:
            self.moments.begin_step()
        for i in range(len(self.sub_groups)):
            grad: Any = self.grad(i)
            total += grad.numel()
            if i in kept_early:
                kept += grad.numel()
                if include_kept:
                    yield i, kept_early[i]
                continue
            normalised = i in self._normalised
            hp = hps[i]
            if normalised:
                assert self.moments is not None
                self.moments.update(i, grad, hp.grad_scale, hp.betas[1])
            if ratio is None:
                kept += grad.numel()
            else:
                assert compression is not None
                grad = compress_topk(
                    grad,
                    ratio,
                    self._residual_slice(i),
                    # Normalised values are rounded to the link once, after the normalisation.
                    value_dtype=torch.float32 if normalised else self.link_dtype,
                    segments=self.sub_groups[i].segments if compression.layerwise else None,
                    check_range=False,  # the engine asked `link_overflows` for the whole buffer before this step
                    residual_factor=residual_factor,
                )
                self._release_residual(i)
                kept += grad.k
            if normalised:
                assert self.moments is not None
                grad = self.moments.normalise(i, grad, hp, self.link_dtype)
                hp = device_step_params(hp)
            fence = ready
            if ratio is not None or normalised:
                if isinstance(grad, SparseGrad):  # only the kept pairs leave an accelerator, without waiting there
                    grad = grad.cpu(non_blocking=True)
                # What was just computed for this sub-group is queued after `ready`: its devices wait for it instead.
                fence = self.partitions.gradient_fence()
            yield (
                i,
                self.backend.submit(i, grad, hp, self.partitions.params(i), link_dtype=self.link_dtype, ready=fence),
            )
        self.last_kept = (kept, total)

    def _step_ratio(self, grad_scale: float) -> tuple[float | None, float]:
        """The kept ratio for this step (``None``: dense), and the factor that brings the residual into the units of
        this step's gradient (one over ``grad_scale``: loss scale times clipping), applied as each sub-group's
        gradient joins it. Every sub-group is compressed while there is a residual, so none is left behind."""
        compression = self.settings.compression
        if compression is None:
            return None, 1.0
        ratio = self.kept_ratio
        if not compression.error_feedback:
            return ratio, 1.0
        scale = 1.0 / grad_scale
        if self.residual is None:
            if ratio is None:
                return None, 1.0
            # fp32 even for bf16 gradients: it sums up to ~1/ratio steps of small gradients, which bf16 would lose.
            self._new_residual()
            self.residual_scale = scale
            return ratio, 1.0
        factor, self.residual_scale = scale / self.residual_scale, scale
        # A dense step with a residual left over sends everything, so the residual is flushed, not lost.
        return (1.0 if ratio is None else ratio), factor

    def _roll_back(self, shards: list[int], *, restore_params: bool) -> None:
        """Discard tentative updates; ``restore_params`` puts the committed parameters back in the partitions."""
        if not shards:
            return
        self.backend.rollback(shards)
        self.early_rolled_back += len(shards)
        if restore_params and self.settings.split_masters:  # half of the committed state: the backend put them back
            for i in shards:
                self.partitions.params_changed(i)
        elif restore_params:
            self._read_params(shards)

    def _read_params(self, shards: Iterable[int]) -> None:
        """Copy the fp32 masters of ``shards`` into their low-precision partitions."""
        for i in shards:
            self.backend.read_master(i, self.partitions.params(i))
        self.backend.wait()
        for i in shards:
            self.partitions.params_changed(i)

    def refresh_params(self) -> None:
        """Copy every shard's fp32 master weights into the low-precision partitions (after a load)."""
        self.partitions.prepare_for_update()
        count = len(self.sub_groups)
        batch = self.partitions.staged_limit or count
        for start in range(0, count, batch):
            self._read_params(range(start, min(count, start + batch)))
        self.partitions.finish_update()

    # ------------------------------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Host-side state that travels with the device state in checkpoints."""
        return {
            "group_steps": {str(k): v for k, v in self.group_steps.items()},
            "loss_scale": self.partitions.loss_scale,
            "num_shards": len(self.sub_groups),
            "rank": self.partitions.rank,
            "world_size": self.partitions.world_size,
            "shards": self.partitions.layout(),
            # ZeRO's own optimizer checkpoint is skipped with NVMe offload, so the param groups' hyperparameters
            # (lr as moved by a scheduler, betas, weight decay, ...) travel here; chainable schedulers need them.
            "param_groups": [_group_hyperparameters(g) for g in self.optimizer.param_groups],
            "residual_loss_scale": self.residual_scale if self.residual is not None else None,
            "moment_updates": self.moments.updates if self.moments is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (the device state itself is loaded by :meth:`restore`, which
        re-shards a state saved under another layout than this run's)."""
        groups = state.get("param_groups")
        if groups is not None and len(groups) != len(self.optimizer.param_groups):
            raise ValueError(
                f"The checkpoint holds {len(groups)} optimizer param groups but this run has "
                f"{len(self.optimizer.param_groups)}. Resume with the same `configure_optimizers`."
            )
        self.group_steps = {int(k): int(v) for k, v in state["group_steps"].items()}
        for group, saved in zip(self.optimizer.param_groups, groups or []):
            for key, value in saved.items():
                group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
        self.partitions.restore_loss_scale(state["loss_scale"])

    def _reshard(
        self, directory: Path, state: dict[str, Any], rank_dirs: Sequence[Path] | None, scratch: contextlib.ExitStack
    ) -> Reshard | None:
        """How to load a checkpoint saved under another layout than this run's; ``None`` for the same layout.

        Where the devices that saved it kept the state files (remote servers), the backend fetches the manifests into
        a private temporary directory that ``scratch`` removes, and the files the plan reads as it needs them."""
        rank, world, layout = self.partitions.rank, self.partitions.world_size, self.partitions.layout()
        has_manifest = (Path(directory) / MANIFEST).is_file()  # none where the state was kept on remote servers
        saved_chunk = read_manifest(Path(directory)).get("chunk_elems") if has_manifest else None
        if (
            same_layout(state, layout, rank, world)
            and saved_chunk in (None, self.settings.chunk_size)
            and self.backend.loads_as_saved(directory)
        ):
            return None
        if rank_dirs is None:
            raise ValueError(
                f"The device state in {str(directory)!r} was saved by rank {state.get('rank')} of "
                f"{state.get('world_size')} with {state.get('num_shards')} sub-groups; this is rank {rank} of {world} "
                f"with {len(layout)}. Re-sharding needs every saved rank's directory; load through the strategy."
            )
        if state.get("residual") is not None and state.get("world_size") != world:
            raise ValueError(
                "The checkpoint holds per-rank host state of gradient compression (the error-feedback residual, "
                f"EF-Adafactor's factors) of {state.get('world_size')} ranks, which cannot be re-sharded over "
                f"{world}. Resume with {state.get('world_size')} ranks (`sub_group_size` and `chunk_size` may change)."
            )
        if all((Path(d) / MANIFEST).is_file() for d in rank_dirs):
            return Reshard.of(rank_dirs, layout, rank, world)
        into = scratch.enter_context(scratch_directory("smartinf-saved-state"))
        kept = self.backend.fetch_saved_state(rank_dirs, into)
        source = self.settings.saved_state_from
        if kept is None and source is not None:  # kept on devices of another kind (remote servers for a `cpu` run)
            timeout = self.settings.device_timeout_s
            kept = registry.kind(source["backend"]).fetch_saved_state(source, rank_dirs, into, scratch, timeout=timeout)
        if kept is None:
            for d in rank_dirs:
                require_state_files(Path(d))  # names the directory and says how to resume it
        assert kept is not None
        local_dirs, fetch = kept
        return Reshard.of(local_dirs, layout, rank, world, fetch=fetch)

    def load_residual(self, residual: SavedTensor | None, loss_scale: float | None) -> None:
        """Restore (or, with ``None``, clear) the compression residual saved with a checkpoint, a block at a time."""
        if residual is None:
            self._residual_buffer = None
            return
        buffer = self.partitions.grad_buffer
        if residual.shape != tuple(buffer.shape):
            raise ValueError(
                f"The checkpoint's compression residual has {residual.numel()} elements but this rank's gradient "
                f"partition has {buffer.numel()}. Resume with the same model and ranks."
            )
        target = self._residual_buffer or self._new_residual()
        for start in range(0, residual.numel(), COPY_BLOCK):  # block by block: host memory holds one at a time
            end = min(start + COPY_BLOCK, residual.numel())
            target.tensor[start:end].copy_(residual.read(start, end))
            target.release(start, end)
        self.residual_scale = float(loss_scale) if loss_scale is not None else self.partitions.loss_scale

    def save(self, directory: Path, *, global_step: int) -> None:
        """Write this rank's device state under ``directory`` (:mod:`~lightning_smartinf.core.format.rank_state`)."""
        moments = self.moments.moments if self.moments is not None else None
        tensors = {"residual": self._residual_buffer, "moments": moments}  # the residual is written block by block
        save_device_state(directory, self.backend, self.state_dict(), tensors, global_step=global_step)

    def restore(self, directory: Path, state: dict[str, Any], *, rank_dirs: Sequence[Path] | None = None) -> None:
        """Load the device state saved under ``directory``, whose ``host_state.json`` is ``state``.

        Hand-offs of a backward no step followed are rolled back first; then the devices' state, the host state and
        the residual are replaced, and the parameter partitions are refreshed from the loaded masters.

        ``rank_dirs``: every saved rank's device-state directory, in rank order. With them, a checkpoint saved under
        another layout (number of ranks, ``sub_group_size``, ``chunk_size``) is re-sharded as it loads
        (:mod:`~lightning_smartinf.core.format.reshard`); ``directory`` then only gives the host state, which every
        rank saves alike.
        """
        with contextlib.ExitStack() as scratch:
            reshard = self._reshard(directory, state, rank_dirs, scratch)
            tensors = load_host_tensors(directory, state.get("residual"))
            residual = tensors.get("residual")
            compression = self.settings.compression
            if residual is not None and (compression is None or not compression.error_feedback):
                warnings.warn(
                    "The checkpoint holds an error-feedback residual, but this run does not use error feedback; the "
                    "residual (gradient not yet sent) is dropped.",
                    stacklevel=1,  # `restore`, as the other warnings of a load
                )
                residual = None
            self.discard_early()
            if self.settings.split_masters:  # the load sets the parameters, the other half of the masters
                self.partitions.prepare_for_update()
            if reshard is None:
                self.backend.load(directory)
            else:
                log.info("Re-sharding the device state of %s into this run's layout.", reshard.describe())
                self.backend.load_resharded(reshard)
            self.load_state_dict(state)
            self.load_residual(residual, state.get("residual_loss_scale"))
            if self.moments is not None:
                # Saved under another rule: the moments start again, bias-corrected from their first update.
                saved = tensors.get("moments")
                self.moments.load(None if saved is None else saved.load(), state.get("moment_updates") or 0)
            elif state.get("moment_updates") is not None:
                self._restart_second_moments()
            self.refresh_params()

    def _restart_second_moments(self) -> None:
        """After a resume from ``ef_adafactor``, whose second moment stayed on the host: this run's Adam moments start
        at zero on the devices, so their bias correction starts again too (else the first steps would be up to
        ``1 / sqrt(1 - beta2)`` times too large: 30x at 0.999)."""
        warnings.warn(
            "The checkpoint was trained with compression rule 'ef_adafactor', which kept its second moment on the "
            "host; this run keeps Adam's moments on the devices, so they start again from zero, bias-corrected from "
            "step 1.",
            stacklevel=2,
        )
        for sub_group in self.sub_groups:
            self.group_steps[sub_group.param_group] = 0


class _Speculation:
    """Whether backward hands sub-groups off: a speculation that the step will neither clip nor rescale.

    It is judged after every step that could hand off (whether a hand-off would have stood), and it is on while the
    steps since the last miss are at least :attr:`pause`. Each miss doubles the pause (1, 2, 4, ... up to
    :data:`MAX_PAUSE`), so a run that clips every step misses once, then updates after backward like
    ``overlap_backward=False``; a run that never clips never stops; any other pattern misses at most once per
    ``pause + 1`` steps, a number that only grows.
    """

    def __init__(self) -> None:
        self.pause = 0
        self.held_since_miss = 0

    @property
    def on(self) -> bool:
        return self.held_since_miss >= self.pause

    def judge(self, *, held: bool) -> None:
        if held:
            self.held_since_miss += 1
        else:
            self.held_since_miss = 0
            self.pause = min(MAX_PAUSE, max(1, 2 * self.pause))


class _HandOffs:
    """Which sub-groups backward has completed and handed off, and which of those were reduced again since."""

    def __init__(self, sub_groups: int) -> None:
        # Tentative updates of this backward, by sub-group: (handle, the hyperparameters they used).
        self.early: dict[int, tuple[Handle, StepParams]] = {}
        # Sub-groups whose gradient was reduced again after their hand-off (their update is stale).
        self.stale: set[int] = set()
        # Sub-groups ever found stale: a parameter reduced twice in one backward is so in every backward.
        self.reduced_twice: set[int] = set()
        # The hyperparameters of each param group a hand-off of this backward takes (``None`` until backward
        # completes a sub-group).
        self.taken: list[StepParams] | None = None
        self.reduced_params: list[set[Hashable]] = [set() for _ in range(sub_groups)]
        # Sub-groups with a gradient partition reduced since the last bucket ended.
        self.touched: set[int] = set()
        self.expected: list[set[Hashable]] | None = None
        # `time.perf_counter()` when each sub-group's gradient was first found complete in this backward.
        self.ready_at: dict[int, float] = {}

    def reduced(self, sub_group: int, param: Hashable) -> None:
        if sub_group in self.early:
            self.stale.add(sub_group)
        self.reduced_params[sub_group].add(param)
        self.touched.add(sub_group)

    def ready(self, expected: Callable[[], list[set[Hashable]]]) -> list[int]:
        """Sub-groups of the last bucket not handed off yet whose every expected gradient partition is reduced."""
        touched, self.touched = self.touched, set()
        if not touched:
            return []
        if self.expected is None:
            self.expected = expected()
        complete = sorted(i for i in touched if i not in self.early and self.reduced_params[i] >= self.expected[i])
        now = time.perf_counter()
        for i in complete:
            self.ready_at.setdefault(i, now)
        return complete

    def take(self) -> tuple[dict[int, tuple[Handle, StepParams]], set[int]]:
        """This backward's tentative updates and the stale ones among them; resets the bookkeeping."""
        early, self.early = self.early, {}
        stale, self.stale = self.stale, set()
        self.reduced_twice |= stale
        self.taken = None
        self.ready_at.clear()
        for reduced in self.reduced_params:
            reduced.clear()
        self.touched.clear()
        return early, stale


#: Renamed; the old name still resolves, with a ``DeprecationWarning``.
__getattr__ = old_names(__name__, {"SmartUpdate": "SmartUpdateController"})
