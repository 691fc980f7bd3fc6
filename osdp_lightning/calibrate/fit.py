"""The step terms fitted to the benches' timings (:mod:`osdp_lightning.calibrate.bench`): collectives
by least squares over their sizes, and what FSDP2's and a reducer's machinery and the optimizer step
cost per group and per byte, as what the stacks took beyond their compute and the cost model's own
collectives."""

from __future__ import annotations

import statistics

from osdp_lightning.calibrate.bench import SPLIT_CHOICE, STACK_DEPTH, STACK_ROWS, STACK_WIDTHS, Bench
from osdp_lightning.choice_table import build_choice_table
from osdp_lightning.cluster import ClusterSpec
from osdp_lightning.profile import ModelProfile, UnitProfile
from osdp_lightning.solve import step_seconds
from osdp_lightning.step_terms import (
    ALL_GATHER,
    ALL_REDUCE,
    COLLECTIVES,
    MACHINERY,
    PLAIN,
    SPLIT_REPLICATED,
    Affine,
    StepTerms,
)
from osdp_lightning.units import ROOT


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


def fit_terms(collective_s: dict[str, float], benches: dict[tuple[str, int], Bench], world: int,
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
