"""The GPU checks of issue 23, one per sub-command, each in a fresh process (DeepSpeed picks its accelerator once).

``python tests/cuda/gpu_checks.py CHECK --device cuda --out DIR`` runs one check and exits non-zero on failure; the
figures it measured go to ``DIR/CHECK.json``. ``tests/cuda/test_gpu.py`` runs them where CUDA exists. The checks
``equivalence``, ``overlap_backward`` and ``activations`` also run with ``--device cpu``, which proves the checks
themselves on a machine without a GPU: the same Lightning and DeepSpeed code paths with host tensors. (DeepSpeed's
CPU accelerator has no fp16, and one CPU is not two GPUs.)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import LMModule, fit, max_relative_error, param_groups  # noqa: E402

from lightning_smartinf import SmartInfinityStrategy  # noqa: E402
from lightning_smartinf.activations import ActivationOffloader  # noqa: E402
from lightning_smartinf.activations.spill import SPILL_FILE_NAME  # noqa: E402

STEPS = 8
#: fp32 on a GPU: cuBLAS may pick other reduction orders inside ZeRO's gathered layers than in a plain module.
CUDA_TOLERANCE = 1e-4


def adamw(model: nn.Module):
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=3e-3, betas=(0.9, 0.95))
    return optimizer, torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)


def strategy(out: Path, name: str, **kwargs) -> SmartInfinityStrategy:
    kwargs = {"sub_group_size": 3000, "chunk_size": 2048, "buffer_count": 4, **kwargs}
    return SmartInfinityStrategy(storage_paths=[out / name], **kwargs)


def tolerance(device: str) -> float:
    return CUDA_TOLERANCE if device == "cuda" else 1e-5


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


class CheckParametersLanded(L.Callback):
    """Before every forward, the parameter partitions the model reads hold exactly the devices' masters: the copies
    from the device workers (on their own stream) finished before training read them."""

    def __init__(self) -> None:
        self.checked = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 0:
            return
        smart_update = trainer.strategy.smart_update
        for i in range(len(smart_update.sub_groups)):
            params = smart_update.partitions.params(i)
            master = torch.empty(params.numel(), dtype=torch.float32)
            smart_update.backend.read_master(i, master)
            smart_update.backend.wait()
            assert torch.equal(params.cpu(), master.to(params.dtype)), f"sub-group {i} before step {batch_idx}"
            self.checked += 1


def overlap_backward(device: str, out: Path) -> dict:
    """Parameters in accelerator memory, sub-groups handed off during backward: each update's parameters land before
    the next forward reads them, and the result is the plain one."""
    _, reference = fit(LMModule(adamw), "auto", steps=STEPS, accelerator=device)
    check = CheckParametersLanded()
    trainer, ours = fit(
        LMModule(adamw),
        strategy(out, "overlap", overlap_backward=True, offload_parameters=False),
        steps=STEPS,
        callbacks=[check],
        accelerator=device,
    )
    smart_update = trainer.strategy.smart_update
    assert smart_update.early_kept > 0, "sub-groups were handed off during backward and kept"
    assert check.checked > 0
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
    """Forward and backward on the user's own stream: offloaded activations come back bitwise, and no file stays."""
    torch.manual_seed(0)
    model = Stack().to(device)
    x = torch.randn(64, 256, device=device)
    user_stream = torch.cuda.Stream() if device == "cuda" else None

    def grads(offloader: ActivationOffloader | None) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        context = torch.cuda.stream(user_stream) if user_stream is not None else _nothing()
        with context:
            if offloader is None:
                model(x).square().mean().backward()
            else:
                with offloader:
                    model(x).square().mean().backward()
        if user_stream is not None:
            user_stream.synchronize()
        return {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    reference = grads(None)
    (out / "act").mkdir(parents=True, exist_ok=True)
    offloader = ActivationOffloader([out / "act"], threshold_bytes=4096, keep_last=1).attach(model)
    ours = grads(offloader)
    stats = offloader.stats
    files = offloader.files()
    run_dirs = offloader.run_dirs
    offloader.close()
    for name, value in reference.items():
        assert torch.equal(ours[name], value), name
    assert stats.tensors_offloaded > 0 and stats.bytes_read > 0 and stats.resident_bytes == 0, stats
    # Between micro-batches only the spill files remain (no record holds bytes); after close, nothing.
    assert {f.name for f in files} <= {SPILL_FILE_NAME}, files
    assert not any(d.exists() for d in run_dirs), run_dirs
    return {"offloaded": stats.tensors_offloaded, "bytes_written": stats.bytes_written}


class _nothing:
    def __enter__(self) -> None: ...

    def __exit__(self, *exc: object) -> None: ...


def one_gpu(device: str, out: Path) -> dict:
    """The reference of :func:`two_gpus`, in a process of its own (Lightning relaunches the two-GPU script)."""
    _, reference = fit(LMModule(adamw), strategy(out, "one"), steps=STEPS, accelerator=device)
    torch.save(reference, out / "one_gpu.pt")
    return {}


def two_gpus(device: str, out: Path) -> dict:
    """Two GPUs with NCCL, launched by Lightning itself, both ranks on the same batches: the same parameters as one
    GPU (:func:`one_gpu`), with each rank holding half of every sub-group."""
    trainer, ours = fit(LMModule(adamw), strategy(out, "two"), steps=STEPS, accelerator=device, devices=2)
    if trainer.global_rank != 0:
        return {}
    reference = torch.load(out / "one_gpu.pt", weights_only=True)
    error = max(max_relative_error(ours, reference).values())
    assert error < tolerance(device), error
    return {"max_relative_error": error, "process_group_backend": trainer.strategy.process_group_backend}


CHECKS: dict[str, Callable[[str, Path], dict]] = {
    "equivalence": equivalence,
    "fp16_compression": fp16_compression,
    "overlap_backward": overlap_backward,
    "activations": activations,
    "one_gpu": one_gpu,
    "two_gpus": two_gpus,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("check", choices=sorted(CHECKS))
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report = CHECKS[args.check](args.device, args.out)
    if report:
        (args.out / f"{args.check}.json").write_text(json.dumps(report, indent=1, default=str))
        print(json.dumps(report, default=str))


if __name__ == "__main__":
    main()
