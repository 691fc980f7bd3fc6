"""Checkpoints of the osdp strategy: canonical, sharded by default, atomic, refused when incomplete.

Layouts (both hold the keys and shapes of the unwrapped LightningModule, whatever the plan):

- sharded (default): a directory ``<name>.ckpt/`` written with ``torch.distributed.checkpoint``
  (every rank writes its own shard file; no rank gathers the model), Lightning's ``meta.pt``
  (loops, schedulers, callbacks) and ``osdp_checkpoint.json`` (written last: the save finished).
- consolidated (``save_distributed_checkpoint=False``): one ``torch.save`` file written by rank 0,
  loadable with ``LightningModule.load_from_checkpoint``.

Saves are atomic: every rank writes into a hidden sibling ``.<name>.osdp-partial-<token>``; after
all ranks finished, rank 0 adds the metadata and renames it into place. A save that dies half-way
leaves the previous checkpoint untouched and a partial directory that :func:`check_checkpoint`
recognises and refuses. Split layers (``SplitLinear``) appear as the ``nn.Linear`` they replace,
in the model state (their own hooks) and in the optimizer state (:func:`canonical_optimizer_state`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from osdp_lightning.resume import collect_rng_state, restore_own_rng_state
from osdp_lightning.split import SplitLinear, merge_slice_weights, split_canonical_weight

META_NAME = "meta.pt"  # Lightning's name (lightning.fabric.strategies.fsdp._METADATA_FILENAME)
MARKER_NAME = "osdp_checkpoint.json"
DCP_METADATA_NAME = ".metadata"
FORMAT_VERSION = 1
_PARTIAL = ".osdp-partial-"
_OLD = ".osdp-old-"


class IncompleteCheckpointError(RuntimeError):
    """The checkpoint was not completely written (a save was interrupted) or is damaged."""


# -- collectives that also work without a process group ----------------------------------------
def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _broadcast(obj: Any) -> Any:
    if _world() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_gather(obj: Any) -> list[Any]:
    if _world() == 1:
        return [obj]
    out: list[Any] = [None] * _world()
    dist.all_gather_object(out, obj)
    return out


def _raise_if_any_failed(error: BaseException | None, stage: str) -> None:
    """Every rank raises when one failed (instead of the others waiting in the next collective)."""
    failures = [(r, msg) for r, msg in enumerate(_all_gather(None if error is None else repr(error))) if msg]
    if error is not None:
        raise error
    if failures:
        rank, message = failures[0]
        raise RuntimeError(f"rank {rank} failed while {stage}: {message}")


# -- canonical state ----------------------------------------------------------------------------
def _split_layers(module: nn.Module) -> dict[str, SplitLinear]:
    return {f"{name}." if name else "": m for name, m in module.named_modules() if isinstance(m, SplitLinear)}


def model_state(module: nn.Module, full: bool) -> dict[str, Any]:
    """Canonical model state: DTensor shards, or (``full``) whole CPU tensors on rank 0 only."""
    state = get_model_state_dict(module)
    return _to_full(state) if full else state


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, full: bool) -> dict[str, Any]:
    """Canonical optimizer state (keyed by the unwrapped model's parameter names)."""
    state = canonical_optimizer_state(module, get_optimizer_state_dict(module, optimizer))
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
                names.insert(at, prefix + "weight")
                group["params"] = names
    return {"state": per_param, "param_groups": groups}


def _split_optimizer_state(module: nn.Module, canonical: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
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
    keep = _rank() == 0
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


def _fill(template: Any, source: Any, where: str, strict: bool) -> Any:
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
        return {k: _fill(v, source[k], f"{where}.{k}", strict) if k in source else v for k, v in template.items()}
    if isinstance(template, DTensor):
        whole = source.to(dtype=template.dtype)
        return distribute_tensor(whole, template.device_mesh, template.placements, src_data_rank=None)
    if isinstance(template, torch.Tensor) and isinstance(source, torch.Tensor):
        return source.to(dtype=template.dtype, device=template.device)
    return source


# -- saving -------------------------------------------------------------------------------------
def save_checkpoint(checkpoint: dict[str, Any], path: Path, sharded: bool, info: dict[str, Any]) -> None:
    """Write ``checkpoint`` (Lightning's dict, canonical tensors) atomically to ``path``; every rank calls it."""
    checkpoint["osdp"] = {**info, "rng_states": _all_gather(collect_rng_state())}
    token = _broadcast(f"{os.getpid()}-{time.time_ns()}")
    partial = path.parent / f".{path.name}{_PARTIAL}{token}"
    error: BaseException | None = None
    if sharded:
        partial.mkdir(parents=True, exist_ok=True)
        tensors = {"state_dict": checkpoint.pop("state_dict")}
        tensors.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        dcp.save(tensors, checkpoint_id=partial)  # raises on every rank when one rank's write failed
        del tensors
    if _rank() == 0:
        try:
            marker = {"format_version": FORMAT_VERSION, "layout": "sharded" if sharded else "consolidated",
                      "global_step": checkpoint.get("global_step"), "epoch": checkpoint.get("epoch"),
                      "world_size": _world(), **info}
            if sharded:
                _write_durably(partial / META_NAME, lambda f: torch.save(checkpoint, f))
                _write_durably(partial / MARKER_NAME, lambda f: f.write(json.dumps(marker, indent=1).encode()))
            else:
                partial.parent.mkdir(parents=True, exist_ok=True)
                _write_durably(partial, lambda f: torch.save(checkpoint, f))
            _move_into_place(partial, path, token)
        except BaseException as err:  # noqa: BLE001  (re-raised on every rank below)
            error = err
    _raise_if_any_failed(error, f"saving checkpoint {path}")


def _write_durably(path: Path, write: Any) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _move_into_place(partial: Path, path: Path, token: str) -> None:
    """Rename the finished save over ``path``; the old version is deleted only once the new one is there."""
    old = path.parent / f".{path.name}{_OLD}{token}"
    if path.exists() or path.is_symlink():
        os.replace(path, old)
    # NOTE: between these two renames ``path`` is missing; check_checkpoint points at the old copy.
    os.replace(partial, path)
    _remove(old)
    for stale in path.parent.glob(f".{path.name}{_PARTIAL}*"):  # from earlier interrupted saves
        _remove(stale)
    _fsync_dir(path.parent)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- checking -----------------------------------------------------------------------------------
def check_checkpoint(path: str | Path) -> str:
    """``"sharded"`` or ``"consolidated"``; raises :class:`IncompleteCheckpointError` with what is wrong."""
    path = Path(path)
    if _PARTIAL in path.name:
        target = path.parent / path.name[1:].split(_PARTIAL)[0]
        raise IncompleteCheckpointError(
            f"{path} is an unfinished save (a rank stopped while writing it), not a checkpoint. "
            f"{_latest_hint(path.parent, target)}")
    if not path.exists():
        backups = sorted(path.parent.glob(f".{path.name}{_OLD}*"))
        if backups:
            raise IncompleteCheckpointError(
                f"{path} does not exist: a save was interrupted while replacing it. The previous version is "
                f"intact at {backups[-1]}; rename it to {path.name} to resume from it")
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if path.is_file():
        if not zipfile.is_zipfile(path):
            raise IncompleteCheckpointError(f"{path} is not a complete torch.save file (truncated or damaged). "
                                            f"{_latest_hint(path.parent, path)}")
        return "consolidated"
    problems = [f"{name} is missing" for name in (DCP_METADATA_NAME, META_NAME) if not (path / name).is_file()]
    if not problems:
        problems = _missing_shards(path)
    if problems:
        raise IncompleteCheckpointError(f"{path} is incomplete ({'; '.join(problems[:4])}): the save did not "
                                        f"finish. {_latest_hint(path.parent, path)}")
    return "sharded"


def _missing_shards(path: Path) -> list[str]:
    """Shard files named in DCP's metadata that are absent or shorter than recorded."""
    metadata = FileSystemReader(path).read_metadata()
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    return [f"shard {name} is missing or truncated" for name, size in sorted(needed.items())
            if not (path / name).is_file() or (path / name).stat().st_size < size]


def is_complete_checkpoint(path: str | Path) -> bool:
    try:
        check_checkpoint(path)
    except (IncompleteCheckpointError, FileNotFoundError, OSError, ValueError):
        return False
    return True


def find_latest_checkpoint(dirpath: str | Path) -> Path | None:
    """The complete ``*.ckpt`` in ``dirpath`` with the highest global step (then the newest); ``None`` if none."""
    found = []
    for candidate in Path(dirpath).glob("*.ckpt"):
        if not candidate.name.startswith(".") and is_complete_checkpoint(candidate):
            found.append((_global_step(candidate), candidate.stat().st_mtime, candidate))
    return max(found)[2] if found else None


def _global_step(path: Path) -> int:
    if (path / MARKER_NAME).is_file():
        return int(json.loads((path / MARKER_NAME).read_text()).get("global_step") or 0)
    meta = torch.load(path / META_NAME if path.is_dir() else path, map_location="cpu", mmap=path.is_file(),
                      weights_only=True)
    return int(meta.get("global_step", 0))


def _latest_hint(dirpath: Path, exclude: Path) -> str:
    latest = next((p for p in [find_latest_checkpoint(dirpath)] if p is not None and p != exclude), None)
    if latest is None:
        return "No complete checkpoint was found next to it."
    return f"The last complete checkpoint next to it is {latest}."


# -- loading into a sharded model ---------------------------------------------------------------
def load_checkpoint(path: Path, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], strict: bool,
                    weights_only: bool | None = None) -> dict[str, Any]:
    """Load ``path`` (either layout, any plan or world size) into ``module`` and ``optimizers``.

    Every rank calls it after the plan is applied. Returns the rest of Lightning's checkpoint
    (loops, schedulers, callbacks) without the tensors already loaded.
    """
    verdict = None
    if _rank() == 0:
        try:
            verdict = check_checkpoint(path)
        except (IncompleteCheckpointError, FileNotFoundError) as err:
            verdict = err
    verdict = _broadcast(verdict)  # the same answer on every rank: none waits in a collective alone
    if isinstance(verdict, BaseException):
        raise verdict
    if verdict == "sharded":
        rest = _load_sharded(path, module, optimizers, strict, weights_only)
    else:
        rest = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
        load_full_model_state(module, rest.pop("state_dict"), strict)
        # NOTE: a weights-only checkpoint has no optimizer states; Lightning itself reports that.
        for optimizer, state in zip(optimizers, rest.pop("optimizer_states", []), strict=False):
            load_full_optimizer_state(module, optimizer, state, strict)
    restore_own_rng_state(rest.get("osdp", {}), _rank(), _world())
    return rest


def _load_sharded(path: Path, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], strict: bool,
                  weights_only: bool | None) -> dict[str, Any]:
    saved_keys = FileSystemReader(path).read_metadata().state_dict_metadata.keys()
    currents = {f"optimizer_{i}": (opt, get_optimizer_state_dict(module, opt)) for i, opt in enumerate(optimizers)}
    currents = {k: v for k, v in currents.items() if any(s.startswith(k + ".") for s in saved_keys)}
    state: dict[str, Any] = {"state_dict": get_model_state_dict(module)}
    state.update({key: canonical_optimizer_state(module, current) for key, (_, current) in currents.items()})
    dcp.load(state, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=not strict))
    module.load_state_dict(state["state_dict"], strict=strict)
    for key, (optimizer, current) in currents.items():
        set_optimizer_state_dict(module, optimizer, _split_optimizer_state(module, state[key], current))
    return torch.load(path / META_NAME, map_location="cpu", weights_only=weights_only)


