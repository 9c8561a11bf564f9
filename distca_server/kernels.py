"""Causal varlen core-attention backends with one signature.

Every backend computes, for a packed batch of B sequences (CA-task shards)::

    forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
            window=None, diagonals=None) -> (out, lse)
    backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
             softmax_scale, window=None, diagonals=None) -> (dq, dk, dv)

Tensors (T_q = total query rows, T_k = total key rows, H_q % H_kv == 0):
    q, out, dout, dq: [T_q, H_q, D], dtype of q.        k, v, dk, dv: [T_k, H_kv, D], dtype of q.
    lse: [T_q, H_q], float32 (float64 when q is float64): lse = logsumexp_j(softmax_scale * q . k_j).
    cu_seqlens_q, cu_seqlens_k: int32 [B + 1], cumulative offsets; max_seqlen_*: python ints.
    Query head h reads kv head h // (H_q // H_kv) (GQA); dk, dv are summed over that group.

Causal mask, bottom-right aligned (flash-attn >= 2.1): in a sequence with Lq query rows and Lk keys,
row r sees key j iff j <= r + (Lk - Lq). With Lq = 2, Lk = 5 (1 = visible)::

    1 1 1 1 0
    1 1 1 1 1

Sliding window ``window = W`` (None: no window): row r sees key j iff also
``j >= r + (Lk - Lq) - W + 1``, the W keys ending at its diagonal (FlashAttention's
``window_size = (W - 1, 0)``). With Lq = 2, Lk = 5, W = 2::

    0 0 1 1 0
    0 0 0 1 1

Any diagonal (partial-KV CA-tasks, whose keys need not end where their queries end): with
``diagonals[b] = d`` (a task's ``q_start - kv_start``) row r of sequence b sees key j iff
``r + d - W < j <= r + d``; None means ``d = Lk - Lq``, the bottom-right alignment above. The
reference and CPU backends take any per-sequence diagonal in one call. FlashAttention's kernels
take one ``window_size = (left, right)`` per call (keys ``r + Lk - Lq - left .. r + Lk - Lq + right``,
-1 unbounded), so a call whose sequences need different (left, right) runs as one kernel call per
distinct pair (:func:`mask_classes`: for a partial-KV plan without a window, two: the diagonal
blocks (-1, 0) and the blocks of keys every query sees (-1, -1)).

A row that sees no key (only possible when Lq > Lk) gets out = 0, lse = -inf and zero gradients.

Any finite softmax_scale is allowed (0 gives uniform attention over the visible keys; a negative
scale favours the least similar keys); inputs may have any strides.

Forward and backward follow FlashAttention-2 (Dao 2023, arXiv 2307.08691), Algorithm 1 (forward
returning the LSE) and Algorithm 2 (backward recomputing P = exp(S - lse) and D = rowsum(dO * O)).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math

import torch

from scheduler.cost import window_arg

from .dtypes import accumulation_dtype
from .kernels_cudnn import CudnnKernels
from .kernels_fa4 import FA4Kernels

__all__ = [
    "AttentionBackend", "ReferenceBackend", "TorchCPUBackend", "TorchVarlenBackend",
    "FlashAttnBackend", "CudnnBackend", "BACKENDS", "get_backend", "available_backends", "check_backend_name",
    "FA4Backend",
]

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
        there is visible). Empty sequences go with the first class.

    Raises:
        ValueError: a sequence with keys past its last query's diagonal that some row must not
            see (``right`` would be negative), which no FlashAttention window expresses.
    """
    classes: dict[tuple[int, int], list[int]] = {}
    for b, (nq, nk, dd) in enumerate(zip(lq, lk, d)):
        e = dd - (nk - nq)  # the diagonal's offset from the bottom-right one: (., e) bounds it
        # Bottom-right sequences keep (., 0); others whose keys every row sees up to the last
        # share (., -1) whatever their offset.
        right = 0 if e == 0 else -1 if nk - 1 <= dd else e
        left = -1 if window is None else window - 1 - e
        if left < 0 and window is not None and window >= nq + dd:
            left = -1  # the window never bites in this sequence
        if right < -1 or left < -1 or (window is not None and left == -1 and window < nq + dd):
            raise ValueError(f"sequence {b} (Lq={nq}, Lk={nk}, diagonal {dd}, window {window}) has keys "
                             f"no query may see; FlashAttention's window_size cannot express it")
        classes.setdefault((left, right), []).append(b)
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


