"""Where the planner puts the optimizer state: GPU memory and host memory up to their budgets, the rest over the
devices by speed.

The same rules as the strategy's placement (:class:`~lightning_smartinf.core.placement.TieredPlacement`), in the
planner's units. The accelerator tier fills its budget first: its update is bound by the GPU link, which carries only
the 16-bit gradient in and the 16-bit parameter out (4 B per 12 B of state). Then, as ``state_memory_share="auto"``
decides:

- Emulated devices (the ``cpu`` backend: the update runs on the host cores, plus storage I/O) training on the CPU share
  the host cores with forward and backward, so the memory tier fills its budget. With ``overlap_backward`` they
  stream their state during the last micro-batch's backward, whose gradients complete as it runs, at the share of
  their rate calibration measured them keep beside training (``device_rate_share_training_by_precision``), and their
  update's arithmetic there takes its share of the host's cores from backward, which lasts that much longer
  (:func:`cpu_overlap`). After backward the devices and the memory tier share the cores: the CPU seconds they have
  left, over the cores, bound the update too (beside a GPU as well).
- Emulated devices beside a GPU start each sub-group's update as backward completes its gradient
  (``overlap_backward``) on host cores the GPU leaves free, so ``backward_s * rate`` bytes of their update hide behind
  backward. Memory takes the share that finishes with what is left of theirs after backward:
  ``memory_share(budget, state - hidden, ...)``, none when all of it hides.
- SmartSSDs compute on their own, in parallel with the host (after backward: they take no hand-offs), so memory takes
  the share that finishes with them (:func:`memory_share`).
- Beside remote servers (a profile with ``network_gbps``) the strategy's split is fixed when it starts, at the share
  one more server would hold (:mod:`~lightning_smartinf.core.tiers.tiered`), and so is the plan's.

The strategy decides the same from measured rates and from when each gradient was complete
(:mod:`~lightning_smartinf.core.tiers.update_model`); the plan assumes backward completes the state at an even pace.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_smartinf.core.placement import memory_share
from lightning_smartinf.plan.cost_model import GB, PlanError, Profile, Workload, cpu_backward_time, fwd_bwd_time

__all__ = ["TierPlacement", "cpu_overlap", "memory_share", "place_state"]


@dataclass(frozen=True)
class TierPlacement:
    """The state's placement and the update phase it predicts (seconds per step, the slowest tier's)."""

    state_bytes: float
    memory_bytes: float
    device_bytes: tuple[float, ...]
    update_s: float
    all_on_device_s: float
    accelerator_bytes: float = 0.0
    #: Seconds of backward the devices' update overlaps (0: it starts after backward).
    backward_s: float = 0.0
    #: Seconds the devices' update adds to backward by sharing the host's cores with it (CPU training), inside
    #: ``update_s``.
    shared_cores_s: float = 0.0
    #: The share of their rate alone the devices keep during those seconds of backward (CPU training: measured).
    backward_rate_share: float = 1.0
    #: Seconds the CPU work left after backward takes over the host's cores (the devices' arithmetic and the memory
    #: tier's step; 0: not modelled), inside ``update_s`` where it is the longest.
    cores_after_s: float = 0.0

    def describe(self, budget_text: str, accelerator_text: str | None = None) -> str:
        """One paragraph for ``smartinf plan``."""
        shares = ", ".join(f"{b / GB:.1f}" for b in self.device_bytes)
        gpu = ":"
        if accelerator_text is not None:
            gpu = (
                f" and state_accelerator_budget={accelerator_text}: {self.accelerator_bytes / GB:.1f} GB in GPU memory "
                f"({self.accelerator_bytes / max(self.state_bytes, 1):.0%}),"
            )
        at = f" at {self.backward_rate_share:.0%} of their rate" if self.backward_rate_share < 1 else ""
        after = (
            f" after backward (the devices' update overlaps its {self.backward_s:.2f} s{at})" if self.backward_s else ""
        )
        notes = []
        if self.shared_cores_s:
            notes.append(
                f"of which {self.shared_cores_s:.2f} s is backward's longer on the cores the devices share with it"
            )
        if self.cores_after_s and self.cores_after_s >= self.update_s - self.shared_cores_s - 1e-9:
            notes.append(
                f"after backward the host's cores bound it: the devices' and the memory tier's arithmetic takes "
                f"{self.cores_after_s:.2f} s of them"
            )
        shared = f" ({'; '.join(notes)})" if notes else ""
        ratio = f" ({self.all_on_device_s / self.update_s:.2f}x)" if self.update_s > 0 else ""
        return (
            f"placement with state_memory_budget={budget_text}{gpu} {self.memory_bytes / GB:.1f} of "
            f"{self.state_bytes / GB:.1f} GB of optimizer state in host memory "
            f"({self.memory_bytes / max(self.state_bytes, 1):.0%}), devices hold {shares} GB; optimizer update{after} "
            f"{self.update_s:.2f} s per step{shared} against {self.all_on_device_s:.2f} s with all of it on the "
            f"devices{ratio}"
        )


def place_state(
    work: Workload,
    prof: Profile,
    devices: int,
    memory_budget: float,
    weights: Sequence[float] | None = None,
    accelerator_budget: float = 0,
    *,
    fill: bool = False,
    overlap_backward: bool = True,
    fwd_bwd_s: float | None = None,
) -> TierPlacement:
    """Place ``work``'s state (:attr:`~.cost_model.Workload.state_bytes` per parameter) in an
    ``accelerator_budget`` of GPU memory, a ``memory_budget`` of host memory and over ``devices``.

    A device's time is its share of the state read and written at its SSD's speeds (the update hides behind that
    I/O, as in the SU+O model), or its update if slower; the memory tier's is its share updated at the host's rate.
    ``weights``: the devices' relative speeds (``None``: equal, as identical devices are). ``fill``: memory takes its
    whole budget (``state_memory_share="fill"``). ``overlap_backward=False``: emulated devices start after backward.
    ``fwd_bwd_s``: forward and backward, when the caller models them (default: :func:`fwd_bwd_time`).
    """
    if memory_budget < 0:
        raise PlanError(f"`--memory-budget` must be >= 0 bytes, got {memory_budget:g}.")
    if accelerator_budget < 0:
        raise PlanError(f"`--accelerator-budget` must be >= 0 bytes, got {accelerator_budget:g}.")
    if accelerator_budget and prof.gpu_link_gbps is None:
        raise PlanError(
            f"`--accelerator-budget` keeps state in GPU memory, but profile {prof.name!r} has no GPU "
            "(`gpu_link_gbps`). Choose a profile with one, or drop the budget."
        )
    weights = tuple(weights) if weights is not None else (1.0,) * devices
    # `0 < w < inf` refuses NaN too: every rate below is a finite share of the fastest device's.
    if len(weights) != devices or not all(0 < w < math.inf for w in weights):
        raise PlanError(f"`--device-weights` needs {devices} finite numbers > 0 (one per device), got {list(weights)}.")
    per_param = work.state_bytes
    total = per_param * work.params
    accelerator = min(accelerator_budget, total)
    # The GPU link carries the 16-bit gradient in and parameter out: 2 * transfer_bytes per parameter's state.
    accelerator_rate = (prof.gpu_link_gbps or 0) * GB * per_param / (2 * prof.transfer_bytes)
    state = total - accelerator
    read, write = prof.device_io_rates(devices)
    cost = prof.update_cost(work.state_precision)
    update = prof.device_update_gparams_per_s * 1e9 / cost * per_param
    # State bytes per second each device updates: its I/O at its weight's share of the nominal speed.
    unit = 1 / max(1 / read + 1 / write, 1 / update)
    rates = [unit * w / max(weights) for w in weights]
    memory_rate = prof.memory_update_rate(work.state_precision) * per_param
    emulated = not prof.gradient_staged_on_ssd and prof.network_gbps is None
    # Emulated devices beside a GPU update during the step's last backward (2 of 3 parts of forward + backward).
    with_gpu = emulated and prof.gpu_peak_tflops is not None
    on_cpu = emulated and not with_gpu
    fwd_bwd_s = fwd_bwd_time(work, prof) if fwd_bwd_s is None else fwd_bwd_s
    # Only the last micro-batch's backward completes gradients: the ones before it only add to them.
    backward_s = 2 / 3 * fwd_bwd_s / work.accumulate if with_gpu and overlap_backward else 0.0
    if fill or on_cpu:  # on the CPU, devices and memory share the host cores: fill the budget
        memory = min(memory_budget, state)
    elif prof.network_gbps is not None:  # beside remote servers the strategy keeps one more server's share
        memory = memory_share(memory_budget, state, sum(rates) / len(rates), sum(rates))
    else:
        memory = memory_share(memory_budget, max(0.0, state - backward_s * sum(rates)), memory_rate, sum(rates))
    rest = state - memory
    device_bytes = tuple(rest * r / sum(rates) for r in rates)
    # What the devices' step costs the cores, seconds of one core per state byte (their update, hand-offs, I/O calls).
    seconds_per_byte = prof.device_cpu_seconds(work.state_precision) / per_param

    # Backward's threads and the devices' share the cores: the devices keep a measured share of their rate there.
    share = prof.device_rate_share_training(work.state_precision) if on_cpu and overlap_backward else 1.0

    def overlapped(on_devices: float) -> tuple[float, float]:
        if not (on_cpu and overlap_backward):
            return backward_s, 0.0
        streaming = share * sum(rates)
        return cpu_overlap(cpu_backward_time(work, prof), on_devices, streaming, seconds_per_byte, prof.cpu_cores)

    def cores_after_backward(on_devices: Sequence[float], backward: float, in_memory: float) -> float:
        """Emulated devices and the memory tier run on the host's cores after backward: their arithmetic there over
        the cores (0 where the cores are not known)."""
        if not emulated or prof.cpu_cores is None:
            return 0.0
        left = sum(max(0.0, b - r * share * backward) for b, r in zip(on_devices, rates))
        memory_cpu = in_memory / per_param * prof.memory_cpu_seconds(work.state_precision)
        return (left * seconds_per_byte + memory_cpu) / prof.cpu_cores

    backward_s, shared_s = overlapped(rest)
    device_s = max(max(0.0, b / r - share * backward_s) for b, r in zip(device_bytes, rates))
    # The tiers run at once, on the cores they share; the step waits for the slowest, or for the cores.
    accelerator_s = accelerator / accelerator_rate if accelerator else 0.0
    cores_s = cores_after_backward(device_bytes, backward_s, memory)
    update_s = max(device_s, memory / memory_rate, accelerator_s, cores_s) + shared_s
    all_backward_s, all_shared_s = overlapped(total)
    all_on_device = tuple(total * r / sum(rates) for r in rates)
    all_on_device_s = max(
        max(0.0, total / sum(rates) - share * all_backward_s), cores_after_backward(all_on_device, all_backward_s, 0.0)
    )
    all_on_device_s += all_shared_s
    return TierPlacement(
        total, memory, device_bytes, update_s, all_on_device_s, accelerator, backward_s, shared_s, share, cores_s
    )


def cpu_overlap(
    backward_s: float, state_bytes: float, rate: float, seconds_per_byte: float, cores: int | None
) -> tuple[float, float]:
    """CPU training with ``overlap_backward``: how long the devices' update overlaps backward, and how much longer
    backward takes for it. The devices stream ``state_bytes`` at ``rate`` state bytes per second from the start of
    the last micro-batch's backward (``backward_s`` alone); their arithmetic, ``seconds_per_byte`` of one core per
    state byte, runs on the ``cores`` backward uses, so backward stretches by the devices' core-seconds over the cores
    (all of their update when it finishes within backward). ``cores=None``: not modelled, nothing stretches."""
    if cores is None or backward_s <= 0:
        return backward_s, 0.0
    share = rate * seconds_per_byte / cores  # of the cores the devices take while they stream
    stretched = backward_s / (1 - share) if share < 1 else math.inf
    if stretched * rate > state_bytes:  # the devices finish within backward: all of their arithmetic stretches it
        stretched = backward_s + state_bytes * seconds_per_byte / cores
    return stretched, stretched - backward_s
