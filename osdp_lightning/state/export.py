"""A checkpoint osdp saved, as a Hugging Face model directory ``from_pretrained`` loads.

:func:`export_hf` reads the model's tensors of either checkpoint layout (a sharded
``torch.distributed.checkpoint`` directory, read in this one process without a process group, or
a consolidated ``.ckpt``, mapped) one output file at a time: at most ``max_shard_bytes`` of
tensors (or one larger tensor) are in memory at once. Keys lose the LightningModule's prefix
(``net.``) so they are the Hugging Face model's own; tied duplicates are written once, under the
first name in the model's parameter order, as ``save_pretrained`` does; files above the size are
sharded as ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``.
``config.json`` comes from the pretrained model's directory (or the given model's config), its
``dtype`` set to the dtype the tensors are written in.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from osdp_lightning.state.checkpoint import _read_dcp_metadata, _torch_load, check_checkpoint
from osdp_lightning.state.weight_files import (
    HF_EXTRA_HINT,
    SAFETENSORS_INDEX_NAME,
    SAFETENSORS_NAME,
    KeyMap,
    best_key_map,
    import_safetensors,
)

DEFAULT_MAX_SHARD_BYTES = 2 * 10**9
"""Largest output file before the export is sharded (``"2GB"``)."""
_STATE = "state_dict."
_CONFIG_FILES = ("config.json", "generation_config.json")


@dataclass(frozen=True)
class ExportReport:
    """What :func:`export_hf` wrote."""
    out_dir: Path
    files: tuple[str, ...]
    tensors: int
    total_bytes: int
    key_map: KeyMap
    tied_skipped: tuple[str, ...]
    """Checkpoint keys not written because they are tied to a key that is."""
    left_out: tuple[str, ...]
    """Checkpoint keys the Hugging Face model has no tensor for (other modules of the LightningModule)."""


@dataclass(frozen=True)
class _HFLayout:
    keys: tuple[str, ...]
    """The model's state-dict keys, tied names included."""
    written_name: dict[str, str]
    """Each key -> the key its tensor is written under (itself, or the first of its tie group)."""
    config: Any


def export_hf(checkpoint_path: str | Path, out_dir: str | Path, config_dir_or_model: str | Path | nn.Module,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, prefix: str | None = None) -> ExportReport:
    """Write the model of an osdp checkpoint as a Hugging Face directory (see the module docstring).

    ``config_dir_or_model``: the pretrained model's directory (its ``config.json`` is copied) or a
    Hugging Face model (its keys and ``config``). ``prefix``: what the checkpoint's keys have
    before the model's (``"net."``); ``None``: found from the keys. Raises ``ValueError`` when the
    checkpoint lacks a tensor of the model or ``out_dir`` already holds weights.
    """
    out_dir = Path(out_dir)
    layout = _hf_layout(config_dir_or_model)
    reader = _CheckpointReader(Path(checkpoint_path))
    key_map = best_key_map(reader.shapes, layout.keys, add="", strip=prefix, max_strip_parts=4)
    names = {key_map(k): k for k in reader.shapes if key_map(k) in layout.written_name}
    chosen: dict[str, str] = {}  # name written -> checkpoint key read (any name of a tie group)
    for name in layout.keys:
        if name in names:
            chosen.setdefault(layout.written_name[name], names[name])
    lacking = sorted({layout.written_name[k] for k in layout.keys} - set(chosen))
    if lacking:
        raise ValueError(f"{checkpoint_path} lacks {len(lacking)} tensor(s) of the model ({', '.join(lacking[:5])}) "
                         f"with its keys read with {key_map}; pass prefix= (osdp-export --prefix) if that is wrong")
    _check_out_dir(out_dir)
    groups = list(_shard_groups(chosen, reader, max_shard_bytes))
    files = [_file_name(i, len(groups)) for i in range(len(groups))]
    safetensors = import_safetensors()
    weight_map: dict[str, str] = {}
    for file, group in zip(files, groups, strict=True):
        tensors = reader.read([chosen[name] for name in group])  # NOTE: one output file's tensors at a time
        safetensors.torch.save_file({name: tensors[chosen[name]].contiguous() for name in group},
                                    str(out_dir / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, file))
        del tensors
    total_bytes = sum(reader.nbytes(k) for k in chosen.values())
    if len(files) > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / SAFETENSORS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    _write_config(config_dir_or_model, layout, out_dir, _floating_dtype(reader, chosen.values()))
    used = set(chosen.values())
    return ExportReport(out_dir=out_dir, files=tuple(files), tensors=len(chosen), total_bytes=total_bytes,
                        key_map=key_map, tied_skipped=tuple(sorted(set(names.values()) - used)),
                        left_out=tuple(sorted(k for k in reader.shapes if k not in set(names.values()))))


