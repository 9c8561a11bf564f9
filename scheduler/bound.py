"""A lower bound on the most loaded attention server of any plan of a batch.

Loads are in causal (query, key) pairs; FLOPs are a constant multiple (``CostModel.flops_per_pair``).

The plans counted are those :func:`~scheduler.plan_batch` can make: a document of ``l`` tokens
is *folded* into ``c = ceil(l / 2)`` positions (position ``f`` is head token ``f`` plus tail token
``l - 1 - f``; the centre alone when ``l`` is odd), and a split document is cut into head–tail
bands of at least ``min_shard`` folded positions each; a document with ``c < 2 · min_shard`` is
never split. Every folded position carries ``l + 1`` pairs, except the centre of an odd document,
which carries ``(l + 1) / 2``: in *half-units* of ``(l + 1) / 2`` pairs a document holds ``l`` of
them, an even count in every piece except the one holding the centre.

The bound is the largest of three facts about every such plan:

1. **Mean.** Some server holds at least ``total / num_servers`` pairs.
2. **Largest piece.** A document can be cut into at most ``K = min(num_servers, c // min_shard)``
   pieces (one per server that holds part of it; ``K = 1`` when it cannot be split), so one of
   them holds at least ``ceil`` of its half-units over ``K``, rounded up to what the parity rule
   allows: with ``c = q·K + r``, the most loaded piece holds at least ``2·ceil(c / K)`` half-units
   when ``l`` is even, and when ``l`` is odd ``l`` of them if ``K = 1``, else ``2q`` (r = 0),
   ``2q + 1`` (r = 1: the centre piece is the one with the extra position) or ``2q + 2``
   (r ≥ 2: at most one of the ``r`` longer pieces holds the centre). This *piece bound*
   ``m_d = h · (l + 1) / 2`` is reached by cutting the document evenly, so it is exact for a
   document alone. The bound takes the largest over documents.
3. **Shared servers.** Sort the documents by ``m_d``, largest first: ``m_1 ≥ m_2 ≥ …``. Each
   document puts a piece of at least ``m_d`` on some server, so the first ``k·S + 1`` documents put
   ``k·S + 1`` such pieces on ``S`` servers and one server holds ``k + 1`` of them: at least the
   sum of the ``k + 1`` smallest, ``m_{kS-k+1} + … + m_{kS+1}``, for every ``k ≥ 1`` (``k = 1``
   is the classic ``p_S + p_{S+1}`` bound of multiprocessor scheduling).

**Windows.** With sliding-window attention (window ``W``) a document with ``l <= W`` costs the same
as without one. A longer one costs ``W (W + 1) / 2 + (l - W) W`` pairs (:func:`scheduler.cost.doc_pairs`)
spread unevenly over its folded positions (the first ``W - 1`` tokens see fewer keys), so its piece
bound is the plain average ``ceil(pairs / K)`` over the ``K`` pieces it can be cut into: one of them
holds at least that. Facts 1 and 3 hold as stated with these pairs and pieces.

So no plan of the batch has a server below ``max(mean, largest piece, shared)``. It is no more
than a bound: deciding the best plan exactly is NP-hard (two servers and unsplittable documents
is the partition problem), so the best achievable maximum can be above it.

Pure Python + numpy; exact Python ints (documents of any int64 length).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .cost import doc_pairs

# Below this length every product of the bound fits int64 exactly: (l + 1) · c < 2**62.
_INT64_SAFE_LEN = 2**31 - 1


class LoadBound(NamedTuple):
    """The lower bound of a batch, in causal pairs (see the module docstring).

    Attributes:
        total: pairs of the whole batch (a Python int).
        num_servers: servers the bound is for.
        piece: the largest piece bound ``max_d m_d`` (0 for an empty batch).
        shared: the shared-server bound (0 when there are no more documents than servers).
    """

    total: int
    num_servers: int
    piece: int
    shared: int

    @property
    def mean(self) -> float:
        """Pairs per server when perfectly balanced."""
        return self.total / self.num_servers

    @property
    def bound(self) -> int:
        """``max(piece, shared)``: the bound besides the mean."""
        return max(self.piece, self.shared)

    @property
    def level(self) -> float:
        """``max(mean, bound)``: no plan's most loaded server holds fewer pairs."""
        return max(self.mean, self.bound)

    def ratio(self) -> float:
        """``level / mean`` (1.0 for an empty batch): the best max/mean any plan could reach."""
        return self.level / self.mean if self.total else 1.0


