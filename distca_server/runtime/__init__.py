"""Runtimes: how ``DistCAClient.attend`` calls become rounds.

- :mod:`.base`: the declared interface (:class:`Runtime`, :class:`PlannedBatch`) and the step
  bookkeeping both runtimes share (:class:`StepState`).
- :mod:`.local`: every participant a thread of this process (``DistCAClient.local``).
- :mod:`.member`: :class:`~.member.GroupMember`, group membership on Ray, shared by clients and
  servers.
- :mod:`.ray_client`: this process as one client of a job on Ray (``DistCAClient.connect``).
- :mod:`.server_actor`: :class:`~.server_actor.AttentionServer`, a dedicated server actor.
- :mod:`.job`: ``launch`` / ``shutdown`` / ``status`` of a job.

Importing this package imports neither Ray nor the Ray modules.
"""

from .base import PlannedBatch, Runtime, StepState, Traffic

__all__ = ["PlannedBatch", "Runtime", "StepState", "Traffic"]
