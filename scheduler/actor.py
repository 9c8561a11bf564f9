"""``SchedulerActor``: the job's central scheduler, a named async Ray actor.

Every step each client reports ``(step, batch, rank, doc_lens, shape)``; once all ``W`` clients of
that batch have reported, the actor plans it with :func:`scheduler.plan_batch` over the live
servers and answers each client — and pushes each dedicated server — its own msgpack
:class:`~scheduler.parts.PlanPart`. One round trip per step and batch: every layer and the
backward pass reuse the plan. The actor also keeps the group epochs (who is in the all-to-all),
relays the rendezvous address, decides who was lost after a failure, and exports per-step metrics
with ``ray.util.metrics`` (they appear on the Ray dashboard).

Only this module of ``scheduler`` imports ray.
"""

from __future__ import annotations

import asyncio
import time

import ray
from ray.util import metrics

from .cost import CostModel
from .parts import plan_part
from .planner import plan_batch

NAMESPACE = "distca"
PLANS_KEPT = 16  # whole plans kept for plan_descriptor (clients read them lazily, for last_plan)


def scheduler_actor_name(name: str) -> str:
    return f"distca-scheduler-{name}"


def server_actor_name(name: str, index: int) -> str:
    return f"distca-server-{name}-{index}"


class _Batch:
    def __init__(self, world_size: int):
        self.reports: dict[int, tuple] = {}
        self.done = asyncio.Event()
        self.answers: dict[int, dict] | None = None
        self.error: dict | None = None
        self.world_size = world_size


