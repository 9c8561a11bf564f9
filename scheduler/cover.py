"""Which CA-task sets cover every (query, key) pair of a document's mask exactly once.

The mask of a document of ``l`` tokens: query ``i`` sees key ``j`` iff ``j <= i`` and, with a
window ``W``, ``j > i - W``. A task ``(q_start, q_end, kv_start, kv_end)`` computes the pairs of its
rectangle that lie in the mask. The accepted sets (the one rule of ``Plan`` and ``PlanPart``):

- *query shards* partition the document: the distinct ``[q_start, q_end)`` of its tasks tile
  ``[0, l)`` (two tasks' query ranges are equal or disjoint);
- the tasks of one shard tile the keys the shard needs, ``[max(0, q_start - W + 1), q_end)``
  (``[0, q_end)`` without a window): sorted by ``kv_start``, each starts where the previous ended.

Every pair is then covered exactly once (row ``i`` of the shard sees keys inside the shard's key
range, and each of those in exactly one task), and every task computes at least one pair (its first
key is visible to query ``max(q_start, kv_start)``). A *full-window* shard is the one-task case;
a shard with several tasks is *split on the key axis* (partial-KV tasks, merged by their LSEs).
Vectorised numpy, no Python loop over tasks.
"""

from __future__ import annotations

import numpy as np

from .cost import window_kv_start


def cover_problems(gid: np.ndarray, qs: np.ndarray, qe: np.ndarray, ks: np.ndarray, ke: np.ndarray,
                   lens: np.ndarray, window: int | None, min_shard: int = 1) -> tuple[list, np.ndarray]:
    """Why a task set does not cover its documents' masks exactly once.

    Args:
        gid: int64 [n] the document of each task (an index into ``lens``).
        qs, qe, ks, ke: int64 [n] each task's query and key range (document offsets), each
            already known to satisfy ``0 <= q_start < q_end <= l`` and ``0 <= kv_start < kv_end``.
        lens: int64 [num_docs] document lengths; documents without a task are reported.
        window: the mask's window (None: full causal).
        min_shard: the shortest query shard of a document cut into several, and the shortest key
            piece of a shard split on the key axis (1 allows any).

    Returns:
        ``(problems, docs)``: ``problems`` a list of ``(message, gids)`` pairs (empty when the set
        is valid), ``docs`` the documents that have at least one task (bool [num_docs]).
    """
    order = np.lexsort((ks, qs, gid))
    g, s, e, a, b = gid[order], qs[order], qe[order], ks[order], ke[order]
    n = len(g)
    problems = []
    covered = np.zeros(len(lens), dtype=bool)
    covered[g] = True
    if not covered.all():
        problems.append(("documents with no task", np.flatnonzero(~covered)))
    if n == 0:
        return problems, covered
    new_doc = np.ones(n, dtype=bool)
    new_doc[1:] = g[1:] != g[:-1]
    # A shard: the tasks of one document with one q_start, in kv_start order.
    new_shard = new_doc.copy()
    new_shard[1:] |= s[1:] != s[:-1]
    last_shard = np.ones(n, dtype=bool)
    last_shard[:-1] = new_shard[1:]
    last_doc = np.ones(n, dtype=bool)
    last_doc[:-1] = new_doc[1:]
    bad = ~new_shard & (e != np.roll(e, 1))
    if bad.any():
        problems.append(("documents with tasks whose query ranges overlap without being equal", g[bad]))
    # Shards tile [0, l): the first starts at 0, each starts where the previous shard ended.
    starts = np.flatnonzero(new_shard)
    sg, ss, se = g[starts], s[starts], e[starts]
    first = np.ones(len(starts), dtype=bool)
    first[1:] = sg[1:] != sg[:-1]
    if (ss[first] != 0).any():
        problems.append(("documents whose first shard does not start at 0", sg[first][ss[first] != 0]))
    gap = ~first & (ss != np.roll(se, 1))
    if gap.any():
        problems.append(("documents with overlapping or missing rows between shards", sg[gap]))
    end = np.ones(len(starts), dtype=bool)
    end[:-1] = first[1:]
    if (se[end] != lens[sg[end]]).any():
        problems.append(("documents whose shards stop before the end", sg[end][se[end] != lens[sg[end]]]))
    # Keys of each shard tile [max(0, q_start - W + 1), q_end).
    lo = window_kv_start(s, window)
    bad = (new_shard & (a != lo)) | (~new_shard & (a != np.roll(b, 1))) | (last_shard & (b != e))
    if bad.any():
        problems.append((f"documents with a shard whose tasks do not tile its keys [max(0, q_start - "
                         f"window + 1), q_end) (window={window}) exactly once", g[bad]))
    if min_shard > 1:
        split_doc = np.zeros(len(lens), dtype=bool)
        split_doc[sg[~first]] = True
        short = split_doc[g] & (e - s < min_shard)
        split_keys = ~(new_shard & last_shard)
        short |= split_keys & (b - a < min_shard)
        if short.any():
            problems.append((f"documents split into shards or key pieces shorter than min_shard={min_shard}",
                             g[short]))
    return problems, covered


__all__ = ["cover_problems"]