def piece_halves(lens: np.ndarray, num_servers: int, min_shard: int) -> np.ndarray:
    """Half-units ``h`` of each document's piece bound (``m_d = h · (l + 1) / 2`` pairs).

    Args:
        lens: int64 [n] document lengths (tokens, > 0).
        num_servers, min_shard: the plan's servers and shortest shard (positive ints).

    Returns:
        int64 [n], ``0 < h <= l``.
    """
    lens = np.asarray(lens, dtype=np.int64)
    c = (lens + 1) >> 1
    k = _pieces(lens, num_servers, min_shard)
    q, r = np.divmod(c, k)
    # 2 ceil(c / K); an odd length has one half-unit less when r == 1 or K == 1 (module doc).
    odd = (lens & 1).astype(bool)
    return 2 * q + 2 * (r > 0) - (odd & ((r == 1) | (k == 1)))


def _pieces(lens: np.ndarray, num_servers: int, min_shard: int) -> np.ndarray:
    """``K``: the most pieces each document can be cut into (1 when it cannot be split)."""
    c = (lens + 1) >> 1
    k = np.minimum(num_servers, c // min_shard)
    k[c < 2 * min_shard] = 1
    return k


def piece_pairs(lens: np.ndarray, num_servers: int, min_shard: int, window: int | None = None) -> list[int]:
    """Each document's piece bound ``m_d`` in pairs, as exact Python ints."""
    lens = np.asarray(lens, dtype=np.int64)
    h = piece_halves(lens, num_servers, min_shard)
    k = _pieces(lens, num_servers, min_shard).tolist()
    out = [hh * (l + 1) // 2 for hh, l in zip(h.tolist(), lens.tolist())]
    if window is not None:
        out = [m if l <= window else -(-doc_pairs(l, window) // kk)
               for m, l, kk in zip(out, lens.tolist(), k)]
    return out


def load_bound(lens, num_servers: int, min_shard: int, window: int | None = None) -> LoadBound:
    """The lower bound on the most loaded server of any plan of a batch.

    Args:
        lens: every document's length (tokens, ints > 0), any order: an int64 array or a list.
        num_servers: attention servers (>= 1).
        min_shard: no shard of a split document is shorter (see :func:`~scheduler.plan_batch`).
        window: the sliding window of the attention (None: full causal).

    Returns:
        A :class:`LoadBound`. Computed with numpy in O(n log n); exact for any int64 lengths.
    """
    lens = np.asarray(lens, dtype=np.int64).reshape(-1)
    n, S = len(lens), int(num_servers)
    if n == 0:
        return LoadBound(0, S, 0, 0)
    longest = int(lens.max())
    if longest <= _INT64_SAFE_LEN and n * longest**2 < 2**62:  # every sum below fits int64
        pairs = doc_pairs(lens, window)
        total = int(pairs.sum())
        m = piece_halves(lens, S, min_shard) * (lens + 1) >> 1
        if window is not None:
            k = _pieces(lens, S, min_shard)
            m = np.where(lens <= window, m, -(-pairs // k))
        if n <= S:
            return LoadBound(total, S, int(m.max()), 0)
        m = np.sort(m)[::-1]
        prefix = np.concatenate([[0], np.cumsum(m)])
        ks = np.arange(1, (n - 1) // S + 1)
        return LoadBound(total, S, int(m[0]), int((prefix[ks * S + 1] - prefix[ks * S - ks]).max()))
    ls = lens.tolist()
    total = sum(doc_pairs(l, window) for l in ls)
    m = sorted(piece_pairs(lens, S, min_shard, window), reverse=True)
    shared = max((sum(m[k * S - k:k * S + 1]) for k in range(1, (n - 1) // S + 1)), default=0)
    return LoadBound(total, S, m[0], shared)


__all__ = ["LoadBound", "load_bound", "piece_halves", "piece_pairs"]
