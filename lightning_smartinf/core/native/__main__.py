"""``python -m lightning_smartinf.core.native``: build the C kernels for this machine and print where they are."""

from __future__ import annotations

import sys

from lightning_smartinf.core.native import KernelBuildError, build

if __name__ == "__main__":
    try:
        for name in ("state_formats", "sum_squares"):
            print(build(name))
    except KernelBuildError as exc:
        sys.exit(f"error: {exc}")
