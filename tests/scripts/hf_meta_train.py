"""Train a tiny Hugging Face Llama (GQA, rotary, tied embeddings) built on the meta device
(``trainer.init_module(empty_init=True)``) on 2 gloo ranks under a fixed mixed plan, and write what
happened as JSON (one file per rank, ``<out>.rank<r>``).

    python hf_meta_train.py --out r.json

The plan is fixed (planning skipped): each block its own choice, priced on the profile of an eager
copy of the same model. Written: the losses of 8 steps and, as setup left the model, whether the
rotary tables equal the ones the config gives, the embeddings are still tied and the final norm is 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import transformers as hf
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import osdp_lightning  # noqa: F401  (registers "osdp")
from osdp_lightning import OSDPStrategy
from osdp_lightning.choices import ChoiceOptions
from osdp_lightning.cost.cluster import ClusterSpec
from osdp_lightning.plan.measure import profile_lightning_module
from osdp_lightning.plan.plan import Plan, fixed_plan

VOCAB, SEQ, STEPS = 256, 32, 8
CONFIG = hf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)
CHOICES = ("zero3", "replicate", "zero2")
"""Taken in turn by the units (the root last, replicated), so that the plan mixes them."""


class TinyLlama(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = hf.LlamaForCausalLM(CONFIG)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(input_ids=batch["input_ids"], labels=batch["input_ids"], use_cache=False).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def loader() -> DataLoader:
    """Sequences counting up from a random start: learnable within a few steps."""
    start = torch.randint(0, VOCAB, (64, 1), generator=torch.Generator().manual_seed(5))
    data = TensorDataset((start + torch.arange(SEQ)) % VOCAB)
    return DataLoader(data, batch_size=4, collate_fn=lambda rows: {"input_ids": torch.stack([r[0] for r in rows])})


def mixed_plan() -> Plan:
    """:data:`CHOICES` in turn, priced on the profile of an eager copy (tiny: profiling it is quick)."""
    batch = next(iter(loader()))
    profile = profile_lightning_module(TinyLlama(), batch, repeats=1, choices=ChoiceOptions(activation_checkpointing="never"))
    cluster = ClusterSpec(world_size=2, memory_budget_bytes=2**40, collective_latency_s=1e-4, bandwidth_bytes_per_s=1e9)
    assignment = [CHOICES[i % len(CHOICES)] for i in range(len(profile.units) - 1)] + ["replicate"]
    return fixed_plan(profile, cluster, assignment, source="hand-made")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class Record(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.state: dict = {}

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        net = pl_module.net
        rotary = net.model.rotary_emb
        want, _ = rotary.compute_default_rope_parameters(CONFIG)
        self.state = {
            "rotary_exact": all(torch.equal(_local(getattr(rotary, n)).cpu(), want)
                                for n in ("inv_freq", "original_inv_freq")),
            "tied": net.lm_head.weight is net.model.embed_tokens.weight,
            "norms_one": bool(_local(net.model.norm.weight).eq(1).all()),
            "meta_left": any(_local(t).is_meta for t in (*pl_module.parameters(), *pl_module.buffers())),
        }

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, i) -> None:  # noqa: ANN001
        self.losses.append(float(outputs["loss"]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    L.seed_everything(0)
    record = Record()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=OSDPStrategy(plan=mixed_plan()), max_steps=STEPS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[record])
    with trainer.init_module(empty_init=True):
        model = TinyLlama()
    try:
        assert next(model.parameters()).is_meta, "init_module(empty_init=True) should build on the meta device"
        trainer.fit(model, loader())
        result = {"losses": record.losses, **record.state, "vocab_size": VOCAB,
                  "plan": {u.name: u.choice for u in trainer.strategy.plan.units}}
    except Exception as err:  # the test reads which error every rank raised
        result = {"error": f"{type(err).__name__}: {err}"}
    rank = dist.get_rank() if dist.is_initialized() else 0
    Path(f"{args.out}.rank{rank}").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
