"""The Ray runtime: scheduler actor, dedicated and in-place servers, gloo all-to-all, failures.

One local Ray instance (2 CPUs, no dashboard, small object store) for most tests, and a 2-node
``ray.cluster_utils.Cluster`` (both nodes on this machine) for placement.
"""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray")

from distca_server import launch, shutdown, status  # noqa: E402
from distca_cli import format_status  # noqa: E402
from distca_server.runtime.base import sum_traffic  # noqa: E402
from scheduler.config import JobConfig, PlanConfig  # noqa: E402
from scheduler.cost import KV_TENSORS, RoundKind  # noqa: E402
from scheduler.tasks import Plan  # noqa: E402
from scripts import RUNTIME_ENV  # noqa: E402
from timing import until  # noqa: E402

TIMEOUT = 10.0
LENS = [[[61, 3, 250], [140, 1, 1, 90]], [[400], [7, 7, 7, 100]], [[33, 260], [1, 290]]]



def _workers(name, world, timeout_s=TIMEOUT):
    from ray_workers import TrainWorker
    return [TrainWorker.remote(name, r, world, timeout_s) for r in range(world)]


def _step(workers, lens_per_rank, seed, **kwargs):
    return ray.get([w.step.remote(lens_per_rank[r], seed, **kwargs) for r, w in enumerate(workers)],
                   timeout=120)


def _nonzero(traffic):
    return {kind: {n: b for n, b in per.items() if b} for kind, per in traffic.items()
            if any(per.values())}


def _comm(plan):
    """``plan.comm_bytes()`` in ``traffic()``'s form (no totals, no zero tensors)."""
    return _nonzero({kind: {n: b for n, b in per.items() if n != "total"}
                     for kind, per in plan.comm_bytes().items()})


def _client_share(plan, rank):
    """What client ``rank``'s participant sends off-participant in one round of each kind: its
    rows to other servers, and in in-place mode its server's results for other ranks."""
    q_rows, kv_rows = plan.row_matrix
    off = plan.off_rank_mask()
    share = {}
    for kind in RoundKind:
        per = {}
        for n in kind.dispatch_with(plan.keep_activations):
            per[n] = int((kv_rows if n in KV_TENSORS else q_rows)[rank][off[rank]].sum())
        if plan.mode == "inplace":
            for n in kind.returns:
                per[n] = int((kv_rows if n in KV_TENSORS else q_rows)[:, rank][off[:, rank]].sum())
        share[kind.value] = {n: rows * plan.cost.bytes_per_token(n) for n, rows in per.items()}
    return _nonzero(share)


def _status_once_served(name, rounds):
    """``status(name)`` once each server's ``rounds_served`` equals ``rounds`` (or the wait timed
    out: the caller's assertion then shows the counts). A server counts a round just after
    sending its results, so its clients can have them, and return, before the count moves."""
    return until(lambda: status(name), ok=lambda st: [s["rounds_served"] for s in st["servers"]] == rounds,
                 timeout_s=60)


def _check_plan_and_traffic(workers, lens_per_rank, seed, servers=()):
    """One step on every client: each ``last_plan`` is the same whole plan, each client's
    ``traffic()`` is its rows' share of it, and clients plus servers moved ``comm_bytes()``."""
    def server_stats():
        return ray.get([s.stats.remote() for s in servers], timeout=30)
    before = server_stats()
    results = ray.get([w.plan_and_traffic.remote(lens_per_rank[r], seed) for r, w in enumerate(workers)],
                      timeout=120)
    assert all(r["ok"] for r in results), results
    assert max(r["error"] for r in results) <= 1e-5
    assert len({r["plan"] for r in results}) == 1
    plan = Plan.from_msgpack(results[0]["plan"])
    assert plan.doc_lens_per_rank == [list(x) for x in lens_per_rank]
    assert plan.num_servers == (len(servers) or len(workers))
    for r, res in enumerate(results):
        assert (res["rank"], res["participant"]) == (r, r)
        assert _nonzero(res["traffic"]) == _client_share(plan, r), r
    # a server counts a round just after sending its results
    after = until(server_stats, ok=lambda now: all(a["rounds_served"] >= b["rounds_served"] + 2
                                                   for a, b in zip(now, before)), timeout_s=30)
    assert all(a["rounds_served"] >= b["rounds_served"] + 2 for a, b in zip(after, before)), (before, after)
    moved = sum_traffic([r["traffic"] for r in results] + [a["traffic"] for a in after]
                        + [{k: {n: -b for n, b in per.items()} for k, per in s["traffic"].items()}
                           for s in before])
    assert _nonzero(moved) == _comm(plan)
    return plan


