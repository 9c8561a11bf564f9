"""Captured exchanges: record a sequence of device-driven exchanges once, replay it at the cost of
one host call (issue 22 item 4, the transport's part of a CUDA graph of a layer's rounds).

A device-driven exchange (:mod:`.routed`) signals and waits for ``generation << 32 | n``, with
``n`` counted by the host: a recorded exchange would repeat its ``n`` at every replay, and its
waits would pass on the words of the replay before. Captured exchanges therefore use words of
their own, and values that do not change between replays:

- **Blocks.** A graph owns one of :data:`~.symmetric.GRAPH_BLOCKS` blocks of words. Its exchange
  ``j`` (at most :data:`~.symmetric.GRAPH_EXCHANGES`) has, per source PE, a credit word and an
  arrival word, in two **sets**. Its value is ``generation << 32 | tag``, where ``tag`` counts
  captures on this transport (every PE captures in the same order, so all agree; a capture that
  fails counts nothing, and :func:`level_graph_tags` evens out a caller that stopped part-way), so
  the words an earlier graph left in a reused block are below it.
- **Two recordings.** The graph records ``fn``'s exchanges twice, once per set, and replays
  alternate between them. A replay of set ``v`` first resets this PE's words of set ``1 - v`` (a
  stream operation, :meth:`~.pe_stream.PeStream.fill`), then runs the exchanges as
  :meth:`.routed.RoutedTransport._queue` does, on the words of set ``v``.

Why the reset is safe: a peer writes a word of set ``1 - v`` here only in its next replay, in an
exchange in which this PE and that peer exchange rows again (both recordings make the same
exchanges). That peer started its next replay after finishing this one's exchange with us, which
waited for a signal that this PE sent after its reset. Within a replay no word is reset, so the
watchdog reads exactly who has not yet answered, and the abort value ends every wait
(:meth:`.routed.RoutedTransport._force_waits`).

A graph replays at most one recording of each set at a time. A replay whose set's previous replay
has not finished waits for it (bounded by its deadline), so the host runs at most two replays
ahead of its stream, and the recordings' snapshots and markers are free to be used again. This
also keeps a reset from undoing the watchdog's force: a queued replay resets the words of the
other set, whose exchanges queued before it have already run to their end or are the ones being
forced, and whose next replay is queued only after those finished.
"""

from __future__ import annotations

import time
from typing import Callable, Hashable

from ..errors import DistCAError
from .base import ExchangeHandle
from .routed import _Entry
from .symmetric_words import _LOW, GRAPH_BLOCKS, GRAPH_EXCHANGES, SIGNAL_KINDS

CREDIT, ARRIVED = 0, 1  # the two words per source PE of a captured exchange
_REPLAY_LABEL = "captured exchange {} of route {!r} (replay {}), group epoch {}"  # formatted on failure only


def graph_slot(world_size: int, block: int, graph_set: int, j: int, kind: int, src: int) -> int:
    """The signal word of captured exchange ``j`` of ``block``'s set ``graph_set``: ``kind``
    (CREDIT or ARRIVED) from PE ``src``."""
    return (SIGNAL_KINDS + ((block * 2 + graph_set) * GRAPH_EXCHANGES + j) * 2 + kind) * world_size + src


def set_words(world_size: int, block: int, graph_set: int) -> tuple[int, int]:
    """``(first slot, count)`` of the words of ``block``'s set ``graph_set`` (contiguous)."""
    return graph_slot(world_size, block, graph_set, 0, CREDIT, 0), GRAPH_EXCHANGES * 2 * world_size


class _Capture:
    """The exchanges recorded while ``fn`` runs for one set of a graph."""

    def __init__(self, transport, block: int, graph_set: int, value: int):
        self.t, self.block, self.set, self.value = transport, block, graph_set, value
        self.records: list = []  # (route, (snapshot, marker, credits, arrivals)) per exchange

    def exchange(self, r, route: Hashable | None, send, send_splits, recv, recv_splits) -> ExchangeHandle:
        t, j = self.t, len(self.records)
        if route is None or r is None or r.growths != t._growths:
            raise ValueError(f"participant {t.rank}: a captured exchange needs an installed route; route "
                             f"{route!r} is not installed (run its exchanges once before capturing them)")
        if j >= GRAPH_EXCHANGES:
            raise ValueError(f"participant {t.rank}: a graph captures at most {GRAPH_EXCHANGES} exchanges")
        t._check_route(r, send, send_splits, recv, recv_splits)
        P = t.world_size
        queued = t._queue(r, send, recv, self.value,
                          lambda pe: graph_slot(P, self.block, self.set, j, CREDIT, pe),
                          lambda pe: graph_slot(P, self.block, self.set, j, ARRIVED, pe))
        self.records.append((r, queued))
        return _CapturedHandle(queued[1], t._stream.synchronous)


