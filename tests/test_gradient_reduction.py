"""The reduced gradient partitions and their norms against stock ZeRO-3's: the float64 norm in one pass on a host
(``core/float64_norm.py``) and the reduce-scatter over one rank, which is the gradients themselves."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from helpers.models import LMModule, TinyGPT, adamw_factory, assert_identical, fit

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.core.float64_norm import HOST_PIECE, LANES, PartitionNorm, lane_sums
from lightning_smartinf.core.native import sum_squares_kernels
from lightning_smartinf.lightning.cpu_support import DeepSpeedCPUStrategy
from lightning_smartinf.zero.linear import (
    LinearIntoGradientBuffer,
    ZeroLinear,
    offer_gradient_buffer,
    withdraw_gradient_buffer,
)
from lightning_smartinf.zero.optimizer import SmartUpdateZeroOptimizer

#: Both sum exact float64 squares in float64 and differ from the exact norm only by the additions' rounding: ours
#: measured within 1e-15 of it here, ZeRO's own (a float64 copy, then ``norm``) within 5e-14. A float32 sum is ~1e-7.
TOLERANCE = 1e-13


def exact_norm(values: torch.Tensor) -> float:
    """The norm with the squares summed exactly (``math.fsum``), rounded once."""
    wide = values.detach().reshape(-1).to(torch.float64)
    return math.sqrt(math.fsum((wide * wide).tolist()))


def zero_norm(values: torch.Tensor) -> float:
    """ZeRO-3's ``_constant_buffered_norm2`` for a partition under 250M elements: a float64 copy, then its norm."""
    return float(values.to(torch.float64).norm(2))


def heavy_tailed(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=generator) * torch.rand(numel, generator=generator) ** 8
    return values.to(dtype)


def test_the_kernels_build_here():
    # Set-up builds them; without them every host norm takes the (slower) reference, which a skip would hide.
    assert sum_squares_kernels() is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("numel", [1, 7, 1000, HOST_PIECE - 1, HOST_PIECE, HOST_PIECE + 1, 3 * HOST_PIECE + 7])
def test_norm_is_the_exact_one_to_float64_rounding_as_zeros_is(dtype, numel):
    values = heavy_tailed(numel, dtype)
    norm = PartitionNorm()(values)
    assert norm.dtype == torch.float64 and norm.dim() == 0 and norm.device == values.device
    assert math.isclose(float(norm), exact_norm(values), rel_tol=TOLERANCE)
    assert math.isclose(zero_norm(values), exact_norm(values), rel_tol=TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "numel", [0, 1, LANES - 1, LANES, LANES + 1, 31, 32, 33, 41, 1000, HOST_PIECE + 3, 2 * HOST_PIECE + 9]
)  # the kernel's blocks are 32 elements, then lanes of 8, then the tail
def test_kernel_gives_the_references_bytes(dtype, numel):
    values = heavy_tailed(numel, dtype, seed=numel)
    if numel > LANES + 1:
        values[LANES + 1] = 0.0
        values[-1] = torch.finfo(dtype).max  # the largest square, exact in float64
    assert torch.equal(PartitionNorm()(values), PartitionNorm(native=False)(values))


def test_reference_adds_each_lane_in_the_elements_order():
    values = torch.tensor([1.0, 2.0, 3.0] + [0.0] * (LANES - 3) + [1e-8, 1e8], dtype=torch.float64)
    lanes = lane_sums(values, torch.zeros(LANES, dtype=torch.float64))
    expected = [1.0 + 1e-16, 4.0 + 1e16, 9.0] + [0.0] * (LANES - 3)
    assert lanes.tolist() == expected
    # Chained over pieces, a lane goes on from where the last piece left it.
    assert torch.equal(
        lane_sums(values[LANES:], lane_sums(values[:LANES], torch.zeros(LANES, dtype=torch.float64))), lanes
    )


def test_one_instance_takes_many_norms_of_any_size():
    norm = PartitionNorm()
    for numel, seed in [(5 * HOST_PIECE, 1), (3, 2), (HOST_PIECE + 1, 3), (0, 4), (2 * HOST_PIECE, 5)]:
        values = heavy_tailed(numel, torch.float32, seed)
        assert math.isclose(float(norm(values)), exact_norm(values), rel_tol=TOLERANCE)


def test_empty_partition_has_norm_zero():
    assert float(PartitionNorm()(torch.empty(0))) == 0.0


