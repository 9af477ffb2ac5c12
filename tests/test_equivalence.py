"""SmartUpdate trains to the same parameters as plain torch.optim (fp32) and as stock DeepSpeed (bf16)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers.models import LMModule, adamw_factory, fit, max_relative_error, param_groups, token_loader

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.lightning.cpu_support import DeepSpeedCPUStrategy

STEPS = 20


adamw_cosine = adamw_factory(betas=(0.9, 0.95), cosine_steps=STEPS, eta_min=3e-4)


# The devices run torch's fused CPU kernel for a fused optimizer: the reference is fused too.
adamw_fused = adamw_factory(betas=(0.9, 0.95), fused=True)


def sgd_momentum(model: torch.nn.Module):
    groups = param_groups(model, 1e-3)
    groups[1]["momentum"] = 0.5  # per-group momentum must reach the device too
    optimizer = torch.optim.SGD(groups, lr=5e-2, momentum=0.9, dampening=0.1, nesterov=False)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)


def sgd_nesterov(model: torch.nn.Module):
    return torch.optim.SGD(param_groups(model, 1e-3), lr=5e-2, momentum=0.9, nesterov=True), None


def adam_amsgrad(model: torch.nn.Module):
    # L2 weight decay (Adam's own) with AMSGrad's running maximum of the second moment: a third state on the devices.
    return torch.optim.Adam(param_groups(model, 1e-2), lr=3e-3, betas=(0.9, 0.95), amsgrad=True), None


def adamw_maximize(model: torch.nn.Module):
    # Gradient ascent on the loss's negative: the devices step against the gradient's sign.
    return torch.optim.AdamW(param_groups(model, 0.1), lr=3e-3, maximize=True), None


def adagrad(model: torch.nn.Module):
    optimizer = torch.optim.Adagrad(param_groups(model, 1e-3), lr=5e-2, lr_decay=1e-3, initial_accumulator_value=0.1)
    return optimizer, None


@pytest.mark.parametrize(
    ("make_optimizer", "accumulate", "clip"),
    [
        pytest.param(adamw_cosine, 2, 0.5, id="adamw-cosine-clip-accumulate"),
        pytest.param(adamw_fused, 1, None, id="adamw-fused"),
        pytest.param(sgd_momentum, 1, None, id="sgd-momentum-steplr"),
        pytest.param(sgd_nesterov, 2, 1.0, id="sgd-nesterov-clip-accumulate"),
        pytest.param(adagrad, 1, 0.5, id="adagrad-clip"),
        pytest.param(adam_amsgrad, 2, 0.5, id="adam-amsgrad-clip-accumulate"),
        pytest.param(adamw_maximize, 1, None, id="adamw-maximize"),
        pytest.param(adamw_cosine, 1, 1.0, id="adamw-cosine-clip-sometimes"),
    ],
)
def test_fp32_matches_torch_optim(tmp_path, make_optimizer, accumulate, clip):
    _, reference = fit(LMModule(make_optimizer), "auto", steps=STEPS, accumulate=accumulate, clip=clip)
    strategy = SmartInfinityStrategy(storage_paths=[tmp_path], sub_group_size=3000, chunk_size=2048, buffer_count=3)
    trainer, ours = fit(LMModule(make_optimizer), strategy, steps=STEPS, accumulate=accumulate, clip=clip)

    assert trainer.global_step == STEPS
    errors = max_relative_error(ours, reference)
    assert max(errors.values()) < 1e-5, errors
    # The comparison is meaningful: training moved every parameter far beyond the tolerance.
    initial = {n: p.detach().clone() for n, p in LMModule(make_optimizer).named_parameters()}
    assert min(max_relative_error(reference, initial).values()) > 1e-3
    # Where clipping never fires, every step handed every sub-group to the devices during backward and kept it.
    # Where it fires (on every step of these runs; a hand-off cannot know it in advance), the first step's
    # hand-offs were rolled back and redone, and from then on the steps updated once, after backward. Both paths
    # ran; neither changed the result.
    optimizer = trainer.strategy.deepspeed_engine.optimizer
    smart_update, groups = optimizer.smart_update, len(optimizer.fp16_groups)
    if smart_update.early_rolled_back == 0:
        assert smart_update.early_kept == STEPS * groups
    elif smart_update.early_kept == 0:
        assert clip is not None and smart_update.early_rolled_back == groups
        assert not smart_update.speculating
    else:  # clipping fired on some steps: a miss, then a pause of the hand-offs twice as long as the last
        assert smart_update.early_rolled_back in (groups, 2 * groups, 3 * groups)


class CountSteps(L.Callback):
    """Counts what happens at each optimizer step: the updates the devices made, Lightning's step hook and the
    learning rate the scheduler left."""

    def __init__(self) -> None:
        self.hooks = 0
        self.lrs: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.hooks += 1

    def on_train_batch_end(self, trainer, pl_module, *_) -> None:
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def test_an_epoch_whose_last_accumulation_window_is_short_steps_as_torch_does(tmp_path):
    """Seven batches an epoch, three accumulated: Lightning over plain PyTorch steps after batches 3, 6 and 7 of
    each epoch, the last step over two micro-batches. DeepSpeed's own count of micro-batches carries that window into
    the next epoch instead (two micro-batches, then one), and every later window with it; Lightning's step count,
    its scheduler and its checkpoints then fall between the updates, and a checkpoint misses the gradients held."""
    steps, accumulate, batches = 6, 3, 7  # two epochs
    reference_steps = CountSteps()
    _, reference = fit(
        LMModule(adamw_cosine), "auto", steps=steps, accumulate=accumulate, clip=0.5, batches=batches,
        callbacks=[reference_steps],
    )  # fmt: skip
    strategy = SmartInfinityStrategy(storage_paths=[tmp_path], sub_group_size=3000, chunk_size=2048, buffer_count=3)
    our_steps = CountSteps()
    trainer, ours = fit(
        LMModule(adamw_cosine), strategy, steps=steps, accumulate=accumulate, clip=0.5, batches=batches,
        callbacks=[our_steps],
    )  # fmt: skip

    assert trainer.global_step == steps and trainer.current_epoch == 2
    smart_update = trainer.strategy.deepspeed_engine.optimizer.smart_update
    assert set(smart_update.group_steps.values()) == {steps}  # the devices updated once per Lightning step
    assert our_steps.hooks == reference_steps.hooks == steps  # `on_before_optimizer_step`: once per step too
    assert our_steps.lrs == reference_steps.lrs
    errors = max_relative_error(ours, reference)
    assert max(errors.values()) < 1e-5, errors


class HalveLrBeforeStep(L.Callback):
    """Changes the learning rate after backward, before the step: what a hand-off during backward cannot see."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        for group in optimizer.param_groups:
            group["lr"] *= 0.5


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_hyperparameters_changed_after_backward_reach_the_update(tmp_path, overlap):
    _, reference = fit(LMModule(sgd_nesterov), "auto", steps=6, callbacks=[HalveLrBeforeStep()])
    strategy = SmartInfinityStrategy(
        storage_paths=[tmp_path], sub_group_size=3000, chunk_size=2048, buffer_count=3, overlap_backward=overlap
    )
    trainer, ours = fit(LMModule(sgd_nesterov), strategy, steps=6, callbacks=[HalveLrBeforeStep()])
    errors = max_relative_error(ours, reference)
    assert max(errors.values()) < 1e-5, errors
    optimizer = trainer.strategy.deepspeed_engine.optimizer
    assert optimizer.smart_update.early_kept == 0
    # The first step's hand-offs missed (another learning rate): no step after it handed off.
    assert optimizer.smart_update.early_rolled_back == (len(optimizer.fp16_groups) if overlap else 0)
    # Without overlap there is no second copy of the state.
    assert len(list(tmp_path.rglob("*.slot1.state"))) == (len(optimizer.fp16_groups) if overlap else 0)


