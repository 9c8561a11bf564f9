"""The time refinement of :func:`scheduler.plan_batch`: balance predicted seconds (DistCA §4.2).

With a :class:`~scheduler.time_cost.TimeModel`, the planner first plans in causal pairs (the FLOP
greedy of :mod:`scheduler.planner`, aimed at the level: ε = 0), then :func:`refine_time` moves
head–tail bands (the vocabulary of :mod:`scheduler.planner`) from the servers with the most
predicted seconds to those with the least, in rounds, all of it vectorised numpy. Its target,
``T`` below, is the level itself, ``level_s = max(mean_s, piece_s)`` seconds
(:meth:`~scheduler.time_cost.TimeModel.bound`); the planner's ε bounds what it accepts
(``scheduler.planner._time_plan``: a plan above ``(1 + ε) · level_s`` is a miss, and then the
FLOP plan at ε is refined as well and the lower kept).

Why the level and not ``(1 + ε) · level_s``: on the measured H200 tables (``bench/time_planner.py``,
32 cells, TP 8 × 8-64 servers) a plan left at ``1.05 · level_s`` is the step's most loaded rank
5% above the mean, which WLB-ideal beats in 21 of 32 cells; aimed at the level the plans end at
1.000-1.009 × the mean and beat it in all 32. Refining the FLOP plan at ε = 0.05 towards the
level instead gets stuck (1.05 in some 512K cells: with 8 servers every destination holds another
band of the long documents) and moves up to 2.9× its bytes; the FLOP plan at ε = 0, 1.00-1.03 ×
the mean in seconds, is a start the refinement finishes in 1-2 rounds.

1. Every server above the target ``T`` (seconds), most loaded first, is paired with one of
   the least loaded servers (``i``-th most loaded with ``i``-th least loaded; a server is in at
   most one pair per round, so the moves of a round are independent).
2. For each pair ``(src, dst)`` the candidates are ``src``'s :data:`_ITEMS` bands with the most
   seconds and the two whose seconds are nearest above and below what ``src`` must shed to reach
   ``T`` (a whole document that just finishes it). A candidate moves the *inner* ``k`` folded positions ``[b - k, b)`` of
   band ``[a, b)`` to ``dst``, which either holds no band of that document (it gets band
   ``[b - k, b)``) or holds the band just inside, ``[b, y)`` (it widens to ``[b - k, y)``); any
   other ``dst`` would hold two bands of one document, and is skipped. ``k`` is the whole band,
   or (documents with ``ceil(l / 2) >= 2 · min_shard``) between ``min_shard`` and
   ``w - min_shard`` positions, so every shard keeps ``min_shard`` tokens.
3. A band's time is not linear in its width (a narrow shard runs slower per pair, the tail's keys
   grow towards the centre), so ``k`` is found in two exact steps: a first guess from the band's
   own seconds per position, then a secant step from the *measured* seconds the guess moves off
   ``src`` and adds to ``dst`` (each side's seconds per position at the guess); each step tries the
   cut that balances the pair and the one that just brings ``src`` to ``T``, besides the whole
   band. Every tried ``k`` is priced exactly with the table
   (:meth:`~scheduler.time_cost.TimeModel.band_seconds`): ``Δsrc = t(a, b) - t(a, b - k)``,
   ``Δdst = t(b - k, y) - t(b, y)`` (``t(b, b) = 0``). Of a candidate's tries the narrowest that
   brings both servers within ``T`` is kept (fewest bytes), else the lowest ``max(src', dst')``.
4. A move's *efficiency* is seconds moved per byte: ``Δsrc / V``, ``V`` the bytes it adds to the
   step as in the FLOP greedy (the moved Q rows off their rank, and the KV rows ``dst`` lacks,
   less those ``src`` no longer needs; ``V <= 0`` ranks first). Per pair the chosen move is the
   most efficient of those that bring both servers within ``T``; failing that, the one with the
   lowest ``max(src', dst')``.
5. A move is applied only if ``max(src', dst') < src`` (its source's seconds before it).

Stops when no server is above ``T``, a round applies no move, or after :data:`_ROUNDS` rounds.

**Guarantee.** Every applied move leaves both servers it touches below its source's seconds before
it, which is at most the plan's most loaded server, and leaves every other server as it was; so the
predicted maximum never rises, and the refined plan's most loaded server holds at most the
predicted maximum of the FLOP plan it was given. Each move must clear its source's seconds by a relative margin of
:data:`_MARGIN`, far above float64 rounding, so the bound holds however the seconds are summed
(:meth:`TimeModel.server_seconds` sums per task); :func:`refine_time` also compares the refined
maximum with the FLOP plan's at the end and returns the FLOP plan if it were not lower.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .bands import band_kv_rows_array
from .cost import window_kv_start
from .time_cost import TimeModel

# Documents (bands) of a source looked at per round, most seconds first.
_ITEMS = 4
# Rounds at most (each a handful of numpy calls over every pair's candidates).
_ROUNDS = 24
# A move must lower its pair's maximum below the source's seconds by this relative margin, so a
# plan's predicted maximum, summed in another order, can never come out above the FLOP plan's.
_MARGIN = 1e-9


def _bands(tasks: np.ndarray, gid: np.ndarray, lens: np.ndarray):
    """Every (server, document) band of a plan: int64 ``srv, gid, a, b``, from a task array in
    canonical order with one or two shards per band (head [a, b) and tail, or one merged shard)."""
    srv, qs, qe = tasks[:, 0], tasks[:, 3], tasks[:, 4]
    first = np.ones(len(tasks), dtype=bool)
    first[1:] = (srv[1:] != srv[:-1]) | (gid[1:] != gid[:-1])
    idx = np.flatnonzero(first)
    count = np.diff(np.append(idx, len(tasks)))
    g = gid[idx]
    return srv[idx].copy(), g.copy(), qs[idx].copy(), np.where(count == 2, qe[idx], (lens[g] + 1) // 2)


def _find(keys: np.ndarray, order: np.ndarray, sorted_keys: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Index (into the arrays ``keys`` came from) of each ``want`` key, or -1."""
    if not len(sorted_keys):
        return np.full(len(want), -1, dtype=np.int64)
    i = np.minimum(np.searchsorted(sorted_keys, want), len(sorted_keys) - 1)
    return np.where(sorted_keys[i] == want, order[i], -1)


