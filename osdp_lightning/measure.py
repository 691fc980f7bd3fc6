"""Measuring a LightningModule whole: its real training step on one device, per unit, plus the
two things the choices need measured on it (whether each unit can be checkpointed, what splitting
each Linear costs). Above the choice families, which know how a unit is checkpointed or split.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from osdp_lightning.choices.checkpointing import find_unreplayable
from osdp_lightning.profile import (
    ModelProfile,
    UnitProfile,
    batch_size_of,
    logging_disabled,
    loss_runner,
    measure_units,
    optimizer_state_bytes_per_param,
    preserved_rng,
    preserved_state,
    tensor_bytes,
)
from osdp_lightning.split import measure_split_overhead_s
from osdp_lightning.units import DEFAULT_MIN_UNIT_PARAMS, ROOT, select_units


def profile_lightning_module(module: nn.Module, batch: object | None = None, *,
                             micro_batch_size: int | None = None,
                             unit_module_types: Sequence[str | type] | None = None,
                             unit_name_patterns: Sequence[str] | None = None,
                             min_unit_params: int = DEFAULT_MIN_UNIT_PARAMS,
                             optimizer: torch.optim.Optimizer | None = None,
                             step_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                             repeats: int = 3, check_checkpointing: bool = True) -> ModelProfile:
    """Profile a LightningModule's real training computation on ``batch``.

    Runs ``training_step(batch, 0)`` plus backward; with ``batch=None`` runs
    ``forward(example_input_array)`` and backpropagates the sum of its output.
    ``check_checkpointing``: also run it with the units checkpointed and record, per unit, why one
    cannot be (:func:`with_checkpoint_refusals`).
    """
    start = time.perf_counter()
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError(f"{type(module).__name__} has no trainable parameters: there is nothing to shard "
                         "or train; unfreeze some parameters (requires_grad=True).")
    specs = select_units(module, unit_module_types, unit_name_patterns, min_unit_params)
    device = next(module.parameters()).device
    run_loss = loss_runner(module, batch, step_context)
    with logging_disabled(module):
        units, activation_bytes, step_s = measure_units(module, specs, run_loss, device, repeats)
        if check_checkpointing:
            units = with_checkpoint_refusals(module, units, run_loss)
    dtype = next(p for p in module.parameters() if p.requires_grad).dtype
    elem = torch.empty((), dtype=dtype).element_size()
    inputs = batch if batch is not None else getattr(module, "example_input_array", None)
    return ModelProfile(
        units=tuple(units), micro_batch_size=micro_batch_size or batch_size_of(inputs),
        param_bytes_per_element=elem, grad_bytes_per_element=elem, compute_bytes_per_element=elem,
        reduce_bytes_per_element=elem,
        optimizer_bytes_per_param=optimizer_state_bytes_per_param(optimizer, dtype) if optimizer else 0,
        activation_bytes=activation_bytes, fixed_bytes=tensor_bytes(inputs), step_s=step_s,
        profile_s=time.perf_counter() - start)


def with_checkpoint_refusals(root: nn.Module, units: Sequence[UnitProfile], run_loss: Callable[[], torch.Tensor]
                             ) -> list[UnitProfile]:
    """``units`` with :attr:`UnitProfile.checkpoint_refusal` set on each unit (or part) whose
    checkpointed step fails (:func:`osdp_lightning.choices.checkpointing.find_unreplayable`: one
    step with every unit checkpointed, one with every part, one more per unit refused)."""
    def candidates(group: Iterable[UnitProfile]) -> dict[str, tuple[str, ...]]:
        return {u.name: u.module_names for u in group if u.name != ROOT and u.input_bytes > 0}

    with preserved_state(root):
        refused = find_unreplayable(root, (candidates(units), candidates(p for u in units for p in u.parts)),
                                    run_loss)

    def with_refusal(unit: UnitProfile) -> UnitProfile:
        return dataclasses.replace(unit, checkpoint_refusal=refused.get(unit.name, ""),
                                   parts=tuple(with_refusal(p) for p in unit.parts))
    return [with_refusal(u) for u in units]


def measure_split_overheads(module: nn.Module, batch: object | None, profile: ModelProfile,
                            factors: Sequence[int],
                            step_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                            ) -> ModelProfile:
    """Add the measured cost of splitting each Linear unit into ``k`` slices (k in ``factors``).

    Captures each Linear unit's real input during one forward, then times the split layer
    against the plain one on that input (k smaller matmuls and a sum are not free on CPU).
    """
    linear_units = [u for u in _with_nested(profile.units) if u.linear_shape is not None]
    if not linear_units:
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
    measured: dict[tuple, tuple[tuple[int, float], ...]] = {}

    def with_overhead(unit: UnitProfile) -> UnitProfile:
        if unit.parts:
            return dataclasses.replace(unit, parts=tuple(with_overhead(p) for p in unit.parts))
        valid = [k for k in factors if unit.linear_shape is not None and unit.linear_shape[1] % k == 0]
        if unit.name not in inputs or not valid:
            return unit
        linear = module.get_submodule(unit.module_names[0])
        x = inputs[unit.name]
        # Layers of one shape fed inputs of one shape cost the same: time each kind once.
        key = (unit.linear_shape, linear.bias is not None, tuple(x.shape), x.dtype)
        if key not in measured:
            with preserved_rng(), step_context():
                measured[key] = tuple((k, max(measure_split_overhead_s(linear, x, k), 0.0)) for k in valid)
        return dataclasses.replace(unit, split_overhead_s=measured[key])
    return dataclasses.replace(profile, units=tuple(with_overhead(u) for u in profile.units))


def _with_nested(units: Sequence[UnitProfile]) -> list[UnitProfile]:
    return [n for u in units for n in (u, *u.parts)]
