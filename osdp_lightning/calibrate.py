"""Timings measured on the live process group at setup (part of the cost stage).

- :func:`measure_collectives`: latency (alpha), all-gather bandwidth and how much of a collective
  hides behind compute (the cluster's link figures);
- :func:`calibrate_step_terms`: every step-time term besides compute
  (:class:`~osdp_lightning.step_terms.StepTerms`): each collective kind at four sizes, FSDP2's own
  work and the optimizer step per choice from tiny plans (Linear stacks of three widths) applied
  with the project's own :func:`~osdp_lightning.apply.apply_plan` (so whatever machinery a choice
  uses is what is priced), cached per machine under ``~/.cache/osdp_lightning/``.

Every rank takes part in the collectives, but only rank 0's numbers are used: they are
broadcast, because plans derived from per-rank timings would differ and deadlock.
"""

from __future__ import annotations

import gc
import inspect
import json
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from osdp_lightning.step_terms import (
    ALL_GATHER,
    ALL_REDUCE,
    COLLECTIVES,
    MACHINERY,
    PLAIN,
    REDUCE_SCATTER,
    SPLIT_REPLICATED,
    Affine,
    StepTerms,
)
from osdp_lightning.units import ROOT

if TYPE_CHECKING:  # NOTE: no runtime import: cluster.py imports this module, plan.py imports cluster.py
    from osdp_lightning.apply import Meshes
    from osdp_lightning.plan import Plan


