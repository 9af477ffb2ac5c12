"""Launched by ``torch.distributed.run`` from tests/test_checkpoint.py with any number of CPU ranks: train (``full``)
TOTAL steps with checkpoints every EVERY steps into ``<root>/ckpts_<tag>``, or resume (``resume``) from a checkpoint
to ``--steps``; rank 0 saves the gathered parameters to ``<root>/<tag>.pt``. The global batch is 4 samples whatever
the number of ranks (``fit_sharded``), so runs on different numbers of ranks see the same data."""

import argparse
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.models import CaptureParams  # noqa: E402
from scripts.ckpt_common import EVERY, TOTAL, fit_sharded  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("tag")
    parser.add_argument("--resume", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=TOTAL)
    parser.add_argument("--sub-group-size", type=int, default=3000)
    parser.add_argument("--compression", type=float, default=None)
    parser.add_argument("--remote-devices", nargs="*", default=None, help="train on these servers (backend remote)")
    parser.add_argument("--remote-token-file", default=None)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    storage = [args.root / f"ssd_{args.tag}_{r}" for r in range(world)]  # one path per rank
    for path in storage:
        path.mkdir(parents=True, exist_ok=True)
    capture = CaptureParams()
    callbacks: list[L.Callback] = [capture]
    if args.resume is None:
        callbacks.append(
            ModelCheckpoint(dirpath=args.root / f"ckpts_{args.tag}", filename="{step}", every_n_train_steps=EVERY,
                            save_top_k=-1)
        )  # fmt: skip
    fit_sharded(
        storage,
        rank=rank,
        world_size=world,
        callbacks=callbacks,
        ckpt_path=args.resume,
        strategy_kwargs={
            "sub_group_size": args.sub_group_size,
            "compression": args.compression,
            **(
                {}
                if args.remote_devices is None
                else {
                    "backend": "remote",
                    "remote_devices": args.remote_devices,
                    "remote_token_file": args.remote_token_file,
                }
            ),
        },
        max_steps=args.steps,
        devices=world,
    )
    if rank == 0:
        torch.save(capture.params, args.root / f"{args.tag}.pt")


if __name__ == "__main__":
    main()
