"""The scheduler's per-step state machine, pure: no Ray, no asyncio, no threads, no clock it reads.

:class:`Coordinator` holds everything the job's scheduler decides; the Ray ``SchedulerActor``
(:mod:`scheduler.actor`) only wraps it with awaits, timeouts, pings and ``.remote()`` calls. Each
call is one state transition that returns plain data telling the wrapper what to hand out:

- membership: :meth:`~Coordinator.register_client`, :meth:`~Coordinator.unregister_client`,
  :meth:`~Coordinator.register_server`, :meth:`~Coordinator.servers_pinged`;
- one step: :meth:`~Coordinator.report` (one per client per ``(step, batch)``) says when all
  clients of a batch reported; :meth:`~Coordinator.plan` then plans it over the live servers and
  cuts every participant's part (its pure work, :meth:`~Coordinator.plan_work`, can run apart,
  e.g. on a worker thread, and be handed to :meth:`~Coordinator.plan`);
  :meth:`~Coordinator.answer`, :meth:`~Coordinator.abort` (a timeout or any other reason to give
  up on a batch);
- group epochs: :meth:`~Coordinator.epoch_for` keeps the group or forms a new epoch when
  membership or the device type changes (world ranks: clients first, then dedicated servers in
  plan order); :meth:`~Coordinator.publish_store` / :meth:`~Coordinator.store_address` relay each
  epoch's rendezvous address;
- failures: :meth:`~Coordinator.failure` and :meth:`~Coordinator.close_failure` decide who was
  lost in a failed epoch (the silent members, once all others reported or the grace period ended).

Deadlines are computed from a ``now`` the caller passes (any monotonic clock). The only clock
read here is ``timer`` (``time.perf_counter`` unless given), which measures how long planning
and cutting took for the record of the last plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

from .checks import finite_nonnegative, is_int, positive_int
from .cost import CostModel
from .parts import plan_parts
from .planner import plan_batch
from .tasks import MODES, Plan

DEVICE_TYPES = ("cpu", "cuda")
_KEEP_STEPS = 2  # batches of steps older than (last planned step - _KEEP_STEPS) are forgotten
KEEP_EPOCHS = 2  # rendezvous addresses and failure verdicts of older epochs are forgotten
PLANS_KEPT = 16  # whole plans kept for plan_descriptor (clients read them lazily, for last_plan)


def error_answer(kind: str, message: str) -> dict:
    """A report's error answer: ``kind`` is ``"ValueError"`` (bad input) or ``"DistCAError"``."""
    return {"error": kind, "message": message}


@dataclass(frozen=True)
class ReportOutcome:
    """What :meth:`Coordinator.report` tells the wrapper.

    Attributes:
        answer: the reporting client's answer if it is known now (an error, or the part of a batch
            already planned), else None: wait until the batch is resolved, then :meth:`answer`.
        plan: True exactly once per batch, when the last client reported and the shapes agree:
            find the live servers and call :meth:`Coordinator.plan`.
        resolved: this call resolved the batch (an error for every client): wake its waiters.
    """

    answer: dict | None = None
    plan: bool = False
    resolved: bool = False


@dataclass(frozen=True)
class Assignment:
    """A dedicated server's place in a new group epoch (``AttentionServer.assign``'s arguments)."""

    server: int
    epoch: int
    world_rank: int
    world_size: int
    plan_index: int
    device_type: str


@dataclass(frozen=True)
class EpochDecision:
    """The group a batch runs in: ``epoch``, its dedicated ``servers`` in plan order, and the
    ``assignments`` to send (non-empty only when this decision formed a new epoch)."""

    epoch: int
    servers: tuple[int, ...]
    assignments: tuple[Assignment, ...] = ()


@dataclass
class PlanOutcome:
    """What :meth:`Coordinator.plan` tells the wrapper.

    Attributes:
        resolved: the batch got its answers now (parts or an error): wake its waiters.
        assignments: new-epoch assignments to send to dedicated servers, before their parts.
        server_parts: ``(server id, part bytes)`` to install on each dedicated server.
        record: the record of this plan (also :attr:`Coordinator.last`), or None if none was made.
    """

    resolved: bool = False
    assignments: tuple[Assignment, ...] = ()
    server_parts: list[tuple[int, bytes]] = field(default_factory=list)
    record: dict | None = None


