"""The chunk update as the ``cpu`` devices run it, per state format and rule: nanoseconds per element, one JSON line.

Times exactly what a host device calls for one chunk (``rule.apply`` on fp32 state, ``update_chunk`` on ``bf16`` and
``int8``), for ``torch.optim.AdamW`` as users build it (``single``: the single-tensor arithmetic) and with
``fused=True`` (``fused``), over ``--chunks`` distinct 1M-element chunks cycled (so that memory is cold, as in a
stream), best of ``--rounds``. It uses only names every version of the package has, so it times an older tree too:
run it once per tree and thread count, alternating, to compare two versions on one machine::

    PYTHONPATH=TREE .venv/bin/python benchmarks/bench_chunk_update.py --threads 1

``--device`` also times what a device does around the update of a bf16 run (AdamW as users build it): the chunk's
bf16 gradient loaded to fp32 and scaled, the update, the parameters copied out to bf16 (``{format}-device``), and, in
``bf16`` and ``int8``, the same in the format's one native pass (``{format}-device-one-pass``, where the tree has it).
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
    parser.add_argument("--device", action="store_true", help="also the device's work around the update")
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
            if args.device and not fused:
                out.update(_device_work(rule, fmt, name, masters, grads, stored, hp, args.rounds))
    print(json.dumps(out))


def _device_work(rule, fmt, name, masters, grads, stored, hp, rounds) -> dict[str, float]:  # noqa: ANN001
    """Nanoseconds per element of a device's chunk work from a bf16 gradient (scaled by 0.5) to bf16 parameters."""
    from lightning_smartinf.core.state_formats import update_chunk

    n, chunks = masters[0].numel(), len(masters)
    links = [grad.to(torch.bfloat16) for grad in grads]
    params, g = torch.empty(n, dtype=torch.bfloat16), torch.empty(n)

    def separate(i: int) -> None:
        g.copy_(links[i])
        g.mul_(0.5)
        if name == "fp32":
            rule.apply(masters[i], g, [raw.view(torch.float32) for raw in stored[i]], hp)
        else:
            update_chunk(rule, fmt, masters[i], g, stored[i], hp)
        params.copy_(masters[i])

    def one_pass(i: int) -> None:
        fmt.fused_update(rule, masters[i], links[i], stored[i], hp, params=params, grad_scale=0.5)

    timed = {f"{name}-device": separate}
    if name != "fp32":
        try:
            if fmt.fused_update(rule, masters[0], links[0], stored[0], hp, params=params, grad_scale=0.5):
                timed[f"{name}-device-one-pass"] = one_pass
        except TypeError:  # a tree whose kernels take an fp32 gradient only
            pass
    out = {}
    for key, work in timed.items():
        best = float("inf")
        for _ in range(rounds):
            start = time.perf_counter()
            for i in range(chunks):
                work(i)
            best = min(best, time.perf_counter() - start)
        out[key] = round(best / chunks / n * 1e9, 3)
    return out


if __name__ == "__main__":
    main()
