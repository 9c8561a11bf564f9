"""The autograd formula of ``distca::attend_fwd`` (the op behind ``DistCAClient.attend``): one
forward round, one backward round, and the state a round carries from one to the other.

The op layers (:mod:`distca_client.op`) register :func:`setup_context` and :func:`backward` with
``torch.library.register_autograd``: that pair is the one autograd function of ``attend``, in eager
mode and under ``torch.compile`` alike. torch.compile traces the backward into a graph, so a
round's state cannot ride on ``ctx`` as Python attributes; it lives in a :class:`Round` that a
small tensor owns (the op's third output), and autograd saves that tensor.
"""

from __future__ import annotations

import itertools
import struct
import weakref

import torch
from torch._subclasses.fake_tensor import is_fake


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


class Pending:
    """A queued forward round (its future) and ``step``, the planned batch it belongs to;
    ``kept``: the key its activations are kept under on the servers (the future's), or None;
    ``ticket``: the round's ticket if it counts for the step (held here until the round's
    :class:`Round` takes it, so a handle dropped before ``wait()`` frees it too), or None;
    ``softmax_scale``: the scale the round runs with (a float); ``counts``: a backward round may
    follow (grad was enabled and an input required grad when the round started)."""

    def __init__(self, step, future, timeout_s: float | None = None, ticket=None,
                 softmax_scale: float | None = None, counts: bool = True):
        self.step, self.future, self.timeout_s, self.ticket = step, future, timeout_s, ticket
        self.softmax_scale, self.counts = softmax_scale, counts
        self.kept = getattr(future, "kept", None)

    def result(self):
        return self.future.result(self.timeout_s)


_ROUNDS: "weakref.WeakValueDictionary[int, Round]" = weakref.WeakValueDictionary()
_ROUND_IDS = itertools.count(1)


class Round(bytearray):
    """A finished forward round's state until its backward round: ``step`` (the
    :class:`~distca_server.runtime.base.PlannedBatch` that runs the backward round), ``kept``
    (the servers' key of its activations, or None), ``ticket`` (see below), ``softmax_scale``.

    The object is 8 bytes holding its id; :meth:`tensor` is an int64 ``[1]`` CPU tensor over
    those bytes (``torch.frombuffer``), the op's ``round`` output. Autograd saves that tensor, and
    its storage keeps this object alive: when autograd frees the node (after its backward, or
    without one) the round goes with it. The backward op finds the round again from the id
    (:meth:`of`), so a copy of the tensor names it too. In eager mode the node's ``ctx`` also
    holds the round and its backward uses that one: a saved-tensor hook that copies saved tensors
    (CPU offloading) does not free it early, and under non-reentrant checkpointing the backward
    uses the activations the servers kept for the original forward (the recomputed forward's
    round is freed with its throw-away node). Compiled code has only the storage: there a copying
    hook frees the round when it drops the original, and the backward then raises.

    Kept activations (``kept`` is a key): the servers hold this round's Q, K, V, O and LSE rows,
    so nothing else is saved and the backward round sends dO (``step.backward_kept``), plus the
    merged O and LSE of query shards split on the key axis, which this process's participant kept
    from the forward round's merge (the servers' own are partial). That backward round frees
    them, so a second backward (``retain_graph=True``) is refused. Otherwise the autograd formula
    saves q, k, v, out and the LSE (float32, or float64 for float64 inputs; FlashAttention-2 Alg. 2
    recomputes the softmax from it), nothing quadratic, and ``step.backward(q, k, v, out, lse,
    dout, softmax_scale)`` resends them, as often as autograd asks.

    ``ticket``: a counted forward round's :class:`~distca_server.runtime.base.Ticket`. The
    backward resolves it; if the round is freed without a backward, the ticket releases the
    round's kept activations itself.
    """

    def __init__(self, pending: Pending):
        super().__init__(8)
        self.id = next(_ROUND_IDS)
        self.step, self.kept, self.softmax_scale = pending.step, pending.kept, pending.softmax_scale
        self.ticket, pending.ticket = pending.ticket, None  # owned here from now on
        self.backward_ran = False
        _ROUNDS[self.id] = self

    def tensor(self) -> torch.Tensor:
        """An int64 ``[1]`` CPU tensor holding :attr:`id`, whose storage owns this round."""
        struct.pack_into("=q", self, 0, self.id)  # the bytes themselves: no tensor operation
        return torch.frombuffer(self, dtype=torch.int64)

    @staticmethod
    def of(t: torch.Tensor) -> "Round":
        """The round whose :meth:`tensor` (or a copy of it) is ``t``.

        Raises:
            RuntimeError: no such round lives (``t`` is not a round tensor).
        """
        rnd = _ROUNDS.get(int(t.item())) if t.numel() == 1 else None
        if rnd is None:
            raise RuntimeError("distca::attend_bwd: its round tensor names no live forward round: pass "
                               "the third output of distca::attend_fwd as autograd saved it (in compiled "
                               "code a saved-tensor hook that copies saved tensors, such as CPU "
                               "offloading, frees the round; see distca_client.autograd.Round)")
        return rnd

    def run_backward(self, dout, q, k, v, out, lse):
        """``distca::attend_bwd``'s body: :meth:`backward` with ``lse`` in the operator's layout
        ([num_heads_q, T] or None); ``(dq, dk, dv)`` contiguous."""
        dq, dk, dv = self.backward(dout, q, k, v, out, None if lse is None else lse.t().contiguous())
        return dq.contiguous(), dk.contiguous(), dv.contiguous()

    def backward(self, dout, q, k, v, out, lse):
        """Run the backward round: ``(dq, dk, dv)`` like q, k, v. ``q, k, v, out`` and ``lse``
        ([T, num_heads_q], the runtime's layout) are None when the servers kept the activations.

        Raises:
            RuntimeError: a second backward of a round whose kept activations the first one
                freed (before any round: no peer waits for one), or no activations at all.
            DistCAError: the backward round failed.
        """
        if self.kept is not None and self.backward_ran:
            raise RuntimeError("a second backward through DistCAClient.attend (retain_graph=True) "
                               "needs the activations that the servers kept for the first one and "
                               "freed after it; use a client with keep_activations=False to "
                               "backpropagate through attention more than once")
        if self.kept is None and q is None:
            raise RuntimeError("DistCAClient.attend: a forward round whose activations the servers did "
                               "not keep saved no q, k, v, out and lse for its backward (under "
                               "torch.compile, a connected client guessed its job's keep_activations "
                               "before its first round)")
        self.backward_ran = True
        try:
            if self.kept is not None:
                return self.step.backward_kept(self.kept, dout.contiguous(), self.softmax_scale)
            return self.step.backward(q, k, v, out, lse, dout.contiguous(), self.softmax_scale)
        finally:  # a failed round is resolved too: the step fails, and nothing retries it
            if self.ticket is not None:
                self.ticket.resolve()


