"""distca scheduler: what to compute where. Pure Python + numpy; imports neither torch nor ray."""

from .config import ConfigError, JobConfig, PlanConfig
from .cost import CostModel, causal_pairs
from .planner import plan_batch
from .tasks import CATask, Plan

__all__ = ["CATask", "ConfigError", "CostModel", "JobConfig", "Plan", "PlanConfig", "causal_pairs", "plan_batch"]
