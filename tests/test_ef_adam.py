"""EF-Adam, the default device rule for Adam and AdamW under compression: the rule, its choice, equivalence with
plain PyTorch through the strategy, exact traffic, checkpoints across rules and bad input."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.checkpoints import assert_converted
from helpers.models import LMModule, adamw_factory, fit, max_relative_error, small_strategy
from helpers.references import topk_adamw
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from scripts.ckpt_common import EVERY, train

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.core.compression import TopKCompression
from lightning_smartinf.core.rules import SGD, Adagrad, Adam, EFAdafactor, EFAdam, StepParams
from lightning_smartinf.core.torch_optim import rule_for_group, state_bytes

STEPS = 8
BETAS = (0.9, 0.95)
EF_ADAM = {"ratio": 0.01, "rule": "ef_adam"}


adamw = adamw_factory(betas=BETAS, cosine_steps=STEPS)


#: What EF-Adam computes, as users could write it: AdamW with beta1 = 0.
adamw_no_first_moment = adamw_factory(betas=(0.0, BETAS[1]), cosine_steps=STEPS)


# ------------------------------------------------------------------------------------------------------ the rule


@pytest.mark.parametrize(
    ("decoupled", "weight_decay", "maximize"), [(True, 0.1, False), (False, 0.01, True), (False, 0.0, False)]
)
def test_rule_is_torch_adam_with_beta1_zero_bitwise(decoupled, weight_decay, maximize) -> None:
    gen = torch.Generator().manual_seed(0)
    ref = torch.nn.Parameter(torch.randn(5000, generator=gen))
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([ref], lr=1e-2, betas=(0.0, 0.99), weight_decay=weight_decay, maximize=maximize, foreach=False)
    master, v = ref.detach().clone(), torch.zeros(5000)
    rule = EFAdam(decoupled_weight_decay=decoupled)
    for step in range(1, 6):
        grad = torch.randn(5000, generator=gen) * (step % 3)  # a zero gradient on step 3
        ref.grad = grad.clone()
        opt.step()
        hp = StepParams(step=step, lr=1e-2, betas=(0.9, 0.99), weight_decay=weight_decay, maximize=maximize)
        rule.apply(master, grad.clone(), [v], hp)  # beta1 = 0.9 in the step: ignored
        assert torch.equal(master, ref.detach()), f"step {step}"
        assert torch.equal(v, opt.state[ref]["exp_avg_sq"])
    assert rule.state_names == ("exp_avg_sq",) and rule.bytes_per_element == 8


def _optimizers() -> dict[str, torch.optim.Optimizer]:
    params = [torch.nn.Parameter(torch.zeros(4))]
    return {
        "adamw": torch.optim.AdamW(params),
        "adam": torch.optim.Adam(params),
        "sgd": torch.optim.SGD(params, lr=0.1, momentum=0.9),
        "adagrad": torch.optim.Adagrad(params),
        "adam_amsgrad": torch.optim.Adam(params, amsgrad=True),
    }


@pytest.mark.parametrize(
    ("name", "compression", "expected"),
    [
        ("adamw", None, Adam(decoupled_weight_decay=True)),
        ("adamw", TopKCompression(0.01, rule="ef_adam"), EFAdam(decoupled_weight_decay=True)),
        ("adam", TopKCompression(0.01, rule="ef_adam"), EFAdam()),
        ("adamw", TopKCompression(0.01), EFAdam(decoupled_weight_decay=True)),  # the default
        ("adamw", TopKCompression(0.01, rule="ef_adafactor"), EFAdafactor()),
        ("adamw", TopKCompression(0.01, rule="optimizer"), Adam(decoupled_weight_decay=True)),
        ("adamw", TopKCompression(0.01, error_feedback=False), Adam(decoupled_weight_decay=True)),
        ("adamw", TopKCompression(1.0, rule="ef_adam"), EFAdam(decoupled_weight_decay=True)),
        ("sgd", TopKCompression(0.01), SGD()),
        ("adagrad", TopKCompression(0.01), Adagrad()),
        ("adam_amsgrad", TopKCompression(0.01), Adam(amsgrad=True)),  # refused later, by the top-k check
    ],
)
def test_rule_choice(name, compression, expected) -> None:
    optimizer = _optimizers()[name]
    assert rule_for_group(optimizer, optimizer.param_groups[0], compression) == expected


def test_state_bytes_follow_the_rule() -> None:
    optimizer = _optimizers()["adamw"]
    assert state_bytes(optimizer) == 4 * 12
    assert state_bytes(optimizer, TopKCompression(0.01, rule="ef_adam")) == 4 * 8


# ---------------------------------------------------------------------------------------- through the strategy


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_ratio_one_is_adamw_without_first_moment_bitwise(tmp_path, precision) -> None:
    """Keeping every entry, EF-Adam through the strategy is the dense run of AdamW(betas=(0, beta2)), bit for bit,
    with accumulation and clipping."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    kwargs = dict(steps=STEPS, accumulate=2, clip=0.5, precision=precision)
    # Compressed runs add micro-batches in the training dtype (DeepSpeed's default): the dense twin does too.
    same_sums = {"config": {"data_types": {"grad_accum_dtype": "bf16"}}} if precision == "bf16-mixed" else {}
    _, dense = fit(LMModule(adamw_no_first_moment), small_strategy(tmp_path / "a", **same_sums), **kwargs)
    trainer, ours = fit(LMModule(adamw), small_strategy(tmp_path / "b", compression=EF_ADAM | {"ratio": 1.0}), **kwargs)
    shards = trainer.strategy.smart_update.backend.shards
    assert {type(s.spec.rule) for s in shards} == {EFAdam}
    assert all(torch.equal(ours[n], dense[n]) for n in dense)
    initial = {n: p.detach().clone() for n, p in LMModule(adamw).named_parameters()}
    assert min(max_relative_error(dense, initial).values()) > 1e-3  # training moved every parameter


