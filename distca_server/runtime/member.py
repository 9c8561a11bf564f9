"""``GroupMember``: one process's membership in a job's all-to-all group, shared by Ray clients and
dedicated attention servers.

Each membership of the job (clients, live servers, device type) is a *group epoch* the scheduler
hands out. A member joins epoch ``e`` as world rank ``r`` of ``w`` with the job's transport through
the scheduler's bootstrap relay (world rank 0 publishes what the others need to join, e.g. its
``TCPStore`` address; see :mod:`.groups`) and runs rounds over it: the round header first
(:mod:`distca_server.header`: which round, and whether every pair agrees on what moves), then the
participant's round. An in-place round whose two routes are installed on a routed transport
skips the header and carries its digest in the exchanges instead (:meth:`GroupMember._tagged_round`).

Liveness comes from the data plane. When a round fails anywhere (a participant found its part
disagrees, a peer's connection closed, an exchange timed out), that member checks in with the
scheduler, which opens the epoch's arbitration. Every other member learns of it through a
long-poll (:meth:`GroupMember.poll`) and checks in too, saying how many rounds of the epoch it
reached and whether it is in one; a member blocked waiting for a round header stops waiting at
once. The verdict names the members that never checked in and those that had not started the
round their peers waited in (late), with the cause the members reported; every member raises it
as :class:`GroupFailure`. A scheduler that dies (and restarts) fails the epoch for every member
the same way (:class:`SchedulerLost`).

Why the header wait is abandoned rather than aborted: a gloo collective cannot be interrupted,
and a timed-out one keeps its group's connections open, so peers do not see them close. The
header exchange runs on a helper thread; an abandoned one over gloo stays blocked there until its
own timeout or its peers leave, while the member moves on. Over a symmetric heap (``shm``,
``nvshmem``) the transport's ``abandon`` or ``close`` ends it at once.
"""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import ray
import torch

from scheduler.cost import RoundKind
from scheduler.outcomes import lost_text

from ..errors import DistCAError
from ..header import RoundHeader, check_claims, claims, common_header, exchange_header
from ..participant import Participant
from .groups import Group, join_epoch

POLL_S = 5.0  # one long-poll of the scheduler lasts at most this long
# A registration (a client's or a server's) waits this long for a busy, starting or restarting
# scheduler: on a loaded machine Ray takes minutes to start an actor's process.
REGISTER_TIMEOUT_S = 180.0
_WAKE_S = 0.1  # while polling, check this often whether the member moved to another epoch


def run_participant(participant: Participant, transport, header: RoundHeader, tensors=()):
    """Run the round ``header`` names on ``participant``: forward (keeping its activations under
    ``header.kept`` when that is >= 0), a stateless backward, or the backward of a kept forward
    round. ``tensors``: the client's dispatch tensors in wire order, empty on a server-only one.

    Raises:
        ValueError: the round does not fit the participant's plan (a kept backward round on a
            stateless plan, or one without a key), before any byte moves.
    """
    kept = header.kept if header.kept >= 0 else None
    args = tuple(tensors) or (None,) * len(header.kind.dispatch_with(participant.keep_activations))
    if header.kind == RoundKind.FORWARD:
        return participant.forward(transport, *args, header.softmax_scale, keep=kept)
    if not participant.keep_activations:
        if kept is not None:
            raise ValueError(f"{header.describe()}: names kept activations, but the plan is stateless")
        return participant.backward(transport, *args, header.softmax_scale)
    if kept is None:
        raise ValueError(f"{header.describe()}: the plan keeps activations, but the backward round names "
                         f"no kept forward round")
    return participant.backward_kept(transport, *args, header.softmax_scale, kept=kept)


def _terse(detail: str) -> str:
    """A collective's error without gloo's source location and advice."""
    detail = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\] ", "", detail)
    return detail.split(" This is typically caused")[0]


class SchedulerLost(DistCAError):
    """The job's scheduler actor died (Ray restarts it if the job allows): its state is gone, so
    every member leaves its group and re-registers."""


