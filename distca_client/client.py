"""``DistCAClient``: the one call training code makes per attention layer."""

from __future__ import annotations

import torch

from distca_server.kernels import check_backend_name
from distca_server.runtime.base import BATCHES_KEPT, PlannedBatch, Runtime, Traffic, sum_traffic
from distca_server.runtime.local import LocalRuntime
from distca_server.wire import RowFormat
from scheduler.checks import MODES, is_int, is_number
from scheduler.tasks import Plan

from .autograd import DistCAAttention, Pending
from .validate import check_attend_inputs


class DistCAClient:
    """Core attention served by attention servers; ``attend`` equals local causal varlen attention.

    Build one with :meth:`local` (in-process virtual servers) or :meth:`connect` (a job on Ray);
    both run on a :class:`~distca_server.runtime.base.Runtime` and behave the same. Each distinct
    batch (``doc_lens``, attention shape, device) of a step is planned once, so every layer of a
    step reuses its plan.

    When a step ends: each grad-requiring forward round awaits its backward round until that round
    runs or autograd frees the round's node without one. The step ends at the first ``attend``
    made outside a backward pass after a backward round of the step has run and no forward round
    still awaits its backward, or at :meth:`new_step`. An ``attend`` made during a backward pass
    (activation checkpointing's recomputation, reentrant or not) belongs to the step being
    backpropagated. So a checkpointed model makes one plan per batch per training step, and so
    does a schedule that forwards many micro-batches and then backpropagates each. The rule
    follows the program's order of calls, so every client of a job ends a step at the same call
    (details: :class:`~distca_server.runtime.base.StepState`).

    Kept activations (``keep_activations=True``, the default): a forward round that will have a
    backward round (grad enabled and q, k or v requiring grad) leaves its Q, K, V rows and its O
    and LSE on the servers that computed them, and the client saves none of them for autograd;
    that layer's backward round sends dO only, returns dQ, dK, dV and frees them. A second
    backward through the same output (``retain_graph=True``) therefore raises ``RuntimeError``;
    a ``keep_activations=False`` client allows it. When autograd frees a round's node without a
    backward, the round's rows are freed at once on this process's participants (dedicated Ray
    servers free theirs when the next step begins). Forward-only rounds (evaluation,
    ``torch.no_grad``) keep nothing, whatever the setting.
    """

    def __init__(self, runtime: Runtime):
        self._runtime = runtime
        self._last_step: PlannedBatch | None = None
        self._step_batches: list[PlannedBatch] = []  # the batches of the last step, in first use order

    @classmethod
    def local(cls, num_servers: int, epsilon: float = 0.05, backend: str = "auto",
              mode: str = "inplace", *, num_ranks: int | None = None, min_shard: int = 128,
              timeout_s: float = 60.0, keep_activations: bool = True,
              max_held_bytes_per_server: int | None = None, partial_kv: bool = False,
              max_batches: int = BATCHES_KEPT) -> "DistCAClient":
        """In-process client: ``num_ranks`` virtual client ranks and ``num_servers`` servers.

        Args:
            num_servers: attention servers (threads here).
            epsilon: planner imbalance tolerance ε.
            backend: "auto" or a name from :data:`distca_server.kernels.BACKENDS`.
            mode: "inplace" (server i inside virtual rank i) or "dedicated".
            num_ranks: virtual client ranks the batch's documents are spread over (default:
                ``num_servers``; must equal it in in-place mode).
            min_shard: smallest shard (tokens) of a split document.
            timeout_s: how long an all-to-all waits for a participant.
            keep_activations: servers keep each layer's activations from its forward round until
                its backward round (see the class doc); False: every backward round resends Q, K,
                V, O and LSE.
            max_held_bytes_per_server: with ``keep_activations``, the planner's cap on the bytes
                one layer of one batch leaves held on a server (see :func:`scheduler.plan_batch`).
            partial_kv: the planner may also split a query shard's keys over servers where that
                balances better (``plan_batch(..., partial_kv=True)``; full causal attention only).
            max_batches: idle batches (no forward round awaiting its backward) a step keeps
                bound, most recently used first; an evicted one is planned again when next seen.
                Batches awaiting a backward are never evicted, however many.

        Raises:
            ValueError: any argument out of range, naming it.
        """
        num_ranks = num_servers if num_ranks is None else num_ranks
        problems = []
        for name, value in (("num_servers", num_servers), ("num_ranks", num_ranks), ("min_shard", min_shard)):
            if not is_int(value) or value < 1:
                problems.append(f"{name}={value!r} (must be an int >= 1)")
        if mode not in MODES:
            problems.append(f"mode={mode!r} (must be one of {MODES})")
        elif mode == "inplace" and num_ranks != num_servers:
            problems.append(f"num_ranks={num_ranks} != num_servers={num_servers} (inplace mode)")
        try:
            check_backend_name(backend)
        except ValueError as exc:
            problems.append(f"backend={backend!r} ({exc})")
        if not is_number(epsilon) or not 0 <= epsilon < float("inf"):
            problems.append(f"epsilon={epsilon!r} (must be finite and >= 0)")
        if not is_number(timeout_s) or not 0 < timeout_s < float("inf"):
            problems.append(f"timeout_s={timeout_s!r} (must be finite and > 0)")
        for name, value in (("keep_activations", keep_activations), ("partial_kv", partial_kv)):
            if type(value) is not bool:
                problems.append(f"{name}={value!r} (must be a bool)")
        if max_held_bytes_per_server is not None and (not is_int(max_held_bytes_per_server)
                                                      or max_held_bytes_per_server < 1
                                                      or keep_activations is not True):
            problems.append(f"max_held_bytes_per_server={max_held_bytes_per_server!r} (must be an int >= 1, "
                            f"with keep_activations=True)")
        problems += _check_max_batches(max_batches)
        if problems:
            raise ValueError("DistCAClient.local: " + "; ".join(problems))
        runtime = LocalRuntime(int(num_servers), int(num_ranks), mode, float(epsilon), backend,
                               int(min_shard), float(timeout_s), keep_activations,
                               None if max_held_bytes_per_server is None else int(max_held_bytes_per_server),
                               partial_kv)
        runtime.max_batches = int(max_batches)
        return cls(runtime)

    @classmethod
    def connect(cls, name: str = "default", rank: int | None = None, world_size: int | None = None,
                *, timeout_s: float | None = None, keep_activations: bool | None = None,
                max_batches: int = BATCHES_KEPT) -> "DistCAClient":
        """Join job ``name`` on the current Ray cluster as client ``rank`` of ``world_size``.

        Call it from any Ray task or actor (Ray Train workers included: rank and world size then
        come from the Train context; elsewhere from ``RANK``/``WORLD_SIZE`` if not given). A client
        that restarted after a failure rejoins the same way.

        ``keep_activations`` is the job's setting (``distca_server.launch(keep_activations=...)``,
        on by default): every client and server of a plan must agree, so it is chosen once per
        job. Passing it here checks that the job runs with that setting.

        ``max_batches``: as in :meth:`local`. Batches are bound in program order, so give every
        client of a job the same value.

        Raises:
            ValueError: no job of that name, rank/world size missing or inconsistent, a
                ``keep_activations`` other than the job's, or a bad ``max_batches``.
            DistCAError: Ray is not initialised or the scheduler does not answer.
        """
        problems = _check_max_batches(max_batches)
        if problems:  # before registering with the job
            raise ValueError("DistCAClient.connect: " + "; ".join(problems))
        from distca_server.runtime.ray_client import RayClientRuntime
        runtime = RayClientRuntime(name, rank, world_size, timeout_s, keep_activations)
        runtime.max_batches = int(max_batches)
        return cls(runtime)

    def attend_async(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_lens, *,
                     softmax_scale: float | None = None, window: int | None = None) -> "AttendHandle":
        """Start :meth:`attend`'s forward round and return at once; ``handle.wait()`` gives ``out``.

        Meanwhile the training loop can run the other nano-batch's layers (DistCA §4.2 ping-pong).
        Rounds run in call order, so every client must issue them in the same order.

        Raises:
            ValueError: as :meth:`attend`, before anything is queued.
        """
        try:
            lens, scale, window = check_attend_inputs(q, k, v, doc_lens, softmax_scale, window)
        except ValueError as exc:  # peers must not wait for this rank's round until they time out
            self._runtime.fail_step(exc)
            raise
        fmt = RowFormat.of(q, k)
        step = self._runtime.step_for(lens, fmt, q.device, window)
        self._remember(step)
        counts = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        future = step.forward_async(q.detach(), k.detach(), v.detach(), scale, counts)
        ticket = self._runtime.open_ticket(step, future) if counts else None
        return AttendHandle(Pending(step, future, ticket=ticket), q, k, v, scale)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_lens, *,
               softmax_scale: float | None = None, window: int | None = None) -> torch.Tensor:
        """(Sliding-window) causal attention inside each document of a packed batch, computed by
        the servers.

        Args:
            q: [total_tokens, num_heads_q, head_dim], float16/bfloat16/float32/float64.
            k, v: [total_tokens, num_heads_kv, head_dim], same dtype and device;
                ``num_heads_q % num_heads_kv == 0`` (GQA).
            doc_lens: document lengths (tokens) in packing order, a list of ints or a 1-D integer
                tensor, ``sum(doc_lens) == total_tokens``.
            softmax_scale: multiplier of ``Q Kᵀ``; None means ``head_dim ** -0.5``.
            window: sliding window ``W``: row ``t`` sees only keys ``t - W + 1 .. t`` of its
                document (Mistral-style); None means full causal attention. Layers with
                different windows in one step get one plan each (a windowed plan balances
                windowed FLOPs and moves only the keys each shard's window needs).

        Returns:
            out: [total_tokens, num_heads_q, head_dim], q's dtype and device; differentiable
            with respect to q, k and v. Row ``t`` of document ``d`` is
            ``softmax(scale · q_t K_dᵀ[s:t+1]) V_d[s:t+1]``, ``s = 0`` or ``max(0, t - W + 1)``
            (causal, no attention across documents).

        Raises:
            ValueError: bad shapes, dtypes, devices, ``doc_lens``, ``softmax_scale`` or
                ``window``, before any byte moves.
            DistCAError: a participant was lost or timed out.
        """
        return self.attend_async(q, k, v, doc_lens, softmax_scale=softmax_scale, window=window).wait()

    def new_step(self) -> None:
        """End the current step now; the next ``attend`` starts a new one. A step with a backward
        ends by itself (see the class doc). Call this in loops that run forward only
        (evaluation), whose steps never end by themselves. A forward round still awaiting its
        backward loses its kept activations, and that backward raises ``DistCAError``."""
        self._runtime.new_step()

    def _remember(self, batch: PlannedBatch) -> None:
        if self._step_batches and self._step_batches[0].step != batch.step:
            self._step_batches = []
        if all(b is not batch for b in self._step_batches):
            self._step_batches.append(batch)
        self._last_step = batch

    @property
    def last_plan(self) -> Plan | None:
        """The whole :class:`~scheduler.tasks.Plan` of the most recent ``attend`` call's batch
        (every rank's documents and every server's CA-tasks), or None before the first call.

        On a :meth:`connect` client it is fetched from the scheduler on first read.

        Raises:
            DistCAError: the scheduler no longer keeps that plan or does not answer (connect).
        """
        return None if self._last_step is None else self._last_step.plan

    @property
    def last_step(self) -> PlannedBatch | None:
        """The most recent ``attend`` call's batch bound to its plan: ``plan``, ``part``,
        ``participants`` (with their ``traffic`` and ``timings`` counters), ``traffic()``."""
        return self._last_step

    def traffic(self) -> Traffic:
        """Bytes this process's participants sent to other participants during the most recent
        step, summed over its batches: ``{round_kind: {tensor: bytes}}`` (``{}`` before the first
        ``attend``).

        On a :meth:`local` client every participant runs here, so one forward and one backward
        round of a one-batch step equal ``last_plan.comm_bytes()`` tensor by tensor; on a
        :meth:`connect` client it is this client's participant's share (its rows' dispatch, and
        in in-place mode what its server sent back).
        """
        return sum_traffic(b.traffic() for b in self._step_batches)

    def close(self) -> None:
        """Stop the client's threads (and leave the job's group); further ``attend`` calls raise
        ``DistCAError``."""
        self._runtime.close()

    def __enter__(self) -> "DistCAClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_max_batches(value) -> list[str]:
    if not is_int(value) or value < 1:
        return [f"max_batches={value!r} (must be an int >= 1)"]
    return []


class AttendHandle:
    """A forward round in flight; :meth:`wait` returns its ``out`` (connected to autograd)."""

    def __init__(self, pending: Pending, q, k, v, softmax_scale: float):
        self._pending, self._inputs, self._scale = pending, (q, k, v), softmax_scale
        self._out = None

    def wait(self) -> torch.Tensor:
        """Block until the round is done; ``out`` as :meth:`DistCAClient.attend` returns it.

        Raises:
            DistCAError: the round failed (a participant was lost or timed out).
        """
        if self._out is None:
            self._out = DistCAAttention.apply(*self._inputs, self._pending, self._scale)
        return self._out

    def done(self) -> bool:
        return self._pending.future.done()
