"""The step protocol in lock-step loops (``docs/design.md`` § "The step protocol"): after each
fault, the step the fault hit may fail, and every later step of the loop runs, exact.

Lock-step: the driver starts each iteration on both clients together and waits for both, as DDP
forces a training loop to. Before the protocol was stated, a client that came out of a fault one
step number apart from its peer stayed apart for good: each iteration one client failed at once
on a step its peer had left, the other after the timeout. One in-place job (2 clients, timeout
``T``) serves the tests in file order; each checks that it leaves the job healthy.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

ray = pytest.importorskip("ray")

from distca_server import launch, shutdown, status  # noqa: E402
from scheduler.config import JobConfig, PlanConfig  # noqa: E402
from scheduler.messages import decode_answer, encode_report  # noqa: E402
from timing import missed_deadline, retry_missed, until  # noqa: E402

T = 4.0  # the job's timeout: room for a busy 2-core machine, short enough for several faults
NAME = "resync"
LENS = [[100, 28], [50, 7, 60]]
AFTER = 3  # lock-step iterations run after each fault, every one of which must succeed
MISSES = 2  # of those, iterations that may miss a deadline (a loaded machine) and are run again


@pytest.fixture(scope="module")
def job(local_ray):
    from ray_workers import TrainWorker
    config = JobConfig(plan=PlanConfig(mode="inplace", min_shard=8), timeout_s=T, failure_grace_s=0.5,
                       scheduler_restarts=-1)
    handles = launch(name=NAME, config=config, detached=False)
    handles["make_worker"] = lambda r: TrainWorker.remote(NAME, r, 2, T)
    handles["workers"] = [handles["make_worker"](r) for r in range(2)]
    handles["seed"] = [0]
    _warm_up(handles)
    yield handles
    shutdown(NAME)


def _iteration(job, extra=({}, {})):
    """One lock-step iteration: both clients' step, started together, waited for together."""
    job["seed"][0] += 1
    refs = [w.step.remote(LENS[r], job["seed"][0], layers=1, **extra[r]) for r, w in enumerate(job["workers"])]
    return ray.get(refs, timeout=600)


def _warm_up(job, tries=5):
    """The job's first step forms its group; on a loaded machine that can miss the deadline, which
    costs that step only (the protocol under test): go on once a step ran."""
    for _ in range(tries):
        if all(r["ok"] for r in _iteration(job)):
            return
    pytest.fail(f"no step ran in {tries} tries")


def _every_later_step_runs(job):
    """``AFTER`` lock-step iterations after a fault all run, exact. An iteration that failed only
    by missing a deadline (a healthy step can, on a loaded machine; the miss costs that iteration
    alone) is run again, at most ``MISSES`` times in all: before the step protocol, every
    iteration after these faults failed, so ``AFTER`` exact ones are still required."""
    ran = missed = 0
    while ran < AFTER:
        results = _iteration(job)
        if missed < MISSES and missed_deadline(results):
            missed += 1
            continue
        assert all(r["ok"] for r in results), (ran, missed, results)
        assert max(r["error"] for r in results) <= 1e-5
        ran += 1


def test_a_killed_client_replaced_mid_step_meets_its_peer_at_once(job):
    """Client 1 dies; client 0's next step fails naming it. Its replacement registers while that
    step still waits (so it is told that step), and joins the loop at the next iteration."""
    ray.kill(job["workers"][1], no_restart=True)
    job["seed"][0] += 1
    alone = job["workers"][0].step.remote(LENS[0], job["seed"][0], layers=1)
    time.sleep(0.5)
    job["workers"][1] = job["make_worker"](1)
    ray.get(job["workers"][1].pid.remote(), timeout=300)  # registered, before client 0 times out
    result = ray.get(alone, timeout=300)
    assert not result["ok"] and "ranks [1] did not report" in result["message"], result
    _every_later_step_runs(job)


def test_a_killed_client_replaced_after_the_failed_step_meets_its_peer_at_once(job):
    ray.kill(job["workers"][1], no_restart=True)
    job["seed"][0] += 1
    result = ray.get(job["workers"][0].step.remote(LENS[0], job["seed"][0], layers=1), timeout=300)
    assert not result["ok"] and "ranks [1] did not report" in result["message"], result
    job["workers"][1] = job["make_worker"](1)
    # Registered before the next iteration, as in the test above: a replacement still importing
    # torch on a busy machine would miss the step's deadline for its start-up, not for the resync.
    ray.get(job["workers"][1].pid.remote(), timeout=300)
    _every_later_step_runs(job)


