"""``SmartInfinityStrategy``: DeepSpeed ZeRO-3 with the optimizer update run next to the storage."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.plugins.precision.deepspeed import DeepSpeedPrecision
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_smartinf.cpu_support import DeepSpeedOnCPUMixin
from lightning_smartinf.csd import Backend, CpuBackend, StorageError, TrafficSnapshot, validate_storage_path
from lightning_smartinf.csd.checkpoint import file_crc32, write_file_atomic
from lightning_smartinf.csd.compression import TopKCompression, check_ratio, check_sparse_supported
from lightning_smartinf.csd.io import IOEngine, ThreadedIO, supports_direct_io
from lightning_smartinf.csd.storage import ensure_private_dir
from lightning_smartinf.csd.torch_optim import SUPPORTED_OPTIMIZERS, rule_for_group
from lightning_smartinf.precision import SmartInfinityPrecision
from lightning_smartinf.zero import check_deepspeed_version, smart_update_optimizer

BACKENDS = ("cpu", "xrt")
IO_ENGINES = ("auto", "aio", "threads")
_STATE_DIR = "smartinf"
log = logging.getLogger(__name__)
_HOST_STATE = "host_state.json"
_RESIDUAL = "residual.safetensors"


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
            ``storage_paths[r::ranks_per_node]``); each rank needs at least one of its own. ``None``: one
            private temporary directory per rank, removed at the end.
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
        io_engine: how devices move state to and from their storage: ``"aio"`` (DeepSpeed's libaio op,
            direct I/O), ``"threads"`` (``pread``/``pwrite`` on a thread pool) or ``"auto"`` (aio where it
            loads and the filesystem allows ``O_DIRECT``, else threads; the choice is logged).
        io_block_size: bytes per I/O request (a multiple of 4096).
        io_queue_depth: I/O requests in flight per chunk transfer.
        io_threads: chunk transfers each emulated device (``backend="cpu"``) keeps in flight per direction;
            reads are also capped at ``buffer_count - 1``.
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
        config: a DeepSpeed config dict or JSON path to start from; SmartUpdate adds its own keys and
            rejects settings that contradict it (optimizer offload, a DeepSpeed ``optimizer`` block, stages < 3).
        reduce_bucket_size: elements of gradients ZeRO reduces at once. Gradients reach the devices one bucket at a
            time, so ``None`` picks ``sub_group_size`` (within 1M..200M) when ``overlap_backward`` is in effect,
            letting each device start as soon as its sub-group is reduced, and Lightning's 200M otherwise.
        allgather_bucket_size, contiguous_gradients, overlap_comm, logging_batch_size_per_gpu,
        loss_scale, initial_scale_power, loss_scale_window, hysteresis, min_loss_scale, logging_level,
        parallel_devices, cluster_environment, precision_plugin, process_group_backend, timeout:
            as in :class:`~lightning.pytorch.strategies.DeepSpeedStrategy`.
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
        if backend not in BACKENDS:
            raise MisconfigurationException(
                f"`SmartInfinityStrategy(backend={backend!r})` is not supported. `backend` must be one of: "
                f"{', '.join(map(repr, BACKENDS))}."
            )
        for name, value, minimum in (
            ("sub_group_size", sub_group_size, 1),
            ("buffer_count", buffer_count, 2),
            ("io_threads", io_threads, 1),
        ):
            if not isinstance(value, int) or value < minimum:
                raise MisconfigurationException(
                    f"`SmartInfinityStrategy({name}={value!r})` is invalid: it must be an integer >= {minimum}."
                )
        if not isinstance(chunk_size, int) or chunk_size <= 0 or chunk_size % 1024:
            raise MisconfigurationException(
                f"`SmartInfinityStrategy(chunk_size={chunk_size!r})` is invalid: it must be a positive multiple of "
                f"1024 elements (the 4 KiB direct-I/O unit), e.g. {max(1024, round((chunk_size or 0) / 1024) * 1024)}."
            )
        if io_engine not in IO_ENGINES:
            raise MisconfigurationException(
                f"`SmartInfinityStrategy(io_engine={io_engine!r})` is not supported. `io_engine` must be one of: "
                f"{', '.join(map(repr, IO_ENGINES))}."
            )
        try:
            ThreadedIO(io_block_size, io_queue_depth).close()
        except ValueError as exc:
            raise MisconfigurationException(f"`SmartInfinityStrategy`: {exc}") from None
        self._offload_activations = offload_activations
        self.io_engine = io_engine
        self.io_block_size = io_block_size
        self.io_queue_depth = io_queue_depth
        self.io_threads = io_threads
        self._storage_paths = self._validate_storage_paths(storage_paths)
        self.backend_name = backend
        self.xclbin = xclbin
        self.xrt_devices = xrt_devices
        if backend == "xrt":
            from lightning_smartinf.csd.xrt import check_xrt_settings

            try:
                check_xrt_settings(xclbin, xrt_devices, self._storage_paths)
            except (ValueError, FileNotFoundError) as exc:
                raise MisconfigurationException(f"`SmartInfinityStrategy(backend='xrt')`: {exc}") from None
        elif xclbin is not None or xrt_devices is not None:
            raise MisconfigurationException(
                f"`SmartInfinityStrategy(xclbin=..., xrt_devices=...)` apply to `backend='xrt'` only, but "
                f"`backend={backend!r}`. Drop them or pass `backend='xrt'`."
            )
        self.compression = self._validate_compression(compression)
        #: Kept ratio of the coming steps; ``None`` = dense. Moved by :class:`CompressionWarmup`.
        self._kept_ratio = self.compression.ratio if self.compression is not None else None
        self.chunk_size = chunk_size
        self.buffer_count = buffer_count
        if not isinstance(overlap_backward, bool):
            raise MisconfigurationException(
                f"`SmartInfinityStrategy(overlap_backward={overlap_backward!r})` is invalid: pass True or False."
            )
        if not isinstance(prefetch_state, bool):
            raise MisconfigurationException(
                f"`SmartInfinityStrategy(prefetch_state={prefetch_state!r})` is invalid: pass True or False."
            )
        self.prefetch_state = prefetch_state
        #: Whether devices start updating during backward (see ``overlap_backward``).
        self.overlap_backward = overlap_backward and backend == "cpu" and self.compression is None
        if overlap_backward and not self.overlap_backward:
            why = "`compression`" if self.compression is not None else f"`backend={backend!r}`"
            log.info("smart_infinity: updates start after backward, not during it (not supported with %s).", why)
        self._backend: Backend | None = None
        self._closed_traffic = TrafficSnapshot()
        if reduce_bucket_size is None:
            reduce_bucket_size = (
                min(200_000_000, max(sub_group_size, 1 << 20)) if self.overlap_backward else 200_000_000
            )
        elif not isinstance(reduce_bucket_size, int) or reduce_bucket_size < 1:
            raise MisconfigurationException(
                f"`SmartInfinityStrategy(reduce_bucket_size={reduce_bucket_size!r})` is invalid: it must be an "
                "integer >= 1 (elements), or None to follow `sub_group_size`."
            )

        user_config = self._load_config(config)
        smart_config = self._smart_update_config(
            user_config,
            sub_group_size=sub_group_size,
            offload_parameters=offload_parameters,
            reduce_bucket_size=reduce_bucket_size,
            allgather_bucket_size=allgather_bucket_size,
            contiguous_gradients=contiguous_gradients,
            overlap_comm=overlap_comm,
        )
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
    def _validate_storage_paths(storage_paths: list[_PATH] | None) -> list[Path] | None:
        if storage_paths is None:
            return None
        if isinstance(storage_paths, (str, os.PathLike)):
            storage_paths = [storage_paths]
        if len(storage_paths) == 0:
            raise MisconfigurationException(
                "`SmartInfinityStrategy(storage_paths=[])` is empty. Pass at least one directory, or `None` for a "
                "temporary directory."
            )
        try:
            resolved = [validate_storage_path(p) for p in storage_paths]
        except ValueError as exc:
            raise MisconfigurationException(f"`SmartInfinityStrategy`: {exc}") from None
        seen: dict[Path, Any] = {}
        for original, path in zip(storage_paths, resolved):
            if path in seen:
                raise MisconfigurationException(
                    f"`SmartInfinityStrategy(storage_paths=...)` names {str(seen[path])!r} and {str(original)!r}, "
                    "which are the same directory; two devices cannot share one storage path. Remove the duplicate."
                )
            seen[path] = original
        return resolved

    @staticmethod
    def _smart_update_config(user_config: dict[str, Any] | None, **settings: Any) -> dict[str, Any]:
        config = json.loads(json.dumps(user_config)) if user_config else {}
        zero = config.setdefault("zero_optimization", {})
        problems = []
        if zero.get("stage", 3) != 3:
            problems.append(f"`zero_optimization.stage={zero['stage']}`: SmartUpdate runs on ZeRO stage 3; remove it.")
        if zero.get("offload_optimizer", {}).get("device", "none") not in ("none", None):
            problems.append(
                f"`zero_optimization.offload_optimizer.device={zero['offload_optimizer']['device']!r}`: the optimizer "
                "state lives on the SmartUpdate devices; remove `offload_optimizer` and set `storage_paths` instead."
            )
        if zero.get("offload_param", {}).get("device") == "nvme":
            problems.append(
                "`zero_optimization.offload_param.device='nvme'`: not supported with SmartUpdate; use 'cpu' "
                "(`offload_parameters=True`)."
            )
        if "optimizer" in config:
            problems.append(
                "`optimizer`: SmartUpdate runs the optimizer from `LightningModule.configure_optimizers`; remove the "
                f"DeepSpeed `optimizer` block and return one of {', '.join(SUPPORTED_OPTIMIZERS)} there."
            )
        if problems:
            raise MisconfigurationException(
                "The DeepSpeed `config` passed to `SmartInfinityStrategy` contradicts SmartUpdate:\n- "
                + "\n- ".join(problems)
            )
        zero["stage"] = 3
        zero.setdefault("sub_group_size", settings["sub_group_size"])
        zero.setdefault("reduce_bucket_size", settings["reduce_bucket_size"])
        zero.setdefault("allgather_bucket_size", settings["allgather_bucket_size"])
        zero.setdefault("contiguous_gradients", settings["contiguous_gradients"])
        zero.setdefault("overlap_comm", settings["overlap_comm"])
        # The path is replaced per rank at set-up; "nvme" makes ZeRO keep only empty fp32 placeholders.
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": tempfile.gettempdir()}
        if settings["offload_parameters"]:
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
    def _validate_compression(compression: Any) -> TopKCompression | None:
        if compression is None or isinstance(compression, TopKCompression):
            return compression
        try:
            if isinstance(compression, dict):
                allowed = [f.name for f in dataclasses.fields(TopKCompression)]
                unknown = set(compression) - set(allowed)
                if unknown:
                    raise ValueError(f"unknown key(s) {sorted(unknown)}; allowed: {allowed}")
                return TopKCompression(**compression)
            return TopKCompression(compression)
        except (TypeError, ValueError) as exc:
            raise MisconfigurationException(
                f"`SmartInfinityStrategy(compression={compression!r})` is invalid: {exc}. Pass the kept ratio "
                "(e.g. `compression=0.01`), a dict like `{'ratio': 0.01, 'error_feedback': False}`, or None."
            ) from None

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

    def _rank_device_dirs(self) -> tuple[list[Path], list[Path]]:
        """This rank's device directories, and those of them the backend must remove at the end."""
        if self._storage_paths is None:
            directory = Path(tempfile.mkdtemp(prefix=f"smartinf-rank{self.global_rank}-"))
            return [directory], [directory]
        mine = self._rank_storage_paths()
        if not mine:
            raise MisconfigurationException(
                f"`SmartInfinityStrategy(storage_paths=...)` gives {len(self._storage_paths)} path(s) to "
                f"{max(1, self.num_processes)} ranks per node, so ranks would share a storage path. Pass at least "
                "one path per rank (directories on the same disk work, e.g. /mnt/nvme/r0 and /mnt/nvme/r1)."
            )
        return [p / _STATE_DIR / f"rank{self.global_rank:03d}" for p in mine], []

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
        for directory in device_dirs:
            ensure_private_dir(directory.parent)
            ensure_private_dir(directory)
        # ZeRO copies its swap folder into checkpoints; ours stays empty (device state is saved separately).
        engine_swap = device_dirs[0] / "engine-swap"
        ensure_private_dir(engine_swap)
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
            raise StorageError(str(exc)) from None
        deepspeed_optimizer.smartinf_compression = self.compression
        deepspeed_optimizer.smartinf_overlap = self.overlap_backward
        deepspeed_optimizer.smartinf_kept_ratio = self._kept_ratio
        return engine, deepspeed_optimizer

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
        """Finish outstanding device work, then free buffer pools, threads and temporary storage. Idempotent."""
        if self._backend is not None:
            self._closed_traffic = self._backend.traffic_snapshot()
            self._backend.close()
            self._backend = None

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

    def _device_state_dir(self, checkpoint_dir: _PATH) -> Path:
        return Path(checkpoint_dir) / "checkpoint" / _STATE_DIR / f"rank{self.global_rank:03d}"

    @override
    def save_checkpoint(self, checkpoint: dict, filepath: _PATH, storage_options: Any | None = None) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options)
        filepath = self.broadcast(filepath)
        zero_optimizer = self.deepspeed_engine.optimizer
        directory = self._device_state_dir(filepath)
        # Between a backward and its step, updates made during backward are still tentative: the backend saves
        # the committed state, the one before this step, like every other part of the checkpoint.
        zero_optimizer.smartinf_backend.save(directory)
        host_state = zero_optimizer.smartinf_state_dict()
        residual = zero_optimizer.smartinf_residual
        if residual is not None:
            from safetensors.torch import save as safetensors_bytes

            path = directory / _RESIDUAL
            write_file_atomic(path, safetensors_bytes({"residual": residual.detach().cpu().contiguous()}))
            size, crc = file_crc32(path)
            host_state["residual"] = {"file": _RESIDUAL, "bytes": size, "crc32": crc}
        # Written last and atomically: its presence marks this rank's device state as complete.
        write_file_atomic(directory / _HOST_STATE, json.dumps(host_state).encode())
        self.barrier("smartinf_save_checkpoint")

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        client_state = super().load_checkpoint(checkpoint_path, weights_only)
        if self.lightning_module is not None and self.lightning_module.trainer.state.fn == "fit":
            directory = self._device_state_dir(checkpoint_path)
            zero_optimizer = self.deepspeed_engine.optimizer
            host_state = directory / _HOST_STATE
            if not host_state.is_file():
                raise MisconfigurationException(
                    f"{checkpoint_path} has no SmartUpdate device state for rank {self.global_rank} ({host_state} "
                    "is missing). Resume from a checkpoint saved with `strategy='smart_infinity'` and the same ranks."
                )
            state = json.loads(host_state.read_text())
            residual = self._load_residual(directory, state.get("residual"))
            zero_optimizer.smartinf_discard_early()
            zero_optimizer.smartinf_backend.load(directory)
            zero_optimizer.load_smartinf_state_dict(state)
            zero_optimizer.load_smartinf_residual(residual, state.get("residual_loss_scale"))
            zero_optimizer.smartinf_refresh_params()
        return client_state

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
            super().teardown()
        finally:
            self.release_backend()

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
