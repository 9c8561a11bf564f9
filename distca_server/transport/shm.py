"""A CPU symmetric heap: the processes of one host share memory-mapped files.

The reference implementation of :class:`.symmetric.SymmetricHeap` (the exchange algorithm runs on it
unchanged, and it is tested on CPU), and a real intra-host transport between CPU processes.

Layout: a directory (under ``/dev/shm`` where it exists) holding, per PE, ``pe{r}.arena`` (the arena,
a sparse file: pages cost memory only once written) and ``pe{r}.signals`` (int64 signal words).
Every PE maps every PE's files, so a put is a ``copy_`` into the peer's mapping and a signal an
8-byte store. A waiting PE blocks on its *doorbell*, a named pipe ``pe{r}.bell`` that a peer writes
a byte to after setting one of its signal words, so it wakes when the kernel delivers the byte
(as a socket read would) instead of sleeping through a polling interval; it re-reads its words
either way, so a lost or early byte costs nothing but a wake-up.

Ordering: a signal must not become visible before the data written ahead of it. Both are plain
stores to shared mappings issued in program order, which x86-64 (TSO) keeps; weakly ordered CPUs
would need a fence here.

Bootstrap: the creator (world rank 0, like the rendezvous store of :mod:`.torch_dist`) makes every
PE's files with :func:`create_heap` and hands the others the returned *handle*, a small msgpack-able
dict, the analogue of NVSHMEM's unique id; each PE attaches with :class:`ShmHeap`, which maps every
PE's files and opens every doorbell at once: once all PEs attached, the files may be removed (the
mappings and pipes stay), so a PE that dies later leaves nothing in ``/dev/shm``.
"""

from __future__ import annotations

import mmap
import os
import select
import shutil
import tempfile
from typing import Callable

import numpy as np
import torch

from scheduler.config import DEFAULT_HEAP_BYTES

from ..errors import DistCAError
from .routed import RoutedTransport
from .symmetric_words import check_heap_bytes, signal_words
HEAP_PREFIX = "distca-heap-"  # every heap directory's name starts so


def host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy CPU uint8 ``src`` into ``dst`` with numpy's single-threaded copy: torch's would wake
    its OpenMP workers, whose spinning after each copy starves the peers a PE is exchanging with on
    a small machine (10x slower rounds measured on 2 cores)."""
    np.copyto(dst.numpy(), src.reshape(-1).numpy())


def heap_root() -> str:
    """Where heaps are made: ``/dev/shm`` (memory) when the host has it, else the temp directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def create_heap(world_size: int, heap_bytes: int = DEFAULT_HEAP_BYTES, root: str | None = None,
                prefix: str = HEAP_PREFIX) -> dict:
    """Make the shared files of a heap of ``world_size`` PEs with ``heap_bytes`` of arena each, in
    a new directory named ``prefix`` + a random suffix under ``root`` (default :func:`heap_root`).

    Returns:
        the handle ``{"kind": "shm", "path", "world_size", "heap_bytes"}`` the PEs attach with.

    Raises:
        ValueError: ``world_size < 1`` or an arena too small for the exchange's tables.
    """
    world_size, heap_bytes = int(world_size), int(heap_bytes)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    check_heap_bytes(heap_bytes, world_size)
    path = tempfile.mkdtemp(prefix=prefix, dir=heap_root() if root is None else root)
    for pe in range(world_size):
        for name, size in ((f"pe{pe}.arena", heap_bytes), (f"pe{pe}.signals", 8 * signal_words(world_size))):
            with open(os.path.join(path, name), "wb") as f:
                f.truncate(size)  # zero-filled and sparse
        os.mkfifo(os.path.join(path, f"pe{pe}.bell"), 0o600)
    return {"kind": "shm", "path": path, "world_size": world_size, "heap_bytes": heap_bytes}


def destroy_heap(handle: dict) -> None:
    """Remove a heap's files (mappings that PEs still hold stay valid until they close)."""
    shutil.rmtree(handle["path"], ignore_errors=True)


def _map(path: str) -> mmap.mmap:
    with open(path, "r+b") as f:
        return mmap.mmap(f.fileno(), 0)


