"""Analytic model of one training iteration under ZeRO-Infinity and Smart-Infinity (SU, SU+O, SU+O+C).

Arithmetic only: no tensors, no DeepSpeed, no Lightning. Units: bytes, seconds, parameters; bandwidths in GB/s
(1e9 B/s) in profiles.

Per iteration, for ``P`` trainable parameters, ``N`` storage devices (``docs/planner.md`` has the derivation):

* GPU:  ``T_fb = k·P·tokens / (peak·eff) + x·P / gpu_link``  (``k`` = 8 with activation recompute; ``x`` the
  GPU <-> host bytes per parameter that method's code copies, :func:`gpu_link_bytes`: ZeRO-3's parameter fetches
  for forward and backward, then the gradient).
* ZeRO-Infinity (RAID-0, host update), read ``16P`` (fp32 master, m, v, grad) and write ``16P`` at
  ``min(N·b_ssd, raid ceiling)``, host update at ``baseline_update`` param/s (DeepSpeed's CPU-Adam; unset:
  ``host_update``), serialised (DeepSpeed's default).
* SmartUpdate (SU): the shared link carries ``t·P`` gradient down (written to each device's SSD) and ``t·P``
  updated parameters up (``t`` = ``transfer_bytes``: 2 here, 4 in the paper); each device reads ``12 + t`` B
  (state + gradient) and writes ``12`` B per own parameter at its own SSD's bandwidth, and updates at
  ``device_update`` param/s; all devices in parallel, steps serialised.
* SU+O: the transfer handler overlaps the update with the storage traffic: ``max(storage, update)`` per
  device plus one sub-group of pipeline fill.
* Remote device servers (a profile with ``network_gbps``): gradients and parameters cross the network instead of
  the shared link, not staged on an SSD, plus one round trip per sub-group and step, four calls in flight.
* SU+O+C: the gradient shrinks to ``c·(t + 4)`` (value + int32 index) bytes per parameter on the link and on the SSD, at
  the cost of the top-k selection on the GPU. With ``gradient_buffer="accelerator"`` only the pairs cross to the
  host; with ``"host"`` (ZeRO's pinned buffer, and the paper's released code) the gradient crosses and comes back.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

from lightning_smartinf.core.arguments import Problems
from lightning_smartinf.core.compression import TopKCompression, compressed_rule
from lightning_smartinf.core.rules import Adam, EFAdafactor, EFAdam, UpdateRule
from lightning_smartinf.core.state_formats import FORMATS, state_format

GB = 1e9

#: Bytes per parameter per step of each traffic class (Adam, fp32 master/m/v, fp16/bf16 model).
FP32_STATE_BYTES = 12  # master + exp_avg + exp_avg_sq
LOW_PRECISION_BYTES = 2  # fp16/bf16 gradient or parameter
FP32_GRAD_BYTES = 4
COMPRESSED_INDEX_BYTES = 4  # int32 position inside the sub-group
#: ZeRO-3 with parameters offloaded to host memory fetches each 16-bit parameter to the GPU twice per step.
PARAM_FETCH_BYTES = 2 * LOW_PRECISION_BYTES
GRADIENT_BUFFERS = ("accelerator", "host")
#: Each ``state_precision``'s update time per element relative to fp32's (the ``cpu`` backend's AdamW as users build
#: it: fp32 by torch's ops, bf16 and int8 by the C kernels that fuse it with the format; measured with
#: ``benchmarks/bench_state_formats.py`` on a 2-core Intel Xeon, one thread, ``docs/state-formats-native-adam.json``).
#: A calibrated machine measures its own.
UPDATE_COST_BY_PRECISION = {"fp32": 1.0, "bf16": 0.51, "int8": 0.99}
#: Calls a remote device server serves at once for one session (``MAX_UPDATES_IN_FLIGHT`` of the remote wire protocol).
REMOTE_CALLS_IN_FLIGHT = 4

METHODS = ("zero_infinity", "su", "su_o", "su_o_c")
#: The most devices a plan is made for (``--devices``, a profile's ``max_devices``): more storage devices or servers
#: than one trainer attaches, and the planner compares every count from 1 up to the one asked (in time that grows
#: with its square: 1024 takes 0.03 s, 100000 two minutes).
MAX_DEVICES = 1024


#: The update rules the devices run for AdamW, by name: its own, and those top-k compression runs for it (EF-Adam,
#: whose error-feedback residual carries the first moment; EF-Adafactor, whose second moment the host keeps).
RULES: dict[str, UpdateRule] = {
    rule.name: rule for rule in (Adam(decoupled_weight_decay=True), EFAdam(decoupled_weight_decay=True), EFAdafactor())
}


def state_bytes_per_param(state_precision: str = "fp32", *, split_masters: bool = False, rule: str = "adam") -> float:
    """Bytes per parameter of the state on a device in ``state_precision``: the fp32 master and the states of
    ``rule`` (Adam's two moments: 12 in fp32, 8 in bf16, about 6.03 in int8; EF-Adam's one: 8 in fp32), 1.875 fewer
    with ``split_masters``. Read and written once each per step."""
    return state_format(state_precision).bytes_per_element(len(RULES[rule].state_names), split=split_masters)


class PlanError(ValueError):
    """A user input the planner cannot use (unknown profile, unparsable size, incomplete config)."""


# ---------------------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """What is trained: parameter count, and per GPU the micro-batch and the micro-batches a step accumulates."""

    params: int
    batch: int = 4
    seq: int = 1024
    name: str = ""
    #: Model FLOPs per parameter per token for forward + backward (6), plus 2 with activation recompute.
    flops_per_param_token: float = 8.0
    #: Micro-batches per optimizer step (Lightning's ``accumulate_grad_batches``).
    accumulate: int = 1
    #: The strategy's ``state_precision``: what the optimizer state on the devices takes (SmartUpdate only;
    #: ZeRO-Infinity keeps fp32).
    state_precision: str = "fp32"
    #: The optimizer is built with ``fused=True`` (Adam/AdamW): the devices run torch's fused kernel, at the rate a
    #: machine profile measured for it.
    fused: bool = False
    #: The strategy's ``split_masters``: 2.125 bytes per master on the devices, the rest in the bf16 parameters, which
    #: then live in host memory.
    split_masters: bool = False
    #: The update rule the devices run (:data:`RULE_STATES`): Adam/AdamW's own, or with ``compression`` the one the
    #: strategy's rule gives (:func:`compressed_rule`; the planners set it from ``compression``).
    rule: str = "adam"

    def __post_init__(self) -> None:
        problems = Problems("Workload", PlanError)
        for name in ("params", "batch", "seq"):  # numbers, not only ints: `Workload(7e9)` plans a 7B model
            problems.number(name, getattr(self, name), low=0, above=True)
        why = "micro-batches per optimizer step, `accumulate_grad_batches`"
        problems.number("accumulate", self.accumulate, low=1, why=why)
        problems.choice("state_precision", self.state_precision, FORMATS)
        problems.choice("rule", self.rule, RULES)
        problems.raise_if_any()

    @property
    def state_bytes(self) -> float:
        """Bytes per parameter of the optimizer state on the devices (:func:`state_bytes_per_param`)."""
        return state_bytes_per_param(self.state_precision, split_masters=self.split_masters, rule=self.rule)

    def compressed(self, compression: float | None) -> Workload:
        """This workload as the strategy runs it: with ``compression`` (its default rule, ``"auto"``), the rule the
        strategy picks for AdamW (EF-Adam, which keeps one state, not two)."""
        if compression is None:
            return self
        return replace(self, rule=compressed_rule(RULES[self.rule], TopKCompression(compression)).name)

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch (at most: sequences may be shorter)."""
        return self.batch * self.seq

    @property
    def step_tokens(self) -> int:
        """Tokens of one optimizer step: every micro-batch it accumulates."""
        return self.tokens * self.accumulate