# ---- the formula registered on distca::attend_fwd ---------------------------------------------
# inputs: q, k, v, doc_lens, client, softmax_scale, window, counts, pending, kept
# outputs: out [T, Hq, D], lse [Hq, T], round [1] int64


def setup_context(ctx, inputs, output, own: "Round | None" = None) -> None:
    """Save the round tensor, plus q, k, v, out and lse unless the servers keep the round's
    activations (the op's ``kept`` argument); the LSE is not differentiable. ``own``: the
    :class:`Round` the round tensor names, where the caller has it (eager), else found from the
    tensor."""
    q, k, v, *_, kept = inputs
    out, lse, rnd = output
    ctx.mark_non_differentiable(lse, rnd)
    ctx.set_materialize_grads(False)  # no zero-filled gradients of lse and round (two launches a layer)
    ctx.out_meta = (out.shape, out.dtype, out.device)  # for a dout that never came (below)
    if own is not None or not is_fake(rnd):  # eager: the node owns the round too, whatever
        ctx.round = own if own is not None else Round.of(rnd)  # saved-tensor hooks (offloading) do
    ctx.num_heads_kv = k.shape[1]
    if kept:
        ctx.save_for_backward(rnd)
    else:
        ctx.save_for_backward(rnd, q, k, v, out, lse)


def backward(ctx, dout, _dlse, _dround):
    """dq, dk, dv from the backward round (``distca::attend_bwd``); None for the other inputs.

    Raises:
        RuntimeError: in a backward with ``create_graph=True`` (double backward), or as
            :meth:`Round.backward`.
    """
    refuse_double_backward("DistCAClient.attend")
    rnd, *saved = ctx.saved_tensors
    q, k, v, out, lse = saved or (None,) * 5
    if dout is None:  # no gradient reached out: the backward round still runs, on every client alike
        shape, dtype, device = ctx.out_meta
        dout = torch.zeros(shape, dtype=dtype, device=device)
    own = getattr(ctx, "round", None)
    if own is not None:  # eager: this node's own round, also when non-reentrant checkpointing
        # recomputed the saved tensors (and so ran another forward round); run it here, without
        # the operator's dispatch (traced code has no own round and calls the operator)
        dq, dk, dv = own.run_backward(dout, q, k, v, out, lse)
    else:
        dq, dk, dv = torch.ops.distca.attend_bwd(dout, rnd, q, k, v, out, lse, ctx.num_heads_kv)
    return dq, dk, dv, None, None, None, None, None, None, None
