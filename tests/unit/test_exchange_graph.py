"""Captured exchanges (transport/exchange_graph.py) over the CPU shared-memory heap, whose stream is
a thread that records and replays its operations: what CI can test of issue 22 item 4.

- every replay delivers exactly the bytes an uncaptured exchange would, with new send data each
  time, at 2-4 PEs, a route twice in one graph, zero-byte peers and own splits;
- replays queued back to back without waiting, with one peer late, stay exact (the two word sets
  and their resets);
- replays mix with uncaptured device- and host-driven exchanges;
- a silent peer during a replay fails the others with ``DistCAError`` naming it, bounded, and the
  next replay fails at once; the next group epoch over the same heap captures and replays exactly;
- refused: an uninstalled route, too many exchanges, fn making different exchanges, a replay after
  the buffers grew or after its block went to a later graph.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import pytest
import torch

from distca_server.errors import DistCAError
from distca_server.transport.exchange_graph import ExchangeGraph, graph_slot, set_words
from distca_server.transport.local_heap import HeapGroup
from distca_server.transport.routed import GRACE_S, RoutedTransport
from distca_server.transport.shm import ShmHeap
from distca_server.transport.symmetric import ReusableHeap
from distca_server.transport.symmetric_words import GRAPH_BLOCKS, GRAPH_EXCHANGES, signal_words
from test_transport_routed import heap  # noqa: F401 - the fixture
from test_transport_routed import (SLACK_S, installed, payload, play, recv_splits, route_data, routed_group,
                                   run_dying_group)
from gpu_subprocess import run_fresh
from test_transport_symmetric import in_threads, reporting

# The transports' deadline where a test means a replay to fail: generous, since the setup (routes
# installed, the graph captured, earlier replays) must succeed on a loaded machine; the short
# deadline goes to the replay meant to fail only (ExchangeGraph.replay(timeout_s)).
SETUP_TIMEOUT_S = 60


def expected(splits, me: int, step: int) -> list[torch.Tensor]:
    """What ``me`` receives when every PE sends ``payload(src, splits, step)``."""
    P = len(splits)
    return [torch.cat([payload(src, splits, step)[s][sum(splits[src][s][:me]):sum(splits[src][s][:me + 1])]
                       for src in range(P)]) for s in range(len(splits[0]))]


class Static:
    """One PE's static buffers for a list of (name, splits) exchanges: send buffers refilled before
    each replay, the installed routes' receive buffers."""

    def __init__(self, t, exchanges):
        me = t.rank
        self.t, self.exchanges = t, exchanges
        self.send = [[torch.zeros(sum(row), dtype=torch.uint8, device=t.device) for row in sp[me]]
                     for _, sp in exchanges]
        self.recv = [[t.buffer(f"recv-{name}-{s}", sum(x)) for s, x in enumerate(recv_splits(sp, me))]
                     for name, sp in exchanges]

    def fill(self, step: int) -> None:
        for j, (_, sp) in enumerate(self.exchanges):
            for dst, src in zip(self.send[j], payload(self.t.rank, sp, step + 100 * j)):
                dst.copy_(src)

    def run(self) -> list:
        """The exchanges, in order (what the graph records); their handles."""
        me = self.t.rank
        return [self.t.exchange(self.send[j], sp[me], self.recv[j], recv_splits(sp, me), route=("test", name))
                for j, (name, sp) in enumerate(self.exchanges)]

    def check(self, step: int) -> None:
        # only the last exchange of a route twice in the graph is left in its buffers
        last = {name: j for j, (name, _) in enumerate(self.exchanges)}
        for name, j in last.items():
            want = expected(self.exchanges[j][1], self.t.rank, step + 100 * j)
            for s, (a, b) in enumerate(zip(self.recv[j], want)):
                assert torch.equal(a.cpu(), b), f"participant {self.t.rank} replay {step} exchange {j} segment {s}"


def capture(ts, exchanges, also=()):
    """Install the routes of ``exchanges`` and ``also``, then capture ``exchanges`` on every PE:
    per PE, (Static, ExchangeGraph)."""
    P, routes = len(ts), list({name: sp for name, sp in list(exchanges) + list(also)}.items())
    in_threads(P, lambda r: play(ts[r], routes * 2))  # the arrays grow, then every route installs
    assert all(("test", name) in t.routes for t in ts for name, _ in routes)
    statics = [Static(t, exchanges) for t in ts]
    graphs = in_threads(P, lambda r: ts[r].graph(lambda: [h.wait() for h in statics[r].run()]))
    return statics, graphs


