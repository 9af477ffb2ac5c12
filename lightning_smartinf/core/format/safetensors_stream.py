"""safetensors files written and read a block or a tensor at a time, with plain reads and writes: never mapped.

The layout is the format's documented one: an 8-byte little-endian header length, a JSON header of
``{name: {"dtype", "shape", "data_offsets": [begin, end]}}`` (and an optional ``__metadata__``), then the data, which
the tensors tile without holes.

Written by hand for memory, not for the format: ``safetensors.torch.save`` copies every tensor into one ``bytes``
object first, and ``safetensors.safe_open`` maps the file, so every page a read touches stays in the process until
the file is closed (a 5 GB shard read tensor by tensor grows the process by 5 GB). Here the process holds at most a
block being written or the tensor being read; the file's pages stay in the kernel's page cache, which it can evict.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_smartinf.core.host_buffer import HostBuffer

#: safetensors' dtype names (the format's header) and the torch dtypes they hold.
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
CODES = {dtype: code for code, dtype in DTYPES.items()}
#: The largest header a safetensors file may have (the format's own bound).
MAX_HEADER_BYTES = 100_000_000
#: Bytes of a tensor written at a time.
BLOCK_BYTES = 64 << 20


def safetensors_blocks(
    tensors: Mapping[str, Tensor | HostBuffer],
    dtypes: Collection[torch.dtype] = tuple(CODES),
    metadata: Mapping[str, str] | None = None,
) -> Iterator[bytes | memoryview]:
    """``tensors`` (and the header's ``__metadata__``, if given) in the safetensors format, a block at a time: the
    header, then each tensor's bytes in order. A :class:`HostBuffer`'s blocks are released once written (see
    ``host_buffer.py``).

    Raises:
        TypeError: a tensor's dtype is not one of ``dtypes``.
    """
    flats: dict[str, Tensor] = {}
    header: dict[str, Any] = {} if metadata is None else {"__metadata__": dict(metadata)}
    offset = 0
    for name, value in tensors.items():
        tensor = (value if isinstance(value, Tensor) else value.tensor).detach().cpu().contiguous()
        if tensor.dtype not in dtypes:
            raise TypeError(f"Cannot save {name!r} of dtype {tensor.dtype}: the host saves {list(dtypes)}.")
        flats[name] = tensor.reshape(-1).view(torch.uint8)
        nbytes = flats[name].numel()
        header[name] = {
            "dtype": CODES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    yield struct.pack("<Q", len(encoded)) + encoded
    for name, value in tensors.items():
        flat = flats[name]
        for start in range(0, flat.numel(), BLOCK_BYTES):
            end = min(start + BLOCK_BYTES, flat.numel())
            yield flat[start:end].numpy().data
            if not isinstance(value, Tensor):
                size = value.tensor.element_size()
                value.release(start // size, -(-end // size))


@dataclass(frozen=True)
class SavedTensor:
    """One tensor of a safetensors file, read from the file when asked."""

    path: Path
    #: Where its bytes start in the file.
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    def numel(self) -> int:
        """Its number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Its size in the file."""
        return self.numel() * self.dtype.itemsize

    def read(self, start: int = 0, end: int | None = None) -> Tensor:
        """Elements ``[start, end)`` (default: all) of the flattened tensor, read from the file into a new tensor.

        Raises:
            ValueError: the file ended before them (it changed since its header was read).
        """
        end = self.numel() if end is None else end
        # Bytes first: DeepSpeed's ZeRO-3 construction context casts new floating-point tensors to its own dtype.
        raw = torch.empty(max(0, end - start) * self.dtype.itemsize, dtype=torch.uint8)
        view = memoryview(raw.numpy())
        with open(self.path, "rb", buffering=0) as file:
            file.seek(self.offset + start * self.dtype.itemsize)
            done = 0
            while done < len(view):
                got = file.readinto(view[done:])
                if not got:
                    raise ValueError(f"{self.path} ended before the tensor it describes: the file changed.")
                done += got
        return raw.view(self.dtype)

    def load(self) -> Tensor:
        """The whole tensor."""
        return self.read().view(self.shape)


def read_safetensors_header(path: Path, dtypes: Collection[torch.dtype] = tuple(CODES)) -> dict[str, SavedTensor]:
    """The tensors of the safetensors file at ``path``, by name in the file's order, each read when asked.

    Raises:
        ValueError: saying why the file is not a safetensors file of ``dtypes`` whose tensors tile it; the caller
            names the file's role in its own message.
    """
    size = path.stat().st_size
    try:
        with open(path, "rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            if not 2 <= length <= min(MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"a header of {length} bytes in a file of {size}")
            header = json.loads(file.read(length))
        tensors: dict[str, SavedTensor] = {}
        end = 0
        for name, info in sorted(
            ((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][0]
        ):
            start, stop = (int(x) for x in info["data_offsets"])
            shape = tuple(int(n) for n in info["shape"])
            dtype = DTYPES.get(info["dtype"])
            if dtype not in dtypes:
                raise ValueError(f"{name!r} has dtype {info['dtype']!r}; this reader takes {list(dtypes)}")
            if start != end or stop - start != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"{name!r} at bytes {start}..{stop} does not follow byte {end} or fit its shape")
            tensors[name] = SavedTensor(path, 8 + length + start, dtype, shape)
            end = stop
        if 8 + length + end != size:
            raise ValueError(f"the tensors end at byte {8 + length + end} of {size}")
    except (ValueError, KeyError, TypeError, AttributeError, struct.error) as exc:
        raise ValueError(str(exc) or repr(exc)) from None
    return tensors
