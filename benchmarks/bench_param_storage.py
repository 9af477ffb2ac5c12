"""Parameters on storage: peak RSS and step time against ZeRO-Infinity, model by model, each run in its own process.

The model: a stack of ``--width``-wide bias-free linear layers, or with ``--model gpt`` a
GPT-style decoder (12 width² per block plus embeddings and head), built in ``configure_model`` (under ZeRO's
``Init``, as a model larger than memory must be), trained in bf16 with AdamW for ``--steps`` steps.

Configurations (``--runs``):

- ``ours_storage``: ``SmartInfinityStrategy(offload_parameters="storage")``;
- ``ours_memory``: ``offload_parameters=True`` (16-bit parameters in host memory);
- ``zi_cpu``: ZeRO-Infinity, optimizer state on NVMe, parameters in host memory;
- ``zi_nvme``: ZeRO-Infinity with ``offload_param: nvme`` too, its buffers sized for the model (``buffer_size`` = the
  largest parameter, ``buffer_count`` = 8, ``max_in_cpu`` = 0), the best setting that does not fail with
  "Not enough buffers" here.

A run that fails (out of memory, out of disk, a DeepSpeed error) is recorded with its exit status and the last line it
printed. ZeRO-Infinity checks no free space and fails only when its disk is full, so a ZeRO-Infinity run whose files
would not fit (``zi_cpu``: 16 B/param: fp32 master, two moments and the fp32 gradient swap; ``zi_nvme``: 2 B more for
the parameters) is recorded as not run instead of filling the machine's disk; ours checks for itself. Each run's
storage directory is made and removed by this script, so a run killed for memory leaves nothing behind; the peak disk
use is sampled while it runs. Results go to ``--out`` (JSON; the runs of other configurations and sizes already there
are kept) and a markdown table is printed. ZeRO-Infinity runs DeepSpeedCPUAdam (AdamW mode), ours torch's AdamW.

    PYTHONPATH=. TORCH_EXTENSIONS_DIR=.venv/torch_extensions .venv/bin/python benchmarks/bench_param_storage.py \\
        --layers 23 --storage /var/tmp/bench --out docs/param-storage-1.5b.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

RUNS = ("ours_storage", "ours_memory", "zi_cpu", "zi_nvme")


def strategy_for(run: str, args: argparse.Namespace, storage: Path) -> Any:
    if run.startswith("ours"):
        from lightning_smartinf import SmartInfinityStrategy

        return SmartInfinityStrategy(
            storage_paths=[storage],
            offload_parameters="storage" if run == "ours_storage" else True,
            sub_group_size=args.sub_group_size,
            reduce_bucket_size=args.sub_group_size,
            overlap_backward=not args.one_copy,
            compression={"ratio": args.ratio, "rule": args.compression} if args.compression else None,
        )
    from lightning_smartinf.lightning.cpu_support import DeepSpeedCPUStrategy

    offload_param: dict[str, Any] = {"device": "cpu"}
    if run == "zi_nvme":
        offload_param = {
            "device": "nvme",
            "nvme_path": str(storage),
            "buffer_count": 8,
            "buffer_size": largest_param(args),
            "max_in_cpu": 0,
        }
    return DeepSpeedCPUStrategy(
        config={
            "train_micro_batch_size_per_gpu": args.batch,
            "zero_allow_untested_optimizer": True,
            "zero_optimization": {
                "stage": 3,
                "sub_group_size": args.sub_group_size,
                "reduce_bucket_size": args.sub_group_size,
                "stage3_max_reuse_distance": 0,
                "offload_optimizer": {"device": "nvme", "nvme_path": str(storage)},
                "offload_param": offload_param,
            },
            "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False},
        }
    )


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    class Stack(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net: torch.nn.Module | None = None

        def configure_model(self) -> None:
            if self.net is None:
                if args.model == "gpt":
                    self.net = gpt(args.width, args.layers, args.vocab)
                else:
                    layers = (torch.nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers))
                    self.net = torch.nn.Sequential(*layers)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if args.model == "gpt":
                tokens, targets = batch
                logits = self.net(tokens)
                return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            return self.net(batch[0]).float().pow(2).mean()

        def configure_optimizers(self) -> Any:
            if args.run.startswith("zi"):  # ZeRO-Offload takes only its own CPU Adam
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                return DeepSpeedCPUAdam(self.parameters(), lr=1e-4, adamw_mode=True)
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, *_: Any) -> None:
            self.starts.append(time.perf_counter())

        def on_train_end(self, *_: Any) -> None:
            self.starts.append(time.perf_counter())

    storage = Path(args.storage)
    Path("/proc/self/oom_score_adj").write_text("1000")  # the kernel's out-of-memory choice is this run, not a shell
    if args.model == "gpt":
        tokens = torch.randint(0, args.vocab, (args.batch * args.steps, args.seq + 1))
        data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    else:
        data = TensorDataset(torch.randn(args.batch * args.steps, args.width))
    timer = Timer()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy_for(args.run, args, storage),
        precision="bf16-true",
        max_steps=args.steps,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(storage),
    )
    started = time.perf_counter()
    trainer.fit(Stack(), DataLoader(data, batch_size=args.batch))
    steps = [b - a for a, b in zip(timer.starts, timer.starts[1:])]
    result = {
        "run": args.run + (f"_{args.compression}" if args.compression else ""),
        "params": model_params(args),
        "ok": True,
        "step_s": steps,
        "step_median_s": statistics.median(steps[1:] or steps),
        "setup_s": timer.starts[0] - started,
        "peak_rss_gb": peak_rss_gb(),
    }
    traffic = getattr(trainer.strategy, "traffic", None)
    if traffic is not None:
        result["param_read_bytes"], result["param_write_bytes"] = (
            traffic.param_read_bytes,
            traffic.param_write_bytes,
        )
    return result


def gpt(width: int, layers: int, vocab: int) -> Any:
    """A GPT-style decoder: embeddings, pre-norm attention and 4x MLP blocks, a head; 12 width² per block."""
    import torch
    from bench_activations import Block  # this script's directory is on the path: it is run as a script
    from torch import nn

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.blocks = nn.Sequential(*(Block(width, max(1, width // 128)) for _ in range(layers)))
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab, bias=False)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.norm(self.blocks(self.embed(tokens))))

    return GPT()


def model_params(args: argparse.Namespace) -> int:
    if args.model == "gpt":
        block = 12 * args.width**2 + 13 * args.width  # weights, biases and two norms
        return args.layers * block + 2 * args.vocab * args.width + 2 * args.width
    return args.width * args.width * args.layers


def largest_param(args: argparse.Namespace) -> int:
    return max(4 * args.width**2, args.vocab * args.width) if args.model == "gpt" else args.width**2


def peak_rss_gb() -> float:
    """This process's peak RSS (``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e9
    raise RuntimeError("no VmHWM in /proc/self/status")


