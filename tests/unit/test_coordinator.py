"""The scheduler's pure coordinator, driven by hand-built reports (no Ray, no event loop).

Each test plays the wrapper's part: report, ping results, plan, failure reports with a hand-moved
clock, and checks the plain data the coordinator hands back.
"""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from scheduler import CostModel, plan_batch
from scheduler.coordinator import Assignment, Coordinator
from scheduler.parts import PlanPart, plan_part

COST = CostModel(4, 2, 16, 2)
SHAPE = {"cost": COST.to_wire(), "device_type": "cpu"}
LENS = [[300, 40, 3], [700, 5]]
GRACE = 2.0


class Ticks:
    """A fake ``timer``: every read advances by the next of ``steps`` seconds."""

    def __init__(self, *steps):
        self.t, self.steps, self.i = 0.0, steps, 0

    def __call__(self):
        self.t += self.steps[self.i % len(self.steps)]
        self.i += 1
        return self.t


def make(mode="dedicated", clients=2, servers=2, timer=None):
    c = Coordinator("job", mode, epsilon=0.05, min_shard=8, timeout_s=10.0, failure_grace_s=GRACE,
                    timer=timer or Ticks(1.0))
    for r in range(clients):
        assert c.register_client(r, clients, {"incarnation": f"c{r}", "node": f"node{r}"})["next_step"] == 0
    for s in range(servers):
        c.register_server(s, {"incarnation": f"s{s}", "node": f"srv{s}"})
    return c


def run_step(c, step, lens=LENS, live=None, shape=SHAPE, batch=0):
    """Report every client, ping (all servers answer unless ``live`` says), plan; returns the outcome."""
    outs = [c.report(step, batch, r, lens[r], shape) for r in range(len(lens))]
    assert [o.plan for o in outs] == [False] * (len(lens) - 1) + [True]
    assert all(o.answer is None for o in outs)
    ids = c.servers_to_ping()
    alive = c.servers_pinged({i: (live is None or i in live) for i in ids})
    return c.plan(step, batch, alive if c.mode == "dedicated" else None)


def decode(answer) -> PlanPart:
    assert set(answer) == {"part", "group"}, answer
    return PlanPart.from_msgpack(answer["part"])  # full validation at the trust boundary


def same_part(got: PlanPart, want: PlanPart) -> None:
    for name in ("step", "batch", "mode", "num_ranks", "num_servers", "cost", "participant", "rank",
                 "server", "doc_lens"):
        assert getattr(got, name) == getattr(want, name), name
    assert np.array_equal(got.client_tasks, want.client_tasks)
    assert np.array_equal(got.server_tasks, want.server_tasks)


# ---- a full step ---------------------------------------------------------------------------------
def test_full_step_dedicated_parts_match_plan_part():
    c = make(timer=Ticks(1.0, 0.010, 0.003))  # start, planned, cut
    out = run_step(c, 0)
    assert out.resolved
    assert out.assignments == (Assignment(0, 0, 2, 4, 0, "cpu"), Assignment(1, 0, 3, 4, 1, "cpu"))
    plan = plan_batch(LENS, 2, cost=COST, epsilon=0.05, mode="dedicated", min_shard=8)
    for r in range(2):
        answer = c.answer(0, 0, r)
        assert answer["group"] == {"epoch": 0, "world_rank": r, "world_size": 4, "device_type": "cpu"}
        same_part(decode(answer), plan_part(plan, r, 0, 0))
    assert [sid for sid, _ in out.server_parts] == [0, 1]
    for i, (sid, data) in enumerate(out.server_parts):
        same_part(PlanPart.from_msgpack(data), plan_part(plan, 2 + i, 0, 0))
    rec = out.record
    assert rec is c.last and c.steps_planned == 1 and c.next_step == 1
    assert rec["plan_ms"] == pytest.approx(10.0) and rec["cut_ms"] == pytest.approx(3.0)
    assert (rec["step"], rec["batch"], rec["epoch"]) == (0, 0, 0)
    assert rec["server_flops"] == dict(enumerate(plan.server_loads()))
    assert rec["server_tasks"] == {s: len(t) for s, t in enumerate(plan.server_tasks)}
    assert rec["num_tasks"] == len(plan.task_array)
    assert rec["bytes"] == {k: v["total"] for k, v in plan.comm_bytes().items()}
    assert (rec["imbalance_before"], rec["imbalance_after"]) == plan.imbalance()
    # the same members next step: the same epoch, nobody re-assigned
    out = run_step(c, 1)
    assert out.assignments == () and c.answer(1, 0, 0)["group"]["epoch"] == 0
    assert c.status()["steps_planned"] == 2 and c.status()["next_step"] == 2


