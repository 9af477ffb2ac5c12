"""What crosses the network between a trainer and a remote device server: one protobuf message, ``Frame``.

gRPC carries the frames (HTTP/2 framing, flow control, deadlines, metadata for the bearer token). A frame holds a
small JSON ``header`` (the call's arguments, at most :data:`MAX_HEADER_BYTES`) and/or one chunk of one tensor as raw
bytes with its dtype, the shape of the whole tensor and the element offset of the chunk. Tensors travel in chunks
of at most :data:`CHUNK_BYTES`, so no message exceeds :data:`MAX_MESSAGE_BYTES`, and gRPC's flow control makes a
slow server push back on its clients.

The message type is built from a descriptor at import (``FRAME_PROTO`` is its ``.proto`` text), so there is no
generated code to keep in step with the protobuf runtime.

Invariants:

- A decoded tensor has exactly the dtype and size its frames declared, or :class:`WireError` is raised; chunks
  must arrive in order, without gaps or overlap.
- Decoding never evaluates anything: headers are JSON, and rules and hyperparameters are rebuilt from known
  classes and fields only.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy
import torch
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from torch import Tensor

from lightning_smartinf.core.backend import ShardSpec
from lightning_smartinf.core.io.checksum import crc32c
from lightning_smartinf.core.rules import SGD, Adagrad, Adam, EFAdafactor, EFAdam, StepParams, UpdateRule
from lightning_smartinf.core.state_formats import FORMATS, check_format_for_rule

__all__ = [
    "CHUNK_BYTES",
    "FRAME_PROTO",
    "MAX_HEADER_BYTES",
    "MAX_UPDATES_IN_FLIGHT",
    "PROTOCOL_VERSION",
    "RETRY_PUSHBACK",
    "MAX_MESSAGE_BYTES",
    "SERVICE",
    "Frame",
    "TensorReader",
    "WireError",
    "decode_header",
    "encode_tensor",
    "header_frame",
    "hp_from_wire",
    "hp_to_wire",
    "read_tensor",
    "rule_from_wire",
    "rule_to_wire",
    "shard_from_wire",
    "shard_to_wire",
]

SERVICE = "smartinf.remote.Device"
#: 2: the server names sessions and checkpoints, and takes the token as gRPC call credentials send it. 3: a client
#: uploads state files (`Upload`, then the `load_upload` control) to resume a checkpoint of another backend or layout.
#: 4: `ReadCheckpoint` also sends a saved checkpoint's manifest and state files (`part`), so that a checkpoint kept
#: on servers resumes under another layout. 5: a shard of ``Open`` may name its state format (``state_format``), which
#: a server of version 4 would ignore. 6: an ``"int8"`` state's second moment is coded in UE4M4 (a server of version 5
#: codes it in E4M3: the same bytes would read as other values). 7: the server adds a lineage id to a session's label
#: (``Open`` replies with it) and a ``load`` names the checkpoint's label, whose lineage the session continues (a
#: server of version 6 would look for the checkpoint under the new session's label).
PROTOCOL_VERSION = 7
#: Updates one session has in flight on a server (the server admits no more; a client sends no more).
MAX_UPDATES_IN_FLIGHT = 4
#: Trailing metadata by which a server tells gRPC's retry policy, and the client, not to retry (a negative pushback).
RETRY_PUSHBACK = "grpc-retry-pushback-ms"
#: Bytes of tensor data per frame.
CHUNK_BYTES = 4 << 20
MAX_HEADER_BYTES = 256 << 10
#: The largest message either side accepts (gRPC's ``max_receive_message_length``).
MAX_MESSAGE_BYTES = CHUNK_BYTES + MAX_HEADER_BYTES + 4096

FRAME_PROTO = """syntax = "proto3";
package smartinf.remote;
message Frame {
  string header = 1;         // JSON object: the call's arguments or reply
  string tensor = 2;         // which tensor the chunk belongs to ("grad", "indices", "out", ...)
  string dtype = 3;          // torch dtype name, e.g. "bfloat16"
  int64 numel = 4;           // elements of the whole tensor
  int64 offset = 5;          // element offset of this chunk
  bytes data = 6;            // the chunk, raw little-endian bytes
}"""


def _frame_class() -> type:
    file = descriptor_pb2.FileDescriptorProto(name="smartinf_remote.proto", package="smartinf.remote", syntax="proto3")
    message = file.message_type.add(name="Frame")
    field = descriptor_pb2.FieldDescriptorProto
    for number, (name, kind) in enumerate(
        [
            ("header", field.TYPE_STRING),
            ("tensor", field.TYPE_STRING),
            ("dtype", field.TYPE_STRING),
            ("numel", field.TYPE_INT64),
            ("offset", field.TYPE_INT64),
            ("data", field.TYPE_BYTES),
        ],
        start=1,
    ):
        message.field.add(name=name, number=number, type=kind, label=field.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("smartinf.remote.Frame"))


#: The one message type of the protocol (see :data:`FRAME_PROTO`).
Frame = _frame_class()

#: Dtypes that may cross the wire, by name.
DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8)
}


class WireError(ValueError):
    """A frame that does not follow the protocol (malformed, oversized, out of order, of an unknown kind)."""


def header_frame(**header: Any) -> Any:
    """A frame carrying only ``header`` (JSON-serialisable)."""
    text = json.dumps(header, separators=(",", ":"))
    if len(text) > MAX_HEADER_BYTES:
        raise WireError(f"A header of {len(text)} bytes exceeds the limit of {MAX_HEADER_BYTES}.")
    return Frame(header=text)


def decode_header(frame: Any, required: Iterable[str] = ()) -> dict[str, Any]:
    """The JSON object of ``frame.header``, with every key of ``required`` present."""
    if len(frame.header) > MAX_HEADER_BYTES:
        raise WireError(f"A header of {len(frame.header)} bytes exceeds the limit of {MAX_HEADER_BYTES}.")
    try:
        header = json.loads(frame.header) if frame.header else {}
    except json.JSONDecodeError as exc:
        raise WireError(f"The frame's header is not JSON: {exc}.") from None
    if not isinstance(header, dict):
        raise WireError(f"The frame's header must be a JSON object, got {type(header).__name__}.")
    if missing := [key for key in required if key not in header]:
        raise WireError(f"The frame's header lacks {', '.join(map(repr, missing))}.")
    return header


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise WireError(f"dtype {dtype} cannot cross the wire; allowed: {', '.join(DTYPES)}.")
    return name


def encode_tensor(name: str, tensor: Tensor, chunk_bytes: int = CHUNK_BYTES) -> Iterator[Any]:
    """Frames carrying the flat ``tensor`` (host memory) in chunks of at most ``chunk_bytes`` bytes."""
    flat = tensor.detach().reshape(-1).cpu()  # the tensor itself when it is in host memory already
    dtype = dtype_name(flat.dtype)
    per_chunk = max(1, chunk_bytes // flat.element_size())
    numel = flat.numel()
    for start in range(0, max(numel, 1), per_chunk):  # an empty tensor: one frame, without data
        chunk = flat[start : start + per_chunk].contiguous()
        data = chunk.view(torch.uint8).numpy().tobytes()
        yield Frame(tensor=name, dtype=dtype, numel=numel, offset=start, data=data)


def encode_file(name: str, path: Path, dtype: torch.dtype, chunk_bytes: int = CHUNK_BYTES) -> Iterator[Any]:
    """Frames carrying the file at ``path`` as a flat tensor of ``dtype``, read a chunk at a time as they are sent
    (the file is never held whole)."""
    size = path.stat().st_size
    itemsize = dtype.itemsize
    if size % itemsize:
        raise WireError(f"{path} holds {size} bytes, not whole {dtype} elements.")
    numel, name_of_dtype = size // itemsize, dtype_name(dtype)
    per_chunk = max(itemsize, chunk_bytes - chunk_bytes % itemsize)
    with open(path, "rb") as f:
        for start in range(0, max(size, 1), per_chunk):  # an empty file: one frame, without data
            data = f.read(min(per_chunk, size - start))
            if len(data) != min(per_chunk, size - start):
                raise WireError(f"{path} ended early at byte {start + len(data)} of {size}.")
            yield Frame(tensor=name, dtype=name_of_dtype, numel=numel, offset=start // itemsize, data=data)


def write_frames(frames: Iterable[Any], path: Path, *, name: str, numel: int, replace: bool = False) -> int:
    """Write the float32 tensor ``name`` of ``numel`` elements that ``frames`` carry to a new private file at ``path``
    (``replace``: or over the one there) as they arrive (never held whole), checking each chunk against the declared
    name, dtype, size and order; returns the CRC-32C of the file. Raises :class:`WireError` at the first chunk that
    does not follow, or where the frames end before the tensor."""
    crc = filled = 0
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_TRUNC if replace else os.O_EXCL)
    with open(os.open(path, flags, 0o600), "wb") as out:
        for frame in frames:
            if frame.tensor != name or frame.dtype != "float32" or frame.numel != numel:
                raise WireError(f"Expected chunks of `{name}`, float32, {numel} elements.")
            if frame.offset != filled or len(frame.data) % 4 or filled + len(frame.data) // 4 > numel:
                raise WireError(f"A chunk of `{name}` at {frame.offset} does not continue at {filled}.")
            out.write(frame.data)
            crc = crc32c(frame.data, crc)
            filled += len(frame.data) // 4
    if filled != numel:
        raise WireError(f"The stream ended after {filled} of {numel} elements of `{name}`.")
    return crc


class TensorReader:
    """Reassembles one tensor from its frames, checking each against what the first declared."""

    def __init__(self, name: str, *, max_numel: int, dtypes: Iterable[torch.dtype] | None = None) -> None:
        self.name = name
        self.max_numel = max_numel
        self.dtypes = None if dtypes is None else tuple(dtypes)
        self.tensor: Tensor | None = None
        self.filled = 0

    def add(self, frame: Any) -> bool:
        """Take one frame; ``True`` once the tensor is complete."""
        if frame.tensor != self.name:
            raise WireError(f"Expected a chunk of {self.name!r}, got one of {frame.tensor!r}.")
        dtype = DTYPES.get(frame.dtype)
        if dtype is None:
            raise WireError(f"Unknown dtype {frame.dtype!r} for {self.name!r}; allowed: {', '.join(DTYPES)}.")
        if self.dtypes is not None and dtype not in self.dtypes:
            raise WireError(f"{self.name!r} may not be {frame.dtype}.")
        if self.tensor is None:
            if not 0 <= frame.numel <= self.max_numel:
                raise WireError(f"{self.name!r} declares {frame.numel} elements; at most {self.max_numel} allowed.")
            self.tensor = torch.empty(frame.numel, dtype=dtype)
        elif dtype != self.tensor.dtype or frame.numel != self.tensor.numel():
            raise WireError(f"A chunk of {self.name!r} changes its dtype or size mid-stream.")
        if frame.offset != self.filled:
            raise WireError(f"A chunk of {self.name!r} starts at {frame.offset}, expected {self.filled}.")
        itemsize = dtype.itemsize
        if len(frame.data) % itemsize or self.filled + len(frame.data) // itemsize > self.tensor.numel():
            raise WireError(f"A chunk of {self.name!r} has {len(frame.data)} bytes, which does not fit the tensor.")
        n = len(frame.data) // itemsize
        if n:
            # One copy, from the message's immutable bytes straight into the tensor.
            target = self.tensor[self.filled : self.filled + n].view(torch.uint8).numpy()
            target[:] = numpy.frombuffer(frame.data, dtype=numpy.uint8)
        self.filled += n
        return self.filled == self.tensor.numel()


def read_tensor(
    frames: Iterator[Any], name: str, numel: int, dtypes: Iterable[torch.dtype], *, exact: bool = True
) -> Tensor:
    """The tensor ``name`` that the next ``frames`` carry, of one of ``dtypes``: ``numel`` elements (at most ``numel``
    unless ``exact``). The frames after it stay in ``frames``."""
    reader = TensorReader(name, max_numel=numel, dtypes=dtypes)
    for frame in frames:
        if reader.add(frame):
            assert reader.tensor is not None
            if exact and reader.tensor.numel() != numel:
                raise WireError(f"`{name}` has {reader.tensor.numel()} elements; {numel} expected.")
            return reader.tensor
    raise WireError(f"The stream ended before {name!r} was complete.")


# ---------------------------------------------------------------------------------------------- rules and steps

_RULES: dict[str, type[UpdateRule]] = {rule.name: rule for rule in (Adam, SGD, Adagrad, EFAdam, EFAdafactor)}


def rule_to_wire(rule: UpdateRule) -> dict[str, Any]:
    return {"name": rule.name, **dataclasses.asdict(rule)}  # type: ignore[call-overload]


def _typed_fields(cls: type, values: dict[str, Any], what: str) -> dict[str, Any]:
    """``values`` checked against the dataclass fields of ``cls``: known names, values of each field's annotated type
    (``bool``, ``int``, a finite ``float``, or a tuple of finite floats)."""
    fields = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    if unknown := sorted(set(values) - set(fields)):
        raise WireError(f"{what} has unknown fields {unknown}; allowed: {sorted(fields)}.")
    required = {
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    if missing := sorted(required - set(values)):
        raise WireError(f"{what} lacks the fields {missing}.")

    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    out: dict[str, Any] = {}
    for name, value in values.items():
        kind = fields[name]
        if kind == "bool":
            ok = isinstance(value, bool)
        elif kind == "int":
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind.startswith("tuple"):
            ok = isinstance(value, list) and all(number(v) for v in value)
            value = tuple(float(v) for v in value) if ok else value
        else:
            ok = number(value)
            value = float(value) if ok else value
        if not ok:
            raise WireError(f"{what}: field {name!r} has the wrong type or value ({value!r}).")
        out[name] = value
    return out


def rule_from_wire(data: Any) -> UpdateRule:
    if not isinstance(data, dict) or data.get("name") not in _RULES:
        raise WireError(f"Unknown update rule {data!r}; the server knows {', '.join(_RULES)}.")
    cls = _RULES[data["name"]]
    return cls(**_typed_fields(cls, {k: v for k, v in data.items() if k != "name"}, f"rule {data['name']!r}"))


def shard_to_wire(spec: ShardSpec) -> dict[str, Any]:
    """A shard as ``Open`` sends it: its size, its rule, and its state format where that is not fp32."""
    fmt = {"state_format": spec.state_format} if spec.state_format != "fp32" else {}
    return {"numel": spec.numel, "rule": rule_to_wire(spec.rule), **fmt}


def shard_from_wire(index: int, data: dict[str, Any]) -> ShardSpec:
    """Shard ``index`` of an ``Open`` (its ``numel`` already checked by the caller): a known rule, and a state format
    this server holds that the rule can take."""
    rule, fmt = rule_from_wire(data.get("rule")), data.get("state_format", "fp32")
    if fmt not in FORMATS:
        raise WireError(f"shard {index}: unknown state format {fmt!r}; the server knows {', '.join(FORMATS)}.")
    try:
        check_format_for_rule(fmt, rule)
    except ValueError as exc:
        raise WireError(f"shard {index}: {exc}") from None
    return ShardSpec(index=index, numel=data["numel"], rule=rule, state_format=fmt)


def hp_to_wire(hp: StepParams) -> dict[str, Any]:
    return {**dataclasses.asdict(hp), "betas": list(hp.betas)}


def hp_from_wire(data: Any) -> StepParams:
    """Step hyperparameters, typed and in range (what ``torch.optim`` accepts): a session never updates its state
    with values that fail it inside a worker or write NaN into it."""
    if not isinstance(data, dict):
        raise WireError(f"Step hyperparameters must be an object, got {data!r}.")
    hp = StepParams(**_typed_fields(StepParams, data, "step hyperparameters"))
    problems = []
    if hp.step < 1:
        problems.append(f"step={hp.step} (steps count from 1)")
    if len(hp.betas) != 2 or not all(0.0 <= beta < 1.0 for beta in hp.betas):
        problems.append(f"betas={list(hp.betas)} (two values in [0, 1))")
    for name in ("lr", "eps", "weight_decay", "momentum", "lr_decay"):
        if getattr(hp, name) < 0.0:
            problems.append(f"{name}={getattr(hp, name)} (at least 0)")
    if not 0.0 <= hp.dampening <= 1.0:
        problems.append(f"dampening={hp.dampening} (in [0, 1])")
    if hp.grad_scale <= 0.0:
        problems.append(f"grad_scale={hp.grad_scale} (positive)")
    if problems:
        raise WireError(f"Step hyperparameters out of range: {'; '.join(problems)}.")
    return hp