def test_bf16_matches_deepspeed_stage3_cpu_offload(tmp_path):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    def host_adamw(model):
        return DeepSpeedCPUAdam(param_groups(model, 0.1), lr=3e-3, betas=(0.9, 0.95), adamw_mode=True), None

    def device_adamw(model):
        return torch.optim.AdamW(param_groups(model, 0.1), lr=3e-3, betas=(0.9, 0.95)), None

    # Lightning's `deepspeed_stage_3_offload` preset: same engine, update on the host by DeepSpeed's CPU Adam.
    baseline = DeepSpeedCPUStrategy(stage=3, offload_optimizer=True, offload_parameters=True)
    _, reference = fit(LMModule(host_adamw), baseline, steps=STEPS, precision="bf16-mixed", clip=1.0)
    strategy = SmartInfinityStrategy(storage_paths=[tmp_path], sub_group_size=3000, offload_parameters=True)
    _, ours = fit(LMModule(device_adamw), strategy, steps=STEPS, precision="bf16-mixed", clip=1.0)

    # Both return bf16 parameters rounded from fp32 masters; masters may differ in the last bits because
    # the link carries bf16 gradients, so allow a few bf16 ulps (2**-8 relative each).
    errors = max_relative_error(ours, reference)
    assert max(errors.values()) < 2e-2, errors
    mean_abs = sum(float((ours[n] - reference[n]).abs().mean()) for n in ours) / len(ours)
    assert mean_abs < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize(
    ("precision", "compression", "accumulate"),
    [("32-true", None, 2), ("bf16-mixed", 0.05, 1)],
    ids=["fp32-dense-accumulate", "bf16-topk"],
)
def test_gradient_buffer_on_the_accelerator_changes_nothing(tmp_path, precision, compression, accumulate):
    """``gradient_buffer="accelerator"`` rebuilds ZeRO's per-parameter gradient views over a new buffer (on a GPU, in
    its memory; here, host memory again): every gradient must still land where the devices read it."""
    results = {}
    for where in ("host", "accelerator"):
        strategy = SmartInfinityStrategy(
            storage_paths=[tmp_path / where],
            sub_group_size=3000,
            chunk_size=2048,
            buffer_count=3,
            compression=compression,
            gradient_buffer=where,
        )
        trainer, results[where] = fit(
            LMModule(adamw_cosine), strategy, steps=6, accumulate=accumulate, precision=precision, clip=0.5
        )
        optimizer = trainer.strategy.deepspeed_engine.optimizer
        if compression is not None:
            assert optimizer.smart_update.residual.device == optimizer.grad_partitions_flat_buffer.device
    for name, value in results["host"].items():
        assert torch.equal(results["accelerator"][name], value), name
    initial = {n: p.detach().float() for n, p in LMModule(adamw_cosine).named_parameters()}
    assert min(max_relative_error(results["host"], initial).values()) > 1e-3


