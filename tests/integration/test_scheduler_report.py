"""SchedulerActor.report on the wire: one msgpack request, one msgpack answer (scheduler/messages.py),
and one deadline per batch (a client that never reports fails the batch for every client after
``timeout_s``; steps go on past the deadline of a batch that resolved)."""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray")

from distca_server import launch, shutdown  # noqa: E402
from scheduler import CostModel, JobConfig, PlanConfig  # noqa: E402
from scheduler.messages import decode_answer, encode_report  # noqa: E402
from scheduler.parts import PlanPart  # noqa: E402

TIMEOUT = 1.0
SHAPE = {"cost": CostModel(num_heads_q=4, num_heads_kv=2, head_dim=8, dtype_bytes=2).to_wire(),
         "device_type": "cpu"}
LENS = [[300, 20, 5], [90, 1]]


@pytest.fixture(scope="module")
def scheduler(local_ray):
    config = JobConfig(plan=PlanConfig(mode="inplace", min_shard=8), timeout_s=TIMEOUT)
    job = launch(name="report-wire", config=config, detached=False)
    sched = job["scheduler"]
    TOKENS[:] = [cfg["token"] for cfg in ray.get([sched.register_client.remote(r, 2, {"incarnation": f"i{r}"})
                                                   for r in range(2)])]
    yield sched
    shutdown("report-wire")


TOKENS: list[str] = []  # each rank's registration secret, which its reports carry


def _report(sched, step, rank, lens=None, token=True):
    return sched.report.remote(encode_report(step, 0, rank, LENS[rank] if lens is None else lens, SHAPE,
                                             TOKENS[rank] if token is True else token))


def _planned(sched, step):
    answers = [decode_answer(a) for a in ray.get([_report(sched, step, r) for r in range(2)], timeout=30)]
    parts = [PlanPart.from_msgpack(a["part"]) for a in answers]
    assert [(p.step, p.rank, p.doc_lens) for p in parts] == [(step, r, LENS[r]) for r in range(2)]
    assert parts[0].plan_id == parts[1].plan_id != 0
    return answers


def test_parts_come_back_as_msgpack_bytes(scheduler):
    raw = ray.get([_report(scheduler, 0, r) for r in range(2)], timeout=30)
    assert all(type(a) is bytes for a in raw)  # the answer is msgpack, not a pickled object
    answers = [decode_answer(a) for a in raw]
    assert all(type(a["part"]) is bytes for a in answers)
    assert [a["group"]["world_rank"] for a in answers] == [0, 1]


def test_a_missing_client_fails_the_batch_at_its_deadline(scheduler):
    start = time.monotonic()
    alone = decode_answer(ray.get(_report(scheduler, 1, 0), timeout=30))
    waited = time.monotonic() - start
    assert alone == {"error": "DistCAError", "message": f"step 1 batch 0: ranks [1] did not report within {TIMEOUT:g} s"}
    assert TIMEOUT * 0.9 <= waited < TIMEOUT + 4
    late = decode_answer(ray.get(_report(scheduler, 1, 1), timeout=30))
    # the step failed; rank 1 took no part in it, so it is sent on to the job's step rather than
    # handed the step's error (the step protocol, docs/design.md)
    assert late == {"error": "resync", "message": "step 1 is over for job 'report-wire'; the job goes on at step 2",
                    "next_step": 2}
    assert decode_answer(ray.get(_report(scheduler, 1, 0), timeout=30)) == alone  # rank 0 took part
    _planned(scheduler, 2)  # the job goes on at the next step


def test_steps_go_on_past_a_resolved_batch_deadline(scheduler):
    _planned(scheduler, 3)
    time.sleep(TIMEOUT * 1.5)  # past step 3's deadline: its answers stand
    _planned(scheduler, 4)
    again = decode_answer(ray.get(_report(scheduler, 3, 0), timeout=30))  # a repeat of step 3
    assert "part" in again and PlanPart.from_msgpack(again["part"]).step == 3


def test_a_malformed_request_is_refused_to_its_sender_alone(scheduler):
    bad = decode_answer(ray.get(scheduler.report.remote(b"\x93\x01\x02\x03"), timeout=30))  # [1, 2, 3]
    assert bad == {"error": "ValueError", "message": "report descriptor must be a map with keys "
                   "['batch', 'doc_lens', 'format', 'rank', 'shape', 'step', 'token', 'version'], got list"}
    cut = decode_answer(ray.get(scheduler.report.remote(encode_report(5, 0, 0, [7], SHAPE)[:-3]), timeout=30))
    assert cut["error"] == "ValueError" and "report descriptor is not valid msgpack" in cut["message"]
    _planned(scheduler, 5)  # nobody else noticed


def test_a_report_without_the_ranks_current_token_is_refused_to_its_sender_alone(scheduler):
    """A client that another client of its rank replaced (a zombie: its old token) or a caller
    that never registered (no token) is refused before anything of the batch is kept; the job's
    own clients plan the step as if nothing was sent."""
    for token in (None, "0" * 32, TOKENS[1]):
        refused = decode_answer(ray.get(_report(scheduler, 6, 0, token=token), timeout=30))
        assert refused == {"error": "DistCAError", "message": "job 'report-wire' refused a report of rank 0: "
                           "another client registered as rank 0 since this one did (it replaced this one, "
                           "which takes no further part in the job: close it)"}
    _planned(scheduler, 6)