class ReferenceBackend(AttentionBackend):
    """Plain torch math, one sequence at a time; the fallback of the other backends.

    Each sequence's q, k, v (and dout) are upcast to the accumulation dtype (float32 for half
    inputs, see :func:`distca_server.dtypes.accumulation_dtype`), so the scores, the LSE, P and dS
    are never rounded to half precision, and the results are rounded once: keeping the LSE in bf16
    measured 2-7x the error of torch.softmax in bf16. Materialises S = scale * q k^T
    ([H_kv, G * Lq, Lk] per sequence, G = H_q // H_kv) in that dtype, so memory is O(Lq * Lk): for
    tests and small fallbacks, not for long documents.
    """

    name = "reference"

    @classmethod
    def _scores(cls, qs, ks, scale, window, d):
        # Query heads of one kv head are stacked along rows, so one batched matmul per kv head
        # serves the whole GQA group and dk/dv come out already summed over it.
        lq, hq, lk, hkv = qs.shape[0], qs.shape[1], ks.shape[0], ks.shape[1]
        qh, kh = cls._to_heads(qs, hkv), ks.transpose(0, 1)
        diag = torch.arange(lq, device=qs.device)[:, None] + d
        cols = torch.arange(lk, device=qs.device)[None, :]
        visible = cols <= diag
        if window is not None:
            visible &= cols > diag - window
        s = (qh @ kh.transpose(1, 2)) * scale
        return qh, kh, s.masked_fill(~visible.repeat(hq // hkv, 1), _NEG_INF)

    @staticmethod
    def _to_heads(x, hkv):  # [L, H_q, ...] -> [H_kv, G * L, ...]
        lq, hq = x.shape[:2]
        x = x.reshape(lq, hkv, hq // hkv, *x.shape[2:]).transpose(0, 1).transpose(1, 2)
        return x.reshape(hkv, hq // hkv * lq, *x.shape[3:])

    @staticmethod
    def _from_heads(x, lq):  # [H_kv, G * L, ...] -> [L, H_q, ...]
        hkv = x.shape[0]
        x = x.reshape(hkv, -1, lq, *x.shape[2:]).transpose(1, 2).transpose(0, 1)
        return x.reshape(lq, -1, *x.shape[3:])

    def _forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, mask):
        acc = accumulation_dtype(q.dtype)
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:2], _NEG_INF, dtype=acc, device=q.device)
        for b, (qa, qb, ka, kb) in enumerate(_sequences(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])):
            if qb == qa:
                continue
            _, _, s = self._scores(q[qa:qb].to(acc), k[ka:kb].to(acc), scale, mask.window,
                                   mask.diagonal(b, qb - qa, kb - ka))
            l = torch.logsumexp(s, dim=-1)
            # Rows with no visible key have l = -inf; subtracting 0 instead keeps exp(-inf) = 0
            # rather than exp(nan), which gives those rows out = 0.
            p = torch.exp(s - l.masked_fill(l == _NEG_INF, 0.0)[..., None])
            out[qa:qb] = self._from_heads(p @ v[ka:kb].to(acc).transpose(0, 1), qb - qa)
            lse[qa:qb] = self._from_heads(l, qb - qa)
        return out, lse

    def _backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                  max_seqlen_k, scale, mask):
        acc = accumulation_dtype(q.dtype)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        hkv = k.shape[1]
        for b, (qa, qb, ka, kb) in enumerate(_sequences(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])):
            if qb == qa or kb == ka:
                continue
            qh, kh, s = self._scores(q[qa:qb].to(acc), k[ka:kb].to(acc), scale, mask.window,
                                     mask.diagonal(b, qb - qa, kb - ka))
            l = self._to_heads(lse[qa:qb].to(acc), hkv)
            p = torch.exp(s - l.masked_fill(l == _NEG_INF, 0.0)[..., None])
            do = self._to_heads(dout[qa:qb].to(acc), hkv)
            vh = v[ka:kb].to(acc).transpose(0, 1)
            delta = (do * self._to_heads(out[qa:qb].to(acc), hkv)).sum(-1, keepdim=True)
            ds = p * (do @ vh.transpose(1, 2) - delta)
            dq[qa:qb] = self._from_heads(ds @ kh, qb - qa) * scale
            dk[ka:kb] = (ds.transpose(1, 2) @ qh).transpose(0, 1) * scale
            dv[ka:kb] = (p.transpose(1, 2) @ do).transpose(0, 1)
        return dq, dk, dv


