"""The communication-aware greedy planner (DistCA §4.2 and Appendix B), improved.

Vocabulary. A document of ``l`` tokens is *folded*: folded position ``f`` in ``[0, c)``,
``c = ceil(l / 2)``, stands for the head token ``f`` and its mirror ``l - 1 - f`` (one token at the
centre when ``l`` is odd). A *band* ``[a, b)`` of folded positions is a head–tail pair of shards,
head ``[a, b)`` and tail ``[l - b, l - a)`` (one merged shard ``[a, l - a)`` when ``b == c``). Its
causal work is exactly ``(l + 1) / 2`` (query, key) pairs per token (DistCA §4.2's head–tail trick),
so a band of any width is an exact, proportional slice of the document's FLOPs.

Algorithm (loads in causal pairs; FLOPs are a constant multiple):

1. Initial placement. ``inplace``: every document on its rank's own server. ``dedicated``:
   longest-processing-time first, each document to the least-loaded server.
2. Target ``F̄ = total / num_servers`` and limit ``U = (1 + ε) F̄``. *Surplus* servers are those
   above ``U``; every other server is a *deficit* server with room ``U - F``.
3. For each surplus server, most loaded first, until it is within ``U``: look at its items (bands),
   and for each the deficit server with the most room plus the deficit servers that already hold
   that document's KV rows. ``ΔF = min(F_item, surplus, room)`` rounded to whole folded tokens (a
   shard never shrinks below ``min_shard`` tokens); ``V`` = the bytes this move adds to the step
   (Q-type rows of the moved band, and only those KV rows the destination does not hold yet; a
   rank's own server holds all its rows). Take the move with the largest ``ΔF / V`` and apply it,
   always moving the *inner* part of a band, whose KV prefix is the shortest.

Improvements over the published version:
(a) The stop rule bounds the maximum: each surplus server is brought to at most ``U`` and a
    deficit server never receives past ``U``. Total room is at least ``ε · total``, so the largest
    room is at least ``ε F̄``; hence whenever every indivisible piece (a document too short to split,
    or a ``min_shard``-token band ``min_shard · (l + 1)`` pairs) is at most ``ε F̄``, the result
    has max load ≤ (1 + ε) F̄.
(b) KV bytes count only rows the destination lacks (one copy per document and server).
(c) Any lengths; documents whose halves are shorter than ``2 · min_shard`` are never split.
(d) Deterministic: every choice breaks ties by server and document index.
(e) Heaps and per-server item lists: about ``O((N + S) log S + moves · items)``.
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence

from .checks import positive_int
from .cost import CostModel
from .tasks import CATask, Plan, check_batch


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


class _Doc:
    __slots__ = ("gid", "rank", "index", "length", "fold", "bands")

    def __init__(self, gid: int, rank: int, index: int, length: int):
        self.gid, self.rank, self.index, self.length = gid, rank, index, length
        self.fold = (length + 1) // 2
        self.bands: dict[int, list[int]] = {}  # server -> [a, b] of the band it holds


def _validate(doc_lens_per_rank, num_servers, cost, epsilon, mode, min_shard) -> None:
    """The checks of :func:`plan_batch` (and the baselines): the plan's own plus ``min_shard``."""
    positive_int("min_shard", min_shard)
    check_batch(doc_lens_per_rank, num_servers, mode, cost, epsilon)


