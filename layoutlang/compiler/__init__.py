"""The plan compiler: two layouts in, a proven, balanced transfer plan out."""

from .match import PlanError
from .plan import Op, Plan, TensorEntry, compile_plan

__all__ = ["compile_plan", "Plan", "Op", "TensorEntry", "PlanError"]
