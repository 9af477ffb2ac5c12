"""``python -m lightning_smartinf.plan``: predict iteration time, recommend a configuration, calibrate a machine."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from lightning_smartinf.plan.model import PlanError, Profile, load_profile, profile_names, workload_from_model
from lightning_smartinf.plan.planner import format_plan, make_plan, strategy_args
from lightning_smartinf.plan.tiers import place_state


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_smartinf.plan",
        description="Analytic performance model of ZeRO-Infinity vs Smart-Infinity (SU, SU+O, SU+O+C): time "
        "breakdown per iteration, speedups, and a recommended SmartInfinityStrategy configuration.",
    )
    parser.add_argument("--model", help="a Hugging Face config.json (or its directory), or a size such as 7B, 350M")
    parser.add_argument(
        "--profile",
        default="paper-a5000",
        help=f"packaged profile ({', '.join(profile_names())}) or a profile JSON file (default: paper-a5000)",
    )
    parser.add_argument("--devices", type=int, help="number of devices / SSDs (default: the recommended number)")
    parser.add_argument("--compression", type=float, help="fraction of gradient elements kept, e.g. 0.01")
    parser.add_argument(
        "--transfer-bytes",
        type=int,
        choices=(2, 4),
        help="bytes per gradient/parameter element on the link: 2 (bf16/fp16, this project) or 4 (fp32, the "
        "paper's runs); default: the profile's",
    )
    parser.add_argument("--batch", type=int, default=4, help="micro-batch size per GPU (default 4, as the paper)")
    parser.add_argument("--seq", type=int, help="sequence length (default: the config's context, capped at 4096)")
    parser.add_argument("--calibrate", metavar="PATH", help="measure storage at PATH and this CPU; write a profile")
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
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead of text")
    return parser


def _write_profile(profile: dict, output: str | None) -> None:
    """``profile`` as JSON into ``output``, or to stdout without one."""
    text = json.dumps(profile, indent=2) + "\n"
    if output:
        Path(output).write_text(text)
        print(f"wrote profile {profile['name']!r} to {output}", file=sys.stderr)
    else:
        sys.stdout.write(text)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    measured: Profile | None = None
    try:
        if args.calibrate:
            from lightning_smartinf.plan.calibrate import calibrate

            name = Path(args.output).stem if args.output else None
            profile = calibrate(args.calibrate, megabytes=args.calibrate_mb, name=name)
            _write_profile(profile, args.output)
            if not args.model:
                return 0
            args.profile = args.output or args.profile
        if args.calibrate_remote:
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
            profile = {**load_profile(args.profile).to_dict(), **figures}
            profile["sources"] = {
                **profile.get("sources", {}),
                **{
                    key: f"measured against {args.calibrate_remote} (smartinf plan --calibrate-remote)"
                    for key in figures
                },
            }
            _write_profile(profile, args.output)
            if not args.model:
                return 0
            measured = Profile.from_dict(profile, origin="the measured profile")
        if not args.model:
            parser.error("--model is required (a config.json or a size like 7B), unless --calibrate is given")
        work = workload_from_model(args.model, batch=args.batch, seq=args.seq)
        prof = measured or load_profile(args.profile)
        if args.transfer_bytes:
            prof = replace(prof, transfer_bytes=args.transfer_bytes)
        plan = make_plan(
            work, prof, devices=args.devices, compression=args.compression, params_on_storage=args.params_on_storage
        )
        tiers = None
        if args.memory_budget is not None or args.device_weights or args.accelerator_budget is not None:
            args.memory_budget = args.memory_budget or "0"
            gpu = 0 if args.accelerator_budget is None else _budget(args.accelerator_budget, "--accelerator-budget")
            tiers = place_state(work, prof, plan.devices, _budget(args.memory_budget), args.device_weights, gpu)
    except PlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = {
            "params": work.params,
            "profile": prof.name,
            "devices": plan.devices,
            "breakdown": {m: {**b.__dict__, "total": b.total} for m, b in plan.breakdowns.items()},
            "speedup": {m: plan.baseline.total / b.total for m, b in plan.breakdowns.items()},
            "recommended_devices": plan.recommended_devices,
            "sub_group_size": plan.sub_group_size,
            "buffer_count": plan.buffer_count,
            "compression": plan.compression if plan.recommend_compression else None,
            "strategy": strategy_args(plan),
        }
        if tiers is not None:
            out["placement"] = {**tiers.__dict__, "memory_budget": args.memory_budget}
            out["strategy"]["state_memory_budget"] = args.memory_budget
            if args.accelerator_budget is not None:
                out["placement"]["accelerator_budget"] = args.accelerator_budget
                out["strategy"]["state_accelerator_budget"] = args.accelerator_budget
        print(json.dumps(out, indent=2))
    else:
        print(format_plan(plan))
        if tiers is not None:
            print(f"\n{tiers.describe(args.memory_budget, args.accelerator_budget)}")
    return 0


def _budget(text: str, flag: str = "--memory-budget") -> int:
    """``flag``'s value in bytes (``"8GiB"``, ``"500MB"``, ``"1073741824"``)."""
    from lightning_smartinf.core.arguments import Problems

    problems = Problems("smartinf plan", PlanError)
    budget = problems.size(flag, text)
    problems.raise_if_any()
    return budget or 0


if __name__ == "__main__":
    sys.exit(main())
