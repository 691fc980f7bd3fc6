"""Solver benchmark: HiGHS against CBC (and the OSDP authors' knapsack DP) on the same tables.

Run with ``python -m benchmarks.solver_bench [--quick]``. Prints markdown tables; the solver's
time targets are printed beside the figures, never asserted.

- Synthetic tables from the project's own cost model (:func:`~osdp_lightning.plan.choice_table.build_choice_table`)
  on a GPT-2-XL-like stack of Linear units (hidden 1536; qkv, attention out, MLP up, MLP down per
  layer, then a root unit), 8 ranks, 12 choices per unit (base + split), +-10 % noise on every
  unit's seconds as a real profile has; budgets at the smallest that fits plus 0 / 5 / 25 % of the
  way to the all-replicate peak.
- Tables whose units all differ: the same stack with every Linear's shape scaled by up to 5 / 10 / 20 %
  (``--unequal-noise``), so that no two units have the same bytes, 1,000 and 2,000 units x 12
  choices, five seeds other than the uniform tables', at the budget 5 % of the way from the smallest
  that fits to the all-replicate peak; median and largest wall seconds over the seeds, the largest
  proven gap and the statuses (``--unequal-gap 0``: proving the optimum, as solves did before they
  settled for :data:`~osdp_lightning.solve.SETTLE_GAP`).
- Real model tables: dry runs (:mod:`osdp_lightning.plan.dryrun`) of gpt_small, gpt_xl and t5_large on
  ``a100_80g_x8`` with the choices ``osdp-plan`` offers (split factors 2/4/8, checkpointing), at the
  cluster's usable budget and at +5 % of the smallest budget.
- Whole ``make_plan`` calls as ``osdp-plan`` makes them: gpt_small at its micro-batch, and gpt_xl with
  ``micro_batch_size="auto"`` (how many tables were solved, how many skipped by bounds).

Each solve is timed in wall seconds and in CPU seconds of this process and its children (the
solver's own work; steadier than wall time on a shared machine). CBC runs capped at ``--cbc-cap``
seconds (uncapped it runs for minutes on the +5 % rows).
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

from osdp_lightning.choices import BASE_CHOICES, Choice, split_choice
from osdp_lightning.cost.cluster import ClusterSpec
from osdp_lightning.plan.choice_table import build_choice_table
from osdp_lightning.profiling.records import ModelProfile, UnitProfile
from osdp_lightning.solve import (
    SETTLE_AFTER_S,
    SETTLE_GAP,
    Solution,
    SolverUnavailableError,
    knapsack_dp,
    peak_bytes,
    smallest_feasible_budget,
    solve_choice_table,
)

HIDDEN = 1536
TOKENS = 8 * 1024  # micro-batch 8, sequence 1024
FLOPS_PER_S = 100e12
CHOICE_SETS: dict[int, tuple[Choice, ...]] = {
    3: BASE_CHOICES,
    6: BASE_CHOICES + (split_choice(2, 1), split_choice(2, 2), split_choice(4, 2)),
    12: BASE_CHOICES + tuple(split_choice(k, j) for k, js in ((2, (1, 2)), (4, (1, 2, 3, 4)), (8, (2, 4, 6)))
                             for j in js),
}
SPLIT_MULTIPLE = 8
"""``in_features`` of a noisy shape stays a multiple of this (the largest split factor), so every
unit keeps its 12 choices."""
LAYER_SHAPES = (("qkv", 3 * HIDDEN, HIDDEN), ("attn_out", HIDDEN, HIDDEN),
                ("mlp_up", 4 * HIDDEN, HIDDEN), ("mlp_down", HIDDEN, 4 * HIDDEN))
CLUSTER = ClusterSpec(world_size=8, memory_budget_bytes=80 * 2**30, collective_latency_s=30e-6,
                      bandwidth_bytes_per_s=50e9, overlap_efficiency=0.5)
BUDGET_FRACTIONS = (0.0, 0.05, 0.25)
"""Budget = smallest feasible + this share of the way to the all-replicate peak."""


def linear_unit(name: str, out_features: int, in_features: int, rng: random.Random) -> UnitProfile:
    params = out_features * in_features + out_features
    forward_s = 2 * params * TOKENS / FLOPS_PER_S * rng.uniform(0.9, 1.1)
    backward_s = 2 * forward_s * rng.uniform(0.9, 1.1)
    # Splitting into k matmuls costs launch overhead and the sum of k partial outputs.
    overhead = tuple((k, (k - 1) * (20e-6 + 0.02 * (forward_s + backward_s))) for k in (2, 4, 8))
    return UnitProfile(name=name, module_names=(name,), param_count=params, frozen_param_count=0,
                       forward_s=forward_s, backward_s=backward_s, activation_bytes=TOKENS * in_features * 4,
                       linear_shape=(out_features, in_features), split_overhead_s=overhead)


def transformer_profile(units: int, seed: int, shape_noise: float = 0.0) -> ModelProfile:
    """``units - 1`` Linear units of consecutive layers, then the root (embeddings and norms); with
    ``shape_noise``, each Linear's out and in features are scaled by up to that share either way,
    so that no two units have the same bytes (nor, from the noise on seconds, the same seconds)."""
    rng = random.Random(seed)
    layers = []
    for i in range(units - 1):
        name, out_features, in_features = LAYER_SHAPES[i % 4]
        if shape_noise:  # NOTE: no draws without it: the uniform tables stay as they were
            out_features, in_features = (max(1, round(f * rng.uniform(1 - shape_noise, 1 + shape_noise) / step)) * step
                                         for f, step in ((out_features, 1), (in_features, SPLIT_MULTIPLE)))
        layers.append(linear_unit(f"h.{i // 4}.{name}", out_features, in_features, rng))
    embed = 50257 * HIDDEN
    root = UnitProfile(name="", module_names=("",), param_count=embed, frozen_param_count=0,
                       forward_s=2 * embed * TOKENS / FLOPS_PER_S, backward_s=4 * embed * TOKENS / FLOPS_PER_S,
                       activation_bytes=TOKENS * HIDDEN * 4)
    all_units = (*layers, root)
    return ModelProfile(units=all_units, micro_batch_size=8, param_bytes_per_element=4,
                        grad_bytes_per_element=4, compute_bytes_per_element=4, reduce_bytes_per_element=4,
                        optimizer_bytes_per_param=8, activation_bytes=sum(u.activation_bytes for u in all_units))


SOLVERS = ("highs", "cbc")
REAL_MODELS = ("gpt_small", "gpt_xl", "t5_large", "bert_large")


def timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """``fn()``, its wall seconds, and the CPU seconds of this process and its children."""
    def cpu() -> float:
        return (time.process_time() + resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
                + resource.getrusage(resource.RUSAGE_CHILDREN).ru_stime)
    wall, used = time.perf_counter(), cpu()
    result = fn()
    return result, time.perf_counter() - wall, cpu() - used


def solver_rows(name: str, table: Any, budgets: list[tuple[str, int]], cbc_cap_s: float) -> list[dict[str, Any]]:
    """One row per budget and solver, with the knapsack DP's plan for reference."""
    rows = []
    for label, budget in budgets:
        dp = knapsack_dp(table, budget, resolution_bytes=max(2**20, budget // 200_000))
        for solver in SOLVERS:
            limit = cbc_cap_s if solver == "cbc" else None
            try:
                solution, wall_s, cpu_s = timed(partial(solve_choice_table, table, budget, time_limit_s=limit,
                                                        solver=solver))
            except SolverUnavailableError as err:  # say so in the table, and go on with the others
                print(f"{name} {label} {solver}: {err}", flush=True)
                solution, wall_s, cpu_s = Solution((), f"error: {str(err)[:40]}", float("inf"), 0, 0.0), 0.0, 0.0
            assert not solution.feasible or solution.peak_bytes <= budget
            rows.append({"table": name, "units": len(table.units),
                         "choices": round(sum(len(u.choices) for u in table.units) / len(table.units), 1),
                         "budget": label, "budget_gib": budget / 2**30, "solver": solver, "wall_s": wall_s,
                         "cpu_s": cpu_s, "status": solution.status, "gap": solution.gap, "step_s": solution.step_s,
                         "dp_step_s": dp.step_s})
        print(format_rows(rows[-len(SOLVERS):], header=False), flush=True)  # as they come: a run may be cut short
    return rows


def synthetic_rows(sizes: tuple[int, ...], cbc_cap_s: float) -> list[dict[str, Any]]:
    rows = []
    for units in sizes:
        table = build_choice_table(transformer_profile(units, seed=units), CLUSTER, choices=CHOICE_SETS[12])
        smallest = smallest_feasible_budget(table)
        widest = peak_bytes(table, ["replicate"] * units)
        budgets = [(f"+{f:.0%}", smallest + int(f * (widest - smallest))) for f in BUDGET_FRACTIONS]
        rows += solver_rows(f"synthetic {units}", table, budgets, cbc_cap_s)
    return rows


UNEQUAL_SIZES = (1000, 2000)
UNEQUAL_SEEDS = (101, 102, 103, 104, 105)
UNEQUAL_NOISE = (0.05, 0.1, 0.2)
"""Shape noise of the unequal tables (:func:`transformer_profile`); their seeds differ from the
uniform tables' (``seed=units``), which the solver's settings were first measured on."""
UNEQUAL_FRACTION = 0.05


def unequal_rows(sizes: tuple[int, ...], seeds: tuple[int, ...], noises: tuple[float, ...],
                 gap: float | None, cap_s: float | None) -> list[dict[str, Any]]:
    """HiGHS on tables of units that all differ (the default solve, or ``gap``), one row per size and
    noise: median and largest seconds over the seeds, the largest gap and the statuses."""
    rows = []
    for units in sizes:
        for noise in noises:
            runs = [unequal_run(units, seed, noise, gap, cap_s) for seed in seeds]
            walls = sorted(r["wall_s"] for r in runs)
            gaps = [r["gap"] for r in runs]
            rows.append({"units": units, "noise": noise, "seeds": seeds, "median_s": statistics.median(walls),
                         "max_s": walls[-1], "cpu_s": statistics.median(r["cpu_s"] for r in runs),
                         "max_gap": None if None in gaps else max(gaps),
                         "statuses": dict(sorted(Counter(r["status"] for r in runs).items())),
                         "budget_s": statistics.median(r["budget_s"] for r in runs)})
            print(format_unequal(rows[-1:], header=False), flush=True)
    return rows


def unequal_run(units: int, seed: int, noise: float, gap: float | None, cap_s: float | None) -> dict[str, Any]:
    """One solve at the budget :data:`UNEQUAL_FRACTION` of the way from the smallest that fits to the
    all-replicate peak."""
    table = build_choice_table(transformer_profile(units, seed, noise), CLUSTER, choices=CHOICE_SETS[12])
    smallest, budget_s, _ = timed(partial(smallest_feasible_budget, table))
    widest = peak_bytes(table, ["replicate"] * units)
    budget = smallest + int(UNEQUAL_FRACTION * (widest - smallest))
    solution, wall_s, cpu_s = timed(partial(solve_choice_table, table, budget, time_limit_s=cap_s, gap=gap))
    assert solution.feasible and solution.peak_bytes <= budget, solution.status
    return {"wall_s": wall_s, "cpu_s": cpu_s, "gap": solution.gap, "status": solution.status, "budget_s": budget_s}


def format_unequal(rows: list[dict[str, Any]], header: bool = True) -> str:
    lines = ["| units x choices | shape noise | seeds | median wall s | max wall s | median CPU s | largest gap "
             "| statuses | smallest-budget solve s (median) |",
             "|---|---:|---|---:|---:|---:|---:|---|---:|"] if header else []
    lines += [f"| {r['units']} x 12 | {r['noise']:.0%} | {','.join(map(str, r['seeds']))} | {r['median_s']:.2f} "
              f"| {r['max_s']:.2f} | {r['cpu_s']:.2f} | {_gap(r['max_gap'], 4)} "
              f"| {', '.join(f'{k} {n}' for k, n in r['statuses'].items())} | {r['budget_s']:.2f} |" for r in rows]
    return "\n".join(lines)


def real_setup(model: str) -> tuple[ModelProfile, ClusterSpec, tuple[Choice, ...], Any]:
    """The dry-run profile, cluster, choices and config ``osdp-plan model=<model> cluster=a100_80g_x8`` uses."""
    from osdp_lightning.choices import ChoiceOptions, choice_space
    from osdp_lightning.cli.common import cluster_spec
    from osdp_lightning.plan import dryrun

    cfg = dryrun.compose_config([f"model={model}", "cluster=a100_80g_x8"])
    cluster = cluster_spec(cfg.cluster)
    profile, _ = dryrun.estimate_recipe_profile(cfg, cluster)
    choices = choice_space(cluster, ChoiceOptions(
        split_factors=tuple(cfg.strategy.split_factors),
        activation_checkpointing=str(cfg.strategy.get("activation_checkpointing", "auto"))))
    return profile, cluster, choices, cfg


def real_rows(models: tuple[str, ...], cbc_cap_s: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Solver rows of each model's table, and the whole make_plan calls of the targets."""
    from osdp_lightning.plan.planner import batch_candidates

    rows, plans = [], []
    for model in models:
        profile, cluster, choices, cfg = real_setup(model)
        table = build_choice_table(profile, cluster, profile.micro_batch_size, choices=choices)
        smallest = smallest_feasible_budget(table)
        budgets = [("cluster", cluster.usable_bytes), ("+5%", smallest + (cluster.usable_bytes - smallest) // 20)]
        rows += solver_rows(model, table, budgets, cbc_cap_s)
        for batch in ("data", "auto") if model == "gpt_xl" else ("data",) if model == "gpt_small" else ():
            candidates = batch_candidates(profile, "auto" if batch == "auto" else None)
            plans.append({"model": model, "micro_batch": batch,
                          **timed_make_plan(profile, cluster, candidates, choices, cfg.strategy.solver_time_limit_s)})
            print(format_plans(plans[-1:], header=False), flush=True)
    return rows, plans


def timed_make_plan(profile: ModelProfile, cluster: ClusterSpec, candidates: tuple[int, ...] | None,
                    choices: tuple[Choice, ...], time_limit_s: float | None) -> dict[str, Any]:
    """One make_plan call as osdp-plan makes it, timed, counting the tables it really solved."""
    from osdp_lightning.plan import plan as plan_module
    solves, original = [], plan_module.solve_choice_table

    def counting(*args: Any, **kwargs: Any) -> Any:
        solves.append(1)
        return original(*args, **kwargs)

    plan_module.solve_choice_table = counting
    try:
        plan, wall_s, cpu_s = timed(partial(plan_module.make_plan, profile, cluster, micro_batch_sizes=candidates,
                                            choices=choices, time_limit_s=time_limit_s))
    finally:
        plan_module.solve_choice_table = original
    return {"tables": len(plan_module.unit_sets(profile)) * len(candidates or (1,)), "solved": len(solves),
            "wall_s": wall_s, "cpu_s": cpu_s, "status": plan.solver_status, "chosen_batch": plan.micro_batch_size,
            "throughput": plan.predicted_throughput}


def format_rows(rows: list[dict[str, Any]], header: bool = True) -> str:
    lines = ["| table | units | choices/unit | budget (GiB) | solver | wall s | CPU s | status | gap | step s "
             "| DP step s | vs DP | vs other solver |",
             "|---|---:|---:|---|---|---:|---:|---|---:|---:|---:|---:|---:|"] if header else []
    for r in rows:
        other = next(o for o in rows if o["table"] == r["table"] and o["budget"] == r["budget"]
                     and o["solver"] != r["solver"])
        lines.append(
            f"| {r['table']} | {r['units']} | {r['choices']} | {r['budget_gib']:.2f} ({r['budget']}) | {r['solver']} "
            f"| {r['wall_s']:.2f} | {r['cpu_s']:.2f} | {r['status']} | {_gap(r['gap'])} | {r['step_s']:.5f} "
            f"| {r['dp_step_s']:.5f} | {_versus(r['step_s'], r['dp_step_s'])} | {_versus(r['step_s'], other['step_s'])} |")
    return "\n".join(lines)


def format_plans(plans: list[dict[str, Any]], header: bool = True) -> str:
    lines = ["| make_plan | micro-batch | tables | solved | wall s | CPU s | status | chosen micro-batch | samples/s |",
             "|---|---|---:|---:|---:|---:|---|---:|---:|"] if header else []
    lines += [f"| {p['model']} | {p['micro_batch']} | {p['tables']} | {p['solved']} | {p['wall_s']:.2f} "
              f"| {p['cpu_s']:.2f} | {p['status']} | {p['chosen_batch']} | {p['throughput']:.1f} |" for p in plans]
    return "\n".join(lines)


def targets(rows: list[dict[str, Any]], plans: list[dict[str, Any]], unequal: list[dict[str, Any]]) -> str:
    """The solver's time targets, met or not (wall seconds of HiGHS, the default)."""
    def wall(table: str, budget: str) -> float | None:
        found = [r["wall_s"] for r in rows if r["table"] == table and r["budget"] == budget and r["solver"] == "highs"]
        return found[0] if found else None

    highs = [r for r in rows if r["solver"] == "highs"]
    settled = sum(r["status"] == "Feasible" for r in highs)
    checks = [(f"every HiGHS row proven optimal, or within {SETTLE_GAP:g} once proving took {SETTLE_AFTER_S:g} s "
               f"({settled} of {len(highs)} so)", all(r["status"] == "Optimal" or (
                   r["status"] == "Feasible" and r["gap"] is not None and r["gap"] <= SETTLE_GAP) for r in highs)),
              ("no HiGHS plan slower than the DP's or CBC's", all(
                  r["step_s"] <= min(r["dp_step_s"], o["step_s"]) * (1 + 1e-9) for r in rows for o in rows
                  if r["solver"] == "highs" and o["solver"] == "cbc" and (o["table"], o["budget"]) == (r["table"], r["budget"])))]
    for label, table, limit in (("1,000 x 12 at +5% <= 2 s", "synthetic 1000", 2.0),
                                ("2,000 x 12 at +5% <= 5 s", "synthetic 2000", 5.0)):
        seconds = wall(table, "+5%")
        checks.append((f"{label} ({seconds:.2f} s)" if seconds is not None else f"{label} (not run)",
                       seconds is not None and seconds <= limit))
    for model, batch, limit, label in (("gpt_small", "data", 5.0, "osdp-plan gpt_small solve <= 5 s"),
                                       ("gpt_xl", "auto", 10.0, "gpt_xl micro_batch_size=auto <= 10 s")):
        found = [p["wall_s"] for p in plans if p["model"] == model and p["micro_batch"] == batch]
        checks.append((f"{label} ({found[0]:.2f} s)" if found else f"{label} (not run)", bool(found) and found[0] <= limit))
    for r in unequal:
        limit = {1000: 2.0, 2000: 5.0}.get(r["units"])
        if limit is not None:
            checks.append((f"{r['units']:,} x 12 unequal ({r['noise']:.0%} noise), median of {len(r['seeds'])} seeds "
                           f"<= {limit:g} s within a gap of 1e-4 ({r['median_s']:.2f} s, largest gap "
                           f"{_gap(r['max_gap'], 4)})",
                           r["median_s"] <= limit and r["max_gap"] is not None and r["max_gap"] <= 1e-4))
    return "\n".join(f"- [{'x' if ok else ' '}] {label}" for label, ok in checks)


def _gap(gap: float | None, digits: int = 2) -> str:
    return "?" if gap is None else f"{gap:.{digits}%}"


def _versus(mine: float, other: float) -> str:
    if other == float("inf"):
        return "other finds none"
    return f"{100 * (mine - other) / other:+.3f} %"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100 and 1,000 units; gpt_small only")
    parser.add_argument("--cbc-cap", type=float, default=60.0, help="time limit of each CBC solve (s)")
    parser.add_argument("--sizes", type=int, nargs="*", default=None, help="synthetic table sizes (units)")
    parser.add_argument("--models", nargs="*", default=None, help=f"real models (default {REAL_MODELS})")
    parser.add_argument("--unequal-sizes", type=int, nargs="*", default=None,
                        help=f"sizes of the tables whose units all differ (default {UNEQUAL_SIZES})")
    parser.add_argument("--unequal-seeds", type=int, nargs="+", default=UNEQUAL_SEEDS)
    parser.add_argument("--unequal-noise", type=float, nargs="+", default=UNEQUAL_NOISE)
    parser.add_argument("--unequal-gap", type=float, default=None,
                        help="gap= of those solves (default: none, as make_plan solves; 0: prove the optimum)")
    parser.add_argument("--unequal-cap", type=float, default=None, help="time limit of each of those solves (s)")
    args = parser.parse_args()
    print(format_unequal([]), flush=True)
    sizes = args.unequal_sizes if args.unequal_sizes is not None else UNEQUAL_SIZES[:1] if args.quick else UNEQUAL_SIZES
    unequal = unequal_rows(tuple(sizes), tuple(args.unequal_seeds), tuple(args.unequal_noise), args.unequal_gap,
                           args.unequal_cap)
    print(format_rows([]), flush=True)
    rows = synthetic_rows(tuple(args.sizes if args.sizes is not None else (100, 1000) if args.quick else (1000, 2000)),
                          args.cbc_cap)
    models = args.models if args.models is not None else ("gpt_small",) if args.quick else REAL_MODELS
    real, plans = real_rows(tuple(models), args.cbc_cap)
    rows += real
    load = os.getloadavg()[0]
    import highspy
    import pulp

    print(f"\nPuLP {pulp.__version__}, HiGHS {highspy.Highs().version()}, CBC (bundled with PuLP) capped at "
          f"{args.cbc_cap:g} s. Exact bytes for both. Load average {load:.1f} on {os.cpu_count()} CPUs at the end.\n")
    print(format_rows(rows))
    print()
    print(format_plans(plans))
    print()
    print(format_unequal(unequal))
    print("\nTargets (wall seconds, HiGHS):")
    print(targets(rows, plans, unequal))


if __name__ == "__main__":
    main()
