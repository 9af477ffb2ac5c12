"""EF-Adafactor, compression rule ``ef_adafactor``: the host's factored second moment, the device's SGD step,
equivalence with plain PyTorch through the strategy, exact traffic, checkpoints across rules and bad input."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.checkpoints import assert_converted
from helpers.models import (
    LMModule,
    TinyGPT,
    adamw_factory,
    fit,
    max_relative_error,
    param_groups,
    small_strategy,
    token_loader,
)
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from scripts.ckpt_common import EVERY, train

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.core.compression import TopKCompression, compress_topk, kept_count
from lightning_smartinf.core.factored import FactoredMoments, device_step_params
from lightning_smartinf.core.rules import SGD, Adam, EFAdafactor, EFAdam, StepParams
from lightning_smartinf.core.torch_optim import rule_for_group, state_bytes

STEPS = 8
BETAS = (0.9, 0.95)
EPS = 1e-8
AF = {"ratio": 0.01, "rule": "ef_adafactor"}


adamw = adamw_factory(betas=BETAS, eps=EPS, cosine_steps=STEPS)


def _factored(square: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = square.reshape(square.shape[0], -1)
    return rows.sum(1, keepdim=True), rows.sum(0, keepdim=True)


# ------------------------------------------------------------------------------------------- the host's moments


def test_moments_are_adafactors_row_and_column_averages() -> None:
    """One rank, whole parameters: v_hat is R C / sum(R) of the averaged sums for a matrix, Adam's v for a vector,
    and what is sent is g * scale / (sqrt(v_hat / bc2) + eps), for dense and top-k gradients alike."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(6, 5), (7,), (4, 3, 2)]
    moments = FactoredMoments([[{"shape": list(s), "partition_numel": math.prod(s)} for s in shapes]], rank=0)
    rows = {s: torch.zeros(s[0], 1) for s in shapes}
    cols = {s: torch.zeros(1, math.prod(s[1:])) for s in shapes}
    vec = torch.zeros(7)
    beta2, scale = 0.9, 0.5
    for step in range(1, 4):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        flat = torch.cat([g.view(-1) for g in grads])
        moments.begin_step()
        moments.update(0, flat, scale, beta2)
        expected = []
        for shape, g in zip(shapes, grads):
            square = (g * scale).square()
            if len(shape) == 1:
                vec.mul_(beta2).add_(square, alpha=1 - beta2)
                v_hat = vec
            else:
                r, c = _factored(square)
                rows[shape].mul_(beta2).add_(r, alpha=1 - beta2)
                cols[shape].mul_(beta2).add_(c, alpha=1 - beta2)
                v_hat = (rows[shape] * cols[shape] / rows[shape].sum()).view(shape)
            expected.append((g * scale / ((v_hat / (1 - beta2**step)).sqrt() + EPS)).view(-1))
        hp = StepParams(step=step, lr=0.1, grad_scale=scale, betas=(0.9, beta2), eps=EPS)
        dense = moments.normalise(0, flat, hp, torch.float32)
        torch.testing.assert_close(dense, torch.cat(expected), rtol=1e-6, atol=0)
        sparse = moments.normalise(0, compress_topk(flat, 0.2, value_dtype=torch.float32), hp, torch.bfloat16)
        torch.testing.assert_close(sparse.values, torch.cat(expected)[sparse.indices.long()].bfloat16())
    assert moments.updates == 3 and moments.moments.numel() == (6 + 5) + 7 + (4 + 6)


