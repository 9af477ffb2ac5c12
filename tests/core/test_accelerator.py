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


def test_a_copy_within_one_memory_has_landed_when_settle_returns(asynchronous_host) -> None:
    """A copy within the accelerator's memory is queued on the caller's stream, not done when ``put`` returns: the
    link fences it there and ``settle`` waits for that fence, as it does for a copy through staging."""
    link = AcceleratorCopies()
    dst, src = torch.empty(8, dtype=torch.bfloat16), torch.randn(8)
    link.put(dst, src)
    recorded = [event for what, event in asynchronous_host if what == "record"]
    assert recorded, "no fence after the copy within one memory"
    link.settle()
    assert ("wait", recorded[-1]) in asynchronous_host
    assert torch.equal(dst, src.to(torch.bfloat16))
