"""The choices a unit can take: one module per family, one registry, one choice space.

    from osdp_lightning.choices import parse, choice_space, choice_cost
    parse("split(k=4, sharded=3)")["k"]  # 4

Only this package reads or writes choice names. A family (``replicate.py``, ``zero2.py``, ...)
says its name and parameters, its cost (:class:`~osdp_lightning.cost.cost.ChoiceCost` from a
:class:`~osdp_lightning.cost.cost.CostContext`) and how it is applied; registering it below is the
only line a new family adds outside its module (see ``docs/design.md``, "Adding a choice family").
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from torch import nn

from osdp_lightning.choices import checkpointing, groups, replicate, split, zero2, zero3
from osdp_lightning.choices.base import (
    REGISTRY,
    Choice,
    ChoiceFamily,
    ChoiceModifier,
    ChoiceOptions,
    as_choice,
    family_of,
    is_known,
    known_names,
    parse,
    register,
    register_modifier,
)
from osdp_lightning.choices.groups import hsdp_choice, zero3_reshard_choice
from osdp_lightning.choices.split import choice as split_choice
from osdp_lightning.cost.aliases import ALIASES, BASELINES
from osdp_lightning.cost.budget import PLAN_HEADROOM_FRACTION
from osdp_lightning.runtime import compile as runtime_compile

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from osdp_lightning.cost.cluster import ClusterSpec
    from osdp_lightning.cost.cost import ChoiceCost, CostContext
    from osdp_lightning.profiling.records import UnitProfile
    from osdp_lightning.runtime.meshes import Meshes

# Registration order is the order of the choice space (the solver keeps the first of equal choices).
for _family in (replicate.FAMILY, zero2.FAMILY, zero3.FAMILY, split.FAMILY, groups.HSDP, groups.ZERO3_RESHARD):
    register(_family)
register_modifier(checkpointing.MODIFIER)

REPLICATE, ZERO2, ZERO3 = replicate.CHOICE, zero2.CHOICE, zero3.CHOICE
BASE_CHOICES: tuple[Choice, ...] = (REPLICATE, ZERO2, ZERO3)


def kept_share(choice: Choice | str) -> float:
    """The share of a choice's bytes a plan keeps free for what the memory model misses, under
    headroom by kind: the largest of its family's and its modifiers' measured shares
    (:class:`~osdp_lightning.choices.base.MemoryMiss`), the flat CPU default share for any not measured."""
    choice = as_choice(choice)
    misses = [family_of(choice).memory_miss, *(REGISTRY.modifiers[m].memory_miss for m in choice.modifiers)]
    return max(PLAN_HEADROOM_FRACTION if miss is None else miss.kept_share for miss in misses)


def resolve(name: str) -> Choice:
    """The choice named ``name`` or by an alias (``"ddp"`` is ``replicate``, ``"fsdp"`` is ``zero3``)."""
    return parse(ALIASES.get(name, name))


def choice_space(cluster: ClusterSpec, options: ChoiceOptions | None = None) -> tuple[Choice, ...]:
    """Every choice the solver may give a unit: each family's, then each modifier's combinations."""
    options = options or ChoiceOptions()
    choices = tuple(c for family in REGISTRY.families.values() for c in family.space(options, cluster))
    for modifier in REGISTRY.modifiers.values():
        choices = modifier.space(options, choices)
    return choices


def choice_cost(unit: UnitProfile, choice: Choice | str, ctx: CostContext) -> ChoiceCost:
    """What ``choice`` costs ``unit``: its family's cost, then each modifier's adjustment."""
    choice = as_choice(choice)
    cost = family_of(choice).cost(unit, choice.base, ctx)
    for name in choice.modifiers:
        cost = REGISTRY.modifiers[name].cost(cost, unit, choice, ctx)
    return cost


def is_allowed(unit: UnitProfile, choice: Choice | str, ctx: CostContext) -> bool:
    choice = as_choice(choice)
    if unit.mixed_dtypes and choice.kind != REPLICATE.kind:
        return False  # NOTE: FSDP2 shards a group of one dtype (base.check_one_dtype says so when applied)
    return family_of(choice).allowed(unit, choice.base, ctx) and all(
        REGISTRY.modifiers[m].allowed(unit, choice, ctx) for m in choice.modifiers)


def apply_choice(model: nn.Module, module_names: tuple[str, ...], choice: Choice | str, meshes: Meshes,
                 mp_policy: MixedPrecisionPolicy, compile_unit: bool = False) -> None:
    """Apply ``choice`` to a unit: modifiers' transforms first (``+ckpt``), then with ``compile_unit``
    ``torch.compile`` of its modules (:mod:`osdp_lightning.runtime.compile`; leaves stay eager), then
    the family's own apply (``fully_shard``, split)."""
    choice = as_choice(choice)
    for name in choice.modifiers:
        REGISTRY.modifiers[name].apply(model, module_names, choice, meshes, mp_policy)
    if compile_unit:
        for module_name in module_names:
            runtime_compile.compile_unit(model.get_submodule(module_name), module_name)
    family_of(choice).apply(model, module_names, choice.base, meshes, mp_policy)


def mesh_group_sizes(choices: Iterable[Choice | str]) -> tuple[int, ...]:
    """Group sizes of the extra (W/g, g) meshes ``choices`` need, sorted, each once."""
    return tuple(sorted({g for c in choices for g in family_of(as_choice(c)).mesh_groups(as_choice(c))}))


__all__ = [
    "ALIASES", "BASELINES", "BASE_CHOICES", "REGISTRY", "REPLICATE", "ZERO2", "ZERO3", "Choice", "ChoiceFamily",
    "ChoiceModifier", "ChoiceOptions", "apply_choice", "as_choice", "choice_cost", "choice_space", "family_of",
    "hsdp_choice", "is_allowed", "is_known", "kept_share", "known_names", "mesh_group_sizes", "parse", "register",
    "register_modifier", "resolve", "split_choice", "zero3_reshard_choice",
]
