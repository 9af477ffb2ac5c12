"""Checks of user arguments that collect every problem and report them in one error.

A :class:`Problems` is filled by small typed checks, one line per bad argument naming the argument and its value,
what is allowed and the fix; :meth:`Problems.raise_if_any` then raises one exception listing them all, so a run
with three bad settings fails once, not three times (litgpt's ``validate_args`` works the same way). The module
imports neither Lightning nor torch: the strategy raises ``MisconfigurationException`` through it, and each
callback the error type it has always raised.

The same conventions hold for every argument of the strategy and of the callbacks:

* A count is an ``int``. ``True``/``False`` are refused although Python makes ``bool`` a subclass of ``int``, and
  so are ``16.0`` and ``"16"``. Without a tighter bound a count must fit in int64, the index type of torch.
* A byte count is an ``int`` number of bytes. Strings with units (``"1MiB"``, ``"4KiB"``, ``"1GB"``) are refused,
  and the message gives the int to write instead: one plain type in signatures, YAML recipes and LightningCLI, and
  no doubt whether ``"1MB"`` means 10**6 or 2**20 bytes. Memory budgets are the exception (:meth:`Problems.size`):
  they take an int or a string with an explicit unit, ``"8GiB"`` (2**30) or ``"8GB"`` (10**9), as users write them.
* A number (a ratio, seconds, a loss scale) is an ``int`` or ``float``, finite, not a ``bool`` and not a string.
* A flag is ``True`` or ``False``; ``1`` and ``"yes"`` are refused.
* A dict argument has its keys checked (unknown ones are listed with the allowed ones) and each value checked as an
  argument of its own, named ``argument['key']``.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import re
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import psutil

__all__ = ["INT64_MAX", "MIB", "Problems", "show"]

#: Largest count accepted where no tighter bound applies: torch indexes with int64.
INT64_MAX = (1 << 63) - 1
MIB = 1 << 20
_MISSING = object()
_UNIT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def show(value: Any) -> str:
    """``repr(value)``, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:56]}...{text[-1]}"


def _bound(n: int) -> str:
    """``2**30`` and ``2**63 - 1`` rather than their digits."""
    for power in range(20, 129):
        if n == 1 << power:
            return f"2**{power}"
        if n == (1 << power) - 1:
            return f"2**{power} - 1"
    return str(n)


def _wrong_type(value: Any) -> str:
    """``"is a str"``, ``"is an int"``, ``"is not allowed"`` (``None``): what is wrong with ``value``'s type."""
    if value is None:
        return "is not allowed"
    name = type(value).__name__
    return f"is {'an' if name[0] in 'aeiouAEIOU' else 'a'} {name}"


def _scaled(text: str) -> float | None:
    """The bytes ``"1MiB"``, ``"4 KiB"``, ``"1GB"`` or ``"4096"`` stand for, as a float; ``None`` if not a size."""
    match = _UNIT.match(text)
    if not match:
        return None
    number, prefix, binary = match.groups()
    return float(number) * (1024 if binary else 1000) ** " kmgt".index(prefix.lower() or " ")


def _bytes_in(text: str) -> int | None:
    """The bytes ``text`` stands for when they are whole (only to say which int to write)."""
    value = _scaled(text)
    return int(value) if value is not None and value.is_integer() else None


