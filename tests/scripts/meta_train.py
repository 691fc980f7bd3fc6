"""Train a GPT built on the meta device (``trainer.init_module(empty_init=True)``) on 2 gloo ranks,
or the same GPT built eagerly, and write what happened as JSON.

    python meta_train.py --strategy osdp --meta --budget 60%ddp --seed-weights seed.pt --out r.json
    python meta_train.py --strategy ddp --seed-weights seed.pt --out ddp.json

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
from osdp_lightning.recipes.gpt import GPT, GPTConfig, GPTLitModule
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import osdp_lightning  # noqa: F401  (registers "osdp")
from osdp_lightning import OSDPStrategy

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
        self.seed_weights, self.losses = seed_weights, []

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.seed_weights and isinstance(trainer.strategy, OSDPStrategy):
            trainer.strategy.load_model_state_dict({"state_dict": torch.load(self.seed_weights)})

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="osdp")
    parser.add_argument("--model", default="gpt", choices=("gpt", "uninit"))
    parser.add_argument("--meta", action="store_true")
    parser.add_argument("--budget", default=None)
    parser.add_argument("--seed-weights", default=None)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    L.seed_everything(0)
    strategy = OSDPStrategy(memory_budget=args.budget) if args.strategy == "osdp" else args.strategy
    record = Record(args.seed_weights)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[record])
    with trainer.init_module(empty_init=args.meta):
        model = build(args.model)
    if args.seed_weights and args.strategy != "osdp":
        model.load_state_dict(torch.load(args.seed_weights))
    result: dict = {}
    try:
        trainer.fit(model, loader())
        result = {"losses": record.losses, "state": local_state(model),
                  "plan": {u.name: u.choice for u in trainer.strategy.plan.units} if args.strategy == "osdp" else {}}
    except Exception as err:  # the test reads which error every rank raised
        result = {"error": f"{type(err).__name__}: {err}"}
    rank = dist.get_rank() if dist.is_initialized() else 0
    Path(f"{args.out}.rank{rank}").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