def test_each_rank_factors_the_elements_of_its_partition() -> None:
    """Two ranks split every parameter mid-row: each rank's row and column sums cover exactly its elements (the
    parameter's others count as zero), its last partition's padding is never read, and `maximize` flips the sign."""
    gen = torch.Generator().manual_seed(1)
    shapes = [(5, 7), (3,), (2, 4, 3)]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    sizes = [(math.prod(s) + 1) // 2 for s in shapes]
    hp = StepParams(step=1, lr=0.1, betas=(0.9, 0.99), eps=EPS, maximize=True)
    for rank in (0, 1):
        moments = FactoredMoments([[{"shape": list(s), "partition_numel": n} for s, n in zip(shapes, sizes)]], rank)
        parts, expected = [], []
        for g, n in zip(grads, sizes):
            flat = torch.nn.functional.pad(g.view(-1), (0, 2 * n - g.numel()), value=float("nan"))
            part = flat[rank * n : (rank + 1) * n].clone()
            mask = torch.zeros(2 * n, dtype=torch.bool)
            mask[rank * n : min((rank + 1) * n, g.numel())] = True
            mine = torch.where(mask[: g.numel()], g.view(-1), 0.0).view(g.shape)
            if g.ndim == 1:
                v_hat = mine.square()
            else:
                touched = mask[: g.numel()].view(g.shape[0], -1).any(1)
                r, c = _factored(mine.square()[touched])
                v_hat = torch.zeros(g.shape[0], c.numel())
                v_hat[touched] = r * c / r.sum()
            sent = -mine.view(-1) / (v_hat.view(-1).sqrt() + EPS)  # (1 - beta2) and its bias correction cancel
            whole = torch.where(mask, torch.nn.functional.pad(sent, (0, 2 * n - g.numel())), float("nan"))
            expected.append(whole[rank * n : (rank + 1) * n])
            parts.append(part)
        flat = torch.cat(parts)
        moments.begin_step()
        moments.update(0, torch.nan_to_num(flat), 1.0, 0.99)  # padding is zero in ZeRO's buffers
        out = moments.normalise(0, torch.nan_to_num(flat), hp, torch.float32)
        valid = ~torch.cat(expected).isnan()
        torch.testing.assert_close(out[valid], torch.cat(expected)[valid], rtol=1e-6, atol=0)
        assert torch.equal(out[~valid], torch.zeros(int((~valid).sum())))


def test_moments_refuse_another_models_and_restart_from_none() -> None:
    moments = FactoredMoments([[{"shape": [4, 4], "partition_numel": 16}]], rank=0)
    moments.begin_step()
    moments.update(0, torch.ones(16), 1.0, 0.9)
    with pytest.raises(ValueError, match="hold 3 floats but this rank's model needs 8"):
        moments.load(torch.zeros(3), 5)
    moments.load(None, 5)
    assert moments.updates == 0 and not moments.moments.any()


# ------------------------------------------------------------------------------------------ the device's rule


def test_device_rule_is_torch_sgd_and_adamws_decoupled_decay() -> None:
    gen = torch.Generator().manual_seed(0)
    ref = torch.nn.Parameter(torch.randn(4000, generator=gen))
    opt = torch.optim.SGD([ref], lr=1e-2, weight_decay=0.1, foreach=False)
    master = ref.detach().clone()
    decoupled = ref.detach().clone()
    rule = EFAdafactor()
    for step in range(1, 4):
        u = torch.randn(4000, generator=gen)
        ref.grad = u.clone()
        opt.step()
        hp = device_step_params(StepParams(step=step, lr=1e-2, grad_scale=3.0, weight_decay=0.1, maximize=True))
        rule.apply(master, u.clone(), [], hp)
        decoupled.mul_(1 - 1e-2 * 0.1).add_(u, alpha=-1e-2)
        assert torch.equal(master, ref.detach())
    torch.testing.assert_close(master, decoupled)
    assert rule.state_names == () and rule.bytes_per_element == 4 and rule.name == "ef_adafactor"
    with pytest.raises(ValueError, match="keeps no momentum"):
        EFAdafactor(with_momentum=True)


def _optimizers() -> dict[str, torch.optim.Optimizer]:
    params = [torch.nn.Parameter(torch.zeros(4))]
    return {
        "adamw": torch.optim.AdamW(params, weight_decay=0.1),
        "adam": torch.optim.Adam(params),
        "adam_l2": torch.optim.Adam(params, weight_decay=0.01),
        "sgd": torch.optim.SGD(params, lr=0.1, momentum=0.9),
        "adam_amsgrad": torch.optim.Adam(params, amsgrad=True),
    }


@pytest.mark.parametrize(
    ("name", "rule", "expected"),
    [
        ("adamw", "ef_adafactor", EFAdafactor()),
        ("adam", "ef_adafactor", EFAdafactor()),
        ("adamw", "auto", EFAdam(decoupled_weight_decay=True)),  # opt-in: `auto` keeps EF-Adam
    ],
)
def test_rule_choice(name, rule, expected) -> None:
    optimizer = _optimizers()[name]
    compression = TopKCompression(0.01, rule=rule)
    assert rule_for_group(optimizer, optimizer.param_groups[0], compression) == expected
    assert state_bytes(optimizer, compression) == 4 * expected.bytes_per_element


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("adam_l2", r"not with Adam's L2 `weight_decay=0.01`. Use torch.optim.AdamW"),
        ("sgd", "'ef_adafactor' is for torch.optim.Adam and AdamW"),
        ("adam_amsgrad", "'ef_adafactor' has no `amsgrad`"),
    ],
)
def test_rule_refusals(name, message) -> None:
    optimizer = _optimizers()[name]
    with pytest.raises(ValueError, match=message):
        rule_for_group(optimizer, optimizer.param_groups[0], TopKCompression(0.01, rule="ef_adafactor"))


