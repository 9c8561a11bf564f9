"""``varlen_attention``: single-device causal varlen attention with autograd, the thing
``DistCAClient.attend`` must equal. Training code can switch between the two with one flag."""

from __future__ import annotations

import torch

from distca_server.kernels import check_backend_name, get_backend

from .autograd import refuse_double_backward
from .validate import check_attend_inputs


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, softmax_scale, backend, window):
        out, lse = backend.forward(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale,
                                   window=window)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.max_seqlen, ctx.softmax_scale, ctx.backend, ctx.window = max_seqlen, softmax_scale, backend, window
        return out

    @staticmethod
    def backward(ctx, dout):
        refuse_double_backward("varlen_attention")
        q, k, v, out, lse, cu = ctx.saved_tensors
        n = ctx.max_seqlen
        dq, dk, dv = ctx.backend.backward(dout, q, k, v, out, lse, cu, cu, n, n, ctx.softmax_scale,
                                          window=ctx.window)
        return dq, dk, dv, None, None, None, None, None


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_lens, *,
                     softmax_scale: float | None = None, backend: str = "auto",
                     window: int | None = None) -> torch.Tensor:
    """Causal attention inside each document, on q's device, differentiable once.

    Same contract as :meth:`DistCAClient.attend`: q [total_tokens, num_heads_q, head_dim]; k, v
    [total_tokens, num_heads_kv, head_dim], any strides; ``doc_lens`` sums to total_tokens;
    ``softmax_scale`` any finite number (0: uniform over the causal prefix); ``window`` W: query
    ``i`` sees only keys ``i - W + 1 .. i`` of its document (None: full causal); returns out like q.
    ``backend`` names a kernel from :mod:`distca_server.kernels` ("auto": the fastest available).

    Raises:
        ValueError: as :meth:`DistCAClient.attend`, or a ``backend`` that is unknown or cannot
            run on q's device, before anything runs.
        RuntimeError: in a backward with ``create_graph=True`` (double backward).
    """
    check_backend_name(backend)
    lens, scale, window = check_attend_inputs(q, k, v, doc_lens, softmax_scale, window)
    kernel = get_backend(backend, q.device)
    if not lens:
        return q * 0  # no tokens: an empty output, still part of the graph
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=q.device)
    return _VarlenAttention.apply(q, k, v, cu, max(lens), scale, kernel, window)
