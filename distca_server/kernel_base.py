"""The interface every attention backend implements (:class:`AttentionBackend`: validation, the
dtype fallback to the reference math, the contract of :mod:`distca_server.kernels`), and the mask
geometry the backends share: windows and per-sequence diagonals cut into pieces
(:func:`_mask_pieces`) or into one kernel call per FlashAttention ``(left, right)`` window
(:func:`mask_classes`, :class:`_BandedKernel`)."""

from __future__ import annotations

import math

import torch

from scheduler.cost import window_arg

from .dtypes import accumulation_dtype

_NEG_INF = float("-inf")


def _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k) -> None:
    # Shape-only checks: nothing here reads device memory, so GPU calls stay sync-free.
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise ValueError(f"expected q [T_q, H_q, D] and k, v [T_k, H_kv, D]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"num_heads_q={q.shape[1]} is not a multiple of num_heads_kv={k.shape[1]}")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v differ in dtype/device: {q.dtype}/{q.device}, {k.dtype}/{k.device}, "
                         f"{v.dtype}/{v.device}")
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.numel() < 1:
        raise ValueError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k "
                         f"{tuple(cu_seqlens_k.shape)} must both be [B + 1]")


def _sequences(cu_seqlens_q, cu_seqlens_k, total_q, total_k) -> list[tuple[int, int, int, int]]:
    """(q_start, q_end, k_start, k_end) per sequence, validated (host copy: CPU paths only)."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if cq[0] < 0 or ck[0] < 0 or cq[-1] > total_q or ck[-1] > total_k or any(
            a > b for a, b in zip(cq, cq[1:])) or any(a > b for a, b in zip(ck, ck[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing within [0, T]: cu_seqlens_q={cq} "
                         f"(T_q={total_q}), cu_seqlens_k={ck} (T_k={total_k})")
    return list(zip(cq, cq[1:], ck, ck[1:]))


def _mask_pieces(lq: int, lk: int, window: int | None, chunk_elems: int = 1 << 22, d: int | None = None):
    """How the CPU backend covers one sequence's mask with calls the aten ops can make.

    Row ``r`` sees key ``j`` iff ``r + d - W < j <= r + d``, ``d = lk - lq`` (bottom-right) unless
    given.
    Returns ``(r0, r1, c0, c1, kind)`` pieces: rows ``[r0, r1)`` against keys ``[c0, c1)`` with
    kind ``"full"`` (every pair visible), ``"causal"`` (a square, top-left causal: the ops'
    ``is_causal``) or ``"mask"`` (an additive mask built per piece, in chunks of rows whose mask
    holds at most ``chunk_elems`` entries). Pieces of one row add up to exactly its visible keys
    and are merged through their LSEs; no piece has a row that sees no key there, so the ops'
    LSE-0-for-empty-rows quirk never reaches the merge.
    """
    d = lk - lq if d is None else d
    r_lo = max(0, -d)  # rows before see no key (j <= r + d < 0)
    r_hi = lq if window is None else min(lq, lk + window - 1 - d)  # rows after: keys past the end
    if r_lo >= r_hi or lk == 0:
        return []
    if window is None or window >= lq + d:  # the window never bites
        # Rows [r_lo, r1) see keys [0, r + d]: a bottom-right block of r1 + d keys, cut into a full
        # block and a square; rows [r1, lq) see every key.
        r1 = min(max(lk - d, r_lo), lq)
        pieces = []
        if r1 > r_lo:
            if d + r_lo > 0:
                pieces.append((r_lo, r1, 0, d + r_lo, "full"))
            pieces.append((r_lo, r1, d + r_lo, r1 + d, "causal"))
        if r1 < lq:
            pieces.append((r1, lq, 0, lk, "full"))
        return pieces
    rows = max(64, min(1024, window, chunk_elems // (window + 1024)))
    return [(a, min(r_hi, a + rows), max(0, a + d - window + 1), min(lk, min(r_hi, a + rows) + d), "mask")
            for a in range(r_lo, r_hi, rows)]


def mask_classes(lq, lk, d, window: int | None) -> list[tuple[tuple[int, int], list[int]]]:
    """Group sequences by the FlashAttention ``window_size = (left, right)`` their masks need.

    Args:
        lq, lk, d: per sequence, query rows, keys and diagonal (lists of ints).
        window: the sliding window (None: none).

    Returns:
        ``[((left, right), [sequence indices]), ...]`` in order of first appearance; ``left`` /
        ``right`` are -1 where the mask has no bound on that side (every key the rows could reach
        there is visible). Empty sequences (no query rows or no keys) go with the first class, in
        index order; if every sequence is empty, that is the bottom-right class
        ``(W - 1 or -1, 0)``.

    Raises:
        ValueError: a sequence with keys past its last query's diagonal that some row must not
            see (``right`` would be negative), which no FlashAttention window expresses.
    """
    classes: dict[tuple[int, int], list[int]] = {}
    empty = []
    for b, (nq, nk, dd) in enumerate(zip(lq, lk, d)):
        if nq == 0 or nk == 0:
            # No (row, key) pair to mask: any window gives out 0, lse -inf and zero gradients, so
            # its diagonal must neither raise nor open a class (one more kernel call) of its own.
            empty.append(b)
            continue
        e = dd - (nk - nq)  # the diagonal's offset from the bottom-right one: (., e) bounds it
        # Bottom-right sequences keep (., 0); others whose keys every row sees up to the last
        # share (., -1) whatever their offset.
        right = 0 if e == 0 else -1 if nk - 1 <= dd else e
        left = -1 if window is None else window - 1 - e
        if left < 0 and window is not None and window >= nq + dd:
            left = -1  # the window never bites in this sequence
        # right = e < 0 (keys after the last row's diagonal) can be -1, the "unbounded" mark, so
        # refuse on the keys themselves (nk - 1 > dd), as the window test does for left == -1.
        if (right < 0 and nk - 1 > dd) or left < -1 or (
                window is not None and left == -1 and window < nq + dd):
            raise ValueError(f"sequence {b} (Lq={nq}, Lk={nk}, diagonal {dd}, window {window}) has keys "
                             f"no query may see; FlashAttention's window_size cannot express it")
        classes.setdefault((left, right), []).append(b)
    if empty:
        first = classes.setdefault(next(iter(classes), (-1 if window is None else window - 1, 0)), [])
        first[:] = sorted(first + empty)
    return list(classes.items())


def _class_calls(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask):
    """The kernel calls of a FlashAttention-style backend: ``[((left, right), rows)]`` where
    ``rows`` is None for one call over everything, else ``(q_index, k_index, cu_q, cu_k, max_q,
    max_k)``: the query and key rows of that class's sequences (gathered, then scattered back)."""
    if mask.diagonals is None:  # bottom-right everywhere: one call
        return [((-1 if mask.window is None else mask.window - 1, 0), None)]
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    lq = [b - a for a, b in zip(cq, cq[1:])]
    lk = [b - a for a, b in zip(ck, ck[1:])]
    classes = mask_classes(lq, lk, mask.diagonals, mask.window)
    if len(classes) == 1:
        return [(classes[0][0], None)]
    calls, dev = [], cu_seqlens_q.device

    def rows(cu, lens, idx):
        index = torch.cat([torch.arange(cu[i], cu[i] + lens[i]) for i in idx]) if idx else torch.zeros(0, dtype=torch.long)
        offsets = torch.tensor([0] + [lens[i] for i in idx]).cumsum(0).to(torch.int32)
        return index.to(dev), offsets.to(dev)
    for lr, idx in classes:
        qi, cuq = rows(cq, lq, idx)
        ki, cuk = rows(ck, lk, idx)
        calls.append((lr, (qi, ki, cuq, cuk, max(lq[i] for i in idx), max(lk[i] for i in idx))))
    return calls


