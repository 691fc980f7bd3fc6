"""A ModelProfile estimated from FLOPs and tensor sizes, without running the model for real.

The model is built on fake tensors (``FakeTensorMode``): every tensor has a shape, dtype and
device but no storage, so a 1.5B-parameter model costs no memory and one fake training step
takes seconds. From that step:

- units: :func:`~osdp_lightning.profiling.units.select_units` and ``owned_params``, as in the measured
  profile, so a plan from this profile applies to the real model unchanged;
- activation bytes: as in the measured profile, the larger of the bytes saved for backward and
  the peak of activations plus backward temporaries (sizes are known without data); a second
  fake step at twice the micro-batch separates what grows with it from fixed bytes;
- compute seconds: FLOPs counted per unit by ``torch.utils.flop_counter.FlopCounterMode``,
  forward and backward apart, times seconds per FLOP (a device's peak FLOP/s times
  ``compute_efficiency`` for a dry run; measured on real blocks for a model built on the meta
  device, :mod:`osdp_lightning.plan.unitbench`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from osdp_lightning.profiling.fakestep import (
    MIXED_PRECISION_DTYPES,
    FakeStep,
    ModelSource,
    activation_bytes_of,
    activation_peak,
    build_fake_module,
    doubled_batch,
    fake_batch,
    fake_mode,
    run_fake_step,
    step_runner,
)
from osdp_lightning.profiling.forward_rise import forward_rises
from osdp_lightning.profiling.optim_state import (
    configured_optimizer,
    optimizer_state_bytes_per_param,
    optimizer_step_bytes,
)
from osdp_lightning.profiling.precision import sharded_precision, with_precision
from osdp_lightning.profiling.profile import assemble_unit, batch_size_of, logging_disabled, tensor_bytes
from osdp_lightning.profiling.recorder import sharded_saved_bytes
from osdp_lightning.profiling.records import ModelProfile, UnitProfile, with_measured_parts
from osdp_lightning.profiling.units import DEFAULT_MIN_UNIT_PARAMS, ROOT, UnitSpec, owned_params, select_units
from osdp_lightning.runtime.guards import preserved_rng

DEFAULT_COMPUTE_EFFICIENCY = 0.4
"""Share of the device's peak FLOP/s a training step achieves on the FLOPs FlopCounterMode
counts (matmuls and attention). 0.4 is a typical model-FLOPs utilisation of transformer training
with FSDP on A100/H100; it also absorbs the uncounted memory-bound ops (norms, softmax, GELU)."""


# ---------------------------------------------------------------------------------------------
# The profile
# ---------------------------------------------------------------------------------------------
def estimate_profile(model: ModelSource, batch: object, *, peak_flops_per_s: float,
                     compute_efficiency: float = DEFAULT_COMPUTE_EFFICIENCY, precision: str = "32-true",
                     optimizer_bytes_per_param: int | None = None,
                     unit_module_types: Sequence[str | type] | None = None,
                     unit_name_patterns: Sequence[str] | None = None,
                     min_unit_params: int = DEFAULT_MIN_UNIT_PARAMS,
                     with_parts: bool = False,
                     optimizer_device: torch.device | None = None, optimizer_foreach: bool | None = None,
                     reduce_dtype: str = "float32") -> ModelProfile:
    """A :class:`ModelProfile` of ``model`` on ``batch`` without running it for real.

    ``model`` is a module (copied onto fake tensors) or a function that builds one (a
    LightningModule's ``training_step`` is the step, else the sum of ``forward``'s outputs).
    ``batch`` is one real batch or the same structure of meta tensors (shapes and dtypes only).
    Optimizer state bytes come from ``configure_optimizers`` when the module has it, else pass
    ``optimizer_bytes_per_param`` (default: Adam's two states). ``with_parts``: blocks carry their
    parts (as in the measured profile), so that a plan may descend into them. The optimizer step's
    own bytes are measured on ``optimizer_device`` (default: the CPU), by torch's default path there
    or ``optimizer_foreach`` (a GPU's default is the foreach path). Sharded units are priced as
    ``precision`` runs them (``bf16-mixed``: gathered in bf16, reduced in ``reduce_dtype``;
    :mod:`osdp_lightning.profiling.precision`).
    """
    start = time.perf_counter()
    if peak_flops_per_s <= 0 or not 0 < compute_efficiency <= 1:
        raise ValueError(f"need peak_flops_per_s > 0 and 0 < compute_efficiency <= 1, got "
                         f"{peak_flops_per_s} and {compute_efficiency}")
    if precision != "32-true" and precision not in MIXED_PRECISION_DTYPES:
        raise ValueError(f"precision {precision!r}: dry runs support '32-true' and {list(MIXED_PRECISION_DTYPES)}")
    sharded = sharded_precision(precision, reduce_dtype)  # raises for what the strategy refuses (16-mixed)
    mode = fake_mode()
    module = build_fake_module(model, mode)
    trainable = [p for p in module.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError(f"{type(module).__name__} has no trainable parameters: there is nothing to shard")
    inputs = fake_batch(batch, mode)
    specs = select_units(module, unit_module_types, unit_name_patterns, min_unit_params)
    micro_batch = batch_size_of(batch)
    with mode:
        run_loss = step_runner(module, inputs, precision)
        step = run_fake_step(module, [*specs, *(p for s in specs for p in s.parts)] if with_parts else specs,
                             run_loss)
        module.zero_grad(set_to_none=True)
        peak, rises = activation_peak(module, run_loss, [*specs, *(part for s in specs for part in s.parts)])
        single = max(sum(step.saved_bytes.values()), peak)
        doubled = activation_bytes_of(module, specs, step_runner(module, doubled_batch(inputs, micro_batch), precision))
        nested = [*specs, *(part for s in specs for part in s.parts)] if with_parts else specs
        gathered = (sharded_saved_bytes(module, nested, run_loss, sharded.gather_dtype)
                    if sharded.gather_dtype is not None else None)
        with preserved_rng(), logging_disabled(module):
            forward = forward_rises(module, [*specs, *(part for s in specs for part in s.parts)], run_loss)
    # NOTE: the cost model scales activations with the micro-batch. Bytes that do not grow with it
    # (position embeddings) are fixed bytes instead; autocast's low-precision copies of parameters
    # do not grow either, but they are the units' (``cast_param_bytes``, which the cost model does
    # not scale) and backward frees them before the optimizer step.
    per_batch_bytes = min(max(doubled - single, 0), single)
    copies = min(sum(step.cast_bytes.values()), single - per_batch_bytes)
    seconds_per_flop = 1.0 / (peak_flops_per_s * compute_efficiency)
    elem = trainable[0].element_size()
    units = _unit_profiles(module, specs, step, seconds_per_flop, elem, rises, with_parts, gathered, forward)
    optimizer = configured_optimizer(module)
    if optimizer_bytes_per_param is None:  # NOTE: without an optimizer, Adam's two states
        optimizer_bytes_per_param = (optimizer_state_bytes_per_param(optimizer, trainable[0].dtype)
                                     if optimizer is not None else 2 * elem)
    step_bytes = 0 if optimizer is None else optimizer_step_bytes(
        optimizer, optimizer_device or torch.device("cpu"), optimizer_foreach)
    return with_precision(ModelProfile(
        units=units, micro_batch_size=micro_batch, param_bytes_per_element=elem,
        grad_bytes_per_element=elem, compute_bytes_per_element=elem, reduce_bytes_per_element=elem,
        optimizer_bytes_per_param=optimizer_bytes_per_param, activation_bytes=per_batch_bytes + copies,
        fixed_bytes=tensor_bytes(batch) + single - per_batch_bytes - copies,
        step_s=(sum(step.forward_flops.values()) + sum(step.backward_flops.values())) * seconds_per_flop,
        profile_s=time.perf_counter() - start, optimizer_step_bytes=step_bytes, seconds_per_flop=seconds_per_flop),
        sharded)


def _unit_profiles(module: nn.Module, specs: Sequence[UnitSpec], step: FakeStep, seconds_per_flop: float,
                   elem: int, rises: dict[str, int], with_parts: bool,
                   gathered: dict[str, int] | None = None, forward: dict[str, int] | None = None,
                   ) -> tuple[UnitProfile, ...]:
    """Units in execution order (never-called units go to the root, as in the measured profile);
    ``with_parts``: each block with its parts, as the measured profile has them; ``gathered``: the
    bytes each unit saved with every unit run as FSDP2 gathering in bf16 (``None``: not measured)."""
    by_name = {s.name: s for s in specs}
    called = [by_name[name] for name in step.order if name in by_name]
    parts = {s.name: [p for p in s.parts if p.name in step.order] if with_parts else [] for s in called}
    owned = owned_params(module, [*called, *(p for s in called for p in parts[s.name])])

    def unit(spec: UnitSpec) -> UnitProfile:
        flops = (step.forward_flops.get(spec.name, 0), step.backward_flops.get(spec.name, 0))
        if spec.name == ROOT:  # FLOPs and bytes of units that never ran belong to the root
            flops = (flops[0] + sum(f for n, f in step.forward_flops.items() if n not in owned),
                     flops[1] + sum(f for n, f in step.backward_flops.items() if n not in owned))
        saved, cast = (_own_bytes(by_unit, spec.name, owned) for by_unit in (step.saved_bytes, step.cast_bytes))
        return assemble_unit(
            module, spec.name, spec.module_names, owned[spec.name],
            forward_s=flops[0] * seconds_per_flop, backward_s=flops[1] * seconds_per_flop,
            activation_bytes=saved, input_bytes=step.input_bytes.get(spec.name, 0),
            output_bytes=step.output_numel.get(spec.name, 0) * elem,
            interleaved=spec.name in step.interleaved, forward_rise_bytes=(forward or {}).get(spec.name),
            backward_rise_bytes=rises.get(spec.name),
            tail_activation_bytes=step.root_tail_bytes if spec.name == ROOT else 0, cast_param_bytes=cast,
            sharded_activation_bytes=None if gathered is None else _own_bytes(gathered, spec.name, owned))
    blocks = [with_measured_parts(unit(s), [unit(p) for p in parts[s.name]], step.order) for s in called]
    return (*blocks, unit(UnitSpec(ROOT, (ROOT,))))


def _own_bytes(by_unit: dict[str, int], name: str, owned: Mapping[str, object]) -> int:
    """A unit's bytes of ``by_unit``; the root's with those of units that never ran."""
    own = by_unit.get(name, 0)
    return own + sum(b for n, b in by_unit.items() if n not in owned) if name == ROOT else own
