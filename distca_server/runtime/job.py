"""Start, inspect and stop a distca job on the current Ray cluster.

``launch`` starts the job's :class:`~scheduler.actor.SchedulerActor` and, in dedicated mode, its
:class:`~distca_server.runtime.server_actor.AttentionServer` actors (detached by default, so they
outlive the driver that started them); clients then ``DistCAClient.connect(name)`` from any Ray
task or actor. Every actor of a job is named (``distca-scheduler-<name>``,
``distca-server-<name>-<i>`` in namespace ``distca``), so ``status`` and ``shutdown`` find them by
name, without asking the scheduler: they work while it is gone or restarting.
"""

from __future__ import annotations

import time

import ray
import torch

from scheduler.actor import (NAMESPACE, SchedulerActor, job_actor_names, scheduler_actor_name, server_actor_name,
                             total_bytes)
from scheduler.checks import check_transport
from scheduler.config import ConfigError, JobConfig, legacy_fields, legacy_job_config

from ..errors import DistCAError
from ..kernels import BACKENDS, _known
from .groups import remove_heaps
from .server_actor import AttentionServerActor

_GONE_S = 30.0  # shutdown waits this long for the killed actors' names to be released


def _actor(name: str):
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


def _named(make, actor_name: str, job: str):
    """``make()``, which creates the actor named ``actor_name``. Ray refuses a name that is
    taken (``ActorAlreadyExistsError``, a ``ValueError``): another ``launch`` of ``job`` got
    there between this one's check and now.

    Raises:
        ValueError: the name is taken, naming the job.
    """
    try:
        return make()
    except ValueError:
        if _actor(actor_name) is None:  # refused for another reason
            raise
        raise ValueError(f"a distca job named {job!r} is already running (another launch started it "
                         f"meanwhile); `distca down --name {job}` first") from None


_LAUNCH_LEGACY = ("servers", "mode", "epsilon", "min_shard", "timeout_s", "failure_grace_s", "backend",
                  "max_restarts", "scheduler_restarts", "start_timeout_s", "coordinator_options",
                  "keep_activations", "max_held_bytes_per_server", "transport", "partial_kv")


def launch(name: str = "default", *, config: JobConfig | None = None, detached: bool = True,
           server_options: dict | None = None, **legacy) -> dict:
    """Start job ``name``: its scheduler and, in dedicated mode, ``config.servers`` attention
    servers, all or nothing (if any actor fails to start, the ones started are stopped and the
    error raised). The config is checked before any Ray call.

    Args:
        name: job name clients connect to.
        config: the job's settings (:class:`~scheduler.config.JobConfig`; default ``JobConfig()``:
            one dedicated server, the planner's defaults; ``docs/config.md`` lists every field).
            Among them: ``plan.mode`` (``"dedicated"``, or ``"inplace"``: every client serves its
            share and ``servers`` is ignored); ``plan.keep_activations`` (servers keep each layer's
            Q, K, V, O and LSE rows from its forward round until its backward round, which then
            sends only dO; forward-only rounds keep nothing on any setting);
            ``plan.max_held_bytes_per_server`` (bytes); ``timeout_s`` (seconds any wait lasts
            before ``DistCAError``); ``failure_grace_s`` (seconds); ``start_timeout_s`` (seconds the
            actors may take to start); ``server_restarts`` / ``scheduler_restarts`` (how often Ray
            restarts a dead server / scheduler, -1: always; a restarted scheduler rebuilds its state
            from the participants re-registering, the step in flight fails on every participant and
            the next one runs); ``transport`` (``"torch_dist"``: gloo on CPU, NCCL on GPU, any
            placement; ``"shm"``: CPU tensors, every client and server on one node, else the
            epoch's batch fails on every client with a ``DistCAError`` naming the nodes;
            ``"nvshmem"``: CUDA tensors, needs nvshmem4py and a GPU where ``launch`` runs);
            ``backend`` (kernel backend on the servers).
        detached: keep the actors alive after this driver exits (``distca down`` stops them).
            With ``detached=False`` the actors live as long as the returned handles do: keep them.
        server_options: Ray actor options for the servers; default one GPU each on a cluster
            with GPUs, else one CPU.
        **legacy: deprecated: the old settings (``servers``, ``mode``, ``epsilon``, ``min_shard``,
            ``timeout_s``, ``failure_grace_s``, ``backend``, ``max_restarts`` (now
            ``server_restarts``), ``scheduler_restarts``, ``start_timeout_s``,
            ``coordinator_options``, ``keep_activations``, ``max_held_bytes_per_server``,
            ``transport``, ``partial_kv``). They warn (``DeprecationWarning``) and build the config.

    Returns:
        ``{"scheduler": handle, "servers": [handles], "config": the JobConfig}``.

    Raises:
        ValueError: a bad config (:class:`~scheduler.config.ConfigError`, naming every bad
            field), a backend no install knows, ``"nvshmem"`` without nvshmem4py or a CUDA device
            here (all before any Ray call), or actors of a job of that name already running, also
            when another ``launch`` of the name started them at the same moment (this one then
            leaves nothing running).
        TypeError: ``config`` not a :class:`JobConfig`, ``config`` together with deprecated
            settings, or an unknown keyword.
        DistCAError: the actors did not start within ``start_timeout_s`` (none is left running).
    """
    given = legacy_fields("launch", (), legacy, accepted=_LAUNCH_LEGACY)
    config = legacy_job_config("launch", config, given)
    check_here(config)
    if not ray.is_initialized():
        ray.init(address="auto", namespace=NAMESPACE)
    running = job_actor_names(name)
    if running:
        raise ValueError(f"a distca job named {name!r} is already running (actors {running}); "
                         f"`distca down --name {name}` first")
    lifetime = "detached" if detached else None
    started = []
    start_timeout_s = config.start_timeout_s
    try:
        scheduler = _named(lambda: SchedulerActor.options(
            name=scheduler_actor_name(name), namespace=NAMESPACE, lifetime=lifetime,
            max_restarts=config.scheduler_restarts).remote(name, config=config),
            scheduler_actor_name(name), name)
        started.append(scheduler)
        ray.get(scheduler.ping.remote(), timeout=start_timeout_s)
        handles = []
        if config.plan.mode == "dedicated":
            if server_options is None:
                gpus = ray.cluster_resources().get("GPU", 0)
                server_options = {"num_gpus": 1} if gpus > 0 else {"num_cpus": 1}
            for i in range(config.servers):
                handles.append(_named(lambda: AttentionServerActor.options(
                    name=server_actor_name(name, i), namespace=NAMESPACE, lifetime=lifetime,
                    max_concurrency=8, max_restarts=config.server_restarts, **server_options).remote(
                        name, i, config.timeout_s, 3600.0, config.backend), server_actor_name(name, i), name))
                started.append(handles[-1])
            ray.get([h.ping.remote() for h in handles], timeout=start_timeout_s)
    except BaseException as exc:
        for handle in started:
            ray.kill(handle, no_restart=True)
        if isinstance(exc, ray.exceptions.GetTimeoutError):
            raise DistCAError(f"job {name!r} did not start within {start_timeout_s:g} s (not enough "
                              f"resources for its servers?); nothing is left running") from None
        raise
    return {"scheduler": scheduler, "servers": handles, "config": config}


