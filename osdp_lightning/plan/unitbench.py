"""The profile of a model that is never whole on one device: shapes from a fake step, time from
one real instance of each distinct unit.

A model built on the meta device (``trainer.init_module(empty_init=True)``), or one whose whole
profile would not fit the memory budget, is planned without materializing it:

- bytes (parameters, activations, inputs, backward rises) and the execution order come from one
  fake training step (:func:`osdp_lightning.profiling.estimate.estimate_profile`), as for a dry run;
- the inputs each unit's forward receives are recorded on the fake step (shapes, dtypes, whether
  they need a gradient, and any non-tensor arguments);
- units that share a layout (module classes, parameter and buffer shapes) and the same recorded
  inputs cost the same: one copy of each kind is materialized alone on the device, fed random
  inputs of the recorded shapes, and profiled for real (forward, backward, its parts, the
  overhead of splitting its Linear layers, whether it can be checkpointed), then freed;
- what no such measurement covers (the root: embeddings, the head and the loss; tied units)
  is priced by its FLOPs times the seconds per FLOP the measured units achieved.

The blocks of a transformer are one kind: a 48-block model measures one block. A unit whose
time depends on more than its layout and inputs (a layer index kept in a plain attribute that
changes its forward) is priced as the one instance measured.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from itertools import chain

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from osdp_lightning.choices import ChoiceOptions
from osdp_lightning.choices.base import measurement_session
from osdp_lightning.plan.measure import measure_choice_overheads
from osdp_lightning.profiling.estimate import estimate_profile
from osdp_lightning.profiling.fakestep import (
    build_fake_module,
    build_meta_module,
    fake_batch,
    fake_mode,
    fake_step_errors,
    flat_tensors,
    release_fake_machinery,
    step_runner,
)
from osdp_lightning.profiling.hf_init import hugging_face_owner
from osdp_lightning.profiling.materialize import initialise_post_order
from osdp_lightning.profiling.profile import logging_disabled, loss_runner, measure_units
from osdp_lightning.profiling.records import ModelProfile, UnitProfile
from osdp_lightning.profiling.units import DEFAULT_MIN_UNIT_PARAMS, UnitSpec, select_units
from osdp_lightning.runtime.guards import preserved_rng

BENCH_NAME = "unit"
"""The measured copy's name inside its bench module."""


class UnitMeasureError(ValueError):
    """A unit that cannot run apart from the model it was built in."""


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """One tensor argument of a unit's forward, as recorded on the fake step."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


def profile_from_shapes(module: nn.Module, batch: object, device: torch.device, *, precision: str = "32-true",
                        step_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                        unit_module_types: Sequence[str | type] | None = None,
                        unit_name_patterns: Sequence[str] | None = None,
                        min_unit_params: int = DEFAULT_MIN_UNIT_PARAMS, choices: ChoiceOptions | None = None,
                        repeats: int = 3) -> ModelProfile:
    """A :class:`ModelProfile` of ``module`` (on the meta device or not; never copied whole onto
    ``device``) for training on ``batch``; see the module docstring."""
    start = time.perf_counter()
    template = build_meta_module(module)
    specs = {s.name: s for s in select_units(template, unit_module_types, unit_name_patterns, min_unit_params)}
    with fake_step_errors():
        # NOTE: one second per FLOP: the estimate's times are its FLOP counts, priced below.
        counted = estimate_profile(template, batch, peak_flops_per_s=1.0, compute_efficiency=1.0, precision=precision,
                                   unit_module_types=unit_module_types, unit_name_patterns=unit_name_patterns,
                                   min_unit_params=min_unit_params, with_parts=True,
                                   optimizer_device=device)
        calls = record_unit_calls(template, batch, list(specs.values()), precision)
    measured: dict[str, UnitProfile] = {}
    kinds: dict[str, UnitProfile | UnitMeasureError] = {}
    with measurement_session():  # NOTE: kinds of unit share their Linear layers' split timings
        for unit in counted.units:
            if unit.name not in calls:
                continue  # the root, tied units (several modules), units never called
            kind = _kind(template, specs[unit.name], calls[unit.name])
            if kind not in kinds:
                try:
                    kinds[kind] = measure_unit(template, specs[unit.name], calls[unit.name], device,
                                               step_context=step_context, choices=choices, repeats=repeats)
                except UnitMeasureError as err:
                    kinds[kind] = err
            if isinstance(kinds[kind], UnitProfile):
                measured[unit.name] = kinds[kind]
    unmeasured = {name: kinds[_kind(template, specs[name], call)] for name, call in calls.items()
                  if name not in measured and name in specs}
    release_fake_machinery()
    forward_spf, backward_spf = _seconds_per_flop(counted.units, measured)
    if unmeasured:
        _warn_priced(unmeasured, bool(measured))
    units = tuple(_measured(u, measured[u.name]) if u.name in measured
                  else _priced(u, forward_spf, backward_spf, unmeasured.get(u.name)) for u in counted.units)
    # NOTE: the seconds are measured now (or priced at the measured seconds per FLOP): no unit's
    # split overhead is estimated from FLOPs.
    return dataclasses.replace(counted, units=units, step_s=sum(u.forward_s + u.backward_s for u in units),
                               profile_s=time.perf_counter() - start, seconds_per_flop=0.0)


def record_unit_calls(template: nn.Module, batch: object, specs: Sequence[UnitSpec], precision: str
                      ) -> dict[str, tuple[tuple, dict]]:
    """The first ``(args, kwargs)`` each single-module unit's forward receives in one fake forward,
    tensors as :class:`InputSpec`, as training passes them (:func:`as_trained`)."""
    mode = fake_mode()
    fake = build_fake_module(template, mode)
    inputs = fake_batch(batch, mode)
    calls: dict[str, tuple[tuple, dict]] = {}

    def recorder(name: str) -> Callable:
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            if name not in calls:
                calls[name] = tree_map_only(torch.Tensor, _input_spec, as_trained(args, kwargs))
        return hook

    handles = [fake.get_submodule(s.module_names[0]).register_forward_pre_hook(recorder(s.name), with_kwargs=True)
               for s in specs if len(s.module_names) == 1]
    try:
        with mode, preserved_rng(), logging_disabled(fake):
            step_runner(fake, inputs, precision)()
    finally:
        for handle in handles:
            handle.remove()
    return calls


def as_trained(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A unit's arguments as a training step passes them: a Hugging Face key/value cache replaced by
    ``None`` and ``use_cache=False``, as Hugging Face's own training path with gradient checkpointing
    does (a cache the forward writes into would carry one repeat's keys and values into the next)."""
    def drop(value: object) -> object:
        return None if _is_hugging_face_cache(value) else value
    args = tuple(drop(a) for a in args)
    kwargs = {k: False if k == "use_cache" and v is True else drop(v) for k, v in kwargs.items()}
    return args, kwargs


