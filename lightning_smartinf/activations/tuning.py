"""Settings of activation offload chosen from the model and from measurements (after SSDTrain's adaptive keep).

:class:`LayerMeter` times each repeated layer's forward and records the sizes of the tensors it saves; after a
measured micro-batch, :func:`tune` turns that and the offloader's I/O clocks into the settings the user left to
``None``, using the cost model of :mod:`lightning_smartinf.activations.costs`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from lightning_smartinf.activations.costs import OVERHEAD_BUDGET, PREDICTION_MARGIN, IOCosts, Overhead, offload_overhead

__all__ = [
    "LayerMeter",
    "Tuning",
    "tune",
    "MEASURE_AT",
    "MEASURE_COUNT",
    "RECHECK_COUNT",
    "MOST_KEPT",
    "DEFAULTS",
    "MIN_THRESHOLD",
    "MIN_BUDGET",
]

#: The micro-batches whose measurements choose the automatic settings: from the third (the first two pay for
#: warm-up: the spill files grow, the allocator settles), this many; layer times averaged, I/O costs their median.
MEASURE_AT = 3
MEASURE_COUNT = 4
#: The micro-batches after the choice whose median time re-checks it once against the model.
RECHECK_COUNT = 3
#: The largest share of the layers the automatic ``keep_last`` keeps in memory.
MOST_KEPT = 0.25
#: Candidate in-flight budgets, in multiples of the largest layer's offloaded bytes.
BUDGET_LAYERS = (1.0, 1.5, 2.0)
#: The settings used until then: ``threshold_bytes``, ``keep_last``, ``max_inflight_bytes``.
DEFAULTS = {"threshold_bytes": 1 << 20, "keep_last": 1, "max_inflight_bytes": 64 << 20}
#: No tensor under this is offloaded: its per-request cost would outweigh the memory it frees.
MIN_THRESHOLD = 64 << 10
#: The smallest automatic in-flight budget.
MIN_BUDGET = 8 << 20


class LayerMeter:
    """Over the measured micro-batches: each layer's forward seconds and the tail's (the forward after the last layer,
    up to the first unpack of backward), averaged; the sizes of the dense tensors each layer saved in the first."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self.micro_batches = 0
        self._forward_s = [0.0] * layers
        self._tail_s = 0.0
        self.sizes: list[list[int]] = [[] for _ in range(layers)]
        self._began: float | None = None
        self._ended: float | None = None

    def start(self) -> None:
        """A measured micro-batch begins."""
        self.micro_batches += 1
        self._began = self._ended = None

    @property
    def forward_s(self) -> list[float]:
        return [f / max(1, self.micro_batches) for f in self._forward_s]

    @property
    def tail_s(self) -> float:
        return self._tail_s / max(1, self.micro_batches)

    def enter(self, layer: int) -> None:
        self._began = time.perf_counter()

    def leave(self, layer: int) -> None:
        now = time.perf_counter()
        if self._began is not None:
            self._forward_s[layer] += now - self._began
        self._began, self._ended = None, now

    def saved(self, layer: int, nbytes: int) -> None:
        """A dense tensor of ``nbytes`` saved in forward by ``layer`` (-1: before the first, counted with it)."""
        if nbytes >= MIN_THRESHOLD and layer < self.layers and self.micro_batches == 1:
            self.sizes[max(layer, 0)].append(nbytes)

    def backward_started(self) -> None:
        """The first unpack of a measured micro-batch (once per :meth:`start`): the tail ends."""
        if self._ended is not None:
            self._tail_s += time.perf_counter() - self._ended


@dataclass(frozen=True)
class Tuning:
    """The settings in force after measuring, what the model predicts for them, and why they were chosen."""

    threshold_bytes: int
    keep_last: int
    max_inflight_bytes: int
    predicted: Overhead
    io: IOCosts
    #: The share of the step offload may add (``overhead_budget``).
    budget: float = OVERHEAD_BUDGET
    #: Bytes of saved activations per micro-batch, and those the settings leave in memory (the in-flight budget
    #: counted where anything is offloaded).
    saved_bytes: int = 0
    held_bytes: int = 0
    #: The settings were held back from the most memory-saving ones to keep the budget (more layers kept, a higher
    #: threshold), or offload nothing; ``given``: the user gave every setting.
    held_back: bool = False
    given: bool = False

    @property
    def saving(self) -> float:
        """The share of the saved activations' bytes that leaves memory."""
        return 1 - self.held_bytes / self.saved_bytes if self.saved_bytes else 0.0

    @property
    def offloads_nothing(self) -> bool:
        return self.predicted.offloaded_bytes == 0

    def describe(self, layers: int) -> str:
        p = self.predicted
        return (
            f"keep_last={self.keep_last} of {layers} layers, threshold_bytes={self.threshold_bytes}, "
            f"max_inflight_bytes={self.max_inflight_bytes}: {p.offloaded_bytes / 1e6:.1f} MB per micro-batch leave "
            f"memory ({self.saving:.0%} of the saved activations) at a predicted {p.share:.1%} of a {p.step_s:.3f} s "
            f"step, budget {self.budget:.0%} (writes {self.io.write_bytes_per_s / 1e9:.2f} GB/s, reads "
            f"{self.io.read_bytes_per_s / 1e9:.2f} GB/s, {self.io.cpu_s_per_byte * 1e12:.0f} ms of CPU per GB"
            + (", on the cores compute uses)" if self.io.compute_on_host else ")")
        )