@pytest.mark.parametrize("P", [2, 3, 4])
def test_replays_deliver_what_the_exchanges_would(heap, P):
    a, b, c = (route_data(P * 10 + i, P) for i in range(3))
    exchanges = [("a", a), ("b", b), ("a", a), ("c", c)]  # a twice: its words differ per exchange
    with routed_group(heap, P, 60) as ts:
        statics, graphs = capture(ts, exchanges)
        assert all(isinstance(g, ExchangeGraph) and g.exchanges == 4 for g in graphs)
        before = [t.device_exchanges for t in ts]
        replay_steps(ts, statics, graphs, 6)
        assert [t.device_exchanges - n for t, n in zip(ts, before)] == [24] * P
        # an uncaptured exchange of the same routes afterwards is still exact
        in_threads(P, lambda r: (statics[r].fill(50), [h.wait() for h in statics[r].run()], statics[r].check(50)))


def test_replays_back_to_back_with_a_late_peer_stay_exact(heap):
    P = 3
    exchanges = [("a", route_data(7, P)), ("b", route_data(8, P))]
    with routed_group(heap, P, 60) as ts:
        statics, graphs = capture(ts, exchanges)

        def run(r):
            statics[r].fill(3)
            if r == 2:
                time.sleep(0.3)  # the others queue all their replays first
            handles = [graphs[r].replay() for _ in range(5)]  # the third waits for the first
            for h in handles:
                h.wait()
            statics[r].check(3)
        in_threads(P, run)


def test_replays_mix_with_uncaptured_exchanges(heap):
    P = 2
    other, unrouted = route_data(2, P), route_data(30, P)
    with routed_group(heap, P, 60) as ts:
        in_threads(P, lambda r: unrouted_exchange(ts[r], unrouted, 0))  # its staging array grows now
        statics, graphs = capture(ts, [("a", route_data(1, P))], also=[("o", other)])
        o = [Static(t, [("o", other)]) for t in ts]

        def run(r):
            for step in range(4):
                statics[r].fill(step)
                o[r].fill(step)
                h = graphs[r].replay()
                for x in o[r].run():  # device-driven, queued behind the replay
                    x.wait()
                h.wait()
                statics[r].check(step)
                o[r].check(step)
                unrouted_exchange(ts[r], unrouted, step)  # host-driven: the stream drains first
        in_threads(P, run)
        assert all(g.replays == 4 for g in graphs)


def unrouted_exchange(t, splits, step: int) -> None:
    rs = recv_splits(splits, t.rank)
    recv = [torch.empty(sum(x), dtype=torch.uint8) for x in rs]
    t.exchange(payload(t.rank, splits, step), splits[t.rank], recv, rs).wait()
    assert all(torch.equal(x, y) for x, y in zip(recv, expected(splits, t.rank, step)))


def test_a_silent_peer_fails_a_replay_naming_it_and_the_next_replay_at_once(heap):
    P, timeout = 3, 1.0
    with routed_group(heap, P, SETUP_TIMEOUT_S) as ts:
        statics, graphs = capture(ts, [("a", [[[64] * P] for _ in range(P)])])

        def live(r):
            t0 = time.monotonic()
            handle = graphs[r].replay(timeout_s=timeout)
            with pytest.raises(DistCAError) as err:
                handle.wait()
            elapsed = time.monotonic() - t0
            with pytest.raises(DistCAError, match="aborted"):
                graphs[r].replay()
            return elapsed, str(err.value)
        for r, (elapsed, msg) in enumerate(in_threads(2, live)):  # participant 2 never replays
            assert timeout <= elapsed < timeout + GRACE_S + SLACK_S, (r, elapsed)
            assert "did not hear from participants [2]" in msg and "captured exchange 0" in msg, msg


def test_replays_queued_back_to_back_all_end_when_a_peer_is_silent(heap):
    """Both sets in flight when the deadline passes: every queued exchange drains and fails (the
    second replay's reset of the first set's words comes after the first replay ended), and none
    is left unresolved."""
    P, timeout = 3, 1.0
    with routed_group(heap, P, SETUP_TIMEOUT_S) as ts:
        statics, graphs = capture(ts, [("a", [[[64] * P] for _ in range(P)]), ("b", route_data(3, P))])

        def live(r):
            t0 = time.monotonic()
            # both sets queued, nothing waited
            handles = [graphs[r].replay(timeout_s=timeout), graphs[r].replay(timeout_s=timeout)]
            for h in handles:
                with pytest.raises(DistCAError):
                    h.wait()
            return time.monotonic() - t0
        for r, elapsed in enumerate(in_threads(2, live)):  # participant 2 never replays
            assert timeout <= elapsed < timeout + 2 * GRACE_S + SLACK_S, (r, elapsed)
        assert all(not t._unresolved() for t in ts[:2])


