"""The device-driven exchange (transport/routed.py) over the CPU shared-memory heap, whose stream is
a thread (transport/pe_stream.py HostStream): what CI can test of issue 22 item 1.

- byte-for-byte what the in-process transport delivers, over random routes (zero-byte peers, own
  splits, several segments), host-driven rounds in between, and arrays growing (which moves the
  buffers: routes are installed again);
- once a route is installed, ``exchange`` returns before any peer has entered the exchange;
- the watchdog: a silent or dead peer fails the others with ``DistCAError`` naming it, after the
  deadline and bounded; a peer that misuses a route is refused with ``ValueError`` and its peers
  fail at once; a peer that closes fails the others; the next group epoch over the same heap is
  exact.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from distca_server.errors import DistCAError
from distca_server.transport.host_thread import HostBoundHeap, HostThread
from distca_server.transport.local import LocalGroup
from distca_server.transport.routed import GRACE_S, RoutedTransport, _Entry, route_id
from distca_server.transport.shm import ShmHeap, create_heap, destroy_heap
from distca_server.transport.symmetric import ReusableHeap, SymmetricTransport
from distca_server.transport.symmetric_words import (ABORT, GEN_SHIFT, MISMATCH, PEER_FAILED, abort_low,
                                                    signal_words)
from test_transport_symmetric import SLACK_S, collect, in_threads, reporting  # the helpers those tests share

SIZES = [0, 0, 1, 3, 64, 255, 1000, 4096]


def route_data(seed: int, P: int, scale: int = 1):
    """A route's sizes ``splits[src][s][dst]`` (the same in every thread)."""
    g = torch.Generator().manual_seed(seed)
    nseg = int(torch.randint(1, 4, (1,), generator=g))
    idx = torch.randint(0, len(SIZES), (P, nseg, P), generator=g)
    return [[[SIZES[int(i)] * scale for i in idx[src, s]] for s in range(nseg)] for src in range(P)]


def payload(src: int, splits, step: int) -> list[torch.Tensor]:
    """What ``src`` sends in exchange ``step``: bytes that name the sender, segment and step."""
    g = torch.Generator().manual_seed(1000 * step + src)
    return [torch.randint(0, 256, (sum(row),), dtype=torch.uint8, generator=g) for row in splits[src]]


def recv_splits(splits, me: int):
    return [[splits[src][s][me] for src in range(len(splits))] for s in range(len(splits[0]))]


def schedule(P: int, steps: int, seed: int):
    """``steps`` exchanges: mostly three repeating routes, sometimes an unrouted one, and a larger
    route late (its buffers grow, so every installed route moves)."""
    routes = {name: route_data(seed * 10 + i, P) for i, name in enumerate("abc")}
    routes["big"] = route_data(seed * 10 + 9, P, scale=8)
    plan = []
    for step in range(steps):
        name = "abc"[step % 3] if step % 7 != 5 else None
        if step == steps // 2:
            name = "big"
        splits = routes[name] if name else route_data(seed * 100 + step, P)
        plan.append((name, splits))
    return plan


def play(transport, plan, key_of=lambda name: f"recv-{name}", timeout_s: float | None = None):
    """Run ``plan`` on one endpoint; returns the received bytes of every exchange. ``timeout_s``:
    each exchange's deadline (default the transport's)."""
    me, out = transport.rank, []
    for step, (name, splits) in enumerate(plan):
        rs = recv_splits(splits, me)
        recv = [transport.buffer(f"{key_of(name)}-{s}", sum(x)) for s, x in enumerate(rs)]
        handle = transport.exchange(payload(me, splits, step), splits[me], recv, rs, timeout_s=timeout_s,
                                    route=None if name is None else ("test", name))
        handle.wait()
        out.append([x.clone() for x in recv])
    return out


@pytest.fixture
def heap():
    made = []

    def make(P, heap_bytes=16 << 20):
        made.append(create_heap(P, heap_bytes))
        return made[-1]
    yield make
    for h in made:
        destroy_heap(h)


@contextlib.contextmanager
def routed_group(heap, P: int, timeout_s: float):
    """``P`` routed transports over a fresh shared-memory heap, closed afterwards."""
    h = heap(P)
    ts = [RoutedTransport(ShmHeap(h, r), timeout_s=timeout_s) for r in range(P)]
    try:
        yield ts
    finally:
        for t in ts:
            t.close()


