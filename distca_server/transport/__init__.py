"""Transports move one round's bytes between participants in one ragged all-to-all.

Every transport implements :class:`Transport`. Implementations: :mod:`.local` (threads in one
process); ``torch.distributed`` and NVSHMEM transports follow the same interface.
"""

from .base import Transport
from .local import LocalGroup, LocalTransport

__all__ = ["LocalGroup", "LocalTransport", "Transport"]
