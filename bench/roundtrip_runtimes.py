"""The two runtimes ``bench/roundtrip.py`` measures, one step at a time: the Ray job with its client
actors (:class:`RayRunner`, :class:`BenchClient`) and the in-process baseline
(:class:`LocalRunner`); the workload both get and the per-round summary of a step's timings. Also
the Ray start every Ray benchmark shares (:func:`start_local_ray`).

:class:`BenchClient` runs in the Ray workers: :func:`ship_by_value` sends it there with this module's
code, so the workers need not import ``bench/``."""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from distca_client import DistCAClient
from distca_server.runtime.local import split_documents
from distca_server.wire import RowFormat
from distca_sim.workloads import sample_batch
try:
    from scheduler.config import JobConfig, PlanConfig
except ImportError:  # a checkout from before the config (DISTCA_TREE): it takes keyword arguments
    JobConfig = PlanConfig = None
from scheduler.cost import CostModel

TRACE = "pretrain"
SHAPE = {"num_heads_q": 8, "num_heads_kv": 2, "head_dim": 64}
DTYPE = torch.float32
PHASES = ("pack", "all_to_all", "kernel", "unpack")
KINDS = ("forward", "backward")
EPSILON, MIN_SHARD = 0.05, 128
TIMEOUT_S = 120.0


def rank_inputs(num_tokens: int, seed: int, step: int, layer: int, rank: int):
    """Q, K, V, dO rows of one rank for one layer of one step (identical wherever they are made)."""
    g = torch.Generator().manual_seed(((seed * 1000 + step) * 100 + layer) * 100 + rank)
    hq, hkv, d = SHAPE["num_heads_q"], SHAPE["num_heads_kv"], SHAPE["head_dim"]
    return [torch.randn(num_tokens, h, d, generator=g, dtype=DTYPE) for h in (hq, hkv, hkv, hq)]


def row_format() -> RowFormat:
    return RowFormat(CostModel(**SHAPE, dtype_bytes=DTYPE.itemsize), DTYPE)


def step_batch(clients: int, context: int, step: int) -> list[list[int]]:
    """The step's documents, cut into ranks as ``DistCAClient.local`` cuts them."""
    docs = [l for rank in sample_batch(TRACE, clients, context, seed=0, step=step) for l in rank]
    return split_documents(docs, clients)


def _traffic_by_kind(traffic) -> dict[str, int]:
    out = {k: 0 for k in KINDS}
    for (kind, _name), n in traffic.items():
        out[kind] = out.get(kind, 0) + int(n)
    return out


class CountingGroup:
    """A process group that counts the all-to-all collectives issued through it."""

    def __init__(self, pg):
        self._pg, self.collectives = pg, 0

    def alltoall_base(self, *args):
        self.collectives += 1
        return self._pg.alltoall_base(*args)

    def __getattr__(self, name):
        return getattr(self._pg, name)