# ---------------------------------------------------------------------------------------- through the strategy


def _plain_reference(steps: int, ratio: float) -> dict[str, torch.Tensor]:
    """Top-k per parameter with an fp32 error-feedback residual, Adafactor's factored second moment of the dense
    gradient dividing what is sent, then torch's SGD (AdamW's decoupled decay): the codec, the host and the device
    written out in plain PyTorch, on the data `fit` uses."""
    module = LMModule(adamw)
    model: TinyGPT = module.model
    optimizer = torch.optim.SGD(param_groups(model, 0.1), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    beta2 = BETAS[1]
    residual = {p: torch.zeros_like(p) for p in model.parameters()}
    second = {p: (torch.zeros(p.shape[0], 1), torch.zeros(1, p[0].numel())) if p.ndim > 1 else torch.zeros_like(p)
              for p in model.parameters()}  # fmt: skip
    for step, (tokens, targets) in enumerate(token_loader(steps), start=1):
        loss = torch.nn.functional.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten())
        loss.backward()
        for p in model.parameters():
            square = p.grad.square()
            if p.ndim > 1:
                (rows, cols), (r, c) = second[p], _factored(square)
                rows.mul_(beta2).add_(r, alpha=1 - beta2)
                cols.mul_(beta2).add_(c, alpha=1 - beta2)
                v_hat = (rows * cols / rows.sum()).view_as(p)
            else:
                v_hat = second[p].mul_(beta2).add_(square, alpha=1 - beta2)
            acc = residual[p].view(-1).add_(p.grad.view(-1))
            keep = torch.topk(acc.abs(), kept_count(acc.numel(), ratio)).indices
            sent = torch.zeros_like(acc)
            sent[keep] = acc[keep]
            acc[keep] = 0.0
            p.grad = sent.view_as(p) / ((v_hat / (1 - beta2**step)).sqrt() + EPS)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return {f"model.{n}": p.detach().clone() for n, p in model.named_parameters()}


def test_one_percent_matches_plain_pytorch_top_k_adafactor_moments_and_sgd(tmp_path) -> None:
    reference = _plain_reference(STEPS, 0.01)
    trainer, ours = fit(LMModule(adamw), small_strategy(tmp_path, compression=AF), steps=STEPS)
    smart_update = trainer.strategy.smart_update
    assert {type(s.spec.rule) for s in smart_update.backend.shards} == {EFAdafactor}
    assert smart_update.moments is not None and smart_update.moments.updates == STEPS
    errors = max_relative_error(ours, reference)
    assert max(errors.values()) < 1e-5, errors
    initial = {f"model.{n}": p.detach().clone() for n, p in LMModule(adamw).model.named_parameters()}
    moved = max_relative_error(reference, initial)
    assert min(moved.values()) > 1e-4, moved  # every parameter trained, far beyond the tolerance


