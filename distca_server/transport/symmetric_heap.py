"""What the one-sided exchange (:mod:`.symmetric`) needs of a heap: the :class:`SymmetricHeap`
endpoint (implemented by :mod:`.shm`, :mod:`.nvshmem` and :mod:`.local_heap`), the ids of buffer
keys every PE computes alike, and the deterministic allocator that keeps arrays at the same arena
offsets on every PE."""

from __future__ import annotations

import zlib
from typing import Protocol

import numpy as np
import torch


class SymmetricHeap(Protocol):
    """One PE's endpoint of a symmetric heap.

    Attributes:
        rank, world_size: this PE and the number of PEs.
        device: where the arena lives.
        arena: uint8 [heap_bytes], this PE's part of the heap; peers write into it at the same
            offsets they use in their own.
    """

    rank: int
    world_size: int
    device: torch.device
    arena: torch.Tensor

    def put(self, pe: int, offset: int, src: torch.Tensor) -> None:
        """Write ``src`` (uint8, any device) into PE ``pe``'s arena at ``offset`` (may return
        before the bytes have landed: see :meth:`quiet`)."""
        ...

    def put_signal(self, pe: int, offset: int, src: torch.Tensor, slot: int, value: int) -> None:
        """:meth:`put`, then set PE ``pe``'s signal word ``slot`` to ``value`` once the bytes of this
        and of every earlier put to ``pe`` have landed."""
        ...

    def signal(self, pe: int, slot: int, value: int) -> None:
        """Set PE ``pe``'s signal word ``slot`` to ``value`` (after every earlier put to ``pe``)."""
        ...

    def signals(self) -> np.ndarray:
        """A snapshot of this PE's signal words: int64 [signal_words(world_size)]."""
        ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Local copy of uint8 ``src`` into ``dst`` on this PE's device (own split, staged rows)."""
        ...

    def read(self, offset: int, nbytes: int) -> torch.Tensor:
        """A CPU copy of this PE's arena bytes ``[offset, offset + nbytes)`` (tables)."""
        ...

    def quiet(self) -> None:
        """Return once every put and signal this PE issued has landed."""
        ...

    def idle(self, seconds: float) -> None:
        """Block for up to ``seconds``; may return early, and should when a peer sets one of this
        PE's signal words (a wake-up, or a short sleep for heaps that can only be polled)."""
        ...

    def close(self) -> None:
        """Release this PE's mappings of the heap."""
        ...


def key_id(key: str) -> int:
    """The id every PE uses for buffer ``key`` in growth requests (>= 2; 0 and 1 are reserved)."""
    return 2 + zlib.crc32(key.encode()) % (2 ** 31)


class _FirstFit:
    """First-fit allocator of arena ranges. Deterministic: PEs that make the same calls in the
    same order get the same offsets, which is what keeps the heap symmetric."""

    def __init__(self, start: int, end: int):
        self.free = [(start, end - start)] if end > start else []

    def alloc(self, nbytes: int) -> int | None:
        for i, (off, size) in enumerate(self.free):
            if size >= nbytes:
                if size == nbytes:
                    del self.free[i]
                else:
                    self.free[i] = (off + nbytes, size - nbytes)
                return off
        return None

    def release(self, off: int, nbytes: int) -> None:
        self.free.append((off, nbytes))
        self.free.sort()
        merged = [self.free[0]]
        for o, s in self.free[1:]:
            lo, ls = merged[-1]
            if lo + ls == o:
                merged[-1] = (lo, ls + s)
            else:
                merged.append((o, s))
        self.free = merged