def test_the_next_group_epoch_captures_and_replays_exactly_after_a_failed_replay(heap):
    P = 2
    h = heap(P)
    heaps = [ReusableHeap(ShmHeap(h, r)) for r in range(P)]
    ex = [("a", route_data(4, P))]
    old = [RoutedTransport(heaps[r].lease(1), timeout_s=SETUP_TIMEOUT_S, epoch=1) for r in range(P)]
    _, graphs = capture(old, ex)
    in_threads(P, lambda r: graphs[r].replay().wait())  # both sets' words now hold epoch 1's values
    in_threads(P, lambda r: graphs[r].replay().wait())
    with pytest.raises(DistCAError):  # participant 1 stays away: participant 0's words are forced
        graphs[0].replay(timeout_s=0.5).wait()
    for t in old:
        t.close()
    new = [RoutedTransport(heaps[r].lease(2), timeout_s=60, epoch=2) for r in range(P)]
    try:
        statics, graphs = capture(new, ex)
        replay_steps(new, statics, graphs, 4)
    finally:
        for t in new:
            t.close()
        for x in heaps:
            x.close()


@pytest.mark.parametrize("how", ["exchange", "replay"])
def test_work_queued_while_another_thread_closes_the_transport_is_refused_at_once(heap, how):
    """A PE's thread that queues a device-driven exchange or a replay while another thread closes
    its transport (the local runtime closes a failed round's group from the caller's thread while
    a participant's round still runs) is refused with ``DistCAError`` at once. Before, work queued
    after close() had stopped the stream, but before it marked the transport closed, never ran:
    its wait lasted the deadline plus twice GRACE_S (a 62 s failure of test_graphed_rounds; the
    setup's deadline is the generous one, a regression costs it)."""
    P = 2
    with routed_group(heap, P, SETUP_TIMEOUT_S) as ts:
        statics, graphs = capture(ts, [("a", route_data(5, P))])
        t, got = ts[1], {}
        work = (lambda: statics[1].run()[0]) if how == "exchange" else graphs[1].replay
        stop = t._stream.close

        def queue():
            try:
                work().wait()
                got["error"] = None
            except DistCAError as exc:
                got["error"] = str(exc)

        def stop_then_queue():  # the window: the stream has stopped, the transport is not closed yet
            stop()
            th = threading.Thread(target=queue)
            th.start()
            th.join(30)
            got["alive"] = th.is_alive()
        t._stream.close = stop_then_queue
        before = t.device_exchanges
        t.close()
        assert got["alive"] is False and "the group is closed" in got["error"], got
        assert t.device_exchanges == before  # nothing was queued


@pytest.mark.parametrize("earlier", [False, True], ids=["alone", "behind-another"])
def test_a_replay_being_queued_when_close_starts_is_ended_by_close(heap, earlier):
    """close() on another thread while a replay that passed its check is queueing (alone, or with
    an earlier replay in flight): close() waits for it to be recorded and ends it, naming the
    close; it neither runs behind the stopped stream nor waits out its deadline."""
    P = 2
    with routed_group(heap, P, SETUP_TIMEOUT_S) as ts:
        statics, graphs = capture(ts, [("a", route_data(5, P))])
        t, g = ts[1], graphs[1]
        h0 = g.replay() if earlier else None  # participant 0 never replays: it waits
        queue, closer = t._stream.replay, []

        def queue_then_close(recording):
            queue(recording)
            closer.append(threading.Thread(target=t.close))
            closer[0].start()
            while not t._leaving and closer[0].is_alive():
                time.sleep(0.001)
            time.sleep(0.05)  # close() runs on: it reaches the wait for this replay
        t._stream.replay = queue_then_close
        h1 = g.replay(timeout_s=10)
        for h in (h0, h1) if earlier else (h1,):
            with pytest.raises(DistCAError, match="participant 1 closed the transport"):
                h.wait()
        closer[0].join(30)
        assert not closer[0].is_alive()