class BenchClient:
    """One training worker of the Ray runtime (a Ray actor): times its plan and rounds."""

    def __init__(self, name: str, rank: int, world_size: int, timeout_s: float, threads: int):
        torch.set_num_threads(threads)
        self.rank = rank
        self.client = DistCAClient.connect(name, rank=rank, world_size=world_size, timeout_s=timeout_s)
        self.layers: list = []

    def info(self) -> dict:
        return {"pid": os.getpid(), "torch_threads": torch.get_num_threads()}

    def _snapshot(self) -> dict:
        p = self.client.last_step.participants[0]  # this client's one participant
        return {"timings": dict(p.timings), "traffic": _traffic_by_kind(p.traffic),
                "collectives": self.collectives()}

    def collectives(self) -> int | None:
        """Collectives this client's transport issued in its group so far, counted at its process
        group (any tree's torch_dist transport calls ``pg.alltoall_base``); None before the group
        forms or on another transport."""
        member = self.client._runtime.member
        transport = member.transport if member is not None else None
        if transport is None or not hasattr(transport, "pg"):
            return None
        if not isinstance(transport.pg, CountingGroup):
            transport.pg = CountingGroup(transport.pg)
        return transport.pg.collectives

    def forward(self, lens: list[int], seed: int, step: int, layers: int) -> dict:
        """Plan the step (timed), then ``layers`` forward rounds, each timed; keeps the graphs."""
        t0 = time.perf_counter()
        self.client._runtime.step_for(list(lens), row_format(), torch.device("cpu"))
        plan_s = time.perf_counter() - t0
        self.layers, rounds = [], []
        for layer in range(layers):
            q, k, v, dout = rank_inputs(sum(lens), seed, step, layer, self.rank)
            leaves = [t.requires_grad_() for t in (q, k, v)]
            t0 = time.perf_counter()
            out = self.client.attend(*leaves, lens)
            rounds.append(time.perf_counter() - t0)
            self.layers.append((out, dout))
        return {"plan_s": plan_s, "round_s": rounds, **self._snapshot()}

    def backward(self) -> dict:
        """One backward round per layer, last layer first, each timed."""
        rounds = []
        for out, dout in reversed(self.layers):
            t0 = time.perf_counter()
            out.backward(dout)
            rounds.append(time.perf_counter() - t0)
        self.layers = []
        return {"round_s": rounds, **self._snapshot()}

    def close(self) -> None:
        self.client.close()


def ship_by_value() -> None:
    """Ship :class:`BenchClient` and what it uses from this module to the Ray workers by value."""
    import ray
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def start_local_ray(num_cpus: int, env_vars: dict[str, str] | None = None,
                    object_store_mib: int | None = None) -> bool:
    """Start this benchmark's own local Ray instance unless this process is connected to one
    already (a test's, or the caller's); True if this call started it, so the caller shuts it down.

    ``address="local"``: a benchmark measures on an instance it controls (its CPUs, its workers'
    ``env_vars``), never on a cluster that happens to run here. Without it ``ray.init`` joins a
    running cluster (``RAY_ADDRESS``, or a ``ray start`` on this machine) and refuses ``num_cpus``
    there ("When connecting to an existing cluster, num_cpus and num_gpus must not be provided")."""
    import ray
    if ray.is_initialized():
        return False
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
             object_store_memory=None if object_store_mib is None else object_store_mib * 2**20,
             runtime_env={"env_vars": env_vars} if env_vars else None, namespace="distca",
             log_to_driver=False)
    return True


# ---- aggregation -----------------------------------------------------------------------------------
def _deltas(before: dict, after: dict) -> dict[str, float]:
    return {ph: after.get(ph, 0.0) - before.get(ph, 0.0) for ph in PHASES}


def summarize_kind(per_participant: list[dict[str, float]], walls: list[list[float]], layers: int,
                   plan_s: list[float] | None) -> dict:
    """One step, one round kind. ``per_participant``: phase seconds over the step's rounds of that
    kind; ``walls``: each client's round wall times. Returns per-round milliseconds."""
    per_round = [{ph: d[ph] / layers * 1e3 for ph in PHASES} for d in per_participant]
    out = {}
    for ph in PHASES:
        vals = [d[ph] for d in per_round]
        out[f"{ph}_ms"] = max(vals)
        out[f"{ph}_mean_ms"] = statistics.fmean(vals)
    out["total_ms"] = max(statistics.fmean(w) for w in walls) * 1e3
    busiest = max(sum(d[ph] for ph in PHASES) for d in per_round)
    out["other_ms"] = out["total_ms"] - busiest
    out["participants_ms"] = per_round
    if plan_s is not None:
        out["plan_ms"] = min(plan_s) * 1e3
        out["plan_max_ms"] = max(plan_s) * 1e3
    else:
        out["plan_ms"] = out["plan_max_ms"] = None
    return out


