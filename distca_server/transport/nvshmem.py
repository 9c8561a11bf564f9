"""The NVSHMEM symmetric heap: :class:`.symmetric.SymmetricTransport` with GPU-direct puts.

A thin binding of :class:`.symmetric.SymmetricHeap` to nvshmem4py (extra ``nvshmem``); the exchange
itself (offsets, credits, growth, failure) is in :mod:`.symmetric`, tested on CPU with :mod:`.shm`.
nvshmem4py and cuda.core are imported only when a heap is made: importing this module (or
distca_server) on a CPU install needs neither.

Lifecycle (one :class:`NvshmemRuntime` per process, :func:`runtime`):

- **Started once.** The first group epoch starts NVSHMEM (``nvshmem.core.init``, uid bootstrap) and
  makes the process's one symmetric allocation: ``heap_bytes`` of arena (the job's
  ``JobConfig.heap_bytes``, as world rank 0 publishes it) followed by the signal words. NVSHMEM's
  documentation makes a second ``nvshmem_init`` in one program undefined behaviour, and its
  ``finalize`` is collective (an implicit barrier over every PE), so NVSHMEM is never started twice
  and never finalized between epochs.
- **Reused across group epochs** of the same world: a later epoch whose world rank 0 still holds
  the runtime publishes the same unique id with ``reuse``; every member that holds that world at
  the same rank takes a new :class:`.symmetric.HeapLease` of the heap (generation = the group
  epoch: signal values carry it, so the words never need to start at zero, and late writes of the
  old epoch are ignored). An epoch that needs another world (a different size, membership or rank,
  a process that never joined it) or a bigger heap than the world's fails with
  :class:`DistCAError` naming why; NVSHMEM cannot add or remove PEs of a running world, so the job
  must restart those processes (Ray restarts actors; a fresh process starts a fresh world).
- **Finalized at exit** (``atexit``): freeing the heap and ``nvshmem.core.finalize`` run on the host
  thread with a bounded wait (the last group's timeout), so a dead peer (the barrier never
  completes) delays exit by at most that long instead of hanging it.
- **One host thread.** Every NVSHMEM host call (unique id, init, allocation, puts, signals, quiet,
  free, finalize) runs on the runtime's :class:`HostThread`, whichever thread (the rounds thread, the
  caller's) drives the exchange. Puts and signals are queued without waiting (their order is the
  queue's); :meth:`~.symmetric.SymmetricHeap.quiet` waits for them. The stream work that feeds them
  (joining the caller's stream, copying host rows to the device) runs on the calling thread, where
  the caller's current stream is known.

Memory: the words are assumed zero in freshly mapped heap memory only for the first generation
(``test_transport_nvshmem`` checks it); later generations read whatever the earlier ones left.

Operations are host-initiated and stream-ordered (``*_on_stream``) on a communication stream that
first waits for the caller's stream (where the rows to send were produced); waits poll the signal
words with a device-to-host copy on a separate stream, so a dead peer costs a timeout, never a hung
stream. Only point-to-point RMA is used: several PEs may share one GPU without MPS. NVSHMEM then
runs in *limited MPG* mode, where some host calls (collectives, teams, the ``*_wait_until_on_stream``
waits) print and ``exit(-1)``; none of them is called here (see :mod:`.nvshmem_stream`). Which mode
ran (``nvshmemx_init_status``) is :attr:`NvshmemRuntime.init_status`, and :meth:`NvshmemRuntime.describe` reports it.

Streams: the heap makes its own (communication, poll, abort signals, force) once, with
``cuStreamCreate(CU_STREAM_NON_BLOCKING)`` (:class:`~.memop_stream.StreamDriver`), never torch's pool
streams, which are handed out round robin and could repeat the stream a wait holds.

``NVSHMEM_SYMMETRIC_SIZE`` (unless set) is set by :func:`set_symmetric_size` before NVSHMEM's first
call in the process (world rank 0's unique id, the others' init): NVSHMEM reads its environment once,
at that call, and keeps it.

The transport is a :class:`~.routed.RoutedTransport`: exchanges of an installed route are
device-driven, queued on the same communication stream by :meth:`NvshmemHeap.stream_ops` (an
:class:`~.nvshmem_stream.NvshmemStream`, whose NVSHMEM calls also run on the host thread).

Bootstrap: world rank 0 publishes ``{"uid": bytes, "heap_bytes": int, "reuse": bool}`` (or
``{"error": str}`` when it cannot take part), the scheduler hands it to the others with the group
epoch (in tests a ``torch.multiprocessing`` queue does), and every PE calls :func:`join_nvshmem`.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import warnings
from typing import Callable

import numpy as np
import torch

from scheduler.config import DEFAULT_HEAP_BYTES

from ..errors import DistCAError
from .base import aligned, host_to_device
from .host_thread import HostBoundHeap, HostThread
from .symmetric import ReusableHeap, SymmetricTransport
from .symmetric_words import check_heap_bytes, signal_words

FINALIZE_TIMEOUT_S = 60.0  # finalize's bound at exit before any group set one
NVSHMEM_STATE_BYTES = 64 << 20  # room in the symmetric heap for NVSHMEM's own allocations
LIMITED_MPG = "STATUS_LIMITED_MPG"  # nvshmem4py's InitStatus name: several PEs per GPU without MPS
log = logging.getLogger(__name__)


def symmetric_size(heap_bytes: int, world_size: int) -> int:
    """Bytes of NVSHMEM symmetric heap a PE needs: the arena (``heap_bytes``), the signal words
    of ``world_size`` PEs and :data:`NVSHMEM_STATE_BYTES` for NVSHMEM's own state."""
    return int(heap_bytes) + 8 * signal_words(world_size) + NVSHMEM_STATE_BYTES


