"""Plain-torch references that tests and benchmarks compare the fast paths against.

Nothing here shares code with :mod:`distca_server.kernels`, the executor or the transports: each
function is the textbook definition, computed segment by segment in the inputs' dtype (pass
float64 tensors for an oracle). Slow on purpose.
"""

from __future__ import annotations

from typing import Sequence

import torch


def cu_seqlens(lens: Sequence[int], device=None) -> torch.Tensor:
    """int32 [len(lens) + 1]: ``[0, l0, l0 + l1, ...]``."""
    out = [0]
    for n in lens:
        out.append(out[-1] + int(n))
    return torch.tensor(out, dtype=torch.int32, device=device)


def _mask(lq: int, lk: int, window: int | None, device) -> torch.Tensor:
    """bool [lq, lk]: row i sees key j iff ``i + lk - lq - window < j <= i + lk - lq``."""
    mask = torch.ones(lq, lk, dtype=torch.bool, device=device).tril(diagonal=lk - lq)
    if window is not None:
        mask &= torch.ones(lq, lk, dtype=torch.bool, device=device).triu(diagonal=lk - lq - window + 1)
    return mask


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q, cu_seqlens_k,
                  softmax_scale: float, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal varlen attention with bottom-right alignment, differentiable through autograd.

    Args:
        q: [total_q, num_heads_q, head_dim]; k, v: [total_k, num_heads_kv, head_dim], any float
            dtype (computed in that dtype); ``num_heads_q % num_heads_kv == 0`` (GQA).
        cu_seqlens_q, cu_seqlens_k: [num_seqs + 1] integer offsets (tensor or list).
        softmax_scale: multiplier of ``Q Kᵀ``.
        window: sliding window ``W``: row ``i`` also needs ``j > i + lk - lq - W`` (None: none).

    Returns:
        ``(out, lse)``: out like q; lse [total_q, num_heads_q] in q's dtype, natural log, ``-inf``
        for a row that sees no key (its out row is 0). Row ``i`` of a segment with ``lq`` queries
        and ``lk`` keys sees keys ``j <= i + lk - lq`` (FlashAttention's convention).
    """
    cq = [int(x) for x in (cu_seqlens_q.tolist() if torch.is_tensor(cu_seqlens_q) else cu_seqlens_q)]
    ck = [int(x) for x in (cu_seqlens_k.tolist() if torch.is_tensor(cu_seqlens_k) else cu_seqlens_k)]
    group = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for qa, qb, ka, kb in zip(cq, cq[1:], ck, ck[1:]):
        lq, lk = qb - qa, kb - ka
        qs = q[qa:qb].transpose(0, 1)                                    # [H, lq, D]
        ks = k[ka:kb].repeat_interleave(group, dim=1).transpose(0, 1)    # [H, lk, D]
        vs = v[ka:kb].repeat_interleave(group, dim=1).transpose(0, 1)
        s = (qs @ ks.transpose(-1, -2)) * softmax_scale
        s = s.masked_fill(~_mask(lq, lk, window, q.device), float("-inf"))
        lse = torch.logsumexp(s, dim=-1)                                 # [H, lq]
        p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
        outs.append((p @ vs).transpose(0, 1))
        lses.append(lse.transpose(0, 1))
    if not outs:
        return q * 0, q.new_zeros(q.shape[:2])
    return torch.cat(outs), torch.cat(lses)


def plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q, cu_seqlens_k,
                    softmax_scale: float, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(scale · Q Kᵀ + causal mask) V`` as torch code writes it, in the inputs' dtype: the
    yardstick of low-precision error.

    A kernel run in bf16/fp16 may be at most 2x as far from the float64 :func:`attention_ref` as
    this is from it on the same rounded inputs (the rule of flash-attention's tests). Unlike
    :func:`attention_ref` the probabilities come from ``torch.softmax``, which normalises in float32
    internally, as plain torch code gets them; the LSE is ``torch.logsumexp`` in the inputs' dtype.
    Shapes, masks and ``(out, lse)`` as :func:`attention_ref`; differentiable through autograd.
    """
    cq = [int(x) for x in (cu_seqlens_q.tolist() if torch.is_tensor(cu_seqlens_q) else cu_seqlens_q)]
    ck = [int(x) for x in (cu_seqlens_k.tolist() if torch.is_tensor(cu_seqlens_k) else cu_seqlens_k)]
    group = q.shape[1] // k.shape[1]
    outs, lses = [q[:0]], [q.new_zeros(0, q.shape[1])]
    for qa, qb, ka, kb in zip(cq, cq[1:], ck, ck[1:]):
        lq, lk = qb - qa, kb - ka
        qs = q[qa:qb].transpose(0, 1)
        ks = k[ka:kb].repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v[ka:kb].repeat_interleave(group, dim=1).transpose(0, 1)
        mask = _mask(lq, lk, window, q.device)
        alive = mask.any(-1, keepdim=True)  # rows that see a key; the others get out = 0
        s = ((qs @ ks.transpose(-1, -2)) * softmax_scale).masked_fill(~mask, float("-inf"))
        p = torch.softmax(s.masked_fill(~alive, 0.0), dim=-1) * alive
        outs.append((p @ vs).transpose(0, 1))
        lses.append(torch.logsumexp(s, dim=-1).transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


def varlen_attention_ref(q, k, v, doc_lens: Sequence[int], softmax_scale: float,
                        window: int | None = None) -> torch.Tensor:
    """(Sliding-window) causal attention inside each document of a packed batch (the contract of
    ``attend``); shapes as :func:`attention_ref` with ``cu_seqlens_q == cu_seqlens_k`` from
    ``doc_lens``."""
    cu = cu_seqlens(doc_lens)
    return attention_ref(q, k, v, cu, cu, softmax_scale, window)[0]


def attend_with_grads_ref(q, k, v, doc_lens, dout, softmax_scale: float,
                          window: int | None = None) -> list[torch.Tensor]:
    """``[out, dq, dk, dv]`` of :func:`varlen_attention_ref` in float64, for upstream ``dout``."""
    q, k, v = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    out = varlen_attention_ref(q, k, v, list(doc_lens), softmax_scale, window)
    out.backward(dout.detach().double().cpu())
    return [out.detach(), q.grad, k.grad, v.grad]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``‖actual − expected‖₂ / ‖expected‖₂`` in float64 (any shapes that broadcast, any devices
    of the same kind): the error measure of the low-precision checks (tests and benchmarks)."""
    a, e = actual.detach().double(), expected.detach().double()
    return float((a - e).norm() / e.norm().clamp_min(1e-30))


def all_to_all_ref(messages: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """The exchange a transport performs: ``messages[src][dst]`` (1-D tensors) delivered so that
    receiver ``dst`` gets ``cat(messages[0][dst], messages[1][dst], ...)``."""
    world = len(messages)
    return [torch.cat([messages[src][dst] for src in range(world)]) for dst in range(world)]
