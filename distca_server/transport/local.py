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
                self._endpoints[key] = self._endpoint_class()(self, rank, device)
            return self._endpoints[key]

    def _endpoint_class(self) -> type:
        return LocalTransport

    def close(self) -> None:
        """Nothing to release (the runtime closes every group it replaces; a heap group's
        transports have threads)."""

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

    def close(self) -> None:
        """Leave the group: peers in an exchange with this participant, or in a later one, fail
        with ``DistCAError`` (the group is aborted; in-process, nothing else is held)."""
        self.group.abort(self.rank, "left the group (closed)")

    def _deposit(self, send, send_splits, recv, recv_splits) -> None:
        """Check the call and put this participant's segments where its peers read them."""
        g, me, P = self.group, self.rank, self.world_size
        try:
            check_exchange(send, send_splits, recv, recv_splits, P, me)
        except ValueError as exc:  # the peers fail at once, not at the barrier's timeout
            g.abort(me, f"bad exchange arguments: {exc}")
            raise
        offsets = []
        for splits in send_splits:
            o, acc = [], 0
            for n in splits:
                o.append(acc)
                acc += int(n)
            offsets.append(o)
        g._slots[me] = (list(send), [list(map(int, x)) for x in send_splits], offsets)
        self.bytes_sent += sum(sum(map(int, x)) - int(x[me]) for x in send_splits)

    def _collect(self, recv, recv_splits) -> None:
        """Copy what every peer deposited for this participant into ``recv`` (sizes checked;
        a mismatch aborts the group)."""
        g, me, P = self.group, self.rank, self.world_size
        try:
            for s, (buf, expect) in enumerate(zip(recv, recv_splits)):
                blocks = []
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
                        blocks.append(sends[s][offs[s][me]:offs[s][me] + n])
                # one copy operation per segment, whatever the number of senders (one launch on a GPU)
                if len(blocks) == 1:
                    buf[:blocks[0].numel()].copy_(blocks[0])
                elif blocks:
                    torch.cat(blocks, out=buf[:sum(b.numel() for b in blocks)])
        except ValueError as exc:
            g.abort(me, str(exc))
            raise

    def exchange(self, send: Sequence[torch.Tensor], send_splits, recv: Sequence[torch.Tensor],
                 recv_splits, timeout_s: float | None = None, route=None) -> ExchangeHandle:
        g, me = self.group, self.rank
        self._deposit(send, send_splits, recv, recv_splits)
        g._wait(me, "deposit")
        self._collect(recv, recv_splits)
        # Nobody may reuse a send buffer for the next exchange before everyone has read this one.
        g._wait(me, "collect")
        g._slots[me] = None
        return DONE


class LockstepGroup(LocalGroup):
    """Shared state of ``world_size`` participants that one thread runs in lock step
    (:func:`distca_server.participant.drive_all`): an exchange only deposits the sender's segments
    and returns a handle; the driver first starts every participant's exchange, then waits on
    every handle, which copies the rows in, then lets every participant go on. So no participant
    waits for another, nothing blocks, and no send buffer is reused before every receiver has read
    it. A handle whose peers did not all deposit raises :class:`DistCAError` at once (a peer
    failed or stopped early: the driver raises its error first)."""

    def __init__(self, world_size: int, timeout_s: float = 0.0):
        super().__init__(world_size, timeout_s=timeout_s)  # nobody waits: kept for the factory's signature
        self._entered = [0] * world_size

    def _endpoint_class(self) -> type:
        return LockstepTransport

    def abort(self, rank: int, reason: str) -> None:
        self._failed[rank] = reason

    @property
    def broken(self) -> bool:
        return bool(self._failed)


class LockstepTransport(LocalTransport):
    """One participant's endpoint of a :class:`LockstepGroup`."""

    def exchange(self, send, send_splits, recv, recv_splits, timeout_s: float | None = None,
                 route=None) -> "_Collect":
        g, me = self.group, self.rank
        self._deposit(send, send_splits, recv, recv_splits)
        g._entered[me] += 1
        return _Collect(self, recv, recv_splits, g._entered[me])


class _Collect:
    """The receive half of a :class:`LockstepTransport` exchange."""

    __slots__ = ("_endpoint", "_recv", "_splits", "_seq")

    def __init__(self, endpoint: LockstepTransport, recv, recv_splits, seq: int):
        self._endpoint, self._recv, self._splits, self._seq = endpoint, recv, recv_splits, seq

    def wait(self, timeout_s: float | None = None) -> None:
        ep = self._endpoint
        if ep is None:
            return
        g = ep.group
        missing = [r for r, n in enumerate(g._entered) if n != self._seq]
        if missing or g._failed:
            detail = "; ".join(f"participant {r} failed: {m}" for r, m in sorted(g._failed.items())) or (
                f"participants {missing} did not start exchange {self._seq}")
            raise DistCAError(f"all-to-all aborted on participant {ep.rank}: {detail}")
        ep._collect(self._recv, self._splits)
        self._endpoint = None