def test_one_percent_matches_plain_pytorch_top_k_and_adamw_without_first_moment(tmp_path) -> None:
    reference = topk_adamw(adamw_no_first_moment, STEPS, 0.01)
    trainer, ours = fit(LMModule(adamw), small_strategy(tmp_path, compression=EF_ADAM), steps=STEPS)
    assert trainer.strategy.smart_update.residual is not None
    errors = max_relative_error(ours, reference)
    assert max(errors.values()) < 1e-5, errors
    initial = {f"model.{n}": p.detach().clone() for n, p in LMModule(adamw).model.named_parameters()}
    moved = max_relative_error(reference, initial)
    assert min(moved.values()) > 1e-4, moved  # every parameter trained, far beyond the tolerance


def test_with_clipping_each_step_is_clipped_by_its_own_norm(tmp_path) -> None:
    """Clipping with error feedback matches plain PyTorch that clips each step's gradient before it joins the
    residual, as dense clipping does; not what was sent before, an entry held back for many steps scaled by the
    clipping of the step that sent it. At 0.05 every step clips, each by a different factor."""
    reference = topk_adamw(adamw_no_first_moment, STEPS, 0.01, clip=0.05)
    trainer, ours = fit(LMModule(adamw), small_strategy(tmp_path, compression=EF_ADAM), steps=STEPS, clip=0.05)
    assert trainer.strategy.smart_update.residual is not None
    errors = max_relative_error(ours, reference)
    assert max(errors.values()) < 1e-5, errors
    when_sent = max_relative_error(ours, topk_adamw(adamw_no_first_moment, STEPS, 0.01, clip=0.05, clip_when_sent=True))
    assert max(when_sent.values()) > 1e-3, when_sent  # the two differ far beyond the tolerance


def test_device_state_and_traffic_are_two_thirds_of_adams(tmp_path) -> None:
    """One fp32 state instead of two: exact storage bytes per step, and the link bytes unchanged."""
    runs = {}
    for rule in ("optimizer", "ef_adam"):
        (tmp_path / rule).mkdir()
        compression = {"ratio": 0.01, "rule": rule}
        trainer, _ = fit(LMModule(adamw, dim=64), small_strategy(tmp_path / rule, compression=compression), steps=3)
        shards = trainer.strategy.smart_update.backend.shards
        padded = sum(sum(s.layout.padded_len(k) for k in range(s.layout.num_chunks)) for s in shards)
        metrics = trainer.callback_metrics
        tensors = {type(s.spec.rule): s.layout.tensors_per_record for s in shards}
        runs[rule] = (padded, tensors, {k: float(v) for k, v in metrics.items() if k.startswith("smartinf/")})
    (padded, adam_tensors, adam), (padded_ef, ef_tensors, ef) = runs["optimizer"], runs["ef_adam"]
    assert adam_tensors == {Adam: 3} and ef_tensors == {EFAdam: 2} and padded == padded_ef
    assert adam["smartinf/storage_read_bytes"] == padded * 12
    assert ef["smartinf/storage_read_bytes"] == ef["smartinf/storage_write_bytes"] == padded * 8
    assert ef["smartinf/link_write_bytes"] == adam["smartinf/link_write_bytes"]
    assert ef["smartinf/link_read_bytes"] == adam["smartinf/link_read_bytes"]


# ------------------------------------------------------------------------------------------------- checkpoints


