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
in the model state (their own hooks) and in the optimizer state (``osdp_lightning/state/canonical.py``).

Loading never unpickles arbitrary objects: ``torch.save`` files are read weights-only, and the
pickled ``.metadata`` of a sharded checkpoint (which ``torch.distributed.checkpoint`` reads with
plain pickle) is first read here admitting only DCP's own metadata types. Anything else is refused
with :class:`UnsafeCheckpointError`.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import json
import os
import pathlib
import pickle
import shutil
import time
import zipfile
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from osdp_lightning.runtime.faults import (
    all_gather_object,
    broadcast_object,
    raise_if_any_rank_failed,
    rank,
    world_size,
)
from osdp_lightning.state.canonical import (
    canonical_optimizer_state,
    fill_like,
    keyed_by_name,
    model_state,
    optimizer_state,
    split_optimizer_state,
)
from osdp_lightning.state.resume import collect_rng_state, restore_own_rng_state

__all__ = [
    "IncompleteCheckpointError", "UnsafeCheckpointError", "check_checkpoint", "consolidate_checkpoint",
    "find_latest_checkpoint", "is_complete_checkpoint", "load_checkpoint", "load_full_model_state",
    "load_full_optimizer_state", "load_model_weights", "model_state", "optimizer_state", "save_checkpoint",
]

META_NAME = "meta.pt"  # Lightning's name (lightning.fabric.strategies.fsdp._METADATA_FILENAME)
MARKER_NAME = "osdp_checkpoint.json"
DCP_METADATA_NAME = ".metadata"
FORMAT_VERSION = 1
_PARTIAL = ".osdp-partial-"
_OLD = ".osdp-old-"


class IncompleteCheckpointError(RuntimeError):
    """The checkpoint was not completely written (a save was interrupted) or is damaged."""


class UnsafeCheckpointError(pickle.UnpicklingError):
    """The checkpoint holds objects that only running code from the file could rebuild; not loaded."""


_TRUST = ("Only load checkpoints you trust: unpickling runs whatever code the file names. If you trust this "
          "one and it holds your own classes, allow them with `with torch.serialization.safe_globals([...]):` "
          "around this call.")


def _torch_load(path: Path, what: str, weights_only: bool | None = True, mmap: bool = False) -> Any:
    """``torch.load`` of ``path`` to CPU, weights-only unless the caller turned that off (a resume the
    user asked to load fully); a weights-only refusal raises :class:`UnsafeCheckpointError` naming the
    file and what it held."""
    try:
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=weights_only)
    except pickle.UnpicklingError as err:
        if weights_only is False:
            raise
        found = [line.strip() for line in str(err).splitlines() if "GLOBAL" in line or "Unsupported" in line]
        raise UnsafeCheckpointError(" ".join([
            f"refused to load {what} {path}: it holds objects other than tensors and plain Python data, and "
            "checkpoints are loaded weights-only (torch.load(weights_only=True)) because unpickling such objects "
            "can run arbitrary code.", *found[:1], _TRUST])) from None


_DCP_PATHS = (pathlib.Path, pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath)


def _metadata_type(module: str, value: Any) -> bool:
    """Whether ``value``, named by ``module``, is one of the plain types DCP's ``.metadata`` pickles."""
    if module.startswith("torch.distributed.checkpoint."):
        return isinstance(value, type) and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum))
    if module == "torch":
        return value is torch.Size or isinstance(value, (torch.dtype, torch.layout, torch.memory_format))
    return ((module == "torch.serialization" and value is getattr(torch.serialization, "_get_layout", None))
            or (module == "pathlib" and value in _DCP_PATHS)
            or (module == "collections" and value is OrderedDict))


