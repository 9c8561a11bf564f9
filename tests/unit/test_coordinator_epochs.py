"""The coordinator's group epochs (:mod:`scheduler.coordinator_epochs`): keeping or forming a
batch's group, relaying each epoch's bootstrap value, refusing what the transport cannot carry, and
arbitrating a failed epoch into one verdict (failure reports with a hand-moved clock).
"""

from __future__ import annotations

import pytest

from scheduler.arbitration import Arbitration, Member
from scheduler.coordinator import KEEP_EPOCHS, MAX_BOOTSTRAP_BYTES
from scheduler.outcomes import lost_text
from test_coordinator import GRACE, LENS, SHAPE, decode, make, run_step  # the shared helpers


# ---- group epochs --------------------------------------------------------------------------------
def test_two_batches_of_one_step_share_the_epoch():
    c = make()
    run_step(c, 0, batch=0)
    out = run_step(c, 0, lens=[[64], [9, 9]], batch=1)
    assert out.assignments == ()
    assert decode(c.answer(0, 1, 1)).batch == 1 and decode(c.answer(0, 0, 1)).batch == 0


def step_error(c, step, batch, ranks=(0, 1)):
    answers = [c.answer(step, batch, r) for r in ranks]
    assert len({a["message"] for a in answers}) == 1 and {a["error"] for a in answers} == {"DistCAError"}
    return answers[0]["message"]


@pytest.mark.parametrize("change", ["lost", "restarted"])
def test_a_server_lost_between_the_batches_of_a_step_fails_the_step(change):
    """Batch 0 of step 0 runs in epoch 0 with servers 0 and 1; server 0 is lost (no longer answers)
    or restarts (a new incarnation) before batch 1. Planning batch 1 in a new epoch would leave
    batch 0's backward rounds in a group the members have left (they ran over the new one and
    failed on their parts' shapes): the step fails for every client at batch 1, naming why, and
    the next step forms the new epoch."""
    c = make()
    run_step(c, 0, batch=0)
    if change == "restarted":
        c.register_server(0, {"incarnation": "s0-again", "node": "srv0"})
    live = [1] if change == "lost" else None
    servers = c.servers_for(0, c.servers_pinged({i: "alive" if live is None or i in live else "suspect"
                                                 for i in c.servers_to_ping()}))
    assert servers == ([1] if change == "lost" else [0, 1])
    for r in range(2):
        c.report(0, 1, r, LENS[r], SHAPE)
    out = c.plan(0, 1, servers)
    assert out.resolved and out.assignments == () and out.server_parts == [] and c.epoch == 0
    why = "no longer answers" if change == "lost" else "restarted"
    assert f"attention server 0 {why}; every client fails step 0" in step_error(c, 0, 1)
    assert c.report(0, 2, 0, LENS[0], SHAPE).answer["error"] == "DistCAError"  # later batches of the step too
    assert c.floor == 1
    out = run_step(c, 1, live=live)  # the next step: a new epoch, planned at once
    assert c.epoch == 1 and [a.server for a in out.assignments] == ([1] if change == "lost" else [0, 1])
    assert decode(c.answer(1, 0, 0)).num_servers == len(out.assignments)


def test_a_server_that_joins_mid_step_serves_from_the_next_step():
    """A server registering between two batches of a step (a new one) does not fail the step:
    the step's later batches keep its group, and the next step's first batch forms the new one."""
    c = make(servers=1)
    run_step(c, 0, batch=0)
    c.register_server(1, {"incarnation": "s1", "node": "srv1"})
    live = c.servers_pinged({i: "alive" for i in c.servers_to_ping()})
    assert live == [0, 1] and c.servers_for(0, live) == [0]
    for r in range(2):
        c.report(0, 1, r, LENS[r], SHAPE)
    out = c.plan(0, 1, c.servers_for(0, live))
    assert out.assignments == () and [sid for sid, _ in out.server_parts] == [0]
    assert c.answer(0, 1, 0)["group"]["epoch"] == 0 and decode(c.answer(0, 1, 0)).num_servers == 1
    assert c.servers_for(1, live) == [0, 1]  # a step not yet planned takes every live server
    out = run_step(c, 1)
    assert c.epoch == 1 and [a.server for a in out.assignments] == [0, 1]
    # step 1's later batches over fewer servers, or on another device, are refused, not run
    assert c.step_group_change(1, [0, 1], "cpu") is None
    assert c.step_group_change(1, [0], "cpu") == "attention server 1 no longer answers"
    assert c.step_group_change(1, [0, 1], "cuda") == "the batch is on cuda, the step's earlier batches on cpu"


def test_a_client_registered_again_mid_step_fails_the_step_in_place():
    c = make("inplace", servers=0)
    run_step(c, 0, batch=0)
    c.register_client(1, 2, {"incarnation": "c1-again", "node": "node1", "step": 0})
    for r in range(2):
        c.report(0, 1, r, LENS[r], SHAPE)
    c.plan(0, 1)
    assert "client rank 1 registered again" in step_error(c, 0, 1)
    assert c.step_group_change(0, (), "cuda") is not None  # in-place: the device type is checked too
    run_step(c, 1)
    assert c.epoch == 1


