"""Activation offload on a GPT-style model (CPU): memory held by saved activations, step time, bytes moved.

Modes, measured side by side (steps interleaved so machine load hits all of them alike):
  plain     no hooks at all (step-time reference)
  resident  the hooks installed with offload disabled: every saved activation stays in memory (memory reference)
  offload   activations above the threshold outside the last ``--keep-last`` layers go to files on --path

"Saved-activation bytes" are the bytes of distinct saved tensors (deduplicated by storage) that the hooks hold in
memory; parameters are not counted. Files are opened with O_DIRECT where the filesystem allows, so reads are not
served by the page cache.

    .venv/bin/python benchmarks/bench_activations.py --path /tmp/act-bench
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from lightning_smartinf.activations import ActivationOffloader
from lightning_smartinf.csd.io import supports_direct_io


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", type=Path, default=None, help="storage directory (default: a temp dir)")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--keep-last", type=int, default=1)
    parser.add_argument("--threshold", type=int, default=1 << 20)
    parser.add_argument("--budget-mib", type=int, default=32)
    args = parser.parse_args()

    path = args.path or Path(tempfile.mkdtemp(prefix="act-bench-"))
    path.mkdir(parents=True, exist_ok=True)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]

    def make():
        torch.manual_seed(0)
        return GPT(args.vocab, args.seq, args.dim, args.layers, args.heads)

    runs = {"plain": (make(), None)}
    runs["resident"] = (m := make(), ActivationOffloader([path], enabled=False).attach(m))
    runs["offload"] = (
        m := make(),
        ActivationOffloader(
            [path], threshold_bytes=args.threshold, keep_last=args.keep_last, max_inflight_bytes=args.budget_mib << 20
        ).attach(m),
    )
    times: dict[str, list[float]] = {k: [] for k in runs}
    for step in range(args.steps + 1):  # step 0 warms up
        for name, (model, off) in runs.items():
            model.zero_grad(set_to_none=True)
            if off is not None:
                off.reset_peak()
            start = time.perf_counter()
            if off is None:
                nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            else:
                with off:
                    nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            elapsed = time.perf_counter() - start
            if step:
                times[name].append(elapsed)
    grads_equal = all(
        torch.equal(a.grad, b.grad) for a, b in zip(runs["plain"][0].parameters(), runs["offload"][0].parameters())
    )
    res, off = runs["resident"][1].stats, runs["offload"][1].stats
    med = {k: statistics.median(v) for k, v in times.items()}
    measured = args.steps + 1
    result = {
        "config": vars(args)
        | {"path": str(path), "direct_io": supports_direct_io(path), "threads": torch.get_num_threads()},
        "params_M": round(sum(p.numel() for p in runs["plain"][0].parameters()) / 1e6, 2),
        "peak_saved_bytes_resident": res.peak_resident_bytes,
        "peak_saved_bytes_offload": off.peak_resident_bytes,
        "activation_memory_reduction": round(1 - off.peak_resident_bytes / res.peak_resident_bytes, 3),
        "peak_staging_bytes_offload": off.peak_staging_bytes,
        "reduction_counting_staging": round(
            1 - (off.peak_resident_bytes + off.peak_staging_bytes) / res.peak_resident_bytes, 3
        ),
        "step_s_median": {k: round(v, 4) for k, v in med.items()},
        "overhead_vs_plain": round(med["offload"] / med["plain"] - 1, 3),
        "overhead_vs_resident_hooks": round(med["offload"] / med["resident"] - 1, 3),
        "per_step_bytes_written": off.bytes_written // measured,
        "per_step_bytes_read": off.bytes_read // measured,
        "per_step": {
            k: getattr(off, k) / measured
            for k in ("tensors_offloaded", "tensors_kept", "dedup_hits", "forwarded", "sync_reads", "waited_reads")
        },
        "grads_bitwise_equal_last_step": grads_equal,
    }
    for _, o in runs.values():
        if o is not None:
            o.close()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
