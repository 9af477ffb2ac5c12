"""lightning_smartinf: PyTorch Lightning training with the optimizer state and update on near-storage devices.

Importing the package registers the ``"smart_infinity"`` strategy in Lightning's ``StrategyRegistry``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_smartinf.callbacks import BufferPool
from lightning_smartinf.csd import Backend, CpuBackend, StepParams, TrafficSnapshot
from lightning_smartinf.precision import SmartInfinityPrecision
from lightning_smartinf.strategy import SmartInfinityStrategy

__version__ = "0.1.0"

if "smart_infinity" not in StrategyRegistry:
    SmartInfinityStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "Backend",
    "BufferPool",
    "CpuBackend",
    "SmartInfinityPrecision",
    "SmartInfinityStrategy",
    "StepParams",
    "TrafficSnapshot",
    "__version__",
]
