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

    def buffer(self, key: str, nbytes: int) -> torch.Tensor:
        return self._buffers.buffer(key, nbytes)

    def exchange(self, send: Sequence[torch.Tensor], send_splits: Sequence[Sequence[int]],
                 recv: Sequence[torch.Tensor], recv_splits: Sequence[Sequence[int]],
                 timeout_s: float | None = None) -> None:
        """One ragged ``alltoall_base`` per segment, straight between the given buffers;
        ``timeout_s`` overrides the transport's deadline (servers wait for the next round's header
        longer than for data inside a round).

        Raises:
            ValueError: bad splits or buffers.
            DistCAError: a collective failed or timed out (a peer died or never came).
        """
        check_exchange(send, send_splits, recv, recv_splits, self.world_size, self.rank)
        opts = dist.AllToAllOptions()
        opts.timeout = _td(self.timeout_s if timeout_s is None else timeout_s)
        try:
            for buf_out, buf_in, rs, ss in zip(recv, send, recv_splits, send_splits):
                work = self.pg.alltoall_base(buf_out, buf_in.to(self.device), list(map(int, rs)),
                                             list(map(int, ss)), opts)
                work.wait(opts.timeout)
        except RuntimeError as exc:  # gloo and NCCL report lost peers and timeouts this way
            raise DistCAError(f"all-to-all failed on participant {self.rank} of group epoch "
                              f"{self.epoch}: {str(exc).splitlines()[0][:300]}") from None
        self.bytes_sent += sum(sum(map(int, ss)) - int(ss[self.rank]) for ss in send_splits)

    def close(self) -> None:
        """Drop the group; peers still in a collective with it see their connection close."""
        pg, self.pg, self.store = self.pg, None, None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except RuntimeError:
                pass


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
    try:
        if rank == 0:
            port, fd = listen_on(host)
            store = dist.TCPStore(host, port, world_size, True, timeout=_td(timeout_s),
                                  wait_for_workers=False, master_listen_fd=fd)
            publish(host, port)
        else:
            addr, port = lookup()
            store = dist.TCPStore(addr, port, world_size, False, timeout=_td(timeout_s))
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
        raise DistCAError(f"could not form group epoch {epoch} as rank {rank} of {world_size}: "
                          f"{str(exc).splitlines()[0][:300]}") from None
    return TorchDistTransport(pg, rank, world_size, timeout_s, device, store=store, epoch=epoch)
