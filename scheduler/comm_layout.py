"""The communication layout of one participant, as data: what its part of a plan moves in each
round, worked out once from the part alone (pure numpy, no tensors).

Two layers, both fixed by the plan:

- :class:`PartRows` (:func:`part_rows`), independent of the round kind: the local rows a client
  gathers for each destination, the rows every peer sends and receives per row class (query, KV,
  and the query rows of split tasks), and the server's fused-kernel layout (``cu_seqlens_q/k``,
  ``max_seqlen``, :class:`~scheduler.layout.ServerLayout`).
- :class:`CommLayout` (:func:`comm_layout`), one per round kind and row format: per tensor and
  peer, the bytes sent and received in the dispatch and in the return exchange, and the offset at
  which each sender's bytes land in this participant's receive segments.

Participants (their copies and exchanges), the round header's claims (the bytes each pair of
participants must agree on) and every transport take their sizes from here; nothing else derives
them. Each participant builds its own from its own :class:`~scheduler.parts.PlanPart`, so the
scheduler's step does none of this work.

Receive segments (DESIGN "round"): per tensor, the own rank's rows first (an in-place server
gathers them itself: ``heads``), then the rows of participants ``0..P-1`` in order; the server's
kernel reads them where they land, in the order of its ``cu_seqlens``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import numpy as np

from .cost import KV_TENSORS, RoundKind, is_split
from .layout import ServerLayout, client_layout_from, concat_ranges, server_layout_from
from .parts import PlanPart

_EMPTY = np.zeros(0, dtype=np.int64)
Q, KV, SPLIT = 0, 1, 2
"""Row classes: query rows, (deduplicated) KV rows, query rows of split tasks (merged O, LSE)."""


def row_class(name: str, merged: tuple[str, ...] = ()) -> int:
    """The row class of tensor ``name`` in a round that sends ``merged`` for split rows only."""
    return KV if name in KV_TENSORS else SPLIT if name in merged else Q


def _split_rows(tasks: np.ndarray, window, row_start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(split, rows)``: bool [n] which of ``tasks`` (int64 [n, 7] plan rows) are split, and
    int64 the query rows of the split ones, task by task: ``row_start[i] + arange(q_len)``."""
    if len(tasks) == 0:
        return np.zeros(0, dtype=bool), _EMPTY
    split = is_split(tasks[:, 3], tasks[:, 4], tasks[:, 5], tasks[:, 6], window)
    return split, concat_ranges(row_start[split], (tasks[:, 4] - tasks[:, 3])[split])


def _is_identity(index: np.ndarray, n: int) -> bool:
    return len(index) == n and bool((index == np.arange(n)).all())


@dataclass(frozen=True)
class PartRows:
    """The rows a participant's part moves, whatever the round kind.

    Row counts are int64 [3, P] (row class :data:`Q`, :data:`KV`, :data:`SPLIT` by participant;
    the own in-place partner's entry is 0: those rows never pass through a transport). Index
    arrays are int64 local rows of the client rank's packed ``[num_tokens, ...]`` tensors.

    Attributes:
        participant, rank, server, num_participants: the part's roles (rank or server None
            without that role).
        num_tokens: the client rank's tokens (0 without a client role).
        q_send, kv_send: query and KV rows for the other servers, server by server.
        q_own, kv_own: the rows for the own in-place server (empty otherwise).
        merged_rows: sorted local rows of the rank's split query shards (their merged O and LSE
            are kept from the forward round for a kept backward round).
        split_send, split_own: indices into ``merged_rows`` of the split rows for the other
            servers (server by server, task order) and for the own server.
        client_rows: rows the client role sends each participant (zeros without the role).
        results_home: every row goes to the own server in order: its results are the outputs.
        server_layout: the server role's fused-kernel layout (own rank's tasks first), or None.
        head_rows: int64 [3]: the own rank's rows the server role gathers itself.
        server_rows: rows the server role receives from each participant (zeros without it).
        split_pos, unsplit_pos: positions in the fused call of the query rows of split tasks
            and of the other tasks (server role; ``split_pos`` None with no split task).
        inputs_home: the own server receives nothing and its kernel reads the client's tensors.
    """

    participant: int
    rank: int | None
    server: int | None
    num_participants: int
    num_tokens: int
    q_send: np.ndarray
    kv_send: np.ndarray
    q_own: np.ndarray
    kv_own: np.ndarray
    merged_rows: np.ndarray
    split_send: np.ndarray
    split_own: np.ndarray
    client_rows: np.ndarray
    results_home: bool
    server_layout: ServerLayout | None
    head_rows: np.ndarray
    server_rows: np.ndarray
    split_pos: np.ndarray | None
    unsplit_pos: np.ndarray
    inputs_home: bool