def mean_over_steps(steps: list[dict]) -> dict:
    out = {}
    for key, value in steps[0].items():
        if isinstance(value, (int, float)) and value is not None:
            out[key] = statistics.fmean(s[key] for s in steps)
        elif value is None:
            out[key] = None
    out["steps_ms"] = [{k: v for k, v in s.items() if k != "participants_ms"} for s in steps]
    out["participants_ms"] = [s["participants_ms"] for s in steps]
    return out


# ---- the Ray runtime ----------------------------------------------------------------------------------
def _server_stats(handles) -> list[dict]:
    import ray
    return ray.get([h.stats.remote() for h in handles], timeout=60)


def _wait_rounds(handles, expected: list[int], timeout_s: float = 60.0) -> list[dict]:
    """Server stats once every server has finished ``expected`` rounds (it counts a round after
    sending its results, so a client may see the round end a little earlier)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = _server_stats(handles)
        if all(s["rounds_served"] >= e for s, e in zip(stats, expected)):
            return stats
        if time.monotonic() > deadline:
            raise RuntimeError(f"servers served {[s['rounds_served'] for s in stats]} rounds, "
                               f"expected {expected}")
        time.sleep(0.005)


def close_job(name: str, workers) -> None:
    """Close each client actor's client, kill the actors, shut job ``name`` down."""
    import ray

    from distca_server import shutdown
    for w in workers:
        try:
            ray.get(w.close.remote(), timeout=30)
        except Exception:  # a broken actor is killed below anyway
            pass
        ray.kill(w)
    shutdown(name)


class RayRunner:
    """One configuration's job on the Ray runtime: scheduler, dedicated servers, client actors."""

    def __init__(self, mode: str, clients: int, servers: int, args):
        import ray

        from distca_server import launch

        self.mode, self.clients, self.args = mode, clients, args
        self.name = f"roundtrip-{mode}-{clients}-{servers}-{os.getpid()}"
        if JobConfig is None:
            self.job = launch(name=self.name, servers=max(servers, 1), mode=mode, epsilon=EPSILON,
                              min_shard=MIN_SHARD, timeout_s=TIMEOUT_S, detached=False,
                              server_options={"num_cpus": 0})
        else:
            config = JobConfig(servers=max(servers, 1), timeout_s=TIMEOUT_S,
                               plan=PlanConfig(mode=mode, epsilon=EPSILON, min_shard=MIN_SHARD))
            self.job = launch(name=self.name, config=config, detached=False, server_options={"num_cpus": 0})
        self.servers = self.job["servers"]
        self.workers = []
        try:
            actor_cls = ray.remote(num_cpus=0)(BenchClient)
            self.workers = [actor_cls.remote(self.name, r, clients, TIMEOUT_S, args.threads)
                            for r in range(clients)]
            self.info = ray.get([w.info.remote() for w in self.workers], timeout=120)
        except BaseException:
            self.close()
            raise
        self.server_kernel_measured = not self.servers or all(
            "phase_seconds" in s for s in _server_stats(self.servers))

    def step(self, index: int, ranks: list[list[int]]) -> dict:
        """One step; per round kind the per-round summary, plus the scheduler's planning time and
        the bytes the clients sent per round."""
        import ray

        from distca_server import status

        args, layers = self.args, self.args.layers
        stats = _server_stats(self.servers)
        before = [s.get("phase_seconds", {}) for s in stats]
        served = [s["rounds_served"] for s in stats]
        pre_counts = ray.get([w.collectives.remote() for w in self.workers], timeout=TIMEOUT_S)
        fwd = ray.get([w.forward.remote(ranks[r], args.seed, index, layers)
                       for r, w in enumerate(self.workers)], timeout=TIMEOUT_S * 4)
        mid = [s.get("phase_seconds", {}) for s in _wait_rounds(self.servers, [n + layers for n in served])]
        bwd = ray.get([w.backward.remote() for w in self.workers], timeout=TIMEOUT_S * 4)
        end = [s.get("phase_seconds", {})
               for s in _wait_rounds(self.servers, [n + 2 * layers for n in served])]
        out = {"sched_plan_batch_ms": status(self.name)["last"]["plan_ms"]}
        zero = {ph: 0.0 for ph in PHASES}
        for kind, res, pre, post in (("forward", fwd, before, mid), ("backward", bwd, mid, end)):
            # a client's participant is new each step: its forward timings start at zero
            client_part = [_deltas(fwd[r]["timings"] if kind == "backward" else zero, res[r]["timings"])
                           for r in range(self.clients)]
            server_part = [_deltas(a, b) for a, b in zip(pre, post)]
            out[kind] = summarize_kind(client_part + server_part, [r["round_s"] for r in res], layers,
                                       [r["plan_s"] for r in fwd] if kind == "forward" else None)
            sent = sum(r["traffic"][kind] - (fwd[i]["traffic"][kind] if kind == "backward" else 0)
                       for i, r in enumerate(res))
            out[kind]["client_bytes_per_round"] = sent / layers
            counts = [(r["collectives"], (fwd[i]["collectives"] if kind == "backward" else pre_counts[i]))
                      for i, r in enumerate(res)]
            out[kind]["collectives_per_round"] = (
                max(a - b for a, b in counts) / layers if all(a is not None and b is not None for a, b in counts)
                else None)
        return out

    def close(self) -> None:
        close_job(self.name, self.workers)
        self.workers = []


