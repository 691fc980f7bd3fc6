"""osdp_lightning: Optimal Sharded Data Parallel (arXiv 2209.13258) as a Lightning strategy.

``import osdp_lightning`` registers ``Trainer(strategy="osdp")``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from osdp_lightning.budget import format_bytes, parse_bytes
from osdp_lightning.callbacks import TrainingSummary
from osdp_lightning.cost import ClusterSpec
from osdp_lightning.plan import InfeasibleBudgetError, Plan, PlanMismatchError, make_plan
from osdp_lightning.strategy import OSDPStrategy

OSDPStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "ClusterSpec",
    "InfeasibleBudgetError",
    "OSDPStrategy",
    "Plan",
    "PlanMismatchError",
    "TrainingSummary",
    "format_bytes",
    "make_plan",
    "parse_bytes",
]
__version__ = "0.1.0"