ZI_DISK_BYTES_PER_PARAM = {"zi_cpu": 16, "zi_nvme": 18}


def launch(args: argparse.Namespace, run: str, layers: int) -> dict[str, Any]:
    params = model_params(argparse.Namespace(**{**vars(args), "layers": layers}))
    name = run + (f"_{args.compression}" if args.compression and run.startswith("ours") else "")
    failed = {"run": name, "params": params, "ok": False}
    Path(args.storage).mkdir(parents=True, exist_ok=True)
    storage = Path(tempfile.mkdtemp(prefix=f"params_{run}_", dir=args.storage))
    try:
        free = shutil.disk_usage(storage).free
        need = ZI_DISK_BYTES_PER_PARAM.get(run, 0) * params
        if need > 0.95 * free:
            note = f"not run: needs {need / 1e9:.0f} GB of disk, {free / 1e9:.0f} GB free"
            return {**failed, "returncode": None, "error": note}
        command = [sys.executable, __file__, "--run", run, "--layers", str(layers), "--storage", str(storage)]
        for name in ("model", "width", "vocab", "seq", "steps", "batch", "sub_group_size"):
            command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
        command += ["--one-copy"] if args.one_copy else []
        command += ["--compression", args.compression, "--ratio", str(args.ratio)] if args.compression else []
        subprocess.run(["sync"], check=False)
        with DiskSampler(storage) as disk:
            done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": "."})
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode == 0 and lines:
            return {**json.loads(lines[-1]), "peak_disk_gb": disk.peak / 1e9}
        tail = (done.stderr.strip().splitlines() or [""])[-1]
        return {**failed, "returncode": done.returncode, "error": tail, "peak_disk_gb": disk.peak / 1e9}
    finally:
        shutil.rmtree(storage, ignore_errors=True)


