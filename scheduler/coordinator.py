"""The scheduler's per-step state machine, pure: no Ray, no asyncio, no threads, no clock it reads.

:class:`Coordinator` holds everything the job's scheduler decides; the Ray ``SchedulerActor``
(:mod:`scheduler.actor`) only wraps it with awaits, timeouts, pings and ``.remote()`` calls. Each
call is one state transition that returns plain data telling the wrapper what to hand out:

- membership: :meth:`~Coordinator.register_client`, :meth:`~Coordinator.unregister_client`,
  :meth:`~Coordinator.register_server`, :meth:`~Coordinator.servers_pinged`. Registrations carry
  the member's last step and group epoch, so a restarted scheduler rebuilds where the job is from
  its participants re-registering;
- one step: :meth:`~Coordinator.report` (one per client per ``(step, batch)``, bounded in size)
  says when all clients of a batch reported; :meth:`~Coordinator.plan` then plans it over the
  live servers and cuts every participant's part (its pure work,
  :meth:`~Coordinator.plan_work`, can run apart, e.g. on a worker thread, and be handed to
  :meth:`~Coordinator.plan`); :meth:`~Coordinator.answer`,
  :meth:`~Coordinator.abort` (a timeout or any other reason to give up on a batch),
  :meth:`~Coordinator.fail_step` (a client's own bad input: every client gets its ``ValueError``);
- group epochs: :meth:`~Coordinator.epoch_for` keeps the group or forms a new epoch when
  membership or the device type changes (world ranks: clients first, then dedicated servers in
  plan order), only between steps: every batch of a step runs in the group of its first
  (:meth:`~Coordinator.servers_for`; a change within a step fails it);
  :meth:`~Coordinator.publish_bootstrap` / :meth:`~Coordinator.bootstrap` relay each
  epoch's *bootstrap value* from world rank 0 to the others: whatever the job's transport needs
  to form the group (:data:`~scheduler.checks.TRANSPORTS`): the ``TCPStore`` ``[host, port]`` of ``torch_dist``,
  the shared-memory heap's handle of ``shm``, the NVSHMEM unique id's bytes of ``nvshmem``.
  The scheduler reads nothing in it; it only bounds its size (:data:`MAX_BOOTSTRAP_BYTES`);
- failures: :meth:`~Coordinator.failure` and :meth:`~Coordinator.close_failure` decide who was
  lost in a failed epoch. Every member checks in with how far it got (rounds reached in the
  epoch); the lost are the members that did not check in within the grace period and the clients
  that had not reached the round the others failed in (late). The verdict carries the causes the
  members reported, so every participant raises the same message.

Steps (the rule both sides follow is ``docs/design.md`` § "The step protocol"): ``next_step`` is
where a (re)joining client starts; ``floor`` is the first step that is not over. A step ends for
everyone when one of its batches failed (a verdict, a timeout, bad input). A report of a step that
is over is answered with the step's error only when the reporting client took part in the step
(it reported one of its batches) or the error is a client's bad input (a ``ValueError`` every
client of the step must raise); otherwise (a replacement that registered late, a client that was
too slow to report before the step timed out, a client left behind by a scheduler restart) it is
answered ``resync``: go on at the floor. So clients that disagree about the step meet again at
their next report, in lock-step loops as in free-running ones. A replacement (a rank registering
as a new process) took part in nothing: the reports of the process it replaces leave every open
batch, and a batch already being planned with one fails its step
(:meth:`~Coordinator._forget_client`). Steps are bounded (:data:`MAX_STEP`, :data:`STEPS_AHEAD`),
so no report can move the job far ahead.

Deadlines are computed from a ``now`` the caller passes (any monotonic clock). The only clock
read here is ``timer`` (``time.perf_counter`` unless given), which measures how long planning
and cutting took for the record of the last plan.

Membership lives in :mod:`scheduler.coordinator_membership`, group epochs and failure verdicts in
:mod:`scheduler.coordinator_epochs`: :class:`Coordinator` inherits both (their constants are
re-exported here).
"""

from __future__ import annotations

import time
from functools import partial
from typing import Callable

