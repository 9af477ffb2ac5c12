"""Performance model and planner: ``python -m lightning_smartinf.plan --model 7B --profile paper-a5000``.

The model (:mod:`.model`) is pure Python; only calibration (:mod:`.calibrate`) needs torch.
"""

from lightning_smartinf.plan.model import (
    METHODS,
    Breakdown,
    PlanError,
    Profile,
    Workload,
    iteration,
    load_profile,
    params_from_config,
    parse_size,
    profile_names,
    speedup,
    workload_from_model,
    zero_infinity,
)
from lightning_smartinf.plan.planner import Plan, format_plan, make_plan, python_snippet, strategy_args, yaml_snippet

__all__ = [
    "METHODS",
    "Breakdown",
    "Plan",
    "PlanError",
    "Profile",
    "Workload",
    "format_plan",
    "iteration",
    "load_profile",
    "make_plan",
    "params_from_config",
    "parse_size",
    "profile_names",
    "python_snippet",
    "speedup",
    "strategy_args",
    "workload_from_model",
    "yaml_snippet",
    "zero_infinity",
]
