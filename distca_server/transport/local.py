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


def check_splits(send: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                 world_size: int) -> None:
    """Validate an all-to-all call's arguments; raises ``ValueError`` naming the offenders."""
    if send.dtype != torch.uint8 or send.dim() != 1:
        raise ValueError(f"send must be a 1-D uint8 tensor, got {send.dtype} {tuple(send.shape)}")
    for name, splits in (("send_splits", send_splits), ("recv_splits", recv_splits)):
        if len(splits) != world_size or any(int(x) < 0 for x in splits):
            raise ValueError(f"{name} must be {world_size} ints >= 0, got {list(splits)}")
    if sum(send_splits) != send.numel():
        raise ValueError(f"send_splits sum to {sum(send_splits)} but send holds {send.numel()} bytes")


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
        self._slots: list[list[torch.Tensor | None]] = [[None] * world_size for _ in range(world_size)]
        self._failed: dict[int, str] = {}

    def endpoint(self, rank: int) -> "LocalTransport":
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range [0, {self.world_size})")
        return LocalTransport(self, rank)

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
    """One participant's endpoint of a :class:`LocalGroup` (see :class:`..base.Transport`)."""

    def __init__(self, group: LocalGroup, rank: int):
        self.group = group
        self.rank = rank
        self.world_size = group.world_size
        self.bytes_sent = 0

    def all_to_all(self, send: torch.Tensor, send_splits: Sequence[int],
                   recv_splits: Sequence[int]) -> torch.Tensor:
        g, me = self.group, self.rank
        check_splits(send, send_splits, recv_splits, self.world_size)
        for dst, piece in enumerate(torch.split(send, list(send_splits))):
            g._slots[me][dst] = piece
        self.bytes_sent += sum(send_splits) - send_splits[me]
        g._wait(me, "deposit")
        pieces = [g._slots[src][me] for src in range(self.world_size)]
        sizes = [p.numel() for p in pieces]
        if sizes != list(recv_splits):
            g.abort(me, f"expected {list(recv_splits)} bytes from each peer, got {sizes}")
            raise ValueError(f"participant {me}: expected {list(recv_splits)} bytes from each "
                             f"peer, got {sizes}")
        out = torch.cat(pieces) if pieces else send.new_empty(0)
        # Nobody may overwrite a slot for the next exchange before everyone has read this one.
        g._wait(me, "collect")
        for dst in range(self.world_size):
            g._slots[me][dst] = None
        return out
