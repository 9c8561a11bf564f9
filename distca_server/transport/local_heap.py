"""An in-process symmetric heap: the PEs are participants of one process (``DistCAClient.local``),
their arenas and signal words plain tensors on one device (issue 22 item 2(a)).

It lets the in-process client run the one-sided protocol of :mod:`.symmetric`, device-driven once a
route is installed (:mod:`.routed`), with no NVSHMEM, no MPS and no second process: on a GPU the
exchange's own cost is measured without context switches, and on the CPU the same protocol runs in
CI. The PE stream is :class:`~.pe_stream.HostStream` on the CPU (a thread per PE) and, on CUDA,
:class:`~.memop_stream.MemopStream` (a CUDA stream per PE: copies for puts, stream memory
operations for signals and waits).

:class:`HeapGroup` is the group :class:`~distca_server.runtime.local.LocalRuntime` forms per round
sequence (``group_factory``): one heap per device and one :class:`~.routed.RoutedTransport` per
participant, run on threads (a host-driven exchange blocks until its peers arrive).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from scheduler.config import DEFAULT_HEAP_BYTES

from ..errors import DistCAError
from .base import aligned
from .routed import RoutedTransport
from .shm import host_copy
from .symmetric_words import check_heap_bytes, signal_words


def heap_bytes_for(tokens: int, row_bytes: int) -> int:
    """Arena bytes per participant for rounds of up to ``tokens`` rows of ``row_bytes`` each (a
    token's Q, K and V): two transport buffers ("client", "server"), each holding at most a round's
    rows and growing by doubling without reusing old generations (under 4x its largest size), plus
    64 MiB for the tables and staging; a multiple of the heap's alignment."""
    return aligned(8 * int(tokens) * int(row_bytes) + (64 << 20))


class LocalHeap:
    """The memory of ``world_size`` PEs of one process on ``device``.

    Attributes:
        arenas: per PE, uint8 [heap_bytes] (contents undefined until written).
        words: per PE, int64 [signal_words(world_size)], zero at start.

    Raises:
        ValueError: ``world_size < 1`` or an arena too small for the exchange's tables.
    """

    def __init__(self, world_size: int, heap_bytes: int = DEFAULT_HEAP_BYTES, device="cpu"):
        world_size, heap_bytes = int(world_size), int(heap_bytes)
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        check_heap_bytes(heap_bytes, world_size)
        self.world_size, self.heap_bytes, self.device = world_size, heap_bytes, torch.device(device)
        # empty, not zeros: untouched CPU pages cost no memory (like the shm heap's sparse files)
        self.arenas = [torch.empty(heap_bytes, dtype=torch.uint8, device=self.device) for _ in range(world_size)]
        self.words = [torch.zeros(signal_words(world_size), dtype=torch.int64, device=self.device)
                      for _ in range(world_size)]
        self._bells = [threading.Condition() for _ in range(world_size)]

    def endpoint(self, rank: int) -> "LocalHeapEndpoint":
        """PE ``rank``'s :class:`~.symmetric.SymmetricHeap` endpoint."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range [0, {self.world_size})")
        return LocalHeapEndpoint(self, rank)


class LocalHeapEndpoint:
    """One PE of a :class:`LocalHeap` (see :class:`~.symmetric.SymmetricHeap`).

    On the CPU a put is a copy into the peer's arena and a signal one store plus a wake-up of the
    peer's waiter. On CUDA the host-driven protocol's puts and signals are stream-ordered on the
    calling thread's current stream (after the rows they announce), and the host reads its words
    and arena on a stream of this endpoint's own, made now, waiting for nothing else: the calling
    thread's stream may be held by a device-side wait (a device-driven exchange's marker it
    joined), which only the watchdog's force ends, after it read the words (slow, but only the
    first exchanges of a route are host-driven). :meth:`signal_now` writes a word on that stream
    too, for the abort path.
    """

    def __init__(self, heap: LocalHeap, rank: int):
        self._heap = heap
        self.rank, self.world_size, self.device = rank, heap.world_size, heap.device
        self.arena, self.arenas, self.words = heap.arenas[rank], heap.arenas, heap.words
        self._cpu = self.device.type == "cpu"
        self._views = [w.numpy() for w in heap.words] if self._cpu else None
        if not self._cpu:  # made now: the failure path must allocate nothing (cf. MemopStream's force)
            self._poll = torch.cuda.Stream(self.device)  # a pool stream: never waits for the legacy one
            self._host = torch.empty(self.words[rank].numel(), dtype=torch.int64, pin_memory=True)
            self._poll_lock = threading.Lock()  # signals(): the watchdog's thread and the PE's share _host

    def put(self, pe: int, offset: int, src: torch.Tensor) -> None:
        n = src.numel()
        if n:
            self.copy(self.arenas[pe][offset:offset + n], src)

    def put_signal(self, pe: int, offset: int, src: torch.Tensor, slot: int, value: int) -> None:
        self.put(pe, offset, src)
        self.signal(pe, slot, value)

    def signal(self, pe: int, slot: int, value: int) -> None:
        if self._cpu:
            self._views[pe][slot] = value  # one aligned 8-byte store, after the copies above
            bell = self._heap._bells[pe]
            with bell:
                bell.notify_all()
        else:
            self.words[pe][slot].fill_(int(value))  # stream-ordered after the puts above

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self._cpu:
            host_copy(dst, src)
        else:
            dst.copy_(src.reshape(-1))

    def signal_now(self, pe: int, slot: int, value: int) -> None:
        """:meth:`signal`, ordered after nothing the calling thread queued (its stream may be held):
        the word is written when this returns. For the abort path (``SymmetricTransport._abort``)."""
        if self._cpu:
            self.signal(pe, slot, value)
            return
        with torch.cuda.stream(self._poll):
            self.words[pe][slot].fill_(int(value))
        self._poll.synchronize()

    def signals(self) -> np.ndarray:
        if self._cpu:
            return self._views[self.rank].copy()
        with self._poll_lock:
            with torch.cuda.stream(self._poll):
                self._host.copy_(self.words[self.rank], non_blocking=True)
            self._poll.synchronize()
            return self._host.numpy().copy()

    def read(self, offset: int, nbytes: int) -> torch.Tensor:
        if self._cpu:
            return self.arena[offset:offset + nbytes].to("cpu", copy=True)
        with torch.cuda.stream(self._poll):
            out = self.arena[offset:offset + nbytes].to("cpu", copy=True)  # pageable: done on return
        self._poll.synchronize()
        return out

    def quiet(self) -> None:
        if not self._cpu:
            torch.cuda.current_stream(self.device).synchronize()

    def idle(self, seconds: float) -> None:
        bell = self._heap._bells[self.rank]
        with bell:
            bell.wait(max(0.0, min(seconds, 0.05 if self._cpu else 5e-5)))

    def stream_ops(self, abort_value: int):
        """This PE's :class:`~.pe_stream.PeStream`: a :class:`~.pe_stream.HostStream` on the CPU,
        a :class:`~.memop_stream.MemopStream` on CUDA."""
        if self._cpu:
            from .pe_stream import HostStream
            return HostStream(self, abort_value, name=f"distca-local-pe-{self.rank}")
        from .memop_stream import MemopStream
        return MemopStream(self.arenas, self.words, self.rank, abort_value, device=self.device)

    def close(self) -> None:
        pass  # the heap's tensors go with the group


class HeapGroup:
    """The in-process group of ``world_size`` participants over a :class:`LocalHeap` per device,
    with the interface :class:`~distca_server.runtime.local.LocalRuntime` expects of a group.

    Args:
        world_size: participants.
        timeout_s: each exchange's deadline (seconds).
        heap_bytes: arena bytes per participant (a CPU arena costs memory only where written).
    """

    def __init__(self, world_size: int, timeout_s: float = 60.0, heap_bytes: int = DEFAULT_HEAP_BYTES):
        self.world_size, self.timeout_s, self.heap_bytes = int(world_size), float(timeout_s), int(heap_bytes)
        self._heaps: dict[str, LocalHeap] = {}
        self._endpoints: dict[tuple[int, str], RoutedTransport] = {}
        self._failed: dict[int, str] = {}
        self._lock = threading.Lock()

    def endpoint(self, rank: int, device="cpu") -> RoutedTransport:
        """Participant ``rank``'s transport on ``device`` (the same one every round)."""
        key = (int(rank), str(torch.device(device)))
        with self._lock:
            found = self._endpoints.get(key)
            if found is None:
                heap = self._heaps.get(key[1])
                if heap is None:
                    heap = self._heaps[key[1]] = LocalHeap(self.world_size, self.heap_bytes, key[1])
                found = self._endpoints[key] = RoutedTransport(heap.endpoint(rank), timeout_s=self.timeout_s)
            return found

    def abort(self, rank: int, reason: str) -> None:
        """Participant ``rank`` failed (``reason``): its endpoints leave the group, so peers
        waiting on it fail with :class:`DistCAError` at once; the runtime forms a new group."""
        with self._lock:
            self._failed[rank] = reason
            mine = [t for (r, _), t in self._endpoints.items() if r == rank or rank < 0]
        for t in mine:
            try:
                t.close()
            except DistCAError:
                pass

    @property
    def broken(self) -> bool:
        with self._lock:
            return bool(self._failed) or any(t._broken is not None for t in self._endpoints.values())

    def close(self) -> None:
        """Close every endpoint (their streams and watchdogs stop)."""
        with self._lock:
            endpoints = list(self._endpoints.values())
        for t in endpoints:
            t.close()


__all__ = ["HeapGroup", "LocalHeap", "LocalHeapEndpoint", "heap_bytes_for"]
