"""Which modules are units (one ``fully_shard`` call each) and which parameters each one owns.

A unit owns the parameters in its modules' subtrees that no unit nested inside it owns; the root
unit ('') owns the rest. Units may nest (FSDP2 is applied bottom-up), and modules that share a
parameter (tied weights) form one unit, since a parameter can live in one FSDP group only.

By default the units are the model's repeated blocks (found as FSDP users' auto-wrap policies
find them: children of an ``nn.ModuleList`` that share a class) plus the large leaf modules
outside them; each block also lists its *parts* (its large leaf modules), so that the plan may
take a block whole or descend into its parts (:func:`osdp_lightning.profiling.records.with_parts`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

ROOT = ""
DEFAULT_MIN_UNIT_PARAMS = 1024


@dataclass(frozen=True)
class UnitSpec:
    """Which modules form a unit, before anything is measured."""

    name: str
    """Qualified module name; tied modules joined with '+'."""
    module_names: tuple[str, ...]
    parts: tuple[UnitSpec, ...] = ()
    """Finer units inside this one (a block's large leaf modules) that a plan may use instead."""


def select_units(module: nn.Module, unit_module_types: Sequence[str | type] | None = None,
                 unit_name_patterns: Sequence[str] | None = None,
                 min_unit_params: int = DEFAULT_MIN_UNIT_PARAMS) -> list[UnitSpec]:
    """Units of ``module`` (root excluded), in module order.

    By default: the repeated blocks (:func:`find_blocks`), each with its parts, plus every module
    outside them that directly holds at least ``min_unit_params`` parameters (embeddings, heads;
    small norms stay with the root); a model without repeated blocks gets those leaf units only.
    Naming module types or ``fnmatch`` name patterns replaces the default (no parts then).
    """
    named = [(n, m) for n, m in module.named_modules() if n != ROOT]
    if unit_module_types or unit_name_patterns:
        chosen = [n for n, m in named if _matches(n, m, unit_module_types or (), unit_name_patterns or ())]
        if not chosen:
            raise ValueError(
                f"unit_module_types={list(unit_module_types or [])} and unit_name_patterns="
                f"{list(unit_name_patterns or [])} match no module of {type(module).__name__}; module "
                f"types present: {sorted({type(m).__name__ for _, m in named})}")
        return _merge_tied(module, chosen)
    blocks = find_blocks(module, min_unit_params)
    inside = [n for n, _ in named if any(n.startswith(b + ".") for b in blocks)]
    leaves = [n for n, m in named if n not in inside and n not in blocks and _direct_params(m) >= min_unit_params]
    specs = _merge_tied(module, sorted(blocks + leaves, key=[n for n, _ in named].index))
    return [_with_parts(module, s, min_unit_params) if s.module_names[0] in blocks and len(s.module_names) == 1
            else s for s in specs]


def find_blocks(module: nn.Module, min_unit_params: int = DEFAULT_MIN_UNIT_PARAMS) -> list[str]:
    """Names of the repeated blocks: children of an ``nn.ModuleList`` that share their class with a
    sibling and hold at least ``min_unit_params`` parameters (outermost lists only: a list inside
    a block, such as a mixture's experts, stays inside it)."""
    blocks: list[str] = []
    for name, mod in module.named_modules():
        if not isinstance(mod, nn.ModuleList) or any(name.startswith(b + ".") for b in blocks):
            continue
        classes = [type(child) for child in mod]
        for index, child in enumerate(mod):
            if classes.count(type(child)) > 1 and sum(p.numel() for p in child.parameters()) >= min_unit_params:
                blocks.append(f"{name}.{index}" if name else str(index))
    return blocks


def _with_parts(root: nn.Module, spec: UnitSpec, min_unit_params: int) -> UnitSpec:
    """``spec`` (one block) with its large leaf modules as parts; none when one of them is tied to
    a module outside the block (a parameter lives in one FSDP group)."""
    block = spec.module_names[0]
    names = [f"{block}.{n}" for n, m in root.get_submodule(block).named_modules()
             if n and _direct_params(m) >= min_unit_params]
    # NOTE: a part nested in another (nn.MultiheadAttention's out_proj) stays with the outer one.
    names = [n for n in names if not any(n.startswith(o + ".") for o in names)]
    parts = _merge_tied(root, names)
    inside = {id(p) for p in root.get_submodule(block).parameters()}
    outside = {id(p) for n, m in root.named_modules() if n != block and not n.startswith(block + ".")
               for p in m.parameters(recurse=False)}
    if inside & outside or len(parts) < 2:
        return spec
    return UnitSpec(spec.name, spec.module_names, tuple(parts))


def _direct_params(mod: nn.Module) -> int:
    return sum(p.numel() for p in mod.parameters(recurse=False))


def owned_params(module: nn.Module, specs: Sequence[UnitSpec]) -> dict[str, list[nn.Parameter]]:
    """Parameters each unit owns (root: ''), nested units first, each parameter counted once."""
    owned: dict[str, list[nn.Parameter]] = {}
    taken: set[int] = set()
    depth = {s.name: min(n.count(".") for n in s.module_names) for s in specs}
    for spec in sorted(specs, key=lambda s: -depth[s.name]):  # innermost units claim first
        params = []
        for mod_name in spec.module_names:
            for p in module.get_submodule(mod_name).parameters():
                if id(p) not in taken:
                    taken.add(id(p))
                    params.append(p)
        owned[spec.name] = params
    owned[ROOT] = [p for p in _unique(module.parameters()) if id(p) not in taken]
    return owned


def unit_param_counts(module: nn.Module, specs: Sequence[UnitSpec]) -> dict[str, int]:
    """Parameters per unit name (root included), computed without running anything."""
    return {name: sum(p.numel() for p in params) for name, params in owned_params(module, specs).items()}


def _unique(params) -> list[nn.Parameter]:  # noqa: ANN001
    seen: dict[int, nn.Parameter] = {}
    for p in params:
        seen.setdefault(id(p), p)
    return list(seen.values())


def _matches(name: str, mod: nn.Module, types: Sequence[str | type], patterns: Sequence[str]) -> bool:
    by_type = any(type(mod).__name__ == t if isinstance(t, str) else isinstance(mod, t) for t in types)
    return by_type or any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _merge_tied(root: nn.Module, chosen: list[str]) -> list[UnitSpec]:
    """Join units that share a parameter (union-find over parameter identity)."""
    parent: dict[str, str] = {n: n for n in chosen}

    def find(n: str) -> str:
        while parent[n] != n:
            n = parent[n]
        return n

    first_owner: dict[int, str] = {}
    own = {name: _own_param_ids(root, name, chosen) for name in chosen}
    for name in chosen:
        for key in own[name]:
            other = first_owner.setdefault(key, name)
            if other != name:
                parent[find(name)] = find(other)
    groups: dict[str, list[str]] = {}
    for name in chosen:
        groups.setdefault(find(name), []).append(name)
    specs = [UnitSpec("+".join(members), tuple(members)) for members in groups.values()]
    return [s for s in specs if not _tied_to_outside(root, s, chosen, own)]


def _own_param_ids(root: nn.Module, name: str, chosen: list[str]) -> set[int]:
    """Parameters in ``name``'s subtree outside the subtrees of chosen modules nested in it."""
    nested = [c for c in chosen if c.startswith(name + ".")]
    return {id(p) for sub, mod in root.get_submodule(name).named_modules(prefix=name)
            if not any(sub == c or sub.startswith(c + ".") for c in nested)
            for p in mod.parameters(recurse=False)}


def _tied_to_outside(root: nn.Module, spec: UnitSpec, chosen: list[str], own: dict[str, set[int]]) -> bool:
    """A unit whose parameter is also held by a module no unit covers must leave it to the root."""
    params = set().union(*(own[n] for n in spec.module_names))
    for name, mod in root.named_modules():
        if any(name == c or name.startswith(c + ".") for c in chosen):
            continue
        if params & {id(p) for p in mod.parameters(recurse=False)}:
            return True
    return False
