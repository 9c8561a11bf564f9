"""The NVSHMEM transport's fixes of the static review, on the CPU with fakes (test_nvshmem_stream.py's
bindings, CUDA and heap; test_memop_stream.py's driver module), each the CPU twin of a check the
``nvshmem`` tests make on a GPU:

1. Limited MPG (several PEs per GPU without MPS, our one-GPU setup): NVSHMEM 3.4.5 exits the
   process on its ``*_wait_until_on_stream`` waits, collectives and team calls. No operation of the
   stream or the heap calls one; a wait is the driver's ``cuStreamWaitValue64`` (GEQ). NVSHMEM's
   init status is recorded by name and reported.
2. ``NvshmemHeap.signal_now``: the abort path's signals go out on a stream of their own, from the
   host thread, past a held communication stream, without synchronizing any stream.
3. The heap's streams are the driver's non-blocking streams, made once: every epoch's device-driven
   stream shares them, and force's is never the communication stream (torch's pool, handing out 32
   streams round robin, made it so about every 32nd epoch). ``CUDA_DEVICE_MAX_CONNECTIONS`` too low
   is warned about once.
4. ``NVSHMEM_SYMMETRIC_SIZE`` is set before NVSHMEM's first call: world rank 0's unique id.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from enum import IntEnum
from types import SimpleNamespace

import pytest
import torch

import distca_server.transport.nvshmem as nv_mod
import distca_server.transport.nvshmem_stream as ns
from distca_server.transport.memop_stream import StreamDriver
from distca_server.transport.nvshmem import (LIMITED_MPG, HostBoundHeap, HostThread, Nvshmem4py, NvshmemHeap,
                                             NvshmemRuntime, init_status_name, set_symmetric_size, symmetric_size)
from distca_server.transport.routed import RoutedTransport
from distca_server.transport.symmetric import ReusableHeap
from distca_server.transport.symmetric_words import ABORT, GEN_SHIFT, TIMED_OUT, abort_low, signal_words

from test_memop_stream import GEQ, NON_BLOCKING, FakeDriver as FakeCudaDriver
from test_nvshmem_stream import SET, FakeBindings, FakeCuda, fake_driver, fake_nvshmem_heap, nv

SIZE = "NVSHMEM_SYMMETRIC_SIZE"


@pytest.fixture
def host():
    h = HostThread("test-nvshmem-cpu")
    yield h
    h.stop()


def _flush(host):
    host.call(lambda: None, timeout_s=5)


def _exits(calls):
    return [c for c in calls if c[0] == "EXIT"]


def _lease(heap, host, generation=1):
    """The heap as NvshmemRuntime offers it: bound to ``host`` (its signal_now's too), leased."""
    heap.submit = host.submit
    return ReusableHeap(HostBoundHeap(heap, host, 5.0)).lease(generation)


# ---- 1. limited MPG ------------------------------------------------------------------------------------
def test_no_stream_or_heap_operation_calls_what_limited_mpg_runs_exit_on(host):
    """Every PeStream operation and every heap call, as a limited-MPG run makes them: none reaches
    a call NVSHMEM 3.4.5 refuses there (the fake records and raises SystemExit, as NVSHMEM's exit(-1)
    would end the process), and nothing failed."""
    b = FakeBindings()
    heap = fake_nvshmem_heap(b)
    lease = _lease(heap, host)
    st = lease.stream_ops(-1)
    x = torch.arange(64, dtype=torch.uint8)
    st.begin()
    st.put(0, 0, x)
    st.put_signal(0, 64, x, 1, 5)
    st.signal(0, 2, 6)
    st.wait_ge(3, 7)
    st.fill(4, 2, 8)
    st.stamp(torch.zeros(2, dtype=torch.int64), 9)
    st.copy(heap.arena[256:320], x)
    snap = st.snapshot(0, 64)
    with st.capture() as graph:
        st.wait_ge(5, 10)
        st.signal(0, 5, 10)
    st.replay(graph)
    marker = st.mark()
    st.force(3, 7)
    _flush(host)
    assert st.error is None, st.error
    assert marker.done() and snap.value()[0].shape == (signal_words(2),)
    lease.put(0, 0, x)  # host-driven: stage runs on this thread (CPU tensors need no copy)
    lease.put_signal(0, 64, x, 1, 11)
    lease.signal(0, 2, 12)
    lease.signal_now(0, 6, 13)
    lease.quiet()
    lease.close()
    st.close()
    _flush(host)
    assert _exits(b.calls) == []
    waits = [c for c in nv(b.calls) if c[0] == "cuStreamWaitValue64"]
    comm = heap._stream.cuda_stream
    assert [c[1] for c in waits] == [(comm, heap._words.data_ptr() + 8 * 3, 7, GEQ),
                                     (comm, heap._words.data_ptr() + 8 * 5, 10, GEQ)]
    assert {c[2] for c in waits} == {host.ident}  # in order with the NVSHMEM calls, on the host thread


def test_a_wait_runs_with_the_devices_context_pushed_on_the_host_thread(host):
    b = FakeBindings()
    heap = fake_nvshmem_heap(b)
    st = _lease(heap, host).stream_ops(-1)
    b.calls.clear()
    st.wait_ge(2, (7 << GEN_SHIFT) | 3)
    _flush(host)
    ctx = b.calls[0][1][0]
    assert [(n, a) for n, a, _ in b.calls] == [
        ("cuCtxPushCurrent", (ctx,)),
        ("cuStreamWaitValue64", (heap._stream.cuda_stream, heap._words.data_ptr() + 16, (7 << GEN_SHIFT) | 3, GEQ)),
        ("cuCtxPopCurrent", ())]
    assert {t for _, _, t in b.calls} == {host.ident}


class _Status(IntEnum):  # nvshmem4py's InitStatus (bindings.Init_status), values as nvshmem_constants.h
    STATUS_NOT_INITIALIZED = 0
    STATUS_IS_BOOTSTRAPPED = 1
    STATUS_IS_INITIALIZED = 2
    STATUS_LIMITED_MPG = 3
    STATUS_FULL_MPG = 4
    STATUS_INVALID = 5


def test_the_init_status_is_named_from_nvshmem4pys_enum():
    # nvshmem.core.init_status() returns the binding's plain int (cpdef int init_status()).
    assert init_status_name(SimpleNamespace(init_status=lambda: 3, InitStatus=_Status)) == LIMITED_MPG
    assert init_status_name(SimpleNamespace(init_status=lambda: 2, InitStatus=_Status)) == "STATUS_IS_INITIALIZED"
    assert init_status_name(SimpleNamespace(init_status=lambda: 42, InitStatus=_Status)) == "42"
    assert init_status_name(SimpleNamespace(init_status=lambda: 3)) == "3"
    assert init_status_name(SimpleNamespace()) == "unknown"


def test_the_real_nvshmem4py_has_the_init_status_names_used():
    core = pytest.importorskip("nvshmem.core")
    assert callable(core.init_status) and core.InitStatus.STATUS_LIMITED_MPG.name == LIMITED_MPG
    assert core.InitStatus.STATUS_IS_INITIALIZED is not None and core.InitStatus.STATUS_FULL_MPG is not None


# ---- 2. signal_now -------------------------------------------------------------------------------------
def test_signal_now_goes_out_on_the_abort_stream_from_the_host_thread_past_a_held_comm_stream(host):
    b = FakeBindings()
    heap = fake_nvshmem_heap(b)
    heap._dirty.add(0)  # a put to PE 0 is pending: a plain signal would quiet first
    lease = _lease(heap, host)
    assert getattr(lease, "signal_now", None) is not None  # what SymmetricTransport._abort looks for
    gate = threading.Event()
    host.submit(gate.wait)  # the host thread busy (a quiet of the held stream, say)
    try:
        t0 = time.monotonic()
        lease.signal_now(0, 7, 123)
        # queued, not waited for: waiting would block until the gate opens below (slack: a loaded CI)
        assert time.monotonic() - t0 < 30
    finally:
        gate.set()
    _flush(host)
    abort, comm = heap._abort.cuda_stream, heap._stream.cuda_stream
    assert len({abort, comm, heap._poll.cuda_stream, heap._side.cuda_stream}) == 4
    assert nv(b.calls) == [("signal_op_on_stream", (heap._words.data_ptr() + 8 * 7, 123, SET, 0, abort), host.ident)]
    assert not [x for x in heap._cuda.log if x[0] == "synchronize"]  # no stream synchronized
    with pytest.raises(ValueError, match="signal word"):
        heap.signal_now(0, signal_words(2), 1)  # checked before anything is queued
    _flush(host)
    # The next quiet completes the abort signals (a process leaving after close() keeps them), on
    # the abort stream only: the communication stream may still be held.
    b.calls.clear()
    lease.quiet()
    assert [(n, a) for n, a, _ in nv(b.calls)] == [("quiet_on_stream", (abort,))]
    assert [x[1] for x in heap._cuda.log if x[0] == "synchronize"] == [heap._abort.name]
    lease.quiet()
    assert nv(b.calls) == [("quiet_on_stream", (abort,), host.ident)]  # nothing more to complete


def test_an_abort_signals_every_peer_on_the_abort_stream_and_never_quiets_the_comm_stream(host):
    b = FakeBindings()
    P = 3
    heap = fake_nvshmem_heap(b, rank=1, world_size=P, heap_bytes=1 << 16)
    t = RoutedTransport(_lease(heap, host, 4), timeout_s=5.0, epoch=4)
    b.calls.clear()
    t._abort(TIMED_OUT, "a test's timeout")
    _flush(host)
    abort, sig = heap._abort.cuda_stream, heap._words.data_ptr()
    value = (t.generation << GEN_SHIFT) | abort_low(TIMED_OUT)
    got = nv(b.calls)
    assert sorted(c[1] for c in got) == sorted((sig + 8 * (ABORT * P + 1), value, SET, pe, abort) for pe in (0, 2))
    assert {c[0] for c in got} == {"signal_op_on_stream"} and {c[2] for c in got} == {host.ident}
    assert heap._stream.name not in [x[1] for x in heap._cuda.log if x[0] == "synchronize"]


# ---- 3. streams ----------------------------------------------------------------------------------------
def test_the_heap_makes_four_non_blocking_streams_once_and_every_epoch_shares_them(host, monkeypatch):
    def pool_stream(*a, **k):
        raise AssertionError("torch.cuda.Stream: a pool stream, handed out round robin")
    monkeypatch.setattr(torch.cuda, "Stream", pool_stream)
    b = FakeBindings()
    heap = fake_nvshmem_heap(b)
    made = [a for n, a, _ in b.calls if n == "cuStreamCreate"]
    assert made == [(NON_BLOCKING,)] * 4
    mine = [heap._stream, heap._poll, heap._abort, heap._side]
    assert len({s.cuda_stream for s in mine}) == 4
    heap.submit = host.submit
    reusable = ReusableHeap(HostBoundHeap(heap, host, 5.0))
    for epoch in range(1, 41):  # past torch's 32 pool streams
        st = reusable.lease(epoch).stream_ops(-1)
        assert st._comm is heap._stream and st._side is heap._side and st._side is not st._comm
        st.close()
    assert [a for n, a, _ in b.calls if n == "cuStreamCreate"] == made  # none made per epoch


def test_a_stream_of_its_own_makes_its_streams_with_the_driver():
    b, cuda = FakeBindings(), FakeCuda()
    st = ns.NvshmemStream(torch.zeros(64, dtype=torch.uint8), torch.zeros(4, dtype=torch.int64), 0, -1, bindings=b,
                          submit=lambda fn, *a: fn(*a), device="cpu", cuda=cuda, driver=fake_driver(b.calls))
    assert [a for n, a, _ in b.calls if n == "cuStreamCreate"] == [(NON_BLOCKING,)] * 2
    assert st._comm.cuda_stream != st._side.cuda_stream


@pytest.fixture
def once(monkeypatch):
    monkeypatch.setattr(ns, "_CONNECTIONS_WARNED", threading.Event())


@pytest.mark.parametrize("raw", ["1", "2", "4"])
def test_too_few_device_connections_are_named(raw):
    problem = ns.device_connections_problem({"CUDA_DEVICE_MAX_CONNECTIONS": raw})
    assert problem is not None and f"CUDA_DEVICE_MAX_CONNECTIONS={raw}" in problem
    assert str(ns.DEVICE_CONNECTIONS_NEEDED) in problem


@pytest.mark.parametrize("env", [{}, {"CUDA_DEVICE_MAX_CONNECTIONS": "5"}, {"CUDA_DEVICE_MAX_CONNECTIONS": "8"},
                                 {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}, {"CUDA_DEVICE_MAX_CONNECTIONS": "many"}])
def test_enough_or_default_device_connections_are_fine(env):
    assert ns.device_connections_problem(env) is None


def test_too_few_connections_warn_once_when_the_heap_offers_a_device_driven_stream(host, monkeypatch, once):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # what Megatron sets
    heap = fake_nvshmem_heap()
    with pytest.warns(RuntimeWarning, match="CUDA_DEVICE_MAX_CONNECTIONS=1"):
        heap.stream_ops(-1, submit=host.submit)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        heap.stream_ops(-1, submit=host.submit)  # once per process
    monkeypatch.setattr(ns, "_CONNECTIONS_WARNED", threading.Event())
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        heap.stream_ops(-1, submit=host.submit)


# ---- 4. NVSHMEM_SYMMETRIC_SIZE ---------------------------------------------------------------------------
def test_the_symmetric_size_holds_the_arena_the_words_and_nvshmems_state():
    assert symmetric_size(1 << 30, 4) == (1 << 30) + 8 * signal_words(4) + nv_mod.NVSHMEM_STATE_BYTES
    env = {}
    assert set_symmetric_size(3 << 30, 2, env) == str(symmetric_size(3 << 30, 2)) == env[SIZE]
    env = {SIZE: "123"}
    assert set_symmetric_size(3 << 30, 2, env) == "123" and env == {SIZE: "123"}  # the user's stays


@pytest.fixture
def no_size(monkeypatch):
    """NVSHMEM_SYMMETRIC_SIZE unset here, and as it was after the test (monkeypatch restores a set
    value, and removes one the code under test set)."""
    monkeypatch.setenv(SIZE, "placeholder")
    monkeypatch.delenv(SIZE)


class _Recorder(Nvshmem4py):
    """The real driver's ``configure``, with the NVSHMEM calls replaced by records of the
    environment each one would have read (NVSHMEM reads it at its first call and keeps it)."""

    def __init__(self, heap_bytes):
        self.seen, self.heap_bytes = [], heap_bytes

    def unique_id(self):
        self.seen.append(("unique_id", os.environ.get(SIZE)))
        return b"uid"

    def start(self, uid, rank, world_size, heap_bytes, device):
        self.configure(world_size, heap_bytes)  # as Nvshmem4py.start does
        self.seen.append(("init", os.environ.get(SIZE)))
        return fake_nvshmem_heap(rank=rank, world_size=world_size, heap_bytes=heap_bytes, init_status=LIMITED_MPG)

    def finalize(self, heap):
        self.seen.append(("finalize", None))


@pytest.mark.parametrize("rank", [0, 1])
def test_the_symmetric_size_is_set_before_nvshmems_first_call_and_the_init_status_reported(rank, no_size):
    heap_bytes, P = 1 << 16, 2
    drv = _Recorder(heap_bytes)
    rt = NvshmemRuntime(driver=drv, register_exit=False)
    published = []
    try:
        t = rt.join(rank=rank, world_size=P, timeout_s=5, publish=published.append, heap_bytes=heap_bytes,
                    lookup=lambda: {"uid": b"uid", "heap_bytes": heap_bytes, "reuse": False}, device="cpu", epoch=1)
        want = str(symmetric_size(heap_bytes, P))
        first = [("unique_id", want), ("init", want)] if rank == 0 else [("init", want)]
        assert drv.seen == first
        assert rt.init_status == LIMITED_MPG
        described = rt.describe()
        assert described["init_status"] == LIMITED_MPG and described["symmetric_size"] == want
        assert (described["state"], described["rank"], described["world_size"]) == ("running", rank, P)
        t.close()
        assert rt.finalize(timeout_s=5) and drv.seen[-1] == ("finalize", None)
    finally:
        rt.host.stop()


def test_the_module_unique_id_sets_the_size_first(no_size, monkeypatch):
    seen = []
    monkeypatch.setattr(Nvshmem4py, "unique_id", lambda self: seen.append(os.environ.get(SIZE)) or b"uid")
    assert nv_mod.unique_id(world_size=2, heap_bytes=3 << 30) == b"uid"
    assert seen == [str(symmetric_size(3 << 30, 2))]


# ---- the driver's waits need 64-bit stream memory operations ------------------------------------------
def test_a_device_without_64_bit_stream_memops_keeps_nvshmem_host_driven(host):
    b = FakeBindings()
    module = FakeCudaDriver(b.calls)
    module.mem64 = 0
    whole = torch.zeros(4096 + 8 * signal_words(2), dtype=torch.uint8)
    heap = NvshmemHeap(whole, 0, 2, 4096, torch.device("cpu"), b, cuda=FakeCuda(),
                       driver=StreamDriver(0, 0, module, require=False))  # the heap itself needs none
    with pytest.warns(RuntimeWarning, match="no 64-bit stream memory operations.*host-driven"):
        assert heap.stream_ops(-1, submit=host.submit) is None
