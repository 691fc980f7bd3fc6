"""The GPU check's bf16-mixed part: osdp's plans against hand-written FSDP2 with the same policy.

The GPT recipe is profiled under bf16 autocast, as ``Trainer(precision="bf16-mixed")`` profiles it,
so that its plans price sharded units the way they run: gathered in bf16, reduced in fp32
(``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``, torchtitan's
default). At each world size, under PyTorch's ``fake`` process group on one device (collectives do
nothing, every FSDP2 buffer is really allocated), each layout trains a few steps under autocast:

- osdp's uniform zero3 plan, and the ILP's plan under a budget halfway between all-replicate's and
  all-zero3's predicted peaks, applied by :func:`osdp_lightning.apply.apply.apply_plan`;
- FSDP2 by hand, as torchtitan and Lightning's docs write it: ``fully_shard`` on each block, then on
  the model, every call with the bf16 policy.

Each row: predicted and measured peak (the CUDA allocator; MemTracker on CPU), the bytes the
all-gathers of one step moved (counted at ``torch.distributed.all_gather_single``, which FSDP2
calls) and their bytes per element (bf16: 2; fp32 would be 4), and the median step seconds, which
under the fake group are compute and FSDP2's own work (no collective moves data).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from lightning.pytorch.strategies.strategy import _ForwardRedirection
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from benchmarks.gpu_check import _release, module_factory, real_batch
from osdp_lightning import ClusterSpec, format_bytes, make_plan
from osdp_lightning.apply.apply import apply_plan, step_groups_apart
from osdp_lightning.choices import ChoiceOptions
from osdp_lightning.integration.strategy import RootWrapper
from osdp_lightning.plan.pipeline import ProfileOptions, profile_model
from osdp_lightning.plan.plan import InfeasibleBudgetError, Plan
from osdp_lightning.profiling.profile import logging_disabled
from osdp_lightning.profiling.records import ModelProfile
from osdp_lightning.runtime.meshes import build_meshes

HAND_POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
TIMED_STEPS = {"cuda": 5, "cpu": 2}
"""Steps timed per layout (their median) after the tracked one; the CPU run is a dry check of the script."""
Layout = Callable[[nn.Module, int], nn.Module]
"""Shards the module for a world size in place; returns the module whose forward starts a step."""


def bf16_profile(args: argparse.Namespace, device: torch.device) -> ModelProfile:
    """The whole model's profile under bf16 autocast, priced for bf16 gathers and fp32 reductions."""
    torch.manual_seed(0)
    module = module_factory(args)().to(device)
    profile = profile_model(module, real_batch(args, device), device,
                            ProfileOptions(choices=ChoiceOptions(activation_checkpointing="never"), precision="bf16-mixed"), whole=True,
                            optimizer=module.configure_optimizers()["optimizer"],
                            step_context=lambda: torch.autocast(device.type, dtype=torch.bfloat16))
    del module
    _release(device)
    return profile


def bf16_plans(profile: ModelProfile, world: int) -> dict[str, Plan]:
    def cluster(budget_bytes: int) -> ClusterSpec:
        return ClusterSpec(world, budget_bytes, 2e-5, 1e11, headroom_fraction=0.02)

    plans = {c: make_plan(profile, cluster(2**50), uniform_choice=c) for c in ("replicate", "zero3")}
    budget = (plans["replicate"].predicted_peak_bytes + plans["zero3"].predicted_peak_bytes) // 2
    try:
        plans["ilp: replicate..zero3"] = make_plan(profile, cluster(budget))
    except InfeasibleBudgetError as err:
        print(f"ilp at {format_bytes(budget)}: {err}")
    return {name: plan for name, plan in plans.items() if name != "replicate"}


def osdp_layout(plan: Plan) -> Layout:
    def layout(module: nn.Module, world: int) -> nn.Module:
        root = RootWrapper(module)
        apply_plan(module, root, plan, build_meshes(next(module.parameters()).device.type, world))
        return root
    return layout


