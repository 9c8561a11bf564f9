"""The in-process transport: segment exchanges against the reference, buffers, splits, timeouts
and failure propagation."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from distca_server.runtime.local import LocalRuntime
from distca_server.errors import DistCAError
from distca_server.refs import all_to_all_ref
from distca_server.transport.base import ALIGN, all_to_all
from distca_server.transport.local import LocalGroup
from scheduler.config import PlanConfig


def _in_threads(world, fn):
    results, errors = [None] * world, [None] * world

    def body(i):
        try:
            results[i] = fn(i)
        except BaseException as exc:  # collected for the assertions
            errors[i] = exc
    threads = [threading.Thread(target=body, args=(i,)) for i in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a participant hung"
    return results, errors


@pytest.mark.parametrize("world", [1, 2, 5])
def test_all_to_all_delivers_every_message(world):
    g = torch.Generator().manual_seed(world)
    sizes = torch.randint(0, 40, (world, world), generator=g).tolist()  # sizes[src][dst]
    group = LocalGroup(world, timeout_s=10)

    def payload(src, dst):
        return torch.full((sizes[src][dst],), (src * 16 + dst) % 256, dtype=torch.uint8)

    def participant(i):
        ep = group.endpoint(i)
        got = []
        for _ in range(3):  # several exchanges reuse the group
            send = torch.cat([payload(i, d) for d in range(world)])
            recv = all_to_all(ep, send, sizes[i], [sizes[s][i] for s in range(world)])
            got.append(recv)
        return got, ep.bytes_sent
    results, errors = _in_threads(world, participant)
    assert errors == [None] * world
    for i, (got, sent) in enumerate(results):
        want = torch.cat([payload(s, i) for s in range(world)])
        assert all(torch.equal(x, want) for x in got)
        assert sent == 3 * (sum(sizes[i]) - sizes[i][i])


def test_missing_participant_raises_distca_error_within_timeout():
    group = LocalGroup(3, timeout_s=0.5)

    def participant(i):
        if i == 2:
            return None  # never joins
        return all_to_all(group.endpoint(i), torch.zeros(0, dtype=torch.uint8), [0] * 3, [0] * 3)
    start = time.monotonic()
    _, errors = _in_threads(3, participant)
    elapsed = time.monotonic() - start
    assert elapsed < 15  # about the 0.5 s timeout (slack: a loaded CI machine)
    for i in (0, 1):
        assert isinstance(errors[i], DistCAError)
        assert "[2]" in str(errors[i]) and "0.5 s" in str(errors[i])


def test_failed_participant_aborts_peers_at_once():
    group = LocalGroup(3, timeout_s=30)

    def participant(i):
        if i == 1:
            group.abort(1, "kernel exploded")
            raise RuntimeError("kernel exploded")
        return all_to_all(group.endpoint(i), torch.zeros(0, dtype=torch.uint8), [0] * 3, [0] * 3)
    start = time.monotonic()
    _, errors = _in_threads(3, participant)
    assert time.monotonic() - start < 15  # at once, not at the 30 s timeout (slack: a loaded CI machine)
    for i in (0, 2):
        assert isinstance(errors[i], DistCAError) and "participant 1 failed: kernel exploded" in str(errors[i])


def test_size_mismatch_is_value_error_and_peers_do_not_hang():
    group = LocalGroup(2, timeout_s=10)

    def participant(i):
        send = torch.zeros(4, dtype=torch.uint8)
        expect = [2, 2] if i == 0 else [2, 1]  # participant 1 expects the wrong size
        return all_to_all(group.endpoint(i), send, [2, 2], expect)
    _, errors = _in_threads(2, participant)
    assert isinstance(errors[1], ValueError) and "has 2 bytes, expected 1" in str(errors[1])
    assert isinstance(errors[0], DistCAError)


def test_bad_arguments_and_close_fail_the_peers_at_once():
    """A participant's own bad splits (ValueError) and a closed endpoint abort the group: the
    peers fail at once, naming it, not at the barrier's 30 s timeout (found by a review)."""
    for how in ("bad splits", "close"):
        group = LocalGroup(3, timeout_s=30)

        def participant(i):
            send = torch.zeros(3, dtype=torch.uint8)
            if i == 1 and how == "close":
                group.endpoint(1).close()
                return None
            return all_to_all(group.endpoint(i), send, [1, 1, 2] if i == 1 else [1, 1, 1], [1, 1, 1])
        start = time.monotonic()
        _, errors = _in_threads(3, participant)
        assert time.monotonic() - start < 15, how  # at once, well before the 30 s timeout
        if how == "bad splits":
            assert isinstance(errors[1], ValueError) and "sum to 4" in str(errors[1])
        for i in (0, 2):
            assert isinstance(errors[i], DistCAError) and "participant 1 failed" in str(errors[i]), (how, errors[i])