def test_dedicated_two_clients_two_servers(local_ray):
    config = JobConfig(plan=PlanConfig(mode="dedicated", min_shard=8), servers=2, timeout_s=TIMEOUT)
    job = launch(name="ded", config=config, detached=False, server_options={"num_cpus": 0})
    try:
        workers = _workers("ded", 2)
        for step, lens in enumerate(LENS):
            results = _step(workers, lens, step)
            assert all(r["ok"] for r in results), results
            assert max(r["error"] for r in results) <= 1e-5
        st = _status_once_served("ded", [12, 12])
        assert st["steps_planned"] == 3 and st["last"]["step"] == 2
        assert [s["rounds_served"] for s in st["servers"]] == [12, 12]  # 3 steps x (2 fwd + 2 bwd)
        assert "imbalance" in format_status(st)
        names = ray.get(job["scheduler"].metric_names.remote())
        for metric in ("distca_imbalance_before", "distca_imbalance_after", "distca_plan_ms",
                       "distca_cut_ms", "distca_bytes_per_round", "distca_server_flops", "distca_server_tasks",
                       "distca_server_held_bytes"):
            assert metric in names

        # a malformed descriptor is refused, and the server keeps serving
        with pytest.raises(ValueError, match="not valid msgpack"):
            ray.get(job["servers"][0].install_part.remote(99, 0, b"\x93garbage"))
        assert ray.get(job["servers"][0].ping.remote())
        results = _step(workers, LENS[0], 7)
        assert all(r["ok"] for r in results) and max(r["error"] for r in results) <= 1e-5

        # ping-pong: two nano-batches with async rounds in one step
        results = ray.get([w.ping_pong.remote(LENS[1][r], LENS[2][r], 11) for r, w in enumerate(workers)],
                          timeout=120)
        assert all(r["ok"] for r in results), results
        assert max(r["error"] for r in results) <= 1e-5

        # clients that disagree on the attention shape all get the same ValueError
        results = ray.get([w.bad_shape_step.remote(LENS[0][r], 16 if r == 0 else 8)
                           for r, w in enumerate(workers)], timeout=60)
        assert [r["type"] for r in results] == ["ValueError", "ValueError"]
        assert "disagree on the attention shape" in results[0]["message"]
        results = _step(workers, LENS[2], 3)  # and the job goes on
        assert all(r["ok"] for r in results)

        # last_plan and traffic() on connect() clients, against the servers' counters
        plan = _check_plan_and_traffic(workers, LENS[1], 4, servers=job["servers"])
        assert plan.mode == "dedicated" and plan.num_servers == 2 and plan.keep_activations
        stats = ray.get([x.stats.remote() for x in job["servers"]], timeout=30)
        assert [st["held_bytes"] for st in stats] == [0, 0] and min(st["peak_held_bytes"] for st in stats) > 0
    finally:
        shutdown("ded")


def test_inplace_three_clients(local_ray):
    # stateless here (every backward round resends Q, K, V, O, LSE); the other jobs keep activations
    plan = PlanConfig(mode="inplace", min_shard=8, keep_activations=False)
    config = JobConfig(plan=plan, timeout_s=TIMEOUT)
    job = launch(name="inp", config=config, detached=False)
    try:
        workers = _workers("inp", 3)
        lens3 = [[[300, 5], [20, 20], [1, 2, 3]], [[77, 77], [500], [9, 90]]]
        for step, lens in enumerate(lens3):
            results = _step(workers, lens, step)
            assert all(r["ok"] for r in results), results
            assert max(r["error"] for r in results) <= 1e-5
        assert status("inp")["last"]["imbalance_after"] <= status("inp")["last"]["imbalance_before"]
        assert job["servers"] == []  # in-place: the clients serve
        plan = _check_plan_and_traffic(workers, lens3[1], 5)
        assert plan.mode == "inplace" and plan.num_servers == 3 and not plan.keep_activations
        # A connect refused for other settings than the job's changes nothing: it must not have
        # registered (a registration replaces the rank's, which evicted rank 1's live client).
        refused = ray.get([_refused_connect.remote("inp", 1, 3, kw) for kw in (
            {"config": JobConfig(timeout_s=5)}, {"keep_activations": True})], timeout=120)
        assert "another config" in refused[0] and "timeout_s" in refused[0], refused
        assert "keep_activations=False" in refused[1], refused
        results = _step(workers, lens3[0], 7)
        assert all(r["ok"] for r in results), results
    finally:
        shutdown("inp")


