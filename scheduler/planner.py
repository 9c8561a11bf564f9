"""The communication-aware greedy planner (DistCA §4.2 and Appendix B), improved: :func:`plan_batch`.

Code: :mod:`scheduler.bands` (band arithmetic), :mod:`scheduler.placement` (steps 1-2),
:mod:`scheduler.greedy` (step 3 and the last pass), this module (the runs, the guarantees).

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
band per document). Guarantees, with ``Q`` the largest piece a server may be unable to cut
further (``l (l + 1) / 2`` for a document with ``c < 2 · min_shard``, else
``(2 · min_shard - 1) · (l + 1)``, maximised over documents):

(a) Always ``max load ≤ max(T, mean + Q)``: a server the last pass leaves above ``T`` could not
    give its smallest piece ``p ≤ Q`` to the least-loaded server (load ``≤ mean``), and each
    receiver of that pass got one piece ``≤ Q`` while it was the least loaded.
(b) Hence ``max load ≤ T = (1 + ε) · max(mean, B)`` whenever ``Q ≤ ε · M``; and in practice far
    beyond: on every batch of one document tried (the even cut reaches the piece bound: 1.047 for
    one 65,536-token document over 256 servers at ε = 0.05 and ``min_shard`` 128), and on all but
    a few in a thousand random small batches at ε > 0 (those where ``B`` is below the true
    optimum, which the planner then reaches or nearly).
(c) Exactly ``T`` on every input is out of reach for any fast planner: with ε = 0 it would solve
    the partition problem (two servers, unsplittable documents).

Also: (d) KV bytes count only rows the destination lacks (one copy per document and server);
(e) any lengths; documents with ``c < 2 · min_shard`` are never split; (f) deterministic: every
choice breaks ties by server and document index; (g) near-linear time whatever the batch:
``O((N + S) log (N + S))`` set-up for ``N`` documents and ``S`` servers, then per move a bounded
set of candidates of the source (its whole documents indexed by length: the longest that fits
whole, the longest, and those nearest the length with the best ``ΔF / V``, or all of them when
there are few; and its newest split bands; older split bands only when none of these moves), and
in the last pass the source's split bands.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .bound import load_bound
from .checks import boolean, check_batch, positive_int
from .cost import CostModel, window_arg
from .greedy import Greedy
from .partial import split_past_blocks
from .placement import PlacedBatch, held_cap_bound
from .tasks import Plan


def validate_plan_args(doc_lens_per_rank, num_servers, cost, epsilon, mode, min_shard) -> tuple[np.ndarray, np.ndarray]:
    """The checks of :func:`plan_batch` (and the baselines): the plan's own plus ``min_shard``.
    Returns ``(doc_counts, doc_lens)`` (see :func:`~scheduler.checks.check_batch`)."""
    positive_int("min_shard", min_shard)
    return check_batch(doc_lens_per_rank, num_servers, mode, cost, epsilon)



def plan_batch(doc_lens_per_rank: Sequence[Sequence[int]], num_servers: int, *, cost: CostModel,
               epsilon: float = 0.05, mode: str = "inplace", min_shard: int = 128,
               window: int | None = None, partial_kv: bool = False,
               max_kv_rows_per_server: int | None = None, keep_activations: bool = True,
               max_held_bytes_per_server: int | None = None) -> Plan:
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
        window: sliding-window attention: query ``i`` sees keys ``i - window + 1 .. i`` of its
            document (None: full causal). Loads are windowed pairs, and a shard's tasks take only
            the keys its window needs (``kv_start = max(0, q_start - window + 1)``), so windowed
            plans move fewer KV rows.
        partial_kv: also split query shards on the key axis (:mod:`scheduler.partial`): a server
            still above ``(1 + ε) · mean`` after the greedy gives exact key blocks of its shards to
            the least-loaded servers (finer than ``min_shard`` positions of a band, so it can beat
            the band lower bound), and ``max_kv_rows_per_server`` is enforced. Full causal only
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
        ValueError: bad lengths, sizes, mode, ε, ``min_shard`` or ``window`` (the message names
            the values); a ``max_held_bytes_per_server``
            without ``keep_activations``, below what any plan needs (the mean over servers, or one
            document's KV rows plus its first shard), or one the planner could not keep (it names
            the server, e.g. an in-place rank whose own rows exceed it: the planner moves work for
            balance, not for memory).
    """
    counts, lens = validate_plan_args(doc_lens_per_rank, num_servers, cost, epsilon, mode, min_shard)
    window = window_arg(window)
    if not isinstance(partial_kv, bool):
        raise ValueError(f"partial_kv must be True or False, got {partial_kv!r}")
    if max_kv_rows_per_server is not None:
        positive_int("max_kv_rows_per_server", max_kv_rows_per_server)
    boolean("keep_activations", keep_activations)
    boolean("partial_kv", partial_kv)
    cap = max_held_bytes_per_server
    if cap is not None:
        positive_int("max_held_bytes_per_server", cap)
        if not keep_activations:
            raise ValueError(f"max_held_bytes_per_server={cap} needs keep_activations=True (stateless "
                             f"servers hold nothing between rounds)")
        need = held_cap_bound(lens, int(num_servers), cost, int(min_shard), window)
        if cap < need:
            raise ValueError(f"max_held_bytes_per_server={cap} is infeasible: every plan of this batch "
                             f"holds at least {need} bytes on some server (the mean over "
                             f"{num_servers} servers, or the longest document's KV rows plus its first shard)")
    batch = PlacedBatch(counts, lens, int(num_servers), cost, mode, int(min_shard), window, keep_activations, cap)
    bound = load_bound(batch.lens_arr, batch.S, batch.min_shard, window)
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
    tasks = best.task_array()

    def make(tasks):
        return Plan._trusted(counts=batch.counts, doc_lens=batch.lens_arr, num_servers=batch.S, mode=mode,
                             cost=cost, task_array=tasks, epsilon=float(epsilon),
                             min_shard=batch.min_shard, keep_activations=keep_activations, window=window)
    plan = make(tasks)
    if partial_kv and (window is None or window >= int(lens.max(initial=0))):
        split = split_past_blocks(tasks, batch.S, (1.0 + epsilon) * bound.mean, batch.min_shard,
                                  max_kv_rows_per_server)
        if split is not tasks:
            unsplit, plan = plan, make(split)
            # Key blocks move for balance and KV budget, not held memory: keep the cap if the
            # greedy's plan did.
            if cap is not None and max(plan.held_bytes()) > cap >= max(unsplit.held_bytes()):
                plan = unsplit
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
