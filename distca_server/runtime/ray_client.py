"""``DistCAClient.connect``: a client of a distca job running on Ray.

Per step the client reports its batch to the scheduler actor once and gets its part of the plan;
then every layer's forward round and, later, backward round runs over the job's all-to-all group
(joined, run and left through :class:`~distca_server.runtime.member.GroupMember`). Steps end as in
:class:`~distca_server.runtime.base.StepState`; within a step, each batch (ping-pong nano-batches,
identical or not) gets its own plan. All rounds of a client run in order on one worker thread, so
``attend_async`` rounds keep the same order on every client.

After a failure every client goes on at the step the scheduler names. When the scheduler dies
and Ray restarts it, the client registers again with its step and epoch and goes on: a step in
flight (batches bound) fails on every participant once a member notices the death (its
long-poll, about 2 s; rounds already on the data plane finish, exact, until then), and a client
with nothing of its step bound waits for the restart and loses no step. A scheduler that cannot
come back (Ray no longer knows its name) fails the next report at once. A report of a step the
job has left behind, by a client that took no part in it, is answered ``resync`` and made again
at the job's step (the step protocol: ``docs/design.md``).
"""

from __future__ import annotations

import logging
import os
import threading
import time

import ray
import torch

from scheduler.actor import NAMESPACE, scheduler_actor_name
from scheduler.config import JobConfig, PlanConfig, differences
from scheduler.cost import RoundKind
from scheduler.logs import configure_logging
from scheduler.messages import decode_answer, encode_report
from scheduler.parts import PlanPart
from scheduler.tasks import Plan

from ..dtypes import dtype_name
from ..errors import DistCAError
from ..header import RoundHeader
from ..kernels import get_backend
from ..participant import Participant
from ..wire import RowFormat
from .base import PlannedBatch, Runtime, StepState
from .order import RoundQueue
from .member import REGISTER_TIMEOUT_S, GroupFailure, GroupMember, SchedulerLost, ask

_REPORT_TRIES = 4  # a report re-made after a re-registration or a resync, at most this often
_RESTART_POLL_S = 0.2  # while the scheduler restarts, try to register again this often
log = logging.getLogger(__name__)


def _check_settings(name: str, cfg: dict, keep_activations: bool | None,
                    config: JobConfig | PlanConfig | None) -> None:
    """``keep_activations`` and ``config`` given to ``connect`` against the job's settings
    (:meth:`SchedulerActor.settings`); None: not checked.

    Raises:
        ValueError: naming the job and every field that differs.
    """
    if keep_activations is not None and keep_activations != cfg["keep_activations"]:
        raise ValueError(f"job {name!r} runs with keep_activations={cfg['keep_activations']}, not "
                         f"{keep_activations} (it is set once per job, at launch)")
    if config is not None:
        job = cfg["config"]  # as a dict: see differences
        differ = differences(config, job if isinstance(config, JobConfig) else job["plan"])
        if differ:
            raise ValueError(f"job {name!r} runs with another config than the one given to connect "
                             f"(given != the job's, set once at launch): {'; '.join(differ)}")


def _ray_rank_and_size(rank, world_size):
    if rank is not None and world_size is not None:
        return rank, world_size
    try:  # inside a Ray Train worker
        from ray import train
        ctx = train.get_context()
        r, w = ctx.get_world_rank(), ctx.get_world_size()
        return (rank if rank is not None else r), (world_size if world_size is not None else w)
    except Exception:  # not in a Ray Train session: fall back to the torchrun-style environment
        pass
    env_rank, env_size = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if env_rank is not None and env_size is not None:
        return (rank if rank is not None else int(env_rank)), (world_size if world_size is not None else int(env_size))
    raise ValueError("connect() needs rank and world_size (pass them, run inside Ray Train, "
                     "or set RANK and WORLD_SIZE)")


