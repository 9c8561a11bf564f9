"""A job with ``transport="shm"``: the one-sided exchange over shared memory between the processes
of one node, bootstrapped through the scheduler with each group epoch (the heap's handle).

In-place and dedicated jobs equal the float64 reference and, bit for bit, the same job over
torch_dist; a dedicated server killed mid-step fails both clients within the timeout + 1 s (the
second stretched by the machine's load: timing.slack) naming it and the next step is exact; no
heap file of a job is left in /dev/shm while it runs (rank 0 removes them once every member
attached) nor after ``shutdown``.
"""

from __future__ import annotations

import glob
import os

import pytest

ray = pytest.importorskip("ray")

from distca_server import launch, shutdown, status  # noqa: E402
from distca_server.runtime.groups import heap_prefix  # noqa: E402
from scheduler.config import JobConfig, PlanConfig  # noqa: E402
from timing import exact_step, kill_server, retry_missed, slack, wait_answers  # noqa: E402

T = 3.0  # the fault job's timeout
LENS = [[[61, 3, 250], [140, 1, 1, 90]], [[400], [7, 7, 7, 100]]]

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")


def _heaps(name: str) -> list[str]:
    return glob.glob(os.path.join("/dev/shm", glob.escape(heap_prefix(name)) + "*"))


def _workers(name, world, timeout_s):
    from ray_workers import TrainWorker
    return [TrainWorker.remote(name, r, world, timeout_s) for r in range(world)]


@pytest.fixture(scope="module")
def workers(local_ray):
    """Two client processes reused by every job of the module (each connects to a job in turn)."""
    name = "shm-first"
    config = JobConfig(plan=PlanConfig(mode="inplace"), timeout_s=10.0, transport="shm")
    job = launch(name=name, config=config, detached=False)  # noqa: F841
    try:
        yield _workers(name, 2, 10.0)
    finally:
        shutdown(name)


def _steps(workers, name, mode, transport):
    """Two steps of two layers, forward and backward, on 2 clients; per step and rank the max
    relative error against the float64 reference."""
    config = JobConfig(plan=PlanConfig(mode=mode, min_shard=8), servers=1, timeout_s=10.0,
                       transport=transport)
    job = launch(name=name, config=config, detached=False,  # noqa: F841 - keeps the actors alive
                 server_options={"num_cpus": 0})
    try:
        ray.get([w.reconnect.remote(name) for w in workers], timeout=60)
        errors = []
        for step, lens in enumerate(LENS):
            results = ray.get([w.step.remote(lens[r], step) for r, w in enumerate(workers)], timeout=120)
            assert all(r["ok"] for r in results), results
            errors.append([r["error"] for r in results])
        kinds = ray.get([w.transport_kind.remote() for w in workers], timeout=30)
        assert kinds == ["RoutedTransport" if transport == "shm" else "TorchDistTransport"] * 2
        if transport == "shm":
            # the plan's dispatch and return routes were installed and later rounds device-driven
            assert all(n > 0 for n in ray.get([w.device_exchanges.remote() for w in workers], timeout=30))
            # in-place rounds after a route's install skip the header exchange; dedicated ones
            # cannot (a server learns the round from it)
            tagged = ray.get([w.tagged_rounds.remote() for w in workers], timeout=30)
            assert (min(tagged) > 0 and len(set(tagged)) == 1) if mode == "inplace" else tagged == [0, 0], tagged
            assert _heaps(name) == []  # removed by rank 0 once every member attached
        return errors
    finally:
        shutdown(name)


@pytest.mark.parametrize("mode", ["inplace", "dedicated"])
def test_shm_job_equals_the_reference_and_torch_dist(workers, mode):
    shm = _steps(workers, f"shm-{mode}", mode, "shm")
    assert max(max(e) for e in shm) <= 1e-5, shm
    assert shm == _steps(workers, f"gloo-{mode}", mode, "torch_dist")  # the same bytes, the same results
    assert _heaps(f"shm-{mode}") == []


