"""What the Lightning layer's helpers read of the strategy that runs SmartUpdate: the callbacks, the training
monitor, activation offload and the Hugging Face export recognise it by :class:`SmartUpdateStrategy`, so none of
them imports the strategy (which imports and adds them)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_smartinf.core import TrafficSnapshot
    from lightning_smartinf.core.clocks import PhaseClocks
    from lightning_smartinf.core.controller import SmartUpdateController
    from lightning_smartinf.core.settings import SmartUpdateSettings

__all__ = ["SmartUpdateStrategy"]


class SmartUpdateStrategy(ABC):
    """A strategy whose optimizer is SmartUpdate (``SmartInfinityStrategy``).

    Attributes:
        settings: every SmartUpdate setting, validated; replaced whole, never changed in place.
        clocks: the forward, backward and after-backward time of this rank.
    """

    settings: SmartUpdateSettings
    clocks: PhaseClocks

    @property
    @abstractmethod
    def has_smart_update(self) -> bool:
        """Whether the devices are live: between engine set-up and teardown of ``fit``."""

    @property
    @abstractmethod
    def smart_update(self) -> SmartUpdateController:
        """This rank's SmartUpdate controller, from engine set-up on."""

    @property
    @abstractmethod
    def traffic(self) -> TrafficSnapshot:
        """Cumulative bytes of this rank: link, storage (inside the devices), parameters; kept after teardown."""

    @property
    @abstractmethod
    def sub_group_size(self) -> int:
        """Elements per ZeRO sub-group, as DeepSpeed will use it."""

    @property
    @abstractmethod
    def devices_per_rank(self) -> int:
        """Devices (storage paths) each rank drives."""

    @abstractmethod
    def rank_storage_paths(self) -> list[Path]:
        """This rank's share of the storage paths (``[]`` with ``storage_paths=None``)."""

    @abstractmethod
    def resize_pools(self, *, chunk_size: int, buffer_count: int) -> None:
        """Use ``buffer_count`` buffers of ``chunk_size`` elements per device (before set-up)."""

    @property
    @abstractmethod
    def kept_ratio(self) -> float | None:
        """Fraction of gradient entries the coming steps send (``None``: dense)."""

    @abstractmethod
    def set_kept_ratio(self, ratio: float | None) -> None:
        """Change the kept ratio from the next optimizer step on (``None``: send dense gradients)."""
