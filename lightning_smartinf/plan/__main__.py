"""``python -m lightning_smartinf.plan``: predict iteration time, recommend a configuration, calibrate a machine."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from lightning_smartinf.core.arguments import Problems
from lightning_smartinf.core.io.storage import write_file_atomic
from lightning_smartinf.core.state_formats import FORMATS
from lightning_smartinf.plan.cost_model import (
    MAX_DEVICES,
    PlanError,
    Profile,
    Workload,
    profile_names,
    workload_from_model,
)
from lightning_smartinf.plan.machine import Machine, load_any
from lightning_smartinf.plan.machine_plan import format_machine_plan, machine_json, plan_machine
from lightning_smartinf.plan.planner import format_plan, make_plan, precisions_json, strategy_args
from lightning_smartinf.plan.tier_placement import place_state


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="smartinf plan",
        description="Analytic performance model of ZeRO-Infinity vs Smart-Infinity (SU, SU+O, SU+O+C): time "
        "breakdown per iteration, speedups, and a recommended SmartInfinityStrategy configuration.",
    )
    parser.add_argument("--model", help="a Hugging Face config.json (or its directory), or a size such as 7B, 350M")
    parser.add_argument(
        "--profile",
        default="paper-a5000",
        help=f"packaged profile ({', '.join(profile_names())}) or a profile JSON file (default: paper-a5000)",
    )
    parser.add_argument(
        "--devices",
        type=int,
        help="number of devices / SSDs; with a machine profile, of its storage paths (default: the recommended number)",
    )
    parser.add_argument("--compression", type=float, help="fraction of gradient elements kept, e.g. 0.01")
    parser.add_argument(
        "--state-precision",
        choices=FORMATS,
        default="fp32",
        help="the strategy's state_precision: Adam's moments on the devices in fp32 (default), bf16 or int8",
    )
    parser.add_argument(
        "--split-masters",
        action="store_true",
        help="the strategy's split_masters: 2.125 bytes per fp32 master on the devices, the rest in the bf16 "
        "parameters, kept in host memory (bf16 training, backend cpu)",
    )
    parser.add_argument(
        "--transfer-bytes",
        type=int,
        choices=(2, 4),
        help="bytes per gradient/parameter element on the link: 2 (bf16/fp16, this project) or 4 (fp32, the "
        "paper's runs); default: the profile's",
    )
    parser.add_argument("--batch", type=int, default=4, help="micro-batch size per GPU (default 4, as the paper)")
    parser.add_argument("--seq", type=int, help="sequence length (default: the config's context, capped at 4096)")
    parser.add_argument(
        "--accumulate",
        type=int,
        default=1,
        help="micro-batches per optimizer step, as the Trainer's accumulate_grad_batches (default 1)",
    )
    parser.add_argument(
        "--fused",
        action="store_true",
        help="the optimizer is built with fused=True (Adam/AdamW): a machine profile's devices update at the rate "
        "it measured for torch's fused kernel",
    )
    parser.add_argument(
        "--no-recompute",
        action="store_true",
        help="forward and backward without activation checkpointing: 6 FLOPs per parameter and token instead of 8",
    )
    parser.add_argument(
        "--calibrate",
        metavar="PATH",
        nargs="+",
        help="measure these storage paths (each alone, then all at once), this CPU, host RAM and the GPU; write a "
        "machine profile (kind local-nvme)",
    )
    parser.add_argument("-o", "--output", help="where --calibrate writes the profile JSON (default: stdout)")
    parser.add_argument("--calibrate-mb", type=int, default=384, help="MiB of test data per file (default 384)")
    parser.add_argument(
        "--calibrate-remote",
        metavar="HOST:PORT",
        help="measure the network to a `smartinf serve` server; write the --profile with its network figures",
    )
    parser.add_argument("--token-file", help="with --calibrate-remote: the server's token file")
    parser.add_argument(
        "--remote-tls-dir",
        help="with --calibrate-remote: ca.pem (and client.pem, client.key for mutual TLS) to reach a TLS server",
    )
    parser.add_argument(
        "--remote-allow-plaintext",
        action="store_true",
        help="with --calibrate-remote: reach a server on another machine in plain gRPC (the token in clear)",
    )
    parser.add_argument(
        "--memory-budget",
        help="host memory per rank for optimizer state (state_memory_budget), e.g. 8GiB: show the placement",
    )
    parser.add_argument(
        "--accelerator-budget",
        help="GPU memory per rank for optimizer state (state_accelerator_budget), e.g. 8GiB: show the placement",
    )
    parser.add_argument(
        "--device-weights", type=float, nargs="+", help="relative speed of each device: show the placement by speed"
    )
    parser.add_argument(
        "--params-on-storage",
        action="store_true",
        help="the 16-bit parameters live on storage (offload_parameters='storage'; ZeRO-Infinity's offload_param nvme)",
    )
    parser.add_argument(
        "--checkpoint-dir",
        help="with a machine profile: where checkpoints are written, for the disk space (default: its first path)",
    )
    parser.add_argument(
        "--keep-checkpoints",
        type=int,
        default=1,
        help="with a machine profile: checkpoints kept there (default 1; 0: none counted)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the plan as JSON instead of text (stdout: JSON only)"
    )
    return parser


def _check_output(output: str) -> None:
    """Refuse a ``-o`` the profile cannot be written to, before the minutes of measuring: a directory, or a file in
    a folder that is missing or not writable."""
    path = Path(output)
    folder = path.parent  # `.` for a bare file name
    if path.is_dir():
        raise PlanError(
            f"`-o {output}` is a directory: name the profile's JSON file, e.g. `-o {path / 'machine.json'}`."
        )
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise PlanError(f"`-o {output}`: its folder {str(folder)!r} {what}. Create the folder, or write elsewhere.")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PlanError(
            f"`-o {output}`: its folder {str(folder)!r} is not writable by this user. Write the profile elsewhere."
        )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Only the answer goes to stdout, once done: anything written meanwhile (a library's warning on import) goes to
    # stderr, so that `--json` output and a profile written to stdout parse as JSON.
    with contextlib.redirect_stdout(sys.stderr):
        try:
            answer = _run(parser, args)
        except PlanError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if answer is not None:
        sys.stdout.write((answer if isinstance(answer, str) else json.dumps(answer, indent=2)) + "\n")
    return 0


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | dict[str, Any] | None:
    """Calibrate and/or plan as ``args`` ask: the text or JSON object to print (``None``: nothing)."""
    _check_numbers(args)
    if args.output:
        _check_output(args.output)
    measured: Profile | Machine | None = None
    calibrated: dict[str, Any] | None = None
    if args.calibrate:
        from lightning_smartinf.plan.calibrate import calibrate

        calibrated = calibrate(
            args.calibrate, megabytes=args.calibrate_mb, name=Path(args.output).stem if args.output else None
        )
        measured = Machine.from_dict(calibrated, origin="the measured profile")
    if args.calibrate_remote:
        calibrated = _calibrate_remote(parser, args)
        measured = Profile.from_dict(calibrated, origin="the measured profile")
    if calibrated is not None:
        if args.output:
            # Through a temporary renamed into place: an interrupted write leaves the earlier profile, not half of one.
            write_file_atomic(Path(args.output), (json.dumps(calibrated, indent=2) + "\n").encode())
            print(f"wrote profile {calibrated['name']!r} to {args.output}", file=sys.stderr)
        if not args.model:
            return None if args.output else calibrated
    if not args.model:
        parser.error("--model is required (a config.json or a size like 7B), unless --calibrate is given")
    work = workload_from_model(args.model, batch=args.batch, seq=args.seq, accumulate=args.accumulate)
    work = replace(work, state_precision=args.state_precision, split_masters=args.split_masters)
    if args.no_recompute:
        work = replace(work, flops_per_param_token=6.0)
    if args.fused:
        work = replace(work, fused=True)
    prof = measured or load_any(args.profile)
    if args.transfer_bytes:
        prof = replace(prof, transfer_bytes=args.transfer_bytes)
    plan = _machine_plan(work, prof, args) if isinstance(prof, Machine) else _testbed_plan(work, prof, args)
    if calibrated is None or args.output:
        return plan
    # The measured profile is part of the answer: inside the JSON, or before the text.
    if isinstance(plan, dict):
        return {**plan, "calibrated_profile": calibrated}
    return json.dumps(calibrated, indent=2) + "\n" + plan


def _calibrate_remote(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """``--profile`` with the network figures measured against the ``--calibrate-remote`` server."""
    if not args.token_file:
        parser.error("--calibrate-remote needs --token-file (the server's token)")
    from lightning_smartinf.devices.remote.client import measure_network
    from lightning_smartinf.devices.remote.tokens import read_tls_dir, read_token

    try:
        tls = read_tls_dir(Path(args.remote_tls_dir)) if args.remote_tls_dir else None
        figures = measure_network(
            args.calibrate_remote,
            read_token(Path(args.token_file)),
            tls=tls,
            allow_plaintext=args.remote_allow_plaintext,
        )
    except (ValueError, OSError) as exc:  # a bad token file, or the server's StorageError
        raise PlanError(str(exc)) from None
    base = load_any(args.profile)
    if isinstance(base, Machine):
        raise PlanError(
            f"`--calibrate-remote` with `--profile {args.profile}`: the network figures extend a testbed profile "
            f"({', '.join(profile_names())} or a file of that kind), not a machine profile. Pass one of those."
        )
    source = f"measured against {args.calibrate_remote} (smartinf plan --calibrate-remote)"
    return {**base.to_dict(), **figures, "sources": {**base.sources, **dict.fromkeys(figures, source)}}


def _machine_plan(work: Workload, machine: Machine, args: argparse.Namespace) -> str | dict[str, Any]:
    """The report (or JSON object) for a machine profile."""
    plan = plan_machine(
        work,
        machine,
        devices=args.devices,
        memory_budget=_budget(args.memory_budget),
        accelerator_budget=_budget(args.accelerator_budget, "--accelerator-budget") or 0,
        compression=args.compression,
        params_on_storage=args.params_on_storage,
        device_weights=args.device_weights,
        checkpoint_dir=args.checkpoint_dir,
        keep_checkpoints=args.keep_checkpoints,
    )
    return machine_json(plan) if args.json else format_machine_plan(plan)


def _testbed_plan(work: Workload, prof: Profile, args: argparse.Namespace) -> str | dict[str, Any]:
    """The comparison with ZeRO-Infinity and the recommendation (or JSON object) for a testbed profile."""
    if work.split_masters and (prof.gradient_staged_on_ssd or prof.network_gbps is not None):
        raise PlanError(
            f"`--split-masters` is for devices on this host's cores (`backend='cpu'`), but profile {prof.name!r} "
            "describes SmartSSDs or remote servers, which keep whole masters. Drop it, or plan with a profile of "
            "emulated devices (`gradient_staged_on_ssd: false`) or a machine profile."
        )
    plan = make_plan(
        work, prof, devices=args.devices, compression=args.compression, params_on_storage=args.params_on_storage
    )
    if args.memory_budget is not None or args.device_weights or args.accelerator_budget is not None:
        memory = _budget(args.memory_budget)
        gpu = _budget(args.accelerator_budget, "--accelerator-budget")
        weights = tuple(args.device_weights) if args.device_weights else None
        placement = place_state(work, prof, plan.devices, memory or 0, weights, gpu or 0)
        plan = replace(plan, memory_budget=memory, accelerator_budget=gpu, device_weights=weights, placement=placement)
    if not args.json:
        return format_plan(plan)
    out: dict[str, Any] = {
        "params": work.params,
        "profile": prof.name,
        "devices": plan.devices,
        "breakdown": {m: {**b.__dict__, "total": b.total} for m, b in plan.breakdowns.items()},
        "speedup": {m: plan.baseline.total / b.total for m, b in plan.breakdowns.items()},
        "recommended_devices": plan.recommended_devices,
        "sub_group_size": plan.sub_group_size,
        "buffer_count": plan.buffer_count,
        "compression": plan.compression if plan.recommend_compression else None,
        "state_precision": precisions_json(plan.precisions),
        "strategy": strategy_args(plan),
    }
    if plan.placement is not None:
        out["placement"] = plan.placement.__dict__
    return out


def _check_numbers(args: argparse.Namespace) -> None:
    """Refuse every bad number among ``args`` at once, by its flag, before any measurement or plan (the planner's
    own checks name the fields of :class:`Workload`, ``batch=0``, not the flags)."""
    problems = Problems("smartinf plan", PlanError)
    problems.integer("--batch", args.batch, low=1, why="sequences per micro-batch")
    if args.seq is not None:  # None: the config's context, or 1024
        problems.integer("--seq", args.seq, low=1, why="tokens per sequence; leave it out for the model's context")
    problems.integer("--accumulate", args.accumulate, low=1, why="micro-batches per optimizer step")
    if args.devices is not None:  # None: the planner's recommendation
        why = (
            f"{MAX_DEVICES} is more storage devices or servers than a trainer attaches, and the planner compares "
            "every count from 1 up to the one asked; leave it out for the recommended number"
        )
        problems.integer("--devices", args.devices, low=1, high=MAX_DEVICES, why=why, example=10)
    problems.integer("--calibrate-mb", args.calibrate_mb, low=1, why="MiB of test data per file", example=384)
    weights = args.device_weights or []
    # Each device's share of the state is its weight over their sum: NaN, inf, 0 or < 0 gives no plan.
    wrong = [w for w in weights if not 0 < w < math.inf]
    if wrong:
        given = " ".join(f"{w:g}" for w in weights)
        fixed = " ".join(f"{w:g}" if 0 < w < math.inf else "1" for w in weights)
        what = "is not a finite number" if len(wrong) == 1 else "are not finite numbers"
        problems.add(
            f"`--device-weights {given}`: {', '.join(f'{w:g}' for w in wrong)} {what} > 0. Each weight is a device's "
            "speed relative to the others' (`2 1`: the first twice as fast as the second). Pass finite numbers > 0, "
            f"e.g. `--device-weights {fixed}`."
        )
    problems.raise_if_any()


def _budget(text: str | None, flag: str = "--memory-budget") -> int | None:
    """``flag``'s value in bytes (``"8GiB"``, ``"500MB"``, ``"1073741824"``); ``None`` where it is not given."""
    problems = Problems("smartinf plan", PlanError)
    budget = problems.size(flag, text)
    problems.raise_if_any()
    return budget


if __name__ == "__main__":
    sys.exit(main())
