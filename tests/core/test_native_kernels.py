"""The C kernels of the state formats (the ``"int8"`` conversions, Adam fused with ``"int8"`` and ``"bf16"``) give the
plain-torch reference's bytes, bit for bit; they build on a fresh machine (set-up installs a compiler), and where
they cannot, the reference runs with one warning."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy
import pytest
import torch
from conftest import REPO_ROOT
from helpers.leftovers import left_over

from lightning_smartinf.core import split_masters
from lightning_smartinf.core.native import build, compiler_flags, kernels_dir, state_format_kernels
from lightning_smartinf.core.rules import Adagrad, Adam, EFAdam, StepParams
from lightning_smartinf.core.state_formats import (
    BLOCK,
    E4M3_MAX,
    NON_NEGATIVE,
    PIECE,
    ROOT_CODE,
    reference_format,
    state_format,
    update_chunk,
)

#: Every float8_e4m3fn code's value, non-negative and finite (0x7F is NaN): a signed state's codes.
_E4M3 = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
_E, _M = ROOT_CODE.exponent_bits, ROOT_CODE.mantissa_bits
_BIAS = 2 ** (_E - 1) - 1
#: Every value of the root code (the codes of a state stored by its square root), written from an unsigned 8-bit
#: float's definition: _E exponent bits, bias 2**(_E - 1) - 1, _M mantissa bits, subnormals.
_ROOT = torch.tensor(
    [
        m * 2.0 ** (1 - _BIAS - _M) if e == 0 else (1 + m / 2**_M) * 2.0 ** (e - _BIAS)
        for e in range(2**_E)
        for m in range(2**_M)
    ]
)
#: Half a step above the largest code: from here on a value saturates (the tie included: it would round up, to even).
_ROOT_SATURATES = float(_ROOT[-1] + (_ROOT[-1] - _ROOT[-2]) / 2)


def test_only_x86_builds_ask_for_the_full_vector_width():
    """``-mprefer-vector-width`` is an x86 flag: an arm64 compiler refuses it, which would leave those machines on the
    slower reference. Every architecture keeps the flags that make the bytes the reference's."""
    for machine in ("x86_64", "AMD64"):
        assert "-mprefer-vector-width=512" in compiler_flags(machine)
    for machine in ("aarch64", "arm64", "ppc64le"):
        assert not any(flag.startswith("-mprefer-vector-width") for flag in compiler_flags(machine))
    for machine in ("x86_64", "aarch64"):
        assert {"-ffp-contract=off", "-march=native", "-O3"} <= set(compiler_flags(machine))


def test_the_kernels_build_here_and_the_devices_use_them():
    """A fresh CI machine has a compiler: the devices convert with the kernels, not the slower reference."""
    assert state_format_kernels() is not None
    assert state_format("int8").native and not reference_format("int8").native
    assert build("state_formats").parent == kernels_dir()


def _gradient(n: int, generator: torch.Generator) -> torch.Tensor:
    """Gradients over twelve orders of magnitude, with zeros, as a chunk of a real one has."""
    g = torch.randn(n, generator=generator) * 10.0 ** torch.randint(-9, 3, (n,), generator=generator).float()
    g[::97] = 0.0
    return g


def _stored_states(rule, fmt: str, padded: int, generator: torch.Generator) -> list[torch.Tensor]:  # noqa: ANN001
    """Each of ``rule``'s states over ``padded`` elements, stored in ``fmt`` by its reference (non-zero throughout)."""
    stored = []
    for name in rule.state_names:
        values = _gradient(padded, generator).abs() if name in NON_NEGATIVE else _gradient(padded, generator)
        raw = torch.empty(state_format(fmt).stored_bytes(padded), dtype=torch.uint8)
        reference_format(fmt).store(values, raw, name)
        stored.append(raw)
    return stored


