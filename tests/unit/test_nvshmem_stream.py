"""The GPU PE stream (transport/nvshmem_stream.py NvshmemStream) with fake bindings, a fake CUDA
driver (test_memop_stream's) and a fake CUDA, on the CPU: how each PeStream operation maps to
nvshmem4py's ``*_on_stream`` calls (addresses, values, constants, PE, stream handle) and a wait to
the driver's ``cuStreamWaitValue64`` (GEQ), the quiet before a signal to a peer with plain puts, that
every binding call and every enqueue on the communication stream ran on the host thread in order,
that ``force`` works while the communication stream and the host thread are blocked, snapshots,
markers and failures; and how the NVSHMEM heap, its host binding and a lease offer the stream.
The fake bindings refuse, as NVSHMEM 3.4.5 does in limited MPG runs (several PEs per GPU without
MPS), every call that exits the process there (test_nvshmem_stream_cpu.py has the rest of that).

The last two tests run on a real GPU heap (``-m nvshmem``; skipped without nvshmem4py and CUDA), 2
PEs (with one GPU they share it: limited MPG unless MPS runs, NVSHMEM's init status is reported as a
warning): device-driven exchanges, then the heap's streams (distinct, shared by 40 epochs' streams),
a held wait ended by force and a ``signal_now`` past it; and a static heap (``NVSHMEM_DISABLE_CUDA_VMM=1``)
above NVSHMEM's 1 GiB default size, which needs ``NVSHMEM_SYMMETRIC_SIZE`` before world rank 0's unique id.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import warnings
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from distca_server.errors import DistCAError
from distca_server.transport.memop_stream import StreamDriver
from distca_server.transport.nvshmem import HostBoundHeap, HostThread, NvshmemHeap, NvshmemRuntime
from distca_server.transport.nvshmem_stream import DeviceSnapshot, NvshmemStream, missing_bindings
from distca_server.transport.routed import RoutedTransport
from distca_server.transport.symmetric import ReusableHeap
from distca_server.transport.symmetric_words import signal_words

from test_heap_lifecycle import FakeDriver, Relay, _join
from test_memop_stream import GEQ, FakeDriver as FakeCudaDriver
from test_transport_routed import in_threads, payload, play, recv_splits

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SET, GE = 7, 5  # distinct from each other and from any PE, slot or value used below
WORDS = 24


def _handle(x):
    """A Cython ``intptr_t`` argument: an int (a torch stream or tensor is a TypeError)."""
    if not isinstance(x, int) or isinstance(x, bool):
        raise TypeError(f"an integer is required, got {type(x).__name__}")
    return x


def _unsigned(x, bits=64):
    """A Cython ``uint64_t`` / ``size_t`` argument (OverflowError outside [0, 2**bits))."""
    if not 0 <= _handle(x) < 1 << bits:
        raise OverflowError(f"can't convert {x} to uint{bits}_t")
    return x


def _c_int(x):
    if not -(1 << 31) <= _handle(x) < 1 << 31:
        raise OverflowError(f"value {x} too large to convert to int")
    return x


# nvshmem4py calls whose NVSHMEM 3.4.5 host function begins with
# NVSHMEM_API_NOT_SUPPORTED_WITH_LIMITED_MPG_RUNS() (fprintf, exit(-1)): the waits of
# src/host/comm/sync.cpp, the collectives of src/host/coll/, the team calls of src/host/team/.
LIMITED_MPG_EXITS = ("signal_wait_until_on_stream", "uint64_wait_until_on_stream", "uint64_wait_until_all_on_stream",
                     "uint64_wait_until_all_vector_on_stream", "barrier", "barrier_on_stream", "barrier_all_on_stream",
                     "sync_all_on_stream", "team_sync", "team_sync_on_stream", "alltoallmem_on_stream",
                     "broadcastmem_on_stream", "fcollectmem_on_stream", "team_split_strided", "team_split_2d")


class LimitedMpgExit(SystemExit):
    """What NVSHMEM does when a limited-MPG run calls one of :data:`LIMITED_MPG_EXITS`."""


class FakeBindings:
    """nvshmem4py's bindings: records ``(name, args, thread identity)``; ``fail`` names a call
    that raises. The calls take the real signatures, argument for argument, and check their
    types as the Cython wrappers do (nvshmem4py 0.4.1, nvshmem/bindings/nvshmem.pyx).

    As in a limited MPG run (this project's one-GPU setup), every call of
    :data:`LIMITED_MPG_EXITS` records ``("EXIT", name)`` and raises :class:`LimitedMpgExit`."""

    class Signal_op:  # real: IntEnum, SIGNAL_SET = 9, SIGNAL_ADD = 10 (the code reads the names)
        SIGNAL_SET, SIGNAL_ADD = SET, 1

    class Cmp_type:  # real: IntEnum, CMP_EQ = 0, ..., CMP_GE = 5
        CMP_EQ, CMP_GE = 0, GE

    def __init__(self):
        self.calls: list = []
        self.fail: str | None = None

    def __getattr__(self, name):
        if name in LIMITED_MPG_EXITS:
            def exits(*args):
                self.calls.append(("EXIT", (name,) + args, threading.get_ident()))
                raise LimitedMpgExit(f"Called NVSHMEM API {name} not supported with limited MPG runs")
            return exits
        raise AttributeError(name)

    def _rec(self, name, *args):
        self.calls.append((name, args, threading.get_ident()))
        if name == self.fail:
            raise RuntimeError(f"{name} failed")

    # putmem_on_stream(intptr_t dest, intptr_t source, size_t bytes, int pe, intptr_t cstrm)
    def putmem_on_stream(self, dest, source, bytes, pe, cstrm):
        self._rec("putmem_on_stream", _handle(dest), _handle(source), _unsigned(bytes), _c_int(pe), _handle(cstrm))

    # putmem_signal_on_stream(intptr_t dest, intptr_t source, size_t bytes, intptr_t sig_addr,
    #                         uint64_t signal, int sig_op, int pe, intptr_t cstrm)
    def putmem_signal_on_stream(self, dest, source, bytes, sig_addr, signal, sig_op, pe, cstrm):
        self._rec("putmem_signal_on_stream", _handle(dest), _handle(source), _unsigned(bytes), _handle(sig_addr),
                  _unsigned(signal), _c_int(sig_op), _c_int(pe), _handle(cstrm))

    # signal_op_on_stream(intptr_t sig_addr, uint64_t signal, int sig_op, int pe, intptr_t cstrm)
    def signal_op_on_stream(self, sig_addr, signal, sig_op, pe, cstrm):
        self._rec("signal_op_on_stream", _handle(sig_addr), _unsigned(signal), _c_int(sig_op), _c_int(pe),
                  _handle(cstrm))

    # quiet_on_stream(intptr_t cstrm)
    def quiet_on_stream(self, cstrm):
        self._rec("quiet_on_stream", _handle(cstrm))


class FakeStream:
    """A CUDA stream; with ``cuda``, its ``wait_event`` keeps CUDA's stream capture rules (CUDA
    Programming Guide, stream capture): a capturing stream may not wait for an event recorded
    outside the capture, and a stream outside it that waits for a captured event is pulled in."""

    def __init__(self, name, log, handle, cuda=None):
        self.name, self.log, self.cuda_stream, self.cuda = name, log, handle, cuda

    def synchronize(self):
        self.log.append(("synchronize", self.name, threading.get_ident()))

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name, threading.get_ident()))

    def wait_event(self, event):
        if self.cuda is not None and getattr(event, "stream", None) is not None:
            capturing = self.cuda.capturing == self.name
            if capturing and not event.captured:
                raise RuntimeError(f"stream {self.name} is capturing: waiting for a non-captured event "
                                   f"invalidates the capture")
            if not capturing and event.captured:
                raise RuntimeError(f"stream {self.name} waited for a captured event: it joins the capture, "
                                   f"which ends unjoined")
        self.log.append(("wait_event", self.name, event, threading.get_ident()))


class FakeEvent:
    def __init__(self, log, cuda=None):
        self.log, self.stream, self.complete, self.cuda, self.captured = log, None, True, cuda, False

    def record(self, stream):
        self.stream = stream
        self.captured = self.cuda is not None and self.cuda.capturing == stream.name
        self.log.append(("record", stream.name, self, threading.get_ident()))

    def query(self):
        if self.captured:  # CUDA: cudaErrorCapturedEvent
            raise RuntimeError("operation not permitted on an event last recorded in a capturing stream")
        return self.stream is None or self.complete  # as CUDA: an event never recorded has passed


class FakeCuda:
    """:class:`TorchCuda`'s methods over CPU tensors; records ``(what, stream, ..., thread)``."""

    def __init__(self):
        self.log: list = []
        self.caller = FakeStream("caller", self.log, 100, self)
        self.capturing: str | None = None  # the name of the stream in capture

    def index(self):
        return 0

    def wrap(self, handle):  # torch.cuda.ExternalStream over a stream the driver made
        assert isinstance(handle, int) and not isinstance(handle, bool), handle
        return FakeStream(f"s{handle}", self.log, handle, self)

    def current_stream(self):
        return self.caller

    @contextmanager
    def use(self, stream):
        self.log.append(("use", stream.name, threading.get_ident()))
        yield

    def event(self):
        return FakeEvent(self.log, self)

    def pinned(self, n, dtype):
        return torch.zeros(n, dtype=dtype)

    def keep(self, tensor, stream):
        self.log.append(("keep", stream.name, tensor.data_ptr(), threading.get_ident()))

    def handle(self, stream):
        return stream.cuda_stream

    def graph(self):
        return SimpleNamespace(name="graph")

    def capture_begin(self, graph, stream):
        self.capturing = stream.name
        self.log.append(("capture_begin", stream.name, graph, threading.get_ident()))

    def capture_end(self, graph, stream):
        self.capturing = None
        self.log.append(("capture_end", stream.name, graph, threading.get_ident()))

    def replay(self, graph, stream):
        self.log.append(("replay", stream.name, graph, threading.get_ident()))