def load_full_model_state(module: nn.Module, state: dict[str, Any], strict: bool = True) -> None:
    """Load a canonical state dict of whole tensors (every rank holds it) into the sharded ``module``."""
    module.load_state_dict(_fill(get_model_state_dict(module), state, "state_dict", strict), strict=strict)


def load_full_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                              strict: bool = True) -> None:
    """Load a canonical optimizer state of whole tensors (every rank holds it)."""
    current = get_optimizer_state_dict(module, optimizer)
    canonical = _fill(canonical_optimizer_state(module, current), state, "optimizer", strict)
    set_optimizer_state_dict(module, optimizer, _split_optimizer_state(module, canonical, current))


# -- without a process group: inference and conversion ------------------------------------------
def load_model_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The model's canonical state dict (whole CPU tensors) from either layout, in one process.

    Needs no process group and no ``osdp_lightning`` model code: ``MyModule().load_state_dict(...)``.
    """
    path = Path(path)
    if check_checkpoint(path) == "consolidated":
        return torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    prefix = "state_dict."
    state = {key[len(prefix):]: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
             for key, meta in metadata.items() if key.startswith(prefix) and hasattr(meta, "size")}
    dcp.load({"state_dict": state}, checkpoint_id=path, no_dist=True)
    return state


def consolidate_checkpoint(path: str | Path, out_file: str | Path) -> Path:
    """Write a sharded checkpoint as one Lightning ``.ckpt`` file (for ``load_from_checkpoint``)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path, out_file = Path(path), Path(out_file)
    if check_checkpoint(path) == "consolidated":
        shutil.copyfile(path, out_file)
        return out_file
    tmp = out_file.parent / f".{out_file.name}{_PARTIAL}convert"
    dcp_to_torch_save(path, tmp)
    tensors = torch.load(tmp, map_location="cpu", weights_only=False)
    checkpoint = torch.load(path / META_NAME, map_location="cpu", weights_only=False)
    checkpoint["state_dict"] = tensors.pop("state_dict")
    optimizers = sorted((k for k in tensors if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    checkpoint["optimizer_states"] = [tensors[k] for k in optimizers]
    _write_durably(tmp, lambda f: torch.save(checkpoint, f))
    os.replace(tmp, out_file)
    return out_file
