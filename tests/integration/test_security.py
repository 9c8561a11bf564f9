"""What a hostile descriptor and a participant of another training run can do (docs/security.md).

- An actor squatting a job's scheduler name answers a client's report with malformed bytes, or
  with a well-formed part of other documents (the same token count, so nothing else would
  notice): the client refuses it with a ``ValueError`` before it joins any group, so no row moves.
- A client of another Ray job (a second driver: another training run) that connects with a
  running job's name is refused at ``connect``; it may read the job's ``status`` but not its
  plans (``plan_descriptor``), nor fail its steps (``fail_step``): both need the secret a
  registered client holds. The running job's next step is unaffected.
- Two ``launch`` calls of one name at the same moment: one job runs, the other call gets a
  ``ValueError`` naming the job and leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading

import pytest

ray = pytest.importorskip("ray")
import torch  # noqa: E402

from distca_server import launch, shutdown  # noqa: E402
from scheduler.actor import NAMESPACE, job_actor_names, scheduler_actor_name  # noqa: E402
from scheduler.config import JobConfig, PlanConfig  # noqa: E402
from scheduler.cost import CostModel  # noqa: E402
from scheduler.messages import decode_report, encode_answer  # noqa: E402
from scheduler.parts import plan_identity, plan_parts  # noqa: E402
from scheduler.planner import plan_batch  # noqa: E402
from scripts import ROOT, RUNTIME_ENV  # noqa: E402

TIMEOUT = 10.0
COST = CostModel(num_heads_q=4, num_heads_kv=2, head_dim=16, dtype_bytes=4)  # ray_workers' float32 inputs


@ray.remote(num_cpus=0)
class SquattingScheduler:
    """Holds ``distca-scheduler-<name>`` and answers every report with ``payload`` as the part."""

    def __init__(self, payload: bytes):
        self.payload = payload
        self.published = []

    def register_client(self, rank, world_size, info):
        return {"name": "squatted", "mode": "inplace", "timeout_s": TIMEOUT, "backend": "auto",
                "next_step": 0, "scheduler": "squatter"}

    def report(self, request: bytes) -> bytes:  # the real wire: scheduler.messages
        _, _, rank, _, _, _ = decode_report(request)
        return encode_answer({"part": self.payload, "group": {"epoch": 0, "world_rank": rank,
                                                              "world_size": 1, "device_type": "cpu"}})

    def publish_bootstrap(self, epoch, value):  # a client that joined a group would call this
        self.published.append((epoch, value))

    def joined(self):
        return self.published

    def fail_step(self, step, rank, message, token=None):
        return {}

    def unregister_client(self, rank, incarnation):
        pass

    def watch(self, epoch, poll_s=5.0):
        return {"state": None, "scheduler": "squatter"}


@ray.remote(num_cpus=0)
class Victim:
    """A client of the squatted job: one attend on documents [4, 4]."""

    def attend(self, name):
        from distca_client import DistCAClient
        client = DistCAClient.connect(name, rank=0, world_size=1, timeout_s=TIMEOUT)
        q = torch.randn(8, 4, 16)
        k, v = torch.randn(8, 2, 16), torch.randn(8, 2, 16)
        try:
            client.attend(q, k, v, [4, 4])
            outcome = {"ok": True}
        except Exception as exc:
            outcome = {"ok": False, "type": type(exc).__name__, "message": str(exc)}
        member = client._runtime.member
        return dict(outcome, epoch=member.epoch, transport=member.transport is not None)


def _other_part() -> bytes:
    """A valid part for rank 0 of step 0 batch 0, for documents [5, 3] (the victim has [4, 4])."""
    plan = plan_batch([[5, 3]], 1, cost=COST, epsilon=0.05, mode="inplace", min_shard=8)
    return plan_parts(plan, 0, 0, plan_identity(plan.to_msgpack(), 0, 0))[0].to_msgpack()


@pytest.mark.parametrize("payload, match", [
    (b"\x93garbage", "part descriptor is not valid msgpack"),
    (None, r"answered step 0 batch 0 with the part of rank 0 step 0 batch 0, 2 documents \(8 tokens\)"),
])
def test_hostile_part_is_refused_before_any_group_forms(local_ray, payload, match):
    name = f"squat-{len(payload or b'')}"
    squatter = SquattingScheduler.options(name=scheduler_actor_name(name), namespace=NAMESPACE).remote(
        payload if payload is not None else _other_part())
    try:
        out = ray.get(Victim.remote().attend.remote(name), timeout=60)
        assert not out["ok"] and out["type"] == "ValueError", out
        assert re.search(match, out["message"]), out["message"]
        # Refused before joining a group: no bootstrap value published, no transport, no epoch.
        assert out["epoch"] is None and not out["transport"], out
        assert ray.get(squatter.joined.remote()) == []
    finally:
        ray.kill(squatter)


_OTHER_RUN = """
import json, sys, ray
from distca_client import DistCAClient
from scheduler.actor import scheduler_actor_name
ray.init(address=sys.argv[1], namespace="distca", log_to_driver=False)
out = {}
def call(key, make):
    try:
        out[key] = {"ok": True, "value": make()}
    except Exception as exc:
        out[key] = {"ok": False, "type": type(exc).__name__, "value_error": isinstance(exc, ValueError),
                    "message": str(exc).strip().splitlines()[-1]}