def ask(ref, timeout_s: float):
    """``ray.get`` of a call to the scheduler actor, its silence as :class:`DistCAError`, its
    death as :class:`SchedulerLost`, and a ``ValueError`` it raised (a refused registration) as
    that plain ``ValueError``, without the actor's traceback."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, ValueError):
            raise ValueError(str(exc.cause)) from None
        raise
    except ray.exceptions.GetTimeoutError:
        raise DistCAError(f"the distca scheduler did not answer within {timeout_s:g} s") from None
    except ray.exceptions.RayActorError as exc:
        raise SchedulerLost(f"the distca scheduler is gone: {str(exc).splitlines()[0][:200]}") from None


class GroupFailure(DistCAError):
    """A round or a join failed; raised with the scheduler's verdict. The Ray client goes on at
    :attr:`next_step`; a server records it and waits for its next group epoch.

    Attributes:
        lost: descriptions of the lost participants with why (e.g. ``"attention server 1 (node
            10.0.0.2): did not answer within 1 s"``), empty if none was lost.
        next_step: the step every client goes on with.
        cause: what the members reported: a participant's own finding first.
        detected: the cause is a participant's own finding (a ``ValueError``), not a symptom.
    """

    def __init__(self, message: str, lost: list[str], next_step: int, cause: str = "", detected: bool = False):
        super().__init__(message)
        self.lost, self.next_step, self.cause, self.detected = lost, next_step, cause, detected


class Superseded(DistCAError):
    """A newer group epoch was assigned while this member waited for a round of the old one (a
    dedicated server), or the member was closed during a round: not a failure, the member just
    leaves the old group."""


class _Abandoned(Exception):
    """The epoch's arbitration opened (or the scheduler died, or a newer epoch was assigned)
    while this member waited."""


class GroupMember:
    """One participant's place in the job's group epochs.

    Args:
        scheduler: the job's ``SchedulerActor`` handle (``publish_bootstrap``, ``bootstrap``,
            ``report_failure``, ``watch``).
        host: this node's IP address (where a ``torch_dist`` world rank 0 hosts its store).
        timeout_s: deadline of the join and of every exchange inside a round.
        who: how errors name this member, e.g. ``"rank 0"`` or ``"server 1"``.
        watch: start a thread per joined epoch that long-polls the scheduler (clients); a
            dedicated server polls from its own control loop instead.
        job: the job's name (names its shared-memory heaps).
        heap_bytes: the job's ``JobConfig.heap_bytes`` (the symmetric heap of ``shm`` and
            ``nvshmem``, bytes) when this member knows it (a client); None: the default. Only a
            group's world rank 0 (a client) needs it: the others take rank 0's.
    """

    tag_rounds = True  # False: exchange the header in every round (a benchmark's baseline)

    def __init__(self, scheduler, host: str, timeout_s: float, who: str, *, watch: bool = True,
                 job: str = "default", heap_bytes: int | None = None):
        self.scheduler, self.host, self.timeout_s, self.who, self.job = scheduler, host, timeout_s, who, job
        self.heap_bytes = heap_bytes
        self.transport = None  # the current epoch's Transport endpoint, None while in no group
        self._group: Group | None = None
        self.epoch: int | None = None  # the last epoch joined (or tried); kept after leaving
        self.world_rank: int | None = None
        self.world_size: int | None = None
        self.rounds_done = 0  # rounds of the current epoch completed
        self.tagged_rounds = 0  # of those, rounds run without a header exchange (their exchanges carry its tag)
        self.in_round = False  # joining, in a round, or (a server) waiting for the next header
        self.round_since = 0.0  # when it last entered one (time.monotonic())
        self.scheduler_lost = False  # set when the scheduler died; the owner re-registers, then clears it
        self.scheduler_incarnation: str | None = None  # the scheduler registered with (owner sets it)
        self._watch = watch
        self._live: int | None = None  # the epoch joined or joining; None after leaving
        self._cond = threading.Condition()
        self._abandoned: dict[int, str] = {}  # epoch -> why its waits stop
        self._verdicts: dict[int, dict] = {}  # epoch -> verdict, once known
        self._headers = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"distca-header-{who}")
        self._pending = None  # (transport, future) of an abandoned header exchange still blocked

    @property
    def joined(self) -> bool:
        return self.transport is not None

    @property
    def waited_s(self) -> float | None:
        """Seconds in the current round so far, None if in none."""
        return time.monotonic() - self.round_since if self.in_round else None

    @property
    def reached(self) -> int:
        """Rounds of the current epoch reached: completed, plus the one it is in."""
        return self.rounds_done + (1 if self.in_round else 0)

    # ---- joining and leaving -----------------------------------------------------------------------
    def join(self, epoch: int, world_rank: int, world_size: int, device, *, step: int,
             transport: str = "torch_dist") -> None:
        """Be world rank ``world_rank`` of group epoch ``epoch`` (no-op if already), leaving the
        previous epoch's group; ``transport``: the job's (one of
        :data:`scheduler.checks.TRANSPORTS`).

        Raises:
            GroupFailure: the group could not be formed in time (reported to the scheduler as a
                failure of ``step``).
        """
        if self.transport is not None and self.epoch == epoch:
            return
        self.leave()
        self.epoch, self.world_rank, self.world_size = epoch, world_rank, world_size
        # round_since before in_round: the watcher thread reads waited_s, never a stale start
        self.round_since = time.monotonic()
        self.rounds_done, self.tagged_rounds, self.in_round, self._live = 0, 0, True, epoch
        if self._watch:
            threading.Thread(target=self._watch_epoch, args=(epoch,), daemon=True,
                             name=f"distca-watch-{self.who}-{epoch}").start()
        try:
            self._group = join_epoch(
                transport, job=self.job, epoch=epoch, rank=world_rank, world_size=world_size,
                host=self.host, timeout_s=self.timeout_s, device=torch.device(device),
                publish=lambda value: ask(self.scheduler.publish_bootstrap.remote(epoch, value), self.timeout_s),
                lookup=lambda: self._lookup(epoch), heap_bytes=self.heap_bytes)
            self.transport = self._group.transport
        except DistCAError as exc:
            raise self.fail(step, f"joining group epoch {epoch}", str(exc)) from None
        finally:
            self.in_round = False

    def leave(self) -> None:
        """Drop the group (peers still in an exchange with it see their connection close, unless
        an exchange of this member is still pending in it). A group with an abandoned header
        exchange pending (over gloo, which cannot end it) is closed when that exchange ends:
        closing it now would wait for it."""
        self._live = None
        transport, self.transport, self._group = self.transport, None, None
        if transport is None:
            return
        pending = self._pending
        if pending is not None and pending[0] is transport and not pending[1].done():
            pending[1].add_done_callback(lambda _: transport.close())
        else:
            transport.close()

    def close(self) -> None:
        """Leave the group and stop the helper threads."""
        epoch = self.epoch
        # Marked before leaving: the leaving ends a wait in the group at once (a routed
        # transport's close), and that wait must read as closed, not as a failure to report.
        self._mark_abandoned(epoch, "closed")
        self.leave()
        self.abandon(epoch, "closed")
        self._headers.shutdown(wait=False)

    def abandon(self, epoch: int | None, why: str) -> None:
        """Stop waiting for epoch ``epoch``'s next round header: its arbitration opened, or the
        scheduler died, or (``why="superseded"``, a server) a newer epoch was assigned. The next
        round of the epoch fails at once, and so does every exchange of a routed transport in
        flight, the header's included (``RoutedTransport.abandon``)."""
        if epoch is None:
            return
        # Marked first: an exchange the transport's abandon ends must find the epoch abandoned.
        self._mark_abandoned(epoch, why)
        transport = self.transport
        if epoch == self.epoch and hasattr(transport, "abandon"):
            # a tagged round waits in device-driven exchanges, not in the header: end them too
            transport.abandon(f"{self.who} gave up on group epoch {epoch}: {why}")
        with self._cond:
            self._cond.notify_all()

    def _mark_abandoned(self, epoch: int | None, why: str) -> None:
        """Record that epoch ``epoch``'s waits stop (the first reason stands)."""
        if epoch is None:
            return
        with self._cond:
            self._abandoned.setdefault(epoch, why)
            for old in [e for e in self._abandoned if e < epoch - 2]:
                del self._abandoned[old]

    # ---- rounds ------------------------------------------------------------------------------------
    def run_round(self, header: RoundHeader | None, num_clients: int,
                  participant_for: Callable[[RoundHeader], Participant], tensors=(), *,
                  header_timeout_s: float | None = None):
        """Exchange the round header and check it, then run the round it names.

        Args:
            header: this client's header, or None on a dedicated server (it learns the round from
                the clients' common header).
            num_clients: client world ranks (they come first in the group).
            participant_for: the participant that runs the round named by a header (a client's
                own, or a server's part of the header's batch).
            tensors: the client's ``(q, k, v)`` (forward), ``(q, k, v, out, lse, dout)``
                (stateless backward) or ``(dout,)`` (kept backward) rows; empty on a dedicated
                server.
            header_timeout_s: how long to wait for the header (servers wait for the next round
                much longer than for data inside a round); default the member's timeout. The wait
                ends early when the epoch's arbitration opens.

        Returns:
            What the participant's round returns: ``(out, lse)`` or ``(dq, dk, dv)`` on a client,
            None on a dedicated server.

        Raises:
            DistCAError: not in a group (an earlier round failed; a new step forms a new one).
            GroupFailure: the round failed anywhere (clients disagreeing on the round, parts that
                disagree, a lost, late or slow peer, the scheduler's death); the group is left
                and the failure reported.
            Superseded: a newer epoch was assigned while waiting for the header, or the member
                was closed during the round (the group is left).
        """
        transport, epoch = self.transport, self.epoch
        if transport is None:
            what = header.describe() if header is not None else "the next round"
            raise DistCAError(f"{self.who} has no group for {what} (a previous round failed; "
                              f"start a new step)")
        step = header.step if header is not None else -1
        what = header.describe() if header is not None else "the next round"
        self.round_since = time.monotonic()  # before in_round (as in join)
        self.in_round = True
        try:
            if self.tag_rounds and header is not None and num_clients == self.world_size:
                participant = participant_for(header)
                if participant.installed(transport, header.kind):
                    return self._tagged_round(participant, transport, header, tensors, epoch)
            own = None
            if header is not None:
                own = claims(participant_for(header), header.kind)
            rows = self._header(transport, header, own, header_timeout_s, epoch)
            group = self._group
            if group is not None and group.transport is transport:
                group.settled()  # every member attached
            common = common_header(rows, num_clients)
            step, what = common.step, common.describe()
            participant = participant_for(common)
            check_claims(common, rows, participant, self.world_rank)
            result = run_participant(participant, transport, common, tensors)
            self.rounds_done += 1
            return result
        except _Abandoned as exc:
            if str(exc) in ("superseded", "closed"):
                self.leave()
                raise Superseded(f"{self.who}: group epoch {epoch} was {exc}") from None
            raise self.fail(step, what, None) from None
        except (DistCAError, ValueError, RuntimeError) as exc:
            with self._cond:
                why = self._abandoned.get(epoch)
            if isinstance(exc, DistCAError) and why == "closed":
                # this member was stopped on another thread, which ended the exchange: not a
                # failure of the group's. (A superseded one still checks in: its epoch's
                # verdict must not wait for it and name it lost.)
                self.leave()
                raise Superseded(f"{self.who}: group epoch {epoch} was {why}") from None
            raise self.fail(step, what, str(exc), detected=isinstance(exc, ValueError)) from None
        finally:
            self.in_round = False

    def _tagged_round(self, participant, transport, header: RoundHeader, tensors, epoch: int):
        """An in-place round whose exchanges both run device-driven (their routes installed, in a
        round that exchanged and checked its header): no header exchange, which would hold the
        host until every peer reached the round. What it checked still holds: the routes name
        the plan, so the parts and claims it compared are the same; the rest of the round (step,
        sequence number, kind, dtype, softmax scale, kept key) goes as :attr:`RoundHeader.tag`
        in every report row, and a receiver whose peer ran another round fails it with
        ``ValueError``. Every member decides alike whether a round is tagged: routes install
        and uninstall alike on every participant."""
        with self._cond:
            if epoch in self._abandoned:
                raise _Abandoned(self._abandoned[epoch])
        result = run_participant(participant, transport.tagged(header.tag), header, tensors)
        self.rounds_done += 1
        self.tagged_rounds += 1
        return result

    def _header(self, transport, header, own, timeout_s, epoch):
        """The header exchange on the helper thread, waited for until it ends or the epoch is
        abandoned."""
        with self._cond:
            if epoch in self._abandoned:
                raise _Abandoned(self._abandoned[epoch])
        future = self._headers.submit(exchange_header, transport, header, own, timeout_s)

        def wake(_):
            with self._cond:
                self._cond.notify_all()
        future.add_done_callback(wake)
        with self._cond:
            while not future.done() and epoch not in self._abandoned:
                self._cond.wait()
            if epoch in self._abandoned:
                if not future.done():  # it stays blocked: later headers need a thread of their own
                    self._pending = (transport, future)
                    self._headers.shutdown(wait=False)
                    self._headers = ThreadPoolExecutor(max_workers=1,
                                                       thread_name_prefix=f"distca-header-{self.who}")
                raise _Abandoned(self._abandoned[epoch])
        return future.result()

    # ---- failures ----------------------------------------------------------------------------------
    def fail(self, step: int, what: str, detail: str | None, *, detected: bool = False,
             in_round: bool = True) -> GroupFailure:
        """Leave the group, check in to the epoch's failure with the scheduler (``detail``: what
        went wrong here; ``detected``: a finding of this member's own, e.g. parts that disagree)
        and wait for its verdict; returns it as a :class:`GroupFailure` for the caller to raise or
        record."""
        epoch, world_rank, reached = self.epoch, self.world_rank, self.rounds_done + (1 if in_round else 0)
        detail = _terse(detail) if detail else detail
        verdict = self._verdicts.get(epoch)
        # Check in before leaving: this member's cause and progress reach the verdict ahead of
        # what its leaving makes its peers see (a closed connection).
        if verdict is None and not self.scheduler_lost:
            try:
                verdict = ask(self.scheduler.report_failure.remote(
                    epoch, world_rank, step, reached, detail, detected, in_round,
                    self.waited_s if in_round else None), self.timeout_s)
            except SchedulerLost:
                self._scheduler_gone()
            except DistCAError as exc:  # the scheduler is slow: name it
                verdict = {"lost": [f"the scheduler ({exc})"], "next_step": step + 1,
                           "cause": detail or "", "detected": detected}
        self.leave()
        if verdict is None or self.scheduler_lost:
            return GroupFailure(f"{self.who}: {what} failed: the job's scheduler died (it restarts if the "
                                f"job allows); every participant fails this step. "
                                f"{('Cause: ' + detail[:300]) if detail else ''}".rstrip(),
                                [], step + 1, detail or "scheduler died", detected)
        self._verdicts[epoch] = verdict
        cause = verdict.get("cause") or detail or ""
        return GroupFailure(f"{self.who}: {what} failed; lost: {lost_text(verdict)}. Cause: {cause[:400]}",
                            list(verdict["lost"]), int(verdict["next_step"]), cause,
                            bool(verdict.get("detected")))

    def poll(self, epoch: int, poll_s: float = POLL_S) -> None:
        """One long-poll of the scheduler about group ``epoch`` (returns within ``poll_s``, or as
        soon as this member moves to another epoch). If its arbitration opened, stop waiting for
        its rounds and check in (how far this member got), keeping the verdict for the member's
        own failure report.

        Raises:
            SchedulerLost: the scheduler died, or answers as another incarnation (it restarted):
                this member's epoch is abandoned and its owner must register again.
        """
        incarnation = self.scheduler_incarnation
        ref = self.scheduler.watch.remote(epoch, poll_s)
        deadline = time.monotonic() + poll_s + self.timeout_s
        while not ray.wait([ref], timeout=_WAKE_S)[0]:
            if self.watch_epoch != epoch or time.monotonic() > deadline:
                return  # moved on (the caller polls the new epoch), or the scheduler is slow
        try:
            reply = ask(ref, self.timeout_s)
        except SchedulerLost:
            # A poll of the scheduler that died may fail only after the owner found that out
            # itself and registered with its successor (a client's next report does): the death
            # is old news then, and must not fail the epoch the member has joined since.
            if self.scheduler_incarnation != incarnation:
                return
            self._scheduler_gone()
            raise
        except DistCAError:
            return
        if self.scheduler_incarnation is not None and reply["scheduler"] != self.scheduler_incarnation:
            self._scheduler_gone()
            raise SchedulerLost("the distca scheduler restarted")
        if reply["state"] is None or epoch in self._verdicts or self.epoch != epoch:
            return
        self.abandon(epoch, "the group's arbitration opened")
        try:
            verdict = ask(self.scheduler.report_failure.remote(
                epoch, self.world_rank, -1, self.reached, None, False, self.in_round, self.waited_s), self.timeout_s)
        except SchedulerLost:
            self._scheduler_gone()
            raise
        except DistCAError:
            return
        self._verdicts.setdefault(epoch, verdict)
        for old in [e for e in self._verdicts if e < epoch - 2]:
            del self._verdicts[old]

    def _watch_epoch(self, epoch: int) -> None:
        """A client's watcher: poll while the member is in ``epoch``."""
        while self._live == epoch:
            try:
                self.poll(epoch)
            except SchedulerLost:
                return
            if epoch in self._verdicts:
                return

    def _scheduler_gone(self) -> None:
        self.scheduler_lost = True
        self.abandon(self.epoch, "the scheduler died")

    def decided(self, epoch: int) -> bool:
        """Whether this member holds the verdict of group ``epoch``'s failure."""
        return epoch in self._verdicts

    @property
    def watch_epoch(self) -> int:
        """The epoch to poll the scheduler about: this member's, or -1 (a heartbeat) if it has
        none or its verdict is already known."""
        epoch = self.epoch
        return -1 if epoch is None or epoch in self._verdicts else epoch

    @property
    def stuck(self) -> bool:
        """In a round of an abandoned epoch: over gloo, a data exchange that only its timeout
        ends (a routed transport's exchanges end when the epoch is abandoned)."""
        return self.in_round and self.epoch in self._abandoned

    def _lookup(self, epoch: int):
        value = ask(self.scheduler.bootstrap.remote(epoch), self.timeout_s + 5)
        if value is None:
            raise DistCAError(f"no bootstrap value for group epoch {epoch} within {self.timeout_s:g} s")
        return value
