"""``<choice>+ckpt``: activation checkpointing of a unit, combined with any sharding choice.

A checkpointed unit keeps only its input from forward to backward; its backward first runs its
forward again (torch's non-reentrant checkpointing, which restores the RNG state, so dropout
draws the same numbers) and holds the recomputed activations while its backward runs.

Cost, from the cost of the same choice without checkpointing (per rank, at the table's batch):

- ``activation_bytes``: the unit's input bytes instead of the bytes it saves for backward;
- ``transient_bytes``: plus the bytes it saves for backward, recomputed (alive during its own
  backward only, not a neighbour's, so ``prefetch_bytes`` stays that of the sharding choice);
- ``compute_s``: plus its forward seconds (the recompute).
"""

from __future__ import annotations

import dataclasses

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from osdp_lightning.choices.base import Choice, ChoiceModifier, ChoiceOptions
from osdp_lightning.cost import ChoiceCost, CostContext
from osdp_lightning.profile import UnitProfile
from osdp_lightning.units import ROOT

NAME = "ckpt"
MODES = ("auto", "never", "always")
"""``activation_checkpointing`` option: the ILP decides per unit / no unit / every unit that can."""


def cost(base: ChoiceCost, unit: UnitProfile, choice: Choice, ctx: CostContext) -> ChoiceCost:
    # NOTE: an upper bound: the recomputed activations are all counted next to the unit's gathered
    # parameters and gradients. FSDPMemTracker sees them together (weight gradients appear before
    # the recompute is freed); taking the larger of the two moments instead under-predicted by 7%.
    return dataclasses.replace(
        base, choice=str(choice), activation_bytes=int(unit.input_bytes * ctx.batch_scale),
        transient_bytes=base.transient_bytes + ctx.activation_bytes(unit), prefetch_bytes=base.prefetch,
        compute_s=base.compute_s + unit.forward_s * ctx.batch_scale)


def allowed(unit: UnitProfile, _choice: Choice, _ctx: CostContext) -> bool:
    """Any unit but the root (it runs the whole step) whose input bytes were recorded."""
    return unit.name != ROOT and unit.input_bytes > 0


def space(options: ChoiceOptions, choices: tuple[Choice, ...]) -> tuple[Choice, ...]:
    """``never``: as is; ``always``: every choice checkpointed; ``auto``: both, the ILP picks."""
    mode = options.activation_checkpointing
    if mode not in MODES:
        raise ValueError(f"activation_checkpointing must be one of {MODES}, got {mode!r}")
    checkpointed = tuple(c.with_modifier(NAME) for c in choices)
    return {"never": choices, "always": checkpointed, "auto": choices + checkpointed}[mode]


def apply(model: nn.Module, module_names: tuple[str, ...], _choice: Choice, _meshes: object,
          _mp_policy: MixedPrecisionPolicy) -> None:
    """Checkpoint the unit's modules in place (module names and state-dict keys stay as they are).

    NOTE: runs before the sharding choice's ``fully_shard``, the order torchtitan's ``apply_ac``
    and FSDP2's own tests use: FSDP2's hooks then gather the parameters again for the recompute.
    """
    from torch.distributed._composable import checkpoint

    for name in module_names:
        checkpoint(model.get_submodule(name))


MODIFIER = ChoiceModifier(name=NAME, cost=cost, apply=apply, space=space, allowed=allowed)
