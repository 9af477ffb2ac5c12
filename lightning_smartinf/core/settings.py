"""The SmartUpdate settings: one frozen, validated object that the controller, placement and backends read.

:class:`SmartUpdateSettings` is built from the same raw values a user passes to the strategy (``compression=0.01``,
``storage_paths="/mnt/nvme"``) and checks them all at once: a bad value raises one :class:`SettingsError` listing
every problem, one line each, in the words the strategy has always used. Once built, its fields hold normalised
values (resolved paths in a tuple, a :class:`~lightning_smartinf.core.compression.TopKCompression`, float seconds)
and it is the only home of the figures derived from them: whether updates overlap backward, pool memory and the
default gradient bucket.

Example::

    >>> settings = SmartUpdateSettings(chunk_size=4096, buffer_count=4, compression=0.01)
    >>> settings.kept_ratio, settings.overlap, settings.pool_bytes(devices=2)
    (0.01, False, 393216)
    >>> SmartUpdateSettings(io_threads=0)
    Traceback (most recent call last):
    ...
    lightning_smartinf.core.settings.SettingsError: `SmartUpdateSettings` got 1 invalid argument:
    - `io_threads=0` is too small: it must be an int >= 1 and <= 1024. Pass `io_threads=1` or more.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from lightning_smartinf.core import registry
from lightning_smartinf.core.arguments import Problems, show
from lightning_smartinf.core.compression import EF_RULES, RULE_CHOICES, TopKCompression, ef_rule_needs_feedback
from lightning_smartinf.core.format.layout import ELEM_ALIGN, POOL_TENSORS, pool_bytes
from lightning_smartinf.core.io.direct import IO_ALIGN
from lightning_smartinf.core.io.storage import validate_storage_path
from lightning_smartinf.core.rules import EFAdafactor
from lightning_smartinf.core.state_formats import FORMATS, check_format_for_rule

if TYPE_CHECKING:
    from lightning_smartinf.core.format.masters import MastersReader

__all__ = [
    "GRADIENT_BUFFERS",
    "IO_ENGINES",
    "MEMORY_SHARES",
    "SettingsError",
    "SmartUpdateSettings",
    "check_sub_group_indexable",
]

IO_ENGINES = ("auto", "aio", "threads")
GRADIENT_BUFFERS = ("auto", "accelerator", "host")
MEMORY_SHARES = ("auto", "fill", "measured")
#: Bucket of gradients ZeRO reduces at once when nothing asks for another size (Lightning's default).
_DEFAULT_BUCKET = 200_000_000


class DeviceOptions(Mapping[str, Any]):
    """A device kind's settings as it normalised them: read-only, and hashable like the rest of the settings."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        self._values = dict(values)

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __hash__(self) -> int:  # equal mappings (Mapping's ``==``) hash alike
        return hash(frozenset(self._values.items()))

    def __repr__(self) -> str:
        return f"DeviceOptions({self._values!r})"


