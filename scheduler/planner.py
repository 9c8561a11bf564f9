"""The communication-aware greedy planner (DistCA §4.2 and Appendix B), improved: :func:`plan_batch`.

Code: :mod:`scheduler.bands` (band arithmetic), :mod:`scheduler.placement` (steps 1-2),
:mod:`scheduler.greedy` (step 3; the last pass in :mod:`scheduler.greedy_settle`), this module (the
runs, the guarantees); with a time model, :mod:`scheduler.time_refine` refines the FLOP plan at
ε = 0 in predicted seconds (:mod:`scheduler.time_cost`; its guarantee: never above that FLOP plan's
predicted maximum).

Vocabulary. A document of ``l`` tokens is *folded*: folded position ``f`` in ``[0, c)``,
``c = ceil(l / 2)``, stands for the head token ``f`` and its mirror ``l - 1 - f`` (one token at the
centre when ``l`` is odd). A *band* ``[a, b)`` of folded positions is a head–tail pair of shards,
head ``[a, b)`` and tail ``[l - b, l - a)`` (one merged shard ``[a, l - a)`` when ``b == c``). Its
causal work is exactly ``l + 1`` (query, key) pairs per folded position (half of it for the centre
of an odd document; DistCA §4.2's head–tail trick), so a band of any width is an exact,
proportional slice of the document's FLOPs.

Windows (``window = W``): query ``t`` sees ``min(t + 1, W)`` keys, so a folded position holds
``min(f + 1, W) + min(l - f, W)`` pairs (non-decreasing towards the centre, ``2 W`` from ``f = W - 1``
on) instead of ``l + 1``; a band's pairs are differences of the cumulative count
(:func:`~scheduler.bands.folded_pairs`), cuts use the closed forms with ``l + 1 -> 2 W`` where the
inner positions are uniform and a binary search near the document's start, and a shard's KV is
its window (:func:`~scheduler.bands.band_kv_rows`), not its prefix.
Documents with ``l <= W`` are planned exactly as without a window.

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
and keeps the better result; if a server is *still* above ``T``, a last pass gives, from each such
server, its smallest piece (a whole unsplittable document, or ``min_shard`` positions off a band,
or a band narrower than ``2 · min_shard``) to the least-loaded server for as long as that lowers
the source (when that server already holds a band of the document further in, the bands between
shift out by the piece's width, each keeping its width and load, so every server still holds one
band per document). If a server is *still* above ``T`` and above ``1.01 · M`` (a material miss:
with ε = 0 the runs above end within 0.4% of ``M`` on the traces of ``bench/planner.py``, not worth
re-placing the batch for) and no held-bytes cap is set, the *fallback* runs step 3 at ``U = T``
and the last pass again from other starts, each placed longest-processing-time first (LPT; Graham,
"Bounds on multiprocessing timing anomalies", 1969), and keeps the first result within ``T``, else
the one whose most loaded server holds least (the plan before it wins ties): *fill*, the
unsplittable documents LPT, then each splittable one, longest first, cut from the outside in so
the least-loaded servers fill up to ``T`` (McNaughton's wrap-around rule, 1959, with bands of
``min_shard`` positions or more); *fill-lpt*, the same with every document in LPT order;
*pieces*, each splittable document cut evenly into bands of at most ``T / 2`` pairs where it can
be (at most its ``K`` of :mod:`scheduler.bound`), the pieces LPT; and in-place *whole*, plain LPT
over whole documents (dedicated mode's initial placement is that already). The fallback moves
more bytes than the communication-aware runs (it re-places every document); it runs only where
they missed. Guarantees, with ``Q`` the largest piece a server may be unable to cut further
(``l (l + 1) / 2`` for a document with ``c < 2 · min_shard``, else ``(2 · min_shard - 1) · (l + 1)``,
maximised over documents):

(a) Always ``max load ≤ max(T, mean + Q)``: a server the last pass leaves above ``T`` could not
    give its smallest piece ``p ≤ Q`` to the least-loaded server (load ``≤ mean``), and each
    receiver of that pass got one piece ``≤ Q`` while it was the least loaded.
(b) Hence ``max load ≤ T = (1 + ε) · max(mean, B)`` whenever ``Q ≤ ε · M``; and in practice
    beyond: on every batch of one document tried (the even cut reaches the piece bound: 1.047 for
    one 65,536-token document over 256 servers at ε = 0.05 and ``min_shard`` 128), and on most
    adversarial batches, measured by ``bench/planner_guarantee.py`` (seeded: 1-16 ranks, in-place
    or dedicated over 1-24 servers, lengths log-uniform up to 256-65,536 tokens, one in five a
    1-token document, a giant document in 30% of batches and a run of one medium length in 20%,
    ε from 0.005 to 0.5, ``min_shard`` 1-512, full causal): the target is missed on 27 of 2,000
    batches at seed 0 (1.35%; 28 and 29 of 2,000 at seeds 1 and 2), by at most 1.183 × ``T``;
    without the fallback 87 of 2,000 (4.35%; 97 and 95), by up to 1.413 × ``T``. Plain LPT
    misses 1,549 of those 2,000. Under a 1,024-token window: 66 of 2,000 (without: 106). Some
    misses left are batches whose best plan is above ``T``
    (``B`` counts one piece per document: e.g. five servers, two unsplittable documents of 0.66
    ``M`` and two documents each cut into pieces of more than 0.58 ``M`` need six servers
    below 1.05 ``M``).
(c) Exactly ``T`` on every input is out of reach for any fast planner: with ε = 0 it would solve
    the partition problem (two servers, unsplittable documents).
Also: (d) KV bytes count only rows the destination lacks (one copy per document and server);
(e) any lengths; documents with ``c < 2 · min_shard`` are never split; (f) deterministic: every
choice breaks ties by server and document index; (g) near-linear time whatever the batch:
``O((N + S) log (N + S))`` set-up for ``N`` documents and ``S`` servers, then per move a bounded
set of candidates of the source (its whole documents indexed by length: the longest that fits
whole, the longest, and those nearest the length with the best ``ΔF / V``, or all of them when
there are few; and its newest split bands; older split bands only when none of these moves), and
in the last pass the source's split bands; the fallback, only where the target was missed, repeats
the set-up and a run for each of at most four starts (each ``O(P log S)`` for its ``P ≤ N + 2 S``
pieces).
(h) Never worse than plain LPT where it misses: without a held-bytes cap, a plan above ``T`` and
    ``1.01 · M`` has its most loaded server at or below that of LPT over whole documents (each
    run only lowers the maximum of its start, and dedicated mode's start and the fallback's
    *whole* are LPT); on the 2,000 batches of (b) no miss at all is above LPT. Within ``T`` it
    keeps the plan that moves fewer bytes, though LPT's maximum may be lower.
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence

import numpy as np

from .bound import _pieces as most_pieces, load_bound
from .checks import check_batch, positive_int
from .bands import folded_pairs
from .config import PlanConfig
from .cost import CostModel, window_arg
from .greedy import Greedy
from .partial import split_past_blocks
from .placement import PlacedBatch, held_cap_bound
from .tasks import Plan
from .time_cost import TimeModel
from .time_refine import _MARGIN as _TIME_MARGIN, refine_time


def validate_plan_args(doc_lens_per_rank, num_servers, cost, epsilon, mode, min_shard) -> tuple[np.ndarray, np.ndarray]:
    """The checks of :func:`plan_batch` (and the baselines): the plan's own plus ``min_shard``.
    Returns ``(doc_counts, doc_lens)`` (see :func:`~scheduler.checks.check_batch`)."""
    positive_int("min_shard", min_shard)
    return check_batch(doc_lens_per_rank, num_servers, mode, cost, epsilon)


# The fallback runs only above (1 + this) times the lower-bound level M (module doc, *Balance*).
_MATERIAL = 0.01


class _LptStart(PlacedBatch):
    """A start of the fallback (module doc, *Balance*), in causal pairs; :attr:`bands` lists each
    split document's ``(server, a, b)`` from the outside in for :meth:`Greedy.start_bands`, and
    in-place accounting is kept (:attr:`homes`: each document's rank).

    - ``"whole"``: plain LPT, every document whole, longest first to the least-loaded server
      (:meth:`PlacedBatch._place_lpt`).
    - ``"pieces"``: a document of ``p`` pairs that may be split is cut evenly (widths differ by at
      most one position) into ``min(K, ceil(p / grain))`` bands (``grain``: ``T / 2``; at most
      ``2 S`` cuts in all, so the start stays near-linear), ``K`` the most it may be cut
      into (:mod:`scheduler.bound`, fact 2); the pieces, largest first (weighed ``p · w / c``),
      each go to the least-loaded server holding no piece of that document; in-place, the
      document's rank takes its outermost band when it holds one (its KV is local there).
    - ``"fill"``: the unsplittable documents as in LPT, then each splittable one, longest first,
      cut from the outside in so that the least-loaded server holding none of it fills up to
      ``grain`` pairs (``T``; McNaughton's wrap-around, with bands of at least ``min_shard``
      positions: at most one cut per server filled); a remainder no server has room for goes
      whole to the least-loaded one (``"fill-lpt"``: every document in LPT order instead).
    """

    def __init__(self, batch: PlacedBatch, cost: CostModel, mode: str, keep_activations: bool,
                 how: str, grain: float = 0.0):
        self.how, self.grain, self.own = how, grain, mode == "inplace"
        self.bands: dict[int, list[tuple[int, int, int]]] = {}
        super().__init__(batch.counts, batch.lens_arr, batch.S, cost, "dedicated", batch.min_shard,
                         batch.window, keep_activations)
        self.inplace = self.own
        self.homes = self.rank_arr.tolist() if self.own else None

    def _place_lpt(self, pairs: list[int], doc_held: list[int]) -> None:
        if self.how == "whole":
            return super()._place_lpt(pairs, doc_held)
        self.loads = [0] * self.S
        self.heap = [(0, s) for s in range(self.S)]
        self.server = [0] * self.N
        if self.how == "pieces":
            self._cut_evenly(pairs)
        else:
            self._fill(pairs, self.how == "fill")
        whole = [0] * self.S  # every document whole on its first band's server; the moves split it
        for g, s in enumerate(self.server):
            whole[s] += pairs[g]
        self.init_loads = whole
        self.init_server_arr = np.asarray(self.server, dtype=np.int64).reshape(-1)

    def _take(self, weight, used=()) -> int:
        """Add ``weight`` to the least-loaded server not in ``used`` (ties: lower); return it."""
        heap, loads = self.heap, self.loads
        load, s = heap[0]
        if load == loads[s] and s not in used:  # the usual case: the top entry is current and free
            loads[s] = load + weight
            heapq.heapreplace(heap, (loads[s], s))
            return s
        skipped = []
        while heap[0][0] != loads[heap[0][1]] or heap[0][1] in used:
            entry = heapq.heappop(heap)
            if entry[0] == loads[entry[1]]:  # else stale
                skipped.append(entry)
        s = heap[0][1]
        for entry in skipped:
            heapq.heappush(heap, entry)
        loads[s] += weight
        heapq.heappush(heap, (loads[s], s))
        return s

    def _cut_evenly(self, pairs: list[int]) -> None:
        lens = self.lens_arr.tolist()
        most = most_pieces(self.lens_arr, self.S, self.min_shard).tolist()
        items = []  # (-weight, gid, k)
        for g, (l, p, K) in enumerate(zip(lens, pairs, most)):
            c = (l + 1) // 2
            k = K if K == 1 or p >= K * self.grain else max(1, math.ceil(p / self.grain))
            base, extra = divmod(c, k)
            items.extend((-p * (base + (j < extra)) / c, g, k) for j in range(k))
        items.sort()
        taken: dict[int, list[int]] = {}
        for neg, g, k in items:
            if k == 1:
                self.server[g] = self._take(-neg)
            else:
                used = taken.setdefault(g, [])
                used.append(self._take(-neg, set(used)))
        for g, used in taken.items():
            if self.own and int(self.rank_arr[g]) in used:  # the rank takes the outermost band
                i = used.index(int(self.rank_arr[g]))
                used[0], used[i] = used[i], used[0]
            c = (lens[g] + 1) // 2
            base, extra = divmod(c, len(used))
            cuts = [0]
            for j in range(len(used)):
                cuts.append(cuts[-1] + base + (j < extra))
            self._split(g, [(s, cuts[j], cuts[j + 1]) for j, s in enumerate(used)])

    def _split(self, g: int, bands: list[tuple[int, int, int]]) -> None:
        self.server[g] = bands[0][0]
        if len(bands) > 1:
            self.bands[g] = bands

    def _fill(self, pairs: list[int], split_last: bool) -> None:
        ms, W, cap = self.min_shard, self.window, self.grain
        lens = self.lens_arr.tolist()
        split = (self.lens_arr + 1) // 2 >= 2 * ms
        keys = (np.arange(self.N), -self.lens_arr) + ((split,) if split_last else ())
        order = np.lexsort(keys).tolist()
        split = split.tolist()
        for g in order:
            l, p = lens[g], pairs[g]
            if not split[g]:
                self.server[g] = self._take(p)
                continue
            c, windowed = (l + 1) // 2, W is not None and l > W
            unit = 2 * W if windowed else l + 1  # the most pairs a position holds
            a, used, bands = 0, set(), []
            while a < c:
                rest = p - (folded_pairs(l, a, W) if windowed else a * (l + 1))
                s = self._take(0, used)
                room = cap - self.loads[s]
                k = min(int(room // unit), c - a - ms) if room > 0 else 0
                if rest <= room or len(used) == self.S - 1:
                    k = c - a
                elif k < ms:  # no room for a piece anywhere: the rest to the least loaded
                    k = c - a
                w = (folded_pairs(l, a + k, W) - folded_pairs(l, a, W) if windowed
                     else rest if a + k == c else k * (l + 1))
                self.loads[s] += w
                heapq.heappush(self.heap, (self.loads[s], s))
                used.add(s)
                bands.append((s, a, a + k))
                a += k
            self._split(g, bands)


def _fallback(batch: PlacedBatch, best: Greedy, target: float, cost: CostModel, mode: str,
              keep_activations: bool, grain: float) -> Greedy:
    """The fallback (module doc, *Balance*; loads in causal pairs): ``best``, or a run from an
    LPT start whose most loaded server holds less, trying the starts in order and stopping at the
    first within ``target``. In-place the last start is plain LPT over whole documents, so a result
    above ``target`` is never above LPT's (dedicated mode's first run started from it)."""
    starts = [("fill", target), ("fill-lpt", target), ("pieces", grain)]
    if batch.inplace:
        starts.append(("whole", 0.0))
    for how, g in starts:
        start = _LptStart(batch, cost, mode, keep_activations, how, g)
        run = Greedy(start, target)
        if start.bands:
            where = np.empty(start.N, dtype=np.int64)
            where[np.asarray(start.sgid, dtype=np.int64)] = np.arange(start.N)
            run.start_bands(start.bands, {gid: int(where[gid]) for gid in start.bands})
        run.run()
        if run.max_load() > target:
            run.settle(target)
        if run.max_load() < best.max_load():
            best = run
        if best.max_load() <= target:
            break
    return best


def _flop_tasks(batch: PlacedBatch, bound, epsilon: float, cost: CostModel, mode: str, keep_activations: bool,
                cap) -> np.ndarray:
    """The FLOP plan's task array at ``epsilon`` (module doc, *Balance*: the runs, the last pass and
    the fallback; loads in causal pairs)."""
    target = (1.0 + epsilon) * bound.level
    best = Greedy(batch, (1.0 + epsilon) * bound.mean)
    best.run()
    if best.max_load() > target and target > best.limit:
        again = Greedy(batch, target)
        again.run()
        if again.max_load() < best.max_load():
            best = again
    if best.max_load() > target:
        best.settle(target)
    if best.max_load() > max(target, (1.0 + _MATERIAL) * bound.level) and cap is None:
        best = _fallback(batch, best, target, cost, mode, keep_activations, target / 2)
    return best.task_array()


def _refine(tasks: np.ndarray, batch: PlacedBatch, model: TimeModel, window, make) -> tuple[np.ndarray, float, float]:
    """A FLOP plan's ``tasks`` refined in predicted seconds towards the level
    (:func:`~scheduler.time_refine.refine_time`; it returns ``tasks`` unless the refined plan's most
    loaded server is lower): ``(tasks, level_s, max_s)``, ``max_s`` the returned plan's predicted
    maximum. Under a held-bytes cap the refined plan (``make``: tasks to a Plan) is kept only if it
    holds within the cap wherever the FLOP plan did."""
    out = refine_time(tasks, counts=batch.counts, lens=batch.lens_arr, num_servers=batch.S,
                      inplace=batch.inplace, model=model, min_shard=batch.min_shard, window=window,
                      q_bytes=batch.q_bytes, kv_bytes=batch.kv_bytes)
    cap = batch.held_cap
    if out.tasks is not tasks and cap is not None and max(make(out.tasks).held_bytes()) > cap >= max(make(tasks).held_bytes()):
        return tasks, out.level_s, out.start_max_s
    return out.tasks, out.level_s, out.max_s


def _time_plan(batch: PlacedBatch, model: TimeModel, epsilon: float, window, make, flop) -> tuple[np.ndarray, dict]:
    """The time planner's task array (DistCA §4.2; ``flop(ε)``: the FLOP plan at ε). It *aims at
    the level*: the FLOP plan at ε = 0 (the greedy aimed at ``max(mean, B)`` in pairs), refined
    towards ``level_s`` seconds (:func:`~scheduler.time_refine.refine_time`). ε (seconds) bounds
    what it accepts: a result above ``T_s = (1 + ε) · level_s`` is a miss, and then the FLOP plan at
    ε is refined as well and kept if its predicted maximum is lower (by the refinement's relative
    margin, so that it holds however the seconds are summed). So the predicted maximum is at most
    the FLOP plan's at ε = 0, exactly, and at most ``max(T_s, the FLOP plan's at ε)`` up to that
    margin (1e-9 relative, on ties). Returns ``(tasks, flops)``: ``flops`` the FLOP plans it
    computed, by ε (the partial-KV step compares against them: :func:`_split_keys`)."""
    flops = {0.0: flop(0.0)}
    tasks, level, top = _refine(flops[0.0], batch, model, window, make)
    if epsilon > 0 and top > (1.0 + epsilon) * level:
        flops[epsilon] = flop(epsilon)
        other, _, other_top = _refine(flops[epsilon], batch, model, window, make)
        if other_top < top * (1.0 - _TIME_MARGIN):
            tasks = other
    return tasks, flops


def _split_keys(batch: PlacedBatch, tasks: np.ndarray, target: float, max_kv_rows, make):
    """``tasks`` with key blocks split off (:func:`~scheduler.partial.split_past_blocks`, towards
    ``target`` pairs per server), as a Plan; the unsplit plan when nothing splits or when the
    split breaks a held-bytes cap the unsplit plan kept (key blocks move for balance and KV
    budget, not held memory)."""
    unsplit = make(tasks)
    split = split_past_blocks(tasks, batch.S, target, batch.min_shard, max_kv_rows)
    if split is tasks:
        return unsplit
    plan, cap = make(split), batch.held_cap
    if cap is not None and max(plan.held_bytes()) > cap >= max(unsplit.held_bytes()):
        return unsplit
    return plan


def _split_keys_timed(batch: PlacedBatch, bound, tasks: np.ndarray, flops: dict, epsilon: float,
                      max_kv_rows, model: TimeModel, window, make, flop):
    """The time planner's partial-KV step: of the time plan, its key splits towards
    ``(1 + ε) · mean`` and towards the mean, and the FLOP plans :func:`_time_plan` computed
    with their own splits (each exactly the plan ``plan_batch`` returns without a time model),
    the one with the fewest predicted seconds on its most loaded server (the first on ties: the
    unsplit time plan). So both guarantees of :func:`_time_plan` still hold with ``partial_kv``:
    the plans they compare against are among the candidates. Under a held-bytes cap (a hard
    limit: ``plan_batch`` raises above it), then under a KV budget (``max_kv_rows``, best
    effort), a candidate above it is kept only if every candidate is, and the guarantees hold
    against the FLOP plans that meet them. If no candidate meets both, the FLOP plan at ε
    (``flop(ε)``, the FLOP planner's own result once split) joins them, so the cap and the
    budget hold wherever the FLOP planner keeps them."""
    splits: dict = {}  # (task array, target) -> its split plan: the time plan is often the FLOP plan at 0

    def split(t, target):
        key = (id(t), target)
        if key not in splits:
            splits[key] = _split_keys(batch, t, target, max_kv_rows, make)
        return splits[key]
    candidates = [make(tasks), split(tasks, (1.0 + epsilon) * bound.mean), split(tasks, bound.mean)]
    candidates += [split(f, (1.0 + eps) * bound.mean) for eps, f in flops.items()]

    # (measure, limit), the hard cap first; the unsplit plans never had the KV budget applied
    limits = [(most, limit) for most, limit in ((lambda p: max(p.held_bytes()), batch.held_cap),
                                                 (lambda p: int(p.row_matrix[1].sum(axis=0).max()), max_kv_rows))
              if limit is not None]
    if limits and epsilon not in flops and not any(all(most(p) <= lim for most, lim in limits) for p in candidates):
        flops[epsilon] = flop(epsilon)  # the FLOP planner's own result, once split
        candidates.append(split(flops[epsilon], (1.0 + epsilon) * bound.mean))
    for most, limit in limits:
        candidates = _within(candidates, most, limit)
    seconds = [model.server_seconds(p.task_array, batch.S, window).max() for p in candidates]
    return candidates[int(np.argmin(seconds))]


def _within(candidates: list, most, limit: int) -> list:
    """The candidates whose ``most(plan)`` is at most ``limit``; all of them if none is."""
    kept = [p for p in candidates if most(p) <= limit]
    return kept or candidates


def plan_batch(doc_lens_per_rank: Sequence[Sequence[int]], num_servers: int, *, cost: CostModel,
               config: PlanConfig | None = None, window: int | None = None,
               epsilon: float = PlanConfig.epsilon, mode: str = PlanConfig.mode,
               min_shard: int = PlanConfig.min_shard, partial_kv: bool = PlanConfig.partial_kv,
               max_kv_rows_per_server: int | None = PlanConfig.max_kv_rows_per_server,
               keep_activations: bool = PlanConfig.keep_activations,
               max_held_bytes_per_server: int | None = PlanConfig.max_held_bytes_per_server,
               attn_profile: str | None = PlanConfig.attn_profile,
               time_model: TimeModel | None = None) -> Plan:
    """Plan one step: split the batch's documents into CA-tasks balanced over the servers.

    The planner's settings come as one :class:`~scheduler.config.PlanConfig` (``config=``) or as
    its fields by keyword (``epsilon=0.1, mode="dedicated"``), defaults
    :class:`~scheduler.config.PlanConfig`'s; not both (a keyword equal to its default cannot be
    told from one not given, so beside ``config=`` it is not refused, and ``config``'s value is used).

    Args:
        doc_lens_per_rank: ``doc_lens_per_rank[r]`` lists the document lengths (tokens, ints > 0)
            packed on client rank ``r``; a rank may have none.
        num_servers: attention servers; in ``inplace`` mode it must equal the number of ranks.
        cost: attention shape and element size (FLOPs per pair, bytes per row).
        config: the planner's settings (None: the keywords below).
        epsilon: imbalance tolerance ε: the planner aims for every server within
            ``(1 + ε) · max(mean, bound)`` attention FLOPs, ``bound`` the lower bound of
            :func:`scheduler.bound.load_bound` (what is guaranteed: see the module doc).
        mode: ``"inplace"`` (server ``i`` is rank ``i``; a rank's rows are free for its own server)
            or ``"dedicated"`` (servers are separate processes; every row moves).
        min_shard: no shard of a split document is shorter than this many tokens (a FlashAttention
            tile is 128 rows, DistCA §3); documents with ``ceil(l / 2) < 2 · min_shard`` stay whole.
            None (the default): 128, or with a time model the table's choice
            (:meth:`~scheduler.time_cost.TimeModel.choose_min_shard`).
        window: sliding-window attention: query ``i`` sees keys ``i - window + 1 .. i`` of its
            document (None: full causal). Loads are windowed pairs, and a shard's tasks take only
            the keys its window needs (``kv_start = max(0, q_start - window + 1)``), so windowed
            plans move fewer KV rows.
        partial_kv: also split query shards on the key axis (:mod:`scheduler.partial`): a server
            still above ``(1 + ε) · mean`` after the greedy gives exact key blocks of its shards to
            the least-loaded servers (finer than ``min_shard`` positions of a band, so it can beat
            the band lower bound), and ``max_kv_rows_per_server`` is sought (best effort; with
            a time model it holds wherever the FLOP planner keeps it). Full causal only
            (with a window, shards are not split on the key axis). False gives full-window tasks.
            With ``keep_activations``, a kept backward round also sends the owner's merged O and
            LSE for the query rows of split tasks (a server's own are partial); with
            ``max_held_bytes_per_server``, the key splits are dropped if they would break the cap.
        max_kv_rows_per_server: with ``partial_kv``, the most KV rows a server should receive
            (None: no limit); key blocks move off servers above it while some server has room.
        keep_activations: servers keep each forward round's rows and results until that layer's
            backward round, which then sends only dO (:attr:`Plan.keep_activations`); moves are
            weighed by the bytes of these rounds.
        max_held_bytes_per_server: with ``keep_activations``, the most bytes any server may hold
            for one layer (:meth:`Plan.held_bytes`; a step holds that once per layer and batch):
            no move fills a server past it, and the dedicated initial placement puts each document
            where it fits. Balance may then stay above the target. None: no cap.

    Returns:
        A :class:`Plan` (built by construction from valid parts, not re-validated).

    Raises:
        ValueError: ``config`` together with a keyword setting; bad settings (a
            :class:`~scheduler.config.ConfigError` naming every bad one); bad lengths, sizes or
            ``window`` (the message names the values); a ``max_held_bytes_per_server``
            without ``keep_activations``, below what any plan needs (the mean over servers, or one
            document's KV rows plus its first shard), or one the planner could not keep (it names
            the server, e.g. an in-place rank whose own rows exceed it: the planner moves work for
            balance, not for memory); ``time_model`` together with ``attn_profile``, a
            ``time_model`` that is not a :class:`~scheduler.time_cost.TimeModel` or was measured
            for another attention shape than ``cost``.

    Time (``time_model=``, or ``attn_profile``: a folder of measured tables, DistCA §4.2): the plan
    balances predicted seconds (forward + backward, :mod:`scheduler.time_cost`) instead of FLOPs.
    It aims at the level: the FLOP plan at ε = 0 is refined by
    :func:`scheduler.time_refine.refine_time` towards ``level_s = max(mean_s, piece_s)`` seconds
    (:meth:`TimeModel.bound`); ε, in predicted seconds, bounds what it accepts: a plan above
    ``T_s = (1 + ε) · level_s`` is a miss, and then the FLOP plan at ε is refined as well and the
    plan with the lower predicted maximum kept. Guaranteed (same batch, ``min_shard`` and other
    settings): its predicted most loaded server is at or below the FLOP plan's at ε = 0, and at or
    below ``max(T_s, the FLOP plan's at ε)`` (up to a relative 1e-9 on ties). ``Plan.epsilon`` is
    the ε given. Without a time
    model the plan is the FLOP plan, bit for bit.
    """
    settings = dict(epsilon=epsilon, mode=mode, min_shard=min_shard, partial_kv=partial_kv,
                    max_kv_rows_per_server=max_kv_rows_per_server, keep_activations=keep_activations,
                    max_held_bytes_per_server=max_held_bytes_per_server, attn_profile=attn_profile)
    if config is None:
        config = PlanConfig(**settings)
    else:
        if not isinstance(config, PlanConfig):
            raise ValueError(f"config must be a PlanConfig, got {type(config).__name__}")
        both = [k for k, v in settings.items() if v is not getattr(PlanConfig, k) and v != getattr(PlanConfig, k)]
        if both:
            raise ValueError(f"plan_batch: pass config= or the settings {both} by keyword, not both")
    if time_model is not None:
        if not isinstance(time_model, TimeModel):
            raise ValueError(f"time_model must be a scheduler.time_cost.TimeModel, got {type(time_model).__name__}")
        if config.attn_profile is not None:
            raise ValueError(f"plan_batch: pass time_model= or attn_profile={config.attn_profile!r}, not both")
    model = time_model if time_model is not None else config.time_model()
    if model is not None and isinstance(cost, CostModel):
        model.check_cost(cost)
    epsilon, mode, min_shard = config.epsilon, config.mode, config.resolved_min_shard(model)
    partial_kv, keep_activations = config.partial_kv, config.keep_activations
    max_kv_rows_per_server, cap = config.max_kv_rows_per_server, config.max_held_bytes_per_server
    counts, lens = validate_plan_args(doc_lens_per_rank, num_servers, cost, epsilon, mode, min_shard)
    window = window_arg(window)
    if cap is not None:
        need = held_cap_bound(lens, int(num_servers), cost, int(min_shard), window)
        if cap < need:
            raise ValueError(f"max_held_bytes_per_server={cap} is infeasible: every plan of this batch "
                             f"holds at least {need} bytes on some server (the mean over "
                             f"{num_servers} servers, or the longest document's KV rows plus its first shard)")
    batch = PlacedBatch(counts, lens, int(num_servers), cost, mode, int(min_shard), window, keep_activations, cap)
    bound = load_bound(batch.lens_arr, batch.S, batch.min_shard, window)

    def make(tasks):
        return Plan._trusted(counts=batch.counts, doc_lens=batch.lens_arr, num_servers=batch.S, mode=mode,
                             cost=cost, task_array=tasks, epsilon=float(epsilon),
                             min_shard=batch.min_shard, keep_activations=keep_activations, window=window)

    def flop(eps: float) -> np.ndarray:
        return _flop_tasks(batch, bound, eps, cost, mode, keep_activations, cap)
    if model is None:
        tasks, flops = flop(epsilon), {}
    else:
        tasks, flops = _time_plan(batch, model, epsilon, window, make, flop)
    if not (partial_kv and (window is None or window >= int(lens.max(initial=0)))):
        plan = make(tasks)
    elif model is None:
        plan = _split_keys(batch, tasks, (1.0 + epsilon) * bound.mean, max_kv_rows_per_server, make)
    else:  # key splits balance pairs: the time planner keeps them only where seconds do not rise
        plan = _split_keys_timed(batch, bound, tasks, flops, epsilon, max_kv_rows_per_server, model, window,
                                 make, flop)
    if cap is not None:
        held = plan.held_bytes()
        worst = int(np.argmax(held))
        if held[worst] > cap:
            why = ("; in-place, a rank's own rows stay on its server unless balancing moves them"
                   if mode == "inplace" else "")
            raise ValueError(f"max_held_bytes_per_server={cap}: the planner could not keep server {worst} "
                             f"within it ({held[worst]} bytes held per layer{why}); raise the cap or "
                             f"add servers")
    return plan
