"""Run as ``python export_rss.py CHECKPOINT MODEL_DIR OUT``: prints one JSON line, how much this process's peak RSS
grew (bytes) while ``smartinf export --save-pretrained OUT --max-shard-size 2MB`` wrote the checkpoint's model, and
while :func:`~lightning_smartinf.commands.export.consolidate_fp32_state_dict` built the whole model in memory (what the
measurement must be able to see).

The export runs once before it is measured, so that imports and caches are not counted; the peak (``VmHWM``) is
reset before each measurement.
"""

import json
import sys
from collections.abc import Callable

from helpers.machine import proc_status, reset_peak

from lightning_smartinf.commands.export import consolidate_fp32_state_dict
from lightning_smartinf.commands.export import main as export_main


def peak_growth(work: Callable[[], object]) -> int:
    before = reset_peak()
    work()
    return proc_status("VmHWM") - before


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
