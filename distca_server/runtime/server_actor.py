"""``AttentionServer``: a dedicated attention server as a Ray actor.

A background thread serves rounds: it joins the group epoch the scheduler assigns (through
:class:`~distca_server.runtime.member.GroupMember`, as the clients do), waits for the round
header, finds the step's part (pushed by the scheduler), runs the server's CA-tasks as one fused
kernel call and sends the results back. With a kept-activation plan it keeps each forward round's
rows and results (per step, batch and round key) until that layer's backward round, which then
receives only dO; kept activations are dropped when their backward round ends, when a round of
the epoch fails, and when a later step begins. Otherwise it keeps no state between rounds. Method calls (``ping``, ``assign``, ``install_part``, ``stats``) run on
other threads of the actor, so the job can be inspected while a round is in flight.

A second thread keeps the server in touch with the scheduler: it long-polls it about the server's
epoch (so a failure anywhere in the group stops the server's wait for the next round at once, and
the server checks in to the arbitration), and when the scheduler dies it re-registers with the
restarted one. A newer epoch's assignment also ends the wait for the old epoch's next round.

Each round served counts in the server's metrics (``distca_rounds_served`` and
``distca_server_bytes_sent`` by round kind, see :mod:`scheduler.metrics`); joins, failures and
re-registrations are logged (:mod:`scheduler.logs`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict

import ray
import torch

from scheduler.actor import NAMESPACE, ray_metrics, scheduler_actor_name
from scheduler.logs import configure_logging
from scheduler.metrics import JOB_LABEL
from scheduler.parts import PlanPart

from ..errors import DistCAError
from ..kernels import get_backend
from ..participant import Participant
from ..wire import RowFormat
from .base import as_traffic, sum_traffic
from .member import POLL_S, REGISTER_TIMEOUT_S, GroupFailure, GroupMember, SchedulerLost, Superseded

_PARTS_KEPT = 8
_REGISTER_RETRY_S = 0.5  # while the scheduler is restarting, try to register again this often
log = logging.getLogger(__name__)


class AttentionServer:
    """Serves CA-tasks of job ``name`` as server ``index`` (plan index assigned per group epoch).

    Args:
        name: the job (its scheduler actor is ``distca-scheduler-<name>``).
        index: this server's id in the job.
        timeout_s: deadline of every exchange inside a round.
        idle_timeout_s: how long the server waits for the next round's header (the clients may be
            busy with everything but attention for a long time).
        backend: attention kernel backend ("auto" picks the fastest on the device).
    """

    def __init__(self, name: str, index: int, timeout_s: float = 60.0,
                 idle_timeout_s: float = 3600.0, backend: str = "auto"):
        self.name, self.index, self.timeout_s = name, index, timeout_s
        self.idle_timeout_s, self.backend_name = idle_timeout_s, backend
        configure_logging(f"distca-server-{name}-{index}")
        self.scheduler = ray.get_actor(scheduler_actor_name(name), namespace=NAMESPACE)
        self.node = ray.util.get_node_ip_address()
        self.incarnation = f"{os.getpid()}-{time.time_ns()}"
        self._cond = threading.Condition()
        self._assignment: tuple | None = None
        self._parts: OrderedDict = OrderedDict()
        self._stop = False
        self.state = "waiting"
        self.rounds_served = 0
        self.phase_seconds: dict[str, float] = {}  # pack / all_to_all / kernel / unpack, all rounds
        self.traffic: dict[str, dict[str, int]] = {}  # bytes sent to other participants, all rounds
        self._retired_seconds: dict[str, float] = {}
        self._retired_traffic: dict[str, dict[str, int]] = {}
        self.last_error = ""
        self.held_bytes = self.peak_held_bytes = 0  # kept activations now, and the most ever held
        self.failures: list[float] = []  # wall-clock times (time.time()) of the failures it saw
        self.member = GroupMember(self.scheduler, self.node, timeout_s, f"server {index}", watch=False, job=name)
        self._metrics = ray_metrics("server")
        self._round_kind = None  # the kind of the round being served (from its common header)
        self._handle = ray.get_runtime_context().current_actor
        self._register()
        log.info("job %s: attention server %d up on node %s (pid %d, backend %s)", name, index, self.node,
                 os.getpid(), backend)
        self._thread = threading.Thread(target=self._serve, name=f"distca-server-{index}", daemon=True)
        self._thread.start()
        threading.Thread(target=self._control, name=f"distca-server-{index}-control", daemon=True).start()

    def _register(self) -> None:
        self.member.scheduler_incarnation = ray.get(self.scheduler.register_server.remote(
            self.index, self._handle, self.describe()), timeout=max(self.timeout_s, REGISTER_TIMEOUT_S))

    def describe(self) -> dict:
        """What the scheduler registers about this server: ``index``, ``node``, ``pid``,
        ``incarnation`` and the last group ``epoch`` it was in (a restarted scheduler numbers
        new epochs past it)."""
        return {"index": self.index, "node": self.node, "pid": os.getpid(), "incarnation": self.incarnation,
                "epoch": self.member.epoch}

    # ---- called by the scheduler and by tools ---------------------------------------------------
    def ping(self) -> bool:
        """True if the server can serve a new epoch now: not stopped, and its serving loop is
        not stuck in a round of a failed epoch (over gloo, only the round's timeout ends one)."""
        return not self._stop and not self.member.stuck

    def assign(self, epoch: int, world_rank: int, world_size: int, plan_index: int, device_type: str,
               transport: str) -> None:
        """Join group ``epoch`` as ``world_rank`` (plan server ``plan_index``) with the job's
        ``transport`` at the next round; a wait for the next round of an older epoch ends now."""
        with self._cond:
            if self._assignment is None or epoch > self._assignment[0]:
                self._assignment = (epoch, world_rank, world_size, plan_index, device_type, transport)
                self._cond.notify_all()
        if self.member.epoch is not None and self.member.epoch < epoch:
            self.member.abandon(self.member.epoch, "superseded")

    def install_part(self, step: int, batch: int, data: bytes) -> bool:
        """Accept this server's descriptor of ``(step, batch)``. A batch's plan never changes, so
        the first part received for it is kept; returns False if one was already held (whether
        parts agree is checked in every round's header).

        Raises:
            ValueError: malformed bytes or a part that is not a server's; the server keeps serving.
        """
        part = PlanPart.from_msgpack(data)
        if part.server is None or (part.step, part.batch) != (step, batch):
            raise ValueError(f"descriptor is for step {part.step} batch {part.batch} server "
                             f"{part.server}, not a server part of step {step} batch {batch}")
        with self._cond:
            if (step, batch) in self._parts:
                return False
            self._parts[(step, batch)] = part
            while len(self._parts) > _PARTS_KEPT:
                self._parts.popitem(last=False)
            self._cond.notify_all()
        return True

    def stats(self) -> dict:
        """The server's counters over every round it served: ``rounds_served``, ``phase_seconds``
        (see :attr:`~distca_server.participant.Participant.timings`), ``traffic`` (bytes sent to
        other participants, ``{round_kind: {tensor: bytes}}``), its state, last error and when it
        saw each failure (``failures``: ``time.time()`` stamps, the last 100), its process id."""
        return {"index": self.index, "node": self.node, "state": self.state, "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id(),
                "rounds_served": self.rounds_served, "last_error": self.last_error,
                "failures": list(self.failures[-100:]),
                "phase_seconds": dict(self.phase_seconds), "traffic": self.traffic,
                "held_bytes": self.held_bytes, "peak_held_bytes": self.peak_held_bytes,
                "assignment": self._assignment}

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self.member.close()

    # ---- in touch with the scheduler ------------------------------------------------------------
    def _control(self) -> None:
        """Long-poll the scheduler about this server's epoch (check in when it fails); when the
        scheduler dies, leave the group and register again with the restarted one."""
        registered = True
        while not self._stop:
            if not registered:
                try:
                    self._register()
                except Exception:  # still restarting (or gone for good): keep trying
                    time.sleep(_REGISTER_RETRY_S)
                    continue
                registered, self.member.scheduler_lost = True, False
                log.info("server %d: registered again with the restarted scheduler", self.index)
            try:
                self.member.poll(self.member.watch_epoch, POLL_S)
            except SchedulerLost:  # its epoch died with it; a new one is numbered past it
                log.warning("server %d: the job's scheduler died; registering again once it is back", self.index)
                registered = False

    # ---- the serving loop -------------------------------------------------------------------------
    def _wait(self, predicate, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._stop:
                value = predicate()
                if value is not None:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(min(left, 1.0))
        return None

    def _newer_assignment(self):
        a = self._assignment
        return a if a is not None and a[0] != self.member.epoch else None

    def _serve(self) -> None:
        member, num_clients, device = self.member, 0, None
        participants: OrderedDict = OrderedDict()
        while not self._stop:
            pending = self._newer_assignment()
            if not member.joined and pending is None:
                pending = self._wait(self._newer_assignment, timeout_s=1.0)
                if pending is None:
                    continue
            if pending is not None:  # a new group epoch: leave the old group, join the new one
                epoch, world_rank, world_size, plan_index, device_type, transport = pending
                num_clients = world_rank - plan_index  # world ranks: clients first, then servers
                device = torch.device("cuda" if device_type == "cuda" else "cpu")
                self.state = f"joining epoch {epoch}"
                log.info("server %d: joining group epoch %d as world rank %d of %d (plan server %d, %s, %s)",
                         self.index, epoch, world_rank, world_size, plan_index, device_type, transport)
                self._retire(participants, keep=0)
                try:
                    member.join(epoch, world_rank, world_size, device, step=-1, transport=transport)
                except GroupFailure as failure:
                    self._failed(failure)
                    continue
            self.state = "serving"
            try:
                member.run_round(None, num_clients,
                                 lambda header: self._participant(header, device, participants),
                                 header_timeout_s=self.idle_timeout_s)
            except Superseded:
                self._release(participants, "the group epoch was superseded")
                continue
            except GroupFailure as failure:
                self._release(participants, f"a round failed: {str(failure)[:200]}")
                self._failed(failure)
                continue
            except DistCAError:  # no group (left after a failure): wait for the next assignment
                continue
            self.rounds_served += 1
            sent = self._count(participants)  # this round's bytes (and a failed round's before it)
            self._note_held(participants)
            tags = {JOB_LABEL: self.name, "server": str(self.index)}
            self._metrics["distca_rounds_served"].inc(tags=dict(tags, round=self._round_kind.value))
            for kind, n in sent.items():
                if n > 0:
                    self._metrics["distca_server_bytes_sent"].inc(n, tags=dict(tags, round=kind))

    def _participant(self, header, device, participants: OrderedDict) -> Participant:
        """The participant of the header's batch, built from its part on first sight."""
        self._round_kind = header.kind
        key = (header.step, header.batch, header.dtype)
        found = participants.get(key)
        if found is not None:
            return found
        for (step, _, _), p in participants.items():  # the clients left those steps
            if step < header.step:
                p.release(f"step {header.step} began")
        part = self._wait(lambda: self._parts.get((header.step, header.batch)), self.timeout_s)
        if part is None:
            raise DistCAError(f"server {self.index}: no descriptor for step {header.step} "
                              f"batch {header.batch} within {self.timeout_s:g} s")
        fmt = RowFormat(part.cost, header.dtype)
        found = participants[key] = Participant(part, fmt, get_backend(self.backend_name, device), device)
        self._retire(participants, keep=_PARTS_KEPT)
        return found

    def _release(self, participants: OrderedDict, why: str) -> None:
        for p in participants.values():
            p.release(why)
        self._note_held(participants)

    def _note_held(self, participants: OrderedDict) -> None:
        self.held_bytes = sum(p.held_bytes() for p in participants.values())
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)

    def _retire(self, participants: OrderedDict, keep: int) -> None:
        """Drop all but the newest ``keep`` participants, keeping their counters in the totals."""
        while len(participants) > keep:
            _, p = participants.popitem(last=False)
            self._retired_seconds = {ph: self._retired_seconds.get(ph, 0.0) + s for ph, s in p.timings.items()}
            self._retired_traffic = sum_traffic([self._retired_traffic, as_traffic(p.traffic)])

    def _count(self, participants: OrderedDict) -> dict[str, int]:
        """Totals over every round served: retired participants' counters plus the live ones'.
        Returns the bytes sent since the last call, by round kind."""
        before = {kind: sum(per.values()) for kind, per in self.traffic.items()}
        seconds = dict(self._retired_seconds)
        for p in participants.values():
            for ph, s in p.timings.items():
                seconds[ph] = seconds.get(ph, 0.0) + s
        self.phase_seconds = seconds
        self.traffic = sum_traffic([self._retired_traffic] + [as_traffic(p.traffic) for p in participants.values()])
        return {kind: sum(per.values()) - before.get(kind, 0) for kind, per in self.traffic.items()}

    def _failed(self, failure: GroupFailure) -> None:
        """The failure is reported (GroupMember did); keep serving once the scheduler assigns a
        new epoch."""
        self.last_error = str(failure)[:500]
        self.failures = self.failures[-99:] + [time.time()]
        log.warning("server %d: %s", self.index, self.last_error)
        self.state = "waiting"


AttentionServerActor = ray.remote(AttentionServer)
