"""Run as ``python export_rss.py CHECKPOINT MODEL_DIR OUT``: prints one JSON line, how much this process's peak RSS
grew (bytes) while ``smartinf export --save-pretrained OUT --max-shard-size 2MB`` wrote the checkpoint's model, and
while :func:`~lightning_smartinf.export.consolidate_fp32_state_dict` built the whole model in memory (what the
measurement must be able to see).

The export runs once before it is measured, so that imports and caches are not counted; the peak (``VmHWM``) is
reset before each measurement.
"""

import json
import sys
from collections.abc import Callable
from pathlib import Path

from lightning_smartinf.export import consolidate_fp32_state_dict
from lightning_smartinf.export import main as export_main


def status(key: str) -> int:
    """A field of /proc/self/status in bytes (``VmRSS`` now, ``VmHWM`` the peak since the last reset)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == key:
            return int(value.split()[0]) * 1024
    raise KeyError(key)


def peak_growth(work: Callable[[], object]) -> int:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = status("VmRSS")
    work()
    return status("VmHWM") - before


def main(checkpoint: str, model_dir: str, out: str) -> None:
    argv = [checkpoint, "--save-pretrained", out, "--hf-model-dir", model_dir, "--max-shard-size", "2MB"]

    def export() -> None:
        assert export_main(argv) == 0

    export()
    growth = peak_growth(export)
    whole = peak_growth(lambda: consolidate_fp32_state_dict(checkpoint))
    print(json.dumps({"export": growth, "consolidate": whole}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