@pytest.mark.parametrize("P", [2, 3, 4])
def test_routed_exchanges_equal_the_local_transport(heap, P):
    plan = schedule(P, 24, seed=P)
    with routed_group(heap, P, 60) as ts:
        got = in_threads(P, lambda r: play(ts[r], plan))
        group = LocalGroup(P, timeout_s=60)
        want = in_threads(P, lambda r: play(group.endpoint(r), plan))
        for r in range(P):
            for step in range(len(plan)):
                for s, (a, b) in enumerate(zip(got[r][step], want[r][step])):
                    assert torch.equal(a, b), f"participant {r} exchange {step} segment {s} ({plan[step][0]})"
        # Exchanges of installed routes ran device-driven, on every PE alike (a growing array
        # uninstalls every route: the unrouted exchanges' random sizes grow theirs now and then).
        counts = {t.device_exchanges for t in ts}
        assert len(counts) == 1 and counts.pop() >= 5, [t.device_exchanges for t in ts]
        assert sorted(map(str, ts[0].routes)) == sorted(map(str, ts[1].routes))
        # bytes_sent counts other participants' bytes, device-driven exchanges included.
        assert ts[0].bytes_sent == sum(sum(row) - row[0] for _, sp in plan for row in sp[0])


def installed(ts, name="r", splits=None, P=None):
    """Run a route's exchanges until it is installed everywhere (growth, then install)."""
    P = P or len(ts)
    splits = splits or [[[64] * P] for _ in range(P)]
    for _ in range(2):
        in_threads(P, lambda r: play(ts[r], [(name, splits)]))
    assert all(("test", name) in t.routes for t in ts)
    return splits


def test_a_route_is_installed_by_its_second_exchange_and_reinstalled_after_growth(heap):
    P = 2
    with routed_group(heap, P, 60) as ts:
        r = [[[64] * P] for _ in range(P)]
        big = [[[5000] * P] for _ in range(P)]
        # 1: the buffer grows; 2: installs; 3-6: device-driven; "big" grows another array, which
        # uninstalls "r": 7 host-driven (installs again), 8-9 device-driven.
        plan = [("r", r)] * 6 + [(None, big)] + [("r", r)] * 3
        in_threads(P, lambda k: play(ts[k], plan))
        assert [t.device_exchanges for t in ts] == [6, 6]


def test_an_installed_route_returns_before_any_peer_enters(heap):
    P = 2
    with routed_group(heap, P, 60) as ts:
        splits = installed(ts)
        rs = recv_splits(splits, 0)
        bufs = [[t.buffer(f"recv-r-{s}", sum(x)) for s, x in enumerate(recv_splits(splits, t.rank))] for t in ts]
        # Participant 0 starts and returns while participant 1 has not even called exchange: the
        # host-driven protocol would block here until its deadline.
        h0 = ts[0].exchange(payload(0, splits, 7), splits[0], bufs[0], rs, route=("test", "r"))
        assert not h0._entry.marker.done()
        h1 = ts[1].exchange(payload(1, splits, 7), splits[1], bufs[1], recv_splits(splits, 1), route=("test", "r"))
        h0.wait()
        h1.wait()
        assert torch.equal(bufs[0][0][64:], payload(1, splits, 7)[0][:64])
        assert torch.equal(bufs[1][0][:64], payload(0, splits, 7)[0][64:])
        assert ts[0].device_exchanges == ts[1].device_exchanges == 1


def test_silent_peer_fails_the_others_after_the_deadline_naming_it(heap):
    P, timeout = 3, 1.0
    # The setup exchanges (installed) must succeed on a loaded machine: the transports' deadline is
    # generous, and the short one goes to the exchange meant to fail only.
    with routed_group(heap, P, 60) as ts:
        splits = installed(ts)

        def live(r):
            rs = recv_splits(splits, r)
            recv = [ts[r].buffer(f"recv-r-{s}", sum(x)) for s, x in enumerate(rs)]
            t0 = time.monotonic()
            before = ts[r].device_exchanges
            # device-driven: it returns (a host-driven exchange would wait here and raise itself)
            handle = ts[r].exchange(payload(r, splits, 9), splits[r], recv, rs, timeout_s=timeout,
                                    route=("test", "r"))
            assert ts[r].device_exchanges == before + 1
            with pytest.raises(DistCAError) as err:
                handle.wait()
            return time.monotonic() - t0, str(err.value)
        got = in_threads(2, live)  # participant 2 never enters
        for r, (elapsed, msg) in enumerate(got):
            assert timeout <= elapsed < timeout + GRACE_S + SLACK_S, (r, elapsed)
            assert "did not hear from participants [2]" in msg, msg
        # The group stays broken for the next exchange, at once.
        with pytest.raises(DistCAError, match="aborted"):
            play(ts[0], [("r", splits)])


