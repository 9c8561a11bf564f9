"""The end of a :class:`~scheduler.greedy.Greedy` run: the last pass of :mod:`scheduler.planner`'s
algorithm (smallest pieces to the least-loaded server) and the run's CA-tasks as the plan's rows.
:class:`GreedySettle` is a mixin of :class:`~scheduler.greedy.Greedy` and works on its state."""

from __future__ import annotations

import heapq

import numpy as np

from .cost import window_kv_start


class GreedySettle:
    """The last pass (:meth:`settle`) and the output (:meth:`task_array`, :meth:`max_load`) of
    :class:`~scheduler.greedy.Greedy`, whose state (loads, bands, index) they read and move."""

    # ---- the last pass: smallest pieces to the least-loaded server ----------------------------------
    def _pieces(self, src: int) -> list[tuple]:
        """The smallest piece of each item ``src`` holds: ``(pairs, gid, k, l, pos)``."""
        ms = self.min_shard
        u0, p0, p1 = self.seg[2 * src], self.seg[2 * src + 1], self.seg[2 * src + 2]
        pieces = []
        for i, k_of, end in ((self._right(u0, p0), None, p0), (self._right(p0, p1), ms, p1)):
            if i < end:  # the shortest whole document of each kind
                l = self.slen[i]
                c = (l + 1) // 2
                k = c if k_of is None else k_of
                pieces.append((self._pairs(l, c - k, c), self.sgid[i], k, l, i))
        for gid in self.recent.get(src, ()):
            l, _, held, _ = self.touched[gid]
            a, hi = held[src]  # an outer band [0, hi): the centre is elsewhere
            k = hi - a if hi - a < 2 * ms else ms
            pieces.append((self._pairs(l, hi - k, hi), gid, k, l, -1))
        return pieces

    def _shift(self, src: int, dst: int, gid: int, k: int) -> None:
        """Move ``k`` positions of src's outer band [a, lo) of a split document to ``dst``, which
        holds a band further in, [x, y): every band between them shifts out by ``k`` (same width,
        same load: a position off the centre always holds l + 1 pairs; under a window an outer
        position holds no more than an inner one, so a shifted band's load can only fall), and
        dst's grows to [x - k, y). Keeps one band per server and document."""
        l, _, held, inner = self.touched[gid]
        a, lo = held[src]
        x = held[dst][0]
        for server, band in held.items():
            if lo <= band[0] < x:
                before = self._pairs(l, band[0], band[1])
                band[0] -= k
                band[1] -= k
                self.loads[server] += self._pairs(l, band[0], band[1]) - before
        held[dst][0] = x - k
        self.loads[src] -= self._pairs(l, lo - k, lo)
        self.loads[dst] += self._pairs(l, x - k, x)
        if lo - k == a:
            del held[src]
            self.recent[src].pop(gid, None)
        else:
            held[src][1] = lo - k

    def settle(self, target: float) -> None:
        """While a server is above ``target``: give its smallest piece to the least-loaded server
        if that lowers it (guarantee (a) of :mod:`scheduler.planner`)."""
        loads = self.loads
        stuck = sorted((s for s in range(self.b.S) if loads[s] > target), key=lambda s: (-loads[s], s))
        heap = [(loads[s], s) for s in range(self.b.S)]
        heapq.heapify(heap)
        for src in stuck:
            while loads[src] > target:
                while heap[0][0] != loads[heap[0][1]]:  # stale entry
                    heapq.heapreplace(heap, (loads[heap[0][1]], heap[0][1]))
                dst = heap[0][1]
                if dst == src:
                    break  # src is the least loaded: nothing lowers it
                pieces = self._pieces(src)
                if not pieces:
                    break
                pairs, gid, k, l, pos = min(pieces)
                record = self.touched.get(gid)
                there = record[2].get(dst) if record is not None else None
                shift = there is not None and there[0] != record[2][src][1]
                gain = self._pairs(l, there[0] - k, there[0]) if shift else pairs  # what dst takes
                if loads[dst] + gain >= loads[src]:
                    break  # not even the smallest piece lowers src
                if self.held is not None:
                    hi = record[2][src][1] if record is not None else (l + 1) // 2
                    if shift or self.held[dst] + self._held_gain(l, hi - k, hi, there) > self.cap:
                        break  # the cap (or bands that would all shift) keeps it here
                if shift:
                    self._shift(src, dst, gid, k)  # dst holds a band further in
                else:
                    self._apply(src, dst, gid, k, l, pos)
                heapq.heapreplace(heap, (loads[dst], dst))

    # ---- output -------------------------------------------------------------------------------
    def task_array(self) -> np.ndarray:
        """int64 [num_tasks, 7] in the plan's canonical order (server, rank, doc, q_start)."""
        bt = self.b
        touched = sorted(self.touched)
        index = np.arange(bt.N, dtype=np.int64) - np.repeat(np.cumsum(bt.counts) - bt.counts, bt.counts)
        keep = np.ones(bt.N, dtype=bool)
        keep[touched] = False
        lens = bt.lens_arr[keep]
        arr = np.zeros((len(lens), 7), dtype=np.int64)
        arr[:, 0] = bt.init_server_arr[keep]
        arr[:, 1] = bt.rank_arr[keep]
        arr[:, 2] = index[keep]
        arr[:, 4] = lens
        arr[:, 6] = lens
        # Moved documents: one row per (band, shard), built column-wise.
        servers, gids, los, his = [], [], [], []
        for gid in touched:
            for server, (a, b) in self.touched[gid][2].items():
                servers.append(server)
                gids.append(gid)
                los.append(a)
                his.append(b)
        g = np.asarray(gids, dtype=np.int64)
        l, a, b = bt.lens_arr[g], np.asarray(los, dtype=np.int64), np.asarray(his, dtype=np.int64)
        t0 = np.maximum(l - b, b)
        split = t0 != b  # a head shard [a, b) and a tail shard [t0, l - a); else one [a, l - a)
        rows = np.zeros((len(g) + int(split.sum()), 7), dtype=np.int64)
        head, tail = rows[:len(g)], rows[len(g):]
        head[:, 0], head[:, 1], head[:, 2], head[:, 3] = servers, bt.rank_arr[g], index[g], a
        head[:, 4] = np.where(split, b, l - a)
        tail[:] = head[split]
        tail[:, 3], tail[:, 4] = t0[split], (l - a)[split]
        rows[:, 5] = window_kv_start(rows[:, 3], bt.window)
        rows[:, 6] = rows[:, 4]
        moved = rows
        if bt.inplace and self.homes is None:
            # Whole documents are in order already (server = rank, documents by index): merge the
            # few moved rows in by their place, found on a packed (server, rank, doc) key.
            if not len(moved):
                return arr
            width = int(bt.counts.max()) + 1
            if bt.S * bt.S * width < 2**62:
                moved = moved[np.lexsort((moved[:, 3], moved[:, 2], moved[:, 1], moved[:, 0]))]
                def key(t):
                    return (t[:, 0] * bt.S + t[:, 1]) * width + t[:, 2]
                return np.insert(arr, np.searchsorted(key(arr), key(moved)), moved, axis=0)
        arr = np.concatenate([arr, moved])
        # Canonical order; a server holds one band of a document, whose shards are in order.
        return arr[np.lexsort((arr[:, 3], arr[:, 2], arr[:, 1], arr[:, 0]))]

    def max_load(self) -> int:
        return max(self.loads)