# The fake CUDA driver's setup calls and context switches, left out of what the tests compare.
DRIVER_SETUP = {"cuInit", "cuDeviceGet", "cuDeviceGetAttribute", "cuDevicePrimaryCtxRetain", "cuCtxPushCurrent",
                "cuCtxPopCurrent", "cuStreamCreate"}


def nv(calls):
    """The binding calls and the driver's stream operations, in order (setup and contexts left out)."""
    return [c for c in calls if c[0] not in DRIVER_SETUP]


def fake_driver(log: list) -> StreamDriver:
    """The real :class:`StreamDriver` over test_memop_stream's fake driver module, recording into
    ``log`` (the bindings' calls list: one order for both)."""
    return StreamDriver(0, 0, FakeCudaDriver(log))


@pytest.fixture
def env():
    host = HostThread("test-nvshmem-stream")
    b, cuda = FakeBindings(), FakeCuda()
    drv = fake_driver(b.calls)
    comm = FakeStream("comm", cuda.log, 42, cuda)
    arena = torch.zeros(1 << 12, dtype=torch.uint8)
    words = torch.zeros(WORDS, dtype=torch.int64)

    def make(submit=host.submit, **kw):
        return NvshmemStream(arena, words, 0, -1, bindings=b, submit=submit, device="cpu", cuda=cuda, driver=drv,
                             comm=comm, dirty=set(), **kw)
    e = SimpleNamespace(host=host, b=b, cuda=cuda, drv=drv, comm=comm, arena=arena, words=words, make=make,
                        sig=words.data_ptr(), flush=lambda: host.call(lambda: None, timeout_s=5),
                        calls=lambda: nv(b.calls))
    yield e
    host.stop()