def test_plan_work_runs_apart_from_the_state():
    """What the actor runs on a worker thread: plan_work() reads no state, plan(cut=...) applies it."""
    c, d = make(timer=Ticks(1.0, 0.010, 0.003)), make(timer=Ticks(1.0, 0.010, 0.003))
    for coord in (c, d):
        for r in range(2):
            coord.report(0, 0, r, LENS[r], SHAPE)
    alive = c.servers_pinged({i: True for i in c.servers_to_ping()})
    d.servers_pinged({i: True for i in d.servers_to_ping()})
    work = c.plan_work(0, 0, alive)
    cut = work()
    assert cut.error is None and cut.plan == plan_batch(LENS, 2, cost=COST, epsilon=0.05,
                                                        mode="dedicated", min_shard=8)
    assert c.batches[(0, 0)].answers is None  # nothing resolved by the work itself
    out = c.plan(0, 0, alive, cut=cut)
    assert out.resolved and d.plan(0, 0, alive).resolved
    assert c.answer(0, 0, 1) == d.answer(0, 0, 1) and out.record == d.last
    assert c.plan_work(0, 0, alive) is None  # resolved: nothing left to compute
    assert c.plan(0, 0, alive, cut=cut) == type(out)()  # a second application changes nothing
    # bad documents: the work returns the error, plan() gives it to every client
    c.report(1, 0, 0, [5, 0], SHAPE)
    c.report(1, 0, 1, [3], SHAPE)
    cut = c.plan_work(1, 0, alive)()
    assert cut.plan is None and "rank 0" in cut.error
    c.plan(1, 0, alive, cut=cut)
    assert c.answer(1, 0, 1) == {"error": "ValueError", "message": cut.error}


def test_full_step_inplace():
    c = make("inplace", clients=3, servers=0)
    lens = [[300, 5], [20, 20], [1, 2, 3]]
    out = run_step(c, 0, lens)
    assert out.assignments == () and out.server_parts == []
    plan = plan_batch(lens, 3, cost=COST, epsilon=0.05, mode="inplace", min_shard=8)
    for r in range(3):
        answer = c.answer(0, 0, r)
        assert answer["group"]["world_size"] == 3
        same_part(decode(answer), plan_part(plan, r, 0, 0))
    assert c.last["server_flops"].keys() == {0, 1, 2}


def test_two_batches_of_one_step_share_the_epoch():
    c = make()
    run_step(c, 0, batch=0)
    out = run_step(c, 0, lens=[[64], [9, 9]], batch=1)
    assert out.assignments == ()
    assert decode(c.answer(0, 1, 1)).batch == 1 and decode(c.answer(0, 0, 1)).batch == 0


# ---- membership ------------------------------------------------------------------------------------
def test_server_drops_out_then_client_restarts_then_device_changes():
    c = make()
    run_step(c, 0)
    assert c.epoch == 0
    out = run_step(c, 1, live={0})  # server 1 does not answer its ping
    assert c.epoch == 1 and out.assignments == (Assignment(0, 1, 2, 3, 0, "cpu"),)
    assert [sid for sid, _ in out.server_parts] == [0]
    assert c.answer(1, 0, 0)["group"] == {"epoch": 1, "world_rank": 0, "world_size": 3, "device_type": "cpu"}
    assert decode(c.answer(1, 0, 0)).num_servers == 1
    assert c.servers_to_ping() == [0] and c.last["server_flops"].keys() == {0}
    assert [row["state"] for row in c.status()["servers"]] == ["alive", "dead"]

    # client 1 restarts: same rank, new incarnation -> a new epoch, at the step the job is at
    assert c.register_client(1, 2, {"incarnation": "c1-again", "node": "node9"})["next_step"] == 2
    out = run_step(c, 2)
    assert c.epoch == 2 and [a.server for a in out.assignments] == [0]
    run_step(c, 3)
    assert c.epoch == 2  # nothing changed

    out = run_step(c, 4, shape={"cost": COST.to_wire(), "device_type": "cuda"})
    assert c.epoch == 3 and out.assignments[0].device_type == "cuda"

    c.register_server(1, {"incarnation": "s1-again", "node": "srv1"})  # back after a restart
    out = run_step(c, 5)
    assert c.epoch == 4 and [a.server for a in out.assignments] == [0, 1]


