"""The chunk update as the ``cpu`` devices run it, per state format and rule: nanoseconds per element, one JSON line.

Times exactly what a host device calls for one chunk (``rule.apply`` on fp32 state, ``update_chunk`` on ``bf16`` and
``int8``), for ``torch.optim.AdamW`` as users build it (``single``: the single-tensor arithmetic) and with
``fused=True`` (``fused``), over ``--chunks`` distinct 1M-element chunks cycled (so that memory is cold, as in a
stream), best of ``--rounds``. It uses only names every version of the package has, so it times an older tree too:
run it once per tree and thread count, alternating, to compare two versions on one machine::

    PYTHONPATH=TREE .venv/bin/python benchmarks/bench_chunk_update.py --threads 1
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--chunks", type=int, default=16, help="distinct chunks cycled (default 16)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the best kept (default 3)")
    args = parser.parse_args(argv)

    from lightning_smartinf.core.rules import Adam, StepParams
    from lightning_smartinf.core.state_formats import state_format, update_chunk

    torch.set_num_threads(args.threads)
    n = 1 << 20
    hp = StepParams(step=5, lr=1e-3, weight_decay=0.01)
    out = {}
    for fused in (False, True):
        rule = Adam(decoupled_weight_decay=True, fused=fused)
        for name in ("fp32", "bf16", "int8"):
            fmt = state_format(name)
            gen = torch.Generator().manual_seed(0)
            masters = [torch.randn(n, generator=gen) for _ in range(args.chunks)]
            grads = [torch.randn(n, generator=gen) * 1e-3 for _ in range(args.chunks)]
            stored = []
            for _ in range(args.chunks):
                raws = [torch.empty(fmt.stored_bytes(n), dtype=torch.uint8) for _ in range(2)]
                fmt.store(torch.randn(n, generator=gen) * 1e-3, raws[0], "exp_avg")
                fmt.store(torch.rand(n, generator=gen) * 1e-6, raws[1], "exp_avg_sq")
                stored.append(raws)
            g = torch.empty(n)
            best = float("inf")
            for _ in range(args.rounds):
                start = time.perf_counter()
                for i in range(args.chunks):
                    g.copy_(grads[i])
                    if name == "fp32":
                        rule.apply(masters[i], g, [raw.view(torch.float32) for raw in stored[i]], hp)
                    else:
                        update_chunk(rule, fmt, masters[i], g, stored[i], hp)
                best = min(best, time.perf_counter() - start)
            out[f"{name}-{'fused' if fused else 'single'}"] = round(best / args.chunks / n * 1e9, 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
