"""The device-state checkpoint format of one rank: the devices' shard files, the compression residual, the host state.

One directory per rank (``<checkpoint>/checkpoint/smartinf/rankNNN/``) holds:

- the devices' copy of every shard's state and its manifest (:mod:`lightning_smartinf.core.format.state_files`);
- ``residual.safetensors``: the host's tensors, when there are any: the error-feedback residual (``residual``) and
  the factored second moments of rule ``ef_adafactor`` (``moments``);
- ``host_state.json``: what the host keeps beside the devices (optimizer steps per param group, loss scale, the
  param groups' hyperparameters, which parameter partitions each shard holds), the global step it belongs to, and
  the size and CRC-32 of ``residual.safetensors``.

Invariant: ``host_state.json`` is written last, so a directory that has it is complete; every other file is
verified against it (the residual) or the manifest (the shards) before anything is loaded.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_smartinf.core.backend import Backend
from lightning_smartinf.core.format.safetensors_stream import SavedTensor, read_safetensors_header, safetensors_blocks
from lightning_smartinf.core.format.state_files import CheckpointError, read_json, write_file_atomic
from lightning_smartinf.core.host_buffer import HostBuffer
from lightning_smartinf.core.io.checksum import CRC32, file_checksum

HOST_STATE = "host_state.json"
RESIDUAL = "residual.safetensors"
#: Keys every ``host_state.json`` has.
REQUIRED_KEYS = ("global_step", "num_shards", "group_steps", "loss_scale")


def save_device_state(
    directory: Path,
    backend: Backend,
    host_state: dict[str, Any],
    tensors: Mapping[str, Tensor | HostBuffer | None],
    *,
    global_step: int,
) -> None:
    """Write ``backend``'s shards, then the host's ``tensors`` (those not ``None``; a :class:`HostBuffer` is written a
    block at a time and released after each), then ``host_state`` (recording ``global_step``) under it.

    Between a backward and its step, updates made during backward are still tentative: the backend saves the
    committed state, the one before this step, like every other part of a checkpoint.
    """
    backend.save(directory)
    host_state = {**host_state, "global_step": global_step}
    kept = {name: tensor for name, tensor in tensors.items() if tensor is not None}
    if kept:
        path = directory / RESIDUAL
        write_file_atomic(path, safetensors_blocks(kept, HOST_DTYPES))
        size, crc = file_checksum(path, CRC32)
        host_state["residual"] = {"file": RESIDUAL, "bytes": size, "crc32": crc}
    write_file_atomic(directory / HOST_STATE, json.dumps(host_state).encode())


def read_host_state(directory: Path, *, global_step: int, sealed_by: Path) -> dict[str, Any]:
    """``host_state.json`` of ``directory``, checked to belong to ``global_step`` (recorded by ``sealed_by``).

    Raises:
        CheckpointError: the file is missing, corrupt, or from another save.
    """
    state = read_json(directory / HOST_STATE, "the device state", REQUIRED_KEYS)
    if state["global_step"] != global_step:
        raise CheckpointError(
            f"{directory / HOST_STATE} records global step {state['global_step']!r}, but {sealed_by} records step "
            f"{global_step}: the device state comes from another save. Resume from another checkpoint."
        )
    return state


def load_host_tensors(directory: Path, entry: dict[str, Any] | None) -> dict[str, SavedTensor]:
    """The host's tensors saved in ``directory``, verified against ``entry`` (their file's size and CRC-32); none
    without one. Each is read when asked (:meth:`SavedTensor.read`), so a large one need not fit in memory at once.

    Raises:
        CheckpointError: ``residual.safetensors`` is missing, does not match ``entry``, or is not a safetensors file
            of the dtypes the host saves.
    """
    if entry is None:
        return {}
    path = directory / RESIDUAL
    if not path.is_file():
        raise CheckpointError(
            f"The compression residual {path} is missing: the checkpoint is incomplete. Resume from another one."
        )
    size, crc = file_checksum(path, CRC32)
    if (crc, size) != (entry["crc32"], entry["bytes"]):
        raise CheckpointError(
            f"The compression residual {path} is corrupt ({size} bytes, CRC-32 {crc:#010x}; the checkpoint "
            f"recorded {entry['bytes']} bytes, CRC-32 {entry['crc32']:#010x}). Resume from another checkpoint."
        )
    return read_host_tensors(path)


#: The dtypes the host saves.
HOST_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8)


def read_host_tensors(path: Path) -> dict[str, SavedTensor]:
    """The tensors of the host's safetensors file at ``path``, by name, each read when asked.

    Raises:
        CheckpointError: the header is not a safetensors header of the dtypes the host saves, or its tensors do not
            tile the file.
    """
    try:
        return read_safetensors_header(path, HOST_DTYPES)
    except ValueError as exc:
        raise CheckpointError(
            f"{path} is not a safetensors file of the host's tensors ({exc}). Resume from another checkpoint."
        ) from None


@dataclass(frozen=True)
class PartitionIndex:
    """Where each parameter's partition lies in one rank's shards, from their parameter lists (``host_state.json``'s
    ``shards``, or a live controller's layout): each shard holds its parameters' partitions back to back."""

    #: parameter name -> (shard, offset in the shard, partition_numel)
    where: dict[str, tuple[int, int, int]]
    #: parameter name -> the whole parameter's shape
    shapes: dict[str, tuple[int, ...]]
    #: the elements each shard's parameters cover
    numels: list[int]

    @classmethod
    def of(cls, shards: Sequence[Sequence[Mapping[str, Any]]], prefix: str = "") -> PartitionIndex:
        """The index of ``shards``; with ``prefix``, only the parameters named ``prefix...``, named without it (the
        numels still count every parameter)."""
        index = cls({}, {}, [])
        for shard, params in enumerate(shards):
            offset = 0
            for param in params:
                numel = int(param["partition_numel"])
                if param["name"].startswith(prefix):
                    name = param["name"][len(prefix) :]
                    index.where[name] = (shard, offset, numel)
                    index.shapes[name] = tuple(int(n) for n in param["shape"])
                offset += numel
            index.numels.append(offset)
        return index


def full_parameter(name: str, partitions: Sequence[Tensor], shape: Sequence[int]) -> Tensor:
    """Parameter ``name`` whole, from its partitions on every rank in rank order (the last one padded).

    Rank ``r`` holds elements ``[r * partition_numel, (r + 1) * partition_numel)`` of the flattened parameter.

    Raises:
        ValueError: the partitions hold fewer elements than ``shape`` needs.
    """
    numel = math.prod(shape)
    flat = torch.cat(list(partitions))
    if flat.numel() < numel:
        raise ValueError(f"Parameter {name!r}: the ranks hold {flat.numel()} elements, its shape needs {numel}.")
    # `cat` made a tensor of its own: only the padding needs another copy to be dropped.
    return (flat if flat.numel() == numel else flat[:numel].clone()).view(list(shape))
