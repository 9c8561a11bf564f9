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
  plan order); :meth:`~Coordinator.publish_bootstrap` / :meth:`~Coordinator.bootstrap` relay each
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
their next report, in lock-step loops as in free-running ones. Steps are bounded (:data:`MAX_STEP`,
:data:`STEPS_AHEAD`), so no report can move the job far ahead.

Deadlines are computed from a ``now`` the caller passes (any monotonic clock). The only clock
read here is ``timer`` (``time.perf_counter`` unless given), which measures how long planning
and cutting took for the record of the last plan.
"""

from __future__ import annotations

import secrets
import time
from functools import partial
from typing import Callable

from .arbitration import Arbitration, Member
import msgpack

from .checks import bad_lengths, is_int, positive_int
from .config import MAX_REPORT_DOCS, MAX_REPORT_TOKENS, JobConfig, legacy_fields, legacy_job_config
from .cost import CostModel
from .messages import agreed_shape, error_answer, same_report
from .outcomes import (Assignment, EpochDecision, FailureOutcome, PlanCut, PlanOutcome, ReportOutcome,
                       plan_and_cut)
from .tasks import Plan

_KEEP_STEPS = 2  # batches of steps older than (last planned step - _KEEP_STEPS) are forgotten
KEEP_EPOCHS = 2  # bootstrap values and failure verdicts of older epochs are forgotten
PLANS_KEPT = 16  # whole plans kept for plan_descriptor (clients read them lazily, for last_plan)
# A report is bounded (JobConfig.max_report_docs, max_report_tokens: defaults MAX_REPORT_DOCS,
# MAX_REPORT_TOKENS, in scheduler.config) before anything else looks at it.
# Steps are ints below this (a job at 1000 steps a second takes 35 years to reach it): a step a
# member claims at registration above it is refused, so no report, abort or floor ever nears the
# int64 limits that torch and msgpack put on the step a round header carries.
MAX_STEP = 1 << 40
# A report, a client's failure or a check-in may name at most this many steps past the job's step
# (max(next_step, floor)): a client's own counter is never ahead of it, since every step it enters
# was resolved, failed or raised by its registration here. One step of slack, no more: a report far
# ahead would otherwise move the floor, and with it every client's counter, to its step.
STEPS_AHEAD = 1
SERVER_STATES = ("alive", "suspect", "dead")
# The device types each transport of scheduler.checks.TRANSPORTS moves (groups.py forms them):
# torch.distributed (gloo on CPU, NCCL on GPU), the one-sided exchange over shared memory between
# the processes of one host (CPU tensors), or over NVSHMEM symmetric GPU memory.
TRANSPORT_DEVICES = {"torch_dist": ("cpu", "cuda"), "shm": ("cpu",), "nvshmem": ("cuda",)}
# A bootstrap value is plain msgpack data, at most this many bytes packed (a TCPStore address, a
# heap handle and an NVSHMEM unique id take ~20-200): members hand it to each other through the
# scheduler, which must not hold whatever a buggy or hostile member publishes.
MAX_BOOTSTRAP_BYTES = 4096


class _Batch:
    __slots__ = ("reports", "shape", "answers")

    def __init__(self):
        self.reports: dict[int, tuple] = {}  # rank -> (doc_lens, shape)
        self.shape: tuple[CostModel, str, int | None] | None = None  # agreed once all reported
        self.answers: dict[int, dict] | None = None  # set once resolved


class Coordinator:
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
        self.next_step = 0
        self.floor = 0
        self.steps_planned = 0
        self.last: dict = {}
        self.plans: dict[tuple[int, int], bytes] = {}  # (step, batch) -> plan descriptor, newest PLANS_KEPT
        self._resolved: list[tuple[int, int]] = []  # batches resolved since the last drain_resolved

    # ---- membership --------------------------------------------------------------------------
    def register_client(self, rank: int, world_size: int, info: dict) -> dict:
        """Client ``rank`` of ``world_size`` joins (or rejoins after a restart with a new
        ``info["incarnation"]``, which makes the next batch form a new epoch).

        ``info`` may carry ``"step"`` (the step the client goes on with) and ``"epoch"`` (the last
        group epoch it was in): a client re-registering with a restarted scheduler rebuilds the
        job's step and epoch numbering this way.

        Returns:
            ``{"name", "mode", "timeout_s", "backend", "next_step", "keep_activations",
            "transport", "config"}``: the job's settings (``config``: all of them,
            :meth:`JobConfig.to_dict <scheduler.config.JobConfig.to_dict>`) and the step the
            client must start at.

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
        self._check_claimed_step(info.get("step"), f"client rank {rank}")
        self.clients[int(rank)] = dict(info, rank=int(rank))
        self._rebuild(info)
        return {"name": self.name, "mode": self.mode, "timeout_s": self.timeout_s,
                "backend": self.backend, "next_step": max(self.next_step, self.floor),
                "keep_activations": self.keep_activations, "transport": self.transport,
                "config": self.config.to_dict()}

    def _rebuild(self, info: dict) -> None:
        """Take a registering member's last step and epoch into account (after a scheduler
        restart the coordinator starts empty): steps before it are over, and epochs are numbered
        past it, so no member mistakes a new group for one it was in."""
        step, epoch = info.get("step"), info.get("epoch")
        if is_int(step) and step > self.floor:
            self._raise_floor(int(step))
        if is_int(epoch) and epoch > self.epoch:
            self.epoch, self.members = int(epoch), None

    @staticmethod
    def _check_claimed_step(step, who: str) -> None:
        """A registering member's last step: None, or an int in ``[0, MAX_STEP)``.

        Raises:
            ValueError: naming ``who`` and the step.
        """
        if step is not None and not (is_int(step) and 0 <= step < MAX_STEP):
            raise ValueError(f"{who} registered with step {step!r}; steps are ints in [0, {MAX_STEP})")

    def _check_step(self, step, what: str) -> None:
        """A step a client names in ``what`` (a report, a failure): an int from 0 to
        :data:`STEPS_AHEAD` past the job's step.

        Raises:
            ValueError: naming the step, the job's step and ``what``.
        """
        if not is_int(step) or step < 0:
            raise ValueError(f"{what}: step must be an int >= 0, got {step!r}")
        job_step = max(self.next_step, self.floor)
        if step > job_step + STEPS_AHEAD:
            raise ValueError(f"{what}: step {step} is ahead of job {self.name!r}, which is at step {job_step} "
                             f"(a client's step is never more than {STEPS_AHEAD} ahead of it)")

    def unregister_client(self, rank: int, incarnation: str) -> None:
        """Client ``rank`` leaves, unless a newer incarnation already took its place."""
        if self.clients.get(rank, {}).get("incarnation") == incarnation:
            del self.clients[rank]

    def issue_token(self, rank: int) -> str:
        """A new secret for registered client ``rank``, replacing its earlier one (the wrapper
        hands it out with each registration): :meth:`check_member` asks for it. Kept in the
        client's info, which :meth:`status` never shows.

        Raises:
            ValueError: ``rank`` is not a registered client.
        """
        if not is_int(rank) or rank not in self.clients:
            raise ValueError(f"rank {rank!r} is not registered with job {self.name!r}")
        token = self.clients[rank]["token"] = secrets.token_hex(16)
        return token

    def check_member(self, rank, token, call: str) -> None:
        """Refuse ``call`` (what changes the job, or reveals its documents) unless ``rank`` is a
        registered client and ``token`` the secret :meth:`issue_token` gave it last.

        Raises:
            ValueError: naming the rank and the call.
        """
        held = self.clients.get(rank, {}).get("token") if is_int(rank) else None
        given = token.encode("utf-8", "surrogatepass") if type(token) is str else None
        if held is None or given is None or not secrets.compare_digest(held.encode(), given):
            raise ValueError(f"job {self.name!r} refused {call} from rank {rank!r}: the caller is not that "
                             f"registered client (it needs the token rank {rank!r} got when it registered)")

    def register_server(self, index: int, info: dict) -> None:
        """Dedicated server ``index`` (re)starts, or re-registers with a restarted scheduler
        (``info["epoch"]``: its last group epoch); it joins the next group epoch.

        Raises:
            ValueError: ``index`` not an int >= 0.
        """
        if not is_int(index) or index < 0:
            raise ValueError(f"server index must be an int >= 0, got {index!r}")
        self.servers[int(index)] = dict(info, index=int(index), state="alive")
        self._rebuild({"epoch": info.get("epoch")})

    def servers_to_ping(self) -> dict[int, str]:
        """``{server id: state}`` of every server not known dead, ascending: the wrapper pings
        these ("suspect" ones briefly: they are left out until they answer)."""
        return {i: s["state"] for i, s in sorted(self.servers.items()) if s["state"] != "dead"}

    def servers_pinged(self, states: dict[int, str]) -> list[int]:
        """Record ping results, ``{server id: "alive" (answered and ready) | "suspect" (no answer
        in time, or not ready) | "dead" (its actor died)}``; returns the live ids, ascending.
        A suspect server is pinged again at the next plan; a dead one waits until it registers.

        Raises:
            ValueError: a state other than those three.
        """
        for sid, state in states.items():
            if state not in SERVER_STATES:
                raise ValueError(f"server {sid}: state must be one of {SERVER_STATES}, got {state!r}")
            if sid in self.servers:
                self.servers[sid]["state"] = state
        return sorted(sid for sid, state in states.items() if state == "alive" and sid in self.servers)

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
        self.groups[self.epoch] = self._describe(servers)
        for table in (self.bootstraps, self.failures, self.groups):
            for old in [e for e in table if e < self.epoch - KEEP_EPOCHS]:
                del table[old]
        world = W + len(servers)
        return EpochDecision(self.epoch, servers, tuple(
            Assignment(sid, self.epoch, W + i, world, i, device_type) for i, sid in enumerate(servers)))

    def publish_bootstrap(self, epoch: int, value) -> None:
        """World rank 0 of group ``epoch`` publishes what the others need to join it (opaque here:
        see the module doc). Kept as its msgpack round trip (lists for tuples), so every member
        looks up plain data.

        Raises:
            ValueError: ``epoch`` not an int >= 0, ``value`` None, not msgpack data, or more than
                :data:`MAX_BOOTSTRAP_BYTES` packed.
        """
        if not is_int(epoch) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        if value is None:
            raise ValueError(f"group epoch {epoch}: the bootstrap value must not be None")
        try:
            packed = msgpack.packb(value, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"group epoch {epoch}: the bootstrap value must be msgpack data, got "
                             f"{type(value).__name__} ({exc})") from None
        if len(packed) > MAX_BOOTSTRAP_BYTES:
            raise ValueError(f"group epoch {epoch}: the bootstrap value takes {len(packed)} bytes packed, "
                             f"more than {MAX_BOOTSTRAP_BYTES}")
        self.bootstraps[int(epoch)] = msgpack.unpackb(packed, raw=False)

    def bootstrap(self, epoch: int):
        """Group ``epoch``'s bootstrap value, or None while none was published (or once the
        epoch is forgotten)."""
        return self.bootstraps.get(epoch)

    def _transport_error(self, device_type: str, servers) -> dict | None:
        """The error answer of a batch the job's transport cannot carry: a device type it does
        not move, or (``shm``) members on several nodes; None if it can."""
        if device_type not in TRANSPORT_DEVICES[self.transport]:
            return error_answer("ValueError", f"job {self.name!r} runs transport {self.transport!r}, which "
                                              f"moves {' or '.join(TRANSPORT_DEVICES[self.transport])} "
                                              f"tensors, not {device_type}")
        if self.transport != "shm":
            return None
        nodes: dict[str, list[str]] = {}
        for r in range(self.world_size or 0):
            nodes.setdefault(str(self.clients.get(r, {}).get("node", "?")), []).append(f"client rank {r}")
        for sid in servers if self.mode == "dedicated" else ():
            nodes.setdefault(str(self.servers.get(sid, {}).get("node", "?")), []).append(f"attention server {sid}")
        if len(nodes) <= 1:
            return None
        where = "; ".join(f"node {n}: {', '.join(who)}" for n, who in sorted(nodes.items()))
        return error_answer("DistCAError", f"job {self.name!r} runs transport 'shm', which needs every "
                                           f"member of a group on one node, but they are on {len(nodes)} "
                                           f"nodes ({where})")

    # ---- one step ----------------------------------------------------------------------------
    def report(self, step: int, batch: int, rank: int, doc_lens, shape) -> ReportOutcome:
        """Client ``rank``'s documents and attention shape for ``(step, batch)``.

        ``shape`` is ``{"cost": CostModel.to_wire(), "device_type": "cpu" | "cuda"}``, plus
        ``"window"`` (an int, or None) for sliding-window attention (absent: None). When the
        last client of the batch reports, every shape is checked and compared: a bad or
        disagreeing one resolves the batch with a ``ValueError`` answer for every client. A
        report of more than ``max_report_docs`` documents or ``max_report_tokens`` tokens does
        the same at once (and is not kept). A repeated identical report is the same report; a
        different one gets a ``ValueError`` answer of its own (the batch goes on with the first).
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
            self._resolve(key, state, error_answer("DistCAError", f"job {self.name!r} has no live attention server"))
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
        decision = self.epoch_for(servers, device_type)
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
        for table in (self.failed_steps, self.took_part):
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

    # ---- failures ----------------------------------------------------------------------------
    def failure(self, epoch: int, world_rank: int, step: int, now: float, reached: int = 0,
                cause: str | None = None, detected: bool = False, in_round: bool = True) -> FailureOutcome:
        """World rank ``world_rank`` of group ``epoch`` checks in to a failure of the epoch.

        A member checks in when a round failed for it (``cause``: what went wrong; ``detected``:
        it found the problem itself, e.g. a part that does not match its peers', rather than seeing
        a collective fail) or, alive and told that the epoch's arbitration opened, with
        ``cause=None``. ``reached`` is how many rounds of the epoch it
        reached (completed, plus the one it is in or waiting for); ``in_round`` whether it is in
        one (a server waiting for the next round's header is); ``step`` the step it was in (-1 if
        it does not know, e.g. a server).

        The first check-in opens the epoch's arbitration (deadline ``now + failure_grace_s``;
        ``opened``). The verdict is decided in the call where the last member checks in, or by
        :meth:`close_failure` at the deadline; who is lost and which cause everyone reads is
        :class:`~scheduler.arbitration.Arbitration`'s rule (the silent, and the late). An epoch
        that is not current and has no arbitration (already over) is answered at once, naming
        nobody. Every verdict ends its epoch (the next batch forms a new group), ends the step
        (the job goes on at the step after), and leaves lost servers out of plans until they
        answer a ping again.
        """
        if step != -1:  # a server does not know the step; a client's is bounded like its reports
            self._check_step(step, f"world rank {world_rank}'s failure of group epoch {epoch}")
        fail = self.failures.get(epoch)
        opened = False
        if fail is None:
            if epoch != self.epoch or epoch not in self.groups or self.members is None:
                return FailureOutcome({"epoch": epoch, "lost": [], "lost_ranks": [],
                                       "next_step": max(self.next_step, self.floor, step + 1),
                                       "cause": f"group epoch {epoch} is over", "detected": False},
                                      now)
            fail = self.failures[epoch] = Arbitration(epoch, self.groups[epoch], now + self.failure_grace_s,
                                                      self.failure_grace_s)
            opened = True
        if fail.verdict is None:
            fail.check_in(world_rank, step, reached, in_round, cause, detected)
            if fail.complete:
                self._decide(fail)
        return FailureOutcome(fail.verdict, fail.deadline, opened)

    def close_failure(self, epoch: int, now: float) -> dict | None:
        """The verdict of group ``epoch``'s failure: decided now if the grace period is over
        (``now >= deadline``), else None (still waiting). An epoch without arbitration names
        nobody."""
        fail = self.failures.get(epoch)
        if fail is None:
            return {"epoch": epoch, "lost": [], "lost_ranks": [], "next_step": max(self.next_step, self.floor),
                    "cause": f"group epoch {epoch} is over", "detected": False}
        if fail.verdict is None and now >= fail.deadline:
            self._decide(fail)
        return fail.verdict

    def arbitration(self, epoch: int) -> str | None:
        """``"open"`` while group ``epoch``'s failure is being arbitrated (members must check in),
        ``"decided"`` once its verdict is out, None if the epoch has not failed."""
        fail = self.failures.get(epoch)
        return None if fail is None else ("open" if fail.verdict is None else "decided")

    def _decide(self, fail: Arbitration) -> None:
        """Decide ``fail``'s verdict and act on it: lost servers out of plans until they answer a
        ping, a fresh group for the next batch, the step failed for every later report."""
        lost = fail.lost()
        for r, _ in lost:
            server = self.servers.get(fail.members[r].server)
            if server is not None and server["state"] == "alive":
                server["state"] = "suspect"
        if fail.epoch == self.epoch:
            self.members = None  # whatever happened, the next batch forms a fresh group
        cause, detected = fail.cause()
        if fail.step >= 0:
            self._fail_step(fail.step, error_answer("DistCAError", f"step {fail.step} failed in group "
                                                                    f"epoch {fail.epoch}: {cause}"[:500]))
        fail.verdict = {"epoch": fail.epoch, "lost": [why for _, why in lost], "lost_ranks": [r for r, _ in lost],
                        "next_step": max(self.next_step, self.floor), "cause": cause, "detected": detected}

    def _describe(self, servers) -> dict[int, Member]:
        """World rank -> member of a group of the clients and ``servers`` (in plan order)."""
        W = self.world_size or 0
        out = {r: Member(f"client rank {r} (node {self.clients.get(r, {}).get('node', '?')})", True, None)
               for r in range(W)}
        for plan_index, sid in enumerate(servers):
            out[W + plan_index] = Member(
                f"attention server {sid} (node {self.servers.get(sid, {}).get('node', '?')})", False, sid)
        return out

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


__all__ = ["Coordinator", "KEEP_EPOCHS", "MAX_BOOTSTRAP_BYTES", "MAX_REPORT_DOCS", "MAX_REPORT_TOKENS"]
