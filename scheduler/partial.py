"""Partial-KV moves: split a query shard's keys over servers (``plan_batch(..., partial_kv=True)``).

The greedy of :mod:`scheduler.planner` moves whole head–tail bands; a band is cut in whole folded
positions of at least ``min_shard`` and takes its KV prefix along. Two things it cannot do are
done here, on its finished task array, by cutting a task's *past block* (keys
``[kv_start, q_start)``, which every query of the shard sees, so a block of ``p`` keys holds exactly
``q_len · p`` pairs) off into a task of its own on another server:

1. **Balance.** A server still above the target gives the least-loaded server a past block of
   exactly the pairs it is over (rounded up to whole keys, at least ``min_shard``), as long as that
   fits under the target there. Loads only move from above the target to below it, so the most
   loaded server never gets worse.
2. **Memory.** A server whose received KV rows exceed ``max_kv_rows_per_server`` gives past
   blocks to the servers with the most KV room (and, among those, the least load) until it fits;
   this may raise the receiver's load (memory first).

The source keeps the shard's queries and its other keys, so its partial output and the moved
block's merge exactly on the query's owner (:class:`distca_server.rowsum.PartialMerge`). Only
without a window (a windowed shard's past keys are not all visible to every query). Each cut is
O(log S) plus the source's tasks scanned once: near-linear overall.
"""

from __future__ import annotations

import heapq

import numpy as np

from .cost import causal_pairs
from .kv import kv_intervals


def _server_pairs(arr: np.ndarray, num_servers: int) -> list[int]:
    """Pairs per server, exact Python ints (int64 sums when they cannot wrap)."""
    if len(arr) == 0:
        return [0] * num_servers
    if int(arr[:, 4].max()) < 2**31 and len(arr) * int(arr[:, 4].max()) ** 2 < 2**62:
        return _sum_by(arr[:, 0], causal_pairs(arr[:, 3], arr[:, 4], arr[:, 5], arr[:, 6]), num_servers)
    out = [0] * num_servers
    for row in arr.tolist():
        out[row[0]] += causal_pairs(*row[3:7])
    return out


def _sum_by(keys: np.ndarray, values: np.ndarray, n: int) -> list[int]:
    out = np.zeros(n, dtype=np.int64)
    np.add.at(out, keys, values)
    return out.tolist()


def split_past_blocks(arr: np.ndarray, num_servers: int, target: float, min_shard: int,
                      max_kv_rows: int | None = None) -> np.ndarray:
    """The task array (int64 [n, 7], canonical order) with past blocks moved (module doc).

    Args:
        arr: a plan's task array without a window.
        num_servers: servers of the plan.
        target: the load (pairs) no server should exceed.
        min_shard: the smallest key block moved or left behind.
        max_kv_rows: the most KV rows a server may receive (None: no limit).

    Returns:
        A new task array in canonical order (the input when nothing moves).
    """
    loads = _server_pairs(arr, num_servers)
    if max(loads, default=0) <= target and max_kv_rows is None:
        return arr  # balanced and no memory budget: nothing to do (the common case)
    rows = [list(map(int, r)) for r in arr.tolist()]
    by_server: list[list[int]] = [[] for _ in range(num_servers)]
    for i, r in enumerate(rows):
        by_server[r[0]].append(i)
    # Where each shard's pieces are: (rank, doc, q_start) -> servers holding a piece.
    holders: dict[tuple, set] = {}
    for r in rows:
        holders.setdefault((r[1], r[2], r[3]), set()).add(r[0])
    moved = False

    def past(i):  # keys every query of task i sees: [kv_start, q_start)
        r = rows[i]
        return max(0, r[3] - r[5])

    def cut(i, dst, p):
        """Move keys [kv_start, kv_start + p) of task i (with its queries) to server dst."""
        nonlocal moved
        r = rows[i]
        q_len = r[4] - r[3]
        rows.append([dst, r[1], r[2], r[3], r[4], r[5], r[5] + p])
        by_server[dst].append(len(rows) - 1)
        r[5] += p
        loads[r[0]] -= q_len * p
        loads[dst] += q_len * p
        holders[(r[1], r[2], r[3])].add(dst)
        moved = True

    # 1. Balance: surplus servers, most loaded first, to the least-loaded server.
    heap = [(loads[s], s) for s in range(num_servers)]
    heapq.heapify(heap)
    for src in sorted(range(num_servers), key=lambda s: -loads[s]):
        if loads[src] <= target:
            break
        candidates = sorted(by_server[src], key=lambda i: -(rows[i][4] - rows[i][3]) * past(i))
        for i in candidates:
            while heap[0][0] != loads[heap[0][1]]:
                heapq.heapreplace(heap, (loads[heap[0][1]], heap[0][1]))
            dst = heap[0][1]
            r = rows[i]
            if dst == src or (r[1], r[2], r[3]) in holders and dst in holders[(r[1], r[2], r[3])]:
                continue
            q_len, avail = r[4] - r[3], past(i)
            need, room = loads[src] - target, target - loads[dst]
            p = -(-int(min(need, room)) // q_len)
            p = max(p, min_shard)
            if p * q_len > room or p > avail or (avail - p and r[6] - r[5] - p < min_shard):
                continue
            cut(i, dst, p)
            heapq.heapreplace(heap, (loads[dst], dst))
            if loads[src] <= target:
                break

    # 2. Memory: servers above the KV budget shed past blocks to the roomiest servers.
    if max_kv_rows is not None:
        def kv_of(s):  # exact: the union of the server's key ranges per document
            sub = np.asarray([rows[i] for i in by_server[s]], dtype=np.int64).reshape(-1, 7)
            sub = sub[np.lexsort((sub[:, 5], sub[:, 3], sub[:, 2], sub[:, 1]))]
            return int(kv_intervals(sub).lengths.sum())
        kv = [kv_of(s) for s in range(num_servers)]
        for src in range(num_servers):
            tried: set = set()
            while kv[src] > max_kv_rows:
                # The task with the most past keys not tried yet (a cut may need to repeat on it:
                # other tasks of the document may still need the keys, so the union shrinks late).
                left = [i for i in by_server[src] if i not in tried and past(i) >= min_shard]
                if not left:
                    break
                i = max(left, key=lambda i: (past(i), -i))
                r = rows[i]
                shard = (r[1], r[2], r[3])
                others = [s for s in range(num_servers) if s != src and s not in holders[shard]]
                dst = min(others, key=lambda s: (kv[s], loads[s], s)) if others else None
                # Keys src's other tasks of the document still need free nothing when moved: cut
                # past them, as much as src is over, within what the roomiest receiver can take.
                kept = max([rows[j][6] for j in by_server[src] if j != i and rows[j][1:3] == r[1:3]
                            and rows[j][5] <= r[5]], default=r[5])
                p = min(past(i), max(kept, r[5]) - r[5] + max(kv[src] - max_kv_rows, min_shard),
                        r[6] - r[5] - min_shard, max_kv_rows - kv[dst] if dst is not None else 0)
                if p < min_shard:
                    tried.add(i)
                    continue
                cut(i, dst, p)  # each cut takes >= min_shard past keys: the loop ends
                kv[src], kv[dst] = kv_of(src), kv_of(dst)
    if not moved:
        return arr
    out = np.asarray(rows, dtype=np.int64).reshape(-1, 7)
    return out[np.lexsort((out[:, 5], out[:, 3], out[:, 2], out[:, 1], out[:, 0]))]


__all__ = ["split_past_blocks"]
