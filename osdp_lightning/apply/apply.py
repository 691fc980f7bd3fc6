"""Stage 4: turn a Plan into FSDP2 calls on the real module.

The order is fixed and the same on every rank (a different order or mesh on one rank would
deadlock the first collective):

1. build the two meshes every choice needs (a 1-D shard mesh, a 2-D (W, 1) replicate mesh),
   plus a 2-D (W/g, g) mesh for each group size g of the plan's ``hsdp(g=G)`` choices;
2. apply every unit's choice in plan order (its family's module in ``osdp_lightning/choices/``
   says how: ``fully_shard`` arguments, or a transform such as ``split(k, j)``'s SplitLinear);
   with ``compile="units"``, each unit's ``torch.compile`` comes after its ``+ckpt`` and before its
   ``fully_shard`` (``osdp_lightning/runtime/compile.py``);
3. apply the root's choice last: it takes every parameter no unit owns;
4. run every family's ``finish`` hook, then (once every rank got this far) its ``connect`` hook:
   replicate's builds one DDP reducer for every replicated parameter (``osdp_lightning/runtime/replicate.py``;
   replicate units and split's replicated slices were only marked, and every ``fully_shard`` above
   them was told to ignore them).

On gloo every FSDP2 module reduce-scatters with an all-reduce in place (``osdp_lightning/runtime/collectives.py``):
gloo's own collective leaves a buffer of the input's size for its worker thread to free, which
lets a plan's peak differ between launches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from osdp_lightning.choices import REGISTRY, apply_choice, mesh_group_sizes
from osdp_lightning.plan.plan import Plan
from osdp_lightning.profiling.precision import plan_precision, sharded_precision
from osdp_lightning.profiling.profile import ROOT
from osdp_lightning.runtime.collectives import reduce_in_place_on_gloo
from osdp_lightning.runtime.meshes import Meshes, group_mesh
from osdp_lightning.runtime.shutdown import release_at_exit


def with_group_meshes(meshes: Meshes, plan: Plan) -> Meshes:
    """``meshes`` plus the (W/g, g) meshes the plan's ``hsdp(g=G)`` choices need.

    Every rank builds the same missing meshes in the same (sorted) order, so this is safe to call
    from :func:`apply_plan` on every rank.
    """
    needed = sorted(set(mesh_group_sizes(u.choice for u in plan.units)) - set(meshes.groups))
    if not needed:
        return meshes
    device_type, world_size = meshes.shard.device_type, meshes.shard.size()
    return replace(meshes, groups={**meshes.groups, **{g: group_mesh(device_type, world_size, g) for g in needed}})


def apply_plan(model: nn.Module, root: nn.Module, plan: Plan, meshes: Meshes,
               mp_policy: MixedPrecisionPolicy | None = None, build_reducer: bool = True,
               compile: str | None = None) -> None:
    """Apply ``plan`` in place: units live inside ``model``; ``root`` is the outermost module.

    Sharded units run under ``mp_policy``, by default the policy the plan was priced for
    (``bf16-mixed``: gathered in bf16, reduced in fp32; :mod:`osdp_lightning.profiling.precision`); the
    root's does not cast its forward's inputs (the batch: a float target stays as the loss reads it).

    ``root`` may be ``model`` itself or a wrapper around it whose forward runs first (Lightning's
    wrapper dispatches to ``training_step``); FSDP2 makes the first module to run forward the root.
    ``build_reducer=False`` leaves out the one step that talks to the other ranks (DDP's reducer
    checks the replicated parameters with a collective): the caller first makes sure every rank got
    this far, then calls :func:`connect_plan`. ``compile="units"`` compiles every unit but the
    root (its forward is the whole step) and the leaves.
    """
    release_at_exit()  # what holds the group is freed before finalization (shutdown.py)
    policy = mp_policy or plan_precision(plan).policy()
    root_policy = dataclasses.replace(policy, cast_forward_inputs=False)
    meshes = with_group_meshes(meshes, plan)
    for unit in plan.units:
        if unit.name != ROOT:
            apply_choice(model, unit.module_names, unit.choice, meshes, policy, compile_unit=compile == "units")
    apply_choice(root, (ROOT,), plan.choice_of(ROOT), meshes, root_policy)
    # What a family does once for the whole plan (replicated units and slices were only marked).
    for family in REGISTRY.families.values():
        family.finish(root, meshes, root_policy)
    reduce_in_place_on_gloo(root, meshes.shard.get_group())
    if build_reducer:
        connect_plan(root)


def connect_plan(root: nn.Module) -> None:
    """The last step of applying a plan, a collective: each family's ``connect`` (replicate: one
    DDP reducer). Every rank calls it, once every rank applied the rest of the plan."""
    for family in REGISTRY.families.values():
        family.connect(root)


def step_groups_apart(optimizers: list[torch.optim.Optimizer]) -> list[str]:
    """Turn off the multi-tensor paths (``foreach``, ``fused``) in every parameter group that holds
    both sharded (DTensor) and replicated (plain) parameters; returns what it changed.

    NOTE: a mixed plan puts both kinds in the group ``configure_optimizers`` made; the multi-tensor
    kernels take them as one list and DTensor refuses plain tensors beside it (torch 2.11 on CUDA,
    AdamW: "got mixed torch.Tensor and DTensor" in ``_foreach_mul_``). The groups stay as they are,
    so learning-rate schedulers and checkpoints see the groups the user made; only the per-tensor
    path is slower (on CPU it is the default anyway)."""
    changed = []
    for i, optimizer in enumerate(optimizers):
        for j, group in enumerate(optimizer.param_groups):
            kinds = {isinstance(p, DTensor) for p in group["params"]}
            if len(kinds) == 2 and (group.get("foreach") is not False or group.get("fused")):
                group.update({k: False for k in ("foreach", "fused") if k in group or k == "foreach"})
                changed.append(f"optimizer {i} group {j} ({type(optimizer).__name__})")
    return changed


def mixed_precision_policy(precision: str | None, reduce_dtype: str = "float32") -> MixedPrecisionPolicy:
    """FSDP2 policy of sharded units under Lightning's ``precision=`` flag: ``bf16-mixed`` gathers in
    bf16 and reduces in ``reduce_dtype`` (autocast computes; the fp32 shards are the master weights),
    the ``*-true`` flags keep the parameters' dtype; ``16-mixed`` is refused, naming what works."""
    return sharded_precision(precision, reduce_dtype).policy()


def world_device_type(device: torch.device) -> str:
    return "cuda" if device.type == "cuda" else "cpu"