@dataclass(frozen=True)
class CollectiveTimings:
    latency_s: float
    """Least time of a one-element all-reduce (of 5, after a warm-up)."""
    bandwidth_bytes_per_s: float
    """All-gather bus bandwidth: bytes moved per rank ((W-1)/W of the output) per second."""
    overlap_efficiency: float
    """Share of an all-gather that ran hidden behind a concurrent matmul (0..1)."""
    calibrate_s: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def least_time_s(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Least seconds of ``repeats`` calls of ``fn`` after one warm-up call."""
    fn()  # warm-up (connection set-up, allocator)
    samples = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - start)
    # NOTE: the least, as for the step terms' collectives: delays are one-sided (the other rank still
    # busy at setup). The median of 5 one-element all-reduces once read 3.8 ms instead of about 0.15
    # (the main job on a fresh clone), and zero2 / zero3 were priced 50-80% slower for it.
    return min(samples)


def measure_collectives(device: torch.device, payload_bytes: int = 8 * 2**20, repeats: int = 5,
                        group: dist.ProcessGroup | None = None) -> CollectiveTimings:
    """Time collectives on ``group`` and return rank 0's figures on every rank."""
    start = time.perf_counter()
    world = dist.get_world_size(group)
    tiny = torch.zeros(1, device=device)
    shard = torch.ones(payload_bytes // 4 // world, device=device)
    gathered = torch.empty(shard.numel() * world, device=device)
    a = torch.randn(512, 512, device=device, generator=torch.Generator(device).manual_seed(0))  # not the user's

    def all_gather(async_op: bool = False):
        with warnings.catch_warnings():  # renamed in newer torch; the old name works from 2.6 on
            warnings.simplefilter("ignore", FutureWarning)
            return dist.all_gather_into_tensor(gathered, shard, group=group, async_op=async_op)

    def both() -> None:
        work = all_gather(async_op=True)
        for _ in range(4):
            a @ a
        work.wait()

    latency = least_time_s(lambda: dist.all_reduce(tiny, group=group), device, repeats)
    gather_s = least_time_s(all_gather, device, repeats)
    compute_s = least_time_s(lambda: [a @ a for _ in range(4)], device, repeats)
    both_s = least_time_s(both, device, repeats)
    moved = gathered.numel() * 4 * (world - 1) / world
    bandwidth = moved / max(gather_s - latency, 1e-9)
    hidden = gather_s + compute_s - both_s
    overlap = min(max(hidden / max(min(gather_s, compute_s), 1e-9), 0.0), 1.0)
    figures = torch.tensor([latency, bandwidth, overlap], dtype=torch.float64, device=device)
    dist.broadcast(figures, src=0, group=group)
    latency, bandwidth, overlap = (float(x) for x in figures.tolist())
    return CollectiveTimings(latency, bandwidth, overlap, time.perf_counter() - start)


# ---------------------------------------------------------------------------------------------
# Step terms: each collective at four sizes, FSDP2's own work and the optimizer step per choice
# ---------------------------------------------------------------------------------------------
CACHE_ENV = "OSDP_LIGHTNING_CACHE_DIR"
"""Directory of the per-machine calibration cache (default ``~/.cache/osdp_lightning``; tests
point it at a temporary directory)."""
CACHE_FORMAT = 3
"""3: the last :data:`CACHE_DRAWS` calibrations (2: one; 1: collectives at two sizes); an older
format is stale."""
CACHE_DRAWS = 3
"""Calibrations the cache keeps; a launch uses their per-term median. On this project's 2-core VM
one block's priced FSDP2 work was more than 15% off the median of nine calibrations in 11-33% of
single calibrations and 0-8% of medians of three; one that priced uniform zero3 27% high went into
every later launch of its benchmark (docs/design.md section 7). So the first launches on
a machine each measure and add theirs until there are this many."""
CACHE_MAX_AGE_S = 7 * 24 * 3600.0
"""A cache older than this is stale (machines change: drivers, load, other tenants)."""
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
SPLIT_CHOICE = "split(k=2, sharded=1)"
QUIET_CPU_SHARE = 0.80
"""Share of a core each of 2 gloo ranks got during a calibration on this project's quiet 2-core VM
(0.78-0.82: the rest is waiting in collectives)."""
BUSY_CPU_SHARE = 0.65
"""Below this share a calibration is used but not cached (:func:`busy_reason`). Beside one busy
process on those 2 cores the ranks got 0.52-0.55 of a core and zero3's per-group constant rose from
5.8 to 8.1 ms; beside two, 0.40-0.44 and 14.5 ms (means of 3-4 calibrations). A cache written then
over-priced sharding in every later launch (docs/design.md section 7)."""


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
class _Bench:
    root: nn.Module | None
    optimizer: torch.optim.Optimizer | None
    step_s: list[float]
    optimizer_s: list[float]


def _stack_plan(depth: int, width: int, choice: str, root_choice: str, world: int) -> Plan:
    from osdp_lightning.plan import Plan, UnitPlan

    units = [UnitPlan(name=f"layers.{i}", module_names=(f"layers.{i}",), param_count=width * width + width,
                      choice=choice, predicted_bytes=0, predicted_comm_s=0.0) for i in range(depth)]
    units.append(UnitPlan(name=ROOT, module_names=(ROOT,), param_count=0, choice=root_choice, predicted_bytes=0,
                          predicted_comm_s=0.0))
    return Plan(units=tuple(units), world_size=world, micro_batch_size=STACK_ROWS, memory_budget_bytes=2**40,
                predicted_peak_bytes=0, predicted_step_s=0.0, predicted_throughput=0.0, activation_bytes=0,
                solver_status="calibration", source="calibration")


def clone_optimizer(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class and settings over ``params``."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}
    return type(optimizer)(params, **defaults)


def _build_bench(config: str, width: int, device: torch.device, meshes: Meshes,
                 optimizer: torch.optim.Optimizer | None) -> _Bench:
    """One stack under ``config``: ``local`` / ``local_split`` (no FSDP2) or a choice for every unit."""
    from osdp_lightning.apply import apply_plan
    from osdp_lightning.split import split_linear_in_module

    # NOTE: seeded, for the same weights on every rank as a real model has, in a fork of the random
    # states: the stream the user's training draws from (dropout) must not move.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        stack = _Stack(width, STACK_DEPTH).to(device)
        root = _StackRoot(stack, torch.randn(STACK_ROWS, width, device=device))
        world = meshes.shard.size()
        if config == "local_split":  # SplitLinear initialises its slices: a draw
            for i in range(STACK_DEPTH):
                split_linear_in_module(stack, f"layers.{i}", 2)
        elif config != "local":
            root_choice = "zero3" if config == SPLIT_CHOICE else config  # a split's biases live in the root
            apply_plan(stack, root, _stack_plan(STACK_DEPTH, width, config, root_choice, world), meshes)
    clone = clone_optimizer(optimizer, list(root.parameters())) if optimizer is not None else None
    return _Bench(root, clone, [], [])


def _release(benches: dict[tuple[str, int], _Bench]) -> None:
    """Free the benches' FSDP2 states and DDP reducers now, while the process group is alive.

    NOTE: they hold the group in reference cycles; left to a later collection they can be freed
    during interpreter finalization, where gloo's threads end in "terminate called without an
    active exception" (SIGABRT; see osdp_lightning/shutdown.py).
    """
    for bench in benches.values():
        bench.root, bench.optimizer = None, None
    gc.collect()


def _bench_step(bench: _Bench, device: torch.device) -> tuple[float, float]:
    if bench.optimizer is not None:
        bench.optimizer.zero_grad(set_to_none=True)
    _sync(device)
    start = time.perf_counter()
    bench.root().backward()
    _sync(device)
    middle = time.perf_counter()
    if bench.optimizer is not None:
        bench.optimizer.step()
    _sync(device)
    return middle - start, time.perf_counter() - middle


def _time_benches(benches: dict[tuple[str, int], _Bench], device: torch.device, repeats: int,
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


def _time_collective_sizes(device: torch.device, repeats: int) -> dict[str, float]:
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
                _sync(device)
                start = time.perf_counter()
                ops[name]()
                _sync(device)
                samples[name].append(time.perf_counter() - start)
    # NOTE: the least, not the median: a standalone collective's delays are one-sided (the other
    # rank late, a page fault on a fresh buffer). The median of 7 of gloo's 16 MiB reduce-scatter
    # came out at 4x its usual time now and then, and every FSDP2 term that subtracts it became 0.
    return {name: min(values) for name, values in samples.items()}


def _fit(points: list[tuple[float, float]], count: float) -> Affine:
    """``y = constant * count + rate * x``, least squares through ``points``; both parts at least 0."""
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    rate = max(sum((x - mean_x) * (y - mean_y) for x, y in points) / spread, 0.0)
    return Affine(max((mean_y - rate * mean_x) / count, 0.0), rate)


def _collective_fit(points: list[tuple[float, float]]) -> Affine:
    """Rate: the least-squares slope through every size; constant: the smallest size's time less its
    bytes at that rate (a launch's latency, measured, not an intercept extrapolated from 16 MiB)."""
    rate = _fit(points, 1).per_byte_s
    nbytes, seconds = points[0]
    return Affine(max(seconds - rate * nbytes, 0.0), rate)


def _stack_comm_s(collectives: dict[str, Affine], config: str, width: int, world: int) -> float:
    """Seconds the cost model itself gives the stack's collectives under ``config`` (so that what
    is left of the measurement is exactly what the model lacks)."""
    from osdp_lightning.cluster import ClusterSpec
    from osdp_lightning.cost import build_choice_table
    from osdp_lightning.profile import ModelProfile, UnitProfile
    from osdp_lightning.solve import step_seconds

    units = [UnitProfile(f"layers.{i}", (f"layers.{i}",), width * width + width, 0, 0.0, 0.0, 0,
                         linear_shape=(width, width), split_overhead_s=((2, 0.0),), tensor_count=2)
             for i in range(STACK_DEPTH)]
    units.append(UnitProfile(ROOT, (ROOT,), 0, 0, 0.0, 0.0, 0, tensor_count=0))
    profile = ModelProfile(units=tuple(units), micro_batch_size=STACK_ROWS, param_bytes_per_element=4,
                           grad_bytes_per_element=4, compute_bytes_per_element=4, reduce_bytes_per_element=4,
                           optimizer_bytes_per_param=0, activation_bytes=0)
    zero = Affine(0.0, 0.0)
    comm_only = StepTerms(collectives=collectives, overhead={k: zero for k in MACHINERY},
                          optimizer={k: zero for k in (*MACHINERY, PLAIN)}, loop_step_s=0.0)
    cluster = ClusterSpec(world_size=world, memory_budget_bytes=2**40,
                          collective_latency_s=collectives[ALL_REDUCE].constant_s,
                          bandwidth_bytes_per_s=1.0 / max(collectives[ALL_GATHER].per_byte_s, 1e-15),
                          step_terms=comm_only)
    root_choice = "zero3" if config == SPLIT_CHOICE else config
    table = build_choice_table(profile, cluster, choices=(config, root_choice))
    return step_seconds(table, [config] * STACK_DEPTH + [root_choice])


def _fit_terms(collective_s: dict[str, float], benches: dict[tuple[str, int], _Bench], world: int,
               split: bool) -> tuple[dict[str, Affine], dict[str, Affine], dict[str, Affine]]:
    """Collectives (from their least times), FSDP2 overhead and optimizer terms (from the benches'
    medians); see the module docstring."""
    ring = (world - 1) / world
    moved = [(kind, int(nbytes) * ring, seconds) for key, seconds in collective_s.items()
             for kind, nbytes in [key.split("@")]]
    collectives = {kind: _collective_fit(sorted((x, t) for k, x, t in moved if k == kind)) for kind in COLLECTIVES}
    step = {k: statistics.median(b.step_s) for k, b in benches.items()}
    opt = {k: statistics.median(b.optimizer_s) if b.optimizer_s else 0.0 for k, b in benches.items()}
    unit_bytes = {w: (w * w + w) * 4 for w in STACK_WIDTHS}
    n = STACK_DEPTH

    def per_width(seconds: dict[int, float], nbytes: dict[int, int], count: float) -> Affine:
        return _fit([(nbytes[w], seconds[w]) for w in STACK_WIDTHS], count)

    overhead, optimizer = {}, {PLAIN: per_width({w: opt["local", w] / n for w in STACK_WIDTHS}, unit_bytes, 2)}
    for choice in ("replicate", "zero2", "zero3"):
        extra = {w: (step[choice, w] - step["local", w] - _stack_comm_s(collectives, choice, w, world)) / n
                 for w in STACK_WIDTHS}
        overhead[choice] = per_width(extra, unit_bytes, 1)
        optimizer[choice] = per_width({w: opt[choice, w] / n for w in STACK_WIDTHS}, unit_bytes, 2)
    if not split:  # NOTE: like zero2, a replicated slice is gathered once per step and kept until backward
        overhead[SPLIT_REPLICATED], optimizer[SPLIT_REPLICATED] = overhead["zero2"], optimizer["replicate"]
        return collectives, overhead, optimizer
    # Per unit: a zero3 slice group and a replicated slice group of half the weight each; the bias
    # (in the root's zero3 group) is priced as one more zero3 tensor.
    half = {w: w * w * 2 for w in STACK_WIDTHS}
    slice_s = {w: (step[SPLIT_CHOICE, w] - step["local_split", w] - _stack_comm_s(collectives, SPLIT_CHOICE, w, world)) / n
               - overhead["zero3"].seconds(1, half[w]) for w in STACK_WIDTHS}
    slice_opt = {w: opt[SPLIT_CHOICE, w] / n - optimizer["zero3"].seconds(2, half[w] + 4 * w) for w in STACK_WIDTHS}
    overhead[SPLIT_REPLICATED] = per_width(slice_s, half, 1)
    optimizer[SPLIT_REPLICATED] = per_width(slice_opt, half, 1)
    return collectives, overhead, optimizer


def measure_step_terms(device: torch.device, optimizer: torch.optim.Optimizer | None, meshes: Meshes, *,
                       split: bool = True, loop_step_s: float = 0.0, repeats: int = 5) -> StepTerms:
    """Time collectives and tiny plans on every rank; fit the terms from rank 0's timings."""
    start, start_cpu = time.perf_counter(), time.process_time()
    collective_s = _time_collective_sizes(device, COLLECTIVE_REPEATS)
    configs = ["local", "replicate", "zero2", "zero3"] + (["local_split", SPLIT_CHOICE] if split else [])
    benches = {(c, w): _build_bench(c, w, device, meshes, optimizer) for w in STACK_WIDTHS for c in configs}
    _time_benches(benches, device, repeats, BENCH_ROUNDS_S)
    raw: list[Any] = [(collective_s, {k: (b.step_s, b.optimizer_s) for k, b in benches.items()})]
    dist.broadcast_object_list(raw, src=0)
    collective_s = raw[0][0]
    for key, (step_s, optimizer_s) in raw[0][1].items():
        benches[key].step_s, benches[key].optimizer_s = step_s, optimizer_s
    collectives, overhead, optimizer_terms = _fit_terms(collective_s, benches, meshes.shard.size(), split)
    extra = {f"{c}@{w}_step_s": statistics.median(b.step_s) for (c, w), b in benches.items()}
    extra.update({f"{c}@{w}_optimizer_s": statistics.median(b.optimizer_s) for (c, w), b in benches.items()
                  if b.optimizer_s})
    extra.update({f"{k}_s": v for k, v in collective_s.items()})
    # NOTE: CPU seconds of this process say what the wall time would be on an idle machine; the
    # least share of a core any rank got says how busy the machine was (busy_reason).
    elapsed = [(time.perf_counter() - start, time.process_time() - start_cpu)] * dist.get_world_size()
    dist.all_gather_object(elapsed, elapsed[0])
    extra["calibrate_cpu_s"] = elapsed[0][1]
    extra["calibrate_cpu_share"] = min(cpu_s / max(wall_s, 1e-9) for wall_s, cpu_s in elapsed)
    _release(benches)
    return StepTerms(collectives, overhead, optimizer_terms, loop_step_s, source="measured at setup",
                     calibrate_s=elapsed[0][0], extra=extra)


def busy_reason(terms: StepTerms, device: torch.device) -> str | None:
    """Why freshly measured ``terms`` must not be cached (the machine was busy), or ``None``.

    On CPU a rank that waits for a core, or for a rank that does, gets less of one: the terms then
    price sharding for a busier machine than the next launch may find, and a cache would carry
    them into every later launch. On CUDA the ranks wait for the device, not for cores: no check.
    """
    share = terms.extra.get("calibrate_cpu_share")
    if device.type != "cpu" or share is None or share >= BUSY_CPU_SHARE:
        return None
    return (f"the machine was busy while they were measured (a rank got {100 * share:.0f}% of a core; "
            f"{100 * QUIET_CPU_SHARE:.0f}% on a quiet machine)")


# -- the per-machine cache ------------------------------------------------------------------------
def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "osdp_lightning")


def calibration_key(device: torch.device, world_size: int, ranks_per_node: int,
                    optimizer: torch.optim.Optimizer | None, split: bool) -> dict[str, Any]:
    """What the cached terms were measured for; any difference makes a cache foreign."""
    flags = {k: optimizer.defaults.get(k) for k in ("foreach", "fused", "amsgrad", "capturable")} if optimizer else {}
    return {"format": CACHE_FORMAT, "host": platform.node(), "torch": torch.__version__,
            "backend": dist.get_backend() if dist.is_initialized() else None, "device": device.type,
            "world_size": world_size, "ranks_per_node": ranks_per_node, "split": split,
            # NOTE: on CPU the intra-op threads set compute and gloo's copies alike (8 MiB all-gather:
            # 0.5 GB/s with two threads on rank 1, 0.16 GB/s with one on each rank, 2 cores)
            "threads": torch.get_num_threads(),
            "optimizer": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}" if optimizer else None,
            "optimizer_flags": {k: repr(v) for k, v in flags.items()}}


def cache_file(key: dict[str, Any]) -> Path:
    return cache_dir() / f"step_terms_{key['device']}_w{key['world_size']}_r{key['ranks_per_node']}.json"


def read_cache(path: Path, key: dict[str, Any], max_age_s: float = CACHE_MAX_AGE_S) -> list[StepTerms] | None:
    """The cached calibrations (oldest first), or ``None`` with one line saying why a cache that
    exists is not trusted."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("key"), dict):
            raise ValueError("no key")
        if data["key"].get("format") != CACHE_FORMAT:
            reason = f"stale (format {data['key'].get('format')}, now {CACHE_FORMAT})"
        elif data["key"] != key:
            differ = sorted(k for k in set(key) | set(data["key"]) if key.get(k) != data["key"].get(k))
            reason = f"foreign (measured for another {', '.join(differ)})"
        elif not time.time() - float(data["written_at"]) <= max_age_s:
            reason = f"stale (older than {max_age_s / 86400:g} days)"
        elif not isinstance(data["draws"], list) or not data["draws"]:
            raise ValueError("no calibrations")
        else:
            return [StepTerms.from_dict(draw, source=f"cache {path}") for draw in data["draws"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        reason = f"corrupt ({type(err).__name__}: {err})"
    rank_zero_info(f"osdp: ignoring the calibration cache {path}: {reason}; measuring again")
    return None


def write_cache(path: Path, key: dict[str, Any], draws: list[StepTerms]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        data = {"key": key, "written_at": time.time(), "draws": [d.to_dict() for d in draws[-CACHE_DRAWS:]]}
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)  # atomic: a reader never sees half a file
    except OSError as err:
        rank_zero_info(f"osdp: could not write the calibration cache {path} ({err})")


def median_terms(draws: list[StepTerms], source: str) -> StepTerms:
    """The per-term median of several calibrations: each constant and each rate on its own (one
    calibration's outlier moves neither), the raw figures of the latest kept for reports."""
    def table(part: str) -> dict[str, Affine]:
        latest: Mapping[str, Affine] = getattr(draws[-1], part)
        return {k: Affine(statistics.median(getattr(d, part)[k].constant_s for d in draws),
                          statistics.median(getattr(d, part)[k].per_byte_s for d in draws)) for k in latest}
    return replace(draws[-1], collectives=table("collectives"), overhead=table("overhead"),
                   optimizer=table("optimizer"), source=source,
                   extra={**draws[-1].extra, "calibration_draws": float(len(draws))})


def calibrate_step_terms(device: torch.device, optimizer: torch.optim.Optimizer | None, meshes: Meshes, *,
                         ranks_per_node: int, split: bool = True, loop_step_s: float = 0.0,
                         use_cache: bool = True) -> StepTerms:
    """The step terms of this process group: the median of the cached calibrations once there are
    :data:`CACHE_DRAWS` of them that rank 0 trusts; else measured, added to the cache and taken
    with the cached ones (every rank must call this; every rank returns rank 0's terms)."""
    key = calibration_key(device, dist.get_world_size(), ranks_per_node, optimizer, split)
    path = cache_file(key)
    found: list[Any] = [[]]
    if use_cache and dist.get_rank() == 0:
        found[0] = [draw.to_dict() for draw in read_cache(path, key) or []][-CACHE_DRAWS:]
    dist.broadcast_object_list(found, src=0)
    draws = [StepTerms.from_dict(draw) for draw in found[0]]
    if len(draws) == CACHE_DRAWS:
        terms = median_terms(draws, source=f"cache {path} (median of {len(draws)} calibrations)")
        return replace(terms, loop_step_s=loop_step_s, calibrate_s=0.0)
    measured = measure_step_terms(device, optimizer, meshes, split=split, loop_step_s=loop_step_s)
    busy = busy_reason(measured, device)  # the same on every rank: from gathered figures
    if busy is not None:  # used for this launch only: a busy machine's terms stand for now, not later
        if use_cache and dist.get_rank() == 0:
            rank_zero_info(f"osdp: step terms not cached: {busy}; the next launch measures again")
        return measured
    if use_cache and dist.get_rank() == 0:
        write_cache(path, key, [*draws, measured])
    if not draws:
        return measured
    terms = median_terms([*draws, measured], source=f"measured at setup, median with {len(draws)} cached")
    return replace(terms, loop_step_s=loop_step_s, calibrate_s=measured.calibrate_s)