class SettingsError(ValueError):
    """Settings that cannot be used; :attr:`problems` holds one line per problem, the message lists them all."""

    def __init__(self, message: str, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        #: One line per problem: the argument and its value, what is allowed and the fix.
        self.problems: list[str] = list(problems)


@dataclass(frozen=True, kw_only=True)
class SmartUpdateSettings:
    """How SmartUpdate runs: devices, their storage, transfers and gradient compression.

    Constructing checks every field and raises one :class:`SettingsError` listing every problem. Fields take the
    raw values users write and hold them normalised: ``storage_paths`` a path or a list of them (a tuple of
    resolved paths, each named once), ``compression`` a ratio, a dict of
    :class:`~lightning_smartinf.core.compression.TopKCompression` arguments or one (a ``TopKCompression``),
    ``device`` the kind's own settings (as its kind normalises them), ``device_timeout_s`` a number (a float).
    Normalised values pass the checks again unchanged, so :meth:`replace` re-validates.
    """

    backend: str = "cpu"
    """The kind of device (registered by :mod:`lightning_smartinf.devices`): ``"cpu"`` emulates
    computational-storage devices on host cores; ``"xrt"`` drives Samsung SmartSSDs through XRT (pyxrt) running the
    kernels of ``hls_kernels/``; ``"remote"`` uses device servers on other machines (``smartinf serve``)."""
    device: Mapping[str, Any] | None = None
    """The kind's own settings (its :attr:`~lightning_smartinf.core.registry.DeviceKind.arguments`, e.g. ``xclbin``
    for ``"xrt"``, ``remote_devices`` for ``"remote"``), as a mapping; the kind checks and normalises them."""
    storage_paths: tuple[Path, ...] | None = None
    """Directories, one per device, shared out among the ranks of a node (see
    :func:`~lightning_smartinf.core.placement.rank_share`). A missing one must be creatable: its parent is a writable
    directory. ``None``: one private temporary directory per rank."""
    compression: TopKCompression | None = None
    """SmartComp top-k gradient compression; ``None`` sends dense gradients."""
    sub_group_size: int = 40_000_000
    """Elements per ZeRO sub-group, the unit of work of a device."""
    chunk_size: int = 1 << 20
    """Elements a device streams through one buffer at a time (a multiple of 1024, the 4 KiB direct-I/O unit)."""
    buffer_count: int = 16
    """Chunk buffers per device (at least 2: one updating, one in I/O)."""
    io_engine: Literal["auto", "aio", "threads"] = "auto"
    """How devices move state to and from their storage: DeepSpeed's libaio op, a thread pool, or the first that
    works."""
    io_block_size: int = 1 << 20
    """Bytes per I/O request: a multiple of 4096, at most 1 GiB."""
    io_queue_depth: int = 8
    """I/O requests in flight: per chunk transfer with ``"aio"`` (each transfer thread's own queue), per device with
    ``"threads"`` (one pool of this many threads, shared by the device's reads and writes)."""
    io_threads: int = 3
    """Chunk transfers each emulated device keeps in flight per direction."""
    device_timeout_s: float | None = 300.0
    """Seconds a device may take to answer before the run fails; ``None`` waits forever."""
    overlap_backward: bool = True
    """Hand each sub-group's gradient to its device as soon as backward has reduced it (see :attr:`overlap`)."""
    prefetch_state: bool = True
    """Let idle devices read the state of the sub-groups they update next into free buffers."""
    state_precision: Literal["fp32", "bf16", "int8"] = "fp32"
    """How the optimizer's per-element state (Adam's moments, SGD's momentum, Adagrad's sum) is stored on the
    devices; master weights stay fp32 (:mod:`lightning_smartinf.core.state_formats`). ``"fp32"``: as ``torch.optim``
    keeps it, bit for bit. ``"bf16"``: rounded to bfloat16, half the bytes. ``"int8"``: one byte per element and one
    fp32 scale per block of 256, a quarter of the bytes. Adam's state on disk, and its traffic per step, shrink from 12
    to 8 (bf16) or 6.03 (int8) bytes per parameter."""
    split_masters: bool = False
    """Keep on the devices only the 17 bits of each fp32 master weight that its bf16 parameter in host memory lacks
    (:mod:`lightning_smartinf.core.split_masters`): exactly the same masters, 2.125 bytes each instead of 4, so
    Adam's state and its traffic per step shrink by 1.875 bytes per parameter each way. Needs bf16 parameters in
    host memory and a kind whose devices run on this host (``backend="cpu"``), without an accelerator tier; the
    parameters of sub-groups updated during backward are copied aside (2 bytes each) until the step keeps them."""
    gradient_buffer: Literal["auto", "accelerator", "host"] = "auto"
    """Where this rank's reduced gradient partitions (and the compression residual) wait for their devices.
    ``"accelerator"``: in accelerator memory, so the norm, the overflow check and top-k run there and only what the
    devices read crosses to the host, once (costs ``2`` bytes per parameter / ranks in bf16, plus ``4`` with error
    feedback). ``"host"``: in pinned host memory, as ZeRO-Infinity keeps them (each partition crosses to the host
    during backward and back for its norm). ``"auto"``: the accelerator when there is one. Without an accelerator
    both are host memory."""
    state_memory_budget: int | None = None
    """Bytes of host memory (an int, or a string like ``"8GiB"``) this rank may use to keep sub-groups' fp32 master
    and optimizer state in RAM, updated by a host core with no storage I/O (the memory tier); the others stay on the
    storage devices (beside remote servers, host memory takes the share one more server would). ``None`` or ``0``: all
    state on the devices."""
    device_weights: tuple[float, ...] | None = None
    """Relative speed of each storage path (one positive number per path of ``storage_paths``), or with
    ``backend="remote"`` of each server of ``remote_devices``: sub-groups are shared out in proportion. ``None``:
    paths on one filesystem are equal; paths on different filesystems are measured when training starts; servers are
    equal."""
    state_accelerator_budget: int | None = None
    """Bytes of GPU memory (an int, or a string like ``"8GiB"``) this rank may use to keep sub-groups' fp32 master and
    optimizer state on the GPU, updated there while ZeRO's optimizer step leaves it idle (the accelerator tier). It
    fills first, then ``state_memory_budget``, then the storage devices (or remote servers). CUDA only. ``None`` or
    ``0``: none."""
    state_memory_share: Literal["auto", "fill", "measured"] = "auto"
    """How much of ``state_memory_budget`` the memory tier takes beside storage devices. ``"fill"``: all of it.
    ``"measured"``: the share whose update phase is predicted shortest from the rates the tiers show and from how
    much of the devices' update hides behind backward, re-planned every 10 steps (``docs/tiers.md``). ``"auto"``:
    ``"measured"`` where the devices' update runs beside the host's own (SmartSSDs, or a model trained on a GPU,
    which leaves the host cores to the devices during backward); ``"fill"`` for emulated devices training on the CPU,
    whose update takes the same cores as forward and backward. Beside remote servers the split is fixed."""
    saved_state_from: Mapping[str, Any] | None = None
    """Where to read the device state of a checkpoint whose devices kept it (remote servers) when this run's own
    devices cannot reach it: ``{"backend": kind, **that kind's arguments}``, e.g. ``{"backend": "remote",
    "remote_devices": ["storage1:50051"], "remote_token_file": "~/.smartinf/token"}`` to resume a checkpoint kept on
    servers with ``backend="cpu"``. Read once, when a checkpoint loads; nothing on those devices changes. ``None``:
    only this run's devices."""

    def __post_init__(self) -> None:
        problems = Problems(type(self).__name__, SettingsError)
        normalised = _check(problems, {field.name: getattr(self, field.name) for field in dataclasses.fields(self)})
        if normalised is None:
            raise SettingsError(problems.message(), problems.lines)
        for name, value in normalised.items():
            object.__setattr__(self, name, value)  # frozen: normalising is part of construction

    @classmethod
    def collect(cls, problems: Problems, **kwargs: Any) -> SmartUpdateSettings | None:
        """The settings made of ``kwargs``, or ``None`` after adding each of their problems to ``problems``.

        For a caller that checks more arguments of its own and reports them all in one error; the lines name the
        settings' own arguments (``buffer_count``), whatever ``problems`` is checking.
        """
        try:
            return cls(**kwargs)
        except SettingsError as exc:
            for line in exc.problems:
                problems.add(line)
            return None

    def replace(self, **changes: Any) -> SmartUpdateSettings:
        """A copy with ``changes`` applied, checked again (raises :class:`SettingsError`)."""
        return dataclasses.replace(self, **changes)

    @property
    def kind(self) -> registry.DeviceKind:
        """The kind of device :attr:`backend` names."""
        return registry.kind(self.backend)

    def option(self, name: str) -> Any:
        """The kind's setting ``name`` (``None`` when not given)."""
        return (self.device or {}).get(name)

    def checkpoint_masters(self) -> MastersReader | None:
        """A reader of the masters a checkpoint kept on its devices instead of in shard files: through this run's
        devices where their kind keeps checkpoint state, else through the devices :attr:`saved_state_from` names.
        ``None``: neither does, so the masters are in the shard files."""
        timeout = self.device_timeout_s
        reader = self.kind.checkpoint_masters(self.device or {}, timeout=timeout)
        source = self.saved_state_from
        if reader is None and source is not None:
            reader = registry.kind(source["backend"]).checkpoint_masters(source, timeout=timeout)
        return reader

    @property
    def overlap(self) -> bool:
        """Whether devices start updating during backward: ``overlap_backward`` where the kind's devices take
        hand-offs, with dense gradients."""
        return self.overlap_backward and self.kind.takes_hand_offs and self.compression is None

    @property
    def state_needs_owner(self) -> bool:
        """Whether some device state lasts only while this process holds it: in temporary directories
        (``storage_paths=None``), in memory (``state_memory_budget``, ``state_accelerator_budget``) or in the kind's
        own keeping (remote sessions)."""
        in_memory = bool(self.state_memory_budget) or bool(self.state_accelerator_budget)
        return self.storage_paths is None or self.kind.state_held_by_process or in_memory

    @property
    def kept_ratio(self) -> float | None:
        """Fraction of gradient entries each step sends, as configured (``None``: dense)."""
        return None if self.compression is None else self.compression.ratio

    def pool_bytes(self, devices: int, tensors_per_record: int = POOL_TENSORS) -> int:
        """Host bytes of the chunk-buffer pools of ``devices`` devices with ``tensors_per_record`` fp32 tensors per
        element (by default the master weight and Adam's two states)."""
        return pool_bytes(devices, self.buffer_count, self.chunk_size, tensors_per_record)

    def default_reduce_bucket_size(self) -> int:
        """Elements of gradients ZeRO should reduce at once when the user names no size.

        Gradients reach the devices one bucket at a time: with :attr:`overlap` a bucket of one sub-group (within
        1M..200M elements) lets each device start as soon as its sub-group is reduced; otherwise Lightning's 200M.
        """
        if self.overlap:
            return min(_DEFAULT_BUCKET, max(self.sub_group_size, 1 << 20))
        return _DEFAULT_BUCKET


def check_pool_shape(
    problems: Problems,
    chunk_size: Any,
    buffer_count: Any,
    *,
    optional: bool = False,
    names: tuple[str, str] = ("chunk_size", "buffer_count"),
) -> list[bool]:
    """The one rule for a device pool's shape, wherever it is given: ``chunk_size`` elements per buffer (a positive
    multiple of the direct-I/O unit) and ``buffer_count`` buffers (at least 2: one updating, one in I/O). Returns
    whether each is valid; ``optional`` accepts ``None`` for either; ``names`` are the two arguments' names where
    they are given (the backends' ``chunk_elems``)."""
    return [
        problems.integer(
            names[0],
            chunk_size,
            low=ELEM_ALIGN,
            multiple=ELEM_ALIGN,
            why=f"elements; {ELEM_ALIGN} fp32 elements are the {IO_ALIGN} B direct-I/O unit",
            example=1 << 20,
            optional=optional,
        ),
        problems.integer(
            names[1], buffer_count, low=2, why="one buffer updating, one in I/O", example=16, optional=optional
        ),
    ]


def check_sub_group_indexable(problems: Problems, sub_group_size: float) -> None:
    """Compressed gradients address their entries in a sub-group of ``sub_group_size`` with int32 indices."""
    if sub_group_size >= 1 << 31:
        problems.add(
            f"`compression` with a ZeRO `sub_group_size` of {sub_group_size:.0f}: compressed gradients address "
            "their entries inside a sub-group with int32 indices, so it must be < 2**31. Lower `sub_group_size` "
            "(e.g. 40_000_000)."
        )


# ------------------------------------------------------------------------------------------------- the checks


def _check(problems: Problems, raw: dict[str, Any]) -> dict[str, Any] | None:
    """Add a line to ``problems`` for each bad value of ``raw`` (the fields as given); return the fields that
    normalising changes, or ``None`` if a line was added."""
    known = len(problems)
    kind = registry.kind(raw["backend"]) if problems.choice("backend", raw["backend"], registry.kinds()) else None
    problems.choice("io_engine", raw["io_engine"], IO_ENGINES)
    problems.choice("gradient_buffer", raw["gradient_buffer"], GRADIENT_BUFFERS)
    problems.choice("state_memory_share", raw["state_memory_share"], MEMORY_SHARES)
    _state_precision(problems, raw, kind)
    if kind is not None and raw["state_memory_share"] == "measured" and not kind.state_movable:
        problems.add(
            f"`state_memory_share='measured'` with `backend={kind.name!r}`: the split between this host and the "
            f"{kind.weighs}s is fixed when training starts (moving a sub-group would carry its whole state over the "
            f"network). Drop it; `state_memory_budget` alone keeps the share one more {kind.weighs} would hold."
        )
    sub_group_valid, chunk_valid, buffers_valid = _check_counts(problems, raw)
    for name in ("overlap_backward", "prefetch_state", "split_masters"):
        problems.flag(name, raw[name])
    if raw["split_masters"] is True and kind is not None and not kind.splits_masters:
        problems.add(
            f"`split_masters=True` with `backend={kind.name!r}`: its devices do not reach this host's parameters, "
            "which hold half of each split master. Use `backend='cpu'`, or drop `split_masters`."
        )
    storage_paths = _storage_paths(problems, raw["storage_paths"])
    device = _device(problems, raw, kind, storage_paths)
    compression = _compression(problems, raw["compression"])
    budget = _memory_budget(problems, raw)
    accelerator_budget = _accelerator_budget(problems, raw)
    weights = _device_weights(problems, raw, kind, device, storage_paths)
    saved_state_from = _saved_state_from(problems, raw["saved_state_from"])
    if raw["split_masters"] is True and accelerator_budget:
        problems.add(
            f"`split_masters=True` with `state_accelerator_budget={show(raw['state_accelerator_budget'])}`: the "
            "accelerator tier updates its state in accelerator memory, away from the host parameters that hold half "
            "of each split master. Drop one of them."
        )
    if sub_group_valid and chunk_valid and buffers_valid and kind is not None and kind.host_pools:
        _check_pool_memory(problems, raw)
    if sub_group_valid and compression is not None:
        check_sub_group_indexable(problems, raw["sub_group_size"])
    if compression is not None and compression.rule == "ef_adafactor" and raw["state_precision"] in FORMATS:
        # This rule is known without the optimizer; the others are checked against the format once it is.
        try:
            check_format_for_rule(raw["state_precision"], EFAdafactor())
        except ValueError as exc:
            problems.add(str(exc))
    if len(problems) > known:
        return None
    timeout = raw["device_timeout_s"]
    return {
        "storage_paths": storage_paths,
        "device": device,
        "compression": compression,
        "state_memory_budget": budget,
        "device_weights": weights,
        "state_accelerator_budget": accelerator_budget,
        "device_timeout_s": None if timeout is None else float(timeout),
        "saved_state_from": saved_state_from,
    }


def _state_precision(problems: Problems, raw: Mapping[str, Any], kind: registry.DeviceKind | None) -> None:
    """``state_precision``: a format the kind's devices hold."""
    precision = raw["state_precision"]
    if not problems.choice("state_precision", precision, FORMATS) or precision == "fp32":
        return
    if kind is not None and precision not in kind.state_formats:
        problems.add(
            f"`state_precision={precision!r}` with `backend={kind.name!r}`: its devices hold the state in "
            f"{', '.join(repr(f) for f in kind.state_formats)} only. Use `state_precision='fp32'` with it."
        )


def _saved_state_from(problems: Problems, source: Any) -> Mapping[str, Any] | None:
    """``saved_state_from``: a kind whose checkpoints keep their state on its devices, and its own arguments (checked
    by the kind), normalised to ``{"backend": name, **checked}``."""
    if source is None:
        return None
    keeping = [name for name in registry.kinds() if registry.kind(name).keeps_checkpoint_state]
    example = (
        "e.g. {'backend': 'remote', 'remote_devices': ['storage1:50051'], 'remote_token_file': '~/.smartinf/token'}"
    )
    if not isinstance(source, Mapping) or source.get("backend") not in keeping:
        problems.add(
            f"`saved_state_from={show(source)}` must be a dict naming the `backend` whose devices kept a checkpoint's "
            f"state ({', '.join(map(repr, keeping)) or 'none is registered'}) and its arguments, {example}; or None."
        )
        return None
    kind = registry.kind(source["backend"])
    options = {name: value for name, value in source.items() if name != "backend"}
    foreign = sorted(name for name in options if name not in kind.arguments)
    if foreign:
        problems.add(
            f"`saved_state_from`: {', '.join(map(repr, foreign))} are not arguments of `backend={kind.name!r}`; it "
            f"takes {', '.join(map(repr, kind.arguments))}."
        )
        return None
    known = len(problems)
    checked = kind.check(problems, options, None)
    return None if len(problems) > known else DeviceOptions({"backend": kind.name, **checked})


def _device(
    problems: Problems, raw: dict[str, Any], kind: registry.DeviceKind | None, storage_paths: tuple[Path, ...] | None
) -> Mapping[str, Any] | None:
    """The kind's own settings, checked by the kind; another kind's settings are refused, naming that kind."""
    options = raw["device"]
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        problems.add(f"`device={show(options)}` must be a mapping of the device kind's settings, or None.")
        return None
    foreign: dict[str, list[str]] = {}
    for name in options:
        if kind is None or name not in kind.arguments:
            owner = registry.kind_of_argument(name)  # never ``kind``, which does not take it
            foreign.setdefault(owner.name if owner is not None else "", []).append(name)
    for owner, names in foreign.items():
        shown = " and ".join(f"`{n}=...`" for n in names)
        if owner:
            verb = "applies" if len(names) == 1 else "apply"
            problems.add(
                f"{shown} {verb} to `backend={owner!r}` only, but `backend={raw['backend']!r}`. Drop "
                f"{'it' if len(names) == 1 else 'them'} or pass `backend={owner!r}`."
            )
        else:
            problems.add(f"{shown}: no device kind takes {'it' if len(names) == 1 else 'them'}.")
    if foreign or kind is None:
        return None
    known = len(problems)
    checked = kind.check(problems, options, storage_paths)
    return None if len(problems) > known else DeviceOptions(checked)


def _check_counts(problems: Problems, raw: dict[str, Any]) -> tuple[bool, bool, bool]:
    """Check the counts, sizes and the timeout; return whether ``sub_group_size``, ``chunk_size`` and
    ``buffer_count`` are valid."""
    sizes = (
        problems.integer("sub_group_size", raw["sub_group_size"], low=1, why="elements", example=40_000_000),
        *check_pool_shape(problems, raw["chunk_size"], raw["buffer_count"]),
    )
    problems.integer(
        "io_block_size",
        raw["io_block_size"],
        low=IO_ALIGN,
        high=1 << 30,
        multiple=IO_ALIGN,
        unit="bytes",
        why="the direct-I/O unit; one system call moves at most 2 GiB",
        example=1 << 20,
    )
    problems.integer("io_queue_depth", raw["io_queue_depth"], low=1, high=1024, example=8)
    problems.integer("io_threads", raw["io_threads"], low=1, high=1024, example=3)
    problems.number(
        "device_timeout_s",
        raw["device_timeout_s"],
        low=0,
        above=True,
        high=threading.TIMEOUT_MAX,
        unit="seconds",
        why="the longest wait Python's threading allows; None waits forever",
        example=300.0,
        optional=True,
    )
    return sizes


def _memory_budget(problems: Problems, raw: dict[str, Any]) -> int | None:
    """``state_memory_budget`` in bytes (``None`` for none or 0): at most the memory available now."""
    budget = problems.size("state_memory_budget", raw["state_memory_budget"])
    if not budget:
        return None
    problems.fits_in_memory(
        f"`state_memory_budget={raw['state_memory_budget']!r}`",
        budget,
        "fp32 master and optimizer state kept in RAM",
        "Lower the budget; the state that does not fit stays on the storage devices.",
    )
    return budget


def _accelerator_budget(problems: Problems, raw: dict[str, Any]) -> int | None:
    """``state_accelerator_budget`` in bytes (``None`` for none or 0), where CUDA exists. The GPU's free memory is
    checked at set-up, on the rank's own device (:func:`check_accelerator_budget`): settings are made before Lightning
    chooses it, and asking then would measure (and create a context on) GPU 0 from every rank."""
    shown = f"`state_accelerator_budget={show(raw['state_accelerator_budget'])}`"
    budget = problems.size("state_accelerator_budget", raw["state_accelerator_budget"])
    if not budget:
        return None
    if not torch.cuda.is_available():
        problems.add(
            f"{shown} keeps optimizer state in GPU memory, but CUDA is not available here (torch {torch.__version__}). "
            "Drop it, or keep state in host memory with `state_memory_budget`."
        )
        return None
    return budget


def check_accelerator_budget(budget: int | None, device: torch.device) -> None:
    """Raise ``ValueError`` unless ``device`` (this rank's GPU) has ``budget`` bytes free for the accelerator tier.

    Called at set-up, once the rank's device is chosen; nothing to check without a budget.
    """
    if not budget:
        return
    if device.type != "cuda":
        raise ValueError(
            f"`state_accelerator_budget={budget}` keeps optimizer state in GPU memory, but this rank trains on "
            f"{device}. Drop it, or train with `accelerator='gpu'`."
        )
    free = torch.cuda.mem_get_info(device)[0]
    if budget > free:
        raise ValueError(
            f"`state_accelerator_budget={budget}` is more than the {free / 2**20:.0f} MiB of memory free on {device} "
            "now. Lower it; the state that does not fit stays in host memory or on the storage devices."
        )


def _device_weights(
    problems: Problems,
    raw: dict[str, Any],
    kind: registry.DeviceKind | None,
    device: Mapping[str, Any] | None,
    paths: tuple[Path, ...] | None,
) -> tuple[float, ...] | None:
    """``device_weights`` as floats: one positive, finite number per device of the kind (per storage path, or per
    remote server)."""
    value, raw_paths = raw["device_weights"], raw["storage_paths"]
    if value is None or kind is None:
        return None
    what = kind.weighs
    if not isinstance(value, (list, tuple)) or not value:
        problems.add(
            f"`device_weights={show(value)}` must be a list of positive numbers, one per {what} (e.g. "
            f"`device_weights=[2.0, 1.0]` gives the first {what} twice the sub-groups of the second), or None."
        )
        return None
    valid = all(
        [problems.number(f"device_weights[{i}]", w, low=0, above=True, example=1.0) for i, w in enumerate(value)]
    )
    if what == "storage path" and raw_paths is None:
        problems.add(
            f"`device_weights={show(value)}` weighs storage paths, but `storage_paths=None`. Pass `storage_paths` "
            "(one weight per path) or drop `device_weights`."
        )
        return None
    if what == "storage path" and paths is None and isinstance(raw_paths, (list, tuple)):
        count: int | None = len(raw_paths)
    else:
        # The kind counts from its options as given where it refused them (e.g. a missing token file beside two
        # servers): the weights are then checked too, and every problem is reported in one error.
        options = device if device is not None else raw["device"]
        count = kind.weight_count(options, paths) if isinstance(options, Mapping) else None
    if count is not None and count != len(value):
        problems.add(
            f"`device_weights` has {len(value)} weight(s) for {count} {what}(s): give one weight per {what}, in order."
        )
        return None
    return tuple(float(w) for w in value) if valid else None


def _check_pool_memory(problems: Problems, raw: dict[str, Any]) -> None:
    """Devices' pools in host memory (the ``"cpu"`` kind's, unlike the SmartSSDs' DDR) fit in what is available."""
    paths = raw["storage_paths"]
    devices = len(paths) if isinstance(paths, (list, tuple)) else 1
    buffer_count, chunk_size = raw["buffer_count"], raw["chunk_size"]
    problems.fits_in_memory(
        f"`buffer_count={buffer_count}` with `chunk_size={chunk_size}` on {devices} storage path(s)",
        pool_bytes(devices, buffer_count, chunk_size),
        f"{devices} x {buffer_count} buffers x {chunk_size} elements x 4 B x {POOL_TENSORS} fp32 tensors: master "
        "weight and 2 Adam states",
        "Lower `buffer_count` (at least 2) or `chunk_size`.",
    )


def _storage_paths(problems: Problems, value: Any) -> tuple[Path, ...] | None:
    """``value`` resolved, each path named once; ``None`` if not given or bad.

    Each is a writable directory, or does not exist yet and can be created: its parent is a writable directory.
    Nothing is created here: each rank creates its own share at set-up
    (:func:`~lightning_smartinf.core.placement.rank_device_dirs`).
    """
    paths = problems.paths("storage_paths", value, optional=True)
    if paths is None:
        return None
    resolved: dict[Path, Any] = {}
    for original in paths:
        try:
            path = validate_storage_path(original, missing_ok=True)
        except (ValueError, OSError) as exc:  # OSError: a name the OS refuses (too long, ...)
            text = str(exc)
            problems.add(text if text.startswith("`storage_paths`") else f"`storage_paths` entry {original!r}: {text}")
            continue
        if path in resolved:
            problems.add(
                f"`storage_paths` names {str(resolved[path])!r} and {str(original)!r}, which are the same "
                "directory; two devices cannot share one storage path. Remove the duplicate."
            )
        resolved[path] = original
    return tuple(resolved) if len(resolved) == len(paths) else None


def _compression(problems: Problems, value: Any) -> TopKCompression | None:
    """``value`` as a :class:`TopKCompression` (``None``: dense, or a problem was added)."""
    if value is None or isinstance(value, TopKCompression):
        return value
    if isinstance(value, dict):
        fields = [field.name for field in dataclasses.fields(TopKCompression)]
        inside = problems.within("compression")
        valid = problems.keys("compression", value, fields, required=["ratio"])
        if "ratio" in value:
            valid = inside.ratio("ratio", value["ratio"]) and valid
        for key in ("error_feedback", "layerwise"):
            if key in value:
                valid = inside.flag(key, value[key]) and valid
        if "rule" in value:
            valid = inside.choice("rule", value["rule"], RULE_CHOICES) and valid
        if valid and value.get("rule") in EF_RULES and value.get("error_feedback") is False:
            problems.add(ef_rule_needs_feedback(value["rule"]))
            valid = False
        return TopKCompression(**value) if valid else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return TopKCompression(value) if problems.ratio("compression", value) else None
    problems.instance(
        "compression",
        value,
        (),
        "the kept ratio (a number with 0 < ratio <= 1, e.g. 0.01), a dict like "
        "{'ratio': 0.01, 'rule': 'ef_adam'}, a `TopKCompression`, or None",
        fix="Pass e.g. `compression=0.01`." if not isinstance(value, str) else "",
    )
    return None
