"""Loading a pretrained Hugging Face model under ``offload_parameters="storage"``: peak RSS and load time, by path.

A Llama-architecture causal LM (hidden 2048, MLP 5632, vocabulary 32000, untied head) is made at each ``--layers``
count (4 layers: 0.34B parameters, 16: 0.94B), saved in bf16 as 2 GB safetensors shards with an index, then
fine-tuned for ``--steps`` bf16 steps with ``SmartInfinityStrategy(offload_parameters="storage")``, each run in a
fresh process, through:

- ``hfcausallm``: :class:`lightning_smartinf.hf.HFCausalLM` (it loads with ``from_pretrained``);
- ``own``: a user's own LightningModule calling :func:`lightning_smartinf.hf.from_pretrained` in ``configure_model``;
- ``transformers``: the same module calling transformers' ``AutoModelForCausalLM.from_pretrained`` under
  transformers' own ZeRO-3 loading (:func:`lightning_smartinf.hf.partitioned_build`), the baseline.

Each run reports the peak RSS of the whole run, how much the peak grew while the model loaded (``/proc/self/status``
VmHWM, reset before the load), the load's seconds, and the step time. ``read_s`` is the time to read every shard file
once in the same process before anything else (page cache as it stands: the files were just written). Records go to
``--out`` (JSON; default ``benchmarks/out/hf-load.json``) and a markdown table is printed::

    .venv/bin/python benchmarks/bench_hf_load.py --work /var/tmp/hf-load --layers 4 16
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PATHS = ("hfcausallm", "own", "transformers")


def status(key: str) -> int:
    """A field of /proc/self/status in bytes (``VmRSS``: now; ``VmHWM``: the peak since the last reset)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == key:
            return int(value.split()[0]) * 1024
    raise KeyError(key)


def make_model(directory: Path, layers: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights

    if (directory / "config.json").is_file():
        return
    config = LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers, num_attention_heads=16,
        num_key_value_heads=16, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    with no_init_weights():
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02) if param.dim() > 1 else param.fill_(1.0)
    model.save_pretrained(directory, max_shard_size="2GB")
    from lightning_smartinf.hf import train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer([REPO / "recipes" / "data" / "python_docs.txt"], directory / "tokenizer")
    tokenizer.save_pretrained(directory)


def worker(model_dir: Path, storage: Path, path: str, steps: int) -> dict[str, Any]:
    """One fine-tuning run in this process; returns its figures."""
    import lightning as L
    import torch

    from lightning_smartinf import SmartInfinityStrategy
    from lightning_smartinf.hf import from_pretrained, partitioned_build

    start = time.perf_counter()
    for file in sorted(model_dir.glob("*.safetensors")):
        with open(file, "rb") as f:
            while f.read(64 << 20):
                pass
    report: dict[str, Any] = {"read_s": time.perf_counter() - start}

    def measured_load(load: Callable[[], None]) -> None:
        """Run ``load``, recording its seconds and how much it raised the peak RSS; the peak then starts again."""
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before, begin = status("VmRSS"), time.perf_counter()
        load()
        report["load_s"] = time.perf_counter() - begin
        report["load_growth_gb"] = (status("VmHWM") - before) / 1e9
        Path("/proc/self/clear_refs").write_text("5")  # the peak from here on: the training's

    class Own(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: torch.nn.Module | None = None

        def configure_model(self) -> None:
            if self.model is None:
                measured_load(self.load)

        def load(self) -> None:
            if path == "transformers":
                from transformers import AutoModelForCausalLM

                with partitioned_build(self):
                    self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
            else:
                self.model = from_pretrained(self, model_dir)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-5)

    if path == "hfcausallm":
        from lightning_smartinf.hf import HFCausalLM

        class Timed(HFCausalLM):
            def configure_model(self) -> None:
                if self.model is None:
                    measured_load(super().configure_model)

            def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
                return self.model(input_ids=batch, labels=batch).loss

        module: L.LightningModule = Timed(str(model_dir), warmup_steps=0)
    else:
        module = Own()

    class StepClock(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, *_: Any) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, *_: Any) -> None:
            self.times.append(time.perf_counter() - self.start)

    clock = StepClock()
    batches = [torch.randint(0, 32000, (16,), generator=torch.Generator().manual_seed(i)) for i in range(steps)]
    trainer = L.Trainer(
        accelerator="cpu",
        strategy=SmartInfinityStrategy(storage_paths=[storage], offload_parameters="storage"),
        precision="bf16-true",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
    )
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=1))
    report["train_peak_rss_gb"] = status("VmHWM") / 1e9
    report["step_s"] = clock.times
    return report


def launch(model_dir: Path, storage: Path, path: str, steps: int) -> dict[str, Any]:
    shutil.rmtree(storage, ignore_errors=True)
    storage.mkdir(parents=True)
    command = [sys.executable, __file__, "--worker", str(model_dir), str(storage), path, str(steps)]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    shutil.rmtree(storage, ignore_errors=True)
    if done.returncode != 0:
        return {"error": done.returncode, "last_line": (done.stderr or done.stdout).strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| parameters | path | load growth of peak RSS (GB) | bf16 model (GB) | load (s) | read shards once (s) "
        "| peak RSS in training (GB) | step (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['params'] / 1e9:.2f}B | {r['path']} | failed: {r['last_line']} |||||")
            continue
        lines.append(
            f"| {r['params'] / 1e9:.2f}B | {r['path']} | {r['load_growth_gb']:.2f} | {2 * r['params'] / 1e9:.2f} | "
            f"{r['load_s']:.1f} | {r['read_s']:.1f} | {r['train_peak_rss_gb']:.2f} | {r['step_s'][-1]:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="directory for the models and the runs' state")
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "hf-load.json")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    results = []
    for layers in args.layers:
        model_dir = args.work / f"llama-{layers}"
        make_model(model_dir, layers)
        params = 2 * 32000 * 2048 + layers * (4 * 2048 * 2048 + 3 * 2048 * 5632 + 2 * 2048) + 2048
        for path in args.paths:
            result = {
                "layers": layers,
                "params": params,
                "path": path,
                **launch(model_dir, args.work / "state", path, args.steps),
            }
            results.append(result)
            print(json.dumps(result), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": results}, indent=1))
    print(table(results))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        model_dir, storage, path, steps = sys.argv[2:6]
        print(json.dumps(worker(Path(model_dir), Path(storage), path, int(steps))))
    else:
        main()