@pytest.mark.parametrize("send,send_splits,recv_splits,fragment", [
    (torch.zeros(3), [3, 0], [0, 0], "uint8"),
    (torch.zeros(3, dtype=torch.uint8), [3], [0, 0], "send_splits"),
    (torch.zeros(3, dtype=torch.uint8), [2, 0], [0, 0], "sum to 2"),
    (torch.zeros(3, dtype=torch.uint8), [3, 0], [0, -1], "recv_splits"),
])
def test_bad_splits_raise_value_error(send, send_splits, recv_splits, fragment):
    ep = LocalGroup(2).endpoint(0)
    with pytest.raises(ValueError, match=fragment):
        all_to_all(ep, send, send_splits, recv_splits)


def test_runtime_reraises_root_cause_and_recovers():
    # 60 s: the root cause must arrive well before the group's timeout (the bound below is 15 s)
    runtime = LocalRuntime(num_servers=3, num_ranks=3, plan=PlanConfig(), backend="auto", timeout_s=60)
    empty = torch.zeros(0, dtype=torch.uint8)

    def good(t):  # a round generator (Participant.forward_steps and the like)
        yield t.exchange([empty], [[0] * 3], [empty], [[0] * 3])
        return t.rank

    def bad(t):
        raise ValueError("descriptor for participant 1 is malformed")
        yield  # a generator that fails before its first exchange
    start = time.monotonic()
    with pytest.raises(ValueError, match="malformed"):
        runtime.run([good, bad, good])
    assert time.monotonic() - start < 15  # at once, not at the timeout (slack: a loaded CI machine)
    assert runtime.run([good, good, good]) == [0, 1, 2]  # a fresh group after the broken one
    runtime.close()
    with pytest.raises(DistCAError, match="closed"):
        runtime.run([good, good, good])


@pytest.mark.parametrize("world,segments", [(1, 1), (3, 2), (4, 6)])
def test_segment_exchange_matches_reference(world, segments):
    g = torch.Generator().manual_seed(10 * world + segments)
    sizes = torch.randint(0, 30, (segments, world, world), generator=g).tolist()  # [seg][src][dst]
    data = [[[torch.randint(0, 256, (sizes[s][src][dst],), generator=g, dtype=torch.uint8)
              for dst in range(world)] for src in range(world)] for s in range(segments)]
    group = LocalGroup(world, timeout_s=10)

    def participant(i):
        ep = group.endpoint(i)
        send = [torch.cat(data[s][i]) for s in range(segments)]
        send_splits = [sizes[s][i] for s in range(segments)]
        recv_splits = [[sizes[s][src][i] for src in range(world)] for s in range(segments)]
        recv = [ep.buffer(f"r{s}", sum(x)) for s, x in enumerate(recv_splits)]
        ep.exchange(send, send_splits, recv, recv_splits)
        return [r.clone() for r in recv]
    results, errors = _in_threads(world, participant)
    assert errors == [None] * world
    for s in range(segments):
        want = all_to_all_ref(data[s])
        for i in range(world):
            assert torch.equal(results[i][s], want[i])


def test_buffers_are_reused_and_grown_not_reallocated_per_round():
    ep = LocalGroup(1).endpoint(0)
    a = ep.buffer("recv", 1000)
    b = ep.buffer("recv", 10)
    assert b.data_ptr() == a.data_ptr() and b.numel() == 10
    c = ep.buffer("recv", 5000)  # grows
    assert c.numel() == 5000 and ep.buffer("recv", 4000).data_ptr() == c.data_ptr()
    assert ep.buffer("send", 1).data_ptr() != c.data_ptr()  # one buffer per key
    assert ep._buffers.reserved_bytes() % ALIGN == 0
