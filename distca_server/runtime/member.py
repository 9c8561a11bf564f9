"""``GroupMember``: one process's membership in a job's all-to-all group, shared by Ray clients and
dedicated attention servers.

Each membership of the job (clients, live servers, device type) is a *group epoch* the scheduler
hands out. A member joins epoch ``e`` as world rank ``r`` of ``w`` through the scheduler's
rendezvous relay (world rank 0 publishes its ``TCPStore`` address, the others look it up), runs
rounds over it (the round header first, then the participant's round), and when anything in a
round fails leaves the group, reports to the scheduler and raises the scheduler's verdict, naming
the lost participants, as :class:`GroupFailure`.
"""

from __future__ import annotations

from typing import Callable

import ray
import torch

from scheduler.cost import RoundKind

from ..errors import DistCAError
from ..header import RoundHeader, exchange_header
from ..participant import Participant
from ..transport.torch_dist import TorchDistTransport, join_group


def ask(ref, timeout_s: float):
    """``ray.get`` of a call to the scheduler actor, its silence or death as :class:`DistCAError`."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise DistCAError(f"the distca scheduler did not answer within {timeout_s:g} s") from None
    except ray.exceptions.RayActorError as exc:
        raise DistCAError(f"the distca scheduler is gone: {exc}") from None


class GroupFailure(DistCAError):
    """A round or a join failed; raised after the scheduler's verdict. The Ray client goes on
    at :attr:`next_step` and raises the message as a plain :class:`DistCAError`; a server records
    it and waits for its next group epoch.

    Attributes:
        lost: descriptions of the participants that never reported back (e.g. ``"attention
            server 1 (node 10.0.0.2)"``), or the scheduler itself if it did not answer.
        next_step: the step every client goes on with.
    """

    def __init__(self, message: str, lost: list[str], next_step: int):
        super().__init__(message)
        self.lost, self.next_step = lost, next_step


class GroupMember:
    """One participant's place in the job's group epochs.

    Args:
        scheduler: the job's ``SchedulerActor`` handle (``publish_store``, ``store_address``,
            ``report_failure``).
        host: this node's IP address (where world rank 0 hosts the rendezvous store).
        timeout_s: deadline of the join and of every exchange inside a round.
        who: how errors name this member, e.g. ``"rank 0"`` or ``"server 1"``.
    """

    def __init__(self, scheduler, host: str, timeout_s: float, who: str):
        self.scheduler, self.host, self.timeout_s, self.who = scheduler, host, timeout_s, who
        self.transport: TorchDistTransport | None = None
        self.epoch: int | None = None  # the last epoch joined (or tried); kept after leaving
        self.world_rank: int | None = None
        self.world_size: int | None = None

    @property
    def joined(self) -> bool:
        return self.transport is not None

    def join(self, epoch: int, world_rank: int, world_size: int, device, *, step: int) -> None:
        """Be world rank ``world_rank`` of group epoch ``epoch`` (no-op if already), leaving the
        previous epoch's group.

        Raises:
            GroupFailure: the group could not be formed in time (reported to the scheduler as a
                failure of ``step``).
        """
        if self.transport is not None and self.epoch == epoch:
            return
        self.leave()
        self.epoch, self.world_rank, self.world_size = epoch, world_rank, world_size
        try:
            self.transport = join_group(
                epoch=epoch, rank=world_rank, world_size=world_size, host=self.host,
                timeout_s=self.timeout_s, device=torch.device(device),
                publish=lambda host, port: ask(self.scheduler.publish_store.remote(epoch, host, port),
                                               self.timeout_s),
                lookup=lambda: self._lookup(epoch))
        except DistCAError as exc:
            raise self.fail(step, "joining the group", str(exc)) from None

    def leave(self) -> None:
        """Drop the group (peers still in a collective with it see their connection close)."""
        if self.transport is not None:
            self.transport.close()
        self.transport = None

    def run_round(self, header: RoundHeader | None, num_clients: int,
                  participant_for: Callable[[RoundHeader], Participant], tensors=(), *,
                  header_timeout_s: float | None = None):
        """Exchange the round header, then run the round it names.

        Args:
            header: this client's header, or None on a dedicated server (it learns the round from
                the clients' common header).
            num_clients: client world ranks (they come first in the group).
            participant_for: the participant that runs the round named by the common header.
            tensors: the client's ``(q, k, v)`` (forward) or ``(q, k, v, out, lse, dout)``
                (backward) rows; empty on a dedicated server.
            header_timeout_s: how long to wait for the header (servers wait for the next round
                much longer than for data inside a round); default the member's timeout.

        Returns:
            What the participant's round returns: ``(out, lse)`` or ``(dq, dk, dv)`` on a client,
            None on a dedicated server.

        Raises:
            DistCAError: not in a group (an earlier round failed; a new step forms a new one).
            GroupFailure: the round failed anywhere (clients disagreeing on the round, a lost or
                slow peer, a bad descriptor); the group is left and the failure reported.
        """
        transport = self.transport
        if transport is None:
            what = header.describe() if header is not None else "the next round"
            raise DistCAError(f"{self.who} has no group for {what} (a previous round failed; "
                              f"start a new step)")
        step = header.step if header is not None else -1
        what = header.describe() if header is not None else "a round"
        try:
            common = exchange_header(transport, header, num_clients, timeout_s=header_timeout_s)
            step, what = common.step, common.describe()
            participant = participant_for(common)
            args = tensors or (None,) * len(common.kind.dispatch)
            if common.kind == RoundKind.FORWARD:
                return participant.forward(transport, *args, common.softmax_scale)
            return participant.backward(transport, *args, common.softmax_scale)
        except (DistCAError, ValueError, RuntimeError) as exc:
            raise self.fail(step, what, str(exc)) from None

    def fail(self, step: int, what: str, detail: str) -> GroupFailure:
        """Leave the group, report the failure of ``what`` in ``step`` to the scheduler and wait
        for its verdict (who was lost, which step comes next); returns it as a
        :class:`GroupFailure` for the caller to raise or record."""
        epoch, world_rank = self.epoch, self.world_rank
        self.leave()
        try:
            verdict = ray.get(self.scheduler.report_failure.remote(epoch, world_rank, step, detail),
                              timeout=self.timeout_s)
        except Exception as exc:  # the scheduler itself is gone or slow
            verdict = {"lost": [f"the scheduler ({type(exc).__name__})"], "next_step": step + 1}
        lost = ", ".join(verdict["lost"]) or "no participant named (all reported back)"
        return GroupFailure(f"{self.who}: {what} failed; lost: {lost}. Cause: {detail[:300]}",
                            list(verdict["lost"]), int(verdict["next_step"]))

    def _lookup(self, epoch: int) -> tuple[str, int]:
        addr = ask(self.scheduler.store_address.remote(epoch), self.timeout_s + 5)
        if addr is None:
            raise DistCAError(f"no rendezvous address for group epoch {epoch} within {self.timeout_s:g} s")
        return tuple(addr)
