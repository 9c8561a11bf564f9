"""distca scheduler: what to compute where. Pure Python + numpy; imports neither torch nor ray."""

from .cost import CostModel, causal_pairs
from .planner import plan_batch
from .tasks import CATask, Plan

__all__ = ["CATask", "CostModel", "Plan", "causal_pairs", "plan_batch"]