def part_rows(part: PlanPart) -> PartRows:
    """The :class:`PartRows` of ``part`` (both roles of an in-place participant)."""
    P, S, R = part.num_participants, part.num_servers, part.num_ranks
    rank, server = part.rank, part.server
    own_server = server if rank is not None else None
    own_rank = rank if server is not None else None
    client_rows = np.zeros((3, P), dtype=np.int64)
    server_rows = np.zeros((3, P), dtype=np.int64)
    head_rows = np.zeros(3, dtype=np.int64)
    c = dict(num_tokens=0, q_send=_EMPTY, kv_send=_EMPTY, q_own=_EMPTY, kv_own=_EMPTY, merged_rows=_EMPTY,
             split_send=_EMPTY, split_own=_EMPTY, results_home=False)
    if rank is not None:
        lay = client_layout_from(part.doc_lens, part.client_tasks, S, rank)
        others = [s for s in range(S) if s != own_server]
        for s in others:
            p = part.server_participant(s)
            client_rows[Q, p], client_rows[KV, p] = len(lay.q_index[s]), len(lay.kv_index[s])
        c["num_tokens"] = part.num_tokens
        c["q_send"] = np.concatenate([lay.q_index[s] for s in others]) if others else _EMPTY
        c["kv_send"] = np.concatenate([lay.kv_index[s] for s in others]) if others else _EMPTY
        if own_server is not None:
            c["q_own"], c["kv_own"] = lay.q_index[own_server], lay.kv_index[own_server]
        # Split shards: the client keeps each split row's merged O and LSE once and sends each
        # server the rows of its split tasks there, in task order (indices into the kept rows).
        ct = part.client_tasks
        doc_start = np.concatenate([[0], np.cumsum(part.doc_lens)]).astype(np.int64)
        split, rows = _split_rows(ct, part.window, doc_start[ct[:, 2]] + ct[:, 3] if len(ct) else None)
        merged = np.unique(rows)
        by_server = np.repeat(ct[split, 0], ct[split, 4] - ct[split, 3])
        at = np.searchsorted(merged, rows)
        for s in others:
            client_rows[SPLIT, part.server_participant(s)] = int((by_server == s).sum())
        c["merged_rows"] = merged
        c["split_send"] = at[by_server != own_server] if own_server is not None else at
        c["split_own"] = at[by_server == own_server] if own_server is not None else _EMPTY
        c["results_home"] = (own_server is not None and not client_rows[Q].any()
                             and _is_identity(c["q_own"], c["num_tokens"])
                             and _is_identity(c["kv_own"], c["num_tokens"]))
    lay_s, split_pos, unsplit_pos = None, None, _EMPTY
    if server is not None:
        tasks = part.server_tasks
        if own_rank is not None:  # own rank's rows first: they are gathered, not received
            tasks = tasks[np.argsort(tasks[:, 1] != own_rank, kind="stable")]
        lay_s = server_layout_from(tasks, R, server)
        cu = lay_s.cu_seqlens_q
        split, pos = _split_rows(tasks, part.window, cu[:-1])
        split_pos = pos if len(pos) else None
        unsplit_pos = concat_ranges(cu[:-1][~split], np.diff(cu)[~split])
        per_rank = np.bincount(tasks[split, 1], weights=np.diff(cu)[split], minlength=R).astype(np.int64)
        for r in range(R):  # rank r is participant r
            if r != own_rank:
                server_rows[:, r] = lay_s.q_rows[r], lay_s.kv_rows[r], per_rank[r]
        if own_rank is not None:
            head_rows[:] = lay_s.q_rows[own_rank], lay_s.kv_rows[own_rank], per_rank[own_rank]
    inputs_home = bool(server is not None and rank is not None and c["results_home"] and not server_rows[Q].any())
    return PartRows(participant=part.participant, rank=rank, server=server, num_participants=P,
                    client_rows=client_rows, server_layout=lay_s, head_rows=head_rows, server_rows=server_rows,
                    split_pos=split_pos, unsplit_pos=unsplit_pos, inputs_home=inputs_home, **c)


