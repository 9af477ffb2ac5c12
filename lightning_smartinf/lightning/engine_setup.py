"""Building a ``SmartInfinityStrategy``'s ZeRO-3 engine: this rank's devices, its controller, ``deepspeed.initialize``.

It takes values, not the strategy: where this rank stands (:class:`RankPlace`), DeepSpeed's config and what else
each step needs. Invariants: a rank's device directories are created and found unclaimed before DeepSpeed is
touched; the backend is handed to the strategy (``on_backend``) as soon as it exists, so the strategy releases it
even when the engine fails to build after it.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.nn import Module
from torch.optim import Optimizer

from lightning_smartinf.core.arguments import Problems
from lightning_smartinf.core.backend import Backend
from lightning_smartinf.core.build import build_backend
from lightning_smartinf.core.compression import check_sparse_supported
from lightning_smartinf.core.controller import Partitions, SmartUpdateController, SubGroup
from lightning_smartinf.core.io.direct import IOEngine
from lightning_smartinf.core.io.storage import StorageError, make_private_dirs
from lightning_smartinf.core.placement import rank_device_dirs
from lightning_smartinf.core.registry import BuildContext
from lightning_smartinf.core.settings import SmartUpdateSettings, check_accelerator_budget
from lightning_smartinf.core.state_formats import check_format_for_rule
from lightning_smartinf.core.torch_optim import SUPPORTED_OPTIMIZERS, rule_for_group, state_bytes
from lightning_smartinf.lightning import quiet
from lightning_smartinf.zero import ControllerFactory, GradientBufferError, smart_update_optimizer
from lightning_smartinf.zero.host_heap import map_large_allocations
from lightning_smartinf.zero.io_choice import choose_io_engine
from lightning_smartinf.zero.param_storage import (
    GATHERS_IN_FLIGHT,
    MIN_SWAPPED_BYTES,
    SPARE_BUFFERS,
    check_param_space,
    construction_swapper,
    full_numel,
    resize_pool,
    stored_param_bytes,
    swap_buffer_settings,
)

log = logging.getLogger(__name__)
#: Removers of the temporary device state of finished runs (``storage_paths=None``); see :func:`release_at_next_run`.
_temporary_state_releases: list[weakref.finalize] = []


@dataclass(frozen=True)
class RankPlace:
    """Where this rank stands, with the run's settings: what engine set-up needs of the strategy, taken once the
    launcher has placed the rank (every value is final then)."""

    settings: SmartUpdateSettings
    global_rank: int
    local_rank: int
    ranks_per_node: int
    world_size: int
    #: The device this rank trains on (Lightning's ``root_device``).
    device: torch.device


def check_optimizer(settings: SmartUpdateSettings, optimizer: Optimizer) -> None:
    """Every param group of ``optimizer`` has an update rule the devices run (and a sparse one with compression) that
    keeps its state in ``state_precision``."""
    if not optimizer.param_groups:  # Lightning's stand-in where `configure_optimizers` returned None
        raise MisconfigurationException(
            "`configure_optimizers` returned no optimizer, but `smart_infinity` trains with one whose state it keeps "
            f"on storage: return one of {', '.join(SUPPORTED_OPTIMIZERS)}. To evaluate without training, call "
            "`trainer.validate`, `trainer.test` or `trainer.predict`, which need none."
        )
    try:
        for group in optimizer.param_groups:
            rule = rule_for_group(optimizer, group, settings.compression)
            if settings.compression is not None:
                check_sparse_supported(rule)
            check_format_for_rule(settings.state_precision, rule)
    except ValueError as exc:
        raise MisconfigurationException(str(exc)) from None


def split_masters_conflict(
    settings: SmartUpdateSettings,
    config: dict[str, Any],
    precision: str | None = None,
    device: torch.device | None = None,
) -> str | None:
    """Why ``split_masters=True`` cannot run, in words, or ``None``: it keeps half of each master in the bf16 parameter
    partitions in host memory. ``precision`` and ``device`` are known once the Trainer has set the strategy up;
    without them, what the strategy's own arguments settle (the parameters on storage) is checked."""
    if not settings.split_masters:
        return None
    offload_param = (config.get("zero_optimization", {}).get("offload_param") or {}).get("device")
    where = None
    if precision is not None and precision not in ("bf16-mixed", "bf16-true", "bf16"):
        where = f"in the precision of `precision={precision!r}`"
    elif offload_param == "nvme":
        where = "on storage (`offload_parameters='storage'`)"
    elif device is not None and device.type != "cpu" and offload_param != "cpu":
        where = f"in {device.type} memory (`offload_parameters=False`)"
    if where is None:
        return None
    return (
        "`SmartInfinityStrategy(split_masters=True)` keeps half of each master weight in the bf16 parameters in "
        f"host memory, but this run keeps its parameters {where}. Train with `precision='bf16-mixed'` and the "
        "parameters in host memory (`offload_parameters=True` beside an accelerator), or drop `split_masters`."
    )


