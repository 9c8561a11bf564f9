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
from scheduler.checks import boolean, check_transport

from ..errors import DistCAError
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


def launch(name: str = "default", servers: int = 1, mode: str = "dedicated", *,
           epsilon: float = 0.05, min_shard: int = 128, timeout_s: float = 60.0,
           failure_grace_s: float = 1.0, backend: str = "auto", detached: bool = True,
           max_restarts: int = 0, scheduler_restarts: int = -1, server_options: dict | None = None,
           start_timeout_s: float = 300.0, coordinator_options: dict | None = None,
           keep_activations: bool = True, max_held_bytes_per_server: int | None = None,
           transport: str = "torch_dist", partial_kv: bool = False) -> dict:
    """Start job ``name``: its scheduler and ``servers`` dedicated attention servers, all or
    nothing (if any actor fails to start, the ones started are stopped and the error raised).

    Args:
        name: job name clients connect to.
        servers: dedicated attention servers (ignored in ``"inplace"`` mode, where every client
            serves its share).
        mode: ``"dedicated"`` or ``"inplace"``.
        epsilon, min_shard: planner settings.
        timeout_s: how long any wait lasts before ``DistCAError``.
        failure_grace_s: after a failure, how long the scheduler waits for the other members to
            check in before naming the silent ones lost.
        backend: kernel backend on the servers.
        detached: keep the actors alive after this driver exits (``distca down`` stops them).
            With ``detached=False`` the actors live as long as the returned handles do: keep them.
        max_restarts: how often Ray restarts a dead server (a restarted server rejoins).
        scheduler_restarts: how often Ray restarts a dead scheduler (-1: always); a restarted
            scheduler rebuilds its state from the participants re-registering, the step in flight
            fails on every participant and the next one runs.
        server_options: Ray actor options for the servers; default one GPU each on a cluster
            with GPUs, else one CPU.
        start_timeout_s: how long the actors may take to start.
        coordinator_options: more scheduler settings (``max_report_docs``, ``max_report_tokens``).
        keep_activations: servers keep each layer's Q, K, V, O and LSE rows from its forward round
            until its backward round, which then sends only dO (see :func:`scheduler.plan_batch`).
            Only forward rounds that will have a backward round keep anything (run with grad and
            inputs that require it); forward-only rounds (evaluation, ``torch.no_grad``) keep
            nothing on any setting. False: every backward round resends everything.
        max_held_bytes_per_server: with ``keep_activations``, the most bytes of kept activations
            one layer of one batch may leave on any server (the planner's cap; None: no cap).
        transport: how every group epoch moves its tensors: ``"torch_dist"`` (gloo on CPU,
            NCCL on GPU; any placement), ``"shm"`` (the one-sided exchange over shared memory:
            CPU tensors, every client and server of the job on one node: an epoch whose members
            span nodes fails its batch on every client with a ``DistCAError`` naming the nodes,
            since where clients run is only known then) or ``"nvshmem"`` (CUDA tensors; needs
            nvshmem4py and a GPU where ``launch`` runs).
        partial_kv: the planner may also split a query shard's keys over servers where that
            balances better (``plan_batch(..., partial_kv=True)``; full causal attention only).

    Returns:
        ``{"scheduler": handle, "servers": [handles]}``.

    Raises:
        ValueError: bad arguments (a ``transport`` not in
            :data:`scheduler.checks.TRANSPORTS`, or ``"nvshmem"`` without nvshmem4py or a
            CUDA device here), or actors of a job of that name already running, also when
            another ``launch`` of the name started them at the same moment (this one then
            leaves nothing running).
        DistCAError: the actors did not start within ``start_timeout_s`` (none is left running).
    """
    boolean("keep_activations", keep_activations)
    _check_transport_here(transport)
    boolean("partial_kv", partial_kv)
    coordinator_options = dict(coordinator_options or {}, keep_activations=keep_activations,
                               max_held_bytes_per_server=max_held_bytes_per_server, transport=transport,
                               partial_kv=partial_kv)
    if not ray.is_initialized():
        ray.init(address="auto", namespace=NAMESPACE)
    if mode not in ("dedicated", "inplace"):
        raise ValueError(f"mode must be 'dedicated' or 'inplace', got {mode!r}")
    if mode == "dedicated" and (not isinstance(servers, int) or servers < 1):
        raise ValueError(f"dedicated mode needs servers >= 1, got {servers!r}")
    running = job_actor_names(name)
    if running:
        raise ValueError(f"a distca job named {name!r} is already running (actors {running}); "
                         f"`distca down --name {name}` first")
    lifetime = "detached" if detached else None
    started = []
    try:
        scheduler = _named(lambda: SchedulerActor.options(
            name=scheduler_actor_name(name), namespace=NAMESPACE, lifetime=lifetime,
            max_restarts=scheduler_restarts).remote(
            name, mode, epsilon, min_shard, timeout_s, failure_grace_s, backend, coordinator_options),
            scheduler_actor_name(name), name)
        started.append(scheduler)
        ray.get(scheduler.ping.remote(), timeout=start_timeout_s)
        handles = []
        if mode == "dedicated":
            if server_options is None:
                gpus = ray.cluster_resources().get("GPU", 0)
                server_options = {"num_gpus": 1} if gpus > 0 else {"num_cpus": 1}
            for i in range(servers):
                handles.append(_named(lambda: AttentionServerActor.options(
                    name=server_actor_name(name, i), namespace=NAMESPACE, lifetime=lifetime,
                    max_concurrency=8, max_restarts=max_restarts, **server_options).remote(
                        name, i, timeout_s, 3600.0, backend), server_actor_name(name, i), name))
                started.append(handles[-1])
            ray.get([h.ping.remote() for h in handles], timeout=start_timeout_s)
    except BaseException as exc:
        for handle in started:
            ray.kill(handle, no_restart=True)
        if isinstance(exc, ray.exceptions.GetTimeoutError):
            raise DistCAError(f"job {name!r} did not start within {start_timeout_s:g} s (not enough "
                              f"resources for its servers?); nothing is left running") from None
        raise
    return {"scheduler": scheduler, "servers": handles}


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