def test_device_keeps_only_the_master_and_the_link_carries_what_ef_adam_sends(tmp_path) -> None:
    """Exact storage bytes per step (4 B/param each way, a third of Adam's), the link unchanged."""
    runs = {}
    for rule in ("ef_adam", "ef_adafactor"):
        (tmp_path / rule).mkdir()
        compression = {"ratio": 0.01, "rule": rule}
        trainer, _ = fit(LMModule(adamw, dim=64), small_strategy(tmp_path / rule, compression=compression), steps=3)
        shards = trainer.strategy.smart_update.backend.shards
        padded = sum(sum(s.layout.padded_len(k) for k in range(s.layout.num_chunks)) for s in shards)
        tensors = {type(s.spec.rule): s.layout.tensors_per_record for s in shards}
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("smartinf/")}
        runs[rule] = (padded, tensors, metrics)
    (padded, ef_tensors, ef), (padded_af, af_tensors, af) = runs["ef_adam"], runs["ef_adafactor"]
    assert ef_tensors == {EFAdam: 2} and af_tensors == {EFAdafactor: 1} and padded == padded_af
    assert af["smartinf/storage_read_bytes"] == af["smartinf/storage_write_bytes"] == padded * 4
    assert ef["smartinf/storage_read_bytes"] == padded * 8
    assert af["smartinf/link_write_bytes"] == ef["smartinf/link_write_bytes"]
    assert af["smartinf/link_read_bytes"] == ef["smartinf/link_read_bytes"]


def test_bf16_with_clipping_overlap_and_warm_up_trains(tmp_path) -> None:
    """The user's pre-training shape: bf16-mixed, clipping, `overlap_backward` and a dense warm-up. Normalised shards
    are never handed off during backward (their moments need the step's whole gradient)."""
    from lightning_smartinf.lightning.callbacks import CompressionWarmup

    strategy = small_strategy(tmp_path, compression=AF, overlap_backward=True)
    trainer, params = fit(
        LMModule(adamw), strategy, steps=STEPS, precision="bf16-mixed", clip=0.5, callbacks=[CompressionWarmup(3)]
    )
    smart_update = trainer.strategy.smart_update
    assert smart_update.early_kept == smart_update.early_rolled_back == 0
    assert smart_update.moments.updates == STEPS
    initial = {n: p.detach().clone() for n, p in LMModule(adamw).named_parameters()}
    assert min(max_relative_error(params, initial).values()) > 1e-4
    assert all(torch.isfinite(p).all() for p in params.values())


# ------------------------------------------------------------------------------------------------- checkpoints


def test_resume_is_bit_identical(tmp_path) -> None:
    comp = {"strategy_kwargs": {"compression": {"ratio": 0.05, "rule": "ef_adafactor"}}}
    expected = train(tmp_path / "ref", steps=2 * EVERY, **comp)
    checkpoint = tmp_path / "ref" / "ckpts" / f"step={EVERY}.ckpt"
    (manifest,) = checkpoint.rglob("manifest.json")
    assert '"ef_adafactor"' in manifest.read_text()
    resumed = train(tmp_path / "resumed", steps=2 * EVERY, ckpt_path=checkpoint, every=None, **comp)
    assert all(torch.equal(resumed[n], expected[n]) for n in expected)


