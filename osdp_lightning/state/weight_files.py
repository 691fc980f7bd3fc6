"""Weight files read by name and by box, never whole: safetensors, torch files, Hugging Face directories.

A source is a Hugging Face model directory (``model.safetensors``, or shards listed by
``model.safetensors.index.json``; ``pytorch_model.bin`` and its index likewise), one
``.safetensors`` file, or one ``torch.save`` file of a state dict (a Lightning ``.ckpt`` too: its
``state_dict``). :func:`open_weights` reads only the headers (safetensors) or maps the file
(torch, ``mmap=True``, weights-only); :meth:`WeightFiles.read_into` then copies one box of one
tensor into the tensor that keeps it, so a rank touches only the bytes it keeps. A box that is one
run of a safetensors file's bytes (a tensor whole, a rank's rows) it reads with ``os.preadv``
straight into the destination's memory: one copy, no page faults on a mapped file, the runs ahead
asked of the kernel when the page cache does not hold the file (:meth:`WeightFiles.will_read`), and
a file cut short after it was opened is a :class:`PretrainedWeightsError`, not a ``SIGBUS``. Column
slices (one run per row) and casts (a bf16 file into an fp32 model) copy from the mapped file
(``safe_open(...).get_slice(name)[rows, cols]``).

Also here: :class:`KeyMap`, the renaming of a file's keys onto a module's (a prefix stripped, a
prefix added), found from the keys themselves, for loading and for exporting alike.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import sys
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
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
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                      "F8_E5M2": torch.float8_e5m2}
"""The safetensors dtypes ``os.preadv`` reads into a tensor of the same dtype; others (and every dtype
on a big-endian host) copy from the mapping. The file's bytes are little-endian."""
READAHEAD_BYTES = 32 << 20
"""How far ahead of a read of a cold file its runs are asked of the kernel (on a 2-core VM: 32 MiB
loads 0.25 s where asking for all of a rank's 255 MiB at once takes 0.30 s, 8 MiB 0.27 s)."""


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
    offset_bytes: int = -1
    """Where its bytes start in a safetensors file; -1 in a torch file."""


@dataclass
class _SafetensorsFile:
    """An open safetensors file: a descriptor to ``os.preadv`` from, and safetensors' own reader
    (it checked the header against the file's length; it reads the dtypes ``preadv`` does not)."""
    path: Path
    fd: int
    reader: Any
    ahead: list[tuple[int, int]] = field(default_factory=list)
    """(offset, bytes) of every run this rank is about to read, in order (:meth:`WeightFiles.will_read`)."""
    next_hint: int = 0
    """The first run of ``ahead`` not asked of the kernel yet."""
    cold: bool = False
    """Whether a read found bytes of it out of the page cache (then runs ahead are asked for)."""


class WeightFiles:
    """The tensors of a weights source by name; the files stay open until :meth:`close`."""

    def __init__(self, path: Path, infos: dict[str, TensorInfo], handles: dict[Path, Any],
                 stack: contextlib.ExitStack) -> None:
        self.path, self.infos, self._handles, self._stack = path, infos, handles, stack
        self.bytes_read = 0
        """Bytes read so far (in the file's dtype)."""

    @property
    def files(self) -> tuple[Path, ...]:
        return tuple(self._handles)

    def read_into(self, name: str, box: Box, out: torch.Tensor) -> bool:
        """Copy the ``box`` of tensor ``name`` into ``out`` (a tensor of the box's shape), reading only
        those bytes; whether it was cast (the file holds another dtype than ``out``)."""
        offset = self._direct_offset(name, box, out)
        if offset is None:  # a torch file, a column slice, a cast: through the mapping
            block = self.read(name, box)
            out.copy_(block)  # casts to the model's dtype (a bf16 file into an fp32 model), or onto its device
            return block.dtype != out.dtype
        _pread_into(self._handles[self.infos[name].file], name, offset, out)
        self.bytes_read += out.numel() * out.element_size()
        return False

    def will_read(self, reads: Iterable[tuple[str, Box, torch.Tensor]]) -> None:
        """The reads :meth:`read_into` is about to make, in order. Once a read finds its bytes out of
        the page cache, the runs up to :data:`READAHEAD_BYTES` ahead of each read are asked of the
        kernel (``posix_fadvise(WILLNEED)``): the disk reads ahead while the rank copies. A cached
        file costs nothing more (``RWF_NOWAIT`` reads)."""
        for name, box, out in reads:
            offset = self._direct_offset(name, box, out)
            if offset is not None:
                self._handles[self.infos[name].file].ahead.append((offset, out.numel() * out.element_size()))

    def _direct_offset(self, name: str, box: Box, out: torch.Tensor) -> int | None:
        """Where in its file the ``box`` of tensor ``name`` starts when ``os.preadv`` reads it straight
        into ``out``: a safetensors file's tensor of ``out``'s dtype, the box one run of bytes (rows
        of a row-major tensor), ``out`` contiguous in CPU memory. ``None``: read through the mapping
        (one ``preadv`` per row of a column slice costs more than copying from the mapping)."""
        info = self.infos[name]
        if (not isinstance(self._handles[info.file], _SafetensorsFile) or sys.byteorder != "little"
                or not hasattr(os, "preadv") or SAFETENSORS_DTYPES.get(info.dtype) != out.dtype
                or out.device.type != "cpu" or not out.is_contiguous() or not out.numel()):
            return None
        first = run_start(info.shape, box)
        return None if first is None else info.offset_bytes + first * out.element_size()

    def read(self, name: str, box: Box) -> torch.Tensor:
        """The ``box`` of tensor ``name`` (a CPU tensor in the file's dtype, a view of the mapped file
        where it can be); reads only those bytes."""
        handle = self._handles[self.infos[name].file]
        if isinstance(handle, dict):  # a torch file's mmap'd tensors: slicing reads the pages touched
            whole = handle[name]
            block = whole[box] if box else whole
        elif box:
            block = handle.reader.get_slice(name)[box]
        else:  # NOTE: a 0-d tensor has no box to slice with
            block = handle.reader.get_tensor(name)
        self.bytes_read += block.numel() * block.element_size()
        return block

    def close(self) -> None:
        self._handles.clear()
        self._stack.close()

    def __enter__(self) -> WeightFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_start(shape: tuple[int, ...], box: Box) -> int | None:
    """The first element of ``box`` (row-major) when its elements are one contiguous run of the
    tensor's, else ``None``: every dimension after the first one it cuts is covered whole, every
    one before it is one index wide."""
    cut = [d for d, (b, n) in enumerate(zip(box, shape, strict=True)) if (b.start, b.stop) != (0, n)]
    if cut and any(b.stop - b.start != 1 for b in box[:cut[-1]]):
        return None
    return sum(b.start * math.prod(shape[d + 1:]) for d, b in enumerate(box))