def check_rates(problems: Problems, values: dict[str, Any]) -> None:
    """Check each of a profile's ``values`` by what its name says it is: a rate or bandwidth (``*_gbps``, ``*_per_s``,
    ``*_tflops``) > 0, ``null`` meaning no limit; a latency (``*_ms``) or seconds per 1e9 parameters
    (``*_s_per_gparam``) >= 0; a share of a peak rate (``*_efficiency``) in (0, 1]."""
    for name, value in values.items():
        if name.endswith(("_gbps", "_per_s", "_tflops", "_ms")) and value is not None:
            rate = not name.endswith("_ms")
            problems.number(name, value, low=0, above=rate, why="null: no limit" if rate else "")
        elif name.endswith("_s_per_gparam"):
            problems.number(name, value, low=0, why="seconds per 1e9 parameters")
        elif name.endswith("_efficiency"):
            problems.number(name, value, low=0, high=1, above=True, why="a share of the peak rate")


#: A profile's figures per state format: what each number is, and its most (``None``: unbounded).
BY_PRECISION: dict[str, tuple[str, float | None]] = {
    "update_cost_by_precision": ("time per element relative to fp32's", None),
    "fused_update_cost_by_precision": ("time per element relative to fp32's", None),
    "device_step_cpu_s_per_gparam_by_precision": ("CPU seconds per 1e9 elements", None),
    "device_rate_share_training_by_precision": ("a share of a device's rate alone", 1),
    "memory_step_s_per_gparam_by_precision": ("seconds per 1e9 elements", None),
    "memory_step_cpu_s_per_gparam_by_precision": ("CPU seconds per 1e9 elements", None),
}


def check_by_precision(problems: Problems, values: dict[str, Any]) -> None:
    """Check each of a profile's figures per state format (:data:`BY_PRECISION`) among ``values``: a mapping of state
    formats to numbers > 0."""
    for key, (why, most) in BY_PRECISION.items():
        if key not in values:
            continue
        if problems.instance(key, values[key], dict, f"a map of {', '.join(FORMATS)} to numbers"):
            within = problems.within(key)
            if problems.keys(key, values[key], FORMATS):
                for name, value in values[key].items():
                    within.number(name, value, low=0, high=most, above=True, why=why)