class _Planner:
    def __init__(self, doc_lens_per_rank, num_servers, cost, epsilon, mode, min_shard):
        self.S = num_servers
        self.mode = mode
        self.min_shard = min_shard
        self.q_bytes, self.kv_bytes = cost.step_row_bytes()
        flat = [(r, i, int(l)) for r, lens in enumerate(doc_lens_per_rank) for i, l in enumerate(lens)]
        self.docs = [_Doc(g, r, i, l) for g, (r, i, l) in enumerate(flat)]
        self.loads = [0] * num_servers
        self.items: list[dict[int, None]] = [dict() for _ in range(num_servers)]  # ordered sets of gids
        self._place()
        total = sum(self.loads)
        self.mean = total / num_servers
        self.limit = (1.0 + epsilon) * self.mean

    # ---- placement --------------------------------------------------------------------------
    def _put(self, doc: _Doc, server: int, a: int, b: int) -> None:
        doc.bands[server] = [a, b]
        self.items[server][doc.gid] = None
        self.loads[server] += _band_pairs(doc.length, a, b)

    def _place(self) -> None:
        if self.mode == "inplace":
            for d in self.docs:
                d.bands[d.rank] = [0, d.fold]
                self.items[d.rank][d.gid] = None
                self.loads[d.rank] += d.length * (d.length + 1) // 2
            return
        heap = [(0, s) for s in range(self.S)]
        for d in sorted(self.docs, key=lambda d: (-d.length, d.gid)):
            load, s = heapq.heappop(heap)
            self._put(d, s, 0, d.fold)
            heapq.heappush(heap, (self.loads[s], s))

    # ---- costs ------------------------------------------------------------------------------
    def _off(self, doc: _Doc, server: int) -> int:
        """1 if rows of ``doc`` must cross the network to reach ``server``."""
        return 0 if self.mode == "inplace" and server == doc.rank else 1

    def _kv_end(self, doc: _Doc, server: int) -> int:
        band = doc.bands.get(server)
        return doc.length - band[0] if band else 0

    def _move_bytes(self, doc: _Doc, src: int, dst: int, a: int, b: int, k: int) -> int:
        """Bytes one step gains when the inner ``k`` folded tokens of band [a, b) go src -> dst."""
        l = doc.length
        lo = b - k
        dq = _band_tokens(l, lo, b) * self.q_bytes * (self._off(doc, dst) - self._off(doc, src))
        new_end = max(self._kv_end(doc, dst), l - lo)
        dkv = (new_end - self._kv_end(doc, dst)) * self._off(doc, dst)
        if lo == a:  # the source gives the document up and no longer needs its KV rows
            dkv -= (l - a) * self._off(doc, src)
        return dq + dkv * self.kv_bytes

    def _choose_k(self, doc: _Doc, a: int, b: int, need: float, room: float) -> int:
        """Folded tokens to move from the inner end of band [a, b), or 0 if nothing fits.

        Moves the smallest amount that brings the source within the limit (``need``) when the
        destination has the room, else the most that fits; shards keep ``min_shard`` tokens.
        """
        l, w = doc.length, b - a
        whole = _band_pairs(l, a, b)
        if whole <= need and whole <= room:
            return w
        ms = self.min_shard
        if w < 2 * ms:  # too narrow to leave two shards of min_shard tokens
            return w if whole <= room else 0

        def pairs(k):
            return _band_pairs(l, b - k, b)
        per = l + 1
        if need <= room:  # finish the source: smallest k with pairs(k) >= need
            k = max(1, math.ceil(need / per))
            while k > 1 and pairs(k - 1) >= need:
                k -= 1
            while k < w and pairs(k) < need:
                k += 1
            if pairs(k) > room:
                k -= 1
        else:  # fill the destination: largest k with pairs(k) <= room
            k = min(w, int(room // per) + 1)
            while k > 0 and pairs(k) > room:
                k -= 1
        # Both branches leave pairs(k) <= room, so k == w only when the whole band fits.
        if k >= w:
            return w
        if k < ms:
            return ms if pairs(ms) <= room else 0
        if w - k < ms:  # the remainder would be a sliver: move all of it, or leave exactly ms
            return w if whole <= room else w - ms
        return k

    # ---- the greedy loop -----------------------------------------------------------------------
    def balance(self) -> int:
        """Run the surplus-to-deficit moves; returns how many moves were made."""
        limit, loads = self.limit, self.loads
        sources = sorted((s for s in range(self.S) if loads[s] > limit), key=lambda s: (-loads[s], s))
        source_set = set(sources)
        heap = [(-(limit - loads[s]), s) for s in range(self.S) if s not in source_set]
        heapq.heapify(heap)
        moves = 0
        for src in sources:
            while loads[src] > limit and heap:
                neg_room, top = heap[0]
                if -neg_room != limit - loads[top]:  # stale entry
                    heapq.heappop(heap)
                    heapq.heappush(heap, (-(limit - loads[top]), top))
                    continue
                best = self._best_move(src, top)
                if best is None:
                    break  # not even the roomiest server takes a piece of this source
                dst, gid, k = best
                self._apply(src, dst, self.docs[gid], k)
                heapq.heappush(heap, (-(limit - loads[dst]), dst))
                moves += 1
        return moves

    def _best_move(self, src: int, top: int):
        """The move from ``src`` with the most FLOPs per byte: ``(dst, gid, k)`` or None."""
        need = self.loads[src] - self.limit
        best_key, best = None, None
        for gid in self.items[src]:
            doc = self.docs[gid]
            a, b = doc.bands[src]
            dests = [top]
            dests.extend(s for s in doc.bands if s != src and s != top)
            if self.mode == "inplace" and doc.rank != src and doc.rank not in dests:
                dests.append(doc.rank)
            for dst in dests:
                room = self.limit - self.loads[dst]
                if room <= 0:
                    continue
                k = self._choose_k(doc, a, b, need, room)
                if k <= 0:
                    continue
                moved = _band_pairs(doc.length, b - k, b)
                v = self._move_bytes(doc, src, dst, a, b, k)
                key = (moved / v if v > 0 else math.inf, moved, -dst, -gid)
                if best_key is None or key > best_key:
                    best_key, best = key, (dst, gid, k)
        return best

    def _apply(self, src: int, dst: int, doc: _Doc, k: int) -> None:
        l = doc.length
        a, b = doc.bands[src]
        lo = b - k
        moved = _band_pairs(l, lo, b)
        self.loads[src] -= moved
        self.loads[dst] += moved
        if lo == a:
            del doc.bands[src]
            del self.items[src][doc.gid]
        else:
            doc.bands[src][1] = lo
        held = doc.bands.get(dst)
        if held is None:
            doc.bands[dst] = [lo, b]
            self.items[dst][doc.gid] = None
        elif held[0] == b:  # adjacent inner band: widen it outwards
            held[0] = lo
        elif held[1] == lo:
            held[1] = b
        else:
            raise AssertionError("non-adjacent bands of one document on one server")

    # ---- output -------------------------------------------------------------------------------
    def server_tasks(self) -> list[list[CATask]]:
        """Each server's tasks; visiting documents in (rank, index) order keeps every list sorted."""
        out: list[list[CATask]] = [[] for _ in range(self.S)]
        for doc in self.docs:
            bands = doc.bands
            if len(bands) == 1:
                (server, (a, b)), = bands.items()
                if a == 0 and b == doc.fold:  # unsplit document: one task
                    out[server].append(CATask(doc.rank, doc.index, 0, doc.length, 0, doc.length))
                    continue
            for server, (a, b) in bands.items():
                for qs, qe in _band_shards(doc.length, a, b):
                    out[server].append(CATask(doc.rank, doc.index, qs, qe, 0, qe))
        return out


def plan_batch(doc_lens_per_rank: Sequence[Sequence[int]], num_servers: int, *, cost: CostModel,
               epsilon: float = 0.05, mode: str = "inplace", min_shard: int = 128) -> Plan:
    """Plan one step: split the batch's documents into CA-tasks balanced over the servers.

    Args:
        doc_lens_per_rank: ``doc_lens_per_rank[r]`` lists the document lengths (tokens, ints > 0)
            packed on client rank ``r``; a rank may have none.
        num_servers: attention servers; in ``inplace`` mode it must equal the number of ranks.
        cost: attention shape and element size (FLOPs per pair, bytes per row).
        epsilon: imbalance tolerance ε: the planner stops once every server is within
            ``(1 + ε)·mean`` attention FLOPs (guaranteed when pieces are fine enough, see module doc).
        mode: ``"inplace"`` (server ``i`` is rank ``i``; a rank's rows are free for its own server)
            or ``"dedicated"`` (servers are separate processes; every row moves).
        min_shard: no shard of a split document is shorter than this many tokens (a FlashAttention
            tile is 128 rows, DistCA §3); documents with ``ceil(l / 2) < 2 · min_shard`` stay whole.

    Returns:
        A validated :class:`Plan`.

    Raises:
        ValueError: bad lengths, sizes, mode or ε (the message names the values).
    """
    _validate(doc_lens_per_rank, num_servers, cost, epsilon, mode, min_shard)
    planner = _Planner(doc_lens_per_rank, num_servers, cost, epsilon, mode, min_shard)
    planner.balance()
    return Plan(doc_lens_per_rank=[[int(x) for x in lens] for lens in doc_lens_per_rank],
                num_servers=num_servers, mode=mode, cost=cost, server_tasks=planner.server_tasks(),
                epsilon=float(epsilon))