@dataclass(frozen=True)
class PlanCut:
    """The pure work of :meth:`Coordinator.plan`: the batch's plan and every participant's part
    bytes, with the milliseconds planning and cutting took; or the ``ValueError`` message the
    documents raised (``plan`` None)."""

    plan: Plan | None
    parts: list[bytes]
    plan_ms: float = 0.0
    cut_ms: float = 0.0
    error: str | None = None


def _plan_and_cut(doc_lens_per_rank, num_servers, cost, epsilon, mode, min_shard, step, batch,
                  timer) -> PlanCut:
    try:
        start = timer()
        plan = plan_batch(doc_lens_per_rank, num_servers, cost=cost, epsilon=epsilon, mode=mode,
                          min_shard=min_shard)
        planned = timer()
        parts = [p.to_msgpack() for p in plan_parts(plan, step, batch)]
        cut = timer()
    except ValueError as exc:  # bad documents: every client of the batch gets the same error
        return PlanCut(None, [], error=str(exc))
    return PlanCut(plan, parts, (planned - start) * 1e3, (cut - planned) * 1e3)


@dataclass(frozen=True)
class FailureOutcome:
    """What :meth:`Coordinator.failure` tells the wrapper: the ``verdict`` (``{"lost": [...],
    "next_step": int}``) if it is decided, else None; then wait until ``deadline`` (on the
    caller's clock) or until another call decides it, and call :meth:`Coordinator.close_failure`."""

    verdict: dict | None
    deadline: float


class _Batch:
    __slots__ = ("reports", "shape", "answers")

    def __init__(self):
        self.reports: dict[int, tuple] = {}  # rank -> (doc_lens, shape)
        self.shape: tuple[CostModel, str] | None = None  # agreed once all reported
        self.answers: dict[int, dict] | None = None  # set once resolved


class _Failure:
    __slots__ = ("members", "reported", "deadline", "lost")

    def __init__(self, members: dict[int, str], deadline: float):
        self.members = members  # world rank -> description
        self.reported: set = set()
        self.deadline = deadline
        self.lost: list[str] | None = None  # the verdict, once decided


