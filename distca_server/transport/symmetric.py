"""The one-sided ragged all-to-all: senders put their rows straight into the receivers' memory.

Written once against a small :class:`SymmetricHeap` (the memory model of NVSHMEM): every
participant (a *PE*) owns an *arena* of the same size that its peers can write into at the same
offsets, and an array of 64-bit *signal words* its peers can set. :mod:`.shm` implements it with
shared memory between the processes of one host (the pure-torch reference, and a real intra-host
CPU transport); :mod:`.nvshmem` with NVSHMEM symmetric GPU memory.

One exchange, number ``n`` (counted by every PE; the signals carry it, so rounds never mix and no
signal word is ever reset). Every value a transport writes into a signal word carries its
*generation* (the group epoch, by default) in the high 32 bits, ``seq = generation << 32 | n``, so a
heap can be reused by the transports of successive group epochs (:class:`ReusableHeap`) without
ever assuming its words start at zero: a word from an older generation (a peer of the old epoch
that still writes late) is below every ``seq`` of the new one and is ignored, ABORT words count only
for their own generation, and a word from a newer generation says that peer has moved on (the
waiting PE fails with :class:`DistCAError` at once):

1. **Announce.** Each receiver ``R`` puts into every sender ``S``'s *inbox* row ``R``: where in
   ``R``'s arena ``S``'s slice of every segment goes and how many bytes ``R`` expects, plus the
   buffer growth ``R`` asks for (below), and sets ``S``'s signal ``ANNOUNCE[R] = n``. ``R`` sends it
   on entering the exchange, i.e. after it has finished with exchange ``n - 1``'s data: the
   announce is also the *credit* that ``R``'s receive buffers may be overwritten.
2. **Agree on growth.** After every announce has arrived, every PE holds every PE's growth request,
   so all of them make the same allocation decisions in the same order: the arena offsets of every
   array stay the same everywhere (symmetric) without a collective.
3. **Data.** ``S`` checks that what it is about to send to ``R`` is what ``R`` announced; if so it
   puts its rows at the announced offsets, then puts its sizes row into ``R``'s *report* table with
   ``DATA[S] = n`` (a put-with-signal: the signal lands after the data). A size mismatch fails the
   exchange with ``ValueError`` on both ends (``S`` sends its true sizes instead of rows; ``R``
   compares them with its own) and aborts the group.
4. **Wait.** ``R`` waits until ``DATA[S] >= n`` (of its generation) for every peer and copies
   staged segments out.

Own split (a rank to itself) is a local copy. No step needs a collective or a barrier: on one GPU
shared by several PEs without MPS, NVSHMEM allows point-to-point RMA only.

Memory: :meth:`SymmetricTransport.buffer` hands out views of *arrays* carved from the arena (one
per key). A key's array grows only at step 2 of an exchange (growth must be agreed), so a
``buffer`` call larger than the key's array returns private memory for now and records the wish;
the next exchange grows the array (to at least twice its size) and later calls get symmetric
memory. Rows for a receive segment in such private memory land at the same offset of the key's new
array and are copied over (one extra copy, that exchange only). A receive segment anywhere else
outside the arena (a fresh tensor) is *staged*: its rows land in a transport-owned staging array
and are copied out (one extra copy; never refused). Old generations of a key's array are not reused
(views handed out stay valid), so an array holds at most twice its largest size; staging's are.

Failure: every wait is bounded by the exchange's deadline. A PE that times out sets its
``ABORT`` word on every peer, so the others fail at once instead of at their own deadline; it
raises :class:`DistCAError` naming the peers it did not hear from. A PE that closes sets
``ABORT = CLOSED``: peers waiting on it fail, others finish what they have.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Sequence

import numpy as np
import torch

from ..errors import DistCAError
from .base import ALIGN, DONE, ExchangeHandle, aligned, check_exchange
from .symmetric_heap import SymmetricHeap, _FirstFit, key_id
from .symmetric_words import (_DIRECT, _LOW, _NSEG, _NWISH, _REPORT, _ROUTE, _ROW, _SEGS, _WHY, _WISH, ABORT, ANNOUNCE,
                              CLOSED, DATA, DIRECT, GEN_SHIFT, GRACE_S, MAX_GENERATION, MAX_SEGMENTS, MAX_WISHES,
                              MISMATCH, MOVED_ON, PEER_FAILED, SIGNAL_KINDS, STAGED, STAGING, TIMED_OUT, abort_low,
                              abort_parts, table_bytes)



class SymmetricTransport:
    """A :class:`.base.Transport` over a :class:`SymmetricHeap` (see the module docstring).

    Args:
        heap: this PE's heap endpoint; the transport owns it from now on (``close`` closes it).
            A :class:`HeapLease` (a reused heap) is closed, not the heap under it.
        timeout_s: deadline of an exchange, in seconds, unless ``exchange`` is given another.
        epoch: the group epoch, named in errors.
        generation: carried in the high bits of every signal value this transport writes
            (default: ``epoch``; a :class:`HeapLease`'s own). Transports that share a heap one after
            another must use increasing generations, and every PE of a group the same one.

    Raises:
        ValueError: ``generation`` not an int in ``[0, MAX_GENERATION]``, or not the lease's.
    """

    def __init__(self, heap: SymmetricHeap, timeout_s: float = 60.0, epoch: int = 0,
                 generation: int | None = None):
        leased = getattr(heap, "generation", None) if isinstance(heap, HeapLease) else None
        if generation is None:
            generation = epoch if leased is None else leased
        if isinstance(generation, bool) or not isinstance(generation, int) or not 0 <= generation <= MAX_GENERATION:
            raise ValueError(f"generation must be an int in [0, {MAX_GENERATION}], got {generation!r}")
        if leased is not None and generation != leased:
            raise ValueError(f"generation {generation} differs from the heap lease's {leased}")
        self.generation = int(generation)
        self._base = self.generation << GEN_SHIFT
        self.heap = heap
        self.rank, self.world_size, self.device = heap.rank, heap.world_size, heap.device
        # the other PEs, rotated so that senders start on different receivers (_peers)
        self._peer_order = tuple((self.rank + i) % self.world_size for i in range(1, self.world_size))
        self.timeout_s, self.epoch = float(timeout_s), epoch
        self.bytes_sent = 0
        P = self.world_size
        self._inbox_at, self._report_at = 0, aligned(P * _ROW * 8)
        self._alloc = _FirstFit(table_bytes(P), heap.arena.numel())
        self._arrays: dict[int, list[tuple[int, int]]] = {}  # key id -> generations (offset, bytes)
        self._keys: dict[int, str] = {}
        self._wishes: dict[int, int] = {}  # key id -> bytes asked of `buffer` beyond its array
        self._private: dict[int, torch.Tensor] = {}  # key id -> memory lent until the array grows
        self._seq = 0
        self._growths = 0  # times any array grew (the same on every PE: growth is agreed)
        self._broken: str | None = None
        self._closed = False
        self._leaving = False  # close() has begun (RoutedTransport sets it before it stops its stream)
        # Held by a host-driven exchange while it runs: close() on another thread waits for it to see
        # the closed flag (its waits look at least every 50 ms) before the heap goes from under it.
        self._hosting = threading.Lock()

    # ---- buffers ----------------------------------------------------------------------------------
    def buffer(self, key: str, nbytes: int) -> torch.Tensor:
        """A uint8 [nbytes] view of buffer ``key``: symmetric memory once an exchange has sized the
        key's array, private memory (and a growth request for the next exchange) before."""
        kid, nbytes = key_id(key), int(nbytes)
        if self._keys.setdefault(kid, key) != key:
            raise ValueError(f"buffer keys {self._keys[kid]!r} and {key!r} hash to the same id {kid}")
        gens = self._arrays.get(kid)
        if gens and gens[-1][1] >= nbytes:
            off = gens[-1][0]
            return self.heap.arena[off:off + nbytes]
        if nbytes == 0:  # nothing to grow for (a wish would keep every route from installing)
            return self.heap.arena[:0]
        self._wishes[kid] = max(self._wishes.get(kid, 0), nbytes)
        private = self._private.get(kid)
        if private is None or private.numel() < nbytes:
            private = self._private[kid] = torch.empty(aligned(nbytes), dtype=torch.uint8, device=self.device)
        return private[:nbytes]

    def symmetric_bytes(self) -> int:
        """Arena bytes held by arrays (all generations, staging included)."""
        return sum(size for gens in self._arrays.values() for _, size in gens)

    def _capacity(self, kid: int) -> int:
        gens = self._arrays.get(kid)
        return gens[-1][1] if gens else 0

    def _grow(self, requests: list[dict[int, int]]) -> None:
        """Apply every PE's growth requests, the same way on every PE."""
        need: dict[int, int] = {}
        for req in requests:
            for kid, n in req.items():
                need[kid] = max(need.get(kid, 0), n)
        for kid in sorted(need):
            cap = self._capacity(kid)
            if need[kid] <= cap:
                continue
            size = max(aligned(need[kid]), 2 * cap)
            gens = self._arrays.setdefault(kid, [])
            if kid == STAGING and gens:  # never handed out: its range is free again
                self._alloc.release(*gens.pop())
            off = self._alloc.alloc(size)
            if off is None:
                name = "the staging array" if kid == STAGING else f"buffer {self._keys.get(kid, kid)!r}"
                self._broken = "symmetric heap full"
                raise DistCAError(
                    f"participant {self.rank}: the symmetric heap ({self.heap.arena.numel()} bytes) has "
                    f"no room for {size} bytes of {name} (holds "
                    f"{self.symmetric_bytes()} bytes in arrays); make the heap larger")
            gens.append((off, size))
            self._growths += 1

    def _recv_layout(self, recv: Sequence[torch.Tensor], growing):
        """Per segment ``(where, base)``: DIRECT with the arena offset of ``recv[s]``; a key id in
        ``growing`` with the offset of ``recv[s]`` in that key's private memory (its rows land at
        the same offset of the key's new array, then are copied over: no staging memory when a
        buffer grows); or STAGED with an offset into the staging array. Also the staging bytes."""
        arena = self.heap.arena
        lo, hi = arena.data_ptr(), arena.data_ptr() + arena.numel()
        lo_arrays = lo + table_bytes(self.world_size)
        layout, staged = [], 0
        for buf in recv:
            p = buf.data_ptr()
            inside = (buf.device == arena.device and buf.numel() > 0 and buf.is_contiguous()
                      and lo_arrays <= p and p + buf.numel() <= hi
                      and not self._in_staging(p - lo, buf.numel()))
            lent = [(kid, p - self._private[kid].data_ptr()) for kid in growing if kid in self._private
                    and 0 <= p - self._private[kid].data_ptr() <= self._private[kid].numel() - buf.numel()]
            if inside or buf.numel() == 0:
                layout.append((DIRECT, p - lo if inside else 0))
            elif lent and buf.is_contiguous():
                layout.append(lent[0])
            else:
                layout.append((STAGED, staged))
                staged += aligned(buf.numel())
        return layout, staged

    def _in_staging(self, off: int, n: int) -> bool:
        return any(o < off + n and off < o + s for o, s in self._arrays.get(STAGING, []))

    # ---- signals ----------------------------------------------------------------------------------
    def _slot(self, kind: int, src: int) -> int:
        return kind * self.world_size + src

    def _peers(self) -> tuple[int, ...]:
        """The other PEs, rotated, so that senders start on different receivers."""
        return self._peer_order

    def _abort(self, code: int, why: str, cause: tuple[int, int] | None = None) -> None:
        """Mark the group broken here and tell every peer (best effort: a peer may be gone);
        ``cause``: the (PE, code) a PEER_FAILED abort passes on. Never blocks on this PE's stream
        (the watchdog calls it, and :meth:`.routed.RoutedTransport._resolve` with the transport's
        lock held)."""
        if self._broken is None:
            self._broken = why
        value = self._base | abort_low(code, cause)
        # A heap whose signals are stream-ordered (the in-process heap on CUDA, NVSHMEM) writes
        # these now where it can (signal_now, a stream of its own): behind its stream, which may be
        # held by the very wait this abort is to end, they would land only once that wait is forced.
        now = getattr(self.heap, "signal_now", None)
        for pe in self._peers():
            try:
                (now or self.heap.signal)(pe, self._slot(ABORT, self.rank), value)
            except Exception:  # noqa: BLE001 - a dead peer's memory may be unreachable
                pass
        # No quiet(), with signal_now or without: it only waits for these writes to complete, and
        # without signal_now they are queued behind the stream's held waits. NVSHMEM's quiet
        # synchronizes that stream on the host thread: it could not return before the force, and
        # overrunning its bound would leave the host thread stuck for every later call. Queued,
        # the signals go out once the stream gets to them (the watchdog forces its waits first);
        # a direct heap (shared memory) has written them already; close() quiets, bounded.

    def _gone(self) -> str | None:
        """Why this PE takes part in no more exchanges: "closed" once :meth:`close` has begun,
        "aborted: <reason>" once the group broke here (a failed exchange, ``abandon``, the
        watchdog), None while it is whole."""
        if self._leaving or self._closed:
            return "closed"
        broken = self._broken
        return None if broken is None else "aborted: " + broken

    def _refuse_if_gone(self, what: str) -> None:
        """Raise ``DistCAError`` naming ``what`` if this PE closed (or is closing) the group, or the
        group is aborted (a routed transport checks it under ``_queueing``, where work is queued next)."""
        state = self._gone()
        if state is not None:
            raise DistCAError(f"{what} on participant {self.rank} of group epoch {self.epoch}: the group is {state}")

    @contextlib.contextmanager
    def _refusing(self):
        """A ``ValueError`` raised inside (this PE's own bad exchange arguments) aborts the group
        before it propagates, so the peers fail at once rather than at their deadline."""
        try:
            yield
        except ValueError as exc:
            if not self._closed:
                self._abort(MISMATCH, f"participant {self.rank} passed bad exchange arguments: {exc}")
            raise

    def _aborted_by(self, sig: np.ndarray, pending) -> tuple[int, int] | None:
        """The first peer whose ABORT word ends this wait: any that timed out or found a mismatch,
        or one we still wait for that left, moved on to a later generation (any of its words
        newer than ours) or gave up after another failed; a cause before a consequence
        (PEER_FAILED last). ABORT words of older generations are ignored."""
        echo = None
        for pe in self._peers():
            code = self._abort_code(sig, pe)
            if pe in pending and any(int(sig[self._slot(k, pe)]) >> GEN_SHIFT > self.generation
                                     for k in range(SIGNAL_KINDS)):
                code = MOVED_ON
            if code in (TIMED_OUT, MISMATCH) or (code in (CLOSED, MOVED_ON) and pe in pending):
                return pe, code
            if code == PEER_FAILED and pe in pending and echo is None:
                echo = pe, code
        return echo

    def _abort_code(self, sig: np.ndarray, pe: int) -> int:
        """What ``pe``'s ABORT word in ``sig`` says in this generation (0: nothing; older
        generations' words are ignored)."""
        word = int(sig[self._slot(ABORT, pe)])
        return abort_parts(word & _LOW)[0] if word >> GEN_SHIFT == self.generation else 0

    def _root(self, sig: np.ndarray, hit: tuple[int, int]) -> tuple[int, int]:
        """The failure behind ``hit`` (a PE and its code, :meth:`_aborted_by`): the one its
        PEER_FAILED word passes on, if it names one, else ``hit``."""
        pe, code = hit
        cause = abort_parts(int(sig[self._slot(ABORT, pe)]) & _LOW)[1]
        return cause if code == PEER_FAILED and cause is not None else hit

    def _reason(self, sig: np.ndarray, hit: tuple[int, int]) -> str:
        """``hit`` in words: "participant 2 timed out ...", or for an echo "participant 1 gave up
        after participant 0 found a mismatch ..." (the failure it passes on)."""
        pe, code = hit
        root = self._root(sig, hit)
        if root != hit:
            return f"participant {pe} gave up after participant {root[0]} {_WHY.get(root[1], 'aborted')}"
        return f"participant {pe} {_WHY.get(code, f'aborted ({code})')}"

    def _landed(self, word: int, seq: int) -> bool:
        """Whether a signal word says exchange ``seq`` of this generation has reached us (a word of
        an older generation never does; a newer one is caught by :meth:`_aborted_by`)."""
        return word >> GEN_SHIFT == self.generation and word >= seq and word & _LOW != _LOW

    def _wait(self, kind: int, seq: int, deadline: float, what: str, arrived=None, report=None) -> None:
        """Wait until every peer's ``kind`` signal reaches ``seq``; ``arrived(pe)`` runs for each
        as it comes (and may raise). When a peer aborts, ``report(pe)`` first checks the sizes row
        of every peer whose row for this exchange has landed (and may raise ValueError): a peer
        that found a size mismatch puts its row, then aborts, and its partner may still be waiting
        for another peer's announce."""
        pending = set(self._peers())
        while True:
            sig = self.heap.signals()
            for pe in sorted(pending):
                if self._landed(int(sig[self._slot(kind, pe)]), seq):
                    pending.discard(pe)
                    if arrived is not None:
                        arrived(pe)
            if not pending:
                return
            hit = self._aborted_by(sig, pending)
            if hit is not None:
                # A peer's last signals may have landed between our reads of its words: look once
                # more, so a peer's sizes row is checked (ValueError) before its abort is reported.
                sig = self.heap.signals()
                for pe in sorted(pending):
                    if arrived is not None and self._landed(int(sig[self._slot(kind, pe)]), seq):
                        arrived(pe)
                for pe in self._peers():
                    if report is not None and self._landed(int(sig[self._slot(DATA, pe)]), seq):
                        report(pe)
                self._broken = self._reason(sig, hit)
                raise DistCAError(f"all-to-all {what} (exchange {seq & _LOW}, group epoch {self.epoch}) aborted "
                                  f"on participant {self.rank}: {self._broken}")
            # This PE gave up (close() or abandon on another thread, e.g. the runtime ending a failed
            # round): nothing it still waits for may ever come, so it stops now, not at its deadline.
            # Its peers learn it from the CLOSED or PEER_FAILED words close() and abandon write.
            state = self._gone()
            if state is not None:
                raise DistCAError(f"all-to-all {what} (exchange {seq & _LOW}, group epoch {self.epoch}) on "
                                  f"participant {self.rank} stopped waiting for participants {sorted(pending)}: "
                                  f"the group is {state}")
            if time.monotonic() > deadline:
                self._abort(TIMED_OUT, "timed out")
                raise DistCAError(f"all-to-all {what} (exchange {seq & _LOW}, group epoch {self.epoch}): "
                                  f"participant {self.rank} did not hear from participants "
                                  f"{sorted(pending)} within the deadline")
            # Until a peer's signal may have landed (heaps that can be woken return at once) or
            # for a while; woken or not, the words are read again.
            self.heap.idle(min(0.05, max(0.0, deadline - time.monotonic())))

    # ---- the exchange -----------------------------------------------------------------------------
    def exchange(self, send: Sequence[torch.Tensor], send_splits: Sequence[Sequence[int]],
                 recv: Sequence[torch.Tensor], recv_splits: Sequence[Sequence[int]],
                 timeout_s: float | None = None, route=None) -> ExchangeHandle:
        """Segment-wise ragged all-to-all (see :meth:`.base.Transport.exchange`), complete when it
        returns :data:`~.base.DONE`: the host drives every step of the one-sided protocol
        (``route`` is ignored here: :class:`.routed.RoutedTransport` drives installed routes from
        the device).

        Raises:
            ValueError: bad splits or buffers, more than ``MAX_SEGMENTS`` segments, or a peer sends
                a different size than this participant expects (or expects a different size than
                it sends); the group is aborted.
            DistCAError: the group was aborted or closed, a peer did not answer within the deadline,
                or the symmetric heap is full.
        """
        self._exchange(send, send_splits, recv, recv_splits, timeout_s)
        return DONE

    def _exchange(self, send, send_splits, recv, recv_splits, timeout_s, route: int = 0) -> None:
        """The host-driven exchange. ``route`` (an id every PE passes for the same exchange, 0 for
        none): when every PE names the same one, receives straight into its arena and no array
        grows, :meth:`_install` is told the offsets it wrote to, for later exchanges of the route."""
        with self._hosting:
            self._exchange_held(send, send_splits, recv, recv_splits, timeout_s, route)

    def _exchange_held(self, send, send_splits, recv, recv_splits, timeout_s, route: int) -> None:
        P, me, heap = self.world_size, self.rank, self.heap
        with self._refusing():
            check_exchange(send, send_splits, recv, recv_splits, P, me)
            if len(send) > MAX_SEGMENTS:
                raise ValueError(f"an exchange moves at most {MAX_SEGMENTS} segments, got {len(send)}")
        self._refuse_if_gone("all-to-all")
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else float(timeout_s))
        ss = [[int(x) for x in sp] for sp in send_splits]
        rs = [[int(x) for x in sp] for sp in recv_splits]
        nseg = len(send)
        if self._seq >= _LOW:
            raise DistCAError(f"participant {me}: group epoch {self.epoch} ran {_LOW} exchanges, the most "
                              f"one generation numbers; form a new group epoch")
        self._seq += 1
        seq = self._base | self._seq
        sig = heap.signals()
        hit = self._aborted_by(sig, set(self._peers()))
        if hit is not None:  # a peer left or failed since the last exchange: nothing will answer
            self._broken = self._reason(sig, hit)
            raise DistCAError(f"all-to-all (exchange {seq & _LOW}, group epoch {self.epoch}) on participant "
                              f"{me}: {self._broken}")
        for s in range(nseg):
            if ss[s][me] != rs[s][me]:
                self._abort(MISMATCH, "own split mismatch")
                raise ValueError(f"participant {me}: segment {s} to itself has {ss[s][me]} bytes, "
                                 f"expected {rs[s][me]}")

        # 1. Announce where each sender's slices go (and the growth this PE asks for).
        # At most MAX_WISHES requests fit a row; any others wait for the next exchange.
        wishes = dict(sorted(self._wishes.items())[:MAX_WISHES - 1])
        layout, staged = self._recv_layout(recv, wishes)
        if staged > self._capacity(STAGING):
            wishes[STAGING] = staged
        prefix = np.zeros((nseg, P + 1), dtype=np.int64)
        for s in range(nseg):
            prefix[s, 1:] = np.cumsum(rs[s])
        # (numpy, not torch, for these small rows: this is per-exchange overhead.)
        rows = np.zeros((P, _ROW), dtype=np.int64)
        direct = all(where == DIRECT for where, _ in layout) and not wishes
        rows[:, :_WISH] = (seq, nseg, len(wishes), route, direct)
        for i, (kid, n) in enumerate(sorted(wishes.items())):
            rows[:, _WISH + 2 * i:_WISH + 2 + 2 * i] = (kid, n)
        segs = rows[:, _SEGS:_SEGS + 3 * nseg].reshape(P, nseg, 3)
        segs[:, :, 0] = [where for where, _ in layout]
        segs[:, :, 1] = (np.array([base for _, base in layout])[:, None] + prefix[:, :P]).T
        segs[:, :, 2] = np.array(rs).T
        rows_t = torch.from_numpy(rows)
        for pe in self._peers():
            heap.put_signal(pe, self._inbox_at + me * _ROW * 8, rows_t[pe].view(torch.uint8),
                            self._slot(ANNOUNCE, me), seq)

        # A peer's sizes row tells what it sent (checked in step 4, or when a peer aborts).
        def check_report(pe: int) -> None:
            rep = heap.read(self._report_at + pe * _REPORT * 8, _REPORT * 8).view(torch.int64).tolist()
            sent = rep[3:3 + int(rep[1])]
            expect = [rs[s][pe] for s in range(nseg)]
            if rep[0] != seq or sent != expect:
                self._abort(MISMATCH, f"size mismatch with participant {pe}")
                raise ValueError(f"participant {me}: participant {pe} sent segment bytes {sent} in "
                                 f"exchange {rep[0] & _LOW}, participant {me} expects {expect} in exchange {seq & _LOW}")

        self._wait(ANNOUNCE, seq, deadline, "announce", report=check_report)
        inbox = heap.read(self._inbox_at, P * _ROW * 8).view(torch.int64).view(P, _ROW).numpy()

        # 2. Agree on growth: every PE applies every PE's requests in the same order.
        requests = [wishes]
        for pe in self._peers():
            if int(inbox[pe, 0]) != seq:
                self._abort(MISMATCH, "out of step")
                raise DistCAError(f"participant {me}: participant {pe} announced exchange "
                                  f"{int(inbox[pe, 0]) & _LOW} during exchange {seq & _LOW} (out of step)")
            nw = int(inbox[pe, _NWISH])
            requests.append({int(inbox[pe, _WISH + 2 * i]): int(inbox[pe, _WISH + 1 + 2 * i]) for i in range(nw)})
        growths = self._growths
        self._grow(requests)
        # The route is installed when every PE named it, receives in place, and nothing grew (a
        # grown array moves the buffers later exchanges of the route receive into).
        install = (route != 0 and direct and growths == self._growths
                   and all(int(inbox[pe, _ROUTE]) == route and int(inbox[pe, _DIRECT]) for pe in self._peers()))
        puts: dict[int, list[tuple[int, int]]] = {}  # peer -> (arena offset, bytes) per segment
        for kid in wishes:
            self._wishes.pop(kid, None)
            self._private.pop(kid, None)  # the caller's views keep it alive as long as they need
        # Where STAGED and key-relative offsets start, now that the arrays have grown.
        at = {kid: gens[-1][0] for kid, gens in self._arrays.items()}
        at[DIRECT] = 0

        # 3. Data: put each peer's rows where it announced, then the sizes row with DATA[me] = seq.
        send_at = [np.concatenate([[0], np.cumsum(sp)]) for sp in ss]
        mismatches = []
        for pe in self._peers():
            row = inbox[pe]
            theirs = [int(row[_SEGS + 3 * s + 2]) for s in range(int(row[_NSEG]))]
            mine = [ss[s][pe] for s in range(nseg)]
            if theirs == mine:
                puts[pe] = []
                for s in range(nseg):
                    n = mine[s]
                    where, off = (int(x) for x in row[_SEGS + 3 * s:][:2])
                    puts[pe].append((at[where] + off, n))
                    if n:
                        a = int(send_at[s][pe])
                        heap.put(pe, at[where] + off, send[s][a:a + n])
            else:
                mismatches.append(f"participant {me} sends participant {pe} segment bytes {mine}, "
                                  f"participant {pe} expects {theirs}")
            report = np.zeros(_REPORT, dtype=np.int64)
            report[:3 + nseg] = [seq, nseg, route] + mine
            heap.put_signal(pe, self._report_at + me * _REPORT * 8,
                            torch.from_numpy(report).view(torch.uint8), self._slot(DATA, me), seq)
        for s in range(nseg):  # own split: a local copy
            n = ss[s][me]
            if n:
                a, b = int(send_at[s][me]), int(prefix[s, me])
                heap.copy(recv[s][b:b + n], send[s][a:a + n])
        heap.quiet()
        if mismatches:
            self._abort(MISMATCH, mismatches[0])
            raise ValueError("; ".join(mismatches))

        # 4. Wait for every peer's rows; a peer's sizes row tells what it sent.
        self._wait(DATA, seq, deadline, "data", check_report, check_report)
        for s, (where, base) in enumerate(layout):
            if where != DIRECT:
                for pe in self._peers():
                    n, b = rs[s][pe], int(prefix[s, pe])
                    if n:
                        src = at[where] + base + b
                        heap.copy(recv[s][b:b + n], heap.arena[src:src + n])
        self.bytes_sent += sum(sum(sp) - sp[me] for sp in ss)
        if install:
            self._install(route, ss, rs, recv, puts)

    def _install(self, route: int, send_splits, recv_splits, recv, puts) -> None:
        """Called after a host-driven exchange of ``route`` that every PE can repeat without
        announcing (see :meth:`_exchange`): ``puts[pe]`` is, per segment, the arena offset at which
        this PE wrote its rows for ``pe`` and their bytes. The host-driven transport keeps nothing."""
    def close(self) -> None:
        """Leave the group: peers waiting on this PE fail with ``DistCAError``, and so does a
        host-driven exchange of this PE waiting on another thread (at its next look, within
        50 ms). close() waits for that exchange at most ``GRACE_S`` (1 s) before it unmaps the
        heap: one held longer inside a single heap call may then fail with another error."""
        if self._closed:
            return
        self._closed = True
        # A PE that aborted has told its peers why already; CLOSED would hide a timeout from them.
        for pe in self._peers() if self._broken is None else []:
            try:
                self.heap.signal(pe, self._slot(ABORT, self.rank), self._base | CLOSED)
            except Exception:  # noqa: BLE001 - a peer's memory may be gone already
                pass
        # An exchange on another thread sees the flag at its next look (every <= 50 ms of waiting);
        # bounded, since one stuck in a heap call must not keep close() forever.
        if self._hosting.acquire(timeout=GRACE_S):
            self._hosting.release()
        try:
            self.heap.quiet()
        finally:
            self.heap.close()


from .heap_lease import HeapLease, ReusableHeap  # noqa: E402  (they need SymmetricHeap, MAX_GENERATION)

__all__ = ["ALIGN", "HeapLease", "ReusableHeap", "SymmetricHeap", "SymmetricTransport", "key_id"]