@dataclass(frozen=True)
class Profile:
    """Hardware numbers the model needs. Bandwidths in GB/s, rates in parameters per second.

    ``None`` for a bandwidth means "not a bottleneck here" (for example no GPU link on a CPU-only machine).
    ``sources`` maps each field to where its number comes from (paper statement, datasheet, fitted, measured).
    """

    name: str
    description: str = ""
    # GPU
    gpu: str = "none"
    gpu_peak_tflops: float | None = None  # dense fp16/bf16 tensor peak; None: no GPU (CPU training)
    gpu_efficiency: float = 0.4
    gpu_link_gbps: float | None = None  # GPU <-> host (ZeRO-3 parameter fetch, gradient offload, top-k copy)
    gpu_topk_gelems_per_s: float | None = None  # top-k selection (sort) throughput on the GPU
    # CPU training (no GPU): forward and backward are their FLOPs at the host's measured training rate, ZeRO-3's passes
    # over each gradient (:func:`fwd_bwd_time`), and ``cpu_step_s_per_gparam`` more per micro-batch and 1e9 parameters.
    cpu_training_tflops: float | None = None  # forward + backward FLOPs per second on the host; None: not modelled
    cpu_reduce_s_per_gparam: float = 0.0  # SmartUpdate: the step's last micro-batch (its gradient norm)
    # SmartUpdate: a step of one micro-batch, whose linear weights' gradients are computed in ZeRO's buffer (0: not
    # measured, ``cpu_reduce_s_per_gparam`` stands in)
    cpu_reduce_in_place_s_per_gparam: float = 0.0
    cpu_reduce_accumulating_s_per_gparam: float = 0.0  # SmartUpdate: each micro-batch before it
    baseline_cpu_reduce_s_per_gparam: float = 0.0  # stock ZeRO-3 (ZeRO-Infinity), the last micro-batch
    baseline_cpu_reduce_accumulating_s_per_gparam: float = 0.0  # stock ZeRO-3, each micro-batch before it
    cpu_step_s_per_gparam: float = 0.0
    #: The host's cores, which forward and backward share with the emulated devices' update during backward (CPU
    #: training); ``None``: not known, and the sharing is not modelled.
    cpu_cores: int | None = None
    # host update: the memory tier's (SmartUpdate) and, unless ``baseline_update_gparams_per_s`` says otherwise,
    # ZeRO-Infinity's
    host_update_gparams_per_s: float = 1.0
    #: ZeRO-Infinity's host Adam (DeepSpeed's CPU-Adam), where it differs from the memory tier's rule code (``None``:
    #: ``host_update_gparams_per_s``, as the paper profiles are fitted).
    baseline_update_gparams_per_s: float | None = None
    # storage
    ssd_read_gbps: float = 3.2  # one SSD, sequential direct read
    ssd_write_gbps: float = 2.0  # one SSD, sequential direct write
    raid_read_ceiling_gbps: float | None = 8.0  # aggregate the host reaches over RAID-0 (shared switch)
    raid_write_ceiling_gbps: float | None = 8.0
    #: ZeRO-Infinity's disk rates over the ones above, which are the devices' (a calibrated machine: its buffers are
    #: ordinary pages, the devices' huge pages, and a disk that splits requests of 4 KiB pages moves less).
    baseline_storage_scale: float = 1.0
    shared_link_gbps: float | None = 8.0  # host <-> devices link the SmartUpdate transfers share
    #: Aggregate ceiling of the devices' *internal* storage traffic: None for independent CSDs; the one disk's
    #: bandwidth when emulated devices share it (``cpu`` backend).
    device_storage_ceiling_gbps: float | None = None
    #: The gradient is written to the device's SSD and read back by the device (SmartSSD P2P); False when the
    #: device takes it from host memory (``cpu`` backend).
    gradient_staged_on_ssd: bool = True
    #: Bytes per element of the gradient sent to a device and of the parameter it returns: 2 (bf16/fp16, this
    #: project) or 4 (fp32, the paper's measured runs: Table I's "2M" each way with M the fp16 model size).
    transfer_bytes: int = 2
    device_update_gparams_per_s: float = 0.5
    max_devices: int = 10
    device_memory_gb: float = 4.0  # per device buffer memory (FPGA DRAM / host pool budget per device)
    #: ZeRO copies each reduced gradient partition to pinned host memory and back to the GPU for its norm (DeepSpeed
    #: 0.19.8 does; the paper profiles are fitted without the way back).
    gradient_round_trip: bool = True
    #: ZeRO-Infinity baseline overlaps its reads and writes (``pipeline_read/write``).
    baseline_pipelined: bool = False
    #: Remote device servers (``backend="remote"``): GB/s between a trainer and the servers, which then carries the
    #: gradients and parameters instead of the shared link (``None``: the devices are local). Servers run the
    #: ``cpu`` backend's devices, so nothing is staged on an SSD.
    network_gbps: float | None = None
    #: Round trip of one call to a server, in milliseconds (one call per sub-group and step).
    network_latency_ms: float = 0.0
    #: Each ``state_precision``'s update time per element relative to fp32's (a format left out:
    #: :data:`UPDATE_COST_BY_PRECISION`).
    update_cost_by_precision: dict[str, float] = field(default_factory=dict)
    #: Measured through a real step of the ``cpu`` backend, per ``state_precision`` (a format left out: from the
    #: update rates above). What one device's step costs the host's cores, its update, hand-offs and I/O calls (CPU
    #: seconds per 1e9 elements, every thread together): what the devices take from backward on a CPU.
    device_step_cpu_s_per_gparam_by_precision: dict[str, float] = field(default_factory=dict)
    #: Measured the same way, per ``state_precision``: the share of its rate alone a device's step keeps while
    #: training's forward and backward run on the host's cores (CPU training; a format left out: 1).
    device_rate_share_training_by_precision: dict[str, float] = field(default_factory=dict)
    #: What the memory tier's step takes (seconds per 1e9 elements, on all the threads it runs on).
    memory_step_s_per_gparam_by_precision: dict[str, float] = field(default_factory=dict)
    #: What it costs the host's cores (CPU seconds per 1e9 elements, every thread together).
    memory_step_cpu_s_per_gparam_by_precision: dict[str, float] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any], origin: str = "profile") -> Profile:
        known = [f.name for f in fields(cls)]
        problems = Problems(origin, PlanError)
        problems.keys("profile", data, [*known, "measured", "comment"], required=["name"])
        clean = {k: v for k, v in data.items() if k in known}
        # The fields left out keep their defaults, all valid: only the values given are checked.
        check_rates(problems, clean)
        problems.integer("cpu_cores", clean.get("cpu_cores"), low=1, optional=True)
        why = "the devices the planner compares, every count from 1 up"
        problems.integer("max_devices", clean.get("max_devices", 10), low=1, high=MAX_DEVICES, why=why, example=10)
        problems.number(
            "baseline_storage_scale",
            clean.get("baseline_storage_scale", 1.0),
            low=0,
            above=True,
            why="ZeRO-Infinity's disk rates over the devices'",
        )
        check_by_precision(problems, clean)
        problems.raise_if_any()
        return cls(**clean)

    def update_cost(self, state_precision: str) -> float:
        """``state_precision``'s update time per element relative to fp32's on this machine."""
        return self.update_cost_by_precision.get(state_precision, UPDATE_COST_BY_PRECISION[state_precision])

    def device_cpu_seconds(self, state_precision: str) -> float:
        """CPU seconds one device spends per element of its step in ``state_precision``: measured through a real
        step where the profile has it, else its update at ``device_update_gparams_per_s`` on one core."""
        measured = self.device_step_cpu_s_per_gparam_by_precision.get(state_precision)
        if measured is not None:
            return measured / 1e9
        return self.update_cost(state_precision) / (self.device_update_gparams_per_s * 1e9)

    def device_rate_share_training(self, state_precision: str) -> float:
        """The share of its rate alone a device keeps in ``state_precision`` while CPU training's backward runs on
        the cores it shares: measured where the profile has it, else 1."""
        return self.device_rate_share_training_by_precision.get(state_precision, 1.0)

    def memory_update_rate(self, state_precision: str) -> float:
        """Elements per second the memory tier updates in ``state_precision``: measured through a real step where the
        profile has it, else ``host_update_gparams_per_s`` over the format's cost."""
        measured = self.memory_step_s_per_gparam_by_precision.get(state_precision)
        if measured is not None:
            return 1e9 / measured
        return self.host_update_gparams_per_s * 1e9 / self.update_cost(state_precision)

    def memory_cpu_seconds(self, state_precision: str) -> float:
        """CPU seconds the memory tier spends per element of its step in ``state_precision``: measured through a
        real step where the profile has it, else its update on one core."""
        measured = self.memory_step_cpu_s_per_gparam_by_precision.get(state_precision)
        if measured is not None:
            return measured / 1e9
        return 1 / self.memory_update_rate(state_precision)

    def device_io_rates(self, devices: int) -> tuple[float, float]:
        """Bytes per second each of ``devices`` devices reads and writes its state at: its SSD's, within its share of
        the devices' ``device_storage_ceiling_gbps``."""
        ceiling = _limit(self.device_storage_ceiling_gbps) / devices
        return min(self.ssd_read_gbps * GB, ceiling), min(self.ssd_write_gbps * GB, ceiling)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _limit(value: float | None) -> float:
    return math.inf if value is None else value * GB