from .arbitration import Arbitration, Member
from .checks import bad_lengths, is_int
from .config import MAX_REPORT_DOCS, MAX_REPORT_TOKENS, JobConfig, legacy_fields, legacy_job_config
from .coordinator_epochs import KEEP_EPOCHS, MAX_BOOTSTRAP_BYTES, TRANSPORT_DEVICES, GroupEpochsMixin
from .coordinator_membership import MAX_STEP, SERVER_STATES, STEPS_AHEAD, MembershipMixin
from .cost import CostModel
from .messages import agreed_shape, error_answer, same_report
from .outcomes import PlanCut, PlanOutcome, ReportOutcome, plan_and_cut
from .tasks import Plan

_KEEP_STEPS = 2  # batches of steps older than (last planned step - _KEEP_STEPS) are forgotten
PLANS_KEPT = 16  # whole plans kept for plan_descriptor (clients read them lazily, for last_plan)
# A report is bounded (JobConfig.max_report_docs, max_report_tokens: defaults MAX_REPORT_DOCS,
# MAX_REPORT_TOKENS, in scheduler.config) before anything else looks at it.


class _Batch:
    __slots__ = ("reports", "shape", "answers")

    def __init__(self):
        self.reports: dict[int, tuple] = {}  # rank -> (doc_lens, shape)
        self.shape: tuple[CostModel, str, int | None] | None = None  # agreed once all reported
        self.answers: dict[int, dict] | None = None  # set once resolved