class _CheckpointReader:
    """The model tensors of an osdp checkpoint, by key; read a few at a time."""

    def __init__(self, path: Path) -> None:
        self.path, self.layout = path, check_checkpoint(path)
        if self.layout == "sharded":
            metadata = _read_dcp_metadata(path).state_dict_metadata  # refuses a .metadata that would run code
            self._meta = {k[len(_STATE):]: v for k, v in metadata.items() if k.startswith(_STATE) and hasattr(v, "size")}
            self.shapes = {k: tuple(v.size) for k, v in self._meta.items()}
            self.dtypes = {k: v.properties.dtype for k, v in self._meta.items()}
        else:
            self._mapped = _torch_load(path, "checkpoint", mmap=True)["state_dict"]
            self.shapes = {k: tuple(v.shape) for k, v in self._mapped.items() if isinstance(v, torch.Tensor)}
            self.dtypes = {k: self._mapped[k].dtype for k in self.shapes}

    def nbytes(self, key: str) -> int:
        return _numel(self.shapes[key]) * self.dtypes[key].itemsize

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        if self.layout != "sharded":
            return {k: self._mapped[k] for k in keys}
        state = {k: torch.empty(self.shapes[k], dtype=self.dtypes[k]) for k in keys}
        with warnings.catch_warnings():  # NOTE: DCP warns that there is no process group: none is meant
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load({"state_dict": state}, checkpoint_id=self.path, no_dist=True)  # only these keys' bytes
        return state


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _shard_groups(chosen: dict[str, str], reader: _CheckpointReader, max_shard_bytes: int) -> Iterator[list[str]]:
    """Output names in model order, cut into files of at most ``max_shard_bytes`` (a larger tensor alone)."""
    group: list[str] = []
    group_bytes = 0
    for name, key in chosen.items():
        size = reader.nbytes(key)
        if group and group_bytes + size > max_shard_bytes:
            yield group
            group, group_bytes = [], 0
        group.append(name)
        group_bytes += size
    if group:
        yield group


def _file_name(index: int, count: int) -> str:
    return SAFETENSORS_NAME if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def _check_out_dir(out_dir: Path) -> None:
    if any(out_dir.glob("*.safetensors")) or (out_dir / SAFETENSORS_INDEX_NAME).exists():
        raise ValueError(f"{out_dir} already holds model weights; export into an empty directory")
    out_dir.mkdir(parents=True, exist_ok=True)


# -- the Hugging Face side: keys, ties, config ----------------------------------------------------
def _hf_layout(config_dir_or_model: str | Path | nn.Module) -> _HFLayout:
    """The model's keys and ties, from a model or from a config (the model built on the meta device)."""
    if isinstance(config_dir_or_model, nn.Module):
        model, config = config_dir_or_model, getattr(config_dir_or_model, "config", None)
    else:
        model, config = _meta_model_of(Path(config_dir_or_model))
    first_of: dict[int, str] = {}
    written: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        written[name] = first_of.setdefault(id(param), name)
    keys = tuple(model.state_dict(keep_vars=True))
    return _HFLayout(keys, {k: written.get(k, k) for k in keys}, config)


def _meta_model_of(config_dir: Path) -> tuple[nn.Module, Any]:
    if not (config_dir / "config.json").is_file():
        raise FileNotFoundError(f"{config_dir / 'config.json'} does not exist: give the pretrained model's "
                                "directory (osdp-export --config DIR)")
    try:
        import transformers
    except ImportError as err:  # pragma: no cover - the dev extra installs it
        raise ImportError(f"exporting a Hugging Face model needs transformers: {HF_EXTRA_HINT}") from err
    config = transformers.AutoConfig.from_pretrained(config_dir)
    architectures = getattr(config, "architectures", None) or []
    model_class = getattr(transformers, architectures[0], None) if architectures else None
    with torch.device("meta"):  # NOTE: shapes and ties only; nothing is allocated
        if model_class is not None:
            return model_class(config), config
        return transformers.AutoModelForCausalLM.from_config(config), config


def _floating_dtype(reader: _CheckpointReader, keys: Any) -> torch.dtype | None:
    floating = [reader.dtypes[k] for k in keys if reader.dtypes[k].is_floating_point]
    return max(set(floating), key=floating.count) if floating else None


def _write_config(source: str | Path | nn.Module, layout: _HFLayout, out_dir: Path, dtype: torch.dtype | None) -> None:
    """``config.json`` (and ``generation_config.json``) into ``out_dir``, saying the written dtype."""
    if isinstance(source, nn.Module):
        if layout.config is None or not hasattr(layout.config, "save_pretrained"):
            raise ValueError(f"{type(source).__name__} has no Hugging Face config to write as config.json")
        layout.config.save_pretrained(out_dir)
    else:
        for name in _CONFIG_FILES:
            if (Path(source) / name).is_file():
                shutil.copyfile(Path(source) / name, out_dir / name)
    config_file = out_dir / "config.json"
    config = json.loads(config_file.read_text())
    # NOTE: from_pretrained loads in the config's dtype; it must be the one the tensors are written in
    for key in ("dtype", "torch_dtype"):
        if key in config and dtype is not None:
            config[key] = str(dtype).removeprefix("torch.")
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
