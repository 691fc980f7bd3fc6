"""Train a small GPT with a Lightning Fabric loop on 2 gloo ranks (osdp or Fabric's own ddp) and
write what happened as JSON (rank 0's and rank 1's, ``OUT.rank<r>``).

    python fabric_train.py --strategy ddp --clip 0.5 --out ddp.json
    python fabric_train.py --strategy osdp --budget 70%ddp --clip 0.5 --out osdp.json
    python fabric_train.py --strategy osdp --hand-made-plan --clip 0.5 --accumulate 2 --out acc.json
    python fabric_train.py --strategy osdp --save-at 4 --ckpt-dir D --out a.json
    python fabric_train.py --strategy osdp --meta --optimizer-after-setup --resume D/step=4 --out b.json  # a's 5-8
    python fabric_train.py --lit --resume TRAINER.ckpt --save-at 8 --ckpt-dir D --out t.json

The model is the GPT of meta_train.py, trained on its loader (4 sequences per rank and step) with
AdamW: a plain ``nn.Module`` whose loss the loop computes (``loss_fn``, as litgpt does), or with
``--lit`` the recipe's LightningModule, its ``training_step``, optimizer groups, the Trainer's
warm-up-cosine schedule over ``--steps`` and the Trainer's shuffled sampler (so that it continues
a Trainer's run exactly).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from meta_train import CONFIG, HAND_MADE, loader
from osdp_lightning.recipes.gpt import GPT, GPTLitModule
from osdp_lightning.recipes.task import warmup_cosine
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler

from osdp_lightning import OSDPFabricStrategy
from osdp_lightning.cost.cluster import ClusterSpec
from osdp_lightning.plan.plan import Plan, fixed_plan
from osdp_lightning.profiling.estimate import estimate_profile
from osdp_lightning.profiling.records import with_parts
from osdp_lightning.state.checkpoint import model_state


def gpt_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["input_ids"])  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())


def lit_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model.training_step(batch, 0)  # Fabric redirects it through the strategy's root


def micro_batches(batch: dict[str, torch.Tensor], k: int) -> list[dict[str, torch.Tensor]]:
    return [dict(zip(batch, parts, strict=True)) for parts in zip(*(t.chunk(k) for t in batch.values()), strict=True)]


def trainer_like_loader(fabric: L.Fabric) -> DataLoader:
    """meta_train's loader as the Trainer samples it: a training loader is shuffled (seed 0)."""
    data = loader()
    sampler = DistributedSampler(data.dataset, num_replicas=fabric.world_size, rank=fabric.global_rank, shuffle=True,
                                 seed=0)
    return DataLoader(data.dataset, batch_size=data.batch_size, sampler=sampler, collate_fn=data.collate_fn)


def build(args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """The model, its AdamW and (``--lit``) the Trainer recipe's schedule, built as a user would."""
    if args.lit:
        model = GPTLitModule(GPT(CONFIG), lr=1e-3, warmup_steps=0)
        optimizer = model.configure_optimizers()["optimizer"]
        factor = functools.partial(warmup_cosine, warmup_steps=0, total_steps=args.steps)
        return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    model = GPT(CONFIG)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), None


def hand_made_plan() -> Plan:
    """meta_train's HAND_MADE (every kind of choice) for the bare GPT: the same units without ``net.``."""
    choices = {name.replace("net.", ""): choice for name, choice in HAND_MADE.items()}
    profile = estimate_profile(lambda: GPT(CONFIG), torch.zeros(4, CONFIG.block_size, dtype=torch.long),
                               peak_flops_per_s=1e12, with_parts=True)
    profile = with_parts(profile, ["h.2"])
    cluster = ClusterSpec(world_size=2, memory_budget_bytes=2**40, collective_latency_s=1e-4, bandwidth_bytes_per_s=1e9)
    return fixed_plan(profile, cluster, [choices[u.name] for u in profile.units], source="hand-made")


def strategy(args: argparse.Namespace) -> Any:
    if args.strategy == "ddp":
        return "ddp"
    example = next(iter(loader()))  # NOTE: one micro-batch: what each forward sees
    example = micro_batches(example, args.accumulate)[0]
    return OSDPFabricStrategy(memory_budget=args.budget, plan=hand_made_plan() if args.hand_made_plan else None,
                              example_batch=example, loss_fn=None if args.lit else gpt_loss,
                              accumulate_grad_batches=args.accumulate,
                              save_distributed_checkpoint=not args.consolidated)


