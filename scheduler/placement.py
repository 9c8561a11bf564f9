"""The planner's starting point: the batch as arrays, each document's initial server, an index of
each server's documents by length, and the least held bytes any plan needs under a cap
(:func:`scheduler.planner.plan_batch`, steps 1 and 2 of its algorithm)."""

from __future__ import annotations

import heapq

import numpy as np

from .bands import band_kv_rows
from .cost import CostModel, doc_pairs


def held_cap_bound(lens: np.ndarray, num_servers: int, cost: CostModel, min_shard: int,
                    window: int | None = None) -> int:
    """Bytes no plan can keep every server's held activations below (kept activations): the
    mean (every token's Q, O, LSE rows and K, V rows are held somewhere), and for each document
    the server holding its first shard, which needs at least ``min_shard`` Q rows (the whole
    document when it is shorter) and the KV rows of its first band ``[0, min_shard)``: all of
    them without a window, the band's windows (:func:`band_kv_rows`) with one."""
    hq, hkv = cost.held_row_bytes()
    if not len(lens):
        return 0
    total = int(lens.sum()) * (hq + hkv)
    longest = int(lens.max())
    if window is None or window >= longest:
        first = longest * hkv + min(longest, min_shard) * hq
    else:  # the longest document need not hold the most: its band's KV is only its windows
        first = max(band_kv_rows(l, 0, min(min_shard, (l + 1) // 2), window) * hkv + min(l, min_shard) * hq
                    for l in set(lens.tolist()))
    return max(-(-total // num_servers), first)



class PlacedBatch:
    """The batch as arrays, its initial placement and an index of each server's documents by
    length (shared by every run of the greedy)."""

    def __init__(self, counts: np.ndarray, lens: np.ndarray, num_servers: int, cost: CostModel,
                 mode: str, min_shard: int, window: int | None = None, keep_activations: bool = False,
                 held_cap: int | None = None):
        self.S, self.min_shard, self.inplace = num_servers, min_shard, mode == "inplace"
        self.window = window
        self.q_bytes, self.kv_bytes = cost.step_row_bytes(keep_activations)
        # Kept activations under a cap: held bytes per server are tracked, and no move (nor the
        # dedicated initial placement) fills a server past the cap.
        self.held_cap = held_cap
        self.hq, self.hkv = cost.held_row_bytes()
        self.counts, self.lens_arr, self.N = counts, lens, len(lens)
        self.rank_arr = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        longest = int(lens.max()) if self.N else 0
        self.small = longest < 2**31 and self.N * longest**2 < 2**62  # all sums of pairs fit int64
        pairs = doc_pairs(lens, window) if self.small else None
        doc_held = lens * (self.hq + self.hkv)  # a whole document holds all its rows, window or not
        if self.inplace:
            self.init_server_arr = self.rank_arr
            if self.small:
                ends = np.cumsum(counts)
                cum = np.concatenate([[0], np.cumsum(pairs)])
                self.init_loads = (cum[ends] - cum[ends - counts]).tolist()
            else:
                self.init_loads = [0] * num_servers
                for r, l in zip(self.rank_arr.tolist(), lens.tolist()):
                    self.init_loads[r] += doc_pairs(l, window)
        else:
            self._place_lpt(pairs.tolist() if self.small else [doc_pairs(l, window) for l in lens.tolist()],
                            doc_held.tolist())
        self.init_held = None if held_cap is None else np.bincount(
            self.init_server_arr, weights=doc_held, minlength=num_servers).astype(np.int64).tolist()
        # Index: documents by (initial server, splittable, length, -index); a server's unsplittable
        # documents are positions [seg[2s], seg[2s+1]), its splittable ones [seg[2s+1], seg[2s+2]).
        segment = self.init_server_arr * 2 + ((lens + 1) // 2 >= 2 * min_shard)
        if self.small and num_servers < 2**29:
            # One stable sort on a packed key; sorting the reversed array puts equal keys in
            # descending document order.
            order = self.N - 1 - np.argsort(((segment << 32) | lens)[::-1], kind="stable")
        else:
            order = np.lexsort((-np.arange(self.N), lens, segment))
        self.sgid = order.tolist()
        self.slen = lens[order].tolist()
        self.seg = np.searchsorted(segment[order], np.arange(2 * num_servers + 1)).tolist()

    def _place_lpt(self, pairs: list[int], doc_held: list[int]) -> None:
        """Longest first, each document to the least-loaded server (ties: lower server); under a
        held-bytes cap, the least-loaded server it fits on (else the least-loaded one: the plan is
        then refused if no move brings it within the cap).

        Under a cap "least loaded" weighs memory too: a server's key is the larger of its FLOPs
        and its held bytes, each over its mean. Plain LPT gives the short documents (many rows,
        few FLOPs) to the servers the long ones left idle, which then hold up to 2.3x the mean
        bytes; under a cap those servers fill up while their FLOPs stay low, and the long
        documents' bands find no server with both FLOP and memory room. Without a cap plain LPT
        stays: its FLOP balance is what the greedy starts from.
        """
        loads = [0] * self.S
        held = [0] * self.S
        server = [0] * self.N
        heap = [(0, s) for s in range(self.S)]
        cap = self.held_cap
        if cap is not None and self.N:
            per_load, per_held = self.S / max(1, sum(pairs)), self.S / max(1, sum(doc_held))
            key = lambda s: max(loads[s] * per_load, held[s] * per_held)  # noqa: E731
        else:
            key = loads.__getitem__
        for g in np.lexsort((np.arange(self.N), -self.lens_arr)).tolist():
            skipped = []
            while cap is not None and heap and held[heap[0][1]] + doc_held[g] > cap:
                skipped.append(heapq.heappop(heap))
            _, s = heapq.heappop(heap) if heap else skipped.pop(0)
            for entry in skipped:
                heapq.heappush(heap, entry)
            server[g] = s
            loads[s] += pairs[g]
            held[s] += doc_held[g]
            heapq.heappush(heap, (key(s), s))
        self.init_loads = loads
        self.init_server_arr = np.asarray(server, dtype=np.int64).reshape(-1)

