"""The torch_dist transport moves every segment of an exchange in one gloo collective
(distca_server/transport/torch_dist.py), and delivers the same bytes as the in-process transport."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distca_server.errors import DistCAError
from distca_server.transport.local import LocalGroup
from bench.roundtrip_runtimes import CountingGroup  # the one counting wrapper: the benchmark counts with it too
from test_groups import _join_all
from test_transport_symmetric import in_threads


def _case(P: int, nseg: int, seed: int):
    """Random ragged splits (zeros and empty segments included) and random bytes: per rank
    ``(send segments, send splits, recv splits)``."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 40, size=(nseg, P, P))  # sizes[s, src, dst]
    sizes[rng.random(sizes.shape) < 0.3] = 0
    for s in range(nseg):
        np.fill_diagonal(sizes[s], 0)  # a participant's own rows never pass through a transport
    if nseg > 1:
        sizes[rng.integers(nseg)] = 0  # a segment nobody sends (e.g. no split rows)
    out = []
    for r in range(P):
        send = [torch.from_numpy(rng.integers(0, 256, int(sizes[s, r].sum()), dtype=np.uint8))
                for s in range(nseg)]
        out.append((send, [sizes[s, r].tolist() for s in range(nseg)],
                    [sizes[s, :, r].tolist() for s in range(nseg)]))
    return out


def _run(transports, case):
    def one(r):
        send, ss, rs = case[r]
        recv = [torch.full((sum(x),), 7, dtype=torch.uint8) for x in rs]
        transports[r].exchange(send, ss, recv, rs).wait()
        return recv
    return in_threads(len(transports), one)


@pytest.mark.parametrize("P, nseg", [(2, 1), (2, 5), (3, 3), (4, 7)])
def test_one_collective_per_exchange_delivers_what_the_reference_does(P, nseg):
    groups = _join_all("torch_dist", P, "j", 0, {})
    local = LocalGroup(P)
    for g in groups:
        g.transport.pg = CountingGroup(g.transport.pg)
    try:
        for seed in range(3):
            case = _case(P, nseg, seed)
            before = [g.transport.pg.collectives for g in groups]
            got = _run([g.transport for g in groups], case)
            want = _run([local.endpoint(r) for r in range(P)], case)
            assert [g.transport.pg.collectives - b for g, b in zip(groups, before)] == [1] * P
            for r in range(P):
                for s in range(nseg):
                    assert torch.equal(got[r][s], want[r][s]), (r, s)
                    # and the bytes are the senders' own: segment s from src, in sender order
                    expect = torch.cat([case[src][0][s][sum(case[src][1][s][:r]):sum(case[src][1][s][:r + 1])]
                                        for src in range(P)])
                    assert torch.equal(got[r][s], expect), (r, s)
    finally:
        for g in groups:
            g.transport.close()


def test_a_handle_waits_once_and_the_next_exchange_completes_an_unwaited_one():
    groups = _join_all("torch_dist", 2, "j", 1, {})
    try:
        case = _case(2, 3, 11)

        def one(r):
            t = groups[r].transport
            send, ss, rs = case[r]
            first = [torch.empty(sum(x), dtype=torch.uint8) for x in rs]
            t.exchange(send, ss, first, rs)  # not waited: the next exchange finishes it first
            second = [torch.empty(sum(x), dtype=torch.uint8) for x in rs]
            h = t.exchange(send, ss, second, rs)
            h.wait()
            h.wait()  # again: returns at once
            return first, second
        out = in_threads(2, one)
        for r in range(2):
            assert all(torch.equal(a, b) for a, b in zip(*out[r]))
    finally:
        for g in groups:
            g.transport.close()


def test_a_peer_that_never_joins_the_collective_fails_the_wait_within_its_timeout():
    groups = _join_all("torch_dist", 2, "j", 2, {})
    try:
        t = groups[0].transport
        send, ss, rs = _case(2, 2, 5)[0]
        recv = [torch.empty(sum(x), dtype=torch.uint8) for x in rs]
        h = t.exchange(send, ss, recv, rs, timeout_s=0.5)
        with pytest.raises(DistCAError, match="all-to-all failed on participant 0 of group epoch 2"):
            h.wait()
        with pytest.raises(DistCAError):  # the same error again, not a hang
            h.wait()
    finally:
        for g in groups:
            g.transport.close()
