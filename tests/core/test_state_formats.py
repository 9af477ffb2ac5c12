"""The reference of each state format: storage sizes, round-trip bounds, and the update through them."""

from __future__ import annotations

import pytest
import torch

from lightning_smartinf.core.rules import SGD, Adagrad, Adam, EFAdafactor, EFAdam, StepParams
from lightning_smartinf.core.state_formats import (
    BLOCK,
    E4M3_MAX,
    FORMATS,
    NON_NEGATIVE,
    ROOT_CODE,
    check_format_for_rule,
    state_format,
    update_chunk,
)


def _values(n: int, seed: int = 0, *, signed: bool = True) -> torch.Tensor:
    """Values spanning many orders of magnitude, as optimizer moments do."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3)
    return x if signed else x.square()


def _round_trip(name: str, x: torch.Tensor, state: str) -> torch.Tensor:
    fmt = state_format(name)
    raw = torch.empty(fmt.stored_bytes(x.numel()), dtype=torch.uint8)
    fmt.store(x, raw, state)
    out = torch.empty_like(x)
    fmt.load(raw, out, state)
    return out


def test_stored_bytes_per_format():
    n = 3 * BLOCK + 5
    assert state_format("fp32").stored_bytes(n) == 4 * n
    assert state_format("bf16").stored_bytes(n) == 2 * n
    assert state_format("int8").stored_bytes(n) == 4 * BLOCK + 4 * 4
    assert state_format("int8").bytes_per_element(2) == pytest.approx(4 + 2 * (1 + 4 / BLOCK))


@pytest.mark.parametrize("state", ["exp_avg", "exp_avg_sq"])
def test_fp32_is_exact_and_bf16_within_its_bound(state):
    x = _values(4096, signed=state not in NON_NEGATIVE)
    assert torch.equal(_round_trip("fp32", x, state), x)
    y = _round_trip("bf16", x, state)
    assert torch.equal(y, x.to(torch.bfloat16).float())  # round to nearest even
    assert bool(((y - x).abs() <= 2**-8 * x.abs()).all())


def test_int8_signed_state_within_its_bound_and_each_blocks_largest_exact():
    x = _values(10 * BLOCK + 17, seed=1)
    y = _round_trip("int8", x, "exp_avg")
    padded = torch.nn.functional.pad(x, (0, (-x.numel()) % BLOCK)).view(-1, BLOCK)
    scale = (padded.abs().amax(dim=1) / E4M3_MAX).repeat_interleave(BLOCK)[: x.numel()]
    assert bool(((y - x).abs() <= 2**-4 * x.abs() + 2**-10 * scale * (1 + 2**-20)).all())
    largest = padded.abs().argmax(dim=1) + torch.arange(padded.shape[0]) * BLOCK
    largest = largest[largest < x.numel()]
    assert torch.equal(y[largest], x[largest])
    assert bool((torch.sign(y) * torch.sign(x) >= 0).all())


def test_int8_non_negative_state_is_stored_by_its_square_root():
    v = _values(8 * BLOCK, seed=2, signed=False)
    stored = _round_trip("int8", v, "exp_avg_sq")
    assert bool((stored >= 0).all())
    root = v.sqrt().view(-1, BLOCK)
    scale = (root.amax(dim=1, keepdim=True) / ROOT_CODE.largest).expand_as(root).reshape(-1)
    bias, m = ROOT_CODE.bias, ROOT_CODE.mantissa_bits
    normal = v >= (scale * 2.0 ** (1 - bias)).square()  # the square root in the code's normal range
    assert 0.05 < float(normal.float().mean()) < 1  # (both ranges taken)
    relative = ((stored - v).abs() / v)[normal]
    half_step = 2.0 ** -(m + 1)  # of a normal square root, relative
    assert float(relative.max()) <= 2 * half_step + half_step**2
    # Below it the codes count multiples of the smallest code; a non-zero element never becomes zero.
    smallest = scale * 2.0 ** (1 - bias - m)
    below, error = ~normal & (v > 0), (stored.sqrt() - v.sqrt()).abs()
    rounded = below & (v.sqrt() >= smallest / 2)  # else taken up to the smallest code
    assert bool((error[rounded] <= smallest[rounded] / 2 * (1 + 2**-10)).all())
    assert bool((error[below] <= smallest[below] * (1 + 2**-10)).all())
    assert bool((stored[v > 0] > 0).all())
    # A block of zeros (a parameter that never had a gradient) stays zeros, not NaN.
    zeros = torch.zeros(2 * BLOCK)
    assert torch.equal(_round_trip("int8", zeros, "exp_avg_sq"), zeros)
    assert torch.equal(_round_trip("int8", zeros, "exp_avg"), zeros)


def _e4m3_root_round_trip(v: torch.Tensor) -> torch.Tensor:
    """``v`` stored by its square root in E4M3 codes, blocks of :data:`BLOCK` (the ``int8`` format's earlier code)."""
    root = v.sqrt().view(-1, BLOCK)
    scale = root.amax(dim=1, keepdim=True) / E4M3_MAX
    return ((root / scale).to(torch.float8_e4m3fn).float() * scale).square().flatten()


def test_a_second_moment_kept_in_int8_follows_the_exact_one():
    """What the root code's precision is for. Adam's exponential average of squared gradients (beta2 0.95), each
    element's gradient noise of its own scale, 300 steps, stored and loaded back after each: kept in int8, 90% of
    the elements stay within 2**0.25 of the exact average; kept by its square root in E4M3 (3 mantissa bits: a
    change of 2.5% rounds away), the changes that round away compound, and a tenth of the elements drift beyond
    2**0.3."""
    n, beta2 = 16 * BLOCK, 0.95
    generator = torch.Generator().manual_seed(9)
    sigma = torch.exp(torch.randn(n, generator=generator))
    fmt = state_format("int8")
    raw = torch.empty(fmt.stored_bytes(n), dtype=torch.uint8)
    exact, kept, e4m3 = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    for _ in range(300):
        grad2 = (sigma * torch.randn(n, generator=generator)).square()
        exact = exact * beta2 + (1 - beta2) * grad2
        kept = kept * beta2 + (1 - beta2) * grad2
        fmt.store(kept, raw, "exp_avg_sq")
        fmt.load(raw, kept, "exp_avg_sq")
        e4m3 = _e4m3_root_round_trip(e4m3 * beta2 + (1 - beta2) * grad2)
    assert float(torch.quantile(torch.log2(kept / exact).abs(), 0.9)) < 0.25
    assert float(torch.quantile(torch.log2(e4m3 / exact).abs(), 0.9)) > 0.3


def test_the_fp32_update_is_the_rule_itself_bit_for_bit():
    rule = Adam(decoupled_weight_decay=True)
    hp = StepParams(step=3, lr=1e-3, weight_decay=0.01)
    fmt = state_format("fp32")
    master, grad = _values(2048, 3), _values(2048, 4)
    states = [_values(2048, 5), _values(2048, 6, signed=False)]
    stored = []
    for name, s in zip(rule.state_names, states):
        raw = torch.empty(fmt.stored_bytes(2048), dtype=torch.uint8)
        fmt.store(s, raw, name)
        stored.append(raw)
    expected_master = master.clone()
    expected_states = [s.clone() for s in states]
    rule.apply(expected_master, grad.clone(), expected_states, hp)
    update_chunk(rule, fmt, master, grad, stored, hp)
    assert torch.equal(master, expected_master)
    for raw, expected in zip(stored, expected_states):
        assert torch.equal(raw.view(torch.float32), expected)


@pytest.mark.parametrize("name", ["bf16", "int8"])
def test_adamw_through_a_smaller_format_stays_near_fp32(name):
    """Not a quality figure (the convergence benchmarks give those): AdamW steps on a quadratic through each format
    track the fp32 run's parameters to within a few percent of their movement (5% in bf16, 6% in int8, whose runs
    here end 5.1% apart: the targets span e**-9 to e**9 within a block, wider than an optimizer's moments do)."""
    rule, n = Adam(decoupled_weight_decay=True), 4 * BLOCK
    target = _values(n, 7)
    runs = {}
    for fmt_name in ("fp32", name):
        fmt = state_format(fmt_name)
        master = torch.zeros(n)
        stored = [torch.zeros(fmt.stored_bytes(n), dtype=torch.uint8) for _ in rule.state_names]
        for step in range(1, 51):
            update_chunk(rule, fmt, master, master - target, stored, StepParams(step=step, lr=1e-2))
        runs[fmt_name] = master
    moved = runs["fp32"].abs().mean()
    assert float((runs[name] - runs["fp32"]).abs().mean()) < {"bf16": 0.05, "int8": 0.06}[name] * float(moved)


def test_formats_and_refusals():
    assert FORMATS == ("fp32", "bf16", "int8")
    with pytest.raises(ValueError, match=r"`state_precision='fp16'` is not a state format; choose one of"):
        state_format("fp16")
    for rule in (Adam(), EFAdam(), SGD(), Adagrad()):
        for name in FORMATS:
            check_format_for_rule(name, rule)
    check_format_for_rule("fp32", EFAdafactor())
    with pytest.raises(ValueError, match=r"'ef_adafactor' update keeps no per-element state"):
        check_format_for_rule("int8", EFAdafactor())
    with pytest.raises(ValueError, match=r"'sgd' update keeps no per-element state"):
        check_format_for_rule("bf16", SGD(with_momentum=False))


def test_the_state_bytes_a_run_stores_follow_its_format():
    from lightning_smartinf.core.torch_optim import state_bytes

    model = torch.nn.Linear(1000, 1000)  # 1,001,000 parameters, Adam's two states each
    optimizer = torch.optim.AdamW(model.parameters())
    numel = 1_001_000
    assert state_bytes(optimizer) == state_bytes(optimizer, None, "fp32") == 12 * numel
    assert state_bytes(optimizer, None, "bf16") == 8 * numel
    assert state_bytes(optimizer, None, "int8") == int(numel * (4 + 2 * (BLOCK + 4) / BLOCK))