class Coordinator(MembershipMixin, GroupEpochsMixin):
    """The scheduler of job ``name``: membership, plans, group epochs, failure verdicts.

    Args:
        name: job name (in messages).
        config: the job's settings (default ``JobConfig()``: dedicated mode): the plan's
            (:class:`~scheduler.config.PlanConfig`, see :func:`scheduler.plan_batch`);
            ``timeout_s`` (how long clients wait for each other: the wrapper's timeouts, in
            messages); ``failure_grace_s`` (after the first failure report of an epoch, how long
            the other members have to check in before the silent ones are named lost);
            ``backend`` (handed to clients); ``max_report_docs`` / ``max_report_tokens`` (a larger
            report is a ``ValueError`` for every client of the batch); ``transport`` (how every
            group epoch moves its tensors, handed to every member with its group: ``"shm"`` needs
            every member of an epoch on one node and CPU tensors, ``"nvshmem"`` CUDA tensors; a
            batch that breaks this fails for every client, ``DistCAError`` naming the nodes,
            ``ValueError`` naming the device type).
        timer: clock for measuring planning and cutting (seconds; default ``time.perf_counter``).
        *legacy_args, **legacy: deprecated: the old settings (``mode``, ``epsilon``,
            ``min_shard``, ``timeout_s``, ``failure_grace_s``, ``backend``, ``max_report_docs``,
            ``max_report_tokens`` by position or keyword; ``keep_activations``,
            ``max_held_bytes_per_server``, ``transport``, ``partial_kv`` by keyword). They warn
            and build the config; pass ``config=JobConfig(...)`` instead.

    Raises:
        ConfigError: bad settings (a ``ValueError`` naming every one).
        TypeError: ``config`` together with deprecated settings, or an unknown one.
    """

    _LEGACY_POSITIONAL = ("mode", "epsilon", "min_shard", "timeout_s", "failure_grace_s", "backend",
                          "max_report_docs", "max_report_tokens")
    _LEGACY = _LEGACY_POSITIONAL + ("keep_activations", "max_held_bytes_per_server", "transport", "partial_kv")

    def __init__(self, name: str, *legacy_args, config: JobConfig | None = None,
                 timer: Callable[[], float] = time.perf_counter, **legacy):
        given = legacy_fields("Coordinator", legacy_args, legacy, positional=self._LEGACY_POSITIONAL,
                              accepted=self._LEGACY)
        self.config = config = legacy_job_config("Coordinator", config, given)
        plan = config.plan
        self.name, self.mode, self.epsilon, self.min_shard = name, plan.mode, plan.epsilon, plan.min_shard
        self.keep_activations, self.partial_kv = plan.keep_activations, plan.partial_kv
        self.max_held_bytes_per_server = plan.max_held_bytes_per_server
        self.transport, self.backend = config.transport, config.backend
        self.timeout_s, self.failure_grace_s = config.timeout_s, config.failure_grace_s
        self.max_report_docs, self.max_report_tokens = config.max_report_docs, config.max_report_tokens
        self.timer = timer
        self.world_size: int | None = None
        self.clients: dict[int, dict] = {}
        # server id -> info + "state": "alive", "suspect" (missed a ping or was named lost: left
        # out of plans until it answers one again) or "dead" (its actor died: until it registers)
        self.servers: dict[int, dict] = {}
        self.epoch = -1
        self.members: tuple | None = None  # who the current epoch is made of; None: form anew
        self.epoch_servers: tuple[int, ...] = ()  # server ids of the current epoch, in plan order
        self.groups: dict[int, dict[int, Member]] = {}  # epoch -> world rank -> member
        self.batches: dict[tuple[int, int], _Batch] = {}
        self.bootstraps: dict[int, object] = {}  # epoch -> world rank 0's bootstrap value
        self.failures: dict[int, Arbitration] = {}
        self.failed_steps: dict[int, dict] = {}  # step -> the error answer of a failed step (see _over)
        self.took_part: dict[int, set[int]] = {}  # step -> client ranks that reported any of its batches
        self.step_epochs: dict[int, int] = {}  # step -> the group epoch its first planned batch runs in
        self.next_step = 0
        self.floor = 0
        self.steps_planned = 0
        self.last: dict = {}
        self.plans: dict[tuple[int, int], bytes] = {}  # (step, batch) -> plan descriptor, newest PLANS_KEPT
        self._resolved: list[tuple[int, int]] = []  # batches resolved since the last drain_resolved

    # ---- one step ----------------------------------------------------------------------------
    def report(self, step: int, batch: int, rank: int, doc_lens, shape) -> ReportOutcome:
        """Client ``rank``'s documents and attention shape for ``(step, batch)``.

        ``shape`` is ``{"cost": CostModel.to_wire(), "device_type": "cpu" | "cuda"}``, plus
        ``"window"`` (an int, or None) for sliding-window attention (absent: None). When the
        last client of the batch reports, every shape is checked and compared: a bad or
        disagreeing one resolves the batch with a ``ValueError`` answer for every client. A
        report of more than ``max_report_docs`` documents or ``max_report_tokens`` tokens does
        the same at once (and is not kept). A repeated identical report is the same report; a
        different one gets a ``ValueError`` answer of its own (the batch goes on with the first);
        a rank whose client registered again as a new process reports afresh (its old process's
        reports left every open batch: :meth:`_forget_client`).
        An unregistered rank gets a ``DistCAError`` answer with ``"register": True``; a step that
        failed, that step's error; an unknown batch of a step that is over, a ``resync`` answer.
        Document lengths are checked by :meth:`plan`.
        """
        if self.world_size is None or not is_int(rank) or rank not in self.clients:
            return ReportOutcome(error_answer("DistCAError", f"rank {rank} is not registered with job "
                                                             f"{self.name!r}", register=True))
        if not (is_int(step) and step >= 0 and is_int(batch) and batch >= 0):
            return ReportOutcome(error_answer("ValueError", f"step and batch must be ints >= 0, got "
                                                            f"step={step!r}, batch={batch!r}"))
        key = (int(step), int(batch))
        state = self.batches.get(key)
        if state is None:
            if key[0] in self.failed_steps:
                return ReportOutcome(self._over(key[0], rank, self.failed_steps[key[0]]))
            if key[0] < self.floor:
                return ReportOutcome(self._resync(key[0]))
            try:
                self._check_step(key[0], f"rank {rank}'s report of batch {batch}")
            except ValueError as exc:  # this client's alone: nothing is kept, no floor moves
                return ReportOutcome(error_answer("ValueError", str(exc)))
            state = self.batches[key] = _Batch()
        if rank in state.reports:
            if not same_report(state.reports[rank], (doc_lens, shape)):
                return ReportOutcome(error_answer(
                    "ValueError", f"rank {rank} reported step {step} batch {batch} twice with different "
                                  f"documents or attention shape"))
            return ReportOutcome(state.answers[rank] if state.answers is not None else None)
        if state.answers is not None:  # given up before this client reported (timeout, abort)
            return ReportOutcome(self._over(key[0], rank, state.answers[rank]))
        too_big = self._oversized(rank, doc_lens)
        if too_big is not None:  # refused before anything plans it: every client gets the error
            self._resolve(key, state, error_answer("ValueError", too_big))
            return ReportOutcome(state.answers[rank], resolved=True)
        state.reports[rank] = (doc_lens, shape)
        self.took_part.setdefault(key[0], set()).add(rank)
        if len(state.reports) < self.world_size:
            return ReportOutcome()
        try:
            state.shape = agreed_shape(state.reports)
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
        return partial(plan_and_cut, [state.reports[r][0] for r in range(W)], len(servers) if servers else W,
                       cost=state.shape[0], config=self.config.plan, step=step, batch=batch, timer=self.timer,
                       window=state.shape[2])

    def _oversized(self, rank: int, doc_lens) -> str | None:
        """The message refusing a report above the bounds, or None (bad lengths are the
        planner's to name)."""
        try:
            n = len(doc_lens)
        except TypeError:
            return None
        if n > self.max_report_docs:
            return (f"rank {rank} reported {n} documents; one report holds at most "
                    f"{self.max_report_docs} (max_report_docs)")
        if isinstance(doc_lens, (list, tuple)) and not bad_lengths(doc_lens):
            tokens = sum(doc_lens)
            if tokens > self.max_report_tokens:
                return (f"rank {rank} reported {tokens} tokens; one report holds at most "
                        f"{self.max_report_tokens} (max_report_tokens)")
        return None

    def _over(self, step: int, rank: int, answer: dict) -> dict:
        """The answer to client ``rank``'s report of a batch of ``step`` resolved without it.

        ``answer`` (the batch's, or the failed step's) when ``rank`` took part in the step (it
        reported one of its batches: it was in the step that failed, and raises with its peers)
        or ``answer`` is not a ``DistCAError`` (bad input, or a resync: every client of the step
        gets it). Otherwise ``rank`` never took part in the failed step: it registered after the
        step began, or reached it only after the step timed out without it. Handing it the old
        error would make it spend its next step number on a step its peers have left, so in a
        lock-step loop it would stay one step behind them forever; it resyncs at the floor instead.
        """
        if answer.get("error") == "DistCAError" and rank not in self.took_part.get(step, ()):
            return self._resync(step)
        return answer

    def _resync(self, step: int) -> dict:
        return error_answer("resync", f"step {step} is over for job {self.name!r}; the job goes on "
                                      f"at step {self.floor}", next_step=self.floor)

    def plan(self, step: int, batch: int, live_servers=None, cut: PlanCut | None = None) -> PlanOutcome:
        """Plan a fully reported batch over ``live_servers`` (dedicated mode: server ids that
        answered a ping, in plan order; ignored in-place), keep or form the group epoch and cut
        every participant's part. Does nothing for a batch that is not ready or already resolved.
        ``cut``: the result of :meth:`plan_work` for the same arguments, if already computed.

        Every client's answer becomes ``{"part": bytes, "group": {"epoch", "world_rank",
        "world_size", "device_type", "transport"}}``; every part carries the plan's id
        (:func:`~scheduler.parts.plan_identity`). Bad documents give every client the same
        ``ValueError`` answer, no live server a ``DistCAError`` answer.
        """
        key = (step, batch)
        state = self.batches.get(key)
        if state is None or state.answers is not None or state.shape is None:
            return PlanOutcome()
        cost, device_type, _ = state.shape
        servers = list(live_servers or ()) if self.mode == "dedicated" else []
        if self.mode == "dedicated" and not servers:
            known = ", ".join(f"server {sid} {info['state']}" for sid, info in sorted(self.servers.items()))
            self._resolve(key, state, error_answer("DistCAError", f"job {self.name!r} has no live attention server "
                                                                  f"({known or 'none registered'})"))
            return PlanOutcome(resolved=True)
        W = self.world_size
        if cut is None:
            cut = self.plan_work(step, batch, live_servers)()
        if cut.error is not None:
            self._resolve(key, state, error_answer("ValueError", cut.error))
            return PlanOutcome(resolved=True)
        plan, parts = cut.plan, cut.parts
        self.plans[key] = cut.descriptor
        while len(self.plans) > PLANS_KEPT:
            del self.plans[next(iter(self.plans))]
        refused = self._transport_error(device_type, servers)
        if refused is not None:
            self._resolve(key, state, refused)
            return PlanOutcome(resolved=True)
        changed = self.step_group_change(step, servers, device_type)
        if changed is not None:  # the step's earlier batches run in a group this batch cannot
            self._fail_step(step, error_answer(
                "DistCAError", f"step {step} batch {batch} cannot run in the group of the step's earlier "
                               f"batches: {changed}; every client fails step {step} and the job goes on at "
                               f"step {step + 1}"))
            return PlanOutcome(resolved=True)
        decision = self.epoch_for(servers, device_type)
        self.step_epochs.setdefault(step, decision.epoch)
        group = {"epoch": decision.epoch, "world_size": plan.num_participants, "device_type": device_type,
                 "transport": self.transport}
        self._resolve(key, state, None, {r: {"part": parts[r], "group": dict(group, world_rank=r)}
                                         for r in range(W)})
        record = self._record(plan, step, batch, servers, cut.plan_ms, cut.cut_ms)
        return PlanOutcome(resolved=True, assignments=decision.assignments,
                           server_parts=[(sid, parts[W + i]) for i, sid in enumerate(servers)],
                           record=record)

    def plan_descriptor(self, step: int, batch: int) -> bytes | None:
        """The whole plan of ``(step, batch)`` as msgpack, or None once it is no longer kept."""
        return self.plans.get((step, batch))

    def answer(self, step: int, batch: int, rank: int) -> dict:
        """Client ``rank``'s answer for a resolved batch (a ``DistCAError`` answer if the batch is
        unknown, forgotten or still open)."""
        state = self.batches.get((step, batch))
        if state is None or state.answers is None or rank not in state.answers:
            return error_answer("DistCAError", f"step {step} batch {batch} has no answer for rank {rank}")
        return state.answers[rank]

    def abort(self, step: int, batch: int, rank: int, message: str | None = None) -> dict:
        """Give up on ``(step, batch)``: every client gets a ``DistCAError`` answer (the wrapper
        calls this when client ``rank``'s wait timed out, or when planning failed unexpectedly),
        and so does every later report of that step: the job goes on at the next step. A batch
        already resolved keeps its answers. Returns client ``rank``'s answer.

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
            self._fail_step(step, state.answers[rank] if rank in state.answers else
                            error_answer("DistCAError", message))
        return state.answers.get(rank) or error_answer("DistCAError", f"rank {rank} is not in job {self.name!r}")

    def fail_step(self, step: int, rank: int, message: str) -> dict:
        """Client ``rank`` hit bad input of its own in ``step`` (e.g. a tensor that does not match
        its documents): every open batch of the step, and every later report of it, gets the same
        ``ValueError`` answer naming the rank, so peers fail at once instead of after a timeout;
        the job goes on at ``step + 1``. Returns that answer.

        Raises:
            ValueError: ``step`` not an int >= 0, or more than :data:`STEPS_AHEAD` past the job's.
        """
        self._check_step(step, f"rank {rank}'s failed step")
        answer = self.failed_steps.get(step) or error_answer("ValueError", f"rank {rank}: {message}")
        self._fail_step(int(step), answer)
        return answer

    def _fail_step(self, step: int, answer: dict) -> None:
        self.failed_steps.setdefault(step, answer)
        for key, state in list(self.batches.items()):  # resolving forgets old batches
            if key[0] == step and state.answers is None:
                self._resolve(key, state, self.failed_steps[step])
        self._raise_floor(step + 1)

    def _raise_floor(self, floor: int) -> None:
        """Steps below ``floor`` are over: their open batches resync at ``floor``."""
        if floor <= self.floor:
            return
        self.floor = floor
        for key, state in list(self.batches.items()):  # resolving forgets old batches
            if key[0] < floor and state.answers is None:
                self._resolve(key, state, self._resync(key[0]))

    def _forget_client(self, rank: int) -> None:
        """Client ``rank`` registered as another process than the one that reported under it (a
        replacement): what the old process reported is not the new one's, which took part in no
        step yet. Its reports leave every open batch, so the replacement reports afresh (its peers
        go on waiting for it, under the batch's deadline) and a step that ends without it resyncs
        it (:meth:`_over`). A batch every client had reported is being planned, and its peers wait
        for that plan: the plan would hand them parts of a group whose rank ``rank`` never comes,
        so its step fails for every client at once, as a timeout would later. Batches resolved
        before keep their answers (and reports): registering is told a step past them."""
        for ranks in self.took_part.values():
            ranks.discard(rank)
        held = [(key, state) for key, state in self.batches.items()
                if state.answers is None and rank in state.reports]  # before failing a step resolves some
        for key, state in held:
            if state.answers is None and state.shape is not None:  # every client reported: the plan has begun
                step, batch = key
                self._fail_step(step, error_answer(
                    "DistCAError", f"client rank {rank} registered again (a new process) while step {step} "
                                   f"batch {batch} was being planned with its old process's report; every "
                                   f"client fails step {step} and the job goes on at step {step + 1}"))
            del state.reports[rank]

    def drain_resolved(self) -> list[tuple[int, int]]:
        """The ``(step, batch)`` keys resolved since the last call (the wrapper wakes their
        waiters)."""
        out, self._resolved = self._resolved, []
        return out

    def _resolve(self, key, state: _Batch, error: dict | None, answers: dict | None = None) -> None:
        W = self.world_size or 0
        state.answers = answers if answers is not None else {r: error for r in range(W)}
        self._resolved.append(key)
        step = key[0]
        self.next_step = max(self.next_step, step + 1)
        for old in [k for k in self.batches if k[0] < step - _KEEP_STEPS]:
            del self.batches[old]
        for table in (self.failed_steps, self.took_part, self.step_epochs):
            for old in [s for s in table if s < step - _KEEP_STEPS]:
                del table[old]

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
                     "server_held_bytes": dict(zip(ids, plan.held_bytes())),
                     "num_tasks": sum(tasks), "epoch": self.epoch}
        return self.last

    # ---- inspection --------------------------------------------------------------------------
    def status(self) -> dict:
        """Job state for ``distca status``: settings, clients, epoch, last plan, and one row per
        server: ``{"server", "node", "state", "rounds_served", "last_flops", "last_tasks",
        "last_error", "bytes_sent", "last_held_bytes"}`` (``rounds_served``, ``last_error`` and
        ``bytes_sent`` are None here: the wrapper asks live servers). Only a server that is alive shows the last
        plan's load: a dead or suspect one serves none of it now. In in-place mode the rows are
        the client ranks that serve (state ``"in-place"``, or ``"unregistered"`` once gone)."""
        servers = []
        if self.mode == "inplace":
            members = {sid: {"node": self.clients.get(sid, {}).get("node", "?"),
                             "state": "in-place" if sid in self.clients else "unregistered"}
                       for sid in range(self.world_size or 0)}
        else:
            members = self.servers
        for sid, s in sorted(members.items()):
            alive = s["state"] in ("alive", "in-place")
            servers.append({"server": sid, "node": s.get("node", "?"), "state": s["state"], "rounds_served": None,
                            "last_flops": self.last.get("server_flops", {}).get(sid) if alive else None,
                            "last_tasks": self.last.get("server_tasks", {}).get(sid) if alive else None,
                            "last_held_bytes": self.last.get("server_held_bytes", {}).get(sid) if alive else None,
                            "last_error": None, "bytes_sent": None})
        return {"name": self.name, "mode": self.mode, "world_size": self.world_size,
                "clients": sorted(self.clients), "epoch": self.epoch,
                "next_step": max(self.next_step, self.floor),
                "steps_planned": self.steps_planned, "last": self.last, "servers": servers}


__all__ = ["Coordinator", "KEEP_EPOCHS", "MAX_BOOTSTRAP_BYTES", "MAX_REPORT_DOCS", "MAX_REPORT_TOKENS",
           "MAX_STEP", "SERVER_STATES", "STEPS_AHEAD", "TRANSPORT_DEVICES"]