def _is_hugging_face_cache(value: object) -> bool:
    """A ``transformers`` ``Cache`` (without importing ``transformers``: a model that passes one has
    loaded the module that defines the class)."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    cache_class = getattr(cache_utils, "Cache", None)
    return cache_class is not None and isinstance(value, cache_class)


def _input_spec(t: torch.Tensor) -> InputSpec:
    return InputSpec(tuple(t.shape), t.dtype, t.requires_grad)


def _kind(template: nn.Module, spec: UnitSpec, call: tuple) -> str:
    """Units of one kind cost the same: the same module classes and tensor shapes, the same inputs."""
    unit = template.get_submodule(spec.module_names[0])
    layout = tuple((name, type(m).__qualname__,
                    tuple((n, tuple(t.shape), t.dtype) for n, t in chain(m.named_parameters(recurse=False),
                                                                          m.named_buffers(recurse=False))))
                   for name, m in unit.named_modules())
    return repr((layout, call))


class _UnitBench(nn.Module):
    """One unit alone; its forward feeds the unit the recorded arguments (random tensors)."""

    example_input_array = ()

    def __init__(self, unit: nn.Module, call: tuple[tuple, dict]) -> None:
        super().__init__()
        setattr(self, BENCH_NAME, unit)
        self.call = call

    def forward(self) -> object:
        # NOTE: a fresh copy of every object around the tensors for each repeat: a forward that
        # writes into an argument (a dict of memos, a cache) must not see an earlier repeat's writes.
        args, kwargs = copy.deepcopy(self.call, memo={id(t): t for t in flat_tensors(self.call)})
        return getattr(self, BENCH_NAME)(*args, **kwargs)


def measure_unit(template: nn.Module, spec: UnitSpec, call: tuple[tuple, dict], device: torch.device, *,
                 step_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 choices: ChoiceOptions | None = None, repeats: int = 3) -> UnitProfile:
    """One copy of ``spec``'s module, materialized alone on ``device`` and profiled for real, with
    what ``choices`` need measured on it (:func:`measure_choice_overheads`); the result is named as
    in the bench (:data:`BENCH_NAME`)."""
    prefix = spec.module_names[0]
    with preserved_rng():
        torch.manual_seed(0)
        unit = copy.deepcopy(template.get_submodule(prefix)).to_empty(device=device)
        with torch.no_grad():
            for t in chain(unit.parameters(), unit.buffers()):
                t.normal_(0.0, 0.02) if t.is_floating_point() else t.zero_()
        # NOTE: then its own init where it has one (a Hugging Face block: its model's): with norms'
        # weights at 0.02 the backward's values shrink into subnormal floats, which x86 computes many
        # times slower (blocks measured 20-30% slow).
        initialise_post_order(unit, hugging_face_owner(template, prefix))
        bench = _UnitBench(unit, tree_map_only(InputSpec, lambda s: _random_input(s, device), call))
    run_loss = loss_runner(bench, None, step_context)
    renamed = _renamed(spec, prefix)
    try:
        # NOTE: bytes come from the fake step; only seconds are measured here.
        units, _, _ = measure_units(bench, [renamed], run_loss, device, repeats, activation_peak=False)
        profile = ModelProfile(units=tuple(units), micro_batch_size=1, param_bytes_per_element=4,
                               grad_bytes_per_element=4, compute_bytes_per_element=4, reduce_bytes_per_element=4,
                               optimizer_bytes_per_param=0, activation_bytes=0)
        units = list(measure_choice_overheads(bench, None, profile, choices or ChoiceOptions(), step_context).units)
    except Exception as err:
        raise UnitMeasureError(
            f"osdp cannot measure unit {spec.name!r} ({type(unit).__name__}) apart from the model, which planning a "
            f"model that is not placed whole on one device needs: {type(err).__name__}: {err}. Build the model "
            "eagerly (not on the meta device) with a memory budget that holds its whole profile (about 3x its "
            "weights; under a budget in bytes, its step's gradients and activations twice as well), or choose "
            "units whose forward takes and returns tensors (unit_module_types=... / unit_name_patterns=...)."
        ) from err
    found = [u for u in units if u.name == BENCH_NAME]
    if not found:
        raise UnitMeasureError(f"osdp measured unit {spec.name!r} apart from the model, but its forward never ran")
    return found[0]


def _random_input(spec: InputSpec, device: torch.device) -> torch.Tensor:
    if spec.dtype.is_floating_point:
        return torch.randn(spec.shape, dtype=spec.dtype, device=device).requires_grad_(spec.requires_grad)
    # NOTE: index tensors of zeros are in range of any embedding or gather; masks of ones keep everything.
    return (torch.ones if spec.dtype == torch.bool else torch.zeros)(spec.shape, dtype=spec.dtype, device=device)


def _renamed(spec: UnitSpec, prefix: str) -> UnitSpec:
    def rename(name: str) -> str:
        return BENCH_NAME + name[len(prefix):]
    return UnitSpec(rename(spec.name), tuple(rename(n) for n in spec.module_names),
                    tuple(_renamed(p, prefix) for p in spec.parts))


def _seconds_per_flop(units: Sequence[UnitProfile], measured: dict[str, UnitProfile]) -> tuple[float, float]:
    """Measured seconds over counted FLOPs of the measured units, forward and backward apart."""
    counted = [u for u in units if u.name in measured and u.forward_s > 0 and u.backward_s > 0]
    if not counted:
        return 0.0, 0.0
    forward = sum(measured[u.name].forward_s for u in counted) / sum(u.forward_s for u in counted)
    backward = sum(measured[u.name].backward_s for u in counted) / sum(u.backward_s for u in counted)
    return forward, backward


def _measured(counted: UnitProfile, bench: UnitProfile) -> UnitProfile:
    """``counted`` (bytes from the fake step) with the seconds, split overheads and checkpoint
    refusal of its kind's measured copy."""
    parts = {p.name[len(BENCH_NAME):]: p for p in bench.parts}
    prefix = counted.module_names[0]

    def timed(unit: UnitProfile, source: UnitProfile | None) -> UnitProfile:
        if source is None:
            return unit
        return dataclasses.replace(unit, forward_s=source.forward_s, backward_s=source.backward_s,
                                   split_overhead_s=source.split_overhead_s,
                                   checkpoint_refusal=source.checkpoint_refusal)
    with_parts = tuple(timed(p, parts.get(p.name[len(prefix):])) for p in counted.parts)
    return dataclasses.replace(timed(counted, bench), parts=with_parts)


