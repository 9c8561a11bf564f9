"""``DistCAClient.attend`` as a PyTorch operator that ``torch.compile`` traces.

Three layers, the structure of flash-attention's ``flash_attn_interface.py``:

1. Two ``torch.library.custom_op`` s in the ``distca`` namespace, each with a ``register_fake``
   that gives only output shapes and dtypes, so torch.compile (dynamo, AOTAutograd, inductor)
   traces a call without running it:

   - ``distca::attend_fwd(q, k, v, doc_lens, client, softmax_scale, window, counts, pending, kept)
     -> (out [T, Hq, D] like q, lse [Hq, T] float32 (float64 for float64 q), round [1] int64 CPU)``
     runs (or finishes) one forward round;
   - ``distca::attend_bwd(dout, round, q?, k?, v?, out?, lse?, num_heads_kv) -> (dq, dk, dv)``
     runs its backward round.

2. One autograd formula, registered on ``attend_fwd`` with ``register_autograd``
   (:mod:`distca_client.autograd`: ``setup_context`` saves the round tensor, plus q, k, v, out
   and lse when the servers keep nothing; ``backward`` calls ``attend_bwd``).

3. The documented :meth:`DistCAClient.attend` (and ``attend_async``/``AttendHandle``), which
   call :func:`attend` / :func:`finish` here.

Eager calls take :class:`EagerAttend`, a plain ``torch.autograd.Function`` with the same body and
the same formula, since the operators' Python dispatch costs host time a replayed layer cannot
hide (about 60 µs per layer against 15 µs, ``bench/results/host_path.json``); compiled code calls
the operators.

An operator takes tensors and plain scalars only, so the client goes in as an int key into a
registry that references clients weakly (:func:`register`), and a forward round's state goes
from the forward to the backward op inside the ``round`` tensor (:class:`~distca_client.autograd.Round`).
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Optional

import numpy as np
import torch

from distca_server.dtypes import accumulation_dtype
from scheduler.cost import window_arg

from . import autograd as _autograd
from .autograd import Pending, Round
from .validate import _doc_lens, check_lens_array, check_qkv, check_softmax_scale

_CLIENTS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # client_key -> DistCAClient
_PENDING: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # key -> Pending (attend_async)
_PENDING_KEYS = itertools.count(1)
_NO_DOCS = torch.empty(0, dtype=torch.int64)  # doc_lens of a call that finishes a started round


def register(client) -> None:
    """Name ``client`` to the operators by :func:`client_key` (the registry holds it weakly).
    Called once, when the client is made: traced code only reads the registry."""
    _CLIENTS[client_key(client)] = client


def client_key(client) -> int:
    """The int that names ``client`` to the operators: ``id(client)``, which torch.compile
    traces into a constant of the graph with a guard on the client object's identity, so a
    compiled function called with another client recompiles for it (an int attribute would turn
    into a dynamic int after a recompile, and torch 2.11's dynamo runs an
    ``assume_constant_result`` function on constant arguments only, not on the client)."""
    return id(client)


@torch.compiler.assume_constant_result
def keeps_activations(key: int) -> bool:
    """Whether the servers of the client :func:`client_key` ``key`` names keep a counted round's
    activations (so the autograd formula saves nothing but the round tensor). Read when
    torch.compile traces a call: every runtime knows its setting (a connected client has its
    job's from registering); a runtime that did not say is taken to keep nothing once it has
    planned no batch (the compiled graph then saves q, k, v, out and lse for nothing, but stays
    exact)."""
    client = _client(key)
    runtime = client._runtime
    keep = getattr(runtime, "keep_activations", None)
    if keep is None and client._last_step is not None:
        keep = client._last_step.keep_activations
    return bool(keep)


def _client(key: int):
    client = _CLIENTS.get(key)
    if client is None:
        raise RuntimeError(f"distca::attend_fwd: no live DistCAClient has key {key}")
    return client


# ---- layer 1: the operators ------------------------------------------------------------------

@torch.library.custom_op("distca::attend_fwd", mutates_args=())
def attend_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_lens: torch.Tensor, client: int,
               softmax_scale: Optional[float], window: Optional[int], counts: bool, pending: int,
               kept: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One forward round of core attention through the servers of client ``client``.

    Args:
        q: [T, Hq, D]; k, v: [T, Hkv, D]; float16/bfloat16/float32/float64, one device.
        doc_lens: 1-D integer tensor of document lengths summing to T (any device).
        client: :func:`client_key` of the client.
        softmax_scale: None means ``D ** -0.5``.
        window: sliding window W, or None (full causal).
        counts: a backward round may follow (grad enabled and an input requiring grad).
        pending: 0, or the :func:`finish` key of a round ``attend_async`` started already (the
            other arguments but q, k, v and kept are then ignored).
        kept: whether the servers keep this round's activations (read by the autograd formula).

    Returns:
        out [T, Hq, D] in q's dtype, contiguous; lse [Hq, T] natural log in float32 (float64 for
        float64 q), contiguous; round: int64 [1] on the CPU (see :class:`Round`).

    Raises:
        ValueError: bad inputs (:func:`~distca_client.validate.check_attend_inputs`), before any
            byte moves.
        DistCAError: a participant was lost or timed out.
    """
    return forward_round(q, k, v, doc_lens, client, softmax_scale, window, counts, pending, kept)


def forward_round(q, k, v, doc_lens, client, softmax_scale, window, counts, pending, kept):
    """``distca::attend_fwd``'s body (arguments and results as it documents)."""
    out, lse, rnd = _forward_results(q, k, v, doc_lens, client, softmax_scale, window, counts, pending, kept,
                                     lse_view=False)
    return out, lse, rnd.tensor()


def _forward_results(q, k, v, doc_lens, client, softmax_scale, window, counts, pending, kept, *, lse_view):
    """(out, lse, the :class:`Round`) of :func:`forward_round`; ``pending`` may also be the
    :class:`Pending` itself (an eager call: no trip through the registry of started rounds).
    ``lse_view``: the LSE as a transposed view of the runtime's ``[T, Hq]`` tensor instead of a
    contiguous copy (an operator's outputs need the layout its fake gives; an eager call need not
    copy: see :class:`EagerAttend`)."""
    if isinstance(pending, Pending):
        found = pending
    elif pending:
        found = _PENDING.pop(pending, None)
        if found is None:
            raise RuntimeError(f"distca::attend_fwd: no started round has key {pending}")
    else:
        found = _client(client)._start_round(q, k, v, doc_lens, softmax_scale, window, counts, synchronous=True)
    out, lse = found.result()
    # Never a view, whatever the plan: alone, a server's own rows come back as a slice of its
    # kernel's output, and autograd refuses in-place changes to a view that local attention's
    # output allows (detach shares the storage and its version counter: no copy, still checked).
    out = out.contiguous()
    return out.detach() if out._is_view() else out, lse.t() if lse_view else lse.t().contiguous(), Round(found)


@attend_fwd.register_fake
def _attend_fwd_fake(q, k, v, doc_lens, client, softmax_scale, window, counts, pending, kept):
    check_qkv(q, k, v)
    T, hq, d = q.shape
    return (q.new_empty((T, hq, d)), q.new_empty((hq, T), dtype=accumulation_dtype(q.dtype)),
            torch.empty((1,), dtype=torch.int64, device="cpu"))


@torch.library.custom_op("distca::attend_bwd", mutates_args=())
def attend_bwd(dout: torch.Tensor, round: torch.Tensor, q: Optional[torch.Tensor], k: Optional[torch.Tensor],
               v: Optional[torch.Tensor], out: Optional[torch.Tensor], lse: Optional[torch.Tensor],
               num_heads_kv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward round of the forward round ``round`` names.

    Args:
        dout: [T, Hq, D], the gradient of ``out``.
        round: the forward op's third output.
        q, k, v, out, lse: the forward's inputs and outputs (lse [Hq, T]), or all None when the
            servers kept them.
        num_heads_kv: Hkv (the shape of dk and dv).

    Returns:
        dq [T, Hq, D]; dk, dv [T, Hkv, D]; dout's dtype and device, contiguous.

    Raises:
        RuntimeError: a second backward of a round whose kept activations are freed
            (``retain_graph=True``), or ``round`` names no live round.
        DistCAError: a participant was lost or timed out, or the round's step has ended.
    """
    return Round.of(round).run_backward(dout, q, k, v, out, lse)


@attend_bwd.register_fake
def _attend_bwd_fake(dout, round, q, k, v, out, lse, num_heads_kv):
    T, _, d = dout.shape
    return dout.new_empty(dout.shape), dout.new_empty((T, num_heads_kv, d)), dout.new_empty((T, num_heads_kv, d))


# ---- layer 2: the autograd function ----------------------------------------------------------

attend_fwd.register_autograd(_autograd.backward, setup_context=_autograd.setup_context)


class EagerAttend(torch.autograd.Function):
    """``distca::attend_fwd`` and its autograd formula as a plain autograd function, for eager
    calls: the same body (:func:`forward_round`), the same ``setup_context`` and ``backward``
    (whose eager branch runs the backward round without ``distca::attend_bwd``), and the same
    arguments and results, without the operators' Python dispatch. A no-op pair of operators with
    this signature costs about 60 µs per layer (forward + backward) on the development machine,
    a no-op autograd function 15 µs (``bench/host_path.py``, ``bench/results/host_path.json``):
    host time a replayed layer cannot hide. Compiled code calls the operators (:func:`attend`).

    One difference: its LSE output is ``[Hq, T]`` as a transposed view of the runtime's
    contiguous ``[T, Hq]`` LSE, not a copy. Training (``return_lse=False``) never reads it, a
    stateless round's backward takes the runtime's layout back without a copy
    (:meth:`~distca_client.autograd.Round.run_backward`), and :func:`finish` makes the one copy
    when the caller asks for the LSE: one device copy of T·Hq·4 bytes per layer less."""

    @staticmethod
    def forward(ctx, *inputs):
        # ctx in forward, not a separate setup_context: with one, apply() binds the arguments to
        # forward's signature through inspect on every call (about 100 µs here)
        out, lse, rnd = _forward_results(*inputs, lse_view=True)
        output = (out, lse, rnd.tensor())
        _autograd.setup_context(ctx, inputs, output, rnd)
        return output

    backward = staticmethod(_autograd.backward)


# ---- the calls layer 3 makes -----------------------------------------------------------------

def attend(client, q, k, v, doc_lens, softmax_scale, window, return_lse: bool):
    """``DistCAClient.attend``'s body (see its docstring).

    Eager: run the round on this thread (inputs checked, the step's batch planned or found, the
    round run after this process's earlier rounds; no hand-off to the rounds thread), then
    :func:`finish` it. Under torch.compile the operator starts the round itself,
    when the compiled code runs, from ``doc_lens`` as a tensor: the documents are data to the
    compiled graph, so a new batch does not recompile it (a tensor of another length recompiles
    once, after which its length is dynamic; a Python list is traced element by element, so its
    length is compiled in: one graph per document count). The checks of the tensor's values,
    the planning and the round all happen inside the operator, where nothing is traced.
    Argument errors found while tracing (a non-tensor q, a bad ``softmax_scale``) are ValueErrors
    that dynamo reports; with ``fullgraph=True`` as ``torch._dynamo.exc.Unsupported`` naming it.
    """
    if not torch.compiler.is_compiling():  # the round runs on this thread: no hand-off
        # (its checks, return_lse's included, tell the peers before raising: Runtime.fail_step)
        return client._handle(q, k, v, doc_lens, softmax_scale, window, return_lse, synchronous=True).wait()
    if type(return_lse) is not bool:
        raise ValueError(f"return_lse must be a bool, got {return_lse!r}")
    check_qkv(q, k, v)  # from shapes, while tracing: the backward's fake would misreport a mismatch
    counts = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    key = client_key(client)
    out, lse, _ = torch.ops.distca.attend_fwd(
        q, k, v, _doc_lens_tensor(doc_lens), key, check_softmax_scale(softmax_scale),
        window_arg(window), counts, 0, counts and keeps_activations(key))
    return (out, lse) if return_lse else out


def finish(pending: Pending, q, k, v, lse_wanted: bool = True):
    """``(out, lse)`` of the round ``pending`` (started by ``attend`` or ``attend_async``), with
    the autograd node every ``attend`` has: :class:`EagerAttend`'s (the operator's when traced);
    lse [Hq, T] contiguous, or (not ``lse_wanted``, eager) whatever layout costs no copy."""
    if torch.compiler.is_compiling():
        key = next(_PENDING_KEYS)
        _PENDING[key] = pending
        out, lse, _ = torch.ops.distca.attend_fwd(q, k, v, _NO_DOCS, 0, None, None, False, key,
                                                  pending.kept is not None)
        return out, lse
    # A round started forward-only (under no_grad, or no input requiring grad) has no backward
    # round in its step, whatever the grad mode is now: its outputs are not connected to autograd
    # (a backward through them would run a round the step never counted, or one whose
    # activations were not kept).
    with torch.no_grad() if not pending.counts else contextlib.nullcontext():
        out, lse, _ = EagerAttend.apply(q, k, v, _NO_DOCS, 0, None, None, False, pending, pending.kept is not None)
    return out, lse.contiguous() if lse_wanted else lse


def _doc_lens_tensor(doc_lens) -> torch.Tensor:
    """``doc_lens`` as a 1-D integer tensor for the operator, which checks its values."""
    if isinstance(doc_lens, np.ndarray):  # a tensor first: dynamo traces tensors, not ndarray.dtype
        doc_lens = torch.from_numpy(doc_lens)
    if isinstance(doc_lens, torch.Tensor):
        return check_lens_array(doc_lens)
    return torch.tensor(_doc_lens(doc_lens), dtype=torch.int64)  # a list's ints, checked