# ---------------------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Breakdown:
    """Seconds per iteration, split by where the time goes (phases are serial unless the method overlaps)."""

    method: str
    devices: int
    fwd_bwd: float
    grad_transfer: float  # gradient over the shared link (baseline: fp32 gradient swap-out to the RAID)
    update: float  # optimizer arithmetic not hidden behind I/O
    param_return: float  # updated low-precision parameters back over the shared link
    storage_io: float  # optimizer-state reads + writes not hidden (baseline: over the RAID; SU: inside devices)
    compression: float = 0.0  # top-k selection on the GPU (SU+O+C)
    gpu_link_bytes: float = 0.0  # bytes per step between GPU and host memory (inside ``fwd_bwd``)
    gpu_gradient_bytes: float = 0.0  # GPU memory the gradient partitions (and residual) keep across the step
    link_write_bytes: float = 0.0  # bytes per step host -> storage over the shared link
    link_read_bytes: float = 0.0  # bytes per step storage -> host over the shared link
    storage_bytes: float = 0.0  # bytes per step read+written on the SSDs in total
    param_read_bytes: float = 0.0  # 16-bit parameters read from storage for forward and backward (params on storage)
    param_write_bytes: float = 0.0  # updated 16-bit parameters written to storage after the step

    @property
    def link_bytes(self) -> float:
        return self.link_write_bytes + self.link_read_bytes

    @property
    def optimizer(self) -> float:
        """Optimizer step: everything except forward/backward (and the compression done on the GPU)."""
        return self.grad_transfer + self.update + self.param_return + self.storage_io

    @property
    def total(self) -> float:
        return self.fwd_bwd + self.optimizer + self.compression