# ---- failure arbitration ------------------------------------------------------------------------
def verdict(lost=(), next_step=1, cause="", detected=False, epoch=0, ranks=(), slowest=""):
    return {"epoch": epoch, "lost": list(lost), "lost_ranks": list(ranks), "slowest": slowest,
            "next_step": next_step, "cause": cause, "detected": detected}


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


def test_nobody_lost_names_the_client_slowest_to_join_the_round():
    """Every member was in round 5 when it timed out, so nobody is lost; client 1 joined it 9 s
    after client 0 (each says how long it had waited; the scheduler's clock places the joins):
    the verdict names it. Servers, waiting since their last round ended, do not count."""
    c = make()
    run_step(c, 0)
    c.failure(0, 0, step=0, now=100.0, reached=5, cause="all-to-all timed out after 10 s", waited_s=10.0)
    c.failure(0, 2, step=-1, now=100.1, reached=5, waited_s=30.0)
    c.failure(0, 3, step=-1, now=100.1, reached=5, waited_s=30.0)
    out = c.failure(0, 1, step=0, now=100.2, reached=5, cause="all-to-all timed out", waited_s=1.2)
    assert out.verdict == verdict(cause="all-to-all timed out after 10 s", slowest=(
        "client rank 1 (node node1): joined round 5 of the epoch 9.00 s after the first client"))
    assert lost_text(out.verdict) == ("none (slowest to join: client rank 1 (node node1): joined round 5 "
                                      "of the epoch 9.00 s after the first client)")


@pytest.mark.parametrize("waits", [(10.0, 7.0), (10.0, None), (None, None)])
def test_no_slowest_client_without_a_late_join(waits):
    """Joins 3 s apart in a 10 s wait are not late (under half the first one's wait), and a
    member that does not say how long it waited (or is in no round) places no join."""
    c = make()
    run_step(c, 0)
    c.failure(0, 0, step=0, now=50.0, reached=2, cause="timed out", waited_s=waits[0])
    c.failure(0, 1, step=0, now=50.0, reached=2, waited_s=waits[1])
    c.failure(0, 2, step=-1, now=50.0, reached=2)
    out = c.failure(0, 3, step=-1, now=50.0, reached=2)
    assert out.verdict["slowest"] == "" and lost_text(out.verdict) == "none"


def test_no_slowest_client_when_a_member_found_the_cause():
    """Client 0 found the cause itself (its parts disagree) after a short wait: client 1 joining
    late in that wait is ordinary skew, not the reason the round failed."""
    c = make()
    run_step(c, 0)
    c.failure(0, 0, step=0, now=5.0, reached=2, cause="parts disagree", detected=True, waited_s=0.12)
    c.failure(0, 1, step=0, now=5.0, reached=2, waited_s=0.03)
    c.failure(0, 2, step=-1, now=5.0, reached=2)
    out = c.failure(0, 3, step=-1, now=5.0, reached=2)
    assert out.verdict == verdict(cause="parts disagree", detected=True)


def test_no_slowest_client_when_one_gave_no_join_in_the_round():
    """Client 1 failed between rounds (its own code raised, out of any round) and gave no join
    time; clients 0 and 2 waited in the round: client 0, the last one placed, is not named as if it
    had joined last (client 1 may have been later still)."""
    members = {r: Member(f"client rank {r}", True, None) for r in range(3)}
    fail = Arbitration(0, members, deadline=10.0, grace_s=2.0)
    fail.check_in(2, 0, 3, True, "timed out", False, now=5.0, waited_s=5.0)
    fail.check_in(0, 0, 3, True, None, False, now=5.0, waited_s=0.1)
    assert fail.slowest().startswith("client rank 0:")  # the two placed: client 0 joined 4.9 s later
    fail.check_in(1, 0, 3, False, "boom", False, now=5.0)
    assert fail.lost() == [] and fail.slowest() == ""


def test_a_lost_member_is_named_instead_of_the_slowest():
    c = make()
    run_step(c, 0)
    c.failure(0, 0, step=0, now=0.0, reached=3, cause="timed out", waited_s=10.0)
    c.failure(0, 1, step=0, now=0.0, reached=3, waited_s=0.5)
    c.failure(0, 2, step=-1, now=0.0, reached=3)
    decided = c.close_failure(0, now=GRACE)
    assert decided["lost_ranks"] == [3] and decided["slowest"] == ""
    assert lost_text(decided) == "attention server 1 (node srv1): did not answer within 2 s"


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "3"])
def test_a_bad_wait_is_refused(bad):
    c = make()
    run_step(c, 0)
    with pytest.raises(ValueError, match="waited_s must be a finite number of seconds >= 0"):
        c.failure(0, 0, step=0, now=0.0, reached=1, waited_s=bad)
    assert c.arbitration(0) is None  # refused before it opened anything


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


# ---- bootstrap values and transports -------------------------------------------------------------
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
