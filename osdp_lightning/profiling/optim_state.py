"""What the model's optimizer is and what state it keeps per parameter, found by asking it rather
than from a table of known classes."""

from __future__ import annotations

import inspect
import math
import warnings
from typing import Any

import torch
from torch import nn

from osdp_lightning.profiling.fakestep import peak_new_bytes

PROBE_BYTES = 2**22
"""Bytes of stand-in parameters :func:`optimizer_step_bytes` steps over (the model's, scaled down)."""
MIN_PROBE_SCALE = 8
"""The stand-ins are at most this much smaller than the parameters: with their gradients, the state
and the step's temporaries (about seven of them) the probe stays below the parameters' own bytes,
inside the memory setup may use."""


def configured_optimizer(module: nn.Module) -> torch.optim.Optimizer | None:
    """The (first) optimizer ``module.configure_optimizers()`` builds, in any of the forms Lightning
    accepts (an optimizer, a dict, lists or tuples of them); ``None`` when there is none."""
    if not hasattr(module, "configure_optimizers"):
        return None
    return _first_optimizer(module.configure_optimizers())


def _first_optimizer(configured: object) -> torch.optim.Optimizer | None:
    if isinstance(configured, torch.optim.Optimizer) or configured is None:
        return configured
    if isinstance(configured, dict):
        return _first_optimizer(configured.get("optimizer"))
    if isinstance(configured, (list, tuple)) and configured:
        return _first_optimizer(configured[0])
    return None


def clone_optimizer(optimizer: torch.optim.Optimizer, params: list[nn.Parameter] | list[dict[str, Any]],
                    **overrides: Any) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class and settings over ``params`` (tensors or groups), with
    the ``overrides`` its class accepts."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    settings = {k: v for k, v in {**optimizer.defaults, **overrides}.items() if k in accepted and k != "params"}
    return type(optimizer)(params, **settings)


def optimizer_state_bytes_per_param(optimizer: torch.optim.Optimizer, dtype: torch.dtype) -> int:
    """Bytes of optimizer state per parameter, found by stepping a same-configured optimizer.

    Works for any ``torch.optim`` optimizer (Adam: 2 states, SGD with momentum: 1, plain SGD: 0)
    without a table of known classes.
    """
    probe = nn.Parameter(torch.zeros(4096, dtype=dtype))
    probe.grad = torch.full_like(probe, 1e-3)
    clone = clone_optimizer(optimizer, [probe])
    clone.step()
    state = clone.state.get(probe, {})
    return sum(t.numel() * t.element_size() for t in state.values()
               if isinstance(t, torch.Tensor) and t.numel() == probe.numel()) // probe.numel()


def optimizer_step_bytes(optimizer: torch.optim.Optimizer, device: torch.device, foreach: bool | None = None) -> int:
    """Bytes one step of ``optimizer`` allocates beside its parameters, gradients and state (its
    temporaries: torch's per-tensor Adam holds two of one tensor's size beside the previous
    tensor's, the foreach path a share of the whole group), found by stepping a same-configured
    optimizer on ``device`` over stand-ins of its parameter groups, every tensor scaled down by one
    factor (the temporaries scale with it), then scaled back. ``foreach``: the path to price (a dry
    run prices a GPU's default on a CPU); ``None``: the optimizer's default on ``device``. 0 for an
    optimizer whose step needs a closure (L-BFGS), and with a warning for one that cannot step the
    stand-ins."""
    groups = [[p for p in group["params"] if p.requires_grad] for group in optimizer.param_groups]
    params = [p for group in groups for p in group]
    if not params:
        return 0
    scale = max(MIN_PROBE_SCALE, math.ceil(sum(p.numel() * p.element_size() for p in params) / PROBE_BYTES))
    stand_ins = [[torch.zeros(math.ceil(p.numel() / scale), dtype=p.dtype, device=device, requires_grad=True)
                  for p in group] for group in groups]
    # NOTE: each group's own settings too (Adam's weight decay adds a gradient-sized tensor; AdamW's does not)
    path = {} if foreach is None else {"foreach": foreach}
    clone = clone_optimizer(optimizer, [{**group, **path, "params": stand_in}
                                        for group, stand_in in zip(optimizer.param_groups, stand_ins, strict=True)
                                        if stand_in], **path)
    for tensor in (t for group in stand_ins for t in group):
        tensor.grad = torch.full_like(tensor, 1e-3)
    try:
        clone.step()  # NOTE: the first step makes the state; the second allocates only temporaries
    except TypeError:  # a step that needs a closure
        return 0
    except Exception as err:  # noqa: BLE001  (an optimizer that cannot step flat stand-ins: Muon needs matrices)
        warnings.warn(f"the memory model leaves out the {type(optimizer).__name__} step's own bytes: a step over "
                      f"stand-ins of its parameters raised {type(err).__name__}: {err}", stacklevel=2)
        return 0
    kept = [*(t for group in stand_ins for t in group), *(t.grad for group in stand_ins for t in group),
            *(v for state in clone.state.values() for v in state.values() if isinstance(v, torch.Tensor))]
    return scale * peak_new_bytes(clone.step, kept)
