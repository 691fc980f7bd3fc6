"""One timed training run of the comparison benchmark (:mod:`benchmarks.compare`).

Run as a script; Lightning's subprocess launcher re-runs this command line for the other ranks::

    python -m benchmarks.compare_worker --method zero3 --out run.json
    python -m benchmarks.compare_worker --method osdp --budget 123456789 --out run.json

Trains the GPT recipe on CPython's shipped docs with the osdp strategy (``--method osdp``) or one
of its FSDP2 baselines (``ddp`` = uniform replicate, ``zero2``, ``zero3``) and writes rank 0's
JSON: the training summary (median step seconds, tokens/s, measured peak bytes per rank), the
plan's predictions, setup seconds, a per-phase step breakdown, or why no plan fitted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

import osdp_lightning  # noqa: F401  (registers strategy="osdp")
from osdp_lightning import InfeasibleBudgetError, OSDPStrategy, TrainingSummary
from recipes.gpt import GPT, GPTConfig, GPTDataModule, GPTLitModule

METHODS = {"ddp": "replicate", "zero2": "zero2", "zero3": "zero3", "osdp": None}
"""Method name -> the strategy's ``uniform_choice`` (``None``: solve the ILP)."""
_SMALLEST_RE = re.compile(r"\((\d+) bytes")


class PhaseTimer(Callback):
    """Median seconds of forward (incl. zero_grad), backward and optimizer per step, after warm-up.

    Lightning's automatic optimization runs the closure (forward, backward) inside
    ``optimizer.step``; ``on_before_optimizer_step`` fires after the closure, before the update.
    """

    def __init__(self, warmup_steps: int = 2) -> None:
        self.warmup_steps = warmup_steps
        self._t: dict[str, float] = {}
        self.phases: dict[str, list[float]] = {"forward_s": [], "backward_s": [], "optimizer_s": []}

    def _now(self, trainer: L.Trainer) -> float:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)
        return time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        self._t = {"start": self._now(trainer)}

    def on_before_backward(self, trainer, pl_module, loss) -> None:  # noqa: ANN001
        self._t["backward"] = self._now(trainer)

    def on_after_backward(self, trainer, pl_module) -> None:  # noqa: ANN001
        self._t["after_backward"] = self._now(trainer)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # noqa: ANN001
        self._t["optimizer"] = self._now(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        t, end = self._t, self._now(trainer)
        if trainer.global_step <= self.warmup_steps or len(t) < 4:
            return
        self.phases["forward_s"].append(t["backward"] - t["start"])
        self.phases["backward_s"].append(t["after_backward"] - t["backward"])
        self.phases["optimizer_s"].append(end - t["optimizer"])

    def medians(self) -> dict[str, float]:
        return {k: statistics.median(v) for k, v in self.phases.items() if v}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=sorted(METHODS), required=True)
    parser.add_argument("--budget", type=int, default=None, help="per-rank bytes (osdp)")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4, help="micro-batch per rank")
    parser.add_argument("--vocab-size", type=int, default=384)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--split-factors", default="2,4,8")
    parser.add_argument("--text-file", default=None, help="training text (default: CPython's docs, parsed per run)")
    parser.add_argument("--plan", default=None, help="a saved plan JSON to apply (osdp; no profile, no solve)")
    parser.add_argument("--out", required=True)
    return parser


def build_trainer(args: argparse.Namespace, callbacks: list[Callback]) -> L.Trainer:
    factors = tuple(int(k) for k in args.split_factors.split(",") if k)
    strategy = OSDPStrategy(memory_budget=args.budget, uniform_choice=METHODS[args.method],
                            split_factors=factors, plan=args.plan)
    return L.Trainer(strategy=strategy, accelerator=args.accelerator, devices=args.devices,
                     max_steps=args.steps, precision="32-true", logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     limit_val_batches=0, callbacks=callbacks)


def run(args: argparse.Namespace) -> tuple[L.Trainer, dict[str, Any]]:
    """Train once; return the trainer and this rank's result record."""
    L.seed_everything(args.seed, workers=True)
    config = GPTConfig(vocab_size=args.vocab_size, block_size=args.seq_len, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd, dropout=0.0)
    data = GPTDataModule(seq_len=args.seq_len, batch_size=args.batch_size, text_files=args.text_file)
    module = GPTLitModule(GPT(config))
    summary, phases = TrainingSummary(tokens_per_sample=data.tokens_per_sample), PhaseTimer()
    trainer = build_trainer(args, [summary, phases])
    record: dict[str, Any] = {"method": args.method, "budget_bytes": args.budget,
                              "param_count": sum(p.numel() for p in module.parameters())}
    try:
        trainer.fit(module, datamodule=data)
    except InfeasibleBudgetError as err:  # raised on every rank (rank 0's error is broadcast)
        match = _SMALLEST_RE.search(str(err))
        record.update(status="infeasible", message=str(err),
                      smallest_feasible_bytes=int(match.group(1)) if match else None)
        return trainer, record
    strategy: OSDPStrategy = trainer.strategy  # type: ignore[assignment]
    plan = strategy.plan
    record.update(status="ok", summary=summary.summary, phases=phases.medians(), setup_s=strategy.setup_s,
                  choices=_choice_counts(plan), plan=plan.to_dict(),
                  profile_step_s=strategy.profile.step_s if strategy.profile else None,
                  profile=dataclasses.asdict(strategy.profile) if strategy.profile else None,
                  device=_device_name(trainer))
    return trainer, record


def _choice_counts(plan: osdp_lightning.Plan) -> dict[str, int]:
    counts: dict[str, int] = {}
    for unit in plan.units:
        counts[unit.choice] = counts.get(unit.choice, 0) + 1
    return counts


def _device_name(trainer: L.Trainer) -> str:
    device = trainer.strategy.root_device
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def main() -> None:
    args = build_parser().parse_args()
    trainer, record = run(args)
    if trainer.global_rank == 0:
        Path(args.out).write_text(json.dumps(record, indent=1, default=str) + "\n")
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()  # without it, multi-process runs abort at exit (-6)


if __name__ == "__main__":
    main()
