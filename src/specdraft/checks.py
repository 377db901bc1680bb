"""Checks and conversions the typed settings share (config.py, the drafters' options in registry.py): light, no
torch."""

from __future__ import annotations

import math
import numbers
import operator
import os

from .errors import SpecdraftError


def check_types(config: object, ints: tuple[str, ...] = (), numbers_: tuple[str, ...] = (),
                strings: tuple[str, ...] = (), optional: tuple[str, ...] = (), owner: str | None = None) -> None:
    """Python API callers pass values the CLI would have parsed: refuse a wrong type with a message that names the
    field, instead of a TypeError deep in torch (a bool is no number here; fields in `optional` may be None)."""
    def as_int(value):
        return operator.index(value)  # ints and numpy integers; not floats or strings

    def as_number(value):
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise TypeError
        return float(value) if not isinstance(value, int) else value

    def as_string(value):
        if not isinstance(value, str):
            raise TypeError
        return value

    for names, convert, kind in ((ints, as_int, "an integer"), (numbers_, as_number, "a finite number"),
                                 (strings, as_string, "a string")):
        for name in names:
            value = getattr(config, name)
            if value is None and name in optional:
                continue
            try:
                if isinstance(value, bool):  # an int to Python, but no count or rate (numpy's bool is neither)
                    raise TypeError
                object.__setattr__(config, name, convert(value))  # numpy scalars become Python ones
            except TypeError:
                raise SpecdraftError(f"{owner or type(config).__name__}.{name} must be {kind}"
                                     f"{' or None' if name in optional else ''}, got {value!r}") from None


def paths_to_str(config: object, *names: str) -> None:
    """A model, head or cache folder may be given as a pathlib.Path: kept as its string."""
    for name in names:
        if isinstance(getattr(config, name), os.PathLike):
            object.__setattr__(config, name, os.fspath(getattr(config, name)))


def auto_to_none(config: object, *names: str) -> None:
    """"auto", the CLI's and the server's spelling, means None (auto) in the Python API too."""
    for name in names:
        if getattr(config, name) == "auto":
            object.__setattr__(config, name, None)
