"""``smartinf fit|validate|test``: Lightning's ``LightningCLI`` with ``strategy="smart_infinity"`` as the default.

A run is a YAML recipe in LightningCLI's format (``trainer:``, ``model:`` and ``data:`` with ``class_path`` /
``init_args``), plus command-line overrides::

    smartinf fit --config recipes/<name>.yaml --trainer.max_steps 100
    smartinf fit --print_config                      # the full config with every default, to start a recipe from

Any LightningModule and LightningDataModule can be named; ``data:`` is optional (a module may bring its own
dataloaders). The Trainer's ``strategy`` defaults to ``"smart_infinity"``, and a
:class:`~lightning_smartinf.lightning.monitor.TrainingMonitor` is always attached (its settings under ``monitor:``). The
config a run used is saved into its log directory. A recipe with an unknown key or a value of the wrong type is
refused before anything is built, with jsonargparse's message naming the key (exit status 2); a value of the right type
that a class refuses (``sub_group_size: 0``) ends the same way, with that class's message.
"""

from __future__ import annotations

import sys
import warnings

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

import lightning_smartinf  # noqa: F401  (registers "smart_infinity")
from lightning_smartinf.commands.cli import LIGHTNING_COMMANDS
from lightning_smartinf.lightning import quiet
from lightning_smartinf.lightning.monitor import TrainingMonitor


class SmartInfinityCLI(LightningCLI):
    """``LightningCLI`` for any LightningModule/LightningDataModule, defaulting to ``strategy="smart_infinity"``.

    ``data:`` is optional, as in ``LightningCLI`` without a datamodule class. Adds a ``monitor:`` group: the arguments
    of :class:`~lightning_smartinf.lightning.monitor.TrainingMonitor`, which is always attached.
    """

    @staticmethod
    @override
    def subcommands() -> dict[str, set[str]]:
        return {name: keys for name, keys in LightningCLI.subcommands().items() if name in LIGHTNING_COMMANDS}

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(TrainingMonitor, "monitor")

    @override
    def instantiate_classes(self) -> None:
        """Build the recipe's classes. A constructor's refusal of a value (a ``ValueError`` or Lightning's
        ``MisconfigurationException``, naming the argument and the fix) is the recipe's error: its message and exit
        status 2, as jsonargparse's for a wrong type, not a traceback through jsonargparse and Lightning."""
        try:
            super().instantiate_classes()
        except (MisconfigurationException, ValueError) as exc:
            self.parser.error(str(exc))

    @override
    def _run_subcommand(self, subcommand: str) -> None:
        """Run the subcommand. A refusal only the run can make (a ``MisconfigurationException`` of the strategy or of
        Lightning, once the model, its optimizer and the precision meet) is the recipe's error too: its message and exit
        status 2. Lightning has torn the run down by the time it reaches here."""
        try:
            super()._run_subcommand(subcommand)
        except MisconfigurationException as exc:
            self.parser.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    """Run ``LightningCLI``; ``argv`` starts with the subcommand (``["fit", "--config", "recipe.yaml"]``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    silenced = quiet.silence(entry_point=True)
    try:
        with warnings.catch_warnings():
            # LightningCLI warns whenever `args` is given while `sys.argv` has arguments; here they are ours on purpose.
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
            SmartInfinityCLI(
                model_class=None,
                datamodule_class=None,
                subclass_mode_model=True,
                subclass_mode_data=True,
                trainer_defaults={"strategy": "smart_infinity"},
                save_config_kwargs={"overwrite": True},
                parser_kwargs={"prog": "smartinf"},
                args=argv,
            )
    finally:
        silenced.restore()
    return 0


if __name__ == "__main__":
    sys.exit(main())
