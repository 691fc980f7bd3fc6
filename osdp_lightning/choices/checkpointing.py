"""``<choice>+ckpt``: activation checkpointing of a unit, combined with any sharding choice.

A checkpointed unit keeps only its input from forward to backward; its backward first runs its
forward again (torch's non-reentrant checkpointing, which restores the RNG state, so dropout
draws the same numbers) and holds the recomputed activations while its backward runs.

Recomputation must replay the forward: the same operations on the same inputs. A Hugging Face
layer (``GradientCheckpointingLayer``: ``T5Block``, ``GPT2Block``, ``BertLayer``, ...) is
checkpointed through its own switch, which drops the key/value cache its forward would write
(T5's decoder fills one even in training); any other unit goes through torch's composable
``checkpoint``. Profiling runs one checkpointed step (the modifier's ``measure`` hook,
:func:`record_refusals`) and a unit whose recomputation still differs gets no ``+ckpt`` choice
(``UnitProfile.checkpoint_refusal`` says why).

Cost, from the cost of the same choice without checkpointing (per rank, at the table's batch):

- ``activation_bytes``: the unit's input bytes instead of the bytes it saves for backward;
- ``transient_bytes``: plus the bytes it saves for backward, recomputed (alive during its own
  backward only, not a neighbour's, so ``prefetch_bytes`` stays that of the sharding choice);
- ``compute_s``: plus its forward seconds (the recompute).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from osdp_lightning.choices.base import Choice, ChoiceModifier, ChoiceOptions, MemoryMiss, StepContext
from osdp_lightning.cost.cost import ChoiceCost, CostContext
from osdp_lightning.profiling.profile import logging_disabled, loss_runner
from osdp_lightning.profiling.records import ModelProfile, UnitProfile
from osdp_lightning.profiling.units import ROOT
from osdp_lightning.runtime.guards import preserved_state

NAME = "ckpt"
MODES = ("auto", "never", "always")
"""``activation_checkpointing`` option: the ILP decides per unit / no unit / every unit that can."""


def cost(base: ChoiceCost, unit: UnitProfile, choice: Choice, ctx: CostContext) -> ChoiceCost:
    # NOTE: an upper bound: the recomputed activations are all counted next to the unit's gathered
    # parameters and gradients. FSDPMemTracker sees them together (weight gradients appear before
    # the recompute is freed); taking the larger of the two moments instead under-predicted by 7%.
    return dataclasses.replace(
        base, choice=str(choice), activation_bytes=int(unit.input_bytes * ctx.batch_scale),
        transient_bytes=base.transient_bytes + base.activation_bytes, prefetch_bytes=base.prefetch,
        compute_s=base.compute_s + unit.forward_s * ctx.batch_scale)


def allowed(unit: UnitProfile, _choice: Choice, _ctx: CostContext) -> bool:
    """Any unit but the root (it runs the whole step) whose input bytes were recorded and whose
    recomputation replayed its forward when profiled."""
    return unit.name != ROOT and unit.input_bytes > 0 and not unit.checkpoint_refusal


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
    A Hugging Face layer checkpoints its forward inside its call, so FSDP2's hooks run outside
    the recompute; its pre-backward hook has gathered the parameters by then.
    """
    for name in module_names:
        checkpoint_module(model.get_submodule(name))


def checkpoint_module(module: nn.Module) -> None:
    """Recompute ``module``'s activations in backward: a Hugging Face layer through its own switch,
    any other module with torch's composable ``checkpoint`` (hooks; the module stays as it is)."""
    if is_hugging_face_layer(module):
        _enable_hugging_face_checkpointing(module, _checkpoint_fn())
        return
    from torch.distributed._composable import checkpoint

    checkpoint(module)


