"""The surplus-to-deficit greedy of :mod:`scheduler.planner` (steps 3 and the last pass of its
algorithm): one :class:`Greedy` run per limit, from a :class:`~scheduler.placement.PlacedBatch`.
The last pass and the output are in :mod:`scheduler.greedy_settle`, a mixin of :class:`Greedy`."""

from __future__ import annotations

import heapq
import math
from math import ceil, floor, isqrt
from bisect import bisect_left, bisect_right
from itertools import islice

from .bands import band_kv_rows, finishable, folded_pairs
from .greedy_settle import GreedySettle
from .placement import PlacedBatch

# Split bands of a source re-examined per move (newest first); older ones only when nothing else moves.
_RECENT_BANDS = 8
# Whole documents examined on each side of the length with the best FLOPs per byte, and the
# most a source may have to be looked at one by one instead.
_NEIGHBOURS = 2
_SCAN = 6
# Under a held-bytes cap, servers with the most held room tried when the FLOP-roomiest one refuses.
_CAP_TRIES = 32


def _skip_dead(dead: dict[int, int], i: int) -> int:
    """The first live position reached from ``i`` by following ``dead`` links, compressing the
    path on the way (union-find), so repeated look-ups stay near constant time."""
    path = []
    while i in dead:
        path.append(i)
        i = dead[i]
    for p in path:
        dead[p] = i
    return i



