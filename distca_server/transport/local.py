"""In-process transport: participants are threads of one process (``DistCAClient.local``).

A real all-to-all with the same interface and failure behaviour as the distributed transports:
each exchange is a collective guarded by a barrier with a timeout, and a participant that fails
aborts the group so its peers raise :class:`DistCAError` at once instead of waiting.
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch

from ..errors import DistCAError
from .base import DONE, ExchangeHandle, GrowingBuffers, check_exchange


class LocalGroup:
    """Shared state of ``world_size`` in-process participants.

    Args:
        world_size: number of participants.
        timeout_s: how long an exchange waits for the slowest participant before every waiting
            participant raises :class:`DistCAError`.
    """

    def __init__(self, world_size: int, timeout_s: float = 60.0):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self._barrier = threading.Barrier(world_size)
        self._lock = threading.Lock()
        self._entered = [0] * world_size  # exchanges each participant has joined
        self._slots: list[tuple | None] = [None] * world_size  # each participant's deposited segments
        self._failed: dict[int, str] = {}
        self._endpoints: dict[tuple[int, str], "LocalTransport"] = {}

    def endpoint(self, rank: int, device="cpu") -> "LocalTransport":
        """Participant ``rank``'s endpoint, the same object for every round on ``device`` (its
        buffers are kept and reused)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range [0, {self.world_size})")
        key = (rank, str(torch.device(device)))
        with self._lock:
            if key not in self._endpoints:
                self._endpoints[key] = LocalTransport(self, rank, device)
            return self._endpoints[key]

    def abort(self, rank: int, reason: str) -> None:
        """Mark ``rank`` as failed and wake every peer waiting on it."""
        with self._lock:
            self._failed[rank] = reason
        self._barrier.abort()

    @property
    def broken(self) -> bool:
        return self._barrier.broken

    def _wait(self, rank: int, what: str) -> None:
        with self._lock:
            self._entered[rank] += 1
        try:
            self._barrier.wait(self.timeout_s)
        except threading.BrokenBarrierError:
            with self._lock:
                latest = max(self._entered)
                missing = [r for r, n in enumerate(self._entered) if n < latest]
                failed = dict(self._failed)
            if failed:
                detail = "; ".join(f"participant {r} failed: {m}" for r, m in sorted(failed.items()))
            else:
                detail = f"participants {missing} did not arrive within {self.timeout_s:g} s"
            raise DistCAError(f"all-to-all {what} aborted on participant {rank}: {detail}") from None


class LocalTransport:
    """One participant's endpoint of a :class:`LocalGroup` (see :class:`.base.Transport`).

    An exchange is two barriers: senders deposit their segments, each receiver copies what its
    peers deposited for it straight into its receive buffers (the one copy an in-process transfer
    costs), and nobody reuses a send buffer before every receiver has read it.
    """

    def __init__(self, group: LocalGroup, rank: int, device="cpu"):
        self.group = group
        self.rank = rank
        self.world_size = group.world_size
        self.device = torch.device(device)
        self.bytes_sent = 0
        self._buffers = GrowingBuffers(self.device)

    def buffer(self, key: str, nbytes: int) -> torch.Tensor:
        return self._buffers.buffer(key, nbytes)

    def exchange(self, send: Sequence[torch.Tensor], send_splits, recv: Sequence[torch.Tensor],
                 recv_splits, timeout_s: float | None = None) -> ExchangeHandle:
        g, me, P = self.group, self.rank, self.world_size
        check_exchange(send, send_splits, recv, recv_splits, P, me)
        offsets = []
        for splits in send_splits:
            o, acc = [], 0
            for n in splits:
                o.append(acc)
                acc += int(n)
            offsets.append(o)
        g._slots[me] = (list(send), [list(map(int, x)) for x in send_splits], offsets)
        self.bytes_sent += sum(sum(map(int, x)) - int(x[me]) for x in send_splits)
        g._wait(me, "deposit")
        try:
            for s, (buf, expect) in enumerate(zip(recv, recv_splits)):
                pos = 0
                for src in range(P):
                    sends, splits, offs = g._slots[src]
                    if s >= len(sends):
                        raise ValueError(f"participant {src} sent {len(sends)} segments, "
                                         f"participant {me} expects {len(recv)}")
                    n = splits[s][me]
                    if n != int(expect[src]):
                        raise ValueError(f"participant {me}: segment {s} from participant {src} has "
                                         f"{n} bytes, expected {int(expect[src])}")
                    if n:
                        buf[pos:pos + n].copy_(sends[s][offs[s][me]:offs[s][me] + n])
                    pos += n
        except ValueError as exc:
            g.abort(me, str(exc))
            raise
        # Nobody may reuse a send buffer for the next exchange before everyone has read this one.
        g._wait(me, "collect")
        g._slots[me] = None
        return DONE