def test_unregister_only_the_same_incarnation():
    c = make()
    c.register_client(0, 2, {"incarnation": "new"})
    c.unregister_client(0, "c0")  # the old process closing late
    assert c.status()["clients"] == [0, 1]
    c.unregister_client(0, "new")
    assert c.status()["clients"] == [1]
    assert c.report(0, 0, 0, [5], SHAPE).answer["error"] == "DistCAError"


def test_unregistered_rank_gets_distca_error():
    c = Coordinator("job", "inplace")
    out = c.report(0, 0, 0, [5], SHAPE)
    assert out.answer == {"error": "DistCAError", "message": "rank 0 is not registered with job 'job'"}
    c.register_client(0, 2, {"incarnation": "a"})
    out = c.report(0, 0, 1, [5], SHAPE)
    assert out.answer["error"] == "DistCAError" and "rank 1 is not registered" in out.answer["message"]
    assert not out.plan and c.batches == {}


@pytest.mark.parametrize("rank, world, match", [(2, 2, r"rank must be in \[0, 2\), got 2"),
                                                (-1, 2, "got -1"), (True, 2, "got True"),
                                                (0, 3, "has 2 clients, not 3"),
                                                (0, 0, "world_size must be a positive int, got 0")])
def test_register_client_rejects(rank, world, match):
    c = make("inplace", clients=2, servers=0)
    with pytest.raises(ValueError, match=match):
        c.register_client(rank, world, {"incarnation": "x"})


def test_no_live_server_is_a_distca_error_for_everyone():
    c = make(servers=1)
    out = run_step(c, 0, live=set())
    assert out.resolved and out.record is None and c.epoch == -1
    for r in range(2):
        assert c.answer(0, 0, r) == {"error": "DistCAError", "message": "job 'job' has no live attention server"}
    assert c.next_step == 1


# ---- one report per client per (step, batch) -------------------------------------------------------
def test_client_reporting_twice():
    c = make()
    assert c.report(0, 0, 0, LENS[0], SHAPE).answer is None
    again = c.report(0, 0, 0, list(LENS[0]), dict(SHAPE))  # the same report again: still waiting
    assert again.answer is None and not again.plan
    assert c.report(0, 0, 1, LENS[1], SHAPE).plan  # the batch completes exactly once
    assert not c.report(0, 0, 1, LENS[1], SHAPE).plan
    other = c.report(0, 0, 0, [343], SHAPE)  # different documents: refused, only for this caller
    assert other.answer["error"] == "ValueError" and "rank 0 reported step 0 batch 0 twice" in other.answer["message"]
    assert not other.resolved
    c.plan(0, 0, c.servers_pinged({0: True, 1: True}))
    assert c.plan(0, 0, [0, 1]).resolved is False  # planning twice does nothing
    assert c.steps_planned == 1
    repeat = c.report(0, 0, 0, LENS[0], SHAPE)  # once planned, a repeat gets the same part
    assert repeat.answer is c.answer(0, 0, 0) and "part" in repeat.answer