def test_a_rank_on_another_tagged_round_fails_the_step_on_both_then_the_next_is_exact(workers):
    """In-place over shm, three layers: layer 2's rounds skip the header (their routes are
    installed), so when rank 1 attends there with another softmax scale, the tag in its report
    rows differs: both ranks fail that step at once (not at the deadline), and the next step is
    exact."""
    name = "shmtags"
    config = JobConfig(plan=PlanConfig(mode="inplace", min_shard=8), timeout_s=30.0, transport="shm")
    job = launch(name=name, config=config, detached=False)  # noqa: F841
    try:
        ray.get([w.reconnect.remote(name, 30.0) for w in workers], timeout=60)
        lens = LENS[0]

        def step(seed, odd=None):
            return ray.get([w.step.remote(lens[r], seed, layers=3, scale_layer=odd if r == 1 else None)
                            for r, w in enumerate(workers)], timeout=120)
        for seed in (1, 2):  # the buffers grow, then the routes install
            assert all(r["ok"] and r["error"] <= 1e-5 for r in step(seed)), seed
        before = ray.get([w.tagged_rounds.remote() for w in workers], timeout=30)
        assert min(before) > 0, before
        for r in step(3, odd=2):
            assert not r["ok"] and r["seconds"] < 20, r  # at once, not at the 30 s deadline
            assert "ran another round" in r["message"] or "found a mismatch" in r["message"], r["message"]
        assert all(r["ok"] and r["error"] <= 1e-5 for r in step(4))
        # two nano-batches per layer (ping-pong), forward only: each has its own plan and routes,
        # and their rounds interleave; the second layer's run tagged
        before = ray.get([w.tagged_rounds.remote() for w in workers], timeout=30)
        loops = ray.get([w.forward_loop.remote([[61, 3, 250], [140, 1, 1, 90]] if r == 0 else [[400], [7, 7, 7, 100]],
                                               5, ping_pong=True) for r, w in enumerate(workers)], timeout=120)
        assert all(r["ok"] and r["error"] <= 1e-5 for r in loops), loops
        after = ray.get([w.tagged_rounds.remote() for w in workers], timeout=30)
        assert all(a > b for a, b in zip(after, before)), (before, after)
    finally:
        shutdown(name)


def test_bad_transports_are_refused_at_launch(local_ray):
    with pytest.raises(ValueError, match=r"transport must be one of \('torch_dist', 'shm', 'nvshmem'\), "
                                         r"got 'gloo'"):
        launch(name="badtransport", config=JobConfig(transport="gloo"), detached=False)
    from distca_server.transport.nvshmem import available
    if not available():
        with pytest.raises(ValueError, match="transport 'nvshmem' needs"):
            launch(name="badtransport", config=JobConfig(transport="nvshmem"), detached=False)


def test_a_killed_server_fails_the_step_then_the_job_goes_on_over_shm(workers):
    """test_faults.py's killed server, over shm: both clients fail within the timeout + slack naming
    server 1 (a dead PE never signals, so the survivors' deadline finds it); the next step runs
    on server 0 alone, then on both once Ray restarted server 1; shutdown leaves no heap file."""
    name = "shmkill"
    config = JobConfig(plan=PlanConfig(mode="dedicated", min_shard=8), servers=2, timeout_s=T,
                       failure_grace_s=0.5, server_restarts=1, transport="shm")
    job = launch(name=name, config=config, detached=False, server_options={"num_cpus": 0})
    try:
        ray.get([w.reconnect.remote(name, T) for w in workers], timeout=60)
        lens = LENS[0]

        def step(seed, servers, tries=2):  # run again on a missed deadline (a loaded machine)
            exact_step(workers, lens, seed, [job["servers"][i] for i in servers], tries)

        step(1, (0, 1), tries=5)  # the job's first step forms its group: slow on a loaded machine
        assert all(r["ok"] for r in retry_missed(
            lambda: ray.get([w.forward_only.remote(lens[r], 2) for r, w in enumerate(workers)], timeout=600)))
        kill_server(job["servers"][1])  # waits until its process is gone: ray.kill only asks
        results = ray.get([w.finish.remote(lens[r], 2) for r, w in enumerate(workers)], timeout=600)
        for r in results:
            assert not r["ok"] and r["type"] == "DistCAError" and r["seconds"] <= T + slack(T), r
            assert "attention server 1" in r["message"], r["message"]
        step(3, (0,))  # while server 1 restarts
        wait_answers(job["servers"][1])  # restarted (registered again)
        step(4, (0, 1))
        assert status(name)["last"]["server_flops"].keys() == {0, 1}
        assert _heaps(name) == []
    finally:
        shutdown(name)
    assert _heaps(name) == []
