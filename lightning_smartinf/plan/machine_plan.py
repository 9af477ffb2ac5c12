"""Settings for one server of the ``local-nvme`` kind (:class:`~lightning_smartinf.plan.machine.Machine`).

:func:`plan_machine` decides, each with its reason in the report:

1. **16-bit parameters** (``offload_parameters``): on the GPU while they take at most :data:`GPU_PARAMS_SHARE` of its
   memory; else in host RAM where it holds them and their gradients; else on the first storage path (``"storage"``).
2. **Gradient partitions** (``gradient_buffer``): on the GPU where they take at most :data:`GRADIENT_GPU_SHARE` of what
   the parameters leave free (the rule of ``"auto"``), else pinned host memory.
3. **Host RAM for state** (``state_memory_budget``): RAM less a reserve (:data:`HOST_RESERVE_SHARE`, at least
   :data:`HOST_RESERVE_MIN_GB`), the device pools and what step 1 and 2 put there; at most the profile's
   ``state_memory_gb`` and the state itself. The placement over RAM and paths is :func:`~.tiers.place_state`'s.
4. **Overlap and disk space** (``overlap_backward``, ``state_memory_share``): the first of overlap on / off, share
   ``"auto"`` / ``"fill"`` whose disk needs fit every path's free space. Overlap keeps a second copy of the state
   on disk; under ``"auto"`` the measured share may move all of it to the paths, under ``"fill"`` RAM keeps its budget.
5. **Paths**: one per disk; a further path on a disk already used only where the model says it is 5% faster (it adds
   an update thread, not bandwidth). ``sub_group_size``: the largest candidate up to :data:`MACHINE_SUB_GROUP_MAX`
   giving every path and the memory tier 8 sub-groups.

Disk per path: its state (``Workload.state_bytes`` per parameter, 12 B for fp32 Adam; twice with overlap), the 16-bit
parameters and gradient file on the first path with ``"storage"``, and checkpoints where they are written: a checkpoint
copies the whole state (:func:`checkpoint_bytes`: whole masters even when the run splits them, plus the 4 B/param
residual with compression), and saving over one stages the new copy beside it first.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import Any

from lightning_smartinf.core.arguments import MIB
from lightning_smartinf.core.format.layout import pool_bytes
from lightning_smartinf.core.io.storage import GIB, free_bytes
from lightning_smartinf.core.state_formats import FORMATS
from lightning_smartinf.plan.cost_model import (
    FP32_GRAD_BYTES,
    GB,
    LOW_PRECISION_BYTES,
    PARAM_FETCH_BYTES,
    RULES,
    PlanError,
    Profile,
    Workload,
    accumulation_bytes,
    fwd_bwd_time,
    gradient_link_bytes,
    parameter_io,
    zero_infinity,
)
from lightning_smartinf.plan.machine import Machine
from lightning_smartinf.plan.planner import (
    ARGUMENT_COMMENTS,
    ENOUGH,
    PARAMETERS_ON_STORAGE,
    PYTHON_HEADER,
    YAML_HEADER,
    choose_sub_group,
    model_text,
    precision_lines,
    precisions_json,
    python_code,
    size_text,
    sub_groups,
    yaml_code,
)
from lightning_smartinf.plan.tier_placement import TierPlacement, place_state

__all__ = ["MachinePlan", "PathSpace", "format_machine_plan", "machine_json", "plan_machine"]

#: Host RAM left to everything else (OS, data loaders, Python, pinned staging): this share, at least the minimum.
HOST_RESERVE_SHARE = 0.10
HOST_RESERVE_MIN_GB = 16.0
#: The 16-bit parameters stay on the GPU while they take at most this share of its memory: forward and backward
#: (activations, workspace, the gathered layer) need the rest.
GPU_PARAMS_SHARE = 0.5
#: ``gradient_buffer="auto"`` keeps the gradients on the GPU where they take at most this share of its free memory
#: (``AUTO_ACCELERATOR_SHARE`` of ``zero/gradient_buffer.py``: the planner imports no ZeRO; a test keeps them equal).
GRADIENT_GPU_SHARE = 0.25
#: The share when a step accumulates micro-batches (``AUTO_ACCUMULATING_SHARE``, kept equal the same way): in host
#: memory each micro-batch after the first takes the fp32 partitions across the link and back.
GRADIENT_ACCUMULATING_SHARE = 2 / 3
#: A device streams 1M-element chunks whatever the sub-group; larger sub-groups only coarsen the memory tier's share
#: and the hand-offs during backward (and ZeRO's reduce bucket, one sub-group with ``overlap_backward``).
MACHINE_SUB_GROUP_MAX = 100_000_000
#: The strategy's defaults the plan keeps: chunk buffers per device and elements per chunk.
BUFFER_COUNT = 16
CHUNK_ELEMS = 1 << 20
#: Paths whose state bandwidths differ by more than this factor get ``device_weights``.
WEIGHTS_SPREAD = 1.10


@dataclass(frozen=True)
class PathSpace:
    """Disk space one path needs (bytes): state, parameters and checkpoints, against its free space."""

    path: str
    #: State with the plan's placement (both copies with ``overlap_backward``).
    planned_bytes: float
    #: State if the memory tier keeps only what it is sure to hold (``"auto"``: nothing; ``"fill"``: its budget).
    at_most_bytes: float
    #: 16-bit parameters and the gradient file (``offload_parameters="storage"``, first path).
    parameter_bytes: float
    #: Checkpoints written here: those kept, plus the one being saved.
    checkpoint_bytes: float
    free_bytes: float | None

    @property
    def needed_bytes(self) -> float:
        return self.at_most_bytes + self.parameter_bytes + self.checkpoint_bytes

    @property
    def fits(self) -> bool | None:
        """Whether the path has room (``None``: its free space is unknown)."""
        return None if self.free_bytes is None else self.needed_bytes <= self.free_bytes


@dataclass(frozen=True)
class MachinePlan:
    work: Workload
    machine: Machine
    paths: tuple[int, ...]  # indices into machine.storage
    profile: Profile  # the model's view of the machine with these paths
    sub_group_size: int
    memory_budget: int  # bytes of host RAM for state; 0: none
    fill: bool  # state_memory_share="fill"
    offload_parameters: bool | str
    gradient_buffer: str | None  # None without a GPU
    overlap_backward: bool
    compression: float | None
    device_weights: tuple[float, ...] | None
    accelerator_budget: int
    placement: TierPlacement
    fwd_bwd_s: float
    param_write_s: float
    all_on_disk_s: float  # the step with no state_memory_budget
    zero_infinity_s: float  # DeepSpeed ZeRO-Infinity, state on the same paths (the model's baseline)
    space: tuple[PathSpace, ...]
    host_memory: dict[str, float]  # what host RAM holds besides the state, bytes
    gpu_memory: dict[str, float]
    reasons: dict[str, str]
    checkpoint_dir: str
    keep_checkpoints: int
    #: Each ``state_precision``'s state bytes and step seconds on the same paths, the rest planned alike.
    precisions: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return self.fwd_bwd_s + self.placement.update_s + self.param_write_s

    @property
    def fits(self) -> bool:
        return all(s.fits is not False for s in self.space)

    @property
    def checkpoint_bytes(self) -> float:
        return checkpoint_bytes(self.work, self.compression)

    def strategy_args(self) -> dict[str, Any]:
        """Every ``SmartInfinityStrategy`` argument the plan decided, as its snippets print them."""
        work = self.work
        args = {
            "storage_paths": [self.machine.storage[i].path for i in self.paths],
            "sub_group_size": self.sub_group_size,
            "buffer_count": BUFFER_COUNT,
            "device_weights": None if self.device_weights is None else list(self.device_weights),
            "state_memory_budget": size_text(self.memory_budget) if self.memory_budget else None,
            "state_memory_share": "fill" if self.fill else None,
            "state_accelerator_budget": size_text(self.accelerator_budget) if self.accelerator_budget else None,
            "offload_parameters": self.offload_parameters,
            "gradient_buffer": self.gradient_buffer,
            "compression": self.compression,
            "overlap_backward": self.overlap_backward,
            "state_precision": None if work.state_precision == "fp32" else work.state_precision,
            "split_masters": True if work.split_masters else None,
        }
        return {name: value for name, value in args.items() if value is not None}  # None: left out


def plan_machine(
    work: Workload,
    machine: Machine,
    *,
    devices: int | None = None,
    memory_budget: int | None = None,
    accelerator_budget: int = 0,
    compression: float | None = None,
    params_on_storage: bool = False,
    device_weights: list[float] | None = None,
    checkpoint_dir: str | None = None,
    keep_checkpoints: int = 1,
) -> MachinePlan:
    """The settings for training ``work`` on ``machine`` (see the module's docstring for the rules).

    ``devices``: use the first ``devices`` paths of :meth:`Machine.path_order` (default: the planner's choice);
    ``memory_budget``, ``accelerator_budget`` (bytes), ``compression`` and ``device_weights``: as asked instead of
    chosen; ``checkpoint_dir``: where checkpoints go (default: the first path), ``keep_checkpoints`` of them.
    """
    order = machine.path_order()
    if devices is not None and not 1 <= devices <= len(order):
        raise PlanError(
            f"`--devices {devices}`: profile {machine.name!r} has {len(order)} storage path(s). Pass 1 to "
            f"{len(order)}, or leave it out to let the planner choose."
        )
    if compression is not None and not 0 < compression <= 1:
        raise PlanError(f"`--compression {compression}` must be in (0, 1]: the fraction of gradient elements kept.")
    work = work.compressed(compression)  # the rule the strategy runs: its state, traffic and update
    if keep_checkpoints < 0:
        raise PlanError(f"`--keep-checkpoints {keep_checkpoints}` must be >= 0 (0: none on these disks).")
    # The devices' shares are the weights over their sum: finite and > 0 each, or the sum is 0, inf or NaN.
    if device_weights is not None and not all(0 < w < math.inf for w in device_weights):
        raise PlanError(
            f"`--device-weights {' '.join(f'{w:g}' for w in device_weights)}`: each weight must be a finite number "
            "> 0 (a device's speed relative to the others')."
        )
    if accelerator_budget and machine.gpu is None:
        raise PlanError(
            f"`--accelerator-budget` keeps state in GPU memory, but profile {machine.name!r} has no GPU (`gpu: null`). "
            "Drop it, or describe the GPU in the profile."
        )
    disks = len({machine.disk_of(i) for i in order})
    counts = [devices] if devices is not None else list(range(disks, len(order) + 1))
    asked = {
        "memory_budget": memory_budget,
        "accelerator_budget": accelerator_budget,
        "compression": compression,
        "params_on_storage": params_on_storage,
        "device_weights": device_weights,
        "checkpoint_dir": checkpoint_dir,
        "keep_checkpoints": keep_checkpoints,
    }
    plans = [_plan_paths(work, machine, tuple(order[:n]), **asked) for n in counts]
    best = min(p.total_s for p in plans)
    chosen = next(p for p in plans if p.total_s <= best * ENOUGH)
    if devices is not None:
        reason = "as asked (--devices)"
    elif len(chosen.paths) > disks:
        reason = (
            f"one per disk, and {len(chosen.paths) - disks} more on a disk already used: one more update thread is "
            f">= {int((ENOUGH - 1) * 100)}% faster"
        )
    elif len(order) > disks:
        reason = "one per disk (a second path on a disk adds no bandwidth)"
    else:
        reason = "one per disk"
    precisions: dict[str, tuple[float, float]] = {}
    for name in FORMATS:
        alike = _plan_paths(replace(work, state_precision=name), machine, chosen.paths, **asked)
        precisions[name] = (alike.work.state_bytes * work.params, alike.total_s)
    return replace(chosen, reasons={**chosen.reasons, "storage_paths": reason}, precisions=precisions)


@dataclass(frozen=True)
class _ModelPlacement:
    """Where the 16-bit parameters and the gradient partitions live, and what they take of host RAM and the GPU."""

    offload_parameters: bool | str
    gradient_buffer: str | None
    #: Bytes on the first path: with ``offload_parameters="storage"`` the 16-bit parameters, and the gradients where
    #: they are not on the GPU (a file beside them).
    path_bytes: float
    host: dict[str, float]
    gpu: dict[str, float]
    reasons: dict[str, str]


def _place_model(
    work: Workload, machine: Machine, devices: int, compression: float | None, params_on_storage: bool, accelerator: int
) -> _ModelPlacement:
    """Steps 1 and 2: the 16-bit parameters, then the gradient partitions."""
    gpu, p16 = machine.gpu, LOW_PRECISION_BYTES * work.params
    residual = FP32_GRAD_BYTES * work.params if compression is not None else 0
    summed = accumulation_bytes(work.accumulate, compression) * work.params  # the gradient partitions' buffer
    gpu_bytes, ram = (gpu.memory_gb * GB if gpu else 0.0), machine.host_memory_gb * GB
    host = {
        "reserve": max(HOST_RESERVE_MIN_GB * GB, HOST_RESERVE_SHARE * ram),
        "device pools": pool_bytes(devices, BUFFER_COUNT, CHUNK_ELEMS),  # fp32 records: the most a format pools
    }
    reasons: dict[str, str] = {}
    offload: bool | str
    if work.split_masters:
        if params_on_storage:
            raise PlanError(
                "`--split-masters` keeps half of each master in the 16-bit parameters in host memory; "
                "`--params-on-storage` puts them on storage. Drop one of them."
            )
        # The parameters of the sub-groups updated during backward are set aside until the step keeps them.
        host["16-bit parameters set aside during backward (split masters)"] = p16
    if params_on_storage:
        offload, reasons["offload_parameters"] = "storage", "as asked (--params-on-storage)"
    elif gpu and p16 <= GPU_PARAMS_SHARE * gpu_bytes and not work.split_masters:
        offload = False
        reasons["offload_parameters"] = (
            f"the 16-bit parameters ({p16 / GB:.1f} GB) take {p16 / gpu_bytes:.0%} of the GPU's {gpu.memory_gb:g} GB: "
            "they stay there, and forward and backward fetch nothing over PCIe"
        )
    elif ram - sum(host.values()) >= p16 + summed + residual:
        offload = bool(gpu)  # without a GPU, "on the accelerator" is host memory too
        if not gpu:
            where = "CPU training"
        elif work.split_masters:
            where = "split masters keep half of each master in them"
        else:
            where = "more than half the GPU's memory"
        reasons["offload_parameters"] = (
            f"{where}: host RAM holds the 16-bit parameters and their gradients ({(p16 + summed) / GB:.1f} GB)"
        )
    elif work.split_masters:
        raise PlanError(
            f"`--split-masters` keeps half of each master in the 16-bit parameters in host memory, but host RAM does "
            f"not hold them and their gradients ({(p16 + summed) / GB:.1f} GB beside the rest): plan without it."
        )
    else:
        offload = "storage"
        reasons["offload_parameters"] = (
            f"neither {'the GPU nor ' if gpu else ''}host RAM holds the 16-bit parameters and their gradients "
            f"({(p16 + summed) / GB:.1f} GB): they live on the first path, read a layer ahead"
        )
    gradient_buffer: str | None = None
    on_gpu: dict[str, float] = {}
    gradients = ("fp32 " if summed > p16 else "") + "gradient partitions" + (" and residual" if residual else "")
    if gpu:
        free = gpu_bytes - (p16 if offload is False else 0)
        share = GRADIENT_ACCUMULATING_SHARE if work.accumulate > 1 else GRADIENT_GPU_SHARE
        gradient_buffer = "accelerator" if summed + residual <= share * free else "host"
        accumulating = f" with {work.accumulate} micro-batches a step" if work.accumulate > 1 else ""
        reasons["gradient_buffer"] = (
            f"the {gradients} ({(summed + residual) / GB:.1f} GB) take {(summed + residual) / free:.0%} of the "
            f"{free / GB:.1f} GB of GPU memory the parameters leave "
            + (
                f"(at most {share:.0%}{accumulating}): the GPU keeps them, and only what the devices read crosses"
                if gradient_buffer == "accelerator"
                else f"(more than {share:.0%}{accumulating}): pinned host memory keeps them"
                + (", and each micro-batch after a step's first takes them over PCIe and back" if accumulating else "")
            )
        )
        if offload is False:
            on_gpu["16-bit parameters"] = p16
        if gradient_buffer == "accelerator":
            on_gpu[gradients] = summed + residual
        if accelerator:
            on_gpu["optimizer state (state_accelerator_budget)"] = min(accelerator, work.state_bytes * work.params)
        on_gpu["left for forward and backward"] = gpu_bytes - sum(on_gpu.values())
    if offload is True or (offload is False and not gpu):
        host["16-bit parameters"] = p16
    gradient_file = offload == "storage" and gradient_buffer != "accelerator"
    if gradient_buffer != "accelerator" and not gradient_file:
        host[gradients] = summed + residual
    on_path = p16 + (summed + residual if gradient_file else 0.0) if offload == "storage" else 0.0
    return _ModelPlacement(offload, gradient_buffer, on_path, host, on_gpu, reasons)


def _state_budget(machine: Machine, model: _ModelPlacement, whole: float, asked: int | None) -> tuple[int, str]:
    """Step 3: bytes of host RAM for the state (``whole`` bytes of it outside the GPU), and why."""
    free = max(0.0, machine.host_memory_gb * GB - sum(model.host.values()))
    cap = free if machine.state_memory_gb is None else min(free, machine.state_memory_gb * GB)
    capped = f" (the profile's state_memory_gb caps it at {machine.state_memory_gb:g} GB)" if cap < free else ""
    if asked is not None:
        beyond = f"; more than the {free / GB:.1f} GB of RAM the plan leaves free" if asked > free else ""
        return asked, f"as asked (--memory-budget){beyond}"
    if whole and cap >= 1.01 * whole:  # 1%: each sub-group's last chunk is padded
        budget = min(_round(1.01 * whole, up=True), int(cap))
        return budget, f"the whole state ({whole / GB:.1f} GB) fits in the {cap / GB:.1f} GB of RAM the run leaves free"
    if whole and cap >= GIB:
        return _round(cap, up=False), (
            f"the {cap / GB:.1f} GB of RAM the run leaves free hold {cap / whole:.0%} of the state "
            f"({whole / GB:.1f} GB){capped}"
        )
    return (
        0,
        "nothing to keep" if not whole else f"the run leaves {cap / GB:.1f} GB of RAM free: none for state{capped}",
    )


def checkpoint_bytes(work: Workload, compression: float | None) -> float:
    """One checkpoint: the whole state, with whole masters whether or not the run splits them (and the error-feedback
    residual with compression)."""
    saved = replace(work, split_masters=False).state_bytes
    return (saved + (FP32_GRAD_BYTES if compression is not None else 0)) * work.params


def _fwd_bwd(work: Workload, prof: Profile, model: _ModelPlacement, compression: float | None) -> tuple[float, float]:
    """Forward and backward with the GPU <-> host copies the settings make, and the parameters' writes after the step
    (``offload_parameters="storage"``)."""
    if prof.gpu_peak_tflops is None:
        fwd_bwd = fwd_bwd_time(work, prof)
    else:
        assert model.gradient_buffer is not None, "a machine with a GPU places the gradient partitions"
        gradient_link = gradient_link_bytes(model.gradient_buffer, compression=compression, accumulate=work.accumulate)
        # Parameters on the GPU take the updated ones back once (2 B); elsewhere ZeRO-3 fetches them for forward and
        # backward of every micro-batch (4 B each).
        fetched = model.offload_parameters is not False
        parameter_link = PARAM_FETCH_BYTES * work.accumulate if fetched else LOW_PRECISION_BYTES
        fwd_bwd = fwd_bwd_time(work, prof, parameter_link + gradient_link)
    fwd_bwd, param_write, _, _ = parameter_io(work, prof, fwd_bwd, model.offload_parameters == "storage")
    return fwd_bwd, param_write


def _plan_paths(
    work: Workload,
    machine: Machine,
    paths: tuple[int, ...],
    *,
    memory_budget: int | None,
    accelerator_budget: int,
    compression: float | None,
    params_on_storage: bool,
    device_weights: list[float] | None,
    checkpoint_dir: str | None,
    keep_checkpoints: int,
) -> MachinePlan:
    prof, n = machine.to_profile(paths, fused=work.fused), len(paths)
    state = work.state_bytes * work.params
    model = _place_model(work, machine, n, compression, params_on_storage, accelerator_budget)
    whole = state - min(accelerator_budget, state)
    budget, budget_reason = _state_budget(machine, model, whole, memory_budget)
    reasons = {**model.reasons, "state_memory_budget": budget_reason}
    fwd_bwd, param_write = _fwd_bwd(work, prof, model, compression)
    rates = machine.path_rates(paths)
    weights = tuple(device_weights) if device_weights is not None else None
    if weights is None and max(rates) > WEIGHTS_SPREAD * min(rates):
        weights = tuple(round(r / max(rates), 2) for r in rates)
    share = [w / sum(weights or [1.0] * n) for w in weights or [1.0] * n]
    checkpoint_dir = checkpoint_dir or machine.storage[paths[0]].path
    checkpoint = (keep_checkpoints + 1) * checkpoint_bytes(work, compression) if keep_checkpoints else 0.0

    # Step 4: overlap first (dense gradients only), then "fill" (without a GPU "auto" fills the budget already).
    overlaps = (True, False) if compression is None else (False,)
    for overlap, fill in [(o, f) for o in overlaps for f in (False, True) if not f or (budget and machine.gpu)]:
        placement = place_state(
            work, prof, n, budget, weights, accelerator_budget, fill=fill, overlap_backward=overlap, fwd_bwd_s=fwd_bwd
        )
        kept = min(budget, whole) if fill or not machine.gpu else 0.0
        copies = 2 if overlap else 1
        space = [
            PathSpace(
                path=machine.storage[i].path,
                planned_bytes=copies * placement.device_bytes[j],
                at_most_bytes=copies * (whole - kept) * share[j],
                parameter_bytes=model.path_bytes if j == 0 else 0.0,
                checkpoint_bytes=checkpoint if _inside(checkpoint_dir, machine.storage[i].path) else 0.0,
                free_bytes=_free(machine, i),
            )
            for j, i in enumerate(paths)
        ]
        if checkpoint and not any(_inside(checkpoint_dir, s.path) for s in space):
            space.append(PathSpace(checkpoint_dir, 0.0, 0.0, 0.0, checkpoint, free_bytes(checkpoint_dir)))
        if all(s.fits is not False for s in space):
            break
    if overlap:
        reasons["overlap_backward"] = (
            "devices start each sub-group's update as backward completes its gradient, "
            + ("on host cores the GPU leaves free" if machine.gpu else "on the cores backward shares with them")
            + "; a second copy of their state on the paths"
        )
    elif compression is not None:
        reasons["overlap_backward"] = "compressed gradients reach the devices after backward"
    else:
        reasons["overlap_backward"] = "two copies of the state would not fit on the paths: updates start after backward"
    if fill:
        reasons["state_memory_share"] = (
            "RAM keeps its whole budget, so the paths hold only the rest (a measured share may move all of it there, "
            "which does not fit)"
        )
    all_on_disk = place_state(
        work, prof, n, 0, weights, accelerator_budget, overlap_backward=overlap, fwd_bwd_s=fwd_bwd
    )
    return MachinePlan(
        work=work,
        machine=machine,
        paths=paths,
        profile=prof,
        sub_group_size=choose_sub_group(work, prof, n + (budget > 0), largest=MACHINE_SUB_GROUP_MAX),
        memory_budget=budget,
        fill=fill,
        offload_parameters=model.offload_parameters,
        gradient_buffer=model.gradient_buffer,
        overlap_backward=overlap,
        compression=compression,
        device_weights=weights,
        accelerator_budget=accelerator_budget,
        placement=placement,
        fwd_bwd_s=fwd_bwd,
        param_write_s=param_write,
        all_on_disk_s=fwd_bwd + all_on_disk.update_s + param_write,
        zero_infinity_s=zero_infinity(work, prof, n, params_on_storage=model.offload_parameters == "storage").total,
        space=tuple(space),
        host_memory=model.host,
        gpu_memory=model.gpu,
        reasons=reasons,
        checkpoint_dir=checkpoint_dir,
        keep_checkpoints=keep_checkpoints,
    )


def _round(nbytes: float, *, up: bool) -> int:
    """``nbytes`` rounded to whole GiB (whole MiB below 10 GiB), up or down."""
    unit = GIB if nbytes >= 10 * GIB else MIB
    return int((math.ceil if up else math.floor)(nbytes / unit)) * unit


def _inside(directory: str, path: str) -> bool:
    directory, path = os.path.normpath(directory), os.path.normpath(path)
    return directory == path or directory.startswith(path.rstrip("/") + "/")


def _free(machine: Machine, index: int) -> float | None:
    """Path ``index``'s free space: as described, else as it is here (when it exists here), else unknown."""
    described = machine.storage[index].free_gb
    if described is not None:
        return described * GB
    return free_bytes(machine.storage[index].path) if os.path.exists(machine.storage[index].path) else None


# ---------------------------------------------------------------------------------------------------- report


def _comments(plan: MachinePlan) -> dict[str, str]:
    offload = {
        False: "16-bit parameters stay in GPU memory" if plan.machine.gpu else "16-bit parameters in host memory",
        True: "16-bit parameters in pinned host memory, fetched for forward and backward",
        "storage": PARAMETERS_ON_STORAGE,
    }[plan.offload_parameters]
    return {
        **ARGUMENT_COMMENTS,
        "storage_paths": "one directory per path (device): the state is spread over them",
        "device_weights": "relative state bandwidth of each path: sub-groups are shared out in proportion",
        "state_memory_share": "RAM keeps its whole budget; the paths hold only the rest",
        "offload_parameters": offload,
        "gradient_buffer": "where the reduced gradient partitions wait for the devices",
        "compression": f"SmartComp: send the largest {(plan.compression or 0) * 100:g}% of each sub-group's gradient",
        "overlap_backward": (
            "devices update during backward (a second copy of the state on disk)"
            if plan.overlap_backward
            else "updates start after backward"
            + (" (compressed gradients)" if plan.compression is not None else " (one copy of the state on disk)")
        ),
    }


def _gb(nbytes: float | None) -> str:
    return "?" if nbytes is None else f"{nbytes / GB:.1f}"


def _sub_groups_text(plan: MachinePlan) -> str:
    """How many sub-groups the plan's ``sub_group_size`` makes, and whether each holder of state gets 8 or more."""
    groups, holders = sub_groups(plan.work, plan.sub_group_size), len(plan.paths) + (plan.memory_budget > 0)
    if groups >= 8 * holders:
        return f"{groups} sub-groups; at most {MACHINE_SUB_GROUP_MAX:,}, >= 8 per path and for the memory tier"
    return f"{groups} sub-group(s) for {holders} holder(s) of state: the model is too small for 8 each"


def format_machine_plan(plan: MachinePlan, python_header: str = PYTHON_HEADER, yaml_header: str = YAML_HEADER) -> str:
    """The report: the machine, the step, each setting with its reason, disk per path, and both snippets."""
    w, m, placed = plan.work, plan.machine, plan.placement
    gpu = (
        f"{m.gpu.name} ({m.gpu.memory_gb:g} GB, host link {m.gpu.link_gbps:g} GB/s, {m.gpu.peak_tflops:g} TFLOPS)"
        if m.gpu
        else "no GPU (CPU training)"
    )
    lines = [
        model_text(w),
        f"machine: {m.name} ({m.kind}, cpu backend): {gpu}; {m.host_memory_gb:g} GB RAM",
        "storage paths (GB/s alone; read+write = reads and writes at once, as training streams state):",
    ]
    width = max(len(p.path) for p in m.storage)
    for i, p in enumerate(m.storage):
        used = "" if i in plan.paths else "  (not used)"
        lines.append(
            f"  {p.path:<{width}}  read {p.read_gbps:.2f}, write {p.write_gbps:.2f}, read+write {p.state_gbps:.2f}; "
            f"disk {m.disk_of(i)}; {_gb(_free(m, i))} GB free{used}"
        )
    lines.append(f"  the {len(plan.paths)} path(s) used, together: {m.aggregate_gbps(plan.paths):.2f} GB/s read+write")
    if (swing := m.disk_swing()) is not None:
        start, end = swing
        lines += [
            f"  note: the paths' rate at once moved from {start:.2f} to {end:.2f} GB/s ({end / start - 1:+.0%}) "
            "while calibrating (the plan takes their mean):",
            "        a step the disk bounds may move as much; calibrate again near the run",
        ]
    base = plan.all_on_disk_s
    lines += [
        "",
        f"{'step (s)':<44}{'fwd/bwd':>8}{'update':>8}{'params':>8}{'total':>8}{'vs':>8}",
        f"{'this plan':<44}{plan.fwd_bwd_s:>8.2f}{placed.update_s:>8.2f}{plan.param_write_s:>8.2f}"
        f"{plan.total_s:>8.2f}{base / plan.total_s:>7.2f}x",
        f"{'all state on the paths (no memory budget)':<44}{plan.fwd_bwd_s:>8.2f}"
        f"{base - plan.fwd_bwd_s - plan.param_write_s:>8.2f}{plan.param_write_s:>8.2f}{base:>8.2f}{1:>7.2f}x",
        f"{'ZeRO-Infinity, state on the same paths':<44}{'':>32}{plan.zero_infinity_s:>8.2f}"
        f"{base / plan.zero_infinity_s:>7.2f}x",
        "('update' runs after backward: the part the devices do during backward is hidden in fwd/bwd"
        + (", except what sharing the CPU's cores adds to backward, counted here" if placed.shared_cores_s else "")
        + "; 'params' writes the 16-bit parameters to storage)",
        f"tokens per second (at most {w.step_tokens:,} a step): this plan {w.step_tokens / plan.total_s:,.0f}, "
        f"ZeRO-Infinity {w.step_tokens / plan.zero_infinity_s:,.0f}",
        *(
            [
                "(no GPU and no `cpu_training_tflops` in the profile: forward and backward's FLOPs are not modelled; "
                "`smartinf plan --calibrate` measures the rate)"
            ]
            if not m.gpu and m.cpu_training_tflops is None
            else []
        ),
        *precision_lines(plan.precisions, w.state_precision, "this plan"),
        "",
        "recommendation:",
        f"  storage_paths: {', '.join(m.storage[i].path for i in plan.paths)}: {plan.reasons['storage_paths']}",
        f"  sub_group_size: {plan.sub_group_size:,} elements ({_sub_groups_text(plan)})",
    ]
    if plan.device_weights is not None:
        lines.append(f"  device_weights: {list(plan.device_weights)}: the paths' state bandwidths differ")
    budget = size_text(plan.memory_budget) if plan.memory_budget else "none"
    lines.append(f"  state_memory_budget: {budget}: {plan.reasons['state_memory_budget']}")
    accelerator = size_text(plan.accelerator_budget) if plan.accelerator_budget else None
    lines.append(f"    {placed.describe(budget, accelerator)}")
    if plan.fill:
        lines.append(f"  state_memory_share: fill: {plan.reasons['state_memory_share']}")
    lines.append(f"  offload_parameters: {plan.offload_parameters}: {plan.reasons['offload_parameters']}")
    if plan.gradient_buffer is not None:
        lines.append(f"  gradient_buffer: {plan.gradient_buffer}: {plan.reasons['gradient_buffer']}")
    if plan.compression is not None:
        lines.append(f"  compression: keep {plan.compression:g} of gradient elements (as asked); costs accuracy")
    lines.append(f"  overlap_backward: {plan.overlap_backward}: {plan.reasons['overlap_backward']}")
    lines.append(
        "  host RAM besides the state: "
        + ", ".join(f"{name} {nbytes / GB:.1f} GB" for name, nbytes in plan.host_memory.items())
        + f" (reserve: {HOST_RESERVE_SHARE:.0%} of RAM, at least {HOST_RESERVE_MIN_GB:g} GB)"
    )
    if plan.gpu_memory:
        lines.append(
            "  GPU memory: " + ", ".join(f"{name} {nbytes / GB:.1f} GB" for name, nbytes in plan.gpu_memory.items())
        )
    lines += _disk_table(plan)
    args, comments = plan.strategy_args(), _comments(plan)
    lines += ["", python_header, "", python_code(args, comments), "", yaml_header, "", yaml_code(args, comments)]
    return "\n".join(lines)


def _disk_table(plan: MachinePlan) -> list[str]:
    precision = plan.work.state_precision
    states = RULES[plan.work.rule].state_names
    moments = ", ".join(states) + (f" in {precision}" if precision != "fp32" and states else "")
    moments = {"adam": moments, "ef_adam": f"{moments} (EF-Adam)", "ef_adafactor": "no moments (EF-Adafactor)"}[
        plan.work.rule
    ]
    master = "split master (2.125 B)" if plan.work.split_masters else "fp32 master"
    per = f"{master}, {moments}" + (", x2 with overlap_backward" if plan.overlap_backward else "")
    width = max(12, *(len(s.path) for s in plan.space))
    lines = [
        "",
        f"disk (GB; state: {plan.work.state_bytes:.3g} B/param, {per}):",
        f"  {'path':<{width}}{'planned':>9}{'at most':>9}{'params':>8}{'ckpts':>8}{'needed':>9}{'free':>9}",
    ]
    for s in plan.space:
        verdict = {True: "ok", False: "DOES NOT FIT", None: "free space unknown"}[s.fits]
        lines.append(
            f"  {s.path:<{width}}{_gb(s.planned_bytes):>9}{_gb(s.at_most_bytes):>9}{_gb(s.parameter_bytes):>8}"
            f"{_gb(s.checkpoint_bytes):>8}{_gb(s.needed_bytes):>9}{_gb(s.free_bytes):>9}  {verdict}"
        )
    at_most = (
        "RAM keeps its budget (state_memory_share='fill' or CPU training)"
        if plan.fill or not plan.machine.gpu
        else "the measured share may move all of the state to the paths"
    )
    lines.append(f"  'at most': {at_most}; 'needed' counts it.")
    if plan.keep_checkpoints:
        lines.append(
            f"  checkpoints in {plan.checkpoint_dir} (--checkpoint-dir): each copies the whole state, "
            f"{_gb(plan.checkpoint_bytes)} GB; "
            f"{plan.keep_checkpoints} kept (--keep-checkpoints) plus the one being saved, which is staged beside it"
        )
    if not plan.fits:
        lines.append(
            "  Too little space: add storage paths, raise state_memory_budget with state_memory_share='fill', write "
            "checkpoints elsewhere (--checkpoint-dir), or keep fewer (--keep-checkpoints)."
        )
    return lines


def machine_json(plan: MachinePlan) -> dict[str, Any]:
    """The plan as a JSON object (``smartinf plan --json``)."""
    return {
        "params": plan.work.params,
        "profile": plan.machine.name,
        "kind": plan.machine.kind,
        "storage_paths": [plan.machine.storage[i].path for i in plan.paths],
        "step": {
            "fwd_bwd": plan.fwd_bwd_s,
            "update": plan.placement.update_s,
            "param_write": plan.param_write_s,
            "total": plan.total_s,
            "all_state_on_paths": plan.all_on_disk_s,
            "zero_infinity": plan.zero_infinity_s,
            "tokens": plan.work.step_tokens,
            "tokens_per_s": plan.work.step_tokens / plan.total_s,
            "zero_infinity_tokens_per_s": plan.work.step_tokens / plan.zero_infinity_s,
        },
        "sub_group_size": plan.sub_group_size,
        "buffer_count": BUFFER_COUNT,
        "memory_budget_bytes": plan.memory_budget,
        "placement": plan.placement.__dict__,
        "host_memory_bytes": plan.host_memory,
        "gpu_memory_bytes": plan.gpu_memory,
        "disk": [{**s.__dict__, "needed_bytes": s.needed_bytes, "fits": s.fits} for s in plan.space],
        "fits": plan.fits,
        "reasons": plan.reasons,
        "state_precision": precisions_json(plan.precisions),
        "strategy": plan.strategy_args(),
    }
