"""The reference of a state format over whole shards: each shard's chunk records in memory, stepped by
:func:`~lightning_smartinf.core.state_formats.update_chunk` in the plain-torch reference of the format, beside a
backend that holds the same shards; what every device kind must give, byte for byte."""

from __future__ import annotations

import torch

from lightning_smartinf.core.backend import Backend, ShardSpec
from lightning_smartinf.core.compression import SparseGrad
from lightning_smartinf.core.format.layout import ChunkLayout
from lightning_smartinf.core.rules import StepParams
from lightning_smartinf.core.state_formats import reference_format, update_chunk

STEPS = 3


def step_params(step: int) -> StepParams:
    return StepParams(step=step, lr=1e-2 / step, grad_scale=0.5, weight_decay=0.01, momentum=0.9)


class Reference:
    """Each shard as records in memory, stepped by the reference of its format."""

    def __init__(self, specs: list[ShardSpec], masters: list[torch.Tensor], chunk_elems: int) -> None:
        self.chunk = chunk_elems
        self.specs = specs
        self.layouts = [ChunkLayout(s.numel, self.chunk, len(s.rule.state_names), s.state_format) for s in specs]
        self.records: list[list[torch.Tensor]] = []
        for spec, layout, master in zip(specs, self.layouts, masters):
            records = []
            for k in range(layout.num_chunks):
                start, n = layout.chunk_range(k)
                padded = layout.padded_len(k)
                tensors = [torch.zeros(padded)]
                tensors[0][:n] = master[start : start + n]
                for name in spec.rule.state_names:
                    tensors.append(torch.zeros(padded))
                    tensors[-1][:n] = spec.rule.initial_state_value(name)
                records.append(layout.pack(tensors, k, spec.rule.state_names).view(torch.float32))
            self.records.append(records)

    def step(self, index: int, grad: torch.Tensor | SparseGrad, hp: StepParams) -> None:
        spec, layout = self.specs[index], self.layouts[index]
        dense = grad.to_dense(torch.float32) if isinstance(grad, SparseGrad) else grad.float()
        for k, record in enumerate(self.records[index]):
            start, n = layout.chunk_range(k)
            g = dense[start : start + n] * hp.grad_scale
            states = layout.states_of(record, k, n)
            if spec.state_format == "fp32":  # the states as fp32 views: the rule itself
                spec.rule.apply(record[:n], g, states, hp)
            else:
                # The plain-torch reference, whatever kernels the devices convert with.
                update_chunk(spec.rule, reference_format(spec.state_format), record[:n], g, states, hp)

    def master(self, index: int) -> torch.Tensor:
        layout = self.layouts[index]
        return torch.cat([r[: layout.chunk_range(k)[1]] for k, r in enumerate(self.records[index])])

    def file_bytes(self, index: int) -> bytes:
        layout = self.layouts[index]
        out = bytearray(layout.file_bytes)
        for k, record in enumerate(self.records[index]):
            raw = record.view(torch.uint8).numpy().tobytes()
            out[layout.record_offset(k) : layout.record_offset(k) + len(raw)] = raw
        return bytes(out)


def train(
    backend: Backend,
    specs: list[ShardSpec],
    chunk_elems: int,
    seed: int = 0,
    *,
    grad_dtype: torch.dtype = torch.bfloat16,
    sparse: bool = False,
) -> Reference:
    """``STEPS`` steps of every shard on ``backend`` and on the reference (a third of the elements of a top-k
    gradient kept, ``sparse``); the parameters the backend returns are checked against the reference's masters."""
    gen = torch.Generator().manual_seed(seed)
    masters = [torch.randn(s.numel, generator=gen) for s in specs]
    backend.open(specs)
    for i, master in enumerate(masters):
        backend.initialize(i, master)
    backend.wait()
    reference = Reference(specs, masters, chunk_elems)
    for step in range(1, STEPS + 1):
        outs = []
        for spec in specs:
            grad: torch.Tensor | SparseGrad = torch.randn(spec.numel, generator=gen).to(grad_dtype)
            if sparse:
                kept = torch.randperm(spec.numel, generator=gen)[: max(1, spec.numel // 3)].sort().values
                grad = SparseGrad(kept.to(torch.int32), grad[kept], spec.numel)
            outs.append(torch.empty(spec.numel, dtype=grad_dtype))
            backend.submit(spec.index, grad, step_params(step), outs[-1])
            reference.step(spec.index, grad, step_params(step))
        backend.wait()
        for spec, out in zip(specs, outs):
            assert torch.equal(out, reference.master(spec.index).to(grad_dtype)), (step, spec.rule.name)
    return reference
