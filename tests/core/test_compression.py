"""SmartComp codec (top-k selection, error feedback) and decompression inside the ``cpu`` backend."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_smartinf.core.backend import ShardSpec
from lightning_smartinf.core.compression import (
    INDEX_DTYPE,
    SAMPLED_SELECTION_MIN_NUMEL,
    LinkOverflowError,
    SparseGrad,
    check_ratio,
    compress_topk,
    kept_count,
    link_overflows,
    topk_indices,
)
from lightning_smartinf.core.rules import SGD, Adam, StepParams
from lightning_smartinf.devices.cpu import CpuBackend

CHUNK = 4096


def _magnitudes_kept(grad: torch.Tensor, sparse: SparseGrad) -> torch.Tensor:
    return grad.abs()[sparse.indices.long()].float().sort().values


@pytest.mark.parametrize("numel", [1, 7, 1000, 4097, SAMPLED_SELECTION_MIN_NUMEL + 3, 1 << 20])
@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.3, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keeps_exactly_the_largest_entries(numel: int, ratio: float, dtype: torch.dtype) -> None:
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(numel), dtype=torch.float32).to(dtype)
    sparse = compress_topk(grad, ratio)
    k = kept_count(numel, ratio)
    assert sparse.k == k == min(numel, max(1, math.ceil(ratio * numel)))
    assert sparse.indices.dtype == INDEX_DTYPE and sparse.values.dtype == dtype
    # Strictly ascending and inside the shard: the device kernels rely on both.
    assert bool((sparse.indices[1:] > sparse.indices[:-1]).all())
    assert int(sparse.indices.min()) >= 0 and int(sparse.indices.max()) < numel
    # Kept values are the gradient's own values, bit for bit.
    assert torch.equal(sparse.values, grad[sparse.indices.long()])
    # Nothing dropped is larger than anything kept.
    expected = grad.abs().float().topk(k).values.sort().values
    assert torch.equal(_magnitudes_kept(grad, sparse), expected)


def test_round_trip_and_chunked_decompression() -> None:
    grad = torch.randn(3 * CHUNK + 5, generator=torch.Generator().manual_seed(0))
    sparse = compress_topk(grad, 0.05)
    dense = sparse.to_dense()
    mask = torch.zeros_like(grad, dtype=torch.bool)
    mask[sparse.indices.long()] = True
    assert torch.equal(dense[mask], grad[mask]) and bool((dense[~mask] == 0).all())
    # Chunk by chunk, into dirty buffers, gives the same dense gradient.
    out = torch.full((CHUNK,), 7.0)
    pieces = []
    for start in range(0, grad.numel(), CHUNK):
        n = min(CHUNK, grad.numel() - start)
        pieces.append(sparse.scatter_chunk(out[:n], start).clone())
    assert torch.equal(torch.cat(pieces), dense)


def test_all_kept_is_the_gradient() -> None:
    grad = torch.randn(1000)
    sparse = compress_topk(grad, 1.0)
    assert torch.equal(sparse.indices, torch.arange(1000, dtype=INDEX_DTYPE))
    assert torch.equal(sparse.to_dense(), grad)


def test_empty_gradient() -> None:
    sparse = compress_topk(torch.empty(0), 0.01)
    assert sparse.k == 0 and sparse.numel == 0 and sparse.link_bytes() == 0
    assert sparse.to_dense().numel() == 0
    assert topk_indices(torch.randn(10), 0).numel() == 0


def _first_largest_by_stable_sort(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """The selection spelled out: largest first (NaN above inf), equal values in position order, the first k."""
    key = magnitude.float().nan_to_num(nan=math.inf, posinf=math.inf)
    return torch.sort(-key, stable=True).indices[:k].sort().values


@pytest.mark.parametrize("numel", [10, 1000, SAMPLED_SELECTION_MIN_NUMEL + 3, 5 * SAMPLED_SELECTION_MIN_NUMEL])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nan", [False, True])
def test_ties_go_to_the_lowest_positions(numel: int, dtype: torch.dtype, nan: bool) -> None:
    """Gradients rounded to a few values tie at the threshold all the time; which of the tied entries are kept must
    not depend on the device's topk (a CPU and an H100 chose differently, and runs drifted 3% apart)."""
    magnitude = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3).round().abs().to(dtype)
    if nan:
        magnitude[:: max(1, numel // 20)] = float("nan")
    for k in sorted({1, 3, numel // 100 + 1, numel // 10, numel // 3, numel - 1}):
        assert torch.equal(topk_indices(magnitude, k), _first_largest_by_stable_sort(magnitude, k)), k


def test_non_finite_entries_are_kept_first() -> None:
    grad = torch.randn(SAMPLED_SELECTION_MIN_NUMEL * 2, generator=torch.Generator().manual_seed(1))
    grad[[5, 70_000, 100_001]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    sparse = compress_topk(grad, 0.001)
    assert {5, 70_000, 100_001} <= set(sparse.indices.tolist())
    dense = sparse.to_dense()
    assert math.isnan(dense[5]) and dense[70_000] == float("inf") and dense[100_001] == -float("inf")


def test_error_feedback_loses_nothing() -> None:
    gen = torch.Generator().manual_seed(2)
    residual = torch.zeros(5000)
    total_in, total_sent = torch.zeros(5000, dtype=torch.float64), torch.zeros(5000, dtype=torch.float64)
    for _ in range(20):
        grad = torch.randn(5000, generator=gen)
        before = residual.clone()
        sparse = compress_topk(grad, 0.02, residual=residual)
        # Sent plus new residual is exactly old residual plus gradient (fp32 add, then a partition).
        assert torch.equal(sparse.to_dense() + residual, before + grad)
        assert bool((residual[sparse.indices.long()] == 0).all())  # fp32 values: sent exactly
        total_in += grad.double()
        total_sent += sparse.to_dense().double()
    assert torch.allclose(total_sent + residual.double(), total_in, atol=1e-4)


def test_grad_is_not_modified_and_values_can_be_narrowed() -> None:
    grad = torch.randn(2048)
    copy = grad.clone()
    residual = torch.zeros(2048)
    sparse = compress_topk(grad, 0.1, residual=residual, value_dtype=torch.bfloat16)
    assert torch.equal(grad, copy)
    assert sparse.values.dtype == torch.bfloat16
    # What bf16 rounding took off the sent values stays in the fp32 residual: nothing is lost.
    assert torch.equal(sparse.to_dense(torch.float32) + residual, grad)
    assert bool(residual[sparse.indices.long()].abs().sum() > 0)
    assert sparse.link_bytes() == sparse.k * (4 + 2)
    assert sparse.link_bytes(torch.float32) == sparse.k * (4 + 4)


def test_sampled_selection_falls_back_when_estimate_is_short() -> None:
    # Constant magnitudes: the sampled threshold keeps everything, still exactly k are chosen.
    flat = torch.ones(SAMPLED_SELECTION_MIN_NUMEL * 2)
    assert topk_indices(flat, 100).numel() == 100
    # Few huge values hidden between sample points: the estimate keeps too few, the full ranking finds them.
    spiky = torch.zeros(SAMPLED_SELECTION_MIN_NUMEL * 4)
    spiky[1::997] = 1.0
    idx = topk_indices(spiky, 200)
    assert bool((spiky[idx] == 1.0).all())


@pytest.mark.parametrize("ratio", [0.0, -0.1, 1.5, float("nan"), True, "0.1"])
def test_bad_ratio(ratio) -> None:
    with pytest.raises(ValueError, match="0 < ratio <= 1"):
        check_ratio(ratio)
    with pytest.raises(ValueError, match="0 < ratio <= 1"):
        compress_topk(torch.randn(10), ratio)


def test_sparse_grad_validates() -> None:
    with pytest.raises(ValueError, match="int32"):
        SparseGrad(torch.arange(3), torch.ones(3), 3)
    with pytest.raises(ValueError, match="shaped like"):
        SparseGrad(torch.arange(3, dtype=torch.int32), torch.ones(2), 3)


# ------------------------------------------------------------------------------------------- in the backend


def _backend(tmp_path, name: str, rule, numel: int) -> CpuBackend:
    backend = CpuBackend([tmp_path / name], chunk_elems=CHUNK, buffer_count=3)
    backend.open([ShardSpec(0, numel, rule)])
    return backend


@pytest.mark.parametrize("rule", [Adam(decoupled_weight_decay=True), SGD()], ids=["adamw", "sgd"])
@pytest.mark.parametrize("ratio", [1.0, 0.03])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_sparse_submit_equals_dense_submit_of_the_decompressed_gradient(
    tmp_path, rule, ratio: float, grad_dtype: torch.dtype
) -> None:
    """Decompression on the device is exact: a sparse gradient updates like its dense expansion, bit for bit."""
    numel = 3 * CHUNK + 5
    master = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    sparse_be, dense_be = _backend(tmp_path, "s", rule, numel), _backend(tmp_path, "d", rule, numel)
    try:
        for backend in (sparse_be, dense_be):
            backend.initialize(0, master).result()
        gen = torch.Generator().manual_seed(4)
        residual = torch.zeros(numel, dtype=grad_dtype)
        for step in range(1, 4):
            grad = torch.randn(numel, generator=gen).to(grad_dtype)
            sparse = compress_topk(grad, ratio, residual=residual)
            hp = StepParams(step=step, lr=1e-2, grad_scale=0.5, weight_decay=0.01, momentum=0.9)
            out_s, out_d = torch.empty(numel, dtype=grad_dtype), torch.empty(numel, dtype=grad_dtype)
            before = sparse_be.traffic_snapshot()
            sparse_be.submit(0, sparse, hp, out_s).result()
            link = (sparse_be.traffic_snapshot() - before).link_write_bytes
            assert link == sparse.k * (4 + grad_dtype.itemsize)
            dense_be.submit(0, sparse.to_dense(), hp, out_d).result()
            assert torch.equal(out_s, out_d)
            if ratio == 1.0:  # keeping everything sends the gradient itself: the uncompressed path's update
                assert torch.equal(sparse.to_dense(), grad)
    finally:
        sparse_be.close()
        dense_be.close()


def test_sparse_values_round_to_link_dtype(tmp_path) -> None:
    numel = CHUNK
    rule = SGD(with_momentum=False)
    a, b = _backend(tmp_path, "a", rule, numel), _backend(tmp_path, "b", rule, numel)
    try:
        master = torch.zeros(numel)
        for backend in (a, b):
            backend.initialize(0, master).result()
        sparse = compress_topk(torch.randn(numel), 0.1)  # fp32 values on the host
        narrowed = SparseGrad(sparse.indices, sparse.values.to(torch.bfloat16), numel)
        out_a, out_b = torch.empty(numel), torch.empty(numel)
        before = a.traffic_snapshot()
        a.submit(0, sparse, StepParams(step=1, lr=1.0), out_a, link_dtype=torch.bfloat16).result()
        assert (a.traffic_snapshot() - before).link_write_bytes == sparse.k * 6
        b.submit(0, narrowed, StepParams(step=1, lr=1.0), out_b).result()
        assert torch.equal(out_a, out_b)
    finally:
        a.close()
        b.close()


def test_sparse_wrong_numel_rejected(tmp_path) -> None:
    backend = _backend(tmp_path, "x", SGD(), 100)
    try:
        with pytest.raises(ValueError, match="has 99 elements, expected 100"):
            backend.submit(0, compress_topk(torch.randn(99), 0.1), StepParams(step=1, lr=0.1), torch.empty(100))
    finally:
        backend.close()


def test_layerwise_segments_each_keep_their_share() -> None:
    gen = torch.Generator().manual_seed(5)
    # A loud segment beside a quiet one: whole-shard selection would take only from the loud one.
    grad = torch.cat([torch.randn(3000, generator=gen) * 100, torch.randn(1000, generator=gen)])
    whole = compress_topk(grad, 0.01)
    assert int((whole.indices >= 3000).sum()) == 0
    layered = compress_topk(grad, 0.01, segments=[3000, 1000])
    assert layered.k == kept_count(3000, 0.01) + kept_count(1000, 0.01)
    assert int((layered.indices >= 3000).sum()) == kept_count(1000, 0.01)
    assert bool((layered.indices[1:] > layered.indices[:-1]).all())
    expected = grad[3000:].abs().topk(kept_count(1000, 0.01)).values.sort().values
    assert torch.equal(grad.abs()[layered.indices[layered.indices >= 3000].long()].sort().values, expected)
    with pytest.raises(ValueError, match="sum to 3999"):
        compress_topk(grad, 0.01, segments=[3000, 999])


def test_fp16_error_feedback_beyond_the_link_range_is_refused_before_anything_changes() -> None:
    """Error feedback sends an entry's accumulated gradient at once: in fp16 a sum past 65504 would cross the link as
    inf and leave -inf in the residual, selected and sent again every step (issue 23, item 1)."""
    grad = torch.zeros(4096, dtype=torch.float16)
    grad[7] = 30000.0
    residual = torch.zeros(4096)
    residual[7] = 40000.0
    before = residual.clone()
    assert link_overflows(grad, residual, torch.float16)
    with pytest.raises(LinkOverflowError, match=r"range of torch.float16 \(65504\).*residual is unchanged"):
        compress_topk(grad, 0.01, residual, value_dtype=torch.float16)
    assert torch.equal(residual, before)
    # Halving the loss scale halves the residual (held in loss-scaled units) and the next gradient: it fits again.
    half = grad / 2
    assert not link_overflows(half, residual, torch.float16, residual_factor=0.5)
    sent = compress_topk(half, 0.01, residual.mul_(0.5), value_dtype=torch.float16)
    assert torch.isfinite(sent.values).all() and torch.isfinite(residual).all()
    assert float(sent.to_dense(torch.float32)[7]) == 35008.0 and float(residual[7]) == -8.0  # fp16 steps by 32 here
    # bf16 and fp32 hold what fp32 residuals hold: only a non-finite sum counts, and none is refused here.
    assert not link_overflows(grad.float() * 1e30, residual, torch.bfloat16)
    assert link_overflows(torch.full((3,), math.inf), torch.zeros(3), torch.bfloat16)
