"""DeepSpeed ZeRO-3 adapter: hands each sub-group's gradient shard to the SmartUpdate controller's devices.

``lightning_smartinf.zero.optimizer`` imports DeepSpeed; import it only after the version check.
"""

from lightning_smartinf.zero.gradient_buffer import GradientBufferError
from lightning_smartinf.zero.install import (
    TESTED_DEEPSPEED,
    ControllerFactory,
    check_deepspeed_version,
    smart_update_optimizer,
)

__all__ = [
    "TESTED_DEEPSPEED",
    "ControllerFactory",
    "GradientBufferError",
    "check_deepspeed_version",
    "smart_update_optimizer",
]
