"""``zero3``: state sharded over all ranks; parameters gathered for forward and again for backward.

FSDP2 ``fully_shard(unit, mesh, reshard_after_forward=True)``: two all-gathers, one reduce-scatter.
"""

from __future__ import annotations

from osdp_lightning.choices.base import Choice, ChoiceFamily, ChoiceOptions, fully_shard_apply
from osdp_lightning.cluster import ClusterSpec
from osdp_lightning.cost import ChoiceCost, CostContext, UnitBytes, all_gather_s, ceil_div, reduce_scatter_s
from osdp_lightning.profile import UnitProfile

CHOICE = Choice("zero3")


def cost(unit: UnitProfile, choice: Choice, ctx: CostContext) -> ChoiceCost:
    """Sharded state; gathered parameters and unsharded gradients are transient (the parameters
    are what a neighbour's prefetch overlaps)."""
    b, cluster = UnitBytes.of(unit, ctx.profile), ctx.cluster
    world = cluster.world_size
    comm_s = 2 * all_gather_s(b.gathered, world, cluster) + ctx.once_per_step_s(reduce_scatter_s(b.reduced, world, cluster))
    overhead_s, optimizer_s = ctx.machinery_s(unit, "zero3")
    kept = ctx.kept_grad_bytes(b.grads)  # accumulating: the unsharded gradient lives through the step
    return ChoiceCost(str(choice), ceil_div(b.state, world) + kept, 0, b.gathered + b.grads - kept,
                      ctx.compute_s(unit), comm_s, prefetch_bytes=b.gathered,
                      exposed_s=(2 + ctx.once_per_step_s(1)) * ctx.world_latency_s(),
                      overhead_s=overhead_s, optimizer_s=optimizer_s,
                      activation_bytes=ctx.activation_bytes(unit))


def space(_options: ChoiceOptions, _cluster: ClusterSpec) -> tuple[Choice, ...]:
    return (CHOICE,)


FAMILY = ChoiceFamily(
    kind="zero3", param_names=(), cost=cost, space=space,
    apply=fully_shard_apply(lambda _choice, meshes: {"mesh": meshes.shard, "reshard_after_forward": True}))
