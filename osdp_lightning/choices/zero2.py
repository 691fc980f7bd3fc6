"""``zero2``: state sharded over all ranks; parameters gathered in forward stay until backward.

FSDP2 ``fully_shard(unit, mesh, reshard_after_forward=False)``: one all-gather, one reduce-scatter.
"""

from __future__ import annotations

from osdp_lightning.choices.base import (
    Choice,
    ChoiceFamily,
    ChoiceOptions,
    MemoryMiss,
    fully_shard_apply,
    whole_unit_calibration,
)
from osdp_lightning.choices.zero3 import sharded_cost
from osdp_lightning.cost.cluster import ClusterSpec
from osdp_lightning.cost.cost import ChoiceCost, CostContext
from osdp_lightning.cost.step_terms import GroupTerms
from osdp_lightning.profiling.records import UnitProfile

CHOICE = Choice("zero2")
TERMS = GroupTerms("zero2", overhead={"cpu": (1.5e-3, 0.9e-9), "gpu": (2.0e-4, 0.0)},
                   optimizer={"cpu": (1.0e-4, 1.2e-9), "gpu": (1.5e-5, 3.5e-12)})


def cost(unit: UnitProfile, choice: Choice, ctx: CostContext) -> ChoiceCost:
    """Sharded state; the gathered parameters are held forward to backward; gradients transient."""
    return sharded_cost(unit, choice, ctx, gathers=(ctx.cluster.world_size,), held=1)


def space(_options: ChoiceOptions, _cluster: ClusterSpec) -> tuple[Choice, ...]:
    return (CHOICE,)


MEMORY_MISS = MemoryMiss(
    under_share=0.006, spread_share=0.0,
    basis="uniform zero2 on four GPT shapes over-predicted (0.2-1.6%), mixed plans with it at most 0.6% "
          "under (GPT 2 x 512); every plan's peak the same in each launch")
"""Measured as :data:`osdp_lightning.choices.replicate.MEMORY_MISS`."""

FAMILY = ChoiceFamily(
    kind="zero2", param_names=(), cost=cost, space=space,
    apply=fully_shard_apply(lambda _choice, meshes: {"mesh": meshes.shard, "reshard_after_forward": False}),
    group_terms=(TERMS,), calibration=whole_unit_calibration(TERMS.kind), memory_miss=MEMORY_MISS)