def test_gradient_buffer_placement_without_an_accelerator():
    from lightning_smartinf.zero.gradient_buffer import gradient_buffer_device

    # DeepSpeed's CPU accelerator: "auto" and "host" leave ZeRO's buffer alone; "accelerator" rebuilds it in host
    # memory (the code path a GPU takes), whatever its size.
    assert gradient_buffer_device("auto", 1 << 40) is None
    assert gradient_buffer_device("host", 1) is None
    assert gradient_buffer_device("accelerator", 1 << 40) == "cpu"


class FrozenEmbedding(LMModule):
    """The token embedding frozen (``requires_grad=False``), as fine-tuning often does; its optimizer takes the
    trainable parameters only. Validation reports the loss."""

    def __init__(self) -> None:
        super().__init__(adamw_cosine)
        self.model.embed.weight.requires_grad_(False)

    def configure_optimizers(self):
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=3e-3, betas=(0.9, 0.95))
        return optimizer

    def validation_step(self, batch, batch_idx):
        tokens, targets = batch
        loss = torch.nn.functional.cross_entropy(self.model(tokens).float().flatten(0, 1), targets.flatten())
        self.log("val_loss", loss)


def test_frozen_parameters_train_evaluate_and_export(tmp_path):
    """Frozen parameters have no state on the devices: training matches torch.optim with them unchanged, a
    checkpoint evaluates to the plain module's validation loss, and the export holds them too (from the partitions
    DeepSpeed saves of them)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_smartinf.commands.export import consolidate_fp32_state_dict

    steps = 6
    _, reference = fit(FrozenEmbedding(), "auto", steps=steps)
    saves = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True)
    strategy = SmartInfinityStrategy(storage_paths=[tmp_path / "ssd"], sub_group_size=3000, chunk_size=2048)
    trainer, ours = fit(FrozenEmbedding(), strategy, steps=steps, callbacks=[saves])
    errors = max_relative_error(ours, reference)
    assert max(errors.values()) < 1e-5, errors
    initial = FrozenEmbedding().model.embed.weight.detach()
    assert torch.equal(ours["model.embed.weight"], initial)
    assert trainer.strategy.smart_update.traffic_snapshot().link_write_bytes > 0

    exported = consolidate_fp32_state_dict(tmp_path / "ckpts" / "last.ckpt")
    assert exported.keys() == ours.keys()
    assert torch.equal(exported["model.embed.weight"], initial)
    errors = max_relative_error(exported, ours)
    assert max(errors.values()) == 0.0, errors

    module = FrozenEmbedding()
    (validated,) = L.Trainer(
        accelerator="cpu", strategy=SmartInfinityStrategy(storage_paths=[tmp_path / "eval"]), logger=False
    ).validate(module, token_loader(2), ckpt_path=tmp_path / "ckpts" / "last.ckpt", verbose=False)
    plain = LMModule(adamw_cosine)
    plain.load_state_dict({k: v for k, v in exported.items()}, strict=True)
    with torch.no_grad():
        losses = [
            torch.nn.functional.cross_entropy(plain.model(t).float().flatten(0, 1), y.flatten())
            for t, y in token_loader(2)
        ]
    assert validated["val_loss"] == pytest.approx(float(torch.stack(losses).mean()), rel=1e-5)


class AccumulationProbe(L.Callback):
    """Records every gradient partition ZeRO adds into its buffer on the first optimizer step's micro-batches, and
    the buffer as the step finds it: the sum a torch reference computes of the same 16-bit gradients in fp64."""

    def __init__(self) -> None:
        self.parts: dict[int, list[torch.Tensor]] = {}
        self.buffers: dict[int, torch.Tensor] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        optimizer = trainer.strategy.deepspeed_engine.optimizer
        original = optimizer.partition_grads

        def partition_grads(params, grad_partitions):  # noqa: ANN001, ANN202 - ZeRO's, recorded
            if trainer.global_step == 0:
                for param, part in zip(params, grad_partitions):
                    self.parts.setdefault(param.ds_id, []).append(part.detach().double().flatten().clone())
            return original(params, grad_partitions)

        optimizer.partition_grads = partition_grads

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == 0:
            zero = trainer.strategy.deepspeed_engine.optimizer
            views = zero._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition
            self.buffers = {i: views[i][: parts[0].numel()].double().clone() for i, parts in self.parts.items()}

    def error(self) -> float:
        """Largest |buffer - exact sum| over the largest |exact sum|, over every parameter."""
        worst = 0.0
        for i, parts in self.parts.items():
            exact = torch.stack(parts).sum(0)
            worst = max(worst, float((self.buffers[i] - exact).abs().max() / exact.abs().max().clamp_min(1e-30)))
        return worst


def test_sixteen_micro_batches_accumulate_in_fp32(tmp_path):
    """bf16 training accumulating 16 micro-batches: ZeRO-3 adds their gradients in fp32 (set for every 16-bit run
    that accumulates), so the gradient the step sends is the exact sum of the 16 bf16 gradients to fp32's precision
    (measured here against their sum in fp64). Added in bf16, DeepSpeed's default, it is off by about bf16's
    precision (1/256), and small contributions vanish beside large ones."""
    errors = {}
    for dtype in ("fp32", "bf16"):
        config = None if dtype == "fp32" else {"data_types": {"grad_accum_dtype": "bf16"}}
        strategy = SmartInfinityStrategy(
            storage_paths=[tmp_path / dtype], sub_group_size=3000, chunk_size=2048, config=config
        )
        probe = AccumulationProbe()
        trainer, _ = fit(
            LMModule(adamw_cosine), strategy, steps=1, accumulate=16, precision="bf16-mixed", callbacks=[probe]
        )
        optimizer = trainer.strategy.deepspeed_engine.optimizer
        assert optimizer.grad_partitions_flat_buffer.dtype == (torch.float32 if dtype == "fp32" else torch.bfloat16)
        assert probe.parts and all(len(parts) == 16 for parts in probe.parts.values())
        errors[dtype] = probe.error()
    assert errors["fp32"] < 1e-6, errors
    assert errors["bf16"] > 1e-3, errors


class ManualClipping(LMModule):
    """Manual optimization as Lightning documents it: ``manual_backward``, ``clip_gradients`` by norm, ``step``;
    clipping only on even steps, so a step without it must not inherit the last step's."""

    def __init__(self, algorithm: str = "norm") -> None:
        super().__init__(adamw_cosine)
        self.automatic_optimization = False
        self.algorithm = algorithm

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        tokens, targets = batch
        loss = torch.nn.functional.cross_entropy(self.model(tokens).float().flatten(0, 1), targets.flatten())
        optimizer.zero_grad()
        self.manual_backward(loss)
        if batch_idx % 2 == 0:
            self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm=self.algorithm)
        optimizer.step()


