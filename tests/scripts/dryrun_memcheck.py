"""Check the dry run's per-rank memory against FSDPMemTracker under a fake process group.

One process, no GPU: for each world size a ``fake`` process group of that size is created, the
dry-run plan is applied with :func:`osdp_lightning.apply.apply.apply_plan` to the model on the meta
device, the model is materialised on fake tensors and one training step (forward, backward,
optimizer step) runs inside ``FSDPMemTracker``. Its peak is compared with the plan's
``predicted_peak_bytes``.

    python tests/scripts/dryrun_memcheck.py --model toy_gpt --world-sizes 8 64 --out figures.json
    python tests/scripts/dryrun_memcheck.py --model gpt_small --world-sizes 8 64
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import FSDPModule
from torch.testing._internal.distributed.fake_pg import FakeStore

from osdp_lightning.apply.apply import apply_plan
from osdp_lightning.choices import hsdp_choice, zero3_reshard_choice
from osdp_lightning.cost.budget import format_bytes
from osdp_lightning.cost.cluster import ClusterSpec
from osdp_lightning.plan.dryrun import dry_run_plan, estimate_profile
from osdp_lightning.plan.plan import Plan
from osdp_lightning.profiling.fakestep import build_meta_module, fake_batch, fake_mode, step_runner
from osdp_lightning.profiling.optim_state import configured_optimizer
from osdp_lightning.profiling.profile import logging_disabled
from osdp_lightning.profiling.records import ModelProfile
from osdp_lightning.runtime.meshes import build_meshes

RANKS_PER_NODE = 8
PEAK_FLOPS = 3.12e14


class _StepRoot(nn.Module):
    """The FSDP root: its forward runs the whole training step (as the strategy's wrapper does)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.run_loss = None

    def forward(self) -> torch.Tensor:
        return self.run_loss()


def tracked_peak(model, batch: object, plan: Plan, precision: str = "32-true") -> dict:  # noqa: ANN001
    """FSDPMemTracker's per-rank peak bytes (and by category) of one training step of ``plan``."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=plan.world_size)
    try:
        # NOTE: meshes and fully_shard run outside FakeTensorMode (mesh set-up reads rank lists);
        # on the meta device nothing is allocated, to_empty then makes the shards fake.
        meshes = build_meshes("cpu", plan.world_size)
        module = build_meta_module(model)
        root = _StepRoot(module)
        apply_plan(module, root, plan, meshes)
        mode = fake_mode()
        with mode:
            root.to_empty(device="cpu")
            optimizer = _optimizer(module)
            inputs = fake_batch(batch, mode)
            root.run_loss = step_runner(module, inputs, precision)
            with logging_disabled(module):
                _train_step(root, optimizer)  # NOTE: the optimizer state exists from the second step on
                tracker = _tracker(root, optimizer, tuple(t for t in torch.utils._pytree.tree_leaves(inputs)
                                                          if isinstance(t, torch.Tensor)))
                with tracker:
                    _train_step(root, optimizer)
            peak = tracker.get_tracker_snapshot("peak")
    finally:
        dist.destroy_process_group()
    (categories,) = peak.values()
    return {"peak_bytes": categories["Total"],
            "categories": {str(getattr(k, "value", k)): v for k, v in categories.items() if v and k != "Total"}}


def _tracker(root: nn.Module, optimizer: torch.optim.Optimizer, inputs: tuple[torch.Tensor, ...]) -> MemTracker:
    """FSDPMemTracker for an FSDP2 root; a plan that shards nothing has none (replicated units are
    plain tensors on DDP's reducer): MemTracker, as the strategy's TrainingSummary does."""
    if isinstance(root, FSDPModule):
        tracker = FSDPMemTracker(root, optimizer)
        tracker.track_inputs(inputs)
        return tracker
    tracker = MemTracker()
    tracker.track_external(root, optimizer, *inputs)
    return tracker


def _train_step(root: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    root().backward()
    optimizer.step()
    optimizer.zero_grad()


def _optimizer(module: nn.Module) -> torch.optim.Optimizer:
    return configured_optimizer(module) or torch.optim.Adam(module.parameters())


def toy_gpt_inputs() -> tuple:
    """A 4-layer GPT (3.4M parameters) and a meta batch of 4 x 128 tokens."""
    from osdp_lightning.recipes.gpt import GPT, GPTConfig, GPTLitModule

    config = GPTConfig(vocab_size=512, block_size=128, n_layer=4, n_head=4, n_embd=256)
    shape = (4, config.block_size)
    batch = {"input_ids": torch.empty(shape, dtype=torch.long, device="meta"),
             "labels": torch.empty(shape, dtype=torch.long, device="meta")}
    return (lambda: GPTLitModule(GPT(config))), batch


def recipe_inputs(model_name: str) -> tuple:
    from osdp_lightning.plan.dryrun import compose_config, recipe_model_and_batch

    factory, batch, _ = recipe_model_and_batch(compose_config([f"model={model_name}"]))
    return factory, batch


def cluster_for(world_size: int, budget_bytes: int) -> ClusterSpec:
    """An A100-like description: 8 ranks per node, a slower link across nodes."""
    return ClusterSpec(world_size=world_size, memory_budget_bytes=budget_bytes, collective_latency_s=2e-5,
                       bandwidth_bytes_per_s=2.3e11, overlap_efficiency=0.8,
                       ranks_per_node=min(RANKS_PER_NODE, world_size), inter_node_bandwidth_bytes_per_s=2.5e10,
                       inter_node_latency_s=5e-5, peak_flops_per_s=PEAK_FLOPS)


def plans_for(model, batch, profile: ModelProfile, world_size: int) -> dict[str, Plan]:  # noqa: ANN001
    """Uniform plans of every choice, and a solved plan under a budget between zero3 and replicate."""
    roomy = cluster_for(world_size, 2**50)
    uniform = ["replicate", "zero2", "zero3"]
    if world_size > RANKS_PER_NODE:
        uniform += [str(hsdp_choice(RANKS_PER_NODE)), str(zero3_reshard_choice(RANKS_PER_NODE))]
    plans = {c: dry_run_plan(model, batch, roomy, profile=profile, uniform_choice=c) for c in uniform}
    budget = (plans["zero3"].predicted_peak_bytes + plans["replicate"].predicted_peak_bytes) // 2
    plans["solved"] = dry_run_plan(model, batch, cluster_for(world_size, budget), profile=profile)
    # Checkpointing: every block recomputed, and a budget below all-zero3 that only checkpoints fit.
    plans["zero3+ckpt"] = dry_run_plan(model, batch, roomy, profile=profile, uniform_choice="zero3+ckpt")
    budget = (plans["zero3"].predicted_peak_bytes + plans["zero3+ckpt"].predicted_peak_bytes) // 2
    plans["solved, ckpt"] = dry_run_plan(model, batch, cluster_for(world_size, budget), profile=profile)
    return plans


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="toy_gpt", help="toy_gpt, or a conf/model name (gpt_small, bert_large)")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model, batch = toy_gpt_inputs() if args.model == "toy_gpt" else recipe_inputs(args.model)
    profile = estimate_profile(model, batch, peak_flops_per_s=PEAK_FLOPS)
    rows = []
    print(f"{args.model}: {profile.param_count:,} parameters, micro-batch {profile.micro_batch_size}")
    print(f"{'world':>5}  {'plan':<18} {'dry run':>11} {'tracker':>11} {'diff':>7}  choices")
    for world_size in args.world_sizes:
        for name, plan in plans_for(model, batch, profile, world_size).items():
            start = time.perf_counter()
            tracked = tracked_peak(model, batch, plan)
            predicted = plan.predicted_peak_bytes
            diff = (predicted - tracked["peak_bytes"]) / tracked["peak_bytes"]
            counts = {c: sum(u.choice == c for u in plan.units) for c in sorted({u.choice for u in plan.units})}
            # NOTE: the allowance tests/test_dryrun_memory.py gives plans with replicated units
            # (predicted over, never under: see its docstring).
            replicate_grad_bytes = sum(u.param_count for u in plan.units if u.choice == "replicate") * \
                profile.grad_bytes_per_element
            rows.append({"model": args.model, "world_size": world_size, "plan": name, "predicted_bytes": predicted,
                         "replicate_grad_bytes": replicate_grad_bytes,
                         "tracked_bytes": tracked["peak_bytes"], "relative_diff": diff, "choices": counts,
                         "tracked_categories": tracked["categories"], "track_s": time.perf_counter() - start})
            print(f"{world_size:>5}  {name:<18} {format_bytes(predicted):>11} {format_bytes(tracked['peak_bytes']):>11} "
                  f"{diff:>+7.1%}  {counts}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    sys.exit(main())