class _BandedKernel:
    """FlashAttention-style backends: one ``window_size = (left, right)`` per kernel call, so a
    call with several mask classes runs one kernel call per class (:func:`_class_calls`)."""

    def _forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, mask):
        calls = _class_calls(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask)
        if calls[0][1] is None:
            return self._banded_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        scale, *calls[0][0])
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:2], _NEG_INF, dtype=accumulation_dtype(q.dtype), device=q.device)
        for lr, (qi, ki, cq, ck, mq, mk) in calls:
            o, l = self._banded_forward(q[qi], k[ki], v[ki], cq, ck, mq, mk, scale, *lr)
            out[qi], lse[qi] = o, l
        return out, lse

    def _backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                  max_seqlen_k, scale, mask):
        calls = _class_calls(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask)
        if calls[0][1] is None:
            return self._banded_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                         max_seqlen_q, max_seqlen_k, scale, *calls[0][0])
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for lr, (qi, ki, cq, ck, mq, mk) in calls:
            g = self._banded_backward(dout[qi], q[qi], k[ki], v[ki], out[qi], lse[qi], cq, ck, mq, mk,
                                      scale, *lr)
            dq[qi], dk[ki], dv[ki] = g  # a class's rows and keys are its sequences' own
        return dq, dk, dv


def _positive_scale(q, scale: float) -> tuple[torch.Tensor, float, int]:
    """``(q', scale', sign)`` with ``scale' > 0`` and ``scale' * (q' . k) == scale * (q . k)`` exactly.

    The kernels assume a positive scale: the CPU flash op writes -inf into masked scores before it
    multiplies them by the scale (0 * -inf = NaN, a negative scale makes them +inf), and
    FlashAttention takes the row max of the unscaled scores. Negating q is exact, and scale 0 is
    the attention of q' = 0 (every visible score 0). The gradient wrt q is ``sign * dq'``.
    """
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be finite, got {scale!r}")
    if scale > 0:
        return q, scale, 1
    if scale < 0:
        return -q, -scale, -1
    return torch.zeros_like(q), 1.0, 0