class ShmHeap:
    """PE ``rank``'s endpoint of the heap ``handle`` (see :class:`.symmetric.SymmetricHeap`); the
    ``owner`` removes the heap's files when it closes.

    Raises:
        ValueError: ``rank`` out of range.
        OSError: the heap's files are gone.
    """

    def __init__(self, handle: dict, rank: int, owner: bool = False):
        P = int(handle["world_size"])
        if not 0 <= rank < P:
            raise ValueError(f"rank {rank} out of range [0, {P})")
        self.rank, self.world_size, self.device = int(rank), P, torch.device("cpu")
        self.handle, self.owner = handle, owner
        self._maps = [(_map(os.path.join(handle["path"], f"pe{pe}.arena")),
                       _map(os.path.join(handle["path"], f"pe{pe}.signals"))) for pe in range(P)]
        self._arenas = [torch.frombuffer(a, dtype=torch.uint8) for a, _ in self._maps]
        self._signals = [np.frombuffer(s, dtype=np.int64) for _, s in self._maps]
        self.arena = self._arenas[self.rank]
        # Read-write, so the pipe never reports end-of-file while no peer has it open; the peers'
        # too (a write-only open fails while the peer has not attached), all now, so that the
        # heap's files are not needed once every PE attached.
        bells = [os.open(os.path.join(handle["path"], f"pe{pe}.bell"), os.O_RDWR | os.O_NONBLOCK)
                 for pe in range(P)]
        self._bell = bells[self.rank]
        self._rings = {pe: fd for pe, fd in enumerate(bells) if pe != self.rank}

    def put(self, pe: int, offset: int, src: torch.Tensor) -> None:
        self.copy(self._arenas[pe][offset:offset + src.numel()], src)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        host_copy(dst, src)

    def put_signal(self, pe: int, offset: int, src: torch.Tensor, slot: int, value: int) -> None:
        self.put(pe, offset, src)
        self.signal(pe, slot, value)

    def signal(self, pe: int, slot: int, value: int) -> None:
        self._signals[pe][slot] = value  # one aligned 8-byte store
        self._ring(pe)

    def _ring(self, pe: int) -> None:
        try:  # our own bell too: a word this PE sets for itself (a watchdog's abort) wakes its waiter
            os.write(self._bell if pe == self.rank else self._rings[pe], b"\0")
        except (OSError, KeyError):  # full (it reads its words before it blocks), or closed
            pass

    def idle(self, seconds: float) -> None:
        if select.select([self._bell], [], [], seconds)[0]:
            try:
                while os.read(self._bell, 4096):
                    pass
            except BlockingIOError:
                pass

    def signals(self) -> np.ndarray:
        return self._signals[self.rank].copy()

    def read(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.arena[offset:offset + nbytes].clone()

    def quiet(self) -> None:
        pass  # puts are synchronous copies

    def close(self) -> None:
        # The mappings go with the last tensor viewing them (views handed out stay valid).
        self._arenas, self._signals, self._maps = [], [], []
        for fd in [self._bell, *self._rings.values()]:
            try:
                os.close(fd)
            except OSError:
                pass
        self._bell, self._rings = -1, {}
        if self.owner:
            destroy_heap(self.handle)


def join_shm(*, rank: int, world_size: int, timeout_s: float, publish: Callable[[dict], None],
             lookup: Callable[[], dict], heap_bytes: int = DEFAULT_HEAP_BYTES,
             epoch: int = 0, prefix: str = HEAP_PREFIX) -> RoutedTransport:
    """Form (or join) a shared-memory group: rank 0 creates the heap (its directory named
    ``prefix`` + a random suffix) and ``publish``-es its handle, the others ``lookup()`` it (e.g.
    through the scheduler, with the group epoch). Rank 0 removes the heap's files when it closes,
    or earlier with :func:`destroy_heap` once every PE attached.

    Raises:
        DistCAError: the heap could not be created or attached within ``timeout_s``.
    """
    try:
        if rank == 0:
            handle = create_heap(world_size, heap_bytes, prefix=prefix)
            try:
                publish(handle)
            except BaseException:
                destroy_heap(handle)
                raise
        else:
            handle = lookup()
        heap = ShmHeap(handle, rank, owner=rank == 0)
    except (OSError, ValueError, KeyError) as exc:
        raise DistCAError(f"could not join shared-memory group epoch {epoch} as rank {rank} of "
                          f"{world_size}: {exc}") from None
    return RoutedTransport(heap, timeout_s=timeout_s, epoch=epoch)