# ---- bad input: the same ValueError for every client --------------------------------------------------
@pytest.mark.parametrize("shape1, match", [
    ({"cost": [4, 2, 32, 2], "device_type": "cpu"}, r"disagree on the attention shape: ranks \[0\] sent .*16.*; ranks \[1\] sent .*32"),
    ({"cost": COST.to_wire(), "device_type": "cuda"}, "disagree on the attention shape"),
    ({"cost": [4, 3, 16, 2], "device_type": "cpu"}, r"rank 1: .*multiple of num_heads_kv"),
    ({"cost": [4, 2, 16], "device_type": "cpu"}, r"rank 1: an attention shape must be four ints"),
    ({"cost": COST.to_wire(), "device_type": "tpu"}, r"rank 1: device_type must be one of .*'tpu'"),
    ({"num_heads_q": 4, "num_heads_kv": 2, "head_dim": 16, "dtype_bytes": 2, "device_type": "cpu"},
     r"rank 1: the attention shape must be a dict with keys 'cost' and 'device_type'"),
    ("llama", "rank 1: the attention shape must be a dict"),
])
def test_bad_or_mismatched_shapes_are_a_value_error_for_all(shape1, match):
    c = make()
    assert c.report(3, 0, 0, LENS[0], SHAPE).answer is None
    out = c.report(3, 0, 1, LENS[1], shape1)
    assert out.resolved and not out.plan and out.answer["error"] == "ValueError"
    assert c.answer(3, 0, 0) == c.answer(3, 0, 1) == out.answer
    assert re.search(match, out.answer["message"]), out.answer["message"]
    assert c.next_step == 4 and c.epoch == -1 and c.plan(3, 0, [0, 1]).record is None


@pytest.mark.parametrize("lens, match", [([[300], [0]], r"rank 1: .*\[0\]"), ([[300], [2.5]], r"2\.5"),
                                         ([[300], "abc"], r"doc_lens_per_rank\[1\]")])
def test_bad_documents_are_a_value_error_for_all(lens, match):
    c = make()
    out = run_step(c, 0, lens)
    assert out.resolved and out.record is None and out.assignments == ()
    answers = [c.answer(0, 0, r) for r in range(2)]
    assert answers[0] == answers[1] and answers[0]["error"] == "ValueError"
    assert re.search(match, answers[0]["message"]), answers[0]["message"]
    assert c.epoch == -1  # no group was formed for a batch that could not be planned


def test_bad_step_or_batch_is_refused_for_that_caller():
    c = make()
    for step, batch in ((-1, 0), (0, -2), ("3", 0), (0, None)):
        out = c.report(step, batch, 0, LENS[0], SHAPE)
        assert out.answer["error"] == "ValueError" and "step and batch must be ints" in out.answer["message"]
    assert c.batches == {}


# ---- timeouts and aborts ---------------------------------------------------------------------------
def test_abort_names_missing_ranks_and_late_reporters_get_the_same_error():
    c = make(clients=3, servers=1)
    c.report(5, 1, 0, [10], SHAPE)
    answer = c.abort(5, 1, 0)  # rank 0's wait timed out
    assert answer == {"error": "DistCAError", "message": "step 5 batch 1: ranks [1, 2] did not report within 10 s"}
    late = c.report(5, 1, 2, [10], SHAPE)
    assert late.answer == answer and not late.plan
    assert c.abort(5, 1, 2) == answer  # a second timeout keeps the first answer
    assert c.next_step == 6


def test_abort_while_planning_wins_over_the_plan():
    c = make()
    c.report(0, 0, 0, LENS[0], SHAPE)
    assert c.report(0, 0, 1, LENS[1], SHAPE).plan
    assert "was not planned within 10 s" in c.abort(0, 0, 1)["message"]
    out = c.plan(0, 0, [0, 1])  # the pings came back after the timeout
    assert not out.resolved and out.record is None and c.epoch == -1


def test_old_batches_are_forgotten():
    c = make("inplace", clients=2, servers=0)
    for step in range(6):
        run_step(c, step)
    assert sorted(c.batches) == [(3, 0), (4, 0), (5, 0)]
    assert c.answer(0, 0, 0)["error"] == "DistCAError"
    assert "part" in c.answer(5, 0, 1)


