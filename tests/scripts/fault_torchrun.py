"""Training under ``torchrun --max-restarts`` that survives SIGKILLed ranks (run by torchrun).

    python -m torch.distributed.run --nproc-per-node=2 --max-restarts=2 --rdzv-backend=c10d \
        --rdzv-endpoint=127.0.0.1:0 fault_torchrun.py --plan plan.json --ckpt-dir C --out O \
        --kill-mid-save-step 12 --kill-at-step 14

Attempt 0: rank 1 kills itself with SIGKILL right after writing its shard of the step-12
checkpoint (a crash mid-save). Attempt 1: rank 1 kills itself when step 14 starts. Every attempt
resumes with ``ckpt_path="last"``; rank 0 appends what it found to ``O/attempts.jsonl`` and the
finishing attempt writes ``O/final.pt`` and ``O/final.json``. Without kill flags it is the
uninterrupted reference run with the same checkpointing schedule.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.distributed.checkpoint import FileSystemWriter

sys.path.insert(0, str(Path(__file__).parent))
from ckpt_run import ResumeMLP, whole_state  # noqa: E402

from osdp_lightning import OSDPStrategy  # noqa: E402
from osdp_lightning.state import checkpoint as checkpoint_io  # noqa: E402

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
RANK = int(os.environ.get("RANK", "0"))
_global_step = [0]


def kill_mid_save_at(step: int) -> None:
    """On attempt 0, rank 1 dies right after its shard of the step-``step`` checkpoint is on disk."""
    real_write = FileSystemWriter.write_data

    def write_then_die(self, plan, planner):  # noqa: ANN001, ANN202
        future = real_write(self, plan, planner)
        if ATTEMPT == 0 and RANK == 1 and _global_step[0] == step:
            future.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return future
    FileSystemWriter.write_data = write_then_die


class Faults(Callback):
    def __init__(self, kill_at_step: int) -> None:
        self.kill_at_step, self.losses = kill_at_step, []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if ATTEMPT == 1 and RANK == 1 and trainer.global_step + 1 == self.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        _global_step[0] = trainer.global_step
        self.losses.append((trainer.global_step, float(outputs["loss"])))


def record_attempt(ckpt_dir: Path, out: Path) -> None:
    """Rank 0: which checkpoints this attempt finds, and how unfinished saves are refused."""
    partials = {}
    for path in sorted(ckpt_dir.glob(".*")) if ckpt_dir.is_dir() else []:
        try:
            checkpoint_io.check_checkpoint(path)
            partials[path.name] = "accepted"
        except (checkpoint_io.IncompleteCheckpointError, FileNotFoundError) as err:
            partials[path.name] = f"{type(err).__name__}: {err}"
    last = ckpt_dir / "last.ckpt"
    entry = {"attempt": ATTEMPT, "partials": partials,
             "last_complete": checkpoint_io.is_complete_checkpoint(last),
             "last_step": checkpoint_io._global_step(last) if checkpoint_io.is_complete_checkpoint(last) else None,
             "latest": str(checkpoint_io.find_latest_checkpoint(ckpt_dir)) if ckpt_dir.is_dir() else None}
    with open(out / "attempts.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--ckpt-every", type=int, default=4)
    parser.add_argument("--kill-mid-save-step", type=int, default=0)
    parser.add_argument("--kill-at-step", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out, ckpt_dir = Path(args.out), Path(args.ckpt_dir)
    out.mkdir(parents=True, exist_ok=True)
    if RANK == 0:
        record_attempt(ckpt_dir, out)
    if args.kill_mid_save_step:
        kill_mid_save_at(args.kill_mid_save_step)

    L.seed_everything(0, workers=True)
    faults = Faults(args.kill_at_step)
    saver = ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=args.ckpt_every,
                            save_top_k=-1, save_last=True)
    trainer = L.Trainer(strategy=OSDPStrategy(plan=args.plan), accelerator="cpu", devices=2,
                        max_steps=args.steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[faults, saver], deterministic=True)
    trainer.fit(ResumeMLP(width=64), ckpt_path="last")
    final = whole_state(trainer)
    losses = [None] * trainer.world_size
    dist.all_gather_object(losses, faults.losses)
    if trainer.global_rank == 0:
        torch.save(final, out / "final.pt")
        (out / "final.json").write_text(json.dumps({"attempt": ATTEMPT, "global_step": trainer.global_step,
                                                    "losses": losses}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
