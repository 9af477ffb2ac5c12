"""One rank's backend from its settings: the device kind's backend (one registry lookup), wrapped in the host-memory
and accelerator tiers when the settings give them a budget.

The state of a kind whose state cannot move (remote servers) is always wrapped, so that a checkpoint records the
split between this host and the devices and a resume under another split is refused by name.
"""

from __future__ import annotations

from typing import Any

from lightning_smartinf.core.backend import Backend
from lightning_smartinf.core.registry import BuildContext
from lightning_smartinf.core.settings import SmartUpdateSettings
from lightning_smartinf.core.streaming.backend import StreamingBackend
from lightning_smartinf.core.tiers.tiered import AttachedTiers, BesideTiers, TieredBackend

__all__ = ["build_backend", "tiers_over"]

#: ``state_memory_share`` as :class:`TieredBackend`'s ``measure_memory_share``.
MEASURE = {"fill": False, "measured": True}


def tiers_over(inner: Backend, *, device_timeout_s: float | None = 300.0, **options: Any) -> TieredBackend:
    """The host-memory and accelerator tiers over ``inner``, in the one design that fits it, chosen here once:
    attached to a backend that streams its state through this host (:class:`AttachedTiers`), else beside it
    (:class:`BesideTiers`). ``options``: :class:`TieredBackend`'s; ``device_timeout_s``: the tiers' devices' where they
    are a backend of their own (attached, they are ``inner``'s)."""
    if isinstance(inner, StreamingBackend):
        return AttachedTiers(inner, **options)
    return BesideTiers(inner, device_timeout_s=device_timeout_s, **options)


def build_backend(settings: SmartUpdateSettings, context: BuildContext) -> Backend:
    """This rank's backend: ``settings.kind``'s, in tiers where ``state_memory_budget`` or
    ``state_accelerator_budget`` is set. ``state_memory_share="auto"`` measures memory's share where the kind's
    devices compute, or where training runs on an accelerator (leaving the host cores to the tiers)."""
    kind = settings.kind
    backend = kind.build(settings, context)
    memory, accelerator = settings.state_memory_budget or 0, settings.state_accelerator_budget or 0
    if not (memory or accelerator or not kind.state_movable):
        return backend
    return tiers_over(
        backend,
        memory_bytes=int(memory),
        accelerator_bytes=int(accelerator),
        devices_compute=kind.devices_compute,
        measure_memory_share=MEASURE.get(settings.state_memory_share, context.accelerator_training or None),
        chunk_elems=settings.chunk_size,
        buffer_count=settings.buffer_count,
        device_timeout_s=settings.device_timeout_s,
    )
