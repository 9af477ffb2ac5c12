"""The host side of :mod:`lightning_smartinf.core.accelerator`: what a machine without CUDA runs (``tests/cuda``
covers the CUDA copies)."""

from __future__ import annotations

import pytest
import torch

from lightning_smartinf.core.accelerator import AcceleratorCopies, on_cuda, record_fence


def test_host_tensors_cross_directly() -> None:
    link = AcceleratorCopies()
    src = torch.randn(1000)
    assert link.to_host(src) is src  # no staging copy of what already is host memory
    out = torch.empty(1000, dtype=torch.bfloat16)
    link.put(out, src)
    link.settle()
    assert torch.equal(out, src.to(torch.bfloat16))  # rounded to nearest even, like every link transfer
    assert not on_cuda(out)


def test_no_fence_without_cuda_work() -> None:
    assert record_fence("cpu") is None
    if not torch.cuda.is_available():
        assert record_fence() is None


@pytest.mark.parametrize("slots", [0, -1])
def test_slots_are_checked(slots) -> None:
    with pytest.raises(ValueError, match=rf"`slots={slots}` must be at least 1"):
        AcceleratorCopies(slots=slots)
