"""A symmetric heap reused by the transports of successive group epochs of one process.

:class:`ReusableHeap` hands each epoch's :class:`~distca_server.transport.symmetric.SymmetricTransport`
a :class:`HeapLease` with a generation above every earlier one; the signal values carry that
generation (:data:`~distca_server.transport.symmetric.GEN_SHIFT`), so a word never has to start at
zero and an old epoch's late writes are told apart (see the ``symmetric`` module docstring).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from ..errors import DistCAError
from .symmetric_heap import SymmetricHeap
from .symmetric_words import MAX_GENERATION


class ReusableHeap:
    """A heap endpoint that the transports of successive group epochs use one after another.

    Each epoch's transport gets a :class:`HeapLease` (:meth:`lease`) with a generation above every
    earlier one; taking a new lease revokes the previous one first: its writes (puts, signals, local
    copies into the arena) raise :class:`DistCAError` from then on, so a transport of an old epoch in
    this process that still runs (an abandoned exchange on another thread) can never overwrite a
    signal word or an array of the new epoch. Writes hold a lock that revocation takes, so once
    :meth:`lease` returns, no write of an old lease is under way. A peer *process* still in the old
    epoch may still write late: its values carry the old generation, which the new transport
    ignores (see the module docstring).

    Device-driven writes go through a stream (``stream_ops``), not through the lease's methods, so
    the lease covers them where they are queued: a revoked lease makes no stream, and a transport
    queues its stream work holding :meth:`HeapLease.writing`, which raises once the lease ended
    (and which revocation waits for). Work queued before revocation still runs (a GPU stream cannot
    take it back): the old epoch's transport must end its exchanges (``close`` forces their waits)
    before the next epoch takes the heap.

    The new epoch's transport carves its arrays afresh (from an empty layout, the same on every PE):
    views that an old epoch's transport handed out are overwritten by the new epoch's exchanges.

    Args:
        heap: the endpoint (a :class:`SymmetricHeap`); :meth:`close` closes it.
    """

    def __init__(self, heap: SymmetricHeap):
        self.heap = heap
        self.rank, self.world_size, self.device, self.arena = heap.rank, heap.world_size, heap.device, heap.arena
        self.generation = -1  # the latest lease's
        self._lease: HeapLease | None = None
        self._lock = threading.RLock()
        self._closed = False

    def lease(self, generation: int) -> "HeapLease":
        """The endpoint for the transport of ``generation`` (revoking the previous lease).

        Raises:
            ValueError: ``generation`` not an int in ``[0, MAX_GENERATION]`` or not above the
                previous lease's (its signals could be mistaken for an older epoch's).
            DistCAError: the heap was closed.
        """
        if isinstance(generation, bool) or not isinstance(generation, int) or not 0 <= generation <= MAX_GENERATION:
            raise ValueError(f"generation must be an int in [0, {MAX_GENERATION}], got {generation!r}")
        with self._lock:
            if self._closed:
                raise DistCAError(f"participant {self.rank}: the symmetric heap is closed")
            if generation <= self.generation:
                raise ValueError(f"generation {generation} must exceed the heap's previous one, "
                                 f"{self.generation}")
            if self._lease is not None:
                self._lease._revoked = f"generation {generation} took the heap"
            self._lease = HeapLease(self, generation)
            self.generation = generation
            return self._lease

    def close(self) -> None:
        """Revoke the current lease and close the endpoint."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._lease is not None:
                self._lease._revoked = "the heap was closed"
        self.heap.close()


class HeapLease:
    """One generation's use of a :class:`ReusableHeap` (a :class:`SymmetricHeap`). Closing it
    ends the lease and leaves the heap open for the next generation. Other attributes of the
    heap under it (a shared-memory ``handle``, NVSHMEM's ``finalize``) are passed through.

    The heap's ``stream_ops`` and ``signal_now``, where it has them, are writes too: a revoked
    lease refuses them (see :class:`ReusableHeap`).

    Raises (every write, once revoked or closed, and :meth:`writing`):
        DistCAError: naming the generation and why the lease ended.
    """

    def __init__(self, owner: ReusableHeap, generation: int):
        self._owner, self._heap, self.generation = owner, owner.heap, int(generation)
        self.rank, self.world_size, self.device, self.arena = owner.rank, owner.world_size, owner.device, owner.arena
        self._revoked: str | None = None
        self._held = _Held(self)  # made once: every write and every exchange queued on a stream enter it

    def __getattr__(self, name):  # handle, finalize ... of the heap under the lease
        if name.startswith("_"):
            raise AttributeError(name)
        found = getattr(self._heap, name)
        if name in ("stream_ops", "signal_now"):  # they write the heap: refused once revoked
            return lambda *args: self._write(found, *args)
        return found

    def writing(self) -> "_Held":
        """A context manager that holds the lease while stream work is queued (revocation waits
        for it to be left).

        Raises:
            DistCAError: on entry, the lease has ended.
        """
        return self._held

    def _check(self) -> None:
        if self._revoked is not None:
            raise DistCAError(f"participant {self.rank}: the heap lease of generation "
                              f"{self.generation} has ended ({self._revoked})")

    def _write(self, fn, *args):
        with self._held:
            return fn(*args)

    def put(self, pe: int, offset: int, src: torch.Tensor) -> None:
        self._write(self._heap.put, pe, offset, src)

    def put_signal(self, pe: int, offset: int, src: torch.Tensor, slot: int, value: int) -> None:
        self._write(self._heap.put_signal, pe, offset, src, slot, value)

    def signal(self, pe: int, slot: int, value: int) -> None:
        self._write(self._heap.signal, pe, slot, value)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._write(self._heap.copy, dst, src)

    def quiet(self) -> None:
        self._heap.quiet()  # waits for this PE's own writes; harmless after revocation

    def signals(self) -> np.ndarray:
        return self._heap.signals()

    def read(self, offset: int, nbytes: int) -> torch.Tensor:
        return self._heap.read(offset, nbytes)

    def idle(self, seconds: float) -> None:
        self._heap.idle(seconds)

    def close(self) -> None:
        """End this lease (the heap stays open for the next generation)."""
        with self._owner._lock:
            if self._revoked is None:
                self._revoked = "closed"


class _Held:
    """:meth:`HeapLease.writing`: the owner's lock, taken only while the lease is live. Not a
    generator-based context manager: it is entered for every put and every replay."""

    __slots__ = ("_lease",)

    def __init__(self, lease: HeapLease):
        self._lease = lease

    def __enter__(self) -> None:
        lock = self._lease._owner._lock
        lock.acquire()
        try:
            self._lease._check()
        except BaseException:
            lock.release()
            raise

    def __exit__(self, *exc) -> None:
        self._lease._owner._lock.release()
