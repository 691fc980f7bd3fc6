"""Train a GPT built on the meta device (``trainer.init_module(empty_init=True)``) on 2 gloo ranks,
or the same GPT built eagerly, and write what happened as JSON.

    python meta_train.py --strategy osdp --meta --budget 60%ddp --seed-weights seed.pt --out r.json
    python meta_train.py --strategy ddp --seed-weights seed.pt --out ddp.json
    python meta_train.py --meta --save-every 3 --ckpt-dir ckpts --out a.json   # then --resume ckpts/step=3.ckpt

``--seed-weights``: a state dict (``torch.save(model.state_dict())``) every run starts from: loaded
into the eager model before ``fit``, or through the strategy once it has sharded the meta one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from osdp_lightning.recipes.gpt import GPT, GPTConfig, GPTLitModule
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import osdp_lightning  # noqa: F401  (registers "osdp")
from osdp_lightning import OSDPStrategy
from osdp_lightning.cost.cluster import ClusterSpec
from osdp_lightning.plan.plan import Plan, fixed_plan
from osdp_lightning.profiling.estimate import estimate_profile
from osdp_lightning.profiling.records import with_parts

CONFIG = GPTConfig(vocab_size=384, block_size=32, n_layer=3, n_head=4, n_embd=64, dropout=0.0)


class UninitializedGPT(GPTLitModule):
    """A GPT with one parameter that no ``reset_parameters`` reaches (a bad model for meta init)."""

    def __init__(self) -> None:
        super().__init__(GPT(CONFIG), lr=1e-3, warmup_steps=0)
        self.scale = nn.Parameter(torch.ones(64))


def build(kind: str) -> GPTLitModule:
    return UninitializedGPT() if kind == "uninit" else GPTLitModule(GPT(CONFIG), lr=1e-3, warmup_steps=0)


def loader() -> DataLoader:
    tokens = torch.randint(0, CONFIG.vocab_size, (64, CONFIG.block_size + 1), generator=torch.Generator().manual_seed(5))
    data = TensorDataset(tokens)

    def collate(rows: list) -> dict[str, torch.Tensor]:
        t = torch.stack([r[0] for r in rows])
        return {"input_ids": t[:, :-1], "labels": t[:, 1:]}
    return DataLoader(data, batch_size=4, collate_fn=collate)


class Record(L.Callback):
    def __init__(self, seed_weights: str | None) -> None:
        self.seed_weights, self.losses, self.initial_state = seed_weights, [], {}

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.seed_weights and isinstance(trainer.strategy, OSDPStrategy):
            trainer.strategy.load_model_state_dict({"state_dict": torch.load(self.seed_weights)})
        self.initial_state = local_state(pl_module)  # as setup left it (a resumed run: before restoring)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, i) -> None:  # noqa: ANN001
        self.losses.append(float(outputs["loss"]))


def local_state(module: nn.Module) -> dict:
    """Per parameter: whether this rank holds it whole (replicated) or a shard, its finiteness and sum."""
    out = {}
    for name, p in module.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        out[name] = {"sharded": isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements),
                     "finite": bool(torch.isfinite(local).all()), "sum": float(local.detach().double().sum()),
                     "std": float(local.detach().float().std()) if local.numel() > 1 else 0.0,
                     "meta": local.is_meta}
    return out


HAND_MADE = {"net.wte+net.lm_head": "zero3", "net.wpe": "zero2", "net.h.0": "replicate", "net.h.1": "zero2+ckpt",
             "net.h.2.attn.c_attn": "zero3", "net.h.2.attn.c_proj": "replicate",
             "net.h.2.mlp.c_fc": "split(k=2, sharded=1)", "net.h.2.mlp.c_proj": "zero2", "": "replicate"}
"""A mixed plan with every kind of choice, the last block descended into its parts."""


def hand_made_plan() -> Plan:
    """:data:`HAND_MADE` priced on the dry-run profile of the same GPT (shapes only, nothing built)."""
    profile = estimate_profile(lambda: build("gpt"), {"input_ids": torch.zeros(4, CONFIG.block_size, dtype=torch.long),
                                                      "labels": torch.zeros(4, CONFIG.block_size, dtype=torch.long)},
                               peak_flops_per_s=1e12, with_parts=True)
    profile = with_parts(profile, ["net.h.2"])
    cluster = ClusterSpec(world_size=2, memory_budget_bytes=2**40, collective_latency_s=1e-4, bandwidth_bytes_per_s=1e9)
    return fixed_plan(profile, cluster, [HAND_MADE[u.name] for u in profile.units], source="hand-made")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="osdp")
    parser.add_argument("--model", default="gpt", choices=("gpt", "uninit"))
    parser.add_argument("--meta", action="store_true")
    parser.add_argument("--budget", default=None)
    parser.add_argument("--hand-made-plan", action="store_true", help="apply HAND_MADE instead of solving")
    parser.add_argument("--seed-weights", default=None)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--save-every", type=int, default=0, help="a checkpoint every N steps into --ckpt-dir")
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--resume", default=None, help="trainer.fit(ckpt_path=...)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    L.seed_everything(0)
    plan = hand_made_plan() if args.hand_made_plan else None
    strategy = OSDPStrategy(memory_budget=args.budget, plan=plan) if args.strategy == "osdp" else args.strategy
    record = Record(args.seed_weights)
    saving = [ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.save_every, save_top_k=-1,
                              filename="{step}")] if args.save_every else []
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, logger=False,
                        enable_checkpointing=bool(saving), enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[record, *saving], precision=args.precision)
    with trainer.init_module(empty_init=args.meta):
        model = build(args.model)
    if args.seed_weights and args.strategy != "osdp":
        model.load_state_dict(torch.load(args.seed_weights))
    result: dict = {}
    try:
        trainer.fit(model, loader(), ckpt_path=args.resume)
        result = {"losses": record.losses, "state": record.initial_state,
                  "plan": {u.name: u.choice for u in trainer.strategy.plan.units} if args.strategy == "osdp" else {}}
    except Exception as err:  # the test reads which error every rank raised
        result = {"error": f"{type(err).__name__}: {err}"}
    rank = dist.get_rank() if dist.is_initialized() else 0
    Path(f"{args.out}.rank{rank}").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
