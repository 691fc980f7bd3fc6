"""One timed training run of the comparison benchmark (:mod:`benchmarks.compare`).

Run as a script on every rank (:func:`benchmarks.launch.run_ranks` starts them together, as torchrun
does), or once and Lightning's subprocess launcher re-runs this command line for the other ranks::

    python -m benchmarks.compare_worker --method zero3 --out run.json
    python -m benchmarks.compare_worker --method osdp --budget 123456789 --out run.json

Trains the GPT recipe on CPython's shipped docs with the osdp strategy (``--method osdp``) or one
of its FSDP2 baselines (``ddp`` = uniform replicate, ``zero2``, ``zero3``) and writes rank 0's
JSON: the training summary (median step seconds, tokens/s, measured peak bytes per rank), the
plan's predictions, setup seconds, a per-phase step breakdown, or why no plan fitted.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import pickle
import re
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy
from osdp_lightning.recipes.gpt import GPT, GPTConfig, GPTDataModule, GPTLitModule
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import osdp_lightning  # noqa: F401  (registers strategy="osdp")
from benchmarks.memory_limit import cgroup_anonymous_bytes, cgroup_peak_bytes, enter_memory_cgroup
from osdp_lightning import InfeasibleBudgetError, OSDPStrategy, TrainingSummary
from osdp_lightning.choices import BASELINES, resolve
from osdp_lightning.runtime.process_memory import process_status_bytes
from osdp_lightning.runtime.shutdown import release_at_exit

METHODS = {**{name: str(resolve(name)) for name in BASELINES if name != "ddp"}, "osdp-replicate": "replicate",
           "osdp": None, "osdp-default": None}
"""Method name -> the osdp strategy's ``uniform_choice`` (``None``: solve the ILP; ``osdp-default``:
at the strategy's default budget, where everything fits)."""
LIGHTNING_METHODS = {"ddp": "ddp", "fsdp2": "fsdp2", "fsdp2-ckpt": "fsdp2-ckpt"}
"""Method name -> Lightning's own strategy, what a user would otherwise run (``ddp``: torch DDP)."""
_SMALLEST_RE = re.compile(r"\((\d+) bytes")
PRECISIONS = ("32-true", "bf16-mixed")
"""``--precision``: the Trainer's. Under ``bf16-mixed`` the hand-written FSDP2 shards each block and the
root with torchtitan's policy (gather bf16, reduce fp32), as osdp's sharded units run."""
HAND_POLICIES = {"32-true": MixedPrecisionPolicy(),
                 "bf16-mixed": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}


class HandFSDP2GPT(GPTLitModule):
    """The GPT recipe sharded by hand, as Lightning documents FSDP2 (``ModelParallelStrategy``):
    ``fully_shard`` on each transformer block, then on the model (embeddings, final norm), each with
    ``mp_policy`` (``--precision``: :data:`HAND_POLICIES`)."""

    mp_policy = HAND_POLICIES["32-true"]

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for block in self.net.h:
            fully_shard(block, mesh=mesh, mp_policy=self.mp_policy)
        fully_shard(self.net, mesh=mesh, mp_policy=self.mp_policy)


class HandFSDP2CheckpointGPT(HandFSDP2GPT):
    """zero3 + activation checkpointing of every block, as a user sets it up by hand: torch's
    checkpointing, then ``fully_shard``, on each transformer block (the baseline for tight budgets)."""

    def configure_model(self) -> None:
        from torch.distributed._composable import checkpoint

        mesh = self.device_mesh["data_parallel"]
        for block in self.net.h:
            checkpoint(block)
            fully_shard(block, mesh=mesh, mp_policy=self.mp_policy)
        fully_shard(self.net, mesh=mesh, mp_policy=self.mp_policy)


HAND_MODULES = {"fsdp2": HandFSDP2GPT, "fsdp2-ckpt": HandFSDP2CheckpointGPT}


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
    parser.add_argument("--method", choices=sorted({*METHODS, *LIGHTNING_METHODS}), required=True)
    parser.add_argument("--budget", type=int, default=None, help="per-rank bytes (osdp)")
    parser.add_argument("--budget-covers", choices=("tensors", "process"), default="tensors",
                        help="what --budget bounds (OSDPConfig.budget_covers): the comparisons' budgets are shares of "
                             "measured tensor peaks; benchmarks.capacity's is a limit on the process")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4, help="micro-batch per rank")
    parser.add_argument("--vocab-size", type=int, default=384)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--precision", default="32-true", choices=PRECISIONS, help="the Trainer's precision")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--split-factors", default="2,4,8")
    parser.add_argument("--text-file", default=None, help="training text (default: CPython's docs, parsed per run)")
    parser.add_argument("--plan", default=None, help="a saved plan JSON to apply (osdp; no profile, no solve)")
    parser.add_argument("--meta", action="store_true",
                        help="build the model under trainer.init_module(empty_init=True) (osdp and the hand FSDP2)")
    parser.add_argument("--rlimit-data", type=int, default=None,
                        help="RLIMIT_DATA of this process in bytes: an allocation past it fails (benchmarks.capacity)")
    parser.add_argument("--cgroup-limit", type=int, default=None,
                        help="bytes this process may use from here on, in a memory cgroup of its own (0: no limit, "
                             "only measured): past them the kernel ends it (benchmarks.capacity, benchmarks.memory_limit)")
    parser.add_argument("--out", required=True)
    return parser