class _Mask:
    """A call's mask: ``window`` (int or None) and ``diagonals`` (list of ints, or None)."""

    __slots__ = ("window", "diagonals")

    def __init__(self, window, diagonals):
        self.window, self.diagonals = window, diagonals

    @classmethod
    def of(cls, window, diagonals, cu_seqlens_q) -> "_Mask":
        window = window_arg(window)
        if diagonals is not None:
            diagonals = diagonals.tolist() if hasattr(diagonals, "tolist") else list(diagonals)
            if len(diagonals) != cu_seqlens_q.numel() - 1 or not all(
                    isinstance(x, int) and not isinstance(x, bool) for x in diagonals):
                raise ValueError(f"diagonals must be {cu_seqlens_q.numel() - 1} ints (one per "
                                 f"sequence), got {diagonals[:8]!r}")
        return cls(window, diagonals)

    def diagonal(self, b: int, lq: int, lk: int) -> int:
        return lk - lq if self.diagonals is None else self.diagonals[b]


class AttentionBackend:
    """Base class: validation, dtype fallback and the shared contract.

    Subclasses implement `_forward`/`_backward` for the dtypes `_kernel_handles` accepts; other
    dtypes go to the reference math (correct, but O(Lq * Lk) memory per sequence and head group).
    """

    name: str = ""
    device_types: tuple[str, ...] | None = None  # None: any device

    def is_available(self) -> bool:
        return True

    def supports(self, device) -> bool:
        dev = torch.device(device)
        return (self.device_types is None or dev.type in self.device_types) and self.is_available()

    def _kernel_handles(self, q: torch.Tensor) -> bool:
        return True

    def _check(self, q, k, v, cu_seqlens_q, cu_seqlens_k):
        from .kernels import BACKENDS, available_backends  # the registry (imports this module)
        _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
        if not self.supports(q.device):
            raise ValueError(f"backend {self.name!r} cannot run on {q.device} "
                             f"(available there: {available_backends(q.device)})")
        return self if self._kernel_handles(q) else BACKENDS["reference"]

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                window=None, diagonals=None):
        """Causal varlen attention forward (FlashAttention-2, Algorithm 1).

        Args: q [T_q, H_q, D]; k, v [T_k, H_kv, D] (same dtype and device as q, any strides);
        cu_seqlens_q, cu_seqlens_k int32 [B + 1]; max_seqlen_q, max_seqlen_k: int; softmax_scale:
        any finite float; window: a positive int (sliding window, module doc) or None (ValueError
        otherwise); diagonals: None (bottom-right) or B ints, each sequence's diagonal (module doc).
        Returns: out [T_q, H_q, D] in q's dtype; lse [T_q, H_q] float32 (float64 for float64 q),
        lse = logsumexp over visible keys of softmax_scale * q . k (-inf where no key is visible).
        """
        impl = self._check(q, k, v, cu_seqlens_q, cu_seqlens_k)
        mask = _Mask.of(window, diagonals, cu_seqlens_q)
        q, scale, _ = _positive_scale(q, float(softmax_scale))
        return impl._forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, mask)

    def backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                 max_seqlen_k, softmax_scale, window=None, diagonals=None):
        """Causal varlen attention backward (FlashAttention-2, Algorithm 2).

        Args: dout, out [T_q, H_q, D] and lse [T_q, H_q] as returned by `forward` (any backend);
        the rest as in `forward`. Returns dq [T_q, H_q, D], dk, dv [T_k, H_kv, D] in q's dtype,
        dk/dv summed over the query heads that share a kv head; zero for rows outside cu_seqlens.
        """
        impl = self._check(q, k, v, cu_seqlens_q, cu_seqlens_k)
        mask = _Mask.of(window, diagonals, cu_seqlens_q)
        if dout.shape != q.shape or out.shape != q.shape or lse.shape != q.shape[:2]:
            raise ValueError(f"dout {tuple(dout.shape)}, out {tuple(out.shape)} must be "
                             f"{tuple(q.shape)} and lse {tuple(lse.shape)} must be {tuple(q.shape[:2])}")
        q, scale, sign = _positive_scale(q, float(softmax_scale))
        dq, dk, dv = impl._backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, scale, mask)
        # scale 0: the scores do not depend on q at all.
        return (dq if sign > 0 else -dq if sign < 0 else torch.zeros_like(dq)), dk, dv

    def __repr__(self) -> str:
        return f"<attention backend {self.name}>"
