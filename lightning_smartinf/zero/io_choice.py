"""Which I/O engine the emulated devices of one rank use: DeepSpeed's aio op where it can run, else threads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lightning_smartinf.core.format.layout import pool_bytes
from lightning_smartinf.core.io.direct import IOEngine, ThreadedIO, supports_direct_io
from lightning_smartinf.core.settings import SmartUpdateSettings


@dataclass(frozen=True)
class EngineChoice:
    """The engine chosen for a rank's devices.

    Args:
        factory: builds one engine per device.
        description: what was chosen, for the log (``"DeepSpeed aio"``, ``"threads, direct"``).
        fallback: why the threads engine was taken although ``io_engine='auto'`` prefers aio; ``None`` otherwise.
    """

    factory: Callable[[], IOEngine]
    description: str
    fallback: str | None = None


def choose_io_engine(settings: SmartUpdateSettings, device_dirs: list[Path]) -> EngineChoice:
    """The engine for ``device_dirs`` under ``settings.io_engine``.

    Raises:
        ValueError: ``io_engine='aio'`` was asked for and cannot be used here (the message says why and the fix).
    """
    direct = all(supports_direct_io(d) for d in device_dirs)
    block, depth = settings.io_block_size, settings.io_queue_depth
    reason = None
    if settings.io_engine != "threads":
        if not direct:
            reason = "a storage path's filesystem refuses O_DIRECT, so I/O is buffered (page cache in play)"
        else:
            try:
                from lightning_smartinf.zero.aio import DeepSpeedAIO, load_aio_op, lockable_bytes, memlock_error

                op = load_aio_op()
            except Exception as exc:  # noqa: BLE001 - any build or load failure means: fall back
                reason = f"DeepSpeed's async_io op is unavailable ({exc})"
            else:
                # The pools are page-locked (worst case: master + 3 states per element); a lock that fails would
                # abort inside DeepSpeed, so a process that may not lock that much never gets the aio engine.
                need = pool_bytes(len(device_dirs), settings.buffer_count, settings.chunk_size, tensors_per_record=4)
                limit = lockable_bytes()
                if limit is not None and need > limit:
                    reason = memlock_error(need, limit)
                else:
                    return EngineChoice(lambda: DeepSpeedAIO(block, depth, op=op), DeepSpeedAIO.name)
        if settings.io_engine == "aio":
            raise ValueError(
                f"`SmartInfinityStrategy(io_engine='aio')` cannot be used: {reason}. Use `io_engine='threads'` or "
                "`'auto'`."
            )
    mode = "direct" if direct else "buffered"
    return EngineChoice(lambda: ThreadedIO(block, depth), f"{ThreadedIO.name}, {mode}", fallback=reason)
