"""A rank whose device is not the host, on a machine without a GPU: what NCCL would refuse, seen on the CPU.

Under NCCL every tensor a collective takes must be on the rank's GPU (``RuntimeError: No backend type associated
with device type cpu``); gloo takes host tensors, so on a CPU run the two look alike. :class:`RankDevice` makes them
differ:

- the rank's device, as the package finds it (``strategy.root_device``; DeepSpeed's accelerator's
  ``current_device_name()``), becomes ``meta``, which is never the host;
- a torch function mode keeps every tensor on the host, where gloo can use it, but remembers which tensors were
  put on that device: those made or moved there (``device=meta``, ``.to(meta)``) and those computed from them.
  Moving one back (``.cpu()``, ``.to("cpu")``) gives a host copy, as a device-to-host copy would;
- every tensor collective of ``torch.distributed`` (which ``deepspeed.comm`` and Lightning call) checks, where the
  package called it, that each tensor it takes was on the rank's device, and records a violation otherwise (and
  raises, as NCCL would).

Collectives called from DeepSpeed's or Lightning's own code (their gathers, their norms) are not checked: their
tensors come from the model, which this mode leaves on the host. Object collectives (``broadcast_object_list``) take
no tensor of ours (torch moves the pickled bytes to the current CUDA device itself) and are only recorded.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

#: The rank's device in a :class:`RankDevice`: never the host.
RANK_DEVICE = torch.device("meta")
PACKAGE = Path(__file__).resolve().parents[2] / "lightning_smartinf"

#: Collectives that take tensors, checked at the package's call sites.
TENSOR_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
)
#: Collectives of pickled objects and barriers: recorded only.
OBJECT_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list", "barrier")
#: Frames skipped when finding who called a collective: the libraries between the package and torch.
LIBRARY_PARTS = (
    f"{Path('torch', 'distributed')}",
    f"{Path('deepspeed', 'comm')}",
    f"{Path('lightning', 'fabric')}",
    f"{Path('lightning', 'pytorch')}",
)


@dataclass
class CollectiveCall:
    """One collective the package called: where (``file.py:function``), which, and what was wrong (if anything)."""

    site: str
    name: str
    problem: str | None = None


@dataclass
class RankDeviceRecord:
    """What a :class:`RankDevice` saw."""

    calls: list[CollectiveCall] = field(default_factory=list)

    @property
    def violations(self) -> list[CollectiveCall]:
        return [call for call in self.calls if call.problem is not None]

    def sites(self) -> set[str]:
        return {call.site for call in self.calls}


def _is_rank_device(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value == RANK_DEVICE
    return isinstance(value, str) and value == str(RANK_DEVICE)


def _is_host(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cpu"
    return isinstance(value, str) and value.split(":")[0] == "cpu"


class _OnDevice:
    """The tensors put on the rank's device, by identity (a tensor's ``==`` compares values), held weakly."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}

    def add(self, tensor: torch.Tensor) -> None:
        self._refs[id(tensor)] = weakref.ref(tensor)

    def __contains__(self, tensor: object) -> bool:
        ref = self._refs.get(id(tensor))
        return ref is not None and ref() is tensor


class _Placement(TorchFunctionMode):
    """Keeps every tensor on the host; remembers which ones the code put on the rank's device."""

    def __init__(self, on_device: _OnDevice) -> None:
        super().__init__()
        self.on_device = on_device

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        moves_there = any(_is_rank_device(value) for value in flat)
        if moves_there:  # made or moved onto the rank's device: on the host here, remembered as there
            args, kwargs = tree_map(lambda v: "cpu" if _is_rank_device(v) else v, (args, kwargs))
            result = func(*args, **kwargs)
            self._remember(result)
            return result
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        to_host = func is torch.Tensor.cpu or (func is torch.Tensor.to and any(_is_host(v) for v in flat[1:]))
        if to_host and source is not None and source in self.on_device:
            return func(*args, **kwargs).clone()  # a device-to-host copy: a tensor of its own, on the host
        result = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        in_place = name.endswith("_") or name in ("__setitem__", "__iadd__", "__imul__")
        if not in_place and not to_host and any(isinstance(v, torch.Tensor) and v in self.on_device for v in flat):
            self._remember(result)  # computed on the device from tensors there: stays there
        return result

    def _remember(self, result: Any) -> None:
        for value in tree_flatten(result)[0]:
            if isinstance(value, torch.Tensor):
                self.on_device.add(value)


def _call_site() -> str | None:
    """``file.py:function`` of the package's frame that called the collective under way; ``None`` when the first
    frame outside torch, DeepSpeed's comm and Lightning is not the package's."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path != __file__ and not any(part in path for part in LIBRARY_PARTS):
            resolved = Path(path).resolve()
            if PACKAGE in resolved.parents:
                return f"{resolved.relative_to(PACKAGE).as_posix()}:{frame.f_code.co_name}"
            return None
        frame = frame.f_back
    return None


class RankDevice:
    """Make the rank's device ``meta`` and check every collective the package calls (see the module)."""

    def __init__(self) -> None:
        self.record = RankDeviceRecord()
        self._on_device = _OnDevice()
        self._undo: list[tuple[Any, str, Any]] = []

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        # The owner's own attribute, or none (an inherited property or a method is deleted again on the way out).
        before = vars(owner).get(name, _MISSING)
        self._undo.append((owner, name, before))
        setattr(owner, name, value)

    def _checked(self, name: str, original: Any, tensors: bool) -> Any:
        @functools.wraps(original)
        def collective(*args: Any, **kwargs: Any) -> Any:
            site = _call_site()
            if site is not None:
                problem = None
                if tensors:
                    flat = [v for v in tree_flatten((args, kwargs))[0] if isinstance(v, torch.Tensor)]
                    elsewhere = [v for v in flat if v not in self._on_device]
                    if elsewhere:
                        problem = (
                            f"`{name}` called from {site} with a tensor on {elsewhere[0].device.type} (the host), not "
                            f"on the rank's device: NCCL refuses it (No backend type associated with device type cpu)"
                        )
                self.record.calls.append(CollectiveCall(site, name, problem))
                if problem is not None:
                    raise AssertionError(problem)
            return original(*args, **kwargs)

        return collective

    def __enter__(self) -> RankDevice:
        from deepspeed.accelerator import get_accelerator

        from lightning_smartinf import SmartInfinityStrategy

        self._patch(SmartInfinityStrategy, "root_device", property(lambda _: RANK_DEVICE))
        self._patch(get_accelerator(), "current_device_name", lambda *_: str(RANK_DEVICE))
        for name in TENSOR_COLLECTIVES + OBJECT_COLLECTIVES:
            self._patch(dist, name, self._checked(name, getattr(dist, name), name in TENSOR_COLLECTIVES))
        self._mode = _Placement(self._on_device)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        for owner, name, value in reversed(self._undo):
            if value is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        self._undo.clear()


_MISSING = object()


@contextmanager
def rank_device() -> Iterator[RankDeviceRecord]:
    """``with rank_device() as record:`` run code whose collectives must take tensors on the rank's device."""
    with RankDevice() as checker:
        yield checker.record