def _bhld(x):  # [L, H, D] -> [1, H, L, D] view, no copy: what the aten SDPA ops take
    return x.unsqueeze(0).transpose(1, 2)


def _lhd(x):  # [1, H, L, ...] -> [L, H, ...]; contiguous, as the CPU ops return q's memory format
    return x.squeeze(0).transpose(0, 1)


class TorchCPUBackend(AttentionBackend):
    """CPU flash attention from aten (`_scaled_dot_product_flash_attention_for_cpu` and its
    backward), one call per sequence and block; memory O(Lq * H * D), never an Lq x Lk mask.

    The ops take [B, H, L, D] (any strides), support H_q a multiple of H_kv natively with the
    h // G grouping, accept float32/float64/bfloat16/float16, and return an LSE [B, H, L] that is
    float64 for float64 inputs and float32 otherwise. Their `is_causal` is top-left aligned, so a
    bottom-right sequence with Lk >= Lq is split into (a) all Lq rows x keys [0, Lk - Lq), no mask,
    and (b) the square Lq x Lq block of keys [Lk - Lq, Lk) where top-left equals bottom-right.
    A sliding window goes through the ops' additive ``attn_mask``, a chunk of rows at a time
    against only the keys their windows reach (:func:`_mask_pieces`), so memory stays
    O(rows x (rows + W)) per call. The partial results merge through their LSEs (Milakov &
    Gimelshein 2018, "Online normalizer calculation for softmax"; the same rescaling as
    FlashAttention-2 Algorithm 1).
    """

    name = "torch_cpu"
    device_types = ("cpu",)
    _OP_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

    def _kernel_handles(self, q):
        return q.dtype in self._OP_DTYPES  # other dtypes: the ops refuse them, reference math

    @staticmethod
    def _operands(*tensors):
        """The tensors as the ops need them: float32 for half inputs, unit-stride head_dim.

        The CPU ops round dK/dV to bf16/fp16 per block and sum GQA groups in that dtype, which
        measured 3.5x plain torch's bf16 error on dK/dV; computing in float32 and rounding once
        at the end stays below it (CPU bf16 matmuls are no faster without AMX anyway). The ops
        take any strides except along head_dim, which they read as if unit-stride (a
        ``x[..., ::2]`` view gave O(1) errors), so only such tensors are copied.
        """
        if tensors[0].dtype in (torch.float16, torch.bfloat16):
            tensors = tuple(t.float() for t in tensors)
        return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)

    def _forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, mask):
        dtype = q.dtype
        q, k, v = self._operands(q, k, v)
        out, lse = self._forward_work(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, mask)
        return out.to(dtype), lse

    def _backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                  max_seqlen_k, scale, mask):
        dtype = q.dtype
        dout, q, k, v, out = self._operands(dout.to(dtype), q, k, v, out.to(dtype))
        grads = self._backward_work(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, scale, mask)
        return tuple(g.to(dtype) for g in grads)

    @staticmethod
    def _pieces(q, k, cu_seqlens_q, cu_seqlens_k, m):
        """``(rows, keys, is_causal, attn_mask)`` of every op call, over all sequences."""
        window = m.window
        for b, (qa, qb, ka, kb) in enumerate(_sequences(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])):
            lq, lk = qb - qa, kb - ka
            d = m.diagonal(b, lq, lk)
            for r0, r1, c0, c1, kind in _mask_pieces(lq, lk, window, d=d):
                mask = None
                if kind == "mask":  # visible: r + d - W < c <= r + d
                    diag = torch.arange(r0, r1, device=q.device)[:, None] + d
                    cols = torch.arange(c0, c1, device=q.device)[None, :]
                    mask = torch.zeros((r1 - r0, c1 - c0), dtype=q.dtype, device=q.device).masked_fill_(
                        (cols > diag) | (cols <= diag - window), _NEG_INF)
                yield slice(qa + r0, qa + r1), slice(ka + c0, ka + c1), kind == "causal", mask

    def _forward_work(self, q, k, v, cu_seqlens_q, cu_seqlens_k, scale, m):
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:2], _NEG_INF, dtype=accumulation_dtype(q.dtype), device=q.device)
        for rows, keys, causal, mask in self._pieces(q, k, cu_seqlens_q, cu_seqlens_k, m):
            o, l = op(_bhld(q[rows]), _bhld(k[keys]), _bhld(v[keys]), 0.0, causal, attn_mask=mask,
                      scale=scale)
            o, l = _lhd(o).to(lse.dtype), _lhd(l).to(lse.dtype)
            # Merge with what earlier pieces gave these rows (none yet: lse -inf, weight 0), in
            # the LSE dtype so low-precision inputs are rounded only once.
            l_old = lse[rows]
            l_all = torch.logaddexp(l_old, l)
            out[rows] = (torch.exp(l_old - l_all)[..., None] * out[rows].to(lse.dtype)
                         + torch.exp(l - l_all)[..., None] * o).to(q.dtype)
            lse[rows] = l_all
        return out, lse

    def _backward_work(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, scale, m):
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        lse = lse.to(accumulation_dtype(q.dtype))
        for rows, keys, causal, mask in self._pieces(q, k, cu_seqlens_q, cu_seqlens_k, m):
            # The op rebuilds P from the lse it is given and D from (out, dout). Feeding each piece
            # the GLOBAL out and lse therefore yields that piece's exact share of the gradient:
            # dq and dk/dv add up over the pieces that share rows or keys.
            g = op(_bhld(dout[rows]), _bhld(q[rows]), _bhld(k[keys]), _bhld(v[keys]), _bhld(out[rows]),
                   lse[rows].t().unsqueeze(0), 0.0, causal, attn_mask=mask, scale=scale)
            dq[rows] += _lhd(g[0])
            dk[keys] += _lhd(g[1])
            dv[keys] += _lhd(g[2])
        return dq, dk, dv


