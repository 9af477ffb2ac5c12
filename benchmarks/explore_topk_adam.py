"""Why 1% top-k costs AdamW accuracy: a plain-PyTorch model of the SmartComp codec, for exploring remedies.

This is **not** the product path (no DeepSpeed, no devices, fp32, no bf16 rounding): the update rules and the
layer-wise top-k + error feedback are written out here so that variants of the device rule can be tried in
seconds. `bench_compression.py` measures the real path; on the baseline variants the two agree within ~0.5%.

A variant is a base and ``+``-separated modifiers (comma-separated ``--variants``):

- bases: ``dense`` (AdamW, every gradient sent); ``ef`` (1% top-k per parameter with error feedback, the device runs
  ordinary AdamW: what shipped before EF-Adam); ``micro`` (MicroAdam's statistics: the update is Adam's ratio over a
  window of the last 10 sent gradients); ``sgd_dense`` / ``sgd_ef`` (SGD with Nesterov momentum).
- modifiers: ``b1=X`` (the device's beta1; ``ef+b1=0`` is EF-Adam, also spelled ``ef_adam``); ``hybrid`` (beta1
  only while the warm-up is dense); ``frozen`` (the variance stops updating once the warm-up ends, as 1-bit Adam);
  ``age`` (an entry sent after ``a`` steps adds ``G**2 / a`` to the variance, not ``G**2``); ``vsel`` (entries
  selected by ``|residual| / sqrt(v)``, v tracked on the host); ``factored`` (the device's variance takes the
  row and column sums of the dense gradient's squares, Adafactor's rank-1 estimate, which the host would send
  beside the pairs); ``adafactor`` (Adafactor itself, what rule ``ef_adafactor`` runs: the host keeps averages of
  those row and column sums and divides what it sends by their rank-1 product); ``block=B`` (the device's variance
  takes the mean of the dense gradient's squares over each block of B consecutive elements); ``fsel`` (with
  ``factored``: select by ``|residual| / sqrt(v)``); ``dense_small=N`` (parameters of fewer than N elements, biases
  and norms, sent whole); ``decay=G`` (the residual is multiplied by G each step); ``rank=R`` (PowerSGD: each
  matrix sends a warm-started rank-R approximation of its residual instead of its top-k); ``lateclip`` (with
  ``--real``: what is sent is scaled by the clipping of the step that sends it, as the product did before it
  clipped each step by its own norm).
- the names of earlier versions still work: ``frozen``, ``age``, ``vsel`` mean ``ef+frozen`` and so on.

``--task gpt2 --real`` runs bench_compression's GPT-2 task as it does (data, 10 warm-up steps and cosine to 10%,
clipping at 1.0); ``--stop N`` ends after N of the schedule's ``--steps``, ``--val-every N`` prints the validation
loss along the way.

``--finetune N`` first trains dense for ``--steps`` steps on English, then fine-tunes for N steps on Python
source (the paper's accuracy claims are for fine-tuning) and compares the variants there.

    PYTHONPATH=. .venv/bin/python benchmarks/explore_topk_adam.py --steps 400 --variants dense,ef,ef_adam,micro
    PYTHONPATH=. .venv/bin/python benchmarks/explore_topk_adam.py --finetune 200 --variants dense,ef,ef_adam
"""

from __future__ import annotations

import argparse
import glob
import math
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from lightning_smartinf.commands.demo import CharDataset, CharGPT, english_text

SEQ = 64
WINDOW = 10  # MicroAdam's window of sent gradients
ALIASES = {"ef_adam": "ef+b1=0", "frozen": "ef+frozen", "age": "ef+age", "vsel": "ef+vsel"}
DENSE_STEPS, STAGE_STEPS, DGC = 20, 10, (0.25, 0.0625, 0.015625)  # bench_compression.py's warm-up


def kept_ratio(step: int, target: float) -> float | None:
    """None while dense; then the DGC stages above the target; then the target (0-based ``step``)."""
    if step < DENSE_STEPS:
        return None
    stages = [r for r in DGC if r > target]
    stage = (step - DENSE_STEPS) // STAGE_STEPS
    return stages[stage] if stage < len(stages) else target


def batches(dataset: Dataset, seed: int, batch_size: int = 16) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed))
    while True:
        yield from loader


def factored_square(grad: torch.Tensor) -> torch.Tensor:
    """Adafactor's rank-1 estimate of ``grad ** 2`` from its row and column sums (exact for 1-D tensors)."""
    g2 = grad.float().square()
    if grad.ndim < 2:
        return g2
    rows = g2.reshape(g2.shape[0], -1)
    r, c = rows.sum(1, keepdim=True), rows.sum(0, keepdim=True)
    return (r * c / r.sum().clamp_min(1e-30)).view_as(grad)