def build_trainer(args: argparse.Namespace, callbacks: list[Callback]) -> L.Trainer:
    factors = tuple(int(k) for k in args.split_factors.split(",") if k)
    if args.method in HAND_MODULES:  # FSDP2 as Lightning documents it (HandFSDP2GPT.configure_model)
        strategy = ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
    else:
        strategy = LIGHTNING_METHODS.get(args.method) or OSDPStrategy(
            memory_budget=args.budget, uniform_choice=METHODS[args.method], budget_covers=args.budget_covers,
            split_factors=factors, plan=args.plan)
    return L.Trainer(strategy=strategy, accelerator=args.accelerator, devices=args.devices,
                     max_steps=args.steps, precision=args.precision, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     limit_val_batches=0, callbacks=callbacks)


def run(args: argparse.Namespace) -> tuple[L.Trainer, dict[str, Any]]:
    """Train once; return the trainer and this rank's result record."""
    L.seed_everything(args.seed, workers=True)
    config = GPTConfig(vocab_size=args.vocab_size, block_size=args.seq_len, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd, dropout=0.0)
    data = GPTDataModule(seq_len=args.seq_len, batch_size=args.batch_size, text_files=args.text_file)
    summary, phases = TrainingSummary(tokens_per_sample=data.tokens_per_sample, module_memory=True), PhaseTimer()
    trainer = build_trainer(args, [summary, phases])
    # NOTE: Lightning's DDP cannot start from the meta device; every other method can.
    meta = args.meta and args.method != "ddp"
    with trainer.init_module(empty_init=True) if meta else contextlib.nullcontext():
        module = HAND_MODULES.get(args.method, GPTLitModule)(GPT(config))
    if args.method in HAND_MODULES:
        module.mp_policy = HAND_POLICIES[args.precision]
    record: dict[str, Any] = {"method": args.method, "budget_bytes": args.budget, "precision": args.precision,
                              "param_count": sum(p.numel() for p in module.parameters())}
    try:
        trainer.fit(module, datamodule=data)
    except InfeasibleBudgetError as err:  # raised on every rank (rank 0's error is broadcast)
        match = _SMALLEST_RE.search(str(err))
        record.update(status="infeasible", message=str(err),
                      smallest_feasible_bytes=int(match.group(1)) if match else None)
        return trainer, record
    if args.method in LIGHTNING_METHODS:
        return trainer, _lightning_record(trainer, record, summary, phases)
    strategy: OSDPStrategy = trainer.strategy  # type: ignore[assignment]
    plan = strategy.plan
    record.update(status="ok", summary=summary.summary, phases=phases.medians(), setup_s=strategy.setup_s,
                  choices=plan.choice_counts(), plan=plan.to_dict(),
                  profile_step_s=strategy.profile.step_s if strategy.profile else None,
                  profile=dataclasses.asdict(strategy.profile) if strategy.profile else None,
                  device=_device_name(trainer))
    return trainer, record


def _lightning_record(trainer: L.Trainer, record: dict[str, Any], summary: TrainingSummary,
                      phases: PhaseTimer) -> dict[str, Any]:
    """A Lightning strategy's record: measured figures only (no plan, nothing predicted)."""
    measured = dict(summary.summary)
    model = trainer.strategy.model
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) and not model.gradient_as_bucket_view:
        # NOTE: DDP's buckets (allocated in C++, invisible to MemTracker) hold a second copy of every gradient.
        buckets = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        measured["peak_bytes"] = int(measured["peak_bytes"]) + buckets
        record["ddp_bucket_bytes"] = buckets
    record.update(status="ok", summary=measured, phases=phases.medians(), setup_s={}, choices={f"Lightning strategy={record['method']}": 1},
                  plan=None, profile_step_s=None, profile=None, cluster=None, device=_device_name(trainer))
    return record


def _device_name(trainer: L.Trainer) -> str:
    device = trainer.strategy.root_device
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _save_pricing(trainer: L.Trainer, path: Path) -> None:
    """The profile and cluster the plan was priced with, as objects: benchmarks/regret.py prices other plans with them."""
    strategy = trainer.strategy
    if isinstance(strategy, OSDPStrategy) and strategy.profile is not None:
        path.write_bytes(pickle.dumps({"profile": strategy.profile, "cluster": strategy.cluster_spec()}))


def main() -> None:
    args = build_parser().parse_args()
    # NOTE: without destroying the group, multi-process runs abort at exit (-6); and the hand-written
    # FSDP2 leaves its groups referenced from the module's FSDP2 state, as osdp's would be. The exit
    # handler destroys the group and frees them while the interpreter is alive, not in its
    # finalization (one hand-FSDP2 run of 21 ended in SIGABRT after a finished fit before the handler did this).
    release_at_exit()
    if args.rlimit_data is not None:
        resource.setrlimit(resource.RLIMIT_DATA, (args.rlimit_data, args.rlimit_data))
    if args.cgroup_limit is not None:
        enter_memory_cgroup(args.cgroup_limit or None)
    trainer, record = run(args)
    record["process"] = process_status_bytes("VmHWM", "VmData")
    if args.cgroup_limit is not None:
        record["process"].update(cgroup_peak=cgroup_peak_bytes(), cgroup_anonymous=cgroup_anonymous_bytes())
    if trainer.global_rank == 0:
        Path(args.out).write_text(json.dumps(record, indent=1, default=str) + "\n")
        _save_pricing(trainer, Path(args.out).with_suffix(".pkl"))


if __name__ == "__main__":
    main()
