"""``SchedulerActor``: the job's central scheduler, a named async Ray actor.

A thin wrapper of :class:`scheduler.coordinator.Coordinator`, which holds every decision
(membership, reports -> plan -> parts, group epochs, rendezvous, failure verdicts). This module
adds only what needs Ray or an event loop: planning and cutting on a worker thread
(``asyncio.to_thread``: the loop keeps answering pings and reports meanwhile), waiting with
timeouts (``asyncio.wait_for``), pinging dedicated servers and feeding the results to the
coordinator, sending them their assignments and parts (``assign.remote``, ``install_part.remote``),
and exporting per-step metrics with ``ray.util.metrics`` (they appear on the Ray dashboard).

Every step each client reports ``(step, batch, rank, doc_lens, shape)`` once and gets its own
msgpack :class:`~scheduler.parts.PlanPart`: one round trip per step and batch; every layer and the
backward pass reuse the plan.

Only this module of ``scheduler`` imports ray.
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray
from ray.util import metrics

from .coordinator import KEEP_EPOCHS, Coordinator, PlanOutcome

NAMESPACE = "distca"
log = logging.getLogger(__name__)
PING_TIMEOUT_S = 2.0  # a server that does not answer a ping within this is dead for the next epoch
_RETRY_S = 0.25  # while no dedicated server is alive, ping again this often


def scheduler_actor_name(name: str) -> str:
    return f"distca-scheduler-{name}"


def server_actor_name(name: str, index: int) -> str:
    return f"distca-server-{name}-{index}"


@ray.remote(num_cpus=0)
class SchedulerActor:
    """The scheduler of job ``name`` (one per job; see :func:`distca_server.launch`).

    Args:
        name: job name; the actor is registered as ``distca-scheduler-<name>`` in namespace
            ``distca``.
        mode: ``"dedicated"`` (attention servers are separate actors) or ``"inplace"``.
        epsilon, min_shard: planner settings (see :func:`scheduler.plan_batch`).
        timeout_s: how long any wait lasts before participants get ``DistCAError``.
        failure_grace_s: after a participant reports a failed round, how long the actor waits
            for the others to report before naming the silent ones lost.
        backend: attention kernel backend name for servers ("auto" picks the fastest).
    """

    def __init__(self, name: str, mode: str = "dedicated", epsilon: float = 0.05,
                 min_shard: int = 128, timeout_s: float = 60.0, failure_grace_s: float = 2.0,
                 backend: str = "auto"):
        self.coord = Coordinator(name, mode, epsilon=epsilon, min_shard=min_shard, timeout_s=timeout_s,
                                 failure_grace_s=failure_grace_s, backend=backend)
        self.name, self.mode, self.timeout_s = name, mode, timeout_s
        self.handles: dict[int, object] = {}  # dedicated server id -> its actor handle
        self._batch_done: dict[tuple[int, int], asyncio.Event] = {}
        self._store_set: dict[int, asyncio.Event] = {}
        self._verdict_set: dict[int, asyncio.Event] = {}
        tags = ("job",)
        self._tags = {"job": name}
        self.m = {
            "imbalance_before": metrics.Gauge("distca_imbalance_before", "max/mean attention FLOPs over ranks, no balancing", tags),
            "imbalance_after": metrics.Gauge("distca_imbalance_after", "max/mean attention FLOPs over servers under the plan", tags),
            "plan_ms": metrics.Gauge("distca_plan_ms", "milliseconds to plan the last batch (planning only)", tags),
            "cut_ms": metrics.Gauge("distca_cut_ms", "milliseconds to cut and encode the last batch's per-participant parts", tags),
            "bytes_per_round": metrics.Gauge("distca_bytes_per_round", "bytes moved off-rank by one round of one layer", ("job", "round")),
            "server_flops": metrics.Gauge("distca_server_flops", "forward attention FLOPs per layer on a server", ("job", "server")),
            "server_tasks": metrics.Gauge("distca_server_tasks", "CA-tasks on a server", ("job", "server")),
            "steps_planned": metrics.Counter("distca_steps_planned", "batches planned", tags),
        }

    # ---- membership --------------------------------------------------------------------------
    def register_client(self, rank: int, world_size: int, info: dict) -> dict:
        """A client joins (or rejoins after a restart) as ``rank`` of ``world_size``.

        Returns ``{"name", "mode", "timeout_s", "backend", "next_step"}``: the job's settings and
        the step it must start at.

        Raises:
            ValueError: rank out of range or a world size other than the job's.
        """
        return self.coord.register_client(rank, world_size, dict(info, registered=time.time()))

    def unregister_client(self, rank: int, incarnation: str) -> None:
        self.coord.unregister_client(rank, incarnation)

    def register_server(self, index: int, handle, info: dict) -> None:
        """A dedicated server (re)starts; it joins the next group epoch."""
        self.coord.register_server(index, dict(info, registered=time.time()))
        self.handles[index] = handle

    async def _live_servers(self) -> list[int]:
        """Ping every server not known dead; returns the ids that answered."""
        async def alive(i):
            try:
                await asyncio.wait_for(self.handles[i].ping.remote(), timeout=PING_TIMEOUT_S)
                return True
            except Exception:  # dead or unreachable actor: any Ray error means "not serving"
                return False
        ids = self.coord.servers_to_ping()
        oks = await asyncio.gather(*(alive(i) for i in ids))
        return self.coord.servers_pinged(dict(zip(ids, oks)))

    # ---- planning ------------------------------------------------------------------------------
    async def report(self, step: int, batch: int, rank: int, doc_lens: list[int], shape: dict) -> dict:
        """Client ``rank``'s documents for ``(step, batch)``; returns its part once all have reported.

        ``shape`` is ``{"cost": CostModel.to_wire(), "device_type": "cpu" | "cuda"}``. The answer
        is ``{"part": bytes, "group": {"epoch", "world_rank", "world_size", "device_type"}}`` or
        ``{"error": kind, "message": str}`` where kind is ``"ValueError"`` (bad input, sent to
        every client of the batch) or ``"DistCAError"`` (a client never reported, no live server).
        """
        out = self.coord.report(step, batch, rank, doc_lens, shape)
        key = (step, batch)
        if out.answer is not None:
            if out.resolved:
                self._batch_event(key).set()
            return out.answer
        done = self._batch_event(key)
        if out.plan:
            await self._plan(key, done)
        try:
            await asyncio.wait_for(done.wait(), timeout=self.timeout_s)
        except asyncio.TimeoutError:
            answer = self.coord.abort(step, batch, rank)
            done.set()  # the others of this batch get the same error now
            return answer
        return self.coord.answer(step, batch, rank)

    def _batch_event(self, key) -> asyncio.Event:
        event = self._batch_done.get(key)
        if event is None:
            event = self._batch_done[key] = asyncio.Event()
        return event

    async def _plan(self, key, done: asyncio.Event) -> None:
        step, batch = key
        try:
            servers = None
            if self.mode == "dedicated":
                deadline = time.monotonic() + self.timeout_s
                servers = await self._live_servers()
                while not servers and time.monotonic() < deadline:
                    await asyncio.sleep(_RETRY_S)
                    servers = await self._live_servers()
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
            done.set()
            for old in [k for k in self._batch_done if k not in self.coord.batches]:
                del self._batch_done[old]

    def _send(self, out: PlanOutcome, step: int, batch: int) -> None:
        for a in out.assignments:  # before the parts: a server joins the epoch, then serves
            self.handles[a.server].assign.remote(a.epoch, a.world_rank, a.world_size, a.plan_index,
                                                 a.device_type)
        for sid, data in out.server_parts:
            self.handles[sid].install_part.remote(step, batch, data)
        if out.record is not None:
            self._export(out.record)

    def _export(self, rec: dict) -> None:
        tags = self._tags
        self.m["imbalance_before"].set(rec["imbalance_before"], tags=tags)
        self.m["imbalance_after"].set(rec["imbalance_after"], tags=tags)
        self.m["plan_ms"].set(rec["plan_ms"], tags=tags)
        self.m["cut_ms"].set(rec["cut_ms"], tags=tags)
        for kind, total in rec["bytes"].items():
            self.m["bytes_per_round"].set(total, tags={"job": self.name, "round": kind})
        for sid, load in rec["server_flops"].items():
            self.m["server_flops"].set(load, tags={"job": self.name, "server": str(sid)})
            self.m["server_tasks"].set(rec["server_tasks"][sid], tags={"job": self.name, "server": str(sid)})
        self.m["steps_planned"].inc(tags=tags)

    # ---- rendezvous ----------------------------------------------------------------------------
    def publish_store(self, epoch: int, host: str, port: int) -> None:
        self.coord.publish_store(epoch, host, port)
        self._store_event(epoch).set()

    async def store_address(self, epoch: int) -> tuple[str, int] | None:
        """The rendezvous address of group ``epoch`` once world rank 0 published it (None on timeout)."""
        try:
            await asyncio.wait_for(self._store_event(epoch).wait(), timeout=self.timeout_s)
        except asyncio.TimeoutError:
            return None
        return self.coord.store_address(epoch)

    def _store_event(self, epoch: int) -> asyncio.Event:
        for old in [e for e in self._store_set if e < self.coord.epoch - KEEP_EPOCHS]:
            del self._store_set[old]
        return self._store_set.setdefault(epoch, asyncio.Event())

    # ---- failures ------------------------------------------------------------------------------
    async def report_failure(self, epoch: int, world_rank: int, step: int, detail: str) -> dict:
        """A participant's round of group ``epoch`` failed. Returns ``{"lost": [...], "next_step"}``
        once every member has reported or the grace period ends; silent members are lost."""
        out = self.coord.failure(epoch, world_rank, step, time.monotonic())
        decided = self._verdict_set.setdefault(epoch, asyncio.Event())
        verdict = out.verdict
        while verdict is None:
            try:
                await asyncio.wait_for(decided.wait(), timeout=max(0.0, out.deadline - time.monotonic()) + 1e-3)
            except asyncio.TimeoutError:
                pass
            verdict = self.coord.close_failure(epoch, time.monotonic())
        decided.set()  # wake the other members waiting for this verdict
        for old in [e for e in self._verdict_set if e < self.coord.epoch - KEEP_EPOCHS]:
            del self._verdict_set[old]
        return verdict

    # ---- inspection ----------------------------------------------------------------------------
    def plan_descriptor(self, step: int, batch: int) -> bytes | None:
        """The whole plan of ``(step, batch)`` as msgpack (for ``DistCAClient.last_plan``), or None
        once the scheduler no longer keeps it."""
        return self.coord.plan_descriptor(step, batch)

    def ping(self) -> bool:
        return True

    async def status(self) -> dict:
        """Job state for ``distca status``: servers (with their own counters), last plan, epoch."""
        st = self.coord.status()
        for row in st["servers"]:
            if row["state"] != "alive":
                continue
            try:
                stats = await asyncio.wait_for(self.handles[row["server"]].stats.remote(), timeout=PING_TIMEOUT_S)
                row["rounds_served"] = stats["rounds_served"]
                row["state"] = stats["state"]
            except Exception:  # a dead actor answers with some Ray error
                row["state"] = "unreachable"
        return st

    def metric_names(self) -> list[str]:
        """Names of the metrics this actor exports."""
        return sorted(m.info["name"] for m in self.m.values())
