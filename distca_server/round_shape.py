"""The bytes of one participant's round, per round kind: fixed by the plan, computed once.

What a round dispatches and returns, and how many bytes go to and come from each participant,
depends only on the participant's plan part, the row format, the round kind and whether the plan
keeps activations, never on the tensors. A :class:`~distca_server.participant.Participant` builds
its :class:`RoundShape` on its first round of each kind and reuses it in every later round (and
step: rebound participants share them), so a round's host work is the copies, the exchange and the
kernel call, not this arithmetic again.
"""

from __future__ import annotations

from typing import NamedTuple

from scheduler.cost import KV_TENSORS, RoundKind


class RoundShape(NamedTuple):
    """One participant's byte layout of a round kind (lists are per tensor, in ``names`` /
    ``back`` order; ``*_splits`` are byte counts per participant, ``*_sizes`` their sums).

    Attributes:
        names: tensors dispatched (the kind's, then ``merged``).
        merged: tensors sent for split tasks' rows only (merged O and LSE of a kept backward).
        back: tensors returned.
        send_splits, send_sizes: the client role's dispatch (zeros without one).
        recv_splits, recv_sizes: the server role's dispatch (zeros without one).
        heads: bytes of the own rank's rows the server role gathers into the head of each receive
            segment (when the kernel cannot read the client's tensors as they are).
        ret_send_splits: the server role's return (zeros without one).
        ret_recv_splits, ret_recv_sizes: the client role's return (zeros without one).
        head_rows_back: rows of each returned tensor that stay with the own rank.
    """

    names: tuple[str, ...]
    merged: tuple[str, ...]
    back: tuple[str, ...]
    send_splits: list[list[int]]
    send_sizes: list[int]
    recv_splits: list[list[int]]
    recv_sizes: list[int]
    heads: list[int]
    ret_send_splits: list[list[int]]
    ret_recv_splits: list[list[int]]
    ret_recv_sizes: list[int]
    head_rows_back: list[int]


def rows_of(name: str, merged, q_rows, kv_rows, split_rows):
    """The row counts (or index tensors) of tensor ``name`` in a round that sends ``merged`` for
    split rows only: KV-shaped tensors follow ``kv_rows``, merged ones ``split_rows``, the rest
    ``q_rows``."""
    return kv_rows if name in KV_TENSORS else split_rows if name in merged else q_rows


def round_shape(p, kind: RoundKind) -> RoundShape:
    """The :class:`RoundShape` of participant ``p`` (a Participant: its roles, row counts per
    participant and row format) for rounds of ``kind``."""
    merged = tuple(kind.split_dispatch_with(p.keep_activations))
    names = tuple(kind.dispatch_with(p.keep_activations)) + merged
    back = tuple(kind.returns)
    row_bytes = p.fmt.row_bytes
    zeros = [0] * p.part.num_participants

    def splits(tensors, merged_, q_rows, kv_rows, split_rows):
        return [[n * row_bytes(t) for n in rows_of(t, merged_, q_rows, kv_rows, split_rows)] for t in tensors]

    client, server = p.rank is not None, p.server is not None
    send = (splits(names, merged, p.client_q_rows, p.client_kv_rows, p.client_split_rows) if client
            else [zeros] * len(names))
    recv = (splits(names, merged, p.server_q_rows, p.server_kv_rows, p.server_split_rows) if server
            else [zeros] * len(names))
    heads = ([row_bytes(t) * rows_of(t, merged, p.head_q_rows, p.head_kv_rows, p.head_split_rows)
              for t in names] if server else [0] * len(names))
    ret_send = (splits(back, (), p.server_q_rows, p.server_kv_rows, None) if server
                else [zeros] * len(back))
    ret_recv = (splits(back, (), p.client_q_rows, p.client_kv_rows, None) if client
                else [zeros] * len(back))
    head_rows = [rows_of(t, (), p.head_q_rows, p.head_kv_rows, None) for t in back] if server else [0] * len(back)
    return RoundShape(names, merged, back, send, [sum(x) for x in send], recv, [sum(x) for x in recv],
                      heads, ret_send, ret_recv, [sum(x) for x in ret_recv], head_rows)