class ManualAccumulation(LMModule):
    """Manual optimization accumulating as Lightning documents it: ``manual_backward`` of the loss over ``N`` on
    every batch, ``step`` and ``zero_grad`` on every ``N``-th. The forwards before a step must read the parameters of
    the last step, whatever the backward before them handed to the devices."""

    N = 3

    def __init__(self) -> None:
        super().__init__(adamw_cosine)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        tokens, targets = batch
        loss = torch.nn.functional.cross_entropy(self.model(tokens).float().flatten(0, 1), targets.flatten())
        self.manual_backward(loss / self.N)
        if (batch_idx + 1) % self.N == 0:
            optimizer.step()
            optimizer.zero_grad()


def test_manual_accumulation_trains_as_torch_does(tmp_path):
    steps = 6
    _, reference = fit(ManualAccumulation(), "auto", steps=steps, batches=steps * ManualAccumulation.N)
    strategy = SmartInfinityStrategy(storage_paths=[tmp_path], sub_group_size=3000)
    trainer, ours = fit(ManualAccumulation(), strategy, steps=steps, batches=steps * ManualAccumulation.N)

    assert trainer.global_step == steps
    errors = max_relative_error(ours, reference)
    assert max(errors.values()) < 1e-5, errors
    # A backward that no step follows hands off once, and then not for twice as many steps as the last time.
    smart_update = trainer.strategy.deepspeed_engine.optimizer.smart_update
    assert smart_update.early_rolled_back > 0


