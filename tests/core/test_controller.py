"""The ``SmartUpdate`` controller on its own: no DeepSpeed, no Lightning, a real ``CpuBackend`` on real files.

``FlatPartitions`` is the smallest engine the controller can drive: one flat fp16 parameter buffer and one flat
gradient buffer, as ZeRO-3 keeps them for one rank. It implements the ``Partitions`` protocol in plain tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_smartinf.core.controller import SmartUpdateController, SubGroup
from lightning_smartinf.core.settings import SmartUpdateSettings
from lightning_smartinf.devices.cpu import CpuBackend
from tests.core.backends import FlatPartitions

SEGMENT = 200  # elements per parameter: top-1% keeps 2 of each


def _controller(tmp_path, sizes: list[int], **settings: Any) -> tuple[SmartUpdateController, FlatPartitions]:
    partitions = FlatPartitions(sizes, torch.float16, loss_scale=65536.0)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    backend = CpuBackend([tmp_path / "dev0"], chunk_elems=1024, buffer_count=3)
    sub_groups = [SubGroup(numel=n, param_group=0, segments=(SEGMENT,) * (n // SEGMENT)) for n in sizes]
    smart_update = SmartUpdateController(SmartUpdateSettings(**settings), backend, optimizer, sub_groups, partitions)
    for i, n in enumerate(sizes):
        smart_update.initialize(i, torch.zeros(n))
    backend.wait()
    return smart_update, partitions


def test_fp16_error_feedback_overflow_skips_the_step_instead_of_sending_inf(tmp_path) -> None:
    """Issue 23, item 1. An entry never among the top 1% builds up in the fp32 residual, in loss-scaled units, past
    fp16's 65504. Sending it would put inf on the link and -inf in the residual for good, and inf into the master
    weights on the device. The engine must see it as an overflow, skip the step, halve the loss scale (which halves
    the residual), and go on with finite state."""
    smart_update, partitions = _controller(tmp_path, [SEGMENT], compression={"ratio": 0.01, "layerwise": True})
    skipped = 0
    for step in range(8):
        scale = partitions.loss_scale
        grad = torch.zeros(SEGMENT)
        grad[7] = 20000.0 / 65536.0  # a steady entry, never the largest
        grad[20 + 2 * step : 22 + 2 * step] = 0.9375  # two new large entries each step (61440 scaled): always sent
        partitions.grad_buffer.copy_(grad * scale)  # what backward leaves: loss-scaled fp16 gradients
        if smart_update.link_overflows():  # what the ZeRO adapter asks before its overflow cleanup
            smart_update.skip_step()
            partitions.loss_scale = scale / 2
            skipped += 1
            continue
        smart_update.step(grad_scale=1.0 / scale)
        assert torch.isfinite(smart_update.residual).all(), f"step {step}: the residual holds inf"
    masters = torch.empty(SEGMENT)
    smart_update.backend.read_master(0, masters)
    smart_update.backend.wait()
    smart_update.backend.close()
    assert smart_update.placement == (0,)
    assert skipped == 1, "the entry's sum passes 65504 once; the halved scale keeps it in range after"
    assert torch.isfinite(masters).all() and torch.isfinite(partitions.flat_params[0]).all()
    assert masters[7] != 0, "the steady entry was delivered once it led (its update reached the master)"


class StagedPartitions(FlatPartitions):
    """Parameters that live elsewhere (on storage): :meth:`params` hands out a staging buffer, :meth:`params_changed`
    stores it and frees it; counts how many are held at once."""

    def __init__(self, sizes: list[int], dtype: torch.dtype, loss_scale: float, limit: int) -> None:
        super().__init__(sizes, dtype, loss_scale)
        self.staged_limit = limit
        self.staged: dict[int, Tensor] = {}
        self.most_staged = 0

    def params(self, sub_group: int) -> Tensor:
        if sub_group not in self.staged:
            self.staged[sub_group] = torch.full_like(self.flat_params[sub_group], float("nan"))
            self.most_staged = max(self.most_staged, len(self.staged))
        return self.staged[sub_group]

    def params_changed(self, sub_group: int) -> None:
        self.flat_params[sub_group].copy_(self.staged.pop(sub_group))


def test_staged_parameters_are_updated_a_few_sub_groups_at_a_time_with_the_same_results(tmp_path) -> None:
    """With parameters on storage the controller holds at most ``staged_limit`` sub-groups' parameters in staging
    during a step (and the same number for hand-offs, none here), in any order; the results are those of parameters
    that live in memory, bit for bit, through steps and a reload of the masters."""
    sizes = [SEGMENT * k for k in (3, 1, 4, 1, 5, 2)]
    plain, flat = _controller(tmp_path / "plain", sizes)
    staged_update, _ = _controller(tmp_path / "staged", sizes)
    staged = StagedPartitions(sizes, torch.float16, 65536.0, limit=2)
    staged_update.partitions = staged
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):
        grad = torch.randn(sum(sizes), generator=generator).to(torch.float16)
        for partitions, update in ((flat, plain), (staged, staged_update)):
            partitions.grad_buffer.copy_(grad)
            update.step(grad_scale=1e-3)
    staged_update.refresh_params()
    plain.refresh_params()
    for update in (plain, staged_update):
        update.backend.close()
    assert 1 <= staged.most_staged <= 2 and not staged.staged
    for ours, reference in zip(staged.flat_params, flat.flat_params):
        assert torch.equal(ours, reference)
    assert staged_update.last_kept == plain.last_kept == (sum(sizes), sum(sizes))
