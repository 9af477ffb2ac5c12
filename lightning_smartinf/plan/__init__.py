"""Performance model and planner: ``python -m lightning_smartinf.plan --model 7B --profile paper-a5000``.

The cost model (:mod:`.cost_model`), machine profiles (:mod:`.machine`) and their plans (:mod:`.machine_plan`) are
pure Python; only calibration (:mod:`.calibrate`) uses torch (``import lightning_smartinf`` loads it all the same: the
device kinds it registers import :mod:`lightning_smartinf.core`). Neither imports DeepSpeed nor Lightning.
"""

from lightning_smartinf.plan.cost_model import (
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
from lightning_smartinf.plan.machine import Machine, load_any
from lightning_smartinf.plan.machine_plan import MachinePlan, format_machine_plan, plan_machine
from lightning_smartinf.plan.planner import Plan, format_plan, make_plan, python_snippet, strategy_args, yaml_snippet

__all__ = [
    "METHODS",
    "Breakdown",
    "Machine",
    "MachinePlan",
    "Plan",
    "PlanError",
    "Profile",
    "Workload",
    "format_machine_plan",
    "format_plan",
    "iteration",
    "load_any",
    "load_profile",
    "make_plan",
    "params_from_config",
    "parse_size",
    "plan_machine",
    "profile_names",
    "python_snippet",
    "speedup",
    "strategy_args",
    "workload_from_model",
    "yaml_snippet",
    "zero_infinity",
]
