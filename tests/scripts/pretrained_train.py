"""Fine-tune a tiny Hugging Face Llama from a ``save_pretrained`` directory on 2 gloo ranks under a
hand-made plan with every kind of choice, then save a checkpoint; write what happened as JSON.

    python pretrained_train.py --pretrained DIR --ckpt run.ckpt --out r.json [--meta]

The model is built with other random weights (eagerly, or on the meta device with ``--meta``);
``OSDPStrategy(pretrained=DIR)`` fills it. Each rank records its first batch and loss, the bytes
it read of each tensor (every ``os.preadv`` of a safetensors file, placed by the file's header; every
``get_slice`` box apart), and what it holds of each tensor. Rank 0 writes the trained weights whole
(``<out>.final.pt``) for the export check.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import safetensors
import torch
import torch.distributed as dist
import transformers as hf
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import osdp_lightning  # noqa: F401  (registers "osdp")
from osdp_lightning import OSDPStrategy, PretrainedWeights
from osdp_lightning.cost.cluster import ClusterSpec
from osdp_lightning.plan.plan import Plan, fixed_plan
from osdp_lightning.profiling.estimate import estimate_profile
from osdp_lightning.profiling.records import with_parts
from osdp_lightning.state.canonical import model_state

CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
SEQ = 16
LAYER = "net.model.layers.1"
HAND_MADE = {"net.model.embed_tokens+net.lm_head": "zero3", "net.model.layers.0": "zero2+ckpt",
             f"{LAYER}.self_attn.q_proj": "zero3", f"{LAYER}.self_attn.k_proj": "replicate",
             f"{LAYER}.self_attn.v_proj": "zero2", f"{LAYER}.self_attn.o_proj": "split(k=2, sharded=1)",
             f"{LAYER}.mlp.gate_proj": "split(k=2, sharded=2)", f"{LAYER}.mlp.up_proj": "zero3",
             f"{LAYER}.mlp.down_proj": "replicate", "": "replicate"}
"""Replicate, zero2 (+ckpt), zero3, split (one or both slices sharded); the tied embedding sharded."""


class CausalLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = hf.LlamaForCausalLM(hf.LlamaConfig(**CONFIG))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(input_ids=batch["input_ids"], labels=batch["input_ids"], use_cache=False).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def reset_parameters(self) -> None:  # a meta-built model: transformers' own init, then the file's values
        for module in reversed(list(self.net.modules())):
            self.net._init_weights(module)


def hand_made_plan() -> Plan:
    batch = {"input_ids": torch.zeros(2, SEQ, dtype=torch.long)}
    profile = estimate_profile(CausalLM, batch, peak_flops_per_s=1e12, with_parts=True)
    profile = with_parts(profile, [LAYER])
    cluster = ClusterSpec(world_size=2, memory_budget_bytes=2**40, collective_latency_s=1e-4, bandwidth_bytes_per_s=1e9)
    return fixed_plan(profile, cluster, [HAND_MADE[u.name] for u in profile.units], source="hand-made")


def loader() -> DataLoader:
    tokens = torch.randint(0, CONFIG["vocab_size"], (16, SEQ), generator=torch.Generator().manual_seed(5))
    return DataLoader(TensorDataset(tokens), batch_size=2, collate_fn=lambda rows: {"input_ids": torch.stack([r[0] for r in rows])})


SLICE_READS: dict[str, list[int]] = {}
"""Per tensor name: the elements of every ``get_slice`` box this rank read from a safetensors file."""
PREADS: list[tuple[str, int, int]] = []
"""Every ``os.preadv`` this rank made: (file, offset, bytes read)."""
_ITEM_BYTES = {"F32": 4, "F16": 2, "BF16": 2}


class _RecordingFile:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._file = _SAFE_OPEN(*args, **kwargs)

    def __enter__(self) -> _RecordingFile:
        self._file.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._file.__exit__(*exc)

    def get_slice(self, name: str) -> Any:
        header = self._file.get_slice(name)

        class Slice:
            get_shape, get_dtype = header.get_shape, header.get_dtype

            def __getitem__(self, box: Any) -> torch.Tensor:
                block = header[box]
                SLICE_READS.setdefault(name, []).append(block.numel())
                return block
        return Slice()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


_SAFE_OPEN = safetensors.safe_open
_PREADV = os.preadv


def _recording_preadv(fd: int, buffers: Any, offset: int, *flags: int) -> int:
    got = _PREADV(fd, buffers, offset, *flags)
    PREADS.append((os.readlink(f"/proc/self/fd/{fd}"), offset, got))
    return got


def pread_elements(directory: Path) -> dict[str, list[int]]:
    """Per tensor name: the elements of every ``os.preadv`` that fell in its bytes (each must stay
    within one tensor's), placed by the safetensors headers of ``directory``."""
    spans: dict[str, list[tuple[int, int, str, int]]] = {}
    for file in directory.glob("*.safetensors"):
        raw = file.read_bytes()
        length = int.from_bytes(raw[:8], "little")
        header = {k: v for k, v in json.loads(raw[8:8 + length]).items() if k != "__metadata__"}
        spans[str(file.resolve())] = sorted((8 + length + v["data_offsets"][0], 8 + length + v["data_offsets"][1],
                                             k, _ITEM_BYTES[v["dtype"]]) for k, v in header.items())
    out: dict[str, list[int]] = {}
    for path, offset, got in PREADS:
        if path not in spans:
            continue  # NOTE: safetensors' own header reads, not osdp's
        file_spans = spans[path]
        begin, end, name, item = file_spans[bisect.bisect_right(file_spans, (offset, float("inf"))) - 1]
        assert begin <= offset and offset + got <= end, (name, offset, got)
        out.setdefault(name, []).append(got // item)
    return out


class Record(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.first_batch: list[list[int]] = []
        self.held: dict[str, int] = {}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
        if i == 0:
            self.first_batch = batch["input_ids"].tolist()
            self.held = held_elements(pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, i: int) -> None:
        self.losses.append(float(outputs["loss"]))


def held_elements(module: nn.Module) -> dict[str, int]:
    """Per parameter: the elements this rank holds (its rows of a sharded one, all of a replicated one)."""
    return {name: (p.to_local() if isinstance(p, DTensor) else p).numel() for name, p in module.named_parameters()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pretrained", required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--meta", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    L.seed_everything(123)  # other weights than the pretrained ones
    strategy = OSDPStrategy(plan=hand_made_plan(), pretrained=PretrainedWeights(args.pretrained))
    record = Record()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[record])
    with trainer.init_module(empty_init=args.meta):
        model = CausalLM()
    result: dict = {}
    # NOTE: osdp imports safe_open when it reads, so every read goes through the recording ones; put
    # back afterwards (the test's rank processes run other scripts after this one)
    safetensors.safe_open, os.preadv = _RecordingFile, _recording_preadv
    try:
        trainer.fit(model, loader())
        os.preadv = _PREADV
        trainer.save_checkpoint(args.ckpt)
        final = model_state(model, full=True)  # a collective: whole tensors on rank 0
        if trainer.global_rank == 0:
            torch.save(final, f"{args.out}.final.pt")
        result = {"losses": record.losses, "first_batch": record.first_batch, "held": record.held,
                  "reads": pread_elements(Path(args.pretrained)), "slice_reads": SLICE_READS,
                  "plan": {u.name: u.choice for u in strategy.plan.units}}
    except Exception as err:  # the test reads which error every rank raised
        result = {"error": f"{type(err).__name__}: {err}"}
    finally:
        safetensors.safe_open, os.preadv = _SAFE_OPEN, _PREADV
    rank = dist.get_rank() if dist.is_initialized() else 0
    Path(f"{args.out}.rank{rank}").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