def test_a_replaced_client_that_lives_on_is_refused_and_the_job_runs_exact(job):
    """A second client registers as rank 1 while the first still lives (a zombie: e.g. a worker
    the training framework gave up on but never stopped). The zombie's reports carry the token
    of a registration that was replaced: each is refused at once with a ``DistCAError`` saying
    so, and none is planned into the job's batches, so rank 0 and the replacement run exact
    steps beside it. Before, the zombie's reports counted as rank 1's, and the pair's steps
    mixed its documents with the replacement's."""
    zombie = job["workers"][1]
    job["workers"][1] = job["make_worker"](1)
    ray.get(job["workers"][1].pid.remote(), timeout=300)  # registered: the zombie is replaced
    ran = missed = 0
    while ran < 2:
        job["seed"][0] += 1
        seed = job["seed"][0]
        refs = [zombie.step.remote(LENS[1], seed + 1000, layers=1)] + [
            w.step.remote(LENS[r], seed, layers=1) for r, w in enumerate(job["workers"])]
        refused, *results = ray.get(refs, timeout=600)
        assert not refused["ok"] and refused["type"] == "DistCAError", refused
        # refused by the scheduler (not a batch deadline's "did not report"): at once
        assert "another client registered as rank 1 since this one did" in refused["message"], refused
        if missed < MISSES and missed_deadline(results):
            missed += 1
            continue  # a step missed its deadline on a loaded machine: see _every_later_step_runs
        assert all(r["ok"] and r["error"] <= 1e-5 for r in results), results
        ran += 1
    ray.kill(zombie, no_restart=True)
    _every_later_step_runs(job)


def test_a_client_closed_mid_step_tells_its_peer_why(job):
    """Client 1 closes its client (and connects again) after the step's forward round: client 0's
    next round of the step fails, its message naming that cause (before, only a closed
    connection, "lost: none"), and the next steps run."""
    job["seed"][0] += 1
    s = job["seed"][0]
    # a forward round that must run: run again if it only missed a deadline (timing.retry_missed)
    assert all(r["ok"] for r in retry_missed(lambda: ray.get(
        [w.forward_only.remote(LENS[r], s) for r, w in enumerate(job["workers"])], timeout=300)))
    ray.get(job["workers"][1].reconnect.remote(NAME, T), timeout=300)
    result = ray.get(job["workers"][0].finish.remote(LENS[0], s), timeout=300)
    assert not result["ok"] and result["type"] == "DistCAError", result
    assert "rank 1 closed its DistCAClient in the middle of step" in result["message"], result
    _every_later_step_runs(job)


def test_a_client_delayed_past_the_timeout_costs_one_iteration(job):
    """Client 1 reports its step T + 1 s late (a slow data loader under load): that iteration
    fails on both clients, and the next one runs."""
    results = _iteration(job, ({}, {"delay_s": T + 1}))
    assert not any(r["ok"] for r in results), results
    _every_later_step_runs(job)


def test_a_client_paused_past_the_timeout_costs_one_iteration(job):
    """Client 1's process is stopped (SIGSTOP) for T + 1 s while its peer starts the step."""
    pid = ray.get(job["workers"][1].pid.remote())
    os.kill(pid, signal.SIGSTOP)
    try:
        job["seed"][0] += 1
        refs = [w.step.remote(LENS[r], job["seed"][0], layers=1) for r, w in enumerate(job["workers"])]
        time.sleep(T + 1)
    finally:
        os.kill(pid, signal.SIGCONT)
    results = ray.get(refs, timeout=600)
    assert not results[0]["ok"], results
    _every_later_step_runs(job)


def test_a_scheduler_killed_while_idle_costs_no_step(job):
    ray.kill(job["scheduler"], no_restart=False)
    _every_later_step_runs(job)


def test_a_scheduler_killed_mid_step_costs_that_step_only(job):
    job["seed"][0] += 1
    s = job["seed"][0]
    # a forward round that must run: run again if it only missed a deadline (timing.retry_missed)
    assert all(r["ok"] for r in retry_missed(lambda: ray.get(
        [w.forward_only.remote(LENS[r], s) for r, w in enumerate(job["workers"])], timeout=300)))
    ray.kill(job["scheduler"], no_restart=False)
    # every client notices through its long-poll (Ray: ~1.7 s)
    assert until(lambda: all(ray.get([w.scheduler_lost.remote() for w in job["workers"]], timeout=30)),
                 timeout_s=60)
    results = ray.get([w.finish.remote(LENS[r], s) for r, w in enumerate(job["workers"])], timeout=600)
    assert not any(r["ok"] for r in results), results
    _every_later_step_runs(job)


def test_a_report_far_ahead_is_refused_and_moves_no_client(job):
    """A report of step 2^63 - 2 from a registered rank (a bug, or a forged call) is refused for
    that caller alone; the job's step does not move and the loop goes on."""
    before = status(NAME)["next_step"]
    shape = {"cost": [4, 2, 16, 4], "device_type": "cpu", "window": None, "dtype": "float32"}
    token = ray.get(job["workers"][0].registration_token.remote(), timeout=30)
    for step in (2**63 - 2, 2**40, before + 2):
        answer = decode_answer(ray.get(job["scheduler"].report.remote(encode_report(step, 0, 0, [5], shape, token)),
                                       timeout=30))
        assert answer["error"] == "ValueError" and f"step {step} is ahead" in answer["message"], answer
    time.sleep(T + 0.5)  # nothing was kept: no batch times out and raises the floor meanwhile
    assert status(NAME)["next_step"] == before
    _every_later_step_runs(job)