def test_resume_is_bit_identical(tmp_path) -> None:
    comp = {"strategy_kwargs": {"compression": EF_ADAM | {"ratio": 0.05}}}
    expected = train(tmp_path / "ref", steps=2 * EVERY, **comp)
    checkpoint = tmp_path / "ref" / "ckpts" / f"step={EVERY}.ckpt"
    (manifest,) = checkpoint.rglob("manifest.json")
    assert '"ef_adam"' in manifest.read_text() and '"exp_avg"' not in manifest.read_text()
    resumed = train(tmp_path / "resumed", steps=2 * EVERY, ckpt_path=checkpoint, every=None, **comp)
    assert all(torch.equal(resumed[n], expected[n]) for n in expected)


@pytest.mark.slow
@pytest.mark.parametrize(("before", "after"), [("optimizer", "ef_adam"), ("ef_adam", "optimizer")])
def test_resume_across_rules_converts_the_device_state(tmp_path, caplog, before, after) -> None:
    """A run saved under one rule resumes under the other (compression's rule changed, e.g. a checkpoint from before
    EF-Adam was the default): the state is converted, with one warning, and training goes on."""
    first = {"strategy_kwargs": {"compression": {"ratio": 0.05, "rule": before}}}
    train(tmp_path / "ref", steps=EVERY, **first)
    checkpoint = tmp_path / "ref" / "ckpts" / f"step={EVERY}.ckpt"
    second = {"strategy_kwargs": {"compression": {"ratio": 0.05, "rule": after}}}
    with caplog.at_level("WARNING", logger="lightning_smartinf.core.format.state_files"):
        resumed = train(tmp_path / "resumed", steps=2 * EVERY, ckpt_path=checkpoint, every=None, **second)
    assert caplog.text.count("converting it to") == 1
    assert all(torch.isfinite(p).all() for p in resumed.values())
    # What the resume converted the state to, saved before any step: the masters and the shared second moment as
    # saved, the first moment (if the new rule has one) starting at zero.
    trainers: list = []
    train(tmp_path / "loaded", steps=EVERY, ckpt_path=checkpoint, every=None, trainers=trainers, **second)
    trainers[0].save_checkpoint(tmp_path / "converted.ckpt")
    assert_converted(checkpoint, tmp_path / "converted.ckpt")


# ---------------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("compression", "message"),
    [
        ({"ratio": 0.01, "rule": "microadam"}, r"`compression\['rule'\]='microadam'` is not supported"),
        ({"ratio": 0.01, "rule": None}, r"`compression\['rule'\]=None` is not supported"),
        ({"ratio": 0.01, "rule": 1}, r"`compression\['rule'\]=1` is not supported"),
        ({"ratio": 0.01, "rule": "ef_adam", "error_feedback": False}, "needs `error_feedback=True`"),
    ],
)
def test_bad_rule_is_refused_at_construction(compression, message) -> None:
    with pytest.raises(MisconfigurationException, match=message):
        SmartInfinityStrategy(compression=compression)


def test_top_k_compression_checks_its_rule() -> None:
    with pytest.raises(ValueError, match="must be one of 'auto', 'optimizer', 'ef_adam'"):
        TopKCompression(0.01, rule="EF_ADAM")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs `error_feedback=True`"):
        TopKCompression(0.01, error_feedback=False, rule="ef_adam")


@pytest.mark.parametrize(
    ("make_optimizer", "message"),
    [
        (lambda m: (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), None), "is for torch.optim.Adam and AdamW"),
        (lambda m: (torch.optim.Adagrad(m.parameters()), None), "is for torch.optim.Adam and AdamW"),
        (lambda m: (torch.optim.Adam(m.parameters(), amsgrad=True), None), "has no `amsgrad`"),
    ],
    ids=["sgd", "adagrad", "amsgrad"],
)
def test_ef_adam_for_another_optimizer_is_refused_before_training(tmp_path, make_optimizer, message) -> None:
    strategy = small_strategy(tmp_path, compression={"ratio": 0.01, "rule": "ef_adam"})
    with pytest.raises(MisconfigurationException, match=message) as info:
        fit(LMModule(make_optimizer), strategy, steps=1)
    assert "rule='auto'" in str(info.value) or "amsgrad=False" in str(info.value)
    assert not list(tmp_path.rglob("*.state"))  # refused before any device state was written


def test_sgd_with_auto_keeps_its_own_rule(tmp_path) -> None:
    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), None

    trainer, params = fit(LMModule(sgd), small_strategy(tmp_path, compression=0.01), steps=2)
    assert {type(s.spec.rule) for s in trainer.strategy.smart_update.backend.shards} == {SGD}
    assert all(math.isfinite(float(p.abs().max())) for p in params.values())
