"""What a CA-task costs: (windowed) causal attention FLOPs and bytes per token (measured latency: profile.py).

Pure Python (no torch). Units: FLOPs are floating-point operations (a multiply-add counts 2),
bytes are bytes, latencies are seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

# Rows of these tensors follow the KV rows of a document; every other tensor follows the query shard.
KV_TENSORS = frozenset({"k", "v", "dk", "dv"})
# What a server keeps of a forward round until that layer's backward round when activations are
# kept: the rows it received and its results. The backward round then dispatches only dO.
KEPT_TENSORS = ("q", "k", "v", "out", "lse")
# What a kept backward round also dispatches for the query rows of *split* CA-tasks (:func:`is_split`):
# the owner's merged O and LSE. FlashAttention-2's backward needs the merged ones (D = rowsum(dO ∘ O),
# P = exp(S - LSE)); a server running one key piece of a shard computed only a partial O and LSE,
# which it therefore does not keep.
MERGED_TENSORS = ("out", "lse")


class RoundKind(str, Enum):
    """The two uses of a plan in a step, and the tensors each one moves (DESIGN "round").

    A round is a dispatch all-to-all (clients -> servers: :meth:`dispatch_with`, in wire order)
    and a return all-to-all (servers -> clients: :attr:`returns`). The value is the name used in
    metrics, ``Plan.comm_bytes()`` and traffic counters; :attr:`code` is the round header's int.

    With kept activations (``keep_activations=True``) the servers hold :data:`KEPT_TENSORS` of
    each forward round until its backward round, which then dispatches ``dout`` for every query
    row and :data:`MERGED_TENSORS` for the query rows of split tasks only
    (:meth:`split_dispatch_with`). The forward round is the same either way.
    """

    FORWARD = "forward"
    BACKWARD = "backward"

    def dispatch_with(self, keep_activations: bool) -> tuple[str, ...]:
        """The tensors clients send servers for every row of their class (query or KV rows) in
        this round, in wire order: what the caller of a round passes."""
        if self is RoundKind.FORWARD:
            return ("q", "k", "v")
        return ("dout",) if keep_activations else ("q", "k", "v", "out", "lse", "dout")

    def split_dispatch_with(self, keep_activations: bool) -> tuple[str, ...]:
        """The tensors clients send after :meth:`dispatch_with`'s, for the query rows of split
        tasks only (:func:`is_split`), in wire order: :data:`MERGED_TENSORS` in a kept backward
        round, else none. The client's participant keeps them from the forward round's merge."""
        return MERGED_TENSORS if self is RoundKind.BACKWARD and keep_activations else ()

    def tensors_with(self, keep_activations: bool) -> tuple[str, ...]:
        """Every tensor that may cross the network in this round: dispatch (:meth:`dispatch_with`,
        then :meth:`split_dispatch_with`), then return."""
        return self.dispatch_with(keep_activations) + self.split_dispatch_with(keep_activations) + self.returns

    @property
    def dispatch(self) -> tuple[str, ...]:
        """:meth:`dispatch_with` of a stateless round (the servers keep nothing)."""
        return self.dispatch_with(False)

    @property
    def returns(self) -> tuple[str, ...]:
        return ("out", "lse") if self is RoundKind.FORWARD else ("dq", "dk", "dv")

    @property
    def tensors(self) -> tuple[str, ...]:
        """:meth:`tensors_with` of a stateless round."""
        return self.tensors_with(False)

    @property
    def code(self) -> int:
        return 1 if self is RoundKind.FORWARD else 2

    @classmethod
    def from_code(cls, code: int) -> "RoundKind":
        """Raises ValueError for a code that names no round kind."""
        for kind in cls:
            if kind.code == code:
                return kind
        raise ValueError(f"no round kind has code {code!r}")


BACKWARD_FLOPS_FACTOR = 2.5


def window_arg(window) -> int | None:
    """``window`` as a Python int, or None (full causal attention): the one check of a window.

    Raises:
        ValueError: anything but None or a positive int (bool refused).
    """
    if window is None:
        return None
    if (not isinstance(window, (int, np.integer)) or isinstance(window, (bool, np.bool_)) or window < 1
            or window > np.iinfo(np.int64).max):  # it meets int64 arrays
        raise ValueError(f"window must be a positive int up to 2**63 - 1 (query i sees keys i-window+1 .. i) "
                         f"or None (full causal), got {window!r}")
    return int(window)


def window_kv_start(q_start, window):
    """First key a query shard starting at ``q_start`` needs: ``max(0, q_start - window + 1)``,
    or 0 with no window. Works elementwise on int64 arrays."""
    if window is None:
        return q_start * 0
    return np.maximum(q_start - window + 1, 0) if isinstance(q_start, np.ndarray) else max(0, q_start - window + 1)


def is_split(q_start, q_end, kv_start, kv_end, window=None):
    """Whether a CA-task is *split*: not its query shard's whole window of keys, i.e. NOT
    (``kv_start == max(0, q_start - window + 1)`` (0 with no window) and ``kv_end == q_end``).

    The tasks of a valid plan (:mod:`scheduler.cover`) tile each shard's keys, so a task is split
    exactly when its shard is cut on the key axis (partial-KV tasks): its O and LSE are partials
    that only the query's owner can merge. Decided from the task row alone; elementwise on int64
    arrays (returns bool [n]), a bool for scalars.
    """
    lo = window_kv_start(q_start, window)
    if isinstance(lo, np.ndarray) or isinstance(kv_start, np.ndarray):
        return (kv_start != lo) | (kv_end != q_end)
    return bool(kv_start != lo or kv_end != q_end)


def _causal_prefix(x, kv_start, kv_end, lo, hi):
    """Pairs ``(i, j)``, ``i < x`` (any integer, negative too), ``j`` in ``[kv_start, kv_end)``,
    ``j <= i``: with ``d = clamp(x - kv_start, 0, n)``, ``d (d + 1) / 2 + max(0, x - kv_end) n``.
    ``lo``/``hi`` are max/min (builtins for ints, numpy's for arrays)."""
    n = kv_end - kv_start
    d = hi(lo(x - kv_start, 0), n)
    return d * (d + 1) // 2 + lo(x - kv_end, 0) * n


def causal_pairs(q_start, q_end, kv_start, kv_end, window=None):
    """(query, key) pairs a CA-task computes: THE definition of a task's work under a mask.

    Offsets are positions inside the document: query ``i`` of ``[q_start, q_end)`` sees key ``j``
    of ``[kv_start, kv_end)`` iff ``j <= i`` and, with a window ``W``, ``j >= i - W + 1``. A task
    whose ``kv_end == q_end`` is the kernels' bottom-right aligned causal block. For the usual
    task ``kv = [0, q_end)`` this is ``sum_{t=q_start}^{q_end-1} (t + 1)``.

    Scalars give an exact Python int. int64 (or float64) numpy arrays are computed elementwise
    (the caller keeps the products below 2**62, or passes float64 for values exact below 2**53);
    ``window`` is one int or None for all of them.

    Raises:
        ValueError: a negative range length (scalars), or a bad ``window``.
    """
    window = window_arg(window)
    if isinstance(q_start, np.ndarray) or isinstance(kv_end, np.ndarray):
        lo, hi = np.maximum, np.minimum
    else:
        if q_end < q_start or kv_end < kv_start:
            raise ValueError(f"negative range: q=[{q_start}, {q_end}), kv=[{kv_start}, {kv_end})")
        q_start, q_end, kv_start, kv_end = int(q_start), int(q_end), int(kv_start), int(kv_end)
        lo, hi = max, min
    pairs = (_causal_prefix(q_end, kv_start, kv_end, lo, hi)
             - _causal_prefix(q_start, kv_start, kv_end, lo, hi))
    if window is not None:  # minus the pairs with j <= i - W: query i - W sees them causally
        pairs = pairs - (_causal_prefix(q_end - window, kv_start, kv_end, lo, hi)
                         - _causal_prefix(q_start - window, kv_start, kv_end, lo, hi))
    return pairs


def doc_pairs(doc_len, window=None):
    """Pairs of a whole document: ``l (l + 1) / 2``, or with a window ``W < l``
    ``W (W + 1) / 2 + (l - W) W`` (:func:`causal_pairs` of the task ``[0, l) x [0, l)``)."""
    return causal_pairs(doc_len * 0, doc_len, doc_len * 0, doc_len, window)


@dataclass(frozen=True)
class CostModel:
    """Attention shape and element size that turn token counts into FLOPs and bytes.

    Args:
        num_heads_q: query heads (per client, after any tensor parallelism).
        num_heads_kv: key/value heads; ``num_heads_q % num_heads_kv == 0`` (GQA).
        head_dim: per-head dimension.
        dtype_bytes: bytes per element of Q, K, V, O and their gradients (2 for bf16).

    The LSE travels in float32, or float64 when ``dtype_bytes == 8`` (float64 runs keep their
    precision end to end).

    Raises:
        ValueError: a non-positive size, heads not divisible, or ``dtype_bytes`` not in 1, 2, 4, 8.
    """

    num_heads_q: int
    num_heads_kv: int
    head_dim: int
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        bad = {
            name: getattr(self, name)
            for name in ("num_heads_q", "num_heads_kv", "head_dim", "dtype_bytes")
            if not isinstance(getattr(self, name), int)
            or isinstance(getattr(self, name), bool)
            or getattr(self, name) <= 0
        }
        if bad:
            raise ValueError(f"CostModel sizes must be positive ints, got {bad}")
        if self.num_heads_q % self.num_heads_kv:
            raise ValueError(
                f"num_heads_q={self.num_heads_q} is not a multiple of num_heads_kv={self.num_heads_kv}"
            )
        if self.dtype_bytes not in (1, 2, 4, 8):
            raise ValueError(f"dtype_bytes must be 1, 2, 4 or 8, got {self.dtype_bytes}")

    # ---- FLOPs -------------------------------------------------------------------------------
    @property
    def flops_per_pair(self) -> int:
        """Forward FLOPs per (query, key) pair: ``4 · head_dim · num_heads_q``.

        Two matmuls (``Q Kᵀ`` and ``P V``) of ``2 · head_dim`` FLOPs each per pair and head; the
        convention of the FlashAttention-2 paper (Dao, 2023, §4.1), also used by DistCA §2.
        """
        return 4 * self.head_dim * self.num_heads_q

    def task_flops(self, q_start: int, q_end: int, kv_start: int, kv_end: int,
                   backward: bool = False, window: int | None = None) -> float:
        """Attention FLOPs of one CA-task (causal, within ``window`` if given).

        Forward = ``4 · head_dim · num_heads_q · pairs`` (see :func:`causal_pairs`); backward =
        2.5 × forward (five matmuls instead of two: FlashAttention-2 paper, §4.1).
        """
        flops = self.flops_per_pair * causal_pairs(q_start, q_end, kv_start, kv_end, window)
        return flops * BACKWARD_FLOPS_FACTOR if backward else float(flops)

    def doc_flops(self, doc_len: int, backward: bool = False, window: int | None = None) -> float:
        """FLOPs of a whole document of ``doc_len`` tokens (pairs: :func:`doc_pairs`)."""
        return self.task_flops(0, doc_len, 0, doc_len, backward, window)

    # ---- bytes -------------------------------------------------------------------------------
    @property
    def lse_bytes(self) -> int:
        """Bytes per LSE element: 4 (float32), or 8 when ``dtype_bytes == 8``."""
        return 8 if self.dtype_bytes == 8 else 4

    def bytes_per_token(self, tensor: str) -> int:
        """Bytes one token's row of ``tensor`` occupies on the wire.

        ``tensor`` is one of q, k, v, out, lse, dout, dq, dk, dv. Q-shaped rows hold
        ``num_heads_q · head_dim`` elements, KV-shaped rows ``num_heads_kv · head_dim``, LSE rows
        ``num_heads_q`` values of :attr:`lse_bytes`.

        Raises:
            ValueError: an unknown tensor name.
        """
        if tensor == "lse":
            return self.num_heads_q * self.lse_bytes
        if tensor in KV_TENSORS:
            return self.num_heads_kv * self.head_dim * self.dtype_bytes
        if tensor in ("q", "out", "dout", "dq"):
            return self.num_heads_q * self.head_dim * self.dtype_bytes
        raise ValueError(f"unknown tensor {tensor!r}; expected one of {RoundKind.BACKWARD.tensors}")

    def _row_bytes(self, names) -> tuple[int, int]:
        """``(bytes per query row, bytes per KV row)`` of the tensors ``names``."""
        q_row = sum(self.bytes_per_token(n) for n in names if n not in KV_TENSORS)
        kv_row = sum(self.bytes_per_token(n) for n in names if n in KV_TENSORS)
        return q_row, kv_row

    def step_row_bytes(self, keep_activations: bool = False) -> tuple[int, int]:
        """Bytes per query row and per KV row moved over one forward plus one backward round.

        Returns ``(q_row_bytes, kv_row_bytes)``; the planner ranks moves by FLOPs per these bytes.
        With ``keep_activations`` the backward round sends dO instead of Q, K, V, O, LSE, dO.
        These are the rows of unsplit tasks: a query row of a split task (partial-KV, made after
        the moves are weighed) moves :data:`MERGED_TENSORS` once more in a kept backward round,
        which :meth:`~scheduler.tasks.Plan.comm_bytes` counts.
        """
        return self._row_bytes([n for kind in RoundKind
                                for n in kind.dispatch_with(keep_activations) + kind.returns])

    def held_row_bytes(self) -> tuple[int, int]:
        """Bytes a server holds per received query row and per received KV row from a forward
        round until its backward round when activations are kept (:data:`KEPT_TENSORS`):
        ``(q + out + lse, k + v)``. A query row of a split task holds only ``q`` (its partial O
        and LSE are not kept; :data:`MERGED_TENSORS` come back in the backward round)."""
        return self._row_bytes(KEPT_TENSORS)

    def merged_row_bytes(self) -> int:
        """Bytes per query row of :data:`MERGED_TENSORS` (``out + lse``): what a split task's
        query row adds to a kept backward round, and what its owner keeps per split row."""
        return self._row_bytes(MERGED_TENSORS)[0]

    def to_wire(self) -> list[int]:
        """The one msgpack form of an attention shape: ``[num_heads_q, num_heads_kv, head_dim,
        dtype_bytes]`` (plan and part descriptors, scheduler reports)."""
        return [self.num_heads_q, self.num_heads_kv, self.head_dim, self.dtype_bytes]

    @classmethod
    def from_wire(cls, obj) -> "CostModel":
        """Inverse of :meth:`to_wire`.

        Raises:
            ValueError: not a list of four ints, or sizes :class:`CostModel` refuses.
        """
        if not isinstance(obj, (list, tuple)) or len(obj) != 4 or any(type(x) is not int for x in obj):
            raise ValueError(f"an attention shape must be four ints [num_heads_q, num_heads_kv, "
                             f"head_dim, dtype_bytes], got {obj!r}")
        return cls(*obj)

    def to_dict(self) -> dict:
        return {"num_heads_q": self.num_heads_q, "num_heads_kv": self.num_heads_kv,
                "head_dim": self.head_dim, "dtype_bytes": self.dtype_bytes}