@pytest.mark.slow
def test_resume_from_ef_adam_converts_and_so_does_the_way_back(tmp_path, caplog) -> None:
    """EF-Adam's state loads into EF-Adafactor (its second moment dropped, the host's starting fresh). EF-Adafactor's
    loads into dense AdamW, whose moments start from zero on the devices: their bias correction restarts with them
    (else the first steps would be up to 1 / sqrt(1 - beta2) times too large)."""
    ef_adam = {"compression": {"ratio": 0.05, "rule": "ef_adam"}}
    ef_adafactor = {"compression": {"ratio": 0.05, "rule": "ef_adafactor"}}
    train(tmp_path / "ef", steps=EVERY, strategy_kwargs=ef_adam)
    saved = tmp_path / "ef" / "ckpts" / f"step={EVERY}.ckpt"
    with caplog.at_level("WARNING", logger="lightning_smartinf.core.format.state_files"):
        resumed = train(tmp_path / "af", steps=2 * EVERY, ckpt_path=saved, strategy_kwargs=ef_adafactor)
    assert caplog.text.count("converting it to ef_adafactor") == 1
    assert all(torch.isfinite(p).all() for p in resumed.values())
    loaded: list = []  # the state that resume made, saved before any step: the masters as saved, nothing else
    train(tmp_path / "loaded", steps=EVERY, ckpt_path=saved, every=None, trainers=loaded, strategy_kwargs=ef_adafactor)
    loaded[0].save_checkpoint(tmp_path / "converted.ckpt")
    assert_converted(saved, tmp_path / "converted.ckpt")
    assert loaded[0].strategy.smart_update.moments.updates == 0  # the host's moments start fresh

    trainers: list = []
    back = tmp_path / "af" / "ckpts" / f"step={2 * EVERY}.ckpt"
    with pytest.warns(UserWarning, match="bias-corrected from step 1"):
        dense = train(
            tmp_path / "dense",
            steps=3 * EVERY,
            ckpt_path=back,
            strategy_kwargs={"compression": None},
            trainers=trainers,
        )
    # Adam's bias correction counts the steps since the resume, not since the start.
    assert set(trainers[-1].strategy.smart_update.group_steps.values()) == {EVERY}
    assert all(torch.isfinite(p).all() for p in dense.values())
    loaded = []  # both Adam moments start at zero on the devices
    with pytest.warns(UserWarning, match="bias-corrected from step 1"):
        train(tmp_path / "back", steps=2 * EVERY, ckpt_path=back, every=None, trainers=loaded)
    loaded[0].save_checkpoint(tmp_path / "dense.ckpt")
    assert_converted(back, tmp_path / "dense.ckpt")


# ---------------------------------------------------------------------------------------------------- bad input


def test_ef_adafactor_without_error_feedback_is_refused_at_construction() -> None:
    with pytest.raises(MisconfigurationException, match="'ef_adafactor' needs `error_feedback=True`"):
        SmartInfinityStrategy(compression={"ratio": 0.01, "rule": "ef_adafactor", "error_feedback": False})
    with pytest.raises(ValueError, match="'ef_adafactor' needs `error_feedback=True`"):
        TopKCompression(0.01, error_feedback=False, rule="ef_adafactor")


def test_adam_with_l2_decay_is_refused_before_training(tmp_path) -> None:
    def adam_l2(model):
        return torch.optim.Adam(model.parameters(), weight_decay=0.01), None

    with pytest.raises(MisconfigurationException, match="Adam's L2 `weight_decay=0.01`") as info:
        fit(LMModule(adam_l2), small_strategy(tmp_path, compression=AF), steps=1)
    assert "rule='ef_adam'" in str(info.value)
    assert not list(tmp_path.rglob("*.state"))  # refused before any device state was written


def test_sgd_gets_its_own_rule_refused(tmp_path) -> None:
    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=0.1), None

    with pytest.raises(MisconfigurationException, match="is for torch.optim.Adam and AdamW"):
        fit(LMModule(sgd), small_strategy(tmp_path, compression=AF), steps=1)
    assert not list(tmp_path.rglob("*.state"))
    assert SGD() != EFAdafactor() and Adam() != EFAdafactor()
