"""lightning_smartinf: PyTorch Lightning training with the optimizer state and update on near-storage devices.

Importing the package registers the ``"smart_infinity"`` strategy in Lightning's ``StrategyRegistry``.
"""

import os
import sys
from pathlib import Path

# scripts/setup.sh pre-builds DeepSpeed's C++ ops into the virtual environment; use them unless told otherwise,
# so a first run does not spend minutes compiling them again under ~/.cache.
_PREBUILT_OPS = Path(sys.prefix) / "torch_extensions"
if "TORCH_EXTENSIONS_DIR" not in os.environ and _PREBUILT_OPS.is_dir():
    os.environ["TORCH_EXTENSIONS_DIR"] = str(_PREBUILT_OPS)

from lightning.pytorch.strategies import StrategyRegistry  # noqa: E402

from lightning_smartinf.callbacks import BufferPool, CompressionWarmup  # noqa: E402
from lightning_smartinf.csd import Backend, CpuBackend, StepParams, TrafficSnapshot  # noqa: E402
from lightning_smartinf.monitor import TrainingMonitor  # noqa: E402
from lightning_smartinf.precision import SmartInfinityPrecision  # noqa: E402
from lightning_smartinf.strategy import SmartInfinityStrategy  # noqa: E402

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
    "StepParams",
    "TrafficSnapshot",
    "TrainingMonitor",
    "__version__",
]