@ray.remote(num_cpus=0)
def _refused_connect(name, rank, world, kwargs):
    from distca_client import DistCAClient
    try:
        DistCAClient.connect(name, rank=rank, world_size=world, timeout_s=TIMEOUT, **kwargs)
    except ValueError as exc:
        return str(exc)
    return "connected"


def test_server_killed_mid_step_then_next_step_on_remaining_server(local_ray):
    config = JobConfig(plan=PlanConfig(mode="dedicated", min_shard=8), servers=2, timeout_s=TIMEOUT,
                       failure_grace_s=2.0)
    job = launch(name="kill", config=config, detached=False, server_options={"num_cpus": 0})
    try:
        workers = _workers("kill", 2)
        assert all(r["ok"] for r in _step(workers, LENS[0], 0))
        assert all(r["ok"] for r in ray.get([w.forward_only.remote(LENS[1][r], 1) for r, w in enumerate(workers)]))
        ray.kill(job["servers"][1], no_restart=True)
        start = time.monotonic()
        results = ray.get([w.finish.remote(LENS[1][r], 1) for r, w in enumerate(workers)], timeout=60)
        assert time.monotonic() - start < TIMEOUT + 5
        for r in results:
            assert not r["ok"] and r["type"] == "DistCAError"
            assert "attention server 1" in r["message"]
        results = _step(workers, LENS[2], 2)
        assert all(r["ok"] for r in results), results
        assert max(r["error"] for r in results) <= 1e-5
        servers = status("kill")["servers"]
        assert [s["state"] for s in servers][1] == "dead"
        assert status("kill")["last"]["server_flops"].keys() == {0}
    finally:
        shutdown("kill")


def test_restarted_client_rejoins(local_ray):
    config = JobConfig(plan=PlanConfig(mode="dedicated", min_shard=8), servers=1, timeout_s=TIMEOUT)
    job = launch(name="rejoin", config=config, detached=False, server_options={"num_cpus": 0})
    try:
        workers = _workers("rejoin", 2)
        assert all(r["ok"] for r in _step(workers, LENS[0], 0))
        assert all(r["ok"] for r in ray.get([w.forward_only.remote(LENS[1][r], 1) for r, w in enumerate(workers)]))
        ray.kill(workers[1], no_restart=True)  # dies mid-step
        result = ray.get(workers[0].finish.remote(LENS[1][0], 1), timeout=60)
        assert not result["ok"] and result["type"] == "DistCAError"
        assert "client rank 1" in result["message"] and result["seconds"] < TIMEOUT
        from ray_workers import TrainWorker
        workers[1] = TrainWorker.remote("rejoin", 1, 2, TIMEOUT)
        results = _step(workers, LENS[2], 2)
        assert all(r["ok"] for r in results), results
        assert ray.get(job["servers"][0].ping.remote())
    finally:
        shutdown("rejoin")


def test_servers_placed_on_the_other_node_by_custom_resource():
    from ray.cluster_utils import Cluster
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "object_store_memory": 80 * 2**20})
    worker_node = cluster.add_node(num_cpus=1, resources={"attn": 2}, object_store_memory=80 * 2**20)
    try:
        ray.init(address=cluster.address, runtime_env=RUNTIME_ENV, namespace="distca", log_to_driver=False)
        config = JobConfig(plan=PlanConfig(mode="dedicated", min_shard=8), servers=2, timeout_s=TIMEOUT)
        job = launch(name="two", config=config, detached=False,
                     server_options={"num_cpus": 0, "resources": {"attn": 1}})
        head = ray.get_runtime_context().get_node_id()
        nodes = {ray.get(s.stats.remote())["node_id"] for s in job["servers"]}
        assert nodes == {worker_node.node_id} and head not in nodes
        workers = _workers("two", 2)
        results = _step(workers, LENS[0], 0)
        assert all(r["ok"] for r in results) and max(r["error"] for r in results) <= 1e-5
        shutdown("two")
    finally:
        ray.shutdown()
        cluster.shutdown()
