"""The communication-aware greedy planner (DistCA §4.2 and Appendix B), improved.

Vocabulary. A document of ``l`` tokens is *folded*: folded position ``f`` in ``[0, c)``,
``c = ceil(l / 2)``, stands for the head token ``f`` and its mirror ``l - 1 - f`` (one token at the
centre when ``l`` is odd). A *band* ``[a, b)`` of folded positions is a head–tail pair of shards,
head ``[a, b)`` and tail ``[l - b, l - a)`` (one merged shard ``[a, l - a)`` when ``b == c``). Its
causal work is exactly ``l + 1`` (query, key) pairs per folded position (half of it for the centre
of an odd document; DistCA §4.2's head–tail trick), so a band of any width is an exact,
proportional slice of the document's FLOPs.

Algorithm (loads in causal pairs; FLOPs are a constant multiple):

1. Initial placement. ``inplace``: every document on its rank's own server. ``dedicated``:
   longest-processing-time first, each document to the least-loaded server.
2. A limit ``U``. *Surplus* servers are those above ``U``; every other server is a *deficit*
   server with room ``U - F``.
3. For each surplus server, most loaded first, until it is within ``U``: among its items (bands)
   and, for each, the deficit server with the most room plus a server that already holds the
   adjacent band of that document, pick the move with the largest ``ΔF / V`` and apply it.
   ``ΔF`` is whole folded positions (a shard never shrinks below ``min_shard`` tokens); ``V`` =
   the bytes this move adds to the step (Q-type rows of the moved band, and only those KV rows the
   destination does not hold yet; a rank's own server holds all its rows). The *inner* part of a
   band moves, whose KV prefix is the shortest. When the source needs more than the destination
   can take, the band's surplus is cut *evenly*: into ``p = ceil(surplus / fits)`` pieces of at
   least ``min_shard`` positions each, so no sliver too narrow to move is left behind.

Balance. Let ``B`` be the lower bound of :mod:`scheduler.bound` (no plan's most loaded server holds
less than ``max(mean, B)``; its derivation is there), ``M = max(mean, B)`` and the target
``T = (1 + ε) · M``. The planner runs step 3 with ``U = (1 + ε) · mean`` (the published stop
rule); if some server is still above ``T`` it runs again from the initial placement with ``U = T``
and keeps the better result; if a server is *still* above ``T`` a last pass moves, from the most
loaded such server, its smallest movable piece to the least-loaded server for as long as that
lowers the source's load. Guarantees (``Q``: the largest piece a server may be unable to cut
further: ``l (l + 1) / 2`` for a document with ``c < 2 · min_shard``, else
``(2 · min_shard - 1) · (l + 1)``, maximised over documents):

(a) Always ``max load ≤ max(T, mean + Q)``: each server the last pass leaves above ``T`` could
    not give its smallest piece ``p ≤ Q`` to the least-loaded server (load ``≤ mean``), and each
    receiver of that pass got one piece ``≤ Q`` while it was the least loaded.
(b) Hence ``max load ≤ T = (1 + ε) · max(mean, B)`` whenever ``Q ≤ ε · M``, and in practice on
    batches of one long document (the even cut reaches the piece bound, e.g. 1.05 for one
    65,536-token document over 256 servers at ε = 0.05 and ``min_shard`` 128).
(c) Exactly ``T`` on every input is out of reach for any fast planner: with ε = 0 it would solve
    the partition problem (two servers, unsplittable documents).

Also: (d) KV bytes count only rows the destination lacks (one copy per document and server);
(e) any lengths, documents with ``c < 2 · min_shard`` are never split; (f) deterministic: every
choice breaks ties by server and document index; (g) time ``O((N + S) log (N + S))`` for ``N``
documents and ``S`` servers, whatever the batch: a move looks at a bounded set of candidates
per source (its still-whole documents indexed by length: the longest that fits whole, the
longest, and those nearest the length with the best ``ΔF / V``; plus its last split bands).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right
from itertools import chain
from typing import Sequence

import numpy as np

from .bound import load_bound
from .checks import positive_int
from .cost import CostModel
from .tasks import Plan, check_batch

# Split bands of a source re-examined per move (newest first); older ones only when nothing else moves.
_RECENT_BANDS = 8
# Still-whole documents examined on each side of the length with the best FLOPs per byte.
_NEIGHBOURS = 2


def _band_tokens(l: int, a: int, b: int) -> int:
    """Tokens in band [a, b): head [a, b) plus tail [max(l - b, b), l - a)."""
    return (b - a) + (l - a - max(l - b, b))


def _band_pairs(l: int, a: int, b: int) -> int:
    """Causal pairs of band [a, b): sum of (t + 1) over its head and tail tokens."""
    t0 = max(l - b, b)
    return ((b - a) * (a + b + 1) + (l - a - t0) * (t0 + l - a + 1)) // 2


def _band_shards(l: int, a: int, b: int) -> list[tuple[int, int]]:
    """Query shards of band [a, b): one merged shard at the centre, else head and tail."""
    t0 = max(l - b, b)
    if t0 == b:
        return [(a, l - a)]
    return [(a, b), (t0, l - a)]


def _finishable(rest: int, keep: int, fits: int, ms: int) -> bool:
    """Whether ``rest`` folded positions of a band can end placed: the source keeping up to
    ``keep`` (0 or >= ms) and the others going in pieces of ``ms`` to ``fits`` positions."""
    if rest == 0 or ms <= rest <= keep:
        return True
    if rest < ms:
        return False
    shed = rest - keep
    p = -(-shed // fits)
    if p * ms <= shed or rest - p * ms >= ms:  # as cut, or with the source keeping less
        return True
    return -(-rest // fits) * ms <= rest  # the source keeping none


def _validate(doc_lens_per_rank, num_servers, cost, epsilon, mode, min_shard) -> None:
    """The checks of :func:`plan_batch` (and the baselines): the plan's own plus ``min_shard``."""
    positive_int("min_shard", min_shard)
    check_batch(doc_lens_per_rank, num_servers, mode, cost, epsilon)


