"""The in-process CUDA PE stream (transport/memop_stream.py MemopStream) with a fake driver module and a
fake CUDA, on the CPU: how each PeStream operation maps to the driver's stream memory operations (the
stream handle, ``words[pe].data_ptr() + 8 * slot``, the 64-bit values, the write flag with its memory
barrier and the GEQ wait), that a put's copy is queued before its signal on the communication
stream, that every driver call runs with the device's context pushed, that ``force`` writes on a
stream of its own from any thread, failed driver results, the 64-bit capability check, snapshots,
markers and close.

The fake driver performs each write on the CPU words (8 bytes at the address), so the words say what
a signal or force did; the copies run at once on CPU tensors.

The ``gpu`` tests run two PEs of one process on a real CUDA device, each in a subprocess with a
timeout (a wait that never ends cannot hang the test run).
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import os
import re
import subprocess
import sys
import threading
import time
from enum import IntEnum

import pytest
import torch

import distca_server.transport.memop_stream as ms
from distca_server.errors import DistCAError
from distca_server.transport.memop_stream import MemopStream, load_driver
from distca_server.transport.nvshmem_stream import CudaMarker, DeviceSnapshot

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WRITE, NO_BARRIER, GEQ, EQ, NON_BLOCKING = 0x21, 0x22, 0x31, 0x32, 0x41  # distinct from any real value
P, WORDS, ARENA = 3, 24, 1 << 12
GEN = (1 << 31) - 1  # the largest generation: values use all 63 bits
ABORT = GEN << 32 | 0xFFFFFFFF


def seq(n: int) -> int:
    return GEN << 32 | n


class FakeCUstream:
    """``cuStreamCreate``'s handle: like cuda.bindings' ``CUstream``, an object whose ``int()`` is
    the ``cudaStream_t`` (the code must convert it before giving it to torch)."""

    def __init__(self, ptr: int):
        self._ptr = ptr

    def __int__(self):
        return self._ptr

    def getPtr(self):
        return self._ptr


def _stream_arg(stream) -> int:
    """A driver call's ``CUstream`` argument: a ``CUstream`` or an int handle (else TypeError)."""
    if isinstance(stream, FakeCUstream):
        return int(stream)
    if not isinstance(stream, int) or isinstance(stream, bool):
        raise TypeError(f"Argument 'stream' is not instance of type (expected <class 'int'> or CUstream), "
                        f"found {type(stream).__name__}")
    return stream


def _u64_arg(value) -> int:
    """A ``cuuint64_t`` / ``CUdeviceptr`` argument: an int in [0, 2**64) (OverflowError below 0)."""
    if not isinstance(value, int):
        raise TypeError("an integer is required")
    if not 0 <= value < 1 << 64:
        raise OverflowError("can't convert negative value to uint64_t" if value < 0 else "value too large")
    return value


def _uint_arg(flags) -> int:
    """An ``unsigned int`` argument (an IntEnum passes, being an int)."""
    if not isinstance(flags, int) or not 0 <= flags < 1 << 32:
        raise TypeError("an integer is required")
    return flags


