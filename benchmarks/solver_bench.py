"""Solver benchmark: ILP (:func:`solve_choice_table`) against the OSDP authors' knapsack DP.

Run with ``python -m benchmarks.solver_bench [--quick]``. Tables come from the project's own cost
model (:func:`~osdp_lightning.cost.build_choice_table`) on a GPT-2-XL-like stack of Linear units
(hidden 1536; qkv, attention out, MLP up, MLP down per layer, then a root unit), 8 ranks, with
+-10 % noise on every unit's measured seconds as a real profile has. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from osdp_lightning.cost import BASE_CHOICES, ClusterSpec, build_choice_table, split_choice
from osdp_lightning.profile import ModelProfile, UnitProfile
from osdp_lightning.solve import knapsack_dp, peak_bytes, smallest_feasible_budget, solve_choice_table

HIDDEN = 1536
TOKENS = 8 * 1024  # micro-batch 8, sequence 1024
FLOPS_PER_S = 100e12
CHOICE_SETS: dict[int, tuple[str, ...]] = {
    3: BASE_CHOICES,
    6: BASE_CHOICES + (split_choice(2, 1), split_choice(2, 2), split_choice(4, 2)),
    12: BASE_CHOICES + tuple(split_choice(k, j) for k, js in ((2, (1, 2)), (4, (1, 2, 3, 4)), (8, (2, 4, 6)))
                             for j in js),
}
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


def transformer_profile(units: int, seed: int) -> ModelProfile:
    """``units - 1`` Linear units of consecutive layers, then the root (embeddings and norms)."""
    rng = random.Random(seed)
    layers = [linear_unit(f"h.{i // 4}.{LAYER_SHAPES[i % 4][0]}", *LAYER_SHAPES[i % 4][1:], rng)
              for i in range(units - 1)]
    embed = 50257 * HIDDEN
    root = UnitProfile(name="", module_names=("",), param_count=embed, frozen_param_count=0,
                       forward_s=2 * embed * TOKENS / FLOPS_PER_S, backward_s=4 * embed * TOKENS / FLOPS_PER_S,
                       activation_bytes=TOKENS * HIDDEN * 4)
    all_units = (*layers, root)
    return ModelProfile(units=all_units, micro_batch_size=8, param_bytes_per_element=4,
                        grad_bytes_per_element=4, compute_bytes_per_element=4, reduce_bytes_per_element=4,
                        optimizer_bytes_per_param=8, activation_bytes=sum(u.activation_bytes for u in all_units))


def bench_rows(units: int, choices: int, repeats: int) -> list[dict[str, object]]:
    """One row per budget in :data:`BUDGET_FRACTIONS` for one table."""
    table = build_choice_table(transformer_profile(units, seed=units), CLUSTER, choices=CHOICE_SETS[choices])
    start = time.perf_counter()
    smallest = smallest_feasible_budget(table)
    smallest_s = time.perf_counter() - start
    widest = peak_bytes(table, ["replicate"] * units)
    rows = []
    for fraction in BUDGET_FRACTIONS:
        budget = smallest + int(fraction * (widest - smallest))
        runs = [solve_choice_table(table, budget) for _ in range(repeats)]
        ilp = runs[-1]
        dp = knapsack_dp(table, budget)
        assert ilp.feasible and ilp.peak_bytes <= budget and (not dp.feasible or dp.peak_bytes <= budget)
        assert not dp.feasible or ilp.step_s <= dp.step_s * (1 + 1e-9), "the ILP must never lose to the DP"
        rows.append({"units": units, "choices": choices, "fraction": fraction, "budget_gib": budget / 2**30,
                     "ilp_s": statistics.median(r.solve_s for r in runs), "repeats": repeats,
                     "smallest_s": smallest_s, "status": ilp.status, "ilp_step_s": ilp.step_s,
                     "dp_step_s": dp.step_s, "dp_s": dp.solve_s})
    return rows


def format_table(rows: list[dict[str, object]]) -> str:
    lines = ["| units | choices/unit | budget (GiB) | ILP solve s (median) | min-budget solve s | ILP status "
             "| ILP step s | DP step s | DP s | ILP faster than DP by |",
             "|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        gain = ("DP finds no plan" if r["dp_step_s"] == float("inf")
                else f"{100 * (r['dp_step_s'] - r['ilp_step_s']) / r['dp_step_s']:.3f} %")
        lines.append(f"| {r['units']} | {r['choices']} | {r['budget_gib']:.2f} (+{r['fraction']:.0%}) "
                     f"| {r['ilp_s']:.3f} (x{r['repeats']}) | {r['smallest_s']:.3f} | {r['status']} "
                     f"| {r['ilp_step_s']:.4f} | {r['dp_step_s']:.4f} | {r['dp_s']:.2f} | {gain} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 and 100 units only")
    args = parser.parse_args()
    sizes = (10, 100) if args.quick else (10, 100, 1000, 2000)
    rows = []
    for choices in (3, 6, 12):
        for units in sizes:
            rows += bench_rows(units, choices, repeats=5 if units <= 100 else 1)
            print(f"done: {units} units x {choices} choices", flush=True)
    print()
    print(f"DP: 1 MiB resolution, worst-case prefetch pair reserved; ILP: PuLP {_pulp_version()} + CBC, "
          f"exact bytes. {CLUSTER.world_size} ranks. Budget = smallest feasible + (x %) of the way to "
          "the all-replicate peak.\n")
    print(format_table(rows))


def _pulp_version() -> str:
    import pulp

    return pulp.__version__


if __name__ == "__main__":
    main()
