"""A PE's stream of exchange work: puts, signals, bounded waits on its own signal words, copies and
markers, queued by the host and run in order without the host waiting (issue 22 item 1).

The device-driven exchange (:mod:`.routed`) is written once against :class:`PeStream`. On a GPU
the stream is a CUDA stream and the operations are NVSHMEM's ``*_on_stream`` calls (a wait is
``signal_wait_until_on_stream``); on the CPU it is :class:`HostStream`, a thread of the PE's own
that runs the queued operations against a :class:`~.symmetric.SymmetricHeap` (the shared-memory
heap of :mod:`.shm`). Either way the thread that queues the work never blocks on a peer: only the
stream does, and every such wait ends when its word reaches the value or when the watchdog writes
the abort value into it (:meth:`PeStream.force`), so a stream always drains.

The CPU stream is the reference the tests run: the same protocol, the same words, the same
watchdog, with a thread where the GPU has a stream.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Protocol

import numpy as np
import torch

POLL_S = 0.05  # longest a CPU wait sleeps between reads of its words (a peer's signal wakes it sooner)


class Marker(Protocol):
    """A point in a PE's stream (:meth:`PeStream.mark`)."""

    def done(self) -> bool:
        """Whether the stream has run every operation queued before the marker (never blocks)."""
        ...

    def wait(self, timeout_s: float) -> bool:
        """Block the calling thread until :meth:`done` (at most ``timeout_s`` seconds); returns
        whether it is. Only the watchdog and a host-synchronous stream's handles call it."""
        ...

    def join(self) -> None:
        """Make the caller's current stream wait for the marker (GPU); nothing on the CPU, where
        the stream's work is complete once :meth:`done`."""
        ...