class FakeDriver:
    """``cuda.bindings.driver``: records ``(name, args, thread)`` in ``log``, returns ``(CUresult,
    ...)`` tuples (a 1-tuple for a call without outputs), performs 64-bit writes on host memory;
    ``fail`` names a call that fails. Signatures and argument checks as cuda-bindings 13's
    (``cuStreamWriteValue64(stream, addr, value, unsigned int flags)``: ``stream`` a ``CUstream``
    or int, ``addr`` a ``CUdeviceptr`` or int, ``value`` a ``cuuint64_t`` or int in [0, 2**64))."""

    class CUresult(IntEnum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_NOT_SUPPORTED = 801

    class CUstreamWriteValue_flags(IntEnum):
        CU_STREAM_WRITE_VALUE_DEFAULT = WRITE
        CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER = NO_BARRIER

    class CUstreamWaitValue_flags(IntEnum):
        CU_STREAM_WAIT_VALUE_GEQ = GEQ
        CU_STREAM_WAIT_VALUE_EQ = EQ

    class CUstream_flags(IntEnum):
        CU_STREAM_NON_BLOCKING = NON_BLOCKING

    class CUdevice_attribute:
        CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS = "attr-64-bit-memops"

    def __init__(self, log: list):
        self.log, self.fail, self.raises, self.mem64, self.made = log, None, None, 1, 0

    def _rec(self, name, *args):
        self.log.append((name, args, threading.get_ident()))
        if name == self.raises:  # as the binding does without libcuda, or with a driver lacking the call
            raise RuntimeError(f'Function "{name}" not found')
        return self.CUresult.CUDA_ERROR_NOT_SUPPORTED if name == self.fail else self.CUresult.CUDA_SUCCESS

    def cuInit(self, Flags):
        return (self._rec("cuInit", _uint_arg(Flags)),)

    def cuDeviceGet(self, ordinal):
        return self._rec("cuDeviceGet", ordinal), ("dev", ordinal)

    def cuDeviceGetAttribute(self, attrib, dev):  # attrib first, then dev (as the real one)
        return self._rec("cuDeviceGetAttribute", attrib, dev), self.mem64

    def cuDevicePrimaryCtxRetain(self, dev):
        return self._rec("cuDevicePrimaryCtxRetain", dev), ("ctx", dev)

    def cuDevicePrimaryCtxRelease(self, dev):
        return (self._rec("cuDevicePrimaryCtxRelease", dev),)

    def cuCtxPushCurrent(self, ctx):
        return (self._rec("cuCtxPushCurrent", ctx),)

    def cuCtxPopCurrent(self):
        return self._rec("cuCtxPopCurrent"), "ctx"

    def cuStreamCreate(self, Flags):  # -> (CUresult, CUstream)
        self.made += 1
        return self._rec("cuStreamCreate", _uint_arg(Flags)), FakeCUstream(1000 + self.made)

    def cuStreamWriteValue64(self, stream, addr, value, flags):  # -> (CUresult,)
        res = self._rec("cuStreamWriteValue64", _stream_arg(stream), _u64_arg(addr), _u64_arg(value),
                        _uint_arg(flags))
        if res == self.CUresult.CUDA_SUCCESS:  # 8 bytes at a CPU tensor's address, as the GPU would
            ctypes.c_uint64.from_address(addr).value = value
        return (res,)

    def cuStreamWaitValue64(self, stream, addr, value, flags):  # -> (CUresult,)
        return (self._rec("cuStreamWaitValue64", _stream_arg(stream), _u64_arg(addr), _u64_arg(value),
                          _uint_arg(flags)),)


class FakeStream:
    def __init__(self, name, log, handle):
        self.name, self.log, self.cuda_stream = name, log, handle

    def wait_stream(self, other):
        self.log.append(("wait_stream", (self.name, other.name), threading.get_ident()))

    def wait_event(self, event):
        self.log.append(("wait_event", (self.name, event), threading.get_ident()))


class FakeEvent:
    def __init__(self, log, complete):
        self.log, self.stream, self.complete = log, None, complete

    def record(self, stream):
        self.stream = stream
        self.log.append(("record", (stream.name, self), threading.get_ident()))

    def query(self):
        return self.stream is None or self.complete


class FakeCuda:
    """:class:`MemopCuda`'s methods over CPU tensors; records into the driver's log."""

    def __init__(self, log):
        self.log, self.complete = log, True
        self.caller = FakeStream("caller", log, 100)

    def index(self):
        return 0

    def wrap(self, handle):
        return FakeStream(f"s{handle}", self.log, handle)

    def current_stream(self):
        return self.caller

    def event(self):
        return FakeEvent(self.log, self.complete)

    def pinned(self, n, dtype):
        return torch.zeros(n, dtype=dtype)

    def keep(self, tensor, stream):
        self.log.append(("keep", (stream.name, tensor.data_ptr()), threading.get_ident()))

    def handle(self, stream):
        return stream.cuda_stream

    @contextlib.contextmanager
    def use(self, stream):
        self.log.append(("use", (stream.name,), threading.get_ident()))
        yield

    def graph(self):
        return "graph"

    def capture_begin(self, graph, stream):
        self.log.append(("capture_begin", (graph, stream.name), threading.get_ident()))

    def capture_end(self, graph, stream):
        self.log.append(("capture_end", (graph, stream.name), threading.get_ident()))

    def replay(self, graph, stream):
        self.log.append(("replay", (graph, stream.name), threading.get_ident()))

    def copy(self, dst, src, stream):
        self.log.append(("copy", (stream.name, dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size()),
                         threading.get_ident()))
        dst.copy_(src)


class Env:
    def __init__(self):
        self.log: list = []
        self.driver, self.cuda = FakeDriver(self.log), FakeCuda(self.log)
        self.arenas = [torch.zeros(ARENA, dtype=torch.uint8) for _ in range(P)]
        self.words = [torch.zeros(WORDS, dtype=torch.int64) for _ in range(P)]

    def make(self, rank=0, **kw):
        return MemopStream(self.arenas, self.words, rank, ABORT, device="cpu", driver=self.driver, cuda=self.cuda, **kw)

    def word(self, pe, slot):
        return self.words[pe].data_ptr() + 8 * slot

    def ops(self, *names):
        """The log without the context push/pop and record_stream entries (or only ``names``)."""
        skip = {"cuCtxPushCurrent", "cuCtxPopCurrent", "keep"}
        return [(n, a) for n, a, _ in self.log if (n in names if names else n not in skip)]


@pytest.fixture
def env(monkeypatch):
    monkeypatch.setattr(ms, "_SPARE", {})  # streams reused across tests would be another test's fakes
    return Env()


def test_construction_checks_64_bit_memops_and_makes_two_non_blocking_streams(env):
    st = env.make()
    assert st.synchronous is False
    assert env.ops() == [
        ("cuInit", (0,)),
        ("cuDeviceGet", (0,)),
        ("cuDeviceGetAttribute", ("attr-64-bit-memops", ("dev", 0))),
        ("cuDevicePrimaryCtxRetain", (("dev", 0),)),
        ("cuStreamCreate", (NON_BLOCKING,)),
        ("cuStreamCreate", (NON_BLOCKING,)),
    ]
    assert st._comm.cuda_stream == 1001 and st._side.cuda_stream == 1002
    # A stream passed in is the communication stream; only force's is made.
    env.log.clear()
    comm = FakeStream("given", env.log, 77)
    st = env.make(comm=comm)
    assert st._comm is comm and st._h == 77 and env.ops("cuStreamCreate") == [("cuStreamCreate", (NON_BLOCKING,))]


def test_a_device_without_64_bit_stream_memops_is_refused(env):
    env.driver.mem64 = 0
    with pytest.raises(DistCAError, match="no 64-bit stream memory operations.*CAN_USE_64_BIT_STREAM_MEM_OPS"):
        env.make()
    assert env.ops("cuStreamCreate") == []


def test_begin_records_one_event_of_its_own_again_each_time_and_nothing_on_its_own_stream(env):
    st = env.make(rank=0)
    env.log.clear()
    st.begin()
    first = st._ready
    st.begin()
    assert st._ready is first  # made once, recorded again: no event made and destroyed per exchange
    assert env.ops("record", "wait_event", "wait_stream") == [("record", ("caller", first)),
                                                              ("wait_event", ("s1001", first))] * 2
    env.log.clear()
    with st.capture():  # the comm stream records: no wait, and the cached event stays out of the graph
        st.begin()
    env.cuda.current_stream = lambda: st._comm  # the caller's stream is the comm stream: nothing to order
    st.begin()
    assert env.ops("record", "wait_event", "wait_stream") == []


def test_operations_map_to_memops_and_copies_in_order_on_the_comm_stream(env):
    st = env.make(rank=0)
    h = st._h
    a, b = torch.arange(10, dtype=torch.uint8) + 1, torch.arange(16, dtype=torch.uint8) + 50
    c = torch.arange(8, dtype=torch.uint8) + 200
    env.log.clear()
    st.begin()
    st.signal(1, 3, seq(11))  # credit
    st.wait_ge(4, seq(12))
    st.put(1, 64, a, credit=4)  # credit accepted and ignored
    st.put_signal(2, 128, b, 9, seq(13))
    st.copy(env.arenas[0][256:264], c)
    ap, bp = env.arenas[1].data_ptr(), env.arenas[2].data_ptr()
    assert env.ops() == [
        ("record", ("caller", st._ready)),  # begin: the comm stream after the caller's
        ("wait_event", ("s1001", st._ready)),
        ("cuStreamWriteValue64", (h, env.word(1, 3), seq(11), WRITE)),
        ("cuStreamWaitValue64", (h, env.word(0, 4), seq(12), GEQ)),
        ("copy", ("s1001", ap + 64, a.data_ptr(), 10)),
        ("copy", ("s1001", bp + 128, b.data_ptr(), 16)),  # the put's copy before its signal
        ("cuStreamWriteValue64", (h, env.word(2, 9), seq(13), WRITE)),
        ("copy", ("s1001", env.arenas[0].data_ptr() + 256, c.data_ptr(), 8)),
    ]
    # Every driver call with the device's context pushed, on the calling thread.
    drv = [(n, a) for n, a, t in env.log if n.startswith("cu")]
    assert drv == [x for op in drv[1::3] for x in (("cuCtxPushCurrent", (("ctx", ("dev", 0)),)), op,
                                                   ("cuCtxPopCurrent", ()))]
    assert {t for n, _, t in env.log} == {threading.get_ident()}
    # What the writes and copies did.
    assert int(env.words[1][3]) == seq(11) and int(env.words[2][9]) == seq(13)
    assert torch.equal(env.arenas[1][64:74], a) and torch.equal(env.arenas[2][128:144], b)
    assert torch.equal(env.arenas[0][256:264], c)
    # The sources (and the copy's destination) are kept for the comm stream.
    kept = {a[1] for n, a, _ in env.log if n == "keep" and a[0] == "s1001"}
    assert kept == {a.data_ptr(), b.data_ptr(), c.data_ptr(), env.arenas[0].data_ptr() + 256}


def test_fill_is_a_fill_and_capture_records_the_comm_stream_into_a_graph(env):
    st = env.make(rank=0)
    h = st._h
    env.log.clear()
    st.fill(2, 3, seq(7))
    assert env.words[0][:6].tolist() == [0, 0, seq(7), seq(7), seq(7), 0] and not env.words[1].any()
    with st.capture() as graph:
        st.wait_ge(4, seq(8))
        st.signal(1, 3, seq(8))
    st.replay(graph)
    comm = st._comm.name
    assert env.ops() == [
        ("use", (comm,)),
        ("capture_begin", ("graph", comm)),
        ("use", (comm,)),  # the caller's work inside the capture goes to the communication stream
        ("cuStreamWaitValue64", (h, env.word(0, 4), seq(8), GEQ)),
        ("cuStreamWriteValue64", (h, env.word(1, 3), seq(8), WRITE)),
        ("capture_end", ("graph", comm)),
        ("replay", ("graph", comm)),
    ]
    with pytest.raises(ValueError, match="outside"):
        st.fill(WORDS - 1, 2, 0)


def test_stamp_fills_a_tensor_on_the_comm_stream_and_keeps_it(env):
    st = env.make(rank=0)
    rows = torch.zeros(3, 5, dtype=torch.int64)
    env.log.clear()
    st.stamp(rows[:, 0], (1 << 62) + 5)  # a strided column: the tag words of report rows
    assert rows[:, 0].tolist() == [(1 << 62) + 5] * 3 and not rows[:, 1:].any()
    assert env.ops() == [("use", (st._comm.name,))]
    assert [a for n, a, _ in env.log if n == "keep"] == [(st._comm.name, rows.data_ptr())]
    with pytest.raises(ValueError, match="stamp needs an int64 tensor"):
        st.stamp(torch.zeros(3, dtype=torch.float32), 1)


def test_64_bit_values_pass_unchanged_and_the_abort_value_ends_a_geq_wait():
    # GEQ is (int64_t)(*addr - value) >= 0: for the values the protocol uses it is the plain >=.
    def geq(word, value):
        d = (word - value) & ((1 << 64) - 1)
        return d < (1 << 63)
    for gen in (0, 1, 7, GEN):
        n_abort = gen << 32 | 0xFFFFFFFF
        for n in (1, 2, 0xFFFFFFFE):
            value = gen << 32 | n
            assert geq(n_abort, value) and geq(value, value) and not geq(value - 1, value)
            assert not geq(0, value)  # a word never written waits
            if gen:
                assert not geq((gen - 1) << 32 | 0xFFFFFFFF, value)  # an older generation's abort


def test_force_writes_now_on_its_own_stream_from_another_thread(env):
    st = env.make(rank=1)
    st.wait_ge(5, seq(99))  # the comm stream would be held here
    env.log.clear()
    t = threading.Thread(target=st.force, args=(5, ABORT))
    t.start()
    t.join(60)  # generous: a loaded machine may be slow to run the thread; it must end, though
    assert not t.is_alive() and int(env.words[1][5]) == ABORT
    ((name, args, who),) = [x for x in env.log if x[0] == "cuStreamWriteValue64"]
    assert args == (st._side.cuda_stream, env.word(1, 5), ABORT, WRITE) and args[0] != st._h
    assert who == t.ident
    assert [n for n, _, w in env.log] == ["cuCtxPushCurrent", "cuStreamWriteValue64", "cuCtxPopCurrent"]
    with pytest.raises(ValueError, match="signal word"):
        st.force(WORDS, 1)


def test_a_failed_driver_result_raises_naming_the_call_and_the_context_is_popped(env):
    st = env.make()
    env.driver.fail = "cuStreamWaitValue64"
    env.log.clear()
    with pytest.raises(DistCAError, match="cuStreamWaitValue64 failed: CUDA_ERROR_NOT_SUPPORTED"):
        st.wait_ge(1, 5)
    assert [n for n, _, _ in env.log] == ["cuCtxPushCurrent", "cuStreamWaitValue64", "cuCtxPopCurrent"]
    env.driver.fail = "cuStreamWriteValue64"
    with pytest.raises(DistCAError, match="cuStreamWriteValue64 failed"):
        st.signal(1, 1, 1)
    with pytest.raises(DistCAError, match="cuStreamWriteValue64 failed"):
        st.force(1, 1)
    env.driver.fail = "cuStreamCreate"
    with pytest.raises(DistCAError, match="participant 0: cuStreamCreate failed: CUDA_ERROR_NOT_SUPPORTED"):
        env.make()
    env.driver.fail, env.driver.raises = None, "cuStreamWaitValue64"
    with pytest.raises(DistCAError, match='cuStreamWaitValue64 failed: Function "cuStreamWaitValue64" not found'):
        st.wait_ge(1, 5)


def test_snapshots_copy_the_words_and_the_table_on_the_comm_stream(env):
    st = env.make(rank=2)
    env.words[2][:] = torch.arange(WORDS) * 3
    env.arenas[2][:128] = torch.arange(128, dtype=torch.uint8)
    env.log.clear()
    snap = st.snapshot(32, 48)
    assert isinstance(snap, DeviceSnapshot)
    assert [(n, a[0], a[3]) for n, a in env.ops()] == [("copy", "s1001", WORDS * 8), ("copy", "s1001", 48)]
    words, table = snap.value()
    assert words.shape == (WORDS,) and str(words.dtype) == "int64" and words.tolist() == list(range(0, 3 * WORDS, 3))
    assert table.shape == (6,) and str(table.dtype) == "int64"
    assert table.tolist() == env.arenas[2][32:80].view(torch.int64).tolist()
    with pytest.raises(ValueError, match="not int64 words"):
        st.snapshot(0, 12)
    with pytest.raises(ValueError, match="outside"):
        st.snapshot(ARENA - 8, 16)


def test_markers_are_events_on_the_comm_stream_polled_within_the_bound(env):
    st = env.make()
    env.cuda.complete = False
    marker = st.mark()
    assert isinstance(marker, CudaMarker) and marker.event.stream.name == "s1001"
    t0 = time.monotonic()
    assert not marker.done() and not marker.wait(0.05)
    assert time.monotonic() - t0 < 5
    marker.join()  # recorded already: the caller's stream waits for it at once
    assert ("wait_event", ("caller", marker.event)) in env.ops()
    marker.event.complete = True
    assert marker.done() and marker.wait(0)


def test_bad_arguments_are_refused_before_anything_is_queued(env):
    st = env.make()
    env.log.clear()
    with pytest.raises(ValueError, match="contiguous"):
        st.put(1, 0, torch.zeros(8, 2, dtype=torch.uint8)[:, 0])
    with pytest.raises(ValueError, match="outside"):
        st.put(1, ARENA - 2, torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="PE 3 outside"):
        st.signal(P, 0, 1)
    with pytest.raises(ValueError, match="signal word"):
        st.put_signal(1, 0, torch.zeros(8, dtype=torch.uint8), WORDS, 1)
    with pytest.raises(ValueError, match="elements"):
        st.copy(env.arenas[0][:4], torch.zeros(5, dtype=torch.uint8))
    with pytest.raises(ValueError):
        MemopStream(env.arenas, env.words[:2], 0, ABORT, device="cpu", driver=env.driver, cuda=env.cuda)
    assert env.log == []


def test_close_drains_then_hands_its_streams_on_and_refuses_more_work(env, monkeypatch):
    monkeypatch.setattr(ms, "CLOSE_WAIT_S", 0.05)
    st = env.make()
    st.close()
    assert env.ops("cuDevicePrimaryCtxRelease") == [("cuDevicePrimaryCtxRelease", (("dev", 0),))]
    with pytest.raises(DistCAError, match="closed"):
        st.signal(1, 1, 1)
    env.log.clear()
    st.force(1, 1)  # drained: nothing waits, nothing is written
    st.close()
    assert env.log == []
    again = env.make()  # the drained streams are reused
    assert {again._comm.cuda_stream, again._side.cuda_stream} == {1001, 1002}
    assert env.ops("cuStreamCreate") == []
    # A stream still held at close keeps its streams and its context: force still ends the wait.
    env.cuda.complete = False
    t0 = time.monotonic()
    again.close()
    assert time.monotonic() - t0 < 5
    assert env.ops("cuDevicePrimaryCtxRelease") == []
    again.force(2, ABORT)
    assert int(env.words[0][2]) == ABORT


def test_load_driver_without_cuda_python_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(DistCAError, match="cuda-python"):
        load_driver()


def test_the_real_driver_module_has_the_names_used():
    driver = pytest.importorskip("cuda.bindings.driver")
    assert int(driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT) == 0
    assert int(driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ) == 0
    assert driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS is not None
    assert driver.CUstream_flags.CU_STREAM_NON_BLOCKING is not None and driver.CUresult.CUDA_SUCCESS == 0
    for name in ("cuInit", "cuDeviceGet", "cuDeviceGetAttribute", "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease",
                 "cuCtxPushCurrent", "cuCtxPopCurrent", "cuStreamCreate", "cuStreamWriteValue64", "cuStreamWaitValue64"):
        assert callable(getattr(driver, name)), name
        # The parameters, in order, as FakeDriver takes them (the bindings' docstrings open with
        # the signature, e.g. "cuStreamWriteValue64(stream, addr, value, unsigned int flags)").
        real = _doc_params(getattr(driver, name))
        if real is not None:
            fake = list(inspect.signature(getattr(FakeDriver, name)).parameters)[1:]
            assert real == fake, (name, real, fake)


def _doc_params(fn) -> list[str] | None:
    """The parameter names in the first line of a Cython binding's docstring (None: no docstring)."""
    first = (fn.__doc__ or "").strip().splitlines()[:1]
    m = re.match(r"\w+\((.*?)\)", first[0]) if first else None
    if m is None:
        return None
    return [p.split(":")[0].split()[-1].lstrip("*") for p in m.group(1).split(",") if p.strip()]


def test_importing_the_module_needs_neither_cuda_python_nor_cuda():
    # (a bare ``cuda`` may be there: the repository's cuda/ folder is a namespace package)
    code = ("import sys, torch\n"
            "before = set(sys.modules)\n"
            "import distca_server.transport.memop_stream\n"
            "assert not any(m.startswith('cuda.') for m in set(sys.modules) - before)\n"
            "assert not torch.cuda.is_initialized()\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


# ---- on a real CUDA device, two PEs of one process -----------------------------------------------------
DATA = 4  # the signal word the tests below use for rows


def _gpu_two_pes() -> None:
    dev = torch.device("cuda", 0)
    arenas = [torch.zeros(1 << 16, dtype=torch.uint8, device=dev) for _ in range(2)]
    words = [torch.zeros(8, dtype=torch.int64, device=dev) for _ in range(2)]
    rows = [torch.randint(0, 256, (4096,), dtype=torch.uint8, device=dev) for _ in range(2)]
    torch.cuda.synchronize()  # nothing device-wide once a wait may be held
    pe = [MemopStream(arenas, words, r, ABORT, device=dev) for r in range(2)]
    try:
        # 1. PE 1 waits first; PE 0's stream later copies into PE 1's arena and sets the word.
        pe[1].begin()
        pe[1].wait_ge(DATA, seq(1))
        snap = pe[1].snapshot(0, 4096)
        m1 = pe[1].mark()
        time.sleep(0.3)
        assert not m1.done(), "PE 1's wait did not hold its stream"
        pe[0].begin()
        pe[0].put_signal(1, 0, rows[0], DATA, seq(1))
        m0 = pe[0].mark()
        assert m0.wait(10) and m1.wait(10), "the signal did not end PE 1's wait"
        w, table = snap.value()
        assert int(w[DATA]) == seq(1)
        assert torch.equal(torch.from_numpy(table).view(torch.uint8), rows[0].cpu())
        m1.join()
        assert torch.equal(arenas[1][:4096].cpu(), rows[0].cpu())
        # 2. Both at once, each put before its own wait (as the exchange queues them).
        snaps, marks = [], []
        for r in range(2):
            pe[r].begin()
            pe[r].put_signal(1 - r, 8192, rows[r], DATA, seq(2))
            pe[r].wait_ge(DATA, seq(2))
            snaps.append(pe[r].snapshot(8192, 4096))
            marks.append(pe[r].mark())
        assert all(m.wait(10) for m in marks), "an exchange between the two PEs did not finish"
        for r in range(2):
            assert torch.equal(torch.from_numpy(snaps[r].value()[1]).view(torch.uint8), rows[1 - r].cpu())
    finally:
        for r in range(2):  # never leave a wait held (the process could not exit)
            pe[r].force(DATA, ABORT)
            pe[r].close()


def _gpu_force() -> None:
    dev = torch.device("cuda", 0)
    arenas = [torch.zeros(1 << 12, dtype=torch.uint8, device=dev)]
    words = [torch.zeros(8, dtype=torch.int64, device=dev)]
    words[0][2] = (GEN - 1) << 32 | 0xFFFFFFFF  # an older generation's abort value: no reason to stop
    torch.cuda.synchronize()
    pe = MemopStream(arenas, words, 0, ABORT, device=dev)
    pe.begin()
    pe.wait_ge(2, seq(1))
    snap = pe.snapshot(0, 8)
    marker = pe.mark()
    time.sleep(0.3)
    assert not marker.done(), "the wait did not hold the stream"
    t0 = time.monotonic()
    t = threading.Thread(target=pe.force, args=(2, ABORT))
    t.start()
    t.join(5)
    assert marker.wait(5), "force did not end the wait"
    assert time.monotonic() - t0 < 5
    assert int(snap.value()[0][2]) == ABORT
    pe.close()


def _run_gpu(fn: str) -> None:
    try:
        load_driver()
    except DistCAError:
        pytest.skip("needs cuda-python")
    code = f"import sys; sys.path.insert(0, {HERE!r}); import test_memop_stream as t; t.{fn}()"
    try:
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{fn} did not finish within 120 s (a wait was never ended)")
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.gpu
def test_two_pes_of_one_process_exchange_through_stream_memops_on_the_gpu():
    _run_gpu("_gpu_two_pes")


@pytest.mark.gpu
def test_force_from_another_thread_ends_a_wait_that_would_never_end_on_the_gpu():
    _run_gpu("_gpu_force")
