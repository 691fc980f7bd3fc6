"""What calibration times: each collective kind at four sizes, and tiny plans (stacks of small
pre-norm MLP blocks at three widths, one unit per block or per Linear) under each calibrated family's
bench choice (``ChoiceFamily.calibration``), applied with the project's own
:func:`~osdp_lightning.apply.apply.apply_plan` so that whatever machinery a choice uses is what is priced,
with a real block's compute between its collectives so that prefetch and overlap run as in training."""

from __future__ import annotations

import gc
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from osdp_lightning.apply.apply import apply_plan
from osdp_lightning.choices import REGISTRY, ChoiceFamily
from osdp_lightning.choices.base import FamilyCalibration, StackTimings
from osdp_lightning.cost.links import synchronize
from osdp_lightning.cost.step_terms import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from osdp_lightning.plan.plan import Plan, UnitPlan
from osdp_lightning.profiling.optim_state import clone_optimizer
from osdp_lightning.profiling.units import ROOT
from osdp_lightning.runtime.collectives import reduce_scatter
from osdp_lightning.runtime.meshes import Meshes

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
STACK_WIDTHS = (64, 256, 512)
"""Widths of the block stacks (blocks of 32 KiB, 514 KiB and 2 MiB): the smallest pins the
per-group constant (FSDP2's hooks and launches, a few ms per group and step on a 2-core VM), the
largest is near the size of real units, so that per-byte rates are measured where they are used.
NOTE: with 768 (4.5 MiB) a calibration took 3.4-3.8 s on 2 CPU ranks instead of 2.3-2.5."""
STACK_DEPTH = 2
"""Blocks per stack: the first block's backward all-gather is prefetched beside the second's backward."""
STACK_ROWS = 128
"""Rows of the stacks' input: a micro-batch's tokens (GPT 4 x 384, seq 64, batch 2). NOTE: with 8
rows and bare Linears nothing ran between the collectives: zero3's prefetched all-gather was never
hidden and the collectives never competed with compute for the cores, unlike beside a real block."""
LOCAL = "local"
"""The plain stack on one rank, no FSDP2: what every bench is timed against unless its family
gives a reference of its own."""


def stack_unit_names(calibration: FamilyCalibration | None) -> tuple[str, ...]:
    """The stack's units under a family's bench: its blocks, or each block's Linears."""
    if calibration is not None and calibration.linear_units:
        return tuple(f"blocks.{i}.{name}" for i in range(STACK_DEPTH) for name in _Block.LINEARS)
    return tuple(f"blocks.{i}" for i in range(STACK_DEPTH))


def stack_unit_params(width: int, calibration: FamilyCalibration | None) -> int:
    """Parameters of one of the stack's units: a Linear(width, width) with bias, or a block of two."""
    linear = width * width + width
    return linear if calibration is not None and calibration.linear_units else len(_Block.LINEARS) * linear


def stack_unit_tensors(calibration: FamilyCalibration | None) -> int:
    """Parameter tensors of one of the stack's units (a Linear's weight and bias, or a block's)."""
    return 2 if calibration is not None and calibration.linear_units else 2 * len(_Block.LINEARS)


def stack_timings(calibration: FamilyCalibration | None, excess_s: dict[int, float],
                  optimizer_s: dict[int, float]) -> StackTimings:
    """What a family's fit reads of its bench, with the shape of the bench's units (at the widths timed)."""
    return StackTimings(excess_s=excess_s, optimizer_s=optimizer_s,
                        unit_bytes={w: 4 * stack_unit_params(w, calibration) for w in {*excess_s, *optimizer_s}},
                        unit_tensors=stack_unit_tensors(calibration))


@dataclass(frozen=True)
class BenchSpec:
    """One stack configuration calibration times."""

    name: str
    """Its key in the timings and in the terms' ``extra``: ``local``, ``local_<kind>``, a choice name."""
    calibration: FamilyCalibration | None = None
    """The family it measures (``None``: the plain stack)."""
    reference: bool = False
    """The family's unsharded reference stack rather than its bench."""
    against: str = LOCAL
    """The bench this one is timed against (a family's bench: its reference)."""


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
        specs.append(BenchSpec(family.calibration.bench, family.calibration, against=reference_name(family)))
    return specs


