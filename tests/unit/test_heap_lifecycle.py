"""The symmetric heap's lifecycle across group epochs, on the CPU.

- Generations: transports of successive epochs on one reused shared-memory heap
  (``ReusableHeap`` leases) exchange correctly although the signal words do not start at zero,
  and a peer of the old epoch that still writes late is not taken for the new epoch.
- The NVSHMEM runtime's lifecycle and host thread, with a fake NVSHMEM driver (no nvshmem4py) over
  shared memory: started once per process, reused by later epochs of the same world, refused with
  ``DistCAError`` for another world or a bigger heap, finalized at exit within a bound, and every
  NVSHMEM call made on one thread (asserted from the thread identities the fake records).
- ``JobConfig.heap_bytes``: validated, a ``distca up`` flag, documented.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from distca_server.errors import DistCAError
from distca_server.transport.base import ALIGN
from distca_server.transport.nvshmem import HostBoundHeap, HostThread, NvshmemRuntime
from distca_server.transport.shm import ShmHeap, create_heap, destroy_heap
from distca_server.transport.symmetric import ReusableHeap, SymmetricTransport
from distca_server.transport.symmetric_words import ABORT, ANNOUNCE, DATA, GEN_SHIFT
from scheduler.config import DEFAULT_HEAP_BYTES, HEAP_ALIGN, ConfigError, JobConfig

from test_transport_symmetric import expected_digests, in_threads, run_rounds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _slot(kind: int, src: int, P: int) -> int:
    return kind * P + src


# ---- generations on a reused heap --------------------------------------------------------------------
def test_two_epochs_on_one_reused_heap_exchange_correctly():
    P, rounds = 3, 6
    handle = create_heap(P, heap_bytes=16 << 20)
    try:
        heaps = [ReusableHeap(ShmHeap(handle, r)) for r in range(P)]
        for epoch, seed in ((4, 11), (5, 12)):
            eps = [SymmetricTransport(heaps[r].lease(epoch), timeout_s=10, epoch=epoch) for r in range(P)]
            if epoch == 5:  # the words hold epoch 4's values: the new epoch must not assume zeros
                words = heaps[0].heap.signals()
                assert (words[_slot(DATA, 1, P)] >> GEN_SHIFT) == 4 and words[_slot(DATA, 1, P)] & 0xFFFF == rounds
            got = in_threads(P, lambda r: run_rounds(eps[r], seed, rounds))
            assert got == expected_digests(seed, rounds, P)
            words = heaps[0].heap.signals()
            assert all(int(words[_slot(k, pe, P)]) == (epoch << GEN_SHIFT) | rounds
                       for k in (ANNOUNCE, DATA) for pe in (1, 2))
            for t in eps:
                t.close()  # ends the lease; the heap stays open
            assert all(int(w) >> GEN_SHIFT == epoch and int(w) & 0xFF == 1  # CLOSED of this epoch
                       for w in heaps[0].heap.signals()[_slot(ABORT, 1, P):_slot(ABORT, P, P)])
        for h in heaps:
            h.close()
    finally:
        destroy_heap(handle)


def test_late_writes_of_a_peer_still_in_the_old_epoch_are_not_taken_for_the_new_one():
    """PE 1 of epoch 1 (another process's endpoint) keeps writing after PE 0 moved to epoch 2: its
    next exchange fails at once (PE 0 moved on), then it writes late an announce of its next
    exchange, a DATA word far ahead, a timeout and a close (ABORT words). PE 0's epoch-2 exchange
    ignores all of it, waits, and completes with the right bytes once PE 1 of epoch 2 arrives."""
    P = 2
    handle = create_heap(P, heap_bytes=8 << 20)
    try:
        pe0 = ReusableHeap(ShmHeap(handle, 0))
        old0 = SymmetricTransport(pe0.lease(1), timeout_s=10, epoch=1)
        old1 = SymmetricTransport(ShmHeap(handle, 1), timeout_s=0.5, epoch=1)  # the old process's endpoint
        payload = [torch.arange(64, dtype=torch.uint8) + 10 * r for r in range(P)]

        def one_exchange(t, r, tag=0):
            out = torch.empty(64, dtype=torch.uint8)
            t.exchange([payload[r] + tag], [[32, 32]], [out], [[32, 32]])
            return out
        in_threads(P, lambda r: one_exchange((old0, old1)[r], r))

        new0 = SymmetricTransport(pe0.lease(2), timeout_s=15, epoch=2)
        with pytest.raises(DistCAError):  # the old epoch's endpoint of PE 0 is revoked
            one_exchange(old0, 0)
        result, errors = {}, []

        def run_new0():
            try:
                result[0] = one_exchange(new0, 0, tag=1)
            except Exception as exc:  # noqa: BLE001 - asserted below
                errors.append(exc)
        waiter = threading.Thread(target=run_new0)
        waiter.start()
        time.sleep(0.3)  # PE 0 has announced epoch 2's exchange
        with pytest.raises(DistCAError, match="participant 0 moved on to a later group epoch"):
            one_exchange(old1, 1)
        # The old PE 1 writes late (values of generation 1): an announce, a stray DATA word far
        # ahead of epoch 2's exchange numbers, a timeout and a close.
        old = 1 << GEN_SHIFT
        for kind, value in ((ANNOUNCE, old | 2), (DATA, old | 999), (ABORT, old | 2), (ABORT, old | 1)):
            old1.heap.signal(0, _slot(kind, 1, P), value)
            time.sleep(0.05)
        old1.close()
        words = pe0.heap.signals()
        assert words[_slot(ANNOUNCE, 1, P)] == old | 2  # the late values did land
        assert words[_slot(DATA, 1, P)] == old | 999 and words[_slot(ABORT, 1, P)] == old | 1
        time.sleep(0.2)
        assert waiter.is_alive() and not errors  # PE 0 of epoch 2 still waits for its peer
        # PE 1 of epoch 2 arrives.
        new1 = SymmetricTransport(ReusableHeap(ShmHeap(handle, 1)).lease(2), timeout_s=15, epoch=2)
        result[1] = one_exchange(new1, 1, tag=1)
        waiter.join(15)
        assert not errors, errors
        for r in range(P):
            want = torch.cat([(payload[s] + 1)[32 * r:32 * r + 32] for s in range(P)])
            assert torch.equal(result[r], want), r
        new0.close()
        new1.close()
        pe0.close()
    finally:
        destroy_heap(handle)


def test_a_peer_that_moved_on_fails_the_old_epoch_at_once():
    P = 2
    handle = create_heap(P, heap_bytes=4 << 20)
    try:
        old0 = SymmetricTransport(ReusableHeap(ShmHeap(handle, 0)).lease(1), timeout_s=60, epoch=1)
        new1 = SymmetricTransport(ReusableHeap(ShmHeap(handle, 1)).lease(2), timeout_s=1, epoch=2)
        z = torch.zeros(0, dtype=torch.uint8)
        t = threading.Thread(target=lambda: pytest.raises(DistCAError, new1.exchange, [z], [[0, 0]], [z], [[0, 0]]))
        t.start()
        start = time.monotonic()
        with pytest.raises(DistCAError, match="participant 1 moved on to a later group epoch"):
            old0.exchange([z], [[0, 0]], [z], [[0, 0]])
        # at once, not at old0's own 60 s deadline (a loaded machine may take seconds to get there)
        assert time.monotonic() - start < 30.0
        t.join(5)
    finally:
        destroy_heap(handle)


def test_leases_and_generations_are_checked():
    handle = create_heap(1, heap_bytes=1 << 20)
    try:
        heap = ReusableHeap(ShmHeap(handle, 0))
        first = SymmetricTransport(heap.lease(3), timeout_s=1, epoch=3)
        assert first.generation == 3
        for bad in (3, 2, -1, True, 1.5, 1 << 31):
            with pytest.raises(ValueError, match="generation"):
                heap.lease(bad)
        lease = heap.lease(7)
        with pytest.raises(ValueError, match="generation 8 differs from the heap lease's 7"):
            SymmetricTransport(lease, generation=8)
        with pytest.raises(ValueError, match="generation must be an int"):
            SymmetricTransport(ShmHeap(handle, 0), generation=-1)
        with pytest.raises(DistCAError, match="generation 3 has ended"):
            first.heap.signal(0, 0, 1)
        first.close()  # closing an old epoch's transport leaves the heap open
        second = SymmetricTransport(lease, timeout_s=1, epoch=7)
        x = torch.arange(8, dtype=torch.uint8)
        out = torch.empty(8, dtype=torch.uint8)
        second.exchange([x], [[8]], [out], [[8]])
        assert torch.equal(out, x)
        heap.close()
        with pytest.raises(DistCAError, match="the heap was closed"):
            lease.put(0, 0, x)
        with pytest.raises(DistCAError, match="closed"):
            heap.lease(9)
    finally:
        destroy_heap(handle)


def test_a_revoked_lease_refuses_device_driven_writes_and_the_next_epoch_is_exact():
    """Device-driven writes go through the PE stream, not the lease's methods. Over a heap whose
    stream ops write the endpoint directly (the in-process heap: a CPU stand-in for NVSHMEM's
    stream), a transport of a revoked lease that still has an installed route and a captured
    graph queues nothing (before, its exchange wrote its credits and rows into memory the new
    epoch uses, and its GEQ waits passed on the new epoch's higher-generation words); the old
    lease makes no stream and writes no signal_now; the next epoch's exchanges are exact."""
    from distca_server.transport.local_heap import LocalHeap
    from distca_server.transport.routed import RoutedTransport
    from test_exchange_graph import Static, replay_steps
    from test_transport_routed import installed, payload, play, recv_splits
    P = 2
    memory = LocalHeap(P, heap_bytes=4 << 20)
    heaps = [ReusableHeap(memory.endpoint(r)) for r in range(P)]
    old = [RoutedTransport(heaps[r].lease(1), timeout_s=60, epoch=1) for r in range(P)]
    splits = installed(old)  # grow, install: the next exchanges of the route are device-driven
    statics = [Static(t, [("r", splits)]) for t in old]
    graphs = in_threads(P, lambda r: old[r].graph(lambda: [h.wait() for h in statics[r].run()]))
    replay_steps(old, statics, graphs, 1)
    leases = [t.heap for t in old]
    new = [RoutedTransport(heaps[r].lease(2), timeout_s=60, epoch=2) for r in range(P)]
    try:
        words, arenas = [w.clone() for w in memory.words], [a.clone() for a in memory.arenas]
        sent = old[0].device_exchanges
        rs = recv_splits(splits, 0)
        with pytest.raises(DistCAError, match="generation 1 has ended"):
            old[0].exchange(payload(0, splits, 7), splits[0], [old[0].buffer("recv-r-0", sum(rs[0]))], rs,
                            route=("test", "r"))
        with pytest.raises(DistCAError, match="generation 1 has ended"):
            graphs[0].replay()
        assert old[0]._stream.mark().wait(30)  # whatever was queued has run
        assert all(torch.equal(a, b) for a, b in zip(words, memory.words))  # no credit, no signal
        assert all(torch.equal(a, b) for a, b in zip(arenas, memory.arenas))  # no row, no report
        assert old[0].device_exchanges == sent
        with pytest.raises(DistCAError, match="generation 1 has ended"):
            leases[0].stream_ops(old[0].abort_value)
        with pytest.raises(DistCAError, match="generation 1 has ended"):
            leases[0].signal_now(1, 0, 1)
        got = in_threads(P, lambda r: play(new[r], [("r", splits)] * 4))  # grow, install, device-driven
        for r in range(P):
            want = [torch.cat([payload(src, splits, step)[0][sum(splits[src][0][:r]):sum(splits[src][0][:r + 1])]
                               for src in range(P)]) for step in range(4)]
            assert all(torch.equal(got[r][step][0], want[step]) for step in range(4)), r
        assert [t.device_exchanges for t in new] == [2, 2]
    finally:
        for t in old + new:
            t.close()


# ---- the NVSHMEM host thread, with a fake heap ------------------------------------------------------
class RecordingHeap:
    """A fake NVSHMEM endpoint: records ``(call, thread identity)``; ``inner`` (a ShmHeap) does the
    work, so exchanges over it are real."""

    def __init__(self, inner, log: list):
        self.inner, self.log = inner, log
        self.rank, self.world_size, self.device, self.arena = inner.rank, inner.world_size, inner.device, inner.arena

    def _rec(self, name):
        self.log.append((name, threading.get_ident()))

    def stage(self, src):
        self._rec("stage")
        return src

    def put(self, *a):
        self._rec("put")
        self.inner.put(*a)

    def put_signal(self, *a):
        self._rec("put_signal")
        self.inner.put_signal(*a)

    def signal(self, *a):
        self._rec("signal")
        self.inner.signal(*a)

    def quiet(self):
        self._rec("quiet")

    def close(self):
        self._rec("close")
        self.inner.close()

    def copy(self, dst, src):
        self.inner.copy(dst, src)

    def signals(self):
        return self.inner.signals()

    def read(self, offset, nbytes):
        return self.inner.read(offset, nbytes)

    def idle(self, seconds):
        self.inner.idle(seconds)


NVSHMEM_CALLS = {"put", "put_signal", "signal", "quiet", "close", "init", "unique_id", "finalize"}


def test_every_nvshmem_call_runs_on_the_host_thread_whoever_drives_the_exchange():
    """Two PEs over host-bound fake heaps: PE 0 exchanges from the main thread and from a second
    ("rounds") thread in turn; every put, signal, quiet and close of either PE ran on its own
    host thread, the stream staging on the caller's."""
    P = 2
    handle = create_heap(P, heap_bytes=4 << 20)
    hosts = [HostThread(f"test-host-{r}") for r in range(P)]
    logs: list[list] = [[] for _ in range(P)]
    try:
        eps = [SymmetricTransport(HostBoundHeap(RecordingHeap(ShmHeap(handle, r), logs[r]), hosts[r], 5),
                                  timeout_s=10) for r in range(P)]
        callers: list[set] = [set() for _ in range(P)]

        def rounds(r, n):
            callers[r].add(threading.get_ident())
            return run_rounds(eps[r], 5, n)
        # Rounds 0-2 driven by one set of threads, then again (same data) by another.
        first = in_threads(P, lambda r: rounds(r, 3))
        second = in_threads(P, lambda r: rounds(r, 3))
        assert first == second == expected_digests(5, 3, P)
        for t in eps:
            t.close()
        for r in range(P):
            calls = {name for name, _ in logs[r]}
            assert {"put", "put_signal", "quiet", "close", "stage"} <= calls
            nv = {ident for name, ident in logs[r] if name in NVSHMEM_CALLS}
            assert nv == {hosts[r].ident}
            staged = {ident for name, ident in logs[r] if name == "stage"}
            # (the rounds' threads, and the main thread that closed the transports)
            assert staged == callers[r] | {threading.get_ident()} and hosts[r].ident not in staged
    finally:
        for h in hosts:
            h.stop()
        destroy_heap(handle)


def test_host_thread_bounds_a_stuck_call_and_fails_later_ones_at_once():
    host = HostThread("test-stuck")
    release = threading.Event()
    start = time.monotonic()
    with pytest.raises(DistCAError, match="NVSHMEM init did not return within 0.2 s"):
        host.call(release.wait, timeout_s=0.2, what="init")
    assert time.monotonic() - start < 10.0  # bounded by its timeout: release is never set
    with pytest.raises(DistCAError, match="stuck in init"):
        host.call(lambda: 1, timeout_s=5)
    with pytest.raises(DistCAError, match="stuck in init"):
        host.submit(lambda: None)
    release.set()  # the stuck call returns (a dead peer's wait ended): the thread is usable again
    assert _eventually(lambda: host.stuck is None)
    assert host.call(lambda: 1, timeout_s=5) == 1
    # A stuck call that fails once it returns: its error is the next call's
    release.clear()

    def late_failure():
        release.wait()
        raise RuntimeError("quiet failed late")
    with pytest.raises(DistCAError, match="NVSHMEM quiet did not return"):
        host.call(late_failure, timeout_s=0.2, what="quiet")
    release.set()
    assert _eventually(lambda: host.stuck is None)
    with pytest.raises(DistCAError, match="an earlier NVSHMEM call failed before put: quiet failed late"):
        host.call(lambda: 2, timeout_s=5, what="put")
    assert host.call(lambda: 3, timeout_s=5) == 3
    host.stop()


def _eventually(cond, bound_s: float = 30.0) -> bool:
    """Whether ``cond()`` holds within ``bound_s`` (generous: a loaded machine's threads run late)."""
    end = time.monotonic() + bound_s
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def test_host_thread_reports_a_submitted_calls_error_at_the_next_call():
    host = HostThread("test-errors")
    ran = []
    host.submit(lambda: (_ for _ in ()).throw(RuntimeError("bad put")))
    host.submit(lambda: ran.append(threading.get_ident()))  # later submissions still run, in order
    with pytest.raises(DistCAError, match="an earlier NVSHMEM call failed before quiet: bad put"):
        host.call(lambda: None, timeout_s=5, what="quiet")
    assert ran == [host.ident]
    assert host.call(lambda: threading.get_ident(), timeout_s=5) == host.ident  # the error was reported once
    assert host.call(lambda: host.call(lambda: 7), timeout_s=5) == 7  # a call from the thread runs inline
    host.stop()


# ---- the NVSHMEM runtime's lifecycle, with a fake driver -------------------------------------------
class FakeDriver:
    """Stands in for nvshmem4py: a unique id names a shared-memory heap; ``start`` attaches this
    PE. Records ``(call, thread identity)``; ``finalize`` may be made to block."""

    def __init__(self, world_size: int, heap_bytes: int = 4 << 20):
        self.world_size, self.file_bytes = world_size, heap_bytes
        self.log: list = []
        self.handles: list = []
        self.block_finalize: threading.Event | None = None

    def configure(self, world_size, heap_bytes):  # NVSHMEM's environment: nothing to set here
        pass

    def unique_id(self) -> bytes:
        self.log.append(("unique_id", threading.get_ident()))
        handle = create_heap(self.world_size, self.file_bytes)
        self.handles.append(handle)
        return json.dumps(handle).encode()

    def start(self, uid, rank, world_size, heap_bytes, device):
        self.log.append(("init", threading.get_ident()))
        handle = json.loads(uid)
        assert handle["world_size"] == world_size and heap_bytes <= handle["heap_bytes"]
        return RecordingHeap(ShmHeap(handle, rank), self.log)

    def finalize(self, heap):
        self.log.append(("finalize", threading.get_ident()))
        if self.block_finalize is not None:
            self.block_finalize.wait()

    def count(self, name):
        return sum(1 for n, _ in self.log if n == name)


class Relay:
    """The scheduler's bootstrap relay, per epoch."""

    def __init__(self):
        self.values: dict[int, queue.Queue] = {}

    def _q(self, epoch):
        return self.values.setdefault(epoch, queue.Queue())

    def publish(self, epoch, P):
        return lambda value: [self._q(epoch).put(value) for _ in range(P - 1)]

    def lookup(self, epoch):
        return lambda: self._q(epoch).get(timeout=10)


def _join(rt, relay, epoch, rank, P, heap_bytes=1 << 20):
    return rt.join(rank=rank, world_size=P, timeout_s=10, publish=relay.publish(epoch, P),
                   lookup=relay.lookup(epoch), heap_bytes=heap_bytes, device="cpu", epoch=epoch)


def test_runtime_starts_once_and_reuses_the_heap_for_later_epochs_of_the_same_world():
    P = 2
    drivers = [FakeDriver(P) for _ in range(P)]
    rts = [NvshmemRuntime(driver=drivers[r], register_exit=False) for r in range(P)]
    relay = Relay()
    try:
        for epoch, seed in ((1, 3), (2, 4), (5, 6)):
            eps = in_threads(P, lambda r: _join(rts[r], relay, epoch, r, P))
            if epoch > 1:  # the old epoch's words are there: generations, not zeros
                assert int(eps[0].heap.signals()[_slot(DATA, 1, P)]) >> GEN_SHIFT < epoch
            assert in_threads(P, lambda r: run_rounds(eps[r], seed, 3)) == expected_digests(seed, 3, P)
            for t in eps:
                t.close()
        for r in range(P):
            assert rts[r].starts == 1 and drivers[r].count("init") == 1
            assert rts[r].state == "running" and rts[r].heap.generation == 5
            assert {ident for name, ident in drivers[r].log if name in NVSHMEM_CALLS} == {rts[r].host.ident}
        assert drivers[0].count("unique_id") == 1  # later epochs publish the running world's id
        # An epoch must be above the heap's last one on every PE.
        with pytest.raises(DistCAError, match="generation 5 must exceed the heap's previous one, 5"):
            _join(rts[0], relay, 5, 0, P)
        # Finalized once, on the host thread; later epochs are refused.
        assert all(rt.finalize(timeout_s=5) for rt in rts)
        assert not rts[0].finalize(timeout_s=5)
        for r in range(P):
            assert drivers[r].count("finalize") == 1
            assert {ident for name, ident in drivers[r].log if name == "finalize"} == {rts[r].host.ident}
        with pytest.raises(DistCAError, match="finalized in this process"):
            _join(rts[0], relay, 9, 0, P)
    finally:
        for d in drivers:
            for h in d.handles:
                destroy_heap(h)


def test_runtime_refuses_another_world_or_a_bigger_heap_with_a_clear_error():
    P = 2
    drivers = [FakeDriver(P) for _ in range(P)]
    rts = [NvshmemRuntime(driver=drivers[r], register_exit=False) for r in range(P)]
    relay = Relay()
    try:
        eps = in_threads(P, lambda r: _join(rts[r], relay, 1, r, P))
        for t in eps:
            t.close()
        # A bigger heap than the running world's: rank 0 refuses and tells the others at once.
        with pytest.raises(DistCAError, match="asks for a 2097152-byte heap, the running NVSHMEM world has 1048576"):
            _join(rts[0], relay, 2, 0, P, heap_bytes=2 << 20)
        with pytest.raises(DistCAError, match="world rank 0 cannot form the group: the group asks for"):
            _join(rts[1], relay, 2, 1, P)
        # Another world size: refused (NVSHMEM cannot start twice in one process).
        with pytest.raises(DistCAError, match="not PE 0 of 3; NVSHMEM cannot be started twice"):
            _join(rts[0], relay, 3, 0, 3)
        # A fresh process asked to join a running world it never joined.
        fresh = NvshmemRuntime(driver=FakeDriver(P), register_exit=False)
        relay.publish(4, P)({"uid": rts[0].uid, "heap_bytes": 1 << 20, "reuse": True})
        with pytest.raises(DistCAError, match="reuses a running NVSHMEM world this process never joined"):
            _join(fresh, relay, 4, 1, P)
        assert fresh.state == "idle" and fresh.driver.count("init") == 0
        # A process of this world at another rank.
        relay.publish(5, 3)({"uid": rts[0].uid, "heap_bytes": 1 << 20, "reuse": True})
        with pytest.raises(DistCAError, match="runs NVSHMEM as PE 1 of another world of 2"):
            _join(rts[1], relay, 5, 2, 3)
        # The same world, a smaller heap asked: reused.
        eps = in_threads(P, lambda r: _join(rts[r], relay, 6, r, P, heap_bytes=1 << 16))
        assert in_threads(P, lambda r: run_rounds(eps[r], 8, 2)) == expected_digests(8, 2, P)
        assert [rt.starts for rt in rts] == [1, 1]
    finally:
        for d in drivers:
            for h in d.handles:
                destroy_heap(h)


def test_a_failed_start_is_final_and_a_stuck_finalize_is_bounded():
    class Failing(FakeDriver):
        def start(self, *a):
            raise RuntimeError("bootstrap failed\nmore")
    rt = NvshmemRuntime(driver=Failing(1), register_exit=False)
    relay = Relay()
    with pytest.raises(DistCAError, match="could not start NVSHMEM for NVSHMEM group epoch 0, rank 0 of 1: bootstrap failed$"):
        _join(rt, relay, 0, 0, 1)
    with pytest.raises(DistCAError, match="failed to start in this process earlier"):
        _join(rt, relay, 1, 0, 1)
    rt.driver.handles and [destroy_heap(h) for h in rt.driver.handles]

    driver = FakeDriver(1)
    rt = NvshmemRuntime(driver=driver, register_exit=False)
    try:
        _join(rt, relay, 0, 0, 1).close()
        driver.block_finalize = threading.Event()  # a dead peer: the barrier never completes
        start = time.monotonic()
        assert rt.finalize(timeout_s=0.3) is False
        assert time.monotonic() - start < 10  # bounded by its timeout (the barrier never completes)
        assert rt.state == "finalized" and rt.host.stuck == "finalize"
        driver.block_finalize.set()
    finally:
        for h in driver.handles:
            destroy_heap(h)


def test_runtime_finalizes_at_process_exit_on_its_host_thread(tmp_path):
    """A real interpreter exit: the atexit hook finalizes once, on the host thread."""
    out = tmp_path / "log.json"
    script = f"""
import json, sys, threading
sys.path.insert(0, {os.path.join(ROOT, 'tests', 'unit')!r})
from test_heap_lifecycle import FakeDriver, Relay, _join
from distca_server.transport.nvshmem import NvshmemRuntime
from distca_server.transport.shm import destroy_heap
import atexit
driver = FakeDriver(1)
rt = NvshmemRuntime(driver=driver)  # registers its atexit hook when started
t = _join(rt, Relay(), 0, 0, 1)
t.close()
host = rt.host.ident
atexit.register(lambda: (json.dump({{"log": driver.log, "host": host, "main": threading.get_ident(),
                                     "state": rt.state}}, open({str(out)!r}, "w")),
                         [destroy_heap(h) for h in driver.handles]))
# atexit runs hooks last-in first-out: register the writer first so it runs after finalize.
atexit.unregister(rt.finalize)
atexit.register(rt.finalize)
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(out.read_text())
    finals = [ident for name, ident in got["log"] if name == "finalize"]
    assert finals == [got["host"]] and got["host"] != got["main"] and got["state"] == "finalized"


# ---- JobConfig.heap_bytes ---------------------------------------------------------------------------
def test_heap_bytes_is_a_validated_job_field_flag_and_documented():
    assert JobConfig().heap_bytes == DEFAULT_HEAP_BYTES == 1 << 30
    assert HEAP_ALIGN == ALIGN  # the transports take their alignment from the config (no torch)
    assert JobConfig(heap_bytes=np.int64(1 << 20)).heap_bytes == 1 << 20
    for bad, why in ((0, "positive int"), (-256, "positive int"), (1000, "multiple of 256 bytes, got 1000"),
                     (1.5, "positive int"), ("1G", "positive int"), (True, "positive int")):
        with pytest.raises(ConfigError, match=f"heap_bytes must be a {why}"):
            JobConfig(heap_bytes=bad)
    from distca_cli.flags import config_from_args
    from distca_cli import build_parser
    args = build_parser().parse_args(["up", "--heap-bytes", str(256 << 20), "--transport", "nvshmem"])
    assert config_from_args(args) == JobConfig(heap_bytes=256 << 20, transport="nvshmem")
    with pytest.raises(ConfigError, match="heap_bytes must be a multiple of 256 bytes, got 1000"):
        config_from_args(build_parser().parse_args(["up", "--heap-bytes", "1000"]))
    assert JobConfig.from_dict(JobConfig(heap_bytes=1 << 20).to_dict()).heap_bytes == 1 << 20
    with open(os.path.join(ROOT, "docs", "config.md")) as f:
        assert "| `heap_bytes` | int | `1073741824` (1 GiB) | bytes | `--heap-bytes` |" in f.read()


def test_a_shm_group_epoch_sizes_its_heap_with_rank_0s_heap_bytes():
    """join_epoch takes the job's heap_bytes; only world rank 0's counts (it is in the handle)."""
    from distca_server.runtime.groups import join_epoch
    P, values, published = 2, {}, threading.Event()

    def publish(value):
        values[0] = value
        published.set()

    def lookup():
        assert published.wait(60)  # generous: the join succeeds, however loaded the machine
        return values[0]
    mine = {0: 2 << 20, 1: None}  # rank 1 (a dedicated server) does not know the job's setting
    groups = in_threads(P, lambda r: join_epoch("shm", job="heap-bytes", epoch=0, rank=r, world_size=P,
                                                host="127.0.0.1", timeout_s=60.0, device=torch.device("cpu"),
                                                publish=publish, lookup=lookup, heap_bytes=mine[r]))
    try:
        assert values[0]["heap_bytes"] == 2 << 20
        assert [g.transport.heap.arena.numel() for g in groups] == [2 << 20] * P
        with pytest.raises(DistCAError, match="heap_bytes must exceed"):
            join_epoch("shm", job="heap-bytes", epoch=1, rank=0, world_size=P, host="127.0.0.1", timeout_s=1.0,
                       device=torch.device("cpu"), publish=publish, lookup=lookup, heap_bytes=256)
    finally:
        for g in groups:
            g.settled()
            g.transport.close()


def test_runtime_refuses_a_heap_too_small_before_publishing_anything():
    rt = NvshmemRuntime(driver=FakeDriver(2), register_exit=False)
    published = []
    with pytest.raises(ValueError, match="heap_bytes must exceed the .* bytes of tables of 2 PEs, got 256"):
        rt.join(rank=0, world_size=2, timeout_s=1, publish=published.append, lookup=lambda: None,
                heap_bytes=256, device="cpu", epoch=0)
    assert published == [] and rt.state == "idle"
    with pytest.raises(ValueError, match=r"rank 2 out of range \[0, 2\)"):
        rt.join(rank=2, world_size=2, timeout_s=1, publish=published.append, lookup=lambda: None, device="cpu")
