"""Canonical state: the keys and shapes of the unwrapped model, whatever the plan.

``get_model_state_dict`` of the LightningModule already names parameters as the user's module
does (FSDP2 keeps module names; split layers merge their slices in their own state-dict hooks).
Optimizer state needs one more step here: a ``SplitLinear``'s per-slice entries become the one
``weight`` entry of the ``nn.Linear`` it replaced, and back when loading into a split layer. The
tensors are DTensor shards, or (``full``) whole CPU tensors on rank 0 for a consolidated file.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from osdp_lightning.runtime.faults import rank
from osdp_lightning.runtime.split import SplitLinear, merge_slice_weights, split_canonical_weight


def _split_layers(module: nn.Module) -> dict[str, SplitLinear]:
    return {f"{name}." if name else "": m for name, m in module.named_modules() if isinstance(m, SplitLinear)}


def model_state(module: nn.Module, full: bool) -> dict[str, Any]:
    """Canonical model state: DTensor shards, or (``full``) whole CPU tensors on rank 0 only."""
    state = get_model_state_dict(module)
    return _to_full(state) if full else state


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, full: bool) -> dict[str, Any]:
    """Canonical optimizer state (keyed by the unwrapped model's parameter names)."""
    never_stepped = not optimizer.state
    state = canonical_optimizer_state(module, get_optimizer_state_dict(module, optimizer))
    if never_stepped:
        # NOTE: get_optimizer_state_dict initialises a fresh optimizer with a zero step (Adam's
        # step count becomes 1); undo that, or saving would change how training continues.
        optimizer.state.clear()
        state = {"state": {}, "param_groups": state["param_groups"]}
    return _to_full(state) if full else state


def canonical_optimizer_state(module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """Merge a ``SplitLinear``'s per-slice optimizer state into its canonical ``weight`` entry."""
    per_param, groups = dict(state["state"]), [dict(g) for g in state["param_groups"]]
    for prefix, layer in _split_layers(module).items():
        keys = layer.slice_keys(prefix)
        if all(k in per_param for k in keys):
            slices = [per_param.pop(k) for k in keys]
            per_param[prefix + "weight"] = {
                field: merge_slice_weights([s[field] for s in slices]) if _is_matrix(value) else value
                for field, value in slices[0].items()}
        for group in groups:
            names = list(group["params"])
            if keys[0] in names:
                at = names.index(keys[0])
                names = [n for n in names if n not in keys]
                # nn.Linear's order: the weight right before the bias (SplitLinear lists its bias first)
                names.insert(names.index(prefix + "bias") if prefix + "bias" in names else at, prefix + "weight")
                group["params"] = names
    return {"state": per_param, "param_groups": groups}


def split_optimizer_state(module: nn.Module, canonical: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`canonical_optimizer_state` for this module's current layout.

    ``current`` is the optimizer's own (non-canonical) state: it gives each slice's layout, and its
    ``params`` lists win (group membership is the running optimizer's, hyperparameters the loaded).
    """
    per_param = dict(canonical["state"])
    for prefix, layer in _split_layers(module).items():
        entry = per_param.pop(prefix + "weight", None)
        keys = layer.slice_keys(prefix)
        if entry is None or not all(k in current["state"] for k in keys):
            continue
        for field, value in entry.items():
            if _is_matrix(value):
                pieces = split_canonical_weight(value, [current["state"][k][field] for k in keys])
            else:
                pieces = [value.clone() if isinstance(value, torch.Tensor) else value for _ in keys]
            for key, piece in zip(keys, pieces, strict=True):
                per_param.setdefault(key, {})[field] = piece
    groups = [{**loaded, "params": mine["params"]}
              for loaded, mine in zip(canonical["param_groups"], current["param_groups"], strict=True)]
    return {"state": per_param, "param_groups": groups}


def _is_matrix(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.ndim == 2


def _to_full(obj: Any) -> Any:
    """Gather DTensors (a collective, same order on every rank); whole CPU copies kept on rank 0."""
    keep = rank() == 0
    if isinstance(obj, dict):
        out = {k: _to_full(v) for k, v in obj.items()}
        return out if keep else {}
    if isinstance(obj, list):
        out_list = [_to_full(v) for v in obj]
        return out_list if keep else []
    if isinstance(obj, DTensor):
        whole = obj.full_tensor()
        return whole.cpu() if keep else None
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu() if keep else None
    return obj


def fill_like(template: Any, source: Any, where: str, strict: bool) -> Any:
    """``source`` (whole tensors) laid out like ``template`` (DTensor shards), without communication."""
    if isinstance(template, dict):
        if not isinstance(source, dict):
            raise ValueError(f"checkpoint entry {where!r} is a {type(source).__name__}, expected a mapping")
        missing = [k for k in template if k not in source]
        unexpected = [k for k in source if k not in template]
        if (missing or unexpected) and strict:
            raise KeyError(f"{where} does not match the model: missing {[f'{where}.{k}' for k in missing[:5]]}, "
                           f"unexpected {[f'{where}.{k}' for k in unexpected[:5]]}; set "
                           "`strict_loading = False` on the LightningModule to load it partially")
        return {k: fill_like(v, source[k], f"{where}.{k}", strict) if k in source else v for k, v in template.items()}
    if isinstance(template, DTensor):
        whole = source.to(dtype=template.dtype)
        return distribute_tensor(whole, template.device_mesh, template.placements, src_data_rank=None)
    if isinstance(template, torch.Tensor) and isinstance(source, torch.Tensor):
        return source.to(dtype=template.dtype, device=template.device)
    return source


def keyed_by_name(saved: dict[str, Any], template: dict[str, Any]) -> dict[str, Any]:
    """A plain ``optimizer.state_dict()`` (keyed by position, e.g. from a DDP run) keyed by name.

    Positions follow the optimizer's parameter order: the same ``configure_optimizers`` gives the
    same order under another strategy, and the template's canonical lists keep it.
    """
    if not any(isinstance(key, int) for key in saved.get("state", {})):
        return saved
    names: dict[int, str] = {}
    for saved_group, group in zip(saved["param_groups"], template["param_groups"], strict=True):
        if len(saved_group["params"]) != len(group["params"]):
            raise ValueError(f"the saved optimizer has a group of {len(saved_group['params'])} parameters where this "
                             f"one has {len(group['params'])}: it was built for another model")
        names.update(zip(saved_group["params"], group["params"], strict=True))
    return {"state": {names[i]: value for i, value in saved["state"].items()}, "param_groups": saved["param_groups"]}