class DiskSampler:
    """The most a run's filesystem filled beyond where it started, sampled every half second."""

    def __init__(self, path: Path) -> None:
        self.path, self.peak = path, 0
        self.start = shutil.disk_usage(path).used
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)

    def sample(self) -> None:
        while not self.done.wait(0.5):
            self.peak = max(self.peak, shutil.disk_usage(self.path).used - self.start)

    def __enter__(self) -> DiskSampler:
        self.thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.done.set()
        self.thread.join()


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| run | params | peak RSS (GB) | step (s, median) | peak disk (GB) | note |", "|---|---|---|---|---|---|"]
    for r in results:
        disk = f"{r['peak_disk_gb']:.1f}" if "peak_disk_gb" in r else "–"
        if r["ok"]:
            rss, step = f"{r['peak_rss_gb']:.1f}", f"{r['step_median_s']:.1f}"
            rows.append(f"| {r['run']} | {r['params'] / 1e9:.2f}B | {rss} | {step} | {disk} | |")
        else:
            note = f"failed ({r['returncode']}): {r['error'][:80]}" if r["returncode"] is not None else r["error"]
            rows.append(f"| {r['run']} | {r['params'] / 1e9:.2f}B | – | – | {disk} | {note} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    parser.add_argument("--layers", type=int, nargs="+", default=[23], help="model sizes to run, in layers")
    parser.add_argument("--model", choices=("stack", "gpt"), default="stack", help="linear stack or GPT-style")
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=8192, help="--model gpt: vocabulary")
    parser.add_argument("--seq", type=int, default=64, help="--model gpt: tokens per sample")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--sub-group-size", type=int, default=100_000_000)
    parser.add_argument("--storage", default=None, help="directory for every run's files (default: the temp dir)")
    parser.add_argument(
        "--one-copy",
        action="store_true",
        help="ours with overlap_backward=False: one copy of the state on disk (12 B/param with Adam, not 24)",
    )
    parser.add_argument(
        "--compression",
        choices=("ef_adam", "ef_adafactor", "optimizer"),
        help="ours with top-k compression under this rule (the device state is then 8 or 4 B/param, not 12)",
    )
    parser.add_argument("--ratio", type=float, default=0.01, help="--compression: the kept ratio")
    parser.add_argument("--out", type=Path, default=None, help="JSON file for the results")
    parser.add_argument("--run", choices=RUNS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        args.layers = args.layers[0]
        print(json.dumps(run_one(args)))
        return
    results = []
    for layers in args.layers:
        for run in args.runs:
            result = launch(args, run, layers)
            print(json.dumps(result), flush=True)
            results.append(result)
    if args.out and args.out.exists():  # runs of other configurations or sizes stay
        done = {(r["run"], r["params"]) for r in results}
        kept = [r for r in json.loads(args.out.read_text())["results"] if (r["run"], r["params"]) not in done]
        results = kept + results
    print(table(results))
    if args.out:
        args.out.write_text(json.dumps({"width": args.width, "steps": args.steps, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
