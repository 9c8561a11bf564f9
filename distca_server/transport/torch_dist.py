"""All-to-all over ``torch.distributed`` (gloo on CPU, NCCL on GPU) for the Ray runtime.

Each membership of clients and dedicated servers is one *group epoch*: a standalone process group
(not the process-global default group, so a group can be dropped and re-formed after a failure
without restarting anyone). World rank 0 hosts the rendezvous ``TCPStore``; the scheduler actor
relays its address and hands out the ranks. The store and gloo's pairs listen on the node's
address only (docs/security.md).
"""

from __future__ import annotations

import datetime
import socket
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..errors import DistCAError
from .base import GrowingBuffers, check_exchange


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(seconds))


class TorchDistTransport:
    """One participant's endpoint of a group epoch (see :class:`.base.Transport`).

    Args:
        pg: a gloo or NCCL process group of ``world_size`` participants.
        rank, world_size: this participant's place in it.
        timeout_s: deadline of every exchange of a round.
        device: where send and receive buffers live (cpu for gloo, cuda for NCCL).
        store: the rendezvous store; kept alive while the group is in use.
    """

    def __init__(self, pg, rank: int, world_size: int, timeout_s: float, device: torch.device,
                 store=None, epoch: int = 0):
        self.pg, self.rank, self.world_size = pg, rank, world_size
        self.timeout_s, self.device, self.store, self.epoch = timeout_s, torch.device(device), store, epoch
        self.bytes_sent = 0
        self._buffers = GrowingBuffers(self.device)
        self._in_flight: _Pending | None = None

    def buffer(self, key: str, nbytes: int) -> torch.Tensor:
        return self._buffers.buffer(key, nbytes)

    def exchange(self, send: Sequence[torch.Tensor], send_splits: Sequence[Sequence[int]],
                 recv: Sequence[torch.Tensor], recv_splits: Sequence[Sequence[int]],
                 timeout_s: float | None = None, route=None) -> "_Pending":
        """All segments in one ragged ``alltoall_base`` (one collective per exchange), started;
        the handle's ``wait`` completes it. ``timeout_s`` overrides the transport's deadline
        (servers wait for the next round's header longer than for data inside a round).

        A collective moves one contiguous block per peer, while a segment (one tensor) must
        arrive contiguous across senders for the kernel: with several segments the send side
        copies them peer by peer into a staging buffer and ``wait`` copies the received blocks
        out into the segments. One copy of each byte on each side buys one collective instead of
        one per tensor (gloo's per-collective cost dominates below ~1 MB per segment; measured
        in bench/README.md, roundtrip.py). A single segment moves with no copy.

        Raises:
            ValueError: bad splits or buffers.
            DistCAError: the collective failed or timed out (a peer died or never came), from
                here or from ``wait``.
        """
        check_exchange(send, send_splits, recv, recv_splits, self.world_size, self.rank)
        if self._in_flight is not None:  # the staging buffers are reused: finish the last one
            self._in_flight.wait()
        ss = [[int(x) for x in sp] for sp in send_splits]
        rs = [[int(x) for x in sp] for sp in recv_splits]
        timeout = _td(self.timeout_s if timeout_s is None else timeout_s)
        per_peer_send = [sum(sp[p] for sp in ss) for p in range(self.world_size)]
        per_peer_recv = [sum(sp[p] for sp in rs) for p in range(self.world_size)]
        if len(send) == 1 and recv[0].is_contiguous():
            send_buf, recv_buf, unpack = send[0].to(self.device), recv[0], None
        else:
            send_buf = self._buffers.buffer("a2a-send", sum(per_peer_send))
            recv_buf = self._buffers.buffer("a2a-recv", sum(per_peer_recv))
            _copy_blocks(send, ss, send_buf, into_staging=True)
            unpack = (recv, rs)
        opts = dist.AllToAllOptions()
        opts.timeout = timeout
        try:
            work = self.pg.alltoall_base(recv_buf, send_buf, per_peer_recv, per_peer_send, opts)
        except RuntimeError as exc:
            raise self._error(exc) from None
        self.bytes_sent += sum(per_peer_send) - per_peer_send[self.rank]
        self._in_flight = _Pending(self, work, timeout, recv_buf, unpack)
        return self._in_flight

    def _error(self, exc: Exception) -> DistCAError:
        return DistCAError(f"all-to-all failed on participant {self.rank} of group epoch "
                           f"{self.epoch}: {str(exc).splitlines()[0][:300]}")

    def close(self) -> None:
        """Drop the group; peers still in a collective with it see their connection close."""
        pg, self.pg, self.store = self.pg, None, None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except RuntimeError:
                pass


