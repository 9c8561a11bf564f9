"""A PE's stream of exchange work for PEs of one process on one CUDA device: :class:`~.pe_stream.PeStream`
over plain device buffers, with CUDA stream memory operations for signals and waits (issue 22 item
2(a); the heap is :mod:`.local_heap`, the CPU twin :class:`~.pe_stream.HostStream`).

Every operation is enqueued by the calling thread on the PE's own CUDA stream, its *communication
stream*, and the host returns at once: a put is an asynchronous device copy into the peer's arena, a
signal is ``cuStreamWriteValue64`` into the peer's word (default flags: a memory barrier before the
write, so the copies earlier on the stream are visible before the word is), a wait is
``cuStreamWaitValue64(..., CU_STREAM_WAIT_VALUE_GEQ)`` on this PE's own word, copies and snapshots
are asynchronous copies, a marker is a CUDA event. No host thread (unlike :mod:`.nvshmem_stream`):
the driver and torch may be called from any thread, and one thread queues a PE's work in order.

The streams are made here with ``cuStreamCreate(CU_STREAM_NON_BLOCKING)``, not taken from torch:
``torch.cuda.Stream()`` hands out its 32 pool streams per priority round robin, so two PEs (or a PE's
communication and force streams) could get the same CUDA stream, and one PE's held wait would hold
the other's signals. Non-blocking: the legacy default stream, which torch work uses unless told
otherwise, never waits implicitly for a stream held in a wait. Every driver call runs with the
device's primary context (torch's) pushed, so it works on any thread (the watchdog's has none).
These driver calls (stream creation, the write, the wait) are :class:`StreamDriver`'s, which the
NVSHMEM heap and stream (:mod:`.nvshmem`, :mod:`.nvshmem_stream`) use too.

Limits (stated, not hidden): ``credit`` is ignored (a stream cannot skip a queued copy). CUDA does not
see a wait's dependency (the driver's own warning), so while a wait is held anything that waits for
the whole device (``torch.cuda.synchronize``, a ``cudaFree`` by the caching allocator) waits for it
too, and streams beyond ``CUDA_DEVICE_MAX_CONNECTIONS`` (default 8) share hardware queues, where a
held wait may hold another stream's work (raise it, at most 32, before CUDA starts, for many PEs).
PEs should not share their callers' current stream: ``begin`` orders after it and a marker's
``join`` makes it wait, so one PE's next ``begin`` could wait for another PE's exchange, which waits
for the first PE's rows (the watchdog ends that, as a failure).
"""

from __future__ import annotations

import contextlib
import threading

import torch

from ..errors import DistCAError
from .nvshmem_stream import CudaMarker, DeviceSnapshot, TorchCuda, _stampable

_RECORDED = threading.Event()  # every marker's "recorded": a marker's event is recorded as it is made
_RECORDED.set()

CLOSE_WAIT_S = 1.0  # how long close() lets the queued work drain (the transport forced its waits)
_U64 = (1 << 64) - 1
_SPARE: dict[tuple[int, int], list] = {}  # (id(driver), device index) -> drained streams to reuse
_SPARE_LOCK = threading.Lock()


def load_driver():
    """cuda-python's driver API, ``cuda.bindings.driver`` (before 12.6.1: ``cuda.cuda``), imported
    when a stream is made. Raises DistCAError without cuda-python."""
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver
        except ImportError as exc:
            raise DistCAError("device-driven exchanges on CUDA in one process need cuda-python's driver "
                              "bindings (pip install cuda-python)") from exc
    return driver


