"""Optimizer-step benchmark: ZeRO-Infinity (DeepSpeed NVMe optimizer offload) vs. ``smart_infinity``, on CPU or CUDA.

Each configuration runs in its own subprocess (this script re-invokes itself with ``--run NAME``) so that peak
RSS is per configuration. Results (JSON) go to ``benchmarks/out/bench_step.json``; a markdown table is printed.

    PYTHONPATH=. TORCH_EXTENSIONS_DIR=.venv/torch_extensions .venv/bin/python benchmarks/bench_step.py
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RUNS = ("zero_infinity", "zero_infinity_pipelined", "smart_infinity", "smart_infinity_no_overlap")
#: State tiers: ours with a share of the state in host memory, and ZeRO-Offload (all of it in RAM, updated
#: by DeepSpeedCPUAdam) as the ceiling. ``_measured``: the memory tier's share of its budget re-planned from measured
#: rates (``state_memory_share="measured"``; give ``--warmup 10`` or more so that the timed steps follow the re-plan at
#: step 10). ``zero_twinflow``: DeepSpeed's partial offload ("Twin-Flow", ``offload_optimizer.ratio``, see
#: ``--twinflow-ratio``): that share of the sub-groups is updated on the host by DeepSpeedCPUAdam, the rest on the
#: accelerator by torch's AdamW (on a CPU-only machine the accelerator is the CPU). Run them with ``--only``.
TIER_RUNS = (
    "smart_infinity_mem25",
    "smart_infinity_mem50",
    "smart_infinity_mem75",
    "smart_infinity_mem100",
    "smart_infinity_mem50_measured",
    "smart_infinity_mem100_measured",
    "zero_offload",
    "zero_twinflow",
)
#: Ours with the optimizer state in fewer bytes (``state_precision``), all of it on storage or half in host memory.
FORMAT_RUNS = ("smart_infinity_bf16", "smart_infinity_int8", "smart_infinity_mem50_bf16", "smart_infinity_mem50_int8")
#: DeepSpeed's own smaller state with NVMe offload: bf16 master weights, gradients and Adam moments
#: (``bf16_master_weights_and_grads`` and ``bf16_optimizer_states``, 6 B/param on storage), with the pipelined swapper:
#: 0.19.8's non-pipelined one asserts on swap-in that its buffers are fp32.
#: DeepSpeed allows it only with bf16 forward and backward (``--precision bf16-mixed``). Its masters are bf16, so it
#: trains other numbers than ours (fp32 masters in every format): a baseline for the bytes, not for the arithmetic.
ZERO_FORMAT_RUNS = ("zero_infinity_bf16_states",)
#: Ours with split masters (``split_masters=True``: 2.125 bytes per master on storage, the rest in the bf16 parameter
#: in host memory), in each state format, and in int8 with half of the state in host memory; needs
#: ``--precision bf16-mixed``.
SPLIT_RUNS = (
    "smart_infinity_split",
    "smart_infinity_bf16_split",
    "smart_infinity_int8_split",
    "smart_infinity_mem50_int8_split",
)
ALL_RUNS = RUNS + TIER_RUNS + FORMAT_RUNS + ZERO_FORMAT_RUNS + SPLIT_RUNS
OUT_DIR = Path(__file__).resolve().parent / "out"


# ------------------------------------------------------------------------------------------------ model


def build_module(args: argparse.Namespace, run: str) -> Any:
    import lightning as L
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, dim: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.qkv = nn.Linear(dim, 3 * dim)
            self.proj = nn.Linear(dim, dim)
            self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, d = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
            return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))

    class GPT(nn.Module):
        def __init__(self, dim: int, layers: int, vocab: int, seq: int) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
            self.blocks = nn.Sequential(*(Block(dim, max(1, dim // 64)) for _ in range(layers)))
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, vocab, bias=False)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            hidden = self.embed(tokens) + self.pos[: tokens.shape[1]]
            return self.head(self.norm(self.blocks(hidden)))

    def make_model() -> nn.Module:
        if args.model == "gpt":
            return GPT(args.dim, args.layers, args.vocab, args.seq)
        return Llama(llama_config(args))

    class Llama(nn.Module):
        """A Hugging Face Llama (``LlamaForCausalLM``, random weights): the architecture users fine-tune."""

        def __init__(self, config: Any) -> None:
            super().__init__()
            from transformers import LlamaForCausalLM

            self.model = LlamaForCausalLM(config)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=tokens, use_cache=False).logits

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: nn.Module | None = None
            with torch.device("meta"):  # counted without making it
                self.num_params = sum(p.numel() for p in make_model().parameters())
            if getattr(args, "build", "init") == "init":
                self.configure_model()

        def configure_model(self) -> None:
            # `--build configure_model`: here, under the strategy's `zero.Init`, each parameter is partitioned (and
            # cast) as it is made, as a large model must be built; `--build init` makes the whole fp32 model first.
            if self.model is None:
                torch.manual_seed(0)
                self.model = make_model()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            tokens, targets = batch
            logits = self.model(tokens)
            loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            if run.startswith("zero_"):
                # Lightning divides the loss by the accumulation and stock DeepSpeed's engine divides it again; ours
                # divides once. Multiplied back once here, every run's gradients (and clipping) are the same.
                return loss * args.accumulate
            return loss

        def configure_optimizers(self) -> Any:
            if run.startswith("zero_"):
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                # DeepSpeed's bf16 states need the CPU Adam to keep its moments in the parameters' dtype.
                optimizer = DeepSpeedCPUAdam(
                    self.parameters(),
                    lr=args.lr,
                    adamw_mode=True,
                    weight_decay=0.01,
                    fp32_optimizer_states=run not in ZERO_FORMAT_RUNS,
                )
            else:
                # Fused, like ZeRO-Infinity's DeepSpeedCPUAdam: the devices then run torch's fused CPU kernel.
                optimizer = torch.optim.AdamW(self.parameters(), lr=args.lr, weight_decay=0.01, fused=not args.unfused)
            if args.schedule == "constant":
                return optimizer
            schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine(args, step))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    return LM()


def llama_config(args: argparse.Namespace) -> Any:
    """``--model llama``: a Llama of ``--dim``, ``--layers``, ``--heads``, ``--kv-heads``, ``--ffn``, ``--vocab``."""
    from transformers import LlamaConfig

    heads = args.heads or max(1, args.dim // 64)
    return LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.dim,
        intermediate_size=args.ffn or 256 * -(-8 * args.dim // 3 // 256),
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=args.kv_heads or max(1, heads // 4),
        max_position_embeddings=max(args.seq, 2048),
        tie_word_embeddings=False,
    )


def warmup_cosine(args: argparse.Namespace, step: int) -> float:
    """The learning rate's factor at optimizer step ``step``: linear warm-up over the first tenth of the run's
    steps (at least one), then cosine decay to a tenth of the peak at its last step."""
    total = args.warmup + args.steps
    warm = max(1, total // 10)
    if step < warm:
        return (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


# ------------------------------------------------------------------------------------------------ measuring


def proc_io() -> dict[str, int]:
    """Block-device bytes of this process (all threads), from ``/proc/self/io``."""
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, value = line.split(":")
            out[key.strip()] = int(value)
    return {"read_bytes": out.get("read_bytes", 0), "write_bytes": out.get("write_bytes", 0)}


class DiskTrace:
    """Samples the storage's block device (``/proc/diskstats``) and marks training phases, to show when it idles."""

    def __init__(self, path: str, period_s: float = 0.005) -> None:
        import threading

        dev = os.stat(path).st_dev
        self._key = (os.major(dev), os.minor(dev))
        self.period_s = period_s
        self.samples: list[tuple[float, int, int, int]] = []  # (t, busy ms, sectors read, sectors written)
        self.marks: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _read(self) -> tuple[int, int, int] | None:
        with open("/proc/diskstats") as f:
            for line in f:
                parts = line.split()
                if (int(parts[0]), int(parts[1])) == self._key:
                    return int(parts[12]), int(parts[5]), int(parts[9])
        return None

    def _sample(self) -> None:
        while not self._stop.wait(self.period_s):
            row = self._read()
            if row is not None:
                self.samples.append((time.perf_counter(), *row))

    def mark(self, name: str) -> None:
        self.marks.append((time.perf_counter(), name))

    def phases(self) -> dict[str, dict[str, float]]:
        """Per phase name, summed over its occurrences: seconds, disk busy fraction, MB/s read and written."""
        self._stop.set()
        self._thread.join()
        out: dict[str, dict[str, float]] = {}
        for (t0, name), (t1, _) in zip(self.marks, self.marks[1:]):
            inside = [s for s in self.samples if t0 <= s[0] <= t1]
            if len(inside) < 2:
                continue
            first, last = inside[0], inside[-1]
            span = last[0] - first[0]
            acc = out.setdefault(name, {"s": 0.0, "busy_s": 0.0, "read_mb": 0.0, "write_mb": 0.0})
            acc["s"] += t1 - t0
            acc["busy_s"] += min(span, (last[1] - first[1]) / 1e3)
            acc["read_mb"] += (last[2] - first[2]) * 512 / 1e6
            acc["write_mb"] += (last[3] - first[3]) * 512 / 1e6
        for acc in out.values():
            s = acc["s"]
            acc.update(busy=acc.pop("busy_s") / s, read_mb_s=acc.pop("read_mb") / s, write_mb_s=acc.pop("write_mb") / s)
        return out