def _copy_blocks(segments, splits, staging: torch.Tensor, into_staging: bool) -> None:
    """Copy between segment-major ``segments`` (segment ``s`` holds peers 0..P-1 in order,
    ``splits[s][p]`` bytes each) and peer-major ``staging`` (peer ``p``'s block holds its bytes
    of segments 0..S-1 in order): into ``staging`` or, with ``into_staging=False``, out of it."""
    seg_off = [0] * len(segments)
    at = 0
    for p in range(len(splits[0]) if splits else 0):
        for s, seg in enumerate(segments):
            n = splits[s][p]
            if n:
                a, b = staging[at:at + n], seg[seg_off[s]:seg_off[s] + n]
                (a.copy_(b) if into_staging else b.copy_(a))
                at += n
                seg_off[s] += n


class _Pending:
    """A :class:`TorchDistTransport` exchange in flight (see :class:`.base.ExchangeHandle`)."""

    def __init__(self, transport: TorchDistTransport, work, timeout: datetime.timedelta,
                 recv_buf: torch.Tensor, unpack):
        self.transport, self.work, self.timeout = transport, work, timeout
        self.recv_buf, self.unpack = recv_buf, unpack
        self.error: DistCAError | None = None

    def wait(self, timeout_s: float | None = None) -> None:
        """Complete the collective (within ``timeout_s``, default the exchange's deadline) and
        copy the received blocks into their segments.

        Raises:
            DistCAError: the collective failed or timed out (again on every later call).
        """
        t = self.transport
        if self.work is not None:
            work, self.work = self.work, None
            if t._in_flight is self:
                t._in_flight = None
            try:
                work.wait(self.timeout if timeout_s is None else _td(timeout_s))
            except RuntimeError as exc:  # gloo and NCCL report lost peers and timeouts this way
                self.error = t._error(exc)
            if self.error is None and self.unpack is not None:
                _copy_blocks(self.unpack[0], self.unpack[1], self.recv_buf, into_staging=False)
        if self.error is not None:
            raise self.error


def listen_on(host: str) -> tuple[int, int]:
    """A listening TCP socket bound to ``host`` (this node's address) on a free port, as
    ``(port, fd)``; the caller's ``TCPStore`` takes the fd over (and closes it).

    ``TCPStore(host, 0, ..., is_master=True)`` alone listens on every interface (``*:port``): the
    store is unauthenticated, so it must answer on the address the group's members use only
    (docs/security.md).

    Raises:
        OSError: ``host`` is not an address of this node.
    """
    family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
    sock = socket.create_server((host, 0), family=family)
    return sock.getsockname()[1], sock.detach()


def _not_arrived(arrived, world_size: int) -> list[int]:
    """The world ranks that never marked their arrival in ``arrived`` (a store), or [] when it
    cannot be read (no store, or its host is gone): who the others waited for."""
    if arrived is None:
        return []
    try:
        return [r for r in range(world_size) if not arrived.check([str(r)])]
    except Exception:  # noqa: BLE001 - the store's host left: nothing to name
        return []


def join_group(*, epoch: int, rank: int, world_size: int, host: str, timeout_s: float,
               device: torch.device, publish: Callable[[str, int], None],
               lookup: Callable[[], tuple[str, int]]) -> TorchDistTransport:
    """Form (or join) group epoch ``epoch``.

    World rank 0 starts a ``TCPStore`` listening on ``host`` only (:func:`listen_on`) and
    ``publish(host, port)``-es it; the others ``lookup()`` the address. Gloo is used for CPU
    devices, NCCL for CUDA.

    Raises:
        DistCAError: the store or the group could not be formed within ``timeout_s``.
    """
    device = torch.device(device)
    arrived = None  # where each member marks that it reached the rendezvous (named when it fails)
    try:
        if rank == 0:
            port, fd = listen_on(host)
            store = dist.TCPStore(host, port, world_size, True, timeout=_td(timeout_s),
                                  wait_for_workers=False, master_listen_fd=fd)
            publish(host, port)
        else:
            addr, port = lookup()
            store = dist.TCPStore(addr, port, world_size, False, timeout=_td(timeout_s))
        arrived = dist.PrefixStore(f"distca/epoch{epoch}/arrived", store)
        arrived.set(str(rank), "1")
        prefixed = dist.PrefixStore(f"distca/epoch{epoch}", store)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = _td(timeout_s)
            pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = _td(timeout_s)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            pg = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
    except (RuntimeError, OSError, DistCAError) as exc:
        missing = _not_arrived(arrived, world_size)
        who = (f" (world ranks {missing} never reached its rendezvous: clients are the first world ranks, "
               f"then the dedicated servers)" if missing else "")
        raise DistCAError(f"could not form group epoch {epoch} as rank {rank} of {world_size}{who}: "
                          f"{str(exc).splitlines()[0][:300]}") from None
    return TorchDistTransport(pg, rank, world_size, timeout_s, device, store=store, epoch=epoch)
