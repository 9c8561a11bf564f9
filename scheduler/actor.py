"""``SchedulerActor``: the job's central scheduler, a named async Ray actor.

A thin wrapper of :class:`scheduler.coordinator.Coordinator`, which holds every decision
(membership, reports -> plan -> parts, group epochs, the bootstrap relay, failure verdicts). This module
adds only what needs Ray or an event loop: planning and cutting on a worker thread
(``asyncio.to_thread``: the loop keeps answering pings and reports meanwhile), waiting with
timeouts (``asyncio.wait_for``), pinging dedicated servers and feeding the results to the
coordinator, sending them their assignments and parts (``assign.remote``, ``install_part.remote``),
answering members' long-polls about their epoch (``watch``), exporting per-step metrics with
``ray.util.metrics`` (:mod:`scheduler.metrics` lists them; Ray's metrics agent serves them to
Prometheus and the Ray dashboard), and logging membership, epochs and failures
(:mod:`scheduler.logs`).

The actor may be restarted by Ray (``JobConfig(scheduler_restarts=n)``): it then starts empty,
and every participant re-registers with its last step and epoch (they notice its death through
their long-polls or their next call), which is all the coordinator needs to go on.

Every step each client reports ``(step, batch, rank, doc_lens, shape)`` once and gets its own
msgpack :class:`~scheduler.parts.PlanPart`: one round trip per step and batch, one msgpack message
each way (:mod:`scheduler.messages`); every layer and the backward pass reuse the plan.

Only this module of ``scheduler`` imports ray.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import ray
from ray.util import metrics

from .checks import is_int
from .config import JobConfig, legacy_fields, legacy_job_config
from .coordinator import KEEP_EPOCHS, Coordinator
from .messages import error_answer
from .outcomes import PlanOutcome, lost_text
from .logs import configure_logging
from .messages import decode_report, encode_answer
from .metrics import JOB_LABEL, metrics_of

NAMESPACE = "distca"
log = logging.getLogger(__name__)
PING_TIMEOUT_S = 2.0  # a server that does not answer a ping within this is left out of this plan
SUSPECT_PING_S = 0.2  # a server that missed its last ping gets this long (it rejoins once it answers)
_RETRY_S = 0.25  # while no dedicated server is alive, ping again this often


def scheduler_actor_name(name: str) -> str:
    return f"distca-scheduler-{name}"


def server_actor_name(name: str, index: int) -> str:
    return f"distca-server-{name}-{index}"


def job_actor_names(name: str) -> list[str]:
    """Names of job ``name``'s actors alive in namespace ``distca`` (scheduler first, then its
    servers by index), found by name: without asking the scheduler, which may be gone."""
    found = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a.get("namespace") == NAMESPACE}
    prefix = server_actor_name(name, "")
    servers = sorted((n for n in found if n.startswith(prefix) and n[len(prefix):].isdigit()),
                     key=lambda n: int(n[len(prefix):]))
    return [n for n in (scheduler_actor_name(name),) if n in found] + servers


def ray_metrics(source: str) -> dict:
    """``{name: ray.util.metrics object}`` of the metrics ``source`` (``"scheduler"`` or
    ``"server"``) exports, built from :data:`scheduler.metrics.METRICS`."""
    out = {}
    for name, m in metrics_of(source).items():
        if m.kind == "gauge":
            out[name] = metrics.Gauge(name, m.help, m.tags)
        elif m.kind == "counter":
            out[name] = metrics.Counter(name, m.help, m.tags)
        else:
            out[name] = metrics.Histogram(name, m.help, list(m.boundaries), m.tags)
    return out


def total_bytes(traffic: dict) -> int:
    """All bytes of a ``{round_kind: {tensor: bytes}}`` traffic dict."""
    return sum(sum(per.values()) for per in traffic.values())


def _live_workers() -> tuple[set[str], set[str]] | None:
    """Ids of the live Ray worker processes and of the finished Ray jobs, from Ray's control
    store; None if it cannot be read. (Ray has no public call for this without its dashboard.)"""
    try:
        from ray._private import state
        return set(state.workers()), {j["JobID"] for j in state.jobs() if j["IsDead"]}
    except Exception:  # an older or newer Ray: liveness unknown, every registered client is listed
        return None


# SchedulerActor's old settings, by position or keyword (deprecated: pass config=JobConfig(...)).
LEGACY_ARGS = ("mode", "epsilon", "min_shard", "timeout_s", "failure_grace_s", "backend", "coordinator_options")


@ray.remote(num_cpus=0)
class SchedulerActor:
    """The scheduler of job ``name`` (one per job; see :func:`distca_server.launch`).

    Args:
        name: job name; the actor is registered as ``distca-scheduler-<name>`` in namespace
            ``distca``.
        config: the job's settings (:class:`~scheduler.config.JobConfig`; default
            ``JobConfig()``), handed to its :class:`~scheduler.coordinator.Coordinator`.
        *legacy_args, **legacy: deprecated: the old settings (``mode``, ``epsilon``,
            ``min_shard``, ``timeout_s``, ``failure_grace_s``, ``backend``, ``coordinator_options``
            by position or keyword). They warn and build the config.

    Raises:
        ConfigError: bad settings (a ``ValueError`` naming every one); TypeError: ``config``
            together with deprecated settings.
    """

    def __init__(self, name: str, *legacy_args, config: JobConfig | None = None, **legacy):
        given = legacy_fields("SchedulerActor", legacy_args, legacy, positional=LEGACY_ARGS, accepted=LEGACY_ARGS)
        config = legacy_job_config("SchedulerActor", config, given)
        self.coord = Coordinator(name, config=config)
        self.name, self.mode, self.timeout_s = name, config.plan.mode, config.timeout_s
        self.incarnation = f"{os.getpid()}-{time.time_ns()}"  # a restarted scheduler is another one
        self.handles: dict[int, object] = {}  # dedicated server id -> its actor handle
        self._batch_done: dict[tuple[int, int], asyncio.Event] = {}  # set when the batch resolves
        self._deadlines: dict[tuple[int, int], asyncio.TimerHandle] = {}  # of batches not resolved
        self._bootstrap_set: dict[int, asyncio.Event] = {}
        self._verdict_set: dict[int, asyncio.Event] = {}
        self._arbitration: dict[int, asyncio.Event] = {}  # epoch -> set once its arbitration opens
        self._discovering = None  # the search for servers by name after a restart, while it runs
        self._tags = {JOB_LABEL: name}
        self.m = ray_metrics("scheduler")
        self._lost_counted: set[int] = set()  # epochs whose lost participants are counted
        configure_logging(scheduler_actor_name(name))
        log.info("job %s: scheduler %s up (%s mode, epsilon %g, min_shard %s, timeout %g s)",
                 name, self.incarnation, self.mode, config.plan.epsilon, config.plan.min_shard, self.timeout_s)

    # ---- membership --------------------------------------------------------------------------
    async def register_client(self, rank: int, world_size: int, info: dict) -> dict:
        """A client joins (or rejoins after a restart of its own or of the scheduler) as ``rank``
        of ``world_size``; ``info`` may carry its last ``step`` and ``epoch``.

        Returns ``{"name", "mode", "timeout_s", "backend", "next_step", "keep_activations",
        "transport", "config", "scheduler", "token"}``: the job's settings, the step it must start at, this
        scheduler's incarnation, and this registration's secret (``fail_step`` and
        ``plan_descriptor`` ask for it; each registration replaces the rank's earlier one).

        Raises:
            ValueError: rank out of range or a world size other than the job's, or the job's
                clients belong to another Ray job that is still running (``info["job_id"]``).
        """
        self._check_ray_job(rank, info.get("job_id"))
        out = self.coord.register_client(rank, world_size, dict(info, registered=time.time()))
        token = self.coord.issue_token(rank)
        log.info("job %s: client rank %d of %d registered (node %s, pid %s, step %s); it goes on at step %d",
                 self.name, rank, world_size, info.get("node", "?"), info.get("pid", "?"), info.get("step", "?"),
                 out["next_step"])
        self._wake_resolved()
        self._discovery()  # after a restart, clients register first: find the servers meanwhile
        return dict(out, scheduler=self.incarnation, token=token)

    def _check_ray_job(self, rank: int, ray_job: str | None) -> None:
        """A job serves the clients of one Ray job (one training run's driver) at a time: a client
        of another Ray job, e.g. a second run that picked the same ``name``, would otherwise take
        over a rank of the running one (registering again is how a restarted client rejoins) and
        the two runs would mix their rounds. It may join once the other Ray job has ended."""
        held = {c.get("job_id") for c in self.coord.clients.values()} - {None, ray_job}
        if ray_job is None or not held:
            return
        # ray.state's job table is the GCS's (Ray has no public call for one job's liveness).
        alive = sorted(j["JobID"] for j in ray._private.state.jobs() if j["JobID"] in held and not j["IsDead"])
        if alive:
            raise ValueError(f"distca job {self.name!r} serves the clients of Ray job(s) {alive}; a client "
                             f"of Ray job {ray_job} cannot join it as rank {rank}: use another job name "
                             f"(`distca up --name ...`), or end that run first")

    def settings(self) -> dict:
        """The job's settings (:meth:`Coordinator.settings`), read-only: what a client checks its
        own against before it registers."""
        return self.coord.settings()

    def unregister_client(self, rank: int, incarnation: str) -> None:
        self.coord.unregister_client(rank, incarnation)
        log.info("job %s: client rank %d left", self.name, rank)

    def register_server(self, index: int, handle, info: dict) -> str:
        """A dedicated server (re)starts, or re-registers with a restarted scheduler (``info``
        may carry its last ``epoch``); it joins the next group epoch. Returns this scheduler's
        incarnation."""
        self.coord.register_server(index, dict(info, registered=time.time()))
        self.handles[index] = handle
        log.info("job %s: attention server %d registered (node %s, pid %s)", self.name, index,
                 info.get("node", "?"), info.get("pid", "?"))
        return self.incarnation

    def _discovery(self):
        """A restarted scheduler knows no server yet: start finding the job's servers by name
        (each also re-registers by itself once it notices the restart, but later). Returns the
        running search, or None."""
        if self.mode == "dedicated" and not self.handles and self._discovering is None:
            self._discovering = asyncio.ensure_future(self._discover_servers())
        return self._discovering

    async def _discover_servers(self) -> None:
        prefix = server_actor_name(self.name, "")

        async def register(name):
            try:
                handle = ray.get_actor(name, namespace=NAMESPACE)
                info = await asyncio.wait_for(handle.describe.remote(), timeout=self.timeout_s)
            except Exception:  # gone or restarting: it registers itself when it is back
                return
            if info["index"] not in self.handles:
                self.register_server(info["index"], handle, info)
        try:
            await asyncio.gather(*(register(n) for n in job_actor_names(self.name) if n.startswith(prefix)))
        finally:
            self._discovering = None

    async def _live_servers(self) -> list[int]:
        """Ping every server not known dead (a suspect one briefly); returns the ids that answered
        ready. A server is ready when its serving loop is not stuck in a failed epoch."""
        search = self._discovery() if not self.handles else None
        if search is not None:
            await search
        async def state(i, was):
            try:
                ready = await asyncio.wait_for(self.handles[i].ping.remote(),
                                               timeout=PING_TIMEOUT_S if was == "alive" else SUSPECT_PING_S)
                return "alive" if ready else "suspect"
            except ray.exceptions.ActorDiedError:
                return "dead"
            except Exception:  # slow, unreachable or restarting: try again at the next plan
                return "suspect"
        ids = self.coord.servers_to_ping()
        states = await asyncio.gather(*(state(i, was) for i, was in ids.items()))
        return self.coord.servers_pinged(dict(zip(ids, states)))

    def _wake_resolved(self) -> None:
        """Wake the waiters of every batch the coordinator resolved since the last call."""
        for key in self.coord.drain_resolved():
            deadline = self._deadlines.pop(key, None)
            if deadline is not None:
                deadline.cancel()
            event = self._batch_done.get(key)
            if event is not None:
                event.set()

    # ---- planning ------------------------------------------------------------------------------
    async def report(self, request: bytes) -> bytes:
        """A client's documents for ``(step, batch)``; answers with its part once all have reported.

        ``request`` is a :func:`scheduler.messages.encode_report` message (step, batch, rank,
        documents, ``shape = {"cost": CostModel.to_wire(), "device_type": "cpu" | "cuda"}``). The
        answer (:func:`scheduler.messages.decode_answer`) is ``{"part": bytes, "group": {"epoch",
        "world_rank", "world_size", "device_type", "transport"}}`` or ``{"error": kind, "message": str}`` where
        kind is ``"ValueError"`` (bad input, sent to every client of the batch; a malformed
        request, to its sender alone) or ``"DistCAError"`` (a client never reported, no live
        server; to its sender alone, a report without the token of the rank's current
        registration: a client that another client of its rank replaced). One bytes argument and a
        bytes answer: see :mod:`scheduler.messages` for why.
        """
        try:
            step, batch, rank, doc_lens, shape, token = decode_report(request)
        except ValueError as exc:
            return encode_answer(error_answer("ValueError", str(exc)))
        if is_int(rank) and rank in self.coord.clients:  # an unregistered rank is told to register
            try:
                self.coord.check_member(rank, token, "report")
            except ValueError:
                return encode_answer(error_answer(
                    "DistCAError", f"job {self.name!r} refused a report of rank {rank}: another client registered "
                                   f"as rank {rank} since this one did (it replaced this one, which takes no "
                                   f"further part in the job: close it)"))
        return encode_answer(await self._report(step, batch, rank, doc_lens, shape))

    async def _report(self, step, batch, rank, doc_lens, shape) -> dict:
        out = self.coord.report(step, batch, rank, doc_lens, shape)
        self._wake_resolved()
        if out.answer is not None:
            return out.answer
        key = (step, batch)
        done = self._batch_event(key, rank)
        if out.plan:
            await self._plan(key, done)
        await done.wait()  # set when the batch resolves: planned, failed, or its deadline passed
        return self.coord.answer(step, batch, rank)

    def fail_step(self, step: int, rank: int, message: str, token: str | None = None) -> dict:
        """Client ``rank`` raised ``ValueError(message)`` on its own input in ``step``: every
        client of the step gets it at once (see :meth:`Coordinator.fail_step`).

        Raises:
            ValueError: ``token`` is not the secret ``rank``'s registration returned (only the
                job's own clients fail its steps), or ``step`` not an int >= 0.
        """
        self.coord.check_member(rank, token, "fail_step")
        answer = self.coord.fail_step(step, rank, message)
        self._wake_resolved()
        return answer

    def _batch_event(self, key, rank: int) -> asyncio.Event:
        """The event set when batch ``key`` resolves. Made at the batch's first waiting report,
        with the batch's deadline ``timeout_s`` later: one timer per batch rather than one per
        waiting client (the first reporter's wait is the one that would time out first anyway)."""
        event = self._batch_done.get(key)
        if event is None:
            event = self._batch_done[key] = asyncio.Event()
            self._deadlines[key] = asyncio.get_running_loop().call_later(
                self.timeout_s, self._expire, key, rank, event)
        return event

    def _expire(self, key, rank: int, event: asyncio.Event) -> None:
        """Batch ``key`` did not resolve by its deadline: every client gets an error (naming the
        ranks that never reported), and so does every later report of its step. ``event`` is
        set here too: the coordinator may have forgotten the batch unresolved (a later step
        resolved), and its event with it."""
        self._deadlines.pop(key, None)
        self.coord.abort(key[0], key[1], rank)
        self._wake_resolved()
        event.set()

    async def _plan(self, key, done: asyncio.Event) -> None:
        step, batch = key
        try:
            servers = None
            if self.mode == "dedicated":
                # Stop waiting for a live server before the batch's own deadline: then the
                # clients hear that no server lives, not only that the batch was not planned.
                loop = asyncio.get_running_loop()
                timer = self._deadlines.get(key)
                deadline = ((timer.when() if timer is not None else loop.time() + self.timeout_s)
                            - SUSPECT_PING_S - 2 * _RETRY_S)
                servers = await self._live_servers()
                while not servers and loop.time() < deadline:
                    await asyncio.sleep(_RETRY_S)
                    servers = await self._live_servers()
                servers = self.coord.servers_for(step, servers)  # one group per step: see servers_for
            # Planning and cutting run on a worker thread: the loop keeps answering meanwhile.
            work = self.coord.plan_work(step, batch, servers)
            cut = await asyncio.to_thread(work) if work is not None else None
            out = self.coord.plan(step, batch, servers, cut=cut)
            self._send(out, step, batch)
        except Exception as exc:  # a bug must not leave the clients waiting for the timeout
            log.exception("job %s: planning step %s batch %s failed", self.name, step, batch)
            self.coord.abort(step, batch, 0, f"step {step} batch {batch}: planning failed: "
                                             f"{type(exc).__name__}: {exc}")
        finally:
            self._wake_resolved()
            done.set()
            for old in [k for k in self._batch_done if k not in self.coord.batches]:
                del self._batch_done[old]

    def _send(self, out: PlanOutcome, step: int, batch: int) -> None:
        for a in out.assignments:  # before the parts: a server joins the epoch, then serves
            self.handles[a.server].assign.remote(a.epoch, a.world_rank, a.world_size, a.plan_index,
                                                 a.device_type, self.coord.transport)
        for sid, data in out.server_parts:
            self.handles[sid].install_part.remote(step, batch, data)
        if out.record is not None:
            self._export(out.record)

    def _export(self, rec: dict) -> None:
        """The plan's record as metrics: gauges hold the last plan, histograms every plan."""
        m, tags = self.m, self._tags
        for key in ("imbalance_before", "imbalance_after", "plan_ms", "cut_ms"):
            m[f"distca_{key}"].set(rec[key], tags=tags)
            m[f"distca_step_{key}"].observe(rec[key], tags=tags)
        for kind, total in rec["bytes"].items():
            round_tags = {JOB_LABEL: self.name, "round": kind}
            m["distca_bytes_per_round"].set(total, tags=round_tags)
            # every plan, one that moves nothing too (its own bucket): the mean per step counts it
            m["distca_step_bytes_per_round"].observe(total, tags=round_tags)
        # a known server left out of this plan (dead, suspect) carries no load now, not its last one
        for sid in sorted(set(rec["server_flops"]) | set(self.coord.servers)):
            server_tags = {JOB_LABEL: self.name, "server": str(sid)}
            m["distca_server_flops"].set(rec["server_flops"].get(sid, 0.0), tags=server_tags)
            m["distca_server_tasks"].set(rec["server_tasks"].get(sid, 0), tags=server_tags)
            m["distca_server_held_bytes"].set(rec["server_held_bytes"].get(sid, 0), tags=server_tags)
        m["distca_steps_planned"].inc(tags=tags)
        log.debug("job %s: planned step %d batch %d: imbalance %.3f -> %.3f, %d CA-tasks, plan %.2f ms, "
                  "cut %.2f ms", self.name, rec["step"], rec["batch"], rec["imbalance_before"],
                  rec["imbalance_after"], rec["num_tasks"], rec["plan_ms"], rec["cut_ms"])

    def _count_lost(self, verdict: dict) -> None:
        """Count and log the participants a verdict names lost, once per failed epoch."""
        epoch = verdict["epoch"]
        if epoch in self._lost_counted or epoch not in self.coord.failures:
            return  # counted already, or an epoch that was over (its verdict names nobody)
        self._lost_counted.add(epoch)
        for old in [e for e in self._lost_counted if e < self.coord.epoch - KEEP_EPOCHS]:
            self._lost_counted.discard(old)
        members = self.coord.groups.get(epoch, {})
        for r in verdict["lost_ranks"]:
            role = "client" if r not in members or members[r].client else "server"
            self.m["distca_lost_participants"].inc(tags={JOB_LABEL: self.name, "role": role})
        log.warning("job %s: group epoch %d failed (%s); lost: %s; next step %d", self.name, epoch,
                    verdict["cause"][:300], lost_text(verdict), verdict["next_step"])

    # ---- bootstrap ----------------------------------------------------------------------------
    def publish_bootstrap(self, epoch: int, value) -> None:
        """World rank 0 of group ``epoch`` publishes its bootstrap value (see
        :meth:`Coordinator.publish_bootstrap`; ``ValueError`` if oversized or not msgpack data)."""
        self.coord.publish_bootstrap(epoch, value)
        self._bootstrap_event(epoch).set()

    async def bootstrap(self, epoch: int):
        """Group ``epoch``'s bootstrap value once world rank 0 published it (None on timeout)."""
        try:
            await asyncio.wait_for(self._bootstrap_event(epoch).wait(), timeout=self.timeout_s)
        except asyncio.TimeoutError:
            return None
        return self.coord.bootstrap(epoch)

    def _bootstrap_event(self, epoch: int) -> asyncio.Event:
        for old in [e for e in self._bootstrap_set if e < self.coord.epoch - KEEP_EPOCHS]:
            del self._bootstrap_set[old]
        return self._bootstrap_set.setdefault(epoch, asyncio.Event())

    # ---- failures ------------------------------------------------------------------------------
    async def report_failure(self, epoch: int, world_rank: int, step: int, reached: int = 0,
                             cause: str | None = None, detected: bool = False, in_round: bool = True,
                             waited_s: float | None = None) -> dict:
        """A member of group ``epoch`` checks in to its failure (see :meth:`Coordinator.failure`):
        a round failed for it (``cause``), or it answers the arbitration. Returns the verdict once
        every member has checked in or the grace period ends."""
        out = self.coord.failure(epoch, world_rank, step, time.monotonic(), reached, cause, detected, in_round,
                                 waited_s)
        self._wake_resolved()
        if out.opened:  # wake every member's long-poll: they check in at once
            self._arbitration.setdefault(epoch, asyncio.Event()).set()
        decided = self._verdict_set.setdefault(epoch, asyncio.Event())
        verdict = out.verdict
        while verdict is None:
            try:
                await asyncio.wait_for(decided.wait(), timeout=max(0.0, out.deadline - time.monotonic()) + 1e-3)
            except asyncio.TimeoutError:
                pass
            verdict = self.coord.close_failure(epoch, time.monotonic())
        self._wake_resolved()
        self._count_lost(verdict)
        decided.set()  # wake the other members waiting for this verdict
        for table in (self._verdict_set, self._arbitration):
            for old in [e for e in table if e < self.coord.epoch - KEEP_EPOCHS]:
                del table[old]
        return verdict

    async def watch(self, epoch: int, poll_s: float = 5.0) -> dict:
        """A member's long-poll about group ``epoch``: ``{"state", "scheduler"}`` with state
        ``"open"``/``"decided"`` as soon as the epoch's arbitration opens (check in), None after
        ``poll_s`` seconds of nothing; ``scheduler`` is this scheduler's incarnation (a member
        that registered with another one re-registers)."""
        state = self.coord.arbitration(epoch)
        if state is None and epoch >= self.coord.epoch - KEEP_EPOCHS:
            try:
                await asyncio.wait_for(self._arbitration.setdefault(epoch, asyncio.Event()).wait(),
                                       timeout=poll_s)
            except asyncio.TimeoutError:
                pass
            state = self.coord.arbitration(epoch)
        elif state is None:  # a forgotten epoch (or none, -1): just a heartbeat
            await asyncio.sleep(poll_s)
        return {"state": state, "scheduler": self.incarnation}

    # ---- inspection ----------------------------------------------------------------------------
    def plan_descriptor(self, step: int, batch: int, rank: int | None = None,
                        token: str | None = None) -> bytes | None:
        """The whole plan of ``(step, batch)`` as msgpack (for ``DistCAClient.last_plan``), or None
        once the scheduler no longer keeps it. A plan shows every rank's document lengths: only
        the job's clients may read it (``rank`` and the ``token`` its registration returned).

        Raises:
            ValueError: a kept plan asked for without ``rank``'s current token.
        """
        data = self.coord.plan_descriptor(step, batch)
        if data is not None:  # nothing kept, nothing to guard: a caller learns no more than status shows
            self.coord.check_member(rank, token, "plan_descriptor")
        return data

    def ping(self) -> bool:
        return True

    async def status(self) -> dict:
        """Job state for ``distca status``: servers (with their own counters), last plan, epoch,
        and this actor's process id (``pid``).

        ``clients`` lists the registered clients whose process is alive (``clients_gone`` the
        others); a server that does not answer shows no load (its last plan is stale)."""
        st = dict(self.coord.status(), pid=os.getpid())
        live = await asyncio.to_thread(_live_workers)  # a read of Ray's control store
        if live is not None:
            workers, dead_jobs = live
            gone = [r for r, c in self.coord.clients.items()
                    if c.get("worker") is not None and c["worker"] not in workers
                    and (not c.get("driver") or c.get("job_id") in dead_jobs)]
            st["clients"] = [r for r in st["clients"] if r not in gone]
            st["clients_gone"] = sorted(gone)
            if self.mode == "inplace":  # the rows are the clients: a gone one serves nothing
                for row in st["servers"]:
                    if row["server"] in gone:
                        row.update(state="gone", last_flops=None, last_tasks=None, last_held_bytes=None)
        for row in st["servers"]:
            if row["state"] == "dead" or row["server"] not in self.handles:
                continue
            try:
                stats = await asyncio.wait_for(self.handles[row["server"]].stats.remote(), timeout=PING_TIMEOUT_S)
                row.update(rounds_served=stats["rounds_served"], state=stats["state"],
                           last_error=stats["last_error"], bytes_sent=total_bytes(stats["traffic"]),
                           peak_held_bytes=stats["peak_held_bytes"])  # kept activations, most ever held
            except Exception:  # a dead actor answers with some Ray error
                row.update(state="unreachable", last_flops=None, last_tasks=None, last_held_bytes=None)
        return st

    def metric_names(self) -> list[str]:
        """Names of the metrics this actor exports."""
        return sorted(m.info["name"] for m in self.m.values())
