"""What the model's optimizer is and what state it keeps per parameter, found by asking it rather
than from a table of known classes."""

from __future__ import annotations

import inspect

import torch
from torch import nn


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


def clone_optimizer(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class and settings over ``params``."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}
    return type(optimizer)(params, **defaults)


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