# ---- failure arbitration ------------------------------------------------------------------------
def test_failure_verdict_names_the_silent_member_after_the_grace_period():
    c = make()
    run_step(c, 0)
    first = c.failure(0, 0, step=0, now=100.0)
    assert first.verdict is None and first.deadline == 100.0 + GRACE
    for world_rank, now in ((1, 100.4), (2, 101.0)):  # both clients and server 0 report
        assert c.failure(0, world_rank, 0, now).verdict is None
    assert c.close_failure(0, now=101.9) is None  # still within the grace period
    verdict = c.close_failure(0, now=102.0)
    assert verdict == {"lost": ["attention server 1 (node srv1)"], "next_step": 1}
    assert c.close_failure(0, now=500.0) == verdict
    # the silent one reporting late gets the same verdict; the next batch forms a new group
    assert c.failure(0, 3, 0, 103.0).verdict == verdict
    out = run_step(c, 1)
    assert c.epoch == 1 and len(out.assignments) == 2


def test_failure_verdict_when_every_member_reports_names_nobody():
    c = make()
    run_step(c, 0)
    outs = [c.failure(0, wr, step=0, now=10.0 + wr) for wr in range(4)]
    assert [o.verdict for o in outs[:3]] == [None, None, None]
    assert outs[3].verdict == {"lost": [], "next_step": 1}  # decided in the same call: readable at once
    assert c.close_failure(0, now=10.5) == {"lost": [], "next_step": 1}  # before the deadline too
    run_step(c, 1)
    assert c.epoch == 1


def test_failure_of_a_client_rank_and_next_step():
    c = make("inplace", clients=3, servers=0)
    run_step(c, 0, [[30], [40], [50]])
    c.failure(0, 0, step=7, now=0.0)
    c.failure(0, 2, step=7, now=0.1)
    assert c.close_failure(0, now=GRACE) == {"lost": ["client rank 1 (node node1)"], "next_step": 8}


def test_failure_of_a_stale_epoch_is_answered_at_once_and_keeps_the_group():
    c = make()
    run_step(c, 0)
    out = c.failure(99, 0, step=0, now=5.0)
    assert out.verdict == {"lost": [], "next_step": 1}
    run_step(c, 1)
    assert c.epoch == 0  # the current group was not ended by a report about another epoch
    assert c.close_failure(12345, now=0.0) == {"lost": [], "next_step": 2}


# ---- rendezvous and status ---------------------------------------------------------------------------
def test_rendezvous_addresses_per_epoch():
    c = make()
    assert c.store_address(0) is None
    c.publish_store(0, "10.0.0.1", 2900)
    assert c.store_address(0) == ("10.0.0.1", 2900)
    for step in range(4):  # every step a new epoch (a server flaps); old addresses are forgotten
        c.register_server(1, {"incarnation": f"s1-{step}"})
        run_step(c, step)
        c.publish_store(c.epoch, "h", step)
    assert c.epoch == 3 and c.store_address(0) is None and c.store_address(3) == ("h", 3)


def test_status_rows():
    c = make(servers=2)
    run_step(c, 0, live={1})
    st = c.status()
    assert st["world_size"] == 2 and st["clients"] == [0, 1] and st["epoch"] == 0
    assert st["servers"] == [
        {"server": 0, "node": "srv0", "state": "dead", "rounds_served": None, "last_flops": None, "last_tasks": None},
        {"server": 1, "node": "srv1", "state": "alive", "rounds_served": None,
         "last_flops": st["last"]["server_flops"][1], "last_tasks": st["last"]["server_tasks"][1]}]


def test_bad_mode_and_server_index():
    with pytest.raises(ValueError, match="'sideways'"):
        Coordinator("job", "sideways")
    with pytest.raises(ValueError, match="-1"):
        Coordinator("job").register_server(-1, {})
    with pytest.raises(ValueError, match="epsilon must be a finite number >= 0, got -0.5"):
        Coordinator("job", epsilon=-0.5)
    with pytest.raises(ValueError, match="min_shard must be a positive int, got 0"):
        Coordinator("job", min_shard=0)
    c = make()
    assert c.report(0, 0, [0], [5], SHAPE).answer["error"] == "DistCAError"  # an unhashable rank


# ---- purity -------------------------------------------------------------------------------------------
def test_coordinator_imports_neither_torch_nor_ray():
    code = ("import sys; import scheduler.coordinator; "
            "print(sorted(m for m in ('torch', 'ray', 'asyncio') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