def _flash_kernel_handles(q) -> bool:
    # FlashAttention-2 kernels: fp16/bf16 only, head_dim a multiple of 8 up to 256.
    return q.dtype in (torch.float16, torch.bfloat16) and q.shape[2] % 8 == 0 and q.shape[2] <= 256


def _lse_from_kernel(lse, cu_seqlens_q, total_q, num_heads):
    """FlashAttention LSE -> (ours: [T_q, H] float32 with -inf on rows without keys, its layout).

    Kernels return [H, T_q] ("heads_first"; assumed when H == T_q makes the shape ambiguous) or, in
    older flash-attn, [B, H, max_seqlen_q] ("padded"); they mark rows without keys with +inf.
    """
    layout = "padded" if lse.dim() == 3 else "heads_first" if lse.shape == (num_heads, total_q) else (
        "tokens_first" if lse.shape == (total_q, num_heads) else None)
    if layout is None:
        raise RuntimeError(f"unexpected kernel LSE shape {tuple(lse.shape)} for T_q={total_q}, H={num_heads}")
    if layout == "padded":
        b, r = _token_positions(cu_seqlens_q)
        lse = lse[b, :, r]
    lse = (lse.t() if layout == "heads_first" else lse).float()
    return lse.masked_fill(lse == float("inf"), _NEG_INF).contiguous(), layout


def _lse_to_kernel(lse, layout, cu_seqlens_q, max_seqlen_q):
    """Inverse of `_lse_from_kernel` for `layout` in {"heads_first", "tokens_first", "padded"}."""
    lse = lse.float().masked_fill(lse == _NEG_INF, float("inf"))
    if layout == "tokens_first":
        return lse.contiguous()
    if layout == "heads_first":
        return lse.t().contiguous()
    b, r = _token_positions(cu_seqlens_q)
    padded = lse.new_full((cu_seqlens_q.numel() - 1, lse.shape[1], max_seqlen_q), float("inf"))
    padded[b, :, r] = lse
    return padded


