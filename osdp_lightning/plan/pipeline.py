"""Profiling for planning: the whole model, or from shapes (:class:`osdp_lightning.plan.planner.Planner` solves).

Two ways to profile a model (both give a :class:`~osdp_lightning.profiling.records.ModelProfile`):

- **whole**: the real training step of the whole model on one device, timed per unit
  (:func:`~osdp_lightning.plan.measure.profile_lightning_module`). It holds about
  :data:`WHOLE_PROFILE_WEIGHT_COPIES` copies of the weights at once (the model, a saved copy of
  its state, its gradients) plus activations;
- **from shapes**: a fake step for every byte, one real copy of each distinct unit for time
  (:func:`~osdp_lightning.plan.unitbench.profile_from_shapes`); the model is never whole on a device.

A model built on the meta device is always profiled from shapes; an eagerly built one is
profiled whole when those copies fit the memory budget, from shapes otherwise. Under a budget that is
a real limit the whole profile must fit it as a fake step measures it
(:func:`whole_profile_peak_bytes`): its activations can outweigh the copies.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import nn

from osdp_lightning.choices import ChoiceOptions, choice_cost
from osdp_lightning.cost.budget import MemoryBudget, format_budget, format_bytes
from osdp_lightning.cost.cluster import ClusterSpec
from osdp_lightning.cost.cost import CostContext
from osdp_lightning.plan.measure import profile_lightning_module
from osdp_lightning.plan.unitbench import profile_from_shapes
from osdp_lightning.profiling.fakestep import MIXED_PRECISION_DTYPES, FakeStepError, step_peak_bytes
from osdp_lightning.profiling.optim_state import configured_optimizer, optimizer_state_bytes_per_param
from osdp_lightning.profiling.precision import sharded_precision, with_precision
from osdp_lightning.profiling.records import ModelProfile, UnitProfile
from osdp_lightning.profiling.units import DEFAULT_MIN_UNIT_PARAMS, ROOT, select_units

WHOLE_PROFILE_WEIGHT_COPIES = 3
"""Copies of the weights the whole-model profile holds at once (model, saved state, gradients)."""

WHOLE_PROFILE_STEP_COPIES = 2
"""How many times :func:`whole_profile_peak_bytes` counts the step's own bytes (gradients,
activations): once as the step holds them, once again for what a process's first real step
allocates beside them and frees (measured on CPU: 13 MiB beside a GPT's 29 MiB and a Phi's 34 MiB
in a plain first step; 24 MiB beside the Phi's in a first whole profile)."""


@dataclasses.dataclass(frozen=True)
class ProfileOptions:
    """How units are chosen and what profiling measures besides the step."""

    unit_module_types: Sequence[str | type] | None = None
    unit_name_patterns: Sequence[str] | None = None
    min_unit_params: int = DEFAULT_MIN_UNIT_PARAMS
    repeats: int = 3
    choices: ChoiceOptions = dataclasses.field(default_factory=ChoiceOptions)
    """The choices the plan may take: profiling measures what they need (``split_factors=()``: no
    split overheads; ``activation_checkpointing="never"``: no checkpointed step)."""
    precision: str = "32-true"
    """Lightning's ``precision`` flag (the fake step of a profile from shapes needs it; sharded units
    are priced as it runs them: :mod:`osdp_lightning.profiling.precision`)."""
    reduce_dtype: str = "float32"
    """Under ``bf16-mixed``, the dtype sharded units reduce their gradients in."""


def weight_bytes(module: nn.Module, names: Sequence[str] = ("",)) -> int:
    """Bytes of the parameters of the named submodules (the whole module by default), tied ones once."""
    params = {id(p): p for name in names for p in module.get_submodule(name).parameters()}
    return sum(p.numel() * p.element_size() for p in params.values())


def budget_floor_bytes(module: nn.Module, budget: MemoryBudget, device_bytes: int, world_size: int) -> int:
    """The budget in bytes, or for a share of a baseline's peak (``"60%ddp"``) the share of what that
    baseline's choice keeps of the whole model (its family's cost: weights, gradients, optimizer
    state and what it holds from forward to backward; no activations), which the budget is at
    least; known before anything is profiled."""
    if not budget.needs_profile:
        return budget.of_device(device_bytes)
    params = {id(p): p for p in module.parameters()}.values()
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        return 0
    optimizer = configured_optimizer(module)
    elem = trainable[0].element_size()
    whole = UnitProfile(name=ROOT, module_names=(ROOT,), param_count=sum(p.numel() for p in trainable),
                        frozen_param_count=sum(p.numel() for p in params if not p.requires_grad),
                        forward_s=0.0, backward_s=0.0, activation_bytes=0)
    profile = ModelProfile(
        units=(whole,), micro_batch_size=1, param_bytes_per_element=elem, grad_bytes_per_element=elem,
        compute_bytes_per_element=elem, reduce_bytes_per_element=elem, activation_bytes=0,
        optimizer_bytes_per_param=optimizer_state_bytes_per_param(optimizer, trainable[0].dtype) if optimizer else 0)
    # NOTE: only bytes are read; the links' figures are placeholders.
    cluster = ClusterSpec(world_size=world_size, memory_budget_bytes=0, collective_latency_s=0.0,
                          bandwidth_bytes_per_s=1.0)
    cost = choice_cost(whole, budget.baseline, CostContext(profile, cluster))
    return int(budget.share * (cost.state_bytes + cost.held_bytes))


def whole_profile_fits(module: nn.Module, budget_bytes: int) -> bool:
    """Whether profiling the whole model on one device stays within ``budget_bytes``."""
    return WHOLE_PROFILE_WEIGHT_COPIES * weight_bytes(module) <= budget_bytes


def whole_profile_peak_bytes(module: nn.Module, batch: object, precision: str = "32-true") -> int:
    """The most the whole profile of ``module`` training on ``batch`` holds at once: the model, a
    saved copy of its state, and the step's own bytes from a fake step, counted
    :data:`WHOLE_PROFILE_STEP_COPIES` times. Raises :class:`FakeStepError` where a fake step cannot
    run the model (the whole profile is then the only one there is)."""
    try:
        step_bytes = step_peak_bytes(module, batch, _fake_step_precision(precision))
    except FakeStepError:
        raise
    except Exception as err:  # NOTE: whatever stops the fake copy's step; the real step then shows it for real
        raise FakeStepError(f"the training step failed on fake tensors: {type(err).__name__}: {err}") from err
    return 2 * weight_bytes(module) + WHOLE_PROFILE_STEP_COPIES * step_bytes


def _fake_step_precision(precision: str) -> str:
    """The precision a fake step of a run at Lightning's ``precision`` takes: the mixed ones (for
    autocast), else ``"32-true"``: under ``"bf16-true"`` and the like the parameters already have
    their dtype."""
    return precision if precision in MIXED_PRECISION_DTYPES else "32-true"


def check_setup_fits(module: nn.Module, options: ProfileOptions, budget_bytes: int) -> None:
    """Raise before anything is placed when the budget cannot hold the profile from shapes itself:
    one whole copy of the largest unit, with its gradients and a saved copy of its state."""
    specs = select_units(module, options.unit_module_types, options.unit_name_patterns, options.min_unit_params)
    sizes = {s.name: weight_bytes(module, s.module_names) for s in specs}
    if not sizes:
        return
    largest = max(sizes, key=sizes.__getitem__)
    need = WHOLE_PROFILE_WEIGHT_COPIES * sizes[largest]
    if need > budget_bytes:
        raise ValueError(
            f"the memory budget ({format_budget(budget_bytes)} per rank) cannot hold even osdp's setup of this model: "
            f"measuring its largest unit {largest!r} ({format_bytes(sizes[largest])} of weights) takes about "
            f"{WHOLE_PROFILE_WEIGHT_COPIES}x that; give at least memory_budget='{format_budget(need)}' (training needs "
            "more), or make the units smaller (unit_module_types=... / unit_name_patterns=...)")


def profile_model(module: nn.Module, batch: object, device: torch.device, options: ProfileOptions, *,
                  whole: bool, optimizer: torch.optim.Optimizer | None = None,
                  step_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
                  ) -> ModelProfile:
    """The profile of ``module`` training on ``batch``: whole on ``device``, or from shapes; priced
    for sharded units that run as ``options.precision`` runs them (``16-mixed``: refused)."""
    sharded = sharded_precision(options.precision, options.reduce_dtype)
    units = dict(unit_module_types=options.unit_module_types, unit_name_patterns=options.unit_name_patterns,
                 min_unit_params=options.min_unit_params)
    if not whole:
        try:
            return with_precision(profile_from_shapes(
                module, batch, device, precision=_fake_step_precision(options.precision), step_context=step_context,
                choices=options.choices, repeats=options.repeats, **units), sharded)
        except FakeStepError as err:
            raise FakeStepError(_cannot_plan_from_shapes(module, err)) from err
    profile = profile_lightning_module(module, batch, optimizer=optimizer, step_context=step_context,
                                       repeats=options.repeats, choices=options.choices,
                                       gather_dtype=sharded.gather_dtype, **units)
    return with_precision(profile, sharded)


def _cannot_plan_from_shapes(module: nn.Module, err: FakeStepError) -> str:
    """What failed, and what would work: the whole profile's budget (an eager build) instead."""
    whole = WHOLE_PROFILE_WEIGHT_COPIES * weight_bytes(module)
    return (f"osdp plans this model from shapes (its whole profile, about {WHOLE_PROFILE_WEIGHT_COPIES}x its "
            f"weights = {format_budget(whole)}, does not fit the budget, or it is built on the meta device), but {err}. "
            f"Build it eagerly with memory_budget='{format_budget(whole)}' or more (osdp then profiles the whole "
            "model for real), or make that operation independent of tensor values (e.g. pass is_causal=True "
            "instead of a mask that is inspected)")