def names(calls):
    return [c[0] for c in nv(calls)]


def test_operations_map_to_the_bindings_on_the_host_thread(env):
    st = env.make()
    base, sig = env.arena.data_ptr(), env.sig
    a, b = torch.arange(10, dtype=torch.uint8), torch.arange(6, dtype=torch.uint8)
    rep = torch.arange(16, dtype=torch.uint8)
    st.begin()
    st.signal(1, 3, 11)  # credit: nothing put to 1 yet, so no quiet
    st.wait_ge(4, 12)
    st.put(1, 64, a, credit=4)  # credit is accepted and ignored
    st.put(1, 128, b)
    st.put(2, 0, b)
    st.put_signal(1, 256, rep, 9, 13)  # plain puts to 1 before: quiet first
    st.signal(2, 10, 14)  # the quiet covered PE 2's put too: no second quiet
    st.put_signal(2, 512, rep, 11, 15)
    env.flush()
    assert st.error is None, st.error
    assert env.calls() == [
        ("signal_op_on_stream", (sig + 8 * 3, 11, SET, 1, 42), env.host.ident),
        ("cuStreamWaitValue64", (42, sig + 8 * 4, 12, GEQ), env.host.ident),  # the driver's, not NVSHMEM's
        ("putmem_on_stream", (base + 64, a.data_ptr(), 10, 1, 42), env.host.ident),
        ("putmem_on_stream", (base + 128, b.data_ptr(), 6, 1, 42), env.host.ident),
        ("putmem_on_stream", (base + 0, b.data_ptr(), 6, 2, 42), env.host.ident),
        ("quiet_on_stream", (42,), env.host.ident),
        ("putmem_signal_on_stream", (base + 256, rep.data_ptr(), 16, sig + 8 * 9, 13, SET, 1, 42), env.host.ident),
        ("signal_op_on_stream", (sig + 8 * 10, 14, SET, 2, 42), env.host.ident),
        ("putmem_signal_on_stream", (base + 512, rep.data_ptr(), 16, sig + 8 * 11, 15, SET, 2, 42), env.host.ident),
    ]
    # begin: the event is recorded on the caller's stream here, the comm stream waits there.
    me = threading.get_ident()
    (rec,) = [x for x in env.cuda.log if x[0] == "record"]
    (wait,) = [x for x in env.cuda.log if x[0] == "wait_event"]
    assert rec[1] == "caller" and rec[3] == me
    assert wait[1] == "comm" and wait[2] is rec[2] and wait[3] == env.host.ident
    # Sources are marked as used by the comm stream, on the calling thread.
    kept = {(x[2], x[3]) for x in env.cuda.log if x[0] == "keep" and x[1] == "comm"}
    assert kept == {(t.data_ptr(), me) for t in (a, b, rep)}


