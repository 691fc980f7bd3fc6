"""Pretrained weights into the sharded model: every rank reads only the tensors and rows it keeps.

:func:`load_pretrained` runs on every rank once the plan is applied (a model built on the meta
device materialized first), when parameters are FSDP2 DTensors (a rank's rows of a sharded unit),
``SplitLinear`` slices, or plain replicated tensors:

1. open the source reading headers only (:mod:`osdp_lightning.state.weight_files`);
2. list the model's live tensors by canonical key: parameters and persistent buffers, a
   ``SplitLinear``'s slices as the one ``[out, in]`` weight of the Linear it replaced, tied
   names as one tensor (read once, from whichever name the file holds);
3. rename the file's keys onto the module's (:func:`~osdp_lightning.state.weight_files.best_key_map`, or
   the given prefix) and check every name and shape. Every rank reads the same headers, so every
   rank decides alike, and a mismatch is one error on every rank before any tensor is written;
4. per tensor (in file order) and per local piece, the box this rank holds (from the DTensor's
   mesh and placements; a split slice's columns), read from the file straight into the local
   tensor (:meth:`~osdp_lightning.state.weight_files.WeightFiles.read_into`), cast to the model's
   dtype where the file holds another. No rank holds more than one tensor's block at a time.

Non-persistent buffers (rotary tables, causal masks) are in no file and stay as initialised; a
persistent buffer the file lacks does too.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from osdp_lightning.runtime.faults import all_ranks_succeed
from osdp_lightning.runtime.split import SplitLinear
from osdp_lightning.state.weight_files import (
    Box,
    KeyMap,
    PretrainedWeightsError,
    WeightFiles,
    best_key_map,
    open_weights,
)

__all__ = ["LoadReport", "PretrainedWeights", "PretrainedWeightsError", "load_pretrained"]
_SHOWN = 5


@dataclass(frozen=True)
class PretrainedWeights:
    """Where the weights a run starts from are, and how their names meet the module's."""
    path: str
    """A Hugging Face model directory (``config.json`` and ``model.safetensors`` or its shards with
    ``model.safetensors.index.json``), one ``.safetensors`` file, or a ``torch.save`` state dict."""
    prefix: str | None = None
    """Put before every file key to name the module's: ``"net."`` when the LightningModule holds the
    Hugging Face model as ``self.net``. ``None``: found from the keys, also when the file names a
    base model (``layers.0...``) and the module holds its ``*ForCausalLM`` (``model.layers.0...``)."""
    strict: bool = True
    """Missing, unexpected and mis-shaped keys are an error; ``False`` loads what matches and leaves
    the rest as initialised (the report lists them)."""


@dataclass(frozen=True)
class LoadReport:
    """What :func:`load_pretrained` did on this rank."""
    path: str
    files: tuple[str, ...]
    key_map: KeyMap
    loaded: int
    """Tensors written (a tied tensor once)."""
    cast: int
    """Of those, how many the file holds in another dtype (cast to the model's)."""
    bytes_read: int
    """Bytes this rank read from the files: its rows of sharded tensors, replicated ones whole."""
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    mismatched: tuple[str, ...] = ()
    kept_buffers: tuple[str, ...] = ()
    """Persistent buffers the file does not hold: left as initialised."""
    load_s: float = 0.0

    def summary(self) -> str:
        left = [f"{len(v)} {k}" for k, v in (("missing", self.missing), ("unexpected", self.unexpected),
                                             ("mis-shaped", self.mismatched)) if v]
        return (f"osdp: loaded {self.loaded} pretrained tensors from {self.path} ({self.key_map}; "
                f"{self.cast} cast) in {self.load_s:.2f} s, {self.bytes_read} bytes read on this rank"
                + (f"; skipped {', '.join(left)} (strict=False)" if left else ""))


@dataclass(frozen=True)
class _Piece:
    tensor: torch.Tensor
    """A live parameter or buffer: a DTensor, or a plain tensor held whole."""
    column_start: int = 0
    """Where its columns start in the canonical tensor (a split slice's offset)."""


@dataclass(frozen=True)
class _LiveTensor:
    names: tuple[str, ...]
    """Its module keys, canonical first; more than one when tied."""
    shape: tuple[int, ...]
    pieces: tuple[_Piece, ...]
    is_buffer: bool


