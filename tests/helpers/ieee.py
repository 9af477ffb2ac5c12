"""Correctly rounded ``sqrt`` for reference computations compared bitwise with the HLS kernels.

The kernels' sqrt is IEEE-754 (correctly rounded); torch's vectorised CPU sqrt is 1 ulp off on some builds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import numpy as np
import torch


def _torch_sqrt_is_ieee() -> bool:
    probe = torch.ldexp(
        torch.rand(1 << 16, generator=torch.Generator().manual_seed(0)) + 0.5,
        torch.randint(-60, 60, (1 << 16,), generator=torch.Generator().manual_seed(1)),
    )
    return torch.equal(probe.sqrt(), torch.from_numpy(np.sqrt(probe.numpy())))


TORCH_SQRT_IS_IEEE = _torch_sqrt_is_ieee()


@contextlib.contextmanager
def ieee_sqrt() -> Iterator[None]:
    """Make ``Tensor.sqrt``/``sqrt_`` correctly rounded (numpy's float32 sqrt is IEEE-754), as the kernels' is."""

    def sqrt(self: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.sqrt(self.detach().contiguous().numpy()))

    def sqrt_(self: torch.Tensor) -> torch.Tensor:
        return self.copy_(sqrt(self))

    with mock.patch.object(torch.Tensor, "sqrt", sqrt), mock.patch.object(torch.Tensor, "sqrt_", sqrt_):
        yield
