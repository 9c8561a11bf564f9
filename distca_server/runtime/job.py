"""Start, inspect and stop a distca job on the current Ray cluster.

``launch`` starts the job's :class:`~scheduler.actor.SchedulerActor` and, in dedicated mode, its
:class:`~distca_server.runtime.server_actor.AttentionServer` actors (detached by default, so they
outlive the driver that started them); clients then ``DistCAClient.connect(name)`` from any Ray
task or actor.
"""

from __future__ import annotations

import ray

from scheduler.actor import NAMESPACE, SchedulerActor, scheduler_actor_name, server_actor_name

from .server_actor import AttentionServerActor


def _scheduler(name: str):
    try:
        return ray.get_actor(scheduler_actor_name(name), namespace=NAMESPACE)
    except ValueError:
        return None


def launch(name: str = "default", servers: int = 1, mode: str = "dedicated", *,
           epsilon: float = 0.05, min_shard: int = 128, timeout_s: float = 60.0,
           failure_grace_s: float = 2.0, backend: str = "auto", detached: bool = True,
           max_restarts: int = 0, server_options: dict | None = None) -> dict:
    """Start job ``name``: its scheduler and ``servers`` dedicated attention servers.

    Args:
        name: job name clients connect to.
        servers: dedicated attention servers (ignored in ``"inplace"`` mode, where every client
            serves its share).
        mode: ``"dedicated"`` or ``"inplace"``.
        epsilon, min_shard: planner settings.
        timeout_s: how long any wait lasts before ``DistCAError``.
        failure_grace_s: how long the scheduler waits for survivors' reports after a failure.
        backend: kernel backend on the servers.
        detached: keep the actors alive after this driver exits (``distca down`` stops them).
            With ``detached=False`` the actors live as long as the returned handles do: keep them.
        max_restarts: how often Ray restarts a dead server (a restarted server rejoins).
        server_options: Ray actor options for the servers; default one GPU each on a cluster
            with GPUs, else one CPU.

    Returns:
        ``{"scheduler": handle, "servers": [handles]}``.

    Raises:
        ValueError: bad arguments, or a job of that name already running.
    """
    if not ray.is_initialized():
        ray.init(address="auto", namespace=NAMESPACE)
    if mode not in ("dedicated", "inplace"):
        raise ValueError(f"mode must be 'dedicated' or 'inplace', got {mode!r}")
    if mode == "dedicated" and (not isinstance(servers, int) or servers < 1):
        raise ValueError(f"dedicated mode needs servers >= 1, got {servers!r}")
    if _scheduler(name) is not None:
        raise ValueError(f"a distca job named {name!r} is already running; `distca down --name {name}` first")
    lifetime = "detached" if detached else None
    scheduler = SchedulerActor.options(name=scheduler_actor_name(name), namespace=NAMESPACE,
                                       lifetime=lifetime).remote(
        name, mode, epsilon, min_shard, timeout_s, failure_grace_s, backend)
    ray.get(scheduler.ping.remote())
    handles = []
    if mode == "dedicated":
        if server_options is None:
            gpus = ray.cluster_resources().get("GPU", 0)
            server_options = {"num_gpus": 1} if gpus > 0 else {"num_cpus": 1}
        for i in range(servers):
            handles.append(AttentionServerActor.options(
                name=server_actor_name(name, i), namespace=NAMESPACE, lifetime=lifetime,
                max_concurrency=8, max_restarts=max_restarts, **server_options).remote(
                    name, i, timeout_s, 3600.0, backend))
        ray.get([h.ping.remote() for h in handles])
    return {"scheduler": scheduler, "servers": handles}


def status(name: str = "default") -> dict:
    """The job's state (see ``SchedulerActor.status``).

    Raises:
        ValueError: no job of that name.
    """
    scheduler = _scheduler(name)
    if scheduler is None:
        raise ValueError(f"no distca job named {name!r} on this Ray cluster")
    return ray.get(scheduler.status.remote(), timeout=30)


def shutdown(name: str = "default") -> int:
    """Stop job ``name``'s servers and scheduler; returns how many actors were stopped."""
    stopped = 0
    scheduler = _scheduler(name)
    if scheduler is not None:
        try:
            ids = [s["server"] for s in ray.get(scheduler.status.remote(), timeout=30)["servers"]]
        except Exception:  # a broken scheduler still gets killed below
            ids = []
        for i in ids:
            try:
                ray.kill(ray.get_actor(server_actor_name(name, i), namespace=NAMESPACE))
                stopped += 1
            except ValueError:
                pass
        ray.kill(scheduler)
        stopped += 1
    return stopped
