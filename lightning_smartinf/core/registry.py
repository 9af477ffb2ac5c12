"""Device kinds by name: each device package registers its kind; building a backend is one lookup.

A kind (``cpu``, ``xrt``, ``remote``; :mod:`lightning_smartinf.devices`) says which settings it takes and checks them,
what its devices can do, and builds one rank's backend. The core asks the kind, never its name: no module here
imports a device package, and no code outside the device packages branches on the kind.

A new kind is a package that subclasses :class:`DeviceKind` and calls :func:`register` when it is imported
(``docs/architecture.md``, "Adding a device").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_smartinf.core.arguments import Problems

if TYPE_CHECKING:
    from contextlib import ExitStack

    from torch import Tensor

    from lightning_smartinf.core.backend import Backend
    from lightning_smartinf.core.format.reshard import Fetch
    from lightning_smartinf.core.io.direct import IOEngine
    from lightning_smartinf.core.settings import SmartUpdateSettings

__all__ = ["BuildContext", "DeviceKind", "kind", "kind_of_argument", "kinds", "register"]


@dataclass(frozen=True)
class BuildContext:
    """What a kind needs to build one rank's backend.

    Args:
        device_dirs: this rank's device directories (created, found unclaimed), one per storage path of its share.
        owned_dirs: those of ``device_dirs`` the backend removes when it releases its storage (temporary ones).
        local_rank: this rank's index on its node.
        ranks_per_node: ranks on this node (they share the node's storage paths, and their weights, out).
        label: this rank's name where it needs one on shared devices (``rank000``).
        io_factory: the I/O engine of each device that moves state on this host (:attr:`DeviceKind.uses_io_engine`).
        accelerator_training: forward and backward run on an accelerator, leaving the host cores to the devices.
    """

    device_dirs: tuple[Path, ...]
    owned_dirs: tuple[Path, ...] = ()
    local_rank: int = 0
    ranks_per_node: int = 1
    label: str = "rank000"
    io_factory: Callable[[], IOEngine] | None = None
    accelerator_training: bool = False


class DeviceKind(ABC):
    """One kind of device backend: its settings, what its devices can do, and how it is built.

    Class attributes say what the rest of the project may assume of the kind; the methods check its settings and
    build its backend.
    """

    #: The kind's name: the strategy's ``backend=...``.
    name: str = ""
    #: The strategy's arguments that belong to this kind only (checked by :meth:`check`, refused with another kind).
    arguments: tuple[str, ...] = ()
    #: Whether its devices take tentative updates, so that sub-groups are handed off during backward (hand-offs).
    takes_hand_offs: bool = False
    #: Whether its devices move state with an I/O engine of this host (chosen at set-up: libaio or threads).
    uses_io_engine: bool = False
    #: Whether its devices keep their buffer pools in host memory (checked against what is available).
    host_pools: bool = False
    #: Whether its devices update with compute of their own, beside the host cores (SmartSSDs, remote servers).
    devices_compute: bool = False
    #: Whether its state lasts only while this process holds it, whatever the storage paths (remote sessions).
    state_held_by_process: bool = False
    #: Whether its state is in this host's storage paths (their free space and SSD wear concern it).
    state_in_storage_paths: bool = True
    #: Whether a shard's state can move between its devices and this host's memory tiers between steps.
    state_movable: bool = True
    #: Whether its checkpoints keep the device state on its devices, not in files in the checkpoint (remote servers):
    #: another kind reaches them with :meth:`fetch_saved_state` (the strategy's ``saved_state_from``).
    keeps_checkpoint_state: bool = False
    #: The state formats its devices hold (``state_precision``; :mod:`lightning_smartinf.core.state_formats`).
    state_formats: tuple[str, ...] = ("fp32",)
    #: Whether its devices run on this host's cores and memory, so that they can keep half of each master in the bf16
    #: parameters there (``split_masters``; :mod:`lightning_smartinf.core.split_masters`).
    splits_masters: bool = False
    #: What one entry of ``device_weights`` weighs.
    weighs: str = "storage path"

    def check(self, problems: Problems, options: Mapping[str, Any], storage_paths: Sequence[Path] | None) -> Any:
        """Check this kind's ``options`` (a subset of :attr:`arguments`, as given); add a line to ``problems`` for each
        bad one and return them normalised (default: nothing to check)."""
        return dict(options)

    def weight_count(self, options: Any, storage_paths: Sequence[Path] | None) -> int | None:
        """How many ``device_weights`` the settings need (``None``: unknown, or no storage paths given)."""
        return None if storage_paths is None else len(storage_paths)

    @abstractmethod
    def build(self, settings: SmartUpdateSettings, context: BuildContext) -> Backend:
        """One rank's backend, its directories claimed."""

    def checkpoint_masters(
        self, options: Mapping[str, Any], *, timeout: float | None
    ) -> Callable[[Path], list[Tensor]] | None:
        """For a kind whose checkpoints keep the state on its devices (remote servers), reached with ``options`` (this
        kind's arguments, as :meth:`check` normalised them): a reader of one rank's masters from a checkpoint's
        device-state directory. ``None`` (the default): the masters are in the directory's shard files."""
        return None

    def fetch_saved_state(
        self,
        options: Mapping[str, Any],
        rank_dirs: Sequence[Path],
        into: Path,
        scratch: ExitStack,
        *,
        timeout: float | None,
    ) -> tuple[list[Path], Fetch] | None:
        """For a run of another kind resuming a checkpoint whose state this kind's devices kept (no state files in
        ``rank_dirs``), reached with ``options`` (this kind's arguments, as :meth:`check` normalised them): what
        :meth:`~lightning_smartinf.core.backend.Backend.fetch_saved_state` returns, with whatever must be closed
        after the load pushed on ``scratch``. ``None`` (the default): this kind's checkpoints keep their state in
        files."""
        return None


_KINDS: dict[str, DeviceKind] = {}


def register(device_kind: DeviceKind) -> DeviceKind:
    """Make ``device_kind`` available by its name (a second registration of a name replaces the first)."""
    if not device_kind.name:
        raise ValueError(f"{type(device_kind).__name__} has no `name`.")
    _KINDS[device_kind.name] = device_kind
    return device_kind


def kinds() -> tuple[str, ...]:
    """The registered kinds' names, in registration order."""
    return tuple(_KINDS)


def kind(name: str) -> DeviceKind:
    """The kind registered as ``name``; ``KeyError`` naming the registered ones otherwise."""
    try:
        return _KINDS[name]
    except (KeyError, TypeError):
        raise KeyError(f"no device kind {name!r}; the kinds are {', '.join(map(repr, _KINDS)) or 'none'}") from None


def kind_of_argument(argument: str) -> DeviceKind | None:
    """The kind ``argument`` belongs to, if any."""
    return next((k for k in _KINDS.values() if argument in k.arguments), None)