class _Alive:
    """Documents of one length-sorted list, still whole on their first server: the nearest alive
    position at or left / right of ``i`` in amortised O(1) (path-halving union-find)."""

    __slots__ = ("left", "right", "n")

    def __init__(self, n: int):
        self.n = n
        self.left = list(range(n + 1))   # position i+1 stands for i; 0 means "none"
        self.right = list(range(n + 1))  # position i stands for i; n means "none"

    def kill(self, i: int) -> None:
        self.left[i + 1] = i
        self.right[i] = i + 1

    def at_or_left(self, i: int) -> int:
        """Largest alive position <= i, or -1."""
        p, left = i + 1, self.left
        while left[p] != p:
            left[p] = left[left[p]]
            p = left[p]
        return p - 1

    def at_or_right(self, i: int) -> int:
        """Smallest alive position >= i, or n."""
        p, right = max(i, 0), self.right
        while right[p] != p:
            right[p] = right[right[p]]
            p = right[p]
        return p


class _Index:
    """One source's still-whole documents, by length: ``gids``, ``lens``, ``pairs`` sorted by
    (length, -gid), so the rightmost of equal lengths is the lowest document index."""

    __slots__ = ("gids", "lens", "pairs", "alive", "pos")

    def __init__(self, gids: list[int], lens: list[int], pairs: list[int]):
        order = sorted(range(len(gids)), key=lambda i: (lens[i], -gids[i]))
        self.gids = [gids[i] for i in order]
        self.lens = [lens[i] for i in order]
        self.pairs = [pairs[i] for i in order]
        self.alive = _Alive(len(order))
        self.pos = {g: i for i, g in enumerate(self.gids)}

    def largest_within(self, pairs_limit) -> int:
        """Position of the longest alive document with ``pairs <= pairs_limit``, or -1."""
        return self.alive.at_or_left(bisect_right(self.pairs, pairs_limit) - 1)