def set_symmetric_size(heap_bytes: int, world_size: int, environ=None) -> str:
    """Set ``NVSHMEM_SYMMETRIC_SIZE`` to :func:`symmetric_size` unless already set; returns the
    value in force. Must run before NVSHMEM's first call in the process: ``nvshmemx_get_uniqueid``
    (world rank 0) and init both begin with ``nvshmemi_options_init()``, which reads the environment
    once and keeps it (NVSHMEM 3.4.5 src/host/init/init.cu, src/host/util/env_vars.cpp); with a
    static heap (``NVSHMEM_DISABLE_CUDA_VMM=1``) a size read too early (default 1 GiB) makes the
    allocation fail."""
    environ = os.environ if environ is None else environ
    return environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(symmetric_size(heap_bytes, world_size)))


def init_status_name(core) -> str:
    """NVSHMEM's init status (``nvshmem.core.init_status()``, ``nvshmemx_init_status``) by its name
    in ``nvshmem.core.InitStatus``: ``"STATUS_IS_INITIALIZED"`` (one PE per GPU),
    :data:`LIMITED_MPG` (several PEs per GPU without MPS), ``"STATUS_FULL_MPG"`` (with MPS); the
    number where the enum lacks it, ``"unknown"`` where this nvshmem4py lacks the call."""
    status = getattr(core, "init_status", None)
    if status is None:
        return "unknown"
    value = int(status())  # the binding returns a plain int
    names = getattr(core, "InitStatus", None)
    try:
        return names(value).name
    except (TypeError, ValueError):
        return str(value)


def _modules():
    """``(nvshmem.core, nvshmem.bindings, cuda.core.Device)``, imported on first use."""
    import nvshmem.bindings as bindings
    import nvshmem.core as core
    try:
        from cuda.core import Device
    except ImportError:  # cuda.core before 0.4 kept it here
        from cuda.core.experimental import Device
    return core, bindings, Device


def available() -> bool:
    """Whether nvshmem4py and a CUDA device are present (for tests and the CLI)."""
    try:
        _modules()
    except ImportError:
        return False
    return torch.cuda.is_available()


def unique_id(*, world_size: int, heap_bytes: int = DEFAULT_HEAP_BYTES) -> bytes:
    """A fresh NVSHMEM unique id (on world rank 0), as bytes to hand to the other PEs, after
    :func:`set_symmetric_size` for ``heap_bytes`` of arena among ``world_size`` PEs (the unique id
    is NVSHMEM's first call). Runs on the process's NVSHMEM host thread."""
    driver = Nvshmem4py()
    driver.configure(world_size, heap_bytes)
    return runtime().host.call(driver.unique_id, what="get_unique_id")