class Coordinator:
    """The scheduler of job ``name``: membership, plans, group epochs, failure verdicts.

    Args:
        name: job name (in messages).
        mode: ``"dedicated"`` (attention servers are separate processes) or ``"inplace"``.
        epsilon, min_shard: planner settings (see :func:`scheduler.plan_batch`).
        timeout_s: how long clients wait for each other (the wrapper's timeouts; in messages).
        failure_grace_s: after the first failure report of an epoch, how long the others have to
            report before the silent ones are named lost.
        backend: attention kernel backend name handed to clients.
        timer: clock for measuring planning and cutting (seconds; default ``time.perf_counter``).

    Raises:
        ValueError: a mode other than ``"dedicated"`` or ``"inplace"``, a bad ε or ``min_shard``.
    """

    def __init__(self, name: str, mode: str = "dedicated", epsilon: float = 0.05, min_shard: int = 128,
                 timeout_s: float = 60.0, failure_grace_s: float = 2.0, backend: str = "auto",
                 timer: Callable[[], float] = time.perf_counter):
        if mode not in MODES:
            raise ValueError(f"mode must be 'dedicated' or 'inplace', got {mode!r}")
        finite_nonnegative("epsilon", epsilon)
        positive_int("min_shard", min_shard)
        self.name, self.mode, self.epsilon, self.min_shard = name, mode, epsilon, min_shard
        self.timeout_s, self.failure_grace_s, self.backend = timeout_s, failure_grace_s, backend
        self.timer = timer
        self.world_size: int | None = None
        self.clients: dict[int, dict] = {}
        self.servers: dict[int, dict] = {}  # server id -> info + "state" ("alive" | "dead")
        self.epoch = -1
        self.members: tuple | None = None  # who the current epoch is made of; None: form anew
        self.epoch_servers: tuple[int, ...] = ()  # server ids of the current epoch, in plan order
        self.batches: dict[tuple[int, int], _Batch] = {}
        self.stores: dict[int, tuple[str, int]] = {}
        self.failures: dict[int, _Failure] = {}
        self.next_step = 0
        self.steps_planned = 0
        self.last: dict = {}
        self.plans: dict[tuple[int, int], Plan] = {}  # (step, batch) -> plan, the newest PLANS_KEPT

    # ---- membership --------------------------------------------------------------------------
    def register_client(self, rank: int, world_size: int, info: dict) -> dict:
        """Client ``rank`` of ``world_size`` joins (or rejoins after a restart with a new
        ``info["incarnation"]``, which makes the next batch form a new epoch).

        Returns:
            ``{"name", "mode", "timeout_s", "backend", "next_step"}``: the job's settings and the
            step the client must start at.

        Raises:
            ValueError: rank out of range or a world size other than the job's.
        """
        positive_int("world_size", world_size)
        if self.world_size is None:
            self.world_size = int(world_size)
        elif world_size != self.world_size:
            raise ValueError(f"job {self.name!r} has {self.world_size} clients, not {world_size}")
        if not is_int(rank) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
        self.clients[int(rank)] = dict(info, rank=int(rank))
        return {"name": self.name, "mode": self.mode, "timeout_s": self.timeout_s,
                "backend": self.backend, "next_step": self.next_step}

    def unregister_client(self, rank: int, incarnation: str) -> None:
        """Client ``rank`` leaves, unless a newer incarnation already took its place."""
        if self.clients.get(rank, {}).get("incarnation") == incarnation:
            del self.clients[rank]

    def register_server(self, index: int, info: dict) -> None:
        """Dedicated server ``index`` (re)starts; it joins the next group epoch.

        Raises:
            ValueError: ``index`` not an int >= 0.
        """
        if not is_int(index) or index < 0:
            raise ValueError(f"server index must be an int >= 0, got {index!r}")
        self.servers[int(index)] = dict(info, index=int(index), state="alive")

    def servers_to_ping(self) -> list[int]:
        """Ids of the servers not yet known dead, ascending: the wrapper pings these."""
        return sorted(i for i, s in self.servers.items() if s["state"] == "alive")

    def servers_pinged(self, alive: dict[int, bool]) -> list[int]:
        """Record ping results (server id -> answered); returns the live ids, ascending.
        A server that did not answer is dead until it registers again."""
        for sid, ok in alive.items():
            if not ok and sid in self.servers:
                self.servers[sid]["state"] = "dead"
        return sorted(sid for sid, ok in alive.items() if ok and sid in self.servers
                      and self.servers[sid]["state"] == "alive")

    # ---- group epochs ------------------------------------------------------------------------
    def epoch_for(self, live_servers, device_type: str) -> EpochDecision:
        """The group for the next batch: the current epoch if nobody joined, left or restarted
        and the device type is the same, else a new epoch.

        Args:
            live_servers: dedicated server ids that answered, in plan order (ignored in-place).
            device_type: ``"cpu"`` or ``"cuda"`` (the transport's backend follows it).
        """
        servers = tuple(live_servers) if self.mode == "dedicated" else ()
        W = self.world_size or 0
        clients = tuple(self.clients.get(r, {}).get("incarnation") for r in range(W))
        members = (clients, tuple((sid, self.servers.get(sid, {}).get("incarnation")) for sid in servers),
                   device_type)
        if members == self.members:
            return EpochDecision(self.epoch, self.epoch_servers)
        self.epoch += 1
        self.members, self.epoch_servers = members, servers
        for old in [e for e in self.stores if e < self.epoch - KEEP_EPOCHS]:
            del self.stores[old]
        for old in [e for e in self.failures if e < self.epoch - KEEP_EPOCHS]:
            del self.failures[old]
        world = W + len(servers)
        return EpochDecision(self.epoch, servers, tuple(
            Assignment(sid, self.epoch, W + i, world, i, device_type) for i, sid in enumerate(servers)))

    def publish_store(self, epoch: int, host: str, port: int) -> None:
        """World rank 0 of group ``epoch`` publishes its rendezvous address."""
        self.stores[epoch] = (host, port)

    def store_address(self, epoch: int) -> tuple[str, int] | None:
        """The rendezvous address of group ``epoch``, or None while none was published."""
        return self.stores.get(epoch)

    # ---- one step ----------------------------------------------------------------------------
    def report(self, step: int, batch: int, rank: int, doc_lens, shape) -> ReportOutcome:
        """Client ``rank``'s documents and attention shape for ``(step, batch)``.

        ``shape`` is ``{"cost": CostModel.to_wire(), "device_type": "cpu" | "cuda"}``. When the
        last client of the batch reports, every shape is checked and compared: a bad or
        disagreeing one resolves the batch with a ``ValueError`` answer for every client. A
        repeated identical report is the same report; a different one gets a ``ValueError``
        answer of its own (the batch goes on with the first). An unregistered rank gets a
        ``DistCAError`` answer. Document lengths are checked by :meth:`plan`.
        """
        if self.world_size is None or not is_int(rank) or rank not in self.clients:
            return ReportOutcome(error_answer("DistCAError", f"rank {rank} is not registered with job {self.name!r}"))
        if not (is_int(step) and step >= 0 and is_int(batch) and batch >= 0):
            return ReportOutcome(error_answer("ValueError", f"step and batch must be ints >= 0, got "
                                                            f"step={step!r}, batch={batch!r}"))
        key = (int(step), int(batch))
        state = self.batches.get(key)
        if state is None:
            state = self.batches[key] = _Batch()
        if rank in state.reports:
            if not _same(state.reports[rank], (doc_lens, shape)):
                return ReportOutcome(error_answer(
                    "ValueError", f"rank {rank} reported step {step} batch {batch} twice with different "
                                  f"documents or attention shape"))
            return ReportOutcome(state.answers[rank] if state.answers is not None else None)
        if state.answers is not None:  # given up before this client reported (timeout, abort)
            return ReportOutcome(state.answers[rank])
        state.reports[rank] = (doc_lens, shape)
        if len(state.reports) < self.world_size:
            return ReportOutcome()
        try:
            state.shape = _agreed_shape(state.reports)
        except ValueError as exc:  # bad input: every client of the batch gets the same error
            self._resolve(key, state, error_answer("ValueError", str(exc)))
            return ReportOutcome(state.answers[rank], resolved=True)
        return ReportOutcome(plan=True)

    def plan_work(self, step: int, batch: int, live_servers=None) -> Callable[[], PlanCut] | None:
        """The pure work of :meth:`plan` (plan the batch, cut and encode its parts) as a call that
        reads no coordinator state, or None when :meth:`plan` has nothing to compute. A wrapper
        runs it off its event loop and passes the result to :meth:`plan`."""
        state = self.batches.get((step, batch))
        if state is None or state.answers is not None or state.shape is None:
            return None
        servers = list(live_servers or ()) if self.mode == "dedicated" else []
        if self.mode == "dedicated" and not servers:
            return None
        W = self.world_size
        return partial(_plan_and_cut, [state.reports[r][0] for r in range(W)],
                       len(servers) if servers else W, state.shape[0], self.epsilon, self.mode,
                       self.min_shard, step, batch, self.timer)

    def plan(self, step: int, batch: int, live_servers=None, cut: PlanCut | None = None) -> PlanOutcome:
        """Plan a fully reported batch over ``live_servers`` (dedicated mode: server ids that
        answered a ping, in plan order; ignored in-place), keep or form the group epoch and cut
        every participant's part. Does nothing for a batch that is not ready or already resolved.
        ``cut``: the result of :meth:`plan_work` for the same arguments, if already computed.

        Every client's answer becomes ``{"part": bytes, "group": {"epoch", "world_rank",
        "world_size", "device_type"}}``; bad documents give every client the same ``ValueError``
        answer, no live server a ``DistCAError`` answer.
        """
        key = (step, batch)
        state = self.batches.get(key)
        if state is None or state.answers is not None or state.shape is None:
            return PlanOutcome()
        cost, device_type = state.shape
        servers = list(live_servers or ()) if self.mode == "dedicated" else []
        if self.mode == "dedicated" and not servers:
            self._resolve(key, state, error_answer("DistCAError", f"job {self.name!r} has no live attention server"))
            return PlanOutcome(resolved=True)
        W = self.world_size
        if cut is None:
            cut = self.plan_work(step, batch, live_servers)()
        if cut.error is not None:
            self._resolve(key, state, error_answer("ValueError", cut.error))
            return PlanOutcome(resolved=True)
        plan, parts = cut.plan, cut.parts
        self.plans[key] = plan
        while len(self.plans) > PLANS_KEPT:
            del self.plans[next(iter(self.plans))]
        decision = self.epoch_for(servers, device_type)
        group = {"epoch": decision.epoch, "world_size": plan.num_participants, "device_type": device_type}
        self._resolve(key, state, None, {r: {"part": parts[r], "group": dict(group, world_rank=r)}
                                         for r in range(W)})
        record = self._record(plan, step, batch, servers, cut.plan_ms, cut.cut_ms)
        return PlanOutcome(resolved=True, assignments=decision.assignments,
                           server_parts=[(sid, parts[W + i]) for i, sid in enumerate(servers)],
                           record=record)

    def plan_descriptor(self, step: int, batch: int) -> bytes | None:
        """The whole plan of ``(step, batch)`` as msgpack, or None once it is no longer kept."""
        plan = self.plans.get((step, batch))
        return None if plan is None else plan.to_msgpack()

    def answer(self, step: int, batch: int, rank: int) -> dict:
        """Client ``rank``'s answer for a resolved batch (a ``DistCAError`` answer if the batch is
        unknown, forgotten or still open)."""
        state = self.batches.get((step, batch))
        if state is None or state.answers is None or rank not in state.answers:
            return error_answer("DistCAError", f"step {step} batch {batch} has no answer for rank {rank}")
        return state.answers[rank]

    def abort(self, step: int, batch: int, rank: int, message: str | None = None) -> dict:
        """Give up on ``(step, batch)``: every client gets a ``DistCAError`` answer (the wrapper
        calls this when client ``rank``'s wait timed out, or when planning failed unexpectedly).
        A batch already resolved keeps its answers. Returns client ``rank``'s answer.

        The default message names the clients that never reported.
        """
        key = (step, batch)
        state = self.batches.get(key)
        if state is None:
            state = self.batches[key] = _Batch()
        if state.answers is None:
            if message is None:
                missing = sorted(set(range(self.world_size or 0)) - set(state.reports))
                message = (f"step {step} batch {batch}: ranks {missing} did not report within "
                           f"{self.timeout_s:g} s" if missing else
                           f"step {step} batch {batch} was not planned within {self.timeout_s:g} s")
            self._resolve(key, state, error_answer("DistCAError", message))
        return state.answers.get(rank) or error_answer("DistCAError", f"rank {rank} is not in job {self.name!r}")

    def _resolve(self, key, state: _Batch, error: dict | None, answers: dict | None = None) -> None:
        W = self.world_size or 0
        state.answers = answers if answers is not None else {r: error for r in range(W)}
        step = key[0]
        self.next_step = max(self.next_step, step + 1)
        for old in [k for k in self.batches if k[0] < step - _KEEP_STEPS]:
            del self.batches[old]

    def _record(self, plan: Plan, step, batch, servers, plan_ms: float, cut_ms: float) -> dict:
        before, after = plan.imbalance()
        comm = plan.comm_bytes()
        loads = plan.server_loads()
        tasks = plan.server_task_counts()
        ids = servers if self.mode == "dedicated" else list(range(plan.num_servers))
        self.steps_planned += 1
        self.last = {"step": step, "batch": batch, "imbalance_before": before, "imbalance_after": after,
                     "plan_ms": plan_ms, "cut_ms": cut_ms, "bytes": {k: comm[k]["total"] for k in comm},
                     "server_flops": dict(zip(ids, loads)), "server_tasks": dict(zip(ids, tasks)),
                     "num_tasks": sum(tasks), "epoch": self.epoch}
        return self.last

    # ---- failures ----------------------------------------------------------------------------
    def failure(self, epoch: int, world_rank: int, step: int, now: float) -> FailureOutcome:
        """World rank ``world_rank`` of group ``epoch`` had a round fail during ``step``.

        The first report of an epoch opens its arbitration (deadline ``now + failure_grace_s``).
        When every member has reported, the verdict is decided in this same call (nobody lost).
        A report for an epoch that is not the current one is answered at once, naming nobody.
        Every verdict ends the epoch: the next batch forms a new group.
        """
        self.next_step = max(self.next_step, step + 1)
        fail = self.failures.get(epoch)
        if fail is None:
            fail = self.failures[epoch] = _Failure(self._describe_members(epoch), now + self.failure_grace_s)
            if not fail.members:  # not the current group: nobody to wait for, nothing to end
                fail.lost = []
        if fail.lost is None:
            fail.reported.add(world_rank)
            if fail.reported >= set(fail.members):
                self._decide(epoch, fail)
        return FailureOutcome(self._verdict(fail), fail.deadline)

    def close_failure(self, epoch: int, now: float) -> dict | None:
        """The verdict of group ``epoch``'s failure: decided now if the grace period is over
        (``now >= deadline``; the silent members are lost), else None (still waiting)."""
        fail = self.failures.get(epoch)
        if fail is None:
            return {"lost": [], "next_step": self.next_step}
        if fail.lost is None and now >= fail.deadline:
            self._decide(epoch, fail)
        return self._verdict(fail)

    def _decide(self, epoch: int, fail: _Failure) -> None:
        fail.lost = [desc for r, desc in sorted(fail.members.items()) if r not in fail.reported]
        if epoch == self.epoch:
            self.members = None  # whatever happened, the next batch forms a fresh group

    def _verdict(self, fail: _Failure) -> dict | None:
        return None if fail.lost is None else {"lost": list(fail.lost), "next_step": self.next_step}

    def _describe_members(self, epoch: int) -> dict[int, str]:
        if epoch != self.epoch or self.members is None:
            return {}
        W = self.world_size
        out = {r: f"client rank {r} (node {self.clients.get(r, {}).get('node', '?')})" for r in range(W)}
        for plan_index, sid in enumerate(self.epoch_servers):
            out[W + plan_index] = f"attention server {sid} (node {self.servers.get(sid, {}).get('node', '?')})"
        return out

    # ---- inspection --------------------------------------------------------------------------
    def status(self) -> dict:
        """Job state for ``distca status``: settings, clients, epoch, last plan, and one row per
        server (``rounds_served`` is None here: the wrapper asks live servers for it)."""
        servers = [{"server": sid, "node": s.get("node", "?"), "state": s["state"], "rounds_served": None,
                    "last_flops": self.last.get("server_flops", {}).get(sid),
                    "last_tasks": self.last.get("server_tasks", {}).get(sid)}
                   for sid, s in sorted(self.servers.items())]
        return {"name": self.name, "mode": self.mode, "world_size": self.world_size,
                "clients": sorted(self.clients), "epoch": self.epoch, "next_step": self.next_step,
                "steps_planned": self.steps_planned, "last": self.last, "servers": servers}


