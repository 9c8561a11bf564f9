"""A PE's stream of exchange work on the GPU: :class:`~.pe_stream.PeStream` over NVSHMEM's
stream-ordered host API (issue 22 item 1; the CPU twin is :class:`~.pe_stream.HostStream`).

Every operation is enqueued on one CUDA stream, the *communication stream* (the heap's own, shared
with the host-driven exchange of :mod:`.nvshmem` so the two stay in one order), and the host returns
at once: puts and signals are ``putmem_on_stream`` / ``putmem_signal_on_stream`` /
``signal_op_on_stream``, a wait is the CUDA driver's ``cuStreamWaitValue64(word, value,
CU_STREAM_WAIT_VALUE_GEQ)`` on this PE's own symmetric signal word (:class:`~.memop_stream.StreamDriver`,
as :class:`~.memop_stream.MemopStream` waits), copies and snapshots are asynchronous copies on that
stream, a marker is a CUDA event recorded there.

Why not NVSHMEM's ``signal_wait_until_on_stream``: in NVSHMEM 3.4.5 it begins with
``NVSHMEM_API_NOT_SUPPORTED_WITH_LIMITED_MPG_RUNS()`` (src/host/comm/sync.cpp), which prints and
calls ``exit(-1)`` (src/include/internal/host/util.h) whenever NVSHMEM runs in *limited MPG* mode:
several PEs on one GPU without MPS (src/host/init/init.cu, ``nvshmemi_determine_mpg_support_level``),
our one-GPU setup. On a GEQ compare of a local word NVSHMEM itself issues the same driver wait
(plus ``CU_STREAM_WAIT_VALUE_FLUSH`` where the device can flush remote, i.e. NIC, writes; the
exchange's peers are on this host). The calls used here carry no such guard in 3.4.5:
``putmem_on_stream`` and ``putmem_signal_on_stream`` (src/host/comm/putget.cpp) and
``signal_op_on_stream`` and ``quiet_on_stream`` (sync.cpp, quiet.cpp) check only that NVSHMEM is
initialised.

The streams (communication and :meth:`NvshmemStream.force`'s) are made with
``cuStreamCreate(CU_STREAM_NON_BLOCKING)`` once per heap (:mod:`.nvshmem` passes them), never taken
from torch's pool, which hands out 32 streams round robin: a force stream made per epoch would, about
every 32nd, be the communication stream itself, queued behind the wait it should end. A held wait
also holds whatever shares its hardware queue, so ``CUDA_DEVICE_MAX_CONNECTIONS`` below
:data:`DEVICE_CONNECTIONS_NEEDED` is warned about once (:func:`warn_device_connections`).

Two threads, one order:

- NVSHMEM's host API is called from one thread per process (:class:`~.host_thread.HostThread`), so
  every binding call is *submitted* there. Work enqueued on the communication stream by any other
  thread would overtake the submissions still queued, so everything that enqueues on that stream
  (the copies, the snapshot, the marker's event, the wait for the caller's stream) is submitted
  too, in the order it was asked for.
- What must see the calling thread's state runs on the calling thread: the caller's current
  stream is per thread (``begin`` records an event on it here; the host thread makes the
  communication stream wait for that event), and ``record_stream`` marks the sources as used by
  the communication stream (the submitted call also holds them until it enqueued its operation,
  so the allocator's event lands after it).

A marker's event is recorded only when the host thread reaches it: ``join`` first waits (bounded)
for that, since making a stream wait for an event not yet recorded would wait for nothing.

Limits: a GPU stream cannot skip a host-queued put, so ``credit`` is ignored (a failing group's
peer may receive rows into a buffer it had not freed; it fails its next exchange, see
:mod:`.routed`). A failed binding call (or a stopped host thread) is kept in :attr:`error`; later
operations are skipped, markers still pass, and the transport raises from the error.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
from typing import Callable

import numpy as np
import torch

from ..errors import DistCAError

QUERY_POLL_S = 1e-3  # longest sleep between two queries of a marker's event
CLOSE_WAIT_S = 1.0  # how long close() lets the queued work drain (the transport forced its waits)
# nvshmem4py's calls and constants the stream uses (none of them refused in limited MPG runs: see
# the module docstring); waits are the CUDA driver's.
BINDINGS = ("putmem_on_stream", "putmem_signal_on_stream", "signal_op_on_stream", "quiet_on_stream")
CONSTANTS = (("Signal_op", "SIGNAL_SET"),)
# Hardware queues a device-driven heap needs: its communication stream (which holds waits) and the
# streams whose work must pass such a wait: force's, the abort signals', the poll of its own words,
# and the caller's current stream (the kernels). CUDA maps streams onto CUDA_DEVICE_MAX_CONNECTIONS
# queues (default 8; Megatron sets 1); with fewer queues than these five streams some two share one,
# and if one of them is the communication stream its held wait holds the other (with 1, force queues
# behind the very wait it should end: the watchdog cannot end a hang).
DEVICE_CONNECTIONS_NEEDED = 5
_CONNECTIONS_WARNED = threading.Event()  # warn_device_connections: once per process


def missing_bindings(bindings) -> list[str]:
    """The names :class:`NvshmemStream` needs that ``bindings`` (``nvshmem.bindings``) lacks."""
    names = [n for n in BINDINGS if not callable(getattr(bindings, n, None))]
    return names + [f"{e}.{m}" for e, m in CONSTANTS if getattr(getattr(bindings, e, None), m, None) is None]


def device_connections_problem(environ=None) -> str | None:
    """What is wrong with ``CUDA_DEVICE_MAX_CONNECTIONS`` in ``environ`` (default ``os.environ``)
    for device-driven exchanges, or None (unset: CUDA's default 8; or at least
    :data:`DEVICE_CONNECTIONS_NEEDED`; or not an integer, which CUDA does not take either). CUDA
    reads it when the process's context is made, so the value seen here is the one in force unless
    it was changed after CUDA started."""
    raw = (os.environ if environ is None else environ).get("CUDA_DEVICE_MAX_CONNECTIONS")
    try:
        n = int(raw) if raw is not None else None
    except ValueError:
        return None
    if n is None or n >= DEVICE_CONNECTIONS_NEEDED:
        return None
    return (f"CUDA_DEVICE_MAX_CONNECTIONS={raw} is below the {DEVICE_CONNECTIONS_NEEDED} hardware queues "
            f"device-driven NVSHMEM exchanges need (the communication stream, which holds waits, and the "
            f"force, abort, poll and caller's streams): a held wait may hold the stream that would end it "
            f"(a hang the watchdog cannot end) or the caller's kernels. Unset it or raise it to at least "
            f"{DEVICE_CONNECTIONS_NEEDED} before CUDA starts in this process")


def warn_device_connections(environ=None) -> bool:
    """Warn (RuntimeWarning) once per process about :func:`device_connections_problem`; whether
    this call warned."""
    problem = device_connections_problem(environ)
    if problem is None or _CONNECTIONS_WARNED.is_set():
        return False
    _CONNECTIONS_WARNED.set()
    warnings.warn(problem, RuntimeWarning, stacklevel=3)
    return True


def _stampable(dst: torch.Tensor, device: torch.device, rank: int) -> None:
    """Refuse (ValueError) a :meth:`~.pe_stream.PeStream.stamp` target off ``device`` or not int64."""
    if dst.device != device or dst.dtype != torch.int64:
        raise ValueError(f"participant {rank}: stamp needs an int64 tensor on {device}, got {dst.dtype} on "
                         f"{dst.device}")


class TorchCuda:
    """The CUDA work an :class:`NvshmemStream` does through torch, on ``device`` (tests pass a
    fake with the same methods)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    def index(self) -> int:
        return self.device.index if self.device.index is not None else torch.cuda.current_device()

    def wrap(self, handle: int):
        """A torch stream over a CUDA stream made with the driver (:class:`~.memop_stream.StreamDriver`):
        never one of torch's pool streams, which it hands out round robin (see :mod:`.memop_stream`)."""
        return torch.cuda.ExternalStream(handle, device=self.device)

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def use(self, stream):
        return torch.cuda.stream(stream)

    def event(self):
        return torch.cuda.Event()

    def pinned(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype, pin_memory=True)

    def keep(self, tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)

    def handle(self, stream) -> int:
        return stream.cuda_stream

    def graph(self):
        return torch.cuda.CUDAGraph()

    def capture_begin(self, graph, stream) -> None:
        """Start capturing ``stream`` (made current on this thread) into ``graph``. Relaxed: the
        other PEs' threads keep queueing work, and a snapshot's pinned buffer is allocated while
        the stream captures."""
        with self.use(stream):
            graph.capture_begin(capture_error_mode="relaxed")

    def capture_end(self, graph, stream) -> None:
        with self.use(stream):
            graph.capture_end()

    def replay(self, graph, stream) -> None:
        with self.use(stream):
            graph.replay()