class RayBatch(PlannedBatch):
    """One batch of one step bound to this client's participant in the job's group."""

    def __init__(self, runtime: "RayClientRuntime", participant: Participant, step: int, batch: int,
                 backend_name: str):
        self.runtime, self.step, self.batch = runtime, step, batch
        self.participants, self.backend_name = [participant], backend_name
        self.epoch: int | None = None  # the group epoch the batch was planned in (step_for sets it)
        self._plan: Plan | None = None
        self._plan_lock = threading.Lock()

    @property
    def plan(self) -> Plan:
        """The whole plan, fetched from the scheduler on first read (clients get only their part
        when the batch is planned) and cached.

        Raises:
            DistCAError: the scheduler no longer keeps this batch's plan (it keeps the last few),
                or does not answer.
        """
        with self._plan_lock:
            if self._plan is None:
                self._plan = self.runtime.fetch_plan(self.step, self.batch)
            return self._plan

    def forward_async(self, q, k, v, softmax_scale, counts_for_step=True, synchronous=False):
        return self.runtime.submit(self, RoundKind.FORWARD, (q, k, v), softmax_scale, q.dtype, counts_for_step,
                                   synchronous=synchronous)

    def backward(self, q, k, v, out, lse, dout, softmax_scale):
        return self.runtime.submit(self, RoundKind.BACKWARD, (q, k, v, out, lse, dout), softmax_scale,
                                   q.dtype, synchronous=True).result()

    def backward_kept(self, kept, dout, softmax_scale):
        return self.runtime.submit(self, RoundKind.BACKWARD, (dout,), softmax_scale, dout.dtype,
                                   kept=kept, synchronous=True).result()