def test_misused_route_is_refused_and_its_peers_fail_at_once(heap):
    P = 3
    with routed_group(heap, P, 60) as ts:
        splits = installed(ts)

        def step(r):
            rs = recv_splits(splits, r)
            if r == 0:  # other sizes under the same route: refused before anything moves
                bad = [[[65] * P]]
                with pytest.raises(ValueError, match=r"route \('test', 'r'\) has other sizes.*\[65, 65, 65\]"):
                    ts[0].exchange(payload(0, bad, 3), bad[0], [torch.empty(sum(rs[0]), dtype=torch.uint8)],
                                   rs, route=("test", "r"))
                return 0.0, ""
            recv = [ts[r].buffer(f"recv-r-{s}", sum(x)) for s, x in enumerate(rs)]
            t0 = time.monotonic()
            with pytest.raises(DistCAError) as err:
                ts[r].exchange(payload(r, splits, 3), splits[r], recv, rs, route=("test", "r")).wait()
            return time.monotonic() - t0, str(err.value)
        got = in_threads(P, step)
        for r in (1, 2):
            elapsed, msg = got[r]
            assert "participant 0 found a mismatch (sizes" in msg, msg
            assert elapsed < 30, "the peers fail on participant 0's abort, not at their 60 s deadline"


@pytest.mark.parametrize("installed_first", [False, True])
@pytest.mark.parametrize("bad", ["sum", "segments"])
def test_bad_exchange_arguments_fail_the_peers_at_once(heap, installed_first, bad):
    """A PE whose own arguments are bad (send splits that do not sum to its segment, or more than
    MAX_SEGMENTS segments) raises ValueError and aborts the group, host-driven or on an installed
    route: its peers fail at once, not at their 60 s deadline (found by a review: they waited
    the deadline and read that the PE was silent)."""
    P = 3
    with routed_group(heap, P, 60) as ts:
        splits = installed(ts) if installed_first else [[[64] * P] for _ in range(P)]

        def step(r):
            rs = recv_splits(splits, r)
            recv = [ts[r].buffer(f"recv-r-{s}", sum(x)) for s, x in enumerate(rs)]
            send, sp = payload(r, splits, 3), splits[r]
            if r == 1 and bad == "sum":
                sp = [[64, 64, 65]]
            elif r == 1:
                send, sp, recv, rs = send * 17, sp * 17, recv * 17, rs * 17
            t0 = time.monotonic()
            try:
                ts[r].exchange(send, sp, recv, rs, route=("test", "r")).wait()
            except (ValueError, DistCAError) as exc:
                return time.monotonic() - t0, exc
            return time.monotonic() - t0, None
        got = in_threads(P, step)
        assert isinstance(got[1][1], ValueError), got[1]
        for r in (0, 2):
            elapsed, exc = got[r]
            assert isinstance(exc, DistCAError) and "participant 1 found a mismatch" in str(exc), exc
            assert elapsed < 30, elapsed


def test_a_peer_that_reads_an_echo_before_its_cause_names_the_cause(heap):
    """The race the test above meets under load: participant 2 reads participant 1's PEER_FAILED
    before participant 0's MISMATCH has landed. The echo carries its cause, so participant 2 still
    names participant 0, and passes the same cause on."""
    P = 3
    with routed_group(heap, P, 60) as ts:
        splits = installed(ts)
        ts[1]._abort(PEER_FAILED, "participant 0 found a mismatch", cause=(0, MISMATCH))  # 0 wrote nothing yet
        rs = recv_splits(splits, 2)
        recv = [ts[2].buffer(f"recv-r-{s}", sum(x)) for s, x in enumerate(rs)]
        t0 = time.monotonic()
        with pytest.raises(DistCAError, match="participant 1 gave up after participant 0 found a mismatch"):
            ts[2].exchange(payload(2, splits, 3), splits[2], recv, rs, route=("test", "r")).wait()
        assert time.monotonic() - t0 < 30
        sig = ts[0].heap.signals()
        assert ts[0]._root(sig, (2, PEER_FAILED)) == (0, MISMATCH)  # told the others
        # an echo that names no cause reads as it always did
        ts[2]._abort(PEER_FAILED, "gave up")
        assert ts[0]._reason(ts[0].heap.signals(), (2, PEER_FAILED)) == (
            "participant 2 gave up after another participant failed")