def test_a_signal_after_puts_to_the_same_peer_is_preceded_by_a_quiet(env):
    st = env.make()
    x = torch.ones(8, dtype=torch.uint8)
    st.put(3, 0, x)
    st.signal(3, 1, 5)
    st.signal(3, 2, 6)  # nothing put since the quiet
    st.put(3, 8, x)
    st.put_signal(3, 16, x, 2, 7)
    env.flush()
    assert names(env.b.calls) == ["putmem_on_stream", "quiet_on_stream", "signal_op_on_stream", "signal_op_on_stream",
                                  "putmem_on_stream", "quiet_on_stream", "putmem_signal_on_stream"]


def test_copies_snapshots_and_markers_are_queued_in_order_on_the_host_thread(env):
    st = env.make()
    env.words[:] = torch.arange(WORDS) * 3
    env.arena[:64] = torch.arange(64, dtype=torch.uint8)
    src = torch.arange(32, dtype=torch.uint8) + 100
    st.wait_ge(0, 1)
    st.copy(env.arena[1024:1056], src)
    snap = st.snapshot(32, 48)
    marker = st.mark()
    env.flush()
    assert torch.equal(env.arena[1024:1056], src)
    words, table = snap.value()
    assert isinstance(snap, DeviceSnapshot)
    assert words.shape == (WORDS,) and str(words.dtype) == "int64" and words.tolist() == list(range(0, 3 * WORDS, 3))
    assert table.shape == (6,) and str(table.dtype) == "int64"
    assert table.tolist() == env.arena[32:80].view(torch.int64).tolist()
    # Every enqueue on the comm stream ran on the host thread, after the wait submitted before it.
    uses = [x for x in env.cuda.log if x[0] == "use"]
    assert [x[1] for x in uses] == ["comm", "comm"] and {x[2] for x in uses} == {env.host.ident}
    (rec,) = [x for x in env.cuda.log if x[0] == "record"]
    assert rec[1] == "comm" and rec[3] == env.host.ident and rec[2] is marker.event
    assert marker.done()
    with pytest.raises(ValueError, match="not int64 words"):
        st.snapshot(0, 12)


def test_fill_and_capture_run_on_the_host_thread_around_the_recorded_calls(env):
    st = env.make()
    st.fill(2, 3, 7)
    with st.capture() as graph:
        st.wait_ge(5, 9)
        st.signal(1, 4, 9)
    st.replay(graph)
    env.flush()
    assert env.words[:6].tolist() == [0, 0, 7, 7, 7, 0]
    # capture begins and ends on the host thread, around the calls issued there, on the comm stream
    log = [(x[0], x[1]) for x in env.cuda.log if x[0] in ("use", "capture_begin", "capture_end", "replay")]
    assert log == [("use", "comm"), ("capture_begin", "comm"), ("capture_end", "comm"), ("replay", "comm")]
    assert {x[-1] for x in env.cuda.log if x[0] != "keep"} == {env.host.ident}
    assert names(env.b.calls) == ["cuStreamWaitValue64", "signal_op_on_stream"] and st.error is None
    with pytest.raises(ValueError, match="outside"):
        st.fill(WORDS - 1, 2, 0)


def test_inside_a_capture_begin_waits_for_nothing_and_markers_order_nothing(env):
    """CUDA's capture rules (kept by the fake streams): the comm stream, capturing on the host
    thread, must not wait for begin's event from the caller's stream, and the caller's stream must
    not wait for a marker's captured event (it would join the capture). The replay's begin and
    marker, outside the capture, order the graph."""
    st = env.make()
    with st.capture() as graph:
        st.begin()
        st.signal(1, 4, 9)
        marker = st.mark()
        marker.join()
    env.flush()
    assert st.error is None, st.error
    assert marker.captured and marker.done() and marker.wait(0)
    assert [x for x in env.cuda.log if x[0] == "wait_event"] == []
    st.begin()
    st.replay(graph)
    after = st.mark()
    env.flush()
    after.join()
    assert st.error is None and not after.captured and after.done()
    assert [x[1] for x in env.cuda.log if x[0] == "wait_event"] == ["comm", "caller"]