def tune(
    forward_s: list[float],
    tail_s: float,
    sizes: list[list[int]],
    io: IOCosts,
    threshold_bytes: int | None,
    keep_last: int | None,
    max_inflight_bytes: int | None,
    budget: float = OVERHEAD_BUDGET,
    extra_s_per_byte: float = 0.0,
) -> Tuning:
    """The user's settings where given; the others from the layers' forward seconds ``forward_s``, the forward after
    them ``tail_s``, the sizes of the tensors each layer saves ``sizes`` (a :class:`LayerMeter`'s), and ``io``, so
    that offload adds at most ``budget`` of the step.

    Candidates: ``threshold_bytes`` a sixteenth of the largest tensor a layer saves (its activations leave memory,
    its small statistics stay), a quarter, a half, or all of it (each higher one offloads fewer tensors), at least
    :data:`MIN_THRESHOLD`; ``keep_last`` from none of the layers to a quarter of them (:data:`MOST_KEPT`), then a
    half, three quarters and all of them (nothing offloaded); ``max_inflight_bytes`` the budgets of
    :data:`BUDGET_LAYERS` (at least :data:`MIN_BUDGET`). The choice: of those predicted to cost at most
    :data:`~lightning_smartinf.activations.costs.PREDICTION_MARGIN` of ``budget``, the one that leaves the least in
    memory; where none does (only when the user fixed some settings), the cheapest. ``extra_s_per_byte``: seconds a
    step was measured to add per offloaded byte beyond the model's prediction (:meth:`SavedTensorOffloader` re-checks
    its choice once against the measured step).
    """
    largest = max((n for layer in sizes for n in layer), default=0)
    saved = sum(sum(layer) for layer in sizes)
    layers = len(sizes)
    thresholds = (
        [threshold_bytes]
        if threshold_bytes is not None
        else sorted({max(MIN_THRESHOLD, largest // k) for k in (16, 4, 2, 1)})
    )
    keeps = (
        [keep_last]
        if keep_last is not None
        else sorted(set(range(int(layers * MOST_KEPT) + 1)) | {layers // 2, 3 * layers // 4, layers})
    )
    target = budget * PREDICTION_MARGIN
    options = []
    for threshold in thresholds:
        nbytes = [sum(n for n in layer if n >= threshold) for layer in sizes]
        biggest = max(nbytes, default=0)
        budgets = (
            [max_inflight_bytes]
            if max_inflight_bytes is not None
            else sorted({max(MIN_BUDGET, int(k * biggest)) for k in BUDGET_LAYERS})
        )
        for in_flight in budgets:
            for keep in keeps:
                predicted = offload_overhead(forward_s, nbytes, keep, io, in_flight, tail_s)
                share = predicted.share + (
                    extra_s_per_byte * predicted.offloaded_bytes / predicted.step_s if predicted.step_s > 0 else 0.0
                )
                # What stays in memory: the bytes not offloaded, and the in-flight budget (none where nothing is).
                held = saved - predicted.offloaded_bytes + min(in_flight, predicted.offloaded_bytes)
                fits = share <= target
                options.append((not fits, held if fits else share, share, threshold, keep, in_flight, predicted, held))
    *_, threshold, keep, in_flight, predicted, held = min(options, key=lambda o: o[:3])
    offloaded = predicted.offloaded_bytes
    given = threshold_bytes is not None and keep_last is not None and max_inflight_bytes is not None
    # Held back: more layers kept than the most-saving range, a threshold above the lowest, or nothing offloaded.
    held_back = not given and (keep > int(layers * MOST_KEPT) or threshold > thresholds[0] or offloaded == 0)
    return Tuning(threshold, keep, in_flight, predicted, io, budget, saved, held, held_back, given)
