"""A profile of the ``local-nvme`` kind: one server, the ``cpu`` backend, state on its own NVMe paths.

The other profiles (:class:`~lightning_smartinf.plan.cost_model.Profile`) describe a testbed of SmartSSDs for the
paper's comparisons. A :class:`Machine` describes what the strategy's settings act on, on a server with a GPU (or
none), a few hundred GB of RAM and one to four ordinary NVMe SSDs:

- each storage path, its read and write bandwidth alone, and the physical disk it is on (paths on one disk share its
  bandwidth); all paths streaming at once (``together_read_write_gbps``), since training reads and writes the state
  on every path at the same time;
- host RAM, and how much of it may hold optimizer state (``state_memory_gb``; ``None``: what the run leaves free);
- the host's update rates: one device's (a worker thread streaming its paths' state) and the memory tier's;
- the GPU: its memory, the pinned host <-> device copy bandwidth and its matmul rate; or none (CPU training).

``smartinf plan --calibrate PATH [PATH ...]`` measures one (:mod:`~lightning_smartinf.plan.calibrate`);
:mod:`~lightning_smartinf.plan.machine_plan` turns one into settings. Arithmetic only, like the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from lightning_smartinf.core.arguments import Problems
from lightning_smartinf.plan.cost_model import PlanError, Profile, check_by_precision, check_rates, read_profile

__all__ = ["MACHINE_KIND", "Gpu", "Machine", "StoragePath", "load_any"]

#: How far the paths' rate may move between the start and the end of a calibration before the plan says so.
DISK_SWING = 0.2
#: The ``kind`` of a machine profile in its JSON.
MACHINE_KIND = "local-nvme"
#: A machine's figures of the steps measured end to end, which ran the rule without a fused optimizer.
_STEP_BY_PRECISION = (
    "device_step_cpu_s_per_gparam_by_precision",
    "device_rate_share_training_by_precision",
    "memory_step_s_per_gparam_by_precision",
    "memory_step_cpu_s_per_gparam_by_precision",
)


def load_any(name_or_path: str | Path) -> Profile | Machine:
    """A packaged profile or a profile file: a :class:`Machine` for ``"kind": "local-nvme"``, else the model's
    :class:`Profile`."""
    data, origin = read_profile(name_or_path)
    if "kind" not in data:
        return Profile.from_dict(data, origin)
    if data["kind"] != MACHINE_KIND:
        raise PlanError(
            f"{origin}: `kind={data['kind']!r}` is unknown. A profile's kind is {MACHINE_KIND!r} (a server with local "
            "NVMe paths, written by `--calibrate`) or absent (the model's testbed profiles)."
        )
    return Machine.from_dict(data, origin)


@dataclass(frozen=True)
class StoragePath:
    """One storage path (a directory on a local disk): its bandwidths alone, in GB/s, and its disk."""

    path: str
    read_gbps: float
    write_gbps: float
    #: Reads and writes at once on this path alone, their sum; ``None``: one after the other, ``2rw / (r + w)``.
    read_write_gbps: float | None = None
    #: The physical disk (``nvme0n1``); paths naming the same disk share its bandwidth. ``None``: a disk of its own.
    disk: str | None = None
    #: Free space when described (``None``: unknown; the planner then looks at the path if it exists here).
    free_gb: float | None = None

    @property
    def state_gbps(self) -> float:
        """Bytes per second (in GB/s) of state this path streams in and out together, reads plus writes."""
        if self.read_write_gbps is not None:
            return self.read_write_gbps
        return 2 * self.read_gbps * self.write_gbps / (self.read_gbps + self.write_gbps)


@dataclass(frozen=True)
class Gpu:
    """The GPU the model trains on."""

    name: str
    memory_gb: float
    #: Pinned host <-> device copies, the slower direction (ZeRO-3's parameter fetches, gradients, updated parameters).
    link_gbps: float
    #: Dense bf16 matmul rate: measured by ``--calibrate``, or the datasheet's dense figure.
    peak_tflops: float
    #: Share of ``peak_tflops`` a training step reaches.
    efficiency: float = 0.4


@dataclass(frozen=True)
class Machine:
    """One server for the ``cpu`` backend. Bandwidths in GB/s (1e9 B/s), memory in GB, rates in parameters per
    second; ``sources`` says where each number comes from and ``measured`` keeps what calibration saw."""

    name: str
    storage: tuple[StoragePath, ...]
    host_memory_gb: float
    #: One device's Adam(W) update: a worker thread over 1M-element chunks (``cpu`` backend).
    device_update_gparams_per_s: float
    #: The memory tier's Adam(W) update over state in RAM (``state_memory_budget``).
    host_update_gparams_per_s: float
    kind: str = MACHINE_KIND
    description: str = ""
    backend: str = "cpu"
    #: All paths streaming state at once, reads plus writes; ``None``: the sum over their disks.
    together_read_write_gbps: float | None = None
    #: The same from buffers of ordinary pages, as ZeRO-Infinity's swap buffers are (the devices' are huge pages where
    #: the OS gives them; a disk that splits a request of 4 KiB pages moves less): the comparison's disk rates are
    #: scaled by it over ``together_read_write_gbps``. ``None``: the same rates as the devices'.
    baseline_together_read_write_gbps: float | None = None
    #: Host RAM that may hold optimizer state; ``None``: what the run leaves free (the planner's count).
    state_memory_gb: float | None = None
    cpu_cores: int | None = None
    gpu: Gpu | None = None
    #: ZeRO-Infinity's host Adam (DeepSpeed's CPU-Adam: fused, vectorised, on every core) for the comparison;
    #: ``None``: ``host_update_gparams_per_s``.
    baseline_update_gparams_per_s: float | None = None
    #: CPU training (no GPU): the host's rate of forward and backward, FLOPs per second in TFLOPS, the faster of bf16
    #: and fp32 (``--calibrate`` times a stack of Llama blocks; ``None``: not measured, and the FLOPs not modelled).
    cpu_training_tflops: float | None = None
    #: CPU training: seconds per 1e9 parameters of ZeRO-3's host passes over each gradient in the step's last
    #: micro-batch and in each one before it, this project's (``cpu_reduce_*``) and stock ZeRO-3's
    #: (``baseline_cpu_reduce_*``), as ``--calibrate`` replays them; ``cpu_reduce_in_place_*``: this project's in a
    #: step of one micro-batch, whose linear weights' gradients are computed in ZeRO's buffer (0: not measured).
    cpu_reduce_s_per_gparam: float = 0.0
    cpu_reduce_in_place_s_per_gparam: float = 0.0
    cpu_reduce_accumulating_s_per_gparam: float = 0.0
    baseline_cpu_reduce_s_per_gparam: float = 0.0
    baseline_cpu_reduce_accumulating_s_per_gparam: float = 0.0
    #: CPU training: any more forward and backward time per micro-batch and 1e9 parameters.
    cpu_step_s_per_gparam: float = 0.0
    #: Bytes per element of the gradient and parameter copies (2: bf16/fp16).
    transfer_bytes: int = 2
    #: Each ``state_precision``'s update time per element relative to fp32's, as calibration measured it (a format
    #: left out: the planner's default).
    update_cost_by_precision: dict[str, float] = field(default_factory=dict)
    #: A device's and the memory tier's Adam(W) update with an optimizer built with ``fused=True`` (torch's fused
    #: kernel), and each format's cost with it over its fp32's; ``None`` / empty: as without.
    fused_update_gparams_per_s: float | None = None
    fused_update_cost_by_precision: dict[str, float] = field(default_factory=dict)
    #: One device's step and the memory tier's, each run for real by ``--calibrate`` with the rule as recipes build it
    #: (not fused), per ``state_precision``: the CPU seconds per 1e9 elements a device's step costs the cores (its
    #: update, hand-offs and I/O calls), the share of its rate a device's step keeps while CPU training runs on the
    #: cores, and the seconds and CPU seconds per 1e9 elements the memory tier's step takes. Empty: from the update
    #: rates above (a share of 1); with a fused optimizer they are not used.
    device_step_cpu_s_per_gparam_by_precision: dict[str, float] = field(default_factory=dict)
    device_rate_share_training_by_precision: dict[str, float] = field(default_factory=dict)
    memory_step_s_per_gparam_by_precision: dict[str, float] = field(default_factory=dict)
    memory_step_cpu_s_per_gparam_by_precision: dict[str, float] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    measured: dict[str, Any] = field(default_factory=dict)

    # ----------------------------------------------------------------------------------------------- JSON

    @classmethod
    def from_dict(cls, data: dict[str, Any], origin: str = "profile") -> Machine:
        """A machine from its JSON object; one :class:`PlanError` lists every problem."""
        problems = Problems(f"{origin} ({MACHINE_KIND} profile)", PlanError)
        known = {f.name for f in fields(cls)}
        problems.keys("profile", data, sorted(known | {"comment"}))
        for key, example in _REQUIRED.items():
            if key not in data:
                problems.add(
                    f"`{key}` is missing: add e.g. `{example}`, or write the profile with "
                    "`smartinf plan --calibrate PATH [PATH ...] -o profile.json`."
                )
        problems.choice("kind", data.get("kind", MACHINE_KIND), (MACHINE_KIND,))
        if data.get("backend", "cpu") != "cpu":
            problems.add(
                f"`backend={data['backend']!r}`: a {MACHINE_KIND} profile runs the update on host cores, so it must be "
                "'cpu'. SmartSSDs are modelled by the paper profiles (--profile paper-a5000)."
            )
        storage = _storage(problems, data.get("storage"))
        gpu = _gpu(problems, data.get("gpu"))
        # These must be numbers (a machine's own, not a limit); the other rates may be null (not measured).
        for key in _NUMBERS:
            problems.number(key, data.get(key, 1.0), low=0, above=True)
        check_rates(problems, {k: v for k, v in data.items() if k in known and k not in _NUMBERS})
        problems.number("state_memory_gb", data.get("state_memory_gb"), low=0, optional=True)
        problems.integer("cpu_cores", data.get("cpu_cores"), low=1, optional=True)
        check_by_precision(problems, data)
        problems.choice("transfer_bytes", data.get("transfer_bytes", 2), (2, 4))
        problems.raise_if_any()
        clean = {k: v for k, v in data.items() if k in known}
        return cls(**{**clean, "storage": storage, "gpu": gpu})

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["storage"] = [asdict(p) for p in self.storage]
        return data

    # ------------------------------------------------------------------------------------------ storage

    def disk_of(self, index: int) -> str:
        """The disk of path ``index`` (its own when the profile names none)."""
        return self.storage[index].disk or f"(disk of {self.storage[index].path})"

    def path_order(self) -> list[int]:
        """Path indices, the first path of each disk first (in the profile's order), then the others."""
        first = {self.disk_of(i): i for i in reversed(range(len(self.storage)))}  # each disk's lowest index
        return sorted(range(len(self.storage)), key=lambda i: first[self.disk_of(i)] != i)  # stable: profile order

    def _scale(self) -> float:
        """What all paths at once reach over the sum of their disks alone (1 without a measurement): below 1 where
        they share a controller or switch, above where one disk serves more requests in flight."""
        alone = self._disks_gbps(range(len(self.storage)))
        if self.together_read_write_gbps is None or alone <= 0:
            return 1.0
        return self.together_read_write_gbps / alone

    def _disks_gbps(self, indices: Sequence[int], rate: str = "state_gbps") -> float:
        """Sum over the disks of ``indices`` of each disk's fastest path alone (paths on one disk share it), by the
        paths' ``rate`` (a :class:`StoragePath` attribute: ``state_gbps``, ``read_gbps`` or ``write_gbps``)."""
        best: dict[str, float] = {}
        for i in indices:
            disk = self.disk_of(i)
            best[disk] = max(best.get(disk, 0.0), getattr(self.storage[i], rate))
        return sum(best.values())

    def _baseline_storage_scale(self) -> float:
        """ZeRO-Infinity's disk rates over the devices': what all paths at once reached from buffers of ordinary pages
        over what they reached from the devices' (1 without both measurements)."""
        if not self.baseline_together_read_write_gbps or not self.together_read_write_gbps:
            return 1.0
        return self.baseline_together_read_write_gbps / self.together_read_write_gbps

    def disk_swing(self) -> tuple[float, float] | None:
        """The paths' rate at once (GB/s) at the start and at the end of the calibration that wrote this profile,
        where they differ by more than :data:`DISK_SWING` of the start's; ``None`` otherwise or unmeasured."""
        start, end = self.measured.get("together_gbps_start"), self.measured.get("together_gbps_end")
        if not (isinstance(start, (int, float)) and isinstance(end, (int, float)) and start > 0):
            return None
        return (start, end) if abs(end / start - 1) > DISK_SWING else None

    def aggregate_gbps(self, indices: Sequence[int]) -> float:
        """State bytes per second (GB/s, reads plus writes) the paths ``indices`` stream together: their disks' sum,
        scaled by what the measurement of all paths at once showed."""
        return self._disks_gbps(indices) * self._scale()

    def path_rates(self, indices: Sequence[int]) -> list[float]:
        """Each path's state bandwidth when ``indices`` stream together (GB/s): its disk's share of the aggregate."""
        total = self.aggregate_gbps(indices)
        alone = [self.storage[i].state_gbps for i in indices]
        return [total * a / sum(alone) for a in alone]

    def to_profile(self, indices: Sequence[int], *, fused: bool = False) -> Profile:
        """The analytic model's :class:`Profile` for this machine training with the paths ``indices`` (``fused``: an
        optimizer built with ``fused=True``, whose update rates the profile measured apart).

        A device's state streams in and out at once; the model reads then writes (``12n/r + 12n/w``), so each path's
        read and write bandwidths are scaled to give its measured reads-plus-writes figure that way. Paths that share
        a disk (or a measured ceiling) get ``device_storage_ceiling_gbps``; the link is host memory.
        """
        paths = [self.storage[i] for i in indices]
        fastest = max(paths, key=lambda p: p.state_gbps)
        k = fastest.state_gbps / replace(fastest, read_write_gbps=None).state_gbps  # over read then write
        aggregate = self.aggregate_gbps(indices)
        shared = aggregate < 0.999 * sum(p.state_gbps for p in paths)
        scale = self._scale()
        gpu = self.gpu
        # The figures the profile names as the machine does carry over (dicts as copies), but for the ones below.
        same = ({f.name for f in fields(Profile)} & {f.name for f in fields(Machine)}) - {"gpu", "sources"}
        figures = {name: getattr(self, name) for name in same}
        # Devices and the memory tier run the same rule code: with a fused optimizer, both at its measured rate (the
        # steps measured end to end ran the rule without it).
        if fused and self.fused_update_gparams_per_s is not None:
            figures.update(
                device_update_gparams_per_s=self.fused_update_gparams_per_s,
                host_update_gparams_per_s=self.fused_update_gparams_per_s,
                update_cost_by_precision=self.fused_update_cost_by_precision,
                **dict.fromkeys(_STEP_BY_PRECISION, {}),
            )
        return Profile(
            **{name: dict(value) if isinstance(value, dict) else value for name, value in figures.items()},
            gpu=gpu.name if gpu else "none",
            gpu_peak_tflops=gpu.peak_tflops if gpu else None,
            gpu_efficiency=gpu.efficiency if gpu else 0.4,
            gpu_link_gbps=gpu.link_gbps if gpu else None,
            ssd_read_gbps=fastest.read_gbps * k,
            ssd_write_gbps=fastest.write_gbps * k,
            raid_read_ceiling_gbps=self._disks_gbps(indices, "read_gbps") * scale,
            raid_write_ceiling_gbps=self._disks_gbps(indices, "write_gbps") * scale,
            baseline_storage_scale=self._baseline_storage_scale(),
            shared_link_gbps=None,
            device_storage_ceiling_gbps=aggregate if shared else None,
            gradient_staged_on_ssd=False,
            max_devices=len(paths),
            # A device streams 1M-element chunks whatever the sub-group; its pool and staging are host memory.
            device_memory_gb=self.host_memory_gb,
            gradient_round_trip=True,
            baseline_pipelined=False,
            sources={
                **self.sources,
                "ssd_read_gbps": "the fastest path's read, scaled so that read then write gives its read+write figure",
                "device_storage_ceiling_gbps": "all paths at once, reads plus writes (null: their disks add up)",
            },
        )


# ---------------------------------------------------------------------------------------------------- checks

#: A machine profile's figures that must be numbers > 0 (others may be null: not measured).
_NUMBERS = ("host_memory_gb", "device_update_gparams_per_s", "host_update_gparams_per_s")
#: The keys a machine profile must have, each with an example value for the message that asks for it.
_REQUIRED = {
    "name": '"name": "my-server"',
    "storage": '"storage": [{"path": "/mnt/nvme0", "read_gbps": 3.0, "write_gbps": 2.5}]',
    "host_memory_gb": '"host_memory_gb": 256',
    "device_update_gparams_per_s": '"device_update_gparams_per_s": 0.3',
    "host_update_gparams_per_s": '"host_update_gparams_per_s": 1.5',
}


def _storage(problems: Problems, entries: Any) -> tuple[StoragePath, ...]:
    if entries is None:
        return ()
    if not isinstance(entries, list) or not entries:
        problems.add(
            f"`storage={entries!r}` must be a non-empty list of paths, each "
            '{"path": "/mnt/nvme0", "read_gbps": 3.0, "write_gbps": 2.5}.'
        )
        return ()
    known = {f.name for f in fields(StoragePath)}
    paths: list[StoragePath] = []
    for i, entry in enumerate(entries):
        within = problems.within("storage").within(i)
        if not problems.instance(f"storage[{i}]", entry, dict, "an object with `path`, `read_gbps`, `write_gbps`"):
            continue
        if not problems.keys(f"storage[{i}]", entry, sorted(known), required=("path", "read_gbps", "write_gbps")):
            continue
        ok = [within.number(k, entry[k], low=0, above=True) for k in ("read_gbps", "write_gbps")]
        ok.append(within.number("read_write_gbps", entry.get("read_write_gbps"), low=0, above=True, optional=True))
        ok.append(within.number("free_gb", entry.get("free_gb"), low=0, optional=True))
        if all(ok):
            paths.append(StoragePath(**entry))
    names = [p.path for p in paths]
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.add(f"storage path {name!r} is listed {names.count(name)} times; name each path once.")
    return tuple(paths)


def _gpu(problems: Problems, entry: Any) -> Gpu | None:
    if entry is None:
        return None
    required = ("name", "memory_gb", "link_gbps", "peak_tflops")
    allowed = "null (no GPU) or an object with `name`, `memory_gb`, `link_gbps`, `peak_tflops` (and `efficiency`)"
    within = problems.within("gpu")
    known = [f.name for f in fields(Gpu)]
    if not problems.instance("gpu", entry, dict, allowed) or not problems.keys("gpu", entry, known, required=required):
        return None
    ok = [within.number(k, entry[k], low=0, above=True) for k in required[1:]]
    ok.append(
        within.number("efficiency", entry.get("efficiency", 0.4), low=0, high=1, above=True, why="a share of the peak")
    )
    return Gpu(**entry) if all(ok) else None
