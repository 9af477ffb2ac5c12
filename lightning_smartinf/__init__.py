"""lightning_smartinf: PyTorch Lightning training with the optimizer state and update on near-storage devices.

Importing the package registers the ``"smart_infinity"`` strategy in Lightning's ``StrategyRegistry``, so
``Trainer(strategy="smart_infinity")`` works after ``import lightning_smartinf``; it changes nothing else (the
environment included: DeepSpeed's pre-built ops are found where they load, see
:func:`lightning_smartinf.zero.aio.prebuilt_ops`).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_smartinf.callbacks import BufferPool, CompressionWarmup, SmartUpdateMonitor
from lightning_smartinf.csd import Backend, CpuBackend, StepParams, TrafficSnapshot
from lightning_smartinf.csd.controller import SmartUpdate
from lightning_smartinf.csd.settings import SmartUpdateSettings
from lightning_smartinf.monitor import TrainingMonitor
from lightning_smartinf.precision import SmartInfinityPrecision
from lightning_smartinf.strategy import SmartInfinityStrategy

__version__ = "0.1.0"

if "smart_infinity" not in StrategyRegistry:
    SmartInfinityStrategy.register_strategies(StrategyRegistry)

__all__ = [
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