def busy_rate_gbps(phases: dict[str, dict[str, float]] | None) -> float | None:
    """GB/s the storage read and wrote while it had I/O in flight, over every traced phase (``None``: not traced).

    The rate the disk gave this run, to set beside a calibration's: a virtual disk's rate changes by tens of percent
    from one minute to the next under the same requests.
    """
    if not phases:
        return None
    moved = sum((p["read_mb_s"] + p["write_mb_s"]) * p["s"] for p in phases.values()) / 1e3
    busy = sum(p["busy"] * p["s"] for p in phases.values())
    return moved / busy if busy > 0 else None


class RssTrace:
    """Samples this process's RSS every ``period_s`` and keeps its peak per stage of the run (building the model,
    setting up the strategy, the warm-up steps, the timed steps), to show which stage sets the peak."""

    def __init__(self, stage: str, period_s: float = 0.01) -> None:
        import threading

        self.stage = stage
        self.period_s = period_s
        self.peaks_mib: dict[str, float] = {}
        self._page_mib = os.sysconf("SC_PAGE_SIZE") / 2**20
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        with open("/proc/self/statm") as statm:
            while not self._stop.wait(self.period_s):
                statm.seek(0)
                rss = int(statm.read().split()[1]) * self._page_mib
                stage = self.stage
                self.peaks_mib[stage] = max(self.peaks_mib.get(stage, 0.0), rss)

    def enter(self, stage: str) -> None:
        self.stage = stage

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return self.peaks_mib


def device_seconds(trainer: Any) -> dict[str, float] | None:
    """Seconds ours' devices spent reading, writing and computing (summed over devices and their threads), seconds
    the host waited on them, and state bytes read between steps that updates used; ``None`` for ZeRO-Infinity."""
    smart_update = getattr(trainer.strategy.deepspeed_engine.optimizer, "smart_update", None)
    if smart_update is None:
        return None
    backend = smart_update.backend
    backend = backend if hasattr(backend, "devices") else getattr(backend, "inner", backend)  # tiers: the devices'
    out = {"wait_s": smart_update.wait_s, "read_s": 0.0, "write_s": 0.0, "compute_s": 0.0}
    # The strategy's own clocks (host time per phase; `update_s`: the devices' step, hand-offs and waits).
    out.update({f"{name}_s": trainer.strategy.clocks.total(name) for name in ("forward", "backward", "after_backward")})
    out["update_s"] = smart_update.step_s
    out["prefetch_used_bytes"] = 0.0
    for device in getattr(backend, "devices", ()):
        out["read_s"] += device.stats.read_s
        out["write_s"] += device.stats.write_s
        out["compute_s"] += device.stats.compute_s
        out["prefetch_used_bytes"] += device.stats.prefetch_used_bytes
    return out