def _uid_bytes(uid) -> bytes:
    # nvshmem.bindings.uniqueid keeps one nvshmemx_uniqueid_v1 in a numpy recarray ``_data``;
    # nvshmem.core.init's own "emulated_mpi" path broadcasts exactly ``_data.view(np.int8)``.
    return uid._data.view(np.int8).tobytes()


def _uid_from(data: bytes):
    core, _, _ = _modules()
    uid = core.get_unique_id(empty=True)
    uid._data.view(np.int8)[:] = np.frombuffer(data, dtype=np.int8)
    return uid


class NvshmemHeap:
    """This PE's endpoint of the NVSHMEM heap (see :class:`.symmetric.SymmetricHeap`), over the
    process's one symmetric allocation ``whole`` (arena, then the signal words). Its NVSHMEM calls
    (``put``, ``put_signal``, ``signal``, ``quiet``) must run on the process's :class:`HostThread`
    (:class:`HostBoundHeap` sees to it); :meth:`stage` runs on the calling thread, and
    :meth:`signal_now` on any thread (it hands its call to the host thread, :attr:`submit`).

    Its CUDA streams are made here, once per heap (so once per process), with
    ``cuStreamCreate(CU_STREAM_NON_BLOCKING)``: the communication stream (puts, signals, the
    device-driven waits), the poll stream (reading its own words and tables), the abort stream
    (:meth:`signal_now`) and the force stream (:meth:`.nvshmem_stream.NvshmemStream.force`). None
    of them is torch's pool stream: the pool hands out 32 streams round robin, so a stream made
    later (per epoch) could be the communication stream itself, queued behind the wait it should
    end. They are not destroyed: torch's allocator may record events on them (``record_stream``)
    until the process exits.

    Args:
        whole: the uint8 symmetric tensor of ``heap_bytes + 8 * signal_words(world_size)`` bytes.
        rank, world_size: this PE and the number of PEs.
        heap_bytes: arena bytes (a multiple of 256).
        device: this PE's CUDA device (several PEs may share one).
        bindings: ``nvshmem.bindings``.
        driver: the CUDA driver calls (default a :class:`~.memop_stream.StreamDriver` on ``device``).
        cuda: the torch work (default :class:`~.nvshmem_stream.TorchCuda` on ``device``).
        init_status: NVSHMEM's init status by name (:func:`init_status_name`).

    Attributes:
        submit: queues ``fn(*args)`` on the NVSHMEM host thread without waiting (a
            ``HostThread.submit``, which runs ``fn`` at once when called there); set by
            :class:`NvshmemRuntime` to its own; None: the process runtime's.
    """

    def __init__(self, whole: torch.Tensor, rank: int, world_size: int, heap_bytes: int,
                 device: torch.device, bindings, *, driver=None, cuda=None, init_status: str = "unknown"):
        from .nvshmem_stream import TorchCuda
        self._bindings = bindings
        words = signal_words(world_size)
        self.rank, self.world_size, self.device = rank, world_size, device
        self.init_status = init_status
        self._whole = whole
        self.arena = whole[:heap_bytes]
        self._words = whole[heap_bytes:heap_bytes + 8 * words].view(torch.int64)
        self._sig_at = self._words.data_ptr()
        self._set = int(getattr(bindings.Signal_op, "SIGNAL_SET"))
        self._cuda = TorchCuda(device) if cuda is None else cuda
        if driver is None:
            from .memop_stream import StreamDriver  # host-driven exchanges need no stream memory operations
            driver = StreamDriver(self._cuda.index(), rank, require=False)
        self._drv = driver
        self._stream = driver.stream(self._cuda)  # puts, signals and the device-driven waits
        self._poll = driver.stream(self._cuda)  # reading our own words and tables
        self._abort = driver.stream(self._cuda)  # signal_now: never behind a held communication stream
        self._side = driver.stream(self._cuda)  # the device-driven stream's force()
        self._host = self._cuda.pinned(words, torch.int64)
        self._dirty: set[int] = set()  # peers with puts since their last signal (host thread only)
        self._joined = False
        self._aborting = False  # signal_now issued since the last quiet or close (host thread only)
        self.submit: Callable | None = None

    def _submitter(self) -> Callable:
        return runtime().host.submit if self.submit is None else self.submit

    # ---- the calling thread: stream work that must see the caller's current stream -------------
    def stage(self, src: torch.Tensor | None) -> torch.Tensor | None:
        """Order the communication stream after the caller's (once per quiet) and return ``src``
        as contiguous device bytes, kept from the allocator until the put has run (None: a signal)."""
        if not self._joined:  # rows to send were produced on the caller's stream
            self._stream.wait_stream(self._cuda.current_stream())
            self._joined = True
        if src is None:
            return None
        src = src.reshape(-1).contiguous()
        if src.device != self.device:  # tables are built on the host
            with self._cuda.use(self._stream):  # not blocking: the stream may be held in a wait
                src = host_to_device(src, self.device)
        self._cuda.keep(src, self._stream)  # not reused by the allocator before the put has run
        return src

    # ---- the host thread: NVSHMEM calls ---------------------------------------------------------
    # Signatures (int addresses, sizes in bytes, the stream as its int handle): see the host-thread
    # section of .nvshmem_stream.NvshmemStream. ``src`` is uint8, so numel() is its byte count.
    def put(self, pe: int, offset: int, src: torch.Tensor) -> None:
        n = src.numel()
        if n == 0:
            return
        self._bindings.putmem_on_stream(self.arena.data_ptr() + offset, src.data_ptr(), n, pe,
                                        self._stream.cuda_stream)
        self._dirty.add(pe)

    def _fence(self, pe: int) -> None:
        if pe in self._dirty:  # earlier puts to pe must land before its signal does
            self._bindings.quiet_on_stream(self._stream.cuda_stream)
            self._dirty.clear()

    def put_signal(self, pe: int, offset: int, src: torch.Tensor, slot: int, value: int) -> None:
        self._fence(pe)
        self._bindings.putmem_signal_on_stream(self.arena.data_ptr() + offset, src.data_ptr(), src.numel(),
                                               self._sig_at + 8 * slot, int(value), self._set, pe,
                                               self._stream.cuda_stream)

    def signal(self, pe: int, slot: int, value: int) -> None:
        self._fence(pe)
        self._bindings.signal_op_on_stream(self._sig_at + 8 * slot, int(value), self._set, pe,
                                           self._stream.cuda_stream)

    def signal_now(self, pe: int, slot: int, value: int) -> None:
        """:meth:`signal`, ordered after nothing queued before it, for the abort path
        (``SymmetricTransport._abort``), from any thread: the communication stream may be held by
        the very wait the abort is to end, so a signal queued there would land only once that wait
        is forced, and a ``quiet`` (which synchronizes it) would not return before.

        ``signal_op_on_stream(SIGNAL_SET)`` on the heap's abort stream (never held: nothing waits
        there), issued on the host thread like every NVSHMEM call (:attr:`submit`; at once when
        called there), without a fence (an abort need not follow the rows) and without waiting:
        neither for the host thread nor for any stream. Every later host call (``quiet``,
        ``close``, ``finalize``) runs after it, and the next :meth:`quiet` or :meth:`close` waits
        for it to complete.

        Raises:
            ValueError: ``slot`` outside the signal words.
            DistCAError: the host thread is stuck or stopped.
        """
        if not 0 <= slot < self._words.numel():
            raise ValueError(f"participant {self.rank}: signal word {slot} outside [0, {self._words.numel()})")
        self._submitter()(self._signal_now, int(pe), self._sig_at + 8 * slot, int(value))

    def _signal_now(self, pe: int, sig: int, value: int) -> None:  # on the host thread
        self._bindings.signal_op_on_stream(sig, value, self._set, pe, self._abort.cuda_stream)
        self._aborting = True

    def _join_aborts(self) -> None:
        # signal_now's signals have completed when quiet() or close() returns: a process that
        # leaves right after close() must not lose them. NVSHMEM's quiet is per stream (a remote
        # PE's signal goes through the proxy), and the abort stream is never held, so its
        # synchronize returns (unless it shares a hardware queue with a held wait: see
        # nvshmem_stream.DEVICE_CONNECTIONS_NEEDED).
        if self._aborting:
            self._bindings.quiet_on_stream(self._abort.cuda_stream)
            self._abort.synchronize()
            self._aborting = False

    def quiet(self) -> None:
        self._join_aborts()
        if self._joined:
            self._bindings.quiet_on_stream(self._stream.cuda_stream)
            self._stream.synchronize()
            self._dirty.clear()
            self._joined = False

    def close(self) -> None:
        """Stop using the heap for now (it stays allocated for the next group epoch; the runtime
        frees it at exit)."""
        self._join_aborts()
        self._stream.synchronize()

    # ---- device-driven exchanges -------------------------------------------------------------------
    def stream_ops(self, abort_value: int, submit: Callable | None = None, timeout_s: float = FINALIZE_TIMEOUT_S):
        """This PE's :class:`~.nvshmem_stream.NvshmemStream` for :class:`~.routed.RoutedTransport`,
        on the heap's own communication stream and fence bookkeeping (host- and device-driven
        work stay in one order). ``submit`` queues a call on the NVSHMEM host thread (default the
        runtime's; :class:`HostBoundHeap` passes its own); ``timeout_s`` bounds a marker's join.
        The streams and driver calls are the heap's, made once (a transport per group epoch calls
        this again). Warns once per process when ``CUDA_DEVICE_MAX_CONNECTIONS`` is too low for
        device-driven exchanges (:func:`~.nvshmem_stream.warn_device_connections`).

        Returns:
            the stream, or None (with a warning) when this nvshmem4py lacks a call it needs or the
            device has no 64-bit stream memory operations: the transport's exchanges then stay
            host-driven.
        """
        from .nvshmem_stream import NvshmemStream, missing_bindings, warn_device_connections
        missing = missing_bindings(self._bindings)
        if missing:
            warnings.warn(f"nvshmem4py lacks {', '.join(missing)}: NVSHMEM exchanges stay host-driven",
                          RuntimeWarning, stacklevel=2)
            return None
        if not self._drv.memops:  # the device-driven waits are cuStreamWaitValue64
            warnings.warn(f"{self.device} has no 64-bit stream memory operations "
                          f"(CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS is 0): NVSHMEM exchanges stay "
                          f"host-driven", RuntimeWarning, stacklevel=2)
            return None
        warn_device_connections()
        return NvshmemStream(self.arena, self._words, self.rank, abort_value, bindings=self._bindings,
                             submit=self._submitter() if submit is None else submit, device=self.device,
                             cuda=self._cuda, driver=self._drv, comm=self._stream, side=self._side,
                             dirty=self._dirty, timeout_s=timeout_s)

    # ---- this PE's own memory: no NVSHMEM call ---------------------------------------------------
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)  # on the caller's stream, like the rows it produced

    def signals(self) -> np.ndarray:
        with self._cuda.use(self._poll):
            self._host.copy_(self._words, non_blocking=True)
        self._poll.synchronize()
        return self._host.numpy().copy()

    def read(self, offset: int, nbytes: int) -> torch.Tensor:
        with self._cuda.use(self._poll):
            out = self.arena[offset:offset + nbytes].to("cpu", non_blocking=False)
        self._poll.synchronize()
        return out

    def idle(self, seconds: float) -> None:
        # No wake-up from a GPU signal without a kernel waiting on it; poll at a short interval
        # (a poll is one small device-to-host copy).
        time.sleep(min(seconds, 5e-5))

    def finalize(self) -> None:
        """Free the heap and finalize NVSHMEM now (collective: every PE calls it; see
        :meth:`NvshmemRuntime.finalize`)."""
        runtime().finalize()