@dataclass
class _Model:
    """The module's live tensors and the names a file may hold without their being unexpected."""
    tensors: list[_LiveTensor]
    non_persistent: set[str] = field(default_factory=set)
    ignore_unexpected: list[str] = field(default_factory=list)
    ignore_missing: list[str] = field(default_factory=list)


def load_pretrained(module: nn.Module, source: PretrainedWeights | str | Path) -> LoadReport:
    """Fill every parameter and persistent buffer of ``module`` from ``source``; every rank calls it.

    ``module`` is the LightningModule (or any module) after the plan is applied. Raises
    :class:`PretrainedWeightsError` (a ``ValueError``) for names or shapes that do not match
    (unless ``strict=False``) and for damaged or missing files, ``UnsafeCheckpointError`` for a
    torch file whose pickle would run code: on every rank, before anything is written.
    """
    weights = source if isinstance(source, PretrainedWeights) else PretrainedWeights(str(source))
    report: LoadReport | None = None
    with all_ranks_succeed(f"loading pretrained weights from {weights.path}"):  # no rank waits for a failed one
        report = _load(module, weights)
    assert report is not None
    rank_zero_info(report.summary())
    return report


def _load(module: nn.Module, weights: PretrainedWeights) -> LoadReport:
    start = time.perf_counter()
    model = _live_model(module)
    with open_weights(weights.path) as files:
        key_map, matched, left = _match(files, model, weights)
        if weights.strict and (left["missing"] or left["unexpected"] or left["mismatched"]):
            raise _mismatch_error(weights.path, key_map, left, matched_any=bool(matched))
        cast = _write(files, matched)
        return LoadReport(path=str(weights.path), files=tuple(str(f) for f in files.files), key_map=key_map,
                          loaded=len(matched), cast=cast, bytes_read=files.bytes_read,
                          **{k: tuple(v) for k, v in left.items()}, load_s=time.perf_counter() - start)


# -- the model's side ---------------------------------------------------------------------------
def _live_model(module: nn.Module) -> _Model:
    """Every parameter and persistent buffer by canonical key (see the module docstring)."""
    all_modules = list(module.named_modules(remove_duplicate=False))
    slice_prefixes = tuple(f"{n}.slices." if n else "slices." for n, m in all_modules if isinstance(m, SplitLinear))
    found: dict[int, _LiveTensor] = {}
    model = _Model([])

    def add(tensor: torch.Tensor, name: str, shape: tuple[int, ...], pieces: tuple[_Piece, ...], buffer: bool) -> None:
        if tensor.is_meta:
            raise RuntimeError(f"{name} is on the meta device: load pretrained weights after the model is materialized")
        seen = found.get(id(tensor))
        found[id(tensor)] = (_LiveTensor(seen.names + (name,), seen.shape, seen.pieces, buffer) if seen
                             else _LiveTensor((name,), shape, pieces, buffer))

    for name, mod in all_modules:
        prefix = f"{name}." if name else ""
        if prefix.startswith(slice_prefixes):
            continue  # NOTE: a slice is read through its SplitLinear, as a column range of the weight
        if isinstance(mod, SplitLinear):
            pieces = tuple(_Piece(s.weight, i * mod.slice_in_features) for i, s in enumerate(mod.slices))
            add(mod.slices[0].weight, prefix + "weight", (mod.out_features, mod.in_features), pieces, False)
        for key, param in mod._parameters.items():
            if param is not None:
                add(param, prefix + key, tuple(param.shape), (_Piece(param),), False)
        for key, buffer in mod._buffers.items():
            if buffer is None:
                continue
            if key in mod._non_persistent_buffers_set:
                model.non_persistent.add(prefix + key)
            else:
                add(buffer, prefix + key, tuple(buffer.shape), (_Piece(buffer),), True)
        # Hugging Face models name keys their checkpoints may hold or lack (GPT-2's old attn.bias)
        model.ignore_unexpected += list(getattr(mod, "_keys_to_ignore_on_load_unexpected", None) or [])
        model.ignore_missing += list(getattr(mod, "_keys_to_ignore_on_load_missing", None) or [])
    model.tensors = list(found.values())
    return model


