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
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_smartinf.core import Backend, StepParams, TrafficSnapshot
    from lightning_smartinf.core.controller import SmartUpdateController
    from lightning_smartinf.core.settings import SmartUpdateSettings
    from lightning_smartinf.devices.cpu import CpuBackend
    from lightning_smartinf.lightning.activation_offload import ActivationOffload
    from lightning_smartinf.lightning.callbacks import BufferPool, CompressionWarmup, SmartUpdateMonitor
    from lightning_smartinf.lightning.monitor import TrainingMonitor
    from lightning_smartinf.lightning.precision import SmartInfinityPrecision
    from lightning_smartinf.lightning.strategy import SmartInfinityStrategy

__version__ = "0.1.0"

#: Public name -> the module that defines it (loaded on first use).
_PUBLIC = {
    "ActivationOffload": "lightning_smartinf.lightning.activation_offload",
    "Backend": "lightning_smartinf.core",
    "BufferPool": "lightning_smartinf.lightning.callbacks",
    "CompressionWarmup": "lightning_smartinf.lightning.callbacks",
    "CpuBackend": "lightning_smartinf.devices.cpu",
    "SmartInfinityPrecision": "lightning_smartinf.lightning.precision",
    "SmartInfinityStrategy": "lightning_smartinf.lightning.strategy",
    "SmartUpdateController": "lightning_smartinf.core.controller",
    "SmartUpdateMonitor": "lightning_smartinf.lightning.callbacks",
    "SmartUpdateSettings": "lightning_smartinf.core.settings",
    "StepParams": "lightning_smartinf.core",
    "TrafficSnapshot": "lightning_smartinf.core",
    "TrainingMonitor": "lightning_smartinf.lightning.monitor",
}

__all__ = [
    "ActivationOffload",
    "Backend",
    "BufferPool",
    "CompressionWarmup",
    "CpuBackend",
    "SmartInfinityPrecision",
    "SmartInfinityStrategy",
    "SmartUpdateController",
    "SmartUpdateMonitor",
    "SmartUpdateSettings",
    "StepParams",
    "TrafficSnapshot",
    "TrainingMonitor",
    "__version__",
]

#: Modules that moved into the layers' packages -> where they are now: the old names still import (with a
#: ``DeprecationWarning``) as the module that moved, so ``from lightning_smartinf.strategy import ...`` keeps working.
_MOVED = {
    "lightning_smartinf.strategy": "lightning_smartinf.lightning.strategy",
    "lightning_smartinf.callbacks": "lightning_smartinf.lightning.callbacks",
    "lightning_smartinf.monitor": "lightning_smartinf.lightning.monitor",
    "lightning_smartinf.precision": "lightning_smartinf.lightning.precision",
    "lightning_smartinf.activation_offload": "lightning_smartinf.lightning.activation_offload",
    "lightning_smartinf.cli": "lightning_smartinf.commands.cli",
    "lightning_smartinf.demo": "lightning_smartinf.commands.demo",
    "lightning_smartinf.export": "lightning_smartinf.commands.export",
    "lightning_smartinf.report": "lightning_smartinf.commands.report",
    "lightning_smartinf.fit": "lightning_smartinf.commands.fit",
    "lightning_smartinf.plan.model": "lightning_smartinf.plan.cost_model",
    "lightning_smartinf.plan.tiers": "lightning_smartinf.plan.tier_placement",
    "lightning_smartinf.core.tiers.memory": "lightning_smartinf.core.tiers.host_memory",
    "lightning_smartinf.core.tiers.accelerator": "lightning_smartinf.core.tiers.accelerator_memory",
    "lightning_smartinf.devices.xrt.model": "lightning_smartinf.devices.xrt.software_xrt",
}

#: Public names that were renamed -> their names now (the old ones still resolve, with a ``DeprecationWarning``).
_RENAMED = {"SmartUpdate": "SmartUpdateController"}

#: Where Lightning keeps its strategy registry.
_REGISTRY_MODULE = "lightning.pytorch.strategies"


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        warnings.warn(
            f"`lightning_smartinf.{name}` is now `{_RENAMED[name]}`; the old name will be removed in a later version.",
            DeprecationWarning,
            stacklevel=2,
        )
        return __getattr__(_RENAMED[name])
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
        from lightning_smartinf.lightning.strategy import SmartInfinityStrategy

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


class _MovedModule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a module's old name (:data:`_MOVED`) as the module at its new place, warning once."""

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname not in _MOVED:
            return None
        # The moved module's file as the origin: `python -m <old name>` runs with it as `sys.argv[0]` (runpy takes the
        # origin), as under the new name; without one, `sys.argv[0]` would be `None`.
        moved = importlib.util.find_spec(_MOVED[fullname])
        return importlib.util.spec_from_loader(fullname, self, origin=moved.origin if moved is not None else None)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = _MOVED[spec.name]
        warnings.warn(f"`{spec.name}` moved to `{new}`; import it from there.", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing: the module ran at its new place."""

    def get_code(self, fullname: str) -> Any:
        """The new module's code, for ``python -m <old name>`` (runpy runs it as ``__main__``)."""
        new = _MOVED[fullname]
        warnings.warn(f"`{fullname}` moved to `{new}`; run `python -m {new}`.", DeprecationWarning, stacklevel=2)
        spec = importlib.util.find_spec(new)
        assert spec is not None and isinstance(spec.loader, importlib.abc.InspectLoader)
        return spec.loader.get_code(new)


if not any(isinstance(finder, _MovedModule) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModule())

# The built-in device kinds (cpu, xrt, remote) register themselves; their modules import nothing heavy.
importlib.import_module("lightning_smartinf.devices")

if _REGISTRY_MODULE in sys.modules:
    _register(sys.modules[_REGISTRY_MODULE].StrategyRegistry)
elif not any(isinstance(finder, _RegisterOnImport) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterOnImport())