class StreamDriver:
    """The CUDA driver calls of device-driven streams on one device (shared by :class:`MemopStream`
    and the NVSHMEM heap and stream of :mod:`.nvshmem` / :mod:`.nvshmem_stream`): non-blocking
    streams of their own, 64-bit stream writes and waits. Every call runs with the device's primary
    context (torch's, the buffers' own) pushed, so it works on any thread (the watchdog's and the
    NVSHMEM host thread included).

    Made once per PE stream or heap: it asks whether the device has 64-bit stream memory
    operations (:attr:`memops`) and retains the primary context (:meth:`release` gives it back).

    Args:
        index: the CUDA device ordinal.
        rank: the PE, for error messages.
        driver: the driver module (default :func:`load_driver`).
        require: refuse a device without 64-bit stream memory operations (a heap whose host-driven
            exchanges need none passes False and reads :attr:`memops`).

    Raises:
        DistCAError: no cuda-python, a failed driver call, or (``require``) a device without 64-bit
            stream memory operations (``CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS``).
    """

    def __init__(self, index: int, rank: int, driver=None, require: bool = True):
        self.d = d = load_driver() if driver is None else driver
        self.rank = int(rank)
        self._ok = d.CUresult.CUDA_SUCCESS
        self._write = int(d.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)  # with a memory barrier
        self._geq = int(d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
        self.call("cuInit", 0)  # idempotent (torch initialised the driver)
        self.dev = self.call("cuDeviceGet", int(index))
        # CUDA 12 enables stream memory operations by default (CUDA 10's drivers only with the nvidia
        # module's NVreg_EnableStreamMemOPs=1); this attribute says whether the 64-bit ones work here.
        # (The non-_V1 name, 122 in CUDA 13's enum; the docs of cuStreamWriteValue64 name it.)
        attr = d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS
        self.memops = bool(self.call("cuDeviceGetAttribute", attr, self.dev))  # (attrib, dev) -> (CUresult, int)
        if require and not self.memops:
            raise DistCAError(f"participant {self.rank}: CUDA device {index} has no 64-bit stream memory "
                              f"operations (CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS is 0); "
                              f"device-driven exchanges need them")
        self.ctx = self.call("cuDevicePrimaryCtxRetain", self.dev)

    def call(self, name: str, *args):
        """``driver.name(*args)``, which returns ``(CUresult, *values)``: the value (or None), or
        DistCAError naming the call and the error (also when the binding raises: no libcuda, or a
        driver without the call).

        cuda-bindings 13 (the classic ``cuda.bindings.driver``, checked against its docstrings):
        every call returns a tuple, ``(CUresult,)`` without outputs; handles (``CUstream``,
        ``CUdeviceptr``, ``cuuint64_t``) may be passed as ints; flags are ``unsigned int`` (an
        IntEnum passes); a negative ``cuuint64_t`` raises OverflowError, so values are masked to
        64 bits. Without libcuda the binding raises ``cuda.pathfinder``'s DynamicLibNotFoundError,
        a RuntimeError."""
        try:
            result = getattr(self.d, name)(*args)
        except RuntimeError as exc:
            raise DistCAError(f"participant {self.rank}: {name} failed: {exc}") from exc
        if result[0] != self._ok:
            raise DistCAError(f"participant {self.rank}: {name} failed: {getattr(result[0], 'name', result[0])}")
        return result[1] if len(result) > 1 else None

    def in_ctx(self, name: str, *args):
        """:meth:`call` with the device's primary context current on this thread."""
        self.call("cuCtxPushCurrent", self.ctx)
        try:
            return self.call(name, *args)
        finally:
            self.call("cuCtxPopCurrent")

    def create_stream(self):
        """A new ``CU_STREAM_NON_BLOCKING`` stream (its ``CUstream``; ``int()`` of it is the
        ``cudaStream_t``). Not from torch's pool: see the module docstring. Non-blocking: the
        legacy default stream never waits implicitly for a stream held in a wait."""
        # cuStreamCreate(unsigned int Flags) -> (CUresult, CUstream)
        return self.in_ctx("cuStreamCreate", int(self.d.CUstream_flags.CU_STREAM_NON_BLOCKING))

    def stream(self, cuda):
        """:meth:`create_stream`, as a torch stream (``cuda.wrap``: ``torch.cuda.ExternalStream``)."""
        return cuda.wrap(int(self.create_stream()))

    def write(self, stream: int, addr: int, value: int) -> None:
        """Queue on ``stream`` (its int handle): the 8 bytes at device address ``addr`` = ``value``
        (masked to 64 bits), after a memory barrier (earlier work on the stream is visible first)."""
        # cuStreamWriteValue64(stream, addr, value, unsigned int flags) -> (CUresult,)
        self.in_ctx("cuStreamWriteValue64", stream, addr, int(value) & _U64, self._write)

    def wait_geq(self, stream: int, addr: int, value: int) -> None:
        """Hold ``stream`` (its int handle) until the 8 bytes at device address ``addr`` >= ``value``.

        GEQ is the cyclic ``(int64_t)(*addr - value) >= 0`` (the bindings' enum docstring); for
        values in [0, 2**63), as the exchange's are (``generation << 32 | n``, generation < 2**31),
        the difference never wraps and the compare is the plain one. The wait re-reads the word
        from memory, so a write from another stream, another GPU or a copy engine ends it."""
        # cuStreamWaitValue64(stream, addr, value, unsigned int flags) -> (CUresult,)
        self.in_ctx("cuStreamWaitValue64", stream, addr, int(value) & _U64, self._geq)

    def release(self) -> None:
        """Give back the primary context retained at construction."""
        self.call("cuDevicePrimaryCtxRelease", self.dev)


class MemopCuda(TorchCuda):
    """The torch work of a :class:`MemopStream` on ``device`` (tests pass a fake with these methods)."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)


class MemopStream:
    """A :class:`~.pe_stream.PeStream` on a CUDA stream of its own (see the module docstring).
    Methods return at once (``synchronous`` is False).

    Args:
        arenas: per PE, uint8 [heap bytes] on ``device`` (a put's offset is into ``arenas[pe]``).
        words: per PE, int64 [signal words] on ``device`` (word ``slot`` of PE ``pe`` is at
            ``words[pe].data_ptr() + 8 * slot``).
        rank: this PE.
        abort_value: the watchdog's value (kept for reference: a stream wait cannot tell it apart).
        device: the CUDA device of every buffer.
        driver: the driver module (default :func:`load_driver`).
        cuda: the torch work (default :class:`MemopCuda` on ``device``).
        comm: the communication stream (a torch stream; default one made here).

    Raises:
        DistCAError: no cuda-python, a failed driver call, or a device without 64-bit stream memory
            operations (``CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS``).
        ValueError: ``rank`` outside the PEs, or ``arenas`` and ``words`` of different lengths.
    """

    synchronous = False

    def __init__(self, arenas, words, rank: int, abort_value: int, *, device, driver=None, cuda=None, comm=None):
        if len(arenas) != len(words) or not 0 <= int(rank) < len(words):
            raise ValueError(f"participant {rank} of {len(arenas)} arenas and {len(words)} signal word arrays")
        self.device, self.rank, self.abort_value = torch.device(device), int(rank), int(abort_value)
        self._cuda = MemopCuda(self.device) if cuda is None else cuda
        self._arenas, self._words = list(arenas), list(words)
        self._drv = StreamDriver(self._cuda.index(), self.rank, driver)
        self._key = (id(self._drv.d), self._cuda.index())
        self._owned: list = []  # (handle, torch stream) made here, reused by a later stream once drained
        self._comm = self._new_stream() if comm is None else comm
        self._side = self._new_stream()  # force()'s, made now: force must allocate nothing
        self._h = self._cuda.handle(self._comm)
        self._lock = threading.Lock()  # force() against close()
        self._closed = False
        self._ready = None  # begin()'s event, made at the first begin and recorded again at each
        self._capturing = False  # inside capture()

    def _new_stream(self):
        with _SPARE_LOCK:
            spare = _SPARE.get(self._key)
            made = spare.pop() if spare else None
        if made is None:
            handle = self._drv.create_stream()
            made = (handle, self._cuda.wrap(int(handle)))
        self._owned.append(made)
        return made[1]

    # ---- checks ---------------------------------------------------------------------------------
    def _open(self) -> None:
        if self._closed:
            raise DistCAError(f"participant {self.rank}: the stream is closed")

    def _source(self, src: torch.Tensor, what: str) -> torch.Tensor:
        # Staging (a copy to the device, a contiguous copy) would run on the caller's stream after
        # begin() ordered us after it: the communication stream would not wait for it. Refused.
        if src.device != self.device or not src.is_contiguous():
            raise ValueError(f"participant {self.rank}: {what} needs a contiguous tensor on {self.device}, got "
                             f"{'a non-contiguous one' if src.device == self.device else src.device}")
        return src

    def _arena(self, pe: int, offset: int, nbytes: int) -> torch.Tensor:
        arena = self._arenas[self._pe(pe)]
        if not 0 <= offset <= offset + nbytes <= arena.numel():
            raise ValueError(f"participant {self.rank}: arena range [{offset}, {offset + nbytes}) of PE {pe} "
                             f"outside [0, {arena.numel()})")
        return arena[offset:offset + nbytes]

    def _word(self, pe: int, slot: int) -> int:
        words = self._words[self._pe(pe)]
        if not 0 <= slot < words.numel():
            raise ValueError(f"participant {self.rank}: signal word {slot} outside [0, {words.numel()})")
        return words.data_ptr() + 8 * slot

    def _pe(self, pe: int) -> int:
        if not 0 <= pe < len(self._words):
            raise ValueError(f"participant {self.rank}: PE {pe} outside [0, {len(self._words)})")
        return pe

    # ---- the stream -----------------------------------------------------------------------------
    def begin(self) -> None:
        """Order what follows on the communication stream after the caller's current stream (this
        thread's): one event, this stream's own, recorded there again each time, and one wait for
        it. A wait orders after the record made before it, so a later record does not move an
        earlier wait (``Stream.wait_stream`` would make, and later destroy, an event each time: two
        CUDA calls more per exchange or replay). Nothing inside :meth:`capture` (the caller's stream
        is the communication stream there, and the cached event is never recorded in a capture) or
        when the caller's stream is the communication stream."""
        self._open()
        if self._capturing:
            return
        caller = self._cuda.current_stream()
        if caller == self._comm:
            return
        if self._ready is None:
            self._ready = self._cuda.event()
        self._ready.record(caller)
        self._comm.wait_event(self._ready)

    def put(self, pe: int, offset: int, src: torch.Tensor, credit: int | None = None) -> None:
        """Copy ``src`` (contiguous, on this device; bytes = numel * element size) into PE ``pe``'s
        arena at ``offset``. ``credit`` is ignored: a stream cannot skip a queued copy.

        Raises:
            ValueError: ``src`` not contiguous on this device, or the range outside the arena.
        """
        self._open()
        src = self._source(src, "put")
        n = src.numel() * src.element_size()
        if n:
            dst = self._arena(pe, offset, n)
            self._cuda.copy(dst, src.reshape(-1).view(torch.uint8), self._comm)
            self._cuda.keep(src, self._comm)  # the allocator keeps it until the stream used it

    def put_signal(self, pe: int, offset: int, src: torch.Tensor, slot: int, value: int,
                   credit: int | None = None) -> None:
        """:meth:`put`, then :meth:`signal` (raises as either)."""
        self._word(pe, slot)  # checked before anything is queued
        self.put(pe, offset, src, credit)
        self.signal(pe, slot, value)

    def signal(self, pe: int, slot: int, value: int) -> None:
        """PE ``pe``'s word ``slot`` = ``value`` (int64) once everything queued before has run.
        Raises ValueError (bad PE or slot), DistCAError (the driver call failed)."""
        self._open()
        self._drv.write(self._h, self._word(pe, slot), value)

    def wait_ge(self, slot: int, value: int) -> None:
        """Hold the stream until this PE's word ``slot`` >= ``value``. GEQ is the cyclic
        ``(int64_t)(*addr - value) >= 0``; the values are ``generation << 32 | n`` and the abort
        value ``generation << 32 | 0xffffffff``, all in [0, 2**63) (generation < 2**31), so the
        difference never wraps and the compare is the plain one (a zero or an older generation's
        word waits, the abort value ends the wait). Raises as :meth:`signal`."""
        self._open()
        self._drv.wait_geq(self._h, self._word(self.rank, slot), value)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` on the communication stream (both contiguous on this device, equal
        sizes; raises ValueError otherwise)."""
        self._open()
        dst, src = self._source(dst, "copy"), self._source(src, "copy")
        if dst.numel() != src.numel():
            raise ValueError(f"participant {self.rank}: copy of {src.numel()} elements into {dst.numel()}")
        self._cuda.copy(dst, src, self._comm)
        self._cuda.keep(src, self._comm)
        self._cuda.keep(dst, self._comm)

    def fill(self, slot: int, count: int, value: int) -> None:
        """This PE's words ``[slot, slot + count)`` = ``value``: a fill kernel on the communication
        stream (raises as :meth:`signal`)."""
        self._open()
        self._word(self.rank, slot + count - 1)
        with self._cuda.use(self._comm):
            self._words[self.rank][slot:slot + count].fill_(int(value))

    def stamp(self, dst: torch.Tensor, value: int) -> None:
        """int64 ``dst`` (on this device) = ``value``: a fill kernel on the communication stream
        (ValueError: another device or dtype)."""
        self._open()
        _stampable(dst, self.device, self.rank)
        with self._cuda.use(self._comm):
            dst.fill_(int(value))
        self._cuda.keep(dst, self._comm)

    @contextlib.contextmanager
    def capture(self):
        """Record the operations queued inside it, and whatever else the calling thread queues on
        the communication stream (current meanwhile), into a CUDA graph: the stream memory
        operations become graph nodes. Yields the graph for :meth:`replay`."""
        self._open()
        graph = self._cuda.graph()
        self._cuda.capture_begin(graph, self._comm)
        self._capturing = True
        try:
            with self._cuda.use(self._comm):
                yield graph
        finally:
            self._capturing = False
            self._cuda.capture_end(graph, self._comm)

    def replay(self, graph) -> None:
        """Launch ``graph`` on the communication stream."""
        self._open()
        self._cuda.replay(graph, self._comm)

    def snapshot(self, offset: int, nbytes: int) -> DeviceSnapshot:
        """Copies, in stream order, into pinned host memory of this PE's int64 [signal words] and of
        its arena bytes ``[offset, offset + nbytes)`` (a multiple of 8, else ValueError); its
        ``value()`` is ``(words, table)`` (int64 numpy, [signal words] and [nbytes / 8]), valid once
        a later marker is done."""
        self._open()
        table = self._arena(self.rank, offset, nbytes)
        if nbytes % 8:
            raise ValueError(f"participant {self.rank}: a snapshot of {nbytes} bytes is not int64 words")
        own = self._words[self.rank]
        snap = DeviceSnapshot(self._cuda.pinned(own.numel(), torch.int64), self._cuda.pinned(nbytes, torch.uint8))
        self._cuda.copy(snap.words, own, self._comm)
        self._cuda.copy(snap.table, table, self._comm)
        return snap

    def mark(self) -> CudaMarker:
        """A CUDA event recorded on the communication stream now: ``done`` queries it, ``wait``
        polls it (never ``synchronize``, which cannot be bounded), ``join`` makes the caller's
        current stream wait for it."""
        self._open()
        marker = CudaMarker(self._cuda.event(), self._cuda, 0.0, self.rank, recorded=_RECORDED)
        marker.event.record(self._comm)  # here, on the calling thread: join never waits for it
        return marker

    def force(self, slot: int, value: int) -> None:
        """Write ``value`` into this PE's own word ``slot`` now, from any thread (the watchdog's).

        ``cuStreamWriteValue64`` on a stream of its own, made with the communication stream: not on
        the communication stream, which is held in the wait this ends. A stream wait re-reads its
        word from memory, so a write from another stream ends it. A driver write rather than a torch
        copy from pinned memory: it goes through no torch allocator or device guard on the
        watchdog's thread, allocates nothing, and carries the value itself (two forces cannot race
        over one staging buffer). A no-op once :meth:`close` found the stream drained.

        Raises:
            ValueError: ``slot`` out of range. DistCAError: the driver call failed.
        """
        addr = self._word(self.rank, slot)
        with self._lock:
            if self._side is not None:
                self._drv.write(self._cuda.handle(self._side), addr, value)

    def close(self) -> None:
        """Let the queued work drain for at most :data:`CLOSE_WAIT_S` seconds (the transport forced
        its waits before) and refuse later operations. Drained, the streams made here go to later
        streams of the device (not destroyed: torch's allocator may still record events on them)
        and the context is released; still held, they stay so that :meth:`force` can end the wait."""
        if self._closed:
            return
        drained = self.mark().wait(CLOSE_WAIT_S)
        self._closed = True
        if drained:
            with self._lock:
                self._side = None
                with _SPARE_LOCK:
                    _SPARE.setdefault(self._key, []).extend(self._owned)
                self._owned = []
                self._drv.release()


__all__ = ["CLOSE_WAIT_S", "MemopCuda", "MemopStream", "StreamDriver", "load_driver"]
