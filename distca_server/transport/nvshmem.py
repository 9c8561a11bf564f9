"""The NVSHMEM symmetric heap: :class:`.symmetric.SymmetricTransport` with GPU-direct puts.

A thin binding of :class:`.symmetric.SymmetricHeap` to nvshmem4py (extra ``nvshmem``); the exchange
itself (offsets, credits, growth, failure) is in :mod:`.symmetric`, tested on CPU with :mod:`.shm`.
nvshmem4py and cuda.core are imported only when a heap is made: importing this module (or
distca_server) on a CPU install needs neither.

Memory: one symmetric allocation per PE at start, ``heap_bytes`` of arena followed by the signal
words; the transport carves its arrays from the arena by agreement, so no NVSHMEM allocation (a
collective) happens after start. The words are assumed zero in freshly mapped heap memory
(``test_transport_nvshmem`` checks it): zeroing them after the allocation could erase a fast
peer's first signal, and a barrier to prevent that would be a collective.

Operations are host-initiated and stream-ordered (``*_on_stream``) on a communication stream that
first waits for the caller's stream (where the rows to send were produced); waits poll the signal
words with a device-to-host copy on a separate stream, so a dead peer costs a timeout, never a hung
stream. Only point-to-point RMA is used: several PEs may share one GPU without MPS.

Bootstrap: world rank 0 makes an NVSHMEM unique id (:func:`unique_id`), the scheduler hands its
bytes to the others with the group epoch (in tests a ``torch.multiprocessing`` queue does), and
every PE calls :func:`join_nvshmem`.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np
import torch

from ..errors import DistCAError
from .base import aligned
from .symmetric import SymmetricTransport, signal_words, table_bytes

DEFAULT_HEAP_BYTES = 1 << 30


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


def unique_id() -> bytes:
    """A fresh NVSHMEM unique id (on world rank 0), as bytes to hand to the other PEs."""
    core, _, _ = _modules()
    return _uid_bytes(core.get_unique_id())


def _uid_bytes(uid) -> bytes:
    return uid._data.view(np.int8).tobytes()


def _uid_from(data: bytes):
    core, _, _ = _modules()
    uid = core.get_unique_id(empty=True)
    uid._data.view(np.int8)[:] = np.frombuffer(data, dtype=np.int8)
    return uid


class NvshmemHeap:
    """This PE's endpoint of an NVSHMEM heap (see :class:`.symmetric.SymmetricHeap`).

    Args:
        uid: the unique id's bytes from :func:`unique_id` (the same on every PE).
        rank, world_size: this PE and the number of PEs.
        heap_bytes: arena bytes per PE (NVSHMEM_SYMMETRIC_SIZE is set to hold it, the signal
            words and NVSHMEM's own state, unless already set).
        device: this PE's CUDA device (several PEs may share one).

    Raises:
        ValueError: bad rank or sizes.
        nvshmem.core.NvshmemError: NVSHMEM failed to start.
    """

    def __init__(self, uid: bytes, rank: int, world_size: int, heap_bytes: int = DEFAULT_HEAP_BYTES,
                 device: torch.device | str = "cuda"):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range [0, {world_size})")
        if heap_bytes <= table_bytes(world_size):
            raise ValueError(f"heap_bytes must exceed the {table_bytes(world_size)} bytes of tables, "
                             f"got {heap_bytes}")
        core, bindings, Device = _modules()
        self._core, self._bindings = core, bindings
        words = signal_words(world_size)
        heap_bytes = aligned(heap_bytes)
        # NVSHMEM reserves its symmetric heap at init (1 GiB unless told): room for ours, plus
        # NVSHMEM's own symmetric state. An explicit NVSHMEM_SYMMETRIC_SIZE wins.
        os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(heap_bytes + 8 * words + (64 << 20)))
        device = torch.device(device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        dev = Device(device.index)
        dev.set_current()
        core.init(device=dev, uid=_uid_from(uid), rank=rank, nranks=world_size, initializer_method="uid")
        self.rank, self.world_size, self.device = rank, world_size, device
        # One collective allocation, now: the arena, then the signal words.
        self._whole = core.interop.torch.bytetensor((heap_bytes + 8 * words,))
        self.arena = self._whole[:heap_bytes]
        self._words = self._whole[heap_bytes:].view(torch.int64)
        self._sig_at = self._words.data_ptr()
        self._set = int(getattr(bindings.Signal_op, "SIGNAL_SET"))
        self._stream = torch.cuda.Stream(device)  # puts and signals
        self._poll = torch.cuda.Stream(device)  # reading our own words and tables
        self._host = torch.empty(words, dtype=torch.int64, pin_memory=True)
        self._dirty: set[int] = set()  # peers with puts since their last signal
        self._joined = False

    def _on_stream(self) -> int:
        if not self._joined:  # rows to send were produced on the caller's stream
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            self._joined = True
        return self._stream.cuda_stream

    def _source(self, src: torch.Tensor) -> torch.Tensor:
        src = src.reshape(-1).contiguous()
        if src.device != self.device:  # tables are built on the host
            with torch.cuda.stream(self._stream):
                src = src.to(self.device, non_blocking=False)
        src.record_stream(self._stream)  # not reused by the allocator before the put has run
        return src

    def put(self, pe: int, offset: int, src: torch.Tensor) -> None:
        n = src.numel()
        if n == 0:
            return
        stream = self._on_stream()
        src = self._source(src)
        self._bindings.putmem_on_stream(self.arena.data_ptr() + offset, src.data_ptr(), n, pe, stream)
        self._dirty.add(pe)

    def put_signal(self, pe: int, offset: int, src: torch.Tensor, slot: int, value: int) -> None:
        stream = self._on_stream()
        if pe in self._dirty:  # earlier puts to pe must land before this signal does
            self._bindings.quiet_on_stream(stream)
            self._dirty.clear()
        src = self._source(src)
        self._bindings.putmem_signal_on_stream(self.arena.data_ptr() + offset, src.data_ptr(), src.numel(),
                                               self._sig_at + 8 * slot, int(value), self._set, pe, stream)

    def signal(self, pe: int, slot: int, value: int) -> None:
        stream = self._on_stream()
        if pe in self._dirty:
            self._bindings.quiet_on_stream(stream)
            self._dirty.clear()
        self._bindings.signal_op_on_stream(self._sig_at + 8 * slot, int(value), self._set, pe, stream)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)  # on the caller's stream, like the rows it produced

    def signals(self) -> np.ndarray:
        with torch.cuda.stream(self._poll):
            self._host.copy_(self._words, non_blocking=True)
        self._poll.synchronize()
        return self._host.numpy().copy()

    def read(self, offset: int, nbytes: int) -> torch.Tensor:
        with torch.cuda.stream(self._poll):
            out = self.arena[offset:offset + nbytes].to("cpu", non_blocking=False)
        self._poll.synchronize()
        return out

    def idle(self, seconds: float) -> None:
        # No wake-up from a GPU signal without a kernel waiting on it; poll at a short interval
        # (a poll is one small device-to-host copy).
        time.sleep(min(seconds, 5e-5))

    def quiet(self) -> None:
        if self._joined:
            self._bindings.quiet_on_stream(self._stream.cuda_stream)
            self._stream.synchronize()
            self._dirty.clear()
            self._joined = False

    def close(self) -> None:
        """Stop using the heap. NVSHMEM's own teardown (``finalize``) is collective and would hang
        on a dead peer, so it is left to :meth:`finalize`, called when every PE is known alive."""
        self._stream.synchronize()

    def finalize(self) -> None:
        """Free the heap and finalize NVSHMEM (collective: every PE calls it)."""
        self._core.interop.torch.free_tensor(self._whole)
        self._core.finalize()


def join_nvshmem(*, rank: int, world_size: int, timeout_s: float, publish: Callable[[bytes], None],
                 lookup: Callable[[], bytes], heap_bytes: int = DEFAULT_HEAP_BYTES,
                 device: torch.device | str = "cuda", epoch: int = 0) -> SymmetricTransport:
    """Form (or join) an NVSHMEM group: rank 0 makes the unique id and ``publish``-es its bytes, the
    others ``lookup()`` them (through the scheduler, with the group epoch); every PE starts NVSHMEM.

    Raises:
        DistCAError: NVSHMEM could not start (the message carries NVSHMEM's).
    """
    try:
        if rank == 0:
            uid = unique_id()
            publish(uid)
        else:
            uid = lookup()
        heap = NvshmemHeap(uid, rank, world_size, heap_bytes, device)
    except ImportError:
        raise
    except Exception as exc:  # noqa: BLE001 - NvshmemError and friends, reported as one kind
        why = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        raise DistCAError(f"could not start NVSHMEM for group epoch {epoch} as rank {rank} of "
                          f"{world_size}: {why}") from None
    return SymmetricTransport(heap, timeout_s=timeout_s, epoch=epoch)
