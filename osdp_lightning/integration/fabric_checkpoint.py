"""``fabric.save`` / ``fabric.load`` under osdp: the Trainer strategy's checkpoints, from Fabric's state dict.

A Fabric state (``{"model": model, "optimizer": optimizer, "step": 10, ...}``) is written as the
Trainer strategy writes Lightning's checkpoint dict (:mod:`osdp_lightning.state.checkpoint`): the model's
canonical tensors under ``state_dict``, each optimizer's (in the state's order) in
``optimizer_states``, every other entry as it is (``state_dict()`` of an object that has one). So
either strategy loads what the other saved, under any plan or world size:

- a Trainer checkpoint into Fabric: the model and optimizers; its other entries (``epoch``,
  ``global_step``, ``loops``, ...) fill the state's keys of those names, or come back from ``fabric.load``;
- a Fabric checkpoint into the Trainer: the weights (``load_model_weights``,
  ``trainer.strategy.load_model_state_dict``); resuming a Trainer's ``fit`` needs the loop state
  only the Trainer writes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from osdp_lightning.apply.apply import step_groups_apart
from osdp_lightning.integration.lightning_compat import Stateful, validate_keys_for_strict_loading
from osdp_lightning.integration.setup_core import RootWrapper
from osdp_lightning.plan.plan import Plan
from osdp_lightning.state import checkpoint as checkpoint_io

RESERVED = ("state_dict", "optimizer_states", "osdp")
"""Keys the checkpoint itself uses; a Fabric state may not name its entries so."""


def save(path: str | Path, state: dict[str, Any], root: RootWrapper | None, sharded: bool, plan: Plan | None) -> None:
    """Write ``state`` to ``path`` as a Trainer checkpoint; every rank calls it."""
    module = _model_of(state, root)
    full = not sharded
    checkpoint: dict[str, Any] = {"state_dict": None, "optimizer_states": []}
    for key, obj in state.items():
        if key in RESERVED:
            raise ValueError(f"fabric.save: the state key {key!r} is taken by the checkpoint itself ({list(RESERVED)})")
        if isinstance(obj, nn.Module):
            checkpoint["state_dict"] = checkpoint_io.model_state(module, full=full)
        elif isinstance(obj, torch.optim.Optimizer):
            checkpoint["optimizer_states"].append(checkpoint_io.optimizer_state(module, obj, full=full))
        else:
            checkpoint[key] = obj.state_dict() if isinstance(obj, Stateful) else obj
    info = {"plan": {u.name: u.choice for u in plan.units} if plan is not None else None}
    checkpoint_io.save_checkpoint(checkpoint, Path(path), sharded=sharded, info=info)


def load(path: str | Path, state: dict[str, Any] | nn.Module, root: RootWrapper | None, strict: bool,
         weights_only: bool | None) -> dict[str, Any]:
    """Restore ``state``'s model, optimizers and other entries from ``path`` (either strategy's
    checkpoint, or for a bare model a file of its whole state dict); returns what the state did not ask for."""
    if isinstance(state, torch.optim.Optimizer):
        raise NotImplementedError("loading a single optimizer is not supported by the osdp strategy: "
                                  "`fabric.load(path, {'model': model, 'optimizer': optimizer})`")
    if isinstance(state, nn.Module):  # fabric.load_raw(path, model): a plain state dict of whole tensors
        module = _model_of({"model": state}, root)
        raw = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only is not False)
        checkpoint_io.load_full_model_state(module, raw, strict)
        return {}
    module = _model_of(state, root)
    optimizers = [obj for obj in state.values() if isinstance(obj, torch.optim.Optimizer)]
    rest = checkpoint_io.load_checkpoint(Path(path), module, optimizers, strict=strict, weights_only=weights_only)
    step_groups_apart(optimizers)  # NOTE: loading restores the groups' saved foreach / fused flags
    rest.pop("osdp", None)
    wanted = [key for key, obj in state.items() if not isinstance(obj, (nn.Module, torch.optim.Optimizer))]
    validate_keys_for_strict_loading(wanted, rest.keys(), strict=strict)
    for key in wanted:
        if key not in rest:
            continue
        value = rest.pop(key)
        if isinstance(state[key], Stateful):
            state[key].load_state_dict(value)
        else:
            state[key] = value
    return rest


def _model_of(state: dict[str, Any], root: RootWrapper | None) -> nn.Module:
    """The model inside ``root`` (what the checkpoint's keys name), checked to be the one ``state`` holds."""
    modules = [obj for obj in state.values() if isinstance(obj, nn.Module)]
    if root is None or len(modules) != 1 or not any(m is root or m is root.module for m in modules):
        raise ValueError("the osdp strategy saves and loads the one model it set up: pass it once in the state, "
                         "`{'model': model, 'optimizer': optimizer, ...}` with the model `fabric.setup` returned")
    return root.module