class _Failure:
    def __init__(self, members: dict[int, str]):
        self.members = members  # world rank -> description
        self.reported: set[int] = set()
        self.done = asyncio.Event()
        self.result: dict | None = None


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
        if mode not in ("dedicated", "inplace"):
            raise ValueError(f"mode must be 'dedicated' or 'inplace', got {mode!r}")
        self.name, self.mode, self.epsilon, self.min_shard = name, mode, epsilon, min_shard
        self.timeout_s, self.failure_grace_s, self.backend = timeout_s, failure_grace_s, backend
        self.world_size: int | None = None
        self.clients: dict[int, dict] = {}
        self.servers: dict[int, dict] = {}
        self.epoch = -1
        self.members: tuple | None = None
        self.epoch_servers: list[int] = []  # server ids of the current epoch, in plan order
        self.batches: dict[tuple[int, int], _Batch] = {}
        self.plans: dict[tuple[int, int], object] = {}  # (step, batch) -> Plan, the newest PLANS_KEPT
        self.stores: dict[int, tuple[str, int]] = {}
        self.store_events: dict[int, asyncio.Event] = {}
        self.failures: dict[int, _Failure] = {}
        self.next_step = 0
        self.last: dict = {}
        self.steps_planned = 0
        tags = ("job",)
        self._tags = {"job": name}
        self.m = {
            "imbalance_before": metrics.Gauge("distca_imbalance_before", "max/mean attention FLOPs over ranks, no balancing", tags),
            "imbalance_after": metrics.Gauge("distca_imbalance_after", "max/mean attention FLOPs over servers under the plan", tags),
            "plan_ms": metrics.Gauge("distca_plan_ms", "milliseconds to plan the last batch", tags),
            "bytes_per_round": metrics.Gauge("distca_bytes_per_round", "bytes moved off-rank by one round of one layer", ("job", "round")),
            "server_flops": metrics.Gauge("distca_server_flops", "forward attention FLOPs per layer on a server", ("job", "server")),
            "server_tasks": metrics.Gauge("distca_server_tasks", "CA-tasks on a server", ("job", "server")),
            "steps_planned": metrics.Counter("distca_steps_planned", "batches planned", tags),
        }

    # ---- membership --------------------------------------------------------------------------
    def register_client(self, rank: int, world_size: int, info: dict) -> dict:
        """A client joins (or rejoins after a restart) as ``rank`` of ``world_size``.

        Returns the job's settings and the step it must start at.

        Raises:
            ValueError: rank out of range or a world size other than the job's.
        """
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if self.world_size is None:
            self.world_size = world_size
        elif world_size != self.world_size:
            raise ValueError(f"job {self.name!r} has {self.world_size} clients, not {world_size}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
        self.clients[rank] = dict(info, rank=rank, registered=time.time())
        return {"name": self.name, "mode": self.mode, "timeout_s": self.timeout_s,
                "backend": self.backend, "next_step": self.next_step}

    def unregister_client(self, rank: int, incarnation: str) -> None:
        if self.clients.get(rank, {}).get("incarnation") == incarnation:
            del self.clients[rank]

    def register_server(self, index: int, handle, info: dict) -> None:
        """A dedicated server (re)starts; it joins the next group epoch."""
        self.servers[index] = dict(info, index=index, handle=handle, state="alive", registered=time.time())

    async def _live_servers(self) -> list[int]:
        async def alive(i):
            try:
                await asyncio.wait_for(self.servers[i]["handle"].ping.remote(), timeout=2.0)
                return True
            except Exception:  # dead or unreachable actor: any Ray error means "not serving"
                return False
        ids = sorted(i for i, s in self.servers.items() if s["state"] == "alive")
        oks = await asyncio.gather(*(alive(i) for i in ids))
        for i, ok in zip(ids, oks):
            if not ok:
                self.servers[i]["state"] = "dead"
        return [i for i, ok in zip(ids, oks) if ok]

    async def _form_epoch(self, device_type: str) -> tuple[int, list[int]]:
        """Decide this batch's group: the current epoch, or a new one if membership changed."""
        servers: list[int] = []
        if self.mode == "dedicated":
            deadline = time.monotonic() + self.timeout_s
            servers = await self._live_servers()
            while not servers:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"job {self.name!r} has no live attention server")
                await asyncio.sleep(0.25)
                servers = await self._live_servers()
        clients = tuple(self.clients[r]["incarnation"] for r in range(self.world_size))
        members = (clients, tuple((i, self.servers[i]["incarnation"]) for i in servers), device_type)
        if members != self.members:
            self.epoch += 1
            self.members, self.epoch_servers = members, servers
            self.store_events[self.epoch] = asyncio.Event()
            W = self.world_size
            for plan_index, sid in enumerate(servers):
                self.servers[sid]["handle"].assign.remote(self.epoch, W + plan_index, W + len(servers),
                                                          plan_index, device_type)
        return self.epoch, self.epoch_servers

    # ---- planning ------------------------------------------------------------------------------
    async def report(self, step: int, batch: int, rank: int, doc_lens: list[int], shape: dict) -> dict:
        """Client ``rank``'s documents for ``(step, batch)``; returns its part once all have reported.

        ``shape`` is ``{"cost": CostModel.to_wire(), "device_type": "cpu" | "cuda"}``. The answer
        is ``{"part": bytes, "group": {...}}`` or ``{"error": kind, "message": str}`` where kind
        is ``"ValueError"`` (bad input, sent to every client of the batch) or ``"DistCAError"`` (a
        client never reported, no live server).
        """
        if self.world_size is None or rank not in self.clients:
            return {"error": "DistCAError", "message": f"rank {rank} is not registered with job {self.name!r}"}
        key = (step, batch)
        state = self.batches.setdefault(key, _Batch(self.world_size))
        state.reports[rank] = (doc_lens, shape)
        if len(state.reports) == self.world_size and not state.done.is_set():
            await self._plan(key, state)
        try:
            await asyncio.wait_for(state.done.wait(), timeout=self.timeout_s)
        except asyncio.TimeoutError:
            self.next_step = max(self.next_step, step + 1)
            missing = sorted(set(range(self.world_size)) - set(state.reports))
            return {"error": "DistCAError",
                    "message": f"step {step} batch {batch}: ranks {missing} did not report within "
                               f"{self.timeout_s:g} s"}
        if state.error is not None:
            return state.error
        return state.answers[rank]

    async def _plan(self, key, state: _Batch) -> None:
        step, batch = key
        try:
            shapes = {r: s for r, (_, s) in state.reports.items()}
            shape = shapes[0]
            if any(s != shape for s in shapes.values()):
                raise ValueError(f"clients disagree on the attention shape: {shapes}")
            cost = CostModel.from_wire(shape["cost"])
            doc_lens = [list(state.reports[r][0]) for r in range(self.world_size)]
            try:
                epoch, servers = await self._form_epoch(shape["device_type"])
            except TimeoutError as exc:
                state.error = {"error": "DistCAError", "message": str(exc)}
                return
            num_servers = self.world_size if self.mode == "inplace" else len(servers)
            start = time.perf_counter()
            plan = plan_batch(doc_lens, num_servers, cost=cost, epsilon=self.epsilon,
                              mode=self.mode, min_shard=self.min_shard)
            plan_ms = (time.perf_counter() - start) * 1e3
            self.plans[key] = plan
            while len(self.plans) > PLANS_KEPT:
                del self.plans[next(iter(self.plans))]
            W = self.world_size
            world = plan.num_participants
            state.answers = {
                r: {"part": plan_part(plan, r, step, batch).to_msgpack(),
                    "group": {"epoch": epoch, "world_rank": r, "world_size": world,
                              "device_type": shape["device_type"]}}
                for r in range(W)}
            if self.mode == "dedicated":
                for plan_index, sid in enumerate(servers):
                    data = plan_part(plan, W + plan_index, step, batch).to_msgpack()
                    self.servers[sid]["handle"].install_part.remote(step, batch, data)
            self._record(plan, plan_ms, step, batch, servers)
            self.next_step = max(self.next_step, step + 1)
            self._forget_old(step)
        except ValueError as exc:  # bad input: every client of the batch gets the same error
            state.error = {"error": "ValueError", "message": str(exc)}
            self.next_step = max(self.next_step, step + 1)
        finally:
            state.done.set()

    def _forget_old(self, step: int) -> None:
        for key in [k for k in self.batches if k[0] < step - 2]:
            del self.batches[key]

    def _record(self, plan, plan_ms, step, batch, servers) -> None:
        before, after = plan.imbalance()
        comm = plan.comm_bytes()
        loads = plan.server_loads()
        tasks = [len(t) for t in plan.server_tasks]
        ids = servers if self.mode == "dedicated" else list(range(plan.num_servers))
        self.last = {"step": step, "batch": batch, "imbalance_before": before, "imbalance_after": after,
                     "plan_ms": plan_ms, "bytes": {k: comm[k]["total"] for k in comm},
                     "server_flops": dict(zip(ids, loads)), "server_tasks": dict(zip(ids, tasks)),
                     "num_tasks": sum(tasks), "epoch": self.epoch}
        self.steps_planned += 1
        self.m["imbalance_before"].set(before, tags=self._tags)
        self.m["imbalance_after"].set(after, tags=self._tags)
        self.m["plan_ms"].set(plan_ms, tags=self._tags)
        for kind in ("forward", "backward"):
            self.m["bytes_per_round"].set(comm[kind]["total"], tags={"job": self.name, "round": kind})
        for sid, load, n in zip(ids, loads, tasks):
            self.m["server_flops"].set(load, tags={"job": self.name, "server": str(sid)})
            self.m["server_tasks"].set(n, tags={"job": self.name, "server": str(sid)})
        self.m["steps_planned"].inc(tags=self._tags)

    def plan_descriptor(self, step: int, batch: int) -> bytes | None:
        """The whole plan of ``(step, batch)`` as ``Plan.to_msgpack()`` bytes, or None if it is
        not among the newest ``PLANS_KEPT`` planned (``DistCAClient.last_plan`` on Ray)."""
        plan = self.plans.get((step, batch))
        return None if plan is None else plan.to_msgpack()

    # ---- rendezvous ----------------------------------------------------------------------------
    def publish_store(self, epoch: int, host: str, port: int) -> None:
        self.stores[epoch] = (host, port)
        self.store_events.setdefault(epoch, asyncio.Event()).set()

    async def store_address(self, epoch: int) -> tuple[str, int] | None:
        """The rendezvous address of group ``epoch`` once world rank 0 published it (None on timeout)."""
        event = self.store_events.setdefault(epoch, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout=self.timeout_s)
        except asyncio.TimeoutError:
            return None
        return self.stores[epoch]

    # ---- failures ------------------------------------------------------------------------------
    def _describe_members(self, epoch: int) -> dict[int, str]:
        if epoch != self.epoch or self.members is None:
            return {}
        out = {r: f"client rank {r} (node {self.clients.get(r, {}).get('node', '?')})"
               for r in range(self.world_size)}
        W = self.world_size
        for plan_index, sid in enumerate(self.epoch_servers):
            node = self.servers[sid].get("node", "?")
            out[W + plan_index] = f"attention server {sid} (node {node})"
        return out

    async def report_failure(self, epoch: int, world_rank: int, step: int, detail: str) -> dict:
        """A participant's round of group ``epoch`` failed. Returns ``{"lost": [...], "next_step"}``
        once every member has reported or the grace period ends; silent members are lost."""
        self.next_step = max(self.next_step, step + 1)
        fail = self.failures.get(epoch)
        if fail is None:
            fail = self.failures[epoch] = _Failure(self._describe_members(epoch))
            asyncio.get_running_loop().create_task(self._close_failure(epoch, fail))
        fail.reported.add(world_rank)
        if fail.members and fail.reported >= set(fail.members):
            fail.done.set()
        await fail.done.wait()
        return dict(fail.result, next_step=self.next_step)

    async def _close_failure(self, epoch: int, fail: _Failure) -> None:
        try:
            await asyncio.wait_for(fail.done.wait(), timeout=self.failure_grace_s)
        except asyncio.TimeoutError:
            pass
        lost = [desc for r, desc in sorted(fail.members.items()) if r not in fail.reported]
        if self.mode == "dedicated":
            await self._live_servers()  # servers that no longer answer are left out from now on
        self.members = None  # whatever happened, the next batch forms a fresh group
        fail.result = {"lost": lost}
        fail.done.set()

    # ---- inspection ----------------------------------------------------------------------------
    def ping(self) -> bool:
        return True

    async def status(self) -> dict:
        """Job state for ``distca status``: servers (with their own counters), last plan, epoch."""
        servers = []
        for sid, s in sorted(self.servers.items()):
            row = {"server": sid, "node": s.get("node", "?"), "state": s["state"], "rounds_served": None}
            if s["state"] == "alive":
                try:
                    st = await asyncio.wait_for(s["handle"].stats.remote(), timeout=2.0)
                    row["rounds_served"] = st["rounds_served"]
                    row["state"] = st["state"]
                except Exception:  # a dead actor answers with some Ray error
                    row["state"] = "unreachable"
            row["last_flops"] = self.last.get("server_flops", {}).get(sid)
            row["last_tasks"] = self.last.get("server_tasks", {}).get(sid)
            servers.append(row)
        return {"name": self.name, "mode": self.mode, "world_size": self.world_size,
                "clients": sorted(self.clients), "epoch": self.epoch, "next_step": self.next_step,
                "steps_planned": self.steps_planned, "last": self.last, "servers": servers}

    def metric_names(self) -> list[str]:
        """Names of the metrics this actor exports."""
        return sorted(m.info["name"] for m in self.m.values())
