"""The DeepSpeed config SmartUpdate runs with: the user's config, checked, with SmartUpdate's own keys added.

:func:`load_config` reads what the user gave (a dict, a JSON file, or the file named by an environment variable);
:func:`deepspeed_config` checks it against what SmartUpdate needs (ZeRO stage 3, no optimizer offload, no
DeepSpeed ``optimizer`` block) and adds the keys that make ZeRO hand the optimizer state to the devices. Every
problem goes to a :class:`~.core.arguments.Problems`, so that one error lists them with the rest of the
strategy's arguments. Nothing here imports Lightning or DeepSpeed.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from lightning_smartinf.core.arguments import Problems, show
from lightning_smartinf.core.settings import SmartUpdateSettings, check_sub_group_indexable
from lightning_smartinf.core.torch_optim import SUPPORTED_OPTIMIZERS

__all__ = [
    "ENGINE",
    "accumulate_in_fp32",
    "check_engine_arguments",
    "deepspeed_config",
    "load_config",
]


def load_config(
    config: str | os.PathLike | dict[str, Any] | None, problems: Problems, *, env_var: str | None = None
) -> dict[str, Any] | None:
    """A copy of the user's DeepSpeed config: ``config``, or the JSON file it names.

    With ``config=None`` and ``env_var`` set in the environment (Lightning's ``PL_DEEPSPEED_CONFIG_PATH``), the file
    that variable names. On a problem (a missing or unreadable file, JSON that is not an object, a value JSON cannot
    represent), adds it to ``problems`` and returns ``None``; ``None`` also when no config is given.
    """
    name = "config"
    if config is None and env_var is not None and env_var in os.environ:
        config, name = os.environ[env_var], env_var
    loaded: Any = config
    if isinstance(config, (str, os.PathLike)):
        loaded = _read_json(Path(config), f"`{name}={str(config)!r}`", problems)
    elif config is not None:
        problems.instance(name, config, dict, "a DeepSpeed config dict, the path of a JSON file, or None")
    if isinstance(loaded, dict):
        try:
            return json.loads(json.dumps(loaded))
        except (TypeError, ValueError) as exc:
            problems.add(f"`{name}` holds a value JSON cannot represent ({exc}). Use numbers, strings, lists, dicts.")
    return None


def _read_json(path: Path, shown: str, problems: Problems) -> dict[str, Any] | None:
    """The JSON object in the file ``path`` (named ``shown`` in problems), or ``None`` after adding a problem."""
    if not path.is_file():
        kind = "is a directory" if path.is_dir() else "does not exist"
        problems.add(f"{shown} {kind}: pass a DeepSpeed config dict or the path of a JSON file. Fix the path.")
        return None
    try:
        loaded = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        problems.add(f"{shown} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}). Fix the file.")
        return None
    except (OSError, UnicodeDecodeError) as exc:
        problems.add(f"{shown} cannot be read ({exc}). Fix its permissions or pass another file.")
        return None
    if not isinstance(loaded, dict):
        problems.add(
            f"{shown} holds a JSON {type(loaded).__name__}, not an object: a DeepSpeed config is a JSON "
            "object of settings (`{...}`)."
        )
        return None
    return loaded


def _check_zero(inside: Problems, zero: dict[str, Any]) -> None:
    """The user's ``zero_optimization`` block: stage 3, no optimizer offload, parameters offloaded to ``cpu`` only,
    sizes and flags of the right type. Blocks of the wrong type are replaced by ``None``."""
    stage = zero.get("stage", 3)
    if isinstance(stage, bool) or stage != 3:
        inside.add(
            f"`{inside.name('stage')}={show(stage)}` is not supported: SmartUpdate runs on ZeRO stage 3. Remove "
            "the key or set it to 3."
        )
    for block in ("offload_optimizer", "offload_param"):
        if zero.get(block) is not None and not inside.instance(
            block, zero[block], dict, "a dict of offload settings, or None"
        ):
            zero[block] = None
    offload_optimizer = zero.get("offload_optimizer") or {}
    if offload_optimizer.get("device", "none") not in ("none", None):
        inside.add(
            f"`{inside.name('offload_optimizer')}['device']={show(offload_optimizer['device'])}`: the optimizer "
            "state lives on the SmartUpdate devices; remove `offload_optimizer` and set `storage_paths` instead."
        )
    offload_param = zero.get("offload_param") or {}
    if offload_param.get("device") == "nvme":
        inside.add(
            f"`{inside.name('offload_param')}['device']='nvme'`: pass `offload_parameters='storage'` instead, which "
            "keeps the parameters on the storage paths with swap buffers sized for the model; remove the "
            "`offload_param` block."
        )
    elif offload_param.get("device", "none") not in ("none", "cpu", None):
        inside.within("offload_param").choice("device", offload_param["device"], ("none", "cpu"))
    for key in ("sub_group_size", "reduce_bucket_size", "allgather_bucket_size"):
        if key in zero:
            value = zero[key]
            # DeepSpeed reads integral floats (`5e8`) as ints, as JSON configs often write them.
            value = int(value) if isinstance(value, float) and value.is_integer() else value
            inside.integer(
                key, value, low=1, why="elements", example=40_000_000 if key == "sub_group_size" else 200_000_000
            )
    for key in ("contiguous_gradients", "overlap_comm"):
        if key in zero:
            inside.flag(key, zero[key])


def _check_top_level(where: Problems, config: dict[str, Any]) -> None:
    """The user's top-level keys: blocks are dicts; Lightning and SmartUpdate own accumulation and the optimizer."""
    for block in ("fp16", "bf16", "aio", "activation_checkpointing"):
        if block in config:
            where.instance(block, config[block], dict, f"a dict of DeepSpeed `{block}` settings")
    if "gradient_clipping" in config:  # DeepSpeed clips by it as Lightning's `gradient_clip_val` would
        where.number("gradient_clipping", config["gradient_clipping"], low=0.0, example=1.0)
    if "train_micro_batch_size_per_gpu" in config:
        where.integer("train_micro_batch_size_per_gpu", config["train_micro_batch_size_per_gpu"], low=1)
    if "gradient_accumulation_steps" in config:
        where.add(
            "`config['gradient_accumulation_steps']` is set by Lightning from "
            "`Trainer(accumulate_grad_batches=...)`; remove it from the DeepSpeed config and set it there."
        )
    if "optimizer" in config:
        where.add(
            "`config['optimizer']`: SmartUpdate runs the optimizer from `LightningModule.configure_optimizers`; "
            f"remove the DeepSpeed `optimizer` block and return one of {', '.join(SUPPORTED_OPTIMIZERS)} there."
        )


#: The ``SmartInfinityStrategy`` arguments that shape the DeepSpeed engine rather than the devices.
ENGINE = (
    "offload_parameters",
    "reduce_bucket_size",
    "allgather_bucket_size",
    "contiguous_gradients",
    "overlap_comm",
    "logging_batch_size_per_gpu",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "min_loss_scale",
    "logging_level",
)


def deepspeed_config(
    problems: Problems,
    settings: SmartUpdateSettings | None,
    config: str | os.PathLike | dict[str, Any] | None,
    *,
    env_var: str | None = None,
    **engine: Any,
) -> dict[str, Any]:
    """The DeepSpeed config of a SmartUpdate run: the user's ``config`` (see :func:`load_config`; not modified) with
    SmartUpdate's keys added, after checking the :data:`ENGINE` arguments in ``engine``. Every problem goes to
    ``problems``: a key of the user's that contradicts SmartUpdate's is one.

    Keys the user set win over ``settings.sub_group_size`` and the bucket arguments; ``reduce_bucket_size=None``
    follows :meth:`SmartUpdateSettings.default_reduce_bucket_size`. ``settings=None`` (refused settings) still
    checks the user's config, so that one error lists every problem; the config returned is then not for use.
    """
    check_engine_arguments(problems, **engine)
    config = load_config(config, problems, env_var=env_var) or {}
    where = problems.within("config")
    zero = config.setdefault("zero_optimization", {})
    if not where.instance("zero_optimization", zero, dict, "a dict of ZeRO settings, or left out"):
        zero = config["zero_optimization"] = {}
    _check_zero(where.within("zero_optimization"), zero)
    _check_top_level(where, config)
    zero["stage"] = 3
    reduce_bucket_size = engine["reduce_bucket_size"]
    if settings is not None:
        own = zero.setdefault("sub_group_size", settings.sub_group_size)
        if settings.compression is not None and own != settings.sub_group_size and isinstance(own, (int, float)):
            check_sub_group_indexable(problems, own)  # the settings checked their own size
        if reduce_bucket_size is None:
            reduce_bucket_size = settings.default_reduce_bucket_size()
    zero.setdefault("reduce_bucket_size", reduce_bucket_size)
    for key in ("allgather_bucket_size", "contiguous_gradients", "overlap_comm"):
        zero.setdefault(key, engine[key])
    # The path is replaced per rank at set-up; "nvme" makes ZeRO keep only empty fp32 placeholders.
    zero["offload_optimizer"] = {"device": "nvme", "nvme_path": tempfile.gettempdir()}
    if engine["offload_parameters"] is True:
        zero["offload_param"] = {"device": "cpu"}
    elif engine["offload_parameters"] == "storage":
        # The path and the buffers are set per rank at set-up, from the model (`param_storage.swap_buffer_settings`).
        zero["offload_param"] = {"device": "nvme", "nvme_path": tempfile.gettempdir(), "max_in_cpu": 0}
        # A parameter kept gathered for reuse would hold its swap buffer: release each module's when it is done.
        zero.setdefault("stage3_max_reuse_distance", 0)
    config["zero_allow_untested_optimizer"] = True
    config["zero_force_ds_cpu_optimizer"] = False
    if engine["logging_batch_size_per_gpu"] != "auto":
        config.setdefault("train_micro_batch_size_per_gpu", engine["logging_batch_size_per_gpu"])
    return config


def check_engine_arguments(problems: Problems, **engine: Any) -> None:
    """Check the :data:`ENGINE` arguments by type and range (the loss-scale ones as DeepSpeed reads them)."""
    offload = engine["offload_parameters"]
    if not (isinstance(offload, bool) or offload == "storage"):
        problems.add(
            f"`offload_parameters={show(offload)}`: pass False (parameters stay on the accelerator), True (in host "
            "memory between uses) or 'storage' (in files on the storage paths, streamed in for forward and backward)."
        )
    for name in ("contiguous_gradients", "overlap_comm"):
        problems.flag(name, engine[name])
    problems.integer(
        "reduce_bucket_size",
        engine["reduce_bucket_size"],
        low=1,
        why="elements; None follows `sub_group_size`",
        example=200_000_000,
        optional=True,
    )
    problems.integer(
        "allgather_bucket_size", engine["allgather_bucket_size"], low=1, why="elements", example=200_000_000
    )
    if engine["logging_batch_size_per_gpu"] != "auto":
        problems.integer(
            "logging_batch_size_per_gpu",
            engine["logging_batch_size_per_gpu"],
            low=1,
            why="or 'auto' for the train dataloader's batch size",
            example="auto",
        )
    problems.number("loss_scale", engine["loss_scale"], low=0, high=1 << 127, why="0: dynamic loss scaling", example=0)
    problems.integer(
        "initial_scale_power",
        engine["initial_scale_power"],
        high=127,
        why="the loss scale 2**power must be a finite fp32 number",
        example=16,
    )
    problems.integer("loss_scale_window", engine["loss_scale_window"], low=1, example=1000)
    problems.integer("hysteresis", engine["hysteresis"], low=1, example=2)
    problems.number("min_loss_scale", engine["min_loss_scale"], low=0, above=True, high=1 << 127, example=1)
    level = engine["logging_level"]
    if not (isinstance(level, str) and isinstance(logging.getLevelName(level), int)):
        problems.integer("logging_level", level, why="a `logging` level, or its name", example=logging.WARN)


def accumulate_in_fp32(config: dict[str, Any]) -> None:
    """Make ZeRO-3 add the micro-batches' gradients in fp32 where training is 16-bit and accumulates several
    micro-batches (``gradient_accumulation_steps`` > 1), unless the config chose (``data_types.grad_accum_dtype``).

    In bf16 a sum of 16 micro-batches' gradients keeps 8 bits of mantissa at every add: small contributions vanish
    beside large ones. In fp32, each micro-batch's 16-bit gradient is exact in the sum. The cost: ZeRO's gradient
    partitions take 4 bytes per element instead of 2 (this rank's share of the parameters); the devices still
    receive the gradient rounded to the training dtype, so the traffic is unchanged. Not with compression: there
    error feedback would carry each step's rounding to the link dtype in its residual, which no longer matches the
    dense update at ``ratio=1`` bit for bit; compressed runs keep DeepSpeed's default (the training dtype).
    """
    sixteen_bit = any(isinstance(config.get(key), dict) and config[key].get("enabled") for key in ("bf16", "fp16"))
    if sixteen_bit and int(config.get("gradient_accumulation_steps", 1)) > 1:
        config.setdefault("data_types", {}).setdefault("grad_accum_dtype", "fp32")