call("connect", lambda: DistCAClient.connect(sys.argv[2], rank=0, world_size=2, timeout_s=10) and None)
sched = ray.get_actor(scheduler_actor_name(sys.argv[2]), namespace="distca")
call("status", lambda: ray.get(sched.status.remote(), timeout=30))
st = out["status"]["value"]
step, batch = st["last"]["step"], st["last"]["batch"]
call("plan", lambda: ray.get(sched.plan_descriptor.remote(step, batch), timeout=30) is not None)
call("plan_guess", lambda: ray.get(sched.plan_descriptor.remote(step, batch, 0, "0" * 32), timeout=30) is not None)
call("fail", lambda: ray.get(sched.fail_step.remote(st["next_step"], 1, "an outsider's error"), timeout=30))
call("fail_guess", lambda: ray.get(sched.fail_step.remote(st["next_step"], 1, "an outsider's error", "0" * 32),
                                   timeout=30))
print(json.dumps(out, default=str))
"""


def test_another_run_cannot_join_read_plans_or_fail_steps_and_the_job_goes_on(local_ray):
    from ray_workers import TrainWorker
    name = "secjob"
    config = JobConfig(plan=PlanConfig(mode="inplace"), timeout_s=TIMEOUT)
    launch(name=name, config=config)  # detached: shutdown() below stops it
    try:
        workers = [TrainWorker.remote(name, r, 2, TIMEOUT) for r in range(2)]
        lens = [[61, 3, 250], [140, 1, 1, 90]]
        first = ray.get([w.step.remote(lens[r], 1) for r, w in enumerate(workers)], timeout=120)
        assert all(r["ok"] and r["error"] <= 1e-5 for r in first), first

        # A second driver is another Ray job: another training run that picked the same name.
        env = dict(os.environ, PYTHONPATH=RUNTIME_ENV["env_vars"]["PYTHONPATH"], RAY_AUTH_MODE="token")
        proc = subprocess.run([sys.executable, "-c", _OTHER_RUN, ray.get_runtime_context().gcs_address, name],
                              capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
        other = json.loads(proc.stdout.strip().splitlines()[-1])
        joined = other["connect"]
        assert not joined["ok"] and joined["type"] == "ValueError", (other, proc.stderr[-2000:])
        assert f"distca job {name!r} serves the clients of Ray job" in joined["message"], joined
        assert "cannot join it as rank 0" in joined["message"], joined

        # status stays readable (distca status runs from other drivers), and shows no secret.
        st = other["status"]
        assert st["ok"] and st["value"]["clients"] == [0, 1] and st["value"]["steps_planned"] == 1, st
        assert not re.search(r"[0-9a-f]{32}", json.dumps(st)), st
        # A plan (every rank's documents) and failing a step need a member's secret.
        for key, call, rank in (("plan", "plan_descriptor", None), ("plan_guess", "plan_descriptor", 0),
                                ("fail", "fail_step", 1), ("fail_guess", "fail_step", 1)):
            got = other[key]
            assert not got["ok"] and got["value_error"], (key, got)
            assert f"job {name!r} refused {call} from rank {rank!r}" in got["message"], (key, got)

        # The job's own clients still hold their ranks: the next step (which the outsider tried
        # to fail) is exact, and a member reads its plan.
        again = ray.get([w.plan_and_traffic.remote(lens[r], 2) for r, w in enumerate(workers)], timeout=120)
        assert all(r["ok"] and r["error"] <= 1e-5 for r in again), again
        assert [r["rank"] for r in again] == [0, 1]
    finally:
        shutdown(name)


def test_two_launches_of_one_name_at_once_start_one_job(local_ray):
    """Both calls pass the "already running" check before either starts an actor (a barrier
    lines them up): Ray gives the scheduler's name to one of them, and the other gets a plain
    ValueError naming the job, with nothing of its own left running."""
    from ray_workers import TrainWorker
    name = "race"
    start, results = threading.Barrier(2), [None, None]

    def go(i):
        start.wait()
        try:
            config = JobConfig(plan=PlanConfig(mode="dedicated", min_shard=8), servers=2, timeout_s=TIMEOUT)
            results[i] = launch(name=name, config=config, server_options={"num_cpus": 0})
        except Exception as exc:
            results[i] = exc
    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        won = [r for r in results if isinstance(r, dict)]
        lost = [r for r in results if not isinstance(r, dict)]
        assert len(won) == 1 and len(lost) == 1, results
        assert type(lost[0]) is ValueError, repr(lost[0])
        assert str(lost[0]).startswith(f"a distca job named {name!r} is already running"), str(lost[0])
        # Only the winner's actors: one scheduler and its two servers.
        assert job_actor_names(name) == [scheduler_actor_name(name)] + [f"distca-server-{name}-{i}" for i in range(2)]
        assert all(ray.get([h.ping.remote() for h in won[0]["servers"]], timeout=60))

        workers = [TrainWorker.remote(name, r, 2, TIMEOUT) for r in range(2)]
        lens = [[61, 3, 50], [40, 1, 90]]
        step = ray.get([w.step.remote(lens[r], 1) for r, w in enumerate(workers)], timeout=120)
        assert all(r["ok"] and r["error"] <= 1e-5 for r in step), step
    finally:
        stopped = shutdown(name)
    assert stopped == 3 and job_actor_names(name) == []