@pytest.mark.parametrize("failure", ["expiry", "abandon"])
def test_a_failure_while_a_replay_is_queued_ends_that_replay_too(heap, failure):
    """The watchdog's expiry of an earlier replay, or the member's ``abandon``, on another thread
    after a replay has queued its work but before it is in flight: that replay ends at once with
    the failure's reason (its own waits are forced when it is recorded), not at its deadline."""
    P = 2
    with routed_group(heap, P, SETUP_TIMEOUT_S) as ts:
        statics, graphs = capture(ts, [("a", route_data(5, P))])
        t, g = ts[1], graphs[1]
        h0 = g.replay()  # participant 0 never replays: this one waits
        e0, queue = g._last[0][0], t._stream.replay
        why = "test: the group failed elsewhere"
        fail = (lambda: t._expire(e0, why)) if failure == "expiry" else (lambda: t.abandon(why))

        def queue_then_fail(recording):
            queue(recording)
            th = threading.Thread(target=fail)  # as the watchdog's (or the member's) thread would
            th.start()
            th.join(30)
        t._stream.replay = queue_then_fail
        h1 = g.replay(timeout_s=10)
        t._stream.replay = queue
        for h in (h0, h1):
            with pytest.raises(DistCAError, match=why):
                h.wait()


# ---- a peer process that dies between replays ------------------------------------------------------
def _worker(rank: int, P: int, handle: dict, timeout: float, results) -> None:
    with reporting(rank, results):  # a failure anywhere (setup included) reaches the parent
        # The setup runs under a generous deadline (the processes may start seconds apart on a
        # loaded machine); ``timeout`` is the deadline of the replay meant to fail only.
        t = RoutedTransport(ShmHeap(handle, rank), timeout_s=SETUP_TIMEOUT_S)
        splits = [[[4096] * P] for _ in range(P)]
        rs = recv_splits(splits, rank)
        send = payload(rank, splits, 0)
        for _ in range(2):  # grow, install
            recv = [t.buffer("recv", sum(rs[0]))]
            t.exchange(send, splits[rank], recv, rs, route="r").wait()
        graph = t.graph(lambda: t.exchange(send, splits[rank], recv, rs, route="r"))
        for _ in range(3):  # both sets, then the first again
            graph.replay().wait()
        if rank == P - 1:
            os._exit(0)  # dies with the graph captured, before the next replay
        t0 = time.monotonic()
        try:
            graph.replay(timeout_s=timeout).wait()
            results.put((rank, "ok", time.monotonic() - t0))
        except DistCAError as exc:
            results.put((rank, str(exc), time.monotonic() - t0))


def test_peer_process_that_dies_fails_the_others_replays_within_the_deadline():
    P, timeout = 3, 1.0
    got = run_dying_group(_worker, __name__, P, timeout)
    assert set(got) == {0, 1}
    for r, (msg, elapsed) in got.items():
        assert "captured exchange 0" in msg and (f"participants [{P - 1}]" in msg or "gave up" in msg), msg
        assert timeout <= elapsed < timeout + GRACE_S + SLACK_S, (r, elapsed)


def test_what_cannot_be_captured_is_refused(heap):
    P = 2
    a = [[[64] * P] for _ in range(P)]
    with routed_group(heap, P, 60) as ts:
        s0 = [Static(t, [("new", a)]) for t in ts]
        with pytest.raises(ValueError, match=r"route \('test', 'new'\) is not installed"):
            ts[0].graph(lambda: s0[0].run())
        installed(ts, "a", a)
        many = [Static(t, [("a", a)] * (GRAPH_EXCHANGES + 1)) for t in ts]
        with pytest.raises(ValueError, match=f"at most {GRAPH_EXCHANGES} exchanges"):
            ts[0].graph(lambda: many[0].run())
        calls = []

        def changing():  # one exchange, then two
            calls.append(1)
            for _ in calls:
                many[0].t.exchange(many[0].send[0], a[0], many[0].recv[0], recv_splits(a, 0), route=("test", "a"))
        with pytest.raises(ValueError, match="different exchanges"):
            ts[0].graph(changing)
        assert ts[0]._capture is None
        assert ts[0]._graphs == [None] * GRAPH_BLOCKS  # a capture that failed took no block


