"""``python -m lightning_smartinf``: same as the ``smartinf`` command."""

import sys

from lightning_smartinf.commands.cli import main

sys.exit(main())
