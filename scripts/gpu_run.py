"""The prepared run for a lent GPU: the single-GPU checks, a user's whole journey, and one step against ZeRO-Infinity.

A GPU is lent now and then, for minutes, with nothing reachable from it: this script needs nothing downloaded and
writes one JSON record (``OUT/record.json``, rewritten as each part ends, so a run cut short keeps what finished).

    .venv/bin/python scripts/gpu_run.py --out /tmp/gpu-run              # on the GPU machine: everything, <= 10 min
    .venv/bin/python scripts/gpu_run.py --out /tmp/gpu-run --device cpu --size tiny   # the same, small, on a CPU

Parts (``--parts``, in this order):

``checks``
    ``tests/cuda/gpu_checks.py all``: every single-GPU check of the GPU suite, each in its own process.
``journey``
    What a user runs: a Llama-architecture Hugging Face model (0.95B parameters on a GPU; ``--size tiny``: 0.1M)
    created here in bf16 safetensors; their own LightningModule with ``from_pretrained`` in ``configure_model``;
    ``precision="bf16-true"``; ``ModelCheckpoint(save_last=True)``; the fit killed (SIGKILL) after a checkpoint and
    resumed from ``last.ckpt``; ``smartinf export --dtype bf16``; transformers reloading the export and generating.
    Each process's peak GPU memory and host RSS are recorded.
``step``
    ``benchmarks/bench_step.py``, the step users run: a Llama (1.1B parameters on a GPU, fewer layers where the disk
    is small), bf16, sequences of 512 tokens, 8 micro-batches accumulated, ``gradient_clip_val=1.0``, AdamW with
    warm-up and cosine decay; alternating rounds of ours with all of the state on storage, ZeRO-Infinity (its best
    setting, pipelined), and ours with half of the state in host memory. Before them, ``smartinf plan --calibrate``
    on the same path and the plan of the same model: its predicted steps beside the measured ones.
``activations``
    ``benchmarks/bench_activations.py``: activation offload's chosen settings and measured overhead.

Asked for by name only (``--parts formats``; run it in a second call when the first left device time):

``formats``
    ``benchmarks/bench_step.py`` at the shape of the state formats' step benchmark (a GPT of 1.54B parameters, fewer
    layers where the disk is small; bf16; 16 tokens; sub-groups of 100M): one round each of ours in fp32, in int8, in
    int8 with split masters, in int8 with half of the state in host memory (whole and split masters), and
    ZeRO-Infinity pipelined. Where forward and backward are a GPU's, the step is the state's.

Each part sizes itself to the disk and memory it finds and is refused, with the reason in the record, where the
machine cannot run it. The record's format: ``{"machine": {...}, "parts": {name: {"status": "passed" | "failed" |
"refused" | "timed out", "seconds": s, ...figures}}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PARTS = ("checks", "journey", "step", "activations")
#: Parts run only when named in ``--parts``.
EXTRA_PARTS = ("formats",)
#: The state formats' runs of ``bench_step.py`` (the ``formats`` part).
FORMAT_RUNS = (
    "smart_infinity",
    "smart_infinity_int8",
    "smart_infinity_int8_split",
    "smart_infinity_mem50_int8",
    "smart_infinity_mem50_int8_split",
    "zero_infinity_pipelined",
)
#: Model shapes by ``--size``: Llama hidden size, MLP size, layers, vocabulary (``gpu``: 0.95B parameters; at least
#: 257 tokens: a byte-level BPE tokenizer's 256 bytes and its end-of-text token).
SIZES = {"gpu": (2048, 5632, 16, 32000), "tiny": (64, 160, 2, 257)}
#: Bytes of disk per parameter the journey needs: the bf16 model and its export (2 + 2), the state with its second
#: copy under overlap_backward (24) and two checkpoints of it (24).
JOURNEY_DISK_PER_PARAM = 52


def llama_params(hidden: int, mlp: int, layers: int, vocab: int) -> int:
    return layers * (4 * hidden * hidden + 3 * hidden * mlp + 2 * hidden) + 2 * vocab * hidden + hidden


def python(*args: str | Path, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}", **(env or {})}
    return subprocess.run(
        [sys.executable, *map(str, args)], cwd=REPO, env=environment, capture_output=True, text=True, timeout=timeout
    )


# ------------------------------------------------------------------------------------------------ the journey


def journey_fit(args: argparse.Namespace) -> None:
    """One fit of the journey, in a process of its own (``--journey-fit``): killed after ``--kill-after`` steps'
    checkpoint, or resumed from ``last.ckpt``. Prints its figures as one JSON line."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_smartinf import SmartInfinityStrategy
    from lightning_smartinf.hf import from_pretrained

    class UserLM(L.LightningModule):
        def __init__(self, path: str) -> None:
            super().__init__()
            self.path, self.model, self.losses = path, None, []

        def configure_model(self) -> None:
            if self.model is None:
                self.model = from_pretrained(self, self.path)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = self.model(input_ids=batch, labels=batch).loss
            self.losses.append(float(loss))
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.01)

    class KillAfter(L.Callback):
        """SIGKILL at the start of the step after ``steps``: its checkpoint is whole, nothing after it ran."""

        def __init__(self, steps: int) -> None:
            self.steps = steps

        def on_train_batch_start(self, trainer: L.Trainer, *_: Any) -> None:
            if trainer.global_step == self.steps:
                print(json.dumps(figures(module.losses)), flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    def figures(losses: list[float]) -> dict[str, Any]:
        peak_gpu = int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else None
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"losses": losses, "peak_gpu_bytes": peak_gpu, "peak_rss_bytes": rss}

    work = Path(args.journey_fit)
    cuda = args.device == "cuda"
    module = UserLM(str(work / "model"))
    generator = torch.Generator().manual_seed(0)
    vocab = SIZES[args.size][3]
    batches = [torch.randint(0, vocab, (args.seq,), generator=generator) for _ in range(args.steps)]
    kill = [KillAfter(args.kill_after)] if args.kill_after else []
    trainer = L.Trainer(
        accelerator="cuda" if cuda else "cpu",
        devices=1,
        strategy=SmartInfinityStrategy(storage_paths=[work / "state"], sub_group_size=args.sub_group_size),
        precision="bf16-true",
        max_steps=args.steps,
        callbacks=[ModelCheckpoint(dirpath=work / "ckpt", save_last=True, every_n_train_steps=2), *kill],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    resume = work / "ckpt" / "last.ckpt" if not args.kill_after else None
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=1), ckpt_path=resume)
    print(json.dumps(figures(module.losses)), flush=True)