def test_stamp_fills_a_tensor_on_the_comm_stream_from_the_host_thread(env):
    st = env.make()
    rows = torch.zeros(2, 4, dtype=torch.int64)
    st.stamp(rows[:, 0], 77)
    env.flush()
    assert rows.tolist() == [[77, 0, 0, 0], [77, 0, 0, 0]]
    assert [(x[0], x[1], x[-1]) for x in env.cuda.log if x[0] == "use"] == [("use", "comm", env.host.ident)]
    with pytest.raises(ValueError, match="stamp needs an int64 tensor"):
        st.stamp(torch.zeros(2, dtype=torch.int32), 1)


def test_markers_poll_their_event_within_the_bound_and_join_the_callers_stream(env):
    st = env.make(timeout_s=0.2)
    gate = threading.Event()
    env.host.submit(gate.wait)  # the host thread is busy: the marker is not recorded yet
    try:
        marker = st.mark()
        assert not marker.done()
        t0 = time.monotonic()
        assert not marker.wait(0.05)
        with pytest.raises(DistCAError, match="did not queue the exchange within 0.2 s"):
            marker.join()
        assert time.monotonic() - t0 < 5
    finally:
        gate.set()
    marker.event.complete = False  # once recorded, the stream has not passed it yet
    env.flush()
    t0 = time.monotonic()
    assert not marker.done() and not marker.wait(0.05)
    assert time.monotonic() - t0 < 5
    marker.join()
    joined = [x for x in env.cuda.log if x[0] == "wait_event" and x[1] == "caller"]
    assert joined == [("wait_event", "caller", marker.event, threading.get_ident())]
    marker.event.complete = True
    assert marker.wait(1.0) and marker.done()
    marker.event.query = None  # passed once, passed for good: no further query
    assert marker.done()


def test_force_writes_the_word_now_without_the_comm_stream_or_the_host_thread(env):
    submitted = []
    st = env.make(submit=lambda fn, *a: (submitted.append(fn), env.host.submit(fn, *a)))
    gate = threading.Event()
    env.host.submit(gate.wait)  # a host-driven quiet waiting on the blocked comm stream, say
    try:
        st.wait_ge(5, 99)  # queued behind it
        n = len(submitted)
        st.force(5, 1234)
        assert int(env.words[5]) == 1234  # at once: the host thread is still blocked
        assert len(submitted) == n and env.calls() == []
        uses = [x for x in env.cuda.log if x[0] == "use"]
        assert uses == [("use", st._side.name, threading.get_ident())] and st._side is not env.comm
        with pytest.raises(ValueError):
            st.force(WORDS, 1)
    finally:
        gate.set()
    env.flush()
    assert names(env.b.calls) == ["cuStreamWaitValue64"] and st.error is None


def test_a_failed_call_is_kept_later_work_skipped_and_markers_still_pass(env):
    st = env.make()
    env.b.fail = "putmem_on_stream"
    x = torch.ones(4, dtype=torch.uint8)
    st.put(1, 0, x)
    st.wait_ge(1, 1)
    marker = st.mark()
    env.flush()
    assert isinstance(st.error, RuntimeError) and "putmem_on_stream failed" in str(st.error)
    assert names(env.b.calls) == ["putmem_on_stream"] and marker.done()
    st.signal(1, 1, 1)  # skipped at once
    env.flush()
    assert names(env.b.calls) == ["putmem_on_stream"]
    # A host thread that cannot take work (stuck, stopped): the error is kept, markers pass.
    stuck = env.make(submit=lambda fn, *a: (_ for _ in ()).throw(DistCAError("stuck in quiet")))
    stuck.signal(1, 1, 1)
    m = stuck.mark()
    assert isinstance(stuck.error, DistCAError) and m.done() and m.wait(0)
    stuck.close()
    with pytest.raises(DistCAError, match="closed"):
        stuck.signal(1, 1, 1)


def test_bad_arguments_are_refused_before_anything_is_queued(env):
    st = env.make()
    with pytest.raises(ValueError, match="contiguous"):
        st.put(1, 0, torch.zeros(8, 2, dtype=torch.uint8)[:, 0])
    with pytest.raises(ValueError, match="outside"):
        st.put(1, env.arena.numel() - 2, torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="signal word"):
        st.signal(1, WORDS, 1)
    with pytest.raises(ValueError, match="elements"):
        st.copy(env.arena[:4], torch.zeros(5, dtype=torch.uint8))
    with pytest.raises(ValueError, match="signal word"):
        st.wait_ge(WORDS, 1)
    env.flush()
    assert env.calls() == []
    assert st.synchronous is False


