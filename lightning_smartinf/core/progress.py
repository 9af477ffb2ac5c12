"""Progress of the package's long operations: a bar while they run, or one line when they end.

At the sizes this package exists for, much of a run is not training: writing the initial optimizer state (96 GB for
an 8B model), saving and loading checkpoints, re-sharding, exporting, building a token cache, loading pretrained
weights. Each is a :class:`Progress`, counted in bytes (or items) as it goes:

* **a bar** (tqdm, on stderr: what, how much, the rate and the time left) where bars are wanted (the Trainer's
  progress bar is on, or a ``smartinf`` command runs) and stderr is a terminal, once the operation has run for a
  second (a quick one shows nothing);
* otherwise **one line when it ends** (what, how much, how long, the rate) if it took a second or more, on the
  ``lightning_smartinf.progress`` logger at INFO, which writes to stderr unless the application configured logging
  itself. An operation that announces itself also says, before it starts, what it prepares and how big it is (from
  a gigabyte up): the first minute of a large run has a reason;
* **nothing** on any process but the first (global rank 0), or when progress is switched off:
  ``SMARTINF_PROGRESS=0`` in the environment, or :func:`configure` ``(enabled=False)``.

The Lightning layer calls :func:`configure` with the Trainer's progress-bar setting; this module knows nothing of
Lightning.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from lightning_smartinf.core.io.storage import readable_size

__all__ = ["Progress", "configure", "is_shown"]

log = logging.getLogger(__name__)
if not logging.getLogger().handlers and not log.handlers:
    # As Lightning does for its own logger: shown on stderr unless the application set logging up.
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(_handler)
    log.setLevel(logging.INFO)
    log.propagate = False


@dataclass
class _Settings:
    #: ``False``: nothing at all (also switched off by ``SMARTINF_PROGRESS=0``).
    enabled: bool = True
    #: Bars where stderr is a terminal; ``False``: the end lines only.
    bars: bool = True
    #: An operation shorter than this shows nothing (its bar appears after this long).
    min_seconds: float = 1.0
    #: An announcing operation of bytes says what it starts from this size up.
    announce_bytes: float = 1e9


_settings = _Settings()


def configure(
    *,
    enabled: bool | None = None,
    bars: bool | None = None,
    min_seconds: float | None = None,
    announce_bytes: float | None = None,
) -> None:
    """Switch progress on or off (``enabled``), and bars (``bars``: else one line per operation); show operations
    from ``min_seconds`` long, announce them from ``announce_bytes``. ``None`` keeps a setting as it is."""
    for name, value in (
        ("enabled", enabled), ("bars", bars), ("min_seconds", min_seconds), ("announce_bytes", announce_bytes)
    ):  # fmt: skip
        if value is not None:
            setattr(_settings, name, value)


def _rank_and_world() -> tuple[int, int]:
    """This process's global rank and the number of ranks: torch.distributed's once it is up (without importing it),
    else the launcher's ``RANK`` and ``WORLD_SIZE``."""
    torch_distributed = sys.modules.get("torch.distributed")
    if torch_distributed is not None and torch_distributed.is_available() and torch_distributed.is_initialized():
        return torch_distributed.get_rank(), torch_distributed.get_world_size()
    return int(os.environ.get("RANK", 0) or 0), int(os.environ.get("WORLD_SIZE", 1) or 1)


def is_shown() -> bool:
    """Whether this process shows progress at all: switched on, and global rank 0."""
    switched_off = os.environ.get("SMARTINF_PROGRESS", "1").strip().lower() in ("0", "off", "false", "no")
    return _settings.enabled and not switched_off and _rank_and_world()[0] == 0


class Progress:
    """One long operation (a context manager): ``update(n)`` as ``n`` more of ``total`` are done (from any thread).

    Args:
        what: what it does, as the bar and the line name it (``"saving the optimizer state"``).
        total: how much there is to do, in ``unit`` (``None``: not known beforehand).
        unit: ``"B"`` (bytes, shown in decimal units) or a count's unit (``"tensors"``, ``"files"``).
        announce: say before it starts what it prepares and how big it is (in line mode; a bar says it anyway).
        per_rank: each rank does its own share of it: with several ranks, the one shown (rank 0's) says it is a share.
    """

    def __init__(
        self, what: str, total: float | None, *, unit: str = "B", announce: bool = False, per_rank: bool = False
    ) -> None:
        if per_rank and (ranks := _rank_and_world()[1]) > 1:
            what = f"{what}, rank 0's share of {ranks} ranks"
        self.what, self.total, self.unit = what[:1].upper() + what[1:], total, unit
        self.done = 0.0
        self._lock = threading.Lock()
        self._started = time.perf_counter()
        self._shown = is_shown()
        self._bar: Any = None
        if not self._shown:
            return
        if _settings.bars and sys.stderr.isatty():
            from tqdm.auto import tqdm

            # Decimal prefixes for bytes and counts alike ("5.12MB", "2.81M tokens"); a count's unit is a word apart.
            self._bar = tqdm(
                total=total,
                desc=self.what,
                unit=unit if unit == "B" else f" {unit}",
                unit_scale=True,
                unit_divisor=1000,
                file=sys.stderr,
                dynamic_ncols=True,
                leave=True,
                delay=_settings.min_seconds,
            )
        elif announce and (unit != "B" or (total or 0) >= _settings.announce_bytes):
            size = f": {self._amount(total)}" if total is not None else ""
            log.info("%s%s ...", self.what, size)

    def _amount(self, amount: float | None) -> str:
        if amount is None:
            return "?"
        return readable_size(amount, decimal=True) if self.unit == "B" else f"{amount:,.0f} {self.unit}"

    def update(self, n: float) -> None:
        with self._lock:
            self.done += n
            if self._bar is not None:
                self._bar.update(n)

    def close(self, *, failed: bool = False) -> None:
        """End it: close the bar, or say in one line what was done, how long it took and at what rate."""
        if not self._shown:
            return
        self._shown = False
        if self._bar is not None:
            self._bar.close()
            return
        seconds = time.perf_counter() - self._started
        if failed or seconds < _settings.min_seconds:
            return
        rate = self.done / seconds if seconds > 0 else 0.0
        count = f"{rate:,.0f}" if rate >= 100 else f"{rate:.3g}"
        per_second = readable_size(rate, decimal=True) if self.unit == "B" else f"{count} {self.unit}"
        log.info(
            "%s: %s in %.1f s (%s/s)", self.what, self._amount(self.done), seconds,
            per_second,
        )  # fmt: skip

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(failed=exc_type is not None)
