"""The coordinator's membership (:mod:`scheduler.coordinator_membership`), driven by hand-built
registrations and reports: clients and servers joining, leaving and restarting, server states from
pings, the bounds on the steps members name, and a restarted scheduler rebuilding from them.
"""

from __future__ import annotations

import pytest

from scheduler.config import JobConfig, PlanConfig
from scheduler.coordinator import Coordinator
from scheduler.outcomes import Assignment
from test_coordinator import COST, GRACE, LENS, SHAPE, Ticks, decode, make, run_step  # the shared helpers


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
        assert c.answer(0, 0, r) == {"error": "DistCAError",
                                     "message": "job 'job' has no live attention server (server 0 suspect)"}
    assert c.next_step == 1
    c.servers_pinged({0: "dead"})
    run_step(c, 1, live=set())
    assert c.answer(1, 0, 0)["message"].endswith("(server 0 dead)")


# ---- a restarted client's old reports ---------------------------------------------------------------
@pytest.mark.parametrize("lens", [[64, 64], [100, 28]], ids=["other documents", "same documents"])
def test_a_replacement_reports_in_place_of_its_dead_process(lens):
    """Rank 1 reported step 4 batch 0 and died before rank 0 reported; its replacement (a new
    incarnation) is told step 4 and reports the batch itself: its report takes the old one's place
    (not refused as a second report of the rank), and the batch is planned with its documents."""
    c = make("inplace", servers=0, step=4)
    assert c.report(4, 0, 1, [100, 28], SHAPE).answer is None
    assert c.register_client(1, 2, {"incarnation": "c1-new", "node": "node1"})["next_step"] == 4
    assert c.took_part.get(4, set()) == set()  # the new process took part in nothing yet
    out = c.report(4, 0, 1, lens, SHAPE)
    assert out.answer is None and not out.plan  # waits for rank 0: the batch holds one report
    assert c.report(4, 0, 0, [50, 7], SHAPE).plan
    assert c.plan(4, 0).resolved
    assert decode(c.answer(4, 0, 1)).doc_lens == lens and decode(c.answer(4, 0, 0)).doc_lens == [50, 7]
    assert c.answer(4, 0, 0)["group"]["epoch"] == 0


@pytest.mark.parametrize("lens", [[64, 64], [100, 28]], ids=["other documents", "same documents"])
def test_a_replacement_reporting_after_the_timeout_resyncs(lens):
    """The batch timed out (rank 0's wait) before the replacement of rank 1 reported it: the
    replacement took no part in step 4 (its dead process did), so it resyncs to step 5, as the
    step protocol promises a replacement, instead of the step's DistCAError or a ValueError."""
    c = make("inplace", servers=0, step=4)
    assert c.report(4, 0, 1, [100, 28], SHAPE).answer is None
    assert c.register_client(1, 2, {"incarnation": "c1-new", "node": "node1"})["next_step"] == 4
    assert c.report(4, 0, 0, [50, 7], SHAPE).answer is None
    assert "ranks [1] did not report" in c.abort(4, 0, 0)["message"]
    assert c.report(4, 0, 1, lens, SHAPE).answer == {
        "error": "resync", "message": "step 4 is over for job 'job'; the job goes on at step 5", "next_step": 5}
    assert c.report(4, 0, 0, [50, 7], SHAPE).answer["error"] == "DistCAError"  # rank 0 took part
    out = run_step(c, 5)
    assert out.resolved and decode(c.answer(5, 0, 1)).doc_lens == LENS[1]


def test_a_reconnecting_client_keeps_its_report():
    """The same process registering again (the same incarnation: a reconnect) is still the client
    that reported: its report stays, the batch plans with it and a timeout is its error too."""
    c = make("inplace", servers=0, step=4)
    assert c.report(4, 0, 1, [100, 28], SHAPE).answer is None
    assert c.register_client(1, 2, {"incarnation": "c1", "node": "node1"})["next_step"] == 4
    assert c.report(4, 0, 1, [64, 64], SHAPE).answer["error"] == "ValueError"  # a second, different report
    assert c.report(4, 0, 0, [50, 7], SHAPE).plan  # the kept report completes the batch
    c.plan(4, 0)
    assert decode(c.answer(4, 0, 1)).doc_lens == [100, 28]
    assert c.report(4, 0, 1, [100, 28], SHAPE).answer is c.answer(4, 0, 1)

    c.report(5, 0, 1, [100, 28], SHAPE)
    c.register_client(1, 2, {"incarnation": "c1", "node": "node1"})
    c.abort(5, 0, 1)
    assert c.report(5, 1, 1, [10], SHAPE).answer["error"] == "DistCAError"  # it took part in step 5


def test_a_replacement_while_its_dead_process_report_is_planned_fails_the_step():
    """Every client had reported and the plan was being computed (its peers wait for it) when rank
    1's replacement registered: the plan holds the dead process's part. Dropping that report would
    wake the peers without an answer; planning it would hand them a part of a group whose rank 1
    never comes. The step fails for every client at once and the replacement starts at the next."""
    c = make("inplace", servers=0, step=4)
    assert c.report(4, 1, 1, [9], SHAPE).answer is None  # the dead process's report of another batch
    assert c.report(4, 0, 1, [100, 28], SHAPE).answer is None
    assert c.report(4, 0, 0, [50, 7], SHAPE).plan
    work = c.plan_work(4, 0)
    assert c.register_client(1, 2, {"incarnation": "c1-new", "node": "node1"})["next_step"] == 5
    assert sorted(c.drain_resolved()) == [(4, 0), (4, 1)]
    answer = c.answer(4, 0, 0)
    assert answer == c.answer(4, 0, 1) and answer["error"] == "DistCAError"
    assert "client rank 1 registered again" in answer["message"] and "goes on at step 5" in answer["message"]
    assert not c.plan(4, 0, cut=work()).resolved and c.epoch == -1  # the plan computed meanwhile is dropped
    for batch, lens in ((0, [64, 64]), (1, [5, 4])):  # it took no part in step 4 (a protocol slip)
        assert c.report(4, batch, 1, lens, SHAPE).answer["error"] == "resync"
    out = run_step(c, 5)
    assert out.resolved and c.epoch == 0


# ---- step bounds ---------------------------------------------------------------------------------
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
