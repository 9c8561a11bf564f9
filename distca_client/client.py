"""``DistCAClient``: the one call training code makes per attention layer."""

from __future__ import annotations

import functools
import threading
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from distca_server.kernels import check_backend_name, get_backend
from distca_server.runtime.base import BATCHES_KEPT, PlannedBatch, Runtime, StepTraffic, Traffic
from distca_server.runtime.graphed import RoundGraphs
from distca_server.runtime.local import LocalRuntime
from distca_server.transport.local_heap import HeapGroup
from distca_server.wire import RowFormat
from scheduler.checks import finite_positive, is_int, is_number, positive_int
from scheduler.config import ConfigError, JobConfig, PlanConfig, legacy_fields, render, warn_deprecated
from scheduler.tasks import Plan

from . import op
from .autograd import Pending
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
        self._devices_checked: set[torch.device] = set()  # devices the job's backend runs on
        self._last_step: PlannedBatch | None = None
        self._step_traffic = StepTraffic()  # what the last step's batches sent (traffic())
        op.register(self)  # the operators' name for this client

    @classmethod
    def local(cls, num_servers: int | None = None, *, config: PlanConfig | JobConfig | None = None,
              num_ranks: int | None = None, max_batches: int = BATCHES_KEPT, **legacy) -> "DistCAClient":
        """In-process client: ``num_ranks`` virtual client ranks and ``num_servers`` servers.

        Call :meth:`close` when done, or use the client as a context manager: over the
        in-process heap (``transport`` ``"shm"`` or ``"nvshmem"``) its participants' threads and
        heap (``heap_bytes`` each) live until then, also when the client is dropped (its forward
        rounds' backward may still run after the last reference to it is gone, so it is not
        closed when collected).

        Args:
            num_servers: attention servers (in this process). With a :class:`JobConfig` it defaults
                to ``config.servers`` and must equal it.
            config: a :class:`~scheduler.config.PlanConfig` (the planner's settings; default
                ``PlanConfig()``: in-place, ε 0.05, ``min_shard`` 128, kept activations; see
                :func:`scheduler.plan_batch`), or a :class:`~scheduler.config.JobConfig` (its
                ``plan``, ``servers``, ``backend`` and ``timeout_s``: how long an all-to-all waits
                for a participant, seconds; ``transport`` ``"shm"`` or ``"nvshmem"`` runs the
                participants over an in-process symmetric heap of ``heap_bytes`` per participant,
                the one-sided protocol, device-driven once a plan's routes are installed
                (:mod:`distca_server.transport.local_heap`), instead of in lock step, and with
                ``cuda_graphs`` on CUDA replays the rounds from CUDA graphs once a batch shape ran
                twice (:mod:`distca_server.runtime.graphed`); its other fields do nothing here). With a PlanConfig,
                ``backend`` and ``timeout_s`` are :class:`JobConfig`'s defaults (``"auto"``, 60 s).
                ``keep_activations``: servers keep each layer's activations from its forward round
                until its backward round (see the class doc); False: every backward round resends
                Q, K, V, O and LSE.
            num_ranks: virtual client ranks the batch's documents are spread over (default:
                ``num_servers``; must equal it in in-place mode).
            max_batches: idle batches (no forward round awaiting its backward) a step keeps
                bound, most recently used first; an evicted one is planned again when next seen.
                Batches awaiting a backward are never evicted, however many.
            **legacy: deprecated: ``epsilon``, ``mode``, ``min_shard``, ``keep_activations``,
                ``max_held_bytes_per_server``, ``partial_kv`` (now ``config=PlanConfig(...)``),
                ``backend``, ``timeout_s`` (now ``config=JobConfig(...)``). They warn
                (``DeprecationWarning``) and build the config; in-place stays their default mode.

        Raises:
            ValueError: every bad argument at once, each named (``"DistCAClient.local: ..."``),
                including a backend this install cannot run.
            TypeError: ``config`` together with deprecated arguments, or an unknown keyword.
        """
        entry = "DistCAClient.local"
        given = legacy_fields(entry, (), legacy, accepted=_LOCAL_LEGACY)
        problems, plan, backend, timeout_s, servers = [], None, JobConfig.backend, JobConfig.timeout_s, num_servers
        heap_bytes = None  # an in-process symmetric heap instead of lock step (JobConfig.transport)
        cuda_graphs = False  # its rounds captured and replayed on CUDA (JobConfig.cuda_graphs)
        if given:
            if config is not None:
                raise TypeError(f"{entry}: pass config= or the deprecated arguments ({', '.join(given)}), not both")
            implied = {} if "mode" in given else {"mode": PlanConfig.mode}
            if {"backend", "timeout_s"} & set(given):
                warn_deprecated(entry, list(given), "config=" + render(given, dict(
                    implied, **({} if num_servers is None else {"servers": num_servers}))))
            else:
                warn_deprecated(entry, list(given), "config=" + render(given, kind="PlanConfig"))
            try:  # servers: num_servers, checked below
                job = JobConfig.from_fields(plan=PlanConfig(), **given)
                plan, backend, timeout_s = job.plan, job.backend, job.timeout_s
            except ConfigError as exc:
                problems += exc.problems
                backend = given.get("backend", backend)  # still checked below: every problem at once
        elif config is None or isinstance(config, PlanConfig):
            plan = PlanConfig() if config is None else config
        elif isinstance(config, JobConfig):
            plan, backend, timeout_s = config.plan, config.backend, config.timeout_s
            if config.transport in ("shm", "nvshmem"):
                heap_bytes, cuda_graphs = config.heap_bytes, config.cuda_graphs
            if num_servers is None:
                servers = config.servers
            elif num_servers != config.servers:
                problems.append(f"num_servers={num_servers!r} != config.servers={config.servers} (give one)")
        else:
            problems.append(f"config must be a PlanConfig or JobConfig, got {type(config).__name__}")
        given_ranks = num_ranks is not None
        num_ranks = num_ranks if given_ranks else servers
        for name, value in (("num_servers", servers), ("num_ranks", num_ranks)):
            if name == "num_ranks" and not given_ranks:
                continue  # num_servers' value: named as num_servers if bad, not the caller's num_ranks
            try:
                positive_int(name, value)
            except ValueError as exc:
                problems.append(str(exc))
        if plan is not None and plan.mode == "inplace" and num_ranks != servers:
            problems.append(f"num_ranks={num_ranks} != num_servers={servers} (inplace mode)")
        if isinstance(backend, str) and backend:  # any other backend is named by JobConfig above
            try:
                check_backend_name(backend)
            except ValueError as exc:
                problems.append(f"backend={backend!r} ({exc})")
        problems += _check_max_batches(max_batches)
        if problems:
            raise ConfigError(entry, problems)
        runtime = LocalRuntime(int(servers), int(num_ranks), plan, backend=backend, timeout_s=timeout_s)
        runtime.max_batches = int(max_batches)
        if heap_bytes is not None:
            runtime.group_factory = functools.partial(HeapGroup, heap_bytes=heap_bytes)
            runtime.graphs = RoundGraphs() if cuda_graphs else None
        return cls(runtime)

    @classmethod
    def connect(cls, name: str = "default", rank: int | None = None, world_size: int | None = None,
                *, config: JobConfig | PlanConfig | None = None, timeout_s: float | None = None,
                max_batches: int = BATCHES_KEPT, **legacy) -> "DistCAClient":
        """Join job ``name`` on the current Ray cluster as client ``rank`` of ``world_size``.

        Call it from any Ray task or actor (Ray Train workers included: rank and world size then
        come from the Train context; elsewhere from ``RANK``/``WORLD_SIZE`` if not given). A client
        that restarted after a failure rejoins the same way.

        The job's settings are chosen once, at launch (``distca_server.launch(config=...)``,
        ``distca up``): every client and server of a plan must agree.

        Args:
            name, rank, world_size: the job, this client's rank and the number of clients.
            config: None, or the :class:`~scheduler.config.JobConfig` the job was launched with
                (or only its :class:`~scheduler.config.PlanConfig`): connect checks that the job
                runs with it and raises ``ValueError`` naming every field that differs.
            timeout_s: this client's deadline of every wait, seconds (None: the job's
                ``timeout_s``).
            max_batches: as in :meth:`local`. Batches are bound in program order, so give every
                client of a job the same value.
            **legacy: deprecated: ``keep_activations`` (checks the job's setting; pass the job's
                config instead). It warns (``DeprecationWarning``).

        Raises:
            ValueError: no job of that name, rank/world size missing or inconsistent, a bad
                ``config``, ``timeout_s`` or ``max_batches``, a job that runs with other settings
                than ``config`` (or another ``keep_activations``).
            TypeError: ``config`` together with ``keep_activations``, or an unknown keyword.
            DistCAError: Ray is not initialised or the scheduler does not answer.
        """
        entry = "DistCAClient.connect"
        given = legacy_fields(entry, (), legacy, accepted=("keep_activations",))
        if given:
            if config is not None:
                raise TypeError(f"{entry}: pass config= or the deprecated keep_activations, not both")
            warn_deprecated(entry, list(given), "config= the job's JobConfig (or its PlanConfig), which "
                                                "connect checks the job runs with")
        problems = _check_max_batches(max_batches)
        if config is not None and not isinstance(config, (JobConfig, PlanConfig)):
            problems.append(f"config must be a JobConfig or PlanConfig, got {type(config).__name__}")
        if timeout_s is not None:
            try:
                finite_positive("timeout_s", timeout_s)
            except ValueError as exc:
                problems.append(str(exc))
        if problems:  # before registering with the job
            raise ConfigError(entry, problems)
        from distca_server.runtime.ray_client import RayClientRuntime
        runtime = RayClientRuntime(name, rank, world_size, timeout_s, given.get("keep_activations"), config=config)
        runtime.max_batches = int(max_batches)
        return cls(runtime)

    def attend_async(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_lens, *,
                     softmax_scale: float | None = None, window: int | None = None,
                     return_lse: bool = False) -> "AttendHandle":
        """Start :meth:`attend`'s forward round and return at once; ``handle.wait()`` gives what
        :meth:`attend` returns (``out``, or ``(out, lse)`` with ``return_lse=True``).

        Meanwhile the training loop can run the other nano-batch's layers (DistCA §4.2 ping-pong).
        Rounds run in call order, so every client must issue them in the same order. Eager only:
        under torch.compile call :meth:`attend`. Whether a backward may follow is decided here:
        a round started under ``torch.no_grad`` (or with no input requiring grad) is forward
        only, and ``wait()`` returns an output without a gradient whatever the grad mode then.

        Raises:
            ValueError: as :meth:`attend`, before anything is queued.
        """
        return self._handle(q, k, v, doc_lens, softmax_scale, window, return_lse, synchronous=False)

    def _handle(self, q, k, v, doc_lens, softmax_scale, window, return_lse, *, synchronous: bool) -> "AttendHandle":
        """:meth:`attend_async`'s handle; ``synchronous``: the round runs on this thread and is
        done when this returns (:meth:`attend`)."""
        counts = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                                 for t in (q, k, v))
        pending = self._start_round(q, k, v, doc_lens, softmax_scale, window, counts, synchronous=synchronous,
                                    return_lse=return_lse)
        return AttendHandle(pending, q, k, v, return_lse)

    def _start_round(self, q, k, v, doc_lens, softmax_scale, window, counts: bool, *,
                     synchronous: bool = False, return_lse: bool = False) -> Pending:
        """Check the inputs (``return_lse`` too), find (or plan) the step's batch and start the
        forward round, queued or (``synchronous``) run on this thread; ``counts``: a backward
        round may follow. Raises as :meth:`attend`."""
        try:
            if type(return_lse) is not bool:
                raise ValueError(f"return_lse must be a bool, got {return_lse!r}")
            lens, scale, window = check_attend_inputs(q, k, v, doc_lens, softmax_scale, window)
            self._check_device(q.device)
        except ValueError as exc:  # peers must not wait for this rank's round until they time out
            self._runtime.fail_step(exc)
            raise
        fmt = RowFormat.of(q, k)
        step = self._runtime.step_for(lens, fmt, q.device, window)
        self._remember(step)
        future = step.forward_async(q.detach(), k.detach(), v.detach(), scale, counts, synchronous=synchronous)
        ticket = future.take_ticket() if counts else None
        return Pending(step, future, ticket=ticket, softmax_scale=scale, counts=counts)

    def _check_device(self, device: torch.device) -> None:
        """A ValueError before anything is planned or sent if the job's attention backend cannot
        run on ``device`` (e.g. "torch_cpu" for CUDA tensors, or the meta device): the batch would
        fail only once bound, after the scheduler report and the group join."""
        if device not in self._devices_checked:
            try:
                get_backend(self._runtime.backend, device)
            except ValueError as exc:
                raise ValueError(f"q, k, v are on {device}, where the job's attention backend "
                                 f"{self._runtime.backend!r} cannot run: {exc}") from None
            self._devices_checked.add(device)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_lens, *,
               softmax_scale: float | None = None, window: int | None = None,
               return_lse: bool = False):
        """(Sliding-window) causal attention inside each document of a packed batch, computed by
        the servers.

        The ``distca::attend_fwd`` operator with its autograd formula (:mod:`distca_client.op`):
        ``torch.compile`` traces it (``fullgraph=True`` works); there pass ``doc_lens`` as a
        tensor, so that a new batch is data to the compiled graph rather than a recompile.

        Args:
            q: [total_tokens, num_heads_q, head_dim], float16/bfloat16/float32/float64.
            k, v: [total_tokens, num_heads_kv, head_dim], same dtype and device;
                ``num_heads_q % num_heads_kv == 0`` (GQA).
            doc_lens: document lengths (tokens) in packing order, a list of ints or a 1-D integer
                tensor (any device), ``sum(doc_lens) == total_tokens``.
            softmax_scale: multiplier of ``Q Kᵀ``; None means ``head_dim ** -0.5``.
            window: sliding window ``W``: row ``t`` sees only keys ``t - W + 1 .. t`` of its
                document (Mistral-style); None means full causal attention. Layers with
                different windows in one step get one plan each (a windowed plan balances
                windowed FLOPs and moves only the keys each shard's window needs).
            return_lse: also return the softmax log-sum-exp.

        Returns:
            out: [total_tokens, num_heads_q, head_dim], q's dtype and device, contiguous;
            differentiable with respect to q, k and v. Row ``t`` of document ``d`` is
            ``softmax(scale · q_t K_dᵀ[s:t+1]) V_d[s:t+1]``, ``s = 0`` or ``max(0, t - W + 1)``
            (causal, no attention across documents).
            With ``return_lse=True``, ``(out, lse)``: lse [num_heads_q, total_tokens] on q's
            device (flash-attention's layout), ``lse[h, t] = log Σ_j exp(scale · q_t·k_j)`` over
            the keys row ``t`` sees (natural log), float32 (float64 for float64 inputs). The LSE
            is not differentiable: autograd treats it as a constant (``requires_grad=False``).

        Raises:
            ValueError: bad shapes, dtypes, devices, ``doc_lens``, ``softmax_scale``, ``window``
                or ``return_lse``, before any byte moves (under torch.compile the values of a
                ``doc_lens`` tensor are checked when the compiled code runs).
            DistCAError: a participant was lost or timed out.
            RuntimeError: in the backward, a second backward (``retain_graph=True``) of a
                client that keeps activations, or a double backward (``create_graph=True``).
        """
        return op.attend(self, q, k, v, doc_lens, softmax_scale, window, return_lse)

    def new_step(self) -> None:
        """End the current step now; the next ``attend`` starts a new one. A step with a backward
        ends by itself (see the class doc). Call this in loops that run forward only
        (evaluation), whose steps never end by themselves. A backward still pending from the
        ended step raises ``DistCAError`` (its batch belongs to a step that is over), with or
        without kept activations; a forward round that kept activations releases them."""
        self._runtime.new_step()

    def _remember(self, batch: PlannedBatch) -> None:
        self._step_traffic.add(batch)
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
        return self._step_traffic.total()

    def close(self) -> None:
        """Stop the client's threads (and leave the job's group); further ``attend`` calls raise
        ``DistCAError``."""
        self._runtime.close()

    def __enter__(self) -> "DistCAClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# DistCAClient.local's old settings, deprecated (see its doc).
