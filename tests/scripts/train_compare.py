"""Train a toy model on 2 gloo ranks with a given strategy and write what happened as JSON.

Run as a script (Lightning's launcher re-runs this file for rank 1):
    python train_compare.py --model mlp --strategy osdp --budget 3MiB --out result.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import lightning as L
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from toy_models import MODELS  # noqa: E402

import osdp_lightning  # noqa: E402,F401  (registers "osdp")
from osdp_lightning import OSDPStrategy, TrainingSummary  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="mlp", choices=sorted(MODELS))
    parser.add_argument("--strategy", default="osdp")
    parser.add_argument("--uniform", default=None, help="replicate | zero2 | zero3")
    parser.add_argument("--budget", default=None)
    parser.add_argument("--plan", default=None, help="plan JSON to apply")
    parser.add_argument("--split-factors", default="2,4,8")
    parser.add_argument("--micro-batch", default=None, help="int or 'auto'")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    L.seed_everything(0, workers=True)
    model = MODELS[args.model]()
    if args.strategy == "osdp":
        factors = tuple(int(k) for k in args.split_factors.split(",") if k)
        micro = args.micro_batch if args.micro_batch in (None, "auto") else int(args.micro_batch)
        strategy = OSDPStrategy(memory_budget=args.budget, uniform_choice=args.uniform, plan=args.plan,
                                split_factors=factors, micro_batch_size=micro)
    else:
        strategy = args.strategy
    summary = TrainingSummary()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=args.devices, max_steps=args.steps,
                        precision=args.precision, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[summary],
                        deterministic=True)
    trainer.fit(model)
    result = {"rank": trainer.global_rank, "losses": model.losses, "summary": summary.summary}
    plan = getattr(trainer.strategy, "_plan", None)
    if plan is not None:
        result["plan"] = plan.to_dict()
    gathered = [None] * trainer.world_size
    if dist.is_initialized():
        dist.all_gather_object(gathered, result)
    else:
        gathered = [result]
    if trainer.global_rank == 0:
        Path(args.out).write_text(json.dumps(gathered, indent=1))
        if plan is not None:
            print(plan.format_table())
        print(summary.format())
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
