"""The GPU suite: one check per sub-command, each in a fresh process (DeepSpeed picks its accelerator once).

``python tests/cuda/gpu_checks.py CHECK --device cuda --out DIR`` runs one check and exits non-zero on failure; what
it measured goes to ``DIR/CHECK.json`` (and ``DIR/CHECK.rank1.json`` for a second rank).

``python tests/cuda/gpu_checks.py all --out DIR`` runs every check a machine can run, each in its own process, and
prints a table (check, result, seconds, peak GPU memory per rank) followed by what to paste into a bug report. It is
what a user with a GPU runs; ``pytest -m cuda tests/cuda`` runs the same checks one test each.

Most checks also run with ``--device cpu``: the same Lightning and DeepSpeed code paths with host tensors, which
proves the checks themselves on a machine without a GPU (``tests/cuda/test_gpu.py``). DeepSpeed's CPU accelerator
has no fp16, and the accelerator tier needs CUDA: those checks are CUDA-only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.models import CaptureParams, LMModule, adamw_factory, fit, max_relative_error, token_loader  # noqa: E402

from lightning_smartinf import SmartInfinityStrategy  # noqa: E402
from lightning_smartinf.activations import SavedTensorOffloader  # noqa: E402
from lightning_smartinf.activations.spill import SPILL_FILE_NAME  # noqa: E402
from lightning_smartinf.core.accelerator import AcceleratorCopies, on_cuda  # noqa: E402
from lightning_smartinf.core.controller import SmartUpdateController  # noqa: E402

STEPS = 8
#: fp32 on a GPU: cuBLAS may pick other reduction orders inside ZeRO's gathered layers than in a plain module.
CUDA_TOLERANCE = 1e-4
#: GPU cycles each parameter copy of a device worker waits before it starts in `overlap_backward` (about 50 ms).
DELAY_CYCLES = 50_000_000


adamw = adamw_factory(betas=(0.9, 0.95), cosine_steps=STEPS)


def strategy(out: Path, name: str, ranks: int = 1, **kwargs: Any) -> SmartInfinityStrategy:
    """The checks' strategy, with one storage path per rank under ``out/name`` (ranks never share one)."""
    kwargs = {"sub_group_size": 3000, "chunk_size": 2048, "buffer_count": 4, **kwargs}
    paths = [out / name] if ranks == 1 else [out / name / f"r{rank}" for rank in range(ranks)]
    (out / name).mkdir(parents=True, exist_ok=True)
    return SmartInfinityStrategy(storage_paths=paths, **kwargs)


def tolerance(device: str) -> float:
    return CUDA_TOLERANCE if device == "cuda" else 1e-5


