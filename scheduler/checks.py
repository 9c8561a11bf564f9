"""Argument checks shared by the scheduler and the client shim.

One definition of "an integer" (Python or numpy, never ``bool``) and "a number", and the
range checks built on them. Every failure is a ``ValueError`` whose message names the argument
and shows the offending value. Pure Python + numpy.
"""

from __future__ import annotations

import math

import numpy as np

INT64_MAX = 2**63 - 1


def is_int(x) -> bool:
    """True for Python and numpy integers; False for ``bool`` (a flag is not a count)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def is_number(x) -> bool:
    """True for Python and numpy ints and floats; False for ``bool``."""
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def int_in_range(name: str, value, lo: int, hi: int = INT64_MAX) -> int:
    """``value`` as a Python int if it is an integer in ``[lo, hi]``.

    Raises:
        ValueError: ``"<name> must be an int in [lo, hi], got <value>"``.
    """
    if not is_int(value) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an int in [{lo}, {hi}], got {value!r}")
    return int(value)


def positive_int(name: str, value) -> int:
    """``value`` as a Python int if it is an integer >= 1.

    Raises:
        ValueError: ``"<name> must be a positive int, got <value>"``.
    """
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def at_least(name: str, value, lo: int = 1) -> int:
    """``value`` as a Python int if it is an integer >= ``lo``.

    Raises:
        ValueError: ``"<name> must be an int >= lo, got <value>"``.
    """
    if not is_int(value) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
    return int(value)


def nonnegative_int(name: str, value) -> int:
    """``value`` as a Python int if it is an integer >= 0."""
    return at_least(name, value, 0)


def finite_nonnegative(name: str, value) -> float:
    """``value`` as a float if it is a finite number >= 0 (an ε, a duration).

    Raises:
        ValueError: ``"<name> must be a finite number >= 0, got <value>"``.
    """
    if not is_number(value) or not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def bad_lengths(lengths) -> list:
    """The entries of ``lengths`` that are not token counts (ints in ``[1, 2**63 - 1]``), in order."""
    # Fast path in C (map/min/max) for the common all-plain-int list: planning checks every
    # document of the batch, ~10^4 of them at 1024 ranks.
    if not lengths or (set(map(type, lengths)) == {int} and min(lengths) > 0 and max(lengths) <= INT64_MAX):
        return []
    return [x for x in lengths if not is_int(x) or not 0 < x <= INT64_MAX]


__all__ = ["INT64_MAX", "bad_lengths", "finite_nonnegative", "int_in_range", "is_int", "is_number",
           "positive_int"]
