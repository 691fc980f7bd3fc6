"""The solver with and without the order rows of identical neighbours (``osdp_lightning.symmetry``).

Run with ``python -m benchmarks.symmetry_check [models...]``. For each recipe's dry-run table on
``a100_80g_x8`` (the choices ``osdp-plan`` offers) and budgets at the smallest that fits plus
0-50% of the way to the all-replicate peak (or the cluster's budget, if smaller), it solves with
the rows and without them, and prints both times, both plans' step times and whether they agree
(the rows must never change the optimum).
"""

from __future__ import annotations

import argparse
import time

from benchmarks.solver_bench import real_setup
from osdp_lightning import solve
from osdp_lightning.cost import ChoiceTable, build_choice_table

MODELS = ("t5_large", "bert_large", "gpt_xl", "t5_base", "bert_base", "gpt_large", "gpt_medium", "gpt_48l_h1536")
FRACTIONS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5)


def timed_solve(table: ChoiceTable, budget: int, rows: bool) -> tuple[solve.Solution, float]:
    """One solve, with the order rows or with none (the module's own function swapped out)."""
    original = solve.forbidden_orders
    if not rows:
        solve.forbidden_orders = lambda *args, **kwargs: {}
    try:
        start = time.perf_counter()
        solution = solve.solve_choice_table(table, budget, time_limit_s=120)
        return solution, time.perf_counter() - start
    finally:
        solve.forbidden_orders = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(MODELS))
    args = parser.parse_args()
    print("| model | budget | with rows s | without s | status | step s (with / without) | agree |")
    print("|---|---|---:|---:|---|---|---|")
    for model in args.models:
        profile, cluster, choices, _ = real_setup(model)
        table = build_choice_table(profile, cluster, profile.micro_batch_size, choices=choices)
        smallest = solve.smallest_feasible_budget(table)
        widest = min(solve.peak_bytes(table, ["replicate"] * len(table.units)), cluster.usable_bytes)
        for fraction in FRACTIONS:
            budget = smallest + int(fraction * (widest - smallest))
            (ours, ours_s), (plain, plain_s) = (timed_solve(table, budget, rows) for rows in (True, False))
            agree = (ours.status == plain.status == solve.OPTIMAL and ours.peak_bytes <= budget
                     and abs(ours.step_s - plain.step_s) <= 1e-9 * plain.step_s)
            print(f"| {model} | +{fraction:.0%} | {ours_s:.2f} | {plain_s:.2f} | {ours.status} / {plain.status} | "
                  f"{ours.step_s:.6f} / {plain.step_s:.6f} | {'yes' if agree else '**NO**'} |", flush=True)


if __name__ == "__main__":
    main()
