"""Known-harmless warnings of our dependencies, silenced by exact message while SmartUpdate runs.

Each entry below is a warning or log record that a user of ``smart_infinity`` sees on every run, that says nothing
about their own code or settings, and that they can do nothing about. Each is matched by its exact message (and, for
warnings, its category and the module it is attributed to), never by a blanket ``ignore``; every other warning still
shows. :func:`silence` installs the filters and returns a handle that removes exactly them again: the strategy holds
one from set-up to teardown, and the ``smartinf`` entry points one for the whole command.
"""

from __future__ import annotations

import functools
import logging
import re
import warnings
from dataclasses import dataclass

from lightning_smartinf.core.io.storage import disk_of, readable_size


@dataclass(frozen=True)
class HarmlessWarning:
    """A ``warnings.warn`` call in a dependency: its message (a regex matched at the start), category, module."""

    message: str
    category: type[Warning]
    module: str
    why: str


@dataclass(frozen=True)
class HarmlessRecord:
    """A log record of a dependency: the logger it goes to and its message (a regex matched at the start)."""

    logger: str
    message: str
    why: str


WARNINGS = (
    HarmlessWarning(
        r"`torch\.distributed\.reduce_scatter_tensor` is deprecated",
        FutureWarning,
        r"torch\.distributed\.c10d_logger",
        "DeepSpeed's ZeRO-3 gradient reduction calls it once per micro-step (41 copies in the demo); only DeepSpeed "
        "can move to the new API.",
    ),
    HarmlessWarning(
        r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
        FutureWarning,
        r"torch\.distributed\.c10d_logger",
        "DeepSpeed's ZeRO-3 parameter gathering calls it; only DeepSpeed can move to the new API.",
    ),
    HarmlessWarning(
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        FutureWarning,
        r"lightning\.pytorch\.utilities\._pytree",
        "Lightning 2.6's own pytree helper uses torch's deprecated `LeafSpec`; only Lightning can change it.",
    ),
    HarmlessWarning(
        r"Since DeepSpeed handles gradient clipping internally, the default `LightningModule\.configure_gradient_cl",
        UserWarning,
        r"lightning\.pytorch\.strategies\.deepspeed",
        "Lightning's DeepSpeed strategy says an overridden `configure_gradient_clipping` will not clip; under "
        "`smart_infinity` its `clip_gradients` does clip (`SmartInfinityPrecision.clip_gradients`).",
    ),
)

RECORDS = (
    HarmlessRecord(
        "DeepSpeed",
        r"Offloading to NVMe can generate heavy write traffic",
        "DeepSpeed's async_io op says it at its first write, whatever the storage; SmartUpdate says it once, in its "
        "own words and with the bytes per step, when the storage is a real block device (`endurance_note`).",
    ),
    HarmlessRecord(
        "DeepSpeed",
        r"\*+ You are using ZeRO with an untested optimizer, proceed with caution",
        "DeepSpeed's own list of ZeRO optimizers lacks SGD (among others) that SmartUpdate runs and checks against "
        "`torch.optim`; the strategy sets `zero_allow_untested_optimizer` itself, so the line says nothing the user "
        "chose.",
    ),
)

#: Silenced by the ``smartinf`` entry points only (a user's own script keeps them: they are about its set-up).
ENTRY_POINT_RECORDS = (
    HarmlessRecord(
        "DeepSpeed",
        r"Setting accelerator to CPU\. If you have GPU or other accelerator, we were unable to detect it\.",
        "DeepSpeed's accelerator detection on a machine without CUDA, where CPU is what the entry point runs on.",
    ),
    HarmlessRecord(
        "lightning.pytorch.utilities.rank_zero",
        r"💡 Tip: For seamless cloud logging",
        "an advertisement for a logging service, printed by every Trainer built without one.",
    ),
)


def _keep(pattern: re.Pattern[str], record: logging.LogRecord) -> bool:
    """A log filter (``Logger.addFilter`` takes any callable): drops the records whose message ``pattern`` matches."""
    return pattern.match(record.getMessage()) is None


class Silenced:
    """Filters installed by :func:`silence`; :meth:`restore` removes exactly those (idempotent)."""

    def __init__(self, records: tuple[HarmlessRecord, ...]) -> None:
        before = list(warnings.filters)
        for entry in WARNINGS:
            warnings.filterwarnings("ignore", message=entry.message, category=entry.category, module=entry.module)
        self._warning_filters = [f for f in warnings.filters if f not in before]
        self._log_filters = [
            (logging.getLogger(record.logger), functools.partial(_keep, re.compile(record.message)))
            for record in records
        ]
        for logger, drop in self._log_filters:
            logger.addFilter(drop)

    def restore(self) -> None:
        for entry in self._warning_filters:
            if entry in warnings.filters:
                warnings.filters.remove(entry)
        self._warning_filters = []
        # The warnings module caches decisions per module until the filters change; tell it they did.
        mutated = getattr(warnings, "_filters_mutated", None)
        if mutated is not None:
            mutated()
        for logger, drop in self._log_filters:
            logger.removeFilter(drop)
        self._log_filters = []


def silence(*, entry_point: bool = False) -> Silenced:
    """Silence the known-harmless warnings (and, for ``entry_point``, the entry points' records) until ``restore``."""
    return Silenced(RECORDS + (ENTRY_POINT_RECORDS if entry_point else ()))


_endurance_said = False


def endurance_note(paths: list[str], bytes_per_step: int) -> str | None:
    """The SSD write-endurance note, once per process, if a path is on a block device (not tmpfs); else ``None``."""
    global _endurance_said
    if _endurance_said or not any(disk_of(p) is not None for p in paths):
        return None
    _endurance_said = True
    per_step, per_1000 = (readable_size(n * bytes_per_step, decimal=True) for n in (1, 1000))
    return (
        f"SmartUpdate rewrites the optimizer state on its storage at every step: {per_step} per step ({per_1000} per "
        f"1000 steps) on {', '.join(paths)}. Consumer SSDs are rated for a few hundred TB written (TBW); prefer "
        "datacenter SSDs for long runs."
    )
