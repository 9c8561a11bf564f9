"""The autograd.Function behind ``DistCAClient.attend``: one forward round, one backward round."""

from __future__ import annotations

import torch


def refuse_double_backward(what: str) -> None:
    """Raise if the backward now running was asked to build a graph (``create_graph=True``).

    The attention backward is a fused kernel (or a round through the servers) whose result is
    not differentiable; without this check a second derivative would silently come out wrong.
    Autograd runs a backward with grad mode on exactly when ``create_graph`` is set.

    Raises:
        RuntimeError: naming double backward and ``what``.
    """
    if torch.is_grad_enabled():
        raise RuntimeError(f"double backward through {what} is not supported: its gradient is not "
                           f"differentiable (create_graph=True); compute second-order terms without "
                           f"differentiating through attention")


class DistCAAttention(torch.autograd.Function):
    """``out = attention(q, k, v)`` whose forward round already runs (or ran) in ``pending``.

    ``pending`` has ``result() -> (out, lse)`` (the queued forward round) and ``step``, the
    :class:`~distca_server.runtime.base.PlannedBatch` that runs the backward round on the same plan.

    Kept activations (``pending.kept`` is a key): the servers hold this round's Q, K, V, O and LSE
    rows, so nothing is saved here and the backward round sends dO (``step.backward_kept``), plus
    the merged O and LSE of query shards split on the key axis, which this process's participant
    kept from the forward round's merge (the servers' own are partial). That backward round frees
    them, so a second backward (``retain_graph=True``) is refused. Stateless: saves q, k, v, out
    and the LSE (float32, or float64 for float64 inputs; FlashAttention-2 Alg. 2 recomputes the
    softmax from it), nothing quadratic, and ``step.backward(q, k, v, out, lse, dout,
    softmax_scale)`` resends them, as often as autograd asks.

    The node holds ``pending.ticket`` (a counted forward round's
    :class:`~distca_server.runtime.base.Ticket`). The backward resolves it; if the node is freed
    without a backward, the ticket releases the round's kept activations itself.
    """

    @staticmethod
    def forward(ctx, q, k, v, pending, softmax_scale):
        out, lse = pending.result()
        ctx.kept, ctx.ticket, ctx.backward_ran = pending.kept, pending.ticket, False
        if ctx.kept is None:
            ctx.save_for_backward(q, k, v, out, lse)
        ctx.step, ctx.softmax_scale = pending.step, softmax_scale
        return out

    @staticmethod
    def backward(ctx, dout):
        refuse_double_backward("DistCAClient.attend")
        if ctx.kept is not None and ctx.backward_ran:  # before any round: no peer waits for one
            raise RuntimeError("a second backward through DistCAClient.attend (retain_graph=True) "
                               "needs the activations that the servers kept for the first one and "
                               "freed after it; use a client with keep_activations=False to "
                               "backpropagate through attention more than once")
        ctx.backward_ran = True
        try:
            if ctx.kept is not None:
                dq, dk, dv = ctx.step.backward_kept(ctx.kept, dout.contiguous(), ctx.softmax_scale)
            else:
                q, k, v, out, lse = ctx.saved_tensors
                dq, dk, dv = ctx.step.backward(q, k, v, out, lse, dout.contiguous(), ctx.softmax_scale)
        finally:  # a failed round is resolved too: the step fails, and nothing retries it
            if ctx.ticket is not None:
                ctx.ticket.resolve()
        return dq, dk, dv, None, None


class Pending:
    """A queued forward round (its future) and ``step``, the planned batch it belongs to;
    ``kept``: the key its activations are kept under on the servers (the future's), or None;
    ``ticket``: the round's ticket if it counts for the step (held here until the autograd node
    takes it, so a handle dropped before ``wait()`` frees it too), or None."""

    def __init__(self, step, future, timeout_s: float | None = None, ticket=None):
        self.step, self.future, self.timeout_s, self.ticket = step, future, timeout_s, ticket
        self.kept = getattr(future, "kept", None)

    def result(self):
        return self.future.result(self.timeout_s)