def _allowed_by_user(module: str, name: str) -> bool:
    """Whether ``module.name`` is among the types the user allowed for weights-only loading
    (``torch.serialization.add_safe_globals`` / ``safe_globals``)."""
    for entry in torch.serialization.get_safe_globals():
        spelled = entry[1] if isinstance(entry, tuple) else f"{entry.__module__}.{entry.__qualname__}"
        if spelled == f"{module}.{name}":
            return True
    return False


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata only: dataclasses and enums of ``torch.distributed.checkpoint``, dtypes,
    sizes and paths, and what the user allowed as torch's safe globals. Modules are checked before
    they are imported, and values after."""

    def find_class(self, module: str, name: str) -> Any:
        if _allowed_by_user(module, name):
            return super().find_class(module, name)
        known = module in ("torch", "torch.serialization", "pathlib", "collections")
        value = super().find_class(module, name) if known or module.startswith("torch.distributed.checkpoint.") else None
        if value is None or not _metadata_type(module, value):
            raise UnsafeCheckpointError(f"it names {module}.{name}, which is not a type of torch.distributed.checkpoint's "
                                        "metadata")
        return value


def _read_dcp_metadata(path: Path) -> Metadata:
    """A sharded checkpoint's ``.metadata``, unpickled admitting only DCP's own metadata types.

    NOTE: torch's ``FileSystemReader.read_metadata`` uses plain ``pickle.load``; reading the file
    here first refuses a crafted one before any torch code unpickles it.
    """
    file = path / DCP_METADATA_NAME
    try:
        metadata = _MetadataUnpickler(io.BytesIO(file.read_bytes())).load()
    except UnsafeCheckpointError as err:
        raise UnsafeCheckpointError(f"refused to read {file}: {err}, and unpickling it could run arbitrary "
                                    f"code. {_TRUST}") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"refused to read {file}: it holds a {type(metadata).__name__}, not "
                                    "torch.distributed.checkpoint metadata")
    return metadata


# -- saving -------------------------------------------------------------------------------------
def save_checkpoint(checkpoint: dict[str, Any], path: Path, sharded: bool, info: dict[str, Any]) -> None:
    """Write ``checkpoint`` (Lightning's dict, canonical tensors) atomically to ``path``; every rank calls it."""
    checkpoint["osdp"] = {**info, "rng_states": all_gather_object(collect_rng_state())}
    token = broadcast_object(f"{os.getpid()}-{time.time_ns()}")
    partial = path.parent / f".{path.name}{_PARTIAL}{token}"
    error: BaseException | None = None
    if sharded:
        partial.mkdir(parents=True, exist_ok=True)
        tensors = {"state_dict": checkpoint.pop("state_dict")}
        tensors.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        dcp.save(tensors, checkpoint_id=partial)  # raises on every rank when one rank's write failed
        del tensors
    if rank() == 0:
        try:
            marker = {"format_version": FORMAT_VERSION, "layout": "sharded" if sharded else "consolidated",
                      "global_step": checkpoint.get("global_step"), "epoch": checkpoint.get("epoch"),
                      "world_size": world_size(), **info}
            if sharded:
                _write_durably(partial / META_NAME, lambda f: torch.save(checkpoint, f))
                _write_durably(partial / MARKER_NAME, lambda f: f.write(json.dumps(marker, indent=1).encode()))
            else:
                partial.parent.mkdir(parents=True, exist_ok=True)
                _write_durably(partial, lambda f: torch.save(checkpoint, f))
            _move_into_place(partial, path, token)
        except BaseException as err:  # noqa: BLE001  (re-raised on every rank below)
            error = err
    raise_if_any_rank_failed(error, f"saving checkpoint {path}")


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
    _fsync_dir(path.parent)  # the new version is durably in place before the old one goes
    _remove(old)
    for stale in path.parent.glob(f".{path.name}{_PARTIAL}*"):  # from earlier interrupted saves
        _remove(stale)


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
    """``"sharded"`` or ``"consolidated"``; raises :class:`IncompleteCheckpointError` saying what is wrong
    and which complete checkpoint lies next to it (``FileNotFoundError`` when there is nothing)."""
    path = Path(path)
    layout, problem = _diagnose(path)
    if problem is None:
        return layout
    if layout == "missing":
        raise FileNotFoundError(problem)
    latest = find_latest_checkpoint(path.parent)
    hint = (f"The last complete checkpoint next to it is {latest}: resume from that one." if latest
            else "No complete checkpoint was found next to it.")
    raise IncompleteCheckpointError(f"{problem} {hint}")


def _diagnose(path: Path) -> tuple[str, str | None]:
    """The layout and, when the checkpoint cannot be loaded, why not."""
    if _PARTIAL in path.name:
        target = path.parent / path.name[1:].split(_PARTIAL)[0]
        replaced = f" The checkpoint it was to replace, {target.name}, is intact." if target.exists() else ""
        return "partial", f"{path} is an unfinished save (a rank stopped while writing it), not a checkpoint.{replaced}"
    if not path.exists():
        backups = sorted(path.parent.glob(f".{path.name}{_OLD}*"))
        if backups:
            return "swapping", (f"{path} does not exist: a save was interrupted while replacing it. The previous "
                                f"version is intact at {backups[-1]}; rename it to {path.name} to resume from it.")
        return "missing", f"checkpoint {path} does not exist"
    if path.is_file():
        if not zipfile.is_zipfile(path):
            return "consolidated", f"{path} is not a complete torch.save file (truncated or damaged)."
        return "consolidated", None
    problems = [f"{name} is missing" for name in (DCP_METADATA_NAME, META_NAME) if not (path / name).is_file()]
    problems = problems or _missing_shards(path)
    if problems:
        return "sharded", f"{path} is incomplete ({'; '.join(problems[:4])}): the save did not finish."
    return "sharded", None


def _missing_shards(path: Path) -> list[str]:
    """Shard files named in DCP's metadata that are absent or shorter than recorded."""
    metadata = _read_dcp_metadata(path)
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    return [f"shard {name} is missing or truncated" for name, size in sorted(needed.items())
            if not (path / name).is_file() or (path / name).stat().st_size < size]


def is_complete_checkpoint(path: str | Path) -> bool:
    try:
        return _diagnose(Path(path))[1] is None
    except (OSError, ValueError):  # unreadable DCP metadata
        return False


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
    meta = _torch_load(path / META_NAME if path.is_dir() else path, "checkpoint", mmap=path.is_file())
    return int(meta.get("global_step", 0))


# -- loading into a sharded model ---------------------------------------------------------------
def load_checkpoint(path: Path, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], strict: bool,
                    weights_only: bool | None = None) -> dict[str, Any]:
    """Load ``path`` (either layout, any plan or world size) into ``module`` and ``optimizers``.

    Every rank calls it after the plan is applied. Returns the rest of Lightning's checkpoint
    (loops, schedulers, callbacks) without the tensors already loaded.
    """
    verdict = None
    if rank() == 0:
        try:
            verdict = check_checkpoint(path)
        except (IncompleteCheckpointError, FileNotFoundError) as err:
            verdict = err
    verdict = broadcast_object(verdict)  # the same answer on every rank: none waits in a collective alone
    if isinstance(verdict, BaseException):
        raise verdict
    if verdict == "sharded":
        rest = _load_sharded(path, module, optimizers, strict, weights_only)
    else:
        rest = _torch_load(path, "checkpoint", weights_only, mmap=True)
        load_full_model_state(module, rest.pop("state_dict"), strict)
        # NOTE: a weights-only checkpoint has no optimizer states; Lightning itself reports that.
        for optimizer, state in zip(optimizers, rest.pop("optimizer_states", []), strict=False):
            load_full_optimizer_state(module, optimizer, state, strict)
    restore_own_rng_state(rest.get("osdp", {}), rank(), world_size())
    return rest