def _token_positions(cu_seqlens_q):
    """(sequence, row within it) of every query row, [T_q] int64 each; cu_seqlens_q[0] must be 0."""
    cu = cu_seqlens_q.long()
    seq = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=cu.device), cu.diff())
    return seq, torch.arange(seq.numel(), device=cu.device) - cu[seq]


class TorchVarlenBackend(_BandedKernel, AttentionBackend):
    """torch's built-in FlashAttention-2 varlen kernels (CUDA): the aten ops
    ``_flash_attention_forward`` / ``_flash_attention_backward`` that
    ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10) wraps. Causal via window (-1, 0),
    which the kernel aligns bottom-right; a sliding window W is (W - 1, 0); GQA native.

    The aten ops are called by keyword rather than through the private ``torch_attn::_varlen_attn``
    custom op: that op's positional parameters changed between torch releases (2.11 and 2.13 differ),
    while the aten schemas have kept theirs. LSE layout: ``[H, T_q]`` float32 on recent torch,
    ``[B, H, max_seqlen_q]`` on older builds; :func:`_lse_from_kernel` reads either.
    """

    name = "torch_varlen"
    device_types = ("cuda",)

    def __init__(self):
        self._lse_layout = "heads_first"  # what torch's fake kernel declares; refined at first call

    def is_available(self):
        return torch.cuda.is_available() and importlib.util.find_spec("torch.nn.attention.varlen") is not None

    def _kernel_handles(self, q):
        return _flash_kernel_handles(q)

    def _banded_forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                        left, right):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, right == 0, False,
            scale=scale, window_size_left=left, window_size_right=right)[:2]
        lse, self._lse_layout = _lse_from_kernel(lse, cu_seqlens_q, q.shape[0], q.shape[1])
        return out, lse

    def _banded_backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                         max_seqlen_k, scale, left, right):
        # Dropout is off, so the Philox state is never read, but the op wants its two tensors.
        rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
        unused = torch.empty(0, device=q.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(),
            _lse_to_kernel(lse, self._lse_layout, cu_seqlens_q, max_seqlen_q),
            cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, right == 0, rng_state, unused,
            scale=scale, window_size_left=left, window_size_right=right)
        return dq, dk, dv


@functools.lru_cache(maxsize=None)
def _parameter_names(fn) -> tuple[tuple[str, bool], ...]:
    # torch.library custom ops wrap the Python function; its signature is on `_init_fn`.
    params = inspect.signature(getattr(fn, "_init_fn", fn)).parameters.values()
    return tuple((p.name, p.default is inspect.Parameter.empty) for p in params)


def _call_by_name(fn, values: dict):
    """Call `fn` with the entries of `values` it accepts: flash-attn's private backward changed its
    positional order across versions (window_size -> window_size_left/right, softcap added)."""
    names = _parameter_names(fn)
    missing = [n for n, required in names if required and n not in values]
    if missing:
        raise RuntimeError(f"unsupported flash-attn version: {fn} needs unknown arguments {missing}")
    return fn(**{n: values[n] for n, _ in names if n in values})


class FlashAttnBackend(_BandedKernel, AttentionBackend):
    """The `flash-attn` package (Dao 2023), `flash_attn_varlen_func(..., causal=True)`: bottom-right
    causal since flash-attn 2.1; a sliding window W is `window_size=(W - 1, 0)` (flash-attn >= 2.3);
    GQA native; LSE from `return_attn_probs=True`."""

    name = "flash_attn"
    device_types = ("cuda",)

    def __init__(self):
        self._lse_layout = "heads_first"  # recent flash-attn's unpadded varlen LSE; refined at first call

    def is_available(self):
        return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None

    def _kernel_handles(self, q):
        return _flash_kernel_handles(q)

    def _banded_forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                        left, right):
        from flash_attn import flash_attn_varlen_func

        out, lse, _ = flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
            softmax_scale=scale, causal=right == 0, window_size=(left, right), return_attn_probs=True)
        lse, self._lse_layout = _lse_from_kernel(lse, cu_seqlens_q, q.shape[0], q.shape[1])
        return out, lse

    def _banded_backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                         max_seqlen_k, scale, left, right):
        from flash_attn.flash_attn_interface import _flash_attn_varlen_backward

        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        # Same arguments as flash-attn's own autograd backward: the window (its forward turns
        # causal into right = 0; -1 is unbounded).
        _call_by_name(_flash_attn_varlen_backward, dict(
            dout=dout.contiguous(), q=q, k=k, v=v, out=out.contiguous(),
            softmax_lse=_lse_to_kernel(lse, self._lse_layout, cu_seqlens_q, max_seqlen_q),
            dq=dq, dk=dk, dv=dv, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, dropout_p=0.0, softmax_scale=scale,
            causal=right == 0, window_size=(left, right), window_size_left=left, window_size_right=right,
            softcap=0.0, alibi_slopes=None, deterministic=False, rng_state=None))
        return dq, dk, dv


