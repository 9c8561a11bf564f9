"""The KV rows a server needs of each document: the union of its tasks' key ranges.

A server receives each document's KV rows once, however many of that document's CA-tasks it runs
("send each KV token to a server once"). With full-prefix tasks that is the longest prefix; with
windowed or partial-KV tasks the key ranges ``[kv_start, kv_end)`` of one document's tasks on one
server may be apart (a head shard's window and a tail shard's window), so a server receives the
*union* of them: disjoint intervals in increasing order, touching ones merged. Clients, servers and
``Plan.comm_bytes`` all derive the rows from :func:`kv_intervals`, so they agree by construction.

Pure numpy.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class KVIntervals(NamedTuple):
    """The merged key intervals of groups of tasks (one group: one server, rank and document).

    Attributes:
        first: int64 [G]: the first task row of each group.
        start, end: int64 [I]: each interval's keys ``[start, end)`` (document offsets), groups in
            task order, intervals of a group in increasing order.
        group: int64 [I]: the group each interval belongs to.
        task_pos: int64 [n]: where each task's ``kv_start`` lands in the concatenation of all
            intervals (its key range is contiguous there).
    """

    first: np.ndarray
    start: np.ndarray
    end: np.ndarray
    group: np.ndarray
    task_pos: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        return self.end - self.start


def kv_intervals(tasks: np.ndarray) -> KVIntervals:
    """Merge the key ranges of each group of ``tasks``.

    Args:
        tasks: int64 [n, 7] rows ``(server, src_rank, doc_index, q_start, q_end, kv_start,
            kv_end)`` in which each (server, src_rank, doc_index) group is contiguous (the order of
            ``Plan.task_array`` and of a part's task arrays).

    Returns:
        A :class:`KVIntervals`; O(n log n), no Python loop over tasks.
    """
    n = len(tasks)
    z = np.zeros(0, dtype=np.int64)
    if n == 0:
        return KVIntervals(z, z, z, z, z)
    new = np.ones(n, dtype=bool)
    new[1:] = (tasks[1:, :3] != tasks[:-1, :3]).any(axis=1)
    first = np.flatnonzero(new)
    group = np.cumsum(new) - 1
    ks, ke = tasks[:, 5], tasks[:, 6]
    order = np.lexsort((ks, group))
    g, s, e = group[order], ks[order], ke[order]
    # Running max of kv_end inside each group: offset every group above the one before, so one
    # cumulative max never crosses a group boundary.
    span = int(ke.max()) + 1
    if len(first) * span < 2**62:
        lifted = np.maximum.accumulate(e + g * span) - g * span
    else:  # keys near int64's limit: a plain loop is exact
        lifted = e.copy()
        for i in range(1, n):
            if g[i] == g[i - 1] and lifted[i - 1] > lifted[i]:
                lifted[i] = lifted[i - 1]
    opens = np.ones(n, dtype=bool)
    opens[1:] = (g[1:] != g[:-1]) | (s[1:] > lifted[:-1])
    heads = np.flatnonzero(opens)
    start = s[heads]
    end = np.maximum.reduceat(e, heads)
    interval = np.cumsum(opens) - 1
    base = np.cumsum(end - start) - (end - start)
    pos = np.empty(n, dtype=np.int64)
    pos[order] = base[interval] + s - start[interval]
    return KVIntervals(first, start, end, g[heads], pos)


__all__ = ["KVIntervals", "kv_intervals"]
