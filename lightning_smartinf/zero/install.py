"""Installing the SmartUpdate optimizer into DeepSpeed for the duration of ``deepspeed.initialize``.

The engine imports ``DeepSpeedZeroOptimizer_Stage3`` from its module inside a function, so replacing
the module attribute while ``initialize`` runs makes the engine build our subclass; the original is
restored afterwards, so other engines in the same process are unaffected.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from lightning_utilities.core.imports import RequirementCache

from lightning_smartinf.core.controller import Partitions, SmartUpdateController, SubGroup

#: Builds the controller of a ZeRO optimizer: ``(torch optimizer, its sub-groups, its partitions) ->
#: SmartUpdateController``.
ControllerFactory = Callable[[torch.optim.Optimizer, Sequence[SubGroup], Partitions], SmartUpdateController]


#: DeepSpeed releases whose private ZeRO-3 methods the adapter was tested against.
TESTED_DEEPSPEED = ">=0.19.8,<0.20"


def check_deepspeed_version() -> None:
    """Raise a :class:`RuntimeError` naming the fix when the installed DeepSpeed is outside the tested range."""
    requirement = RequirementCache(f"deepspeed{TESTED_DEEPSPEED}")
    if not requirement:
        import deepspeed

        raise RuntimeError(
            "lightning_smartinf hooks DeepSpeed's private ZeRO-3 methods and is tested with "
            f"deepspeed{TESTED_DEEPSPEED}, "
            f"but deepspeed {deepspeed.__version__} is installed. Install a tested version: "
            f"`pip install 'deepspeed{TESTED_DEEPSPEED}'`."
        )


@contextlib.contextmanager
def smart_update_optimizer(controller_factory: ControllerFactory) -> Iterator[None]:
    """Make ZeRO-3 engines built inside this block use ``SmartUpdateZeroOptimizer``, with controllers built by
    ``controller_factory`` (bound here, when the optimizer is built; nothing is pushed into it afterwards)."""
    check_deepspeed_version()
    from deepspeed.runtime.zero import stage3

    from lightning_smartinf.zero.optimizer import SmartUpdateZeroOptimizer

    bound = type(
        "SmartUpdateZeroOptimizer",
        (SmartUpdateZeroOptimizer,),
        {"controller_factory": staticmethod(controller_factory)},
    )
    original = stage3.DeepSpeedZeroOptimizer_Stage3
    stage3.DeepSpeedZeroOptimizer_Stage3 = bound
    try:
        yield
    finally:
        stage3.DeepSpeedZeroOptimizer_Stage3 = original