def test_missing_bindings_are_named():
    class Old:
        putmem_on_stream = putmem_signal_on_stream = signal_op_on_stream = staticmethod(print)
    assert missing_bindings(Old) == ["quiet_on_stream", "Signal_op.SIGNAL_SET"]
    # NVSHMEM's own wait is not needed (the driver waits): a bindings without it is complete.
    assert missing_bindings(FakeBindings()) == [] and not hasattr(FakeBindings, "signal_wait_until_on_stream")
    with pytest.raises(DistCAError, match="quiet_on_stream, Signal_op.SIGNAL_SET"):
        NvshmemStream(torch.zeros(8, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64), 0, 0, bindings=Old,
                      submit=None, device="cpu", cuda=FakeCuda())


# ---- how the heap offers the stream ------------------------------------------------------------------
def test_the_real_bindings_take_the_fakes_signatures():
    """nvshmem4py's Cython bindings (where installed): every call the stream makes takes the
    parameters FakeBindings takes, in the same order (the docstrings open with the signature,
    e.g. "putmem_on_stream(intptr_t dest, intptr_t source, size_t bytes, int pe, intptr_t cstrm)"),
    and the constants are there."""
    import inspect
    import re
    b = pytest.importorskip("nvshmem.bindings")
    assert missing_bindings(b) == []
    assert int(b.Signal_op.SIGNAL_SET) != int(b.Signal_op.SIGNAL_ADD)
    for name in ("putmem_on_stream", "putmem_signal_on_stream", "signal_op_on_stream", "quiet_on_stream"):
        first = (getattr(b, name).__doc__ or "").strip().splitlines()[:1]
        m = re.match(r"\w+\((.*?)\)", first[0]) if first else None
        if m is None:
            continue
        real = [p.split()[-1].lstrip("*") for p in m.group(1).split(",") if p.strip()]
        fake = list(inspect.signature(getattr(FakeBindings, name)).parameters)[1:]
        assert real == fake, (name, real, fake)


HEAP_BYTES = 4096


def fake_nvshmem_heap(bindings=None, cuda=None, rank=1, world_size=2, heap_bytes=HEAP_BYTES, **kw):
    """A real :class:`NvshmemHeap` over a CPU "symmetric" tensor, fake bindings, the fake CUDA and
    the fake driver (recording into the bindings' calls)."""
    bindings = FakeBindings() if bindings is None else bindings
    cuda = FakeCuda() if cuda is None else cuda
    whole = torch.zeros(heap_bytes + 8 * signal_words(world_size), dtype=torch.uint8)
    return NvshmemHeap(whole, rank, world_size, heap_bytes, torch.device("cpu"), bindings,
                       driver=StreamDriver(0, rank, FakeCudaDriver(bindings.calls)), cuda=cuda, **kw)


def test_the_nvshmem_heap_offers_a_stream_on_its_own_comm_stream_through_its_host_thread():
    b = FakeBindings()
    heap = fake_nvshmem_heap(b)
    heap._dirty.add(0)
    comm = heap._stream.cuda_stream
    host = HostThread("test-offer")
    try:
        lease = ReusableHeap(HostBoundHeap(heap, host, 7.5)).lease(3)
        st = lease.stream_ops(99)  # HeapLease -> HostBoundHeap -> NvshmemHeap, with the host thread
        assert isinstance(st, NvshmemStream) and st.abort_value == 99 and st.rank == 1
        assert st._comm is heap._stream and st._dirty is heap._dirty and st._timeout_s == 7.5
        assert st._side is heap._side and st._drv is heap._drv and st._cuda is heap._cuda
        st.signal(0, 2, 5)  # PE 0 had a host-driven put: the shared bookkeeping asks for a quiet
        host.call(lambda: None, timeout_s=5)
        assert [(n, a[-1], t) for n, a, t in nv(b.calls)] == [("quiet_on_stream", comm, host.ident),
                                                              ("signal_op_on_stream", comm, host.ident)]
        # An endpoint without stream_ops has none behind the binding and the lease either.
        plain = ReusableHeap(HostBoundHeap(_Plain(), host, 1)).lease(1)
        assert getattr(plain, "stream_ops", None) is None
        # An nvshmem4py without the calls: a warning, and the exchanges stay host-driven.
        heap._bindings = SimpleNamespace(**{n: getattr(b, n) for n in ("putmem_on_stream", "putmem_signal_on_stream",
                                                                       "signal_op_on_stream")},
                                         Signal_op=FakeBindings.Signal_op)
        with pytest.warns(RuntimeWarning, match="quiet_on_stream"):
            assert heap.stream_ops(1, submit=host.submit) is None
    finally:
        host.stop()


class _Plain:
    rank, world_size, device, arena = 0, 1, torch.device("cpu"), torch.zeros(8, dtype=torch.uint8)


