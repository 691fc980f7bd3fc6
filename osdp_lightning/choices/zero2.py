"""``zero2``: state sharded over all ranks; parameters gathered in forward stay until backward.

FSDP2 ``fully_shard(unit, mesh, reshard_after_forward=False)``: one all-gather, one reduce-scatter.
"""

from __future__ import annotations

from osdp_lightning.choices.base import Choice, ChoiceFamily, ChoiceOptions, fully_shard_apply
from osdp_lightning.cluster import ClusterSpec
from osdp_lightning.cost import ChoiceCost, CostContext, UnitBytes, all_gather_s, ceil_div, reduce_scatter_s
from osdp_lightning.profile import UnitProfile

CHOICE = Choice("zero2")


def cost(unit: UnitProfile, choice: Choice, ctx: CostContext) -> ChoiceCost:
    """Sharded state; the gathered parameters are held forward to backward; gradients transient."""
    b, cluster = UnitBytes.of(unit, ctx.profile), ctx.cluster
    world = cluster.world_size
    comm_s = all_gather_s(b.gathered, world, cluster) + ctx.once_per_step_s(reduce_scatter_s(b.reduced, world, cluster))
    overhead_s, optimizer_s = ctx.machinery_s(unit, "zero2")
    kept = ctx.kept_grad_bytes(b.grads)  # accumulating: the unsharded gradient lives through the step
    return ChoiceCost(str(choice), ceil_div(b.state, world) + kept, b.gathered, b.grads - kept, ctx.compute_s(unit),
                      comm_s, exposed_s=(1 + ctx.once_per_step_s(1)) * ctx.world_latency_s(), overhead_s=overhead_s, optimizer_s=optimizer_s,
                      activation_bytes=ctx.activation_bytes(unit))


def space(_options: ChoiceOptions, _cluster: ClusterSpec) -> tuple[Choice, ...]:
    return (CHOICE,)


FAMILY = ChoiceFamily(
    kind="zero2", param_names=(), cost=cost, space=space,
    apply=fully_shard_apply(lambda _choice, meshes: {"mesh": meshes.shard, "reshard_after_forward": False}))