def gradient_link_bytes(gradient_buffer: str, *, compression: float | None = None, accumulate: int = 1) -> float:
    """GPU <-> host bytes per parameter per step the gradient partitions take under this project's ZeRO-3 (16-bit
    training; a step of ``accumulate`` micro-batches adds their gradients in fp32, or in the training dtype with
    ``compression``).

    - ``gradient_buffer="accelerator"``: the gradient stays on the GPU (accumulation, norm and top-k run there); a
      device reads it across once, ``2``, or only the kept pairs, ``c·(2 + 4)``.
    - ``"host"``: each micro-batch's partition crosses to pinned host memory once (its norm is taken on the GPU
      first); each micro-batch after the first also brings the partial sum over and back, to add to it on the GPU.
      Top-k (``compression``) needs the summed gradient back on the GPU, then sends the pairs.
    """
    if gradient_buffer not in GRADIENT_BUFFERS:
        raise PlanError(
            f"`gradient_buffer={gradient_buffer!r}` is unknown; choose one of {', '.join(GRADIENT_BUFFERS)}."
        )
    pairs = 0.0 if compression is None else compression * (LOW_PRECISION_BYTES + COMPRESSED_INDEX_BYTES)
    if gradient_buffer == "accelerator":
        return LOW_PRECISION_BYTES if compression is None else pairs
    summed = accumulation_bytes(accumulate, compression)
    crossings = summed * (1 + 2 * (accumulate - 1))
    return crossings + (summed + pairs if compression is not None else 0.0)


def accumulation_bytes(accumulate: int, compression: float | None = None) -> int:
    """Bytes per element of the buffer ZeRO-3 sums a step's gradients in: fp32 for a 16-bit run that accumulates
    (the strategy sets it), the training dtype otherwise and with compression."""
    return FP32_GRAD_BYTES if accumulate > 1 and compression is None else LOW_PRECISION_BYTES


def gpu_link_bytes(
    method: str,
    *,
    gradient_buffer: str = "accelerator",
    compression: float | None = None,
    round_trip: bool = True,
    accumulate: int = 1,
) -> float:
    """GPU <-> host bytes per parameter per step that ``method``'s code copies (16-bit training, parameters offloaded
    to host memory; the updated parameters are written there, so none go back to the GPU).

    - ZeRO-3's parameter fetches for forward and backward of each micro-batch: ``4·accumulate``.
    - ZeRO-Infinity: ZeRO copies each reduced gradient partition into pinned host memory, ``2``, and back to the GPU
      for its norm, ``2`` (``round_trip``: DeepSpeed 0.19.8 does; the paper profiles are fitted without it); each
      later micro-batch of an accumulation brings the sum over and back, ``4``.
    - SmartUpdate: :func:`gradient_link_bytes`.
    """
    fetches = PARAM_FETCH_BYTES * accumulate
    if method == "zero_infinity":
        first = LOW_PRECISION_BYTES * (2 if round_trip else 1)
        return fetches + first + 2 * LOW_PRECISION_BYTES * (accumulate - 1)
    return fetches + gradient_link_bytes(gradient_buffer, compression=compression, accumulate=accumulate)


def parameter_io(work: Workload, prof: Profile, compute: float, on_storage: bool) -> tuple[float, float, float, float]:
    """Forward and backward time once the parameters' reads are counted, the seconds of their writes after the step,
    and the bytes of each: with the 16-bit parameters on storage (``on_storage``: ``offload_parameters="storage"``;
    ZeRO-Infinity's ``offload_param: nvme``), else ``compute`` and none. One storage path holds them, and the reads
    cross the shared link; DeepSpeed reads a layer ahead, so reads hide behind compute up to their own time."""
    if not on_storage:
        return compute, 0.0, 0.0, 0.0
    p = work.params
    reads, writes = PARAM_FETCH_BYTES * p * work.accumulate, LOW_PRECISION_BYTES * p
    read_s = reads / min(_limit(prof.shared_link_gbps), prof.ssd_read_gbps * GB)
    write_s = writes / min(_limit(prof.shared_link_gbps), prof.ssd_write_gbps * GB)
    return max(compute, read_s), write_s, reads, writes


def fwd_bwd_time(
    work: Workload, prof: Profile, link_bytes_per_param: float = 3 * LOW_PRECISION_BYTES, *, method: str = "su_o"
) -> float:
    """Forward and backward, and the GPU <-> host copies of ``link_bytes_per_param`` (not overlapped: an upper
    bound).

    Without a GPU: each micro-batch's :func:`_cpu_micro_batch_time` (its FLOPs at the host's measured training rate
    ``cpu_training_tflops`` and ``cpu_step_s_per_gparam``), plus ZeRO-3's host passes
    over each gradient element in every micro-batch (autograd's fresh gradient, the reduce bucket, the accumulation
    buffer; the last micro-batch takes the norm), which ``method``'s code makes: stock ZeRO-3's for
    ``"zero_infinity"`` (with its averaging reduce-scatter and float64 norm), this project's for the others.
    """
    if prof.gpu_peak_tflops is None:
        if method == "zero_infinity":
            last = prof.baseline_cpu_reduce_s_per_gparam
            accumulating = prof.baseline_cpu_reduce_accumulating_s_per_gparam
        else:
            last, accumulating = _last_reduce_s_per_gparam(work, prof), prof.cpu_reduce_accumulating_s_per_gparam
        passes = (last + accumulating * (work.accumulate - 1)) * work.params / 1e9
        return work.accumulate * _cpu_micro_batch_time(work, prof) + passes
    flops = work.flops_per_param_token * work.params * work.step_tokens
    compute = flops / (prof.gpu_peak_tflops * 1e12 * prof.gpu_efficiency)
    return compute + link_bytes_per_param * work.params / _limit(prof.gpu_link_gbps)


