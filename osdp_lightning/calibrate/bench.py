"""What calibration times: each collective kind at four sizes, and tiny plans (Linear stacks of
three widths, one unit per layer) under each calibrated family's bench choice
(``ChoiceFamily.calibration``), applied with the project's own
:func:`~osdp_lightning.apply.apply_plan` so that whatever machinery a choice uses is what is priced."""

from __future__ import annotations

import gc
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from osdp_lightning.apply import Meshes, apply_plan
from osdp_lightning.choices import REGISTRY, ChoiceFamily
from osdp_lightning.choices.base import FamilyCalibration
from osdp_lightning.links import synchronize
from osdp_lightning.optim_state import clone_optimizer
from osdp_lightning.plan import Plan, UnitPlan
from osdp_lightning.step_terms import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from osdp_lightning.units import ROOT

COLLECTIVE_BYTES = (64 * 2**10, 2**20, 4 * 2**20, 16 * 2**20)
"""Unsharded bytes of the timed sizes of each collective. NOTE: on gloo the fit through two sizes
(64 KiB, 2 MiB) moved the all-reduce rate by 4x from one calibration to the next; the rate is now a
least-squares slope through sizes up to a transformer block's (16 MiB), the constant the smallest
size's time."""
COLLECTIVE_REPEATS = 7
BENCH_ROUNDS_S = 1.6
"""Seconds the timed bench rounds may take: at least five rounds, more while they fit (a fast
machine takes many; this project's 2-core VM about 9). Medians of 3-5 moved FSDP2's per-byte
cost by 2x from one calibration to the next here; with 1.2 s (7 rounds) the predicted
all-replicate step of the GPT bench preset still ranged 0.117-0.152 s over 9 calibrations on a
quiet machine, with 1.8 s 0.111-0.126 s over 5 (measured: 0.106-0.115 s)."""
MAX_BENCH_ROUNDS = 25
STACK_WIDTHS = (64, 256, 768)
"""Widths of the Linear stacks (16 KiB, 256 KiB and 2.3 MiB per unit): the smallest pins the
per-group constant (FSDP2's hooks and launches, about 3 ms per group and step on a 2-core VM),
the largest is the size of real units, so that per-byte rates are measured where they are used."""
STACK_DEPTH = 2
STACK_ROWS = 8
LOCAL = "local"
"""The plain stack on one rank, no FSDP2: what every bench is timed against unless its family
gives a reference of its own."""


@dataclass(frozen=True)
class BenchSpec:
    """One stack configuration calibration times."""

    name: str
    """Its key in the timings and in the terms' ``extra``: ``local``, ``local_<kind>``, a choice name."""
    calibration: FamilyCalibration | None = None
    """The family it measures (``None``: the plain stack)."""
    reference: bool = False
    """The family's unsharded reference stack rather than its bench."""


def reference_name(family: ChoiceFamily) -> str:
    """The bench a family's bench is timed against."""
    calibration = family.calibration
    return f"{LOCAL}_{family.kind}" if calibration is not None and calibration.reference is not None else LOCAL


def calibrated_families(optional: bool) -> list[ChoiceFamily]:
    """The families calibration benches, in registry order (those whose bench is optional only if ``optional``)."""
    return [f for f in REGISTRY.families.values()
            if f.calibration is not None and (optional or not f.calibration.optional)]


def bench_specs(optional: bool) -> list[BenchSpec]:
    """The plain stack, then each calibrated family's reference (if it has one) and bench."""
    specs = [BenchSpec(LOCAL)]
    for family in calibrated_families(optional):
        if reference_name(family) != LOCAL:
            specs.append(BenchSpec(reference_name(family), family.calibration, reference=True))
        specs.append(BenchSpec(family.calibration.bench, family.calibration))
    return specs


class _Stack(nn.Module):
    """``depth`` Linear units of ``width`` (one FSDP2 group each under a plan)."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


class _StackRoot(nn.Module):
    """The outermost module, as the strategy's wrapper: its forward computes the loss."""

    def __init__(self, stack: _Stack, x: torch.Tensor) -> None:
        super().__init__()
        self.stack, self.x = stack, x

    def forward(self) -> torch.Tensor:
        return self.stack(self.x).square().mean()


@dataclass
class Bench:
    root: nn.Module | None
    optimizer: torch.optim.Optimizer | None
    step_s: list[float]
    optimizer_s: list[float]


def _stack_plan(depth: int, width: int, choice: str, root_choice: str, world: int) -> Plan:
    units = [UnitPlan(name=f"layers.{i}", module_names=(f"layers.{i}",), param_count=width * width + width,
                      choice=choice, predicted_bytes=0, predicted_comm_s=0.0) for i in range(depth)]
    units.append(UnitPlan(name=ROOT, module_names=(ROOT,), param_count=0, choice=root_choice, predicted_bytes=0,
                          predicted_comm_s=0.0))
    return Plan(units=tuple(units), world_size=world, micro_batch_size=STACK_ROWS, memory_budget_bytes=2**40,
                predicted_peak_bytes=0, predicted_step_s=0.0, predicted_throughput=0.0, activation_bytes=0,
                solver_status="calibration", source="calibration")


