"""Each update rule against the matching ``torch.optim`` step (single-tensor, or fused if the rule is), bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from lightning_smartinf.core.rules import SGD, Adagrad, Adam, StepParams, UpdateRule
from lightning_smartinf.core.torch_optim import rule_for_group

NUMEL = 3001
STEPS = 6

# (id, rule, torch optimizer class, torch kwargs, StepParams kwargs beyond step/lr)
CASES = [
    ("adam", Adam(), torch.optim.Adam, {}, {}),
    (
        "adam_l2_betas_eps",
        Adam(),
        torch.optim.Adam,
        {"betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.05},
        {"betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.05},
    ),
    (
        "adamw",
        Adam(decoupled_weight_decay=True),
        torch.optim.AdamW,
        {"weight_decay": 0.1},
        {"weight_decay": 0.1},
    ),
    (
        "adam_decoupled_flag",
        Adam(decoupled_weight_decay=True),
        torch.optim.Adam,
        {"weight_decay": 0.1, "decoupled_weight_decay": True},
        {"weight_decay": 0.1},
    ),
    (
        "adam_amsgrad",
        Adam(amsgrad=True),
        torch.optim.Adam,
        {"amsgrad": True, "weight_decay": 0.01},
        {"weight_decay": 0.01},
    ),
    (
        "adamw_amsgrad_maximize",
        Adam(decoupled_weight_decay=True, amsgrad=True),
        torch.optim.AdamW,
        {"amsgrad": True, "maximize": True, "weight_decay": 0.02},
        {"maximize": True, "weight_decay": 0.02},
    ),
    ("adam_maximize", Adam(), torch.optim.Adam, {"maximize": True}, {"maximize": True}),
    # fused=True: torch's fused CPU kernel, against the optimizer built with fused=True.
    (
        "adamw_fused",
        Adam(True, fused=True),
        torch.optim.AdamW,
        {"fused": True, "weight_decay": 0.1},
        {"weight_decay": 0.1},
    ),
    (
        "adam_fused_l2_betas_eps",
        Adam(fused=True),
        torch.optim.Adam,
        {"fused": True, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.05},
        {"betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.05},
    ),
    (
        "adamw_fused_amsgrad_maximize",
        Adam(decoupled_weight_decay=True, amsgrad=True, fused=True),
        torch.optim.AdamW,
        {"fused": True, "amsgrad": True, "maximize": True, "weight_decay": 0.02},
        {"maximize": True, "weight_decay": 0.02},
    ),
    ("sgd_plain", SGD(with_momentum=False), torch.optim.SGD, {}, {}),
    ("sgd_momentum_zero_with_buffer", SGD(), torch.optim.SGD, {"momentum": 0.0}, {"momentum": 0.0}),
    ("sgd_momentum", SGD(), torch.optim.SGD, {"momentum": 0.9}, {"momentum": 0.9}),
    (
        "sgd_dampening",
        SGD(),
        torch.optim.SGD,
        {"momentum": 0.9, "dampening": 0.3},
        {"momentum": 0.9, "dampening": 0.3},
    ),
    (
        "sgd_nesterov_wd",
        SGD(),
        torch.optim.SGD,
        {"momentum": 0.8, "nesterov": True, "weight_decay": 1e-2},
        {"momentum": 0.8, "nesterov": True, "weight_decay": 1e-2},
    ),
    ("sgd_weight_decay", SGD(with_momentum=False), torch.optim.SGD, {"weight_decay": 0.1}, {"weight_decay": 0.1}),
    (
        "sgd_maximize",
        SGD(),
        torch.optim.SGD,
        {"momentum": 0.5, "maximize": True},
        {"momentum": 0.5, "maximize": True},
    ),
    ("adagrad", Adagrad(), torch.optim.Adagrad, {"eps": 1e-10}, {"eps": 1e-10}),
    (
        "adagrad_all",
        Adagrad(initial_accumulator_value=0.1),
        torch.optim.Adagrad,
        {"lr_decay": 0.05, "initial_accumulator_value": 0.1, "weight_decay": 0.01, "eps": 1e-10},
        {"lr_decay": 0.05, "weight_decay": 0.01, "eps": 1e-10},
    ),
    (
        "adagrad_maximize",
        Adagrad(initial_accumulator_value=0.5),
        torch.optim.Adagrad,
        {"initial_accumulator_value": 0.5, "maximize": True, "eps": 1e-10},
        {"maximize": True, "eps": 1e-10},
    ),
]

# torch's per-parameter state keys, in each rule's ``state_names`` order.
TORCH_STATE_KEYS = {
    "exp_avg": "exp_avg",
    "exp_avg_sq": "exp_avg_sq",
    "max_exp_avg_sq": "max_exp_avg_sq",
    "momentum_buffer": "momentum_buffer",
    "sum": "sum",
}


def _lr(base: float, t: int) -> float:
    """A learning rate that changes every step, like a scheduler."""
    return base * (0.9 ** (t - 1)) + 1e-4 * t


@pytest.mark.parametrize(
    ("rule", "torch_cls", "torch_kwargs", "hp_kwargs"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_rule_matches_torch_optim(rule: UpdateRule, torch_cls, torch_kwargs, hp_kwargs) -> None:
    gen = torch.Generator().manual_seed(1234)
    base_lr = 1e-2
    init = torch.randn(NUMEL, generator=gen)

    ref = torch.nn.Parameter(init.clone())
    opt = torch_cls([ref], lr=base_lr, foreach=False, **torch_kwargs)

    master = init.clone()
    states = [torch.full((NUMEL,), rule.initial_state_value(name)) for name in rule.state_names]

    for t in range(1, STEPS + 1):
        lr = _lr(base_lr, t)
        grad = torch.randn(NUMEL, generator=gen)
        ref.grad = grad.clone()
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()

        rule.apply(master, grad.clone(), states, StepParams(step=t, lr=lr, **hp_kwargs))

        assert_close(master, ref.detach(), rtol=0, atol=0, msg=lambda m, t=t: f"step {t}: {m}")
        torch_state = opt.state[ref]
        for name, state in zip(rule.state_names, states):
            expected = torch_state.get(TORCH_STATE_KEYS[name])
            if expected is None:
                # torch keeps no momentum buffer when momentum == 0; the rule must then leave it untouched.
                assert name == "momentum_buffer" and hp_kwargs.get("momentum", 0.0) == 0.0
                assert torch.count_nonzero(state) == 0
                continue
            assert_close(state, expected, rtol=0, atol=0, msg=lambda m, t=t, n=name: f"step {t}, {n}: {m}")


def test_rules_actually_change_the_master() -> None:
    """Guards the comparison above against a rule and a reference that both do nothing."""
    for _, rule, _, _, hp_kwargs in CASES:
        master = torch.ones(16)
        states = [torch.full((16,), rule.initial_state_value(n)) for n in rule.state_names]
        rule.apply(master, torch.full((16,), 0.5), states, StepParams(step=1, lr=0.1, **hp_kwargs))
        assert not torch.equal(master, torch.ones(16)), rule


@pytest.mark.parametrize(
    ("rule", "hp_kwargs"),
    [(Adam(), {}), (Adam(amsgrad=True), {}), (SGD(), {"momentum": 0.9}), (Adagrad(0.1), {"lr_decay": 0.1})],
    ids=["adam", "amsgrad", "sgd", "adagrad"],
)
def test_rule_ignores_grad_scale(rule: UpdateRule, hp_kwargs) -> None:
    """``grad_scale`` is applied by the backend before ``apply``; the rule must not apply it again."""
    gen = torch.Generator().manual_seed(7)
    init, grad = torch.randn(2048, generator=gen), torch.randn(2048, generator=gen)
    results = []
    for scale in (1.0, 8.0):
        master = init.clone()
        states = [torch.full((2048,), rule.initial_state_value(n)) for n in rule.state_names]
        for t in (1, 2):
            rule.apply(master, grad.clone(), states, StepParams(step=t, lr=0.01, grad_scale=scale, **hp_kwargs))
        results.append(master)
    assert_close(results[0], results[1], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("rule", "names", "nbytes"),
    [
        (Adam(), ("exp_avg", "exp_avg_sq"), 12),
        (Adam(decoupled_weight_decay=True), ("exp_avg", "exp_avg_sq"), 12),
        (Adam(amsgrad=True), ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"), 16),
        (SGD(), ("momentum_buffer",), 8),
        (SGD(with_momentum=False), (), 4),
        (Adagrad(), ("sum",), 8),
        (Adagrad(initial_accumulator_value=0.3), ("sum",), 8),
    ],
)
def test_state_names_and_bytes(rule: UpdateRule, names: tuple[str, ...], nbytes: int) -> None:
    assert rule.state_names == names
    assert rule.bytes_per_element == nbytes


def test_initial_state_values() -> None:
    assert Adagrad(initial_accumulator_value=0.25).initial_state_value("sum") == 0.25
    assert Adagrad().initial_state_value("sum") == 0.0
    for name in Adam(amsgrad=True).state_names:
        assert Adam(amsgrad=True).initial_state_value(name) == 0.0
    assert SGD().initial_state_value("momentum_buffer") == 0.0


def test_rule_names_distinct() -> None:
    assert {Adam.name, SGD.name, Adagrad.name} == {"adam", "sgd", "adagrad"}


def test_fused_adam_is_a_different_rounding_of_the_same_update() -> None:
    """The fused cases above compare the fused kernel, not the single-tensor arithmetic under another name."""
    gen = torch.Generator().manual_seed(3)
    init, grad = torch.randn(1 << 16, generator=gen), torch.randn(1 << 16, generator=gen)
    masters = []
    for fused in (False, True):
        master, states = init.clone(), [torch.zeros(1 << 16), torch.zeros(1 << 16)]
        for t in (1, 2, 3):
            hp = StepParams(step=t, lr=1e-3, weight_decay=0.01)
            Adam(decoupled_weight_decay=True, fused=fused).apply(master, grad.clone(), states, hp)
        masters.append(master)
    assert not torch.equal(masters[0], masters[1])
    assert_close(masters[0], masters[1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda p: torch.optim.AdamW(p), Adam(decoupled_weight_decay=True)),
        (lambda p: torch.optim.AdamW(p, fused=True, amsgrad=True), Adam(True, amsgrad=True, fused=True)),
        (lambda p: torch.optim.Adam(p, fused=True), Adam(fused=True)),
        (lambda p: torch.optim.Adam(p, decoupled_weight_decay=True), Adam(decoupled_weight_decay=True)),
        (lambda p: torch.optim.Adam(p, foreach=False), Adam()),
    ],
    ids=["adamw", "adamw-fused-amsgrad", "adam-fused", "adam-decoupled", "adam-foreach-false"],
)
def test_rule_for_group_follows_the_optimizers_options(make, expected) -> None:
    optimizer = make([torch.nn.Parameter(torch.zeros(4))])
    assert rule_for_group(optimizer, optimizer.param_groups[0]) == expected