def _cpu_micro_batch_time(work: Workload, prof: Profile) -> float:
    """Without a GPU: one micro-batch's forward and backward but for ZeRO-3's passes over its gradients: its FLOPs at
    ``cpu_training_tflops`` (none where that is not measured) and ``cpu_step_s_per_gparam``."""
    flops = work.flops_per_param_token * work.params * work.tokens
    compute = flops / (prof.cpu_training_tflops * 1e12) if prof.cpu_training_tflops else 0.0
    return compute + prof.cpu_step_s_per_gparam * work.params / 1e9


def cpu_backward_time(work: Workload, prof: Profile) -> float:
    """Without a GPU: the backward of the step's last micro-batch, while which the gradients complete and the
    emulated devices take their hand-offs (``overlap_backward``): its share of :func:`_cpu_micro_batch_time` (4 of
    the 6 FLOPs per parameter and token, 6 of the 8 with recompute) and this project's ZeRO-3 passes over the last
    micro-batch's gradients (the norm's among them), all in :func:`fwd_bwd_time` too. 0 where the FLOPs' rate is not
    measured: backward is not known then."""
    if not prof.cpu_training_tflops:
        return 0.0
    backward_share = (work.flops_per_param_token - 2) / work.flops_per_param_token
    passes = _last_reduce_s_per_gparam(work, prof) * work.params / 1e9
    return backward_share * _cpu_micro_batch_time(work, prof) + passes


def _last_reduce_s_per_gparam(work: Workload, prof: Profile) -> float:
    """This project's passes over each gradient of the step's last micro-batch per 1e9 parameters: where it is the
    only one, its linear weights' gradients are computed in ZeRO's buffer (the buffer then has the training dtype), so
    only the norm reads them, where measured."""
    if work.accumulate == 1 and prof.cpu_reduce_in_place_s_per_gparam > 0:
        return prof.cpu_reduce_in_place_s_per_gparam
    return prof.cpu_reduce_s_per_gparam


def zero_infinity(work: Workload, prof: Profile, devices: int, *, params_on_storage: bool = False) -> Breakdown:
    p = work.params
    io_scale = prof.baseline_storage_scale
    read_bw = min(devices * prof.ssd_read_gbps * GB, _limit(prof.raid_read_ceiling_gbps)) * io_scale
    write_bw = min(devices * prof.ssd_write_gbps * GB, _limit(prof.raid_write_ceiling_gbps)) * io_scale
    grad_out = FP32_GRAD_BYTES * p / write_bw
    state_in = (FP32_STATE_BYTES + FP32_GRAD_BYTES) * p / read_bw
    state_out = FP32_STATE_BYTES * p / write_bw
    update = p / ((prof.baseline_update_gparams_per_s or prof.host_update_gparams_per_s) * 1e9)
    pcie = gpu_link_bytes("zero_infinity", round_trip=prof.gradient_round_trip, accumulate=work.accumulate)
    # An SSD's reads and writes share its bandwidth, so pipelining hides the host update behind the I/O, not
    # reads behind writes.
    if prof.baseline_pipelined:
        update = max(0.0, update - (state_in + state_out))
    compute = fwd_bwd_time(work, prof, pcie, method="zero_infinity")
    fwd_bwd, param_write, param_reads, param_writes = parameter_io(work, prof, compute, params_on_storage)
    return Breakdown(
        "zero_infinity",
        devices,
        fwd_bwd=fwd_bwd,
        grad_transfer=grad_out,
        update=update,
        param_return=param_write,
        storage_io=state_in + state_out,
        link_write_bytes=16.0 * p,
        link_read_bytes=16.0 * p,
        storage_bytes=32.0 * p,
        gpu_link_bytes=pcie * p if prof.gpu_peak_tflops is not None else 0.0,
        param_read_bytes=param_reads,
        param_write_bytes=param_writes,
    )