def _load_sharded(path: Path, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], strict: bool,
                  weights_only: bool | None) -> dict[str, Any]:
    saved_keys = _read_dcp_metadata(path).state_dict_metadata.keys()
    currents = {f"optimizer_{i}": (opt, get_optimizer_state_dict(module, opt)) for i, opt in enumerate(optimizers)}
    currents = {k: v for k, v in currents.items() if any(s.startswith(k + ".") for s in saved_keys)}
    state: dict[str, Any] = {"state_dict": get_model_state_dict(module)}
    state.update({key: canonical_optimizer_state(module, current) for key, (_, current) in currents.items()})
    for key in currents:
        if not any(s.startswith(f"{key}.state.") for s in saved_keys):
            state[key]["state"] = {}  # saved before its first step: it continues with no state
    dcp.load(state, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=not strict))
    module.load_state_dict(state["state_dict"], strict=strict)
    for key, (optimizer, current) in currents.items():
        set_optimizer_state_dict(module, optimizer, split_optimizer_state(module, state[key], current))
    return _torch_load(path / META_NAME, "checkpoint metadata", weights_only)


def load_full_model_state(module: nn.Module, state: dict[str, Any], strict: bool = True) -> None:
    """Load a canonical state dict of whole tensors (every rank holds it) into the sharded ``module``."""
    module.load_state_dict(fill_like(get_model_state_dict(module), state, "state_dict", strict), strict=strict)