def make_model(directory: Path, size: str) -> int:
    """A Llama-architecture model in bf16 safetensors (seed 0), with a byte-level tokenizer trained here."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_smartinf.hf import train_bpe_tokenizer

    hidden, mlp, layers, vocab = SIZES[size]
    tokenizer = train_bpe_tokenizer([REPO / "recipes" / "data" / "python_docs.txt"], directory, vocab_size=vocab)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 128), max_position_embeddings=2048, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory, max_shard_size="2GB")
    return sum(p.numel() for p in model.parameters())


def journey(out: Path, args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    work = out / "journey"
    shutil.rmtree(work, ignore_errors=True)
    (work / "model").mkdir(parents=True)
    hidden, mlp, layers, vocab = SIZES[args.size]
    params = llama_params(hidden, mlp, layers, vocab)
    free = shutil.disk_usage(work).free
    if free < JOURNEY_DISK_PER_PARAM * params:
        return {
            "status": "refused",
            "reason": f"{params / 1e9:.2f}B parameters need {JOURNEY_DISK_PER_PARAM * params / 1e9:.1f} GB of disk "
            f"(model, export, state twice, two checkpoints); {free / 1e9:.1f} GB free under {out}",
        }
    record: dict[str, Any] = {"params": make_model(work / "model", args.size)}
    common = ["--device", args.device, "--size", args.size, "--steps", "6", "--seq", str(args.seq)]
    common += ["--sub-group-size", str(args.sub_group_size)]
    killed = python(
        __file__, "--journey-fit", work, "--kill-after", "4", *common, timeout=max(60, deadline - time.monotonic())
    )
    if killed.returncode != -signal.SIGKILL:
        return {**record, "status": "failed", "stage": "fit killed after step 4", "output": killed.stderr[-4000:]}
    record["killed"] = json.loads(killed.stdout.strip().splitlines()[-1])
    resumed = python(__file__, "--journey-fit", work, *common, timeout=max(60, deadline - time.monotonic()))
    if resumed.returncode != 0:
        return {**record, "status": "failed", "stage": "resume from last.ckpt", "output": resumed.stderr[-4000:]}
    record["resumed"] = json.loads(resumed.stdout.strip().splitlines()[-1])
    export = python(
        "-m", "lightning_smartinf.commands.cli", "export", work / "ckpt" / "last.ckpt", "--save-pretrained",
        work / "exported", "--hf-model-dir", work / "model", "--dtype", "bf16",
        timeout=max(60, deadline - time.monotonic()),
    )  # fmt: skip
    if export.returncode != 0:
        return {**record, "status": "failed", "stage": "smartinf export", "output": export.stderr[-4000:]}
    generate = python(
        "-c",
        "import json, sys, torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "path = sys.argv[1]\n"
        "model = AutoModelForCausalLM.from_pretrained(path)\n"
        "tokenizer = AutoTokenizer.from_pretrained(path)\n"
        "ids = tokenizer('def main():', return_tensors='pt').input_ids\n"
        "out = model.generate(ids, max_new_tokens=8, do_sample=False)\n"
        "print(json.dumps({'dtype': str(model.dtype), 'generated': tokenizer.decode(out[0][ids.shape[1]:])}))\n",
        work / "exported",
        timeout=max(60, deadline - time.monotonic()),
    )
    if generate.returncode != 0:
        return {**record, "status": "failed", "stage": "transformers reload", "output": generate.stderr[-4000:]}
    record["reloaded"] = json.loads(generate.stdout.strip().splitlines()[-1])
    record["steps_trained"] = len(record["killed"]["losses"]) + len(record["resumed"]["losses"])
    return {**record, "status": "passed"}


# ------------------------------------------------------------------------------------------------ the other parts


def checks(out: Path, args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    done = python(
        REPO / "tests" / "cuda" / "gpu_checks.py", "all", "--device", args.device, "--out", out / "checks",
        "--timeout", str(max(60, (deadline - time.monotonic()) / 4)), timeout=max(60, deadline - time.monotonic()),
    )  # fmt: skip
    results = {
        report.stem: json.loads(report.read_text())
        for report in sorted((out / "checks").glob("*/*.json"))
        if ".rank" not in report.name
    }
    table = done.stdout.split("--- paste into a bug report ---")[0].strip().splitlines()[-15:]
    return {"status": "passed" if done.returncode == 0 else "failed", "table": table, "checks": results}


def step(out: Path, args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    """The step users run (a Llama in bf16, sequences of 512 tokens, 8 micro-batches accumulated, clipping at 1.0,
    AdamW with warm-up and cosine decay), in alternating rounds: ours with all of the state on storage,
    ZeRO-Infinity (its best setting, pipelined), ours with half of the state in host memory. The largest model of
    1.1B or fewer parameters (fewer layers) whose state (ours 24 B/param with overlap's second copy; ZeRO's 16 B/param
    swap files) fits in half the free disk."""
    storage = out / "step"
    storage.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(storage).free
    # TinyLlama's shape (1.1B parameters) on a GPU; on a CPU a small one.
    dim, mlp, layers, vocab = (2048, 5632, 22, 32000) if args.size == "gpu" else (64, 160, 2, 256)
    while 40 * llama_params(dim, mlp, layers, vocab) > free / 2 and layers > 2:
        layers //= 2
    params = llama_params(dim, mlp, layers, vocab)
    if 40 * params > free / 2:
        return {"status": "refused", "reason": f"{free / 1e9:.1f} GB free under {out}: too little for a step"}
    runs = ["smart_infinity", "zero_infinity_pipelined", "smart_infinity_mem50"]
    heads = max(1, dim // 64)
    seq = 512 if args.size == "gpu" else 32
    planner = predicted_step(out, storage, dim, mlp, layers, vocab, heads, seq, deadline)
    command = [REPO / "benchmarks" / "bench_step.py", "--model", "llama", "--dim", str(dim), "--layers", str(layers)]
    command += ["--heads", str(heads), "--kv-heads", str(max(1, heads // 8)), "--ffn", str(mlp), "--vocab", str(vocab)]
    command += ["--seq", str(seq), "--batch", "1", "--accumulate", "8", "--clip", "1.0"]
    command += ["--schedule", "warmup-cosine", "--lr", "3e-4", "--build", "configure_model"]
    command += ["--sub-group-size", "100000000", "--rounds", "2", "--storage", storage, "--accelerator", args.device]
    command += ["--settle", "1", "--raw-gib", "0.25", *(item for run in runs for item in ("--only", run))]
    command += ["--steps", "3", "--warmup", "1"] if args.size == "gpu" else ["--steps", "1", "--warmup", "1"]
    done = python(*command, timeout=max(60, deadline - time.monotonic()))
    result = REPO / "benchmarks" / "out" / "bench_step.json"
    record: dict[str, Any] = {"dim": dim, "layers": layers, "params": params, "planner": planner}
    if done.returncode != 0 or not result.is_file():
        return {**record, "status": "failed", "output": done.stderr[-4000:]}
    measured = json.loads(result.read_text())
    record["planner_over_measured"] = {
        run: planner["step"][key] / measured["results"][run]["train_step_mean_s"]
        for run, key in (("smart_infinity", "all_state_on_paths"), ("zero_infinity_pipelined", "zero_infinity"))
        if "step" in planner and "train_step_mean_s" in measured["results"].get(run, {})
    }
    return {**record, "status": "passed", "bench_step": measured}


def formats(out: Path, args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    """The state formats' step (:data:`FORMAT_RUNS`, one round each): a GPT of 1.54B parameters (2048 wide, 30 layers;
    fewer layers where half the free disk cannot hold ours in fp32 with overlap's second copy and ZeRO's swap files,
    40 B/param), bf16, 16 tokens a step, sub-groups of 100M."""
    storage = out / "formats"
    storage.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(storage).free
    dim, layers = (2048, 30) if args.size == "gpu" else (64, 2)
    params = lambda n: n * 12 * dim * dim + 2 * 6144 * dim  # noqa: E731 - bench_step's GPT (vocabulary 6144)
    while 40 * params(layers) > free / 2 and layers > 2:
        layers //= 2
    if 40 * params(layers) > free / 2:
        return {"status": "refused", "reason": f"{free / 1e9:.1f} GB free under {out}: too little for a step"}
    command = [REPO / "benchmarks" / "bench_step.py", "--dim", str(dim), "--layers", str(layers)]
    command += ["--seq", "16", "--batch", "1", "--warmup", "1", "--steps", "2", "--precision", "bf16-mixed"]
    command += ["--sub-group-size", str(100_000_000 if args.size == "gpu" else 100_000), "--rounds", "1"]
    command += ["--storage", storage, "--accelerator", args.device, "--settle", "1", "--raw-gib", "0.25"]
    command += [item for run in FORMAT_RUNS for item in ("--only", run)]
    done = python(*command, timeout=max(60, deadline - time.monotonic()))
    result = REPO / "benchmarks" / "out" / "bench_step.json"
    record: dict[str, Any] = {"dim": dim, "layers": layers, "params": params(layers)}
    if done.returncode != 0 or not result.is_file():
        return {**record, "status": "failed", "output": done.stderr[-4000:]}
    return {**record, "status": "passed", "bench_step": json.loads(result.read_text())}


def predicted_step(
    out: Path, storage: Path, dim: int, mlp: int, layers: int, vocab: int, heads: int, seq: int, deadline: float
) -> dict[str, Any]:
    """What ``smartinf plan`` predicts for the step part's model, from a profile calibrated on its storage path just
    before the runs: the step with all of the state there (``all_state_on_paths``) and ZeRO-Infinity's
    (``zero_infinity``), to set beside the measured train steps."""
    profile, config = out / "step-machine.json", out / "step-llama-config.json"
    config.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": dim,
                "intermediate_size": mlp,
                "num_hidden_layers": layers,
                "num_attention_heads": heads,
                "num_key_value_heads": max(1, heads // 8),
                "vocab_size": vocab,
                "hidden_act": "silu",
                "tie_word_embeddings": False,
                "max_position_embeddings": max(seq, 2048),
            }
        )
    )
    timeout = max(60, min(180, deadline - time.monotonic()))
    calibrated = python("-m", "lightning_smartinf.plan", "--calibrate", storage, "--calibrate-mb", "256", "-o", profile,
                        timeout=timeout)  # fmt: skip
    if calibrated.returncode != 0:
        return {"status": "failed", "stage": "calibrate", "output": calibrated.stderr[-2000:]}
    planned = python("-m", "lightning_smartinf.plan", "--model", config, "--profile", profile, "--batch", "1",
                     "--seq", str(seq), "--accumulate", "8", "--devices", "1", "--json", timeout=timeout)  # fmt: skip
    if planned.returncode != 0:
        return {"status": "failed", "stage": "plan", "output": planned.stderr[-2000:]}
    return {"status": "passed", "calibrated": json.loads(profile.read_text()), **json.loads(planned.stdout)}


def activations(out: Path, args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    result = out / "activations.json"
    command = [REPO / "benchmarks" / "bench_activations.py", "--device", args.device, "--out", result]
    command += ["--path", out / "activations-spill"]
    if args.size == "tiny":
        command += ["--dim", "64", "--layers", "4", "--heads", "2", "--seq", "32", "--rounds", "1", "--steps", "1"]
    (out / "activations-spill").mkdir(parents=True, exist_ok=True)
    done = python(*command, timeout=max(60, deadline - time.monotonic()))
    if done.returncode != 0 or not result.is_file():
        return {"status": "failed", "output": done.stderr[-4000:]}
    return {"status": "passed", "bench_activations": json.loads(result.read_text())}


def machine() -> dict[str, Any]:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": gpu,
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="where the record and every part's files go")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--size", choices=tuple(SIZES), default=None, help="default: gpu on cuda, tiny on cpu")
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS + EXTRA_PARTS)}"
    )
    parser.add_argument("--budget-s", type=float, default=570.0, help="seconds for all parts together")
    parser.add_argument("--seq", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--sub-group-size", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--journey-fit", help=argparse.SUPPRESS)
    parser.add_argument("--kill-after", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.size = args.size or ("gpu" if args.device == "cuda" else "tiny")
    args.seq = args.seq or (1024 if args.size == "gpu" else 16)
    args.sub_group_size = args.sub_group_size or (100_000_000 if args.size == "gpu" else 100_000)
    if args.journey_fit:
        journey_fit(args)
        return
    if args.out is None:
        parser.error("--out is required")
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS + EXTRA_PARTS]
    if unknown:
        parser.error(f"--parts {args.parts!r}: unknown {unknown}; choose from {', '.join(PARTS + EXTRA_PARTS)}")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(
            "--device cuda: this machine has no CUDA GPU (torch.cuda.is_available() is False); use --device cpu"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"machine": machine(), "size": args.size, "parts": {}}
    started = time.monotonic()
    deadline = started + args.budget_s
    for name in parts:
        began = time.monotonic()
        if began >= deadline:
            record["parts"][name] = {"status": "refused", "reason": "no time left in --budget-s"}
            continue
        try:
            run = {"checks": checks, "journey": journey, "step": step, "activations": activations, "formats": formats}
            result = run[name](args.out, args, deadline)
        except subprocess.TimeoutExpired:
            result = {"status": "timed out"}
        except Exception:  # noqa: BLE001 - one part's failure is recorded, and the next parts still run
            result = {"status": "failed", "stage": "in this script", "output": traceback.format_exc()[-4000:]}
        record["parts"][name] = {**result, "seconds": round(time.monotonic() - began, 1)}
        (args.out / "record.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
        print(f"{name}: {record['parts'][name]['status']} in {record['parts'][name]['seconds']:.0f} s", flush=True)
    failed = [n for n, p in record["parts"].items() if p["status"] in ("failed", "timed out")]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
