"""``smartinf`` (and ``python -m lightning_smartinf``): the project's command line.

Each subcommand is a module with ``main(argv) -> int``; this dispatcher imports only the one asked for, so
``smartinf plan`` starts without importing Lightning or DeepSpeed. ``fit``, ``validate`` and ``test`` are
``LightningCLI`` subcommands (:mod:`lightning_smartinf.commands.fit`), which get the subcommand name as ``argv[0]``.
"""

from __future__ import annotations

import importlib
import sys

#: subcommand -> (module with ``main(argv)``, one-line help)
COMMANDS = {
    "fit": ("lightning_smartinf.commands.fit", "train with LightningCLI: `smartinf fit --config recipes/<name>.yaml`"),
    "validate": ("lightning_smartinf.commands.fit", "run the validation loop with LightningCLI (same config as fit)"),
    "test": ("lightning_smartinf.commands.fit", "run the test loop with LightningCLI (same config as fit)"),
    "report": (
        "lightning_smartinf.commands.report",
        "plot loss, tokens/s and link traffic from a CSV or TensorBoard log dir",
    ),
    "demo": ("lightning_smartinf.commands.demo", "train a small GPT on 2 emulated CSDs and print the traffic summary"),
    "plan": ("lightning_smartinf.plan.__main__", "predict iteration time and recommend a configuration"),
    "serve": (
        "lightning_smartinf.devices.remote.serve",
        "run a remote device server next to the storage (docs/remote.md)",
    ),
    "export": (
        "lightning_smartinf.commands.export",
        "rebuild full weights from a checkpoint's device state (fp32 safetensors, or a HF save_pretrained directory)",
    ),
}

#: subcommands run by LightningCLI, which parses the subcommand name itself
LIGHTNING_COMMANDS = ("fit", "validate", "test")
#: subcommands that never import DeepSpeed (they start without it)
WITHOUT_DEEPSPEED = ("plan", "report")


def deepspeed_logs_to_stderr() -> None:
    """Import DeepSpeed with its log handler writing to stderr.

    DeepSpeed's logger writes to stdout, and logs its accelerator notice while it is imported: what a command prints
    on stdout for a program or a file (``smartinf fit --print_config > config.yaml``) would start with a log line.
    Its handler keeps the stream it was made with, so importing it while stdout is stderr moves all its logs there.
    """
    if "deepspeed" in sys.modules:
        return
    import contextlib

    with contextlib.redirect_stdout(sys.stderr):
        import deepspeed  # noqa: F401


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: smartinf <command> [args...]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "`smartinf <command> --help` describes a command's arguments."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"smartinf: unknown command {command!r}; choose one of: {', '.join(COMMANDS)}.\n", file=sys.stderr)
        print(usage(), file=sys.stderr)
        return 2
    if command in WITHOUT_DEEPSPEED:
        return _run(command, argv, rest)
    from lightning_smartinf.lightning import quiet  # not before: `plan` and `report` start without Lightning

    silenced = quiet.silence(entry_point=True)  # before DeepSpeed logs its accelerator while it is imported
    try:
        deepspeed_logs_to_stderr()
        return _run(command, argv, rest)
    finally:
        silenced.restore()


def _run(command: str, argv: list[str], rest: list[str]) -> int:
    module = importlib.import_module(COMMANDS[command][0])
    return int(module.main(argv if command in LIGHTNING_COMMANDS else rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
