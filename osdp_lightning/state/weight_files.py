"""Weight files read by name and by box, never whole: safetensors, torch files, Hugging Face directories.

A source is a Hugging Face model directory (``model.safetensors``, or shards listed by
``model.safetensors.index.json``; ``pytorch_model.bin`` and its index likewise), one
``.safetensors`` file, or one ``torch.save`` file of a state dict (a Lightning ``.ckpt`` too: its
``state_dict``). :func:`open_weights` reads only the headers (safetensors) or maps the file
(torch, ``mmap=True``, weights-only); :meth:`WeightFiles.read` then reads one box of one tensor
(``safe_open(...).get_slice(name)[rows, cols]``), so a rank touches only the bytes it keeps.

Also here: :class:`KeyMap`, the renaming of a file's keys onto a module's (a prefix stripped, a
prefix added), found from the keys themselves, for loading and for exporting alike.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from osdp_lightning.state.checkpoint import _torch_load

HF_EXTRA_HINT = "pip install osdp-lightning[hf]"
SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
TORCH_NAME = "pytorch_model.bin"
TORCH_INDEX_NAME = "pytorch_model.bin.index.json"
Box = tuple[slice, ...]
"""Per dimension, the range of one block of a tensor (a rank's rows, a split slice's columns)."""


class PretrainedWeightsError(ValueError):
    """Weights that cannot be loaded as they are: a damaged or missing file, or names and shapes
    that do not match the model."""


def import_safetensors() -> Any:
    """The ``safetensors`` package, imported on first use (it is an optional dependency)."""
    try:
        import safetensors
        import safetensors.torch  # noqa: F401  (save_file, for exports)
    except ImportError as err:  # pragma: no cover - the dev extra installs it
        raise ImportError(f"reading and writing safetensors files needs the safetensors package: "
                          f"{HF_EXTRA_HINT}") from err
    return safetensors


@dataclass(frozen=True)
class TensorInfo:
    """What a file's header says of one tensor."""
    file: Path
    shape: tuple[int, ...]
    dtype: str
    """As the file names it (``"BF16"`` in safetensors, ``"torch.float32"`` in torch files)."""


