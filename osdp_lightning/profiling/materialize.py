"""Shard, then materialize: give a model built on the meta device storage for its own shards only,
then initialise it one unit at a time.

After the plan is applied to the meta model, ``to_empty`` allocates what each rank keeps (its
shards of sharded units, whole replicated units). Values come from a meta copy of the model made
before the plan was applied (the *template*), one plan unit at a time: that unit's own tensors
are given storage in the template, every module is initialised (children before their parents,
so a block may refine what its layers did; on the still-meta tensors of other units this does
nothing), and the unit's values are loaded into the sharded model, then freed. The template is the
same on every rank and the random generator is seeded alike on every rank, so replicated units are
identical everywhere and the shards of a sharded unit come from one whole tensor, as under eager
construction; at most one unit is ever whole on the device. Tied parameters stay one tensor in
the template and in the sharded model (``to_empty_keeping_ties``).

The initialisation contract (as Lightning's and FSDP's for meta-device models):

- your own modules: every module that owns parameters or buffers is initialised by its own
  ``reset_parameters()`` or an ancestor's; non-persistent buffers (a causal mask, rotary tables)
  must be re-created there too, since no checkpoint holds them;
- Hugging Face models (``transformers.PreTrainedModel``, anywhere in the model): each module inside
  one is initialised as eager construction does it, its own ``reset_parameters()`` where it has
  one, then the innermost enclosing model's ``_init_weights(module)`` (what ``post_init()`` runs;
  in transformers 5 it also re-creates rotary ``inv_freq`` and other buffers computed in
  ``__init__``); see :mod:`osdp_lightning.profiling.hf_init`.

Anything left uninitialised is an error naming the module.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from itertools import chain

import torch
from torch import nn

from osdp_lightning.profiling.fakestep import to_empty_keeping_ties
from osdp_lightning.profiling.hf_init import init_as_hugging_face, is_hugging_face_model
from osdp_lightning.profiling.units import ROOT
from osdp_lightning.state.canonical import fill_like


class UninitializedModuleError(RuntimeError):
    """A module of a meta-device model whose tensors no ``reset_parameters()`` (nor, inside a Hugging
    Face model, its ``_init_weights``) reached."""


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in chain(module.parameters(), module.buffers()))


def unit_of_module(names: Sequence[str], units: Sequence[tuple[str, ...]]) -> dict[str, int]:
    """For each module name, the index of the innermost unit whose module contains it (``-1``: the
    root). ``units`` are the plan units' module names (tied modules share a unit)."""
    owner_of: dict[str, int] = {}
    for name in names:
        best, depth = -1, -1
        for i, unit in enumerate(units):
            for prefix in unit:
                inside = prefix == ROOT or name == prefix or name.startswith(prefix + ".")
                if inside and len(prefix) > depth:
                    best, depth = i, len(prefix)
        owner_of[name] = best
    return owner_of


def materialize(root: nn.Module, module: nn.Module, template: nn.Module, units: Sequence[tuple[str, ...]],
                device: torch.device, seed: int) -> None:
    """Allocate the shards of ``root`` (the plan applied, on the meta device) on ``device`` and
    initialise ``module`` (inside ``root``) from ``template``, unit by unit; see the module docstring.

    Raises :class:`UninitializedModuleError` on every rank alike (the template and seed are the same
    everywhere) before any collective.
    """
    to_empty_keeping_ties(root, device)
    holders = {name: m for name, m in template.named_modules() if _direct_tensors(m)}
    owner_of = unit_of_module(list(holders), units)
    groups = sorted(set(owner_of.values()))
    generator_state = torch.get_rng_state()
    torch.manual_seed(seed)
    try:
        for group in groups:
            names = [n for n in holders if owner_of[n] == group]
            with _materialized(template, names, device):
                initialise_post_order(template)
                _check_initialised(template, names)
                for name in names:
                    _load_module(module.get_submodule(name), holders[name])
    finally:
        torch.set_rng_state(generator_state)


def _direct_tensors(m: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, t) for n, t in chain(m._parameters.items(), m._buffers.items()) if t is not None]


