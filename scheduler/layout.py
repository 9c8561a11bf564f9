"""The all-to-all layout a plan implies: which local rows each client sends to each server, and
how a server lays its received rows out for one fused varlen kernel call.

Pure numpy, derived from :class:`~scheduler.tasks.Plan` alone, so every participant computes the
same layout from the same descriptor and no sizes need to be exchanged.

Wire order, per (client rank ``r``, server ``s``) message: the Q rows of ``r``'s tasks on ``s`` in
task order, then the deduplicated KV rows of each of ``r``'s documents on ``s`` (the union of its
tasks' key ranges there, :mod:`scheduler.kv`), documents in index order. A server concatenates the messages of ranks ``0..R-1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .kv import kv_intervals
from .tasks import Plan


def concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + n) for s, n in zip(starts, lengths)])`` without a Python loop.

    Returns int64 [sum(lengths)].
    """
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(total, dtype=np.int64)


@dataclass(frozen=True)
class ClientLayout:
    """What client rank ``rank`` sends to and receives from each server.

    ``q_index[s]`` / ``kv_index[s]``: int64 arrays of local row indices (into the rank's packed
    ``[total_tokens, ...]`` tensors) of the Q rows and the deduplicated KV rows for server ``s``,
    in wire order. Every local row appears in exactly one ``q_index[s]``.
    """

    rank: int
    q_index: list[np.ndarray]
    kv_index: list[np.ndarray]

    @property
    def q_rows(self) -> list[int]:
        return [len(x) for x in self.q_index]

    @property
    def kv_rows(self) -> list[int]:
        return [len(x) for x in self.kv_index]


@dataclass(frozen=True)
class ServerLayout:
    """How server ``server`` receives rows and feeds them to one fused varlen kernel call.

    Attributes:
        q_rows, kv_rows: rows received from each client rank (lists of length ``num_ranks``).
        cu_seqlens_q, cu_seqlens_k: int64 [num_tasks + 1]: one varlen sequence per CA-task, in
            task order; queries are the received Q rows in order, keys the gathered KV rows.
        max_seqlen_q, max_seqlen_k: longest task query and key lengths (0 with no tasks).
        kv_gather: int64 [cu_seqlens_k[-1]] indices into the received (deduplicated) KV rows that
            build each task's key range, or None when that is the identity (no two tasks share KV).
        diagonals: int64 [num_tasks] each task's ``q_start - kv_start`` (the kernels' per-sequence
            diagonal) when some task's keys do not end where its queries end (partial-KV tasks),
            else None (every task bottom-right aligned).
    """

    server: int
    q_rows: list[int]
    kv_rows: list[int]
    cu_seqlens_q: np.ndarray
    cu_seqlens_k: np.ndarray
    max_seqlen_q: int
    max_seqlen_k: int
    kv_gather: np.ndarray | None
    diagonals: np.ndarray | None = None

    @property
    def num_tasks(self) -> int:
        return len(self.cu_seqlens_q) - 1


def client_layout(plan: Plan, rank: int) -> ClientLayout:
    """The send/receive row indices of client ``rank`` of ``plan`` (see :class:`ClientLayout`)."""
    if not 0 <= rank < plan.num_ranks:
        raise ValueError(f"rank {rank} out of range [0, {plan.num_ranks})")
    arr = plan.task_array
    return client_layout_from(plan.doc_lens_per_rank[rank], arr[arr[:, 1] == rank],
                              plan.num_servers, rank)


def client_layout_from(doc_lens, tasks: np.ndarray, num_servers: int, rank: int) -> ClientLayout:
    """Client layout from the rank's document lengths and its tasks (int64 [n, 7] rows of
    ``Plan.task_array`` with ``src_rank == rank``, sorted), e.g. a :class:`~scheduler.parts.PlanPart`."""
    doc_start = np.concatenate([[0], np.cumsum(doc_lens)]).astype(np.int64)
    q_index, kv_index = [], []
    bounds = np.searchsorted(tasks[:, 0], np.arange(num_servers + 1))
    kv = kv_intervals(tasks)
    iv_server = tasks[kv.first[kv.group], 0] if len(tasks) else kv.group
    iv_rows = doc_start[tasks[kv.first[kv.group], 2]] + kv.start if len(tasks) else kv.start
    iv_bounds = np.searchsorted(iv_server, np.arange(num_servers + 1))
    for s in range(num_servers):
        t = tasks[bounds[s]:bounds[s + 1]]
        q_index.append(concat_ranges(doc_start[t[:, 2]] + t[:, 3], t[:, 4] - t[:, 3]))
        i0, i1 = iv_bounds[s], iv_bounds[s + 1]
        kv_index.append(concat_ranges(iv_rows[i0:i1], kv.lengths[i0:i1]))
    return ClientLayout(rank=rank, q_index=q_index, kv_index=kv_index)


def server_layout(plan: Plan, server: int) -> ServerLayout:
    """The receive and fused-kernel layout of ``server`` of ``plan`` (see :class:`ServerLayout`)."""
    if not 0 <= server < plan.num_servers:
        raise ValueError(f"server {server} out of range [0, {plan.num_servers})")
    arr = plan.task_array
    return server_layout_from(arr[arr[:, 0] == server], plan.num_ranks, server)


def server_layout_from(t: np.ndarray, num_ranks: int, server: int) -> ServerLayout:
    """Server layout from the server's tasks (int64 [m, 7] rows of ``Plan.task_array``, sorted)."""
    q_len = t[:, 4] - t[:, 3]
    kv_len = t[:, 6] - t[:, 5]
    kv = kv_intervals(t)
    q_rows = np.bincount(t[:, 1], weights=q_len, minlength=num_ranks).astype(np.int64)
    iv_rank = t[kv.first[kv.group], 1] if len(t) else kv.group
    kv_rows = np.bincount(iv_rank, weights=kv.lengths, minlength=num_ranks).astype(np.int64)
    # Received KV rows are each group's key intervals in order, groups in task order (ranks arrive
    # in order), so a task's keys start at its place in that concatenation.
    shared = len(kv.first) != len(t)
    kv_gather = concat_ranges(kv.task_pos, kv_len) if shared else None
    cu_q = np.concatenate([[0], np.cumsum(q_len)]).astype(np.int64)
    cu_k = np.concatenate([[0], np.cumsum(kv_len)]).astype(np.int64)
    return ServerLayout(
        server=server, q_rows=q_rows.tolist(), kv_rows=kv_rows.tolist(),
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        max_seqlen_q=int(q_len.max()) if len(t) else 0,
        max_seqlen_k=int(kv_len.max()) if len(t) else 0,
        kv_gather=kv_gather, diagonals=t[:, 3] - t[:, 5] if (t[:, 6] != t[:, 4]).any() else None)