class CudnnBackend(CudnnKernels, _BandedKernel, AttentionBackend):
    """cuDNN fused attention via ``nvidia-cudnn-frontend`` (sm90+; :mod:`distca_server.kernels_cudnn`)."""


class FA4Backend(FA4Kernels, _BandedKernel, AttentionBackend):
    """FlashAttention-4, CuTe DSL, via ``flash-attn-4`` (sm90+; :mod:`distca_server.kernels_fa4`)."""


BACKENDS: dict[str, AttentionBackend] = {
    b.name: b for b in (CudnnBackend(), FA4Backend(), FlashAttnBackend(), TorchVarlenBackend(),
                        TorchCPUBackend(), ReferenceBackend())
}

# "auto" never picks `reference`: its O(Lq * Lk) memory would turn a long document into an OOM
# rather than a clear error. Force it by name.
_AUTO_ORDER = {"cuda": ("cudnn", "fa4", "flash_attn", "torch_varlen"), "cpu": ("torch_cpu",)}  # cudnn, fa4: sm90+


def available_backends(device) -> list[str]:
    """Names of the backends that can run on `device` (torch.device or str), fastest first."""
    return [name for name, b in BACKENDS.items() if b.supports(device)]


def _known(name) -> bool:
    # A str test first: a list or dict as a name must not reach the dict lookup (TypeError).
    return isinstance(name, str) and (name == "auto" or name in BACKENDS)


def check_backend_name(name, device=None) -> str:
    """``name`` if it names a backend this install can run, else a ValueError.

    Args:
        name: "auto" or a key of :data:`BACKENDS`.
        device: where the backend will run (torch.device or str); None (the device is not known
            yet, e.g. when a client is built) only asks that the backend run on some device here,
            so "flash_attn" is refused on an install without CUDA or without the package.

    Raises:
        ValueError: ``name`` is not a str, is unknown, or cannot run on ``device`` (or anywhere
            here); the message lists the backends that can.
    """
    if not _known(name):
        raise ValueError(f"unknown attention backend {name!r}; known: {['auto', *BACKENDS]}")
    if device is not None:
        get_backend(name, device)
    elif name != "auto" and not BACKENDS[name].is_available():
        runnable = [n for n, b in BACKENDS.items() if b.is_available()]
        raise ValueError(f"attention backend {name!r} cannot run on this install "
                         f"(CUDA available: {torch.cuda.is_available()}); runnable here: {runnable}")
    return name


def get_backend(name: str, device) -> AttentionBackend:
    """The backend called `name` for tensors on `device`.

    `name` is one of "auto", "reference", "torch_cpu", "torch_varlen", "flash_attn", "cudnn", "fa4".
    "auto" picks cudnn (sm90+, package installed), then fa4 (likewise), then flash_attn, then
    torch_varlen on CUDA, and torch_cpu on CPU. Raises ValueError, listing the backends available on `device`, for an
    unknown name or one that cannot run there.
    """
    device = torch.device(device)
    available = available_backends(device)
    if not _known(name):
        raise ValueError(f"unknown attention backend {name!r}; known: {['auto', *BACKENDS]}, "
                         f"available on {device}: {available}")
    if name == "auto":
        for candidate in _AUTO_ORDER.get(device.type, ()):
            if candidate in available:
                return BACKENDS[candidate]
        raise ValueError(f"no fast attention backend for {device}; available: {available} "
                         f"(pass name='reference' to force the O(Lq*Lk)-memory reference)")
    if name not in available:
        raise ValueError(f"attention backend {name!r} is not available on {device}; available: {available}")
    return BACKENDS[name]
