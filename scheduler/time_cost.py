"""The profiled-time cost of CA-tasks (DistCA §4.2): :class:`TimeModel`.

DistCA's scheduler predicts each CA-task's time from a profiled ``(query length, KV length)`` table
(§4.2) instead of counting FLOPs: small shards run far below a kernel's saturated throughput (the
measured backward of fused 128-token shards runs at 0.42x the speed of whole documents), so a plan
balanced in FLOPs is not balanced in time. A :class:`TimeModel` holds the measured forward and
backward :class:`~scheduler.profile.ProfileTable` and predicts, in seconds:

* a CA-task ``[q_start, q_end) x [kv_start, kv_end)`` (document offsets) with ``q = q_end - q_start``
  query rows and ``kv = kv_end - kv_start`` key rows costs

      ``forward(q', kv) + backward(q', kv)``, scaled by ``pairs / work(q', kv)``, plus ``task_s``

  with ``q' = min(q, kv)``, ``pairs`` the task's (query, key) pairs under the mask
  (:func:`scheduler.cost.causal_pairs`) and ``work(q', kv)`` those of the bottom-right causal task
  of that shape, which the table measured. A plain task (keys ``[0, q_end)``, no window) has
  ``pairs == work``, so it costs exactly the table's value; a windowed task or a past key block
  (:mod:`scheduler.partial`) is charged at the throughput the table measured for its shape;
* a server costs the sum of its tasks plus ``call_s`` when it runs any (one fused kernel call
  per round; a server without tasks costs 0).

The planner (:func:`scheduler.plan_batch` with ``time_model=`` or ``PlanConfig.attn_profile``)
balances these seconds (:mod:`scheduler.time_refine`). Pure Python + numpy (no torch).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .bound import _pieces as most_pieces
from .checks import finite_nonnegative
from .cost import CostModel, causal_pairs, window_kv_start
from .profile import ProfileTable, _work_np, read_profile_dir

__all__ = ["TimeBound", "TimeModel", "MIN_SHARD_FRACTION", "TILE_ROWS"]

# The min_shard rule (TimeModel.choose_min_shard): the smallest multiple of a FlashAttention tile
# (128 rows, DistCA §3) whose shard runs at this fraction of the best throughput the table shows.
TILE_ROWS = 128
MIN_SHARD_FRACTION = 0.65


class TimeBound(NamedTuple):
    """The time planner's level, in predicted seconds (see :meth:`TimeModel.bound`).

    Attributes:
        mean_s: the batch's documents' seconds, each whole, per server: ``Σ t(l_d) / S``.
        piece_s: the largest ``t(l_d) / K_d`` (``K_d``: the most pieces document ``d`` may be cut
            into, :mod:`scheduler.bound` fact 2).
        level_s: ``max(mean_s, piece_s)``.
    """

    mean_s: float
    piece_s: float
    level_s: float


@dataclass(frozen=True)
class TimeModel:
    """Predicted seconds of CA-tasks from measured latency tables (module doc; DistCA §4.2).

    Args:
        forward: forward latency (seconds) of one bottom-right causal task over ``(q_len, kv_len)``.
        backward: the backward's, same meaning.
        task_s: a fixed cost per CA-task, seconds (>= 0; 0 for tables measured per task inside
            fused calls, as ``bench/gpu_kernels.py`` measures them).
        call_s: a fixed cost per kernel call, seconds (>= 0): paid once by each server that runs
            any task.

    Raises:
        ValueError: a table that is not a :class:`ProfileTable`, a negative or non-finite
            ``task_s`` / ``call_s``, or tables whose ``meta["cost"]`` (the attention shape they
            were measured for) differ (the message names the values).
    """

    forward: ProfileTable
    backward: ProfileTable
    task_s: float = 0.0
    call_s: float = 0.0

    def __post_init__(self):
        for name in ("forward", "backward"):
            table = getattr(self, name)
            if not isinstance(table, ProfileTable):
                raise ValueError(f"TimeModel: {name} must be a ProfileTable, got {type(table).__name__} {table!r}")
        for name in ("task_s", "call_s"):
            object.__setattr__(self, name, finite_nonnegative(f"TimeModel: {name} (seconds)", getattr(self, name)))
        fc, bc = self.forward.meta.get("cost"), self.backward.meta.get("cost")
        if fc is not None and bc is not None and fc != bc:
            raise ValueError(f"TimeModel: the forward table was measured for the attention shape {fc}, "
                             f"the backward table for {bc}")
        shape = fc if fc is not None else bc
        try:  # checked here, not at the first plan: a table's meta is the user's file
            cost = None if shape is None else CostModel(**shape)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"TimeModel: meta['cost'] must be a CostModel's fields (num_heads_q, num_heads_kv, "
                             f"head_dim, dtype_bytes), got {shape!r} ({exc})") from None
        object.__setattr__(self, "_cost", cost)
        # Same grid (the measured tables): one table of forward + backward seconds, one lookup.
        if self.forward.q_lens == self.backward.q_lens and self.forward.kv_lens == self.backward.kv_lens:
            with np.errstate(over="ignore"):
                total = self.forward._lat + self.backward._lat
            if not np.isfinite(total).all():
                i, j = map(int, np.argwhere(~np.isfinite(total))[0])
                raise ValueError(f"TimeModel: forward + backward seconds at (q={self.forward.q_lens[i]}, "
                                 f"kv={self.forward.kv_lens[j]}) exceed float64: {self.forward._lat[i, j]!r} + "
                                 f"{self.backward._lat[i, j]!r}")
            both = total.tolist()
            combined = ProfileTable(q_lens=self.forward.q_lens, kv_lens=self.forward.kv_lens, latency_s=both)
            tables = (combined,)
        else:
            tables = (self.forward, self.backward)
        object.__setattr__(self, "_tables", tables)

    # ---- what a model was measured for --------------------------------------------------------
    @property
    def cost(self) -> CostModel | None:
        """The attention shape the tables were measured for (``meta["cost"]``), or None."""
        return self._cost

    def check_cost(self, cost: CostModel) -> None:
        """Raise ValueError when the tables were measured for another attention shape than ``cost``
        (a latency measured for other head counts would mis-price every task)."""
        mine = self.cost
        if mine is not None and mine != cost:
            raise ValueError(f"time_model: the tables were measured for the attention shape {mine.to_dict()}, "
                             f"the plan's cost is {cost.to_dict()}")

    # ---- seconds --------------------------------------------------------------------------------
    def _shape_seconds(self, q: np.ndarray, kv: np.ndarray) -> np.ndarray:
        """Forward + backward seconds of bottom-right causal tasks, int64 arrays ``0 <= q <= kv``."""
        out = self._tables[0]._latencies_unchecked(q, kv)
        for t in self._tables[1:]:
            out = out + t._latencies_unchecked(q, kv)
        return out

    def task_seconds(self, q_start, q_end, kv_start, kv_end, window: int | None = None) -> np.ndarray:
        """Predicted seconds (forward + backward + ``task_s``) of CA-tasks (module doc).

        Args:
            q_start, q_end, kv_start, kv_end: int64 arrays of one shape (broadcastable), document
                offsets with ``q_start < q_end`` and ``kv_start < kv_end`` (tasks of a Plan).
            window: the mask's window (None: full causal).

        Returns:
            float64 seconds, one per task.
        """
        qs, qe, ks, ke = np.broadcast_arrays(*(np.asarray(x, dtype=np.int64) for x in (q_start, q_end, kv_start, kv_end)))
        q, kv = qe - qs, ke - ks
        qq = np.minimum(q, kv)
        secs = self._shape_seconds(qq, kv)
        plain = (ks == 0) & (ke == qe) & (window is None)
        if not np.all(plain):
            pairs = causal_pairs(qs, qe, ks, ke, window).astype(np.float64)
            work = _work_np(qq, kv)
            secs = np.where(plain, secs, secs * pairs / np.maximum(work, 1.0))
        return secs + self.task_s

    def server_seconds(self, task_array: np.ndarray, num_servers: int, window: int | None = None) -> np.ndarray:
        """float64 [num_servers]: each server's predicted seconds for a plan's int64 [n, 7] task
        array (``Plan.task_array``): its tasks' :meth:`task_seconds` plus ``call_s`` if it has any."""
        arr = np.asarray(task_array, dtype=np.int64).reshape(-1, 7)
        secs = self.task_seconds(arr[:, 3], arr[:, 4], arr[:, 5], arr[:, 6], window)
        out = np.bincount(arr[:, 0], secs, minlength=num_servers)
        if self.call_s:
            out = out + self.call_s * (np.bincount(arr[:, 0], minlength=num_servers) > 0)
        return out

    def band_seconds(self, l, a, b, window: int | None = None) -> np.ndarray:
        """Seconds of head–tail bands ``[a, b)`` of documents of ``l`` tokens (int64 arrays, one
        shape, ``0 <= a <= b <= ceil(l / 2)``; 0 where ``a == b``): the head shard ``[a, b)`` and the
        tail shard ``[l - b, l - a)``, one merged shard ``[a, l - a)`` when ``b == ceil(l / 2)``
        (:func:`scheduler.bands.band_shards`), each with the keys its window needs."""
        l, a, b = np.broadcast_arrays(*(np.asarray(x, dtype=np.int64) for x in (l, a, b)))
        shape = l.shape
        l, a, b = l.reshape(-1), a.reshape(-1), b.reshape(-1)
        t0 = np.maximum(l - b, b)
        tail = np.flatnonzero(t0 != b)  # bands with a tail shard [t0, l - a); else one merged shard
        head_end = b.copy()
        merged = t0 == b
        head_end[merged] = (l - a)[merged]
        qs = np.concatenate([a, t0[tail]])
        qe = np.concatenate([np.maximum(head_end, a + 1), (l - a)[tail]])
        if window is None:  # plain tasks (keys [0, q_end)): the table's own shape
            secs = self._shape_seconds(qe - qs, qe) + self.task_s
        else:
            secs = self.task_seconds(qs, qe, window_kv_start(qs, window), qe, window)
        n = len(l)
        out = secs[:n]
        out[tail] += secs[n:]
        out[b <= a] = 0.0
        return out.reshape(shape)

    def whole_seconds(self, lens, window: int | None = None) -> np.ndarray:
        """Seconds of each document run whole (one task ``[0, l) x [0, l)``)."""
        l = np.asarray(lens, dtype=np.int64)
        return self.task_seconds(np.zeros_like(l), l, np.zeros_like(l), l, window)

    def bound(self, lens, num_servers: int, min_shard: int, window: int | None = None,
              whole: np.ndarray | None = None) -> TimeBound:
        """The time planner's level in seconds, ``max(mean_s, piece_s)`` (:class:`TimeBound`).

        It is the level of the whole documents: what a plan reaches if cutting a document changed
        no document's seconds. It is a lower bound on every plan's most loaded server only up to
        the factor ``ρ`` of the table, the least ratio of a cut document's pieces' seconds to the
        whole document's (then every plan's most loaded server holds at least ``ρ · level_s``,
        as in :mod:`scheduler.bound` with every piece and the mean scaled by ``ρ``). Cutting
        usually costs time (narrow shards run slower per pair), but a table may run a mid-length
        document's head–tail shards faster than the whole causal document: on the shipped
        tables ``ρ`` is 0.81-0.93 over even cuts into 2-64 bands of 1K-256K-token documents
        (``tests/unit/test_time_planner.py`` checks ``ρ >= 0.8``), so a time plan may end below
        ``level_s``. The planner aims at ``level_s`` and accepts a plan within ``(1 + ε) · level_s``
        (:func:`scheduler.plan_batch`); what is guaranteed is stated against the FLOP plans
        (:mod:`scheduler.time_refine`).
        Plus ``call_s`` (the most loaded server runs a call). ``whole``: the documents'
        :meth:`whole_seconds` when the caller has them already.
        """
        l = np.asarray(lens, dtype=np.int64).reshape(-1)
        S = int(num_servers)
        if l.size == 0:
            return TimeBound(0.0, 0.0, 0.0)
        whole = self.whole_seconds(l, window) if whole is None else np.asarray(whole, dtype=np.float64)
        mean = float(whole.sum()) / S + self.call_s
        piece = float((whole / most_pieces(l, S, min_shard)).max()) + self.call_s
        return TimeBound(mean, piece, max(mean, piece))

    # ---- min_shard --------------------------------------------------------------------------------
    def choose_min_shard(self, fraction: float = MIN_SHARD_FRACTION, tile: int = TILE_ROWS) -> int:
        """The ``min_shard`` a plan uses when the caller gives none: the smallest multiple ``m`` of
        ``tile`` rows whose shard, against the table's longest KV ``K`` (where a planner's shards
        sit: the tails of long documents), runs at ``fraction`` of the best throughput the table
        shows at ``K``:

            ``work(m, K) / t(m, K) >= fraction · max_q work(q, K) / t(q, K)``

        (``t``: forward + backward seconds, ``work``: causal pairs; ``q`` over the table's query
        grid). ``tile`` if even the widest grid shard does not reach it. On the shipped H100 / H200
        tables for Llama-3-8B and 34B (tp 8) this gives 256 (0.69-0.75 of the best at 128K keys;
        128-row shards run at 0.52-0.59).

        Raises:
            ValueError: ``fraction`` not in (0, 1], or ``tile`` not a positive int.
        """
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"choose_min_shard: fraction must be a number in (0, 1], got {fraction!r}")
        if isinstance(tile, bool) or not isinstance(tile, (int, np.integer)) or tile < 1:
            raise ValueError(f"choose_min_shard: tile must be a positive int, got {tile!r}")
        K = max(self.forward.kv_lens[-1], self.backward.kv_lens[-1])
        top = max(self.forward.q_lens[-1], self.backward.q_lens[-1], tile)
        grid = np.asarray(sorted(set(self.forward.q_lens) | set(self.backward.q_lens)), dtype=np.int64)
        m = np.arange(tile, min(top, K) + 1, tile, dtype=np.int64)
        # The best throughput over the grid's query lengths at K, and the candidates' own (a
        # table may have no query length <= K). A cell of zero seconds has no throughput to
        # compare: it is left out, not taken as infinitely fast.
        grid = np.concatenate([grid[grid <= K], m])
        best, rate = (self._rates(x, K) for x in (grid, m))
        if not np.isfinite(best).any():
            return int(tile)
        ok = np.flatnonzero(rate >= fraction * np.nanmax(best))
        return int(m[ok[0]]) if ok.size else int(tile)

    def _rates(self, q: np.ndarray, K: int) -> np.ndarray:
        """Causal pairs per second of ``q``-row shards against ``K`` keys; NaN where the table
        predicts zero seconds."""
        kv = np.full_like(q, K)
        seconds = self._shape_seconds(q, kv)
        return np.where(seconds > 0, _work_np(q, kv) / np.where(seconds > 0, seconds, 1.0), np.nan)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, directory, task_s: float = 0.0, call_s: float = 0.0) -> "TimeModel":
        """The model of a folder holding ``forward.json`` and ``backward.json`` (ProfileTable JSON,
        as ``bench/gpu_kernels.py --sections profile`` and ``distca_sim/data/profiles/`` hold them).
        Loaded once per folder and file modification times (cached).

        Raises:
            ValueError: not a folder, a missing or unreadable file, or an invalid table (the
                message names the path, and the OS's reason where reading it failed).
        """
        if not isinstance(directory, (str, os.PathLike)) or not str(directory):
            raise ValueError(f"attention profile must be a folder path, got {directory!r}")
        try:
            folder = Path(directory).expanduser().resolve()
            if not folder.is_dir():
                raise ValueError(f"attention profile {directory!r}: not a folder")
            stamps = tuple((folder / f"{kind}.json").stat().st_mtime_ns if (folder / f"{kind}.json").is_file() else -1
                           for kind in ("forward", "backward"))  # a missing file: read_profile_dir names it
        except OSError as exc:  # is_dir/stat raise for a folder this process may not search, a too long name
            raise ValueError(f"attention profile {directory!r}: {exc.strerror or exc}") from None
        return _load(str(folder), stamps, float(task_s), float(call_s))


@lru_cache(maxsize=16)
def _load(folder: str, stamps: tuple, task_s: float, call_s: float) -> TimeModel:
    forward, backward = read_profile_dir(folder)
    return TimeModel(forward, backward, task_s, call_s)