class PeStream(Protocol):
    """One PE's ordered queue of exchange operations; every method returns at once.

    Attributes:
        synchronous: True when results are read by the host (CPU): a handle's ``wait`` blocks
            until the marker is done. False on a GPU: a handle's ``wait`` orders the caller's
            stream after the marker and returns.
    """

    synchronous: bool

    def begin(self) -> None:
        """Order the operations queued from now on after the work the caller has queued so far
        (the rows to send were produced there, and the receive buffers are read there)."""
        ...

    def put(self, pe: int, offset: int, src: torch.Tensor, credit: int | None = None) -> None:
        """Write uint8 ``src`` into PE ``pe``'s arena at ``offset``. ``credit``: the word whose
        wait cleared the way; a stream that can skips the put when that wait ended in the abort
        value (the peer never freed its buffer)."""
        ...

    def put_signal(self, pe: int, offset: int, src: torch.Tensor, slot: int, value: int,
                   credit: int | None = None) -> None:
        """:meth:`put`, then set ``pe``'s word ``slot`` to ``value`` once this and every earlier
        put to ``pe`` has landed (release)."""
        ...

    def signal(self, pe: int, slot: int, value: int) -> None:
        """Set ``pe``'s word ``slot`` to ``value`` after every earlier put to ``pe`` has landed."""
        ...

    def wait_ge(self, slot: int, value: int) -> None:
        """Hold the stream until this PE's word ``slot`` is at least ``value`` (int64 compare)."""
        ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy uint8 ``src`` into ``dst`` on this PE."""
        ...

    def snapshot(self, offset: int, nbytes: int) -> "Snapshot":
        """A copy, in stream order, of this PE's signal words and of its arena bytes
        ``[offset, offset + nbytes)``: what the waits before it saw."""
        ...

    def mark(self) -> Marker:
        """A marker after every operation queued so far."""
        ...

    def fill(self, slot: int, count: int, value: int) -> None:
        """Set this PE's own words ``[slot, slot + count)`` to ``value``, in stream order (a
        captured exchange resets the words of its other set, :mod:`.exchange_graph`)."""
        ...

    def stamp(self, dst: torch.Tensor, value: int) -> None:
        """Set every element of int64 ``dst`` (on this PE's device, outside the words) to
        ``value``, in stream order: a tagged exchange writes its round's tag into the report rows
        it puts next (:mod:`.routed`)."""
        ...

    def force(self, slot: int, value: int) -> None:
        """Set this PE's own word ``slot`` to ``value`` *now*, not in stream order: the watchdog's
        way to end a wait that would never end (called from the watchdog's thread)."""
        ...

    def close(self) -> None:
        """Stop the stream once its queued work has run (its waits must be able to end)."""
        ...


class Capturable(Protocol):
    """A :class:`PeStream` that can record its operations once and run them again."""

    def capture(self):
        """A context manager: operations queued inside it are recorded, not run; it yields the
        recording, which :meth:`replay` queues again. The recorded snapshots are written again
        by each replay; the recorded markers say nothing about a replay (mark after it)."""
        ...

    def replay(self, recording) -> None:
        """Queue every operation of ``recording`` again, in order (returns at once)."""
        ...


class Snapshot:
    """What :meth:`PeStream.snapshot` copied; :meth:`value` is valid once a later marker is done."""

    __slots__ = ("words", "table")

    def __init__(self):
        self.words: np.ndarray | None = None
        self.table: np.ndarray | None = None

    def value(self) -> tuple[np.ndarray, np.ndarray]:
        """``(words, table)``: int64 [signal words] and int64 [nbytes / 8] of the arena range."""
        return self.words, self.table


class _Event:
    """A :class:`Marker` of a :class:`HostStream`."""

    __slots__ = ("_event",)

    def __init__(self):
        self._event = threading.Event()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout_s: float) -> bool:
        return self._event.wait(max(0.0, timeout_s))

    def join(self) -> None:
        return None


class Recording:
    """What :meth:`HostStream.capture` recorded: the queued operations."""

    __slots__ = ("items",)

    def __init__(self):
        self.items: list = []


class HostStream:
    """A :class:`PeStream` on the CPU: a daemon thread runs the queued operations against
    ``heap`` in order (puts are copies into the peers' mapped arenas, a wait reads this PE's
    words and sleeps on its doorbell between reads).

    A put whose credit wait was ended by the abort value is skipped: the peer never said its
    buffer was free. An operation that raises (a revoked heap lease) stops the stream's work:
    :attr:`error` keeps the first error, later operations are skipped and markers still pass, so
    the transport sees the failure and nothing waits forever.

    Args:
        heap: the PE's heap endpoint (``put``, ``put_signal``, ``signal``, ``signals``,
            ``copy``, ``idle``).
        abort_value: a word holding it ends every wait on it (see :meth:`PeStream.force`).
        name: the thread's name.
    """

    synchronous = True

    def __init__(self, heap, abort_value: int, name: str = "distca-pe-stream"):
        self.heap, self.abort_value = heap, int(abort_value)
        self.error: BaseException | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._aborted: set[int] = set()  # slots whose last wait was ended by the abort value
        self._closing = False
        self._recording: Recording | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- queued -----------------------------------------------------------------------------------
    def begin(self) -> None:
        return None  # the caller's CPU work is complete when it queues ours

    def _enqueue(self, fn, *args, always: bool = False) -> None:
        """Queue ``fn(*args)`` (or record it, while capturing); after a failure only ``always``
        operations (markers) still run."""
        if self._recording is not None:
            self._recording.items.append((fn, args, always))
        else:
            self._queue.put((fn, args, always))

    def put(self, pe: int, offset: int, src: torch.Tensor, credit: int | None = None) -> None:
        if src.numel():
            self._enqueue(self._put, pe, offset, src, credit)

    def put_signal(self, pe: int, offset: int, src: torch.Tensor, slot: int, value: int,
                   credit: int | None = None) -> None:
        self._enqueue(self._put_signal, pe, offset, src, slot, int(value), credit)

    def signal(self, pe: int, slot: int, value: int) -> None:
        self._enqueue(self.heap.signal, pe, slot, int(value))

    def wait_ge(self, slot: int, value: int) -> None:
        self._enqueue(self._wait_ge, slot, int(value))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._enqueue(self.heap.copy, dst, src)

    def snapshot(self, offset: int, nbytes: int) -> Snapshot:
        snap = Snapshot()
        self._enqueue(self._snapshot, snap, offset, nbytes)
        return snap

    def fill(self, slot: int, count: int, value: int) -> None:
        self._enqueue(self._fill, slot, int(count), int(value))

    def stamp(self, dst: torch.Tensor, value: int) -> None:
        self._enqueue(dst.fill_, int(value))

    def mark(self) -> _Event:
        marker = _Event()
        self._enqueue(marker._event.set, always=True)
        return marker

    @contextlib.contextmanager
    def capture(self):
        """Record instead of queue (see :class:`Capturable`); yields the :class:`Recording`."""
        if self._recording is not None:
            raise RuntimeError("HostStream.capture: already capturing")
        self._recording = Recording()
        try:
            yield self._recording
        finally:
            self._recording = None

    def replay(self, recording: Recording) -> None:
        """Queue ``recording``'s operations again (a marker queued after them says when they ran)."""
        for item in recording.items:
            self._queue.put(item)

    def force(self, slot: int, value: int) -> None:
        # One 8-byte store into our own word, past a lease that may have ended (the word is ours);
        # the waiting thread re-reads it when its doorbell rings.
        from .heap_lease import HeapLease
        own = self.heap._heap if isinstance(self.heap, HeapLease) else self.heap
        own.signal(own.rank, slot, int(value))

    def close(self) -> None:
        self._closing = True
        self._queue.put(None)

    # ---- the stream's thread ---------------------------------------------------------------------
    def _put(self, pe: int, offset: int, src: torch.Tensor, credit: int | None) -> None:
        if credit is None or credit not in self._aborted:
            self.heap.put(pe, offset, src)

    def _put_signal(self, pe: int, offset: int, src: torch.Tensor, slot: int, value: int,
                    credit: int | None) -> None:
        if credit is None or credit not in self._aborted:
            self.heap.put_signal(pe, offset, src, slot, value)

    def _fill(self, slot: int, count: int, value: int) -> None:
        for k in range(slot, slot + count):
            self.heap.signal(self.heap.rank, k, value)

    def _snapshot(self, snap: Snapshot, offset: int, nbytes: int) -> None:
        snap.words = self.heap.signals()
        snap.table = self.heap.read(offset, nbytes).view(torch.int64).numpy()

    def _wait_ge(self, slot: int, value: int) -> None:
        while True:
            word = int(self.heap.signals()[slot])
            if word == self.abort_value:
                self._aborted.add(slot)
                return
            if word >= value:
                self._aborted.discard(slot)
                return
            if self._closing:  # close() came while a peer never answered and nobody forced it
                self._aborted.add(slot)
                return
            self.heap.idle(POLL_S)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args, always = item
            if self.error is not None and not always:
                continue
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 - kept; the transport reports it
                if self.error is None:
                    self.error = exc


__all__ = ["Capturable", "HostStream", "Marker", "PeStream", "POLL_S", "Recording", "Snapshot"]
