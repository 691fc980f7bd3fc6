"""Groups across nodes, the paper's "group sharding" and "communication with groups":

- ``hsdp(g=G)``: zero3 inside groups of ``G`` consecutive ranks, replicated across groups (FSDP2
  on a 2-D (W/G, G) mesh);
- ``zero3(reshard=G)``: zero3 over all ranks that reshards after forward only down to groups of
  ``G`` ranks (FSDP2's ``reshard_after_forward=G``), so the backward all-gather stays in a group.
"""

from __future__ import annotations

import dataclasses

from osdp_lightning.choices.base import Choice, ChoiceFamily, ChoiceOptions, fully_shard_apply
from osdp_lightning.choices.zero3 import TERMS as ZERO3_TERMS
from osdp_lightning.choices.zero3 import sharded_cost
from osdp_lightning.cost.cluster import ClusterSpec
from osdp_lightning.cost.cost import ChoiceCost, CostContext, UnitBytes, all_reduce_s, ceil_div
from osdp_lightning.profiling.records import UnitProfile


def hsdp_choice(group: int) -> Choice:
    return Choice("hsdp", (("g", group),))


def zero3_reshard_choice(group: int) -> Choice:
    return Choice("zero3", (("reshard", group),))


def group_sizes_for(options: ChoiceOptions, cluster: ClusterSpec) -> tuple[int, ...]:
    """The options' group sizes (default: one node's ranks when there are several nodes).

    Only sizes that divide the world and lie strictly between 1 and it. On one node the default is
    none: a group smaller than the node saves no bandwidth, it only shards less.
    """
    sizes = options.group_sizes
    if sizes is None:
        sizes = (cluster.local_world_size,) if cluster.num_nodes > 1 else ()
    return tuple(g for g in sizes if 1 < g < cluster.world_size and cluster.world_size % g == 0)


def _check_group(group: int, cluster: ClusterSpec) -> None:
    if not 1 < group < cluster.world_size or cluster.world_size % group:
        raise ValueError(f"group size {group} must divide the world size {cluster.world_size} and lie "
                         "strictly between 1 and it")


def hsdp_cost(unit: UnitProfile, choice: Choice, ctx: CostContext) -> ChoiceCost:
    """Two all-gathers and a reduce-scatter inside the group (inside a node when ``g`` ranks fit
    in one), then an all-reduce of the 1/g gradient shard across the W/g groups, whose members sit
    on different nodes whenever there are several."""
    group, cluster = choice["g"], ctx.cluster
    _check_group(group, cluster)
    # zero3 inside the group (its machinery priced as zero3 groups: never offered on one node, where
    # calibration runs), plus the all-reduce
    in_group = sharded_cost(unit, choice, ctx, gathers=(group, group), shard=group, priced_as=ZERO3_TERMS.kind)
    across_nodes = cluster.num_nodes > 1
    reduced = UnitBytes.of(unit, ctx.profile).reduced
    across_s = ctx.once_per_step_s(all_reduce_s(ceil_div(reduced, group), cluster.world_size // group, cluster,
                                                crosses_nodes=across_nodes))
    return dataclasses.replace(in_group, comm_s=in_group.comm_s + across_s,
                               exposed_s=in_group.exposed_s + ctx.once_per_step_s(cluster.link(across_nodes)[0]))


def zero3_reshard_cost(unit: UnitProfile, choice: Choice, ctx: CostContext) -> ChoiceCost:
    """Sharded over all W ranks; 1/group of the gathered parameters held until backward; the
    forward all-gather and the reduce-scatter span all W ranks, the backward all-gather a group."""
    group = choice["reshard"]
    _check_group(group, ctx.cluster)
    return sharded_cost(unit, choice, ctx, gathers=(ctx.cluster.world_size, group), held=group)


def hsdp_kwargs(choice: Choice, meshes: object) -> dict:
    """``fully_shard`` arguments of ``hsdp(g=G)``: the (W/G, G) mesh, resharded after forward."""
    group = choice["g"]
    if group not in meshes.groups:
        raise ValueError(f"{choice} needs a ({meshes.shard.size() // group}, {group}) mesh: build it with "
                         "build_meshes(..., group_sizes) or with_group_meshes(meshes, plan)")
    return {"mesh": meshes.groups[group], "reshard_after_forward": True}


HSDP = ChoiceFamily(
    kind="hsdp", param_names=("g",), cost=hsdp_cost, apply=fully_shard_apply(hsdp_kwargs),
    space=lambda options, cluster: tuple(hsdp_choice(g) for g in group_sizes_for(options, cluster)),
    mesh_groups=lambda choice: (choice["g"],))

def zero3_reshard_kwargs(choice: Choice, meshes: object) -> dict:
    # NOTE: FSDP2 reshards to rows of `group` consecutive ranks: the backward all-gather stays in a node.
    return {"mesh": meshes.shard, "reshard_after_forward": choice["reshard"]}


ZERO3_RESHARD = ChoiceFamily(
    kind="zero3", param_names=("reshard",), cost=zero3_reshard_cost, apply=fully_shard_apply(zero3_reshard_kwargs),
    space=lambda options, cluster: tuple(zero3_reshard_choice(g) for g in group_sizes_for(options, cluster)))