def _same(a, b) -> bool:
    """``a == b`` for reports; anything that cannot be compared counts as different."""
    try:
        return bool(a == b)
    except Exception:  # e.g. arrays, whose == is elementwise
        return False


def _agreed_shape(reports: dict[int, tuple]) -> tuple[CostModel, str]:
    """The one ``(CostModel, device_type)`` all reports carry.

    Raises:
        ValueError: a shape that is not ``{"cost": [4 ints], "device_type": "cpu" | "cuda"}``
            (naming the rank), or clients that disagree (naming which ranks sent what).
    """
    by_shape: dict[tuple, list[int]] = {}
    for rank in sorted(reports):
        shape = reports[rank][1]
        if not isinstance(shape, dict) or set(shape) != {"cost", "device_type"}:
            raise ValueError(f"rank {rank}: the attention shape must be a dict with keys 'cost' and "
                             f"'device_type', got {shape!r}")
        try:
            cost = CostModel.from_wire(shape["cost"])
        except ValueError as exc:
            raise ValueError(f"rank {rank}: {exc}") from None
        if shape["device_type"] not in DEVICE_TYPES:
            raise ValueError(f"rank {rank}: device_type must be one of {DEVICE_TYPES}, got {shape['device_type']!r}")
        by_shape.setdefault((cost, shape["device_type"]), []).append(rank)
    if len(by_shape) != 1:
        sent = "; ".join(f"ranks {ranks} sent {{'cost': {c.to_wire()}, 'device_type': {d!r}}}"
                         for (c, d), ranks in by_shape.items())
        raise ValueError(f"clients disagree on the attention shape: {sent}")
    (shape, _), = by_shape.items()
    return shape


__all__ = ["Assignment", "Coordinator", "DEVICE_TYPES", "KEEP_EPOCHS", "EpochDecision", "FailureOutcome", "PlanOutcome",
           "ReportOutcome", "error_answer"]