def make_callback(args: argparse.Namespace, rss: RssTrace) -> Any:
    import lightning as L

    class Meter(L.Callback):
        def __init__(self) -> None:
            self.step_times: list[float] = []
            #: Disk bytes moved while ``optimizer.step`` ran (timed steps only); the rest moved in forward/backward.
            self.step_io: dict[str, int] = {}
            self.calls = 0
            self.io0: dict[str, int] = {}
            self.io1: dict[str, int] = {}
            self.traffic0: Any = None
            self.traffic1: Any = None
            self.step_wall0 = self.step_wall1 = 0.0
            self.dev0: dict[str, float] | None = None
            self.dev1: dict[str, float] | None = None
            self.trace: DiskTrace | None = None
            self.grad_norms: list[float] = []

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            rss.enter("warm-up steps")
            optimizer = trainer.strategy.deepspeed_engine.optimizer
            inner = optimizer.step

            def timed_step(*a: Any, **k: Any) -> Any:
                self._mark("step")
                io0 = proc_io()
                t0 = time.perf_counter()
                out = inner(*a, **k)
                self._mark("after step")
                self.calls += 1
                # The step's gradient norm before clipping (DeepSpeed's and ours alike): clipping fired above the clip.
                self.grad_norms.append(float(getattr(optimizer, "_global_grad_norm", float("nan"))))
                if self.calls > args.warmup:
                    self.step_times.append(time.perf_counter() - t0)
                    io1 = proc_io()
                    for key in io1:
                        self.step_io[key] = self.step_io.get(key, 0) + io1[key] - io0[key]
                return out

            optimizer.step = timed_step

        def _mark(self, name: str) -> None:
            if self.trace is not None:
                self.trace.mark(name)

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
            self._mark("backward")

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            first = batch_idx == args.warmup * args.accumulate  # the first micro-batch of the first timed step
            if first:
                rss.enter("timed steps")
            if first and args.trace:
                self.trace = DiskTrace(args.storage or tempfile.gettempdir())
            self._mark("forward")
            if first:
                self.io0 = proc_io()
                self.traffic0 = getattr(trainer.strategy, "traffic", None)
                self.step_wall0 = time.perf_counter()
                self.dev0 = device_seconds(trainer)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == (args.warmup + args.steps) * args.accumulate - 1:
                self.io1 = proc_io()
                self.traffic1 = getattr(trainer.strategy, "traffic", None)
                self.step_wall1 = time.perf_counter()
                self.dev1 = device_seconds(trainer)
                self._mark("end")

    return Meter()