def hand_layout(module: nn.Module, world: int) -> nn.Module:
    """FSDP2 as written by hand: each block, then the model, all with torchtitan's bf16 policy."""
    mesh = build_meshes(next(module.parameters()).device.type, world).shard
    for block in module.net.h:
        fully_shard(block, mesh=mesh, mp_policy=HAND_POLICY)
    fully_shard(module.net, mesh=mesh, mp_policy=HAND_POLICY)
    return module


class GatherCounter:
    """Bytes and elements FSDP2's all-gathers output while installed (their ``all_gather_single``)."""

    def __init__(self) -> None:
        self.bytes = self.elements = 0
        self._original = dist.all_gather_single

    def __enter__(self) -> GatherCounter:
        def counted(output: torch.Tensor, *args: object, **kwargs: object) -> object:
            self.bytes += output.numel() * output.element_size()
            self.elements += output.numel()
            return self._original(output, *args, **kwargs)
        dist.all_gather_single = counted
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_gather_single = self._original


def run_layout(args: argparse.Namespace, device: torch.device, world: int, layout: Layout) -> dict:
    """Train a few steps of ``layout`` under the fake process group and bf16 autocast: the tracked
    step's peak, one step's gathered bytes and elements, the median step seconds."""
    _release(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        torch.manual_seed(0)
        module = module_factory(args)().to(device)
        batch = real_batch(args, device)
        root = layout(module, world)
        optimizer = module.configure_optimizers()["optimizer"]
        step_groups_apart([optimizer])

        def step() -> None:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = (_ForwardRedirection()(root, module, "training_step", batch, 0) if root is not module
                       else module.training_step(batch, 0))
            (out["loss"] if isinstance(out, dict) else out).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        with logging_disabled(module):
            step()
            with GatherCounter() as gathered:
                peak = _tracked_peak_bytes(step, device, root, optimizer, batch) - base
            times = []
            for _ in range(TIMED_STEPS.get(device.type, 2)):
                start = _now(device)
                step()
                times.append(_now(device) - start)
        return {"peak": peak, "gathered_bytes": gathered.bytes, "gathered_elements": gathered.elements,
                "step_s": statistics.median(times)}
    finally:
        dist.destroy_process_group()


def _tracked_peak_bytes(step: Callable[[], None], device: torch.device, root: nn.Module,
                        optimizer: torch.optim.Optimizer, batch: dict) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    tracker = MemTracker()
    tracker.track_external(root, optimizer, *batch.values())
    with tracker:
        step()
    return int(max(v["Total"] for v in tracker.get_tracker_snapshot("peak").values()))


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def check_bf16(args: argparse.Namespace, device: torch.device) -> None:
    """Print one table row per layout and world size as it is measured."""
    profile = bf16_profile(args, device)
    print(f"bf16-mixed: sharded units gather {profile.param_dtype}, reduce {profile.reduce_dtype}; fake process "
          f"group, {TIMED_STEPS.get(device.type, 2)} timed steps each (no collective moves data)\n\n"
          "| precision | world | layout | choices | predicted peak | measured peak | error | gathered/step "
          "| bytes/element | step s | x hand |\n|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    for world in args.worlds:
        hand = run_layout(args, device, world, hand_layout)
        rows = [("hand FSDP2 (bf16 policy)", "zero3 per block + root", None, hand)]
        for name, plan in bf16_plans(profile, world).items():
            rows.append((f"osdp {name}", plan.choices_text(), plan, run_layout(args, device, world, osdp_layout(plan))))
        for name, choices, plan, run in rows:
            predicted = format_bytes(plan.predicted_peak_bytes) if plan else "-"
            error = f"{plan.predicted_peak_bytes / run['peak'] - 1:+.1%}" if plan else "-"
            per_element = run["gathered_bytes"] / run["gathered_elements"] if run["gathered_elements"] else 0.0
            print(f"| bf16-mixed | {world} | {name} | {choices} | {predicted} | {format_bytes(run['peak'])} | {error} | "
                  f"{run['gathered_bytes']} | {per_element:g} | {run['step_s']:.4f} | "
                  f"{run['step_s'] / hand['step_s']:.2f} |", flush=True)
