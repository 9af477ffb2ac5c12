"""Whether an fp32 master can be rebuilt from its bf16 parameter and fewer bytes: a check, not a feature.

The parameter is the master rounded to bfloat16 by torch's conversion (round to nearest, ties to even), as DeepSpeed
and the devices round it. The master's high 16 bits are then the parameter's or one below them (where the rounding
carried), so its low 16 bits and one bit saying whether the rounding carried rebuild it:
``master = ((parameter - carried) << 16) | low``. The low bits alone do not: an even parameter is the rounding of two
ties (low bits ``0x8000``) whose high halves differ by one.

Checks the rebuild on ``--batches`` batches of 2**24 random bit patterns and on every pattern within two bf16 steps
of a few values (1.0, its successor, 2.0, a subnormal, the largest finite value), both signs; prints how many finite
masters were rebuilt, how many were ties, and exits non-zero at the first master that is not rebuilt bit for bit.
``docs/benchmarks.md`` records the result::

    PYTHONPATH=. .venv/bin/python benchmarks/check_split_masters.py --batches 64
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import Tensor

#: High halves (bf16 bit patterns) whose neighbourhoods are checked whole.
EDGES = (0x3F80, 0x3F81, 0x4000, 0x0001, 0x7F7F)


def rebuild_failures(bits: Tensor) -> tuple[int, int, int]:
    """For fp32 masters given by their bits (``int32``): how many are finite, how many of those are ties, and how many
    of those the parameter, low 16 bits and carry bit do not rebuild exactly."""
    masters = bits.view(torch.float32)
    finite = torch.isfinite(masters)
    bits, masters = bits[finite], masters[finite]
    parameter = masters.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    high, low = (bits >> 16) & 0xFFFF, bits & 0xFFFF
    carried = (high != parameter).to(torch.int32)
    rebuilt = (((parameter - carried) & 0xFFFF) << 16) | low
    return int(finite.sum()), int((low == 0x8000).sum()), int((rebuilt != bits).sum())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=64, help="batches of 2**24 random bit patterns (default 64)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    generator = torch.Generator().manual_seed(args.seed)
    batches = [
        torch.randint(-(2**31), 2**31, (1 << 24,), dtype=torch.int64, generator=generator).to(torch.int32)
        for _ in range(args.batches)
    ]
    for high in EDGES:
        for sign in (0, 0x8000):
            around = torch.arange(-2 * 65536, 3 * 65536, dtype=torch.int64) + ((high | sign) << 16)
            batches.append(torch.where(around >= 2**31, around - 2**32, around).to(torch.int32))
    finite = ties = failures = 0
    for bits in batches:
        n, t, f = rebuild_failures(bits)
        finite, ties, failures = finite + n, ties + t, failures + f
    print(f"{finite:,} finite masters, {ties:,} ties among them: {failures:,} not rebuilt bit for bit")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
