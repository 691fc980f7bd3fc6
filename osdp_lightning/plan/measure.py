"""Measuring a LightningModule whole: its real training step on one device, per unit, plus what
the choices need measured on it (each family's and modifier's ``measure`` hook: whether each unit
can be checkpointed, what splitting each Linear costs). Above the choice families, which know how
a unit is checkpointed or split.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from osdp_lightning.choices import REGISTRY, ChoiceOptions
from osdp_lightning.choices.base import StepContext
from osdp_lightning.profiling.optim_state import optimizer_state_bytes_per_param, optimizer_step_bytes
from osdp_lightning.profiling.profile import (
    batch_size_of,
    logging_disabled,
    loss_runner,
    measure_units,
    tensor_bytes,
)
from osdp_lightning.profiling.recorder import sharded_saved_bytes
from osdp_lightning.profiling.records import ModelProfile, UnitProfile
from osdp_lightning.profiling.units import DEFAULT_MIN_UNIT_PARAMS, UnitSpec, select_units
from osdp_lightning.runtime.guards import preserved_state


def profile_lightning_module(module: nn.Module, batch: object | None = None, *,
                             micro_batch_size: int | None = None,
                             unit_module_types: Sequence[str | type] | None = None,
                             unit_name_patterns: Sequence[str] | None = None,
                             min_unit_params: int = DEFAULT_MIN_UNIT_PARAMS,
                             optimizer: torch.optim.Optimizer | None = None,
                             step_context: StepContext = contextlib.nullcontext,
                             repeats: int = 3, choices: ChoiceOptions | None = None,
                             gather_dtype: torch.dtype | None = None) -> ModelProfile:
    """Profile a LightningModule's real training computation on ``batch``.

    Runs ``training_step(batch, 0)`` plus backward; with ``batch=None`` runs
    ``forward(example_input_array)`` and backpropagates the sum of its output.
    Then what the choices ``choices`` offers (default ``ChoiceOptions()``) need measured on it
    (:func:`measure_choice_overheads`: which units can be checkpointed, what splitting each Linear
    costs). ``gather_dtype``: also run it once as FSDP2 runs units that gather in that dtype
    (``bf16-mixed``), for what they save (:func:`with_sharded_activations`).
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
        if gather_dtype is not None:
            units = with_sharded_activations(module, specs, units, run_loss, gather_dtype)
    dtype = next(p for p in module.parameters() if p.requires_grad).dtype
    elem = torch.empty((), dtype=dtype).element_size()
    inputs = batch if batch is not None else getattr(module, "example_input_array", None)
    profile = ModelProfile(
        units=tuple(units), micro_batch_size=micro_batch_size or batch_size_of(inputs),
        param_bytes_per_element=elem, grad_bytes_per_element=elem, compute_bytes_per_element=elem,
        reduce_bytes_per_element=elem,
        optimizer_bytes_per_param=optimizer_state_bytes_per_param(optimizer, dtype) if optimizer else 0,
        optimizer_step_bytes=optimizer_step_bytes(optimizer, device) if optimizer else 0,
        activation_bytes=activation_bytes, fixed_bytes=tensor_bytes(inputs), step_s=step_s)
    profile = measure_choice_overheads(module, batch, profile, choices or ChoiceOptions(), step_context)
    return dataclasses.replace(profile, profile_s=time.perf_counter() - start)


def with_sharded_activations(root: nn.Module, specs: Sequence[UnitSpec], units: Sequence[UnitProfile],
                             run_loss: Callable[[], torch.Tensor], dtype: torch.dtype) -> list[UnitProfile]:
    """``units`` with :attr:`UnitProfile.sharded_activation_bytes` measured in one step with every
    unit gathered in ``dtype`` (:func:`osdp_lightning.profiling.recorder.sharded_saved_bytes`); a block's
    include its parts'."""
    nested = [*specs, *(part for s in specs for part in s.parts)]
    with preserved_state(root):
        saved = sharded_saved_bytes(root, nested, run_loss, dtype)
    totals = {s.name: saved.get(s.name, 0) + sum(saved.get(p.name, 0) for p in s.parts) for s in specs}

    def measured(unit: UnitProfile) -> UnitProfile:
        own = totals.get(unit.name, saved.get(unit.name, 0))
        return dataclasses.replace(unit, sharded_activation_bytes=own, parts=tuple(measured(p) for p in unit.parts))
    return [measured(u) for u in units]


def measure_choice_overheads(module: nn.Module, batch: object | None, profile: ModelProfile, options: ChoiceOptions,
                             step_context: StepContext = contextlib.nullcontext) -> ModelProfile:
    """``profile`` with what each choice family and modifier the options turn on needs measured on
    the model (their ``measure`` hooks: split times each Linear cut into ``k`` slices, ``+ckpt``
    checks which units' recomputation replays their forward)."""
    for hook in (*(f.measure for f in REGISTRY.families.values()), *(m.measure for m in REGISTRY.modifiers.values())):
        profile = hook(module, batch, profile, options, step_context)
    return profile