def smart_update(
    work: Workload,
    prof: Profile,
    devices: int,
    *,
    overlap: bool = False,
    compression: float | None = None,
    sub_group_size: int = 40_000_000,
    gradient_buffer: str = "accelerator",
    params_on_storage: bool = False,
) -> Breakdown:
    """SmartUpdate with ``devices`` CSDs; ``overlap`` = the transfer handler (SU+O); ``compression`` = kept ratio;
    ``gradient_buffer`` = where the gradient partitions wait (see :func:`gpu_link_bytes`); ``params_on_storage`` =
    ``offload_parameters="storage"`` (:func:`parameter_io`)."""
    if compression is not None and not 0 < compression <= 1:
        raise PlanError(f"`compression={compression}` must be in (0, 1] (fraction of gradient elements kept).")
    p = work.params
    n = p / devices  # parameters per device
    tb = prof.transfer_bytes
    if compression is None:
        grad_bytes = float(tb)
        method = "su_o" if overlap else "su"
        comp_time = 0.0
    else:
        grad_bytes = compression * (tb + COMPRESSED_INDEX_BYTES)
        method = "su_o_c"
        comp_time = p / _limit(prof.gpu_topk_gelems_per_s)  # 0 when not given
    remote = prof.network_gbps is not None
    link = _limit(prof.network_gbps if remote else prof.shared_link_gbps)
    staged_on_ssd = prof.gradient_staged_on_ssd and not remote
    grad_link = grad_bytes * p / (min(link, devices * prof.ssd_write_gbps * GB) if staged_on_ssd else link)
    param_return = tb * p / link
    if remote:
        # One call per sub-group and step, devices (servers) in parallel, REMOTE_CALLS_IN_FLIGHT calls each at once.
        grad_link += math.ceil(n / sub_group_size) * prof.network_latency_ms / 1e3 / REMOTE_CALLS_IN_FLIGHT
    b_r, b_w = prof.device_io_rates(devices)
    staged = grad_bytes if staged_on_ssd else 0.0
    state = work.state_bytes
    storage = (state + staged) * n / b_r + state * n / b_w
    update = n / (prof.device_update_gparams_per_s * 1e9) * prof.update_cost(work.state_precision)
    exposed_update = update
    if overlap or compression is not None:  # the storage traffic hides the update but for one sub-group's fill
        exposed_update = max(0.0, update - storage) + min(storage, update) * min(1.0, sub_group_size / n)
    pcie = gpu_link_bytes(
        method,
        gradient_buffer=gradient_buffer,
        compression=compression,
        round_trip=prof.gradient_round_trip,
        accumulate=work.accumulate,
    )
    on_gpu = prof.gpu_peak_tflops is not None
    # The gradient partitions (fp32 while a step accumulates), plus the fp32 error-feedback residual with compression.
    kept_on_gpu = (accumulation_bytes(work.accumulate, compression) + (4 if compression is not None else 0)) * p
    compute = fwd_bwd_time(work, prof, pcie, method=method)
    fwd_bwd, param_write, param_reads, param_writes = parameter_io(work, prof, compute, params_on_storage)
    return Breakdown(
        method,
        devices,
        fwd_bwd=fwd_bwd,
        grad_transfer=grad_link,
        update=exposed_update,
        param_return=param_return + param_write,
        storage_io=storage,
        compression=comp_time,
        link_write_bytes=grad_bytes * p,
        link_read_bytes=float(tb) * p,
        storage_bytes=(2 * state + 2 * staged) * p,
        gpu_link_bytes=pcie * p if on_gpu else 0.0,
        gpu_gradient_bytes=kept_on_gpu if on_gpu and gradient_buffer == "accelerator" else 0.0,
        param_read_bytes=param_reads,
        param_write_bytes=param_writes,
    )


def iteration(
    method: str,
    work: Workload,
    prof: Profile,
    devices: int,
    *,
    compression: float = 0.01,
    sub_group_size: int = 40_000_000,
    gradient_buffer: str = "accelerator",
    params_on_storage: bool = False,
) -> Breakdown:
    if devices < 1:
        raise PlanError(f"`devices={devices}` must be at least 1.")
    if method not in METHODS:
        raise PlanError(f"`method={method!r}` is unknown; choose one of {', '.join(METHODS)}.")
    if method == "zero_infinity":
        return zero_infinity(work, prof, devices, params_on_storage=params_on_storage)
    return smart_update(
        work,
        prof,
        devices,
        overlap=method != "su",
        compression=compression if method == "su_o_c" else None,
        sub_group_size=sub_group_size,
        gradient_buffer=gradient_buffer,
        params_on_storage=params_on_storage,
    )


def speedup(method: str, work: Workload, prof: Profile, devices: int, **kw: Any) -> float:
    """Iteration speedup of ``method`` over ZeRO-Infinity on a RAID-0 of the same ``devices`` SSDs."""
    return zero_infinity(work, prof, devices).total / iteration(method, work, prof, devices, **kw).total


# ---------------------------------------------------------------------------------------------------------------
# Model sizes: "7B", "350M", "1.5e9", or a Hugging Face config.json
# ---------------------------------------------------------------------------------------------------------------

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbt]?)\s*$", re.IGNORECASE)
_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def parse_size(text: str) -> int:
    """``"7B"`` → 7e9, ``"350M"`` → 3.5e8, ``"1.5e9"`` → 1.5e9."""
    match = _SIZE.match(str(text))
    if not match:
        raise PlanError(
            f"`--model {text!r}` is neither a size (like 7B, 350M, 1.5e9) nor an existing config.json file."
        )
    value = float(match.group(1)) * _SUFFIX[match.group(2).lower()]
    if value < 1:
        raise PlanError(f"`--model {text!r}` gives {value:g} parameters; it must be at least 1.")
    return int(round(value))


def _first(cfg: dict[str, Any], *keys: str) -> Any:
    return next((cfg[key] for key in keys if cfg.get(key) is not None), None)


