"""What activation offload costs a training step: a model of its stalls and its CPU time, and the settings it implies.

Pure Python (no torch). Units: seconds and bytes.

The step is a forward over the repeated layers, then a tail (head and loss), then backward in reverse order, each
layer's backward taking ``backward_factor`` times its forward. Offloading the first ``L - keep_last`` layers costs:

* **Forward stall**: one writer drains each layer's bytes at ``write_bytes_per_s`` from the end of that layer;
  forward blocks whenever the bytes produced and not yet written exceed the in-flight budget.
* **Backward stall**: one reader fetches layers in reverse order at ``read_bytes_per_s``, at most ``budget`` bytes
  ahead of backward; a layer's backward starts once its bytes are back. Bytes still being written when backward
  starts stay in memory and are never read.
* **CPU**: where compute runs on the host's cores (CPU training), the I/O takes CPU from compute, and compute waits
  for its slowest thread, so that time adds to the step. The I/O threads' own CPU time is measured; with the
  kernel's completion work (interrupts, charged to whichever thread they interrupt) and the wake-ups, the step grows
  by :data:`HOST_CPU_FACTOR` times that (``docs/benchmarks.md``). On a GPU the I/O runs on otherwise idle
  host cores and costs the step nothing.

:func:`lightning_smartinf.activations.tuning.tune` chooses the offloader's settings with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "AUTO_OVERHEAD",
    "BACKWARD_FACTOR",
    "HOST_CPU_FACTOR",
    "OVERHEAD_BUDGET",
    "PREDICTION_MARGIN",
    "IOCosts",
    "Overhead",
    "offload_overhead",
]

#: The share of the step activation offload may add (``overhead_budget``'s default).
OVERHEAD_BUDGET = 0.10
#: The share of the budget the automatic settings may be predicted to cost, so that with the model's error (measured
#: on the 2-core VM: the step's overhead 0.8 to 1.2 times the prediction) the step stays within the budget.
PREDICTION_MARGIN = 0.8
#: The predicted share the automatic settings aim at under the default budget (8%).
AUTO_OVERHEAD = OVERHEAD_BUDGET * PREDICTION_MARGIN
#: Backward over forward time of a layer (two matrix products per forward one).
BACKWARD_FACTOR = 2.0
#: Step seconds the I/O adds per CPU second of the I/O threads, where compute shares the cores. Measured on the
#: 2-core VM (``benchmarks/bench_activations.py``, three settings: 1.3 to 2.2): besides the threads' own time, the
#: kernel's completion work is charged to whichever thread it interrupts, and compute waits for its slowest thread.
HOST_CPU_FACTOR = 2.0
#: Pieces per layer in the model: a layer's saved tensors are produced, and used again, through its compute.
PIECES = 4


@dataclass(frozen=True)
class IOCosts:
    """Measured (or assumed) costs of moving activation bytes."""

    write_bytes_per_s: float
    read_bytes_per_s: float
    #: CPU seconds the I/O threads spend per byte moved (written or read).
    cpu_s_per_byte: float = 0.0
    #: Whether compute runs on the host cores that the I/O also uses.
    compute_on_host: bool = True


@dataclass(frozen=True)
class Overhead:
    """Predicted seconds added to one step, and the bytes that leave memory."""

    forward_stall_s: float
    backward_stall_s: float
    cpu_s: float
    offloaded_bytes: int
    step_s: float  # the step without offload

    @property
    def total_s(self) -> float:
        return self.forward_stall_s + self.backward_stall_s + self.cpu_s

    @property
    def share(self) -> float:
        """Added time as a share of the step without offload."""
        return self.total_s / self.step_s if self.step_s > 0 else 0.0


def _forward(piece_s: Sequence[float], piece_bytes: Sequence[int], budget: int, write_bps: float):
    """Forward over the pieces with its stalls: (forward seconds, each piece's write end time). A piece's bytes are
    produced when its compute ends; bytes produced and not yet written stay within the budget (one piece may exceed
    it alone)."""
    t = 0.0
    writer_free = 0.0
    done: list[float] = []
    for f, a in zip(piece_s, piece_bytes):
        t += f
        if not a:
            done.append(t)
            continue
        writer_free = max(writer_free, t) + a / write_bps
        done.append(writer_free)
        while True:
            pending = [(d, b) for d, b in zip(done, piece_bytes) if d > t]
            if len(pending) <= 1 or sum(b for _, b in pending) <= budget:
                break
            t = min(d for d, _ in pending)
    return t, done


def _backward_stall(
    piece_s: Sequence[float], read_bytes: Sequence[int], budget: int, read_bps: float, start_s: float
) -> float:
    """Seconds backward waits for its reads: pieces in reverse order, each needed when its backward (``piece_s``)
    starts and released when it ends; the reader runs at most ``budget`` bytes ahead of backward."""
    order = [k for k in reversed(range(len(piece_s))) if read_bytes[k]]
    held: dict[int, int] = {}  # piece -> bytes read (or being read) and not yet released
    ready: dict[int, float] = {}
    reader_free = 0.0

    def issue(now: float) -> None:
        nonlocal reader_free
        while order and (not held or sum(held.values()) + read_bytes[order[0]] <= budget):
            k = order.pop(0)
            reader_free = max(reader_free, now) + read_bytes[k] / read_bps
            ready[k], held[k] = reader_free, read_bytes[k]

    issue(0.0)
    t, stall = start_s, 0.0
    for k in reversed(range(len(piece_s))):
        if k in ready:
            wait = max(0.0, ready[k] - t)
            stall, t = stall + wait, t + wait
        t += piece_s[k]
        if held.pop(k, None) is not None:
            issue(t)
    return stall


def offload_overhead(
    forward_s: Sequence[float],
    nbytes: Sequence[int],
    keep_last: int,
    io: IOCosts,
    budget: int,
    tail_s: float = 0.0,
    backward_factor: float = BACKWARD_FACTOR,
) -> Overhead:
    """Predicted cost of offloading all but the last ``keep_last`` of the layers whose forward takes ``forward_s``
    and saves ``nbytes`` (eligible bytes per layer); ``tail_s`` is the forward after the layers (head, loss)."""
    if len(forward_s) != len(nbytes):
        raise ValueError(f"{len(forward_s)} layer times for {len(nbytes)} layer byte counts.")
    layers = len(forward_s)
    offloaded = max(0, layers - keep_last)
    compute = sum(forward_s)
    step = (compute + tail_s) * (1 + backward_factor)
    # Each layer as PIECES equal pieces: its saved tensors are produced, and used again, through its compute.
    piece_s = [f / PIECES for f in forward_s for _ in range(PIECES)]
    piece_bytes = [nbytes[i] // PIECES if i < offloaded else 0 for i in range(layers) for _ in range(PIECES)]
    fwd, done = _forward(piece_s, piece_bytes, budget, io.write_bytes_per_s)
    forward_end = fwd + tail_s
    # A piece written by the end of forward is read back in backward; one still being written stays in memory.
    read_bytes = [a if a and d <= forward_end else 0 for a, d in zip(piece_bytes, done)]
    stall = _backward_stall(
        [f * backward_factor for f in piece_s], read_bytes, budget, io.read_bytes_per_s, tail_s * backward_factor
    )
    moved = sum(piece_bytes) + sum(read_bytes)
    cpu = HOST_CPU_FACTOR * io.cpu_s_per_byte * moved if io.compute_on_host else 0.0
    return Overhead(
        forward_stall_s=max(0.0, fwd - sum(piece_s)),
        backward_stall_s=stall,
        cpu_s=cpu,
        offloaded_bytes=sum(piece_bytes),
        step_s=step,
    )