@contextlib.contextmanager
def _materialized(template: nn.Module, names: Sequence[str], device: torch.device) -> Iterator[None]:
    """Within the block, the named modules' own tensors in ``template`` have storage on ``device``
    (NaN, or the largest integer, so that what nothing initialises shows), then are meta again."""
    _set_tensors(template, names, lambda t: _sentinel_like(t, device))
    try:
        yield
    finally:
        _set_tensors(template, names, lambda t: torch.empty_like(t, device="meta"))


def _set_tensors(template: nn.Module, names: Sequence[str], make: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Replace the named modules' own tensors by ``make(t)``; a parameter held by several modules
    (tied) gets one replacement for all of them."""
    made: dict[int, torch.Tensor] = {}
    wanted = set(names)
    for owner_name, owner in template.named_modules(remove_duplicate=False):
        for store in (owner._parameters, owner._buffers):
            for key, t in store.items():
                if t is None or (owner_name not in wanted and id(t) not in made):
                    continue
                if id(t) not in made:
                    new = make(t)
                    made[id(t)] = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new
                store[key] = made[id(t)]


def _sentinel_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    new = torch.empty_like(t, device=device)
    if new.is_floating_point() or new.is_complex():
        return new.fill_(math.nan)
    return new.fill_(True if new.dtype == torch.bool else torch.iinfo(new.dtype).max)


def initialise_post_order(module: nn.Module, owner: nn.Module | None = None) -> None:
    """Initialise every module of ``module``, children before parents, as the module docstring says:
    ``reset_parameters()`` where a module has one, then, inside a Hugging Face model, that model's
    ``_init_weights``. ``owner``: the Hugging Face model holding ``module`` when ``module`` is a part
    of one (or a copy of such a part; :func:`osdp_lightning.profiling.hf_init.hugging_face_owner` finds it)."""
    with torch.no_grad():
        _initialise(module, owner)


def _initialise(m: nn.Module, owner: nn.Module | None) -> None:
    owner = m if is_hugging_face_model(m) else owner
    for child in m.children():
        _initialise(child, owner)
    reset = getattr(m, "reset_parameters", None)
    if callable(reset):
        reset()
    if owner is not None:
        init_as_hugging_face(owner, m)


def _check_initialised(template: nn.Module, names: Sequence[str]) -> None:
    missing = []
    for name in names:
        m = template.get_submodule(name)
        left = [n for n, t in _direct_tensors(m) if _looks_unset(t)]
        if left:
            missing.append(f"{name or type(template).__name__} ({type(m).__name__}: {', '.join(left)})")
    if missing:
        raise UninitializedModuleError(
            "these modules of the model built on the meta device were not initialised: "
            f"{'; '.join(missing)}. osdp initialises each module with its own reset_parameters() or an "
            "ancestor's (children first, then parents) and, inside a Hugging Face model (transformers' "
            "PreTrainedModel), with that model's _init_weights(module) too; define reset_parameters() on these "
            "modules or cover them in _init_weights (re-create their non-persistent buffers there too), or build "
            "the model eagerly.")


def _looks_unset(t: torch.Tensor) -> bool:
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).any())
    if t.dtype == torch.bool:
        return False  # NOTE: a mask of ones is a valid value; bool buffers cannot show that they were missed
    return bool((t == torch.iinfo(t.dtype).max).all()) and t.numel() > 0


def _load_module(live: nn.Module, source: nn.Module) -> None:
    """The whole tensors of ``source``'s own parameters and buffers into ``live`` (DTensor shards,
    split slices, replicated tensors), without communication."""
    own = {n for n, _ in _direct_tensors(source)}
    persistent = {k: v for k, v in source.state_dict().items() if k in own}
    if persistent:
        current = {k: v for k, v in live.state_dict().items() if k in persistent}
        live.load_state_dict(fill_like(current, persistent, type(live).__name__, strict=True), strict=False)
    with torch.no_grad():
        for key, value in source._buffers.items():
            if value is not None and key not in persistent:
                live.get_buffer(key).copy_(value)
