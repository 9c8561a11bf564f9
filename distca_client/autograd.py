"""The autograd.Function behind ``DistCAClient.attend``: one forward round, one backward round."""

from __future__ import annotations

import torch


class DistCAAttention(torch.autograd.Function):
    """``out = attention(q, k, v)`` run by ``step``, an object with

    - ``forward(q, k, v, softmax_scale) -> (out, lse)`` and
    - ``backward(q, k, v, out, lse, dout, softmax_scale) -> (dq, dk, dv)``

    bound to one step's plan. Saves q, k, v, out and the LSE (float32, or float64 for float64
    inputs; FlashAttention-2 Alg. 2 recomputes the softmax from it), nothing quadratic.
    """

    @staticmethod
    def forward(ctx, q, k, v, step, softmax_scale):
        out, lse = step.forward(q.detach(), k.detach(), v.detach(), softmax_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.step, ctx.softmax_scale = step, softmax_scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.step.backward(q, k, v, out, lse, dout.contiguous(), ctx.softmax_scale)
        return dq, dk, dv, None, None
