"""The secret each registered client gets (issue 23, defect 9): calls that change a job or read
its documents (``fail_step``, ``plan_descriptor``) need it; ``status`` never shows it."""

from __future__ import annotations

import re

import pytest

from scheduler import CostModel
from scheduler.config import JobConfig, PlanConfig
from scheduler.coordinator import Coordinator

SHAPE = {"cost": CostModel(4, 2, 8, 2).to_wire(), "device_type": "cpu"}


def job():
    coord = Coordinator("tok", config=JobConfig(plan=PlanConfig(mode="inplace", min_shard=8)))
    tokens = []
    for r in range(2):
        coord.register_client(r, 2, {"incarnation": f"i{r}", "node": "n"})
        tokens.append(coord.issue_token(r))
    return coord, tokens


def refused(call, rank):
    return pytest.raises(ValueError, match=rf"job 'tok' refused {call} from rank {re.escape(repr(rank))}: the "
                                           rf"caller is not that registered client")


def test_each_registration_gets_its_own_secret_and_only_it_passes():
    coord, (t0, t1) = job()
    assert re.fullmatch(r"[0-9a-f]{32}", t0) and t0 != t1
    coord.check_member(0, t0, "fail_step")
    coord.check_member(1, t1, "plan_descriptor")
    for rank, token in ((0, None), (0, t1), (1, t0), (0, ""), (0, t0.upper()), (0, b"x"), (0, "\udc80"),
                        (2, t0), (None, t0), ("0", t0), ([0], t0)):
        with refused("fail_step", rank):
            coord.check_member(rank, token, "fail_step")


def test_a_new_registration_replaces_the_secret_and_leaving_drops_it():
    """A client that re-registers (after a scheduler restart, or a restart of its own) gets a new
    secret; the old one is refused, so a replaced process can no longer fail the job's steps."""
    coord, (t0, _) = job()
    coord.register_client(0, 2, {"incarnation": "i0-again", "token": t0})  # a client cannot pick its own
    new = coord.issue_token(0)
    assert new != t0
    coord.check_member(0, new, "fail_step")
    with refused("fail_step", 0):
        coord.check_member(0, t0, "fail_step")
    coord.unregister_client(0, "i0-again")
    with refused("plan_descriptor", 0):
        coord.check_member(0, new, "plan_descriptor")
    with pytest.raises(ValueError, match=r"rank 0 is not registered with job 'tok'"):
        coord.issue_token(0)


def test_status_never_shows_a_secret():
    coord, tokens = job()
    for r in range(2):
        coord.report(0, 0, r, [5, 3], SHAPE)
    coord.plan(0, 0)
    shown = repr(coord.status())
    assert coord.status()["clients"] == [0, 1] and coord.status()["steps_planned"] == 1
    assert not any(t in shown for t in tokens)