def load_full_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                              strict: bool = True) -> None:
    """Load an optimizer state of whole tensors (every rank holds it): canonical, or a plain
    ``optimizer.state_dict()`` keyed by position (a checkpoint of another strategy)."""
    current = get_optimizer_state_dict(module, optimizer)
    template = canonical_optimizer_state(module, current)
    if not state.get("state"):  # saved before its first step: it continues with no state
        template["state"] = {}
    canonical = fill_like(template, keyed_by_name(state, template), "optimizer", strict)
    set_optimizer_state_dict(module, optimizer, split_optimizer_state(module, canonical, current))


# -- without a process group: inference and conversion ------------------------------------------
def load_model_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The model's canonical state dict (whole CPU tensors) from either layout, in one process.

    Needs no process group and no ``osdp_lightning`` model code: ``MyModule().load_state_dict(...)``.
    Loads weights-only; raises :class:`UnsafeCheckpointError` for a file that holds anything else.
    """
    path = Path(path)
    if check_checkpoint(path) == "consolidated":
        return _torch_load(path, "checkpoint")["state_dict"]
    metadata = _read_dcp_metadata(path).state_dict_metadata
    prefix = "state_dict."
    state = {key[len(prefix):]: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
             for key, meta in metadata.items() if key.startswith(prefix) and hasattr(meta, "size")}
    dcp.load({"state_dict": state}, checkpoint_id=path, no_dist=True)
    return state


def consolidate_checkpoint(path: str | Path, out_file: str | Path) -> Path:
    """Write a sharded checkpoint as one Lightning ``.ckpt`` file (for ``load_from_checkpoint``).

    Reads weights-only; raises :class:`UnsafeCheckpointError` for a checkpoint that holds anything else.
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path, out_file = Path(path), Path(out_file)
    if check_checkpoint(path) == "consolidated":
        shutil.copyfile(path, out_file)
        return out_file
    tmp = out_file.parent / f".{out_file.name}{_PARTIAL}convert"
    dcp_to_torch_save(path, tmp)
    tensors = _torch_load(tmp, "converted checkpoint")
    checkpoint = _torch_load(path / META_NAME, "checkpoint metadata")
    checkpoint["state_dict"] = tensors.pop("state_dict")
    optimizers = sorted((k for k in tensors if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    checkpoint["optimizer_states"] = [tensors[k] for k in optimizers]
    _write_durably(tmp, lambda f: torch.save(checkpoint, f))
    os.replace(tmp, out_file)
    return out_file
