"""The scheduler's pure coordinator, driven by hand-built reports (no Ray, no event loop): one step.

Each test plays the wrapper's part: report, ping results, plan, failure reports with a hand-moved
clock, and checks the plain data the coordinator hands back. Here: a full step, its reports, plans
and answers, bad input, timeouts, the step floor and resyncs, report bounds and status
(:mod:`scheduler.coordinator`). Membership is in ``test_coordinator_membership.py``, group epochs
and failure arbitration in ``test_coordinator_epochs.py``; both import the helpers defined here.
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
from scheduler.coordinator import Coordinator
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
    t0 = time.process_time()  # this process's CPU time: a busy machine does not inflate it
    out = c.report(0, 0, 0, [1] * 10_000_000, SHAPE)
    assert time.process_time() - t0 < 2.0  # refused by its length, not planned (that takes minutes)
    assert out.answer["error"] == "ValueError" and "at most 65536 (max_report_docs)" in out.answer["message"]


# ---- status and configuration --------------------------------------------------------------------
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