def test_the_nvshmem_join_path_returns_a_routed_transport():
    """Over the fake NVSHMEM runtime (shared memory, a CPU stream): routed, and its routes run."""
    from distca_server.transport.shm import destroy_heap
    P = 2
    drivers = [FakeDriver(P) for _ in range(P)]
    rts = [NvshmemRuntime(driver=drivers[r], register_exit=False) for r in range(P)]
    relay = Relay()
    try:
        eps = in_threads(P, lambda r: _join(rts[r], relay, 1, r, P))
        assert all(isinstance(t, RoutedTransport) for t in eps)
        splits = [[[64] * P] for _ in range(P)]
        in_threads(P, lambda r: play(eps[r], [("r", splits)] * 4))
        assert [t.device_exchanges for t in eps] == [2, 2]  # grow, install, then device-driven
        for t in eps:
            t.close()
    finally:
        for rt in rts:
            rt.host.stop()
        for d in drivers:
            for h in d.handles:
                destroy_heap(h)


def test_importing_the_nvshmem_modules_needs_neither_nvshmem4py_nor_cuda():
    code = ("import sys, torch, distca_server.transport.nvshmem, distca_server.transport.nvshmem_stream\n"
            "assert not any(m == 'nvshmem' or m.startswith(('nvshmem.', 'cuda.core')) for m in sys.modules)\n"
            "assert not torch.cuda.is_initialized()\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


# ---- on a real GPU heap ------------------------------------------------------------------------------
def gpu_splits(P: int):
    """``splits[src][s][dst]``: two segments, every pair's sizes different."""
    return [[[64 * (1 + src + 2 * dst) for dst in range(P)], [8 * (src + 1)] * P] for src in range(P)]


EPOCHS = 40  # device-driven streams made on one heap: past torch's 32 pool streams


def _gpu_stream_checks(t, rank: int, P: int) -> dict:
    """After the exchanges, on the real heap: its four streams are distinct; :data:`EPOCHS` streams
    offered by the lease share its communication and force streams; PE 0 holds its communication
    stream in a wait (the driver's, as in any exchange), sends PE 1 a ``signal_now`` past it, then
    ends the wait with a force from another thread; PE 1 sees the signal. Uses the last two graph
    words, which no exchange of this test touches. Each check bounded (seconds in the result)."""
    from distca_server.transport.nvshmem import runtime
    heap = runtime().heap.heap.heap  # ReusableHeap -> HostBoundHeap -> NvshmemHeap
    words = heap._words.numel()
    held_slot, now_slot, now_value = words - 1, words - 2, 7 << 40
    out = {"streams": len({s.cuda_stream for s in (heap._stream, heap._poll, heap._abort, heap._side)})}
    streams = [t.heap.stream_ops(t.abort_value) for _ in range(EPOCHS)]
    out["shared"] = all(st._comm is heap._stream and st._side is heap._side for st in streams)
    st = streams[-1]
    if rank == 0:
        st.begin()
        st.wait_ge(held_slot, 1 << 62)
        marker = st.mark()
        time.sleep(0.3)
        out["held"] = not marker.done()
        t.heap.signal_now(1, now_slot, now_value)  # past the held stream
        t0 = time.monotonic()
        force = threading.Thread(target=st.force, args=(held_slot, 1 << 62))
        force.start()
        force.join(10)
        out["forced"], out["force_s"] = marker.wait(10), time.monotonic() - t0
        out["error"] = repr(st.error)
    else:
        t0, seen = time.monotonic(), False
        while not seen and time.monotonic() - t0 < 20:
            seen = int(t.heap.signals()[now_slot]) == now_value
            time.sleep(0.01)
        out["signal_now_seen"], out["signal_now_s"] = seen, time.monotonic() - t0
    for other in streams:
        other.close()
    return out


def _gpu_worker(rank: int, P: int, uids, results) -> None:
    from distca_server.transport.nvshmem import join_nvshmem, runtime
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    t = join_nvshmem(rank=rank, world_size=P, timeout_s=30, device=device, heap_bytes=64 << 20,
                     publish=lambda uid: [uids.put(uid) for _ in range(P - 1)], lookup=lambda: uids.get(timeout=120))
    splits = gpu_splits(P)
    rs = recv_splits(splits, rank)
    got = []
    for step in range(6):  # grow, install, then device-driven
        recv = [t.buffer(f"recv-{s}", sum(x)) for s, x in enumerate(rs)]
        send = [x.to(device) for x in payload(rank, splits, step)]
        t.exchange(send, splits[rank], recv, rs, route=("gpu", "r")).wait()
        got.append([x.cpu() for x in recv])  # on the caller's stream, which waited for the exchange
    checks = _gpu_stream_checks(t, rank, P)
    results.put((rank, {"type": type(t).__name__, "device_exchanges": t.device_exchanges, "got": got,
                        "nvshmem": runtime().describe(), "checks": checks, "gpus": torch.cuda.device_count()}))
    t.close()
    runtime().finalize(timeout_s=60)
    results.close()
    results.join_thread()
    os._exit(0)


def _spawn(target, P: int, *args, timeout_s: float = 300) -> dict:
    """Run ``target(rank, P, uids, results, *args)`` in ``P`` spawned PE processes; their results
    by rank, failing at once when one died (``get_result``)."""
    import torch.multiprocessing as mp
    from test_transport_nvshmem import get_result
    ctx = mp.get_context("spawn")
    uids, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, P, uids, results) + args) for r in range(P)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        return dict(get_result(results, procs, deadline) for _ in range(P))
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


