"""The scheduler's pure coordinator, driven by hand-built reports (no Ray, no event loop).

Each test plays the wrapper's part: report, ping results, plan, failure reports with a hand-moved
clock, and checks the plain data the coordinator hands back.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import numpy as np
import pytest

from scheduler import CostModel, Plan, plan_batch
from scheduler.config import JobConfig, PlanConfig
from scheduler.coordinator import KEEP_EPOCHS, MAX_BOOTSTRAP_BYTES, Coordinator
from scheduler.cost import is_split
from scheduler.outcomes import Assignment
from scheduler.parts import PlanPart, plan_identity, plan_part

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


def make(mode="dedicated", clients=2, servers=2, timer=None, transport="torch_dist", node=None, step=0):
    """A coordinator with registered clients and servers, each on its own node unless ``node``;
    the clients registered at ``step`` (reports may name at most one step past the job's)."""
    config = JobConfig(plan=PlanConfig(mode=mode, epsilon=0.05, min_shard=8), timeout_s=10.0,
                       failure_grace_s=GRACE, transport=transport)
    c = Coordinator("job", config=config, timer=timer or Ticks(1.0))
    for r in range(clients):
        info = {"incarnation": f"c{r}", "node": node or f"node{r}", "step": step}
        assert c.register_client(r, clients, info)["next_step"] == step
    for s in range(servers):
        c.register_server(s, {"incarnation": f"s{s}", "node": node or f"srv{s}"})
    return c


def run_step(c, step, lens=LENS, live=None, shape=SHAPE, batch=0):
    """Report every client, ping (all servers answer unless ``live`` says), plan; returns the outcome."""
    outs = [c.report(step, batch, r, lens[r], shape) for r in range(len(lens))]
    assert [o.plan for o in outs] == [False] * (len(lens) - 1) + [True]
    assert all(o.answer is None for o in outs)
    ids = c.servers_to_ping()
    alive = c.servers_pinged({i: "alive" if live is None or i in live else "suspect" for i in ids})
    return c.plan(step, batch, alive if c.mode == "dedicated" else None)


def decode(answer) -> PlanPart:
    assert set(answer) == {"part", "group"}, answer
    return PlanPart.from_msgpack(answer["part"])  # full validation at the trust boundary


def same_part(got: PlanPart, want: PlanPart) -> None:
    for name in ("step", "batch", "mode", "num_ranks", "num_servers", "cost", "participant", "rank",
                 "server", "doc_lens", "plan_id"):
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
    pid = plan_identity(plan.to_msgpack(), 0, 0)
    assert pid != plan_identity(plan.to_msgpack(), 1, 0) != plan_identity(plan.to_msgpack(), 0, 1)
    assert c.plan_descriptor(0, 0) == plan.to_msgpack()
    for r in range(2):
        answer = c.answer(0, 0, r)
        assert answer["group"] == {"epoch": 0, "world_rank": r, "world_size": 4, "device_type": "cpu",
                                   "transport": "torch_dist"}
        same_part(decode(answer), plan_part(plan, r, 0, 0, plan_id=pid))
    assert [sid for sid, _ in out.server_parts] == [0, 1]
    for i, (sid, data) in enumerate(out.server_parts):
        same_part(PlanPart.from_msgpack(data), plan_part(plan, 2 + i, 0, 0, plan_id=pid))
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
    alive = c.servers_pinged({i: "alive" for i in c.servers_to_ping()})
    d.servers_pinged({i: "alive" for i in d.servers_to_ping()})
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
        same_part(decode(answer), plan_part(plan, r, 0, 0, plan_id=plan_identity(plan.to_msgpack(), 0, 0)))
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
    assert c.answer(1, 0, 0)["group"] == {"epoch": 1, "world_rank": 0, "world_size": 3, "device_type": "cpu",
                                             "transport": "torch_dist"}
    assert decode(c.answer(1, 0, 0)).num_servers == 1
    assert c.servers_to_ping() == {0: "alive", 1: "suspect"} and c.last["server_flops"].keys() == {0}
    assert [row["state"] for row in c.status()["servers"]] == ["alive", "suspect"]

    # client 1 restarts: same rank, new incarnation -> a new epoch, at the step the job is at
    assert c.register_client(1, 2, {"incarnation": "c1-again", "node": "node9"})["next_step"] == 2
    out = run_step(c, 2, live={0})
    assert c.epoch == 2 and [a.server for a in out.assignments] == [0]
    run_step(c, 3, live={0})
    assert c.epoch == 2  # nothing changed

    out = run_step(c, 4, shape={"cost": COST.to_wire(), "device_type": "cuda"}, live={0})
    assert c.epoch == 3 and out.assignments[0].device_type == "cuda"

    # one slow ping does not drop a server for good: it is pinged again and rejoins when it answers
    out = run_step(c, 5)
    assert c.epoch == 4 and [a.server for a in out.assignments] == [0, 1]
    run_step(c, 6, live={1})
    c.servers_pinged({0: "dead"})  # its actor died: not pinged until it registers again
    assert c.servers_to_ping() == {1: "alive"}
    c.register_server(0, {"incarnation": "s0-again", "node": "srv0"})  # back after a restart
    out = run_step(c, 7)
    assert c.epoch == 6 and [a.server for a in out.assignments] == [0, 1]
    with pytest.raises(ValueError, match="server 1: state must be one of .* got True"):
        c.servers_pinged({1: True})


def test_unregister_only_the_same_incarnation():
    c = make()
    c.register_client(0, 2, {"incarnation": "new"})
    c.unregister_client(0, "c0")  # the old process closing late
    assert c.status()["clients"] == [0, 1]
    c.unregister_client(0, "new")
    assert c.status()["clients"] == [1]
    assert c.report(0, 0, 0, [5], SHAPE).answer["error"] == "DistCAError"


def test_unregistered_rank_gets_distca_error():
    c = Coordinator("job", config=JobConfig(plan=PlanConfig(mode="inplace")))
    out = c.report(0, 0, 0, [5], SHAPE)
    assert out.answer == {"error": "DistCAError", "message": "rank 0 is not registered with job 'job'",
                          "register": True}
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
    c.plan(0, 0, c.servers_pinged({0: "alive", 1: "alive"}))
    assert c.plan(0, 0, [0, 1]).resolved is False  # planning twice does nothing
    assert c.steps_planned == 1
    repeat = c.report(0, 0, 0, LENS[0], SHAPE)  # once planned, a repeat gets the same part
    assert repeat.answer is c.answer(0, 0, 0) and "part" in repeat.answer


def test_windowed_shapes_plan_with_the_window():
    """Clients of a sliding-window layer report its window: the batch is planned with it and every
    part carries it (a layer without one is a batch of its own)."""
    c = make()
    shape = dict(SHAPE, window=64)
    assert c.report(0, 0, 0, LENS[0], shape).answer is None
    assert c.report(0, 0, 1, LENS[1], shape).plan
    c.plan(0, 0, c.servers_pinged({0: "alive", 1: "alive"}))
    part = PlanPart.from_msgpack(c.answer(0, 0, 0)["part"])
    assert part.window == 64
    assert all(t[5] == max(0, t[3] - 63) for t in part.client_tasks.tolist())


# ---- bad input: the same ValueError for every client --------------------------------------------------
@pytest.mark.parametrize("shape1, match", [
    ({"cost": [4, 2, 32, 2], "device_type": "cpu"}, r"disagree on the attention shape: ranks \[0\] sent .*16.*; ranks \[1\] sent .*32"),
    ({"cost": COST.to_wire(), "device_type": "cuda"}, "disagree on the attention shape"),
    ({"cost": [4, 3, 16, 2], "device_type": "cpu"}, r"rank 1: .*multiple of num_heads_kv"),
    ({"cost": [4, 2, 16], "device_type": "cpu"}, r"rank 1: an attention shape must be four ints"),
    ({"cost": COST.to_wire(), "device_type": "tpu"}, r"rank 1: device_type must be one of .*'tpu'"),
    ({"num_heads_q": 4, "num_heads_kv": 2, "head_dim": 16, "dtype_bytes": 2, "device_type": "cpu"},
     r"rank 1: the attention shape must be a dict with keys 'cost', 'device_type' and optionally 'window'"),
    ("llama", "rank 1: the attention shape must be a dict"),
    ({"cost": COST.to_wire(), "device_type": "cpu", "window": 64},
     r"disagree on the attention shape: .*'window': None.*'window': 64"),
    ({"cost": COST.to_wire(), "device_type": "cpu", "window": 0}, r"rank 1: window must be a positive int"),
])
def test_bad_or_mismatched_shapes_are_a_value_error_for_all(shape1, match):
    c = make(step=3)
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
def test_abort_names_missing_ranks_and_late_ranks_resync():
    """Rank 0 timed out waiting in step 5; ranks 1 and 2 never took part in it (too slow, or
    replaced): they are sent on to step 6 rather than handed step 5's error, which would cost
    them step 6 too and leave them a step behind rank 0 for good in a lock-step loop."""
    c = make(clients=3, servers=1, step=5)
    c.report(5, 1, 0, [10], SHAPE)
    answer = c.abort(5, 1, 0)  # rank 0's wait timed out
    assert answer == {"error": "DistCAError", "message": "step 5 batch 1: ranks [1, 2] did not report within 10 s"}
    late = c.report(5, 1, 2, [10], SHAPE)
    assert late.answer["error"] == "resync" and late.answer["next_step"] == 6 and not late.plan
    assert c.report(5, 0, 1, [10], SHAPE).answer["error"] == "resync"  # any batch of the step
    assert c.report(5, 2, 0, [10], SHAPE).answer == answer  # rank 0 took part: the step's error
    assert c.abort(5, 1, 2) == answer  # a second timeout keeps the first answer
    assert c.next_step == 6
    assert all(c.report(6, 0, r, [10], SHAPE).answer is None for r in range(3))  # they meet at step 6


def test_a_replacement_that_registered_mid_step_meets_its_peer_at_the_next_step():
    """Rank 1 died; its replacement registers while rank 0 waits in step 4 (so it is told step 4)
    and reports step 4 only after rank 0 timed out and went on to step 5. It never took part in
    step 4: it resyncs to step 5 and meets rank 0 there, instead of failing step 4 at once and then
    reporting step 5 after rank 0 has timed out of it (a lock-step loop would repeat that forever)."""
    c = make("inplace", servers=0, step=4)
    assert c.report(4, 0, 0, LENS[0], SHAPE).answer is None
    assert c.register_client(1, 2, {"incarnation": "c1-new", "node": "node1"})["next_step"] == 4
    assert "ranks [1] did not report" in c.abort(4, 0, 0)["message"]
    assert c.report(4, 0, 1, LENS[1], SHAPE).answer == {
        "error": "resync", "message": "step 4 is over for job 'job'; the job goes on at step 5", "next_step": 5}
    out = run_step(c, 5)
    assert out.resolved and decode(c.answer(5, 0, 1)).step == 5


def test_a_value_error_fails_every_client_of_the_step_even_those_not_yet_reported():
    """Bad input is every client's error: a peer that reports the step later raises it too (the
    step's error is not a resync, so its training loop loses the same step as the bad rank's)."""
    c = make("inplace", servers=0, step=2)
    answer = c.fail_step(2, 0, "q has 40 rows")
    assert c.report(2, 0, 1, LENS[1], SHAPE).answer == answer


@pytest.mark.parametrize("step", [2**40, 2**63 - 2, 8])
def test_steps_far_ahead_are_refused_and_move_nothing(step):
    """A report, a failed step or a check-in more than one step past the job's is a ValueError for
    its sender alone: nothing is kept, the floor and every client's next step stay."""
    c = make("inplace", servers=0, step=5)
    out = c.report(step, 0, 0, LENS[0], SHAPE)
    assert out.answer["error"] == "ValueError" and f"step {step} is ahead of job 'job', which is at step 5" \
        in out.answer["message"]
    assert c.batches == {} and c.floor == 5 and c.next_step == 0
    with pytest.raises(ValueError, match=f"step {step} is ahead"):
        c.fail_step(step, 0, "x")
    run_step(c, 5, [[30], [40]])
    with pytest.raises(ValueError, match=f"step {step} is ahead"):
        c.failure(0, 0, step=step, now=0.0)
    assert c.report(6, 0, 0, LENS[0], SHAPE).answer is None  # one step ahead is a client's next step
    assert c.register_client(1, 2, {"incarnation": "c1", "step": 6})["next_step"] == 6


@pytest.mark.parametrize("step", [2**40, 2**63 - 2, -1, "7"])
def test_a_registration_with_an_out_of_range_step_is_refused(step):
    c = make("inplace", servers=0)
    with pytest.raises(ValueError, match=r"client rank 1 registered with step .*; steps are ints in \[0, 1099511627776\)"):
        c.register_client(1, 2, {"incarnation": "c1-new", "step": step})
    assert c.floor == 0 and c.clients[1]["incarnation"] == "c1"


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
def verdict(lost=(), next_step=1, cause="", detected=False, epoch=0, ranks=()):
    return {"epoch": epoch, "lost": list(lost), "lost_ranks": list(ranks), "next_step": next_step,
            "cause": cause, "detected": detected}


def test_failure_verdict_names_the_silent_member_after_the_grace_period():
    c = make()
    run_step(c, 0)
    first = c.failure(0, 0, step=0, now=100.0, reached=3, cause="all-to-all timed out")
    assert first.verdict is None and first.deadline == 100.0 + GRACE and first.opened
    assert c.arbitration(0) == "open" and c.arbitration(1) is None
    for world_rank, now in ((1, 100.4), (2, 101.0)):  # client 1 and server 0 check in, alive
        out = c.failure(0, world_rank, -1, now, reached=3)
        assert out.verdict is None and not out.opened
    assert c.close_failure(0, now=101.9) is None  # still within the grace period
    decided = c.close_failure(0, now=102.0)
    assert decided == verdict(["attention server 1 (node srv1): did not answer within 2 s"], ranks=[3],
                              cause="all-to-all timed out")
    assert c.close_failure(0, now=500.0) == decided and c.arbitration(0) == "decided"
    # the silent one reporting late gets the same verdict; the next batch forms a new group without
    # it until it answers a ping again
    assert c.failure(0, 3, 0, 103.0).verdict == decided
    assert c.servers_to_ping() == {0: "alive", 1: "suspect"}
    out = run_step(c, 1, live={0})
    assert c.epoch == 1 and [a.server for a in out.assignments] == [0]


def test_failure_verdict_when_every_member_checks_in_names_nobody():
    c = make()
    run_step(c, 0)
    outs = [c.failure(0, wr, step=0, now=10.0 + wr, reached=2) for wr in range(4)]
    assert [o.verdict for o in outs[:3]] == [None, None, None] and [o.opened for o in outs] == [True] + [False] * 3
    assert outs[3].verdict == verdict()  # decided in the same call: readable at once
    assert c.close_failure(0, now=10.5) == verdict()  # before the deadline too
    run_step(c, 1)
    assert c.epoch == 1


def test_a_late_client_is_named_and_nobody_else():
    """Client 1 had not started the round that client 0 and both servers waited in (defect 1):
    only it is lost, although every member answered."""
    c = make()
    run_step(c, 0)
    c.failure(0, 0, step=0, now=0.0, reached=5, cause="rank 0: all-to-all timed out after 10 s")
    c.failure(0, 2, step=-1, now=0.1, reached=5)
    c.failure(0, 3, step=-1, now=0.1, reached=5)
    out = c.failure(0, 1, step=0, now=0.2, reached=4, in_round=False)  # its watcher: alive, but behind
    assert out.verdict == verdict(["client rank 1 (node node1): late, had not started the round its peers "
                                   "waited for"], ranks=[1], cause="rank 0: all-to-all timed out after 10 s")
    assert c.servers_to_ping() == {0: "alive", 1: "alive"}  # servers that waited stay in the plans


def test_a_member_that_failed_inside_an_earlier_round_is_not_late():
    """Client 0 got its results of round 4 and waits in round 5; client 1's return exchange of
    round 4 failed (server 1 died mid-round): only the server is lost."""
    c = make()
    run_step(c, 0)
    c.failure(0, 1, step=0, now=0.0, reached=4, cause="connection closed")
    c.failure(0, 0, step=0, now=0.1, reached=5, in_round=True)
    c.failure(0, 2, step=-1, now=0.1, reached=5)
    assert c.close_failure(0, now=GRACE)["lost_ranks"] == [3]


def test_a_servers_own_error_is_the_cause_everyone_reads():
    """A participant's own error (e.g. a part that disagrees with its peers') is the cause in the
    verdict every member receives, ahead of the collective errors it caused elsewhere."""
    c = make()
    run_step(c, 0)
    c.failure(0, 0, step=0, now=0.0, reached=1, cause="connection closed by peer")
    c.failure(0, 2, step=0, now=0.1, reached=1, cause="server 0: participant 0 sends 640 bytes, "
                                                      "participant 2 expects 768", detected=True)
    c.failure(0, 1, step=0, now=0.2, reached=1, cause="connection closed by peer")
    out = c.failure(0, 3, step=-1, now=0.3, reached=1)
    assert out.verdict["lost"] == [] and out.verdict["detected"]
    assert out.verdict["cause"].startswith("server 0: participant 0 sends 640 bytes")


def test_failure_of_a_client_rank_and_next_step():
    c = make("inplace", clients=3, servers=0, step=7)
    run_step(c, 7, [[30], [40], [50]])
    c.failure(0, 0, step=7, now=0.0, reached=1)
    c.failure(0, 2, step=7, now=0.1, reached=1)
    assert c.close_failure(0, now=GRACE)["lost"] == ["client rank 1 (node node1): did not answer within 2 s"]
    assert c.close_failure(0, now=GRACE)["next_step"] == 8


def test_a_failed_step_fails_its_other_batches_and_later_reports():
    """After a verdict in step 3, a client that goes on with step 3's second nano-batch learns at
    once that the step is over; the job goes on at step 4."""
    c = make(step=3)
    run_step(c, 3)
    c.report(3, 1, 0, LENS[0], SHAPE)  # rank 0's second nano-batch, waiting for rank 1
    for wr in range(4):
        c.failure(0, wr, step=3, now=0.0, reached=1, cause="timed out")
    assert c.drain_resolved() == [(3, 0), (3, 1)]
    for r in range(2):
        assert c.answer(3, 1, r)["error"] == "DistCAError" and "step 3 failed" in c.answer(3, 1, r)["message"]
    assert c.report(3, 2, 1, LENS[1], SHAPE).answer["error"] == "DistCAError"
    assert c.status()["next_step"] == 4
    out = run_step(c, 4)
    assert out.record is not None and c.epoch == 1


def test_failure_of_a_stale_epoch_is_answered_at_once_and_keeps_the_group():
    c = make()
    run_step(c, 0)
    out = c.failure(99, 0, step=0, now=5.0)
    assert out.verdict == verdict(epoch=99, cause="group epoch 99 is over") and not out.opened
    run_step(c, 1)
    assert c.epoch == 0  # the current group was not ended by a report about another epoch
    assert c.close_failure(12345, now=0.0)["lost"] == []


def test_an_older_epochs_verdict_still_names_its_lost():
    """A verdict is kept with its epoch: a member of an older epoch reporting late reads the
    names, not "nobody" (defect 6)."""
    c = make()
    run_step(c, 0)
    c.failure(0, 0, step=0, now=0.0, reached=1)
    decided = c.close_failure(0, now=GRACE)
    assert [x.split(":")[0] for x in decided["lost"]] == [
        "client rank 1 (node node1)", "attention server 0 (node srv0)", "attention server 1 (node srv1)"]
    run_step(c, 1)
    assert c.epoch == 1 and c.failure(0, 1, 0, now=50.0).verdict == decided


# ---- bad input of one client: every client fails at once with its message -------------------------
def test_fail_step_gives_every_client_the_same_value_error():
    c = make()
    run_step(c, 0)
    run_step(c, 1)
    c.report(2, 0, 1, LENS[1], SHAPE)  # rank 1 waits for rank 0, whose tensors were bad
    answer = c.fail_step(2, 0, "q has 40 rows but doc_lens sum to 343")
    assert answer == {"error": "ValueError", "message": "rank 0: q has 40 rows but doc_lens sum to 343"}
    assert c.drain_resolved()[-1] == (2, 0) and c.answer(2, 0, 1) == answer
    assert c.report(2, 1, 1, LENS[1], SHAPE).answer == answer  # the step's later batches too
    assert c.fail_step(2, 1, "other") == answer  # the first error stays the step's
    assert c.register_client(0, 2, {"incarnation": "c0"})["next_step"] == 3
    out = run_step(c, 3)  # the next step is planned with fresh lengths, not the abandoned ones
    assert decode(c.answer(3, 0, 0)).doc_lens == LENS[0] and out.record["step"] == 3
    run_step(c, 4)
    run_step(c, 5)
    c.report(6, 0, 1, LENS[1], SHAPE)
    c.fail_step(6, 0, "bad")  # resolving it forgets steps 0-3 while the open batches are walked
    assert sorted(c.batches) == [(4, 0), (5, 0), (6, 0)] and c.answer(6, 0, 1)["message"] == "rank 0: bad"
    with pytest.raises(ValueError, match="step must be an int >= 0, got -1"):
        c.fail_step(-1, 0, "x")


# ---- report bounds ---------------------------------------------------------------------------------
@pytest.mark.parametrize("lens, match", [
    ([1] * 65, r"rank 1 reported 65 documents; one report holds at most 64 \(max_report_docs\)"),
    ([1000, 25], r"rank 1 reported 1025 tokens; one report holds at most 1024 \(max_report_tokens\)")])
def test_oversized_report_is_a_value_error_naming_the_limit(lens, match):
    plan = PlanConfig(mode="inplace", min_shard=8)
    c = Coordinator("job", config=JobConfig(plan=plan, max_report_docs=64, max_report_tokens=1024))
    for r in range(2):
        c.register_client(r, 2, {"incarnation": f"c{r}"})
    c.report(0, 0, 0, [5], SHAPE)
    out = c.report(0, 0, 1, lens, SHAPE)
    assert out.resolved and not out.plan and out.answer["error"] == "ValueError"
    assert re.search(match, out.answer["message"]) and c.answer(0, 0, 0) == out.answer
    assert c.batches[(0, 0)].reports.keys() == {0}  # the oversized report is not kept
    first = c.report(1, 0, 0, lens, SHAPE)  # refused before the others report, too
    assert first.resolved and first.answer["error"] == "ValueError"
    with pytest.raises(ValueError, match="max_report_docs must be a positive int, got 0"):
        Coordinator("job", config=JobConfig(max_report_docs=0))


def test_default_bounds_refuse_ten_million_documents_at_once():
    c = make("inplace", clients=1, servers=0)
    t0 = time.perf_counter()
    out = c.report(0, 0, 0, [1] * 10_000_000, SHAPE)
    assert time.perf_counter() - t0 < 0.5  # refused by its length, not planned
    assert out.answer["error"] == "ValueError" and "at most 65536 (max_report_docs)" in out.answer["message"]


# ---- a restarted scheduler rebuilds from re-registrations -----------------------------------------
def test_restart_rebuilds_step_and_epoch_from_registrations():
    """A fresh coordinator (the restarted actor) learns where the job was from the members
    re-registering: epochs are numbered past every member's last one and steps go on after the
    one that was in flight, whichever member registers first."""
    config = JobConfig(plan=PlanConfig(mode="dedicated", min_shard=8), timeout_s=10.0, failure_grace_s=GRACE)
    c = Coordinator("job", config=config, timer=Ticks(1.0))
    c.register_server(0, {"incarnation": "s0", "node": "srv0", "epoch": 4})
    assert c.register_client(1, 2, {"incarnation": "c1", "node": "node1", "step": 12, "epoch": 4})["next_step"] == 12
    # rank 1 is first: its report of step 12 waits ...
    assert c.report(12, 0, 1, LENS[1], SHAPE).answer is None
    # ... then rank 0 re-registers: it had already given up step 12, so the job goes on at 13
    assert c.register_client(0, 2, {"incarnation": "c0", "node": "node0", "step": 13, "epoch": 5})["next_step"] == 13
    assert c.drain_resolved() == [(12, 0)]
    resync = c.answer(12, 0, 1)
    assert resync["error"] == "resync" and resync["next_step"] == 13
    assert c.report(12, 1, 1, LENS[1], SHAPE).answer["error"] == "resync"  # any batch of step 12
    out = run_step(c, 13)
    assert c.epoch == 6 and out.assignments == (Assignment(0, 6, 2, 3, 0, "cpu"),)
    assert decode(c.answer(13, 0, 1)).step == 13
    # a member of a pre-restart epoch reporting a failure of it is answered at once
    assert c.failure(4, 2, 12, now=0.0).verdict["lost"] == []


# ---- rendezvous and status ---------------------------------------------------------------------------
@pytest.mark.parametrize("value", [["10.0.0.1", 2900],  # torch_dist: the TCPStore address
                                   {"kind": "shm", "path": "/dev/shm/distca-heap-x", "world_size": 3,
                                    "heap_bytes": 1 << 30},  # shm: the heap's handle
                                   bytes(range(128))])  # nvshmem: a unique id's bytes
def test_bootstrap_values_per_epoch(value):
    c = make()
    assert c.bootstrap(0) is None
    c.publish_bootstrap(0, value)
    assert c.bootstrap(0) == value
    for step in range(4):  # every step a new epoch (a server restarts); old values are forgotten
        c.register_server(1, {"incarnation": f"s1-{step}"})
        run_step(c, step)
        c.publish_bootstrap(c.epoch, [value, step])
    assert c.epoch == 3 and c.bootstrap(0) is None  # older than KEEP_EPOCHS before the current one
    assert [c.bootstrap(e) for e in range(3 - KEEP_EPOCHS, 4)] == [[value, e] for e in range(3 - KEEP_EPOCHS, 4)]
    # tuples come back as lists (msgpack data): every member looks up the same plain value
    c.publish_bootstrap(3, ("h", 1))
    assert c.bootstrap(3) == ["h", 1]


def test_bootstrap_values_are_bounded_plain_data():
    c = make()
    c.publish_bootstrap(0, b"x" * (MAX_BOOTSTRAP_BYTES - 5))  # fits with its msgpack header
    with pytest.raises(ValueError, match=rf"takes {MAX_BOOTSTRAP_BYTES + 3} bytes packed, more than "
                                         rf"{MAX_BOOTSTRAP_BYTES}"):
        c.publish_bootstrap(1, b"x" * MAX_BOOTSTRAP_BYTES)
    with pytest.raises(ValueError, match="must be msgpack data, got object"):
        c.publish_bootstrap(1, object())
    with pytest.raises(ValueError, match="must not be None"):
        c.publish_bootstrap(1, None)
    with pytest.raises(ValueError, match=r"epoch must be an int >= 0, got '1'"):
        c.publish_bootstrap("1", [1])
    assert c.bootstrap(1) is None


def test_transport_is_checked_and_handed_out_with_the_group():
    with pytest.raises(ValueError, match=r"transport must be one of \('torch_dist', 'shm', 'nvshmem'\), "
                                         r"got 'gloo'"):
        make(transport="gloo")
    c = make(transport="shm", node="10.0.0.1")
    assert c.register_client(0, 2, {"incarnation": "c0", "node": "10.0.0.1"})["transport"] == "shm"
    out = run_step(c, 0)
    for r in range(2):
        assert c.answer(0, 0, r)["group"]["transport"] == "shm"
    assert len(out.assignments) == 2 and c.transport == "shm"  # the actor assigns with coord.transport


def test_shm_refuses_a_group_across_nodes_and_cuda_tensors():
    c = make(transport="shm", node="10.0.0.1")
    c.register_server(1, {"incarnation": "s1", "node": "10.0.0.9"})
    run_step(c, 0)
    for r in range(2):
        answer = c.answer(0, 0, r)
        assert answer["error"] == "DistCAError", answer
        assert "needs every member of a group on one node, but they are on 2 nodes" in answer["message"]
        assert "attention server 1" in answer["message"] and "10.0.0.9" in answer["message"]
    assert c.epoch == -1  # no group formed
    d = make(transport="shm", servers=1, node="n")
    run_step(d, 0, shape=dict(SHAPE, device_type="cuda"))
    assert d.answer(0, 0, 0)["error"] == "ValueError"
    assert "moves cpu tensors, not cuda" in d.answer(0, 0, 0)["message"]


def test_status_rows():
    c = make(servers=2)
    run_step(c, 0, live={1})
    st = c.status()
    assert st["world_size"] == 2 and st["clients"] == [0, 1] and st["epoch"] == 0
    assert st["servers"] == [
        {"server": 0, "node": "srv0", "state": "suspect", "rounds_served": None, "last_flops": None,
         "last_tasks": None, "last_held_bytes": None, "last_error": None, "bytes_sent": None},
        {"server": 1, "node": "srv1", "state": "alive", "rounds_served": None,
         "last_flops": st["last"]["server_flops"][1], "last_tasks": st["last"]["server_tasks"][1],
         "last_held_bytes": st["last"]["server_held_bytes"][1], "last_error": None, "bytes_sent": None}]
    assert st["servers"][1]["last_flops"] > 0
    # server 1 dies after the plan: its row keeps no stale load (the plan record still has it)
    c.servers_pinged({0: "alive", 1: "dead"})
    st = c.status()
    assert [(s["state"], s["last_flops"], s["last_tasks"]) for s in st["servers"]] == [
        ("alive", None, None), ("dead", None, None)]
    assert 1 in st["last"]["server_flops"]


def test_status_rows_inplace():
    c = make("inplace", servers=0)
    run_step(c, 0)
    c.unregister_client(1, "c1")
    rows = c.status()["servers"]
    assert [(s["server"], s["node"], s["state"]) for s in rows] == [(0, "node0", "in-place"),
                                                                    (1, "?", "unregistered")]
    assert rows[0]["last_flops"] == c.last["server_flops"][0] and rows[1]["last_flops"] is None


def test_bad_mode_and_server_index():
    with pytest.raises(ValueError, match="'sideways'"):
        Coordinator("job", config=JobConfig(plan=PlanConfig(mode="sideways")))
    with pytest.raises(ValueError, match="-1"):
        Coordinator("job").register_server(-1, {})
    with pytest.raises(ValueError, match="epsilon must be a finite number >= 0, got -0.5"):
        Coordinator("job", config=JobConfig(plan=PlanConfig(epsilon=-0.5)))
    with pytest.raises(ValueError, match="min_shard must be a positive int, got 0"):
        Coordinator("job", config=JobConfig(plan=PlanConfig(min_shard=0)))
    c = make()
    assert c.report(0, 0, [0], [5], SHAPE).answer["error"] == "DistCAError"  # an unhashable rank


# ---- purity -------------------------------------------------------------------------------------------
def test_coordinator_imports_neither_torch_nor_ray():
    code = ("import sys; import scheduler.coordinator; "
            "print(sorted(m for m in ('torch', 'ray', 'asyncio') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_partial_kv_plans_split_key_blocks():
    """A coordinator with ``PlanConfig(partial_kv=True)`` (``launch(config=...)``) plans with key
    splits where the bands cannot balance: one 2,048-token document over 4 servers at min_shard 512."""
    lens = [[2048], [5]]
    for partial_kv in (False, True):
        config = JobConfig(plan=PlanConfig(mode="dedicated", epsilon=0.05, min_shard=512,
                                           partial_kv=partial_kv), timeout_s=10.0, failure_grace_s=GRACE)
        c = Coordinator("job", config=config, timer=Ticks(1.0))
        for r in range(2):
            c.register_client(r, 2, {"incarnation": f"c{r}", "node": "n"})
        for s in range(4):
            c.register_server(s, {"incarnation": f"s{s}", "node": "n"})
        assert run_step(c, 0, lens=lens).resolved
        plan = Plan.from_msgpack(c.plan_descriptor(0, 0))
        arr = plan.task_array
        assert bool(is_split(arr[:, 3], arr[:, 4], arr[:, 5], arr[:, 6], None).any()) is partial_kv
        assert (plan.imbalance()[1] <= 1.05 + 1e-9) is partial_kv
    with pytest.raises(ValueError, match="partial_kv must be a bool"):
        Coordinator("job", config=JobConfig(plan=PlanConfig(partial_kv="yes")))
