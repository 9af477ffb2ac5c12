"""lightning_smartinf: PyTorch Lightning training with the optimizer state and update on near-storage devices.

Importing the package registers the ``"smart_infinity"`` strategies in Lightning's ``StrategyRegistry``, so
``Trainer(strategy="smart_infinity")`` works after ``import lightning_smartinf``; it changes nothing else (the
environment included: DeepSpeed's pre-built ops are found where they load, see
:func:`lightning_smartinf.zero.aio.prebuilt_ops`).

The package root imports neither Lightning nor DeepSpeed itself: its public names load on first use, and the
strategies are registered as soon as Lightning's registry exists (at once where Lightning is imported already, else
when it is). So ``smartinf serve`` and ``smartinf plan``, which need neither, start without them. It registers the
built-in device kinds (:mod:`lightning_smartinf.devices`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_smartinf.activation_offload import ActivationOffload
    from lightning_smartinf.callbacks import BufferPool, CompressionWarmup, SmartUpdateMonitor
    from lightning_smartinf.core import Backend, StepParams, TrafficSnapshot
    from lightning_smartinf.core.controller import SmartUpdate
    from lightning_smartinf.core.settings import SmartUpdateSettings
    from lightning_smartinf.devices.cpu import CpuBackend
    from lightning_smartinf.monitor import TrainingMonitor
    from lightning_smartinf.precision import SmartInfinityPrecision
    from lightning_smartinf.strategy import SmartInfinityStrategy

__version__ = "0.1.0"

#: Public name -> the module that defines it (loaded on first use).
_PUBLIC = {
    "ActivationOffload": "lightning_smartinf.activation_offload",
    "Backend": "lightning_smartinf.core",
    "BufferPool": "lightning_smartinf.callbacks",
    "CompressionWarmup": "lightning_smartinf.callbacks",
    "CpuBackend": "lightning_smartinf.devices.cpu",
    "SmartInfinityPrecision": "lightning_smartinf.precision",
    "SmartInfinityStrategy": "lightning_smartinf.strategy",
    "SmartUpdate": "lightning_smartinf.core.controller",
    "SmartUpdateMonitor": "lightning_smartinf.callbacks",
    "SmartUpdateSettings": "lightning_smartinf.core.settings",
    "StepParams": "lightning_smartinf.core",
    "TrafficSnapshot": "lightning_smartinf.core",
    "TrainingMonitor": "lightning_smartinf.monitor",
}

__all__ = [
    "ActivationOffload",
    "Backend",
    "BufferPool",
    "CompressionWarmup",
    "CpuBackend",
    "SmartInfinityPrecision",
    "SmartInfinityStrategy",
    "SmartUpdate",
    "SmartUpdateMonitor",
    "SmartUpdateSettings",
    "StepParams",
    "TrafficSnapshot",
    "TrainingMonitor",
    "__version__",
]

#: Where Lightning keeps its strategy registry.
_REGISTRY_MODULE = "lightning.pytorch.strategies"


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    try:  # a subpackage not imported yet (`lightning_smartinf.core`)
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def _register(registry: Any) -> None:
    """Register the strategies: each entry builds the strategy class, which is imported only then."""
    if "smart_infinity" in registry:
        return

    def smart_infinity(**kwargs: Any) -> Any:
        from lightning_smartinf.strategy import SmartInfinityStrategy

        return SmartInfinityStrategy(**kwargs)

    registry.register(
        "smart_infinity",
        smart_infinity,
        description="ZeRO-3 with optimizer state and update on near-storage devices (emulated on CPU by default)",
    )
    registry.register(
        "smart_infinity_comp",
        smart_infinity,
        description="smart_infinity with top-1% gradient compression, error feedback and EF-Adam (SmartComp)",
        compression=0.01,
    )


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers the strategies once Lightning's registry module has run, where Lightning is imported after us.

    Found first on ``sys.meta_path`` for that one module: it asks the path finder for the module's spec, and wraps
    the loader so that the registry module runs, then :func:`_register`. It removes itself on first use.
    """

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname != _REGISTRY_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_register(module: ModuleType) -> None:
            exec_module(module)
            _register(module.StrategyRegistry)

        spec.loader.exec_module = exec_and_register  # type: ignore[method-assign]
        return spec


# The built-in device kinds (cpu, xrt, remote) register themselves; their modules import nothing heavy.
importlib.import_module("lightning_smartinf.devices")

if _REGISTRY_MODULE in sys.modules:
    _register(sys.modules[_REGISTRY_MODULE].StrategyRegistry)
elif not any(isinstance(finder, _RegisterOnImport) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterOnImport())