class Nvshmem4py:
    """The NVSHMEM calls an :class:`NvshmemRuntime` makes, through nvshmem4py (each runs on the
    host thread). Tests of the lifecycle pass a fake with the same four methods (``configure``,
    ``unique_id``, ``start``, ``finalize``)."""

    def configure(self, world_size: int, heap_bytes: int) -> None:
        """NVSHMEM's environment, before its first call in the process: :func:`set_symmetric_size`."""
        set_symmetric_size(heap_bytes, world_size)

    def unique_id(self) -> bytes:
        core, _, _ = _modules()
        return _uid_bytes(core.get_unique_id())

    def start(self, uid: bytes, rank: int, world_size: int, heap_bytes: int, device) -> NvshmemHeap:
        """``nvshmem.core.init`` (uid bootstrap) on ``device`` and the one symmetric allocation
        (collective). NVSHMEM_SYMMETRIC_SIZE is set to hold it plus NVSHMEM's own state, unless
        already set (on world rank 0 already before its unique id: :meth:`configure`). The heap
        records NVSHMEM's init status (:func:`init_status_name`).

        Raises:
            nvshmem.core.NvshmemError: NVSHMEM failed to start.
        """
        core, bindings, Device = _modules()
        words = signal_words(world_size)
        self.configure(world_size, heap_bytes)  # the other PEs' first NVSHMEM call is init
        device = torch.device(device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)  # on the host thread, which makes every later call
        dev = Device(device.index)
        dev.set_current()
        # nvshmem.core.init(device: cuda.core.Device, uid, rank, nranks, mpi_comm, initializer_method)
        core.init(device=dev, uid=_uid_from(uid), rank=rank, nranks=world_size, initializer_method="uid")
        whole = core.interop.torch.bytetensor((heap_bytes + 8 * words,))  # uint8 [n], collective
        return NvshmemHeap(whole, rank, world_size, heap_bytes, device, bindings, init_status=init_status_name(core))

    def finalize(self, heap: NvshmemHeap) -> None:
        """Free the heap and finalize NVSHMEM (collective). The heap's streams stay (see
        :class:`NvshmemHeap`)."""
        core, _, _ = _modules()
        heap._stream.synchronize()
        core.interop.torch.free_tensor(heap._whole)
        core.finalize()


