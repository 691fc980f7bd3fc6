"""What the Fabric strategy takes from the user to plan, and the optimizer it fixes up afterwards.

Fabric has no dataloader and no ``training_step`` at ``fabric.setup``: the user's loop computes the
loss. osdp's profiling runs a LightningModule's ``training_step(batch, 0)`` and prices the optimizer
``configure_optimizers()`` returns, so while the Fabric strategy plans, :func:`as_lightning_step`
gives the module these two (as methods bound to it, so the copies profiling makes of it call their
own), from:

- the batch: the strategy's ``example_batch``, else the module's ``example_input_array``;
- the step: the strategy's ``loss_fn(module, batch) -> loss``; else the module's own
  ``training_step(batch, 0)`` when it has one and the batch is ``example_batch``; else the sum of
  the module's outputs on the batch (a tuple is passed as positional arguments);
- the optimizer: the one given to ``fabric.setup(model, optimizer)``; else the module's own
  ``configure_optimizers()``; else AdamW with torch's defaults (two states per parameter).

Applying the plan replaces parameters (FSDP2's DTensors, a split Linear's slices, a meta-built
model's storage); :func:`rebind_optimizer` points an optimizer built before at the new ones, by name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import MethodType
from typing import Any

import torch
from torch import nn

from osdp_lightning.profiling.profile import tensors_in
from osdp_lightning.runtime.split import SplitLinear

LossFn = Callable[[nn.Module, Any], torch.Tensor]
"""``loss_fn(module, batch) -> loss``: one training step's loss, as the training loop computes it."""


def example_batch_of(module: nn.Module, example_batch: Any) -> Any:
    """The batch profiling runs on; raises, saying how to give one, when there is none."""
    batch = example_batch if example_batch is not None else getattr(module, "example_input_array", None)
    if batch is None:
        raise ValueError(
            "the osdp strategy profiles the model at `fabric.setup()` and needs one example batch of the size "
            "training uses: `Fabric(strategy=OSDPFabricStrategy(example_batch=batch, loss_fn=loss_fn))`, or "
            "`fabric.strategy.example_batch = batch` before `fabric.setup()`, or an `example_input_array` "
            f"attribute on {type(module).__name__} (or pass plan=... to skip profiling)")
    return batch


def default_optimizer(module: nn.Module) -> torch.optim.Optimizer:
    """What a plan prices when the user gives no optimizer: AdamW with torch's defaults."""
    return torch.optim.AdamW([p for p in module.parameters() if p.requires_grad])


@contextlib.contextmanager
def as_lightning_step(module: nn.Module, optimizer: torch.optim.Optimizer | None, loss_fn: LossFn | None,
                      batch_is_example: bool) -> Iterator[None]:
    """Within the block, ``module.training_step`` and ``module.configure_optimizers`` are the step and
    the optimizer of the module docstring; afterwards the module is as it was."""
    bound: dict[str, Any] = {}
    if loss_fn is not None:
        bound["training_step"] = MethodType(lambda self, batch, _index: loss_fn(self, batch), module)
    elif not (batch_is_example and callable(getattr(module, "training_step", None))):
        bound["training_step"] = MethodType(_summed_outputs, module)
    if optimizer is not None:
        bound["configure_optimizers"] = MethodType(lambda _self: optimizer, module)
    hidden = {name: module.__dict__[name] for name in bound if name in module.__dict__}
    module.__dict__.update(bound)
    try:
        yield
    finally:
        for name in bound:
            del module.__dict__[name]
        module.__dict__.update(hidden)


def _summed_outputs(module: nn.Module, batch: Any, _index: int) -> torch.Tensor:
    """A stand-in loss: the sum of every output tensor (what profiling backpropagates without one)."""
    out = module(*batch) if isinstance(batch, tuple) else module(batch)
    return sum(t.float().sum() for t in tensors_in(out))  # type: ignore[return-value]




def parameter_names(module: nn.Module) -> dict[int, str]:
    """Each parameter's name in ``module`` by identity (a tied one: its first name)."""
    names: dict[int, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    return names


def rebind_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str], module: nn.Module) -> None:
    """Point ``optimizer``'s groups (built over ``module``'s parameters, whose names ``names`` holds)
    at ``module``'s parameters now; a split Linear's ``weight`` becomes its slices. The groups keep
    their settings, so schedulers built on the optimizer keep working."""
    if optimizer.state:
        raise ValueError(f"the {type(optimizer).__name__} given to `fabric.setup` has stepped already; osdp "
                         "replaces the model's parameters when it applies the plan: set the optimizer up "
                         "before its first step")
    current = dict(module.named_parameters())
    split_weights = {f"{name}.weight" if name else "weight": (f"{name}." if name else "", layer)
                     for name, layer in module.named_modules() if isinstance(layer, SplitLinear)}
    for group in optimizer.param_groups:
        params: list[nn.Parameter] = []
        for param in group["params"]:
            name = names.get(id(param))
            if name in current:
                params.append(current[name])
            elif name in split_weights:
                prefix, layer = split_weights[name]
                params.extend(current[key] for key in layer.slice_keys(prefix))
            else:
                raise ValueError(f"the {type(optimizer).__name__} given to `fabric.setup` holds a parameter that is "
                                 f"not one of the model's ({name or 'unnamed'}): osdp cannot rebind it")
        group["params"] = params