def _split_record(n: int, generator: torch.Generator) -> tuple[int, torch.Tensor, torch.Tensor]:
    """A chunk of ``n`` random masters padded as a record pads it (to 1024 elements), and its split masters' region."""
    padded = -(-n // 1024) * 1024
    masters = torch.randn(n, generator=generator)
    region = torch.zeros(split_masters.region_bytes(padded), dtype=torch.uint8)
    split_masters.encode(masters, region)
    return padded, masters, region


#: The variants of Adam's arithmetic: AdamW and Adam (L2 decay), with and without decay, maximizing.
ADAM_VARIANTS = {
    "adamw": (Adam(decoupled_weight_decay=True), {"weight_decay": 0.1}),
    "adamw-no-decay": (Adam(decoupled_weight_decay=True), {}),
    "adam-l2": (Adam(), {"weight_decay": 0.01}),
    "adam-maximize": (Adam(), {"weight_decay": 0.01, "maximize": True, "betas": (0.8, 0.95), "eps": 1e-6}),
}


@pytest.mark.parametrize("variant", sorted(ADAM_VARIANTS))
@pytest.mark.parametrize("fmt", ["int8", "bf16"])
@pytest.mark.parametrize(("n", "threads"), [(0, 1), (1, 1), (BLOCK + 3, 1), (5 * 1024 + 17, 1), (3 * PIECE + 1000, 3)])
def test_adam_fused_with_a_format_is_the_reference_byte_for_byte(fmt, variant, n, threads, monkeypatch):
    """Six steps of one chunk, padded as a record pads it (to 1024 elements; the padding holds earlier values that
    must come back unchanged): the kernel's masters and stored states are the reference's (load, the rule with IEEE
    square roots, store), bit for bit, at every step; split among three threads as among one."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)  # the pieces follow torch's thread count
    rule, settings = ADAM_VARIANTS[variant]
    fast, ref = state_format(fmt), reference_format(fmt)
    generator = torch.Generator().manual_seed(n)
    padded = -(-n // 1024) * 1024
    master = torch.randn(n, generator=generator)
    stored = _stored_states(rule, fmt, padded, generator)  # not zero past the chunk's elements too
    want_master, want = master.clone(), [raw.clone() for raw in stored]
    for step in range(1, 7):
        hp = StepParams(step=step, lr=1e-3 * step, **settings)
        grad = _gradient(n, generator)
        assert fast.fused_update(rule, master, grad.clone(), stored, hp), "the kernel must take this update"
        update_chunk(rule, ref, want_master, grad.clone(), want, hp)
        assert torch.equal(master, want_master), f"masters differ at step {step}"
        for name, got, expected in zip(rule.state_names, stored, want):
            assert torch.equal(got, expected), f"{name} differs at step {step}"


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("grad_scale", [1.0, 1 / 3, 1024.0])
@pytest.mark.parametrize("fmt", ["int8", "bf16"])
@pytest.mark.parametrize(("n", "threads"), [(1, 1), (BLOCK + 3, 1), (3 * PIECE + 1000, 3)])
def test_adam_fused_takes_the_gradient_as_it_crossed_and_writes_the_parameters(
    fmt, grad_scale, split, n, threads, monkeypatch
):
    """What a device does around the update, inside the kernels' pass: the bf16 gradient as it crossed the link,
    times the gradient scale, and (beside whole masters) the parameters written out: the same bytes as converting the
    gradient to fp32, ``mul_(grad_scale)``, the reference's update and ``params.copy_(masters)``."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    rule, settings = ADAM_VARIANTS["adamw"]
    fast, ref = state_format(fmt), reference_format(fmt)
    generator = torch.Generator().manual_seed(n)
    padded, masters, region = _split_record(n, generator)
    params, want_params = masters.to(torch.bfloat16), masters.to(torch.bfloat16)
    stored = _stored_states(rule, fmt, padded, generator)
    want_masters, want_region, want = masters.clone(), region.clone(), [raw.clone() for raw in stored]
    for step in range(1, 4):
        hp = StepParams(step=step, lr=1e-3 * step, **settings)
        link = _gradient(n, generator).to(torch.bfloat16)
        scaled = link.float()
        if grad_scale != 1.0:
            scaled.mul_(grad_scale)  # as a device scales the gradient it loaded
        if split:
            chunk = split_masters.SplitChunk(params, region)
            assert fast.fused_update(rule, torch.empty(n), link, stored, hp, chunk, grad_scale=grad_scale)
            reference = split_masters.SplitChunk(want_params, want_region)
            update_chunk(rule, ref, torch.empty(n), scaled, want, hp, split=reference)
            assert torch.equal(region, want_region), f"low halves or carry bits differ at step {step}"
        else:
            assert fast.fused_update(rule, masters, link, stored, hp, params=params, grad_scale=grad_scale)
            update_chunk(rule, ref, want_masters, scaled, want, hp)
            want_params.copy_(want_masters)
            assert torch.equal(masters, want_masters), f"masters differ at step {step}"
        assert torch.equal(params, want_params), f"parameters differ at step {step}"
        for name, got, expected in zip(rule.state_names, stored, want):
            assert torch.equal(got, expected), f"{name} differs at step {step}"


def test_parameters_written_by_the_kernel_must_be_host_bf16_of_the_chunks_size():
    """Where the parameters cannot take the kernel's writes (another dtype or size, beside split masters), the kernel
    does not run and nothing is written: the caller runs the reference and copies them itself."""
    rule, fast = ADAM_VARIANTS["adamw"][0], state_format("int8")
    n = 2 * BLOCK
    stored = [torch.zeros(fast.stored_bytes(n), dtype=torch.uint8) for _ in range(2)]
    master, grad, hp = torch.ones(n), torch.ones(n), StepParams(1, 0.1)
    for params in (
        torch.zeros(n),
        torch.zeros(n - 1, dtype=torch.bfloat16),
        torch.zeros(2 * n, dtype=torch.bfloat16)[::2],
    ):
        assert not fast.fused_update(rule, master, grad, stored, hp, params=params)
        assert torch.equal(master, torch.ones(n)) and not params.any()
    region = torch.zeros(split_masters.region_bytes(n), dtype=torch.uint8)
    chunk = split_masters.SplitChunk(master.bfloat16(), region)
    assert not fast.fused_update(rule, master, grad, stored, hp, chunk, params=torch.zeros(n, dtype=torch.bfloat16))


@pytest.mark.parametrize("variant", ["adamw", "adam-maximize"])
@pytest.mark.parametrize("fmt", ["int8", "bf16"])
@pytest.mark.parametrize(("n", "threads"), [(1, 1), (BLOCK + 3, 1), (5 * 1024 + 17, 1), (3 * PIECE + 1000, 3)])
def test_adam_fused_over_split_masters_is_the_reference_byte_for_byte(fmt, variant, n, threads, monkeypatch):
    """The kernels reading and writing split masters (:mod:`lightning_smartinf.core.split_masters`) in their pass:
    the parameters, the low halves and carry bits, the stored states and the copy of the parameters set aside are the
    reference's (rebuild the masters, update, store them back), bit for bit, at every step."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    rule, settings = ADAM_VARIANTS[variant]
    fast, ref = state_format(fmt), reference_format(fmt)
    generator = torch.Generator().manual_seed(n)
    padded, masters, region = _split_record(n, generator)
    params = masters.to(torch.bfloat16)
    stored = _stored_states(rule, fmt, padded, generator)
    want = [params.clone(), region.clone(), *(raw.clone() for raw in stored)]
    for step in range(1, 5):
        hp = StepParams(step=step, lr=1e-3 * step, **settings)
        grad = _gradient(n, generator)
        before = params.clone()
        aside, want_aside = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
        split = split_masters.SplitChunk(params, region, aside)
        assert fast.fused_update(rule, torch.empty(n), grad.clone(), stored, hp, split), "the kernel must take it"
        reference = split_masters.SplitChunk(want[0], want[1], want_aside)
        update_chunk(rule, ref, torch.empty(n), grad.clone(), want[2:], hp, split=reference)
        for name, got, expected in zip(["params", "region", *rule.state_names], [params, region, *stored], want):
            assert torch.equal(got, expected), f"{name} differs at step {step}"
        assert torch.equal(aside, before) and torch.equal(want_aside, before)


def test_the_reference_of_a_format_takes_ieee_square_roots_and_fp32_torchs():
    """A stored format's reference is the rule with IEEE square roots (what every device computes); ``"fp32"`` is the
    rule as it stands, whose square roots are torch's, as torch.optim's are."""
    rule, n = Adam(decoupled_weight_decay=True), 1 << 14
    generator = torch.Generator().manual_seed(3)
    # exp_avg_sq values whose torch square root is off by one ulp somewhere on this build, or IEEE already
    second = torch.rand(n, generator=generator) * 10
    grad = torch.zeros(n)
    hp = StepParams(step=1, lr=1e-3)
    for ieee in (False, True):
        master, states = torch.ones(n), [torch.ones(n), second.clone()]
        rule.apply(master, grad.clone(), states, hp, ieee_sqrt=ieee)
        denom = torch.from_numpy(numpy.sqrt((second * 0.999).numpy())) if ieee else (second * 0.999).sqrt()
        denom = denom.div_(math.sqrt(1 - 0.999)).add_(1e-8)
        assert torch.equal(master, torch.ones(n).addcdiv_(torch.ones(n) * 0.9, denom, value=-1e-3 / 0.1))
    fp32 = state_format("fp32")
    raw = [torch.ones(n).view(torch.uint8), (second.clone()).view(torch.uint8)]
    master = torch.ones(n)
    update_chunk(rule, fp32, master, grad.clone(), raw, hp)
    expected = torch.ones(n)
    rule.apply(expected, grad.clone(), [torch.ones(n), second.clone()], hp)
    assert torch.equal(master, expected)


@pytest.mark.parametrize(
    "rule",
    [Adam(fused=True), Adam(amsgrad=True), EFAdam(), Adagrad()],
    ids=["fused", "amsgrad", "ef_adam", "adagrad"],
)
def test_a_rule_the_kernels_do_not_have_runs_the_reference(rule):
    """The kernels hold the single-tensor Adam and AdamW only: torch's fused kernel rounds otherwise, and the other
    rules run the reference, on every format."""
    n = 1000
    for fmt in ("int8", "bf16"):
        fast = state_format(fmt)
        stored = [torch.zeros(fast.stored_bytes(1024), dtype=torch.uint8) for _ in rule.state_names]
        assert not fast.fused_update(rule, torch.zeros(n), torch.ones(n), stored, StepParams(1, 0.1))
    assert not reference_format("int8").fused_update(
        Adam(), torch.zeros(n), torch.ones(n), [torch.zeros(1040, dtype=torch.uint8)] * 2, StepParams(1, 0.1)
    )


def _both(values: torch.Tensor, state: str) -> tuple[torch.Tensor, torch.Tensor]:
    fast, ref = state_format("int8"), reference_format("int8")
    a = torch.full((fast.stored_bytes(values.numel()),), 0xAB, dtype=torch.uint8)
    b = a.clone()
    fast.store(values, a, state)
    ref.store(values.clone(), b, state, consume=True)
    return a, b


def _loaded(raw: torch.Tensor, n: int, state: str, native: bool) -> torch.Tensor:
    fmt = state_format("int8") if native else reference_format("int8")
    out = torch.full((n,), float("nan"))
    fmt.load(raw, out, state)
    return out


def _edges(codes: torch.Tensor, top: float, saturating: float) -> torch.Tensor:
    """Every code's value, the midpoints between neighbouring codes (where rounding ties go to the even code) and
    the floats one step either side of each, and values between the largest code ``top`` and ``saturating``: the
    values a block whose largest element is ``top`` (scale 1) codes as they are."""
    ups, downs = torch.nextafter(codes, torch.tensor(1e9)), torch.nextafter(codes, torch.tensor(-1.0))
    mids = (codes[:-1].double() + codes[1:].double()).div(2).float()  # exact: one more bit than a code
    mid_ups, mid_downs = torch.nextafter(mids, torch.tensor(1e9)), torch.nextafter(mids, torch.tensor(-1.0))
    below = float(torch.nextafter(torch.tensor(saturating), torch.tensor(0.0)))
    above = torch.tensor([top, (top + saturating) / 2, below])
    return torch.cat([codes, ups, downs.clamp(min=0), mids, mid_ups, mid_downs, above]).clamp(max=below)


def test_every_rounding_edge_codes_as_torch_does_for_a_signed_state():
    """Each value in a block of its own whose largest element is 448: its code is torch's float8_e4m3fn conversion
    of the value (round to nearest, ties to even), in the kernels as in the reference."""
    values = _edges(_E4M3, E4M3_MAX, 464.0)
    values = torch.cat([values, -values])
    blocks = torch.zeros(values.numel(), BLOCK)
    blocks[:, 0], blocks[:, 1] = E4M3_MAX, values
    a, b = _both(blocks.flatten(), "exp_avg")
    assert torch.equal(a, b)
    codes = a[: values.numel() * BLOCK].view(-1, BLOCK)[:, 1]
    assert torch.equal(codes, values.to(torch.float8_e4m3fn).view(torch.uint8))


def test_every_rounding_edge_codes_to_the_nearest_root_code_for_a_never_negative_state():
    """Each square root in a block of its own whose largest square root is the root code's largest (scale 1): its
    code is the nearest, ties to the even code, from half a step above the largest saturating, in the kernels as in
    the reference; and a non-zero value below the smallest code takes that code, never zero."""
    assert torch.equal(_ROOT, ROOT_CODE.values)
    tiny = torch.tensor([float(_ROOT[1]) / 2, float(_ROOT[1]) / 3, 2.0**-20, 2.0**-60, 0.0])
    roots = torch.cat([_edges(_ROOT, ROOT_CODE.largest, _ROOT_SATURATES), tiny])
    blocks = torch.zeros(roots.numel(), BLOCK)
    blocks[:, 0], blocks[:, 1] = ROOT_CODE.largest, roots
    blocks = blocks.square()  # the state: codes and midpoints square exactly (at most 14 significant bits) ...
    roots = torch.from_numpy(numpy.sqrt(blocks[:, 1].numpy()))  # ... the floats beside them within a step
    assert torch.equal(blocks[:, 0].sqrt(), torch.full_like(roots, ROOT_CODE.largest))
    a, b = _both(blocks.flatten(), "exp_avg_sq")
    assert torch.equal(a, b)
    codes = a[: roots.numel() * BLOCK].view(-1, BLOCK)[:, 1].long()
    distance = (_ROOT[None, :].double() - roots[:, None].double()).abs()
    nearest = distance.min(dim=1, keepdim=True).values
    tied = distance == nearest  # the nearest codes; of two, the even one
    expected = torch.where(
        tied.sum(dim=1) > 1, (tied * (torch.arange(256) % 2 == 0)).int().argmax(dim=1), tied.int().argmax(dim=1)
    )
    expected = torch.where((expected == 0) & (roots > 0), 1, expected)
    assert torch.equal(codes, expected)


@pytest.mark.parametrize("state", ["exp_avg", "exp_avg_sq"])
def test_blocks_of_subnormal_scale_saturate_as_torch_does(state):
    """A block whose largest magnitude is under 448 * 2**-126 has a subnormal scale, rounded enough that an element
    over it reaches 512: torch's conversion saturates such a quotient to 448's code (an earlier kernel coded it as
    NaN, which would have poisoned the parameter), the root code to its largest; infinities saturate too, and a NaN
    makes its block's scale NaN. Every finite block loads back finite."""
    tiny = [2.0**-140, -(2.0**-141), 1.5 * 2.0**-139, 2.0**-149, 3 * 2.0**-147, 448 * 2.0**-127]
    blocks = torch.zeros(len(tiny) + 2, BLOCK)
    for i, largest in enumerate(tiny):
        blocks[i, :4] = torch.tensor([largest, largest / 3, -largest / 2, largest / 7])
    blocks[-2, :3] = torch.tensor([float("inf"), 1.0, -2.0])
    blocks[-1, :3] = torch.tensor([float("nan"), 1.0, -2.0])
    values = blocks.flatten().abs() if state in NON_NEGATIVE else blocks.flatten()
    a, b = _both(values, state)
    assert torch.equal(a, b)
    native, reference = _loaded(a, values.numel(), state, True), _loaded(b, values.numel(), state, False)
    assert torch.equal(native.view(torch.int32), reference.view(torch.int32))
    assert bool(native.view(-1, BLOCK)[: len(tiny)].isfinite().all()), "a finite state loaded as NaN or infinity"


def _moments(n: int, seed: int, non_negative: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 6)  # 1e-15 .. 1e15
    x[torch.rand(n, generator=g) < 0.05] = 0.0
    x[torch.rand(n, generator=g) < 0.01] = -0.0
    if non_negative:
        x = x.abs()
    x[-BLOCK:] = 0.0  # an all-zero block: scale 0
    return x


@pytest.mark.parametrize("n", [1 << 20, 1000 * BLOCK + 17, BLOCK, 1])
@pytest.mark.parametrize("state", ["exp_avg", "exp_avg_sq", "momentum_buffer", "sum"])
def test_store_and_load_match_the_reference_bit_for_bit(n, state):
    """Moments over thirty orders of magnitude, zeros of both signs, whole and partial blocks: the same bytes, and
    the same fp32 values read back (the bits compared, so -0.0 and 0.0 differ)."""
    values = _moments(max(n, BLOCK + 1), n, state in NON_NEGATIVE)[:n]
    a, b = _both(values, state)
    assert torch.equal(a, b)
    native, reference = _loaded(a, n, state, True), _loaded(b, n, state, False)
    assert torch.equal(native.view(torch.int32), reference.view(torch.int32))


@pytest.mark.parametrize("state", ["exp_avg", "exp_avg_sq"])
def test_every_code_loads_as_the_references_table_gives_it(state):
    """The kernel decodes each code from its bits (the reference reads a table of the 256 values): every code, NaN's
    included, under scales from zero and subnormal to the largest finite, gives the reference's bits."""
    scales = torch.tensor([0.0, 1.0, 1e-40, 2.0**-126, 0.3, 3.4e38, float("inf")], dtype=torch.float32)
    blocks = scales.numel()
    raw = torch.cat([torch.arange(256, dtype=torch.uint8).repeat(blocks), scales.view(torch.uint8)])
    n = blocks * BLOCK
    native, reference = _loaded(raw, n, state, True), _loaded(raw, n, state, False)
    assert torch.equal(native.view(torch.int32), reference.view(torch.int32))
    if state in NON_NEGATIVE:  # the root code's values, squared, under scale 1
        assert torch.equal(native[BLOCK : 2 * BLOCK], _ROOT.square())


def test_the_values_are_only_read_and_non_contiguous_input_takes_the_reference():
    values = _moments(4 * BLOCK, 3, True)
    kept = values.clone()
    a, b = _both(values, "exp_avg_sq")
    assert torch.equal(values, kept) and torch.equal(a, b)
    strided = torch.stack([values, values], dim=1)[:, 0]  # not contiguous: the reference's way
    c = torch.empty_like(a)
    state_format("int8").store(strided, c, "exp_avg_sq")
    assert torch.equal(c, a)


def _python(script: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **env},
        timeout=300,
    )


