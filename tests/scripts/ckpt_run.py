"""Train the toy MLP with the osdp strategy, checkpointing and/or resuming; record what happened.

Run as a script (Lightning's launcher re-runs this file for rank 1), e.g.:
    python ckpt_run.py --steps 10 --plan plan.json --ckpt-dir ckpts --ckpt-every 5 --out run_b
    python ckpt_run.py --steps 20 --plan plan.json --resume ckpts/step=10.ckpt --out run_c

Writes to --out: ``record.json`` (per rank: step, lr, batch fingerprint, loss), ``final.pt``
(whole canonical model and optimizer state after training) and, when resuming, ``start.pt`` (the
same right after the checkpoint was loaded).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

sys.path.insert(0, str(Path(__file__).parent))
from torch.utils.data import TensorDataset  # noqa: E402
from toy_models import MLP  # noqa: E402

import osdp_lightning  # noqa: E402,F401  (registers "osdp")
from osdp_lightning import OSDPStrategy  # noqa: E402
from osdp_lightning.state import checkpoint as checkpoint_io  # noqa: E402
from osdp_lightning.state.resume import ResumableDataLoader  # noqa: E402


class ResumeMLP(MLP):
    """The toy MLP with a per-step learning-rate schedule and a resumable loader."""

    def __init__(self, width: int, frozen: bool = False) -> None:
        super().__init__(width=width)
        if frozen:  # the first layer is frozen: no gradient, no optimizer state
            self.net[0].requires_grad_(False)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=1e-2)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.8)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self) -> ResumableDataLoader:
        data = self.make_data(torch.Generator().manual_seed(1234))
        return ResumableDataLoader(TensorDataset(*data), batch_size=self.batch_size, shuffle=True,
                                   generator=torch.Generator().manual_seed(7))


def whole_state(trainer: L.Trainer) -> dict[str, Any]:
    """Canonical model and optimizer state as whole tensors (rank 0; a collective)."""
    module = trainer.lightning_module
    return {"model": checkpoint_io.model_state(module, full=True),
            "optimizers": [checkpoint_io.optimizer_state(module, opt, full=True) for opt in trainer.optimizers]}


class Recorder(Callback):
    def __init__(self, out: Path, resuming: bool) -> None:
        self.out, self.resuming, self.steps = out, resuming, []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        state = whole_state(trainer)
        if self.resuming and trainer.global_rank == 0:
            torch.save({**state, "global_step": trainer.global_step}, self.out / "start.pt")

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        x = batch[0]
        self.steps.append({"step": trainer.global_step + 1, "epoch": trainer.current_epoch,
                           "lr": trainer.optimizers[0].param_groups[0]["lr"],
                           "batch": float(x.double().sum()), "batch_idx": batch_idx})

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.steps[-1]["loss"] = float(outputs["loss"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--plan", default=None)
    parser.add_argument("--budget", default=None)
    parser.add_argument("--frozen", action="store_true")
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--ckpt-every", type=int, default=0)
    parser.add_argument("--consolidated", action="store_true", help="one file instead of a sharded directory")
    parser.add_argument("--resume", default=None)
    parser.add_argument("--save-after", action="store_true", help="trainer.save_checkpoint(OUT/after_fit.ckpt)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    L.seed_everything(0, workers=True)
    model = ResumeMLP(args.width, frozen=args.frozen)
    strategy = OSDPStrategy(plan=args.plan, memory_budget=args.budget,
                            save_distributed_checkpoint=not args.consolidated)
    recorder = Recorder(out, resuming=args.resume is not None)
    callbacks: list[Callback] = [recorder]
    if args.ckpt_every:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, filename="{step}", every_n_train_steps=args.ckpt_every,
                                         save_top_k=-1, save_last=True))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=args.devices, max_steps=args.steps,
                        logger=False, enable_checkpointing=bool(args.ckpt_every), enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks, deterministic=True)
    trainer.fit(model, ckpt_path=args.resume)
    if args.save_after:
        trainer.save_checkpoint(out / "after_fit.ckpt")
    final = whole_state(trainer)
    gathered = [None] * trainer.world_size
    record = {"rank": trainer.global_rank, "steps": recorder.steps, "global_step": trainer.global_step,
              "plan": {u.name: u.choice for u in trainer.strategy.plan.units}}
    if dist.is_initialized() and trainer.world_size > 1:
        dist.all_gather_object(gathered, record)
    else:
        gathered = [record]
    if trainer.global_rank == 0:
        torch.save(final, out / "final.pt")
        (out / "record.json").write_text(json.dumps(gathered, indent=1))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
