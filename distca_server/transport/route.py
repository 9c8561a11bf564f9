"""What a PE keeps of an installed route (:mod:`.routed`): its id, sizes, receive buffers, where
its rows go in each peer's arena, and the report rows it puts after them."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Hashable, Sequence

import numpy as np
import torch

from .base import host_to_device
from .symmetric_words import _REPORT

if TYPE_CHECKING:
    from .routed import RoutedTransport


def route_id(route: Hashable) -> int:
    """A positive int63 every process computes alike for ``route`` (from its ``repr``: Python's
    own ``hash`` of a string differs between processes)."""
    digest = hashlib.blake2b(repr(route).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1) or 1


class _Route:
    """What a PE keeps of an installed route: the sizes and receive buffers it was installed
    with, where its rows go in each peer's arena, and its report rows."""

    __slots__ = ("rid", "name", "send_splits", "recv_splits", "recv_ptrs", "puts", "reports", "report_rows",
                 "tag", "send_to", "recv_from", "own", "growths", "sent", "expects")

    def __init__(self, transport: "RoutedTransport", rid: int, name, ss, rs, recv, puts):
        me = transport.rank
        self.rid, self.name, self.growths = rid, name, transport._growths
        self.send_splits, self.recv_splits = ss, rs
        self.recv_ptrs = _pointers(recv)
        nseg = len(ss)
        self.send_to = [pe for pe in transport._peers() if any(ss[s][pe] for s in range(nseg))]
        self.recv_from = [pe for pe in transport._peers() if any(rs[s][pe] for s in range(nseg))]
        send_at = [np.concatenate([[0], np.cumsum(sp)]).tolist() for sp in ss]
        recv_at = [np.concatenate([[0], np.cumsum(sp)]).tolist() for sp in rs]
        # per peer: (segment, source offset, arena offset, bytes) of every non-empty slice
        self.puts = {pe: [(s, send_at[s][pe], off, n) for s, (off, n) in enumerate(puts[pe]) if n]
                     for pe in self.send_to}
        self.own = [(s, send_at[s][me], recv_at[s][me], ss[s][me]) for s in range(nseg) if ss[s][me]]
        # One report row per peer, in one tensor: word 0 is the round tag (stamped in stream order
        # when it changes, see ``RoutedTransport._queue``), then ``nseg, route, bytes...``.
        rows = np.zeros((len(self.send_to), _REPORT), dtype=np.int64)
        for i, pe in enumerate(self.send_to):
            rows[i, 1:3 + nseg] = [nseg, rid] + [ss[s][pe] for s in range(nseg)]
        # on the caller's stream, not blocking the host (the comm stream orders after it in begin())
        self.report_rows = host_to_device(torch.from_numpy(rows), transport.device)
        self.reports = {pe: self.report_rows[i].view(torch.uint8) for i, pe in enumerate(self.send_to)}
        self.tag = 0  # the tag word 0 of the rows holds once the queued work has run
        # per peer we receive from, words 1.. of the report row it must send (nseg, route, bytes...)
        self.expects = {pe: [nseg, rid] + [rs[s][pe] for s in range(nseg)] for pe in self.recv_from}
        self.sent = sum(sum(sp) - sp[me] for sp in ss)


def _pointers(bufs: Sequence[torch.Tensor]) -> list[int]:
    return [b.data_ptr() if b.numel() else 0 for b in bufs]