def test_peers_that_disagree_on_the_route_fail_instead_of_mixing_bytes(heap):
    P = 2
    with routed_group(heap, P, 60) as ts:
        a = installed(ts, "a", [[[64, 64]], [[64, 64]]])
        b = installed(ts, "b", [[[64, 32]], [[32, 64]]])  # its buffers grew: "a" is installed anew
        installed(ts, "a", a)
        assert ts[0].device_exchanges == ts[1].device_exchanges

        def step(r):
            name, splits = ("a", a) if r == 0 else ("b", b)
            rs = recv_splits(splits, r)
            recv = [ts[r].buffer(f"recv-{name}-{s}", sum(x)) for s, x in enumerate(rs)]
            with pytest.raises((ValueError, DistCAError)) as err:
                ts[r].exchange(payload(r, splits, 5), splits[r], recv, rs, route=("test", name)).wait()
            return str(err.value)
        devices = [t.device_exchanges for t in ts]
        msgs = in_threads(P, step)
        assert [t.device_exchanges for t in ts] == [n + 1 for n in devices]  # both ran device-driven
        assert any("under another route" in m for m in msgs), msgs


def test_peer_that_closes_fails_the_others(heap):
    P = 3
    h = heap(P)
    ts = [RoutedTransport(ShmHeap(h, r), timeout_s=60) for r in range(P)]
    try:
        splits = installed(ts)
        ts[2].close()

        def step(r):
            rs = recv_splits(splits, r)
            recv = [ts[r].buffer(f"recv-r-{s}", sum(x)) for s, x in enumerate(rs)]
            t0 = time.monotonic()
            with pytest.raises(DistCAError, match="participant 2 left the group"):
                ts[r].exchange(payload(r, splits, 4), splits[r], recv, rs, route=("test", "r")).wait()
            return time.monotonic() - t0
        assert max(in_threads(2, step)) < 30
    finally:
        for t in ts[:2]:
            t.close()


def test_next_group_epoch_over_the_same_heap_is_exact_after_a_failure(heap):
    P, timeout = 2, 0.5
    h = heap(P)
    heaps = [ReusableHeap(ShmHeap(h, r)) for r in range(P)]
    # a generous deadline for the setup exchanges (installed); the short one for the one meant to fail
    old = [RoutedTransport(heaps[r].lease(1), timeout_s=60, epoch=1) for r in range(P)]
    splits = installed(old)
    with pytest.raises(DistCAError):  # participant 1 stays away: participant 0's watchdog fires
        play(old[0], [("r", splits)], timeout_s=timeout)
    for t in old:
        t.close()
    # Epoch 2 reuses the heap: its words hold epoch 1's values (abort values included).
    new = [RoutedTransport(heaps[r].lease(2), timeout_s=60, epoch=2) for r in range(P)]
    try:
        plan = [("r", splits)] * 4 + [("s", route_data(3, P))] * 3
        got = in_threads(P, lambda r: play(new[r], plan))
        for step in range(len(plan)):
            for r in range(P):
                want = [torch.cat([payload(src, plan[step][1], step)[s][
                    sum(plan[step][1][src][s][:r]):sum(plan[step][1][src][s][:r + 1])] for src in range(P)])
                    for s in range(len(plan[step][1][0]))]
                assert all(torch.equal(x, y) for x, y in zip(got[r][step], want)), (step, r)
        assert new[0].device_exchanges >= 3
    finally:
        for t in new:
            t.close()
        for x in heaps:
            x.close()


def test_route_ids_are_the_same_in_every_process():
    assert route_id(("plan", 3, "dispatch")) == route_id(("plan", 3, "dispatch")) > 0
    assert route_id(("plan", 3, "dispatch")) != route_id(("plan", 3, "return"))