def zero3_config(args: argparse.Namespace, offload_optimizer: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed's ZeRO-3 configuration with the parameters in host memory and the optimizer ``offload_optimizer``."""
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": args.sub_group_size,
            "offload_optimizer": offload_optimizer,
            "offload_param": {"device": "cpu"},
        },
    }


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(os.cpu_count() or 1)
    storage = Path(tempfile.mkdtemp(prefix=f"bench_{args.run}_", dir=args.storage))
    rss = RssTrace("build")
    try:
        module = build_module(args, args.run)
        rss.enter("setup")
        if args.run == "zero_offload":
            from lightning_smartinf.lightning.cpu_support import DeepSpeedCPUStrategy

            # Lightning's `deepspeed_stage_3_offload`: optimizer state and parameters in host memory.
            strategy = DeepSpeedCPUStrategy(
                stage=3, offload_optimizer=True, offload_parameters=True, sub_group_size=args.sub_group_size
            )
        elif args.run == "zero_twinflow":
            from lightning_smartinf.lightning.cpu_support import DeepSpeedCPUStrategy

            strategy = DeepSpeedCPUStrategy(config=zero3_config(args, {"device": "cpu", "ratio": args.twinflow_ratio}))
        elif args.run.startswith("zero_infinity"):
            from lightning_smartinf.lightning.cpu_support import DeepSpeedCPUStrategy

            # The pipelined swapper overlaps reads and writes; it needs buffer_count >= 16 with several sub-groups.
            # DeepSpeed 0.19.8's non-pipelined swapper refuses bf16 states (its buffer pool asserts fp32 on swap-in).
            pipelined = args.run in ("zero_infinity_pipelined", "zero_infinity_bf16_states")

            offload_optimizer: dict[str, Any] = {
                "device": "nvme",
                "nvme_path": str(storage),
                "pipeline_read": pipelined,
                "pipeline_write": pipelined,
                "buffer_count": 16 if pipelined else 4,
            }
            aio: dict[str, Any] = {
                "block_size": 1048576,
                "queue_depth": 8,
                "intra_op_parallelism": 1,
                "single_submit": False,
                "overlap_events": True,
            }
            for name, value in args.zero:
                (aio if name in aio else offload_optimizer)[name] = value
            config = {**zero3_config(args, offload_optimizer), "aio": aio}
            if args.run == "zero_infinity_bf16_states":  # (--precision bf16-mixed, checked by main)
                config["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
            strategy = DeepSpeedCPUStrategy(config=config)
        else:
            from lightning_smartinf import SmartInfinityStrategy
            from lightning_smartinf.core.state_formats import state_format

            share = int(args.run.partition("_mem")[2].partition("_")[0] or 0) / 100
            split = args.run in SPLIT_RUNS
            base = args.run.removesuffix("_split")
            precision = base.rpartition("_")[2] if base in FORMAT_RUNS else "fp32"
            # fp32 master + two Adam states in the format, plus each sub-group's last-chunk padding (at most 3 x 4 KiB).
            per_param = state_format(precision).bytes_per_element(2, split=split)
            state = int(per_param * module.num_params) + 12 * 4096 * (module.num_params // args.sub_group_size + 1)
            settings = {
                "state_precision": precision,
                "split_masters": split,
                "state_memory_budget": int(share * state) or None,
                "storage_paths": [storage],
                "sub_group_size": args.sub_group_size,
                "offload_parameters": True,
                "io_engine": args.io_engine,
                "overlap_backward": args.run != "smart_infinity_no_overlap",
                "state_memory_share": "measured" if args.run.endswith("_measured") else "auto",
            }
            strategy = SmartInfinityStrategy(**{**settings, **dict(args.smartinf)})  # --smartinf overrides
        n = args.batch * args.accumulate * (args.warmup + args.steps)
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, args.vocab, (n, args.seq + 1), generator=g)
        loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch)
        meter = make_callback(args, rss)
        trainer = L.Trainer(
            accelerator=args.accelerator,
            devices=1,
            precision=args.precision,
            strategy=strategy,
            max_steps=args.warmup + args.steps,
            accumulate_grad_batches=args.accumulate,
            gradient_clip_val=args.clip,
            callbacks=[meter],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=str(storage),
        )
        t0 = time.perf_counter()
        trainer.fit(module, loader)
        fit_s = time.perf_counter() - t0
        steps = len(meter.step_times)
        p = module.num_params
        tokens = args.batch * args.accumulate * args.seq * args.steps  # in the timed steps
        result: dict[str, Any] = {
            "run": args.run,
            "params": p,
            "timed_steps": steps,
            "opt_step_median_s": statistics.median(meter.step_times) if steps else None,
            "opt_step_times_s": meter.step_times,
            "train_step_mean_s": (meter.step_wall1 - meter.step_wall0) / max(args.steps, 1),
            "tokens_per_s": tokens / (meter.step_wall1 - meter.step_wall0),
            "grad_norms": meter.grad_norms,
            # DeepSpeed's test (the norm plus 1e-6 over the clip above 1), on every step, warm-up included.
            "clip_fired_steps": sum(n + 1e-6 > args.clip for n in meter.grad_norms) if args.clip else 0,
            "fit_s": fit_s,
            "disk_read_bytes_per_param_step": (meter.io1["read_bytes"] - meter.io0["read_bytes"]) / p / args.steps,
            "disk_write_bytes_per_param_step": (meter.io1["write_bytes"] - meter.io0["write_bytes"]) / p / args.steps,
            "disk_read_bytes_per_param_in_step": meter.step_io.get("read_bytes", 0) / p / args.steps,
            "disk_write_bytes_per_param_in_step": meter.step_io.get("write_bytes", 0) / p / args.steps,
            "peak_rss_mib": peak_rss_mib(),
            "peak_rss_mib_by_stage": rss.stop(),
        }
        optimizer = trainer.strategy.deepspeed_engine.optimizer
        if hasattr(optimizer, "smart_update"):
            # Sub-groups updated during backward and kept by the step, and those the step rolled back.
            result["early_kept"] = optimizer.smart_update.early_kept
            result["early_rolled_back"] = optimizer.smart_update.early_rolled_back
            result["sub_groups"] = len(optimizer.fp16_groups)
            result["optimizer_steps"] = args.warmup + args.steps
            backend = optimizer.smart_update.backend
            shards = getattr(backend, "shards", ())
            if shards:
                held = sum(s.layout.file_bytes for s in shards if s.file.in_memory)
                result["memory_share_final"] = held / sum(s.layout.file_bytes for s in shards)
            plan = getattr(backend, "last_replan", None)
            if plan is not None:
                result["replan"] = {
                    "memory_share_bytes": plan.memory_share,
                    "predicted_s": plan.predicted_s,
                    "current_s": plan.current_s,
                    "rates_gbps": {str(d): r / 1e9 for d, r in plan.rates.items()},
                    "ready_s": {str(i): t for i, t in sorted(plan.ready.items())},
                }
        if meter.dev0 is not None and meter.dev1 is not None:
            result["device_s_per_step"] = {k: (meter.dev1[k] - meter.dev0[k]) / args.steps for k in meter.dev0}
        if meter.trace is not None:
            result["disk_phases"] = meter.trace.phases()
            result["disk_busy_gbps"] = busy_rate_gbps(result["disk_phases"])
        if meter.traffic0 is not None and meter.traffic1 is not None:
            delta = (meter.traffic1 - meter.traffic0).as_dict()
            result["traffic_bytes_per_param_step"] = {k: v / p / args.steps for k, v in delta.items()}
        return result
    finally:
        shutil.rmtree(storage, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ driver


def peak_rss_mib() -> float:
    """This process's peak RSS (``VmHWM``): ``ru_maxrss`` would keep the launching process's peak across exec."""
    with open("/proc/self/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    return kib / 1024


def tiers_table(results: dict[str, dict[str, Any]]) -> str:
    """Markdown: ours with 0-100% of the state in host memory beside ZeRO-Infinity's best and ZeRO-Offload."""
    zis = [
        results[k] for k in ("zero_infinity", "zero_infinity_pipelined") if "opt_step_median_s" in results.get(k, {})
    ]
    best = min(zis, key=lambda r: r["train_step_mean_s"]) if zis else {}
    columns = [
        ("all on device", results.get("smart_infinity", {})),
        *[(f"{share}% in memory", results.get(f"smart_infinity_mem{share}", {})) for share in (25, 50, 75, 100)],
        *[
            (f"{share}% budget, measured", results.get(f"smart_infinity_mem{share}_measured", {}))
            for share in (50, 100)
        ],
        ("ZeRO-Infinity best", best),
        ("ZeRO-Offload", results.get("zero_offload", {})),
        ("Twin-Flow", results.get("zero_twinflow", {})),
    ]
    columns = [(name, r) for name, r in columns if "train_step_mean_s" in r]
    device = results.get("smart_infinity", {})

    def traffic(r: dict[str, Any], key: str) -> float | None:
        t = r.get("traffic_bytes_per_param_step")
        return None if not t else t.get(key, 0.0)

    rows: list[tuple[str, Any]] = [
        ("optimizer step, median (s)", lambda r: r.get("opt_step_median_s")),
        ("train step, mean (s)", lambda r: r.get("train_step_mean_s")),
        ("train step: all on device / this", lambda r: _ratio(device.get("train_step_mean_s"), r["train_step_mean_s"])),
        (
            "train step: ZeRO-Infinity best / this",
            lambda r: _ratio(best.get("train_step_mean_s"), r["train_step_mean_s"]),
        ),
        (
            "train step: this / ZeRO-Offload",
            lambda r: _ratio(r["train_step_mean_s"], results.get("zero_offload", {}).get("train_step_mean_s")),
        ),
        (
            "train step: this / Twin-Flow",
            lambda r: _ratio(r["train_step_mean_s"], results.get("zero_twinflow", {}).get("train_step_mean_s")),
        ),
        ("peak RSS (MiB)", lambda r: r.get("peak_rss_mib")),
        (
            "state in memory at the end (%)",
            lambda r: 100 * r["memory_share_final"] if "memory_share_final" in r else None,
        ),
        (
            "storage read + write (B/param/step)",
            lambda r: (
                None
                if traffic(r, "storage_read_bytes") is None
                else traffic(r, "storage_read_bytes") + traffic(r, "storage_write_bytes")
            ),
        ),
        (
            "memory read + write (B/param/step)",
            lambda r: (
                None
                if traffic(r, "memory_read_bytes") is None
                else traffic(r, "memory_read_bytes") + traffic(r, "memory_write_bytes")
            ),
        ),
    ]
    lines = ["| metric | " + " | ".join(name for name, _ in columns) + " |", "|---|" + "---:|" * len(columns)]
    for name, get in rows:
        lines.append(f"| {name} | " + " | ".join(fmt(get(r), 2) for _, r in columns) + " |")
    return "\n".join(lines)


def _ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or ``None`` (shown as a dash) when either was not run."""
    return None if a is None or not b else a / b


def raw_bandwidth(directory: Path, gib: float) -> dict[str, float]:
    """Direct-I/O bandwidth of ``directory``: sequential read, write, and both at once.

    Uses the devices' own I/O path (12 MiB requests, as one Adam chunk record, split into 1 MiB pieces with 8 in
    flight) without any update in between: the ceiling the devices' streaming can reach on this storage.
    """
    import threading

    from lightning_smartinf.core.io.direct import StateFile, ThreadedIO, aligned_empty

    req = 12 << 20
    size = max(req, int(gib * 2**30) // req * req)  # at least one request: a smaller --raw-gib times nothing
    engine = ThreadedIO(1 << 20, 8)
    work = Path(tempfile.mkdtemp(prefix="bench_raw_", dir=directory))
    try:
        a, b = StateFile(work / "a", size, create=True), StateFile(work / "b", size, create=True)
        buf_a, buf_b = aligned_empty(req), aligned_empty(req)
        offsets = range(0, size, req)

        def timed(fn: Any) -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

        write_s = timed(lambda: [engine.write(a, buf_a, o) for o in offsets])
        read_s = timed(lambda: [engine.read(a, buf_a, o) for o in offsets])
        threads = [
            threading.Thread(target=lambda: [engine.read(a, buf_a, o) for o in offsets]),
            threading.Thread(target=lambda: [engine.write(b, buf_b, o) for o in offsets]),
        ]
        both_s = timed(lambda: ([t.start() for t in threads], [t.join() for t in threads]))
        a.close()
        b.close()
        engine.close()
        gib_moved = size / 2**30
        return {
            "read_gib_s": gib_moved / read_s,
            "write_gib_s": gib_moved / write_s,
            "concurrent_gib_s": 2 * gib_moved / both_s,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def fmt(x: Any, digits: int = 3) -> str:
    return "—" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def formats_table(results: dict[str, dict[str, Any]]) -> str:
    """Markdown: ours in each ``state_precision``, all of the state on storage and half of it in host memory, beside
    ZeRO-Infinity's best (the faster train step of its two settings)."""
    zis = [
        results[k] for k in ("zero_infinity", "zero_infinity_pipelined") if "train_step_mean_s" in results.get(k, {})
    ]
    best = min(zis, key=lambda r: r["train_step_mean_s"]) if zis else {}
    fp32 = results.get("smart_infinity", {})
    columns = [
        ("fp32", fp32),
        ("bf16", results.get("smart_infinity_bf16", {})),
        ("int8", results.get("smart_infinity_int8", {})),
        ("fp32, split masters", results.get("smart_infinity_split", {})),
        ("bf16, split masters", results.get("smart_infinity_bf16_split", {})),
        ("int8, split masters", results.get("smart_infinity_int8_split", {})),
        ("fp32, half in memory", results.get("smart_infinity_mem50", {})),
        ("bf16, half in memory", results.get("smart_infinity_mem50_bf16", {})),
        ("int8, half in memory", results.get("smart_infinity_mem50_int8", {})),
        ("int8, half in memory, split masters", results.get("smart_infinity_mem50_int8_split", {})),
        ("ZeRO-Infinity best", best),
        ("ZeRO-Infinity, bf16 states", results.get("zero_infinity_bf16_states", {})),
    ]
    columns = [(name, r) for name, r in columns if "train_step_mean_s" in r]

    def traffic(r: dict[str, Any], *keys: str) -> float | None:
        t = r.get("traffic_bytes_per_param_step")
        return None if not t else sum(t.get(key, 0.0) for key in keys)

    def disk(r: dict[str, Any]) -> float | None:
        if r.get("run", "").startswith("zero_"):  # ZeRO-Infinity's swap traffic is its disk's
            return r.get("disk_read_bytes_per_param_step", 0.0) + r.get("disk_write_bytes_per_param_step", 0.0)
        return traffic(r, "storage_read_bytes", "storage_write_bytes")

    rows: list[tuple[str, Any]] = [
        ("optimizer step, median (s)", lambda r: r.get("opt_step_median_s")),
        ("train step, mean (s)", lambda r: r.get("train_step_mean_s")),
        (
            "train step: this / fp32 all on storage",
            lambda r: _ratio(r["train_step_mean_s"], fp32.get("train_step_mean_s")),
        ),
        (
            "train step: this / ZeRO-Infinity best",
            lambda r: _ratio(r["train_step_mean_s"], best.get("train_step_mean_s")),
        ),
        ("storage read + write (B/param/step)", disk),
        (
            "host memory tier read + write (B/param/step)",
            lambda r: traffic(r, "memory_read_bytes", "memory_write_bytes"),
        ),
        ("peak RSS (GiB)", lambda r: r["peak_rss_mib"] / 1024 if "peak_rss_mib" in r else None),
    ]
    lines = ["| metric | " + " | ".join(name for name, _ in columns) + " |", "|---|" + "---:|" * len(columns)]
    for name, get in rows:
        lines.append(f"| {name} | " + " | ".join(fmt(get(r), 2) for _, r in columns) + " |")
    return "\n".join(lines)


def table(results: dict[str, dict[str, Any]]) -> str:
    """Markdown: the two ZeRO-Infinity settings, ours, and ours over the better (faster-step) baseline."""
    zis = [
        results[k] for k in ("zero_infinity", "zero_infinity_pipelined") if "opt_step_median_s" in results.get(k, {})
    ]
    best = min(zis, key=lambda r: r["opt_step_median_s"]) if zis else {}
    zi, zp, si, sn = (
        results.get("zero_infinity", {}),
        results.get("zero_infinity_pipelined", {}),
        results.get("smart_infinity", {}),
        results.get("smart_infinity_no_overlap", {}),
    )

    def link(r: dict[str, Any], key: str | None) -> float | None:
        # ZeRO-Infinity's host<->storage "link" IS its disk traffic.
        w, rd = r.get("disk_write_bytes_per_param_step"), r.get("disk_read_bytes_per_param_step")
        if w is None:
            return None
        return {"write": w, "read": rd, None: w + rd}[key]

    def traffic(r: dict[str, Any], key: str) -> float | None:
        t = r.get("traffic_bytes_per_param_step")
        if not t:
            return None
        return t["link_write_bytes"] + t["link_read_bytes"] if key == "link" else t[key]

    def ours_link(r: dict[str, Any], key: str | None) -> float | None:
        return traffic(r, {"write": "link_write_bytes", "read": "link_read_bytes", None: "link"}[key])

    def early(r: dict[str, Any]) -> str | None:
        if "early_kept" not in r:
            return None
        return f"{r['early_kept']} / {r['early_rolled_back']} of {r['sub_groups'] * r['optimizer_steps']}"

    def device(r: dict[str, Any], key: str) -> float | None:
        return r.get("device_s_per_step", {}).get(key)

    def clipped(r: dict[str, Any]) -> str | None:
        return None if "grad_norms" not in r else f"{r['clip_fired_steps']} / {len(r['grad_norms'])}"

    def prefetched(r: dict[str, Any]) -> float | None:
        used = device(r, "prefetch_used_bytes")
        return None if used is None else used / r["params"]

    # (metric, value of a baseline run, value of one of ours)
    rows = [
        ("optimizer step, median (s)", lambda r: r.get("opt_step_median_s"), None),
        ("train step, mean (s)", lambda r: r.get("train_step_mean_s"), None),
        ("tokens/s", lambda r: r.get("tokens_per_s"), None),
        ("steps where clipping fired / steps", clipped, None),
        ("disk read (B/param/step, /proc/self/io)", lambda r: r.get("disk_read_bytes_per_param_step"), None),
        ("disk write (B/param/step, /proc/self/io)", lambda r: r.get("disk_write_bytes_per_param_step"), None),
        ("of which inside optimizer.step: read", lambda r: r.get("disk_read_bytes_per_param_in_step"), None),
        ("of which inside optimizer.step: write", lambda r: r.get("disk_write_bytes_per_param_in_step"), None),
        ("link host→storage (B/param/step)", lambda r: link(r, "write"), lambda r: ours_link(r, "write")),
        ("link storage→host (B/param/step)", lambda r: link(r, "read"), lambda r: ours_link(r, "read")),
        ("link total (B/param/step)", lambda r: link(r, None), lambda r: ours_link(r, None)),
        ("in-device storage read (B/param/step)", lambda r: None, lambda r: traffic(r, "storage_read_bytes")),
        ("in-device storage write (B/param/step)", lambda r: None, lambda r: traffic(r, "storage_write_bytes")),
        ("storage's rate while busy, read + write (GB/s, --trace)", lambda r: r.get("disk_busy_gbps"), None),
        ("peak RSS (MiB)", lambda r: r.get("peak_rss_mib"), None),
        ("sub-groups updated in backward: kept / rolled back", lambda r: None, early),
        ("forward, host (s/step)", lambda r: None, lambda r: device(r, "forward_s")),
        ("backward incl. gradient reduction, host (s/step)", lambda r: None, lambda r: device(r, "backward_s")),
        ("optimizer step after backward, host (s/step)", lambda r: None, lambda r: device(r, "after_backward_s")),
        ("of which the devices' step: hand-offs and waits (s/step)", lambda r: None, lambda r: device(r, "update_s")),
        ("device compute (s/step)", lambda r: None, lambda r: device(r, "compute_s")),
        ("device read, summed over threads (s/step)", lambda r: None, lambda r: device(r, "read_s")),
        ("device write, summed over threads (s/step)", lambda r: None, lambda r: device(r, "write_s")),
        ("host waited on devices (s/step)", lambda r: None, lambda r: device(r, "wait_s")),
        ("state read between steps and used (B/param/step)", lambda r: None, prefetched),
    ]
    lines = [
        "| metric | ZeRO-Infinity | ZeRO-Infinity pipelined | smart_infinity | smart_infinity, no overlap "
        "| best baseline / ours |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, get, get_ours in rows:
        get_ours = get_ours or get
        base = get(best) if best else None
        ours = get_ours(si)
        ratio = base / ours if isinstance(base, (int, float)) and isinstance(ours, (int, float)) and ours else None
        cells = [get(zi), get(zp), ours, get_ours(sn), ratio]
        lines.append(f"| {name} | " + " | ".join(c if isinstance(c, str) else fmt(c, 2) for c in cells) + " |")
    return "\n".join(lines)


def merge_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's rounds as one result: medians over every timed step of every round, per-round medians kept.

    Byte counts per step are exact and equal in every round; they and the remaining fields come from the last good
    round, except the bytes moved inside ``optimizer.step`` and the device seconds, which vary and are averaged.
    """
    good = [r for r in runs if "opt_step_times_s" in r]
    if not good:
        return runs[-1] if runs else {"error": "not run"}
    merged = dict(good[-1])
    merged["opt_step_times_s"] = [t for r in good for t in r["opt_step_times_s"]]
    merged["opt_step_median_s"] = statistics.median(merged["opt_step_times_s"])
    merged["train_step_mean_s"] = statistics.fmean(r["train_step_mean_s"] for r in good)
    merged["round_opt_step_medians_s"] = [r["opt_step_median_s"] for r in good]
    merged["round_train_step_means_s"] = [r["train_step_mean_s"] for r in good]
    if all("tokens_per_s" in r for r in good):
        merged["tokens_per_s"] = statistics.fmean(r["tokens_per_s"] for r in good)
        merged["grad_norms"] = [n for r in good for n in r["grad_norms"]]
        merged["clip_fired_steps"] = sum(r["clip_fired_steps"] for r in good)
    merged["peak_rss_mib"] = max(r["peak_rss_mib"] for r in good)
    if all("memory_share_final" in r for r in good):
        merged["round_memory_share_final"] = [r["memory_share_final"] for r in good]
    for key in ("disk_read_bytes_per_param_in_step", "disk_write_bytes_per_param_in_step"):
        if all(key in r for r in good):
            merged[key] = statistics.fmean(r[key] for r in good)
    if all(r.get("disk_busy_gbps") is not None for r in good):
        merged["round_disk_busy_gbps"] = [r["disk_busy_gbps"] for r in good]
        merged["disk_busy_gbps"] = statistics.fmean(merged["round_disk_busy_gbps"])
    if all("device_s_per_step" in r for r in good):
        merged["device_s_per_step"] = {
            k: statistics.fmean(r["device_s_per_step"][k] for r in good) for k in good[-1]["device_s_per_step"]
        }
    merged["rounds"] = len(good)
    return merged


def per_round_ratios(results: dict[str, dict[str, Any]], key: str) -> list[float]:
    """Per round: the faster ZeRO-Infinity setting's time over ours (>1: ours faster)."""
    ours = results.get("smart_infinity", {}).get(key, [])
    bases = [results[k][key] for k in ("zero_infinity", "zero_infinity_pipelined") if key in results.get(k, {})]
    return [min(b[i] for b in bases) / o for i, o in enumerate(ours) if bases and all(i < len(b) for b in bases)]


def _setting(text: str) -> tuple[str, int | bool | str]:
    name, _, value = text.partition("=")
    if not name.isidentifier() or not value:
        raise argparse.ArgumentTypeError(f"expected NAME=INT, NAME=true|false or NAME=TEXT, got {text!r}")
    if value in ("true", "false"):
        return name, value == "true"
    return name, int(value) if value.lstrip("-").isdigit() else value


ZERO_SETTINGS = (
    "block_size",
    "queue_depth",
    "intra_op_parallelism",
    "single_submit",
    "overlap_events",
    "pipeline_read",
    "pipeline_write",
    "buffer_count",
)


def _zero_setting(text: str) -> tuple[str, int | bool]:
    name, value = _setting(text)
    if name not in ZERO_SETTINGS:
        raise argparse.ArgumentTypeError(f"--zero {text!r}: the name must be one of {', '.join(ZERO_SETTINGS)}")
    return name, value


def machine_info(args: argparse.Namespace, storage: str) -> dict[str, Any]:
    import deepspeed
    import lightning
    import torch
    from held_disk import current_hold

    disk = subprocess.run(["df", "-h", storage], capture_output=True, text=True).stdout.strip().splitlines()
    return {
        "cpu_count": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "lightning": lightning.__version__,
        "gpu": torch.cuda.get_device_name(0) if args.accelerator == "cuda" else None,
        "storage_dir": storage,
        "disk": disk[-1] if disk else None,
        # Limits of benchmarks/held_disk.py where it runs this benchmark, by disk (major:minor), in bytes/s.
        "held_disk": current_hold(),
        "args": {k: v for k, v in vars(args).items() if k != "run"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=6144)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--sub-group-size", type=int, default=8_000_000)
    parser.add_argument(
        "--model",
        choices=("gpt", "llama"),
        default="gpt",
        help="gpt: this script's small GPT (the default, as the recorded runs); llama: Hugging Face's LlamaForCausalLM "
        "with random weights, shaped by --dim, --layers, --heads, --kv-heads, --ffn and --vocab",
    )
    parser.add_argument("--heads", type=int, default=0, help="llama: attention heads (default --dim / 64)")
    parser.add_argument("--kv-heads", type=int, default=0, help="llama: key/value heads (default a quarter of --heads)")
    parser.add_argument(
        "--ffn", type=int, default=0, help="llama: MLP size (default 8/3 of --dim, to a multiple of 256)"
    )
    parser.add_argument(
        "--accumulate", type=int, default=1, help="micro-batches per optimizer step (accumulate_grad_batches)"
    )
    parser.add_argument("--clip", type=float, default=0.0, help="gradient_clip_val (default 0: no clipping)")
    parser.add_argument("--lr", type=float, default=1e-4, help="peak learning rate of AdamW")
    parser.add_argument(
        "--schedule",
        choices=("constant", "warmup-cosine"),
        default="constant",
        help="per optimizer step: constant, or linear warm-up over a tenth of the steps then cosine decay",
    )
    parser.add_argument("--storage", default=None, help="directory for both runs' storage (default: /tmp)")
    parser.add_argument(
        "--accelerator",
        default="cpu",
        choices=("cpu", "cuda"),
        help="where forward and backward run (default cpu); the state is on --storage either way",
    )
    parser.add_argument(
        "--precision",
        default="bf16-mixed",
        choices=("bf16-mixed", "32-true"),
        help="Lightning precision of every run (default bf16-mixed); 32-true on a CPU without bf16 matrix units "
        "keeps forward and backward from being the largest floor",
    )
    parser.add_argument(
        "--only",
        choices=ALL_RUNS,
        action="append",
        help=f"run only these configurations (tiers: {', '.join(TIER_RUNS)}; state formats: {', '.join(FORMAT_RUNS)}; "
        f"split masters: {', '.join(SPLIT_RUNS)})",
    )
    parser.add_argument(
        "--io-engine",
        default="threads",
        choices=("auto", "aio", "threads"),
        help="smart_infinity device I/O engine (default threads: the faster one on this machine)",
    )
    parser.add_argument(
        "--smartinf",
        metavar="NAME=VALUE",
        type=_setting,
        action="append",
        default=[],
        help="SmartInfinityStrategy setting (an integer, true/false, or text) for every smart_infinity run, over "
        "this script's own, e.g. chunk_size=4194304, prefetch_state=false, offload_parameters=storage or "
        "sub_group_size=8000000 (ours with other sub-groups than --sub-group-size gives ZeRO)",
    )
    parser.add_argument(
        "--zero",
        metavar="NAME=VALUE",
        type=_zero_setting,
        action="append",
        default=[],
        help="ZeRO-Infinity setting for both zero_infinity runs, after the defaults: an `aio` key (block_size, "
        "queue_depth, intra_op_parallelism, single_submit, overlap_events) or an `offload_optimizer` one "
        "(pipeline_read, pipeline_write, buffer_count), e.g. queue_depth=32 or buffer_count=8",
    )
    parser.add_argument(
        "--unfused",
        action="store_true",
        help="smart_infinity runs torch.optim.AdamW without fused=True (the single-tensor arithmetic on the devices)",
    )
    parser.add_argument(
        "--twinflow-ratio",
        type=float,
        default=0.5,
        help="zero_twinflow: the share of sub-groups DeepSpeed updates on the host (offload_optimizer.ratio)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="repeat every configuration, alternating the order")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds after sync before each configuration")
    parser.add_argument("--raw-gib", type=float, default=2.0, help="GiB per direction for the raw bandwidth probe")
    parser.add_argument(
        "--trace",
        action="store_true",
        help="sample the storage's block device every 5 ms and report, per training phase, how busy it was",
    )
    parser.add_argument(
        "--build",
        choices=("init", "configure_model"),
        default="init",
        help="where the module makes its model: in __init__, whole and in fp32 before the strategy partitions it "
        "(the default, as the recorded runs did), or in configure_model under the strategy's zero.Init, partitioned "
        "as it is made (how a model larger than host memory must be built)",
    )
    parser.add_argument("--run", choices=ALL_RUNS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    chosen = set(args.only or RUNS) | {args.run}
    if chosen & set(SPLIT_RUNS) and args.precision != "bf16-mixed":
        parser.error(
            f"--only {sorted(chosen & set(SPLIT_RUNS))[0]} needs --precision bf16-mixed (split masters keep half of "
            f"each master in the bf16 parameters); got --precision {args.precision}"
        )
    if chosen & set(ZERO_FORMAT_RUNS) and args.precision != "bf16-mixed":
        parser.error(
            f"--only {ZERO_FORMAT_RUNS[0]} needs --precision bf16-mixed (DeepSpeed's bf16 states need bf16 masters, "
            f"so bf16 forward and backward); got --precision {args.precision}"
        )

    if args.run:
        result = run_one(args)
        print("BENCH_RESULT " + json.dumps(result), flush=True)
        return

    storage = args.storage or tempfile.gettempdir()
    Path(storage).mkdir(parents=True, exist_ok=True)
    raw = raw_bandwidth(Path(storage), args.raw_gib)
    print(f"# raw direct I/O on {storage}: {raw}", file=sys.stderr, flush=True)
    forwarded = [a for a in sys.argv[1:]]
    names = list(args.only or RUNS)
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for r in range(args.rounds):
        # Alternate the order (A B, B A, ...): this disk drifts and one run's write-back spills into the next.
        for name in names if r % 2 == 0 else names[::-1]:
            os.sync()
            time.sleep(args.settle)
            cmd = [sys.executable, __file__, *forwarded, "--run", name]
            print(f"# round {r + 1}/{args.rounds}: running {name} ...", file=sys.stderr, flush=True)
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("BENCH_RESULT ")]
            if proc.returncode != 0 or not lines:
                print(proc.stdout[-4000:], proc.stderr[-4000:], file=sys.stderr)
                rounds[name].append({"error": f"exit {proc.returncode}"})
                continue
            rounds[name].append(json.loads(lines[-1][len("BENCH_RESULT ") :]))
            print(f"# {name}: {rounds[name][-1]}", file=sys.stderr, flush=True)
    results = {name: merge_rounds(runs) for name, runs in rounds.items()}

    md = table(results)
    if any(name in results for name in TIER_RUNS):
        md += "\n\n" + tiers_table(results)
    if any(name in results for name in FORMAT_RUNS + ZERO_FORMAT_RUNS + SPLIT_RUNS):
        md += "\n\n" + formats_table(results)
    ours = results.get("smart_infinity", {})
    if "disk_read_bytes_per_param_in_step" in ours and ours.get("opt_step_median_s"):
        # Only what the devices still had to move when the step began counts: with overlap_backward the rest
        # moved during backward. /proc/self/io counts O_DIRECT transfers as they are submitted.
        in_step = ours["disk_read_bytes_per_param_in_step"] + ours["disk_write_bytes_per_param_in_step"]
        state_gib = in_step * ours["params"] / 2**30
        achieved = state_gib / ours["opt_step_median_s"]
        md += (
            f"\n\nRaw direct I/O of the storage path (same script, {args.raw_gib:g} GiB each way, "
            "the devices' I/O path): "
            f"read {raw['read_gib_s']:.2f} GiB/s, write {raw['write_gib_s']:.2f} GiB/s, read and write together "
            f"{raw['concurrent_gib_s']:.2f} GiB/s. smart_infinity moved {state_gib:.2f} GiB of state inside the "
            f"median optimizer step: {achieved:.2f} GiB/s = {achieved / raw['concurrent_gib_s']:.0%} of the "
            "concurrent raw bandwidth measured before the runs."
        )
    for key, what in (("round_opt_step_medians_s", "optimizer step"), ("round_train_step_means_s", "train step")):
        ratios = per_round_ratios(results, key)
        if len(ratios) > 1:
            md += (
                f"\n\nPer round ({len(ratios)} rounds, order alternating), {what}, best baseline / ours: "
                + ", ".join(f"{x:.2f}" for x in ratios)
                + f" (median {statistics.median(ratios):.2f})."
            )
    info = machine_info(args, storage)
    info["raw_io"] = raw
    params = next((r["params"] for r in results.values() if "params" in r), None)
    info["params"] = params
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "bench_step.json").write_text(json.dumps({"machine": info, "results": results, "table": md}, indent=2))
    print(f"params: {params:,}" if params else "params: ?")
    print(
        f"machine: {info['cpu_count']} CPUs, torch {info['torch']}, deepspeed {info['deepspeed']}, "
        f"lightning {info['lightning']}, disk: {info['disk']}"
        + (f", held by benchmarks/held_disk.py to {info['held_disk']}" if info["held_disk"] else "")
    )
    print()
    print(md)


if __name__ == "__main__":
    main()
