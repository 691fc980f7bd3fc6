"""osdp_lightning: Optimal Sharded Data Parallel (arXiv 2209.13258) as a Lightning strategy.

``import osdp_lightning`` registers ``Trainer(strategy="osdp")`` and ``Fabric(strategy="osdp")``.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from osdp_lightning.cost.budget import MemoryBudget, format_bytes, parse_bytes, parse_memory_budget
from osdp_lightning.cost.cluster import ClusterSpec
from osdp_lightning.integration.callbacks import TrainingSummary
from osdp_lightning.integration.config import OSDPConfig
from osdp_lightning.integration.fabric_strategy import OSDPFabricStrategy
from osdp_lightning.integration.strategy import OSDPStrategy
from osdp_lightning.plan.plan import InfeasibleBudgetError, Plan, PlanMismatchError, make_plan
from osdp_lightning.profiling.profile import is_profiling
from osdp_lightning.state.pretrained import PretrainedWeights, load_pretrained

OSDPStrategy.register_strategies(StrategyRegistry)
OSDPFabricStrategy.register_strategies(STRATEGY_REGISTRY)

__all__ = [
    "ClusterSpec",
    "InfeasibleBudgetError",
    "MemoryBudget",
    "OSDPConfig",
    "OSDPFabricStrategy",
    "OSDPStrategy",
    "Plan",
    "PlanMismatchError",
    "PretrainedWeights",
    "TrainingSummary",
    "format_bytes",
    "is_profiling",
    "load_pretrained",
    "make_plan",
    "parse_bytes",
    "parse_memory_budget",
]
__version__ = "0.1.0"
