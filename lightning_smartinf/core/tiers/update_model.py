"""How long the update phase of a step lasts under a placement: the model the memory tier's share is chosen by.

Backward completes the sub-groups' gradients one after another. A storage device that takes hand-offs during
backward (``overlap_backward``) starts each of its shards as soon as its gradient is complete, so part of its work
hides behind backward; the memory and accelerator tiers never take hand-offs and start at the step. Every device
works through its shards in turn at its own rate, all devices at once, and the step waits for the last. So:

- a shard's update takes ``2 * state_bytes / rate`` seconds on its device (its state read and written once; rates
  are state bytes read and written per second of update, as :meth:`StreamingBackend.update_rates` measures them);
- a device starts a shard at the later of the shard's start and the end of its previous shard, in order of start;
- the update phase is the time from the step's start until the last device is done (0 when all of it hid).

Example: a device at 2 B/s holding two 1-byte shards completed 3 s and 2 s before the step has both done by then
(1 s each), while memory at 4 B/s holding one 1-byte shard needs 0.5 s after it::

    >>> update_tail([0, 0, 1], sizes=[1, 1, 1], rates=[2.0, 4.0], early=[True, False], ready={0: 3.0, 1: 2.0})
    0.5
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence

__all__ = ["best_share", "memory_candidates", "update_tail"]

#: At most this many shares are predicted per re-plan (about one more than this many): beyond it, every k-th prefix.
MAX_CANDIDATES = 256
#: Predicted update phases within this fraction of the shortest count as equal: the one nearest the current
#: share is chosen, so a re-plan does not move state for a gain the measurements cannot tell from noise.
TIE = 0.03


def update_tail(
    assignment: Sequence[int],
    sizes: Sequence[int],
    rates: Sequence[float],
    early: Sequence[bool],
    ready: Mapping[int, float],
) -> float:
    """Seconds from the step's start until every device has updated its shards.

    Args:
        assignment: the device of each shard.
        sizes: each shard's state bytes.
        rates: each device's update rate, state bytes read and written per second (positive).
        early: whether each device takes shards as backward completes their gradients (hand-offs).
        ready: seconds before the step's start that backward completed each shard's gradient (missing: at the
            start). Only devices that take hand-offs start early.
    """
    pending: list[list[tuple[float, int]]] = [[] for _ in rates]
    for shard, device in enumerate(assignment):
        start = -ready.get(shard, 0.0) if early[device] else 0.0
        pending[device].append((start, shard))
    tail = 0.0
    for device, shards in enumerate(pending):
        done = -math.inf
        for start, shard in sorted(shards):
            done = max(done, start) + 2 * sizes[shard] / rates[device]
        tail = max(tail, done)
    return tail


def memory_candidates(sizes: Sequence[int], budget: int, limit: int = MAX_CANDIDATES) -> list[int]:
    """The memory shares that give different placements when memory fills in index order: none, each prefix of
    ``sizes`` (the shards it may hold, in index order) within ``budget``, and ``budget`` itself; every k-th prefix
    when there are more than ``limit``."""
    prefixes = list(itertools.takewhile(lambda held: held <= budget, itertools.accumulate(sizes)))
    step = max(1, math.ceil(len(prefixes) / limit))
    shares = [0, *prefixes[step - 1 :: step]]
    if shares[-1] != budget:
        shares.append(budget)
    return shares


def best_share(candidates: Sequence[int], tail: Callable[[int], float], current: int) -> tuple[int, float]:
    """The candidate share whose predicted update phase (``tail``) is shortest, and that phase.

    Phases within :data:`TIE` of the shortest are equal: of those, the share nearest ``current`` wins, then the
    larger (less storage I/O).
    """
    predicted = {share: tail(share) for share in candidates}
    shortest = min(predicted.values())
    equal = [share for share, t in predicted.items() if t <= shortest * (1 + TIE) + 1e-9]
    share = min(equal, key=lambda s: (abs(s - current), -s))
    return share, predicted[share]