# ---- a peer process that dies mid-exchange ---------------------------------------------------------
def _worker(rank: int, P: int, handle: dict, timeout: float, results) -> None:
    with reporting(rank, results):  # a failure anywhere (setup included) reaches the parent
        # The setup exchanges run under a generous deadline: the processes may start seconds apart
        # on a loaded machine. ``timeout`` is the deadline of the exchange meant to fail only.
        t = RoutedTransport(ShmHeap(handle, rank), timeout_s=60)
        splits = [[[4096] * P] for _ in range(P)]
        rs = recv_splits(splits, rank)
        for step in range(3):  # grow, install, then one device-driven exchange
            recv = [t.buffer("recv", sum(rs[0]))]
            t.exchange(payload(rank, splits, step), splits[rank], recv, rs, route="r").wait()
        if rank == P - 1:
            os._exit(0)  # dies with the route installed, before the next exchange
        t0 = time.monotonic()
        try:
            recv = [t.buffer("recv", sum(rs[0]))]
            t.exchange(payload(rank, splits, 3), splits[rank], recv, rs, timeout_s=timeout, route="r").wait()
            results.put((rank, "ok", time.monotonic() - t0, t.device_exchanges))
        except DistCAError as exc:
            results.put((rank, str(exc), time.monotonic() - t0, t.device_exchanges))