class _Block(nn.Module):
    """``x + proj(gelu(fc(layer_norm(x))))``: a transformer's pre-norm MLP block (its norm without
    weights: the two Linears are all its parameters, so that a split bench can cut each of them)."""

    LINEARS = ("fc", "proj")

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (rows, width)
        return x + self.proj(F.gelu(self.fc(F.layer_norm(x, x.shape[-1:]))))


class _Stack(nn.Module):
    """``depth`` blocks of ``width``."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
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
    """Forward and backward, per round."""
    optimizer_s: list[float]
    forward_s: list[float] = field(default_factory=list)


def _stack_plan(width: int, calibration: FamilyCalibration, world: int) -> Plan:
    units = [UnitPlan(name=name, module_names=(name,), param_count=stack_unit_params(width, calibration),
                      choice=calibration.bench, predicted_bytes=0, predicted_comm_s=0.0)
             for name in stack_unit_names(calibration)]
    units.append(UnitPlan(name=ROOT, module_names=(ROOT,), param_count=0, choice=calibration.root or calibration.bench,
                          predicted_bytes=0, predicted_comm_s=0.0))
    return Plan(units=tuple(units), world_size=world, micro_batch_size=STACK_ROWS, memory_budget_bytes=2**40,
                predicted_peak_bytes=0, predicted_step_s=0.0, predicted_throughput=0.0, activation_bytes=0,
                solver_status="calibration", source="calibration")


def build_stack(width: int, device: torch.device) -> tuple[_Stack, _StackRoot]:
    """The plain stack and its root, seeded: the same weights and input on every rank."""
    # NOTE: in a fork of the random states: the stream the user's training draws from (dropout) must not move.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        stack = _Stack(width, STACK_DEPTH).to(device)
        return stack, _StackRoot(stack, torch.randn(STACK_ROWS, width, device=device))


def build_bench(spec: BenchSpec, width: int, device: torch.device, meshes: Meshes | None,
                optimizer: torch.optim.Optimizer | None) -> Bench:
    """One stack as ``spec`` says: plain or a family's reference (no FSDP2), or its bench choice for
    every unit (which needs ``meshes``)."""
    stack, root = build_stack(width, device)
    calibration = spec.calibration
    if calibration is not None and spec.reference:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(1)  # a transform may draw (SplitLinear's slices)
            for name in stack_unit_names(calibration):
                calibration.reference(stack, name)
    elif calibration is not None:
        if meshes is None:
            raise ValueError(f"the {spec.name} bench shards its stack: it needs the process group's meshes")
        apply_plan(stack, root, _stack_plan(width, calibration, meshes.shard.size()), meshes)
    clone = clone_optimizer(optimizer, list(root.parameters())) if optimizer is not None else None
    return Bench(root, clone, [], [])


def release_benches(benches: dict[tuple[str, int], Bench]) -> None:
    """Free the benches' FSDP2 states and DDP reducers now, while the process group is alive.

    NOTE: they hold the group in reference cycles; left to a later collection they can be freed
    during interpreter finalization, where gloo's threads end in "terminate called without an
    active exception" (SIGABRT; see osdp_lightning/runtime/shutdown.py).
    """
    for bench in benches.values():
        bench.root, bench.optimizer = None, None
    gc.collect()


def _bench_step(bench: Bench, device: torch.device) -> tuple[float, float, float]:
    """Seconds of one step's forward, backward and optimizer step."""
    if bench.optimizer is not None:
        bench.optimizer.zero_grad(set_to_none=True)
    synchronize(device)
    start = time.perf_counter()
    loss = bench.root()
    synchronize(device)
    forward = time.perf_counter()
    loss.backward()
    synchronize(device)
    backward = time.perf_counter()
    if bench.optimizer is not None:
        bench.optimizer.step()
    synchronize(device)
    return forward - start, backward - forward, time.perf_counter() - backward