class Problems:
    """The problems found in the arguments of one call, reported together by :meth:`raise_if_any`.

    Each check takes the argument's name and value, adds a line if the value is wrong and returns whether it is
    right, so later checks that need a valid value can be skipped.

    Args:
        owner: what was called, shown in the error's first line (``"SmartInfinityStrategy"``).
        error: the exception type :meth:`raise_if_any` raises.

    Example::

        >>> problems = Problems("BufferPool")
        >>> problems.integer("buffer_count", True, low=2, example=16)
        False
        >>> problems.integer("chunk_size", 4096, low=1024, multiple=1024)
        True
        >>> print(problems.message())
        `BufferPool` got 1 invalid argument:
        - `buffer_count=True` is a bool, not a count: it must be an int >= 2. Pass e.g. `buffer_count=16`.
    """

    def __init__(self, owner: str, error: type[Exception] = ValueError) -> None:
        self.owner = owner
        self.error = error
        self.lines: list[str] = []
        self._prefix = ""

    def within(self, argument: str) -> Problems:
        """Checks of the keys of dict argument ``argument``, named ``argument['key']``, adding to the same list."""
        child = Problems(self.owner, self.error)
        child.lines = self.lines
        child._prefix = self.name(argument)
        return child

    def name(self, key: str | int) -> str:
        """How argument (or key) ``key`` is shown: ``key``, or ``argument['key']`` inside :meth:`within`."""
        return f"{self._prefix}[{key!r}]" if self._prefix else str(key)

    def add(self, line: str) -> None:
        """Record one problem: one line naming the argument and value, what is allowed and the fix."""
        self.lines.append(line)

    def __len__(self) -> int:
        return len(self.lines)

    def message(self) -> str:
        count = len(self.lines)
        header = f"`{self.owner}` got {count} invalid argument{'s' if count != 1 else ''}:"
        return "\n- ".join([header, *self.lines])

    def raise_if_any(self) -> None:
        """Raise :attr:`error` listing every problem found, if there is one."""
        if self.lines:
            raise self.error(self.message())

    # ----------------------------------------------------------------------------------------------- checks

    def integer(
        self,
        key: str | int,
        value: Any,
        *,
        low: int = 0,
        high: int = INT64_MAX,
        multiple: int = 1,
        unit: str = "",
        why: str = "",
        example: Any = _MISSING,
        optional: bool = False,
    ) -> bool:
        """An ``int`` (not ``bool``) in ``[low, high]`` and a multiple of ``multiple``; ``None`` if ``optional``.

        ``unit="bytes"`` marks a byte count: a string with units gets the number of bytes to write instead.
        ``example`` is the value the fix suggests (by default the valid value nearest to ``low``).
        """
        if value is None and optional:
            return True
        name = self.name(key)
        allowed = "an int" + (f" number of {unit}" if unit else "") + f" >= {low}"
        if high < INT64_MAX or (isinstance(value, int) and value > high):
            allowed += f" and <= {_bound(high)}"
        if multiple > 1:
            allowed += f", a multiple of {multiple}"
        allowed += f" ({why})" if why else ""
        allowed += ", or None" if optional else ""
        nearest = -(-low // multiple) * multiple
        if example is _MISSING:
            example = nearest
        fix = f"Pass e.g. `{name}={example!r}`."
        if isinstance(value, bool):
            wrong = f"is a bool, not {'a number of ' + unit if unit else 'a count'}"
        elif isinstance(value, int):
            if low <= value <= high and value % multiple == 0:
                return True
            if value < low:
                wrong, fix = "is too small", f"Pass `{name}={nearest}` or more."
            elif value > high:
                wrong = "is too large"
            else:
                wrong = f"is not a multiple of {multiple}"
                below = value // multiple * multiple
                fix = f"Pass `{name}={below if below >= low else nearest}`."
        elif isinstance(value, float) and value.is_integer() and self._fits(value, low, high, multiple):
            wrong, fix = "is a float", f"Pass the int `{name}={int(value)}`."
        elif isinstance(value, numbers.Integral) and self._fits(int(value), low, high, multiple):  # numpy's integers
            wrong, fix = _wrong_type(value), f"Pass the Python int `{name}={int(value)}` (`int(...)` converts it)."
        elif isinstance(value, str):
            wrong = "is a str"
            digits = value.strip().isascii() and value.strip().isdigit()
            parsed = _bytes_in(value) if unit == "bytes" else (int(value) if digits else None)
            if parsed is not None and unit == "bytes" and not digits:
                fix = f"Write the bytes as an int: `{name}={parsed}` for {value!r} (units are not parsed)."
            elif parsed is not None:
                fix = f"Pass the int `{name}={parsed}`, without quotes."
        else:
            wrong = _wrong_type(value)
        self.add(f"`{name}={show(value)}` {wrong}: it must be {allowed}. {fix}")
        return False

    def size(
        self, key: str | int, value: Any, *, low: int = 0, example: str = "8GiB", optional: bool = True
    ) -> int | None:
        """A memory size: an int number of bytes >= ``low``, or a string with a unit (``"8GiB"``, ``"512MiB"``,
        ``"2GB"``, ``"4096"``) of at least ``low`` bytes once rounded down; returns the bytes, or ``None`` (``value``
        is ``None`` and ``optional``, or a line was added)."""
        if value is None and optional:
            return None
        if isinstance(value, str):
            scaled = _scaled(value)  # the bytes, rounded down below
            if scaled is not None and scaled <= INT64_MAX and int(scaled) >= low:
                return int(scaled)
            wrong = "is not a size" if scaled is None else "is too large" if scaled > INT64_MAX else "is too small"
            self.add(
                f"`{self.name(key)}={show(value)}` {wrong}: it must "
                f"be an int number of bytes >= {low} or a string like '8GiB' (2**30 B), '512MiB' or '2GB' (10**9 B). "
                f"Pass e.g. `{self.name(key)}={example!r}`."
            )
            return None
        if self.integer(key, value, low=low, unit="bytes", example=example, optional=optional):
            return value
        return None

    @staticmethod
    def _fits(value: float, low: int, high: int, multiple: int) -> bool:
        return low <= value <= high and value % multiple == 0

    def number(
        self,
        key: str | int,
        value: Any,
        *,
        low: float | None = None,
        high: float | None = None,
        above: bool = False,
        unit: str = "",
        why: str = "",
        example: Any = None,
        optional: bool = False,
        allowed: str = "",
    ) -> bool:
        """A finite ``int`` or ``float`` (not ``bool``) >= ``low`` (> ``low`` if ``above``) and <= ``high``.

        ``allowed`` replaces the description of the allowed values that is otherwise made from the bounds.
        """
        if value is None and optional:
            return True
        name = self.name(key)
        if not allowed:
            bounds = []
            if low is not None:
                bounds.append(f"{'>' if above else '>='} {low}")
            if high is not None:
                bounds.append(f"<= {_bound(high) if isinstance(high, int) else high}")
            allowed = "a finite number" + (f" of {unit}" if unit else "") + "".join(f" {b}" for b in bounds[:1])
            allowed += "".join(f" and {b}" for b in bounds[1:])
        allowed += f" ({why})" if why else ""
        allowed += ", or None" if optional else ""
        fix = f"Pass e.g. `{name}={example!r}`." if example is not None else ""
        if isinstance(value, bool):
            wrong = "is a bool, not a number"
        elif isinstance(value, (int, float)):
            if isinstance(value, float) and not math.isfinite(value):  # (an int may be too large for a float)
                wrong = "is not finite"
            elif (low is not None and (value <= low if above else value < low)) or (high is not None and value > high):
                wrong = "is out of range"
            else:
                return True
        elif isinstance(value, str):
            wrong = "is a str"
            with contextlib.suppress(ValueError):
                if math.isfinite(float(value)):
                    fix = f"Pass the number `{name}={float(value)!r}`, without quotes."
        else:
            wrong = _wrong_type(value)
        self.add(f"`{name}={show(value)}` {wrong}: it must be {allowed}. {fix}".rstrip())
        return False

    def ratio(self, key: str | int, value: Any, *, example: float = 0.01) -> bool:
        """A kept ratio of gradient compression: a number with ``0 < ratio <= 1``."""
        return self.number(
            key,
            value,
            low=0,
            high=1,
            above=True,
            example=example,
            allowed="a number with 0 < ratio <= 1 (0.01 sends the largest 1% of gradient entries; 1.0 sends all)",
        )

    def flag(self, key: str | int, value: Any) -> bool:
        """``True`` or ``False``."""
        if isinstance(value, bool):
            return True
        name = self.name(key)
        self.add(
            f"`{name}={show(value)}` {_wrong_type(value)}: it must be True or False. Pass `{name}=True` or "
            f"`{name}=False`."
        )
        return False

    def choice(self, key: str | int, value: Any, choices: Collection[Any]) -> bool:
        """One of ``choices``."""
        if isinstance(value, (str, int, float, type(None))) and value in choices:
            return True
        self.add(
            f"`{self.name(key)}={show(value)}` is not supported: it must be one of: {', '.join(map(repr, choices))}."
        )
        return False

    def instance(
        self, key: str | int, value: Any, types: type | tuple[type, ...], allowed: str, *, fix: str = ""
    ) -> bool:
        """An instance of ``types``, described to the user as ``allowed``."""
        if isinstance(value, types):
            return True
        self.add(f"`{self.name(key)}={show(value)}` {_wrong_type(value)}: it must be {allowed}. {fix}".rstrip())
        return False

    def keys(self, key: str, value: Mapping, allowed: Iterable[str], *, required: Iterable[str] = ()) -> bool:
        """Only string keys of ``allowed``, and every key of ``required``."""
        allowed = list(allowed)
        unknown = [k for k in value if k not in allowed]
        missing = [k for k in required if k not in value]
        name = self.name(key)
        if unknown:
            self.add(
                f"`{name}` has unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(show, unknown))}: "
                f"the allowed keys are {', '.join(map(repr, allowed))}. Remove or rename "
                f"{'them' if len(unknown) > 1 else 'it'}."
            )
        if missing:
            self.add(
                f"`{name}` lacks the key{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}: "
                f"{'they are' if len(missing) > 1 else 'it is'} required. Add {'them' if len(missing) > 1 else 'it'}."
            )
        return not unknown and not missing

    def path(self, key: str | int, value: Any, *, optional: bool = False) -> bool:
        """A non-empty ``str`` or ``os.PathLike`` (not checked on disk); ``None`` if ``optional``."""
        return self._path(self.name(key), value, optional)

    def paths(self, key: str, value: Any, *, optional: bool = False) -> list[Any] | None:
        """One path or a non-empty list or tuple of them, as a list; ``None`` if wrong (or ``None`` and optional)."""
        if value is None and optional:
            return None
        name = self.name(key)
        if isinstance(value, (str, os.PathLike)):
            value = [value]
        if not isinstance(value, (list, tuple)) or not value:
            kind = "is empty" if isinstance(value, (list, tuple)) else _wrong_type(value)
            self.add(
                f"`{name}={show(value)}` {kind}: it must be a directory or a non-empty list of directories"
                f"{', or None' if optional else ''}."
            )
            return None
        valid = [self._path(f"{name}[{index}]", entry, False) for index, entry in enumerate(value)]
        return list(value) if all(valid) else None

    def _path(self, name: str, value: Any, optional: bool) -> bool:
        if (value is None and optional) or isinstance(value, os.PathLike) or (isinstance(value, str) and value):
            return True
        allowed = "a non-empty path (str or pathlib.Path)" + (", or None" if optional else "")
        self.add(f"`{name}={show(value)}` is not a path: it must be {allowed}.")
        return False

    def fits_in_memory(self, what: str, needed: int, detail: str, fix: str) -> bool:
        """``needed`` bytes of host memory fit in what is available now (``psutil.virtual_memory().available``).

        The problem reads: "{what} needs N MiB of host memory ({detail}), M MiB available. {fix}".
        """
        available = psutil.virtual_memory().available
        if needed <= available:
            return True
        self.add(
            f"{what} needs {needed / MIB:.0f} MiB of host memory ({detail}), {available / MIB:.0f} MiB available. {fix}"
        )
        return False