def test_a_non_contiguous_tensor_is_read_in_its_logical_order():
    matrix = heavy_tailed(700 * 900, torch.float32).view(700, 900)
    assert math.isclose(float(PartitionNorm()(matrix.t())), exact_norm(matrix), rel_tol=TOLERANCE)


@pytest.mark.parametrize(("bad", "expected"), [(math.inf, math.inf), (-math.inf, math.inf), (math.nan, math.nan)])
def test_a_non_finite_element_reaches_the_overflow_check(bad, expected):
    values = heavy_tailed(2 * HOST_PIECE + 3, torch.float32)
    values[HOST_PIECE + 1] = bad  # in the second piece: a later finite piece must not hide it
    norm = float(PartitionNorm()(values))
    assert norm == expected or (math.isnan(expected) and math.isnan(norm))


def test_squares_beyond_float32_do_not_overflow():
    # 3e38 squared is 9e76: infinite in float32, exact in float64. Equal squares are sequential summation's worst
    # case: each lane's running sum may be off by one rounding per addition, (numel / LANES) * 2**-53 in all.
    values = torch.full((HOST_PIECE + 5,), 3e38, dtype=torch.float32)
    bound = values.numel() / LANES * 2.0**-53
    assert math.isclose(float(PartitionNorm()(values)), exact_norm(values), rel_tol=bound)