@pytest.mark.gpu
@pytest.mark.nvshmem
def test_two_pes_exchange_device_driven_on_the_gpu_heap():
    """With one GPU the PEs share it: NVSHMEM runs in limited MPG mode (unless MPS runs), where its
    own stream waits exit the process; the driver's waits, NVSHMEM's puts and signals all work."""
    from distca_server.transport.nvshmem import LIMITED_MPG
    P = 2
    got = _spawn(_gpu_worker, P)
    splits = gpu_splits(P)
    status = {me: got[me]["nvshmem"]["init_status"] for me in range(P)}
    warnings.warn(f"NVSHMEM init status per PE: {status} ({got[0]['gpus']} GPUs)")  # the session's log shows it
    for me in range(P):
        assert got[me]["type"] == "RoutedTransport" and got[me]["device_exchanges"] >= 3, got[me]["device_exchanges"]
        if got[me]["gpus"] < P:  # several PEs on one GPU
            assert status[me] in (LIMITED_MPG, "STATUS_FULL_MPG"), status
        for step, recv in enumerate(got[me]["got"]):
            for s, buf in enumerate(recv):
                want = []
                for src in range(P):
                    at = sum(splits[src][s][:me])
                    want.append(payload(src, splits, step)[s][at:at + splits[src][s][me]])
                assert torch.equal(buf, torch.cat(want)), (me, step, s)
    c0, c1 = got[0]["checks"], got[1]["checks"]
    assert c0["streams"] == c1["streams"] == 4 and c0["shared"] and c1["shared"], (c0, c1)
    assert c0["held"], "the driver's wait did not hold the communication stream"
    assert c0["forced"] and c0["force_s"] < 10, f"force did not end the held wait: {c0}"
    assert c0["error"] == "None", c0["error"]
    assert c1["signal_now_seen"], f"PE 0's signal_now did not pass its held communication stream: {c1}"


STATIC_HEAP_BYTES = 1536 << 20  # above NVSHMEM's 1 GiB default symmetric size


def _gpu_static_worker(rank: int, P: int, uids, results) -> None:
    from distca_server.transport.nvshmem import join_nvshmem, runtime
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    t = join_nvshmem(rank=rank, world_size=P, timeout_s=60, device=device, heap_bytes=STATIC_HEAP_BYTES,
                     publish=lambda uid: [uids.put(uid) for _ in range(P - 1)], lookup=lambda: uids.get(timeout=120))
    splits = gpu_splits(P)
    rs = recv_splits(splits, rank)
    recv = [t.buffer(f"recv-{s}", sum(x)) for s, x in enumerate(rs)]
    t.exchange([x.to(device) for x in payload(rank, splits, 0)], splits[rank], recv, rs).wait()
    results.put((rank, {"nvshmem": runtime().describe(), "arena": t.heap.arena.numel()}))
    t.close()
    runtime().finalize(timeout_s=60)
    results.close()
    results.join_thread()
    os._exit(0)


@pytest.mark.gpu
@pytest.mark.nvshmem
def test_a_static_heap_above_nvshmems_default_size_starts_on_every_pe(monkeypatch):
    """NVSHMEM_DISABLE_CUDA_VMM=1 (a static heap of NVSHMEM_SYMMETRIC_SIZE, read at NVSHMEM's first
    call): world rank 0's first call is its unique id, so the size must be set before it, or rank 0
    keeps the 1 GiB default and its allocation fails."""
    from distca_server.transport.nvshmem import symmetric_size
    monkeypatch.setenv("NVSHMEM_DISABLE_CUDA_VMM", "1")
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "placeholder")
    monkeypatch.delenv("NVSHMEM_SYMMETRIC_SIZE")  # the PEs inherit this environment (spawn)
    P = 2
    got = _spawn(_gpu_static_worker, P, timeout_s=240)
    for me in range(P):
        assert got[me]["arena"] == STATIC_HEAP_BYTES
        assert got[me]["nvshmem"]["symmetric_size"] == str(symmetric_size(STATIC_HEAP_BYTES, P)), got[me]