def release_at_next_run(owner: object, release: Callable[[], None]) -> weakref.finalize:
    """Keep a finished run's temporary device state until the next run starts, ``owner`` is collected, or exit."""
    finalizer = weakref.finalize(owner, release)
    _temporary_state_releases.append(finalizer)
    return finalizer


def rank_devices(place: RankPlace) -> tuple[list[Path], list[Path]]:
    """This rank's device directories, created (0700), and those the backend removes at the end (temporary ones).

    Raises:
        MisconfigurationException: the rank gets no storage path of its own.
        StorageError: a directory cannot be created, or another training holds it (nothing in it was touched).
    """
    # A run starting ends the after-`fit` life of every finished run's temporary state in this process (a strategy is
    # not reliably garbage-collected: Lightning's logging keeps bound methods of it), so at most one run's is kept.
    while _temporary_state_releases:
        _temporary_state_releases.pop()()
    try:
        directories, owned = rank_device_dirs(
            place.settings,
            global_rank=place.global_rank,
            local_rank=place.local_rank,
            ranks_per_node=place.ranks_per_node,
        )
        check_node_memory_budget(place.settings, place.ranks_per_node)
        # On this rank's own GPU, now that Lightning chose it.
        check_accelerator_budget(place.settings.state_accelerator_budget, place.device)
    except ValueError as exc:  # a StorageError is no ValueError: it propagates as it is
        raise MisconfigurationException(str(exc)) from None
    return directories, owned


def check_node_memory_budget(settings: SmartUpdateSettings, ranks_per_node: int) -> None:
    """Every rank of this node keeps up to ``state_memory_budget`` in RAM: together, they must fit (the settings
    checked one budget, before the ranks were known). Runs after the previous run's temporary state was freed."""
    budget, ranks = settings.state_memory_budget, max(1, ranks_per_node)
    if not budget or ranks == 1:
        return
    problems = Problems("SmartInfinityStrategy", MisconfigurationException)
    problems.fits_in_memory(
        f"`state_memory_budget={budget}` on each of the {ranks} ranks of this node",
        budget * ranks,
        f"{ranks} x {budget / 2**20:.0f} MiB of optimizer state in RAM",
        "Lower the budget: it is per rank.",
    )
    problems.raise_if_any()


def controller_factory(
    place: RankPlace,
    device_dirs: list[Path],
    owned: list[Path],
    on_backend: Callable[[Backend], None],
    kept_ratio: Callable[[], float | None],
) -> ControllerFactory:
    """What ZeRO calls when it builds its optimizer: this rank's backend, then the controller over it (sending the
    share of the gradient entries ``kept_ratio()`` gives when it is built, ``None``: dense)."""
    settings = place.settings
    io_factory: Callable[[], IOEngine] | None = None
    if settings.kind.uses_io_engine:
        try:
            choice = choose_io_engine(settings, device_dirs)
        except ValueError as exc:
            raise MisconfigurationException(str(exc)) from None
        if choice.fallback is not None:
            rank_zero_warn(f"SmartUpdate falls back to thread-pool pread/pwrite: {choice.fallback}.")
        log.info(f"SmartUpdate rank {place.global_rank}: device I/O through {choice.description}")
        io_factory = choice.factory
    context = BuildContext(
        device_dirs=tuple(device_dirs),
        owned_dirs=tuple(owned),
        local_rank=place.local_rank,
        ranks_per_node=place.ranks_per_node,
        label=f"rank{place.global_rank:03d}",
        io_factory=io_factory,
        accelerator_training=place.device.type != "cpu",
    )

    def build(optimizer: Optimizer, sub_groups: Sequence[SubGroup], partitions: Partitions) -> SmartUpdateController:
        backend = build_backend(settings, context)
        on_backend(backend)
        smart_update = SmartUpdateController(settings, backend, optimizer, sub_groups, partitions)
        smart_update.kept_ratio = kept_ratio()
        return smart_update

    return build