def _warn_priced(unmeasured: dict[str, UnitMeasureError], any_measured: bool) -> None:
    """Units that could not run apart from the model are priced by their FLOPs; with no unit
    measured there is no price per FLOP, and nothing can price them."""
    first = next(iter(unmeasured.values()))
    if not any_measured:
        raise first
    names = ", ".join(repr(n) for n in list(unmeasured)[:4]) + (" ..." if len(unmeasured) > 4 else "")
    cause = first.__cause__ or first
    warnings.warn(f"osdp could not run {len(unmeasured)} unit(s) apart from the model ({names}: "
                  f"{type(cause).__name__}: {cause}); their seconds are their FLOPs at the seconds per FLOP the "
                  "measured units achieved, and they are not split or checkpointed", stacklevel=3)


def _priced(unit: UnitProfile, forward_spf: float, backward_spf: float,
            unmeasured: UnitMeasureError | None = None) -> UnitProfile:
    """A unit no copy measured (the root, tied units, a unit that cannot run alone): its FLOPs at the
    measured seconds per FLOP; not a split candidate (its overhead was not measured), and a unit that
    could not run alone is not checkpointed (its recomputation could not be checked)."""
    refusal = f"not measured apart from the model ({unmeasured.__cause__ or unmeasured})" if unmeasured else ""
    return dataclasses.replace(
        unit, forward_s=unit.forward_s * forward_spf, backward_s=unit.backward_s * backward_spf,
        split_overhead_s=(), checkpoint_refusal=unit.checkpoint_refusal or refusal,
        parts=tuple(_priced(p, forward_spf, backward_spf, unmeasured) for p in unit.parts))

