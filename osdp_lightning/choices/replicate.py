"""``replicate``: every rank keeps the whole unit and all-reduces its gradients (DDP's layout).

Applied with DDP's own machinery (``osdp_lightning/runtime/replicate.py``): the unit's parameters stay
plain tensors, and one DDP reducer for every replicated parameter of the plan all-reduces their
gradients in buckets during backward. Applying only marks the unit; ``apply_plan`` builds the
reducer once every unit is applied.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from osdp_lightning.choices.base import (
    Choice,
    ChoiceFamily,
    ChoiceOptions,
    MemoryMiss,
    unit_modules,
    whole_unit_calibration,
)
from osdp_lightning.cost.cluster import ClusterSpec
from osdp_lightning.cost.cost import ChoiceCost, CostContext, UnitBytes, all_reduce_s
from osdp_lightning.cost.step_terms import GroupTerms
from osdp_lightning.profiling.records import UnitProfile
from osdp_lightning.runtime.replicate import (
    BUCKET_CAP_MB,
    build_replicate_reducer,
    finish_replicate,
    mark_replicated,
)

CHOICE = Choice("replicate")
TERMS = GroupTerms("replicate", overhead={"cpu": (1.5e-3, 0.8e-9), "gpu": (1.0e-4, 0.0)},
                   optimizer={"cpu": (3.0e-5, 1.3e-9), "gpu": (5.0e-6, 3.5e-12)})
"""A unit's share of DDP's reducer (hooks, bucket copies) and the optimizer over its plain tensors."""


def cost(unit: UnitProfile, choice: Choice, ctx: CostContext) -> ChoiceCost:
    """Whole state on every rank, no parameter copy; the gradients' all-reduce rides in DDP's buckets."""
    b = UnitBytes.of(unit, ctx.profile)
    # NOTE: gradients are views into the reducer's buckets (gradient_as_bucket_view=True), so they
    # are part of the persistent state and there is no second copy. After zero_grad(set_to_none)
    # autograd computes each gradient into a fresh tensor that the reducer copies into its bucket
    # and frees: one tensor at a time, beside the gradient of that layer's input.
    overhead_s, optimizer_s = ctx.machinery_s(unit, TERMS.kind)
    # One collective per ~25 MiB bucket, not per unit: the unit pays its share of a launch.
    bucket_share = min(1.0, b.grads / (BUCKET_CAP_MB * 2**20))
    # Accumulating, DDP's no-sync adds each micro-step's gradients into the same buckets: no extra bytes.
    return ChoiceCost(str(choice), b.state, 0, backward_transient_bytes(unit, b, ctx), ctx.compute_s(unit),
                      ctx.once_per_step_s(all_reduce_s(b.grads, ctx.cluster.world_size, ctx.cluster)), prefetch_bytes=0,
                      exposed_s=ctx.once_per_step_s(ctx.world_latency_s() * bucket_share), overhead_s=overhead_s, optimizer_s=optimizer_s,
                      activation_bytes=ctx.activation_bytes(unit), forward_bytes=0,
                      unsaved_forward_bytes=ctx.unsaved_forward_bytes(unit), rebuild_bytes=ctx.rebuilt_grad_bytes(b.grads))


def backward_transient_bytes(unit: UnitProfile, b: UnitBytes, ctx: CostContext) -> int:
    """Bytes a replicated unit's backward holds at once beyond its activations: the gradient in flight
    and the gradient of its layer's input, as the profile measured them (the most any one layer, a
    module with parameters and no children, added in its backward:
    :attr:`UnitProfile.leaf_backward_rise_bytes`); what lies above its largest gradient scales with
    the micro-batch. Not measured: its largest gradient."""
    rise = unit.leaf_backward_rise_bytes
    return b.largest_grad if rise is None else b.largest_grad + int(max(rise - b.largest_grad, 0) * ctx.batch_scale)


def space(_options: ChoiceOptions, _cluster: ClusterSpec) -> tuple[Choice, ...]:
    return (CHOICE,)


def apply(model: nn.Module, module_names: tuple[str, ...], _choice: Choice, _meshes: Any, _mp_policy: Any) -> None:
    """Mark the unit for DDP's reducer; :func:`finish` and :func:`connect` build it after every unit."""
    modules = unit_modules(model, module_names)
    for module in modules if isinstance(modules, list) else [modules]:
        mark_replicated(module)


def finish(root: nn.Module, meshes: Any, mp_policy: Any) -> None:
    """Every marked unit (and split's replicated slices) stays plain: the sharded units need an FSDP2 root above them."""
    finish_replicate(root, meshes.shard, mp_policy)


def connect(root: nn.Module) -> None:
    """One DDP reducer for every marked parameter (a collective: every rank, once all applied)."""
    build_replicate_reducer(root)


MEMORY_MISS = MemoryMiss(
    under_share=0.006, spread_share=0.0,
    basis="uniform replicate on four GPT shapes 0.1-0.4% under, mixed plans with it at most 0.6% under "
          "(GPT 2 x 512 with zero3, zero2 and a split); every plan's peak the same in each launch")
"""``./dev bench peak_spread`` (uniform plans, 2 launches each) and ``benchmarks.reprice_memory`` on the
memory_model_* runs (docs/benchmarks), 2 gloo ranks on 2 cores."""

FAMILY = ChoiceFamily(kind="replicate", param_names=(), cost=cost, space=space, apply=apply, finish=finish,
                      connect=connect, group_terms=(TERMS,), calibration=whole_unit_calibration(TERMS.kind),
                      memory_miss=MEMORY_MISS)