def _pread_into(file: _SafetensorsFile, name: str, offset: int, out: torch.Tensor) -> None:
    """Read ``out``'s bytes from ``offset`` of ``file`` straight into its memory."""
    view = memoryview((ctypes.c_char * (out.numel() * out.element_size())).from_address(out.data_ptr())).cast("B")
    done = _read_cached(file, view, offset)
    if done < len(view):
        _ask_ahead(file, offset + done)
    while done < len(view):
        got = os.preadv(file.fd, [view[done:]], offset + done)
        if got == 0:
            raise PretrainedWeightsError(
                f"{file.path} is not a complete safetensors file (truncated or damaged): {name} ends past "
                f"the end of the file ({os.fstat(file.fd).st_size} bytes)")
        done += got


def _read_cached(file: _SafetensorsFile, view: memoryview, offset: int) -> int:
    """What of ``view`` the page cache holds, read without waiting for the disk (``RWF_NOWAIT``); 0
    once the file was found cold, or where the kernel cannot tell."""
    if file.cold:
        return 0
    try:
        got = os.preadv(file.fd, [view], offset, os.RWF_NOWAIT)
    except (AttributeError, OSError):  # NOTE: EAGAIN (not cached); no RWF_NOWAIT here: read ahead always
        got = 0
    file.cold = got < len(view)
    return got


def _ask_ahead(file: _SafetensorsFile, offset: int) -> None:
    """Ask the kernel for the runs ahead of ``offset`` up to :data:`READAHEAD_BYTES` further
    (``WILLNEED``: reads in flight while this rank copies), each run once."""
    while file.next_hint < len(file.ahead) and hasattr(os, "posix_fadvise"):
        start, length = file.ahead[file.next_hint]
        if start > offset + READAHEAD_BYTES:
            return
        if start + length > offset:
            os.posix_fadvise(file.fd, max(start, offset), start + length - max(start, offset), os.POSIX_FADV_WILLNEED)
        file.next_hint += 1


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
            infos.update({n: TensorInfo(file, *found[n]) for n in wanted})
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


def _open_file(file: Path, stack: contextlib.ExitStack) -> tuple[Any, dict[str, tuple[tuple[int, ...], str, int]]]:
    """A reader of ``file`` and, per tensor, its shape, dtype and where its bytes start (-1: a torch file)."""
    if file.suffix == ".safetensors":
        safetensors = import_safetensors()
        try:
            reader = stack.enter_context(safetensors.safe_open(str(file), framework="pt"))
        except safetensors.SafetensorError as err:
            raise PretrainedWeightsError(f"{file} is not a complete safetensors file (truncated or damaged): "
                                         f"{err}") from None
        fd = os.open(file, os.O_RDONLY)
        stack.callback(os.close, fd)
        header, data_start = _safetensors_header(fd)
        return _SafetensorsFile(file, fd, reader), {
            name: (tuple(h["shape"]), h["dtype"], data_start + h["data_offsets"][0]) for name, h in header.items()}
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
    return tensors, {k: (tuple(v.shape), str(v.dtype), -1) for k, v in tensors.items()}


def _safetensors_header(fd: int) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (8 bytes of length, then JSON; ``safe_open`` has checked it) and
    where its data starts."""
    length = int.from_bytes(os.pread(fd, 8, 0), "little")
    header = json.loads(os.pread(fd, length, 8))
    header.pop("__metadata__", None)
    return header, 8 + length


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