class RayClientRuntime(Runtime):
    """The client side of a job: scheduler round trips, group membership, ordered rounds.

    Args:
        name: the job.
        rank, world_size: this client's rank and the number of clients (None: from Ray Train or
            ``RANK``/``WORLD_SIZE``).
        timeout_s: deadline of every wait, seconds (None: the job's).
        keep_activations: None, or the job's setting this client expects (checked).
        config: None, or the job's :class:`~scheduler.config.JobConfig` (or its
            :class:`~scheduler.config.PlanConfig`) this client expects (checked field by field).

    Raises:
        ValueError: no job of that name, rank/world size missing or inconsistent, or a
            ``keep_activations`` or ``config`` other than the job's (naming every field that differs).
        DistCAError: Ray is not initialised or the scheduler does not answer.
    """

    def __init__(self, name: str, rank: int | None, world_size: int | None, timeout_s: float | None,
                 keep_activations: bool | None = None, config: JobConfig | PlanConfig | None = None):
        if keep_activations is not None and type(keep_activations) is not bool:
            raise ValueError(f"keep_activations must be a bool or None, got {keep_activations!r}")
        if not ray.is_initialized():
            raise DistCAError("DistCAClient.connect needs Ray: call it from a Ray task or actor, "
                              "or ray.init() first")
        self.rank, self.world_size = _ray_rank_and_size(rank, world_size)
        try:
            self.scheduler = ray.get_actor(scheduler_actor_name(name), namespace=NAMESPACE)
        except ValueError:
            raise ValueError(f"no distca job named {name!r}; start one with `distca up --name {name}` "
                             f"or distca_server.launch(name={name!r})") from None
        self.name = name
        configure_logging(f"distca-client-{name}-{self.rank}")
        self.node = ray.util.get_node_ip_address()
        self.incarnation = f"{os.getpid()}-{time.time_ns()}"
        self.timeout_s = float(timeout_s) if timeout_s is not None else JobConfig.timeout_s
        self.member: GroupMember | None = None
        if keep_activations is not None or config is not None:
            # before registering: a registration replaces the rank's earlier one, so a client
            # refused here would otherwise have evicted the rank's live client from the job
            _check_settings(name, ask(self.scheduler.settings.remote(), max(self.timeout_s, REGISTER_TIMEOUT_S)),
                            keep_activations, config)
        cfg = self._register()
        self.mode, self.backend = cfg["mode"], cfg["backend"]
        # the job's, set once at launch (None: a scheduler that did not say; the plans tell)
        self.keep_activations = cfg.get("keep_activations")
        self.timeout_s = float(timeout_s if timeout_s is not None else cfg["timeout_s"])
        self._state = StepState(cfg["next_step"])
        heap_bytes = (cfg.get("config") or {}).get("heap_bytes")  # the job's symmetric heap (world rank 0 uses it)
        self.member = GroupMember(self.scheduler, self.node, self.timeout_s, f"rank {self.rank}", job=name,
                                  heap_bytes=heap_bytes)
        self.member.scheduler_incarnation = cfg["scheduler"]
        self._needs_register = False
        self._rounds = RoundQueue(f"distca-client-{self.rank}")
        self._lock = threading.RLock()
        self.closed = False

    def _register(self, step: int = 0) -> dict:
        """Register with the job's scheduler (again after it restarted), telling it the step this
        client goes on with and the last group epoch it was in."""
        ctx = ray.get_runtime_context()
        # worker, job_id, driver: the scheduler's status lists only clients whose process lives, and
        # refuses a client whose Ray job (the training run) differs from a running one's
        info = {"node": self.node, "pid": os.getpid(), "incarnation": self.incarnation, "step": step,
                "epoch": self.member.epoch if self.member is not None else None,
                "worker": ctx.get_worker_id(), "job_id": ctx.get_job_id(),
                "driver": ctx.worker.mode == ray.SCRIPT_MODE}
        log.info("rank %d of %d: registering with job %s at step %d", self.rank, self.world_size, self.name, step)
        cfg = ask(self.scheduler.register_client.remote(self.rank, self.world_size, info),
                  max(self.timeout_s, REGISTER_TIMEOUT_S))
        self._token = cfg.get("token")  # this registration's secret: fail_step and plan_descriptor need it
        return cfg

    def _reregister(self) -> None:
        """Register again if the scheduler died since (lock held). A step with batches bound is
        over when the job goes on at a later step: :class:`DistCAError`."""
        if not (self._needs_register or self.member.scheduler_lost):
            return
        cfg = self._register(self._state.step)
        self._needs_register = self.member.scheduler_lost = False
        self.member.scheduler_incarnation = cfg["scheduler"]
        if cfg["next_step"] > self._state.step:
            mid_step = bool(self._state.batches)
            step = self._state.step
            self._state.advance(cfg["next_step"])
            if mid_step:
                raise DistCAError(f"rank {self.rank}: step {step} failed: the job's scheduler restarted and "
                                  f"goes on at step {cfg['next_step']}")

    def _resume_after(self, failure: GroupFailure) -> DistCAError:
        """Go on at the step the scheduler's verdict names (every client does the same); returns
        the verdict as the plain :class:`DistCAError` users see."""
        with self._lock:
            self._state.advance(max(failure.next_step, self._state.step + 1))
            if self.member.scheduler_lost:
                self._needs_register = True
        log.warning("rank %d: %s; going on at step %d", self.rank, failure, self._state.step)
        return DistCAError(str(failure))

    def fail_step(self, error: ValueError) -> None:
        """This client's own input failed a check in the current step: every other client of
        the job fails the step at once with the same message (their open reports get it as a
        ``ValueError``; peers waiting in a round get a ``DistCAError`` carrying it), and all go
        on at the next step. Never raises: the caller raises ``error``."""
        with self._lock:
            if self.closed:
                return
            if self._state.ended:
                self._state.advance()
            step, mid_step = self._state.step, self._state.seq > 0
            self._state.advance()
            try:  # a restarted scheduler takes fail_step only from a client that registered with it
                self._reregister()
            except Exception:  # the scheduler is gone or broken: the peers' own timeouts take over
                return
        message = str(error)
        try:
            ask(self.scheduler.fail_step.remote(step, self.rank, message, self._token), self.timeout_s)
        except Exception:  # the scheduler is gone or broken: the peers' own timeouts take over
            return
        if mid_step and self.member.joined:  # peers may wait in this step's next round
            fail = lambda: self.member.fail(step, f"step {step}", f"rank {self.rank}: {message}",  # noqa: E731
                                            detected=True)
            self._rounds.reserve().here(fail).result()  # after the rounds this client queued

    def step_for(self, doc_lens: list[int], fmt: RowFormat, device: torch.device,
                 window: int | None = None) -> RayBatch:
        """The batch for ``doc_lens`` in the current step (see :meth:`StepState.lookup`), asking
        the scheduler for a new one when none is free."""
        if self.closed:
            raise DistCAError("this DistCAClient is closed")
        with self._lock:
            key = (tuple(doc_lens), fmt, str(device), window)
            found = self._state.lookup(key)
            if found is not None:
                return found
            shape = {"cost": fmt.cost.to_wire(), "device_type": torch.device(device).type, "window": window,
                     "dtype": dtype_name(fmt.dtype)}
            step, batch, answer = self._report(doc_lens, shape)
            if "error" in answer:  # every client of the batch gets it: all move on together
                self._state.advance()
                if answer["error"] == "ValueError":
                    raise ValueError(answer["message"])
                raise DistCAError(answer["message"])
            part = PlanPart.from_msgpack(answer["part"])
            if (part.rank, part.step, part.batch, part.cost, part.doc_lens) != (
                    self.rank, step, batch, fmt.cost, list(doc_lens)):
                # A scheduler bug, or an actor squatting the job's scheduler name: refused before
                # this client joins any group or moves a row.
                self._state.advance()
                raise ValueError(
                    f"rank {self.rank}: the scheduler of job {self.name!r} answered step {step} batch {batch} "
                    f"with the part of rank {part.rank} step {part.step} batch {part.batch}, "
                    f"{len(part.doc_lens)} documents ({part.num_tokens} tokens), {part.cost}; this client "
                    f"reported {len(doc_lens)} documents ({sum(doc_lens)} tokens), {fmt.cost}")
            group = answer["group"]
            try:
                self.member.join(group["epoch"], group["world_rank"], group["world_size"], device, step=step,
                                 transport=group["transport"])
            except GroupFailure as failure:
                raise self._resume_after(failure) from None
            backend = get_backend(self.backend, device)
            found = RayBatch(self, Participant(part, fmt, backend, device), step, batch, backend.name)
            found.epoch = group["epoch"]
            self._state.add(key, found)
            return found

    def _report(self, doc_lens: list[int], shape: dict) -> tuple[int, int, dict]:
        """Report the next batch of the current step and wait for the scheduler's answer (lock
        held); returns ``(step, batch, answer)``. Follows the step protocol of ``docs/design.md``:

        - a ``resync`` answer (the job left this step behind, and this client took no part in its
          failure) moves the client to the job's step and reports there, unless the client already
          has batches bound in the step (then the step failed for it: :class:`DistCAError`);
        - a scheduler that died is waited for (it restarts under Ray) and registered with again:
          while nothing of the step is bound, that costs no step; mid-step the step fails.

        Raises:
            DistCAError: mid-step, the scheduler died or the job went on; or the scheduler did not
                come back within ``max(timeout_s, REGISTER_TIMEOUT_S)``, cannot come back (at once:
                :meth:`_scheduler_gone_for_good`), or kept answering ``resync``.
        """
        lost_since, tries = None, 0
        while tries < _REPORT_TRIES:
            try:
                self._reregister()
                step, batch = self._state.step, self._state.next_batch_index()
                request = encode_report(step, batch, self.rank, doc_lens, shape, self._token)
                answer = decode_answer(ask(self.scheduler.report.remote(request), self.timeout_s + 10))
            except SchedulerLost as exc:
                self._needs_register = True
                step = self._state.step
                if self._state.batches:  # this step's rounds were planned by the scheduler that died
                    self._state.advance()
                    raise DistCAError(f"rank {self.rank}: step {step} failed: {exc}") from None
                gone = self._scheduler_gone_for_good()
                if gone is not None:
                    raise DistCAError(f"rank {self.rank}: step {step}: {exc}, and it will not come back: "
                                      f"{gone}") from None
                lost_since = lost_since or time.monotonic()
                waited = time.monotonic() - lost_since
                if waited > max(self.timeout_s, REGISTER_TIMEOUT_S):
                    raise DistCAError(f"rank {self.rank}: step {step}: {exc}, and it did not come back within "
                                      f"{waited:.0f} s") from None
                time.sleep(_RESTART_POLL_S)  # Ray is restarting it: not a try of the loop
                continue
            tries += 1
            if answer.get("register"):  # a restarted scheduler that does not know us yet
                self._needs_register = True
                continue
            if answer.get("error") == "resync":  # the job left this step behind
                mid_step = bool(self._state.batches)
                self._state.advance(max(answer["next_step"], step + 1))
                log.info("rank %d: %s; going on at step %d", self.rank, answer["message"], self._state.step)
                if mid_step:
                    raise DistCAError(f"rank {self.rank}: {answer['message']}")
                continue
            return step, batch, answer
        raise DistCAError(f"rank {self.rank}: the scheduler of job {self.name!r} did not plan "
                          f"step {step} batch {batch} after {_REPORT_TRIES} tries")

    def _scheduler_gone_for_good(self) -> str | None:
        """Why the job's scheduler, found dead, cannot come back; None while Ray may restart it.
        A restarting actor keeps its name; one that is dead for good (``distca down``, or out of
        restarts) no longer has it, and a job launched since under the same name has another
        actor."""
        try:
            handle = ray.get_actor(scheduler_actor_name(self.name), namespace=NAMESPACE)
        except ValueError:
            return (f"Ray no longer knows job {self.name!r} (it was shut down, or its scheduler "
                    f"used up its restarts)")
        except Exception:  # the cluster itself is slow or restarting: keep waiting
            return None
        if handle._actor_id != self.scheduler._actor_id:  # ActorHandle has no public id
            return f"job {self.name!r} was launched again since; connect to it anew"
        return None

    def fetch_plan(self, step: int, batch: int) -> Plan:
        """The whole plan of ``(step, batch)`` from the scheduler (``plan_descriptor``).

        Raises:
            DistCAError: the scheduler no longer keeps it, or does not answer.
            ValueError: the scheduler refused this client's token (another client of its rank
                registered since).
        """
        try:
            data = ask(self.scheduler.plan_descriptor.remote(step, batch, self.rank, self._token), self.timeout_s)
        except SchedulerLost as exc:  # a restarted scheduler keeps no plan of before
            self._needs_register = True
            raise DistCAError(f"rank {self.rank}: the plan of step {step} batch {batch}: {exc}") from None
        if data is None:
            raise DistCAError(f"the scheduler of job {self.name!r} no longer keeps the plan of step "
                              f"{step} batch {batch} (it keeps the most recent ones)")
        return Plan.from_msgpack(data)

    # ---- rounds ----------------------------------------------------------------------------------
    def submit(self, batch: RayBatch, kind: RoundKind, tensors, softmax_scale: float, dtype,
               counts_for_step: bool = True, kept: int | None = None, *, synchronous: bool = False):
        """Count a round toward its step and run it after this client's earlier rounds: here
        (``synchronous``) or on the client's rounds thread (:mod:`~distca_server.runtime.order`);
        returns a future of its result (a forward round's tells the step when its result is
        claimed). A forward round of a kept-activation plan that counts for the step is kept
        under its sequence number; a backward round names the key of its forward round in
        ``kept``."""
        with self._lock:
            if self.closed:
                raise DistCAError("this DistCAClient is closed")
            seq = self._state.count_round(batch, kind, counts_for_step)
            ticket = None
            if kind == RoundKind.FORWARD:
                kept = seq if batch.keep_activations and counts_for_step else None
                # under the lock with the count: another thread must not end the step between
                ticket = self._state.open_ticket(batch, kept) if counts_for_step else None
            header = RoundHeader(batch.step, batch.batch, seq, kind, dtype, float(softmax_scale),
                                 batch.participants[0].part.plan_id, -1 if kept is None else kept)
            slot = self._rounds.reserve()  # in the order rounds are counted
        if synchronous:
            future = slot.here(self._run, batch, header, tensors)
        else:
            future = slot.queued(self._run, tensors, batch, header, tensors)
        return self._state.claimable(batch, future, kept, ticket) if kind == RoundKind.FORWARD else future

    def _run(self, batch: RayBatch, header: RoundHeader, tensors):
        participant = batch.participants[0]
        if self.member.joined and self.member.epoch != batch.epoch:
            # Its parts fit only the group they were planned for (the scheduler keeps a step's
            # batches in one group: this is a backstop, never a round over another group).
            raise DistCAError(f"rank {self.rank}: {header.describe()}: the batch was planned in group epoch "
                              f"{batch.epoch}, which this client has left for epoch {self.member.epoch}; "
                              f"start a new step")
        try:
            return self.member.run_round(header, self.world_size, lambda _: participant, tensors)
        except GroupFailure as failure:
            raise self._resume_after(failure) from None

    def close(self) -> None:
        """Leave the job. Closed in the middle of a step (a forward round of it awaits its
        backward round, which the peers would wait in), the client first fails the step's group
        epoch with that cause, so its peers read why they fail (before, only a closed
        connection, naming nobody). Closed after a forward-only loop, it just leaves."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            step, mid_step = self._state.step, self._state.awaits_backward
        self._rounds.close()  # the rounds already queued run (or fail) first
        if mid_step and self.member.joined:
            try:
                self.member.fail(step, f"step {step}", f"rank {self.rank} closed its DistCAClient in the middle "
                                                       f"of step {step}", detected=True, in_round=False)
            except Exception:  # closing must not fail because the job is already down
                pass
        self.member.close()
        try:
            ray.get(self.scheduler.unregister_client.remote(self.rank, self.incarnation), timeout=10)
        except Exception:  # closing must not fail because the job is already down
            pass