def run_dying_group(worker, module: str, P: int, timeout: float) -> dict:
    """``worker(rank, P, heap handle, timeout, results)`` in ``P`` processes over a fresh
    shared-memory heap (``module``, the worker's, preloaded), the last of which dies; the others'
    reports ``(rank, *rest)`` as ``{rank: rest}``. A worker that fails (``reporting``) or crashes
    fails the test at once (``collect``)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", module])
    handle = create_heap(P, heap_bytes=4 << 20)
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, P, handle, timeout, results)) for r in range(P)]
    try:
        for p in procs:
            p.start()
        return {r: tuple(rest) for r, *rest in collect(results, procs, P - 1)}
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        destroy_heap(handle)


def test_peer_process_that_dies_fails_the_others_within_the_deadline():
    P, timeout = 3, 1.0
    got = run_dying_group(_worker, __name__, P, timeout)
    assert set(got) == {0, 1}
    for r, (msg, elapsed, n) in got.items():
        assert n == 2, "the exchange that failed ran device-driven"
        assert f"participants [{P - 1}]" in msg or "gave up" in msg, msg
        assert timeout <= elapsed < timeout + GRACE_S + SLACK_S, (r, elapsed)


def test_unwaited_device_driven_exchanges_complete_before_a_host_driven_one(heap):
    """A GPU caller does not wait on every handle: a host-driven exchange (here unrouted) first
    lets every device-driven one in flight finish, and both deliver."""
    P = 2
    with routed_group(heap, P, 60) as ts:
        splits = installed(ts)
        other = route_data(7, P)

        def step(r):
            rs = recv_splits(splits, r)
            for k in range(3):  # three device-driven exchanges, none waited
                ts[r].exchange(payload(r, splits, 20 + k), splits[r], [ts[r].buffer("recv-r-0", sum(rs[0]))],
                               rs, route=("test", "r"))
            ors = recv_splits(other, r)
            out = [torch.empty(sum(x), dtype=torch.uint8) for x in ors]
            ts[r].exchange(payload(r, other, 30), other[r], out, ors).wait()  # host-driven: drains first
            return out
        outs = in_threads(P, step)
        for r in range(P):
            for s in range(len(other[0])):
                want = torch.cat([payload(src, other, 30)[s][sum(other[src][s][:r]):sum(other[src][s][:r + 1])]
                                  for src in range(P)])
                assert torch.equal(outs[r][s], want)
        assert ts[0].device_exchanges == 3 and not ts[0]._unresolved()


def test_a_shorter_wait_bound_ends_a_silent_exchange_early(heap):
    P, timeout = 2, 60.0
    with routed_group(heap, P, timeout) as ts:
        splits = installed(ts)
        rs = recv_splits(splits, 0)
        handle = ts[0].exchange(payload(0, splits, 40), splits[0], [ts[0].buffer("recv-r-0", sum(rs[0]))], rs,
                                route=("test", "r"))
        t0 = time.monotonic()
        with pytest.raises(DistCAError, match="did not finish within 0.5 s"):
            handle.wait(0.5)  # participant 1 never comes; the transport's deadline is 60 s
        assert time.monotonic() - t0 < timeout / 2



# ---- the abort path never waits on the stream it is ending --------------------------------------------
class _HeldStreamHeap:
    """An NVSHMEM-like endpoint (behind ``HostBoundHeap``) whose stream is held by a device-driven
    wait: ``quiet`` (NVSHMEM's quiet_on_stream + stream synchronize) cannot return until the
    stream's ``force`` sets ``held``. Logs what reached it, in order."""

    rank, world_size, device = 0, 2, torch.device("cpu")

    def __init__(self, held: threading.Event, log: list):
        self.held, self.log = held, log
        self.arena = torch.zeros(1 << 16, dtype=torch.uint8)

    def put(self, *a):
        self.log.append(("put",))

    def put_signal(self, *a):
        self.log.append(("put_signal",))

    def signal(self, pe, slot, value):
        self.log.append(("signal", pe, slot))

    def quiet(self):
        self.log.append(("quiet",))
        self.held.wait()

    def close(self):
        pass

    def signals(self):
        return np.zeros(signal_words(self.world_size), dtype=np.int64)

    def read(self, offset, nbytes):
        return torch.zeros(nbytes, dtype=torch.uint8)

    def idle(self, seconds):
        time.sleep(seconds)


class _HeldStream:
    """The PE stream of that endpoint: ``force`` ends the held wait (and logs whether the
    transport's lock was held meanwhile)."""

    synchronous = False

    def __init__(self, held: threading.Event, log: list, transport_lock):
        self.held, self.log, self.lock = held, log, transport_lock

    def force(self, slot, value):
        self.log.append(("force", slot, self.lock._is_owned()))
        self.held.set()

    def close(self):
        pass


class _HeldMarker:
    def __init__(self, held: threading.Event):
        self.held = held

    def done(self):
        return self.held.is_set()

    def wait(self, timeout_s):
        return self.held.wait(timeout_s)

    def join(self):
        pass


def test_an_expired_exchange_forces_its_waits_first_and_never_waits_on_the_held_stream():
    """The watchdog's expiry of a device-driven exchange whose stream is held (a heap without
    signal_now): the waits are forced first, outside the transport's lock, then the abort's
    signals go out, and nothing waits on the held stream. Before, the abort's quiet synchronized
    that stream on the host thread until the force that came only after it: the expiry took the
    host call's whole bound and left the host thread stuck for every later NVSHMEM call."""
    held, log = threading.Event(), []
    host = HostThread("test-held-stream")
    try:
        # 2 s: what a regression would cost here; the fixed path waits for no host call
        lease = ReusableHeap(HostBoundHeap(_HeldStreamHeap(held, log), host, 2.0)).lease(0)
        t = RoutedTransport(lease, timeout_s=60.0)
        t._stream = _HeldStream(held, log, t._lock)
        e = _Entry(t._base | 1, time.monotonic(), None, None, _HeldMarker(held), {1: 1}, {1: 3}, "test exchange")
        t._inflight.append(e)
        t._expire(e)  # what the watchdog does at the deadline
        assert host.call(lambda: 7, timeout_s=30) == 7 and host.stuck is None  # usable; its queue has run
        forced = [i for i, x in enumerate(log) if x[0] == "force"]
        signalled = [i for i, x in enumerate(log) if x[0] == "signal"]
        assert forced and signalled and max(forced) < min(signalled), log
        assert not any(log[i][2] for i in forced), log  # the transport's lock was not held
        assert [log[i] for i in signalled] == [("signal", 1, t._slot(ABORT, 0))] and ("quiet",) not in log, log
        assert e.expired == "participant 0 did not hear from participants [1] within the deadline"
        assert t._broken == e.expired
    finally:
        held.set()
        host.stop()


def test_the_abort_writes_through_signal_now_where_the_heap_has_it():
    """A heap with ``signal_now`` (the in-process heap on CUDA): the abort writes every peer's
    ABORT word through it, and neither queues a signal behind the stream nor quiets."""
    log = []

    class Heap(_HeldStreamHeap):
        rank, world_size = 1, 3

        def signal_now(self, pe, slot, value):
            self.log.append(("signal_now", pe, slot, value))
    t = SymmetricTransport(Heap(threading.Event(), log), timeout_s=5, epoch=4)
    t._abort(MISMATCH, "test")
    value = (4 << GEN_SHIFT) | abort_low(MISMATCH, None)  # generation = epoch 4
    assert log == [("signal_now", pe, t._slot(ABORT, 1), value) for pe in (2, 0)]
    assert t._broken == "test"