class _CapturedHandle:
    """The handle an exchange returns while it is recorded: ``wait`` orders the caller's stream
    after it on a GPU (recorded too: over MemopStream the caller's stream is the capturing one;
    over NVSHMEM the captured marker's ``join`` does nothing, see
    :class:`~.nvshmem_stream.CudaMarker`), and has nothing to wait for on the CPU."""

    __slots__ = ("_marker", "_host")

    def __init__(self, marker, host: bool):
        self._marker, self._host = marker, host

    def wait(self, timeout_s: float | None = None) -> None:
        if not self._host:
            self._marker.join()


class _ReplayHandle:
    """The :class:`~.base.ExchangeHandle` of one replay: waits for each of its exchanges."""

    __slots__ = ("_transport", "_entries")

    def __init__(self, transport, entries):
        self._transport, self._entries = transport, entries

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait for every exchange of the replay (none is left unresolved), then raise the first
        failure. The replay's exchanges share one marker: once the caller's stream was made to
        wait for it (a device-driven wait, which leaves them to be resolved later), the others
        would only make the same wait again, two CUDA calls each; a passed marker resolves each."""
        first, joined = None, None
        for e in self._entries:
            if joined is not None and e.marker is joined:
                continue
            try:
                self._transport._wait_entry(e, timeout_s)
            except (DistCAError, ValueError) as exc:
                first = first or exc
            if not e.resolved:  # joined on the device: the caller's stream waits for the marker
                joined = e.marker
        if first is not None:
            raise first


class ExchangeGraph:
    """The device-driven exchanges of ``fn()``, recorded once per set and replayed (see the module
    docstring). Made by :meth:`.routed.RoutedTransport.graph`, which every PE of the group calls
    at the same point, with the same exchanges.

    ``fn`` makes exchanges of installed routes only (run them once before), at most
    :data:`~.symmetric.GRAPH_EXCHANGES`, into receive buffers that stay allocated while the graph
    is used; a replay reads the send buffers as they are when its exchanges run, and writes the
    receive buffers. Over in-process PEs on CUDA (:class:`~.memop_stream.MemopStream`) ``fn``'s
    torch work goes to the communication stream, made current while it runs, and is recorded with
    the exchanges; over NVSHMEM and on the CPU only the exchanges are recorded (``fn``'s other work
    runs once per recording, when it is called).

    Raises:
        ValueError: the transport's stream cannot record; an exchange in ``fn`` without an
            installed route, beyond the limit, or misused as :meth:`.routed.RoutedTransport.exchange`
            says; the two recordings made different exchanges.
        DistCAError: the group is aborted or closed.
    """

    def __init__(self, transport, fn: Callable[[], object]):
        t = transport
        st = t._pe_stream()
        if st is None or not hasattr(st, "capture"):
            raise ValueError(f"participant {t.rank}: the stream of this transport ({type(st).__name__}) cannot "
                             f"record exchanges")
        if t._capture is not None:
            raise ValueError(f"participant {t.rank}: graphs cannot be captured inside a capture")
        t._drain()  # a reused block's old graph has nothing in flight
        self._t, self.replays, self._next = t, 0, 0
        if t._graph_tag + 1 >= _LOW:
            raise DistCAError(f"participant {t.rank}: too many graphs captured in group epoch {t.epoch}")
        self._tag = t._graph_tag + 1
        # A capture that fails changes nothing on this PE: not its tag (the values its waits need;
        # a peer that never attempted this capture did not count it, and after the next capture
        # this PE would wait for tag n + 1 while that peer sends n: every replay would time out),
        # not its blocks (the graph its block was taken from stays usable, as on that peer). Its
        # recordings never ran, so nothing of the words it would have used was written.
        # In-process callers that stop at the first failure level the tags of the participants
        # they captured before it (level_graph_tags).
        taken = list(t._graphs), list(t._graph_order)
        self._block = _take_block(t, self)
        try:
            self._record(st, fn)
        except BaseException:
            t._graphs[:], t._graph_order[:] = taken
            raise
        t._graph_tag = self._tag

    def _record(self, st, fn) -> None:
        t, value = self._t, self._t._base | self._tag
        self._recordings, self._records = [], []
        for graph_set in (0, 1):
            cap = _Capture(t, self._block, graph_set, value)
            with st.capture() as recording:
                st.fill(*set_words(t.world_size, self._block, 1 - graph_set), t._base)
                t._capture = cap
                try:
                    fn()
                finally:
                    t._capture = None
            self._recordings.append(recording)
            self._records.append(cap.records)
        names = [[r.rid for r, _ in recs] for recs in self._records]
        if names[0] != names[1]:
            raise ValueError(f"participant {t.rank}: the graph's two recordings made different exchanges "
                             f"(routes {names[0]} and {names[1]}): fn must make the same exchanges every call")
        self._last: list[list] = [[], []]  # the entries of each set's latest replay
        self.exchanges = len(self._records[0])
        # the buffer growth its routes were installed at (all the same, as each exchange checked;
        # None: no exchange) and the bytes a replay sends: read at every replay
        growths = {r.growths for r, _ in self._records[0]}
        self._growths = None if not growths else growths.pop() if len(growths) == 1 else -1
        self._sent = [sum(r.sent for r, _ in records) for records in self._records]

    @property
    def next_set(self) -> int:
        """The recording (0 or 1: ``fn``'s first or second call) the next :meth:`replay` runs."""
        return self._next

    @property
    def usable(self) -> bool:
        """Whether :meth:`replay` can run: no later capture took the graph's words and no growth
        moved the buffers its exchanges were recorded with."""
        t = self._t
        return t._graphs[self._block] is self and self._growths in (None, t._growths)

    def replay(self, timeout_s: float | None = None) -> ExchangeHandle:
        """Queue the recorded exchanges again (one host call on a GPU) and return their handle.

        Args:
            timeout_s: each exchange's deadline (default the transport's ``timeout_s``).

        Raises:
            ValueError: the graph was released (another capture took its block) or the buffers
                grew since it was captured (capture it again).
            DistCAError: the group is aborted or closed, the previous replay of the same set failed,
                or the transport's heap lease has ended.
        """
        t, v = self._t, self._next
        if not self.usable:
            why = ("was released: a later capture took its block" if t._graphs[self._block] is not self else
                   "was captured before the exchange buffers grew")
            raise ValueError(f"participant {t.rank}: this graph {why}; capture it again")
        for e in self._last[v]:  # its snapshots and markers are used again
            if not e.resolved or e.error is not None:  # (most were settled since, and delivered)
                t._finish(e)
        deadline = time.monotonic() + (t.timeout_s if timeout_s is None else float(timeout_s))
        t._settle()
        with t._queueing:  # as a device-driven exchange queues (routed.RoutedTransport._queueing)
            t._refuse_if_gone("graph replay")
            with t._leased:  # a recording's writes are the stream's: a revoked lease refuses them
                t._stream.begin()  # after the caller's work (the send rows)
                t._stream.replay(self._recordings[v])
                marker = t._stream.mark()  # not the recorded markers: a GPU's recorded event passes early
            value, n = t._base | self._tag, self.replays
            entries = [_Entry(value, deadline, r, snap, marker, credits, arrivals,
                              label=(_REPLAY_LABEL, j, r.name, n, t.epoch))
                       for j, (r, (snap, _, credits, arrivals)) in enumerate(self._records[v])]
            t._record(entries)
            t._watch().poke()  # inside: close() then finds the watchdog to stop
        self._last[v], self._next = entries, 1 - v
        self.replays += 1
        t.device_exchanges += len(entries)
        t.bytes_sent += self._sent[v]
        return _ReplayHandle(t, entries)

    def release(self) -> None:
        """Give the graph's block back (later replays raise ValueError)."""
        if self._t._graphs[self._block] is self:
            self._t._graphs[self._block] = None


def level_graph_tags(transports) -> None:
    """Raise every transport's capture count (the tag of its next graph's values, see
    :class:`ExchangeGraph`) to the highest among them, before one graph is captured on each.

    For a caller that captures its participants one after another in one process
    (:class:`~distca_server.runtime.graphed.CapturedRound`) and stops at the first failure: the
    participants captured before it counted their captures, the others did not, and a graph
    whose PEs wait for different tags never completes a replay. Levelling before every capture
    keeps them equal whichever participant failed; a count only ever rises, so the words an earlier
    graph left in a block stay below the next graph's values."""
    top = max((t._graph_tag for t in transports), default=0)
    for t in transports:
        t._graph_tag = top


def _take_block(t, graph: ExchangeGraph) -> int:
    """A free block for ``graph``, else the least recently captured graph's (released). Every PE
    captures in the same order, so every PE picks the same block."""
    free = [b for b in range(GRAPH_BLOCKS) if t._graphs[b] is None]
    block = free[0] if free else t._graph_order[0]
    if block in t._graph_order:
        t._graph_order.remove(block)
    t._graph_order.append(block)
    t._graphs[block] = graph
    return block


__all__ = ["ARRIVED", "CREDIT", "ExchangeGraph", "graph_slot", "level_graph_tags", "set_words"]
