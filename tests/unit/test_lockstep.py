"""The lock-step in-process exchange (``LockstepGroup`` + ``drive_all``): one thread runs every
participant; it delivers what the threaded ``LocalGroup`` and the reference deliver, and a
participant that fails or stops early fails the round at once, never a hang."""

from __future__ import annotations

import pytest
import torch

from distca_server.errors import DistCAError
from distca_server.participant import drive, drive_all
from distca_server.refs import all_to_all_ref
from distca_server.transport.base import DONE
from distca_server.transport.local import LockstepGroup


def _messages(world: int, segments: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, 30, (segments, world, world), generator=g).tolist()  # [seg][src][dst]
    sizes[0][0][world - 1] = 0  # an empty split
    data = [[[torch.randint(0, 256, (sizes[s][src][dst],), generator=g, dtype=torch.uint8)
              for dst in range(world)] for src in range(world)] for s in range(segments)]
    return sizes, data


@pytest.mark.parametrize("world,segments,exchanges", [(1, 1, 1), (2, 3, 2), (4, 5, 3), (5, 1, 4)])
def test_lockstep_exchanges_equal_the_reference(world, segments, exchanges):
    group = LockstepGroup(world)
    rounds_data = [_messages(world, segments, 100 * world + 10 * segments + e) for e in range(exchanges)]

    def participant(me):
        ep = group.endpoint(me)
        got = []
        for sizes, data in rounds_data:
            send = [torch.cat([data[s][me][d] for d in range(world)]) for s in range(segments)]
            recv = [torch.empty(sum(sizes[s][src][me] for src in range(world)), dtype=torch.uint8)
                    for s in range(segments)]
            send_splits = [sizes[s][me] for s in range(segments)]
            recv_splits = [[sizes[s][src][me] for src in range(world)] for s in range(segments)]
            yield ep.exchange(send, send_splits, recv, recv_splits)
            got.append(recv)
        return got
    results = drive_all([participant(me) for me in range(world)])
    for e, (sizes, data) in enumerate(rounds_data):
        for s in range(segments):
            want = all_to_all_ref(data[s])
            for me in range(world):
                assert torch.equal(results[me][e][s], want[me])


def test_a_participant_that_fails_fails_the_round_with_its_own_error_and_the_group_breaks():
    group = LockstepGroup(3)
    empty = torch.zeros(0, dtype=torch.uint8)
    closed = []

    def good(me):
        try:
            yield group.endpoint(me).exchange([empty], [[0] * 3], [empty], [[0] * 3])
            return me
        finally:
            closed.append(me)

    def bad(me):
        raise ValueError("descriptor for participant 1 is malformed")
        yield
    rounds = [good(0), bad(1), good(2)]
    with pytest.raises(ValueError, match="malformed"):
        drive_all(rounds)
    assert closed == [0]  # participant 0 had started its exchange: its round was closed
    assert all(r.gi_frame is None for r in rounds)  # no round is left suspended


def test_a_participant_that_stops_early_fails_its_peers_wait():
    group = LockstepGroup(2)
    one = torch.arange(4, dtype=torch.uint8)

    def exchanges(me, n):
        for _ in range(n):
            recv = torch.empty(4, dtype=torch.uint8)
            yield group.endpoint(me).exchange([one], [[2, 2]], [recv], [[2, 2]])
        return n
    with pytest.raises(DistCAError, match=r"participants \[1\] did not start exchange 2"):
        drive_all([exchanges(0, 2), exchanges(1, 1)])


def test_a_size_mismatch_is_a_value_error_naming_both_participants():
    group = LockstepGroup(2)

    def participant(me):
        send_splits = [[2, 3]] if me == 0 else [[2, 2]]
        send = [torch.zeros(sum(send_splits[0]), dtype=torch.uint8)]
        recv = [torch.empty(4, dtype=torch.uint8)]
        yield group.endpoint(me).exchange(send, send_splits, recv, [[2, 2]])
    with pytest.raises(ValueError, match="participant 1: segment 0 from participant 0 has 3 bytes, expected 2"):
        drive_all([participant(0), participant(1)])
    assert group.broken


def test_drive_runs_one_round_waiting_on_each_handle():
    def steps():
        a = yield DONE
        b = yield DONE
        return (a, b, "done")
    assert drive(steps()) == (None, None, "done")
