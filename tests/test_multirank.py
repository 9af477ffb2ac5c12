"""Two gloo ranks on CPU: each rank's shards go to its own storage path and training matches one rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.launch import torchrun
from helpers.models import LMModule, adamw_factory, fit, max_relative_error

from lightning_smartinf import SmartInfinityStrategy

SCRIPT = Path(__file__).parent / "scripts" / "train_two_ranks.py"
STEPS = 8


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_match_one_rank(tmp_path, free_port):
    storage = [tmp_path / "ssd0", tmp_path / "ssd1"]
    for path in storage:
        path.mkdir()
    torchrun(SCRIPT, tmp_path, ",".join(map(str, storage)), str(STEPS), port=free_port())

    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, report in enumerate(reports):
        assert report["files"], "every rank owns shards"
        assert all(Path(f).parent == storage[rank] / "smartinf" / f"rank{rank:03d}" for f in report["files"])
        assert report["traffic"]["link_read_bytes"] > 0

    two_ranks = torch.load(tmp_path / "params.pt", weights_only=True)

    # One rank sees each global batch of 4 whole (the two ranks see its even and odd samples).
    _, one_rank = fit(
        LMModule(adamw_factory(cosine_steps=8)),  # what the script trains with
        SmartInfinityStrategy(storage_paths=[tmp_path], sub_group_size=3000),
        steps=STEPS,
        clip=0.5,
        batches=STEPS,
    )
    errors = max_relative_error(two_ranks, one_rank)
    assert max(errors.values()) < 1e-5, errors
