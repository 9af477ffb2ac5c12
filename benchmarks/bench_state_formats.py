"""What each ``state_precision`` costs and saves: the update's rate on this CPU, and the storage bytes of a step.

Two measurements, side by side for ``fp32``, ``bf16`` and ``int8``:

1. The update of one chunk (``--chunk`` elements of AdamW state) through each format as the ``cpu`` devices run it
   (bf16 and int8 with their C kernels, and with their plain-torch references beside them), on one thread, then on
   all of torch's intra-op threads (a memory tier's one device updates with them all): milliseconds per chunk and
   elements per second, best of ``--rounds`` alternating rounds; for ``torch.optim.AdamW`` as users build it (the
   single-tensor arithmetic, which the kernels fuse with the formats) and built with ``fused=True`` (torch's fused
   kernel, then the formats' conversions). Where it is slower than the disk delivers the state, the update, not the
   disk, sets the step.
2. A short fit of a small GPT (``--steps`` steps, prefetch off, updates after backward) on one storage path: the
   storage bytes read and written per parameter per step, from the backend's exact counters.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_state_formats.py --out docs/state-formats.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

FORMATS = ("fp32", "bf16", "int8")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def update_rates(chunk: int, rounds: int, repeats: int, threads: int, fused: bool) -> dict[str, dict[str, float]]:
    from lightning_smartinf.core.rules import Adam, StepParams
    from lightning_smartinf.core.state_formats import reference_format, state_format, update_chunk

    # The devices' formats, and their plain-torch references beside their C kernels (the same bytes).
    formats = {name: state_format(name) for name in FORMATS[1:]}
    formats.update({f"{name}-reference": reference_format(name) for name in FORMATS[1:]})

    torch.set_num_threads(threads)
    rule = Adam(decoupled_weight_decay=True, fused=fused)
    hp = StepParams(step=5, lr=1e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(0)
    master, grad = torch.randn(chunk, generator=gen), torch.randn(chunk, generator=gen)
    fp32_states = [torch.randn(chunk, generator=gen) * 1e-3, torch.rand(chunk, generator=gen) * 1e-6]
    stored = {}
    for name, fmt in formats.items():
        stored[name] = [torch.empty(fmt.stored_bytes(chunk), dtype=torch.uint8) for _ in fp32_states]
        for state, raw, value in zip(rule.state_names, stored[name], fp32_states):
            fmt.store(value, raw, state)
    best = dict.fromkeys(["fp32", *formats], float("inf"))
    for _ in range(rounds):  # alternating: each round runs every format once
        for name in best:
            start = time.perf_counter()
            for _ in range(repeats):
                g = grad.clone()
                if name == "fp32":
                    rule.apply(master, g, fp32_states, hp)
                else:
                    update_chunk(rule, formats[name], master, g, stored[name], hp)
            best[name] = min(best[name], (time.perf_counter() - start) / repeats)
    return {name: {"ms_per_chunk": s * 1e3, "elements_per_s": chunk / s} for name, s in best.items()}


def step_traffic(steps: int) -> dict[str, dict[str, float]]:
    import lightning as L
    from helpers.models import LMModule, adamw_factory, token_loader

    from lightning_smartinf import SmartInfinityStrategy

    out = {}
    for name in FORMATS:
        with tempfile.TemporaryDirectory() as directory:
            strategy = SmartInfinityStrategy(
                storage_paths=[directory],
                sub_group_size=1 << 20,
                chunk_size=1 << 18,
                state_precision=name,
                io_engine="threads",
                overlap_backward=False,
                prefetch_state=False,
            )
            trainer = L.Trainer(
                accelerator="cpu",
                devices=1,
                strategy=strategy,
                max_steps=steps,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
            )
            trainer.fit(LMModule(adamw_factory(), dim=256, layers=4), token_loader(steps))
            numel = sum(s.numel for s in strategy.smart_update.sub_groups)
            traffic = strategy.traffic
            initial = traffic.storage_write_bytes - traffic.storage_read_bytes  # the state's first write
            out[name] = {
                "parameters": numel,
                "read_per_param_step": traffic.storage_read_bytes / numel / steps,
                "written_per_param_step": (traffic.storage_write_bytes - initial) / numel / steps,
                "on_disk_per_param": initial / numel,
            }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk", type=int, default=1 << 20, help="elements per chunk of the update rate")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of the update rate")
    parser.add_argument("--repeats", type=int, default=10, help="chunks per format per round")
    parser.add_argument("--steps", type=int, default=4, help="training steps of the traffic count")
    parser.add_argument("--out", type=Path, default=None, help="write the record as JSON here")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    record = {
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "update": update_rates(args.chunk, args.rounds, args.repeats, 1, fused=False),
        "threads": threads,
        "update_all_threads": update_rates(args.chunk, args.rounds, args.repeats, threads, fused=False),
        "update_fused_rule": update_rates(args.chunk, args.rounds, args.repeats, 1, fused=True),
        "update_fused_rule_all_threads": update_rates(args.chunk, args.rounds, args.repeats, threads, fused=True),
        "traffic": step_traffic(args.steps),
    }
    print(f"CPU: {record['cpu']}")
    fp32_rate = record["update"]["fp32"]["elements_per_s"]
    fp32_bytes = record["traffic"]["fp32"]["read_per_param_step"]
    for name in FORMATS:
        rate, traffic = record["update"][name], record["traffic"][name]
        print(
            f"{name}: update {rate['ms_per_chunk']:.1f} ms per {args.chunk:,}-element chunk "
            f"({rate['elements_per_s'] / 1e6:.0f} M elements/s, {rate['elements_per_s'] / fp32_rate:.2f}x fp32's); "
            f"storage {traffic['read_per_param_step']:.3f} B/param read + {traffic['written_per_param_step']:.3f} "
            f"written per step ({traffic['read_per_param_step'] / fp32_bytes:.3f}x fp32's), "
            f"{traffic['on_disk_per_param']:.3f} B/param on disk"
        )
    for name, rate in record["update_all_threads"].items():
        speedup = rate["elements_per_s"] / record["update"][name]["elements_per_s"]
        print(
            f"{name} on {threads} threads: {rate['ms_per_chunk']:.1f} ms per chunk "
            f"({rate['elements_per_s'] / 1e6:.0f} M elements/s, {speedup:.2f}x one thread's)"
        )
    for name in FORMATS[1:]:
        reference = record["update"][f"{name}-reference"]
        print(
            f"{name} with its plain-torch reference instead of the C kernels: {reference['ms_per_chunk']:.1f} ms per "
            f"chunk ({reference['elements_per_s'] / 1e6:.0f} M elements/s)"
        )
    for name, rate in record["update_fused_rule"].items():
        every = record["update_fused_rule_all_threads"][name]
        print(
            f"{name} with AdamW(fused=True): {rate['ms_per_chunk']:.1f} ms per chunk on one thread, "
            f"{every['ms_per_chunk']:.1f} on {threads}"
        )
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