class WeightFiles:
    """The tensors of a weights source by name; the files stay open until :meth:`close`."""

    def __init__(self, path: Path, infos: dict[str, TensorInfo], handles: dict[Path, Any],
                 stack: contextlib.ExitStack) -> None:
        self.path, self.infos, self._handles, self._stack = path, infos, handles, stack
        self.bytes_read = 0
        """Bytes :meth:`read` returned so far (in the file's dtype)."""

    @property
    def files(self) -> tuple[Path, ...]:
        return tuple(self._handles)

    def read(self, name: str, box: Box) -> torch.Tensor:
        """The ``box`` of tensor ``name`` (a CPU tensor in the file's dtype); reads only those bytes."""
        handle = self._handles[self.infos[name].file]
        if isinstance(handle, dict):  # a torch file's mmap'd tensors: slicing reads the pages touched
            whole = handle[name]
            block = whole[box] if box else whole
        elif box:
            block = handle.get_slice(name)[box]
        else:  # NOTE: a 0-d tensor has no box to slice with
            block = handle.get_tensor(name)
        self.bytes_read += block.numel() * block.element_size()
        return block

    def close(self) -> None:
        self._handles.clear()
        self._stack.close()

    def __enter__(self) -> WeightFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_weights(path: str | Path) -> WeightFiles:
    """Open a weights source (see the module docstring) reading headers only.

    Raises :class:`PretrainedWeightsError` for a truncated or damaged file, a shard the index
    names that is absent or lacks a tensor the index puts there, a directory without weights;
    :class:`~osdp_lightning.state.checkpoint.UnsafeCheckpointError` for a torch file whose pickle would
    run code; ``FileNotFoundError`` when ``path`` does not exist.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"pretrained weights {path} do not exist")
    expected = _files_of_directory(path) if path.is_dir() else {path: None}
    stack = contextlib.ExitStack()
    infos: dict[str, TensorInfo] = {}
    handles: dict[Path, Any] = {}
    try:
        for file, names in expected.items():
            handle, found = _open_file(file, stack)
            handles[file] = handle
            wanted = found if names is None else names
            absent = [n for n in wanted if n not in found]
            if absent:
                raise PretrainedWeightsError(
                    f"{file} lacks {len(absent)} tensor(s) its index puts there ({', '.join(absent[:5])}): the "
                    "shard does not belong to this index, or the download is incomplete")
            infos.update({n: TensorInfo(file, found[n][0], found[n][1]) for n in wanted})
    except BaseException:
        stack.close()
        raise
    return WeightFiles(path, infos, handles, stack)


def _files_of_directory(path: Path) -> dict[Path, list[str] | None]:
    """The weight files of a Hugging Face model directory, each with the names its index gives it."""
    for index_name, single in ((SAFETENSORS_INDEX_NAME, SAFETENSORS_NAME), (TORCH_INDEX_NAME, TORCH_NAME)):
        if (path / index_name).is_file():
            return _files_of_index(path / index_name)
        if (path / single).is_file():
            return {path / single: None}
    raise PretrainedWeightsError(f"{path} holds no {SAFETENSORS_NAME}, {SAFETENSORS_INDEX_NAME}, {TORCH_NAME} "
                                 f"or {TORCH_INDEX_NAME}: not a Hugging Face model directory")


def _files_of_index(index: Path) -> dict[Path, list[str] | None]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as err:
        raise PretrainedWeightsError(f"{index} is not a weights index (JSON with a 'weight_map'): {err}") from None
    files: dict[Path, list[str] | None] = {}
    for name, file in weight_map.items():
        names = files.setdefault(index.parent / file, [])
        assert names is not None
        names.append(name)
    missing = sorted(str(f.name) for f in files if not f.is_file())
    if missing:
        raise PretrainedWeightsError(f"{index} names {len(missing)} shard(s) that are not in {index.parent}: "
                                     f"{', '.join(missing[:5])} (an incomplete download or copy)")
    return files


def _open_file(file: Path, stack: contextlib.ExitStack) -> tuple[Any, dict[str, tuple[tuple[int, ...], str]]]:
    """A reader of ``file`` and, per tensor, its shape and dtype."""
    if file.suffix == ".safetensors":
        safetensors = import_safetensors()
        try:
            handle = stack.enter_context(safetensors.safe_open(str(file), framework="pt"))
            found = {}
            for name in handle.keys():
                header = handle.get_slice(name)
                found[name] = (tuple(header.get_shape()), str(header.get_dtype()))
        except safetensors.SafetensorError as err:
            raise PretrainedWeightsError(f"{file} is not a complete safetensors file (truncated or damaged): "
                                         f"{err}") from None
        return handle, found
    try:
        loaded = _torch_load(file, "pretrained weights", mmap=True)
    except (RuntimeError, EOFError) as err:
        raise PretrainedWeightsError(f"{file} is not a complete torch.save file (truncated or damaged): "
                                     f"{err}") from None
    if isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict):
        loaded = loaded["state_dict"]  # a Lightning checkpoint
    if not isinstance(loaded, dict):
        raise PretrainedWeightsError(f"{file} holds a {type(loaded).__name__}, not a state dict of tensors")
    tensors = {k: v for k, v in loaded.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}
    return tensors, {k: (tuple(v.shape), str(v.dtype)) for k, v in tensors.items()}


# -- names ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KeyMap:
    """A file key ``strip + rest`` is the module key ``add + rest``."""
    strip: str = ""
    add: str = ""

    def __call__(self, key: str) -> str | None:
        return self.add + key[len(self.strip):] if key.startswith(self.strip) else None

    def __str__(self) -> str:
        if not (self.strip or self.add):
            return "the same keys"
        return " ".join(filter(None, [f"{self.strip!r} stripped" if self.strip else "",
                                      f"{self.add!r} added" if self.add else ""]))


def _dotted_prefixes(key: str, max_parts: int) -> list[str]:
    """``""``, ``"a."``, ``"a.b."``, ... of ``key`` (at most ``max_parts`` parts, never all of it)."""
    parts = key.split(".")
    return [".".join(parts[:i]) + "." if i else "" for i in range(min(max_parts, len(parts) - 1) + 1)]


def best_key_map(source_keys: Iterable[str], target_keys: Collection[str], *, add: str | None = None,
                 strip: str | None = None, max_strip_parts: int = 2) -> KeyMap:
    """The :class:`KeyMap` that carries the most ``source_keys`` onto ``target_keys``.

    ``add`` / ``strip`` fix that part (``None``: found). Candidates strip up to ``max_strip_parts``
    leading parts (a base model's ``model.`` / ``transformer.``) and add any leading part of a
    target key; of equals, the one that strips least, then adds least. A one-part suffix votes
    only when nothing is stripped (``weight`` alone would match every layer).
    """
    adds_by_suffix: dict[str, set[str]] = {}
    for target in target_keys:
        for head in _dotted_prefixes(target, target.count(".")):
            adds_by_suffix.setdefault(target[len(head):], set()).add(head)
    votes: Counter[tuple[str, str]] = Counter()
    for key in source_keys:
        heads = [strip] if strip is not None else _dotted_prefixes(key, max_strip_parts)
        for head in heads:
            rest = key[len(head):]
            if not key.startswith(head) or ("." not in rest and head):
                continue
            for found in adds_by_suffix.get(rest, ()):
                if add is None or found == add:
                    votes[(head, found)] += 1
    if not votes:
        return KeyMap(strip or "", add or "")
    (head, found), _ = min(votes.items(), key=lambda item: (-item[1], item[0][0].count("."), len(item[0][1])))
    return KeyMap(head, found)
