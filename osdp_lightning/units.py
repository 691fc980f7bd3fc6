"""Which modules are units (one ``fully_shard`` call each) and which parameters each one owns.

A unit owns the parameters in its modules' subtrees that no unit nested inside it owns; the root
unit ('') owns the rest. Units may nest (FSDP2 is applied bottom-up), and modules that share a
parameter (tied weights) form one unit, since a parameter can live in one FSDP group only.
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


def select_units(module: nn.Module, unit_module_types: Sequence[str | type] | None = None,
                 unit_name_patterns: Sequence[str] | None = None,
                 min_unit_params: int = DEFAULT_MIN_UNIT_PARAMS) -> list[UnitSpec]:
    """Units of ``module`` (root excluded), in module order.

    By default every module that directly holds at least ``min_unit_params`` parameters is a unit
    (Linear, Embedding, attention projections; small norms stay with the root). Naming module
    types or ``fnmatch`` name patterns replaces the default.
    """
    named = [(n, m) for n, m in module.named_modules() if n != ROOT]
    if unit_module_types or unit_name_patterns:
        chosen = [n for n, m in named if _matches(n, m, unit_module_types or (), unit_name_patterns or ())]
        if not chosen:
            raise ValueError(
                f"unit_module_types={list(unit_module_types or [])} and unit_name_patterns="
                f"{list(unit_name_patterns or [])} match no module of {type(module).__name__}; module "
                f"types present: {sorted({type(m).__name__ for _, m in named})}")
    else:
        chosen = [n for n, m in named if sum(p.numel() for p in m.parameters(recurse=False)) >= min_unit_params]
    return _merge_tied(module, chosen)


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
    for name in chosen:
        for p in root.get_submodule(name).parameters(recurse=False):
            other = first_owner.setdefault(id(p), name)
            if other != name:
                parent[find(name)] = find(other)
    groups: dict[str, list[str]] = {}
    for name in chosen:
        groups.setdefault(find(name), []).append(name)
    specs = [UnitSpec("+".join(members), tuple(members)) for members in groups.values()]
    return [s for s in specs if not _tied_to_outside(root, s, chosen)]


def _tied_to_outside(root: nn.Module, spec: UnitSpec, chosen: list[str]) -> bool:
    """A unit whose parameter is also held directly by a non-unit module must leave it to the root."""
    params = {id(p) for n in spec.module_names for p in root.get_submodule(n).parameters(recurse=False)}
    for name, mod in root.named_modules():
        if name in spec.module_names or any(name.startswith(m + ".") for m in spec.module_names):
            continue
        if name not in chosen and params & {id(p) for p in mod.parameters(recurse=False)}:
            return True
    return False