class LocalRunner:
    """The baseline: ``DistCAClient.local`` with the same ranks, modes and planner settings."""

    def __init__(self, mode: str, clients: int, servers: int, args):
        self.clients, self.args = clients, args
        num_servers = clients if mode == "inplace" else servers
        if JobConfig is None:
            self.client = DistCAClient.local(num_servers=num_servers, epsilon=EPSILON, mode=mode,
                                             num_ranks=clients, min_shard=MIN_SHARD, timeout_s=TIMEOUT_S)
        else:
            self.client = DistCAClient.local(num_ranks=clients, config=JobConfig(
                servers=num_servers, timeout_s=TIMEOUT_S,
                plan=PlanConfig(mode=mode, epsilon=EPSILON, min_shard=MIN_SHARD)))
        self.backend = None

    def step(self, index: int, ranks: list[list[int]]) -> dict:
        args, layers, client = self.args, self.args.layers, self.client
        lens = [l for r in ranks for l in r]
        t0 = time.perf_counter()
        step = client._runtime.step_for(lens, row_format(), torch.device("cpu"))
        plan_s = time.perf_counter() - t0
        self.backend = step.backend_name
        graphs, walls = [], []
        for layer in range(layers):
            parts = [rank_inputs(sum(ranks[r]), args.seed, index, layer, r) for r in range(self.clients)]
            q, k, v, dout = (torch.cat([p[j] for p in parts]) for j in range(4))
            leaves = [t.requires_grad_() for t in (q, k, v)]
            t0 = time.perf_counter()
            out = client.attend(*leaves, lens)
            walls.append(time.perf_counter() - t0)
            graphs.append((out, dout))
        if client.last_step is not step:
            raise RuntimeError("the local client planned the step again")
        mid = [dict(p.timings) for p in step.participants]
        bwalls = []
        for out, dout in reversed(graphs):
            t0 = time.perf_counter()
            out.backward(dout)
            bwalls.append(time.perf_counter() - t0)
        end = [dict(p.timings) for p in step.participants]
        sent = {k: sum(_traffic_by_kind(p.traffic)[k] for p in step.participants if p.rank is not None)
                for k in KINDS}
        out = {"forward": summarize_kind([_deltas({}, m) for m in mid], [walls], layers, [plan_s]),
               "backward": summarize_kind([_deltas(a, b) for a, b in zip(mid, end)], [bwalls], layers, None)}
        for kind in KINDS:
            out[kind]["client_bytes_per_round"] = sent[kind] / layers
        return out

    def close(self) -> None:
        self.client.close()
