"""Forming a group epoch with the job's transport, bootstrapped through the scheduler.

The job picks its transport once, at launch (:data:`scheduler.checks.TRANSPORTS`); every
member learns it with its group (a client's report answer, a dedicated server's assignment) and
joins epoch ``e`` with :func:`join_epoch`. World rank 0 makes what the others need and publishes
it as the epoch's *bootstrap value* (``SchedulerActor.publish_bootstrap``); the others look it up
(``SchedulerActor.bootstrap``), which waits until it is there:

- ``torch_dist``: rank 0's ``TCPStore`` address ``[host, port]`` (gloo on CPU, NCCL on GPU);
- ``shm``: the handle of a shared-memory heap rank 0 creates under ``/dev/shm`` (every member on
  rank 0's node, CPU tensors). Its files are named after the job and the epoch
  (:func:`heap_prefix`); rank 0 removes them as soon as every member attached (its first exchange
  completed: :meth:`Group.settled`) or when it leaves, and :func:`remove_heaps` sweeps what a
  rank 0 that died before either left behind (the next epoch's rank 0, and ``shutdown``);
- ``nvshmem``: ``{"uid", "heap_bytes", "reuse"}``, an NVSHMEM unique id (CUDA tensors; nvshmem4py
  installed). NVSHMEM starts once per process and its heap is reused by the later epochs of the same
  world (:mod:`~distca_server.transport.nvshmem`).

``shm`` and ``nvshmem`` size their symmetric heap with the job's ``JobConfig.heap_bytes`` as world
rank 0 knows it (the others take rank 0's from the bootstrap value).
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import shutil
from typing import Callable

import torch

from scheduler.checks import check_transport

from ..errors import DistCAError
from ..transport.shm import DEFAULT_HEAP_BYTES, HEAP_PREFIX, destroy_heap, heap_root, join_shm
from ..transport.torch_dist import join_group

def heap_prefix(job: str, epoch: int | None = None) -> str:
    """The directory-name prefix of job ``job``'s shared-memory heaps (of ``epoch``, if given).
    Characters that a file name cannot safely hold are replaced and a long name is cut, so any
    job name works; a digest of the whole name follows, so that names which read the same once
    replaced ("my-job", "my_job") never share heaps (nor sweep each other's,
    :func:`remove_heaps`)."""
    safe = re.sub(r"[^A-Za-z0-9_.]", "_", job)[:64]
    digest = hashlib.sha1(job.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"{HEAP_PREFIX}{safe}-{digest}-e" + ("" if epoch is None else f"{int(epoch)}-")


def remove_heaps(job: str, below_epoch: int | None = None, root: str | None = None) -> list[str]:
    """Remove job ``job``'s heap directories on this node (those of epochs below ``below_epoch``
    only, if given); returns the paths removed. Mappings that live processes hold stay valid."""
    prefix = heap_prefix(job)
    removed = []
    root = heap_root() if root is None else root
    for path in glob.glob(os.path.join(glob.escape(root), glob.escape(prefix) + "*")):
        # <prefix><epoch>-<mkdtemp suffix>: a job whose name extends this one's does not match.
        m = re.fullmatch(r"(\d+)-\w+", os.path.basename(path)[len(prefix):])
        if m is None or (below_epoch is not None and int(m.group(1)) >= below_epoch):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


class Group:
    """A member's transport of one group epoch and what it owes the node once formed.

    Attributes:
        transport: the :class:`~distca_server.transport.base.Transport` endpoint.
        kind: the transport's name.
    """

    def __init__(self, transport, kind: str, heap: dict | None = None):
        self.transport, self.kind, self._heap = transport, kind, heap

    def settled(self) -> None:
        """An exchange completed on this member: every member has attached, so a heap's creator
        removes its files now (later deaths leave nothing in ``/dev/shm``)."""
        if self._heap is not None:
            destroy_heap(self._heap)
            self._heap = None


def join_epoch(kind: str, *, job: str, epoch: int, rank: int, world_size: int, host: str,
               timeout_s: float, device: torch.device, publish: Callable[[object], None],
               lookup: Callable[[], object], heap_bytes: int | None = None) -> Group:
    """Form (or join) group epoch ``epoch`` as world rank ``rank`` with transport ``kind``.

    Args:
        kind: one of :data:`scheduler.checks.TRANSPORTS`.
        job: the job's name (names its shared-memory heaps).
        host: this node's address (where a ``torch_dist`` rank 0 listens).
        device: where the member's tensors live.
        publish: rank 0 hands the epoch's bootstrap value (msgpack data) to the scheduler.
        lookup: the others get it (raising ``DistCAError`` when none comes in time).
        heap_bytes: the symmetric heap per participant of ``shm`` and ``nvshmem``, in bytes (the
            job's ``JobConfig.heap_bytes``; None: the default, 1 GiB). Only world rank 0's counts.

    Raises:
        DistCAError: the group could not be formed within ``timeout_s``, or the transport cannot
            carry ``device``'s tensors.
        ValueError: an unknown ``kind``.
    """
    device = torch.device(device)
    check_transport(kind)
    heap_bytes = DEFAULT_HEAP_BYTES if heap_bytes is None else heap_bytes
    if kind == "torch_dist":
        transport = join_group(epoch=epoch, rank=rank, world_size=world_size, host=host, timeout_s=timeout_s,
                               device=device, publish=lambda h, p: publish([h, p]),
                               lookup=lambda: tuple(lookup()))
        return Group(transport, kind)
    if kind == "shm":
        if device.type != "cpu":
            raise DistCAError(f"transport 'shm' moves CPU tensors, not {device.type} (group epoch {epoch})")
        if rank == 0:
            remove_heaps(job, below_epoch=epoch)  # a rank 0 that died before removing its heap's files
        transport = join_shm(rank=rank, world_size=world_size, timeout_s=timeout_s, publish=publish,
                             lookup=lookup, epoch=epoch, prefix=heap_prefix(job, epoch), heap_bytes=heap_bytes)
        return Group(transport, kind, transport.heap.handle if rank == 0 else None)
    if kind == "nvshmem":
        if device.type != "cuda":
            raise DistCAError(f"transport 'nvshmem' moves CUDA tensors, not {device.type} (group epoch {epoch})")
        from ..transport.nvshmem import join_nvshmem  # imports nothing of NVSHMEM until a heap is made
        transport = join_nvshmem(rank=rank, world_size=world_size, timeout_s=timeout_s, publish=publish,
                                 lookup=lookup, device=device, epoch=epoch, heap_bytes=heap_bytes)
        return Group(transport, kind)
