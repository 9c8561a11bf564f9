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

import torch

from .dtypes import accumulation_dtype
from .kernel_base import _NEG_INF, AttentionBackend, _BandedKernel, _mask_pieces, _sequences, mask_classes
from .kernels_cudnn import CudnnKernels
from .kernels_fa4 import FA4Kernels
from .kernels_flash import FlashAttnBackend, TorchVarlenBackend

__all__ = [
    "AttentionBackend", "ReferenceBackend", "TorchCPUBackend", "TorchVarlenBackend",
    "FlashAttnBackend", "CudnnBackend", "BACKENDS", "get_backend", "available_backends", "check_backend_name",
    "FA4Backend", "mask_classes",
]

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
