"""The host's tensors in a checkpoint (``residual.safetensors``): written a block at a time, read a range at a time,
and readable by the safetensors library both ways."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from lightning_smartinf.core.format.rank_state import HOST_DTYPES, read_host_tensors
from lightning_smartinf.core.format.safetensors_stream import BLOCK_BYTES, safetensors_blocks
from lightning_smartinf.core.format.state_files import CheckpointError, write_file_atomic
from lightning_smartinf.core.host_buffer import InMemoryBuffer

TENSORS = {
    "residual": torch.randn(BLOCK_BYTES // 4 * 2 + 123, generator=torch.Generator().manual_seed(0)),
    "moments": torch.randn(7, 5, dtype=torch.float32),
    "half": torch.randn(33, dtype=torch.bfloat16),
    "counts": torch.arange(6, dtype=torch.int64).view(2, 3),
    "empty": torch.empty(0, 4),
}


class Released(InMemoryBuffer):
    """An in-memory buffer that records what the writer releases."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__(tensor)
        object.__setattr__(self, "released", [])

    def release(self, start: int = 0, end: int | None = None) -> None:
        self.released.append((start, end))


def test_the_blocks_are_a_safetensors_file_and_a_host_buffer_is_released_block_by_block(tmp_path) -> None:
    buffer = Released(TENSORS["residual"])
    path = tmp_path / "residual.safetensors"
    write_file_atomic(path, safetensors_blocks({**TENSORS, "residual": buffer}))
    loaded = load_file(str(path))
    assert loaded.keys() == TENSORS.keys()
    for name, tensor in TENSORS.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    n = TENSORS["residual"].numel()
    step = BLOCK_BYTES // 4
    assert buffer.released == [(0, step), (step, 2 * step), (2 * step, n)]
    (length,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert length % 8 == 0


def test_a_file_written_by_the_library_is_read_range_by_range(tmp_path) -> None:
    path = tmp_path / "residual.safetensors"
    save_file(TENSORS, str(path), metadata={"by": "safetensors"})
    saved = read_host_tensors(path)
    assert saved.keys() == TENSORS.keys()
    for name, tensor in TENSORS.items():
        assert saved[name].shape == tuple(tensor.shape) and saved[name].numel() == tensor.numel()
        assert torch.equal(saved[name].load(), tensor), name
    flat = TENSORS["residual"]
    assert torch.equal(saved["residual"].read(5, 1000), flat[5:1000])
    assert torch.equal(saved["residual"].read(flat.numel() - 3), flat[-3:])
    assert saved["residual"].read(10, 10).numel() == 0


@pytest.mark.parametrize(
    "header, why",
    [
        ({"r": {"dtype": "F64", "shape": [2], "data_offsets": [0, 16]}}, "F64"),
        ({"r": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, "fit its shape"),
        ({"r": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, "does not follow byte 0"),
        ({"r": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, "end at byte"),
        ({"r": {"shape": [2], "data_offsets": [0, 8]}}, "dtype"),
        ([1, 2], "items"),
    ],
)
def test_a_header_that_does_not_describe_the_file_is_a_checkpoint_error(tmp_path, header, why) -> None:
    encoded = json.dumps(header).encode()
    path = tmp_path / "residual.safetensors"
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + bytes(8))
    with pytest.raises(CheckpointError, match=rf"is not a safetensors file of the host's tensors \(.*{why}"):
        read_host_tensors(path)


def test_a_header_longer_than_the_file_is_a_checkpoint_error(tmp_path) -> None:
    path = tmp_path / "residual.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(CheckpointError, match="a header of 1099511627776 bytes in a file of 10"):
        read_host_tensors(path)


def test_a_dtype_the_host_does_not_save_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"Cannot save 'x' of dtype torch.float64"):
        list(safetensors_blocks({"x": torch.zeros(2, dtype=torch.float64)}, HOST_DTYPES))