class HookClipping(LMModule):
    """Automatic optimization with ``configure_gradient_clipping`` overridden: a clipping norm that changes."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(
            optimizer, gradient_clip_val=0.02 * (1 + self.global_step % 3), gradient_clip_algorithm="norm"
        )


@pytest.mark.parametrize("module", [ManualClipping, lambda: HookClipping(adamw_cosine)], ids=["manual", "hook"])
def test_clip_gradients_clips_as_torch_does(tmp_path, module, recwarn):
    """``LightningModule.clip_gradients`` (manual optimization, or an overridden ``configure_gradient_clipping``)
    clips the step as ``clip_grad_norm_`` does with plain torch; DeepSpeed's plugin drops it silently."""
    _, reference = fit(module(), "auto", steps=8)
    _, unclipped = fit(LMModule(adamw_cosine), "auto", steps=8)
    trainer, ours = fit(module(), SmartInfinityStrategy(storage_paths=[tmp_path], sub_group_size=3000), steps=8)

    errors = max_relative_error(ours, reference)
    assert max(errors.values()) < 1e-5, errors
    assert max(max_relative_error(unclipped, reference).values()) > 1e-3  # the clipping fired
    assert not [w for w in recwarn if "will not actually clip gradients" in str(w.message)]


def test_clip_gradients_by_value_is_refused_with_the_way_out(tmp_path):
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException, match="gradient_clip_algorithm='norm'"):
        fit(ManualClipping("value"), SmartInfinityStrategy(storage_paths=[tmp_path], sub_group_size=3000), steps=2)
