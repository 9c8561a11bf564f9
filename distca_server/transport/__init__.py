"""Transports move one round's bytes between participants in one ragged all-to-all.

Every transport implements :class:`Transport`. Implementations: :mod:`.local` (threads in one
process), :mod:`.torch_dist` (gloo or NCCL collectives between processes), and :mod:`.symmetric`, the
one-sided exchange (senders put rows straight into receivers' memory, put-with-signal, no
collectives) over a symmetric heap: :mod:`.shm` (shared memory between the processes of one host)
or :mod:`.nvshmem` (NVSHMEM GPU memory). Only :mod:`.local` is imported here; importers name the
others (:mod:`.nvshmem` imports nvshmem4py only when a heap is made, so CPU installs never do).
"""

from .base import Transport
from .local import LocalGroup, LocalTransport

__all__ = ["LocalGroup", "LocalTransport", "Transport"]
