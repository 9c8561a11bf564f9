"""Argument checks shared by the scheduler and the client shim, and the checks of a batch
(:func:`check_batch`) every plan's inputs pass.

One definition of "an integer" (Python or numpy, never ``bool``) and "a number", and the
range checks built on them. Every failure is a ``ValueError`` whose message names the argument
and shows the offending value. Pure Python + numpy.
"""

from __future__ import annotations

import math
from itertools import chain

import numpy as np

from .cost import CostModel

INT64_MAX = 2**63 - 1
MAX_SERVERS = 1 << 20
"""Most attention servers a plan may have: the bound its descriptor's receiver checks
(:meth:`~scheduler.tasks.Plan.from_msgpack`), so that no plan the planner makes is refused there."""


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
    """``value`` as a Python int if it is an integer in ``[1, INT64_MAX]`` (every count ends up
    in an int64 array or a descriptor's int64 field).

    Raises:
        ValueError: ``"<name> must be a positive int, got <value>"`` (``"... at most 2**63 - 1"``
            above it).
    """
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if value > INT64_MAX:
        raise ValueError(f"{name} must be a positive int at most 2**63 - 1, got {value!r}")
    return int(value)


def at_least(name: str, value, lo: int = 1) -> int:
    """``value`` as a Python int if it is an integer in ``[lo, INT64_MAX]`` (as :func:`positive_int`).

    Raises:
        ValueError: ``"<name> must be an int >= lo, got <value>"`` (``"... at most 2**63 - 1"``
            above it).
    """
    if not is_int(value) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
    if value > INT64_MAX:
        raise ValueError(f"{name} must be an int >= {lo} at most 2**63 - 1, got {value!r}")
    return int(value)


def nonnegative_int(name: str, value) -> int:
    """``value`` as a Python int if it is an integer >= 0."""
    return at_least(name, value, 0)


def finite_nonnegative(name: str, value) -> float:
    """``value`` as a float if it is a finite number >= 0 (an ε, a duration).

    Raises:
        ValueError: ``"<name> must be a finite number >= 0, got <value>"``.
    """
    if not is_number(value) or not (value >= 0 and is_finite_number(value)):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def finite_positive(name: str, value) -> float:
    """``value`` as a float if it is a finite number > 0 (a timeout).

    Raises:
        ValueError: ``"<name> must be a finite number > 0, got <value>"``.
    """
    if not is_number(value) or not (value > 0 and is_finite_number(value)):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def is_finite_number(value) -> bool:
    """Whether ``value`` is a number (:func:`is_number`) that is finite as a float: an int past
    float's range (10**400) is not, rather than an OverflowError."""
    try:
        return is_number(value) and math.isfinite(value)
    except OverflowError:
        return False


def boolean(name: str, value) -> bool:
    """``value`` if it is a bool (not 0 or 1, not None); else a ``ValueError`` naming ``name``."""
    if type(value) is not bool:
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def bad_lengths(lengths) -> list:
    """The entries of ``lengths`` that are not token counts (ints in ``[1, 2**63 - 1]``), in order."""
    # Fast path in C (map/min/max) for the common all-plain-int list: planning checks every
    # document of the batch, ~10^4 of them at 1024 ranks.
    if not lengths or (set(map(type, lengths)) == {int} and min(lengths) > 0 and max(lengths) <= INT64_MAX):
        return []
    return [x for x in lengths if not is_int(x) or not 0 < x <= INT64_MAX]


__all__ = ["INT64_MAX", "MODES", "TRANSPORTS", "at_least", "bad_lengths", "boolean", "check_mode",
           "check_transport", "finite_nonnegative", "finite_positive", "int_in_range", "is_int", "is_number",
           "positive_int"]


MODES = ("inplace", "dedicated")  # where attention servers run: in the client ranks, or apart


def check_mode(mode) -> str:
    """``mode`` if it is one of :data:`MODES`.

    Raises:
        ValueError: ``"mode must be one of ('inplace', 'dedicated'), got <value>"``.
    """
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return mode


