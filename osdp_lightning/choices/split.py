"""``split(k=K, sharded=J)``: a Linear cut into ``K`` slices along ``in_features`` (OSDP's
operator splitting), ``J`` slices zero3 and ``K - J`` replicated.

Applied by replacing the Linear with :class:`osdp_lightning.runtime.split.SplitLinear` and sharding its
slices one by one (each slice its own all-gather group). Its cost needs what cutting each Linear
costs, measured on the profiled model (:func:`measure_overheads`); its replicated slices are a
group kind of their own in the step model (:data:`TERMS`, calibrated by :func:`fit_terms`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from osdp_lightning.choices import replicate, zero2, zero3
from osdp_lightning.choices.base import (
    Choice,
    ChoiceFamily,
    ChoiceOptions,
    FamilyCalibration,
    StackTimings,
    StepContext,
    TermsFit,
    session_memo,
)
from osdp_lightning.cost.cluster import ClusterSpec
from osdp_lightning.cost.cost import (
    ChoiceCost,
    CostContext,
    all_gather_s,
    all_reduce_s,
    ceil_div,
    reduce_scatter_s,
)
from osdp_lightning.cost.step_terms import Affine, GroupTerms
from osdp_lightning.profiling.profile import logging_disabled, loss_runner
from osdp_lightning.profiling.records import ModelProfile, UnitProfile
from osdp_lightning.runtime.guards import preserved_rng, preserved_state
from osdp_lightning.runtime.split import measure_split_overhead_s, shard_split_linear, split_linear_in_module

TERMS = GroupTerms("split_replicated", overhead={"cpu": (1.5e-3, 0.9e-9), "gpu": (2.0e-4, 0.0)},
                   optimizer={"cpu": (1.0e-4, 1.8e-9), "gpu": (1.5e-5, 3.5e-12)})
"""A replicated slice: its own FSDP2 group on the (W, 1) mesh, kept from forward to backward.
A sharded slice is a zero3 group."""
SPLIT_REPLICATED = TERMS.kind
PEAK_FLOPS_PER_MEMORY_BYTE = 150.0
"""Peak FLOP/s over memory bytes/s (A100: 312 TFLOP/s / 2 TB/s); prices the memory-bound sum of a
split Linear's ``k`` partial outputs in a profile priced from FLOP counts (the only cost of
splitting the FLOP count does not see)."""
KERNEL_LAUNCH_S = 1e-5
"""Fixed seconds of one extra kernel (a split Linear runs ``k`` matmuls per pass instead of one)."""


def choice(k: int, sharded: int) -> Choice:
    """A Linear cut into ``k`` slices of which ``sharded`` are zero3."""
    return Choice("split", (("k", k), ("sharded", sharded)))


def cost(unit: UnitProfile, choice: Choice, ctx: CostContext) -> ChoiceCost:
    """Cost of ``split(k, sharded)``. The first ``sharded`` slices are zero3 (own all-gather group
    each), the other ``k - sharded`` replicated on DDP's reducer (``osdp_lightning/runtime/replicate.py``,
    plain tensors: no copy); the bias (``out`` parameters) stays whole, in the enclosing unit's
    group. Assumptions, checked with FSDPMemTracker on 2 gloo ranks (fp32, measured within 3% of
    peak minus start-of-step bytes):

    - held: nothing (a replicated slice computes with its own parameter);
    - transient: sharded slices run one after another, but FSDP2's backward prefetch gathers the
      next slice while the current one's gradient is reduced, so two consecutive sharded slices
      are in flight (the pair rule the ILP applies between units, applied inside the unit), each
      its gathered weight and gradient; every replicated slice's gradient twice (autograd's tensor
      and the bucket's copy, alive until the bucket's all-reduce); plus one sharded slice's
      reduce-scatter output (added into the existing gradient shard) and the bias gradient;
    - communication: one all-gather group per sharded slice (latency paid per slice: two
      all-gathers and a reduce-scatter each); the replicated slices' gradients ride in DDP's
      buckets and the bias gradient in the enclosing unit's collective (bytes, no extra latency);
    - compute: the unit's forward and backward plus the measured overhead of ``k`` smaller
      matmuls and their sum (``unit.split_overhead_s``), all scaled with the micro-batch.
    """
    k, sharded = choice["k"], choice["sharded"]
    profile, cluster = ctx.profile, ctx.cluster
    if unit.linear_shape is None:
        raise ValueError(f"unit {unit.name!r} is not a single nn.Linear; it cannot be split")
    out_features, in_features = unit.linear_shape
    if k < 2 or in_features % k:
        raise ValueError(f"k={k} does not split in_features={in_features} of unit {unit.name!r}")
    if not 0 <= sharded <= k:
        raise ValueError(f"sharded must be in [0, {k}], got {sharded}")
    overhead_s = split_overhead_s(unit, k, profile)
    if overhead_s is None:
        raise ValueError(f"unit {unit.name!r} has no measured split overhead for k={k} "
                         f"(has {sorted(dict(unit.split_overhead_s))})")
    world, replicated = cluster.world_size, k - sharded
    weight = out_features * in_features
    weight_trainable = unit.param_count >= weight
    bias = unit.param_count + unit.frozen_param_count - weight
    bias_trainable = unit.param_count - (weight if weight_trainable else 0)
    slice_params = weight // k
    slice_trainable = slice_params if weight_trainable else 0

    def state_bytes(params: int, trainable: int) -> int:
        return (params * profile.param_bytes_per_element
                + trainable * (profile.grad_bytes_per_element + profile.optimizer_bytes_per_param))

    slice_state = state_bytes(slice_params, slice_trainable)
    state = (sharded * ceil_div(slice_state, world) + replicated * slice_state
             + state_bytes(bias, bias_trainable))
    gathered = slice_params * profile.compute_bytes_per_element
    grads = slice_trainable * profile.grad_bytes_per_element
    gathered_grads = slice_trainable * profile.compute_bytes_per_element  # a sharded slice's, unsharded
    reduced = slice_trainable * profile.reduce_bytes_per_element
    # Sharded slices: two consecutive ones in flight (FSDP2's backward prefetch). Replicated slices:
    # each gradient exists twice until the reducer all-reduces the bucket at the end of backward
    # (autograd's tensor and its copy in the bucket; measured with FSDPMemTracker on 2 gloo ranks,
    # tests/scripts/split_fsdp_check.py), for every replicated slice at once.
    in_flight = min(sharded, 2) * (gathered + gathered_grads) + 2 * replicated * grads
    # Accumulating: each sharded slice keeps its unsharded gradient (in the reduce dtype) through the
    # step (its in-flight gradient is then that tensor; counted in both places, an upper bound).
    state += ctx.kept_grad_bytes(sharded * reduced)
    # NOTE: sharded slices gathered in autocast's dtype save no copy of their weight (bf16-mixed).
    replicated_bytes, sharded_bytes = ctx.activation_bytes(unit), ctx.activation_bytes(unit, sharded=True)
    activation_bytes = replicated_bytes + (sharded_bytes - replicated_bytes) * sharded // k
    transient = (in_flight + (ceil_div(reduced, world) if sharded else 0)
                 + bias_trainable * profile.grad_bytes_per_element)
    bias_s = all_reduce_s(bias_trainable * profile.grad_bytes_per_element, world, cluster)
    reduce_s = (sharded * reduce_scatter_s(reduced, world, cluster)
                + replicated * max(0.0, all_reduce_s(grads, world, cluster) - cluster.collective_latency_s)
                + max(0.0, bias_s - cluster.collective_latency_s))  # rides in the enclosing unit's call
    comm_s = sharded * 2 * all_gather_s(gathered, world, cluster) + ctx.once_per_step_s(reduce_s)
    compute_s = (unit.forward_s + unit.backward_s + overhead_s) * ctx.batch_scale
    # Each slice is its own FSDP2 group (k per-group constants); the bias is one more zero3 tensor.
    slice_bytes = slice_params * profile.param_bytes_per_element
    machinery_s = (sharded * ctx.overhead_s(zero3.TERMS.kind, 1, slice_bytes)
                   + replicated * ctx.overhead_s(SPLIT_REPLICATED, 1, slice_bytes))
    optimizer_s = ((sharded * ctx.optimizer_s(zero3.TERMS.kind, 1, slice_bytes)
                    + replicated * ctx.optimizer_s(SPLIT_REPLICATED, 1, slice_bytes)) if weight_trainable else 0.0)
    optimizer_s += ctx.optimizer_s(zero3.TERMS.kind, 1, bias_trainable * profile.param_bytes_per_element) if bias_trainable else 0.0
    # A neighbouring unit's run overlaps at most one prefetched slice of this one.
    return ChoiceCost(str(choice), state, 0, transient, compute_s, comm_s,
                      prefetch_bytes=gathered if sharded else 0,
                      exposed_s=(2 + ctx.once_per_step_s(1)) * sharded * cluster.collective_latency_s if world > 1 else 0.0,
                      overhead_s=machinery_s, optimizer_s=optimizer_s,
                      activation_bytes=activation_bytes, reduce_bytes=reduced if sharded else 0,
                      rebuild_bytes=ctx.rebuilt_grad_bytes(replicated * grads))


def allowed(unit: UnitProfile, choice: Choice, ctx: CostContext) -> bool:
    """Only a Linear whose ``in_features`` ``k`` divides, with a split overhead for ``k``."""
    k = choice["k"]
    return (unit.linear_shape is not None and unit.linear_shape[1] % k == 0
            and split_overhead_s(unit, k, ctx.profile) is not None)


def split_overhead_s(unit: UnitProfile, k: int, profile: ModelProfile) -> float | None:
    """Extra forward+backward seconds of cutting the unit's Linear into ``k`` slices: measured
    (:func:`measure_overheads`), or in a profile priced from FLOP counts, estimated: ``k - 1`` more
    kernels in each of the three passes and the sum of ``k`` partial outputs (memory-bound: two
    reads and a write per element). ``None``: neither (not a split candidate)."""
    measured = dict(unit.split_overhead_s)
    if k in measured:
        return measured[k]
    if not profile.seconds_per_flop or not unit.output_bytes:
        return None
    seconds_per_byte = profile.seconds_per_flop * PEAK_FLOPS_PER_MEMORY_BYTE
    return (k - 1) * (3 * KERNEL_LAUNCH_S + 3 * unit.output_bytes * seconds_per_byte)


def space(options: ChoiceOptions, _cluster: ClusterSpec) -> tuple[Choice, ...]:
    """Every ``split(k, j)`` with ``k`` in the split factors and 1 <= j <= k sharded slices.

    (j = 0 would be ``replicate`` plus the cost of splitting, never better, so it is left out.)
    """
    return tuple(choice(k, j) for k in options.split_factors for j in range(1, k + 1))


def apply(model: nn.Module, module_names: tuple[str, ...], choice: Choice, meshes: object,
          mp_policy: MixedPrecisionPolicy) -> None:
    """Replace the Linear with a SplitLinear and shard its slices (the bias stays with the parent unit)."""
    split_module = split_linear_in_module(model, module_names[0], choice["k"])
    # NOTE: replicated slices join DDP's reducer (replicate_mesh=None), built by replicate's connect hook.
    shard_split_linear(split_module, choice["sharded"], meshes.shard, None, mp_policy)


def measure_overheads(module: nn.Module, batch: object | None, profile: ModelProfile, options: ChoiceOptions,
                      step_context: StepContext) -> ModelProfile:
    """``profile`` with the measured cost of splitting each Linear unit into ``k`` slices, for every
    ``k`` of ``options.split_factors``.

    Captures each Linear unit's real input during one forward, then times the split layer
    against the plain one on that input (k smaller matmuls and a sum are not free on CPU).
    """
    linear_units = [n for u in profile.units for n in (u, *u.parts) if n.linear_shape is not None]
    if not options.split_factors or not linear_units:
        return profile
    inputs: dict[str, torch.Tensor] = {}
    handles = [module.get_submodule(u.module_names[0]).register_forward_pre_hook(
        lambda _m, args, name=u.name: inputs.setdefault(name, args[0].detach())) for u in linear_units]
    run_loss = loss_runner(module, batch, step_context)
    try:
        with preserved_state(module), logging_disabled(module), torch.no_grad():
            run_loss()
    finally:
        for h in handles:
            h.remove()
    measured: dict[tuple, float] = session_memo(TERMS.kind)

    def with_overhead(unit: UnitProfile) -> UnitProfile:
        if unit.parts:
            return dataclasses.replace(unit, parts=tuple(with_overhead(p) for p in unit.parts))
        valid = [k for k in options.split_factors if unit.linear_shape is not None and unit.linear_shape[1] % k == 0]
        if unit.name not in inputs or not valid:
            return unit
        linear = module.get_submodule(unit.module_names[0])
        x = inputs[unit.name]
        # Layers of one shape fed inputs of one shape cost the same: time each kind once (in a
        # measurement session, once for all the units measured in it).
        key = (unit.linear_shape, linear.bias is not None, tuple(x.shape), x.dtype, x.device.type)
        for k in valid:
            if (key, k) not in measured:
                with preserved_rng(), step_context():
                    measured[key, k] = max(measure_split_overhead_s(linear, x, k), 0.0)
        return dataclasses.replace(unit, split_overhead_s=tuple((k, measured[key, k]) for k in valid))
    return dataclasses.replace(profile, units=tuple(with_overhead(u) for u in profile.units))


CALIBRATION_K = 2
"""Calibration's bench: every Linear(width, width) of the stack a unit, cut in two, one slice zero3
and one replicated (the rest of each block, weightless, in the root's zero3 group)."""


def fit_terms(timings: StackTimings | None, overhead: Mapping[str, Affine], optimizer: Mapping[str, Affine]
              ) -> TermsFit:
    """A replicated slice's terms: what the bench took per unit beyond its zero3 slice (its bias,
    in the root's zero3 group, priced as one more zero3 tensor). Not benched: a replicated slice is
    gathered once per step and kept until backward like zero2, its optimizer runs like replicate's."""
    if timings is None:
        return {TERMS.kind: overhead[zero2.TERMS.kind]}, {TERMS.kind: optimizer[replicate.TERMS.kind]}
    zero3_overhead, zero3_optimizer = overhead[zero3.TERMS.kind], optimizer[zero3.TERMS.kind]
    half = {w: w * w * 4 // CALIBRATION_K for w in timings.excess_s}  # one slice's weight, fp32

    def fitted(seconds: Mapping[int, float]) -> Affine:
        return Affine.fit([(half[w], s) for w, s in seconds.items()], 1)
    slice_s = {w: s - zero3_overhead.seconds(1, half[w]) for w, s in timings.excess_s.items()}
    slice_opt = {w: s - zero3_optimizer.seconds(2, half[w] + 4 * w) for w, s in timings.optimizer_s.items()}
    return {TERMS.kind: fitted(slice_s)}, {TERMS.kind: fitted(slice_opt)}


def _split_in_calibration(stack: nn.Module, unit_name: str) -> None:
    split_linear_in_module(stack, unit_name, CALIBRATION_K)


FAMILY = ChoiceFamily(
    kind="split", param_names=("k", "sharded"), cost=cost, apply=apply, space=space, allowed=allowed,
    measure=measure_overheads, group_terms=(TERMS,),
    calibration=FamilyCalibration(bench=str(choice(CALIBRATION_K, 1)), fit=fit_terms, root=str(zero3.CHOICE),
                                  reference=_split_in_calibration, optional=True, linear_units=True))