class NvshmemRuntime:
    """A process's NVSHMEM: started by the first group epoch, reused by the later ones of the same
    world, finalized at exit (see the module docstring).

    Args:
        driver: the NVSHMEM calls (default :class:`Nvshmem4py`).
        host: the thread they run on (default: a new :class:`HostThread`).
        register_exit: finalize at interpreter exit (``atexit``) once started.

    Attributes:
        state: ``"idle"`` (not started), ``"running"``, ``"failed"`` (a start failed or is stuck:
            NVSHMEM cannot be started again in this process) or ``"finalized"``.
        uid, rank, world_size, heap_bytes: the running world's unique id, this PE, its size and
            arena bytes.
        init_status: NVSHMEM's init status by name once started (:func:`init_status_name`, e.g.
            :data:`LIMITED_MPG` when several PEs share a GPU without MPS), else None.
        starts, finalizes: how often NVSHMEM was started and finalized (at most once each).
    """

    def __init__(self, driver=None, host: HostThread | None = None, register_exit: bool = True):
        self.driver = Nvshmem4py() if driver is None else driver
        self.host = HostThread() if host is None else host
        self.state, self.why = "idle", ""
        self.uid: bytes | None = None
        self.rank = self.world_size = self.heap_bytes = None
        self.init_status: str | None = None
        self.heap: ReusableHeap | None = None
        self.timeout_s = FINALIZE_TIMEOUT_S
        self.starts = self.finalizes = 0
        self._register_exit = register_exit
        self._lock = threading.Lock()

    def _unusable(self) -> str | None:
        if self.state == "failed":
            return f"NVSHMEM failed to start in this process earlier ({self.why}) and cannot be started again"
        if self.state == "finalized":
            return ("NVSHMEM was finalized in this process; a second nvshmem_init in one program is "
                    "undefined behaviour, so it is not started again")
        return None

    def join(self, *, rank: int, world_size: int, timeout_s: float, publish: Callable[[dict], None],
             lookup: Callable[[], object], heap_bytes: int = DEFAULT_HEAP_BYTES,
             device: torch.device | str = "cuda", epoch: int = 0) -> SymmetricTransport:
        """This PE's transport of group epoch ``epoch``, a :class:`~.routed.RoutedTransport` (see
        :func:`join_nvshmem`).

        Raises:
            ValueError: bad rank, world size or heap size.
            DistCAError: NVSHMEM could not start within ``timeout_s`` seconds, or the epoch needs
                another world or a bigger heap than the one this process runs (the message says
                which), or ``epoch`` is not above the previous epoch on this heap.
        """
        world_size, rank, heap_bytes = int(world_size), int(rank), aligned(heap_bytes)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range [0, {world_size})")
        where = f"NVSHMEM group epoch {epoch}, rank {rank} of {world_size}"
        with self._lock:
            if rank == 0:
                check_heap_bytes(heap_bytes, world_size)  # before anything is published
                value = self._offer(world_size, heap_bytes, where, publish)
            else:
                value = lookup()
                if isinstance(value, (bytes, bytearray)):  # a bare unique id: a fresh world
                    value = {"uid": bytes(value), "heap_bytes": heap_bytes, "reuse": False}
                if "error" in value:
                    raise DistCAError(f"{where}: world rank 0 cannot form the group: {value['error']}")
            uid, heap_bytes = bytes(value["uid"]), int(value["heap_bytes"])
            check_heap_bytes(heap_bytes, world_size)
            if self.state == "idle":
                if value.get("reuse"):
                    raise DistCAError(f"{where}: world rank 0 reuses a running NVSHMEM world this process "
                                      f"never joined; NVSHMEM cannot add a PE to a running world, so world "
                                      f"rank 0's process must restart for a new world to start")
                self._start(uid, rank, world_size, heap_bytes, device, timeout_s, where)
            elif self._unusable() is not None:
                raise DistCAError(f"{where}: {self._unusable()}")
            elif (uid, rank, world_size) != (self.uid, self.rank, self.world_size):
                raise DistCAError(f"{where}: this process runs NVSHMEM as PE {self.rank} of another world "
                                  f"of {self.world_size}, and NVSHMEM cannot be started twice in one "
                                  f"process; the group's processes must restart to form a new world")
            self.timeout_s = float(timeout_s)
            try:
                lease = self.heap.lease(int(epoch))
            except ValueError as exc:
                raise DistCAError(f"{where}: cannot reuse the heap: {exc}") from None
        from .routed import RoutedTransport  # exchanges of installed routes are device-driven
        return RoutedTransport(lease, timeout_s=timeout_s, epoch=epoch)

    def _offer(self, world_size: int, heap_bytes: int, where: str, publish) -> dict:
        """World rank 0: the bootstrap value (published): a fresh unique id, or the running world's."""
        problem = self._unusable()
        if problem is None and self.state == "running":
            if self.rank != 0 or self.world_size != world_size:
                problem = (f"this process runs NVSHMEM as PE {self.rank} of a world of {self.world_size}, "
                           f"not PE 0 of {world_size}; NVSHMEM cannot be started twice in one process, so "
                           f"the group's processes must restart to form a new world")
            elif heap_bytes > self.heap_bytes:
                problem = (f"the group asks for a {heap_bytes}-byte heap, the running NVSHMEM world has "
                           f"{self.heap_bytes} bytes, and it can grow only by restarting its processes")
        if problem is not None:
            try:
                publish({"error": problem})  # the others fail at once instead of at their timeout
            except Exception:  # noqa: BLE001 - the error below is what matters
                pass
            raise DistCAError(f"{where}: {problem}")
        if self.state == "running":
            value = {"uid": self.uid, "heap_bytes": self.heap_bytes, "reuse": True}
        else:
            self.driver.configure(world_size, heap_bytes)  # before the unique id: NVSHMEM reads its environment then
            try:
                uid = self.host.call(self.driver.unique_id, what="get_unique_id")
            except ImportError:
                raise
            except Exception as exc:  # noqa: BLE001 - NvshmemError and friends, reported as one kind
                raise DistCAError(f"could not make an NVSHMEM unique id for {where}: {_first_line(exc)}") from None
            value = {"uid": uid, "heap_bytes": heap_bytes, "reuse": False}
        publish(value)
        return value

    def _start(self, uid, rank, world_size, heap_bytes, device, timeout_s, where) -> None:
        try:
            heap = self.host.call(self.driver.start, uid, rank, world_size, heap_bytes, device,
                                  timeout_s=timeout_s, what="init")
        except ImportError:
            raise  # nvshmem4py is not installed: nothing was started
        except Exception as exc:  # noqa: BLE001 - NvshmemError and friends, reported as one kind
            why = _first_line(exc)
            self.state, self.why = "failed", why
            raise DistCAError(f"could not start NVSHMEM for {where}: {why}") from None
        self.state, self.starts = "running", self.starts + 1
        self.uid, self.rank, self.world_size, self.heap_bytes = uid, rank, world_size, heap_bytes
        self.init_status = getattr(heap, "init_status", None)
        if isinstance(heap, NvshmemHeap):
            heap.submit = self.host.submit  # signal_now, from any thread, calls NVSHMEM on this host thread
        log.info("NVSHMEM started: PE %d of %d, init status %s, NVSHMEM_SYMMETRIC_SIZE=%s", rank, world_size,
                 self.init_status, os.environ.get("NVSHMEM_SYMMETRIC_SIZE"))
        self.heap = ReusableHeap(HostBoundHeap(heap, self.host, timeout_s))
        if self._register_exit:
            atexit.register(self.finalize)

    def describe(self) -> dict:
        """What this process runs, for reports (e.g. a GPU session's): ``state``, ``init_status``
        (None before the start), ``rank``, ``world_size``, ``heap_bytes`` (arena bytes per PE),
        ``symmetric_size`` (``NVSHMEM_SYMMETRIC_SIZE`` as set, or None), ``starts``, ``finalizes``."""
        return {"state": self.state, "init_status": self.init_status, "rank": self.rank,
                "world_size": self.world_size, "heap_bytes": self.heap_bytes,
                "symmetric_size": os.environ.get("NVSHMEM_SYMMETRIC_SIZE"), "starts": self.starts,
                "finalizes": self.finalizes}

    def finalize(self, timeout_s: float | None = None) -> bool:
        """Free the heap and finalize NVSHMEM (collective: every PE of the world must call it; the
        leases end). Waits at most ``timeout_s`` seconds (default: the last group's timeout): with
        a dead peer the barrier never completes, and the host thread is left stuck (it is a daemon
        thread, so the process still exits). Called at exit; later calls do nothing.

        Returns:
            whether NVSHMEM was finalized.
        """
        with self._lock:
            if self.state != "running":
                return False
            self.state = "finalized"
            heap, self.heap = self.heap, None
        try:
            heap.close()  # ends the lease; the endpoint's stream is drained
        except Exception:  # noqa: BLE001 - the host thread may be stuck already
            return False
        try:
            self.host.call(self.driver.finalize, heap.heap.heap,
                           timeout_s=self.timeout_s if timeout_s is None else timeout_s, what="finalize")
        except Exception:  # noqa: BLE001 - at exit: a peer may be gone; nothing else to do
            return False
        self.finalizes += 1
        return True


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__


