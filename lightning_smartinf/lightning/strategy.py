"""``SmartInfinityStrategy``: DeepSpeed ZeRO-3 with the optimizer update run next to the storage.

The Lightning layer only: its hooks turn Lightning's calls into calls on the core (the settings, the
:class:`~lightning_smartinf.core.controller.SmartUpdateController`) and on the ZeRO adapter; docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import weakref
from collections.abc import Callable, Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.plugins.precision.deepspeed import DeepSpeedPrecision
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_smartinf.core import Backend, TrafficSnapshot, progress, registry
from lightning_smartinf.core.arguments import Problems
from lightning_smartinf.core.clocks import PhaseClocks
from lightning_smartinf.core.compression import TopKCompression, check_ratio
from lightning_smartinf.core.controller import SmartUpdateController
from lightning_smartinf.core.format import checkpoint_folder
from lightning_smartinf.core.placement import rank_share
from lightning_smartinf.core.settings import SettingsError, SmartUpdateSettings
from lightning_smartinf.lightning import checkpoints, engine_setup, quiet
from lightning_smartinf.lightning.activation_offload import check_offload_options
from lightning_smartinf.lightning.callbacks import add_strategy_callbacks, refuse_learning_rate_finder
from lightning_smartinf.lightning.contract import SmartUpdateStrategy
from lightning_smartinf.lightning.cpu_support import DeepSpeedOnCPUMixin
from lightning_smartinf.lightning.precision import SmartInfinityPrecision
from lightning_smartinf.zero import check_deepspeed_version
from lightning_smartinf.zero.config import ENGINE, accumulate_in_fp32, deepspeed_config

log = logging.getLogger(__name__)
#: The strategy's arguments that are the fields of its `SmartUpdateSettings`, by name (the device kinds' own
#: arguments go to the settings' `device`).
SETTINGS = tuple(field.name for field in dataclasses.fields(SmartUpdateSettings) if field.name != "device")
#: The strategy's arguments that belong to one device kind (`DeviceKind.arguments` of the registered kinds).
DEVICE = tuple(argument for name in registry.kinds() for argument in registry.kind(name).arguments)
#: The arguments handed on to Lightning's `DeepSpeedStrategy` as they are.
LIGHTNING = (
    "accelerator",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "min_loss_scale",
    "logging_level",
    "parallel_devices",
    "cluster_environment",
    "precision_plugin",
    "process_group_backend",
    "timeout",
)


class SmartInfinityStrategy(DeepSpeedOnCPUMixin, DeepSpeedStrategy, SmartUpdateStrategy):
    """Train with DeepSpeed ZeRO-3 while fp32 master weights and optimizer states live on storage devices.

    Every ZeRO sub-group partition is a shard owned by one device (round-robin unless tiers or weights say). After
    backward, each shard's reduced gradient goes to its device in the training dtype; the device applies the update of
    the optimizer from ``configure_optimizers`` to the state on its storage and returns the updated low-precision
    parameters. Verified on CPU (DeepSpeed's CPU accelerator, gloo) and on one CUDA GPU (an H100); two GPUs have not
    run yet (docs/gpu.md).

    Args:
        accelerator: the accelerator; ``"cpu"`` and ``"cuda"`` are supported.
        backend: ``"cpu"`` emulates computational-storage devices on host cores, ``"xrt"`` drives SmartSSDs through
            XRT running ``hls_kernels/``, ``"remote"`` uses device servers on other machines (``docs/remote.md``).
        xclbin: ``backend="xrt"`` only: path of the ``.xclbin`` built from ``hls_kernels/``.
        xrt_devices: ``backend="xrt"`` only: one XRT device per storage path of this node, as device index or
            PCIe BDF (``"0000:3b:00.1"``); ``None`` maps each storage path to the SmartSSD it is mounted from.
        remote_devices, remote_token_file, remote_tls_dir: ``backend="remote"`` only: ``"host:port"`` of each
            server, a file (mode 0600) with their token, and TLS files (``None``: servers on this machine only,
            through gRPC's local credentials); ``docs/remote.md``.
        remote_allow_plaintext: ``True`` lets a run without ``remote_tls_dir`` reach servers on other machines in
            plain gRPC (token and state in clear, for a network you trust); refused otherwise.
        storage_paths: directories, one per device, shared out among the ranks of a node (rank ``r`` gets
            ``storage_paths[r::ranks_per_node]``, at least one, locked while it trains); a missing one is created (0700)
            at set-up. ``None``: one private temporary directory per rank, kept after ``fit`` (for
            ``trainer.save_checkpoint``) until the next run starts or the process exits.
        compression: SmartComp gradient compression: the fraction of each sub-group's gradient entries sent per step
            (e.g. ``0.01``: top-1% by magnitude, as int32 index + value pairs), a dict of ``TopKCompression``
            arguments (``{"ratio": 0.01, "rule": "auto"}``: Adam and AdamW run EF-Adam, whose first moment is the
            error-feedback residual; ``"optimizer"`` runs their own rule), or ``None`` (dense). Pair it with
            ``CompressionWarmup`` for dense or DGC-style warm-up.
        sub_group_size: elements per ZeRO sub-group, the unit of work of a device.
        chunk_size: elements a device streams through one buffer at a time (a multiple of 1024).
        buffer_count: chunk buffers per device, ``devices * buffer_count * chunk_size * 4 * (1 + states)`` bytes
            (192 MiB per device for Adam; refused beyond available memory). Keep it above ``2 * io_threads + 1``.
        io_engine: how devices move state to and from their storage: ``"aio"`` (DeepSpeed's libaio op,
            direct I/O), ``"threads"`` (``pread``/``pwrite`` on a thread pool) or ``"auto"`` (aio where it
            loads and the filesystem allows ``O_DIRECT``, else threads; the choice is logged).
        io_block_size: bytes per I/O request: an int, a multiple of 4096, at most 1 GiB (``1 << 30``).
        io_queue_depth: I/O requests in flight: per chunk transfer with ``"aio"``, per device with ``"threads"``.
        io_threads: chunk transfers each emulated device keeps in flight per direction (reads: ``buffer_count - 1``).
        device_timeout_s: seconds a device may take to answer before the run fails with a
            :class:`~lightning_smartinf.core.StorageError` (a positive finite number); ``None`` waits forever.
        overlap_backward: hand each sub-group's gradient to its device as soon as backward has reduced it. The update
            is tentative until the step confirms it (same hyperparameters and scale, no clipping, no skipped step),
            else rolled back and redone, so results do not change. Keeps a second copy of the state on the storage
            paths (2x the disk space, not the traffic). ``backend="cpu"`` and ``"remote"``, without ``compression``.
        prefetch_state: let each device read the state of the sub-groups it updates next into free buffers whenever
            it would idle (at most ``buffer_count - 1 - io_threads`` chunks). Never changes results; ``False`` compares.
        state_precision: how the optimizer's per-element state is stored on the devices: ``"fp32"`` (as
            ``torch.optim``, bit for bit), ``"bf16"`` or ``"int8"`` (blockwise, one fp32 scale per 256 elements);
            master weights stay fp32. Adam: 12, 8 or 6.03 bytes per parameter on disk and per step each way
            (docs/arguments.md). Every backend.
        split_masters: keep on the devices only the 17 bits of each fp32 master that its bf16 parameter in host memory
            lacks: the same masters bit for bit, 2.125 bytes each instead of 4 (Adam: 10.125 bytes per parameter on
            disk and per step each way in fp32, 4.16 in int8). Needs ``precision="bf16-mixed"`` with the parameters in
            host memory (``offload_parameters=True`` beside a GPU) and ``backend="cpu"``; checkpoints hold whole
            masters, so they load with it on or off (docs/arguments.md).
        gradient_buffer: where gradients wait for devices: ``"accelerator"``, ``"host"`` or ``"auto"`` (docs/gpu.md).
        state_memory_budget, state_accelerator_budget, device_weights, state_memory_share: tiers (docs/tiers.md).
        saved_state_from: where a checkpoint's state is read from when the devices that saved it kept it and this
            run's cannot reach them: ``{"backend": "remote", "remote_devices": [...], "remote_token_file": ...}``
            resumes a checkpoint kept on servers with ``backend="cpu"`` (docs/checkpoints.md).
        offload_parameters: where ZeRO's low-precision parameter partitions live between uses: ``False`` on the
            accelerator, ``True`` in host memory, ``"storage"`` in files on the first storage path, read in for
            forward and backward through swap buffers sized for the model (docs/parameters.md).
        offload_activations: write large saved activations to the storage paths during forward and read them back
            ahead of backward (``True``, or a dict of :class:`~lightning_smartinf.activations.ActivationOffload` args).
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

    The SmartUpdate arguments (``backend`` to ``saved_state_from``) become the strategy's :attr:`settings`.
    Every argument is checked here, by type and range (see :mod:`lightning_smartinf.core.arguments`), and one
    ``MisconfigurationException`` lists every problem.
    """

    strategy_name = "smart_infinity"

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        backend: Literal["cpu", "xrt", "remote"] = "cpu",
        storage_paths: list[str | os.PathLike] | None = None,
        xclbin: str | os.PathLike | None = None,
        xrt_devices: list[int | str] | None = None,
        remote_devices: list[str] | None = None,
        remote_token_file: str | os.PathLike | None = None,
        remote_tls_dir: str | os.PathLike | None = None,
        remote_allow_plaintext: bool | None = None,
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
        state_precision: Literal["fp32", "bf16", "int8"] = "fp32",
        split_masters: bool = False,
        gradient_buffer: Literal["auto", "accelerator", "host"] = "auto",
        state_memory_budget: int | str | None = None,
        device_weights: list[float] | None = None,
        state_accelerator_budget: int | str | None = None,
        state_memory_share: Literal["auto", "fill", "measured"] = "auto",
        saved_state_from: dict[str, Any] | None = None,
        offload_parameters: bool | Literal["storage"] = False,
        offload_activations: bool | dict[str, Any] = False,
        config: str | os.PathLike | dict[str, Any] | None = None,
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
        # The flat keyword arguments by name: `SmartUpdateSettings`' fields are the settings, DeepSpeed's the config.
        arguments = dict(locals())
        check_deepspeed_version()
        problems = Problems("SmartInfinityStrategy", MisconfigurationException)
        device = {name: arguments[name] for name in DEVICE if arguments[name] is not None}
        settings = SmartUpdateSettings.collect(problems, device=device, **{name: arguments[name] for name in SETTINGS})
        config = deepspeed_config(
            problems, settings, config, env_var=self.DEEPSPEED_ENV_VAR, **{name: arguments[name] for name in ENGINE}
        )
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
        if isinstance(timeout, timedelta) and not timeout.total_seconds() > 0:
            problems.add(
                f"`timeout={timeout!r}` is not a wait: it must be a positive `datetime.timedelta` (how long a "
                "collective may wait for the other ranks), or None. Pass e.g. `timeout=timedelta(minutes=30)`."
            )
        check_offload_options(problems, "offload_activations", offload_activations)
        if settings is not None and (conflict := engine_setup.split_masters_conflict(settings, config)) is not None:
            problems.add(conflict)
        problems.raise_if_any()
        assert settings is not None
        #: Every SmartUpdate setting, validated; replaced whole (:meth:`resize_pools`), never changed in place.
        self.settings = settings
        self._offload_activations = offload_activations
        #: Kept ratio of the coming steps; ``None`` = dense. Moved by :class:`CompressionWarmup`.
        self._kept_ratio = settings.kept_ratio
        if overlap_backward and not settings.overlap:
            why = "`compression`" if settings.compression is not None else f"`backend={backend!r}`"
            log.info("smart_infinity: updates start after backward, not during it (not supported with %s).", why)
        self._before_engine: list[Callable[[pl.Trainer, pl.LightningModule], None]] = []
        #: Host seconds per phase of training (forward, backward, after_backward), cumulative over the run.
        self.clocks = PhaseClocks()
        #: What ``ModelCheckpoint`` keeps, to free what its rotation deletes before a save that needs the room.
        self.rotation = checkpoints.Rotation()
        #: Warns early when a checkpoint folder has less room than the next save needs.
        self.room_watch = checkpoints.RoomWatch()
        super().__init__(config=config, **{name: arguments[name] for name in LIGHTNING})

    _smart_update: SmartUpdateController | None = None  # the run's controller and backend (None before set-up)
    _backend: Backend | None = None
    #: The engine ``fit`` trained with; it writes DeepSpeed's part of every checkpoint (see :meth:`save_checkpoint`).
    _training_engine: Any = None
    #: The known-harmless warnings silenced from set-up to teardown (:mod:`lightning_smartinf.lightning.quiet`).
    _silenced: quiet.Silenced | None = None
    #: Removes the temporary device directories of the last run (``storage_paths=None``); see :meth:`release_backend`.
    _release_storage: weakref.finalize | None = None

    # ----------------------------------------------------------------------------------------- configuration

    def before_engine(self, hook: Callable[[pl.Trainer, pl.LightningModule], None]) -> None:
        """Call ``hook(trainer, module)`` once the model exists, before the engine is built (a callback that sizes
        something for the model registers here, e.g. ``BufferPool``). Registering a hook twice calls it once."""
        if hook not in self._before_engine:
            self._before_engine.append(hook)

    def run_before_engine(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """Call what :meth:`before_engine` registered, in order (the engine's set-up calls it)."""
        for hook in self._before_engine:
            hook(trainer, module)

    def resize_pools(self, *, chunk_size: int, buffer_count: int) -> None:
        """Use ``buffer_count`` buffers of ``chunk_size`` elements per device (before set-up; ``BufferPool``)."""
        try:
            self.settings = self.settings.replace(chunk_size=chunk_size, buffer_count=buffer_count)
        except SettingsError as exc:
            raise MisconfigurationException(str(exc)) from None

    @property
    def sub_group_size(self) -> int:
        """Elements per ZeRO sub-group, as DeepSpeed will use it (a user's config may override the argument)."""
        assert isinstance(self.config, dict)
        return int(self.config["zero_optimization"]["sub_group_size"])

    def rank_storage_paths(self) -> list[Path]:
        """This rank's share of the storage paths (``[]`` with ``storage_paths=None``)."""
        return rank_share(self.settings.storage_paths or (), self.local_rank, self.num_processes)

    def rank_place(self) -> engine_setup.RankPlace:
        """Where this rank stands, with the settings (for engine set-up; final once the launcher placed the rank)."""
        return engine_setup.RankPlace(
            settings=self.settings,
            global_rank=self.global_rank,
            local_rank=self.local_rank,
            ranks_per_node=self.num_processes,
            world_size=self.world_size,
            device=self.root_device,
        )

    @property
    def devices_per_rank(self) -> int:
        """Devices (storage paths) each rank drives."""
        return 1 if self.settings.storage_paths is None else len(self.rank_storage_paths())

    @property
    def kept_ratio(self) -> float | None:
        """Fraction of gradient entries the coming steps send (``None``: dense)."""
        return self._kept_ratio

    def set_kept_ratio(self, ratio: float | None) -> None:
        """Change the kept ratio from the next optimizer step on (``None``: send dense gradients)."""
        if self.settings.compression is None:
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
        if self._smart_update is not None:
            self._smart_update.kept_ratio = ratio

    @DeepSpeedStrategy.precision_plugin.setter  # Lightning's getter, this setter
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

    # ------------------------------------------------------------------------------------------ engine set-up

    @override
    def setup_environment(self) -> None:
        # Known-harmless warnings of DeepSpeed, torch and Lightning stay silent until teardown (see `quiet`).
        if self._silenced is None:
            self._silenced = quiet.silence()
        super().setup_environment()
        if self.lightning_module is not None:
            trainer = self.lightning_module.trainer
            refuse_learning_rate_finder(trainer)
            add_strategy_callbacks(trainer, self._offload_activations)
            # Long operations (the initial state, checkpoints, re-sharding) show bars as the Trainer shows its own.
            progress.configure(bars=trainer.progress_bar_callback is not None)

    @override
    def _format_config(self) -> None:
        assert self.lightning_module is not None
        accumulate = self.lightning_module.trainer.accumulate_grad_batches
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise MisconfigurationException(
                f"`Trainer(accumulate_grad_batches={accumulate!r})`: accumulate a whole number of micro-batches, 1 or "
                "more, before each step (1 steps after every batch)."
            )
        super()._format_config()
        if self.settings.compression is None:  # top-k's error feedback rounds what it sends: see accumulate_in_fp32
            accumulate_in_fp32(self.config)

    @override
    def _auto_select_batch_size(self) -> int:
        """The training loader's batch size, for the engine's throughput log only; 1 where the loader has none of its
        own (``batch_size=None`` for batches the dataset makes, a ``batch_sampler`` of index lists), on which
        Lightning's DeepSpeed strategy fails with an ``AttributeError``."""
        try:
            size = super()._auto_select_batch_size()
        except AttributeError:  # the loader's `batch_sampler` is None or has no `batch_size`
            return 1
        return size if isinstance(size, int) and size > 0 else 1

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        self._init_config_if_needed()
        assert isinstance(self.config, dict)
        # With parameters on storage, each partition goes straight to this rank's files.
        with engine_setup.model_init_context(self.rank_place(), self.config, self.remote_device):
            yield

    @override
    def _init_optimizers(self) -> tuple[Optimizer, Any]:
        optimizer, scheduler = super()._init_optimizers()
        engine_setup.check_optimizer(self.settings, optimizer)
        return optimizer, scheduler

    @override
    def _setup_model_and_optimizer(
        self, model: Module, optimizer: Optimizer | None, lr_scheduler: Any = None
    ) -> tuple[Any, Optimizer]:
        def adopt(backend: Backend) -> None:
            self._backend = backend  # released at teardown, even if the engine then fails to build

        def before_engine() -> engine_setup.RankPlace:
            if (module := self.lightning_module) is not None:
                self.run_before_engine(module.trainer, module)
            return self.rank_place()

        assert isinstance(self.config, dict)
        deepspeed_engine, zero_optimizer = engine_setup.initialize(
            model,
            optimizer,
            lr_scheduler,
            config=self.config,
            precision=self.precision_plugin.precision,
            deepspeed_args=self.deepspeed_args(),
            kept_ratio=lambda: self.kept_ratio,
            before_engine=before_engine,
            on_backend=adopt,
        )
        self._smart_update = zero_optimizer.smart_update
        self._training_engine = deepspeed_engine
        return deepspeed_engine, zero_optimizer

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        """``False``: Lightning ends each accumulation window, as over plain PyTorch, an epoch's last (shorter) one
        included, and the precision plugin tells the engine where (:meth:`SmartInfinityPrecision.backward`).

        DeepSpeed's strategy leaves it to the engine's count of micro-batches, which carries an epoch's short last
        window into the next epoch: the updates then fall between Lightning's steps, so its ``global_step``, its
        schedulers and its checkpoints (which miss the gradients held) no longer match them."""
        return False

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Nothing to block while Lightning accumulates: ZeRO-3 reduces each micro-batch's gradients into their
        partitions (its engine refuses ``no_sync``)."""
        yield

    @property
    def has_smart_update(self) -> bool:
        """Whether the devices are live: between engine set-up and teardown of ``fit``."""
        return self._backend is not None

    @property
    def smart_update(self) -> SmartUpdateController:
        """This rank's SmartUpdate controller, from engine set-up on; after teardown it can still save the final state
        (``trainer.save_checkpoint``) though its backend is closed."""
        if self._smart_update is None:
            raise RuntimeError("The SmartUpdate controller exists only once `Trainer.fit` has set the engine up.")
        return self._smart_update

    @property
    def backend(self) -> Backend:
        """This rank's backend; exists between engine set-up and teardown."""
        return self.smart_update.backend

    def release_backend(self) -> None:
        """Finish device work, free pools and threads, give up the storage. Idempotent. Temporary state (and memory
        tiers) outlives it, owned by this process, for ``trainer.save_checkpoint`` after ``fit``; it goes when the
        next run in this process starts, when the strategy is garbage-collected, or at exit."""
        if self._backend is None:
            return
        backend, self._backend = self._backend, None
        backend.close(keep_claims=True)
        if self.settings.state_needs_owner:  # temporary directories, host memory or remote sessions
            self._release_storage = engine_setup.release_at_next_run(self, backend.release_storage)
        else:
            backend.release_storage()

    @property
    def state_released(self) -> bool:
        """Whether this run's temporary state (``storage_paths=None``, memory tiers, remote sessions) is gone: a later
        run started in this process, which ends the after-``fit`` life of every earlier run's."""
        return self._release_storage is not None and not self._release_storage.alive

    @property
    def traffic(self) -> TrafficSnapshot:
        """Cumulative bytes of this rank: link, storage (inside the devices), parameters; kept after teardown."""
        return self._smart_update.traffic_snapshot() if self._smart_update is not None else TrafficSnapshot()

    # --------------------------------------------------------------------------------------------- checkpoints

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike, storage_options: Any | None = None
    ) -> None:
        """Save a checkpoint directory at ``filepath``, replacing any there whole and atomically (a kill at any
        instant leaves the previous checkpoint or the new one); see :func:`.checkpoints.save`."""
        checkpoints.save(self, checkpoint, filepath, storage_options, write_engine=self._write_engine)

    def _write_engine(self, checkpoint: dict[str, Any], directory: Path) -> None:
        """DeepSpeed's part of a checkpoint (its files, Lightning's client state in them), as Lightning's
        ``DeepSpeedStrategy.save_checkpoint`` writes it, but by the engine that trained: after ``validate``, ``test``
        or ``predict``, Lightning holds the inference engine it evaluated with, which has no optimizer and cannot
        save. Without DeepSpeed's conversion scripts, and without Lightning's warning pointing to them: they read
        DeepSpeed's optimizer files, which hold none of the state here (``smartinf export`` rebuilds the weights)."""
        engine = self._training_engine or self.deepspeed_engine
        client_state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        engine.save_checkpoint(
            directory,
            client_state=client_state,
            tag=checkpoint_folder.TAG,
            exclude_frozen_parameters=self.exclude_frozen_parameters,
        )
        for script in checkpoint_folder.DEEPSPEED_SCRIPTS:  # copied by rank 0 once its own files are written
            (Path(directory) / script).unlink(missing_ok=True)

    @override
    def remove_checkpoint(self, filepath: str | os.PathLike) -> None:
        """Delete a checkpoint (``ModelCheckpoint``'s ``save_top_k`` rotation) so that no kill leaves part of it."""
        if self.is_global_zero:
            checkpoint_folder.retire(Path(filepath))

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if (module := self.lightning_module) is not None:
            self.rotation.remember(module.trainer)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        module = self.lightning_module
        if module is not None and self.is_global_zero and self.has_smart_update:
            # Every rank's state is about the same size: no collective for a warning.
            needed = self.smart_update.backend.checkpoint_bytes() * self.world_size + checkpoints.SAVE_MARGIN
            self.room_watch.check(module.trainer, needed)

    @override
    def load_checkpoint(self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        """Verify the checkpoint against its seal, then load it without unpickling code (``weights_only=True``):
        all state for ``fit``, the trained weights for evaluation (:func:`.checkpoints.load`)."""
        return checkpoints.load(self, checkpoint_path)

    # ------------------------------------------------------------------------------------------------ phases

    def _before_forward(self) -> None:
        # A backward of manual optimization may have handed updates to the devices that no step followed yet.
        if self.has_smart_update:
            self.smart_update.withdraw_hand_offs()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._before_forward()
        with self.clocks.phase("forward"):
            return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._before_forward()
        return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self._before_forward()
        return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self._before_forward()
        return super().predict_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        with self.clocks.phase("backward"):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """The step; what it does besides the forward and backward its closure runs counts as ``after_backward``
        (gradient clipping, the engine's step: gradients handed to the devices, waits for updated parameters)."""
        inside = self.clocks.total("forward", "backward")
        started = time.perf_counter()
        try:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            closure_s = self.clocks.total("forward", "backward") - inside
            self.clocks.add("after_backward", time.perf_counter() - started - closure_s)

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