def train(fabric: L.Fabric, args: argparse.Namespace) -> dict[str, Any]:
    with fabric.init_module(empty_init=args.meta):
        model, optimizer, scheduler = build(args)
    if args.optimizer_after_setup:  # Fabric's order for FSDP: the model, then an optimizer over its shards
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1))
    else:
        model, optimizer = fabric.setup(model, optimizer)
    initial = local_state_ok(model)  # as setup left it (a meta-built model: materialized)
    data = fabric.setup_dataloaders(trainer_like_loader(fabric) if args.lit else loader(),
                                    use_distributed_sampler=not args.lit)
    loss_fn, start, state = lit_loss if args.lit else gpt_loss, 0, {"model": model, "optimizer": optimizer, "step": 0}
    if args.resume:
        rest = fabric.load(args.resume, state, strict=False)
        start = int(state.get("step") or rest.get("global_step") or 0)
        if scheduler is not None:
            scheduler.load_state_dict(rest["lr_schedulers"][0])
    losses, norms = [], []
    for step, batch in enumerate(data):
        if step < start:
            continue
        if step >= args.steps:
            break
        total = 0.0
        for i, micro in enumerate(micro_batches(batch, args.accumulate)):
            with fabric.no_backward_sync(model, enabled=i < args.accumulate - 1):
                loss = loss_fn(model, micro) / args.accumulate
                fabric.backward(loss)
            total += float(loss.detach())
        if args.clip:
            norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=args.clip)))
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(total)
        state["step"] = step + 1
        if args.save_at == step + 1:
            fabric.save(Path(args.ckpt_dir) / f"step={step + 1}", state)
    facts = osdp_facts(fabric, model)
    if args.load_raw:
        facts["load_raw_sums"] = load_raw_round_trip(fabric, model, Path(args.load_raw))
    return {"losses": losses, "norms": norms, "initial_ok": initial, **facts}


def load_raw_round_trip(fabric: L.Fabric, model: nn.Module, path: Path) -> dict[str, float]:
    """The whole state written by rank 0, the model zeroed, then ``fabric.load_raw``: the sum of
    each whole tensor afterwards."""
    module = fabric.strategy.module
    full = model_state(module, full=True)
    if fabric.global_rank == 0:
        torch.save(full, path)
    fabric.barrier()
    with torch.no_grad():
        for param in module.parameters():
            (param.to_local() if isinstance(param, DTensor) else param).zero_()
    fabric.load_raw(path, model)
    return {k: float(v.double().sum()) for k, v in model_state(module, full=True).items()}


def local_state_ok(model: nn.Module) -> bool:
    """Every tensor this rank holds is allocated (not meta) and finite."""
    tensors = [t.to_local() if isinstance(t, DTensor) else t for t in model.state_dict().values()]
    return all(not t.is_meta and bool(torch.isfinite(t).all()) for t in tensors)


def osdp_facts(fabric: L.Fabric, model: nn.Module) -> dict[str, Any]:
    """The plan, how it was profiled, and the sum of each whole tensor (a collective)."""
    if not isinstance(fabric.strategy, OSDPFabricStrategy):
        return {}
    plan = fabric.strategy.plan
    sums = {k: float(v.double().sum()) for k, v in model_state(fabric.strategy.module, full=True).items()}
    return {"plan": {u.name: u.choice for u in plan.units}, "profiled_whole": fabric.strategy.profiled_whole,
            "sums": sums, "fits": {b.choice: b.fits for b in plan.baselines}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="osdp", choices=("osdp", "ddp"))
    parser.add_argument("--budget", default="70%ddp")
    parser.add_argument("--hand-made-plan", action="store_true", help="apply HAND_MADE instead of solving")
    parser.add_argument("--lit", action="store_true", help="the recipe's LightningModule and schedule")
    parser.add_argument("--meta", action="store_true", help="build under fabric.init_module(empty_init=True)")
    parser.add_argument("--optimizer-after-setup", action="store_true",
                        help="fabric.setup_module, then fabric.setup_optimizers (else fabric.setup(model, optimizer))")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--clip", type=float, default=0.0)
    parser.add_argument("--save-at", type=int, default=0)
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--consolidated", action="store_true", help="save one file (save_distributed_checkpoint=False)")
    parser.add_argument("--load-raw", default=None, help="after training: a full state dict there, back via load_raw")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy(args))
    fabric.launch()
    fabric.seed_everything(0)
    try:
        result = train(fabric, args)
    except Exception as err:  # the test reads which error every rank raised
        result = {"error": f"{type(err).__name__}: {err}"}
    Path(f"{args.out}.rank{fabric.global_rank}").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
