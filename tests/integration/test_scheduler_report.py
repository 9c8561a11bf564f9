"""SchedulerActor.report on the wire: one msgpack request, one msgpack answer (scheduler/messages.py),
and one deadline per batch (a client that never reports fails the batch for every client after
``timeout_s``; steps go on past the deadline of a batch that resolved).

Two jobs: batches that must be planned run on one with a generous timeout (a batch's deadline
starts at its first report, and planning counts against it: on a loaded machine a short one can
pass before both reports are in); the deadline tests run on one with a short timeout, where a
batch that must be planned and misses it costs that step alone (the step protocol) and the next
step is tried."""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray")

from distca_server import launch, shutdown, status  # noqa: E402
from scheduler import CostModel, JobConfig, PlanConfig  # noqa: E402
from scheduler.coordinator import _KEEP_STEPS  # noqa: E402
from scheduler.messages import decode_answer, encode_report  # noqa: E402
from scheduler.parts import PlanPart  # noqa: E402

TIMEOUT = 30.0  # the job whose batches must be planned: no deadline a busy machine could miss
SHORT = 1.0  # the deadline tests' job
WAIT = 120  # ray.get's limit for an answer: a hang guard, not a deadline under test
SHAPE = {"cost": CostModel(num_heads_q=4, num_heads_kv=2, head_dim=8, dtype_bytes=2).to_wire(),
         "device_type": "cpu"}
LENS = [[300, 20, 5], [90, 1]]


def _job(name, timeout_s):
    config = JobConfig(plan=PlanConfig(mode="inplace", min_shard=8), timeout_s=timeout_s)
    sched = launch(name=name, config=config, detached=False)["scheduler"]
    TOKENS[sched] = [cfg["token"] for cfg in ray.get([sched.register_client.remote(r, 2, {"incarnation": f"i{r}"})
                                                       for r in range(2)], timeout=WAIT)]
    return sched


@pytest.fixture(scope="module")
def scheduler(local_ray):
    """The job whose batches must be planned (timeout ``TIMEOUT``)."""
    yield _job("report-wire", TIMEOUT)
    shutdown("report-wire")


@pytest.fixture(scope="module")
def short(local_ray):
    """The deadline tests' job (timeout ``SHORT``)."""
    yield _job("report-deadline", SHORT)
    shutdown("report-deadline")


TOKENS: dict = {}  # per scheduler handle, each rank's registration secret, which its reports carry


def _report(sched, step, rank, lens=None, token=True):
    return sched.report.remote(encode_report(step, 0, rank, LENS[rank] if lens is None else lens, SHAPE,
                                             TOKENS[sched][rank] if token is True else token))


def _planned(sched, step, tries=1):
    """Both ranks report ``step``; each gets its part of the same plan. Returns the step planned:
    with ``tries`` > 1 (the short job), a step that missed its deadline (the clients' answers a
    ``DistCAError`` naming the deadline, or a ``resync`` for a rank whose report came after it)
    costs that step alone and the next one is tried, up to ``tries`` steps in all."""
    for _ in range(tries):
        answers = [decode_answer(a) for a in ray.get([_report(sched, step, r) for r in range(2)], timeout=WAIT)]
        missed = [a for a in answers if a.get("error") == "resync" or (a.get("error") == "DistCAError" and (
            "did not report within" in a["message"] or "was not planned within" in a["message"]))]
        if not missed:
            break
        step = max([step + 1] + [a["next_step"] for a in missed if "next_step" in a])
    assert all("part" in a for a in answers), answers
    parts = [PlanPart.from_msgpack(a["part"]) for a in answers]
    assert [(p.step, p.rank, p.doc_lens) for p in parts] == [(step, r, LENS[r]) for r in range(2)]
    assert parts[0].plan_id == parts[1].plan_id != 0
    return step


def test_parts_come_back_as_msgpack_bytes(scheduler):
    raw = ray.get([_report(scheduler, 0, r) for r in range(2)], timeout=WAIT)
    assert all(type(a) is bytes for a in raw)  # the answer is msgpack, not a pickled object
    answers = [decode_answer(a) for a in raw]
    assert all(type(a["part"]) is bytes for a in answers)
    assert [a["group"]["world_rank"] for a in answers] == [0, 1]


def test_a_missing_client_fails_the_batch_at_its_deadline(short):
    start = time.monotonic()
    alone = decode_answer(ray.get(_report(short, 1, 0), timeout=WAIT))
    waited = time.monotonic() - start
    assert alone == {"error": "DistCAError", "message": f"step 1 batch 0: ranks [1] did not report within {SHORT:g} s"}
    assert SHORT * 0.9 <= waited < SHORT + 30  # not before the deadline; after it, as soon as a busy machine allows
    late = decode_answer(ray.get(_report(short, 1, 1), timeout=WAIT))
    # the step failed; rank 1 took no part in it, so it is sent on to the job's step rather than
    # handed the step's error (the step protocol, docs/design.md)
    assert late == {"error": "resync", "message": "step 1 is over for job 'report-deadline'; the job goes on at step 2",
                    "next_step": 2}
    assert decode_answer(ray.get(_report(short, 1, 0), timeout=WAIT)) == alone  # rank 0 took part
    _planned(short, 2, tries=5)  # the job goes on at the next step


def test_steps_go_on_past_a_resolved_batch_deadline(short):
    step = _planned(short, status("report-deadline")["next_step"], tries=5)
    time.sleep(SHORT * 1.5)  # past that step's deadline: its answers stand
    # at most _KEEP_STEPS tries: the scheduler still keeps that step's answers after them
    _planned(short, step + 1, tries=_KEEP_STEPS)
    again = decode_answer(ray.get(_report(short, step, 0), timeout=WAIT))  # a repeat of that step
    assert "part" in again and PlanPart.from_msgpack(again["part"]).step == step


def test_a_malformed_request_is_refused_to_its_sender_alone(scheduler):
    bad = decode_answer(ray.get(scheduler.report.remote(b"\x93\x01\x02\x03"), timeout=WAIT))  # [1, 2, 3]
    assert bad == {"error": "ValueError", "message": "report descriptor must be a map with keys "
                   "['batch', 'doc_lens', 'format', 'rank', 'shape', 'step', 'token', 'version'], got list"}
    cut = decode_answer(ray.get(scheduler.report.remote(encode_report(1, 0, 0, [7], SHAPE)[:-3]), timeout=WAIT))
    assert cut["error"] == "ValueError" and "report descriptor is not valid msgpack" in cut["message"]
    _planned(scheduler, 1)  # nobody else noticed


def test_a_report_without_the_ranks_current_token_is_refused_to_its_sender_alone(scheduler):
    """A client that another client of its rank replaced (a zombie: its old token) or a caller
    that never registered (no token) is refused before anything of the batch is kept; the job's
    own clients plan the step as if nothing was sent."""
    for token in (None, "0" * 32, TOKENS[scheduler][1]):
        refused = decode_answer(ray.get(_report(scheduler, 2, 0, token=token), timeout=WAIT))
        assert refused == {"error": "DistCAError", "message": "job 'report-wire' refused a report of rank 0: "
                           "another client registered as rank 0 since this one did (it replaced this one, "
                           "which takes no further part in the job: close it)"}
    _planned(scheduler, 2)