class Greedy(GreedySettle):
    """One run of the greedy from the initial placement, at limit ``limit``.

    A document is *whole* until its first move; the index of :class:`PlacedBatch` finds a source's
    whole documents (dead positions skip left or right through path-compressed dicts). A moved
    document is *touched*: ``touched[gid] = [l, home, {server: [a, b]}, {source: server}]``,
    ``home`` its rank's server in-place (-1 in dedicated mode, where every row moves), the last map
    the server each source last gave part of its band to (it holds the band just inside).

    In-place, a whole document starts on its rank's server unless the batch says otherwise: a
    start of :mod:`scheduler.planner`'s fallback carries ``homes`` (each document's rank), and
    its split documents are set up with :meth:`start_bands`.
    """

    def __init__(self, batch: PlacedBatch, limit: float):
        self.b = batch
        self.limit = limit
        self.inplace, self.min_shard, self.window = batch.inplace, batch.min_shard, batch.window
        self.q_bytes, self.kv_bytes = batch.q_bytes, batch.kv_bytes
        self.slen, self.sgid, self.seg = batch.slen, batch.sgid, batch.seg
        q = batch.q_bytes if batch.inplace else 0  # dedicated: Q rows cross the network anyway
        self._cut_factor = 2 * (2 * q + batch.kv_bytes) / max(1, batch.kv_bytes)
        self.loads = list(batch.init_loads)
        self.cap = batch.held_cap
        self.held = None if self.cap is None else list(batch.init_held)
        self.touched: dict[int, list] = {}
        self.dead_left: dict[int, int] = {}
        self.dead_right: dict[int, int] = {}
        self.recent: dict[int, dict[int, None]] = {}  # source -> documents it split and still holds
        # In-place with whole documents away from their rank's server: each document's home.
        self.homes = getattr(batch, "homes", None) if batch.inplace else None

    # ---- the index of whole documents ------------------------------------------------------------
    def _left(self, i: int, lo: int) -> int:
        """Largest whole position in [lo, i], or -1."""
        i = _skip_dead(self.dead_left, i)
        return i if i >= lo else -1

    def _right(self, i: int, hi: int) -> int:
        """Smallest whole position in [i, hi), or hi."""
        i = _skip_dead(self.dead_right, i)
        return i if i < hi else hi

    # ---- what a band holds ------------------------------------------------------------------------
    def _windowed(self, l: int) -> bool:
        """Whether the window bites in a document of ``l`` tokens (else it costs ``l + 1`` pairs
        per folded position, as without a window)."""
        return self.window is not None and l > self.window

    def _pairs(self, l: int, a: int, b: int) -> int:
        """Pairs of band ``[a, b)`` of a document of ``l`` tokens."""
        if self._windowed(l):
            return folded_pairs(l, b, self.window) - folded_pairs(l, a, self.window)
        centre = 1 if (l & 1 and 2 * b == l + 1) else 0
        return (2 * (b - a) - centre) * (l + 1) // 2

    def _inner_k(self, l: int, b: int, w: int, pairs, at_least: bool) -> int:
        """Windowed documents: the most inner positions of a band ``[b - w, b)`` holding at most
        ``pairs`` pairs, or (``at_least``) the fewest holding at least that many (``w + 1`` when
        the band holds fewer). Binary search: the inner positions hold the most pairs each."""
        W = self.window
        top = folded_pairs(l, b, W)
        lo, hi = 0, w + 1  # at_least: answer in [lo, hi]; else the answer + 1 is in (lo, hi]
        while lo < hi:
            mid = (lo + hi) // 2
            held = top - folded_pairs(l, b - mid, W) if mid <= w else math.inf
            if at_least:
                if held >= pairs:
                    hi = mid
                else:
                    lo = mid + 1
            elif held <= pairs:
                lo = mid + 1
            else:
                hi = mid
        return lo if at_least else lo - 1

    # ---- how much of a band to move ---------------------------------------------------------------
    def _choose_k(self, l: int, a: int, b: int, need, room) -> int:
        """Folded positions to move from the inner end of band [a, b), or 0 if nothing fits.

        ``need``: pairs the source is above the limit; ``room``: pairs the destination may take.
        The inner ``k`` positions hold ``(2k - centre) (l + 1) / 2`` pairs, ``centre`` 1 when the
        band holds the centre of an odd document. Both parts of a split band keep ``min_shard``
        positions, so every shard keeps ``min_shard`` tokens.
        """
        w, half = b - a, l + 1
        windowed = self._windowed(l)
        centre = 1 if (l & 1 and 2 * b == half) else 0
        whole = self._pairs(l, a, b)
        if whole <= need and whole <= room:
            return w
        ms = self.min_shard
        if w < 2 * ms:  # too narrow to leave two shards of min_shard tokens
            return w if whole <= room else 0
        if windowed and l >= 2 * self.window - 1:
            # Positions f >= W - 1 hold 2 W pairs each (W at an odd document's centre): the
            # closed forms below with l + 1 -> 2 W are exact while the inner k stay there.
            uniform = 2 * self.window
            fits = (2 * floor(room) // uniform + centre) // 2
            k_need = (-(-2 * ceil(need) // uniform) + centre + 1) // 2
            # exact when every position counted (and, for fits, the next one) lies past W - 1
            if b - min(fits + 1, w) < self.window - 1 or b - min(k_need, w) < self.window - 1:
                fits = k_need = None
        else:
            fits = k_need = None
        if windowed and fits is None:
            fits = self._inner_k(l, b, w, floor(room), False)
        elif not windowed:
            fits = (2 * floor(room) // half + centre) // 2  # most positions that fit
        if fits > w:
            fits = w
        if fits < ms:
            return 0
        # Fewest positions that bring the source within the limit (w + 1: not even all of them):
        # the least k with (2k - centre) >= ceil(2 need / (l + 1)).
        if windowed and k_need is None:
            k_need = self._inner_k(l, b, w, ceil(need), True)
        elif not windowed:
            k_need = (-(-2 * ceil(need) // half) + centre + 1) // 2
        if need <= room and k_need <= fits:  # finish the source with the smallest piece that does it
            k = k_need if k_need > ms else ms
            if w - k < ms:  # the remainder would be a sliver: move all of it, or leave exactly ms
                return w if whole <= room else w - ms
            return k
        # Fill the destination, unless that leaves a remainder no later moves can place (pieces
        # of at most `fits` and at least ms positions): then cut the band's surplus evenly.
        keep = w - k_need if k_need <= w else 0  # widest outer part the source may keep
        if keep < ms:
            keep = 0
        if windowed:  # no position holds more than min(l + 1, 2 W) pairs
            plain = floor(room) // min(half, 2 * self.window)
        else:
            plain = (2 * floor(room) // half) // 2  # positions of a later piece (no centre) that fit
        if plain > w:
            plain = w
        if plain < ms or finishable(w - fits, keep, plain, ms):
            # fill the destination, but never leave a sliver: with a window, `plain` counts the
            # most pairs a position holds, so it can be below ms while fits is above w - ms
            return fits if fits == w or w - fits >= ms else w - ms
        shed = w - keep
        p = -(-shed // plain)
        if p * ms > shed:  # pieces would be narrower than min_shard: the source keeps less
            keep = w - p * ms
            if keep >= ms:
                shed = p * ms
            else:
                shed, p = w, -(-w // plain)
                if p * ms > w:  # no even cut: fill the destination, leave at least ms
                    return fits if w - fits >= ms else w - ms
        k = -(-shed // p)
        return w - ms if 0 < w - k < ms else k

    # ---- candidate moves ------------------------------------------------------------------------
    def _consider(self, best, gid: int, l: int, a: int, b: int, home: int, src: int, dst: int,
                  dst_band, need, room, pos: int):
        """``best`` or the move of the inner part of band [a, b) to ``dst`` (``room`` pairs free),
        whichever has the larger key (FLOPs per byte, FLOPs, then lower server and document)."""
        if room <= 0:
            return best
        k = self._choose_k(l, a, b, need, room)
        if k > 0 and self.held is not None and self.held[dst] + self._held_gain(l, b - k, b, dst_band) > self.cap:
            k = self._held_fit(l, a, b, k, dst_band, self.cap - self.held[dst])
        if k <= 0:
            return best
        centre = 1 if (l & 1 and 2 * b == l + 1) else 0
        lo = b - k
        moved = self._pairs(l, lo, b)
        # Bytes the step gains: the moved Q rows, and only the KV rows dst lacks.
        inplace = self.inplace
        off_dst = 0 if inplace and dst == home else 1
        off_src = 0 if inplace and src == home else 1
        if self._windowed(l):  # KV: each band's head and tail windows (:func:`~scheduler.bands.band_kv_rows`)
            W = self.window
            if dst_band is None:
                dkv = band_kv_rows(l, lo, b, W) * off_dst
            else:  # dst holds the adjacent inner band [b, y): it widens to [lo, y)
                dkv = (band_kv_rows(l, lo, dst_band[1], W) - band_kv_rows(l, dst_band[0], dst_band[1], W)) * off_dst
            dkv -= (band_kv_rows(l, a, b, W) - (band_kv_rows(l, a, lo, W) if lo > a else 0)) * off_src
        else:
            if dst_band is None:
                dkv = (l - lo) * off_dst
            else:
                dkv = (dst_band[0] - lo) * off_dst if lo < dst_band[0] else 0
            if lo == a:  # the source gives the document up and no longer needs its KV rows
                dkv -= (l - a) * off_src
        if self.held is not None and self.held[dst] + self._held_gain(l, lo, b, dst_band) > self.cap:
            return best  # dst would hold more kept activations than the cap
        v = (2 * k - centre) * self.q_bytes * (off_dst - off_src) + dkv * self.kv_bytes
        key = (moved / v if v > 0 else math.inf, moved, -dst, -gid)
        if best is None or key > best[0]:
            return (key, dst, gid, k, l, pos)
        return best

    def _held_fit(self, l: int, a: int, b: int, k: int, dst_band, held_room: int) -> int:
        """The widest inner piece of band [a, b), at most ``k`` positions, whose kept activations
        fit in ``held_room`` bytes at the destination, or 0. Pieces keep ``min_shard`` positions
        and leave the source at least as many. Without this a cap refused any piece of a long
        document (its KV prefix alone may fill a server), and balance stalled far above 1+ε.
        Binary search: the held gain grows with the piece's width."""
        ms = self.min_shard
        hi = min(k, b - a - ms)
        if hi < ms or self._held_gain(l, b - ms, b, dst_band) > held_room:
            return 0
        lo = ms  # fits; answer in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._held_gain(l, b - mid, b, dst_band) <= held_room:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _held_gain(self, l: int, lo: int, hi: int, dst_band) -> int:
        """Kept-activation bytes a server holding ``dst_band`` (None, or the band just inside)
        gains with band [lo, hi): its Q rows, and the KV rows it lacks (a band [x, y) needs the
        prefix up to l - x)."""
        centre = 1 if (l & 1 and 2 * hi == l + 1) else 0
        if self._windowed(l):  # the KV span the band's windows need (:func:`~scheduler.bands.band_kv_rows`)
            W = self.window
            if dst_band is None:
                kv = band_kv_rows(l, lo, hi, W)
            else:
                kv = band_kv_rows(l, lo, dst_band[1], W) - band_kv_rows(l, dst_band[0], dst_band[1], W)
        else:
            kv = l - lo if dst_band is None else max(0, dst_band[0] - lo)
        return (2 * (hi - lo) - centre) * self.b.hq + kv * self.b.hkv

    def _kv_lost(self, l: int, a: int, lo: int, hi: int) -> int:
        """KV rows a server holding band [a, hi) no longer needs once it gives up [lo, hi)."""
        if self._windowed(l):
            return band_kv_rows(l, a, hi, self.window) - (band_kv_rows(l, a, lo, self.window) if lo > a else 0)
        return l - a if lo == a else 0

    def _consider_touched(self, best, gid: int, src: int, top: int, need):
        """A band ``src`` already split: to ``top``, or to the server holding the adjacent band."""
        l, home, held, inner = self.touched[gid]
        a, b = held[src]
        adjacent = inner.get(src)  # the last server src gave part of this band to
        if adjacent is not None and (adjacent not in held or held[adjacent][0] != b):
            adjacent = None
        top_band = held.get(top)
        if top_band is None or top == adjacent:
            best = self._consider(best, gid, l, a, b, home, src, top, top_band, need,
                                  self.limit - self.loads[top], -1)
        if adjacent is not None and adjacent != top:
            best = self._consider(best, gid, l, a, b, home, src, adjacent, held[adjacent], need,
                                  self.limit - self.loads[adjacent], -1)
        return best

    def _longest_within(self, pairs) -> int:
        """The longest document whose whole pairs are at most ``pairs``: ``l (l + 1) / 2 <= x``
        iff ``l <= (isqrt(8 x + 1) - 1) / 2``; past a window ``W`` each token adds ``W``."""
        x, W = floor(pairs), self.window
        if W is None or x < W * (W + 1) // 2:
            return (isqrt(8 * x + 1) - 1) // 2
        return W + (x - W * (W + 1) // 2) // W

    def _best_move(self, src: int, top: int):
        """The move from ``src`` with the most FLOPs per byte, ``(key, dst, gid, k, l, pos)``, or
        None. Looks at a bounded set of candidates (:mod:`scheduler.planner`, (g))."""
        need = self.loads[src] - self.limit
        room = self.limit - self.loads[top]
        if room <= 0:
            return None  # top has the most room of all
        slen, seg, left, right = self.slen, self.seg, self._left, self._right
        u0, p0, p1 = seg[2 * src], seg[2 * src + 1], seg[2 * src + 2]
        found = set()
        # Whole documents: the longest that fits whole (FLOPs per byte grow with the length of
        # a whole move; l (l + 1) / 2 <= x  <=>  l <= (isqrt(8 x + 1) - 1) / 2) ...
        if u0 < p0:
            i = left(bisect_right(slen, self._longest_within(room), u0, p0) - 1, u0)
            if i >= 0:
                found.add(i)
        if p1 - p0 <= _SCAN:  # few splittable whole documents: look at each
            j = right(p0, p1)
            while j < p1:
                found.add(j)
                j = right(j + 1, p1)
        else:
            x = need if need < room else room
            i = left(bisect_right(slen, self._longest_within(x), p0, p1) - 1, p0)
            if i >= 0:
                found.add(i)
            # ... the longest, and those nearest the length whose cut moves most FLOPs per byte:
            # cutting x pairs off length l adds ~x (2 q + kv) / (l + 1) + kv l / 2 bytes (q only
            # where the source's Q rows are free), least at (l + 1)^2 = 2 x (2 q + kv) / kv.
            i = left(p1 - 1, p0)
            if i >= 0:
                found.add(i)
            # ms-cut fits (a windowed position holds at most 2 W pairs, however long the document)
            cut = floor(room / self.min_shard) - 1
            hi = p1 if self.window is not None and cut >= 2 * self.window else bisect_right(slen, cut, p0, p1)
            mid = bisect_left(slen, isqrt(floor(x * self._cut_factor)) - 1, p0, hi)
            j = mid - 1
            for _ in range(_NEIGHBOURS):
                j = left(j, p0)
                if j < 0:
                    break
                found.add(j)
                j -= 1
            j = mid
            for _ in range(_NEIGHBOURS):
                j = right(j, hi)
                if j >= hi:
                    break
                found.add(j)
                j += 1
        best = None
        home = src if self.inplace else -1
        sgid, homes = self.sgid, self.homes
        for pos in found:
            l, gid = slen[pos], sgid[pos]
            best = self._consider(best, gid, l, 0, (l + 1) // 2, home if homes is None else homes[gid],
                                  src, top, None, need, room, pos)
        # Bands this source split before: the newest few; all of them if nothing else moves.
        recent = self.recent.get(src)
        if recent:
            for _, gid in zip(range(_RECENT_BANDS), reversed(recent)):
                best = self._consider_touched(best, gid, src, top, need)
            if best is None and len(recent) > _RECENT_BANDS:
                for gid in islice(reversed(recent), _RECENT_BANDS, None):
                    best = self._consider_touched(best, gid, src, top, need)
        return best

    # ---- moves ----------------------------------------------------------------------------------
    def _apply(self, src: int, dst: int, gid: int, k: int, l: int, pos: int) -> None:
        record = self.touched.get(gid)
        if record is None:  # first move of a whole document
            home = -1 if not self.inplace else src if self.homes is None else self.homes[gid]
            record = self.touched[gid] = [l, home, {src: [0, (l + 1) // 2]}, {}]
            self.dead_left[pos] = pos - 1
            self.dead_right[pos] = pos + 1
        held = record[2]
        band = held[src]
        a, hi = band
        lo = hi - k
        centre = 1 if (l & 1 and 2 * hi == l + 1) else 0
        moved = self._pairs(l, lo, hi)
        if self.held is not None:
            self.held[dst] += self._held_gain(l, lo, hi, held.get(dst))
            self.held[src] -= (2 * k - centre) * self.b.hq + self._kv_lost(l, a, lo, hi) * self.b.hkv
        self.loads[src] -= moved
        self.loads[dst] += moved
        recent = self.recent.setdefault(src, {})
        recent.pop(gid, None)
        if lo == a:
            del held[src]
        else:
            band[1] = lo
            recent[gid] = None  # newest last
            record[3][src] = dst  # holds the band just inside src's
        there = held.get(dst)
        if there is None:
            held[dst] = [lo, hi]
        elif there[0] == hi:  # adjacent inner band: widen it outwards
            there[0] = lo
        else:
            raise AssertionError("non-adjacent bands of one document on one server")

    def start_bands(self, bands: dict[int, list[tuple[int, int, int]]], positions: dict[int, int]) -> None:
        """Split whole documents into the given bands before :meth:`run`: ``bands[gid]`` lists
        ``(server, a, b)`` from the outside in, the first on the document's initial server and
        every server distinct; ``positions[gid]`` is its place in the index. Applied as moves of
        the inner bands, innermost first, so the state is what those moves would have made."""
        slen = self.slen
        for gid, parts in bands.items():
            pos = positions[gid]
            src = parts[0][0]
            for server, a, b in reversed(parts[1:]):
                self._apply(src, server, gid, b - a, slen[pos], pos)

    def run(self) -> None:
        """Surplus-to-deficit moves at ``self.limit`` (steps 2 and 3 of :mod:`scheduler.planner`)."""
        limit, loads = self.limit, self.loads
        sources = sorted((s for s in range(self.b.S) if loads[s] > limit), key=lambda s: (-loads[s], s))
        source_set = set(sources)
        heap = [(-(limit - loads[s]), s) for s in range(self.b.S) if s not in source_set]
        heapq.heapify(heap)
        # Under a cap, the servers with the least FLOPs are often the fullest in memory (many short
        # documents): the servers with the most held room are tried when the roomiest refuses.
        held_heap = None
        if self.held is not None:
            held_heap = [(self.held[s] - self.cap, s) for s in range(self.b.S) if s not in source_set]
            heapq.heapify(held_heap)
        for src in sources:
            while loads[src] > limit and heap:
                neg_room, top = heap[0]
                if -neg_room != limit - loads[top]:  # stale entry
                    heapq.heapreplace(heap, (-(limit - loads[top]), top))
                    continue
                best = self._best_move(src, top)
                if best is None and held_heap is not None:
                    best = self._held_room_move(src, top, held_heap, limit)
                if best is None:
                    break  # not even the roomiest servers take a piece of this source
                _, dst, gid, k, l, pos = best
                self._apply(src, dst, gid, k, l, pos)
                heapq.heapreplace(heap, (-(limit - loads[top]), top))
                if dst != top:
                    heapq.heappush(heap, (-(limit - loads[dst]), dst))
                if held_heap is not None:
                    heapq.heappush(held_heap, (self.held[dst] - self.cap, dst))

    def _held_room_move(self, src: int, top: int, held_heap: list, limit):
        """Under a cap, when the server with the most FLOP room refuses ``src``'s pieces: the best
        move to one of the :data:`_CAP_TRIES` servers with the most held-bytes room (and FLOP room),
        or None. Entries that are stale or at the FLOP limit are dropped (destinations never lose
        load within a run, and every move pushes its destination's new entry)."""
        tried, best = [], None
        while held_heap and len(tried) < _CAP_TRIES:
            key, s = heapq.heappop(held_heap)
            if key != self.held[s] - self.cap or self.loads[s] >= limit:
                continue
            tried.append((key, s))
            if s != top:
                best = self._best_move(src, s)
                if best is not None:
                    break
        for entry in tried:
            heapq.heappush(held_heap, entry)
        return best