def identical(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(ours[name].cpu(), value.cpu()), f"{name} differs"


# ------------------------------------------------------------------------------------------------ one GPU


def equivalence(device: str, out: Path) -> dict:
    """fp32 AdamW with a cosine schedule and clipping matches ``torch.optim``, with either gradient buffer."""
    _, reference = fit(LMModule(adamw), "auto", steps=STEPS, clip=0.5, accelerator=device)
    report = {}
    for where in ("accelerator", "host"):
        trainer, ours = fit(
            LMModule(adamw), strategy(out, where, gradient_buffer=where), steps=STEPS, clip=0.5, accelerator=device
        )
        buffer = trainer.strategy.deepspeed_engine.optimizer.grad_partitions_flat_buffer
        assert buffer.device.type == (device if where == "accelerator" else "cpu"), (where, buffer.device)
        error = max(max_relative_error(ours, reference).values())
        assert error < tolerance(device), (where, error)
        report[where] = {"max_relative_error": error, "link": trainer.strategy.traffic.as_dict()}
    return report


def fp16_compression(device: str, out: Path) -> dict:
    """fp16 with a dynamic loss scale that starts far too high, and top-k with error feedback: overflowing steps are
    skipped (none sends inf), the scale comes down, and training moves every parameter to finite values."""
    initial = {n: p.detach().float().clone() for n, p in LMModule(adamw).named_parameters()}
    compressed = strategy(
        out, "fp16", compression={"ratio": 0.05, "error_feedback": True}, initial_scale_power=30, loss_scale_window=4
    )
    trainer, ours = fit(LMModule(adamw), compressed, steps=3 * STEPS, precision="16-mixed", accelerator=device)
    optimizer = trainer.strategy.deepspeed_engine.optimizer
    residual = optimizer.smart_update.residual
    assert residual is not None and residual.device == optimizer.grad_partitions_flat_buffer.device
    assert torch.isfinite(residual).all()
    assert all(torch.isfinite(p).all() for p in ours.values())
    moved = min(max_relative_error(ours, initial).values())
    assert moved > 1e-4, moved
    scale = float(optimizer.loss_scale)
    assert scale < 2.0**30, "steps overflowed and were skipped"
    return {"final_loss_scale": scale, "min_relative_change": moved, "kept": list(optimizer.smart_update.last_kept)}


class DelayedLinks:
    """Every parameter copy of a device worker into GPU memory starts ``DELAY_CYCLES`` late on the link's stream.

    If the host returned from a step before those copies landed, a read right after the step would see the old
    parameters: the delay makes that certain instead of a matter of luck.
    """

    def __enter__(self) -> DelayedLinks:
        self._put = put = AcceleratorCopies.put

        def delayed(link: AcceleratorCopies, dst: torch.Tensor, src: torch.Tensor) -> None:
            if on_cuda(dst):
                with torch.cuda.stream(link._streams.stream(dst.device, "out")):
                    torch.cuda._sleep(DELAY_CYCLES)
            put(link, dst, src)

        AcceleratorCopies.put = delayed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        AcceleratorCopies.put = self._put  # type: ignore[method-assign]


class CheckParametersLanded(L.Callback):
    """Right after every step, the parameter partitions the model reads hold exactly the devices' masters: the
    copies from the device workers (on their own, delayed stream) finished before the step returned."""

    def __init__(self) -> None:
        self.checked = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        smart_update = trainer.strategy.smart_update
        for i in range(len(smart_update.sub_groups)):
            params = smart_update.partitions.params(i)
            seen = params.cpu()  # on the training stream, which nothing made wait for the link's
            master = torch.empty(params.numel(), dtype=torch.float32)
            smart_update.backend.read_master(i, master)
            smart_update.backend.wait()
            assert torch.equal(seen, master.to(params.dtype)), f"sub-group {i} after step {batch_idx}"
            self.checked += 1


def overlap_backward(device: str, out: Path) -> dict:
    """Parameters in accelerator memory, sub-groups handed off during backward: each update's parameters have
    landed when the step returns (checked right after it, with the copies delayed), and the result is the plain one."""
    _, reference = fit(LMModule(adamw), "auto", steps=STEPS, accelerator=device)
    check = CheckParametersLanded()
    with DelayedLinks() if device == "cuda" else nullcontext():
        trainer, ours = fit(
            LMModule(adamw),
            strategy(out, "overlap", overlap_backward=True, offload_parameters=False),
            steps=STEPS,
            callbacks=[check],
            accelerator=device,
        )
    smart_update = trainer.strategy.smart_update
    assert smart_update.early_kept > 0, "sub-groups were handed off during backward and kept"
    assert check.checked == STEPS * len(smart_update.sub_groups), check.checked
    error = max(max_relative_error(ours, reference).values())
    assert error < tolerance(device), error
    return {"early_kept": smart_update.early_kept, "checked": check.checked, "max_relative_error": error}


class Stack(nn.Module):
    def __init__(self, dim: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)) for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def activations(device: str, out: Path) -> dict:
    """Forward and backward on the user's own stream, every offloaded activation written before backward starts:
    each is read back from its file onto a side stream and handed to backward (``record_stream``), and the gradients
    are bitwise those without offload; no file stays."""
    torch.manual_seed(0)
    model = Stack().to(device)
    x = torch.randn(64, 256, device=device)
    user_stream = torch.cuda.Stream() if device == "cuda" else None
    if user_stream is not None:
        user_stream.wait_stream(torch.cuda.current_stream())  # the model and inputs were made on the default stream

    def grads(offloader: SavedTensorOffloader | None) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with torch.cuda.stream(user_stream) if user_stream is not None else nullcontext():
            if offloader is None:
                model(x).square().mean().backward()
            else:
                with offloader:
                    loss = model(x).square().mean()
                    offloader.settle_writes()  # every offloaded activation is in its file, none in memory
                    loss.backward()
        if user_stream is not None:
            user_stream.synchronize()
        return {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    reference = grads(None)
    (out / "act").mkdir(parents=True, exist_ok=True)
    offloader = SavedTensorOffloader([out / "act"], threshold_bytes=4096, keep_last=1).attach(model)
    grads(offloader)  # warm-up: staging buffers and side streams exist from here on
    before = dataclasses.replace(offloader.stats)
    ours = grads(offloader)
    stats = offloader.stats
    files = offloader.files()
    run_dirs = offloader.run_dirs
    offloader.close()
    identical(ours, reference)
    offloaded = stats.tensors_offloaded - before.tensors_offloaded
    assert offloaded > 0 and stats.resident_bytes == 0, stats
    assert stats.forwarded == before.forwarded, "a write was still pending when backward used its tensor"
    assert stats.bytes_read - before.bytes_read == stats.bytes_written - before.bytes_written > 0, stats
    # Between micro-batches only the spill files remain (no record holds bytes); after close, nothing.
    assert {f.name for f in files} <= {SPILL_FILE_NAME}, files
    assert not any(d.exists() for d in run_dirs), run_dirs
    return {"offloaded": offloaded, "bytes_read": stats.bytes_read - before.bytes_read}


PARAMS_DIM = 512  # the MLP weights' partitions (512 x 1024 in bf16) reach DeepSpeed's 1 MiB and go to storage


adamw_plain = adamw_factory()


def params_on_storage(device: str, out: Path) -> dict:
    """``offload_parameters="storage"`` with the gradients in host memory (a file beside the parameters): set-up,
    accumulation and clipping train bit for bit like the parameters in pinned host memory."""
    common = {"steps": 3, "accumulate": 2, "precision": "bf16-true", "clip": 0.5, "accelerator": device}
    _, reference = fit(
        LMModule(adamw_plain, dim=PARAMS_DIM), strategy(out, "in-memory", offload_parameters=True), **common
    )
    trainer, ours = fit(
        LMModule(adamw_plain, dim=PARAMS_DIM),
        strategy(out, "on-storage", offload_parameters="storage", gradient_buffer="host"),
        **common,
    )
    identical(ours, reference)
    traffic = trainer.strategy.traffic
    assert traffic.param_read_bytes > 0 and traffic.param_write_bytes > 0, traffic
    optimizer = trainer.strategy.deepspeed_engine.optimizer
    assert optimizer.gradient_file is not None, "the gradients live in a file on the storage path"
    report: dict[str, Any] = {"param_read_bytes": traffic.param_read_bytes}
    if device == "cuda":
        assert optimizer.gradient_ring is not None, "backward's partitions reach the file through pinned staging"
        report["host_memory_stats"] = {
            k: v for k, v in torch.cuda.host_memory_stats().items() if k.startswith(("allocated_bytes", "reserved"))
        }
    return report


def compression_host_buffer(device: str, out: Path) -> dict:
    """Top-k with error feedback where the gradients wait in host memory, against the same in accelerator memory:
    the same selection's traffic, and the same parameters within the device's rounding."""
    runs = {}
    for where in ("accelerator", "host"):
        trainer, params = fit(
            LMModule(adamw),
            strategy(out, f"topk-{where}", gradient_buffer=where, compression={"ratio": 0.1, "error_feedback": True}),
            steps=STEPS,
            precision="bf16-mixed",
            accelerator=device,
        )
        runs[where] = (trainer.strategy.traffic.link_write_bytes, params, trainer.strategy.smart_update.last_kept)
    assert runs["host"][0] == runs["accelerator"][0], (runs["host"][0], runs["accelerator"][0])
    assert runs["host"][2] == runs["accelerator"][2]
    # Bit for bit: the selection breaks ties by position, not as each device's topk does (0.03 apart on an H100).
    error = max(max_relative_error(runs["host"][1], runs["accelerator"][1]).values())
    assert error == 0.0, error
    return {"link_write_bytes": runs["host"][0], "max_relative_error": error}


def half_in_gpu_memory(device: str, out: Path, **kwargs: Any) -> Any:
    """Train with all of the state on the storage path, then with half of it in GPU memory (``kwargs``: the
    strategy's other settings, the same in both): the same parameters within rounding; returns the second run's
    traffic, which counted the GPU shards apart."""
    steps, results, trainers = 6, {}, {}
    for name, budget in (("all_on_storage", None), ("half_in_memory", "half")):
        if budget == "half":  # of the state the first run read per step (the whole model's state takes 0.3 MiB)
            budget = trainers["all_on_storage"].strategy.traffic.storage_read_bytes // steps // 2
        trainers[name], results[name] = fit(
            LMModule(adamw),
            strategy(out, f"{name}-{kwargs.get('state_precision', 'fp32')}", state_accelerator_budget=budget, **kwargs),
            steps=steps,
            precision="bf16-mixed",
            accelerator=device,
        )
    for name, value in results["all_on_storage"].items():
        torch.testing.assert_close(results["half_in_memory"][name], value, rtol=1e-3, atol=1e-3)
    traffic = trainers["half_in_memory"].strategy.traffic
    assert traffic.accelerator_read_bytes > 0 and traffic.storage_read_bytes > 0, traffic
    return traffic


def accelerator_tier(device: str, out: Path) -> dict:
    """Half the state in GPU memory against all of it on the storage path: the same training within rounding, the
    GPU shards' traffic counted apart; a budget beyond the GPU's free memory is refused at set-up, on its own GPU."""
    traffic = half_in_gpu_memory(device, out)
    try:
        fit(LMModule(adamw), strategy(out, "too-much", state_accelerator_budget="100TiB"), steps=1, accelerator=device)
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        assert "MiB of memory free on cuda:" in str(exc), exc
    else:
        raise AssertionError("a 100 TiB accelerator budget was accepted")
    return {"accelerator_read_bytes": traffic.accelerator_read_bytes}


def accelerator_formats(device: str, out: Path) -> dict:
    """The state in bf16 and int8 in GPU memory: stored and loaded there byte for byte as the host's plain-torch
    reference of each format (values over forty orders of magnitude, both signs, zeros, partial blocks); and half the
    state in GPU memory trains as all of it on the storage path, in the same format, within rounding."""
    from lightning_smartinf.core.state_formats import reference_format, state_format

    generator = torch.Generator().manual_seed(0)
    n = 3 * 256 * 1024 + 77  # a partial last block
    values = torch.randn(n, generator=generator) * 10.0 ** torch.randint(-30, 10, (n,), generator=generator)
    values[::97] = 0.0
    values[1::89] = -0.0
    compared = 0
    for name in ("bf16", "int8"):
        host, gpu = reference_format(name), state_format(name)
        for state in ("exp_avg", "exp_avg_sq"):
            x = values.abs() if state == "exp_avg_sq" else values
            expected = torch.empty(host.stored_bytes(n), dtype=torch.uint8)
            host.store(x, expected, state)
            got = torch.empty(gpu.stored_bytes(n), dtype=torch.uint8, device=device)
            gpu.store(x.to(device), got, state)
            assert torch.equal(got.cpu(), expected), f"{name} {state}: the GPU stored other bytes than the reference"
            back_host, back_gpu = torch.empty(n), torch.empty(n, device=device)
            host.load(expected, back_host, state)
            gpu.load(got, back_gpu, state)
            assert torch.equal(back_gpu.cpu(), back_host), f"{name} {state}: the GPU loaded other values"
            compared += 1
    traffic = half_in_gpu_memory(device, out, state_precision="int8")
    return {"conversions_compared": compared, "accelerator_read_bytes": traffic.accelerator_read_bytes}


def activations_zero3(device: str, out: Path) -> dict:
    """``offload_activations=True`` under ZeRO-3, launched by Lightning: bit for bit the run without it."""
    runs = {}
    for offload in (False, True):
        _, runs[offload] = fit(
            LMModule(adamw, dim=128),
            strategy(out, f"act{offload}", offload_activations=offload, overlap_backward=False),
            steps=4,
            precision="bf16-mixed",
            accelerator=device,
        )
    identical(runs[True], runs[False])
    return {}


class LMWithValidation(LMModule):
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        tokens, targets = batch
        loss = nn.functional.cross_entropy(self.model(tokens).float().flatten(0, 1), targets.flatten())
        self.log("val_loss", loss)


def checkpoint_resume(device: str, out: Path) -> dict:
    """What users run: ``ModelCheckpoint(save_last=True)`` saving during training, a new trainer resuming from
    ``last.ckpt`` (``fit(ckpt_path="last")``), and ``validate`` from the final checkpoint. The resumed run ends bit
    for bit where the run that never stopped does; ``validate`` sees the saved masters."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_smartinf.commands.export import consolidate_fp32_state_dict

    # Saves every `epoch` steps, at an epoch's last batch: the resumed run starts the next epoch on the same batches.
    # (Not `every_n_epochs`: Lightning replays a batch on resuming from a checkpoint saved at the epoch's end.)
    epoch = 3

    def trainer(name: str, steps: int, callbacks: list) -> L.Trainer:
        return L.Trainer(
            accelerator=device, devices=1, strategy=strategy(out, name), precision="bf16-mixed", max_steps=steps,
            logger=False, enable_progress_bar=False, enable_model_summary=False, deterministic=True,
            limit_val_batches=0, callbacks=callbacks, enable_checkpointing=any(isinstance(c, ModelCheckpoint)
            for c in callbacks),
        )  # fmt: skip

    whole = CaptureParams()
    trainer("whole", 2 * epoch, [whole]).fit(LMWithValidation(adamw), token_loader(epoch))
    saves = ModelCheckpoint(dirpath=out / "ckpts", save_last=True, every_n_train_steps=epoch)
    trainer("first", epoch, [saves]).fit(LMWithValidation(adamw), token_loader(epoch))
    resumed = CaptureParams()
    again = ModelCheckpoint(dirpath=out / "ckpts", save_last=True, every_n_train_steps=epoch)
    trainer("resumed", 2 * epoch, [resumed, again]).fit(
        LMWithValidation(adamw), token_loader(epoch), ckpt_path=out / "ckpts" / "last.ckpt"
    )
    identical(resumed.params, whole.params)

    evaluator = L.Trainer(accelerator=device, devices=1, strategy=strategy(out, "eval"), logger=False)
    (validated,) = evaluator.validate(
        LMWithValidation(adamw, seed=7), token_loader(2), ckpt_path=out / "ckpts" / "last.ckpt", verbose=False
    )
    plain = LMWithValidation(adamw)
    plain.load_state_dict(consolidate_fp32_state_dict(out / "ckpts" / "last.ckpt"))
    plain = plain.to(device)
    with torch.no_grad():
        losses = [
            nn.functional.cross_entropy(plain.model(t.to(device)).float().flatten(0, 1), y.to(device).flatten())
            for t, y in token_loader(2)
        ]
    expected = float(torch.stack(losses).mean())
    assert abs(validated["val_loss"] - expected) <= tolerance(device) * abs(expected), (validated["val_loss"], expected)
    return {"val_loss": validated["val_loss"], "plain_val_loss": expected, "checkpoints": sorted(
        path.name for path in (out / "ckpts").iterdir())}  # fmt: skip


def stream_hazards(device: str, out: Path) -> dict:
    """Work queued on one stream and read from another, each made late (``torch.cuda._sleep``) so that a missing
    fence shows: a copy within GPU memory (``AcceleratorCopies.put``) read after ``settle``; an accelerator-tier
    write-back copied to the host by a checkpoint's staging right after it."""
    from lightning_smartinf.core.tiers.accelerator_memory import AcceleratorStateFile

    n = 1 << 20
    src = torch.randn(n, device=device)
    late = torch.cuda.Stream()
    link = AcceleratorCopies()
    dst = torch.zeros(n, dtype=torch.bfloat16, device=device)
    with torch.cuda.stream(late):
        late.wait_stream(torch.cuda.current_stream())
        torch.cuda._sleep(DELAY_CYCLES)
        link.put(dst, src)
    link.settle()
    assert torch.equal(dst.cpu(), src.cpu().bfloat16()), "a copy within GPU memory had not landed at settle"

    state = AcceleratorStateFile("shard", n * 4, torch.device(device))
    with torch.cuda.stream(late):
        late.wait_stream(torch.cuda.current_stream())
        torch.cuda._sleep(DELAY_CYCLES)
        state.write_from(src, 0)  # a write-back, queued on a device thread's stream
    state.stage(copy=True)
    staged = torch.empty(n, dtype=torch.float32)
    state._host.read_into(staged, 0)
    assert torch.equal(staged, src.cpu()), "a checkpoint copied the tier's state before its write-back landed"
    state.discard()
    return {}


def gradient_norms(device: str, out: Path) -> dict:
    """ZeRO's float64 norm of a gradient partition as taken where the partition is (in pieces of
    ``ACCELERATOR_PIECE`` on a GPU, by the C kernel on a host) against the exact norm; an infinite element reaches it
    from a later piece."""
    import math

    from lightning_smartinf.core.float64_norm import ACCELERATOR_PIECE, LANES, PartitionNorm

    norm, errors = PartitionNorm(), {}
    generator = torch.Generator().manual_seed(0)
    numel = 2 * ACCELERATOR_PIECE + 5
    for dtype in (torch.float32, torch.bfloat16):
        values = (torch.randn(numel, generator=generator) * torch.rand(numel, generator=generator) ** 8).to(dtype)
        wide = values.double()
        exact = math.sqrt(math.fsum((wide * wide).tolist()))
        taken = norm(values.to(device))
        assert taken.dtype == torch.float64 and taken.device.type == torch.device(device).type
        errors[str(dtype)] = abs(float(taken) - exact) / exact
        assert errors[str(dtype)] < numel / LANES * 2.0**-53, errors  # the documented bound (float32's sum: 1e-7)
        values[ACCELERATOR_PIECE + 1] = math.inf
        assert float(norm(values.to(device))) == math.inf
    return {"relative_error": errors}


# ------------------------------------------------------------------------------------------------ two GPUs


def one_gpu(device: str, out: Path) -> dict:
    """The reference of :func:`two_gpus`, in a process of its own (Lightning relaunches the two-GPU script)."""
    _, reference = fit(LMModule(adamw), strategy(out, "one"), steps=STEPS, accelerator=device)
    torch.save(reference, out / "one_gpu.pt")
    return {}


def two_gpus(device: str, out: Path) -> dict:
    """Two GPUs with NCCL, launched by Lightning itself, both ranks on the same batches: the same parameters as one
    GPU (:func:`one_gpu`), each rank on a storage path of its own and holding half of every sub-group."""
    trainer, ours = fit(LMModule(adamw), strategy(out, "two", ranks=2), steps=STEPS, accelerator=device, devices=2)
    report = {"process_group_backend": trainer.strategy.process_group_backend}
    if trainer.global_rank == 0:
        reference = torch.load(out / "one_gpu.pt", weights_only=True)
        report["max_relative_error"] = max(max_relative_error(ours, reference).values())
        assert report["max_relative_error"] < tolerance(device), report
    return report


class OverflowOnRankZero(L.Callback):
    """From the third step on, rank 0 alone finds that its link would overflow once (an injected fault: each rank sees
    only its own partition). Every rank's loss scale, step count and parameters after each step are recorded."""

    def __init__(self) -> None:
        self.scales: list[float] = []
        self.steps: list[int] = []

    def on_train_start(self, trainer, pl_module) -> None:
        smart_update: SmartUpdateController = trainer.strategy.smart_update
        check, state = smart_update.link_overflows, {"armed": trainer.global_rank == 0}

        def overflows_once(clip_factor: float = 1.0) -> torch.Tensor:
            flag = check(clip_factor)
            if state["armed"] and trainer.global_step >= 2:
                state["armed"] = False
                return torch.ones((), dtype=torch.bool)
            return flag

        smart_update.link_overflows = overflows_once  # type: ignore[method-assign]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        optimizer = trainer.strategy.deepspeed_engine.optimizer
        self.scales.append(float(optimizer.loss_scale))
        self.steps.append(max(optimizer.smart_update.group_steps.values(), default=0))


def overflow_on_one_rank(device: str, out: Path) -> dict:
    """Error feedback on two ranks, where one rank alone finds its link would overflow: both skip that step (no
    hang, no diverging ranks), with the same loss scale and step count, then train on together."""
    callback = OverflowOnRankZero()
    precision = "16-mixed" if device == "cuda" else "32-true"
    trainer, params = fit(
        LMModule(adamw),
        strategy(out, "overflow", ranks=2, compression={"ratio": 0.1, "error_feedback": True}),
        steps=6,
        precision=precision,
        accelerator=device,
        devices=2,
        callbacks=[callback],
    )
    steps = [0, *callback.steps]
    skipped = [i for i in range(len(callback.steps)) if steps[i + 1] == steps[i]]
    assert 2 in skipped, (callback.steps, "the injected overflow skipped the third step")
    assert all(torch.isfinite(p).all() for p in params.values())
    return {"scales": callback.scales, "steps": callback.steps, "skipped": skipped}


def same_on_every_rank(out: Path) -> None:
    """Every rank skipped the same steps with the same loss scales (:func:`overflow_on_one_rank`)."""
    reports = [json.loads(path.read_text()) for path in sorted(out.glob("overflow_on_one_rank*.json"))]
    assert len(reports) == 2, f"{len(reports)} rank reports in {out}"
    for key in ("skipped", "scales", "steps"):
        assert reports[0][key] == reports[1][key], (key, reports[0][key], reports[1][key])


# ------------------------------------------------------------------------------------------------ running


@dataclasses.dataclass(frozen=True)
class Check:
    run: Callable[[str, Path], dict]
    #: GPUs it needs (Lightning launches a rank per GPU).
    gpus: int = 1
    #: Whether it also runs on the CPU (DeepSpeed's CPU accelerator, gloo).
    on_cpu: bool = True
    #: A check run first, in a process of its own, into the same directory (a reference).
    after: str | None = None
    #: What the parent checks in the directory once every rank has exited.
    verify: Callable[[Path], None] | None = None


CHECKS: dict[str, Check] = {
    "equivalence": Check(equivalence),
    "fp16_compression": Check(fp16_compression, on_cpu=False),
    "overlap_backward": Check(overlap_backward),
    "activations": Check(activations),
    "params_on_storage": Check(params_on_storage),
    "compression_host_buffer": Check(compression_host_buffer),
    "accelerator_tier": Check(accelerator_tier, on_cpu=False),
    "accelerator_formats": Check(accelerator_formats, on_cpu=False),
    "activations_zero3": Check(activations_zero3),
    "checkpoint_resume": Check(checkpoint_resume),
    "stream_hazards": Check(stream_hazards, on_cpu=False),
    "gradient_norms": Check(gradient_norms),
    "one_gpu": Check(one_gpu),
    "two_gpus": Check(two_gpus, gpus=2, after="one_gpu"),
    "overflow_on_one_rank": Check(overflow_on_one_rank, gpus=2, verify=same_on_every_rank),
}


def run_check(name: str, device: str, out: Path, timeout: float) -> tuple[bool, str]:
    """Run check ``name`` (after its reference) in processes of their own; whether it passed, and its output."""
    check = CHECKS[name]
    env = {**os.environ, "DS_ACCELERATOR": device}
    output = ""
    for step in [check.after, name] if check.after else [name]:
        command = [sys.executable, __file__, step, "--device", device, "--out", str(out)]
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            return False, f"{step} timed out after {timeout:.0f} s\n{str(exc.stdout or '')[-2000:]}"
        output += done.stdout + done.stderr
        if done.returncode != 0:
            return False, output[-6000:]
    if check.verify is not None:
        try:
            check.verify(out)
        except AssertionError as exc:
            return False, f"{output[-3000:]}\nverify: {exc!r}"
    return True, output[-6000:]


def gpu_contexts() -> dict[str, Any]:
    """The GPUs this process holds a CUDA context on, by PCI bus id (from ``nvidia-smi``; empty where it cannot
    tell, e.g. inside a PID namespace)."""
    try:
        listing = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    mine = sorted({bus.strip().lower() for pid, _, bus in (line.partition(",") for line in listing.splitlines())
                   if pid.strip() == str(os.getpid())})  # fmt: skip
    return {"contexts_on": mine} if mine else {}


def bus_id(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    return f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"


def rank_figures(device: str) -> dict[str, Any]:
    """This process's peak GPU memory and the GPUs it touched (one, its own: no stray context on GPU 0)."""
    if device != "cuda":
        return {}
    index = torch.cuda.current_device()
    figures = {"gpu": index, "peak_memory_bytes": int(torch.cuda.max_memory_allocated(index)), **gpu_contexts()}
    held = figures.get("contexts_on")
    if held:
        assert held == [bus_id(index)], f"this rank (GPU {index}) holds CUDA contexts on {held}"
    return figures


def run_one(name: str, device: str, out: Path) -> None:
    report = CHECKS[name].run(device, out)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    report = {**report, **rank_figures(device)}
    suffix = "" if rank == 0 else f".rank{rank}"
    (out / f"{name}{suffix}.json").write_text(json.dumps(report, indent=1, default=str))
    if rank == 0:
        print(json.dumps(report, default=str))


def environment() -> list[str]:
    """What a bug report needs to know of this machine."""
    import deepspeed
    import lightning

    import lightning_smartinf

    lines = [
        f"python {platform.python_version()} on {platform.platform()}",
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), deepspeed {deepspeed.__version__}, "
        f"lightning {lightning.__version__}, lightning_smartinf {lightning_smartinf.__version__}",
    ]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            lines.append(f"GPU {i}: {torch.cuda.get_device_name(i)}")
        try:
            driver = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.split()
            lines.append(f"driver {driver[0] if driver else 'unknown'}")
        except (OSError, subprocess.TimeoutExpired):
            lines.append("driver unknown (no nvidia-smi)")
    return lines


def run_all(device: str, out: Path, timeout: float) -> int:
    """Every check this machine can run, each in a process of its own; prints the table and the bug-report block."""
    gpus = torch.cuda.device_count() if device == "cuda" else 2
    rows, failures = [], []
    for name, check in CHECKS.items():
        if any(other.after == name for other in CHECKS.values()):
            continue  # a reference: run with the check that needs it
        if device == "cpu" and not check.on_cpu:
            rows.append((name, "n/a on CPU", "", ""))
            continue
        if check.gpus > gpus:
            rows.append((name, f"skipped: needs {check.gpus} GPUs", "", ""))
            continue
        started = time.monotonic()
        passed, tail = run_check(name, device, out / name, timeout)
        seconds = time.monotonic() - started
        peaks = []
        for report in sorted((out / name).glob(f"{name}*.json")):
            figures = json.loads(report.read_text())
            if "peak_memory_bytes" in figures:
                peaks.append(f"GPU{figures['gpu']} {figures['peak_memory_bytes'] / 2**20:.0f} MiB")
        rows.append((name, "passed" if passed else "FAILED", f"{seconds:.0f}", ", ".join(peaks)))
        # As each check ends: a run cut short still shows what finished, and every check's output stays on disk.
        (out / name).mkdir(parents=True, exist_ok=True)
        (out / name / "output.log").write_text(tail)
        print(f"{name}: {rows[-1][1]} in {seconds:.0f} s", flush=True)
        if not passed:
            failures.append((name, tail))
    width = max(len(r[0]) for r in rows)
    print(f"\n{'check':<{width}}  {'result':<22}  {'s':>5}  peak GPU memory per rank")
    for name, result, seconds, peak in rows:
        print(f"{name:<{width}}  {result:<22}  {seconds:>5}  {peak}")
    print("\n--- paste into a bug report ---")
    print("\n".join(environment()))
    for name, tail in failures:
        print(f"\n[{name}] last output:\n{tail}")
    print("--- end ---")
    return 1 if failures else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("check", choices=["all", *CHECKS])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds each check may take (with `all`)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.check == "all":
        sys.exit(run_all(args.device, args.out, args.timeout))
    run_one(args.check, args.device, args.out)


if __name__ == "__main__":
    main()
