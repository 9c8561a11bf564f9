"""Arithmetic of folded documents and head–tail bands (the vocabulary of :mod:`scheduler.planner`).

A document of ``l`` tokens is folded: folded position ``f`` stands for the head token ``f`` and its
mirror ``l - 1 - f``; a band ``[a, b)`` of folded positions is a head shard and a tail shard. These
are the planner's inner-loop counts, in Python ints; :mod:`scheduler.cost` defines the pairs they
count.
"""

from __future__ import annotations

import numpy as np


def prefix_pairs(x: int, window: int) -> int:
    """Pairs of the tokens ``[0, x)`` of a document under ``window``: ``doc_pairs(x, window)``
    in Python ints (the planner's inner loop; :func:`scheduler.cost.doc_pairs` defines it)."""
    return x * (x + 1) // 2 if x <= window else window * (window + 1) // 2 + (x - window) * window


def folded_pairs(l: int, f: int, window: int) -> int:
    """Pairs of folded positions ``[0, f)`` of a document of ``l > window`` tokens: heads
    ``[0, f)`` and tails ``[l - f, l)`` (the centre counted once)."""
    return prefix_pairs(f, window) + prefix_pairs(l, window) - prefix_pairs(max(l - f, f), window)


def band_kv_rows(l: int, a: int, b: int, window: int | None) -> int:
    """KV rows band ``[a, b)`` of a document of ``l`` tokens needs: the union of its head's and
    its tail's key ranges, ``[max(0, a - W + 1), b)`` and ``[max(0, l - b - W + 1), l - a)``
    (with no window, the prefix ``[0, l - a)``)."""
    if window is None:
        return l - a
    h0, t0 = max(0, a - window + 1), max(0, l - b - window + 1)
    return l - a - h0 if b >= t0 else (b - h0) + (l - a - t0)


def band_kv_rows_array(l, a, b, window: int):
    """:func:`band_kv_rows` of int64 arrays (one shape) under a window (the time refinement of
    :mod:`scheduler.time_refine` prices many moves at once)."""
    h0, t0 = np.maximum(0, a - window + 1), np.maximum(0, l - b - window + 1)
    return np.where(b >= t0, l - a - h0, (b - h0) + (l - a - t0))


def band_shards(l: int, a: int, b: int) -> list[tuple[int, int]]:
    """Query shards of band [a, b): one merged shard at the centre, else head and tail."""
    t0 = max(l - b, b)
    if t0 == b:
        return [(a, l - a)]
    return [(a, b), (t0, l - a)]


def finishable(rest: int, keep: int, fits: int, ms: int) -> bool:
    """Whether ``rest`` folded positions of a band can end placed: the source keeping up to
    ``keep`` (0 or >= ms) and the others going in pieces of ``ms`` to ``fits`` positions."""
    if rest == 0 or ms <= rest <= keep:
        return True
    if rest < ms:
        return False
    shed = rest - keep
    p = -(-shed // fits)
    if p * ms <= shed or rest - p * ms >= ms:  # as cut, or with the source keeping less
        return True
    return -(-rest // fits) * ms <= rest  # the source keeping none