def check_batch(doc_lens_per_rank, num_servers, mode, cost, epsilon) -> tuple[np.ndarray, np.ndarray]:
    """The checks every plan's inputs pass, shared by :func:`~scheduler.plan_batch`, the baselines
    and :class:`Plan` itself.

    Returns:
        ``(doc_counts, doc_lens)``: int64 [num_ranks] documents per rank and int64 [num_docs] all
        lengths, rank after rank.

    Raises:
        ValueError: a mode other than :data:`MODES`; ``cost`` not a :class:`CostModel`;
            ``num_servers`` not an int in [1, :data:`MAX_SERVERS`]; ``epsilon`` not a finite
            number >= 0;
            ``doc_lens_per_rank`` not a non-empty list of lists of positive int64 lengths (the
            message names the rank and its first bad lengths), or a rank whose lengths sum past
            int64; in-place mode with ``num_servers != len(doc_lens_per_rank)``.
    """
    check_mode(mode)
    if not isinstance(cost, CostModel):
        raise ValueError(f"cost must be a CostModel, got {type(cost).__name__}")
    int_in_range("num_servers", num_servers, 1, MAX_SERVERS)
    finite_nonnegative("epsilon", epsilon)
    if not isinstance(doc_lens_per_rank, (list, tuple)) or not doc_lens_per_rank:
        raise ValueError("doc_lens_per_rank must be a non-empty list of per-rank length lists")
    if mode == "inplace" and num_servers != len(doc_lens_per_rank):
        raise ValueError(f"inplace mode needs one server per client rank: num_servers={num_servers}, "
                         f"ranks={len(doc_lens_per_rank)}")
    arrays = _fast_arrays(doc_lens_per_rank)
    if arrays is not None:
        return arrays
    for r, lens in enumerate(doc_lens_per_rank):  # slow path: find and name the bad rank
        if not isinstance(lens, (list, tuple)):
            raise ValueError(f"doc_lens_per_rank[{r}] must be a list of lengths, got "
                             f"{type(lens).__name__} {str(lens)[:80]}")
        bad = bad_lengths(lens)
        if bad:
            raise ValueError(f"rank {r}: document lengths must be positive ints, got {bad[:5]}")
    counts = np.fromiter(map(len, doc_lens_per_rank), dtype=np.int64, count=len(doc_lens_per_rank))
    lens = np.fromiter((int(x) for x in chain.from_iterable(doc_lens_per_rank)), dtype=np.int64,
                       count=int(counts.sum()))
    check_rank_totals(counts, lens)
    return counts, lens


def _fast_arrays(doc_lens_per_rank):
    """``(doc_counts, doc_lens)`` in a few C-speed passes when every rank is a list of plain or
    signed numpy ints in ``[1, 2**63 - 1]``, else None (the caller finds and names the problem)."""
    if not all(type(x) is list or type(x) is tuple for x in doc_lens_per_rank):
        return None
    types = set(map(type, chain.from_iterable(doc_lens_per_rank)))
    if not all(t is int or issubclass(t, np.signedinteger) for t in types):
        return None
    counts = np.fromiter(map(len, doc_lens_per_rank), dtype=np.int64, count=len(doc_lens_per_rank))
    try:
        lens = np.fromiter(chain.from_iterable(doc_lens_per_rank), dtype=np.int64, count=int(counts.sum()))
    except OverflowError:
        return None
    if len(lens) and int(lens.min()) < 1:
        return None
    check_rank_totals(counts, lens)
    return counts, lens


def check_rank_totals(counts: np.ndarray, lens: np.ndarray) -> None:
    """Every rank's tokens must fit int64 (rows are indexed with int64); vectorised."""
    nonempty = counts > 0
    if not nonempty.any() or float(lens.max()) * float(counts.max()) < 2.0**62:
        return
    starts = (np.cumsum(counts) - counts)[nonempty]
    approx = np.add.reduceat(lens.astype(np.float64), starts)
    for r, start in zip(np.flatnonzero(nonempty)[approx > 2.0**62].tolist(), starts[approx > 2.0**62].tolist()):
        total = sum(lens[start:start + counts[r]].tolist())
        if total > INT64_MAX:
            raise ValueError(f"rank {r}: documents of {total} tokens in all, more than int64 holds")


TRANSPORTS = ("torch_dist", "shm", "nvshmem")  # how a job's group epochs move tensors


def check_transport(transport) -> str:
    """``transport`` if it names one of :data:`TRANSPORTS`.

    Raises:
        ValueError: naming the value and the choices.
    """
    if not isinstance(transport, str) or transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    return transport