def rotated(items: list[Any], round_index: int) -> list[Any]:
    """``items`` rotated one place further each round: over ``len(items)`` rounds each runs once in
    every position, so that a change of load within a round favours none. (Reversing every other
    round did not: the middle ones always ran in the middle.)"""
    shift = round_index % len(items) if items else 0
    return items[shift:] + items[:shift]


def time_benches(benches: dict[tuple[str, int], Bench], device: torch.device, repeats: int,
                  budget_s: float) -> None:
    """Warm every bench up once, then step each in turn: ``repeats`` rounds, and more while the
    rounds so far took less than ``budget_s`` (rank 0 decides for all; the order rotated each round).
    Without a process group only plain benches can run: one process times them alone."""
    names = list(benches)
    for name in names:
        _bench_step(benches[name], device)
    start, more = time.perf_counter(), torch.zeros(1, device=device)
    for index in range(MAX_BENCH_ROUNDS):
        for name in rotated(names, index):
            forward_s, backward_s, optimizer_s = _bench_step(benches[name], device)
            benches[name].forward_s.append(forward_s)
            benches[name].step_s.append(forward_s + backward_s)
            benches[name].optimizer_s.append(optimizer_s)
        if index + 1 >= repeats:
            elapsed = time.perf_counter() - start
            more.fill_(float(elapsed * (index + 2) / (index + 1) <= budget_s))  # room for one more round
            if dist.is_initialized():
                dist.broadcast(more, src=0)
            if not more.item():
                break


def time_collective_sizes(device: torch.device, repeats: int,
                          sizes: tuple[int, ...] = COLLECTIVE_BYTES) -> dict[str, float]:
    """Least seconds of each collective kind at each of ``sizes`` (unsharded bytes), keyed
    ``"<kind>@<bytes>"``; one size's tensors at a time (the room calibration takes:
    :mod:`osdp_lightning.calibrate.room`)."""
    world = dist.get_world_size()
    least: dict[str, float] = {}
    with warnings.catch_warnings():  # renamed in newer torch; the old name works from 2.6 on
        warnings.simplefilter("ignore", FutureWarning)
        for nbytes in sizes:
            least.update(_least_times(_collective_ops(max(nbytes // 4 // world, 1) * world, world, device),
                                      device, repeats))
    return least


def _collective_ops(numel: int, world: int, device: torch.device) -> dict[str, Callable[[], Any]]:
    """Each collective kind over ``numel`` fp32 elements (gathered), keyed ``"<kind>@<bytes>"``."""
    full, shard = torch.zeros(numel, device=device), torch.zeros(numel // world, device=device)
    return {f"{ALL_GATHER}@{numel * 4}": lambda: dist.all_gather_into_tensor(full, shard),
            f"{REDUCE_SCATTER}@{numel * 4}": lambda: reduce_scatter(shard, full),
            f"{ALL_REDUCE}@{numel * 4}": lambda: dist.all_reduce(full)}


def _least_times(ops: dict[str, Callable[[], Any]], device: torch.device, repeats: int) -> dict[str, float]:
    """Each op's least seconds over ``repeats`` rounds (their order rotated), after one warm-up call."""
    samples: dict[str, list[float]] = {name: [] for name in ops}
    for op in ops.values():
        op()
    for index in range(repeats):
        for name in rotated(list(ops), index):
            synchronize(device)
            start = time.perf_counter()
            ops[name]()
            synchronize(device)
            samples[name].append(time.perf_counter() - start)
    # NOTE: the least, not the median: a standalone collective's delays are one-sided (the other
    # rank late, a page fault on a fresh buffer). The median of 7 of gloo's 16 MiB reduce-scatter
    # came out at 4x its usual time now and then, and every FSDP2 term that subtracts it became 0.
    return {name: min(values) for name, values in samples.items()}