class CudaMarker:
    """A :class:`~.pe_stream.Marker`: a CUDA event recorded on the communication stream once the
    host thread reaches it (``recorded``).

    ``captured``: made inside a :meth:`NvshmemStream.capture`, so its event is a *captured event*
    (a node of the graph, never executed as such). CUDA forbids querying one
    (``cudaErrorCapturedEvent``), and a stream outside the capture that waits for one is pulled
    into the capture (CUDA Programming Guide, "Cross-stream Dependencies and Events"), which then
    fails at ``cudaStreamEndCapture`` as unjoined. Such a marker orders nothing and passes at once;
    a replay's own marker (recorded outside the capture) is the one to wait for."""

    __slots__ = ("event", "recorded", "captured", "_cuda", "_bound_s", "_rank", "_passed")

    def __init__(self, event, cuda, bound_s: float, rank: int, captured: bool = False,
                 recorded: threading.Event | None = None):
        """``recorded``: a set Event when the caller records the event itself, at once (shared:
        making one per marker costs the host a lock and a condition each time)."""
        self.event, self._cuda, self._bound_s, self._rank = event, cuda, float(bound_s), rank
        self.recorded = threading.Event() if recorded is None else recorded
        self.captured = bool(captured)
        self._passed = False  # an event passed stays passed (a marker's is never recorded again)

    def done(self) -> bool:
        """Recorded and passed (an event never recorded, after a failure, queries as passed; a
        captured marker passes without a query). Once it passed, answered without a query."""
        if self._passed or self.captured:
            return True
        self._passed = self.recorded.is_set() and bool(self.event.query())
        return self._passed

    def wait(self, timeout_s: float) -> bool:
        """Poll :meth:`done` for at most ``timeout_s`` seconds; never ``event.synchronize()``,
        which cannot be bounded."""
        if self.captured:
            return True
        deadline = time.monotonic() + max(0.0, timeout_s)
        if not self.recorded.wait(max(0.0, timeout_s)):
            return False
        while not self.event.query():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(QUERY_POLL_S, left))
        return True

    def join(self) -> None:
        """Make the caller's current stream wait for the marker.

        Raises:
            DistCAError: the host thread did not reach the marker within the stream's bound.
        """
        if self.captured:  # waiting for a captured event would pull the caller's stream into the capture
            return
        if not self.recorded.wait(self._bound_s):
            raise DistCAError(f"participant {self._rank}: the NVSHMEM host thread did not queue the exchange "
                              f"within {self._bound_s:.3g} s")
        self._cuda.current_stream().wait_event(self.event)


