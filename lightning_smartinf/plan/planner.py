"""Recommendations and printable reports on top of :mod:`lightning_smartinf.plan.cost_model`."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import Any

from lightning_smartinf.core.state_formats import FORMATS
from lightning_smartinf.plan.cost_model import (
    MAX_DEVICES,
    METHODS,
    Breakdown,
    PlanError,
    Profile,
    Workload,
    iteration,
    zero_infinity,
)
from lightning_smartinf.plan.tier_placement import TierPlacement

#: Candidate ZeRO sub-group sizes (elements); the paper used 4e7 and 1e8.
SUB_GROUP_CANDIDATES = (10_000_000, 20_000_000, 40_000_000, 100_000_000, 200_000_000)
#: Device buffer bytes per sub-group element in the paper's kernel: fp32 master, m, v + fp16 grad + fp16 param.
DEVICE_BYTES_PER_ELEMENT = 16
#: Speedup gained by compression below which the planner does not recommend it (it costs accuracy, Table IV).
COMPRESSION_WORTH = 1.10
#: A device count within this factor of the best time is "enough" (more devices buy < 5%).
ENOUGH = 1.05


#: Placeholder storage directory of device ``i`` in the printed snippets.
STORAGE_PLACEHOLDER = "/mnt/csd{}"
PYTHON_HEADER = "python (paste into a training script; then `Trainer(strategy=strategy, ...)`):"
YAML_HEADER = "yaml (`trainer.strategy` of a `smartinf fit` recipe; merge it in, or pass it as a second --config):"

SHORT_LABELS = {"zero_infinity": "ZeRO-Infinity", "su": "SU", "su_o": "SU+O", "su_o_c": "SU+O+C"}


@dataclass(frozen=True)
class Plan:
    work: Workload
    profile: Profile
    devices: int  # devices the breakdown is for
    compression: float
    breakdowns: dict[str, Breakdown]
    recommended_devices: int
    baseline_saturation_devices: int
    sub_group_size: int
    buffer_count: int
    recommend_compression: bool
    compression_gain: float
    params_on_storage: bool = False
    #: ``--memory-budget``, ``--accelerator-budget`` (bytes) and ``--device-weights``, with the placement they give.
    memory_budget: int | None = None
    accelerator_budget: int | None = None
    device_weights: tuple[float, ...] | None = None
    placement: TierPlacement | None = None
    #: Each ``state_precision``'s state bytes and the recommended SmartUpdate method's step seconds.
    precisions: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def baseline(self) -> Breakdown:
        return self.breakdowns["zero_infinity"]


def choose_sub_group(work: Workload, prof: Profile, devices: int, *, largest: int | None = None) -> int:
    """Largest candidate (up to ``largest``) that gives every device >= 8 sub-groups (pipeline fill and drain under
    ~1/8 of a device's work) and whose buffers fit in half the device memory (room for the next sub-group's)."""
    per_device = work.params / devices
    fitting = [
        s
        for s in SUB_GROUP_CANDIDATES
        if 2 * s * DEVICE_BYTES_PER_ELEMENT <= prof.device_memory_gb * 1e9
        and 8 * s <= per_device
        and (largest is None or s <= largest)
    ]
    if fitting:
        return max(fitting)
    # A small model: 8 sub-groups per device, rounded up to a multiple of 1M elements, at most the smallest candidate.
    return max(1 << 20, min(min(SUB_GROUP_CANDIDATES), int(-(-per_device // 8 // (1 << 20)) * (1 << 20))))


def _per_device(groups: int, devices: int) -> str:
    """``>= 8 sub-groups per device``, or how many there are where the model is too small for that."""
    if groups >= 8 * devices:
        return ">= 8 sub-groups per device"
    return f"{groups:,} sub-group(s) over {devices} device(s): the model is too small for 8 per device"


def sub_groups(work: Workload, sub_group_size: int) -> int:
    """How many sub-groups of ``sub_group_size`` elements the model's parameters make."""
    return -(-work.params // sub_group_size)


def make_plan(
    work: Workload,
    prof: Profile,
    *,
    devices: int | None = None,
    compression: float | None = None,
    params_on_storage: bool = False,
) -> Plan:
    if devices is not None and devices < 1:
        raise PlanError(f"`--devices {devices}` must be at least 1.")
    if devices is not None and devices > MAX_DEVICES:
        raise PlanError(
            f"`--devices {devices}` is more than the {MAX_DEVICES} the planner compares (every count from 1 up to it). "
            f"Pass {MAX_DEVICES} or fewer, or leave it out for the recommended number."
        )
    ratio = 0.01 if compression is None else compression
    if not 0 < ratio <= 1:
        raise PlanError(f"`--compression {ratio}` must be in (0, 1]: the fraction of gradient elements kept.")
    # Every count from 1 to `top` (<= MAX_DEVICES) is compared: the recommendation is the best of them. A count with
    # fewer sub-groups than devices (a model of fewer elements than a sub-group per device) would leave some idle.
    top = max(prof.max_devices, devices or 1)
    sizes = {n: choose_sub_group(work, prof, n) for n in range(1, top + 1)}
    times = {  # the faster of SU+O and SU+O+C
        n: min(iteration(m, work, prof, n, compression=ratio, sub_group_size=s).total for m in ("su_o", "su_o_c"))
        for n, s in sizes.items()
        if n == 1 or sub_groups(work, s) >= n
    }
    best = min(times.values())
    recommended = min(n for n, t in times.items() if t <= best * ENOUGH)
    base = {n: zero_infinity(work, prof, n).total for n in range(1, top + 1)}
    saturation = min(n for n, t in base.items() if t <= min(base.values()) * ENOUGH)
    n = devices or recommended
    sub_group = choose_sub_group(work, prof, n)
    shared = {"compression": ratio, "sub_group_size": sub_group, "params_on_storage": params_on_storage}
    breakdowns = {m: iteration(m, work, prof, n, **shared) for m in METHODS}
    gain = breakdowns["su_o"].total / breakdowns["su_o_c"].total
    method = "su_o_c" if compression is not None or gain >= COMPRESSION_WORTH else "su_o"
    precisions: dict[str, tuple[float, float]] = {}
    for name in FORMATS:
        alike = replace(work, state_precision=name)
        precisions[name] = (alike.state_bytes * work.params, iteration(method, alike, prof, n, **shared).total)
    return Plan(
        work=work,
        profile=prof,
        devices=n,
        compression=ratio,
        breakdowns=breakdowns,
        recommended_devices=recommended,
        baseline_saturation_devices=saturation,
        sub_group_size=sub_group,
        buffer_count=16,
        recommend_compression=method == "su_o_c",
        compression_gain=gain,
        params_on_storage=params_on_storage,
        precisions=precisions,
    )


def model_text(work: Workload) -> str:
    """``model: 7B = 7.00B parameters (7,000,000,000), batch 2 x seq 2048 x 16 micro-batches a step``: each report's
    first line, the model and what one step trains."""
    size = str(work.params)
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if work.params >= scale:
            size = f"{work.params / scale:.2f}{unit}"
            break
    micro = f"batch {work.batch} x seq {work.seq}"
    recompute = (
        "" if work.flops_per_param_token == 8.0 else f", {work.flops_per_param_token:g} FLOPs per parameter and token"
    )
    fused = ", a fused optimizer" if work.fused else ""
    steps = f" x {work.accumulate} micro-batches a step" if work.accumulate > 1 else ""
    return f"model: {work.name or 'model'} = {size} parameters ({work.params:,}), {micro}{steps}{recompute}{fused}"


def format_plan(plan: Plan) -> str:
    w, prof, n = plan.work, plan.profile, plan.devices
    lines = [
        model_text(w),
        f"profile: {prof.name} ({prof.gpu}); {n} device(s)",
        "",
        f"{'method':<22}{'fwd/bwd':>9}{'grad xfer':>10}{'update':>9}{'param ret':>10}{'storage':>9}"
        f"{'topk':>7}{'total s':>9}{'speedup':>9}{'link GB':>9}",
    ]
    base = plan.baseline.total
    for method, b in plan.breakdowns.items():
        label = SHORT_LABELS[method] + (f" (c={plan.compression:g})" if method == "su_o_c" else "")
        lines.append(
            f"{label:<22}{b.fwd_bwd:>9.2f}{b.grad_transfer:>10.2f}{b.update:>9.2f}{b.param_return:>10.2f}"
            f"{b.storage_io:>9.2f}{b.compression:>7.2f}{b.total:>9.2f}{base / b.total:>8.2f}x{b.link_bytes / 1e9:>9.1f}"
        )
    lines.append(
        f"tokens per second (at most {w.step_tokens:,} a step): "
        + ", ".join(f"{SHORT_LABELS[m]} {w.step_tokens / b.total:,.0f}" for m, b in plan.breakdowns.items())
    )
    method = SHORT_LABELS["su_o_c" if plan.recommend_compression else "su_o"]
    lines += precision_lines(plan.precisions, w.state_precision, f"{method} step")
    if plan.baseline.gpu_link_bytes:
        b = plan.breakdowns
        dense, compressed = b["su_o"].gpu_gradient_bytes, b["su_o_c"].gpu_gradient_bytes
        lines.append(
            f"GPU<->host copies per step (in fwd/bwd): ZeRO-Infinity {b['zero_infinity'].gpu_link_bytes / 1e9:.1f} GB, "
            f"SU {b['su'].gpu_link_bytes / 1e9:.1f} GB, SU+O+C {b['su_o_c'].gpu_link_bytes / 1e9:.1f} GB; the gradient "
            f"partitions stay in GPU memory: {dense / 1e9:.1f} GB ({compressed / 1e9:.1f} GB with compression's "
            "residual; `gradient_buffer='host'` keeps them in pinned host memory instead)"
        )
    if plan.params_on_storage:
        b = plan.baseline
        lines.append(
            f"16-bit parameters on storage (both methods): {b.param_read_bytes / 1e9:.1f} GB read per step for forward"
            f" and backward (hidden behind compute up to the read time, in fwd/bwd), {b.param_write_bytes / 1e9:.1f}"
            " GB written after it (in param ret)"
        )
    lines += [
        "SU = SmartUpdate (update on the devices), +O = transfer/update overlap, +C = top-k gradient compression.",
        "(seconds per iteration; 'storage' is SSD reads+writes: over the RAID for ZeRO-Infinity, inside the devices"
        " for SU; 'update' is the part not hidden behind I/O)",
        "",
        "recommendation:",
        f"  devices: {plan.recommended_devices} (more buy < {int((ENOUGH - 1) * 100)}%); "
        f"ZeRO-Infinity's RAID stops scaling at {plan.baseline_saturation_devices}",
        f"  sub_group_size: {plan.sub_group_size:,} elements "
        f"({plan.sub_group_size * DEVICE_BYTES_PER_ELEMENT / 1e9:.2f} GB device buffers per sub-group; "
        f"{_per_device(sub_groups(w, plan.sub_group_size), n)})",
        f"  buffer pool: buffer_count={plan.buffer_count} chunk buffers per device "
        "(add the BufferPool callback to size them from a host-memory budget)",
    ]
    if plan.recommend_compression:
        lines += [
            f"  compression: keep {plan.compression:g} of gradient elements (SU+O+C {plan.compression_gain:.2f}x over"
            " SU+O); costs accuracy",
            "    (paper Table IV, without error feedback: GPT-2 MNLI-m -0.7 to -1.4); the strategy adds error feedback",
            "    by default: an fp32 residual of 4 B per parameter",
        ]
    else:
        lines.append(
            f"  compression: not worth it here (SU+O+C {plan.compression_gain:.2f}x over SU+O, < "
            f"{COMPRESSION_WORTH:.2f}x); keep full gradients"
        )
    if plan.devices != plan.recommended_devices:
        lines.append(f"  (the snippets below are for the {plan.devices} device(s) asked for)")
    if plan.placement is not None:
        memory = size_text(plan.memory_budget or 0)
        accelerator = None if plan.accelerator_budget is None else size_text(plan.accelerator_budget)
        lines += ["", plan.placement.describe(memory, accelerator)]
    lines += ["", PYTHON_HEADER, "", python_snippet(plan), "", YAML_HEADER, "", yaml_snippet(plan)]
    return "\n".join(lines)


def strategy_args(plan: Plan) -> dict[str, Any]:
    """The ``SmartInfinityStrategy`` arguments the plan recommends or was asked for, as its snippets print them.

    ``storage_paths`` are placeholders (:data:`STORAGE_PLACEHOLDER`), one per device of the plan.
    """
    compressed, work = plan.recommend_compression, plan.work
    args = {
        "storage_paths": [STORAGE_PLACEHOLDER.format(i) for i in range(plan.devices)],
        "sub_group_size": plan.sub_group_size,
        "buffer_count": plan.buffer_count,
        "device_weights": None if plan.device_weights is None else list(plan.device_weights),
        "state_memory_budget": None if plan.memory_budget is None else size_text(plan.memory_budget),
        "state_accelerator_budget": None if plan.accelerator_budget is None else size_text(plan.accelerator_budget),
        "offload_parameters": "storage" if plan.params_on_storage else None,
        "compression": plan.compression if compressed else None,
        # The strategy starts updates during backward only for dense gradients; say so instead of ignoring it.
        "overlap_backward": False if compressed else None,
        "state_precision": None if work.state_precision == "fp32" else work.state_precision,
        "split_masters": True if work.split_masters else None,
    }
    return {name: value for name, value in args.items() if value is not None}  # None: left out


def precisions_json(precisions: dict[str, tuple[float, float]]) -> dict[str, dict[str, float]]:
    """Each ``state_precision``'s state bytes and step seconds, as ``smartinf plan --json`` writes them."""
    return {name: {"state_bytes": nbytes, "step_s": seconds} for name, (nbytes, seconds) in precisions.items()}


def precision_lines(precisions: dict[str, tuple[float, float]], chosen: str, step: str) -> list[str]:
    """The table of each ``state_precision``: the optimizer state's size and the step it gives, ``chosen`` marked
    (nothing when ``precisions`` is empty)."""
    if len(precisions) < 2:
        return []
    fp32_s = precisions["fp32"][1]
    lines = ["", f"state_precision (Adam's moments on the devices; the master weights stay fp32; {step}):"]
    for name, (nbytes, seconds) in precisions.items():
        mark = "  <- this plan" if name == chosen else ""
        lines.append(
            f"  {name:<6}{nbytes / 1e9:>9.1f} GB of state{seconds:>10.2f} s{fp32_s / seconds:>8.2f}x fp32's{mark}"
        )
    lines.append("  (their training quality against fp32's: docs/benchmarks.md; plan with one: --state-precision)")
    return lines


#: What each strategy argument of a snippet does, written above it (a planner adds or replaces what depends on its
#: plan).
ARGUMENT_COMMENTS = {
    "sub_group_size": "elements per ZeRO sub-group, the unit of work of a device",
    "buffer_count": "chunk buffers per device",
    "state_memory_budget": "host RAM for fp32 master and optimizer state (the memory tier)",
    "state_accelerator_budget": "GPU memory for optimizer state (the accelerator tier), filled first",
    "state_precision": "Adam's moments in fewer bytes on the devices (the master weights stay fp32)",
    "split_masters": "2.125 bytes per fp32 master on the devices, the rest in the bf16 parameters in host memory",
}
#: ``offload_parameters="storage"``'s comment.
PARAMETERS_ON_STORAGE = "16-bit parameters in files on the first storage path, read a layer ahead"


def _comments(plan: Plan) -> dict[str, str]:
    """One comment per argument of :func:`strategy_args`, shared by the Python and YAML snippets."""
    return {
        **ARGUMENT_COMMENTS,
        "storage_paths": "one directory per device / SSD: replace the placeholders with yours",
        "device_weights": "relative speed of each device: sub-groups are shared out in proportion",
        "compression": f"SmartComp: send the largest {plan.compression * 100:g}% of each sub-group's gradient entries",
        "overlap_backward": "compressed gradients reach the devices after backward, not during it",
        "offload_parameters": PARAMETERS_ON_STORAGE,
    }


def size_text(nbytes: int) -> str:
    """``nbytes`` as the strategy reads sizes: ``"79GiB"``, ``"512MiB"``, ``"2GB"``, else the int's digits."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("GB", 10**9), ("MB", 10**6)):
        if nbytes and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(int(nbytes))


def _python_value(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 10_000:
        return f"{value:_}"
    if isinstance(value, str):
        return json.dumps(value)  # a valid Python string literal, quotes and backslashes escaped
    return repr(value)


def python_code(args: dict[str, Any], comments: dict[str, str]) -> str:
    """Python that builds ``SmartInfinityStrategy(**args)``, each argument under its comment."""
    lines = ["from lightning_smartinf import SmartInfinityStrategy", "", "strategy = SmartInfinityStrategy("]
    for name, value in args.items():
        lines.append(f"    # {comments[name]}")
        if isinstance(value, list):
            inline = f"    {name}=[{', '.join(map(_python_value, value))}],"
            if len(inline) <= 100:
                lines.append(inline)
            else:
                lines += [f"    {name}=[", *(f"        {_python_value(v)}," for v in value), "    ],"]
        else:
            lines.append(f"    {name}={_python_value(value)},")
    lines.append(")")
    return "\n".join(lines)


def python_snippet(plan: Plan) -> str:
    """Python that builds the recommended ``SmartInfinityStrategy`` (paste into a training script)."""
    return python_code(strategy_args(plan), _comments(plan))


#: Plain YAML scalars that stay strings (``80GiB``, ``/mnt/nvme0``); anything else (``true``, ``1e5``, ``0x10``,
#: ``a: b``, ``#x``) is written quoted.
_PLAIN = re.compile(r"[A-Za-z0-9_/][A-Za-z0-9_./+-]*")
_YAML_WORDS = {"true", "false", "yes", "no", "on", "off", "null", "y", "n"}


def _plain(text: str) -> bool:
    """Whether YAML 1.1 reads ``text`` back as this string, unquoted."""
    if not _PLAIN.fullmatch(text) or text.lower() in _YAML_WORDS or text[:2].lower() in ("0x", "0o", "0b"):
        return False
    try:
        float(text)
    except ValueError:
        return True
    return False


def _yaml_scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        text = repr(value)
        # YAML 1.1 (PyYAML, jsonargparse) reads `1e-05` as a string: give the mantissa a dot.
        mantissa, e, exponent = text.partition("e")
        return f"{mantissa}.0e{exponent}" if e and "." not in mantissa else text
    if isinstance(value, str) and not _plain(value):
        return json.dumps(value)  # a double-quoted YAML scalar
    return str(value)


def yaml_code(args: dict[str, Any], comments: dict[str, str]) -> str:
    """The ``trainer.strategy`` of a ``smartinf fit`` recipe (LightningCLI) with ``args``, each under its comment."""
    lines = [
        "trainer:",
        "  strategy:",
        "    class_path: lightning_smartinf.SmartInfinityStrategy",
        "    init_args:",
    ]
    for name, value in args.items():
        lines.append(f"      # {comments[name]}")
        if isinstance(value, list):
            lines.append(f"      {name}:")
            lines += [f"        - {_yaml_scalar(item)}" for item in value]
        else:
            lines.append(f"      {name}: {_yaml_scalar(value)}")
    return "\n".join(lines)


def yaml_snippet(plan: Plan) -> str:
    """The ``trainer.strategy`` of a ``smartinf fit`` recipe (LightningCLI) with the recommended arguments."""
    return yaml_code(strategy_args(plan), _comments(plan))
