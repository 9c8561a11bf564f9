"""Measured attention-kernel latency tables: :class:`ProfileTable`, defined in
:mod:`scheduler.profile` (the planner prices CA-tasks with it, DistCA §4.2) and re-exported here for
the simulator and its users."""

from scheduler.profile import ProfileTable, _work_np  # noqa: F401  (one definition)

__all__ = ["ProfileTable"]