def test_a_replay_after_growth_or_after_its_block_was_taken_is_refused(heap):
    P = 2
    a = [[[64] * P] for _ in range(P)]
    with routed_group(heap, P, 60) as ts:
        statics, graphs = capture(ts, [("a", a)])
        later = [in_threads(P, lambda r: ts[r].graph(lambda: statics[r].run())) for _ in range(GRAPH_BLOCKS)]
        assert later[-1][0]._block == graphs[0]._block  # every block taken since: the first went back
        with pytest.raises(ValueError, match="released"):
            graphs[0].replay()
        in_threads(P, lambda r: later[-1][r].replay().wait())
        big = [[[1 << 16] * P] for _ in range(P)]  # grows another array: every route moves
        in_threads(P, lambda r: ts[r].exchange(payload(r, big, 0), big[r],
                                               [ts[r].buffer("big", sum(recv_splits(big, r)[0]))],
                                               recv_splits(big, r)).wait())
        with pytest.raises(ValueError, match="grew"):
            later[-1][0].replay()


def test_graph_words_lie_after_the_exchange_words_and_fit_the_heap():
    P = 3
    first, count = set_words(P, 0, 0)
    assert first == 3 * P and count == GRAPH_EXCHANGES * 2 * P
    assert set_words(P, 0, 1)[0] == first + count
    last = graph_slot(P, GRAPH_BLOCKS - 1, 1, GRAPH_EXCHANGES - 1, 1, P - 1)
    assert last == signal_words(P) - 1


def replay_steps(ts, statics, graphs, steps, stream=lambda: None):
    """Every PE in a thread of its own (on its own CUDA stream where ``stream()`` makes one):
    ``steps`` replays, each with new send data, each checked."""
    def run(r):
        st = stream()
        with torch.cuda.stream(st) if st is not None else contextlib.nullcontext():
            for step in range(steps):
                statics[r].fill(step)
                graphs[r].replay().wait()
                if st is not None:
                    st.synchronize()
                statics[r].check(step)
    in_threads(len(ts), run)


def test_replays_over_the_in_process_heap_are_exact():
    P = 3
    group = HeapGroup(P, timeout_s=60)
    ts = [group.endpoint(r) for r in range(P)]
    try:
        statics, graphs = capture(ts, [("a", route_data(5, P)), ("b", route_data(6, P))])
        replay_steps(ts, statics, graphs, 5)
    finally:
        group.close()


class _FakeEntry:
    def __init__(self, marker):
        self.marker, self.resolved = marker, False


class _FakeWaits:
    """``_wait_entry`` of a transport on a GPU stream: a marker that has not passed makes the
    caller's stream wait (the entry stays unresolved); one that passed resolves the entry."""

    def __init__(self, passed: bool, fail_first: bool = False):
        self.calls, self.passed, self.fail_first = [], passed, fail_first

    def _wait_entry(self, e, timeout_s):
        self.calls.append(e)
        if self.passed:
            e.resolved = True
        if self.fail_first and len(self.calls) == 1:
            raise DistCAError("group aborted")


def test_a_replay_joins_its_shared_marker_once_and_resolves_each_exchange_once_it_passed():
    from distca_server.transport.exchange_graph import _ReplayHandle
    shared = object()
    entries = [_FakeEntry(shared) for _ in range(3)]
    waits = _FakeWaits(passed=False)
    _ReplayHandle(waits, entries).wait()
    assert waits.calls == entries[:1]  # one device wait (two CUDA calls), not one per exchange
    entries = [_FakeEntry(shared) for _ in range(3)]
    waits = _FakeWaits(passed=True)
    _ReplayHandle(waits, entries).wait()
    assert waits.calls == entries  # each is resolved from its own snapshot
    entries = [_FakeEntry(shared), _FakeEntry(object())]
    waits = _FakeWaits(passed=False, fail_first=True)
    with pytest.raises(DistCAError, match="aborted"):
        _ReplayHandle(waits, entries).wait()
    assert waits.calls == entries  # an exchange with a marker of its own is waited for too


def _gpu_replays() -> None:
    """Two and three PEs of one process on CUDA (stream memory operations in a CUDA graph)."""
    for P in (2, 3):
        group = HeapGroup(P, timeout_s=20)
        ts = [group.endpoint(r, "cuda") for r in range(P)]
        try:
            statics, graphs = capture(ts, [("a", route_data(5, P)), ("b", route_data(6, P)), ("a", route_data(5, P))])
            replay_steps(ts, statics, graphs, 6, stream=torch.cuda.Stream)
        finally:
            group.close()


@pytest.mark.gpu
def test_replays_over_the_in_process_heap_on_the_gpu_are_exact():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    run_fresh("test_exchange_graph", "_gpu_replays", 180, "the replays")