_RUNTIME: NvshmemRuntime | None = None
_RUNTIME_LOCK = threading.Lock()


def runtime() -> NvshmemRuntime:
    """The process's :class:`NvshmemRuntime` (made on first use; starts nothing)."""
    global _RUNTIME
    with _RUNTIME_LOCK:
        if _RUNTIME is None:
            _RUNTIME = NvshmemRuntime()
        return _RUNTIME


def join_nvshmem(*, rank: int, world_size: int, timeout_s: float, publish: Callable[[dict], None],
                 lookup: Callable[[], object], heap_bytes: int = DEFAULT_HEAP_BYTES,
                 device: torch.device | str = "cuda", epoch: int = 0) -> SymmetricTransport:
    """Form (or join) an NVSHMEM group epoch through the process's :func:`runtime`.

    World rank 0 publishes ``{"uid", "heap_bytes", "reuse"}``: a fresh unique id and its
    ``heap_bytes`` (arena bytes per PE, rounded up to 256) when this process has not started
    NVSHMEM, else the running world's (the heap is reused); the others ``lookup()`` it (through the
    scheduler, with the group epoch) and start NVSHMEM or reuse theirs. The transport's signals
    carry ``epoch`` as their generation, so epochs on one heap must increase. The transport is a
    :class:`~.routed.RoutedTransport` (a :class:`~.symmetric.SymmetricTransport` whose exchanges
    of an installed route are device-driven).

    Raises:
        ValueError: bad rank or sizes.
        DistCAError: NVSHMEM could not start (the message carries NVSHMEM's) within
            ``timeout_s`` seconds, or this epoch needs another world or a bigger heap than the
            process runs (NVSHMEM is started at most once per process).
    """
    return runtime().join(rank=rank, world_size=world_size, timeout_s=timeout_s, publish=publish,
                          lookup=lookup, heap_bytes=heap_bytes, device=device, epoch=epoch)


__all__ = ["DEFAULT_HEAP_BYTES", "LIMITED_MPG", "HostBoundHeap", "HostThread", "Nvshmem4py", "NvshmemHeap",
           "NvshmemRuntime", "available", "init_status_name", "join_nvshmem", "runtime",
           "set_symmetric_size", "symmetric_size", "unique_id"]