class _Balance:
    """One run of the greedy from the initial placement at limit ``limit``."""

    def __init__(self, batch: "_Batch", limit: float):
        self.b = batch
        self.limit = limit
        self.loads = list(batch.init_loads)
        self.bands: dict[int, dict[int, list[int]]] = {}  # touched documents: server -> [a, b]
        self.index: dict[int, tuple[_Index, _Index]] = {}  # source -> (unsplittable, splittable)
        self.recent: dict[int, list[int]] = {}  # source -> documents it split, oldest first

    # ---- a source's items ---------------------------------------------------------------------
    def _indexes(self, src: int) -> tuple[_Index, _Index]:
        idx = self.index.get(src)
        if idx is None:
            b = self.b
            gids = b.docs_on(src)
            unsplit = [g for g in gids if not b.splittable[g]]
            split = [g for g in gids if b.splittable[g]]
            idx = self.index[src] = (
                _Index(unsplit, [b.lens[g] for g in unsplit], [b.pairs[g] for g in unsplit]),
                _Index(split, [b.lens[g] for g in split], [b.pairs[g] for g in split]))
            self.recent[src] = []
        return idx

    def _band(self, gid: int, server: int):
        """[a, b] of document ``gid`` on ``server``, or None."""
        held = self.bands.get(gid)
        if held is None:
            return [0, self.b.fold[gid]] if self.b.init_server[gid] == server else None
        return held.get(server)

    # ---- costs ------------------------------------------------------------------------------
    def _off(self, gid: int, server: int) -> int:
        """1 if rows of document ``gid`` must cross the network to reach ``server``."""
        return 0 if self.b.inplace and server == self.b.rank[gid] else 1

    def _move_bytes(self, gid: int, src: int, dst: int, a: int, b: int, k: int, dst_band) -> int:
        """Bytes one step gains when the inner ``k`` folded tokens of band [a, b) go src -> dst."""
        l = self.b.lens[gid]
        lo = b - k
        centre = 1 if (l & 1 and b == (l + 1) // 2) else 0
        off_dst, off_src = self._off(gid, dst), self._off(gid, src)
        dq = (2 * k - centre) * self.b.q_bytes * (off_dst - off_src)
        end = l - dst_band[0] if dst_band is not None else 0
        dkv = (max(end, l - lo) - end) * off_dst
        if lo == a:  # the source gives the document up and no longer needs its KV rows
            dkv -= (l - a) * off_src
        return dq + dkv * self.b.kv_bytes

    # ---- how much of a band to move ---------------------------------------------------------------
    @staticmethod
    def _inner_pairs(l: int, b: int, k: int) -> int:
        """Pairs of the inner ``k`` folded positions ``[b - k, b)`` of a band ending at ``b``."""
        if k <= 0:
            return 0
        centre = 1 if (l & 1 and b == (l + 1) // 2) else 0
        return (2 * k - centre) * (l + 1) // 2

    def _k_at_most(self, l: int, b: int, w: int, x) -> int:
        """Largest ``k`` in [0, w] whose inner pairs are ``<= x``."""
        centre = 1 if (l & 1 and b == (l + 1) // 2) else 0
        k = min(w, max(0, (int(2 * x // (l + 1)) + centre) // 2))
        pairs = self._inner_pairs
        while k > 0 and pairs(l, b, k) > x:
            k -= 1
        while k < w and pairs(l, b, k + 1) <= x:
            k += 1
        return k

    def _k_at_least(self, l: int, b: int, w: int, x) -> int:
        """Smallest ``k`` in [1, w] whose inner pairs are ``>= x``, or ``w + 1``."""
        k = self._k_at_most(l, b, w, x)
        if k >= 1 and self._inner_pairs(l, b, k) >= x:
            return k
        return k + 1

    def _choose_k(self, gid: int, a: int, b: int, need, room) -> int:
        """Folded positions to move from the inner end of band [a, b), or 0 if nothing fits.

        ``need``: pairs the source is above the limit; ``room``: pairs the destination may take.
        Every shard keeps ``min_shard`` tokens: both parts of a split band keep ``min_shard``
        folded positions.
        """
        l, w = self.b.lens[gid], b - a
        whole = self._inner_pairs(l, b, w)
        if whole <= need and whole <= room:
            return w
        ms = self.b.min_shard
        if w < 2 * ms:  # too narrow to leave two shards of min_shard tokens
            return w if whole <= room else 0
        fits = self._k_at_most(l, b, w, room)
        if fits < ms:
            return 0
        if need <= room:  # finish the source with the smallest piece that does it
            k = max(ms, self._k_at_least(l, b, w, need))
            if w - k < ms:  # the remainder would be a sliver: move all of it, or leave exactly ms
                return w if whole <= room else w - ms
            return k
        # Fill the destination, unless that leaves a remainder no later moves can place (pieces
        # of at most `fits` and at least ms positions): then cut the band's surplus evenly.
        k_need = self._k_at_least(l, b, w, need)
        keep = w - k_need if k_need <= w else 0  # widest outer part the source may keep
        if keep < ms:
            keep = 0
        if _finishable(w - fits, keep, fits, ms):
            return fits
        shed = w - keep
        p = -(-shed // fits)
        if p * ms > shed:  # pieces would be narrower than min_shard: the source keeps less
            keep = w - p * ms
            if keep >= ms:
                shed = p * ms
            else:
                shed, p = w, -(-w // fits)
                if p * ms > w:  # no even cut: fill the destination, leave at least ms
                    return fits if w - fits >= ms else w - ms
        k = -(-shed // p)
        if 0 < w - k < ms:
            k = w - ms
        return k

    # ---- candidate moves ------------------------------------------------------------------------
    def _consider(self, best, gid: int, a: int, b: int, src: int, dst: int, dst_band, need):
        room = self.limit - self.loads[dst]
        if room <= 0:
            return best
        k = self._choose_k(gid, a, b, need, room)
        if k <= 0:
            return best
        moved = self._inner_pairs(self.b.lens[gid], b, k)
        v = self._move_bytes(gid, src, dst, a, b, k, dst_band)
        key = (moved / v if v > 0 else math.inf, moved, -dst, -gid)
        if best is None or key > best[0]:
            return (key, dst, gid, k)
        return best

    def _consider_split(self, best, gid: int, src: int, top: int, need):
        """A band ``src`` already split: to ``top`` or to the server holding the adjacent band."""
        held = self.bands[gid]
        a, b = held[src]
        adjacent = None
        for s, band in held.items():
            if band[0] == b:
                adjacent = s
        top_band = held.get(top)
        if top_band is None or top == adjacent:
            best = self._consider(best, gid, a, b, src, top, top_band, need)
        if adjacent is not None and adjacent != top:
            best = self._consider(best, gid, a, b, src, adjacent, held[adjacent], need)
        return best

    def _best_move(self, src: int, top: int):
        """The move from ``src`` with the most FLOPs per byte: ``(dst, gid, k)`` or None."""
        need = self.loads[src] - self.limit
        room = self.limit - self.loads[top]
        unsplit, split = self._indexes(src)
        b = self.b
        best = None
        fresh = set()
        # Still-whole documents: the longest that fits whole (FLOPs per byte grow with length
        # for a whole move) ...
        i = unsplit.largest_within(room)
        if i >= 0:
            fresh.add(unsplit.gids[i])
        i = split.largest_within(min(need, room))
        if i >= 0:
            fresh.add(split.gids[i])
        # ... the longest, and those nearest the length whose cut moves most FLOPs per byte.
        n = len(split.gids)
        if n:
            i = split.alive.at_or_left(n - 1)
            if i >= 0:
                fresh.add(split.gids[i])
            # Cutting X pairs off a document of length l moves ~X (2 q + kv) / (l + 1) + kv l / 2
            # bytes (q only where the source sends Q rows), smallest at (l + 1)^2 = 2 X (2 q + kv) / kv.
            x = min(need, room)
            q = b.q_bytes if b.inplace else 0
            best_len = math.isqrt(int(2 * x * (2 * q + b.kv_bytes) // max(1, b.kv_bytes))) - 1
            longest_cut = int(room // b.min_shard) - 1  # longest whose min_shard piece fits
            hi = bisect_right(split.lens, longest_cut)
            mid = min(bisect_left(split.lens, best_len), hi)
            j = mid - 1
            for _ in range(_NEIGHBOURS):
                j = split.alive.at_or_left(j)
                if j < 0:
                    break
                fresh.add(split.gids[j])
                j -= 1
            j = mid
            for _ in range(_NEIGHBOURS):
                j = split.alive.at_or_right(j)
                if j >= hi:
                    break
                fresh.add(split.gids[j])
                j += 1
        for gid in sorted(fresh):
            best = self._consider(best, gid, 0, b.fold[gid], src, top, None, need)
        # Bands this source split before: the newest few; all of them if nothing else moves.
        recent = [g for g in self.recent[src] if src in self.bands[g]]
        self.recent[src] = recent
        for gid in recent[-_RECENT_BANDS:]:
            best = self._consider_split(best, gid, src, top, need)
        if best is None:
            for gid in recent[:-_RECENT_BANDS]:
                best = self._consider_split(best, gid, src, top, need)
        return None if best is None else best[1:]

    # ---- moves ----------------------------------------------------------------------------------
    def _apply(self, src: int, dst: int, gid: int, k: int) -> None:
        b = self.b
        held = self.bands.get(gid)
        if held is None:  # first move of a still-whole document
            held = self.bands[gid] = {src: [0, b.fold[gid]]}
            unsplit, split = self._indexes(src)
            index = split if b.splittable[gid] else unsplit
            index.alive.kill(index.pos[gid])
        band = held[src]
        a, hi = band
        lo = hi - k
        moved = self._inner_pairs(b.lens[gid], hi, k)
        self.loads[src] -= moved
        self.loads[dst] += moved
        if lo == a:
            del held[src]
        else:
            band[1] = lo
            if gid not in self.recent[src][-1:]:
                self.recent[src].append(gid)
        there = held.get(dst)
        if there is None:
            held[dst] = [lo, hi]
        elif there[0] == hi:  # adjacent inner band: widen it outwards
            there[0] = lo
        else:
            raise AssertionError("non-adjacent bands of one document on one server")

    def run(self) -> None:
        """Surplus-to-deficit moves at ``self.limit`` (steps 2 and 3 of the module docstring)."""
        limit, loads = self.limit, self.loads
        sources = sorted((s for s in range(self.b.S) if loads[s] > limit), key=lambda s: (-loads[s], s))
        source_set = set(sources)
        heap = [(-(limit - loads[s]), s) for s in range(self.b.S) if s not in source_set]
        heapq.heapify(heap)
        for src in sources:
            while loads[src] > limit and heap:
                neg_room, top = heap[0]
                if -neg_room != limit - loads[top]:  # stale entry
                    heapq.heapreplace(heap, (-(limit - loads[top]), top))
                    continue
                best = self._best_move(src, top)
                if best is None:
                    break  # not even the roomiest server takes a piece of this source
                dst, gid, k = best
                self._apply(src, dst, gid, k)
                heapq.heapreplace(heap, (-(limit - loads[top]), top))
                if dst != top:
                    heapq.heappush(heap, (-(limit - loads[dst]), dst))

    # ---- the last pass: smallest pieces to the least-loaded server ----------------------------------
    def _smallest_piece(self, src: int, dst: int):
        """``(pairs, gid, k)`` of the smallest piece ``src`` can give ``dst``, or None."""
        b, ms = self.b, self.b.min_shard
        unsplit, split = self._indexes(src)
        best = None
        for index in (unsplit, split):
            i = index.alive.at_or_right(0)
            if i < len(index.gids):
                gid = index.gids[i]
                w = b.fold[gid]
                k = w if w < 2 * ms else ms
                best = min(best or (math.inf,), (self._inner_pairs(b.lens[gid], w, k), gid, k))
        for gid in self.recent[src]:
            held = self.bands[gid]
            if src not in held:
                continue
            a, hi = held[src]
            there = held.get(dst)
            if there is not None and there[0] != hi:
                continue  # dst holds a band of this document that is not adjacent
            k = hi - a if hi - a < 2 * ms else ms
            best = min(best or (math.inf,), (self._inner_pairs(b.lens[gid], hi, k), gid, k))
        return best

    def settle(self, target: float) -> None:
        """While a server is above ``target``: give its smallest piece to the least-loaded server
        if that lowers it (guarantee (a) of the module docstring)."""
        loads = self.loads
        stuck = sorted((s for s in range(self.b.S) if loads[s] > target), key=lambda s: (-loads[s], s))
        heap = [(loads[s], s) for s in range(self.b.S)]
        heapq.heapify(heap)
        for src in stuck:
            while loads[src] > target:
                while heap[0][0] != loads[heap[0][1]] or heap[0][1] == src:
                    load, s = heapq.heappop(heap)
                    if s == src:
                        parked = (load, s)
                    elif load == loads[s]:
                        heapq.heappush(heap, (load, s))
                        break
                    else:
                        heapq.heappush(heap, (loads[s], s))
                else:
                    parked = None
                dst = heap[0][1]
                piece = self._smallest_piece(src, dst)
                if piece is None or loads[dst] + piece[0] >= loads[src]:
                    break
                self._apply(src, dst, piece[1], piece[2])
                heapq.heappush(heap, (loads[dst], dst))
            heapq.heappush(heap, (loads[src], src))

    # ---- output -------------------------------------------------------------------------------
    def task_array(self) -> np.ndarray:
        """int64 [num_tasks, 7] in the plan's canonical order (server, rank, doc, q_start)."""
        b = self.b
        touched = sorted(self.bands)
        keep = np.ones(b.N, dtype=bool)
        keep[touched] = False
        lens = b.lens_arr[keep]
        whole = np.zeros((len(lens), 7), dtype=np.int64)
        whole[:, 0] = b.init_server_arr[keep]
        whole[:, 1] = b.rank_arr[keep]
        whole[:, 2] = b.index_arr[keep]
        whole[:, 4] = lens
        whole[:, 6] = lens
        rows = []
        for gid in touched:
            l, r, i = b.lens[gid], b.rank[gid], b.index[gid]
            for server, (a, hi) in self.bands[gid].items():
                for qs, qe in _band_shards(l, a, hi):
                    rows.append((server, r, i, qs, qe, 0, qe))
        if not rows:
            arr = whole
            if b.inplace:  # each rank's documents on its own server: already in order
                return arr
        else:
            arr = np.concatenate([whole, np.array(rows, dtype=np.int64).reshape(-1, 7)])
        # Canonical order; a server holds one band of a document, whose shards are in order.
        order = np.lexsort((arr[:, 3], arr[:, 2], arr[:, 1], arr[:, 0]))
        return arr[order]

    def max_load(self) -> int:
        return max(self.loads)


class _Batch:
    """The batch as flat lists and arrays, and its initial placement (shared by every run)."""

    def __init__(self, doc_lens_per_rank, num_servers, cost, mode, min_shard):
        self.S, self.min_shard, self.inplace = num_servers, min_shard, mode == "inplace"
        self.q_bytes, self.kv_bytes = cost.step_row_bytes()
        counts = np.fromiter(map(len, doc_lens_per_rank), dtype=np.int64, count=len(doc_lens_per_rank))
        self.N = N = int(counts.sum())
        self.counts = counts
        self.lens_arr = np.fromiter(chain.from_iterable(doc_lens_per_rank), dtype=np.int64, count=N)
        self.rank_arr = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        starts = np.cumsum(counts) - counts
        self.index_arr = np.arange(N, dtype=np.int64) - np.repeat(starts, counts)
        self.lens = self.lens_arr.tolist()
        self.rank = self.rank_arr.tolist()
        self.index = self.index_arr.tolist()
        fold = (self.lens_arr + 1) // 2
        self.fold = fold.tolist()
        self.splittable = (fold >= 2 * min_shard).tolist()
        if N and int(self.lens_arr.max()) < 2**31:
            pairs = self.lens_arr * (self.lens_arr + 1) // 2
            self.pairs = pairs.tolist()
        else:
            pairs = None
            self.pairs = [l * (l + 1) // 2 for l in self.lens]
        if self.inplace:
            self.init_server_arr = self.rank_arr
            self.init_server = self.rank
            self._starts = np.concatenate([starts, [N]]).tolist()
            if pairs is not None and N * int(self.lens_arr.max()) ** 2 < 2**62:
                loads = np.zeros(num_servers, dtype=np.int64)
                np.add.at(loads, self.rank_arr, pairs)
                self.init_loads = loads.tolist()
            else:
                self.init_loads = [0] * num_servers
                for g, p in enumerate(self.pairs):
                    self.init_loads[self.rank[g]] += p
        else:
            self._place_lpt()

    def _place_lpt(self) -> None:
        """Longest first, each document to the least-loaded server (ties: lower server)."""
        loads = [0] * self.S
        server = [0] * self.N
        heap = [(0, s) for s in range(self.S)]
        pairs = self.pairs
        for g in np.lexsort((np.arange(self.N), -self.lens_arr)).tolist():
            load, s = heap[0]
            server[g] = s
            loads[s] = load + pairs[g]
            heapq.heapreplace(heap, (loads[s], s))
        self.init_server, self.init_loads = server, loads
        self.init_server_arr = np.asarray(server, dtype=np.int64).reshape(-1)
        self._on = None

    def docs_on(self, server: int) -> list[int]:
        """Documents initially on ``server``, by index."""
        if self.inplace:
            return list(range(self._starts[server], self._starts[server + 1]))
        if self._on is None:
            order = np.argsort(self.init_server_arr, kind="stable")
            bounds = np.searchsorted(self.init_server_arr[order], np.arange(self.S + 1)).tolist()
            order = order.tolist()
            self._on = [order[bounds[s]:bounds[s + 1]] for s in range(self.S)]
        return self._on[server]


def plan_batch(doc_lens_per_rank: Sequence[Sequence[int]], num_servers: int, *, cost: CostModel,
               epsilon: float = 0.05, mode: str = "inplace", min_shard: int = 128) -> Plan:
    """Plan one step: split the batch's documents into CA-tasks balanced over the servers.

    Args:
        doc_lens_per_rank: ``doc_lens_per_rank[r]`` lists the document lengths (tokens, ints > 0)
            packed on client rank ``r``; a rank may have none.
        num_servers: attention servers; in ``inplace`` mode it must equal the number of ranks.
        cost: attention shape and element size (FLOPs per pair, bytes per row).
        epsilon: imbalance tolerance ε: the planner aims for every server within
            ``(1 + ε) · max(mean, bound)`` attention FLOPs, ``bound`` the lower bound of
            :func:`scheduler.bound.load_bound` (what is guaranteed: see the module doc).
        mode: ``"inplace"`` (server ``i`` is rank ``i``; a rank's rows are free for its own server)
            or ``"dedicated"`` (servers are separate processes; every row moves).
        min_shard: no shard of a split document is shorter than this many tokens (a FlashAttention
            tile is 128 rows, DistCA §3); documents with ``ceil(l / 2) < 2 · min_shard`` stay whole.

    Returns:
        A :class:`Plan` (built by construction from valid parts, not re-validated).

    Raises:
        ValueError: bad lengths, sizes, mode, ε or ``min_shard`` (the message names the values).
    """
    _validate(doc_lens_per_rank, num_servers, cost, epsilon, mode, min_shard)
    batch = _Batch(doc_lens_per_rank, int(num_servers), cost, mode, int(min_shard))
    bound = load_bound(batch.lens_arr, batch.S, batch.min_shard)
    target = (1.0 + epsilon) * bound.level
    best = _Balance(batch, (1.0 + epsilon) * bound.mean)
    best.run()
    if best.max_load() > target and target > best.limit:
        again = _Balance(batch, target)
        again.run()
        if again.max_load() < best.max_load():
            best = again
    if best.max_load() > target:
        best.settle(target)
    return Plan._trusted(counts=batch.counts, doc_lens=batch.lens_arr, num_servers=batch.S, mode=mode,
                         cost=cost, task_array=best.task_array(), epsilon=float(epsilon),
                         min_shard=batch.min_shard)
