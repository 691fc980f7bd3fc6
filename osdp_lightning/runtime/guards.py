"""Guards that leave no trace of a measurement: a module's weights, buffers and gradients, and
every random state (torch, CUDA, Python, NumPy), restored when the block ends."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def preserved_state(module: nn.Module) -> Iterator[None]:
    """Restore parameters, buffers, gradients and every RNG after the block."""
    tensors = {k: v.detach().clone() for k, v in module.state_dict(keep_vars=True).items()}
    grads = {id(p): (p.grad.detach().clone() if p.grad is not None else None) for p in module.parameters()}
    with preserved_rng():
        try:
            yield
        finally:
            with torch.no_grad():
                for key, value in module.state_dict(keep_vars=True).items():
                    value.copy_(tensors[key])
            for p in module.parameters():
                p.grad = grads[id(p)]


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Restore the torch, CUDA, Python and NumPy random states after the block."""
    state = _rng_state()
    try:
        yield
    finally:
        _set_rng_state(state)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    with contextlib.suppress(ImportError):
        import numpy as np
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np
        np.random.set_state(state["numpy"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
