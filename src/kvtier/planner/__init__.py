"""``kvtier plan``: capacity, bandwidth and read-or-recompute arithmetic for any
model shape. Pure functions over frozen
inputs; depends only on ``kvtier.layout``. Formulas: ``docs/planning.md``."""

from kvtier.planner.hf_config import read_shape_fields, shape_fields
from kvtier.planner.plan import (
    Compute,
    Deployment,
    GroupPlan,
    Network,
    Plan,
    Workload,
    make_plan,
    prefill_flops,
    transfer_seconds,
)
from kvtier.planner.shape import ModelShape

__all__ = [
    "Compute",
    "Deployment",
    "GroupPlan",
    "ModelShape",
    "Network",
    "Plan",
    "Workload",
    "make_plan",
    "prefill_flops",
    "read_shape_fields",
    "shape_fields",
    "transfer_seconds",
]