class DeviceSnapshot:
    """What :meth:`NvshmemStream.snapshot` copies into pinned host memory; valid once a later
    marker is done."""

    __slots__ = ("words", "table")

    def __init__(self, words: torch.Tensor, table: torch.Tensor):
        self.words, self.table = words, table  # int64 [signal words], uint8 [nbytes]

    def value(self) -> tuple[np.ndarray, np.ndarray]:
        """``(words, table)``: int64 [signal words] and int64 [nbytes / 8] of the arena range."""
        return self.words.numpy(), self.table.view(torch.int64).numpy()


class NvshmemStream:
    """A :class:`~.pe_stream.PeStream` on a CUDA stream through nvshmem4py (see the module
    docstring). Methods return at once (``synchronous`` is False).

    Args:
        arena: this PE's uint8 arena of the symmetric heap (remote offsets are relative to it:
            the arena is at the same symmetric address on every PE).
        words: this PE's int64 [signal words] (word ``slot`` is at ``words.data_ptr() + 8*slot``).
        rank: this PE.
        abort_value: the watchdog's value (kept for reference: a GPU wait cannot tell it apart).
        bindings: ``nvshmem.bindings``.
        submit: queues ``fn(*args)`` on the process's NVSHMEM host thread (``HostThread.submit``).
        device: this PE's CUDA device.
        cuda: the CUDA work (default :class:`TorchCuda` on ``device``).
        driver: the CUDA driver calls (a :class:`~.memop_stream.StreamDriver`; default one made
            here; :mod:`.nvshmem` passes the heap's): the waits, and the streams made here.
        comm: the communication stream (default: a new one; :mod:`.nvshmem` passes the heap's).
        side: :meth:`force`'s stream (default: a new one; :mod:`.nvshmem` passes the heap's, made
            once per heap: one per epoch would cost a stream each epoch).
        dirty: peers with puts since the last quiet (shared with the heap; host thread only).
        timeout_s: the longest a marker's ``join`` waits for the host thread to reach it.

    Raises:
        DistCAError: ``bindings`` lacks a call or constant (this nvshmem4py is too old), no
            cuda-python, or the device has no 64-bit stream memory operations.
    """

    synchronous = False

    def __init__(self, arena: torch.Tensor, words: torch.Tensor, rank: int, abort_value: int, *, bindings,
                 submit: Callable, device, cuda=None, driver=None, comm=None, side=None, dirty: set | None = None,
                 timeout_s: float = 60.0):
        missing = missing_bindings(bindings)
        if missing:
            raise DistCAError(f"device-driven exchanges need nvshmem4py's {', '.join(missing)}, which this "
                              f"nvshmem4py lacks; upgrade nvshmem4py")
        self._b, self._submit = bindings, submit
        self._set = int(bindings.Signal_op.SIGNAL_SET)
        self.device, self.rank, self.abort_value = torch.device(device), int(rank), int(abort_value)
        self._cuda = TorchCuda(self.device) if cuda is None else cuda
        if driver is None:
            from .memop_stream import StreamDriver  # here: memop_stream imports this module
            driver = StreamDriver(self._cuda.index(), self.rank)
        self._drv = driver
        self._arena, self._words = arena, words
        self._base, self._sig = arena.data_ptr(), words.data_ptr()
        self._comm = driver.stream(self._cuda) if comm is None else comm
        self._h = self._cuda.handle(self._comm)
        self._dirty = set() if dirty is None else dirty
        self._timeout_s = float(timeout_s)
        # force(): its own stream (never the communication stream, which it must pass) and host
        # words, made now so that force allocates nothing
        self._side = driver.stream(self._cuda) if side is None else side
        self._forced = self._cuda.pinned(words.numel(), torch.int64)
        self._force_lock = threading.Lock()
        self.error: BaseException | None = None  # the first failure of a queued operation
        self._closed = False
        self._capturing = False  # inside capture() (set and read on the calling thread)

    # ---- the calling thread -------------------------------------------------------------------------
    def _enqueue(self, fn: Callable, *args, always: bool = False) -> bool:
        """Submit ``fn(*args)`` to the host thread (whether it was): skipped after a failure
        unless ``always`` (markers), its error kept in :attr:`error`."""
        if self._closed:
            raise DistCAError(f"participant {self.rank}: the NVSHMEM stream is closed")
        if self.error is not None and not always:
            return False

        def run():
            if self.error is not None and not always:
                return
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 - kept; the transport reports it
                if self.error is None:
                    self.error = exc
        try:
            self._submit(run)
        except BaseException as exc:  # noqa: BLE001 - the host thread is stuck or stopped
            if self.error is None:
                self.error = exc
            return False
        return True

    def _source(self, src: torch.Tensor, what: str) -> torch.Tensor:
        # Staging (a copy to the device, a contiguous copy) would run on the caller's stream after
        # begin() took its event: the communication stream would not wait for it. Refused instead.
        if src.device != self.device or not src.is_contiguous():
            raise ValueError(f"participant {self.rank}: {what} needs a contiguous tensor on {self.device}, got "
                             f"{'a non-contiguous one' if src.device == self.device else src.device}")
        return src

    def _at(self, offset: int, nbytes: int) -> int:
        if not 0 <= offset <= offset + nbytes <= self._arena.numel():
            raise ValueError(f"participant {self.rank}: arena range [{offset}, {offset + nbytes}) outside "
                             f"[0, {self._arena.numel()})")
        return self._base + offset

    def _word(self, slot: int) -> int:
        if not 0 <= slot < self._words.numel():
            raise ValueError(f"participant {self.rank}: signal word {slot} outside [0, {self._words.numel()})")
        return self._sig + 8 * slot

    def begin(self) -> None:
        """Order what follows after the caller's current stream. Inside :meth:`capture` nothing:
        a capturing stream must not wait for an event recorded outside the capture (CUDA
        Programming Guide, "Prohibited and Unhandled Operations": invalid without
        ``cudaEventWaitExternal``, which torch's ``Stream.wait_event`` does not pass; the capture
        would be invalidated). :meth:`replay` runs after a ``begin`` of its own instead."""
        if self._capturing:
            return
        ready = self._cuda.event()
        ready.record(self._cuda.current_stream())  # here: the caller's stream is this thread's
        self._enqueue(self._comm.wait_event, ready)  # there: in order with the submissions before it

    def put(self, pe: int, offset: int, src: torch.Tensor, credit: int | None = None) -> None:
        """Put ``src`` (contiguous, on this device; bytes = numel * element size) at ``offset`` of
        PE ``pe``'s arena. ``credit`` is ignored: a GPU stream cannot skip a host-queued put.

        Raises:
            ValueError: ``src`` not contiguous on this device, or the range outside the arena.
        """
        src = self._source(src, "put")
        n = src.numel() * src.element_size()
        if n:
            dst = self._at(offset, n)
            self._cuda.keep(src, self._comm)
            self._enqueue(self._put, int(pe), dst, src, n)

    def put_signal(self, pe: int, offset: int, src: torch.Tensor, slot: int, value: int,
                   credit: int | None = None) -> None:
        """:meth:`put`, then ``pe``'s word ``slot`` = ``value`` after this and every earlier put
        to ``pe`` landed (``credit`` ignored). Raises as :meth:`put`, or ``slot`` out of range."""
        src = self._source(src, "put_signal")
        n = src.numel() * src.element_size()
        dst, sig = self._at(offset, n), self._word(slot)
        self._cuda.keep(src, self._comm)
        self._enqueue(self._put_signal, int(pe), dst, src, n, sig, int(value))

    def signal(self, pe: int, slot: int, value: int) -> None:
        self._enqueue(self._signal, int(pe), self._word(slot), int(value))

    def wait_ge(self, slot: int, value: int) -> None:
        """Hold the communication stream until this PE's word ``slot`` >= ``value``: a driver
        ``cuStreamWaitValue64`` (GEQ), queued from the host thread in order with the calls before
        it (ValueError: ``slot`` out of range). Not NVSHMEM's wait, which exits the process in
        limited MPG runs (see the module docstring)."""
        self._enqueue(self._wait, self._word(slot), int(value))

    def fill(self, slot: int, count: int, value: int) -> None:
        """This PE's words ``[slot, slot + count)`` = ``value``, a fill kernel on the communication
        stream (ValueError: the range outside the words)."""
        self._word(slot + count - 1)
        self._enqueue(self._fill, self._words[slot:slot + count], int(value))

    def stamp(self, dst: torch.Tensor, value: int) -> None:
        """int64 ``dst`` (on this device) = ``value``: a fill kernel on the communication stream,
        issued on the host thread (ValueError: another device or dtype)."""
        _stampable(dst, self.device, self.rank)
        self._enqueue(self._fill, dst, int(value))

    @contextlib.contextmanager
    def capture(self):
        """Record the operations queued inside it into a CUDA graph of the communication stream,
        captured on the host thread (where they are issued); yields the graph for :meth:`replay`."""
        graph = self._cuda.graph()
        self._enqueue(self._cuda.capture_begin, graph, self._comm)
        self._capturing = True  # begin() waits for nothing, markers are captured (see CudaMarker)
        try:
            yield graph
        finally:
            self._capturing = False
            self._enqueue(self._cuda.capture_end, graph, self._comm, always=True)

    def replay(self, graph) -> None:
        """Launch ``graph`` on the communication stream, from the host thread."""
        self._enqueue(self._cuda.replay, graph, self._comm)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` on the communication stream (both contiguous on this device, equal
        sizes; raises ValueError otherwise)."""
        dst, src = self._source(dst, "copy"), self._source(src, "copy")
        if dst.numel() != src.numel():
            raise ValueError(f"participant {self.rank}: copy of {src.numel()} elements into {dst.numel()}")
        self._cuda.keep(src, self._comm)
        self._cuda.keep(dst, self._comm)
        self._enqueue(self._copy, dst, src)

    def snapshot(self, offset: int, nbytes: int) -> DeviceSnapshot:
        """Copies, in stream order, of the int64 signal words and of arena bytes
        ``[offset, offset + nbytes)`` (``nbytes`` a multiple of 8, else ValueError)."""
        self._at(offset, nbytes)
        if nbytes % 8:
            raise ValueError(f"participant {self.rank}: a snapshot of {nbytes} bytes is not int64 words")
        snap = DeviceSnapshot(self._cuda.pinned(self._words.numel(), torch.int64),
                              self._cuda.pinned(nbytes, torch.uint8))
        self._enqueue(self._snapshot, snap, offset, nbytes)
        return snap

    def mark(self) -> CudaMarker:
        marker = CudaMarker(self._cuda.event(), self._cuda, self._timeout_s, self.rank, captured=self._capturing)
        if not self._enqueue(self._record, marker, always=True):
            marker.recorded.set()  # nothing will record it: it passes at once, and error says why
        return marker

    def force(self, slot: int, value: int) -> None:
        """Write ``value`` into this PE's own word ``slot`` now, from the calling thread (the
        watchdog's): a host-to-device copy from pinned memory on a stream of its own.

        Not through NVSHMEM: the host thread may itself be waiting on the blocked communication
        stream (a host-driven ``quiet`` synchronizes it), and ``signal_op_on_stream`` would have
        to be called there. Not on the communication stream: it is the one blocked. A copy engine
        write is seen by the pending wait (a polling kernel's volatile loads, or a stream
        memory-wait, read the word from memory), so the stream drains.

        Raises:
            ValueError: ``slot`` out of range.
        """
        self._word(slot)
        with self._force_lock:
            # One host word per slot: a second force of a slot whose first copy has not run yet
            # only changes what that copy writes (the latest value, as wanted).
            self._forced[slot] = int(value)
            with self._cuda.use(self._side):
                self._words[slot:slot + 1].copy_(self._forced[slot:slot + 1], non_blocking=True)

    def close(self) -> None:
        """Let the queued work drain for at most :data:`CLOSE_WAIT_S` seconds (never blocks
        longer: the transport forced its waits before) and refuse later operations. The
        communication stream is the heap's and stays."""
        if self._closed:
            return
        marker = self.mark()
        self._closed = True
        marker.wait(CLOSE_WAIT_S)

    # ---- the host thread ----------------------------------------------------------------------------
    # nvshmem4py 0.4.1, nvshmem/bindings/nvshmem.pyx (every address and the stream as int handles):
    #   putmem_on_stream(intptr_t dest, intptr_t source, size_t bytes, int pe, intptr_t cstrm)
    #   putmem_signal_on_stream(intptr_t dest, intptr_t source, size_t bytes, intptr_t sig_addr,
    #                           uint64_t signal, int sig_op, int pe, intptr_t cstrm)
    #   signal_op_on_stream(intptr_t sig_addr, uint64_t signal, int sig_op, int pe, intptr_t cstrm)
    #   quiet_on_stream(intptr_t cstrm)
    # dest and sig_addr are this PE's symmetric addresses (NVSHMEM maps them to pe's); values are
    # uint64 (ours are in [0, 2**63)); Signal_op.SIGNAL_SET is an IntEnum. Waits: StreamDriver.wait_geq.
    def _fence(self, pe: int) -> None:
        if pe in self._dirty:  # earlier plain puts to pe land before its signal does
            self._b.quiet_on_stream(self._h)
            self._dirty.clear()  # quiet completed every PE's

    def _put(self, pe: int, dst: int, src: torch.Tensor, n: int) -> None:
        self._b.putmem_on_stream(dst, src.data_ptr(), n, pe, self._h)
        self._dirty.add(pe)

    def _put_signal(self, pe: int, dst: int, src: torch.Tensor, n: int, sig: int, value: int) -> None:
        self._fence(pe)
        if n:
            self._b.putmem_signal_on_stream(dst, src.data_ptr(), n, sig, value, self._set, pe, self._h)
        else:
            self._b.signal_op_on_stream(sig, value, self._set, pe, self._h)

    def _signal(self, pe: int, sig: int, value: int) -> None:
        self._fence(pe)
        self._b.signal_op_on_stream(sig, value, self._set, pe, self._h)

    def _wait(self, sig: int, value: int) -> None:
        self._drv.wait_geq(self._h, sig, value)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with self._cuda.use(self._comm):
            dst.copy_(src, non_blocking=True)

    def _fill(self, words: torch.Tensor, value: int) -> None:
        with self._cuda.use(self._comm):
            words.fill_(value)

    def _snapshot(self, snap: DeviceSnapshot, offset: int, nbytes: int) -> None:
        with self._cuda.use(self._comm):
            snap.words.copy_(self._words, non_blocking=True)
            snap.table.copy_(self._arena[offset:offset + nbytes], non_blocking=True)

    def _record(self, marker: CudaMarker) -> None:
        try:
            marker.event.record(self._comm)
        finally:
            marker.recorded.set()


__all__ = ["DEVICE_CONNECTIONS_NEEDED", "CudaMarker", "DeviceSnapshot", "NvshmemStream", "TorchCuda",
           "device_connections_problem", "missing_bindings", "warn_device_connections"]