def params_from_config(cfg: dict[str, Any], origin: str = "config") -> int:
    """Trainable parameters of a decoder/encoder transformer from a Hugging Face ``config.json`` dict.

    Counts embeddings (+ untied LM head, learned positions), attention (with grouped KV heads), MLP (gated for
    SiLU/GELU-gated families) and norms; within ~1% of the real count for GPT-2, BERT, Llama, Mistral, Qwen.
    """
    if isinstance(cfg.get("text_config"), dict):  # multimodal wrappers
        cfg = {**cfg, **cfg["text_config"]}
    h = _first(cfg, "hidden_size", "n_embd", "d_model")
    layers = _first(cfg, "num_hidden_layers", "n_layer", "num_layers")
    vocab = _first(cfg, "vocab_size")
    found = {"hidden_size/n_embd": h, "num_hidden_layers/n_layer": layers, "vocab_size": vocab}
    missing = [name for name, value in found.items() if value is None]
    if missing:
        raise PlanError(
            f"{origin}: cannot count parameters, missing {', '.join(missing)}. Pass a Hugging Face config.json of a "
            "transformer, or a size such as `--model 7B`."
        )
    h, layers, vocab = int(h), int(layers), int(vocab)
    inter = int(_first(cfg, "intermediate_size", "n_inner", "ffn_dim", "d_ff") or 4 * h)
    heads = int(_first(cfg, "num_attention_heads", "n_head") or 1)
    kv_heads = int(_first(cfg, "num_key_value_heads") or heads)
    head_dim = int(_first(cfg, "head_dim") or h // heads)
    act = str(_first(cfg, "hidden_act", "activation_function") or "").lower()
    model_type = str(cfg.get("model_type", "")).lower()
    gated = act in ("silu", "swiglu", "geglu") or model_type in ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3")
    biases = model_type in ("gpt2", "bert", "roberta", "gpt_neox", "opt", "bloom", "")
    attn = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h
    mlp = (3 if gated else 2) * h * inter
    per_layer = attn + mlp + 4 * h  # two norms (weight + bias)
    if biases:
        per_layer += heads * head_dim + 2 * kv_heads * head_dim + h + inter * (2 if gated else 1) + h
    total = layers * per_layer + vocab * h + 2 * h  # embeddings + final norm
    if not cfg.get("tie_word_embeddings", True) and model_type not in ("bert", "roberta"):
        total += vocab * h
    learned = model_type in ("bert", "roberta", "opt", "gpt2")  # learned position embeddings
    positions = _first(cfg, "max_position_embeddings", "n_positions") if learned else None
    if positions:
        total += int(positions) * h
    if model_type in ("bert", "roberta"):
        total += int(cfg.get("type_vocab_size", 2)) * h
    return int(total)


def workload_from_model(model: str, batch: int = 4, seq: int | None = None, accumulate: int = 1) -> Workload:
    """``model`` is a size (``"7B"``) or a path to a Hugging Face ``config.json`` (or its directory); ``accumulate``
    micro-batches of ``batch`` sequences of ``seq`` tokens per step."""
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            cfg = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise PlanError(f"`--model {model}`: cannot read {path} as JSON ({exc}).") from exc
        if not isinstance(cfg, dict):
            raise PlanError(f"`--model {model}`: {path} must hold a JSON object (a Hugging Face config).")
        params = params_from_config(cfg, origin=str(path))
        if seq is None:
            seq = int(min(_first(cfg, "max_position_embeddings", "n_positions", "n_ctx") or 1024, 4096))
        name = str(cfg.get("_name_or_path") or path.parent.name)
        return Workload(params, batch=batch, seq=seq, name=name, accumulate=accumulate)
    if model.endswith(".json") or "/" in model:
        raise PlanError(f"`--model {model}`: no such file. Pass a Hugging Face config.json or a size like 7B.")
    # `seq=0` is the Workload's to refuse, as with a config: only `None` means "not given".
    seq = 1024 if seq is None else seq
    return Workload(parse_size(model), batch=batch, seq=seq, name=model, accumulate=accumulate)


# ---------------------------------------------------------------------------------------------------------------
# Profiles
# ---------------------------------------------------------------------------------------------------------------


def profile_names() -> list[str]:
    root = resources.files("lightning_smartinf.plan") / "profiles"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json"))


def read_profile(name_or_path: str | Path) -> tuple[dict[str, Any], str]:
    """The JSON object of a packaged profile (by name) or a profile file, and where it came from (for messages)."""
    path = Path(name_or_path)
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise PlanError(f"`--profile {name_or_path}`: no such file.")
        text, origin = path.read_text(), str(path)
    else:
        names = profile_names()
        if str(name_or_path) not in names:
            raise PlanError(
                f"`--profile {name_or_path!r}` is unknown. Packaged profiles: {', '.join(names)}; "
                "or pass a profile JSON file (write one with `--calibrate PATH [PATH ...] -o profile.json`)."
            )
        text = (resources.files("lightning_smartinf.plan") / "profiles" / f"{name_or_path}.json").read_text()
        origin = f"profile {name_or_path!r}"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanError(f"{origin}: not valid JSON ({exc}).") from exc
    if not isinstance(data, dict):
        raise PlanError(f"{origin}: must hold a JSON object.")
    return data, origin


def load_profile(name_or_path: str | Path) -> Profile:
    """A packaged profile by name (``paper-a5000``) or a profile JSON file of the model's own kind (a machine
    profile, ``"kind": "local-nvme"``, loads with :func:`lightning_smartinf.plan.machine.load_any`)."""
    data, origin = read_profile(name_or_path)
    if "kind" in data:
        raise PlanError(
            f"{origin}: a profile of kind {data['kind']!r} describes a machine, not the model's testbed. Load it with "
            "`lightning_smartinf.plan.machine.load_any` (`smartinf plan --profile` takes either)."
        )
    return Profile.from_dict(data, origin)