# -- names and shapes, checked before anything is written ----------------------------------------
def _match(files: WeightFiles, model: _Model, weights: PretrainedWeights
           ) -> tuple[KeyMap, list[tuple[_LiveTensor, str]], dict[str, list[str]]]:
    """The file key each live tensor is read from, and what is left over (by kind)."""
    names = {name for t in model.tensors for name in t.names}
    key_map = best_key_map(files.infos, names | model.non_persistent, add=weights.prefix)
    file_key_of: dict[str, str] = {}
    left: dict[str, list[str]] = {"missing": [], "unexpected": [], "mismatched": [], "kept_buffers": []}
    for file_key in files.infos:
        module_key = key_map(file_key)
        if module_key in names:
            file_key_of[module_key] = file_key
        elif module_key not in model.non_persistent and not _any_search(model.ignore_unexpected, file_key):
            left["unexpected"].append(file_key)
    matched: list[tuple[_LiveTensor, str]] = []
    for tensor in model.tensors:
        # NOTE: tied names: the first the file holds is read, the others are neither read nor unexpected
        file_key = next((file_key_of[n] for n in tensor.names if n in file_key_of), None)
        if file_key is None:
            kind = "kept_buffers" if tensor.is_buffer else "missing"
            if kind == "kept_buffers" or not _any_search(model.ignore_missing, tensor.names[0]):
                left[kind].append(tensor.names[0])
        elif files.infos[file_key].shape != tensor.shape:
            left["mismatched"].append(f"{tensor.names[0]}: file {list(files.infos[file_key].shape)}, "
                                      f"model {list(tensor.shape)}")
        else:
            matched.append((tensor, file_key))
    return key_map, matched, left


def _any_search(patterns: list[str], key: str) -> bool:
    return any(re.search(pattern, key) for pattern in patterns)


def _mismatch_error(path: str, key_map: KeyMap, left: dict[str, list[str]], matched_any: bool) -> PretrainedWeightsError:
    parts = []
    for kind, what in (("missing", "missing (in the model, not in the file)"),
                       ("unexpected", "unexpected (in the file, not in the model)"), ("mismatched", "mis-shaped")):
        found = left[kind]
        if found:
            more = f", ... {len(found) - _SHOWN} more" if len(found) > _SHOWN else ""
            parts.append(f"{len(found)} {what}: {', '.join(found[:_SHOWN])}{more}")
    hint = "" if matched_any else (" No key of the file names a tensor of the model: set PretrainedWeights(prefix=...) "
                                   "to what the module's keys have before the file's.")
    return PretrainedWeightsError(
        f"pretrained weights {path} do not match the model (file keys read with {key_map}): {'; '.join(parts)}."
        f"{hint} To load what matches and keep the rest as initialised, pass "
        "PretrainedWeights(path, strict=False).")


# -- writing: each rank its own block of each tensor ------------------------------------------
def _write(files: WeightFiles, matched: list[tuple[_LiveTensor, str]]) -> int:
    """Copy each tensor's local blocks in from the file; the number of tensors cast to another dtype."""
    cast: set[str] = set()
    # NOTE: in file order: a file the page cache does not hold is read front to back
    in_order = sorted(matched, key=lambda m: (str(files.infos[m[1]].file), files.infos[m[1]].offset_bytes))
    blocks = [(tensor.names[0], file_key, *_local_block(piece, tensor.names[0]))
              for tensor, file_key in in_order for piece in tensor.pieces]
    blocks = [b for b in blocks if b[2].numel()]  # NOTE: more ranks than rows: this rank may hold none
    files.will_read((file_key, box, local) for _, file_key, local, box in blocks)
    with torch.no_grad():
        for name, file_key, local, box in blocks:
            if files.read_into(file_key, box, local):
                cast.add(name)
    return len(cast)


def _local_block(piece: _Piece, name: str) -> tuple[torch.Tensor, Box]:
    """The tensor this rank holds of ``piece`` and where it lies in the canonical tensor."""
    tensor = piece.tensor
    if isinstance(tensor, DTensor):
        if not all(isinstance(p, Replicate) or type(p) is Shard for p in tensor.placements):
            raise PretrainedWeightsError(f"{name} is laid out as {tensor.placements}; pretrained weights load into "
                                         "replicated or Shard(dim) placements only")
        local_shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh,
                                                                     tensor.placements)
        local = tensor.to_local()
        assert tuple(local.shape) == tuple(local_shape), (name, local.shape, local_shape)
    else:
        local, local_shape, offset = tensor, tuple(tensor.shape), (0,) * tensor.ndim
    box = [slice(start, start + size) for start, size in zip(offset, local_shape, strict=True)]
    if piece.column_start:
        box[1] = slice(box[1].start + piece.column_start, box[1].stop + piece.column_start)
    return local, tuple(box)