_LOCAL_LEGACY = ("epsilon", "backend", "mode", "min_shard", "timeout_s", "keep_activations",
                 "max_held_bytes_per_server", "partial_kv")


def _check_max_batches(value) -> list[str]:
    if not is_int(value) or value < 1:
        return [f"max_batches={value!r} (must be an int >= 1)"]
    return []


class AttendHandle:
    """A forward round in flight; :meth:`wait` returns its ``out`` (connected to autograd), or
    ``(out, lse)`` if it was started with ``return_lse=True``."""

    def __init__(self, pending: Pending, q, k, v, return_lse: bool = False):
        self._pending, self._inputs, self._return_lse = pending, (q, k, v), return_lse
        self._result = None

    def wait(self, timeout: float | None = None):
        """Block until the round is done; ``out`` (or ``(out, lse)``) as :meth:`DistCAClient.attend`
        returns it.

        Args:
            timeout: the most seconds to wait (None or inf: until the round ends, which the
                job's ``timeout_s`` bounds anyway: a lost peer fails the round; 0 or less: not at
                all).

        Raises:
            ValueError: ``timeout`` is not an int or float (bool and str refused), or is NaN.
            TimeoutError: the round is still running after ``timeout`` seconds; it goes on, and a
                later ``wait`` returns its result.
            DistCAError: the round failed (a participant was lost or timed out).
        """
        if timeout is not None:
            if not is_number(timeout) or timeout != timeout:  # NaN (math.isnan overflows on huge ints)
                raise ValueError(f"timeout must be a number of seconds or None, got {timeout!r}")
            if timeout > threading.TIMEOUT_MAX:  # inf, or past what a lock wait takes
                timeout = None
        if self._result is None:
            if timeout is not None:
                try:  # wait without taking the result: the round may still be claimed later
                    self._pending.future.exception(timeout=max(0.0, float(timeout)))
                except FutureTimeout:
                    raise TimeoutError(f"the forward round is still running after {timeout} s "
                                       f"(it goes on; wait again for its result)") from None
            self._result = op.finish(self._pending, *self._inputs, lse_wanted=self._return_lse)
        return self._result if self._return_lse else self._result[0]

    def done(self) -> bool:
        return self._pending.future.done()
