"""Run as ``python hf_load_rss.py MODEL_DIR STORAGE PATH_KIND``: a user's own LightningModule loads the Hugging Face
causal LM in ``MODEL_DIR`` in ``configure_model`` under ``SmartInfinityStrategy(offload_parameters="storage")`` and
trains one step; prints one JSON line: the parameter count, how much this process's peak RSS grew while the model
loaded (bytes), the load's seconds, and the largest difference between a loaded parameter and the checkpoint.

``PATH_KIND``: ``ours`` loads with :func:`lightning_smartinf.hf.from_pretrained`; ``transformers`` with
transformers' own ZeRO-3 loading (its ``from_pretrained`` under :func:`~lightning_smartinf.hf.partitioned_build`).
"""

import json
import sys
import time
from pathlib import Path

import deepspeed
import lightning as L
import torch
from helpers.machine import proc_status, reset_peak
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.hf import from_pretrained, partitioned_build


class OwnModule(L.LightningModule):
    def __init__(self, path: Path, kind: str) -> None:
        super().__init__()
        self.path, self.kind = path, kind
        self.model: torch.nn.Module | None = None
        self.report: dict = {}

    def configure_model(self) -> None:
        if self.model is not None:
            return
        before, start = reset_peak(), time.perf_counter()
        if self.kind == "ours":
            self.model = from_pretrained(self, self.path)
        else:
            with partitioned_build(self):
                self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32).train()
        self.report["load_s"] = time.perf_counter() - start
        self.report["load_growth"] = proc_status("VmHWM") - before
        self.report["params"] = sum(p.ds_numel for p in self.model.parameters())
        self.report["max_error"] = self.check_weights()

    def check_weights(self) -> float:
        params = dict(self.model.named_parameters(remove_duplicate=False))
        worst = 0.0
        for file in sorted(self.path.glob("*.safetensors")):
            for key, value in load_file(file).items():
                param = params[key]
                with deepspeed.zero.GatheredParameters([param]):
                    worst = max(worst, float((param.float() - value.float()).abs().max()))
        return worst

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def main(path: Path, storage: Path, kind: str) -> None:
    module = OwnModule(path, kind)
    batches = [torch.randint(0, 1000, (16,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    trainer = L.Trainer(
        accelerator="cpu",
        strategy=SmartInfinityStrategy(storage_paths=[storage], offload_parameters="storage", io_engine="threads"),
        precision="bf16-true",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=1))
    print(json.dumps({**module.report, "loss": float(trainer.callback_metrics.get("train_loss", float("nan")))}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