#: What each kernel library's user computes twice without a compiler, against its reference; and what it says.
WITHOUT_A_COMPILER = {
    "state_formats": (
        "from lightning_smartinf.core.rules import Adam, StepParams\n"
        "from lightning_smartinf.core.state_formats import state_format, reference_format, update_chunk\n"
        "x = torch.rand(3000)\n"
        "for _ in range(2):\n"
        "    a = torch.empty(state_format('int8').stored_bytes(3000), dtype=torch.uint8); b = a.clone()\n"
        "    state_format('int8').store(x, a, 'exp_avg'); reference_format('int8').store(x, b, 'exp_avg')\n"
        "    assert torch.equal(a, b)\n"
        "    assert not state_format('int8').fused_update(Adam(), x.clone(), x.clone(), [a, b], StepParams(1, 0.1))\n",
        "The optimizer state's formats",
    ),
    "norm": (
        "from lightning_smartinf.core.float64_norm import PartitionNorm\n"
        "x = torch.randn(3000)\n"
        "for _ in range(2):\n"
        "    assert torch.equal(PartitionNorm()(x), PartitionNorm(native=False)(x))\n",
        "Gradient norms",
    ),
}


@pytest.mark.parametrize("kernels", sorted(WITHOUT_A_COMPILER))
def test_without_a_compiler_the_reference_runs_and_says_so_once(tmp_path, kernels):
    computes, subject = WITHOUT_A_COMPILER[kernels]
    script = "import torch\n" + computes + "print('same bytes')\n"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    os.symlink(sys.executable, bin_dir / "python")
    run = _python(script, {"PATH": str(bin_dir), "CC": "", "SMARTINF_KERNELS_DIR": str(tmp_path / "k")})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "same bytes"
    said = [line for line in run.stderr.splitlines() if "its C kernels did not build here" in line]
    assert len(said) == 1 and "no C compiler on PATH" in said[0] and subject in said[0], run.stderr
    assert not (tmp_path / "k").exists()


def test_processes_building_at_once_all_load_one_whole_library(tmp_path):
    """Two processes on a directory where a killed build left its temporaries: each builds and renames into place;
    both load, and only the library is left, with the temporaries of a build still running (this process's)."""
    script = (
        "from lightning_smartinf.core.native import state_format_kernels\nassert state_format_kernels() is not None\n"
    )
    killed = [left_over(tmp_path / "state_formats-0123456789abcdef.so"), left_over(tmp_path / "state_formats.c")]
    running = left_over(tmp_path / "state_formats.c", pid=os.getpid())
    for path in [*killed, running]:
        path.write_bytes(b"half a build")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "SMARTINF_KERNELS_DIR": str(tmp_path)}
    runs = [
        subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT, env=env, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    for run in runs:
        _, err = run.communicate(timeout=300)
        assert run.returncode == 0, err
    assert [p.suffix for p in tmp_path.iterdir() if p != running] == [".so"] and running.exists()
