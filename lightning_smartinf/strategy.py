"""``SmartInfinityStrategy``: DeepSpeed ZeRO-3 with the optimizer update run next to the storage."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.plugins.precision.deepspeed import DeepSpeedPrecision
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_smartinf import checkpoint_dir, quiet
from lightning_smartinf.arguments import POOL_TENSORS, Problems, pool_bytes, show
from lightning_smartinf.checkpoint_dir import CheckpointError
from lightning_smartinf.cpu_support import DeepSpeedOnCPUMixin
from lightning_smartinf.csd import Backend, CpuBackend, StorageError, TrafficSnapshot, validate_storage_path
from lightning_smartinf.csd.checkpoint import file_crc32, write_file_atomic
from lightning_smartinf.csd.compression import TopKCompression, check_ratio, check_sparse_supported
from lightning_smartinf.csd.io import IO_ALIGN, IOEngine, ThreadedIO, supports_direct_io
from lightning_smartinf.csd.layout import ELEM_ALIGN
from lightning_smartinf.csd.ownership import check_unclaimed, make_temp_device_dir, remove_stale_temp_dirs
from lightning_smartinf.csd.storage import create_storage_path, make_private_dirs
from lightning_smartinf.csd.torch_optim import SUPPORTED_OPTIMIZERS, rule_for_group
from lightning_smartinf.precision import SmartInfinityPrecision
from lightning_smartinf.zero import check_deepspeed_version, smart_update_optimizer
from lightning_smartinf.zero.safe_load import load_deepspeed_file, safe_checkpoint_engine

BACKENDS = ("cpu", "xrt")
IO_ENGINES = ("auto", "aio", "threads")
_STATE_DIR = "smartinf"
log = logging.getLogger(__name__)
_HOST_STATE = checkpoint_dir.HOST_STATE
_RESIDUAL = "residual.safetensors"
#: Removers of the temporary device state of finished runs (``storage_paths=None``), see ``release_backend``.
_lingering_temporary_state: list[weakref.finalize] = []


class SmartInfinityStrategy(DeepSpeedOnCPUMixin, DeepSpeedStrategy):
    """Train with DeepSpeed ZeRO-3 while fp32 master weights and optimizer states live on storage devices.

    Every ZeRO sub-group partition is a shard owned by one device (shard ``s`` on device ``s mod N`` of
    this rank's storage paths). After backward, each shard's reduced gradient goes to its device in the
    training dtype; the device reads its master weights and states, applies the update of the optimizer
    from ``configure_optimizers`` there, writes them back to its storage and returns the updated
    low-precision parameters. Runs on CUDA and on CPU (DeepSpeed's CPU accelerator with gloo).

    Args:
        accelerator: the accelerator; ``"cpu"`` and ``"cuda"`` are supported.
        backend: device implementation; ``"cpu"`` emulates computational-storage devices on host cores,
            ``"xrt"`` drives Samsung SmartSSDs through XRT (pyxrt) running the kernels of ``hls_kernels/``.
        xclbin: ``backend="xrt"`` only: path of the ``.xclbin`` built from ``hls_kernels/``.
        xrt_devices: ``backend="xrt"`` only: one XRT device per storage path of this node, as device index or
            PCIe BDF (``"0000:3b:00.1"``); ``None`` maps each storage path to the SmartSSD it is mounted from.
        storage_paths: directories, one per device, shared out among the ranks of a node (rank ``r`` gets
            ``storage_paths[r::ranks_per_node]``); each rank needs at least one of its own, and locks it while it
            trains. A missing one is created (0700) at set-up if its parent is a writable directory. ``None``: one
            private temporary directory per rank, kept after ``fit`` (for ``trainer.save_checkpoint``) until the
            next run starts or the process exits.
        compression: SmartComp gradient compression: the fraction of each sub-group's gradient entries sent
            per step (e.g. ``0.01``: top-1% by magnitude, as int32 index + value pairs), a dict of
            :class:`~lightning_smartinf.csd.compression.TopKCompression` arguments (``ratio``,
            ``error_feedback``), or ``None`` (dense). Pair it with the
            :class:`~lightning_smartinf.callbacks.CompressionWarmup` callback for dense or DGC-style warm-up.
        sub_group_size: elements per ZeRO sub-group, the unit of work of a device.
        chunk_size: elements a device streams through one buffer at a time (a multiple of 1024).
        buffer_count: chunk buffers per device; host memory of the update path is
            ``devices * buffer_count * chunk_size * 4 * (1 + states)`` bytes (192 MiB per device for Adam with
            the defaults). Keep it above ``2 * io_threads + 1`` so reads never wait for a write to free a buffer.
            With ``backend="cpu"``, pools of ``storage paths (1 for None) * buffer_count * chunk_size * 4 * 3``
            bytes (master weight and Adam's two states) that exceed the available host memory are refused here.
        io_engine: how devices move state to and from their storage: ``"aio"`` (DeepSpeed's libaio op,
            direct I/O), ``"threads"`` (``pread``/``pwrite`` on a thread pool) or ``"auto"`` (aio where it
            loads and the filesystem allows ``O_DIRECT``, else threads; the choice is logged).
        io_block_size: bytes per I/O request: an int, a multiple of 4096, at most 1 GiB (``1 << 30``).
        io_queue_depth: I/O requests in flight per chunk transfer.
        io_threads: chunk transfers each emulated device (``backend="cpu"``) keeps in flight per direction;
            reads are also capped at ``buffer_count - 1``.
        device_timeout_s: seconds a device may take to answer before the run fails with a
            :class:`~lightning_smartinf.csd.StorageError` (a positive finite number); ``None`` waits forever.
        overlap_backward: hand each sub-group's gradient to its device as soon as backward has reduced it, so
            devices update during backward instead of after it. The update is tentative until the step
            confirms it (same hyperparameters and scale, no clipping, no skipped step), otherwise it is rolled
            back and redone, so results do not change. Keeps a second copy of the state on the storage paths
            (2x the disk space, not the traffic). ``backend="cpu"`` without ``compression`` only.
        prefetch_state: after each step, every device is told the order it will get sub-groups in next step,
            and reads their state into free buffers whenever it has no sub-group to update (during forward and
            between hand-offs in backward; at most ``buffer_count - 1 - io_threads`` chunks at once), so its
            storage does not idle. Never changes results or memory; ``False`` is for comparisons.
        offload_parameters: keep ZeRO's low-precision parameter partitions in host memory between uses.
        offload_activations: write large saved activations to the storage paths during forward and read them
            back ahead of backward (``True``, or a dict of
            :class:`~lightning_smartinf.activations.ActivationOffload` arguments).
        config: a DeepSpeed config dict or JSON path to start from (``None``: the file named by
            ``$PL_DEEPSPEED_CONFIG_PATH``, if set); SmartUpdate adds its own keys and rejects settings that
            contradict it (optimizer offload, a DeepSpeed ``optimizer`` block or ``gradient_accumulation_steps``,
            stages < 3) and values of the wrong shape (``zero_optimization`` not a dict, ``"auto"`` sizes).
        reduce_bucket_size: elements of gradients ZeRO reduces at once. Gradients reach the devices one bucket at a
            time, so ``None`` picks ``sub_group_size`` (within 1M..200M) when ``overlap_backward`` is in effect,
            letting each device start as soon as its sub-group is reduced, and Lightning's 200M otherwise.
        allgather_bucket_size, contiguous_gradients, overlap_comm, logging_batch_size_per_gpu,
        loss_scale, initial_scale_power, loss_scale_window, hysteresis, min_loss_scale, logging_level,
        parallel_devices, cluster_environment, precision_plugin, process_group_backend, timeout:
            as in :class:`~lightning.pytorch.strategies.DeepSpeedStrategy`.

    Every argument is checked here, by type and range, and one ``MisconfigurationException`` lists every problem.
    Counts and sizes are ``int`` (``True``, ``16.0`` and ``"16"`` are refused); byte counts are ints of bytes
    (``"1MiB"`` is refused: write ``1 << 20``); flags are ``True`` or ``False``; dict arguments have their keys
    and values checked. See :mod:`lightning_smartinf.arguments`.
    """

    strategy_name = "smart_infinity"

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        backend: Literal["cpu", "xrt"] = "cpu",
        storage_paths: list[_PATH] | None = None,
        xclbin: _PATH | None = None,
        xrt_devices: list[int | str] | None = None,
        compression: float | dict[str, Any] | TopKCompression | None = None,
        sub_group_size: int = 40_000_000,
        chunk_size: int = 1 << 20,
        buffer_count: int = 16,
        io_engine: Literal["auto", "aio", "threads"] = "auto",
        io_block_size: int = 1 << 20,
        io_queue_depth: int = 8,
        io_threads: int = 3,
        device_timeout_s: float | None = 300.0,
        overlap_backward: bool = True,
        prefetch_state: bool = True,
        offload_parameters: bool = False,
        offload_activations: bool | dict[str, Any] = False,
        config: _PATH | dict[str, Any] | None = None,
        reduce_bucket_size: int | None = None,
        allgather_bucket_size: int = 200_000_000,
        contiguous_gradients: bool = True,
        overlap_comm: bool = True,
        logging_batch_size_per_gpu: str | int = "auto",
        loss_scale: float = 0,
        initial_scale_power: int = 16,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
        min_loss_scale: int = 1,
        logging_level: int = logging.WARN,
        parallel_devices: list[Any] | None = None,
        cluster_environment: Any = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        check_deepspeed_version()
        problems = Problems("SmartInfinityStrategy", MisconfigurationException)
        problems.choice("backend", backend, BACKENDS)
        problems.choice("io_engine", io_engine, IO_ENGINES)
        counts = [
            problems.integer("sub_group_size", sub_group_size, low=1, why="elements", example=40_000_000),
            problems.integer(
                "chunk_size",
                chunk_size,
                low=ELEM_ALIGN,
                multiple=ELEM_ALIGN,
                why=f"elements; {ELEM_ALIGN} fp32 elements are the {IO_ALIGN} B direct-I/O unit",
                example=1 << 20,
            ),
            problems.integer("buffer_count", buffer_count, low=2, why="one buffer updating, one in I/O", example=16),
        ]
        problems.integer(
            "io_block_size",
            io_block_size,
            low=IO_ALIGN,
            high=1 << 30,
            multiple=IO_ALIGN,
            unit="bytes",
            why="the direct-I/O unit; one system call moves at most 2 GiB",
            example=1 << 20,
        )
        problems.integer("io_queue_depth", io_queue_depth, low=1, high=1024, example=8)
        problems.integer("io_threads", io_threads, low=1, high=1024, example=3)
        problems.number(
            "device_timeout_s",
            device_timeout_s,
            low=0,
            above=True,
            high=threading.TIMEOUT_MAX,
            unit="seconds",
            why="the longest wait Python's threading allows; None waits forever",
            example=300.0,
            optional=True,
        )
        for name, value in (
            ("overlap_backward", overlap_backward),
            ("prefetch_state", prefetch_state),
            ("offload_parameters", offload_parameters),
            ("contiguous_gradients", contiguous_gradients),
            ("overlap_comm", overlap_comm),
        ):
            problems.flag(name, value)
        problems.integer(
            "reduce_bucket_size",
            reduce_bucket_size,
            low=1,
            why="elements; None follows `sub_group_size`",
            example=200_000_000,
            optional=True,
        )
        problems.integer("allgather_bucket_size", allgather_bucket_size, low=1, why="elements", example=200_000_000)
        if logging_batch_size_per_gpu != "auto":
            problems.integer(
                "logging_batch_size_per_gpu",
                logging_batch_size_per_gpu,
                low=1,
                why="or 'auto' for the train dataloader's batch size",
                example="auto",
            )
        problems.number("loss_scale", loss_scale, low=0, high=1 << 127, why="0: dynamic loss scaling", example=0)
        problems.integer(
            "initial_scale_power",
            initial_scale_power,
            high=127,
            why="the loss scale 2**power must be a finite fp32 number",
            example=16,
        )
        problems.integer("loss_scale_window", loss_scale_window, low=1, example=1000)
        problems.integer("hysteresis", hysteresis, low=1, example=2)
        problems.number("min_loss_scale", min_loss_scale, low=0, above=True, high=1 << 127, example=1)
        if not (isinstance(logging_level, str) and isinstance(logging.getLevelName(logging_level), int)):
            problems.integer("logging_level", logging_level, why="a `logging` level, or its name", example=logging.WARN)
        for name, value, kind, allowed in (
            ("accelerator", accelerator, Accelerator, "an `Accelerator`, or None (`Trainer(accelerator=...)` sets it)"),
            ("parallel_devices", parallel_devices, (list, tuple), "a list of `torch.device`, or None"),
            ("cluster_environment", cluster_environment, ClusterEnvironment, "a `ClusterEnvironment`, or None"),
            ("precision_plugin", precision_plugin, DeepSpeedPrecision, "a `SmartInfinityPrecision`, or None"),
            ("process_group_backend", process_group_backend, str, "a backend name such as 'nccl' or 'gloo', or None"),
            ("timeout", timeout, timedelta, "a `datetime.timedelta`, or None"),
        ):
            if value is not None:
                problems.instance(name, value, kind, allowed)
        if not isinstance(offload_activations, bool):
            from lightning_smartinf.activations.callback import check_offload_options

            check_offload_options(problems, "offload_activations", offload_activations)

        self._storage_paths = self._validate_storage_paths(storage_paths, problems)
        if backend == "xrt":
            from lightning_smartinf.csd.xrt import check_xrt_settings

            try:
                check_xrt_settings(xclbin, xrt_devices, self._storage_paths)
            except (ValueError, FileNotFoundError) as exc:
                problems.add(f"`backend='xrt'`: {exc}")
        elif xclbin is not None or xrt_devices is not None:
            problems.add(
                f"`xclbin=...` and `xrt_devices=...` apply to `backend='xrt'` only, but `backend={backend!r}`. Drop "
                "them or pass `backend='xrt'`."
            )
        self.compression = self._validate_compression(compression, problems)
        if all(counts) and backend == "cpu":
            # The xrt backend's buffers are in the SmartSSDs' DDR; the cpu backend's are here.
            paths = len(storage_paths) if isinstance(storage_paths, (list, tuple)) else 1
            problems.fits_in_memory(
                f"`buffer_count={buffer_count}` with `chunk_size={chunk_size}` on {paths} storage path(s)",
                pool_bytes(paths, buffer_count, chunk_size),
                f"{paths} x {buffer_count} buffers x {chunk_size} elements x 4 B x {POOL_TENSORS} fp32 tensors: master "
                "weight and 2 Adam states",
                "Lower `buffer_count` (at least 2) or `chunk_size`.",
            )

        #: Whether devices start updating during backward (see ``overlap_backward``).
        self.overlap_backward = overlap_backward is True and backend == "cpu" and self.compression is None
        if reduce_bucket_size is None and counts[0]:
            reduce_bucket_size = (
                min(200_000_000, max(sub_group_size, 1 << 20)) if self.overlap_backward else 200_000_000
            )
        smart_config = self._smart_update_config(
            self._load_config(config, problems),
            problems,
            sub_group_size=sub_group_size,
            offload_parameters=offload_parameters,
            reduce_bucket_size=reduce_bucket_size,
            allgather_bucket_size=allgather_bucket_size,
            contiguous_gradients=contiguous_gradients,
            overlap_comm=overlap_comm,
        )
        zero_sub_group = smart_config["zero_optimization"].get("sub_group_size")
        if self.compression is not None and isinstance(zero_sub_group, (int, float)) and zero_sub_group >= 1 << 31:
            problems.add(
                f"`compression` with a ZeRO `sub_group_size` of {zero_sub_group:.0f}: compressed gradients address "
                "their entries inside a sub-group with int32 indices, so it must be < 2**31. Lower `sub_group_size` "
                "(e.g. 40_000_000)."
            )
        problems.raise_if_any()

        self._offload_activations = offload_activations
        self.io_engine = io_engine
        self.io_block_size = io_block_size
        self.io_queue_depth = io_queue_depth
        self.io_threads = io_threads
        #: Seconds a device may take to answer before the run fails with a ``StorageError``; ``None``: no limit.
        self.device_timeout_s = None if device_timeout_s is None else float(device_timeout_s)
        self.backend_name = backend
        self.xclbin = xclbin
        self.xrt_devices = xrt_devices
        #: Kept ratio of the coming steps; ``None`` = dense. Moved by :class:`CompressionWarmup`.
        self._kept_ratio = self.compression.ratio if self.compression is not None else None
        self.chunk_size = chunk_size
        self.buffer_count = buffer_count
        self.prefetch_state = prefetch_state
        if overlap_backward and not self.overlap_backward:
            why = "`compression`" if self.compression is not None else f"`backend={backend!r}`"
            log.info("smart_infinity: updates start after backward, not during it (not supported with %s).", why)
        self._backend: Backend | None = None
        self._closed_traffic = TrafficSnapshot()
        if logging_batch_size_per_gpu != "auto":
            smart_config.setdefault("train_micro_batch_size_per_gpu", logging_batch_size_per_gpu)
        super().__init__(
            accelerator=accelerator,
            config=smart_config,
            loss_scale=loss_scale,
            initial_scale_power=initial_scale_power,
            loss_scale_window=loss_scale_window,
            hysteresis=hysteresis,
            min_loss_scale=min_loss_scale,
            logging_level=logging_level,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )

    # ----------------------------------------------------------------------------------------- configuration

    @staticmethod
    def _validate_storage_paths(storage_paths: Any, problems: Problems) -> list[Path] | None:
        """``storage_paths`` resolved, each named once; ``None`` if not given or bad.

        Each is a writable directory, or does not exist yet and can be created: its parent is a writable directory.
        Nothing is created here: each rank creates its own share at set-up (:meth:`_rank_device_dirs`).
        """
        paths = problems.paths("storage_paths", storage_paths, optional=True)
        if paths is None:
            return None
        resolved: dict[Path, Any] = {}
        for original in paths:
            try:
                path = validate_storage_path(original, missing_ok=True)
            except (ValueError, OSError) as exc:  # OSError: a name the OS refuses (too long, ...)
                text = str(exc)
                problems.add(
                    text if text.startswith("`storage_paths`") else f"`storage_paths` entry {original!r}: {text}"
                )
                continue
            if path in resolved:
                problems.add(
                    f"`storage_paths` names {str(resolved[path])!r} and {str(original)!r}, which are the same "
                    "directory; two devices cannot share one storage path. Remove the duplicate."
                )
            resolved[path] = original
        return list(resolved) if len(resolved) == len(paths) else None

    @override
    def _load_config(
        self, config: _PATH | dict[str, Any] | None, problems: Problems | None = None
    ) -> dict[str, Any] | None:
        """The user's DeepSpeed config: ``config``, or the JSON file it names (``$PL_DEEPSPEED_CONFIG_PATH`` when it
        is ``None``). On a problem, adds it to ``problems`` (raises at once without) and returns ``None``."""
        own = problems is None
        problems = Problems(type(self).__name__, MisconfigurationException) if own else problems
        name = "config"
        if config is None and self.DEEPSPEED_ENV_VAR in os.environ:
            config, name = os.environ[self.DEEPSPEED_ENV_VAR], self.DEEPSPEED_ENV_VAR
        loaded: Any = config
        if isinstance(config, (str, os.PathLike)):
            loaded, path, shown = None, Path(config), f"`{name}={str(config)!r}`"
            if not path.is_file():
                kind = "is a directory" if path.is_dir() else "does not exist"
                problems.add(f"{shown} {kind}: pass a DeepSpeed config dict or the path of a JSON file. Fix the path.")
            else:
                try:
                    loaded = json.loads(path.read_text())
                except json.JSONDecodeError as exc:
                    problems.add(
                        f"{shown} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}). Fix the file."
                    )
                except (OSError, UnicodeDecodeError) as exc:
                    problems.add(f"{shown} cannot be read ({exc}). Fix its permissions or pass another file.")
                if loaded is not None and not isinstance(loaded, dict):
                    problems.add(
                        f"{shown} holds a JSON {type(loaded).__name__}, not an object: a DeepSpeed config is a JSON "
                        "object of settings (`{...}`)."
                    )
                    loaded = None
        elif config is not None and not problems.instance(
            name, config, dict, "a DeepSpeed config dict, the path of a JSON file, or None"
        ):
            loaded = None
        if isinstance(loaded, dict):
            try:
                json.dumps(loaded)
            except (TypeError, ValueError) as exc:
                problems.add(
                    f"`{name}` holds a value JSON cannot represent ({exc}). Use numbers, strings, lists, dicts."
                )
                loaded = None
        if own:
            problems.raise_if_any()
        return loaded

    @staticmethod
    def _smart_update_config(user_config: dict[str, Any] | None, problems: Problems, **settings: Any) -> dict[str, Any]:
        """``user_config`` with SmartUpdate's settings added; adds a problem for each key that contradicts them."""
        config = json.loads(json.dumps(user_config)) if user_config else {}
        where = problems.within("config")
        zero = config.setdefault("zero_optimization", {})
        if not where.instance("zero_optimization", zero, dict, "a dict of ZeRO settings, or left out"):
            zero = config["zero_optimization"] = {}
        inside = where.within("zero_optimization")
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
                f"`{inside.name('offload_param')}['device']='nvme'` is not supported with SmartUpdate; use 'cpu' "
                "(`offload_parameters=True`)."
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
        for block in ("fp16", "bf16", "aio", "activation_checkpointing"):
            if block in config:
                where.instance(block, config[block], dict, f"a dict of DeepSpeed `{block}` settings")
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
        zero["stage"] = 3
        zero.setdefault("sub_group_size", settings["sub_group_size"])
        zero.setdefault("reduce_bucket_size", settings["reduce_bucket_size"])
        zero.setdefault("allgather_bucket_size", settings["allgather_bucket_size"])
        zero.setdefault("contiguous_gradients", settings["contiguous_gradients"])
        zero.setdefault("overlap_comm", settings["overlap_comm"])
        # The path is replaced per rank at set-up; "nvme" makes ZeRO keep only empty fp32 placeholders.
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": tempfile.gettempdir()}
        if settings["offload_parameters"] is True:
            zero["offload_param"] = {"device": "cpu"}
        config["zero_allow_untested_optimizer"] = True
        config["zero_force_ds_cpu_optimizer"] = False
        return config

    @property
    @override
    def precision_plugin(self) -> Precision:
        return super().precision_plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        # The connector hands every DeepSpeedStrategy a plain DeepSpeedPrecision; ours adds validation and link dtype.
        if isinstance(plugin, DeepSpeedPrecision) and not isinstance(plugin, SmartInfinityPrecision):
            plugin = SmartInfinityPrecision(plugin.precision)
        elif plugin is not None and not isinstance(plugin, SmartInfinityPrecision):
            raise MisconfigurationException(
                f"`SmartInfinityStrategy` needs a `SmartInfinityPrecision` plugin, got `{type(plugin).__name__}`. "
                "Pass `precision=...` to the Trainer instead."
            )
        self._precision_plugin = plugin

    @override
    def setup_environment(self) -> None:
        # Known-harmless warnings of DeepSpeed, torch and Lightning stay silent until teardown (see `quiet`).
        if self._silenced is None:
            self._silenced = quiet.silence()
        super().setup_environment()
        if self._offload_activations and self.lightning_module is not None:
            from lightning_smartinf.activations import ActivationOffload

            trainer = self.lightning_module.trainer
            if not any(isinstance(c, ActivationOffload) for c in trainer.callbacks):
                options = {} if self._offload_activations is True else dict(self._offload_activations)
                trainer.callbacks.append(ActivationOffload(**options))

    # ------------------------------------------------------------------------------------------ engine set-up

    @override
    def _init_optimizers(self) -> tuple[Optimizer, Any]:
        optimizer, scheduler = super()._init_optimizers()
        try:
            for group in optimizer.param_groups:
                rule = rule_for_group(optimizer, group)
                if self.compression is not None:
                    check_sparse_supported(rule)
        except ValueError as exc:
            raise MisconfigurationException(str(exc)) from None
        return optimizer, scheduler

    def _rank_storage_paths(self) -> list[Path]:
        """This rank's share of ``storage_paths``: every ``ranks_per_node``-th one, from ``local_rank``."""
        assert self._storage_paths is not None
        return self._storage_paths[self.local_rank :: max(1, self.num_processes)]

    @staticmethod
    def _validate_compression(compression: Any, problems: Problems) -> TopKCompression | None:
        """``compression`` as a :class:`TopKCompression` (``None``: dense, or a problem was added)."""
        if compression is None or isinstance(compression, TopKCompression):
            return compression
        if isinstance(compression, dict):
            fields = [f.name for f in dataclasses.fields(TopKCompression)]
            inside = problems.within("compression")
            valid = problems.keys("compression", compression, fields, required=["ratio"])
            if "ratio" in compression:
                valid = inside.ratio("ratio", compression["ratio"]) and valid
            for key in ("error_feedback", "layerwise"):
                if key in compression:
                    valid = inside.flag(key, compression[key]) and valid
            return TopKCompression(**compression) if valid else None
        if isinstance(compression, (int, float)) and not isinstance(compression, bool):
            return TopKCompression(compression) if problems.ratio("compression", compression) else None
        problems.instance(
            "compression",
            compression,
            (),
            "the kept ratio (a number with 0 < ratio <= 1, e.g. 0.01), a dict like "
            "{'ratio': 0.01, 'error_feedback': False}, a `TopKCompression`, or None",
            fix="Pass e.g. `compression=0.01`." if not isinstance(compression, str) else "",
        )
        return None

    @property
    def kept_ratio(self) -> float | None:
        """Fraction of gradient entries the coming steps send (``None``: dense)."""
        return self._kept_ratio

    def set_kept_ratio(self, ratio: float | None) -> None:
        """Change the kept ratio from the next optimizer step on (``None``: send dense gradients)."""
        if self.compression is None:
            raise MisconfigurationException(
                "Gradient compression is off: pass `SmartInfinityStrategy(compression=...)` (or use the "
                "'smart_infinity_comp' preset) before scheduling a kept ratio."
            )
        if ratio is not None:
            try:
                check_ratio(ratio)
            except ValueError as exc:
                raise MisconfigurationException(f"`set_kept_ratio`: {exc}") from None
        self._kept_ratio = ratio
        if self._backend is not None and self.deepspeed_engine is not None:
            self.deepspeed_engine.optimizer.smartinf_kept_ratio = ratio

    def _rank_xrt_devices(self) -> list[int | str] | None:
        """This rank's XRT devices, paired with :meth:`_rank_storage_paths` (``None``: map by mount)."""
        if self.xrt_devices is None:
            return None
        return self.xrt_devices[self.local_rank :: max(1, self.num_processes)]

    #: The known-harmless warnings silenced from set-up to teardown (:mod:`lightning_smartinf.quiet`).
    _silenced: quiet.Silenced | None = None
    #: Removes the temporary device directories of the last run (``storage_paths=None``); see :meth:`release_backend`.
    _release_storage: weakref.finalize | None = None

    def _rank_device_dirs(self) -> tuple[list[Path], list[Path]]:
        """Create this rank's device directories (0700); return them and those the backend must remove at the end.

        This rank's storage paths that do not exist yet are created first (0700; logged).

        Raises:
            StorageError: a storage path cannot be created, a directory is in use by another training (nothing in it
                was touched), or a component below a storage path is a symbolic link or not a directory.
        """
        # A run starting ends the after-`fit` life of every finished run's temporary state in this process (a
        # strategy is not reliably garbage-collected: Lightning's logging keeps bound methods of it), so at most
        # one finished run's state lingers.
        while _lingering_temporary_state:
            _lingering_temporary_state.pop()()
        if self._storage_paths is None:
            for stale in remove_stale_temp_dirs():
                log.info(f"SmartUpdate removed {str(stale)!r}, the temporary device directory of a run that died")
            directory = make_temp_device_dir(self.global_rank)
            return [directory], [directory]
        mine = self._rank_storage_paths()
        if not mine:
            raise MisconfigurationException(
                f"`SmartInfinityStrategy(storage_paths=...)` gives {len(self._storage_paths)} path(s) to "
                f"{max(1, self.num_processes)} ranks per node, so ranks would share a storage path. Pass at least "
                "one path per rank (directories on the same disk work, e.g. /mnt/nvme/r0 and /mnt/nvme/r1)."
            )
        for path in mine:
            # Checked at construction (its parent is a writable directory); created only now, by the rank using it.
            if create_storage_path(path):
                log.info(
                    f"SmartUpdate rank {self.global_rank} created storage path {str(path)!r} (mode 0700): it did not "
                    "exist"
                )
        directories = [make_private_dirs(p, (_STATE_DIR, f"rank{self.global_rank:03d}")) for p in mine]
        # Fails before DeepSpeed's set-up; the backend's claim, taken when it is built, is what holds them.
        check_unclaimed(directories)
        return directories, []

    def _io_factory(self, device_dirs: list[Path]) -> Callable[[], IOEngine]:
        """The I/O engine each device uses, chosen once per rank and logged."""
        direct = all(supports_direct_io(d) for d in device_dirs)
        block, depth = self.io_block_size, self.io_queue_depth
        reason = ""
        if self.io_engine != "threads":
            if not direct:
                reason = "a storage path's filesystem refuses O_DIRECT, so I/O is buffered (page cache in play)"
            else:
                try:
                    from lightning_smartinf.zero.aio import DeepSpeedAIO, load_aio_op, lockable_bytes, memlock_error

                    op = load_aio_op()
                except Exception as exc:  # noqa: BLE001 - any build or load failure means: fall back
                    reason = f"DeepSpeed's async_io op is unavailable ({exc})"
                else:
                    # The pools are page-locked (worst case: master + 3 states per element); a lock that fails would
                    # abort inside DeepSpeed, so a process that may not lock that much never gets the aio engine.
                    need = len(device_dirs) * self.buffer_count * self.chunk_size * 4 * 4
                    limit = lockable_bytes()
                    if limit is not None and need > limit:
                        reason = memlock_error(need, limit)
                    else:
                        log.info(f"SmartUpdate rank {self.global_rank}: device I/O through {DeepSpeedAIO.name}")
                        return lambda: DeepSpeedAIO(block, depth, op=op)
            if self.io_engine == "aio":
                raise MisconfigurationException(
                    f"`SmartInfinityStrategy(io_engine='aio')` cannot be used: {reason}. Use `io_engine='threads'` "
                    "or `'auto'`."
                )
            rank_zero_warn(f"SmartUpdate falls back to thread-pool pread/pwrite: {reason}.")
        mode = "direct" if direct else "buffered"
        log.info(f"SmartUpdate rank {self.global_rank}: device I/O through {ThreadedIO.name}, {mode}")
        return lambda: ThreadedIO(block, depth)

    @override
    def _setup_model_and_optimizer(
        self, model: Module, optimizer: Optimizer | None, lr_scheduler: Any = None
    ) -> tuple[Any, Optimizer]:
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        precision = self.precision_plugin.precision
        if precision in ("16-mixed", "16-true") and not get_accelerator().is_fp16_supported():
            raise MisconfigurationException(
                f"`precision={precision!r}` needs fp16 support, which DeepSpeed's "
                f"`{get_accelerator().device_name()}` accelerator lacks on this machine. Use "
                "`precision='bf16-mixed'` (or train on a GPU)."
            )
        if optimizer is None:
            raise MisconfigurationException(
                "`SmartInfinityStrategy` needs an optimizer from `LightningModule.configure_optimizers` (one of "
                f"{', '.join(SUPPORTED_OPTIMIZERS)})."
            )
        device_dirs, owned = self._rank_device_dirs()
        # ZeRO copies its swap folder into checkpoints; ours stays empty (device state is saved separately).
        if self.is_global_zero and (
            note := quiet.endurance_note([str(d) for d in device_dirs], self._state_bytes(optimizer) // self.world_size)
        ):
            rank_zero_warn(note)
        engine_swap = make_private_dirs(device_dirs[0], ("engine-swap",))
        assert isinstance(self.config, dict)
        self.config["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(engine_swap)

        # The xrt backend moves state SSD <-> FPGA itself (P2P); only the cpu backend needs a host I/O engine.
        io_factory = self._io_factory(device_dirs) if self.backend_name == "cpu" else None

        def make_backend() -> Backend:
            if self.backend_name == "xrt":
                from lightning_smartinf.csd.xrt import XrtBackend

                self._backend = XrtBackend(
                    device_dirs,
                    xclbin=self.xclbin,
                    devices=self._rank_xrt_devices(),
                    chunk_elems=self.chunk_size,
                    buffer_count=self.buffer_count,
                    owned_dirs=owned,
                    prefetch_state=self.prefetch_state,
                    device_timeout_s=self.device_timeout_s,
                )
            else:
                assert io_factory is not None
                self._backend = CpuBackend(
                    device_dirs,
                    chunk_elems=self.chunk_size,
                    buffer_count=self.buffer_count,
                    owned_dirs=owned,
                    io_factory=io_factory,
                    io_threads=self.io_threads,
                    tentative_slots=self.overlap_backward,
                    prefetch_state=self.prefetch_state,
                    device_timeout_s=self.device_timeout_s,
                )
            return self._backend

        model_parameters = filter(lambda p: p.requires_grad, model.parameters())
        try:
            with smart_update_optimizer(make_backend):
                engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
                    args=self._deepspeed_args(),
                    config=self.config,
                    model=model,
                    model_parameters=model_parameters,
                    optimizer=optimizer,
                    lr_scheduler=lr_scheduler,
                    dist_init_required=False,
                )
        except StorageError as exc:
            raise exc.with_traceback(None) from None  # no frames from inside DeepSpeed
        deepspeed_optimizer.smartinf_compression = self.compression
        deepspeed_optimizer.smartinf_overlap = self.overlap_backward
        deepspeed_optimizer.smartinf_kept_ratio = self._kept_ratio
        return engine, deepspeed_optimizer

    @staticmethod
    def _state_bytes(optimizer: Optimizer) -> int:
        """Bytes of fp32 master weights and optimizer states of this rank's trainable parameters (before ZeRO)."""
        return sum(
            getattr(p, "ds_numel", p.numel()) * rule_for_group(optimizer, group).bytes_per_element  # ZeRO-3: full size
            for group in optimizer.param_groups
            for p in group["params"]
            if p.requires_grad
        )

    @property
    def sub_group_size(self) -> int:
        assert isinstance(self.config, dict)
        return int(self.config["zero_optimization"]["sub_group_size"])

    @property
    def devices_per_rank(self) -> int:
        """Devices (storage paths) each rank drives."""
        if self._storage_paths is None:
            return 1
        return len(self._rank_storage_paths())

    @property
    def backend(self) -> CpuBackend:
        """This rank's backend; exists between engine set-up and teardown."""
        if self._backend is None:
            raise RuntimeError("The SmartUpdate backend exists only while `Trainer.fit` runs (after set-up).")
        return self._backend

    def release_backend(self) -> None:
        """Finish outstanding device work, then free buffer pools and threads, and give up the storage. Idempotent.

        With ``storage_paths=None`` the temporary device directories (and the state in them) outlive this call, still
        owned by this process, so that ``trainer.save_checkpoint`` after ``fit`` can copy the final state; they are
        removed when the next run in this process starts, when the strategy is garbage-collected, or at exit.
        """
        if self._backend is None:
            return
        backend, self._backend = self._backend, None
        self._closed_traffic = backend.traffic_snapshot()
        backend.close(keep_claims=True)
        if self._storage_paths is None:
            self._release_storage = weakref.finalize(self, backend.release_storage)
            _lingering_temporary_state.append(self._release_storage)
        else:
            backend.release_storage()

    # ------------------------------------------------------------------------------------------------ traffic

    @property
    def traffic(self) -> TrafficSnapshot:
        """Cumulative bytes moved by this rank's devices: link (host↔device) and storage (inside the device)."""
        return self._backend.traffic_snapshot() if self._backend is not None else self._closed_traffic

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        before = self.traffic
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        module = self.lightning_module
        if module is not None and module._current_fx_name is not None:
            delta = self.traffic - before
            metrics = {f"smartinf/{name}": float(value) for name, value in delta.as_dict().items()}
            if self.compression is not None:
                kept, total = self.deepspeed_engine.optimizer.smartinf_last_kept
                metrics["smartinf/kept_ratio"] = kept / max(1, total)
                # Dense gradient bytes over the gradient bytes sent: 1.0 when dense, about 33 at 1% with bf16.
                dense_bytes = total * self.precision_plugin.link_dtype.itemsize
                metrics["smartinf/compression_ratio"] = dense_bytes / max(1, delta.link_write_bytes)
            for name, value in metrics.items():
                module.log(name, value, on_step=True, on_epoch=False, sync_dist=False, reduce_fx="sum")
        return output

    # --------------------------------------------------------------------------------------------- checkpoints

    @override
    def save_checkpoint(self, checkpoint: dict, filepath: _PATH, storage_options: Any | None = None) -> None:
        """Save a checkpoint directory at ``filepath``, replacing any checkpoint there whole and atomically.

        Every rank writes its part (DeepSpeed's files, Lightning's client state, its device state) into one staging
        directory beside ``filepath``; rank 0 seals it (global step, every file's size and CRC-32) and swaps it in.
        A kill at any instant leaves the previous checkpoint or the new one at ``filepath``.
        """
        if storage_options is not None:
            raise TypeError(
                "`Trainer.save_checkpoint(..., storage_options=...)` is not supported by `SmartInfinityStrategy`: "
                "checkpoints are directories written by DeepSpeed and the devices. Drop `storage_options`."
            )
        failure = self.deepspeed_engine.optimizer.smartinf_backend.failure
        if failure is not None:
            refusal = StorageError(
                f"`save_checkpoint({str(filepath)!r})` refused: a device failed earlier, so the state on the devices "
                "may be torn, and a checkpoint of it would be worse than none. The last good checkpoint is as it was; "
                f"resume from it once the storage is fixed. The error was: {failure}",
                path=getattr(failure, "path", None),
                operation=getattr(failure, "operation", None),
                errno=getattr(failure, "errno", None),
            )
            module = self.lightning_module
            interrupted = module is not None and module.trainer.state.status == TrainerStatus.INTERRUPTED
            if interrupted and self._backend is not None:
                # A save on the way out of the failed run, before teardown (`OnExceptionCheckpoint`): raising here
                # would keep Lightning from tearing the run down and releasing the devices; the run's own error follows.
                rank_zero_warn(str(refusal))
                return
            raise refusal
        target = Path(self.broadcast(os.path.abspath(filepath)))
        staging: str | None = None
        if self.is_global_zero:
            target.parent.mkdir(parents=True, exist_ok=True)
            checkpoint_dir.remove_leftovers(target.parent)
            staging_dir = checkpoint_dir.staging_path(target)
            staging_dir.mkdir(mode=0o700)
            staging = str(staging_dir)
        staging_dir = Path(self.broadcast(staging))
        try:
            super().save_checkpoint(checkpoint, staging_dir)
            self._save_device_state(staging_dir, int(checkpoint["global_step"]))
            self.barrier("smartinf_save_checkpoint")
            if self.is_global_zero:
                checkpoint_dir.seal(staging_dir, global_step=int(checkpoint["global_step"]), world_size=self.world_size)
                checkpoint_dir.install(staging_dir, target)
        except BaseException as exc:
            if self.is_global_zero:
                shutil.rmtree(staging_dir, ignore_errors=True)
            if isinstance(exc, OSError):  # StorageError included: say which checkpoint, and that the old one stands
                raise StorageError(
                    f"Saving checkpoint {str(target)!r} failed: {exc} Nothing was written at that name; the previous "
                    "checkpoint there, if any, is untouched.",
                    path=getattr(exc, "path", None) or exc.filename,
                    operation=getattr(exc, "operation", None) or "save",
                    errno=exc.errno,
                ) from exc
            raise
        self.barrier("smartinf_checkpoint_installed")

    def _save_device_state(self, root: Path, global_step: int) -> None:
        """This rank's device state, residual and host state under ``root``; host state last, recording the step."""
        zero_optimizer = self.deepspeed_engine.optimizer
        directory = checkpoint_dir.rank_state_dir(root, self.global_rank)
        # Between a backward and its step, updates made during backward are still tentative: the backend saves
        # the committed state, the one before this step, like every other part of the checkpoint.
        zero_optimizer.smartinf_backend.save(directory)
        host_state = zero_optimizer.smartinf_state_dict()
        host_state["global_step"] = global_step
        residual = zero_optimizer.smartinf_residual
        if residual is not None:
            from safetensors.torch import save as safetensors_bytes

            path = directory / _RESIDUAL
            write_file_atomic(path, safetensors_bytes({"residual": residual.detach().cpu().contiguous()}))
            size, crc = file_crc32(path)
            host_state["residual"] = {"file": _RESIDUAL, "bytes": size, "crc32": crc}
        write_file_atomic(directory / _HOST_STATE, json.dumps(host_state).encode())

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Delete a checkpoint (``ModelCheckpoint``'s ``save_top_k`` rotation) so that no kill leaves part of it."""
        if self.is_global_zero:
            checkpoint_dir.retire(Path(filepath))

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Verify the checkpoint against its seal, then load it without unpickling code (``weights_only=True``).

        ``fit`` restores DeepSpeed's and Lightning's state and every rank's device state; ``validate``, ``test``
        and ``predict`` load the trained weights (the fp32 masters on the devices, cast to the model's dtypes).
        """
        root = Path(checkpoint_path).resolve()  # the path itself may be a link (`save_last="link"`); nothing inside
        try:
            seal = checkpoint_dir.verify(root)
            if seal["world_size"] != self.world_size:
                raise CheckpointError(
                    f"{root / checkpoint_dir.SEAL} was saved by {seal['world_size']} ranks, this run has "
                    f"{self.world_size}. Resume with the same number of ranks, or export the weights "
                    "(`smartinf export`) and start a new run from them."
                )
            model_states = root / checkpoint_dir.TAG / checkpoint_dir.MODEL_STATES
            assert self.lightning_module is not None
            if self.lightning_module.trainer.state.fn == "fit":
                client_state = self._load_for_fit(root, seal)
            else:
                client_state = load_deepspeed_file(model_states)
                self._load_trained_weights(root)
            if client_state.get("global_step") != seal["global_step"]:
                raise CheckpointError(
                    f"{model_states} holds global step {client_state.get('global_step')!r}, but "
                    f"{root / checkpoint_dir.SEAL} records step {seal['global_step']}: the checkpoint's parts come "
                    "from different saves. Resume from another checkpoint."
                )
        except CheckpointError:
            raise
        except ValueError as exc:  # the device state's own checks (manifest, sizes, CRC-32), named by file
            raise CheckpointError(str(exc)) from None
        return client_state

    def _load_for_fit(self, root: Path, seal: dict[str, Any]) -> dict[str, Any]:
        directory = checkpoint_dir.rank_state_dir(root, self.global_rank)
        state = checkpoint_dir.read_json(
            directory / _HOST_STATE, "the device state", ("global_step", "num_shards", "group_steps", "loss_scale")
        )
        if state["global_step"] != seal["global_step"]:
            raise CheckpointError(
                f"{directory / _HOST_STATE} records global step {state['global_step']!r}, but "
                f"{root / checkpoint_dir.SEAL} records step {seal['global_step']}: the device state comes from "
                "another save. Resume from another checkpoint."
            )
        engine = self.deepspeed_engine
        with safe_checkpoint_engine(engine):
            _, client_state = engine.load_checkpoint(
                str(root),
                tag=checkpoint_dir.TAG,
                load_optimizer_states=True,
                load_lr_scheduler_states=False,
                load_module_strict=self.lightning_module.strict_loading,
            )
        if client_state is None:
            raise CheckpointError(f"{root} holds no DeepSpeed model states for this rank.")
        zero_optimizer = engine.optimizer
        residual = self._load_residual(directory, state.get("residual"))
        zero_optimizer.smartinf_discard_early()
        zero_optimizer.smartinf_backend.load(directory)
        zero_optimizer.load_smartinf_state_dict(state)
        zero_optimizer.load_smartinf_residual(residual, state.get("residual_loss_scale"))
        zero_optimizer.smartinf_refresh_params()
        return client_state

    def _load_trained_weights(self, root: Path) -> None:
        """Put the checkpoint's fp32 masters (cast to each parameter's dtype) into the evaluation engine's module.

        Parameters the devices never held (frozen ones) keep the values the module was built with.
        """
        import deepspeed

        from lightning_smartinf.export import consolidate_fp32_state_dict

        weights = consolidate_fp32_state_dict(root)
        module = self.lightning_module
        assert module is not None
        params = dict(module.named_parameters())
        if unknown := sorted(set(weights) - set(params)):
            raise CheckpointError(
                f"{root} holds weights for {unknown[:5]}, which this module does not have. Evaluate it with the "
                "module it was trained with."
            )
        with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0), torch.no_grad():
            for name, value in weights.items():
                params[name].copy_(value.view(params[name].shape).to(params[name].dtype))

    def _load_residual(self, directory: Path, entry: dict | None) -> Any:
        """The compression residual saved in ``directory``, verified against its size and CRC-32, or ``None``."""
        if entry is None:
            return None
        path = directory / _RESIDUAL
        if not path.is_file():
            raise MisconfigurationException(
                f"The compression residual {path} is missing: the checkpoint is incomplete. Resume from another one."
            )
        size, crc = file_crc32(path)
        if (crc, size) != (entry["crc32"], entry["bytes"]):
            raise MisconfigurationException(
                f"The compression residual {path} is corrupt ({size} bytes, CRC-32 {crc:#010x}; the checkpoint "
                f"recorded {entry['bytes']} bytes, CRC-32 {entry['crc32']:#010x}). Resume from another checkpoint."
            )
        if self.compression is None or not self.compression.error_feedback:
            rank_zero_warn(
                "The checkpoint holds an error-feedback residual, but this run does not use error feedback; the "
                "residual (gradient not yet sent) is dropped."
            )
            return None
        from safetensors.torch import load_file

        return load_file(str(path))["residual"]

    @override
    def teardown(self) -> None:
        try:
            try:
                super().teardown()
            finally:
                self.release_backend()
        finally:  # also after a device error made the teardown itself fail
            if self._silenced is not None:
                self._silenced.restore()
                self._silenced = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "smart_infinity",
            cls,
            description="ZeRO-3 with optimizer state and update on near-storage devices (emulated on CPU by default)",
        )
        strategy_registry.register(
            "smart_infinity_comp",
            cls,
            description="smart_infinity with top-1% gradient compression and error feedback (SmartComp)",
            compression=0.01,
        )
