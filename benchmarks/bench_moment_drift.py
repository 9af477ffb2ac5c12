"""How far a second moment kept in an 8-bit code drifts from the exact one, while a real run trains.

The GPT-2 task of ``bench_state_codecs.py`` trains with torch's ``AdamW`` in fp32 (its moments exact). Beside it,
for each candidate code, a shadow of Adam's second moment is kept as a device that holds it in that code would:
after every optimizer step, ``v = code(beta2 * v + (1 - beta2) * g**2)`` from the step's own (clipped) gradients,
stored and loaded back. Every ``--every`` steps it prints, over all parameters' elements, the quantiles of
``log2(v_code / v_exact)`` (a drift that compounds step after step shows here, beyond one rounding's error), the
fraction of non-zero elements stored as zero, and what the drift does to Adam's update: ``|du| / |u|`` and
``|u_code| / |u|`` with ``u = m_hat / (sqrt(v_hat) + eps)`` from the exact first moment. It also prints where the
square roots of the exact second moment lie in their blocks of 256 (the range a code must span).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_moment_drift.py --steps 400 --every 100 \\
        --out docs/moment-drift-gpt2.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_compression import gpt2_task  # noqa: E402
from bench_state_codecs import (  # noqa: E402
    E4M3_UNSIGNED,
    Codec,
    FormatCodec,
    MomentCodec,
    dynamic_map,
    plain_trainer,
)
from bench_state_formats import cpu_model  # noqa: E402

from lightning_smartinf.core.state_formats import BLOCK, ROOT_CODE, UnsignedFloat8  # noqa: E402

#: The codes a second moment is kept in: each stores the square root, blocks of 256.
CODES: dict[str, MomentCodec] = {
    "e4m3 (int8 before)": Codec(E4M3_UNSIGNED, sqrt=True),
    f"{ROOT_CODE.name.lower()} (int8)": FormatCodec("exp_avg_sq"),
    "ue3m5": FormatCodec("exp_avg_sq", UnsignedFloat8(3)),
    "ue5m3": FormatCodec("exp_avg_sq", UnsignedFloat8(5)),
    "dynamic (bitsandbytes' map)": Codec(dynamic_map(False), sqrt=True),
}
QUANTILES = (0.01, 0.1, 0.5, 0.9, 0.99)


def _sample(x: torch.Tensor, n: int = 1 << 20) -> torch.Tensor:
    """At most ``n`` of ``x``'s elements (``torch.quantile`` takes at most 16M), drawn with a fixed seed."""
    if x.numel() <= n:
        return x
    return x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0))[:n]]


class Drift(L.Callback):
    """Keeps each code's shadow second moment and reports every ``every`` steps (see the module docstring)."""

    def __init__(self, every: int) -> None:
        self.every, self.step = every, 0
        self.shadow: dict[str, dict[torch.Tensor, torch.Tensor]] = {name: {} for name in CODES}
        self.report: list[dict[str, Any]] = []

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # After the step the gradients are still the clipped ones the step used (zero_grad comes later).
        trainer.optimizers[0].register_step_post_hook(self._after_step)

    def _after_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self.step += 1
        beta2 = optimizer.param_groups[0]["betas"][1]
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g2 = p.grad.detach().float().square()
                for name, code in CODES.items():
                    v = self.shadow[name].get(p)
                    v = (1 - beta2) * g2 if v is None else v.mul_(beta2).add_(g2, alpha=1 - beta2)
                    self.shadow[name][p] = code.round_trip(v)
        if self.step % self.every == 0:
            self._measure(optimizer)

    def _measure(self, optimizer: torch.optim.Optimizer) -> None:
        beta1, beta2 = optimizer.param_groups[0]["betas"]
        eps = optimizer.param_groups[0]["eps"]
        bc1, bc2 = 1 - beta1**self.step, 1 - beta2**self.step
        params = [p for g in optimizer.param_groups for p in g["params"] if optimizer.state.get(p)]
        roots = []
        for p in params:
            root = optimizer.state[p]["exp_avg_sq"].flatten().sqrt()
            rows = torch.nn.functional.pad(root, (0, -root.numel() % BLOCK)).view(-1, BLOCK)
            top = rows.amax(dim=1, keepdim=True).expand_as(rows)
            live = (rows > 0) & (top > 0)
            roots.append(torch.log2(rows[live] / top[live]))
        where = torch.quantile(_sample(torch.cat(roots)), torch.tensor([0.001, 0.01, 0.1, 0.5]))
        entry: dict[str, Any] = {"step": self.step, "log2_root_over_block_largest_q001_q01_q10_q50": where.tolist()}
        print(f"step {self.step}: log2(sqrt(v) / its block's largest) at 0.1/1/10/50%: " + _fmt(where), flush=True)
        for name in CODES:
            ratios, zeros, nonzero, du2, u2, uq2 = [], 0, 0, 0.0, 0.0, 0.0
            for p in params:
                state = optimizer.state[p]
                v, m, kept = state["exp_avg_sq"], state["exp_avg"], self.shadow[name][p]
                live = v > 0
                ratios.append(torch.log2(kept[live].clamp_min(1e-45) / v[live]))
                zeros += int((live & (kept == 0)).sum())
                nonzero += int(live.sum())
                u = (m / bc1) / ((v / bc2).sqrt() + eps)
                uq = (m / bc1) / ((kept / bc2).sqrt() + eps)
                du2 += float((uq - u).square().sum())
                u2 += float(u.square().sum())
                uq2 += float(uq.square().sum())
            q = torch.quantile(_sample(torch.cat(ratios)), torch.tensor(QUANTILES))
            row = {
                "code": name,
                "log2_kept_over_exact_quantiles": dict(zip(map(str, QUANTILES), q.tolist())),
                "zero_fraction": zeros / nonzero,
                "update_error": math.sqrt(du2 / u2),
                "update_norm_ratio": math.sqrt(uq2 / u2),
            }
            entry[name] = row
            print(
                f"  {name:28s} log2(kept/exact) at 1/10/50/90/99%: {_fmt(q)}; zeros {row['zero_fraction']:.1e}; "
                f"|du|/|u| {row['update_error']:.3f}; |u_code|/|u| {row['update_norm_ratio']:.3f}",
                flush=True,
            )
        self.report.append(entry)


def _fmt(values: torch.Tensor) -> str:
    return " ".join(f"{float(v):+.2f}" for v in values)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="write the measurements as JSON here")
    args = parser.parse_args(argv)
    print(f"CPU: {cpu_model()}; {args.steps} steps; seed {args.seed}", flush=True)
    L.seed_everything(args.seed, verbose=False)
    drift = Drift(args.every)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="smartinf-drift-") as tmp:
        model, datamodule = gpt2_task(Path(tmp), 384, 6, 4.0)
        model.configure_model()
        trainer = plain_trainer(args.steps, [drift])
        trainer.fit(model, datamodule=datamodule)
    if args.out is not None:
        record = {
            "cpu": cpu_model(),
            "steps": args.steps,
            "seed": args.seed,
            "seconds": time.perf_counter() - start,
            "measurements": drift.report,
        }
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