def is_hugging_face_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers`` ``GradientCheckpointingLayer`` (without importing
    ``transformers``: a model built from it has loaded the module that defines the class)."""
    layers = sys.modules.get("transformers.modeling_layers")
    layer_class = getattr(layers, "GradientCheckpointingLayer", None)
    return layer_class is not None and isinstance(module, layer_class)


def _checkpoint_fn(context_fn: Callable[[], tuple] | None = None) -> Callable[..., object]:
    """Torch's non-reentrant checkpoint (what the composable ``checkpoint`` runs), with the RNG
    restored for the recompute."""
    extra = {"context_fn": context_fn} if context_fn is not None else {}
    return functools.partial(torch_checkpoint, use_reentrant=False, preserve_rng_state=True, **extra)


def _enable_hugging_face_checkpointing(module: nn.Module, checkpoint_fn: Callable[..., object]) -> None:
    # NOTE: what PreTrainedModel.gradient_checkpointing_enable() sets on each layer. The layer then
    # checkpoints its own forward in training, with the cache arguments it writes set to None
    # (T5's decoder writes its cross-attention keys once and reads them back: the recompute would
    # skip two projections, 48 saved tensors against 52, and fail in backward).
    module.gradient_checkpointing = True
    module._gradient_checkpointing_func = checkpoint_fn


# ---------------------------------------------------------------------------------------------
# Checking at profiling time that recomputation replays
# ---------------------------------------------------------------------------------------------
def record_refusals(module: nn.Module, batch: object | None, profile: ModelProfile, options: ChoiceOptions,
                    step_context: StepContext) -> ModelProfile:
    """``profile`` with :attr:`UnitProfile.checkpoint_refusal` set on each unit (or part) whose
    checkpointed step fails (:func:`find_unreplayable`: one step with every unit checkpointed, one
    with every part, one more per unit refused); as it is where ``+ckpt`` is never offered."""
    if options.activation_checkpointing == "never":
        return profile

    def candidates(group: Iterable[UnitProfile]) -> dict[str, tuple[str, ...]]:
        return {u.name: u.module_names for u in group if u.name != ROOT and u.input_bytes > 0}

    run_loss = loss_runner(module, batch, step_context)
    with preserved_state(module), logging_disabled(module):
        refused = find_unreplayable(
            module, (candidates(profile.units), candidates(p for u in profile.units for p in u.parts)), run_loss)

    def with_refusal(unit: UnitProfile) -> UnitProfile:
        return dataclasses.replace(unit, checkpoint_refusal=refused.get(unit.name, ""),
                                   parts=tuple(with_refusal(p) for p in unit.parts))
    return dataclasses.replace(profile, units=tuple(with_refusal(u) for u in profile.units))


def find_unreplayable(root: nn.Module, groups: Sequence[Mapping[str, tuple[str, ...]]],
                      run_loss: Callable[[], torch.Tensor]) -> dict[str, str]:
    """Units (name: the error) whose checkpointed forward and backward fail, checkpointed the way
    :func:`checkpoint_module` does. Each group's units are checkpointed together (a block's parts go
    in a group after the blocks'): one step per group, plus one per unit that fails. Leaves the
    gradients empty; the caller restores anything else the steps change."""
    refused: dict[str, str] = {}
    for group in groups:
        refused.update(_group_refusals(root, group, run_loss))
    return refused


def _group_refusals(root: nn.Module, units: Mapping[str, tuple[str, ...]],
                    run_loss: Callable[[], torch.Tensor]) -> dict[str, str]:
    refused: dict[str, str] = {}
    while trying := {name: modules for name, modules in units.items() if name not in refused}:
        recomputing: list[str] = []
        try:
            with contextlib.ExitStack() as stack:
                for name, module_names in trying.items():
                    for module_name in module_names:
                        stack.enter_context(_checkpointed(root.get_submodule(module_name), name, recomputing))
                run_loss().backward()
        except Exception as err:  # any failure of a checkpointed step refuses the unit it happened in
            # NOTE: torch raises right after the recompute that went wrong, before any other starts;
            # an error before any recompute (in forward) has no unit to blame: all of them are refused.
            for name in recomputing[-1:] or trying:
                refused[name] = _first_lines(err)
        else:
            break
        finally:
            root.zero_grad(set_to_none=True)
    return refused


@contextlib.contextmanager
def _checkpointed(module: nn.Module, name: str, recomputing: list[str]) -> Iterator[None]:
    """``module`` checkpointed for the block (undone after it), noting ``name`` in ``recomputing``
    when its recompute starts."""
    def context_fn() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        return contextlib.nullcontext(), _noting(recomputing, name)

    checkpoint_fn = _checkpoint_fn(context_fn)
    keys = ("gradient_checkpointing", "_gradient_checkpointing_func", "forward")
    before = {key: module.__dict__[key] for key in keys if key in module.__dict__}
    if is_hugging_face_layer(module):
        _enable_hugging_face_checkpointing(module, checkpoint_fn)
    else:
        # NOTE: composable checkpoint cannot be undone; it runs the same non-reentrant checkpoint
        # around the module's call, so wrapping its forward tells the same.
        module.forward = functools.partial(checkpoint_fn, module.forward)
    try:
        yield
    finally:
        for key in keys:
            module.__dict__.pop(key, None)
        module.__dict__.update(before)


@contextlib.contextmanager
def _noting(names: list[str], name: str) -> Iterator[None]:
    names.append(name)
    yield


def _first_lines(err: Exception, lines: int = 3) -> str:
    text = " ".join(line.strip() for line in str(err).splitlines()[:lines] if line.strip())
    return f"{type(err).__name__}: {text}"


def refusal_message(units: Sequence[UnitProfile]) -> str | None:
    """What to tell the user before training about units (and parts) that cannot be checkpointed;
    ``None`` when there are none."""
    refused = [u for unit in units for u in (unit, *unit.parts) if u.checkpoint_refusal]
    if not refused:
        return None
    return ("osdp: these units cannot be checkpointed (+ckpt): recomputing them in backward did not "
            "replay their forward (the forward changes something it reads, e.g. a cache passed in as an "
            "argument); they keep their choices without +ckpt:\n"
            + "\n".join(f"  {u.name}: {u.checkpoint_refusal}" for u in refused))


MEMORY_MISS = MemoryMiss(
    under_share=0.019, spread_share=0.0,
    basis="a Hugging Face BERT with zero2+ckpt and zero3+ckpt layers 1.9% under (its checkpointed layers' "
          "backward), uniform zero3+ckpt on the GPT 4 x 384 1.1% under; every plan's peak the same in each launch")
"""``./dev bench hf_models`` and ``./dev bench peak_spread``, 2 gloo ranks on 2 cores: the largest miss
under any measured peak (:data:`~osdp_lightning.cost.budget.LARGEST_MEASURED_MISS`) is this kind's."""

MODIFIER = ChoiceModifier(name=NAME, cost=cost, apply=apply, space=space, allowed=allowed,
                          measure=record_refusals, memory_miss=MEMORY_MISS)
