"""The remote protocol's frames: tensors survive the trip exactly, and anything else is refused with a reason."""

from __future__ import annotations

import pytest
import torch

from lightning_smartinf.core.rules import SGD, Adagrad, Adam, StepParams
from lightning_smartinf.devices.remote.wire import (
    MAX_HEADER_BYTES,
    Frame,
    TensorReader,
    WireError,
    decode_header,
    encode_tensor,
    header_frame,
    hp_from_wire,
    hp_to_wire,
    rule_from_wire,
    rule_to_wire,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32])
def test_tensors_cross_in_bounded_chunks_bit_exact(dtype) -> None:
    tensor = (torch.randn(100_003) * 1000).to(dtype)
    frames = list(encode_tensor("t", tensor, chunk_bytes=4096))
    assert all(len(f.data) <= 4096 for f in frames) and len(frames) > 1
    reader = TensorReader("t", max_numel=tensor.numel())
    done = [reader.add(Frame.FromString(f.SerializeToString())) for f in frames]
    assert done[-1] and not any(done[:-1])
    assert torch.equal(reader.tensor.view(torch.uint8), tensor.view(torch.uint8))


def test_empty_tensor() -> None:
    reader = TensorReader("t", max_numel=10)
    assert [reader.add(f) for f in encode_tensor("t", torch.empty(0))] == [True]


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (Frame(tensor="other", dtype="float32", numel=4, data=bytes(16)), "Expected a chunk of 't'"),
        (Frame(tensor="t", dtype="complex64", numel=4, data=bytes(16)), "Unknown dtype 'complex64'"),
        (Frame(tensor="t", dtype="float32", numel=10**12, data=b""), "at most 100 allowed"),
        (Frame(tensor="t", dtype="float32", numel=4, offset=2, data=bytes(8)), "starts at 2, expected 0"),
        (Frame(tensor="t", dtype="float32", numel=4, data=bytes(15)), "does not fit"),
        (Frame(tensor="t", dtype="float32", numel=4, data=bytes(20)), "does not fit"),
        (Frame(tensor="t", dtype="int64", numel=4, data=bytes(32)), "may not be int64"),
    ],
)
def test_malformed_tensor_frames_are_refused(frame, message) -> None:
    reader = TensorReader("t", max_numel=100, dtypes=(torch.float32, torch.int32))
    with pytest.raises(WireError, match=message):
        reader.add(frame)


def test_a_chunk_may_not_change_the_tensor_mid_stream() -> None:
    reader = TensorReader("t", max_numel=100)
    reader.add(Frame(tensor="t", dtype="float32", numel=8, data=bytes(16)))
    with pytest.raises(WireError, match="changes its dtype or size"):
        reader.add(Frame(tensor="t", dtype="float32", numel=9, offset=4, data=bytes(16)))


def test_headers() -> None:
    assert decode_header(header_frame(a=1, b=[1, 2]), ("a",)) == {"a": 1, "b": [1, 2]}
    with pytest.raises(WireError, match="lacks 'c'"):
        decode_header(header_frame(a=1), ("c",))
    with pytest.raises(WireError, match="not JSON"):
        decode_header(Frame(header="{"))
    with pytest.raises(WireError, match="must be a JSON object"):
        decode_header(Frame(header="[1]"))
    with pytest.raises(WireError, match="exceeds the limit"):
        header_frame(blob="x" * MAX_HEADER_BYTES)


@pytest.mark.parametrize("rule", [Adam(), Adam(decoupled_weight_decay=True, amsgrad=True), SGD(False), Adagrad(0.3)])
def test_rules_round_trip(rule) -> None:
    assert rule_from_wire(rule_to_wire(rule)) == rule


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"name": "lion"}, "Unknown update rule"),
        ("adam", "Unknown update rule"),
        ({"name": "adam", "amsgrad": 1}, "field 'amsgrad' has the wrong type"),
        ({"name": "adam", "__class__": "x"}, "unknown fields"),
        ({"name": "adagrad", "initial_accumulator_value": float("nan")}, "wrong type or value"),
    ],
)
def test_bad_rules_are_refused(data, message) -> None:
    with pytest.raises(WireError, match=message):
        rule_from_wire(data)


def test_step_hyperparameters_round_trip_and_are_checked() -> None:
    hp = StepParams(step=7, lr=3e-4, grad_scale=0.5, betas=(0.9, 0.95), nesterov=True, maximize=False)
    assert hp_from_wire(hp_to_wire(hp)) == hp
    with pytest.raises(WireError, match="field 'step'"):
        hp_from_wire({**hp_to_wire(hp), "step": 1.5})
    with pytest.raises(WireError, match="field 'lr'"):
        hp_from_wire({**hp_to_wire(hp), "lr": "0.1"})
    with pytest.raises(WireError, match="field 'betas'"):
        hp_from_wire({**hp_to_wire(hp), "betas": [0.9, None]})