class Refined(NamedTuple):
    """What :func:`refine_time` returns (seconds: predicted, summed per band in this module's order).

    Attributes:
        tasks: int64 [m, 7], the refined task array in canonical order (the given array itself
            when nothing moved, or when the refined maximum is not below the start's).
        level_s: ``max(mean_s, piece_s)`` as :meth:`TimeModel.bound` computes it; the target.
        start_max_s: the given plan's most loaded server.
        max_s: ``tasks``' most loaded server (``start_max_s`` when ``tasks`` is the given array).
    """

    tasks: np.ndarray
    level_s: float
    start_max_s: float
    max_s: float


def refine_time(tasks: np.ndarray, *, counts: np.ndarray, lens: np.ndarray, num_servers: int, inplace: bool,
                model: TimeModel, min_shard: int, window: int | None, q_bytes: int, kv_bytes: int) -> Refined:
    """The refined plan (module doc), aimed at the level: target ``T_s = level_s`` seconds.

    Args:
        tasks: int64 [n, 7], a plan's task array in canonical order (server, rank, doc, q_start),
            each document on a server as one head–tail band (no key splits).
        counts: int64 [ranks], documents per rank; lens: int64 [documents], their lengths.
        num_servers: servers; inplace: server ``r`` holds rank ``r``'s rows for free.
        model: the time model.
        min_shard: the shortest shard of a split document, tokens; window: the mask's window.
        q_bytes, kv_bytes: bytes a step moves per query row and per KV row
            (:meth:`~scheduler.cost.CostModel.step_row_bytes`).

    Returns:
        :class:`Refined`; its ``tasks`` a valid plan covering every pair exactly once.
    """
    S, ms = int(num_servers), int(min_shard)
    if not len(tasks):
        return Refined(tasks, 0.0, 0.0, 0.0)
    starts = np.cumsum(counts) - counts
    gid = starts[tasks[:, 1]] + tasks[:, 2]
    rank_of = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    srv, g, a, b = _bands(tasks, gid, lens)
    t = model.band_seconds(lens[g], a, b, window)
    # the level: whole documents' seconds (a band [0, ceil(l / 2)) is its document whole)
    whole_band = (a == 0) & (b == (lens[g] + 1) // 2)
    whole = np.zeros(len(lens))
    whole[g[whole_band]] = t[whole_band]
    cut = np.ones(len(lens), dtype=bool)
    cut[g[whole_band]] = False
    if cut.any():
        whole[cut] = model.whole_seconds(lens[cut], window)
    level = model.bound(lens, S, ms, window, whole=whole).level_s
    target_s = level
    q_move = q_bytes if inplace else 0  # dedicated: Q rows cross the network wherever they go
    width = int(lens.max()) + 1
    N = len(lens)
    cnt = np.bincount(srv, minlength=S)
    st = np.bincount(srv, t, minlength=S) + model.call_s * (cnt > 0)
    first_max = st.max()
    moved_any = False
    for _ in range(_ROUNDS):
        order = np.argsort(-st, kind="stable")
        n_over = int((st > target_s).sum())
        P = min(n_over, S - n_over)
        if P <= 0:
            break
        src_of, dst_of = order[:P], order[::-1][:P]
        keep = st[dst_of] < st[src_of]
        src_of, dst_of = src_of[keep], dst_of[keep]
        if not len(src_of):
            break
        pair = np.full(S, -1, dtype=np.int64)
        pair[src_of] = np.arange(len(src_of))
        # candidates per source: its bands with the most seconds, and the two whose seconds are
        # nearest above and below what it must shed (a whole document that just finishes it)
        cand = np.flatnonzero(pair[srv] >= 0)
        pi = pair[srv[cand]]
        tmax = max(float(t[cand].max()), 1e-300) * 2.0
        key = pi + t[cand] / tmax
        o = np.argsort(key, kind="stable")
        cand, key, pi = cand[o], key[o], pi[o]
        grp_end = np.searchsorted(pi, np.arange(len(src_of)), side="right")
        grp_start = np.searchsorted(pi, np.arange(len(src_of)), side="left")
        need = np.arange(len(src_of)) + np.clip(st[src_of] - target_s, 0, None) / tmax
        at = np.searchsorted(key, need)
        rank_in = np.arange(len(cand)) - grp_start[pi]
        from_top = grp_end[pi] - 1 - np.arange(len(cand))
        near = (np.arange(len(cand)) == at[pi]) | (np.arange(len(cand)) == at[pi] - 1)
        cand = cand[(from_top < _ITEMS) | (near & (rank_in >= 0))]
        cs, cg, ca, cb, ct = srv[cand], g[cand], a[cand], b[cand], t[cand]
        cd = dst_of[pair[cs]]
        cl = lens[cg]
        cc = (cl + 1) // 2
        # where dst stands: the band just inside (widen), none of the document (new), or another.
        # Only bands of cut documents can share a document with another server.
        part = np.flatnonzero(~((a == 0) & (b == (lens[g] + 1) // 2)))
        k1, k2 = srv[part] * N + g[part], g[part] * width + a[part]
        o1, o2 = np.argsort(k1), np.argsort(k2)
        inner = np.where(cb < cc, _find(k2, part[o2], k2[o2], cg * width + cb), -1)
        widen = (inner >= 0) & (srv[np.maximum(inner, 0)] == cd)
        holds = _find(k1, part[o1], k1[o1], cd * N + cg) >= 0
        ok = widen | ~holds
        if not ok.any():
            break
        cand, cs, cg, ca, cb, ct, cd, cl, cc, inner, widen = (x[ok] for x in (cand, cs, cg, ca, cb, ct, cd, cl, cc,
                                                                            inner, widen))
        k_chosen, ok_move = _choose(model, window, ms, target_s, q_move, kv_bytes, inplace, rank_of, cnt, st,
                                    cs, cg, ca, cb, ct, cd, cl, cc, widen, b[np.maximum(inner, 0)],
                                    t[np.maximum(inner, 0)])
        if not ok_move.any():
            break
        moved_any = True
        pick = np.flatnonzero(ok_move)
        # apply: the source keeps [a, b - k) (or gives the band up); dst widens or gets a new band
        j, k = cand[pick], k_chosen[pick]
        lo = cb[pick] - k
        whole_move = k == (cb - ca)[pick]
        wid = widen[pick]
        h = inner[pick][wid]
        a[h] = lo[wid]
        newb = ~wid
        add_srv, add_g, add_a, add_b = cd[pick][newb], cg[pick][newb], lo[newb], cb[pick][newb]
        b[j] = lo
        fresh = model.band_seconds(np.concatenate([cl[pick], lens[g[h]], lens[add_g]]),
                                   np.concatenate([ca[pick], a[h], add_a]),
                                   np.concatenate([lo, b[h], add_b]), window)
        t[j], t[h], add_t = fresh[:len(j)], fresh[len(j):len(j) + len(h)], fresh[len(j) + len(h):]
        keep_band = np.ones(len(srv), dtype=bool)
        keep_band[j[whole_move]] = False
        srv, g, a, b, t = (np.concatenate([x[keep_band], y_]) for x, y_ in
                           ((srv, add_srv), (g, add_g), (a, add_a), (b, add_b), (t, add_t)))
        cnt = np.bincount(srv, minlength=S)
        st = np.bincount(srv, t, minlength=S) + model.call_s * (cnt > 0)
    top = float(st.max())
    if not moved_any or top > first_max:
        return Refined(tasks, level, float(first_max), float(first_max))
    return Refined(_task_array(srv, g, a, b, lens, counts, rank_of, window), level, float(first_max), top)


def _choose(model, window, ms, target_s, q_move, kv_bytes, inplace, rank_of, cnt, st,
            cs, cg, ca, cb, ct, cd, cl, cc, widen, y_inner, t_inner):
    """Per pair, the move to apply (module doc, steps 3-5): ``(k, chosen)``, ``k`` the positions
    each candidate would move, ``chosen`` one candidate per source at most."""
    n = len(cs)
    w = cb - ca
    split = (cc >= 2 * ms) & (w >= 2 * ms)
    y = np.where(widen, y_inner, cb)  # dst's band after the move: [b - k, y)
    t_dold = np.where(widen, t_inner, 0.0)
    s_src, s_dst = st[cs], st[cd]
    empties, d_new = cnt[cs] == 1, cnt[cd] == 0

    def price(*ks, sub=None):
        """Exact seconds after moving the inner ``k`` positions, for each ``k`` array of ``ks``
        (one table lookup for all; ``sub``: only those candidates, the others keep the whole-band
        move of ``tries[0]``): a list of (k, src', dst', Δsrc, Δdst)."""
        idx = np.arange(n) if sub is None else sub
        m_, w_, cl_, ca_, cb_, y_ = len(idx), w[idx], cl[idx], ca[idx], cb[idx], y[idx]
        fixed = []
        for k in ks:
            k = np.clip(k[idx], ms, w_)  # a split keeps ms <= k <= w - ms, or moves the whole band
            k = np.where((k > w_ - ms) & (k < w_), np.where(2 * k < 2 * w_ - ms, w_ - ms, w_), k)
            fixed.append(np.where(split[idx], k, w_))
        lo = np.concatenate([cb_ - k for k in fixed])
        r = len(fixed)
        secs = model.band_seconds(np.tile(cl_, 2 * r), np.concatenate([np.tile(ca_, r), lo]),
                                  np.concatenate([lo, np.tile(y_, r)]), window)
        out = []
        for i, k in enumerate(fixed):
            rest, new = secs[i * m_:(i + 1) * m_], secs[(r + i) * m_:(r + i + 1) * m_]
            src2 = s_src[idx] - ct[idx] + rest - np.where((k == w_) & empties[idx], model.call_s, 0.0)
            dst2 = s_dst[idx] + new - t_dold[idx] + np.where(d_new[idx], model.call_s, 0.0)
            got = (k, src2, dst2, ct[idx] - rest, new - t_dold[idx])
            if sub is not None:
                got = tuple(_scatter(full, part, idx) for full, part in zip(tries[0], got))
            out.append(got)
        return out

    tries = price(w)
    sub = np.flatnonzero(split)
    if len(sub):
        # first guess: the band's own seconds per position on both sides
        rate = ct / np.maximum(w, 1)
        tries += price(_positions(s_src - s_dst, 2 * rate, w), _positions(s_src - target_s, rate, w), sub=sub)
        # secant step from the measured seconds per position at the balancing guess
        k1, _, _, ds, dd = tries[1]
        rs, rd = np.maximum(ds, 1e-15) / np.maximum(k1, 1), np.maximum(dd, 1e-15) / np.maximum(k1, 1)
        tries += price(_positions(s_src - s_dst, rs + rd, w), _positions(s_src - target_s, rs, w), sub=sub)
    home = rank_of[cg] if inplace else np.full(n, -1)
    off_src, off_dst = (cs != home).astype(np.int64), (cd != home).astype(np.int64)
    centre = ((cl & 1) == 1) & (cb == cc)
    # per candidate: the narrowest try that brings both servers within T_s (fewest bytes), else
    # the try with the lowest max(src', dst'); across a pair's candidates: finishing ones by
    # seconds moved per byte (mapped into (1, 1 + pi/2]), then the others by the pair's new max
    best_score, best_k = np.full(n, -np.inf), np.zeros(n, dtype=np.int64)
    best_fin = np.zeros(n, dtype=bool)
    for k, src2, dst2, ds, _ in tries:
        lo = cb - k
        if window is None:  # KV rows dst lacks, less those src no longer needs
            dkv = np.where(widen, k, cl - lo) * off_dst - np.where(lo == ca, cl - ca, 0) * off_src
        else:
            gain = np.where(widen, band_kv_rows_array(cl, lo, y, window) - band_kv_rows_array(cl, cb, y, window),
                            band_kv_rows_array(cl, lo, cb, window))
            kept = np.where(lo > ca, band_kv_rows_array(cl, ca, np.maximum(lo, ca), window), 0)
            dkv = gain * off_dst - (band_kv_rows_array(cl, ca, cb, window) - kept) * off_src
        v = (2 * k - centre) * q_move * (off_dst - off_src) + dkv * kv_bytes
        eff = np.where(v > 0, ds / np.maximum(v, 1), np.inf)  # seconds moved per byte
        pmax = np.maximum(src2, dst2)
        valid = pmax < s_src * (1 - _MARGIN)
        fin = valid & (src2 <= target_s) & (dst2 <= target_s)
        score = np.where(fin, 1.0 + np.arctan(eff * 1e12), -pmax / s_src)
        score = np.where(valid, score, -np.inf)
        better = np.where(best_fin, fin & (k < best_k), fin | (score > best_score))
        best_score, best_k = np.where(better, score, best_score), np.where(better, k, best_k)
        best_fin |= fin
    good = np.flatnonzero(np.isfinite(best_score))
    chosen = np.zeros(n, dtype=bool)
    if len(good):
        good = good[np.lexsort((-best_score[good], cs[good]))]
        first = np.ones(len(good), dtype=bool)
        first[1:] = cs[good][1:] != cs[good][:-1]
        chosen[good[first]] = True
    return best_k, chosen


def _positions(need_s: np.ndarray, rate: np.ndarray, w: np.ndarray) -> np.ndarray:
    """int64 guess of how many positions of each band to move: ``ceil(need_s / rate)`` (seconds
    over seconds per position), limited to ``[0, w]`` (``price`` clips to ``[min_shard, w]``
    anyway). A band whose rate is 0 (zero-second table cells) moves whole where seconds are
    needed and not at all where none are, without numpy's divide or cast warnings."""
    with np.errstate(divide="ignore", invalid="ignore"):
        guess = np.ceil(need_s / rate)
    guess = np.nan_to_num(guess, nan=0.0, posinf=np.inf, neginf=0.0)
    return np.clip(guess, 0, w).astype(np.int64)


def _scatter(full: np.ndarray, part: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """A copy of ``full`` with ``part`` at ``idx``."""
    out = full.copy()
    out[idx] = part
    return out


def _task_array(srv, g, a, b, lens, counts, rank_of, window) -> np.ndarray:
    """int64 [m, 7] of bands (server, gid, [a, b)) in canonical order (server, rank, doc,
    q_start): bands sorted by (server, document), each one's head row before its tail row."""
    o = np.argsort(srv * len(lens) + g, kind="stable")
    srv, g, a, b = srv[o], g[o], a[o], b[o]
    l = lens[g]
    t0 = np.maximum(l - b, b)
    split = t0 != b
    at = np.arange(len(g)) + np.cumsum(split) - split  # row of each band's head
    rows = np.zeros((len(g) + int(split.sum()), 7), dtype=np.int64)
    rank = rank_of[g]
    index = g - (np.cumsum(counts) - counts)[rank]
    rows[at, 0], rows[at, 1], rows[at, 2], rows[at, 3] = srv, rank, index, a
    rows[at, 4] = np.where(split, b, l - a)
    tail = at[split] + 1
    rows[tail, 0], rows[tail, 1], rows[tail, 2] = srv[split], rank[split], index[split]
    rows[tail, 3], rows[tail, 4] = t0[split], (l - a)[split]
    rows[:, 5] = window_kv_start(rows[:, 3], window)
    rows[:, 6] = rows[:, 4]
    return rows
