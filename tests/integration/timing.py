"""Timing helpers the Ray integration tests share. CI runs them on a 2-core machine that may be
heavily loaded, so no test may depend on a short deadline being met by a busy scheduler: a bound
on how long a failure takes is stretched by the load (:func:`slack`), and a step that must run is
run again when it failed only by missing a deadline (:func:`retry_missed`; the step protocol makes
a miss cost that step alone)."""

from __future__ import annotations

import os
import time

import ray

# Messages of a step that missed a deadline: on a loaded machine a healthy step can.
DEADLINE_MISSED = ("did not report within", "timed out", "did not answer within", "Timed out")


def slack(timeout_s: float) -> float:
    """The "+ 1 s" of "within the timeout + 1 s", stretched by the machine's load now: on a busy
    2-core machine (CI beside other jobs) every process runs that much slower, and a fault test
    must not fail for that; its other checks (who is named, the next step exact) still hold."""
    return 1.0 + timeout_s * max(0.0, os.getloadavg()[0] / (os.cpu_count() or 1) - 1.0)


def missed_deadline(results: list[dict]) -> bool:
    """Whether a step's results (one dict per client, ``ok`` and on failure ``message``) failed,
    and only by missing deadlines."""
    failed = [r for r in results if not r["ok"]]
    return bool(failed) and all(any(m in r.get("message", "") for m in DEADLINE_MISSED) for r in failed)


def retry_missed(run, tries: int = 2) -> list[dict]:
    """``run()``: one step on every client, returning its results. Run it again while it failed
    only by missing deadlines, up to ``tries`` runs in all; returns the last results (the caller
    asserts on them, so any other failure, or misses on every try, still fails the test)."""
    for _ in range(tries):
        results = run()
        if not missed_deadline(results):
            break
    return results


def exact_step(workers, lens, seed: int, servers=(), tries: int = 2) -> list[dict]:
    """A step (``TrainWorker.step`` of ``lens[r]`` on worker r) that runs on every client and
    matches the float64 reference, run again on deadline misses (:func:`retry_missed`); then
    every actor of ``servers`` (handles) and every client still answers (nothing aborted)."""
    results = retry_missed(lambda: ray.get([w.step.remote(lens[r], seed) for r, w in enumerate(workers)],
                                           timeout=600), tries)  # room for restarting actors on a loaded machine
    assert all(r["ok"] for r in results), results
    assert max(r["error"] for r in results) <= 1e-5
    assert all(ray.get([s.ping.remote() for s in servers], timeout=30))
    assert len(ray.get([w.pid.remote() for w in workers], timeout=30)) == len(workers)
    return results


def until(get, *, ok=bool, timeout_s: float = 120.0, poll_s: float = 0.1):
    """``get()``'s value once ``ok(value)`` holds, else its last value after ``timeout_s`` (the
    caller asserts on it, so a timeout shows what was seen). The bound is generous because the
    wait ends as soon as the condition holds, and a loaded machine may take long to get there."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = get()
        if ok(value) or time.monotonic() > deadline:
            return value
        time.sleep(poll_s)


def kill_server(server) -> None:
    """Kill attention server actor ``server`` (Ray restarts it if the job allows) and wait until
    its process is gone: ``ray.kill`` only asks, and on a loaded machine a round could still run
    on it meanwhile."""
    pid = ray.get(server.stats.remote(), timeout=30)["pid"]
    ray.kill(server, no_restart=False)
    assert not until(lambda: _alive(pid), ok=lambda alive: not alive, timeout_s=30, poll_s=0.05), \
        f"server process {pid} still lives"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_answers(actor, timeout_s: float = 300.0):
    """Wait until a (restarting) actor answers ``ping``; returns its answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(actor.ping.remote(), timeout=timeout_s)
        except ray.exceptions.ActorUnavailableError:
            assert time.monotonic() < deadline, "the actor did not come back"
            time.sleep(0.2)