class GradNorms(L.Callback):
    """ZeRO's global gradient norm (before clipping) after each optimizer step."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.norms.append(float(trainer.strategy.deepspeed_engine.optimizer._global_grad_norm))


def test_the_strategy_clips_by_the_norm_stock_zero_takes(tmp_path):
    """Same model, batch and parameters: our first step's global norm is stock ZeRO-3's, to float32 rounding."""
    ours, stock = GradNorms(), GradNorms()
    strategy = SmartInfinityStrategy(storage_paths=[tmp_path], sub_group_size=3000)
    fit(LMModule(adamw_factory()), strategy, steps=1, clip=1e-3, callbacks=[ours])

    def host_adamw(model):
        return DeepSpeedCPUAdam(model.parameters(), lr=3e-3, adamw_mode=True), None

    baseline = DeepSpeedCPUStrategy(stage=3, offload_optimizer=True, offload_parameters=True)
    fit(LMModule(host_adamw), baseline, steps=1, clip=1e-3, callbacks=[stock])
    assert len(ours.norms) == len(stock.norms) == 1
    assert ours.norms[0] > 1e-3  # the clip fired: the norm was used
    assert math.isclose(ours.norms[0], stock.norms[0], rel_tol=1e-6), (ours.norms, stock.norms)


class CompareReduceScatter(L.Callback):
    """During training (the process group live), reduces made-up gradients of some parameters both ways."""

    def __init__(self, communication_dtype: torch.dtype) -> None:
        self.communication_dtype = communication_dtype
        self.compared = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        optimizer = trainer.strategy.deepspeed_engine.optimizer
        params = [p for group in optimizer.fp16_groups for p in group][:4]
        generator = torch.Generator().manual_seed(batch_idx)
        for p in params:
            p.grad = torch.randn(p.ds_shape, generator=generator).to(p.dtype)
        expected = [p.grad.clone() for p in params]
        ours = optimizer._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads(params, self.communication_dtype)
        ours = [t.clone() for t in ours]  # ZeRO's in-place division by one may write where ours point
        stock = DeepSpeedZeroOptimizer_Stage3._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads(
            optimizer, params, self.communication_dtype
        )
        for p, grad, mine, theirs in zip(params, expected, ours, stock, strict=True):
            assert mine.dtype == theirs.dtype == optimizer.gradient_accumulation_dtype
            assert mine.shape == theirs.shape == (p.ds_numel,)
            assert torch.equal(mine, theirs)
            assert torch.equal(mine, grad.reshape(-1).to(self.communication_dtype).to(mine.dtype))
            p.grad = None
        self.compared += len(params)


@pytest.mark.parametrize("communication_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_one_rank_reduce_scatter_returns_zeros_values_without_its_passes(tmp_path, communication_dtype):
    probe = CompareReduceScatter(communication_dtype)
    strategy = SmartInfinityStrategy(storage_paths=[tmp_path], sub_group_size=3000)
    fit(LMModule(adamw_factory()), strategy, steps=2, precision="bf16-mixed", callbacks=[probe])
    assert probe.compared == 8


class WatchBucket(L.Callback):
    """Records, for every gradient ZeRO adds to its bucket during training, whether it stayed where autograd put it
    (the hook wrapped on the optimizer instance, where ZeRO's own call finds it)."""

    def __init__(self) -> None:
        self.stayed: list[bool] = []

    def on_train_start(self, trainer, pl_module) -> None:
        optimizer = trainer.strategy.deepspeed_engine.optimizer
        add = optimizer._DeepSpeedZeroOptimizer_Stage3__add_grad_to_ipg_bucket

        def watched(param) -> None:
            before = param.grad.data_ptr()
            add(param)
            self.stayed.append(param.grad.data_ptr() == before)

        optimizer._DeepSpeedZeroOptimizer_Stage3__add_grad_to_ipg_bucket = watched


@pytest.mark.parametrize("reduce_scatter", [True, False], ids=["reduce_scatter", "contiguous_reduce"])
@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_one_host_rank_reduces_gradients_where_autograd_left_them(tmp_path, monkeypatch, reduce_scatter, precision):
    """Over one rank on a host, ZeRO's bucket serves no collective: no gradient is copied into it, and training (two
    micro-batches a step, so accumulation reads them too) ends bit for bit where ZeRO's copying path ends."""

    def run(directory, watch):
        strategy = SmartInfinityStrategy(
            storage_paths=[directory],
            sub_group_size=3000,
            config={"zero_optimization": {"reduce_scatter": reduce_scatter}},
        )
        _, params = fit(
            LMModule(adamw_factory()), strategy, steps=3, accumulate=2, precision=precision, callbacks=[watch]
        )
        return params

    ours = WatchBucket()
    mine = run(tmp_path / "ours", ours)
    monkeypatch.setattr(SmartUpdateZeroOptimizer, "_gradients_stay_put", lambda self, params: False)
    zeros = WatchBucket()
    theirs = run(tmp_path / "zero", zeros)
    assert ours.stayed and all(ours.stayed), "a gradient was copied into ZeRO's bucket"
    assert zeros.stayed and not any(zeros.stayed), "ZeRO's path no longer copies: the comparison proves nothing"
    assert_identical(mine, theirs)


class WatchDestinations(L.Callback):
    """Counts the weight-gradient places the optimizer hands out (wrapped on the instance, which the offer calls),
    and records, for every gradient ZeRO partitions at the first micro-batch, whether it already lay in its place in
    the gradient buffer."""

    def __init__(self) -> None:
        self.handed_out = 0
        self.in_place: list[bool] = []

    def on_train_start(self, trainer, pl_module) -> None:
        optimizer = trainer.strategy.deepspeed_engine.optimizer
        destination, partition = optimizer.gradient_destination, optimizer.partition_grads
        views = optimizer._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition

        def counted(param, dtype, device):
            place = destination(param, dtype, device)
            self.handed_out += place is not None
            return place

        def watched(params, grads):
            if optimizer.micro_step_id == 0:
                self.in_place += [g.data_ptr() == views[p.ds_id].data_ptr() for p, g in zip(params, grads)]
            return partition(params, grads)

        optimizer.gradient_destination, optimizer.partition_grads = counted, watched


class TiedAndTwice(TinyGPT):
    """TinyGPT with the output head tied to the embedding (its weight gets two gradients: the head's product and the
    embedding's scatter) and one projection applied twice (two products for one weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.blocks(self.embed(tokens) + self.pos[: tokens.shape[1]])
        proj = self.blocks[0].proj
        hidden = hidden + proj(torch.tanh(proj(hidden)))
        return self.head(self.norm(hidden))


class TiedModule(LMModule):
    def __init__(self) -> None:
        super().__init__(adamw_factory())
        torch.manual_seed(0)
        self.model = TiedAndTwice()


@pytest.mark.parametrize(
    ("precision", "accumulate", "model"),
    [("bf16-mixed", 1, "gpt"), ("32-true", 1, "gpt"), ("32-true", 2, "gpt"), ("bf16-mixed", 1, "tied_and_twice")],
)
def test_linear_weight_gradients_are_computed_in_the_gradient_buffer(
    tmp_path, monkeypatch, precision, accumulate, model
):
    """Over one host rank each linear weight's gradient of a step's first micro-batch is computed in its place in
    ZeRO's gradient buffer, once per weight even where the weight has several gradients (tied to the embedding, or
    applied twice), and training ends bit for bit where computing it in a tensor of its own and copying it ends."""

    def run(directory):
        watch = WatchDestinations()
        strategy = SmartInfinityStrategy(storage_paths=[directory], sub_group_size=3000)
        module = TiedModule() if model == "tied_and_twice" else LMModule(adamw_factory())
        _, params = fit(module, strategy, steps=3, accumulate=accumulate, precision=precision, callbacks=[watch])
        return watch, params

    ours, mine = run(tmp_path / "ours")
    monkeypatch.setattr(SmartUpdateZeroOptimizer, "gradient_destination", lambda self, param, dtype, device: None)
    zeros, theirs = run(tmp_path / "copied")
    linears = 13  # 2 blocks of 6, and the head (tied: the embedding's weight, still one linear weight)
    assert ours.handed_out == 3 * linears, "one place per linear weight and step"
    assert zeros.handed_out == 0 and not any(zeros.in_place), "the comparison's path computes no gradient in place"
    summed = 0 if model == "gpt" else 2  # the weights whose place autograd may have added another gradient to
    assert sum(ours.in_place) >= 3 * (linears - summed), "a gradient computed in place was moved"
    assert_identical(mine, theirs)


@pytest.mark.parametrize("offered", [True, False], ids=["offered", "not_offered"])
@pytest.mark.parametrize("shape", [(5, 8), (3, 5, 8)], ids=["2d", "3d"])
def test_the_linear_function_computes_an_offered_gradient_in_its_place(offered, shape):
    """ZeRO's linear function with a place offered for its weight's gradient: the gradient is computed there (autograd
    then hands that very tensor to ``weight.grad``), to the bit what ZeRO's own backward computes; each saved tensor
    is unpacked once either way (activation offload frees it at its first unpacking)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator).to(torch.bfloat16).requires_grad_()
    weight = torch.nn.Parameter(torch.randn(6, 8, generator=generator).to(torch.bfloat16))
    bias = torch.nn.Parameter(torch.randn(6, generator=generator).to(torch.bfloat16))
    place = torch.full((6, 8), float("nan"), dtype=torch.bfloat16)
    handed: list[tuple] = []

    def destination(param, dtype, device):
        handed.append((param, dtype, device))
        return place.view(6, 8)  # a view of its own, as the optimizer hands out: autograd takes it as the gradient

    def reference(function):
        inputs = [t.detach().clone().requires_grad_() for t in (x, weight, bias)]
        function.apply(*inputs).float().square().sum().backward()
        return [t.grad for t in inputs]

    unpacked: list[int] = []

    def unpack_once(saved):
        assert id(saved) not in unpacked, "a saved tensor unpacked twice"
        unpacked.append(id(saved))
        return saved

    if offered:
        offer_gradient_buffer([weight], destination)
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack_once):
            LinearIntoGradientBuffer.apply(x, weight, bias).float().square().sum().backward()
    finally:
        withdraw_gradient_buffer([weight], destination)
    expected = reference(ZeroLinear)
    assert [torch.equal(a, b) for a, b in zip((x.grad, weight.grad, bias.grad), expected)] == [True] * 3
    assert (weight.grad.data_ptr() == place.data_ptr()) is offered
    assert handed == ([(weight, torch.bfloat16, x.device)] if offered else [])
    assert len(unpacked) == len(set(unpacked)) > 0


def test_an_offer_is_withdrawn_only_by_whoever_made_it():
    weight = torch.nn.Parameter(torch.zeros(2, 2))
    first, second = torch.zeros(2, 2), torch.ones(2, 2)

    def first_offer(param, dtype, device):
        return first.view(2, 2)

    def second_offer(param, dtype, device):
        return second.view(2, 2)

    offer_gradient_buffer([weight], first_offer)
    offer_gradient_buffer([weight], second_offer)  # a later engine over the same model
    withdraw_gradient_buffer([weight], first_offer)  # the earlier one's teardown
    x = torch.ones(1, 2)
    LinearIntoGradientBuffer.apply(x, weight, None).sum().backward()
    assert weight.grad.data_ptr() == second.data_ptr()
    withdraw_gradient_buffer([weight], second_offer)
    weight.grad = None
    LinearIntoGradientBuffer.apply(x, weight, None).sum().backward()
    assert weight.grad.data_ptr() not in (first.data_ptr(), second.data_ptr())
