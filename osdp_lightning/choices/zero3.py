"""``zero3``: state sharded over all ranks; parameters gathered for forward and again for backward.

FSDP2 ``fully_shard(unit, mesh, reshard_after_forward=True)``: two all-gathers, one reduce-scatter.
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
from osdp_lightning.cost.cluster import ClusterSpec
from osdp_lightning.cost.cost import (
    ChoiceCost,
    CostContext,
    UnitBytes,
    all_gather_s,
    ceil_div,
    reduce_scatter_s,
)
from osdp_lightning.cost.step_terms import GroupTerms
from osdp_lightning.profiling.records import UnitProfile

CHOICE = Choice("zero3")
TERMS = GroupTerms("zero3", overhead={"cpu": (2.5e-3, 1.8e-9), "gpu": (3.0e-4, 0.0)},
                   optimizer={"cpu": (1.0e-4, 1.2e-9), "gpu": (1.5e-5, 3.5e-12)})
"""One zero3 group: also a split's sharded slice, an hsdp group and a zero3(reshard=G) group."""


def _latency_s(ctx: CostContext, ranks: int) -> float:
    """Launch latency of a collective over ``ranks`` consecutive ranks."""
    cluster = ctx.cluster
    if ranks == cluster.world_size:
        return ctx.world_latency_s()
    return cluster.link(cluster.crosses_nodes(ranks))[0]


def sharded_cost(unit: UnitProfile, choice: Choice, ctx: CostContext, *, gathers: tuple[int, ...],
                 held: int = 0, shard: int | None = None, priced_as: str = "") -> ChoiceCost:
    """The cost of every FSDP2 layout (zero2, zero3, zero3(reshard=G), hsdp's part in its group).

    State sharded over ``shard`` ranks (default all), one reduce-scatter over them per optimizer
    step, and one all-gather of the parameters per entry of ``gathers`` (the ranks it spans).
    ``held``: the gathered parameters kept from forward to backward, 0 none (transient: what a
    neighbour's prefetch overlaps), 1 all (zero2: no second gather), G a 1/G shard (reshard=G).
    The machinery is priced as the group kind ``priced_as`` (default: the choice's kind).
    """
    b, cluster = UnitBytes.of(unit, ctx.profile), ctx.cluster
    shard = cluster.world_size if shard is None else shard
    # NOTE: gathers over the shard ranks are counted, their latency multiplied, as each layout's own
    # formula did: every layout's cost stays the same to the bit.
    comm_s = sum(all_gather_s(b.gathered, ranks, cluster) for ranks in gathers) + ctx.once_per_step_s(
        reduce_scatter_s(b.reduced, shard, cluster))
    exposed_s = ((gathers.count(shard) + ctx.once_per_step_s(1)) * _latency_s(ctx, shard)
                 + sum(_latency_s(ctx, ranks) for ranks in gathers if ranks != shard))
    overhead_s, optimizer_s = ctx.machinery_s(unit, priced_as or choice.kind)
    # NOTE: accumulating, the unsharded gradient lives through the step, kept in the reduce dtype
    # (FSDP2 upcasts a bf16 gradient to accumulate it in fp32).
    kept = ctx.kept_grad_bytes(b.reduced)
    whole = held == 1  # zero2: the gathered copy is held, not transient; nothing is gathered for backward
    # NOTE: its backward frees saved activations while it makes the gradients: the profiled rise
    # (gradients and temporaries less what was freed by then) when measured at this micro-batch,
    # kept to its gradients plus twice what it saved (their gradients): torch's module tracker
    # ends a module's backward when every input's gradient is complete, which an input many units
    # share (T5's position bias) is only at the end of the step, and the rise then takes in later
    # units' gradients (T5's encoder blocks: 19 to 131 MiB, one more per block).
    measured = unit.backward_rise_bytes is not None and ctx.batch_scale == 1
    rise = min(unit.backward_rise_bytes, b.grads + 2 * unit.activation_bytes) if measured else b.grads
    rise -= b.grads - b.gathered_grads  # gradients made in the gathered dtype (bf16-mixed: half of fp32's)
    return ChoiceCost(str(choice), ceil_div(b.state, shard) + kept, ceil_div(b.gathered, held) if held else 0,
                      (0 if whole else b.gathered) + max(rise - kept, 0), ctx.compute_s(unit), comm_s,
                      prefetch_bytes=b.gathered, exposed_s=exposed_s,
                      overhead_s=overhead_s, optimizer_s=optimizer_s,
                      activation_bytes=ctx.activation_bytes(unit, sharded=True), forward_bytes=2 * b.gathered,
                      backward_prefetch_bytes=0 if whole else None,
                      late_grad_bytes=0 if kept else ceil_div(b.grads, shard), reduce_bytes=b.reduced,
                      unsaved_forward_bytes=ctx.unsaved_forward_bytes(unit))


def cost(unit: UnitProfile, choice: Choice, ctx: CostContext) -> ChoiceCost:
    """Sharded state; gathered parameters and unsharded gradients are transient (the parameters
    are what a neighbour's prefetch overlaps)."""
    world = ctx.cluster.world_size
    return sharded_cost(unit, choice, ctx, gathers=(world, world))


def space(_options: ChoiceOptions, _cluster: ClusterSpec) -> tuple[Choice, ...]:
    return (CHOICE,)


MEMORY_MISS = MemoryMiss(
    under_share=0.007, spread_share=0.0,
    basis="uniform zero3 on four GPT shapes at most 0.7% under (6 x 256 and 2 x 512), mixed plans with it "
          "at most 0.6% under; every plan's peak the same in each launch")
"""Measured as :data:`osdp_lightning.choices.replicate.MEMORY_MISS`."""

FAMILY = ChoiceFamily(
    kind="zero3", param_names=(), cost=cost, space=space,
    apply=fully_shard_apply(lambda _choice, meshes: {"mesh": meshes.shard, "reshard_after_forward": True}),
    group_terms=(TERMS,), calibration=whole_unit_calibration(TERMS.kind), memory_miss=MEMORY_MISS)
