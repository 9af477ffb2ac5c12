"""Public names that were renamed: the old name still resolves to the same object, with a ``DeprecationWarning``."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def old_names(module: str, renamed: Mapping[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``module`` under which each old name of ``renamed`` (old -> new) is the
    module's object of the new name, with a ``DeprecationWarning`` naming both; any other name is missing."""

    def __getattr__(name: str) -> Any:
        new = renamed.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"`{module}.{name}` is now `{new}`; the old name will be removed in a later version.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(sys.modules[module], new)

    return __getattr__