def require_parameter_swapper() -> None:
    """Refuse ``offload_parameters="storage"``, before anything is built or written, where DeepSpeed's parameter
    swapper cannot run: it reads and writes the parameter files through DeepSpeed's async_io op (libaio)."""
    from lightning_smartinf.zero.aio import load_aio_op

    try:
        load_aio_op()
    except Exception as exc:  # noqa: BLE001 - any reason the op cannot be built or loaded
        raise MisconfigurationException(
            "`SmartInfinityStrategy(offload_parameters='storage')` needs DeepSpeed's async_io op, through which "
            f"DeepSpeed reads and writes the parameter files, and it cannot be used here: {exc} Or keep the "
            "parameters in host memory: `offload_parameters=True`."
        ) from exc


@contextmanager
def model_init_context(place: RankPlace, config: dict[str, Any], remote_device: str | None) -> Iterator[None]:
    """Where ``LightningModule.configure_model`` builds the model: ZeRO-3's ``zero.Init`` over DeepSpeed's ``config``,
    as Lightning's own (partitions on ``remote_device``). With ``offload_parameters="storage"`` each partition is
    written to this rank's parameter files as its module is built, so the whole model is never in memory; the
    swapper's pool is sized for the model once it exists (:func:`place_parameters`)."""
    import deepspeed

    map_large_allocations()  # layer-sized blocks built, cast and partitioned one after another leave no holes
    offload_param = config["zero_optimization"].get("offload_param") or {}
    if offload_param.get("device") != "nvme":
        with deepspeed.zero.Init(remote_device=remote_device, config_dict_or_path=config):
            yield
        return
    require_parameter_swapper()
    device_dirs, _ = rank_devices(place)
    offload_param["nvme_path"] = str(make_private_dirs(device_dirs[0], ("params",)))
    # Until the model exists: a small pool; larger partitions are written from buffers of their own.
    offload_param.update(buffer_count=GATHERS_IN_FLIGHT + SPARE_BUFFERS, buffer_size=MIN_SWAPPED_BYTES // 2)
    swapper = construction_swapper(config)
    with deepspeed.zero.Init(remote_device="nvme", config_dict_or_path=config, param_swapper=swapper):
        yield


def place_parameters(
    place: RankPlace,
    precision: str,
    model: Module,
    offload_param: dict[str, Any],
    device_dirs: Sequence[Path],
    state_on_storage: int,
    *,
    aio: dict[str, Any],
    sub_group_size: int,
) -> None:
    """Complete ``offload_param`` for ``offload_parameters="storage"``: this rank's private parameter directory on its
    first storage path and swap buffers sized for ``model``; refuse, before anything is written, a disk without room
    for the parameters and the state, or a working set larger than the memory available. ``sub_group_size`` is
    DeepSpeed's (the config's, which may differ from the argument's)."""
    from deepspeed.accelerator import get_accelerator

    require_parameter_swapper()
    problems = Problems("SmartInfinityStrategy", MisconfigurationException)
    element_size = 4 if precision in ("32-true", "32", 32) else 2
    if element_size == 4 and not get_accelerator().is_fp16_supported():
        # deepspeed 0.19's `zero.Init._set_dtype` gives the parameter swapper bf16 for an fp32 model unless the
        # accelerator supports fp16: forward would then meet bf16 weights.
        raise MisconfigurationException(
            f"`offload_parameters='storage'` with `precision={precision!r}`: DeepSpeed stores the parameters in "
            f"16 bits on this accelerator ({get_accelerator().device_name()}), which breaks an fp32 model. Train in "
            "`precision='bf16-true'` or 'bf16-mixed', or keep the parameters in memory (`offload_parameters=True`)."
        )
    buffers = swap_buffer_settings(
        model.modules(),
        world_size=place.world_size,
        element_size=element_size,
        block_size=int(aio.get("block_size", 1 << 20)),
    )
    largest_sub_group = min(sub_group_size, sum(full_numel(p) for p in model.parameters()))
    # Staging for two sub-groups per device (`ZeroPartitions.staged_limit`), and the swapper's own write buffer.
    staging = 2 * len(device_dirs) * largest_sub_group * element_size + largest_sub_group * element_size
    problems.fits_in_memory(
        "`offload_parameters='storage'`",
        buffers["buffer_count"] * buffers["buffer_size"] * element_size + staging,
        f"{buffers['buffer_count']} swap buffers of {buffers['buffer_size']:,} elements for the largest parameter "
        "partition, and staging for the updated sub-groups",
        "Lower `sub_group_size`, train on more ranks, or split the largest parameters.",
    )
    problems.raise_if_any()
    built_there = next((p.nvme_swapper for p in model.parameters() if getattr(p, "nvme_swapper", None)), None)
    directory = make_private_dirs(device_dirs[0], ("params",))
    params_bytes = stored_param_bytes(model.parameters(), world_size=place.world_size, element_size=element_size)
    same_disk = [d for d in device_dirs if d.stat().st_dev == directory.stat().st_dev]
    gradient_bytes = params_bytes  # one per parameter, in the training dtype
    compression = place.settings.compression
    residual_bytes = params_bytes // element_size * 4 if compression is not None and compression.error_feedback else 0
    state_bytes = max(0, state_on_storage) * len(same_disk) // len(device_dirs)
    # A model built in `configure_model` (by `model_init_context`) is written already: the rest must still fit.
    written = built_there is not None
    check_param_space(directory, 0 if written else params_bytes, gradient_bytes, state_bytes, residual_bytes)
    if written:  # its files exist; the pool is sized for the model now
        resize_pool(built_there, buffer_count=buffers["buffer_count"], buffer_size=buffers["buffer_size"])
        return
    offload_param.update(buffers, nvme_path=str(directory))


def initialize(
    model: Module,
    optimizer: Optimizer | None,
    lr_scheduler: Any,
    *,
    config: dict[str, Any],
    precision: str,
    deepspeed_args: Any,
    kept_ratio: Callable[[], float | None],
    before_engine: Callable[[], RankPlace],
    on_backend: Callable[[Backend], None],
) -> tuple[Any, Any]:
    """``deepspeed.initialize`` over ``config`` with the SmartUpdate optimizer installed; returns the engine and its
    optimizer. ``before_engine()`` runs what waited for the model and returns where the rank stands then: what it ran
    may have changed the settings (``BufferPool`` sizes the pools for the model)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if precision in ("16-mixed", "16-true") and not get_accelerator().is_fp16_supported():
        raise MisconfigurationException(
            f"`precision={precision!r}` needs fp16 support, which DeepSpeed's `{get_accelerator().device_name()}` "
            "accelerator lacks on this machine. Use `precision='bf16-mixed'` (or train on a GPU)."
        )
    # Lightning passes none only for a DeepSpeed `optimizer` block, which `deepspeed_config` refuses; a module that
    # returns none is refused before (`check_optimizer`).
    assert optimizer is not None
    # From here on (and for a model built in `configure_model`, from before it): each large host block is a mapping
    # of its own, given back when freed, so partitions moved, gradients and buffers freed leave no holes in the RSS.
    map_large_allocations()
    place = before_engine()  # the model exists now (`configure_model` ran)
    device_dirs, owned = rank_devices(place)
    # The memory tiers' state is in memory; a kind may keep its state elsewhere than `device_dirs` (remote servers).
    settings = place.settings
    in_memory = (settings.state_memory_budget or 0) + (settings.state_accelerator_budget or 0)
    # Refused before anything is built: `split_masters=True` with the parameters in another precision or elsewhere.
    if (conflict := split_masters_conflict(settings, config, precision, place.device)) is not None:
        raise MisconfigurationException(conflict)
    whole = state_bytes(optimizer, settings.compression, settings.state_precision, split_masters=settings.split_masters)
    on_storage = whole // place.world_size - in_memory
    if (
        place.global_rank == 0
        and settings.kind.state_in_storage_paths
        and on_storage > 0
        and (note := quiet.endurance_note([str(d) for d in device_dirs], on_storage))
    ):
        rank_zero_warn(note)
    # ZeRO copies its swap folder into checkpoints; ours stays empty (device state is saved separately).
    config["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(
        make_private_dirs(device_dirs[0], ("engine-swap",))
    )
    offload_param = config["zero_optimization"].get("offload_param") or {}
    if offload_param.get("device") == "nvme":
        place_parameters(
            place,
            precision,
            model,
            offload_param,
            device_dirs,
            on_storage,
            aio=config.get("aio") or {},
            sub_group_size=int(config["zero_optimization"]["sub_group_size"]),  # the config accepts 1e9
        )
    try:
        with smart_update_optimizer(controller_factory(place, device_dirs, owned, on_backend, kept_ratio)):
            engine, zero_optimizer, _, _ = deepspeed.initialize(
                args=deepspeed_args,
                config=config,
                model=model,
                model_parameters=filter(lambda p: p.requires_grad, model.parameters()),
                optimizer=optimizer,
                lr_scheduler=lr_scheduler,
                dist_init_required=False,
            )
    except StorageError as exc:
        raise exc.with_traceback(None) from None  # no frames from inside DeepSpeed
    except GradientBufferError as exc:
        raise MisconfigurationException(str(exc)) from None
    return engine, zero_optimizer