@dataclass(frozen=True)
class CommLayout:
    """One participant's bytes in a round of one kind. Arrays are int64, one row per tensor
    (``names`` for the dispatch, ``back`` for the return) and one column per participant; a
    role the participant lacks has all zeros.

    Attributes:
        kind: the round kind.
        names: tensors dispatched, in wire order (the kind's, then ``merged``).
        merged: tensors sent for the query rows of split tasks only (a kept backward round).
        back: tensors returned.
        send_splits: [len(names), P] bytes the client role sends each participant.
        recv_splits: [len(names), P] bytes the server role receives from each participant.
        heads: [len(names)] bytes of the own rank's rows the server role gathers into the head
            of each receive segment.
        recv_offsets: [len(names), P] byte offset in this participant's receive segment of each
            tensor at which participant ``p``'s bytes land (after the head, senders in order).
        ret_send_splits: [len(back), P] bytes the server role returns to each participant.
        ret_recv_splits: [len(back), P] bytes the client role gets back from each participant.
        head_rows_back: [len(back)] rows of each returned tensor that stay with the own rank.
    """

    kind: RoundKind
    names: tuple[str, ...]
    merged: tuple[str, ...]
    back: tuple[str, ...]
    send_splits: np.ndarray
    recv_splits: np.ndarray
    heads: np.ndarray
    recv_offsets: np.ndarray
    ret_send_splits: np.ndarray
    ret_recv_splits: np.ndarray
    head_rows_back: np.ndarray

    @cached_property  # read in every round: computed once
    def send_sizes(self) -> list[int]:
        """Bytes of each dispatched tensor the client role sends in all."""
        return self.send_splits.sum(axis=1).tolist()

    @cached_property  # read in every round: computed once
    def recv_sizes(self) -> list[int]:
        """Bytes of each dispatched tensor the server role receives in all (heads excluded)."""
        return self.recv_splits.sum(axis=1).tolist()

    @cached_property  # read in every round: computed once
    def ret_recv_sizes(self) -> list[int]:
        """Bytes of each returned tensor the client role receives in all."""
        return self.ret_recv_splits.sum(axis=1).tolist()

    @cached_property
    def sent(self) -> dict[tuple[str, str], int]:
        """``{(kind value, tensor): bytes}`` the participant sends other participants in one
        round, both exchanges (what ``Participant.traffic`` counts per round; no zero entries)."""
        out: dict[tuple[str, str], int] = {}
        for name, n in [*zip(self.names, self.send_sizes), *zip(self.back, self.ret_send_splits.sum(axis=1).tolist())]:
            if n:
                out[(self.kind.value, name)] = out.get((self.kind.value, name), 0) + int(n)
        return out

    def peer_bytes(self) -> np.ndarray:
        """int64 [4, P]: per peer, the bytes this participant sends and expects in the dispatch,
        then sends and expects in the return: what the round header claims to each peer."""
        return np.stack([self.send_splits.sum(axis=0), self.recv_splits.sum(axis=0),
                         self.ret_send_splits.sum(axis=0), self.ret_recv_splits.sum(axis=0)])


def comm_layout(rows: PartRows, kind: RoundKind, row_bytes: Callable[[str], int],
                keep_activations: bool) -> CommLayout:
    """The :class:`CommLayout` of a round of ``kind`` for the participant of ``rows``.

    Args:
        rows: :func:`part_rows` of the participant's part.
        kind: the round kind.
        row_bytes: bytes of one row of a tensor, by name (the row format: heads x head_dim x
            element size; LSE rows have no head_dim).
        keep_activations: the plan's setting (a kept backward round sends dO, and merged O and
            LSE for split rows, instead of every input).
    """
    merged = tuple(kind.split_dispatch_with(keep_activations))
    names = tuple(kind.dispatch_with(keep_activations)) + merged
    back = tuple(kind.returns)

    def by_tensor(tensors, table, merged_=()):
        return np.stack([table[row_class(t, merged_)] * row_bytes(t) for t in tensors]).astype(np.int64)

    client, server = rows.rank is not None, rows.server is not None
    zeros = np.zeros((3, rows.num_participants), dtype=np.int64)
    send = by_tensor(names, rows.client_rows if client else zeros, merged)
    recv = by_tensor(names, rows.server_rows if server else zeros, merged)
    heads = np.array([rows.head_rows[row_class(t, merged)] * row_bytes(t) for t in names], dtype=np.int64)
    offsets = heads[:, None] + np.cumsum(recv, axis=1) - recv
    return CommLayout(kind=kind, names=names, merged=merged, back=back, send_splits=send, recv_splits=recv,
                      heads=heads, recv_offsets=offsets,
                      ret_send_splits=by_tensor(back, rows.server_rows if server else zeros),
                      ret_recv_splits=by_tensor(back, rows.client_rows if client else zeros),
                      head_rows_back=np.array([rows.head_rows[row_class(t)] if server else 0 for t in back],
                                              dtype=np.int64))


__all__ = ["CommLayout", "KV", "PartRows", "Q", "SPLIT", "comm_layout", "part_rows", "row_class"]
