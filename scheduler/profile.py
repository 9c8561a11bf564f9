"""Measured attention-kernel latency of one CA-task over a ``(q_len, kv_len)`` grid.

Pure Python + numpy (no torch). Units: lengths are tokens, latencies are seconds. The planner
prices CA-tasks with it (:mod:`scheduler.time_cost`, DistCA §4.2's profiled cost); the simulator
re-exports it as ``distca_sim.profile.ProfileTable``.

A FLOP count alone predicts kernel time badly for small tasks (launch overhead, tiles that are
only partly full) and well for large ones (the kernel runs at its saturated throughput). A
:class:`ProfileTable` stores what a benchmark measured on a grid of query and key lengths and
answers any ``(q_len, kv_len)`` by

* **bilinear interpolation** inside the grid;
* **saturation** past the largest grid point: the kernel is assumed to keep the throughput it had
  at the grid's edge, so the latency at the clamped point is scaled by the ratio of causal
  ``(query, key)`` pairs, ``work(q, kv) / work(q_clamped, kv_clamped)``;
* **a floor** below the smallest grid point: the clamped latency is kept as is (launch overhead does
  not shrink with the task), never scaled down.

``work(q, kv)`` is the number of pairs of a bottom-right aligned causal task with ``q`` query rows and
``kv`` keys, ``scheduler.cost.causal_pairs(kv - q, kv, 0, kv)``; for ``q <= kv`` it equals
``q·kv − q(q−1)/2``.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .checks import INT64_MAX, finite_nonnegative, finite_positive, is_int
from .cost import CostModel, causal_pairs

__all__ = ["ProfileTable", "read_profile_dir"]

_JSON_KEYS = ("q_lens", "kv_lens", "latency_s", "meta")


def _check_axis(name: str, values: Any) -> list[int]:
    """Validate one grid axis: a non-empty, strictly increasing list of positive ints."""
    try:
        vals = list(values)
    except TypeError:
        raise ValueError(f"{name} must be a list of ints, got {values!r}") from None
    if not vals:
        raise ValueError(f"{name} must not be empty")
    bad = [v for v in vals if not is_int(v)]
    if bad:
        raise ValueError(f"{name} must hold ints, got non-int values {bad[:5]!r}")
    vals = [int(v) for v in vals]
    nonpos = [v for v in vals if v <= 0]
    if nonpos:
        raise ValueError(f"{name} must be positive, got {nonpos[:5]}")
    big = [v for v in vals if v > INT64_MAX]
    if big:  # the grid is held as int64
        raise ValueError(f"{name} must be at most 2**63 - 1, got {big[:5]}")
    steps = [(i, vals[i], vals[i + 1]) for i in range(len(vals) - 1) if vals[i + 1] <= vals[i]]
    if steps:
        i, a, b = steps[0]
        raise ValueError(
            f"{name} must be strictly increasing, got {name}[{i}]={a} then {name}[{i + 1}]={b}"
        )
    return vals


_EXACT_LEN = 2**31  # lengths up to this keep q·kv in int64: pairs exact (as floats, below 2**53)


def _work_np(q: np.ndarray, kv: np.ndarray) -> np.ndarray:
    """Vectorised ``causal_pairs(kv - q, kv, 0, kv)`` as float64: exact below 2**53 pairs with
    both lengths at most 2**31, else rounded to float64 (never wrapped).

    Rows ``i`` of ``[0, q)`` see ``min(kv, max(0, i + kv - q + 1))`` keys: for ``q <= kv`` that is
    ``q·kv − q(q−1)/2``; for ``q > kv`` the first ``q − kv`` rows see nothing and the rest form a
    full triangle, ``kv(kv+1)/2``.
    """
    q = q.astype(np.int64)
    kv = kv.astype(np.int64)
    big = (q > _EXACT_LEN) | (kv > _EXACT_LEN)  # their products would wrap in int64
    small_q, small_kv = np.where(big, 0, q), np.where(big, 0, kv)
    le = small_q * small_kv - (small_q * (small_q - 1)) // 2
    gt = (small_kv * (small_kv + 1)) // 2
    out = np.where(small_q <= small_kv, le, gt).astype(np.float64)
    if big.any():  # past 2**31 tokens, float64 (16 digits) instead of a wrapped int64
        qf, kf = q[big].astype(np.float64), kv[big].astype(np.float64)
        out[big] = np.where(qf <= kf, qf * kf - qf * (qf - 1) / 2, kf * (kf + 1) / 2)
    return out


def _work(q: int, kv: int) -> int:
    """Causal pairs of a bottom-right task with ``q`` rows and ``kv`` keys (see module doc)."""
    return causal_pairs(kv - q, kv, 0, kv)


@dataclass(frozen=True)
class ProfileTable:
    """Measured attention kernel latency (seconds) of one CA-task over a (q_len, kv_len) grid.

    Args:
        q_lens: query lengths of the grid, tokens; strictly increasing, positive ints.
        kv_lens: key/value lengths of the grid, tokens; strictly increasing, positive ints.
        latency_s: ``latency_s[i][j]`` is the forward latency in seconds of one causal
            (bottom-right aligned) task with ``q_lens[i]`` query rows and ``kv_lens[j]`` keys;
            shape ``[len(q_lens)][len(kv_lens)]``, finite and ``>= 0``. Grid points with
            ``q_len > kv_len`` are allowed (they are never real tasks but keep the grid
            rectangular).
        meta: free-form, JSON-serialisable description: device, dtype, heads, head_dim, backend...

    The table is immutable (frozen); values are normalised to Python ``int``/``float`` lists.

    Raises:
        ValueError: non-int, non-positive or non-increasing grid values, a latency matrix of the
            wrong shape, or a negative / NaN / infinite latency (the message names them).
    """

    q_lens: list[int]
    kv_lens: list[int]
    latency_s: list[list[float]]
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        q_lens = _check_axis("q_lens", self.q_lens)
        kv_lens = _check_axis("kv_lens", self.kv_lens)
        try:
            rows = [list(r) for r in self.latency_s]
        except TypeError:
            raise ValueError(
                f"latency_s must be a list of {len(q_lens)} rows, got {self.latency_s!r}"
            ) from None
        if len(rows) != len(q_lens) or any(len(r) != len(kv_lens) for r in rows):
            shape = [len(r) for r in rows]
            raise ValueError(
                f"latency_s must have shape [{len(q_lens)}][{len(kv_lens)}] "
                f"(len(q_lens) x len(kv_lens)), got {len(rows)} rows of lengths {shape}"
            )
        bad = []
        matrix = []
        for i, row in enumerate(rows):
            out_row = []
            for j, v in enumerate(row):
                if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.number)):
                    bad.append((q_lens[i], kv_lens[j], v))
                    continue
                try:
                    f = float(v)
                except OverflowError:  # an int past float64
                    f = math.inf
                if not math.isfinite(f) or f < 0:
                    bad.append((q_lens[i], kv_lens[j], v))
                out_row.append(f)
            matrix.append(out_row)
        if bad:
            shown = ", ".join(f"(q={q}, kv={k}): {v!r:.40}" for q, k, v in bad[:5])
            raise ValueError(
                f"latency_s must be finite numbers >= 0; {len(bad)} bad value(s): {shown}"
            )
        if not isinstance(self.meta, dict):
            raise ValueError(f"meta must be a dict, got {type(self.meta).__name__}")
        object.__setattr__(self, "q_lens", q_lens)
        object.__setattr__(self, "kv_lens", kv_lens)
        object.__setattr__(self, "latency_s", matrix)
        object.__setattr__(self, "meta", dict(self.meta))
        object.__setattr__(self, "_q", np.asarray(q_lens, dtype=np.int64))
        object.__setattr__(self, "_kv", np.asarray(kv_lens, dtype=np.int64))
        object.__setattr__(self, "_lat", np.asarray(matrix, dtype=np.float64))

    # ---- lookup ------------------------------------------------------------------------------
    @staticmethod
    def _check_lens(q_len: Any, kv_len: Any) -> tuple[int, int]:
        if not is_int(q_len) or not is_int(kv_len):
            raise ValueError(f"q_len and kv_len must be ints, got q_len={q_len!r}, kv_len={kv_len!r}")
        q_len, kv_len = int(q_len), int(kv_len)
        if q_len < 0 or kv_len < 0:
            raise ValueError(f"lengths must be >= 0, got q_len={q_len}, kv_len={kv_len}")
        if q_len > kv_len:
            raise ValueError(
                f"q_len={q_len} > kv_len={kv_len}: a causal CA-task has at most as many query "
                f"rows as keys"
            )
        return q_len, kv_len

    @staticmethod
    def _bracket(grid: list[int], x: int) -> tuple[int, float]:
        """Index ``i`` and weight ``w`` with ``x = (1-w)·grid[i] + w·grid[i+1]`` (x inside grid)."""
        if len(grid) == 1:
            return 0, 0.0
        i = min(max(bisect.bisect_right(grid, x) - 1, 0), len(grid) - 2)
        return i, (x - grid[i]) / (grid[i + 1] - grid[i])

    def _bilinear(self, q: int, kv: int) -> float:
        """Bilinear interpolation of the table at a point inside the grid."""
        i, wq = self._bracket(self.q_lens, q)
        j, wk = self._bracket(self.kv_lens, kv)
        lat = self.latency_s
        i1 = min(i + 1, len(self.q_lens) - 1)
        j1 = min(j + 1, len(self.kv_lens) - 1)
        return ((1 - wq) * ((1 - wk) * lat[i][j] + wk * lat[i][j1])
                + wq * ((1 - wk) * lat[i1][j] + wk * lat[i1][j1]))

    def latency(self, q_len: int, kv_len: int) -> float:
        """Predicted forward latency in seconds of one causal CA-task.

        Args:
            q_len: query rows of the task, tokens.
            kv_len: keys the task attends to, tokens (bottom-right causal alignment).

        Each coordinate is first raised to the grid's smallest value (``f``: the launch-overhead
        floor, never scaled down), then lowered to the grid's largest value (``c``). With ``T``
        the bilinear interpolation of the table,

            ``latency = T(c) · work(f) / work(c)``

        so the ratio is 1 inside or below the grid and, past the grid, the task runs at the
        throughput (pairs per second) measured at the grid's edge. ``q_len == 0`` costs 0.0.

        Raises:
            ValueError: non-int or negative lengths, or ``q_len > kv_len``.
        """
        q_len, kv_len = self._check_lens(q_len, kv_len)
        if q_len == 0:
            return 0.0
        qf = max(q_len, self.q_lens[0])
        kf = max(kv_len, self.kv_lens[0])
        qc = min(qf, self.q_lens[-1])
        kc = min(kf, self.kv_lens[-1])
        base = self._bilinear(qc, kc)
        if qc == qf and kc == kf:
            return base
        return base * _work(qf, kf) / _work(qc, kc)

    def latencies(self, q_lens: Any, kv_lens: Any) -> np.ndarray:
        """Vectorised :meth:`latency` over broadcastable integer arrays; returns float64 seconds.

        Raises:
            ValueError: non-integer values, negative lengths, ``q_len > kv_len`` anywhere, or
                shapes that do not broadcast.
        """
        q = self._int_array("q_lens", q_lens)
        kv = self._int_array("kv_lens", kv_lens)
        try:
            q, kv = np.broadcast_arrays(q, kv)
        except ValueError:
            raise ValueError(f"shapes do not broadcast: q_lens {q.shape}, kv_lens {kv.shape}") from None
        neg = (q < 0) | (kv < 0)
        if neg.any():
            k = tuple(np.argwhere(neg)[0])
            raise ValueError(f"lengths must be >= 0, got q_len={q[k]}, kv_len={kv[k]} at index {k}")
        over = q > kv
        if over.any():
            k = tuple(np.argwhere(over)[0])
            raise ValueError(
                f"q_len > kv_len at index {k}: q_len={q[k]}, kv_len={kv[k]} "
                f"({int(over.sum())} such pair(s))"
            )
        return self._latencies_unchecked(q, kv)

    def _latencies_unchecked(self, q: np.ndarray, kv: np.ndarray) -> np.ndarray:
        """:meth:`latencies` of int64 arrays of one shape already known to hold ``0 <= q <= kv``
        (the planner's inner loop, :mod:`scheduler.time_cost`); float64 seconds."""
        qf = np.maximum(q, self._q[0])
        kf = np.maximum(kv, self._kv[0])
        qc = np.minimum(qf, self._q[-1])
        kc = np.minimum(kf, self._kv[-1])
        base = np.array(self._bilinear_np(qc, kc), dtype=np.float64, ndmin=1).reshape(q.shape)
        scaled = (qc != qf) | (kc != kf)
        if scaled.any():
            base[scaled] *= _work_np(qf[scaled], kf[scaled]) / _work_np(qc[scaled], kc[scaled])
        base[q == 0] = 0.0
        return base

    @staticmethod
    def _int_array(name: str, x: Any) -> np.ndarray:
        arr = np.asarray(x)
        if arr.dtype.kind in "iu":
            return arr.astype(np.int64)
        if (arr.dtype.kind == "f" and np.all(np.isfinite(arr)) and np.all(arr == np.floor(arr))
                and np.all(np.abs(arr) < 2.0**63)):  # larger floats would wrap in the cast
            return arr.astype(np.int64)
        raise ValueError(f"{name} must hold integers (int64), got dtype {arr.dtype} values {arr.ravel()[:5]}")

    def _cells(self) -> tuple:
        """Per grid cell ``(i, j)`` the coefficients of its bilinear form, flattened: with
        ``dq = q - q_lens[i]``, ``dk = kv - kv_lens[j]``,
        ``T = c0 + dq · (cq + cqk · dk) + ck · dk`` (the four-corner interpolation, rearranged so a
        lookup gathers from one flat index). Built on first use."""
        cells = self.__dict__.get("_cells_cache")
        if cells is None:
            lat, q, kv = self._lat, self._q.astype(np.float64), self._kv.astype(np.float64)
            nq, nk = lat.shape
            i1, j1 = min(1, nq - 1), min(1, nk - 1)
            l00 = lat[:max(nq - 1, 1), :max(nk - 1, 1)]
            l10 = lat[i1:, :max(nk - 1, 1)] if nq > 1 else l00
            l01 = lat[:max(nq - 1, 1), j1:] if nk > 1 else l00
            l11 = lat[i1:, j1:] if nq > 1 and nk > 1 else (l10 if nk == 1 else l01)
            dq = (np.diff(q) if nq > 1 else np.ones(1))[:, None]
            dk = (np.diff(kv) if nk > 1 else np.ones(1))[None, :]
            cq = (l10 - l00) / dq if nq > 1 else np.zeros_like(l00)
            ck = (l01 - l00) / dk if nk > 1 else np.zeros_like(l00)
            cqk = (l11 - l10 - l01 + l00) / (dq * dk) if nq > 1 and nk > 1 else np.zeros_like(l00)
            cells = tuple(c.ravel().copy() for c in (l00, cq, ck, cqk)) + (l00.shape[1],)
            object.__setattr__(self, "_cells_cache", cells)
        return cells

    @staticmethod
    def _cell_index(grid: np.ndarray, x: np.ndarray) -> np.ndarray:
        if len(grid) == 1:
            return np.zeros(x.shape, dtype=np.intp)
        return np.clip(np.searchsorted(grid, x, side="right") - 1, 0, len(grid) - 2)

    def _bilinear_np(self, q: np.ndarray, kv: np.ndarray) -> np.ndarray:
        """Bilinear interpolation of the table at int64 points inside the grid."""
        c0, cq, ck, cqk, width = self._cells()
        i, j = self._cell_index(self._q, q), self._cell_index(self._kv, kv)
        flat = i * width + j
        dq = q - self._q[i]
        dk = kv - self._kv[j]
        return c0[flat] + dq * (cq[flat] + cqk[flat] * dk) + ck[flat] * dk

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_flops(cls, rate_flops_per_s: float, overhead_s: float, q_lens: list[int],
                   kv_lens: list[int], cost: CostModel) -> "ProfileTable":
        """An analytic table for when nothing was measured yet.

        ``latency_s[i][j] = overhead_s + cost.task_flops(kv − q, kv, 0, kv) / rate_flops_per_s``
        with ``q = q_lens[i]``, ``kv = kv_lens[j]``: a fixed launch cost plus forward FLOPs at a
        constant throughput. (Past the grid, :meth:`latency` scales the whole entry, overhead
        included, by the pair ratio: a slight over-estimate that vanishes for large grids.)

        Args:
            rate_flops_per_s: sustained kernel throughput, FLOP/s; finite and > 0.
            overhead_s: per-call overhead, seconds; finite and >= 0.
            q_lens, kv_lens: the grid, tokens.
            cost: the attention shape (:class:`scheduler.cost.CostModel`).

        Raises:
            ValueError: a bad rate, overhead, grid or cost.
        """
        finite_positive("rate_flops_per_s", rate_flops_per_s)
        finite_nonnegative("overhead_s", overhead_s)
        if not isinstance(cost, CostModel):
            raise ValueError(f"cost must be a scheduler.cost.CostModel, got {type(cost).__name__}")
        qs = _check_axis("q_lens", q_lens)
        ks = _check_axis("kv_lens", kv_lens)
        lat = [[overhead_s + cost.task_flops(k - q, k, 0, k) / rate_flops_per_s for k in ks]
               for q in qs]
        meta = {"source": "analytic", "rate_flops_per_s": float(rate_flops_per_s),
                "overhead_s": float(overhead_s), "cost": cost.to_dict()}
        return cls(q_lens=qs, kv_lens=ks, latency_s=lat, meta=meta)

    # ---- serialisation -----------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Plain dict with keys ``q_lens``, ``kv_lens``, ``latency_s``, ``meta`` (copies)."""
        return {"q_lens": list(self.q_lens), "kv_lens": list(self.kv_lens),
                "latency_s": [list(r) for r in self.latency_s], "meta": dict(self.meta)}

    @classmethod
    def from_dict(cls, d: dict) -> "ProfileTable":
        """Inverse of :meth:`to_dict`; ``meta`` may be missing.

        Raises:
            ValueError: not a dict, missing or unknown keys, or invalid values.
        """
        if not isinstance(d, dict):
            raise ValueError(f"expected a dict, got {type(d).__name__}")
        missing = [k for k in _JSON_KEYS[:3] if k not in d]
        unknown = sorted(set(d) - set(_JSON_KEYS))
        if missing or unknown:
            raise ValueError(f"ProfileTable dict: missing keys {missing}, unknown keys {unknown}")
        return cls(q_lens=d["q_lens"], kv_lens=d["kv_lens"], latency_s=d["latency_s"],
                   meta=d.get("meta", {}))

    def to_json(self, path: str | Path) -> None:
        """Write :meth:`to_dict` as JSON to ``path``."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_json(cls, path: str | Path) -> "ProfileTable":
        """Read a table written by :meth:`to_json`.

        Raises:
            ValueError: the file is not valid JSON or does not describe a valid table.
        """
        try:
            d = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(d)


def read_profile_dir(directory) -> tuple["ProfileTable", "ProfileTable"]:
    """The ``(forward, backward)`` tables of an attention profile folder: ``forward.json`` and
    ``backward.json``, each :class:`ProfileTable` JSON (``bench/gpu_kernels.py --sections profile``
    writes them; ``distca_sim/data/profiles/`` ships measured ones).

    Raises:
        ValueError: a missing or unreadable file or an invalid table (the message names the folder
            and file, and the OS's reason where reading failed).
    """
    folder = Path(directory)
    tables = []
    for kind in ("forward", "backward"):
        path = folder / f"{kind}.json"
        try:
            found = path.is_file()
            if found:
                tables.append(ProfileTable.from_json(path))
        except OSError as exc:  # a file this process may not read, or a folder it may not search
            raise ValueError(f"attention profile {folder}: {kind}.json: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise ValueError(f"attention profile {folder}: {kind}.json: {exc}") from None
        if not found:
            raise ValueError(f"attention profile {folder}: no {kind}.json there (expected "
                             f"forward.json and backward.json, ProfileTable JSON)")
    return tables[0], tables[1]
