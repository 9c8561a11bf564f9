"""The device-driven exchange: once a *route* is installed, an exchange makes no blocking host
call (issue 22 item 1).

A route is an exchange that repeats: the same sizes to and from every peer, received into the
same buffers (a plan's dispatch or return of one round kind; the participant names it, e.g.
``(plan id, kind, "dispatch")``). Its first exchange runs the host-driven protocol of
:mod:`.symmetric` (announce, agree on growth, put, wait), which tells every PE where its rows land
in each peer's arena; when every PE named the same route, every PE received in place and no array
grew, each PE keeps those offsets (:meth:`RoutedTransport._install`). Every later exchange of the
route is queued on the PE's stream (:mod:`.pe_stream`) and the host returns at once:

1. **Credit.** For each peer it receives from, ``signal(peer, ANNOUNCE[me], seq)``: queued after
   everything this PE did before (the kernel that read the previous rows), it tells the peer its
   buffers may be overwritten. No inbox row: the offsets are the route's.
2. **Data.** For each peer it sends to: wait until ``ANNOUNCE[peer] >= seq`` (the peer's credit),
   put the rows at the route's offsets, then put its report row (``tag, nseg, route, bytes``)
   with ``DATA[me] = seq`` (the signal lands after the data: release). ``tag`` names the round
   for a caller that skipped its own round check (``exchange(..., tag=)``); the row's tag word
   is stamped on the stream when it changes.
3. **Own split**, a local copy; then wait until ``DATA[peer] >= seq`` for each peer it receives from.
4. **Snapshot** of this PE's words and report table, then a marker: the handle's completion.

Signal values carry the generation and ``seq`` as in :mod:`.symmetric`; ``seq`` counts host- and
device-driven exchanges alike, so the two never mix.

**Every wait is bounded.** A :class:`~.watchdog.Watchdog` thread (it never blocks the thread that
queues work) looks at the exchanges in flight every :data:`~.watchdog.WATCH_POLL_S`. When one
passes its deadline it names the peers whose words did not arrive, marks the group broken, sets
``ABORT[me] = TIMED_OUT`` on every peer, and writes the abort value (``generation << 32 | 0xffffffff``) into this PE's own
words (:meth:`~.pe_stream.PeStream.force`), so its stream drains. A PE only ever forces its own
words: a peer's watchdog sees the ABORT word of a peer its exchange waits for (timed out, found a
mismatch, left, or gave up on another) and expires its own exchange at once, telling those that
wait on it (``PEER_FAILED``, with the PE and code of the failure it passes on, so a PE that reads the
echo before the cause still names the cause). Words a peer wrote are never overwritten, so a peer that delivered
and then left is not taken for one that did not. A drained exchange fails when it is resolved
(from its snapshot: a wait ended by the abort value, a peer's ABORT word, or a report row that
does not match the route): :class:`~distca_server.errors.DistCAError` naming the silent peer, or
``ValueError`` naming the sizes that differ. On the CPU, ``wait`` blocks until then: within the
deadline plus :data:`GRACE_S`. On a GPU, ``wait`` orders the caller's stream after the exchange and
returns; the failure is raised by the next call on the transport (``wait`` or ``exchange``).

Limits (stated, not hidden): a put whose credit wait was ended by the abort value is skipped on
the CPU; a GPU stream cannot skip a host-queued put, so there a failing group's peer may receive
rows into a buffer it had not freed (it fails its next exchange). Exchanges of a route must pass
the same sizes and the same receive buffers as the one that installed it: anything else is
refused with ``ValueError`` before a byte moves and aborts the group, whose peers fail with
``DistCAError``. Over a reused heap, a transport whose lease has ended (a later group epoch took
the heap, :mod:`.heap_lease`) queues nothing more: its exchanges and replays raise ``DistCAError``;
what it queued before still runs, so it must be closed before the next epoch takes the heap.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Hashable, Sequence

import numpy as np
import torch

from ..errors import DistCAError
from .base import DONE, ExchangeHandle, check_exchange
from .heap_lease import HeapLease
from .pe_stream import HostStream, PeStream
from .route import _pointers, _Route, route_id
from .symmetric import SymmetricTransport
from .symmetric_words import (_LOW, _REPORT, ANNOUNCE, CLOSED, DATA, GRACE_S, GRAPH_BLOCKS, MAX_SEGMENTS,
                              MISMATCH, PEER_FAILED, TIMED_OUT)
from .watchdog import Watchdog

if TYPE_CHECKING:
    from .exchange_graph import ExchangeGraph

MAX_ROUTES = 64  # installed routes kept per transport (the least recently used go first)


class _Entry:
    """One device-driven exchange in flight: ``seq`` the value its words must reach, ``credits`` and
    ``arrivals`` this PE's words (by source PE) it waits on for each peer's credit and rows;
    ``label`` names it in errors: a str, or ``(format, *args)`` formatted only when read (an
    exchange that succeeds, nearly every one, never formats it: a replay makes one per exchange)."""

    __slots__ = ("seq", "deadline", "route", "snapshot", "marker", "credits", "arrivals", "_label", "tag",
                 "expired", "error", "resolved")

    def __init__(self, seq: int, deadline: float, route: _Route, snapshot, marker, credits: dict[int, int],
                 arrivals: dict[int, int], label: str | tuple, tag: int | None = None):
        self.seq, self.deadline, self.route, self.snapshot, self.marker = seq, deadline, route, snapshot, marker
        self.credits, self.arrivals, self._label = credits, arrivals, label
        self.tag = tag  # the round tag every sender's report row must carry; None: not checked
        self.expired: str | None = None  # why the watchdog ended its waits
        self.error: BaseException | None = None
        self.resolved = False

    @property
    def label(self) -> str:
        label = self._label
        return label if isinstance(label, str) else label[0].format(*label[1:])


class _Handle:
    """The :class:`~.base.ExchangeHandle` of a device-driven exchange."""

    __slots__ = ("_transport", "_entry")

    def __init__(self, transport: "RoutedTransport", entry: _Entry):
        self._transport, self._entry = transport, entry

    def wait(self, timeout_s: float | None = None) -> None:
        self._transport._wait_entry(self._entry, timeout_s)


class RoutedTransport(SymmetricTransport):
    """A :class:`~.symmetric.SymmetricTransport` whose exchanges of an installed route are
    device-driven (see the module docstring); exchanges without a route are host-driven.

    Args:
        heap, timeout_s, epoch, generation: as :class:`~.symmetric.SymmetricTransport`.
        stream: the PE's :class:`~.pe_stream.PeStream`; default a :class:`~.pe_stream.HostStream`
            on a CPU heap, the heap's ``stream_ops(abort_value)`` where it has one; without either,
            routes are ignored and every exchange is host-driven.
    """

    def __init__(self, heap, timeout_s: float = 60.0, epoch: int = 0, generation: int | None = None,
                 stream: PeStream | None = None):
        super().__init__(heap, timeout_s=timeout_s, epoch=epoch, generation=generation)
        self.abort_value = self._base | _LOW
        self._stream = stream
        # Held while work is queued on the stream (HeapLease.writing): a revoked lease refuses it,
        # as it refuses a host call's write; a heap of one generation needs nothing held.
        self._leased = heap.writing() if isinstance(heap, HeapLease) else contextlib.nullcontext()
        self._routes: OrderedDict[int, _Route] = OrderedDict()
        self._inflight: list[_Entry] = []
        self._lock = threading.RLock()
        # Held while an exchange checks the group, queues its work and records it in flight
        # (_record). close() sets _leaving, then takes it, so an exchange on another thread is
        # either ended by close() or refused: work queued on a stopped stream would never run and
        # its wait would last the whole deadline. Not _lock: the stream's queue may block behind
        # a stuck wait that only the watchdog, which needs _lock, can end.
        self._queueing = threading.Lock()
        self._watchdog: Watchdog | None = None
        self._naming: Hashable | None = None  # the route of the host-driven exchange running now
        self._capture = None  # the exchange_graph._Capture recording exchanges now, if any
        # captured exchanges (exchange_graph): the graph holding each block of words, the blocks in
        # capture order, and the captures so far (a graph's signal value)
        self._graphs: list = [None] * GRAPH_BLOCKS
        self._graph_order: list[int] = []
        self._graph_tag = 0
        self.device_exchanges = 0  # exchanges that ran device-driven (for tests and benchmarks)
        # A benchmark's control (bench/pingpong.py, the paper's Fig. 11): device-driven exchanges
        # put 1 byte per peer and segment instead of their rows, with every signal and wait kept.
        # The received bytes are then garbage; never set outside a benchmark.
        self.signal_only = False

    # ---- the stream and the watchdog, made at the first device-driven exchange ----------------------
    def _pe_stream(self) -> PeStream | None:
        if self._stream is None:
            make = getattr(self.heap, "stream_ops", None)
            if make is not None:
                self._stream = make(self.abort_value)
            elif self.device.type == "cpu":
                self._stream = HostStream(self.heap, self.abort_value, name=f"distca-pe-stream-{self.rank}")
        return self._stream

    def _watch(self) -> Watchdog:
        if self._watchdog is None:
            self._watchdog = Watchdog(self)
        return self._watchdog

    @property
    def routes(self) -> list[Hashable]:
        """The installed routes, least recently used first."""
        return [r.name for r in self._routes.values()]

    # ---- the exchange -----------------------------------------------------------------------------
    def exchange(self, send: Sequence[torch.Tensor], send_splits: Sequence[Sequence[int]],
                 recv: Sequence[torch.Tensor], recv_splits: Sequence[Sequence[int]],
                 timeout_s: float | None = None, route: Hashable | None = None, tag: int = 0) -> ExchangeHandle:
        """Segment-wise ragged all-to-all (see :meth:`.base.Transport.exchange`).

        Args:
            route: names an exchange that repeats with the same sizes and receive buffers (every
                PE passes the same for the same exchange). Its first exchange is host-driven and
                installs it; later ones are device-driven and return at once.
            tag: an int63 naming the round a device-driven exchange belongs to, for a caller that
                skips its own check that every PE runs the same round (an in-place Ray round,
                :mod:`distca_server.runtime.member`): each sender's report row carries it and
                each receiver compares it with its own (``ValueError`` if they differ). Every PE
                passes the same for the same exchange; 0 (default) for none. A host-driven
                exchange ignores it (its caller checked the round first).

        Raises:
            ValueError: as :meth:`.symmetric.SymmetricTransport.exchange`, or an exchange of an
                installed route with other sizes or receive buffers than it was installed with
                (the group is aborted).
            DistCAError: as :meth:`.symmetric.SymmetricTransport.exchange`; from ``wait`` (CPU)
                or the next call (GPU), a device-driven exchange that a peer failed or that
                passed its deadline.
        """
        rid = route_id(route) if route is not None else 0
        if self._capture is not None:
            return self._capture.exchange(self._routes.get(rid), route, send, send_splits, recv, recv_splits)
        found = self._routes.get(rid) if rid else None
        if found is not None and found.growths == self._growths and self._pe_stream() is not None:
            self._routes.move_to_end(rid)
            return self._device_exchange(found, send, send_splits, recv, recv_splits, timeout_s, int(tag))
        self._drain()  # the host-driven protocol reads and writes the words itself: the stream rests
        self._naming = route
        self._exchange(send, send_splits, recv, recv_splits, timeout_s,
                       route=rid if self._pe_stream() is not None else 0)
        return DONE

    def installed(self, route: Hashable) -> bool:
        """Whether an exchange of ``route`` would run device-driven now: it is installed, no array
        grew since, and the PE has a stream. Every PE of the group answers alike (routes install
        and uninstall alike everywhere)."""
        found = self._routes.get(route_id(route))
        return found is not None and found.growths == self._growths and self._pe_stream() is not None

    def tagged(self, tag: int) -> "TaggedRounds":
        """This transport as one round sees it: every exchange passes ``tag`` (see :meth:`exchange`)."""
        return TaggedRounds(self, tag)

    def _install(self, route: int, send_splits, recv_splits, recv, puts) -> None:
        if len(send_splits) > MAX_SEGMENTS:
            return
        self._routes[route] = _Route(self, route, self._naming, send_splits, recv_splits, recv, puts)
        self._routes.move_to_end(route)
        while len(self._routes) > MAX_ROUTES:  # every PE installs and uses routes in the same order
            self._routes.popitem(last=False)

    def _check_route(self, r: _Route, send, send_splits, recv, recv_splits) -> None:
        """Refuse (ValueError, and abort the group) an exchange of route ``r`` whose sizes or
        receive buffers are not the ones it was installed with; DistCAError on a broken group."""
        P, me = self.world_size, self.rank
        with self._refusing():
            check_exchange(send, send_splits, recv, recv_splits, P, me)
        self._settle()
        self._refuse_if_gone("all-to-all")
        ss = [[int(x) for x in sp] for sp in send_splits]
        rs = [[int(x) for x in sp] for sp in recv_splits]
        if ss != r.send_splits or rs != r.recv_splits or _pointers(recv) != r.recv_ptrs:
            what = ("receive buffers" if ss == r.send_splits and rs == r.recv_splits else
                    f"sizes (send {ss}, receive {rs}; installed with send {r.send_splits}, receive "
                    f"{r.recv_splits})")
            self._abort(MISMATCH, f"route {r.name!r} misused")
            raise ValueError(f"participant {me}: an exchange of route {r.name!r} has other {what} than the "
                             f"exchange that installed it")

    def _queue(self, r: _Route, send, recv, value: int, credit_slot, arrival_slot, tag: int | None = None):
        """Queue one exchange of route ``r`` on the stream: its words are ``credit_slot(src)`` and
        ``arrival_slot(src)`` (this PE's words a source PE sets; the same index on every PE), and
        every signal and wait uses ``value``; ``tag`` (None: left as it is) goes into word 0 of the
        report rows. Returns ``(snapshot, marker, credits, arrivals)``.

        Raises:
            DistCAError: the heap lease has ended (nothing is queued).
        """
        with self._leased:  # the stream's writes bypass the lease's own checks: hold it here
            return self._queue_held(r, send, recv, value, credit_slot, arrival_slot, tag)

    def _queue_held(self, r: _Route, send, recv, value: int, credit_slot, arrival_slot, tag: int | None):
        me, st = self.rank, self._stream
        st.begin()
        if tag is not None and tag != r.tag and r.send_to:
            # Stream-ordered: the previous exchange's puts read the rows before this runs.
            st.stamp(r.report_rows[:, 0], tag)
            r.tag = tag
        for pe in r.recv_from:  # 1. credit: our buffers may take this exchange's rows
            st.signal(pe, credit_slot(me), value)
        for pe in r.send_to:  # 2. data, each peer once its credit came
            credit = credit_slot(pe)
            st.wait_ge(credit, value)
            for s, a, off, n in r.puts[pe]:
                st.put(pe, off, send[s][a:a + (1 if self.signal_only else n)], credit=credit)
            st.put_signal(pe, self._report_at + me * _REPORT * 8, r.reports[pe], arrival_slot(me), value,
                          credit=credit)
        for s, a, b, n in r.own:  # 3. own split, then every peer's rows
            st.copy(recv[s][b:b + n], send[s][a:a + n])
        for pe in r.recv_from:
            st.wait_ge(arrival_slot(pe), value)
        snapshot = st.snapshot(self._report_at, self.world_size * _REPORT * 8)  # 4. what the waits saw
        return (snapshot, st.mark(), {pe: credit_slot(pe) for pe in r.send_to},
                {pe: arrival_slot(pe) for pe in r.recv_from})

    def _device_exchange(self, r: _Route, send, send_splits, recv, recv_splits, timeout_s, tag: int = 0) -> _Handle:
        self._check_route(r, send, send_splits, recv, recv_splits)
        if self._seq >= _LOW - 1:
            raise DistCAError(f"participant {self.rank}: group epoch {self.epoch} ran {self._seq} exchanges, the "
                              f"most one generation numbers; form a new group epoch")
        self._seq += 1
        seq = self._base | self._seq
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else float(timeout_s))
        with self._queueing:  # a close() on another thread either sees this entry or is seen here
            self._refuse_if_gone("all-to-all")
            queued = self._queue(r, send, recv, seq, lambda pe: self._slot(ANNOUNCE, pe),
                                 lambda pe: self._slot(DATA, pe), tag)
            entry = _Entry(seq, deadline, r, *queued,
                           label=("device-driven exchange {} of route {!r}, group epoch {}", self._seq, r.name,
                                  self.epoch), tag=tag)
            self._record([entry])
            self._watch().poke()  # inside: close() then finds the watchdog to stop
        self.bytes_sent += r.sent
        self.device_exchanges += 1
        return _Handle(self, entry)

    def _record(self, entries: list[_Entry]) -> None:
        """Put queued ``entries`` in flight. A failure that came while they were queued (the
        watchdog's expiry or :meth:`abandon` set ``_broken`` and forced the waits in flight, not
        yet these) ends them now, with its reason: the failure sets ``_broken`` and reads
        ``_inflight`` under ``_lock``, so it either sees them or is seen here."""
        with self._lock:
            self._inflight.extend(entries)
            late = self._broken
            for e in entries if late is not None else ():
                e.expired = late  # no signal of its own: as if refused, the peers learn it as of the failure
        if late is not None:
            self._force_waits()

    # ---- completion and failure ------------------------------------------------------------------
    def _unresolved(self) -> list[_Entry]:
        with self._lock:
            return [e for e in self._inflight if not e.resolved]

    def _settle(self) -> None:
        """Resolve the exchanges whose marker passed (never blocks) and forget resolved ones."""
        with self._lock:
            for e in self._inflight:
                if not e.resolved and e.marker.done():
                    self._resolve(e)
            self._inflight = [e for e in self._inflight if not e.resolved]

    def _wait_entry(self, e: _Entry, timeout_s: float | None) -> None:
        st = self._stream
        if not st.synchronous and not e.marker.done():
            e.marker.join()  # the caller's stream waits; a failure surfaces at the next call
            if self._broken is not None:
                raise DistCAError(f"all-to-all on participant {self.rank} of group epoch {self.epoch}: the "
                                  f"group is aborted: {self._broken}")
            return
        self._finish(e, timeout_s)

    def _finish(self, e: _Entry, timeout_s: float | None = None) -> None:
        """Block until ``e``'s marker passed (bounded by its deadline, or ``timeout_s``), resolve it
        and raise its failure."""
        if not e.marker.done():
            bound = max(0.0, e.deadline - time.monotonic()) + GRACE_S
            if timeout_s is not None:
                bound = min(bound, float(timeout_s))
            if not e.marker.wait(bound):
                self._expire(e, f"the exchange did not finish within {bound:.3g} s of its wait")
                e.marker.wait(GRACE_S)
        self._resolve(e)
        if e.error is not None:
            raise e.error

    def _drain(self) -> None:
        """Wait for every exchange in flight (bounded by its deadline and the watchdog), raising
        the first failure."""
        for e in self._unresolved():
            self._wait_entry(e, None)
        self._settle()

    def _pending(self, e: _Entry, words) -> set[int]:
        """The peers whose credit or rows exchange ``e`` still waits for, by ``words``."""
        return ({pe for pe, slot in e.arrivals.items() if not self._landed(int(words[slot]), e.seq)}
                | {pe for pe, slot in e.credits.items() if not self._landed(int(words[slot]), e.seq)})

    def _check_peers(self, e: _Entry, words) -> None:
        """Expire ``e`` at once when a peer it waits for aborted or left (its ABORT word), rather
        than at the deadline: a peer's failure never writes into our other words."""
        hit = self._aborted_by(words, self._pending(e, words))
        if hit is not None:
            self._expire(e, self._reason(words, hit), code=PEER_FAILED, cause=self._root(words, hit))

    def _expire(self, e: _Entry, why: str | None = None, code: int = TIMED_OUT,
                cause: tuple[int, int] | None = None) -> None:
        """End exchange ``e``'s waits: the watchdog at its deadline (``code`` TIMED_OUT: every
        peer fails), on a peer's failure (PEER_FAILED: the peers waiting on this one fail, told
        ``cause``, the (PE, code) that failed first), or a wait that gave up.

        Nothing here blocks while holding the transport's lock (the words are read before it is
        taken: a device heap's read synchronizes a stream, its own, but still a wait)."""
        if e.resolved or e.expired is not None:
            return
        words, me = (self.heap.signals() if why is None else None), self.rank
        with self._lock:
            if e.resolved or e.expired is not None:
                return
            if why is None:
                # A peer we send to that gave its credit has entered the exchange: its rows may be
                # held up by another peer. The others never showed up (as far as this PE can tell).
                entered = {pe for pe, slot in e.credits.items() if self._landed(int(words[slot]), e.seq)}
                missing = self._pending(e, words)
                # Peers whose deadline passed as ours did have aborted too: alive, not silent.
                gave_up = {pe for pe in missing if self._abort_code(words, pe)}
                silent, held = sorted(missing - entered - gave_up), sorted((missing & entered) - gave_up)
                why = (f"participant {me} did not hear from participants {silent} within the deadline"
                       + (f"; participants {held} entered the exchange but their rows did not come" if held else "")
                       + (f"; participants {sorted(gave_up)} gave up waiting too" if gave_up else ""))
            e.expired = why  # claimed: no other thread expires it again
            if self._broken is None:  # before the stream drains: a GPU wait that returns sees it
                self._broken = why
        # Our own waits first, then the peers: the abort's signals may be queued on this PE's
        # stream behind the very waits being ended (a heap without signal_now), and a peer's
        # memory may be slow or gone; the stream must drain whatever the abort does.
        self._force_waits()
        self._abort(code, why, cause)

    def _force_waits(self) -> None:
        """End every wait of this PE's stream: the abort value into its own exchange words and the
        words of every captured exchange in flight."""
        with self._lock:
            slots = {self._slot(kind, pe) for pe in self._peers() for kind in (ANNOUNCE, DATA)}
            for e in self._inflight:
                if not e.resolved:
                    slots.update(e.credits.values(), e.arrivals.values())
        for slot in sorted(slots):
            self._stream.force(slot, self.abort_value)

    def _fail(self, e: _Entry, error: BaseException) -> None:
        """Resolve ``e`` as failed with ``error`` (the group is broken from now on)."""
        with self._lock:
            if not e.resolved:
                e.resolved, e.error = True, error
                if self._broken is None:
                    self._broken = str(error)

    def _resolve(self, e: _Entry) -> None:
        """Decide, from the exchange's snapshot, whether it delivered (once its marker passed)."""
        with self._lock:
            if e.resolved:
                return
            e.resolved = True
            r, me = e.route, self.rank
            error = getattr(self._stream, "error", None)
            code = None  # what to tell the peers: nothing when they know already
            if error is not None:
                e.error, code = DistCAError(f"all-to-all ({e.label}) on participant {me}: the stream failed: "
                                            f"{error}"), TIMED_OUT
            elif e.expired is not None:
                e.error = DistCAError(f"all-to-all ({e.label}): {e.expired}")  # _expire told them
            else:
                words, table = e.snapshot.value()
                pending = self._pending(e, words)
                hit = self._aborted_by(words, pending)
                if hit is not None:  # the peer that aborted told everyone
                    e.error = DistCAError(f"all-to-all ({e.label}) aborted on participant {me}: "
                                          f"{self._reason(words, hit)}")
                elif pending:
                    e.error, code = DistCAError(f"all-to-all ({e.label}) aborted on participant {me}: no rows from "
                                                f"participants {sorted(pending)}"), TIMED_OUT
                else:
                    e.error = self._check_reports(r, table, e, e.tag)
                    code = MISMATCH if e.error is not None else None
            if e.error is not None:
                if self._broken is None:
                    self._broken = str(e.error)
                if code is not None:
                    self._abort(code, str(e.error))

    def _check_reports(self, r: _Route, table: np.ndarray, e: _Entry, tag: int | None = None) -> ValueError | None:
        """The error, naming exchange ``e``, if a peer's report row in ``table`` says it sent other
        sizes or under another route than ``r`` expects, or (``tag`` not None) ran another round."""
        rows = table.reshape(self.world_size, _REPORT)
        nseg = len(r.recv_splits)
        for pe, expects in r.expects.items():  # every row as expected: no error to word (nearly always)
            rep = rows[pe]
            if rep[1:3 + nseg].tolist() != expects or (tag is not None and int(rep[0]) != tag):
                break
        else:
            return None
        where = e.label
        for pe in r.recv_from:
            rep = rows[pe]
            expect = r.expects[pe][2:]  # the segment bytes of the row checked above
            sent = rep[3:3 + int(rep[1])].tolist() if 0 <= int(rep[1]) <= MAX_SEGMENTS else None
            if int(rep[2]) != r.rid or sent != expect:
                return ValueError(f"participant {self.rank} ({where}): participant {pe} sent segment bytes "
                                  f"{sent} under another route, participant {self.rank} expects {expect}")
            if tag is not None and int(rep[0]) != tag:
                return ValueError(f"participant {self.rank} ({where}): participant {pe} ran another round (tag "
                                  f"{int(rep[0]):#x}) than participant {self.rank} (tag {tag:#x})")
        return None

    def close(self) -> None:
        """Leave the group: exchanges still in flight end now (their waits are forced), then as
        :meth:`.symmetric.SymmetricTransport.close`."""
        if self._closed:
            return
        self._leaving = True  # an exchange that checks from now is refused (the stream stops below)

        def end_in_flight():
            for e in self._unresolved():
                if not e.marker.done():
                    # CLOSED, not TIMED_OUT: only the peers waiting on this one fail, and say it left
                    self._expire(e, f"participant {self.rank} closed the transport during the exchange", code=CLOSED)
        end_in_flight()  # first: an exchange being queued may wait on the stream these hold
        if self._stream is not None and self._queueing.locked():
            self._force_waits()  # an exchange is being queued: its own unrecorded waits too
        # One that checked before the flag has recorded its entries once this is free; bounded,
        # since a GPU enqueue stuck behind a wait nothing forced must not keep close() forever.
        if self._queueing.acquire(timeout=self.timeout_s + GRACE_S):
            self._queueing.release()
        end_in_flight()
        if self._stream is not None:
            for e in self._unresolved():
                e.marker.wait(GRACE_S)
            self._stream.close()
        if self._watchdog is not None:
            self._watchdog.stop()
        super().close()

    def abandon(self, why: str) -> None:
        """Give up on the group now (its member learned that the group failed elsewhere): every
        exchange in flight ends with ``DistCAError`` naming ``why``, the peers waiting on this PE
        are told (``PEER_FAILED``), and later exchanges fail at once. Returns at once."""
        with self._lock:  # broken before the scan: an exchange recorded after it forces itself (_record)
            first = self._broken is None
            if first:
                self._broken = why
        for e in self._unresolved():
            self._expire(e, why, code=PEER_FAILED)
        if first:
            self._abort(PEER_FAILED, why)  # the peers learn it (again, if an expiry above told them)

    def graph(self, fn) -> "ExchangeGraph":
        """Capture the exchanges ``fn()`` makes, to replay them (:class:`.exchange_graph.ExchangeGraph`)."""
        from .exchange_graph import ExchangeGraph
        return ExchangeGraph(self, fn)


class TaggedRounds:
    """A :class:`RoutedTransport` whose exchanges all pass one round tag (``RoutedTransport.tagged``);
    everything else is the transport's."""

    __slots__ = ("transport", "tag")

    def __init__(self, transport: RoutedTransport, tag: int):
        if not 0 < int(tag) < 1 << 63:
            raise ValueError(f"a round tag is an int in [1, 2**63), got {tag!r}")
        self.transport, self.tag = transport, int(tag)

    def exchange(self, send, send_splits, recv, recv_splits, timeout_s: float | None = None,
                 route: Hashable | None = None) -> ExchangeHandle:
        return self.transport.exchange(send, send_splits, recv, recv_splits, timeout_s, route, self.tag)

    def __getattr__(self, name):
        return getattr(self.transport, name)


__all__ = ["GRACE_S", "RoutedTransport", "TaggedRounds", "route_id"]
