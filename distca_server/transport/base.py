"""The interface every transport implements, and the helpers they share.

One exchange moves *segments*: a round's tensors (``q``, ``k``, ``v`` ...), each a ragged
all-to-all of its own, so that every tensor arrives contiguous across senders and the server's
kernel reads it where it landed. Both sides lay a segment out peer by peer in participant order:
``send[s]`` holds the bytes for participants ``0..P-1``, ``recv[s]`` the bytes from them. The data
rounds give a participant's own split 0 and write its own rows where they belong, so rows that stay
on their rank never pass through a transport (a transport still copies a non-zero own split).

Buffers: a transport hands out the memory that exchanges read and write (:meth:`Transport.buffer`),
allocated once per key and grown, never per round; a transport whose peers write into it directly
(NVSHMEM symmetric memory) owns it by necessity. Callers may also pass any uint8 tensor (e.g. a
kernel's output viewed as bytes) as a segment to send.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from scheduler.config import HEAP_ALIGN as ALIGN  # noqa: F401  (one definition, in the torch-free config)


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-int(nbytes) // ALIGN) * ALIGN


def host_to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device`` without stopping the host where it can: a host tensor bound for a CUDA
    device goes through pinned memory in a non-blocking copy on the current stream (a copy from
    pageable memory synchronizes that stream, which a device-driven exchange may hold in a wait
    for a peer); torch's pinned-memory cache keeps the staging block until the copy has run.
    Anything else is ``t.to(device)``. Use the result in the current stream's order."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)


class Transport(Protocol):
    """One participant's endpoint of an all-to-all group.

    Attributes:
        rank: this participant's index in the group.
        world_size: number of participants.
        device: where its buffers live.
        bytes_sent: running total of bytes this endpoint sent to *other* participants.
    """

    rank: int
    world_size: int
    device: torch.device
    bytes_sent: int

    def buffer(self, key: str, nbytes: int) -> torch.Tensor:
        """A uint8 [nbytes] view of the transport's buffer ``key`` (contents undefined).

        The same key returns the same memory until a larger request grows it; a view stays valid
        until the next ``buffer`` call with that key. Callers use one key per role (the dispatch
        receive buffer, a send buffer ...).
        """
        ...

    def exchange(self, send: Sequence[torch.Tensor], send_splits: Sequence[Sequence[int]],
                 recv: Sequence[torch.Tensor], recv_splits: Sequence[Sequence[int]],
                 timeout_s: float | None = None, route=None) -> "ExchangeHandle":
        """Segment-wise ragged all-to-all, started; collective: every participant calls it once
        per exchange with the same number of segments. All segments move in one operation; the
        ``recv`` segments hold the data once the returned handle's ``wait()`` has returned (a
        one-sided transport may finish before it returns and hand back :data:`DONE`). The
        ``send`` segments must stay unchanged until then. Starting the next exchange first
        completes this one.

        Args:
            send: per segment, uint8 [sum(send_splits[s])]: the bytes for participants 0..P-1.
            send_splits: per segment, ``world_size`` byte counts.
            recv: per segment, uint8 [sum(recv_splits[s])]: filled with the bytes from 0..P-1.
            recv_splits: per segment, ``world_size`` byte counts expected from each participant.
            timeout_s: overrides the transport's deadline (servers wait longer for a header).
            route: a hashable naming an exchange that repeats with the same sizes into the same
                receive buffers (every participant passes the same one for the same exchange;
                e.g. a plan's dispatch of one round kind), or None. A transport may use it to skip
                re-agreeing on offsets (:mod:`.routed`: device-driven exchanges); others ignore it.

        Raises:
            ValueError: bad splits or buffers, or a peer sent a different size than expected
                (from ``exchange`` or from ``wait``).
            DistCAError: a peer did not join within the deadline or failed (from ``exchange``
                or from ``wait``).
        """
        ...

    def close(self) -> None:
        """Leave the group; peers still in an exchange with it fail with ``DistCAError``."""
        ...


class ExchangeHandle(Protocol):
    """An exchange in flight (:meth:`Transport.exchange`)."""

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until the exchange's ``recv`` segments hold their data (at most ``timeout_s``
        seconds, default the transport's deadline). Waiting again returns at once.

        Raises:
            DistCAError: a peer failed or did not join within the deadline.
        """
        ...


class _Done:
    """The handle of an exchange that finished before ``exchange`` returned."""

    def wait(self, timeout_s: float | None = None) -> None:
        return None


DONE: ExchangeHandle = _Done()
"""The handle one-sided transports (local, shm, NVSHMEM) return: their exchange is complete."""


def check_exchange(send, send_splits, recv, recv_splits, world_size: int, rank: int) -> None:
    """Validate an exchange's arguments; raises ``ValueError`` naming the offenders."""
    if not (len(send) == len(send_splits) == len(recv) == len(recv_splits)):
        raise ValueError(f"exchange needs as many send/recv buffers as splits, got {len(send)}, "
                         f"{len(send_splits)}, {len(recv)}, {len(recv_splits)}")
    for s, (buf, splits, what) in enumerate(
            [(b, sp, "send") for b, sp in zip(send, send_splits)]
            + [(b, sp, "recv") for b, sp in zip(recv, recv_splits)]):
        if buf.dtype != torch.uint8 or buf.dim() != 1:
            raise ValueError(f"{what} segment must be a 1-D uint8 tensor, got {buf.dtype} {tuple(buf.shape)}")
        if len(splits) != world_size or any(int(x) < 0 for x in splits):
            raise ValueError(f"{what}_splits must be {world_size} ints >= 0, got {list(splits)}")
        if sum(splits) != buf.numel():
            raise ValueError(f"{what}_splits sum to {sum(splits)} but the {what} segment holds "
                             f"{buf.numel()} bytes")


class GrowingBuffers:
    """The :meth:`Transport.buffer` of transports that allocate with torch on their device."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._buffers: dict[str, torch.Tensor] = {}

    def buffer(self, key: str, nbytes: int) -> torch.Tensor:
        nbytes = int(nbytes)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < nbytes:
            # Grow by at least half again, so a slowly growing batch does not reallocate each step.
            size = max(aligned(nbytes), 0 if buf is None else buf.numel() + buf.numel() // 2)
            buf = self._buffers[key] = torch.empty(size, dtype=torch.uint8, device=self.device)
        return buf[:nbytes]

    def reserved_bytes(self) -> int:
        """Bytes held by all buffers (for memory accounting)."""
        return sum(b.numel() for b in self._buffers.values())


def all_to_all(transport: Transport, send: torch.Tensor, send_splits: Sequence[int],
               recv_splits: Sequence[int], timeout_s: float | None = None) -> torch.Tensor:
    """A one-segment exchange into a fresh tensor: uint8 [sum(recv_splits)] from 0..P-1 in order."""
    out = torch.empty(max(0, sum(map(int, recv_splits))), dtype=torch.uint8, device=transport.device)
    transport.exchange([send], [send_splits], [out], [recv_splits], timeout_s=timeout_s).wait(timeout_s)
    return out