def check_here(config: JobConfig) -> None:
    """What ``config`` needs of this process, checked before any Ray call (by :func:`launch`, and
    by ``distca up`` before it connects): a backend name some install knows (whether the servers
    can run it is theirs to say), a transport that can run.

    Raises:
        ConfigError: naming every problem.
    """
    problems = []
    if not _known(config.backend):
        problems.append(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {config.backend!r}")
    try:
        _check_transport_here(config.transport)
    except ValueError as exc:
        problems.append(str(exc))
    if problems:
        raise ConfigError("launch", problems)


def _check_transport_here(transport) -> None:
    """Refuse a transport name that is not one, or ``"nvshmem"`` where it cannot run."""
    check_transport(transport)
    if transport == "nvshmem":
        from ..transport.nvshmem import _modules
        try:
            _modules()
        except ImportError as exc:
            raise ValueError(f"transport 'nvshmem' needs nvshmem4py and cuda.core (pip install "
                             f"'distca[nvshmem]'): {exc}") from None
        if not torch.cuda.is_available():
            raise ValueError("transport 'nvshmem' needs a CUDA device, and torch sees none here")


def status(name: str = "default") -> dict:
    """The job's state (see ``SchedulerActor.status``). Without a scheduler that answers (gone or
    restarting), the servers found by name answer for themselves: ``scheduler`` says which.

    Raises:
        ValueError: no actor of a job of that name.
    """
    names = job_actor_names(name)
    if not names:
        raise ValueError(f"no distca job named {name!r} on this Ray cluster")
    scheduler = _actor(scheduler_actor_name(name)) if scheduler_actor_name(name) in names else None
    if scheduler is not None:
        try:
            return dict(ray.get(scheduler.status.remote(), timeout=30), scheduler="running")
        except Exception as exc:  # dead, restarting or stuck: fall back to the servers
            state = f"not answering ({type(exc).__name__})"
    else:
        state = "missing"
    rows = []
    for n in names[1 if scheduler is not None else 0:]:
        sid = int(n.rsplit("-", 1)[1])
        row = {"server": sid, "node": "?", "state": "unreachable", "rounds_served": None,
               "last_flops": None, "last_tasks": None, "last_error": None, "bytes_sent": None,
               "last_held_bytes": None, "peak_held_bytes": None}
        handle = _actor(n)
        try:
            stats = ray.get(handle.stats.remote(), timeout=10)
            row.update(node=stats["node"], state=stats["state"], rounds_served=stats["rounds_served"],
                       last_error=stats["last_error"], bytes_sent=total_bytes(stats["traffic"]),
                       peak_held_bytes=stats["peak_held_bytes"])
        except Exception:  # a dead or stuck server: shown as unreachable
            pass
        rows.append(row)
    return {"name": name, "scheduler": state, "mode": "?", "world_size": None, "clients": [], "epoch": None,
            "next_step": None, "steps_planned": None, "last": {}, "servers": rows}


def shutdown(name: str = "default") -> int:
    """Stop every actor of job ``name`` found by name (servers, then the scheduler, none of them
    restarted), and wait until their names are free; returns how many were stopped. Shared-memory
    heaps of the job that a killed member left on this node are removed (see
    :func:`~distca_server.runtime.groups.remove_heaps`)."""
    names = job_actor_names(name)
    stopped = 0
    for n in names[::-1]:  # servers first: the scheduler is last to go
        handle = _actor(n)
        if handle is not None:
            ray.kill(handle, no_restart=True)
            stopped += 1
    deadline = time.monotonic() + _GONE_S
    while job_actor_names(name) and time.monotonic() < deadline:
        time.sleep(0.1)
    remove_heaps(name)
    return stopped