def build_bench(spec: BenchSpec, width: int, device: torch.device, meshes: Meshes,
                optimizer: torch.optim.Optimizer | None) -> Bench:
    """One stack as ``spec`` says: plain or a family's reference (no FSDP2), or its bench choice for every unit."""
    # NOTE: seeded, for the same weights on every rank as a real model has, in a fork of the random
    # states: the stream the user's training draws from (dropout) must not move.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        stack = _Stack(width, STACK_DEPTH).to(device)
        root = _StackRoot(stack, torch.randn(STACK_ROWS, width, device=device))
        world, calibration = meshes.shard.size(), spec.calibration
        if calibration is not None and spec.reference:  # a transform may draw (SplitLinear's slices)
            for i in range(STACK_DEPTH):
                calibration.reference(stack, f"layers.{i}")
        elif calibration is not None:
            plan = _stack_plan(STACK_DEPTH, width, calibration.bench, calibration.root or calibration.bench, world)
            apply_plan(stack, root, plan, meshes)
    clone = clone_optimizer(optimizer, list(root.parameters())) if optimizer is not None else None
    return Bench(root, clone, [], [])


def release_benches(benches: dict[tuple[str, int], Bench]) -> None:
    """Free the benches' FSDP2 states and DDP reducers now, while the process group is alive.

    NOTE: they hold the group in reference cycles; left to a later collection they can be freed
    during interpreter finalization, where gloo's threads end in "terminate called without an
    active exception" (SIGABRT; see osdp_lightning/shutdown.py).
    """
    for bench in benches.values():
        bench.root, bench.optimizer = None, None
    gc.collect()


def _bench_step(bench: Bench, device: torch.device) -> tuple[float, float]:
    if bench.optimizer is not None:
        bench.optimizer.zero_grad(set_to_none=True)
    synchronize(device)
    start = time.perf_counter()
    bench.root().backward()
    synchronize(device)
    middle = time.perf_counter()
    if bench.optimizer is not None:
        bench.optimizer.step()
    synchronize(device)
    return middle - start, time.perf_counter() - middle


def time_benches(benches: dict[tuple[str, int], Bench], device: torch.device, repeats: int,
                  budget_s: float) -> None:
    """Warm every bench up once, then step each in turn: ``repeats`` rounds, and more while the
    rounds so far took less than ``budget_s`` (rank 0 decides for all; order reversed every other
    round, so that a change of load hits all alike)."""
    names = list(benches)
    for name in names:
        _bench_step(benches[name], device)
    start, more = time.perf_counter(), torch.zeros(1, device=device)
    for index in range(MAX_BENCH_ROUNDS):
        for name in names if index % 2 == 0 else names[::-1]:
            step_s, optimizer_s = _bench_step(benches[name], device)
            benches[name].step_s.append(step_s)
            benches[name].optimizer_s.append(optimizer_s)
        if index + 1 >= repeats:
            elapsed = time.perf_counter() - start
            more.fill_(float(elapsed * (index + 2) / (index + 1) <= budget_s))  # room for one more round
            dist.broadcast(more, src=0)
            if not more.item():
                break


def time_collective_sizes(device: torch.device, repeats: int) -> dict[str, float]:
    """Least seconds of each collective kind at each size, keyed ``"<kind>@<bytes>"``."""
    world = dist.get_world_size()
    ops: dict[str, Callable[[], Any]] = {}
    for nbytes in COLLECTIVE_BYTES:
        numel = max(nbytes // 4 // world, 1) * world
        full, shard = torch.zeros(numel, device=device), torch.zeros(numel // world, device=device)
        ops[f"{ALL_GATHER}@{numel * 4}"] = lambda f=full, s=shard: dist.all_gather_into_tensor(f, s)
        ops[f"{REDUCE_SCATTER}@{numel * 4}"] = lambda f=full, s=shard: dist.reduce_scatter_tensor(s, f)
        ops[f"{ALL_REDUCE}@{numel * 4}"] = lambda f=full: dist.all_reduce(f)
    samples: dict[str, list[float]] = {name: [] for name in ops}
    with warnings.catch_warnings():  # renamed in newer torch; the old name works from 2.6 on
        warnings.simplefilter("ignore", FutureWarning)
        for op in ops.values():
            op()
        for index in range(repeats):
            for name in list(ops) if index % 2 == 0 else list(ops)[::-1]:
                synchronize(device)
                start = time.perf_counter()
                ops[name]()
                synchronize(device)
                samples[name].append(time.perf_counter() - start)
    # NOTE: the least, not the median: a standalone collective's delays are one-sided (the other
    # rank late, a page fault on a fresh buffer). The median of 7 of gloo's 16 MiB reduce-scatter
    # came out at 4x its usual time now and then, and every FSDP2 term that subtracts it became 0.
    return {name: min(values) for name, values in samples.items()}
