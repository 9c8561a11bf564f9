"""Rounds without a header exchange (distca_server/runtime/member.py ``_tagged_round``): once a
plan's dispatch and return routes are installed, an in-place round skips the host-driven header
and every device-driven exchange carries the round's tag in its report rows instead
(``RoutedTransport.exchange(..., tag=)``), checked by every receiver.

Over a shared-memory heap on the CPU (HostStream): tagged exchanges deliver the same bytes, a peer
on another round fails every pair it touches with ``ValueError`` naming both tags (at once, not
at the deadline), an untagged exchange after tagged ones is checked against no tag; tagged rounds
of real in-place participants equal the float64 reference, and a participant whose round differs
(its sequence number, softmax scale) fails the round on every participant.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from distca_server.errors import DistCAError
from distca_server.header import RoundHeader
from distca_server.kernels import get_backend
from distca_server.participant import Participant
from distca_server.refs import varlen_attention_ref
from distca_server.runtime.member import GroupMember, run_participant
from distca_server.transport.local_heap import HeapGroup
from distca_server.transport.routed import TaggedRounds
from distca_server.wire import RowFormat
from scheduler import CostModel, plan_batch
from scheduler.cost import RoundKind
from scheduler.parts import plan_identity, plan_parts
from test_transport_routed import heap, installed, payload, recv_splits, routed_group  # noqa: F401
from gpu_subprocess import run_fresh
from test_transport_symmetric import in_threads

COST = CostModel(4, 2, 16, 4)
FMT = RowFormat(COST, torch.float32)
SCALE = 16 ** -0.5


def _exchange(t, splits, step, tag):
    rs = recv_splits(splits, t.rank)
    recv = [t.buffer(f"recv-r-{s}", sum(x)) for s, x in enumerate(rs)]
    t.exchange(payload(t.rank, splits, step), splits[t.rank], recv, rs, route=("test", "r"), tag=tag).wait()
    return [x.clone() for x in recv]


def test_tagged_exchanges_deliver_and_an_untagged_one_after_them_is_checked_against_no_tag(heap):  # noqa: F811
    P = 3
    with routed_group(heap, P, 60) as ts:
        splits = installed(ts, splits=[[[64, 3, 200]], [[0, 17, 5]], [[9, 9, 9]]])
        before = [t.device_exchanges for t in ts]
        for step, tag in enumerate([5, 5, 1 << 62, 0, 0, 7]):
            got = in_threads(P, lambda r: _exchange(ts[r], splits, step, tag))
            for me in range(P):  # receiver me's segment holds every sender's rows in order
                want = torch.cat([payload(src, splits, step)[0][sum(splits[src][0][:me]):][:splits[src][0][me]]
                                  for src in range(P)])
                assert torch.equal(got[me][0], want), (step, me)
        assert [t.device_exchanges - b for t, b in zip(ts, before)] == [6] * P
        route = next(iter(ts[0]._routes.values()))
        assert route.tag == 7  # stamped when the tag changed, in stream order


def test_a_peer_on_another_round_fails_every_pair_it_touches_at_once(heap):  # noqa: F811
    P = 3
    with routed_group(heap, P, 60) as ts:
        splits = installed(ts)

        def step(r):
            t0 = time.monotonic()
            with pytest.raises((ValueError, DistCAError)) as err:
                _exchange(ts[r], splits, 4, 0x55 if r == 1 else 0x66)
            return time.monotonic() - t0, err.type, str(err.value)
        got = in_threads(P, step)
        # Whoever resolves first finds the mismatch (ValueError naming both tags) and aborts the
        # group; a participant that sees that abort first fails with DistCAError naming it.
        found = [r for r, (_, kind, _) in enumerate(got) if kind is ValueError]
        assert found, got
        for r, (elapsed, kind, msg) in enumerate(got):
            assert elapsed < 30, "a round mismatch fails at once, not at the 60 s deadline"
            if kind is DistCAError:
                assert "found a mismatch (sizes, route or round)" in msg, msg
            elif r == 1:
                assert "ran another round (tag 0x66) than participant 1 (tag 0x55)" in msg, msg
            else:
                assert f"participant 1 ran another round (tag 0x55) than participant {r} (tag 0x66)" in msg, msg


def test_abandoning_the_group_ends_device_driven_waits_at_once(heap):  # noqa: F811
    """A tagged round waits in device-driven exchanges, where the header used to wait: when the
    member learns that the group failed (its arbitration opened, the scheduler died), its
    ``abandon`` ends them, and tells the peers waiting on it."""
    P = 3
    with routed_group(heap, P, 60) as ts:
        splits = installed(ts)
        member = GroupMember(None, "127.0.0.1", 60, "rank 1", watch=False)
        member.transport, member.epoch = ts[1], 0

        def step(r):  # participant 2 never enters: 0 and 1 would wait 60 s
            t0 = time.monotonic()
            if r == 2:
                time.sleep(0.5)
                ts[0].abandon("rank 0 gave up on group epoch 0: the scheduler died")
                member.abandon(0, "the group's arbitration opened")
                return None
            with pytest.raises(DistCAError) as err:
                _exchange(ts[r], splits, 4, 0)
            return time.monotonic() - t0, str(err.value)
        got = in_threads(P, step)
        assert got[0][0] < 30 and "the scheduler died" in got[0][1], got[0]
        assert got[1][0] < 30, got[1]
        assert "gave up" in got[1][1] or "arbitration opened" in got[1][1], got[1]
        with pytest.raises(DistCAError, match="aborted"):  # and the next exchange fails at once
            _exchange(ts[0], splits, 5, 0)


@pytest.mark.parametrize("how", ["close", "superseded"])
def test_leaving_during_a_header_wait_is_superseded_not_a_failure(heap, how):  # noqa: F811
    """A server stopped (``close``) or given a newer epoch (``superseded``) while it waits for a
    round header over a routed transport: leaving ends the header exchange at once, and the round
    ends as ``Superseded``, not as a failure reported to the scheduler (there is none here: a
    report would raise). The epoch is marked before the transport is told, so the ended exchange
    always reads as the member leaving."""
    from distca_server.runtime.member import Superseded
    from distca_server.transport.symmetric_words import ANNOUNCE
    with routed_group(heap, 2, 60) as ts:  # participant 1 never enters the round
        member = GroupMember(None, "127.0.0.1", 60, "server 0", watch=False)
        member.transport, member.epoch = ts[0], 3
        marked = []
        for name in ("close", "abandon"):
            def told(*args, _call=getattr(ts[0], name)):
                marked.append(member._abandoned.get(3))
                return _call(*args)
            setattr(ts[0], name, told)
        out = {}

        def serve():
            try:
                member.run_round(None, 1, lambda header: None, header_timeout_s=60)
                out["outcome"] = "returned"
            except Exception as exc:  # noqa: BLE001 - asserted below
                out["outcome"] = exc
        waiter = threading.Thread(target=serve)
        t0 = time.monotonic()
        waiter.start()
        while not ts[1].heap.signals()[ts[0]._slot(ANNOUNCE, 0)] and time.monotonic() < t0 + 30:
            time.sleep(0.01)  # until the header exchange waits for participant 1
        member.close() if how == "close" else member.abandon(3, "superseded")
        waiter.join(30)
        assert not waiter.is_alive()
        assert time.monotonic() - t0 < 30  # not the header's 60 s deadline
        assert isinstance(out["outcome"], Superseded), out["outcome"]
        assert f"group epoch 3 was {how if how == 'superseded' else 'closed'}" in str(out["outcome"])
        assert marked and all(m == (how if how == "superseded" else "closed") for m in marked), marked
        assert member.transport is None  # the group is left


@pytest.mark.parametrize("tag", [0, -3, 1 << 63])
def test_a_round_tag_outside_int63_is_refused(heap, tag):  # noqa: F811
    with routed_group(heap, 2, 5) as ts:
        with pytest.raises(ValueError, match="a round tag is an int in"):
            ts[0].tagged(tag)
        assert isinstance(ts[0].tagged(1), TaggedRounds) and ts[0].tagged(1).rank == 0


def test_round_tags_differ_in_every_field_and_are_never_zero():
    base = RoundHeader(3, 1, 7, RoundKind.FORWARD, torch.float32, 0.25, 1 << 40, -1)
    others = [RoundHeader(4, 1, 7, RoundKind.FORWARD, torch.float32, 0.25, 1 << 40, -1),
              RoundHeader(3, 2, 7, RoundKind.FORWARD, torch.float32, 0.25, 1 << 40, -1),
              RoundHeader(3, 1, 8, RoundKind.FORWARD, torch.float32, 0.25, 1 << 40, -1),
              RoundHeader(3, 1, 7, RoundKind.BACKWARD, torch.float32, 0.25, 1 << 40, -1),
              RoundHeader(3, 1, 7, RoundKind.FORWARD, torch.bfloat16, 0.25, 1 << 40, -1),
              RoundHeader(3, 1, 7, RoundKind.FORWARD, torch.float32, 0.125, 1 << 40, -1),
              RoundHeader(3, 1, 7, RoundKind.FORWARD, torch.float32, 0.25, (1 << 40) + 1, -1),
              RoundHeader(3, 1, 7, RoundKind.FORWARD, torch.float32, 0.25, 1 << 40, 7)]
    tags = {h.tag for h in [base] + others}
    assert len(tags) == 1 + len(others) and 0 not in tags and max(tags) < 1 << 63
    assert base.tag == RoundHeader(3, 1, 7, RoundKind.FORWARD, torch.float32, 0.25, 1 << 40, -1).tag


LENS = [[61, 3, 250], [140, 1, 1, 90], [1, 400]]


def _participants(P, device="cpu"):
    plan = plan_batch(LENS[:P], P, cost=COST, epsilon=0.05, mode="inplace", min_shard=8)
    parts = plan_parts(plan, 3, 0, plan_identity(plan.to_msgpack(), 3, 0))
    backend = get_backend("reference", device)
    return [Participant(p, FMT, backend, device) for p in parts]


def _forward(p, t, seq, layer, scale=SCALE):
    """Layer ``layer``'s forward round on participant ``p``: tagged when its routes are installed
    (as the member decides), else plain. Returns (tagged, max relative error against float64)."""
    g = torch.Generator().manual_seed(100 * layer + p.rank)
    lens = LENS[p.rank]
    q, k, v = (torch.randn(sum(lens), h, 16, generator=g).to(p.device) for h in (4, 2, 2))
    header = RoundHeader(3, 0, seq, RoundKind.FORWARD, torch.float32, scale, p.part.plan_id)
    tagged = p.installed(t, RoundKind.FORWARD)
    out, _ = run_participant(p, t.tagged(header.tag) if tagged else t, header, (q, k, v))
    want = varlen_attention_ref(*(x.cpu().double() for x in (q, k, v)), lens, SCALE)
    return tagged, ((out.cpu().double() - want).abs().max() / want.abs().max()).item()


def test_tagged_rounds_of_in_place_participants_equal_the_reference(heap):  # noqa: F811
    P = 3
    ps = _participants(P)
    with routed_group(heap, P, 60) as ts:
        got = in_threads(P, lambda r: [_forward(ps[r], ts[r], seq, seq) for seq in range(5)])
        for r in range(P):
            tagged = [x for x, _ in got[r]]
            # the first rounds grow the buffers and install the routes; then every round is tagged,
            # on every participant alike
            assert tagged == [x for x, _ in got[0]] and tagged[-2:] == [True, True] and not tagged[0], got[r]
            assert max(e for _, e in got[r]) <= 1e-5, got[r]
        assert len({t.device_exchanges for t in ts}) == 1


@pytest.mark.parametrize("what", ["seq", "scale"])
def test_a_participant_on_another_round_fails_the_tagged_round_everywhere(heap, what):  # noqa: F811
    P = 2
    ps = _participants(P)
    with routed_group(heap, P, 60) as ts:
        in_threads(P, lambda r: [_forward(ps[r], ts[r], seq, seq) for seq in range(3)])
        assert all(p.installed(t, RoundKind.FORWARD) for p, t in zip(ps, ts))

        def odd(r):
            seq, scale = 3, SCALE
            if r == 1:
                seq, scale = (4, SCALE) if what == "seq" else (3, SCALE / 2)
            t0 = time.monotonic()
            with pytest.raises((ValueError, DistCAError)) as err:
                _forward(ps[r], ts[r], seq, 3, scale)
            return time.monotonic() - t0, str(err.value)
        got = in_threads(P, odd)
        assert any("ran another round" in msg for _, msg in got), got
        for elapsed, msg in got:
            assert elapsed < 30 and ("ran another round" in msg or "found a mismatch" in msg), msg


def _gpu_tagged(device="cuda") -> None:
    """Three in-process participants on ``device`` (CUDA: stream memory operations, the tag
    stamped by a fill on each PE's communication stream): tagged rounds are exact, and a
    participant on another round fails that round or the next call on every participant."""
    P = 3
    ps = _participants(P, device)
    group = HeapGroup(P, timeout_s=20)
    ts = [group.endpoint(r, device) for r in range(P)]

    def rounds(r, seqs, scale=SCALE):
        out = []
        with torch.cuda.stream(torch.cuda.Stream()) if device == "cuda" else contextlib.nullcontext():
            for seq in seqs:
                try:
                    out.append(_forward(ps[r], ts[r], seq, seq, scale))
                except (ValueError, DistCAError) as exc:
                    out.append(exc)
        return out
    try:
        got = in_threads(P, lambda r: rounds(r, range(5)))
        for r in range(P):
            assert [x for x, _ in got[r]][-2:] == [True, True] and max(e for _, e in got[r]) <= 1e-5, got[r]
        # participant 2 runs round 6 where the others run round 5; every participant must fail
        # that round or its next call (a GPU resolves an exchange after its marker passed)
        got = in_threads(P, lambda r: rounds(r, [6 if r == 2 else 5, 7, 8]))
        for r in range(P):
            failed = [x for x in got[r] if isinstance(x, Exception)]
            assert failed and ("ran another round" in str(failed[0]) or "found a mismatch" in str(failed[0])), got[r]
    finally:
        group.close()


def test_tagged_rounds_of_in_process_participants_over_the_in_process_heap():
    _gpu_tagged("cpu")  # what the gpu test below runs, on the CPU (HostStream)


@pytest.mark.gpu
def test_tagged_rounds_of_in_place_participants_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    run_fresh("test_round_tags", "_gpu_tagged", 180, "the tagged rounds")