def block_square(grad: torch.Tensor, block: int) -> torch.Tensor:
    """Each element's ``grad ** 2`` replaced by the mean over its block of ``block`` consecutive elements."""
    g2 = grad.float().square().view(-1)
    padded = torch.nn.functional.pad(g2, (0, -g2.numel() % block))
    means = padded.view(-1, block).mean(1).repeat_interleave(block)[: g2.numel()]
    if g2.numel() % block:  # the last, partial block averages only its own elements
        tail = g2.numel() // block * block
        means[tail:] = g2[tail:].mean()
    return means.view_as(grad)


def train(
    model: nn.Module,
    dataset: Dataset,
    steps: int,
    variant: str,
    max_lr: float,
    ratio: float,
    *,
    schedule: str = "onecycle",
    clip: float | None = None,
    batch_size: int = 16,
    every: int = 0,
    evaluate=None,
    stop: int | None = None,
) -> None:
    first, *rest = variant.split("+")
    base, *mods = ALIASES.get(first, first).split("+") + rest
    options = dict(m.split("=") if "=" in m else (m, "") for m in mods)
    sgd = base.startswith("sgd")
    params = list(model.parameters())
    decay = {id(p): (0.0 if sgd or p.ndim < 2 else 0.1) for p in params}
    # Only for the learning-rate (and beta1 / momentum) schedule; the updates are written out below.
    opt = (
        torch.optim.SGD(params, lr=max_lr, momentum=0.9, nesterov=True) if sgd else torch.optim.AdamW(params, lr=max_lr)
    )
    if schedule == "cosine":  # bench_compression's GPT-2 task: 10 warm-up steps, cosine to 10%
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda t: (t + 1) / 10 if t < 10 else 0.1 + 0.45 * (1 + math.cos(math.pi * (t - 10) / (steps - 10)))
        )
    else:
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=max_lr, total_steps=steps)
    state = {id(p): {k: torch.zeros_like(p) for k in ("m", "v", "residual", "age", "v_host")} for p in params}
    window: dict[int, list[torch.Tensor]] = {id(p): [] for p in params}
    frozen_at: int | None = None
    data = batches(dataset, seed=0, batch_size=batch_size)
    for step in range(1, (stop or steps) + 1):
        if every and evaluate is not None and step > 1 and (step - 1) % every == 0:
            print(f"  {variant} step {step - 1}: val loss {evaluate(model):.4f}", flush=True)
        tokens, targets = next(data)
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        model.zero_grad(set_to_none=True)
        loss.backward()
        coef = 1.0  # `lateclip`: the step's clip factor, applied to what is delivered (as the product did)
        if clip is not None:
            if "lateclip" in options:
                norm = torch.linalg.vector_norm(torch.stack([q.grad.norm() for q in params]))
                coef = min(1.0, clip / (float(norm) + 1e-6))
            else:
                nn.utils.clip_grad_norm_(params, clip)
        group = opt.param_groups[0]
        lr = group["lr"]
        beta1, beta2 = group.get("betas", (0.9, 0.999))
        if "b1" in options:
            beta1 = float(options["b1"])
        keep = None if base.endswith("dense") else kept_ratio(step - 1, ratio)
        if "hybrid" in options and keep is None:
            beta1 = group["betas"][0]
        if "frozen" in options and frozen_at is None and step - 1 >= DENSE_STEPS + STAGE_STEPS * 3:
            frozen_at = step - 1
        with torch.no_grad():
            for p in params:
                s, grad = state[id(p)], p.grad
                v_weight: torch.Tensor | None = None
                square = factored_square(grad) if "factored" in options else None
                if "block" in options:
                    square = block_square(grad, int(options["block"]))
                if "vsel" in options:
                    s["v_host"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                small = "dense_small" in options and p.numel() < int(options["dense_small"])
                if keep is None or small:
                    grad = (grad + s["residual"]) * coef
                    s["residual"].zero_()
                    s["age"].zero_()
                elif "rank" in options and p.ndim == 2:  # PowerSGD: a rank-R approximation, warm-started
                    residual = s["residual"].add_(grad)
                    if "q" not in s:
                        seed = torch.Generator().manual_seed(0)
                        s["q"] = torch.randn(p.shape[1], int(options["rank"]), generator=seed)
                    left = torch.linalg.qr(residual @ s["q"]).Q
                    s["q"] = residual.T @ left
                    grad = left @ s["q"].T
                    residual.sub_(grad)
                else:
                    flat = s["residual"].view(-1)
                    if "decay" in options:  # the residual forgets what waits: stale gradient mass fades
                        flat.mul_(float(options["decay"]))
                    flat.add_(grad.view(-1))
                    score = flat.abs()
                    if "vsel" in options or "fsel" in options:
                        score = score / (s["v_host" if "vsel" in options else "v"].view(-1).sqrt() + 1e-12)
                    idx = score.topk(max(1, math.ceil(keep * flat.numel()))).indices
                    sent = torch.zeros_like(flat)
                    sent[idx] = flat[idx]
                    flat[idx] = 0
                    grad = sent.view_as(p) * coef
                    age = s["age"].view(-1)
                    age.add_(1)
                    if "age" in options:
                        weight = torch.zeros_like(flat)
                        weight[idx] = 1.0 / age[idx]
                        v_weight = weight.view_as(p)
                    age[idx] = 0
                if sgd:
                    buf = s["m"]
                    buf.copy_(grad) if step == 1 else buf.mul_(group["momentum"]).add_(grad)
                    p.add_(grad + group["momentum"] * buf, alpha=-lr)
                    continue
                p.mul_(1 - lr * decay[id(p)])
                if base == "micro":
                    sent_window = window[id(p)]
                    sent_window.append(grad.clone())
                    del sent_window[:-WINDOW]
                    m_hat, v_hat = torch.zeros_like(p), torch.zeros_like(p)
                    for a, g in enumerate(reversed(sent_window)):
                        m_hat.add_(g, alpha=beta1**a)
                        v_hat.addcmul_(g, g, value=beta2**a)
                    n = len(sent_window)
                    m_hat.mul_((1 - beta1) / (1 - beta1**n))
                    v_hat.mul_((1 - beta2) / (1 - beta2**n))
                    p.addcdiv_(m_hat, v_hat.sqrt().add_(1e-8), value=-lr)
                    continue
                s["m"].lerp_(grad, 1 - beta1)
                if "adafactor" in options:  # Adafactor's factored moments: EMAs of the row and column sums
                    g2 = (p.grad.float() * coef).square()
                    if g2.ndim < 2:
                        s["v"].mul_(beta2).add_(g2, alpha=1 - beta2)
                        v_hat = s["v"]
                    else:
                        rows = g2.reshape(g2.shape[0], -1)
                        if "r" not in s:
                            s["r"], s["c"] = torch.zeros(rows.shape[0], 1), torch.zeros(1, rows.shape[1])
                        r, c = s["r"], s["c"]
                        r.mul_(beta2).add_(rows.sum(1, keepdim=True), alpha=1 - beta2)
                        c.mul_(beta2).add_(rows.sum(0, keepdim=True), alpha=1 - beta2)
                        v_hat = (r * c / r.sum().clamp_min(1e-30)).view_as(p)
                    denom = v_hat.sqrt().div_(math.sqrt(1 - beta2**step)).add_(1e-8)
                    p.addcdiv_(s["m"], denom, value=-lr / (1 - beta1**step))
                    continue
                if square is not None:
                    s["v"].mul_(beta2).add_(square, alpha=1 - beta2)
                elif frozen_at is None:
                    s["v"].mul_(beta2).addcmul_(grad, grad if v_weight is None else grad * v_weight, value=1 - beta2)
                v_step = frozen_at if frozen_at is not None else step
                denom = s["v"].sqrt().div_(math.sqrt(1 - beta2**v_step)).add_(1e-8)
                p.addcdiv_(s["m"], denom, value=-lr / (1 - beta1**step))
        sched.step()


class TokenWindows(Dataset):
    """Consecutive ``seq``-token windows of ``ids`` and their next-token targets."""

    def __init__(self, ids: torch.Tensor, seq: int) -> None:
        self.ids, self.seq = ids, seq

    def __len__(self) -> int:
        return (self.ids.numel() - 1) // self.seq

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.ids[i * self.seq : (i + 1) * self.seq + 1]
        return window[:-1], window[1:]


class GPT2Logits(nn.Module):
    """bench_compression's ``--task gpt2`` model (the GPT-2 recipe's, 6 x 384: 12.3M parameters), returning logits."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=vocab, n_positions=256, n_embd=384, n_layer=6, n_head=6)
        config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
        self.model = GPT2LMHeadModel(config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens).logits


def python_tokens(root: Path, megabytes: float) -> tuple[torch.Tensor, int]:
    """The standard library's Python source (its first ``megabytes`` MB) in the GPT-2 recipe's 4,096-token BPE."""
    from lightning_smartinf.hf.data import train_bpe_tokenizer

    repo = Path(__file__).resolve().parents[1]
    tokenizer = train_bpe_tokenizer([repo / "recipes" / "data" / "python_docs.txt"], root / "tok", vocab_size=4096)
    text, files = "", sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/**/*.py", recursive=True))
    for f in files:
        if len(text) >= megabytes * 1e6:
            break
        text += Path(f).read_text(encoding="utf-8", errors="replace")
    return torch.tensor(tokenizer(text)["input_ids"]), len(tokenizer)


def validation_loss(model: nn.Module, dataset: Dataset, batches: int = 16) -> float:
    model.eval()
    losses = []
    with torch.no_grad():
        for i, (tokens, targets) in enumerate(DataLoader(dataset, batch_size=32)):
            if i == batches:
                break
            losses.append(nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).item())
    model.train()
    return sum(losses) / len(losses)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="dense,ef")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--finetune", type=int, default=0, help="fine-tuning steps on Python source (0: off)")
    parser.add_argument("--finetune-lr", type=float, default=1e-3)
    parser.add_argument("--task", choices=["char", "gpt2"], default="char", help="gpt2: 12.3M GPT-2 on Python source")
    parser.add_argument("--real", action="store_true", help="gpt2: bench_compression's data, schedule and clipping")
    parser.add_argument("--val-every", type=int, default=0, help="print the validation loss every N steps (gpt2)")
    parser.add_argument("--stop", type=int, default=None, help="gpt2: stop after N of the schedule's --steps")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    if args.task == "gpt2":
        return explore_gpt2(args)
    english = english_text()
    code = ""
    if args.finetune:
        files = sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/*.py"))[:60]
        code = "".join(Path(f).read_text(encoding="utf-8") for f in files)[:800_000]
    vocab = sorted(set(english) | set(code))
    start = time.perf_counter()
    results: dict[str, float] = {}
    base: dict[str, torch.Tensor] | None = None
    if args.finetune:
        torch.manual_seed(0)
        model = CharGPT(len(vocab), seq=SEQ, dim=args.dim)
        train(model, CharDataset(english, SEQ, vocab), args.steps, "dense", 3e-3, args.ratio)
        base = {k: v.clone() for k, v in model.state_dict().items()}
        text, steps, max_lr = code, args.finetune, args.finetune_lr
    else:
        text, steps, max_lr = english, args.steps, 3e-3
    dataset = CharDataset(text, SEQ, vocab)
    split = int(len(dataset) * 0.9)
    train_set, val_set = Subset(dataset, range(split)), Subset(dataset, range(split, len(dataset)))
    for variant in args.variants.split(","):
        torch.manual_seed(0)
        model = CharGPT(len(vocab), seq=SEQ, dim=args.dim)
        if base is not None:
            model.load_state_dict(base)
        lr = 0.3 if variant.startswith("sgd") else max_lr
        train(model, train_set, steps, variant, lr, args.ratio)
        results[variant] = validation_loss(model, val_set)
        print(f"{variant:10s} val loss {results[variant]:.4f}  ({time.perf_counter() - start:.0f} s)", flush=True)
    for variant, loss in results.items():
        ref = results.get("sgd_dense" if variant.startswith("sgd") else "dense")
        if ref is not None and variant not in ("dense", "sgd_dense"):
            print(f"{variant:10s} {100 * (loss - ref) / ref:+.1f}% vs dense")
    return 0


def explore_gpt2(args: argparse.Namespace) -> int:
    """The variants on bench_compression's GPT-2 task (peak LR 1e-3, batch 16 x 64 tokens, 90% / 10% held out;
    with ``--real``: as bench_compression runs it, batch 8 x 128 tokens of 4 MB, 5% held out, 10 warm-up steps and
    cosine to 10%, clipping at 1.0, validation on 32 batches)."""
    import tempfile

    real = args.real
    with tempfile.TemporaryDirectory() as root:
        ids, vocab = python_tokens(Path(root), 4.0 if real else 2.0)
    dataset = TokenWindows(ids, 128 if real else 64)
    split = int(len(dataset) * (0.95 if real else 0.9))
    train_set, val_set = Subset(dataset, range(split)), Subset(dataset, range(split, len(dataset)))
    start, results = time.perf_counter(), {}
    for variant in args.variants.split(","):
        torch.manual_seed(0)
        model = GPT2Logits(vocab)
        train(
            model,
            train_set,
            args.steps,
            variant,
            1e-3,
            args.ratio,
            schedule="cosine" if real else "onecycle",
            clip=1.0 if real else None,
            batch_size=8 if real else 16,
            every=args.val_every,
            evaluate=lambda m: validation_loss(m, val_set, 32 if real else 16),
            stop=args.stop,
        )
        results[variant] = validation_loss(model, val_set, 32 if real else 16)
        print(f"{variant:10s} val loss {results[variant]:.4f}  ({time.perf_counter() - start:.0f} s)", flush=True)
    for variant, loss in results.items():
        if variant != "dense" and "dense" in results:
            print(f"{variant:10s} {100 * (loss - results['dense']) / results['dense']:+.1f}% vs dense")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
