"""Identical neighbours in a fixed order (symmetry.py): every forbidden order can be swapped away
without a larger peak or another step time, and the ILP with those rows still finds the optimum
that brute force finds, on tables of repeated blocks."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import random

import pytest
from test_solve import best_step, chosen, evaluate, make_table

from osdp_lightning.cost.cost import ChoiceCost, ChoiceTable
from osdp_lightning.solve import (
    OPTIMAL,
    peak_bytes,
    smallest_feasible_budget,
    solve_choice_table,
    step_seconds,
)
from osdp_lightning.solve.evaluate import moment_peak, parts_of
from osdp_lightning.solve.symmetry import forbidden_orders, sorted_plan

SEEDS = range(40)


def blocks_table(seed: int) -> ChoiceTable:
    """A run of 2-4 identical blocks (4 choices) between 0-2 other units and 0-1 after; the blocks
    gather one of two sizes or nothing (zero3, zero2, replicate, each with and without recompute),
    so that many swaps leave the neighbours the same buffers."""
    rng = random.Random(seed)
    gathered = [rng.randint(1, 1500), rng.randint(1, 1500)]

    def choice(name: str, sizes: list[int]) -> ChoiceCost:
        prefetch = rng.choice([0, *sizes])
        backward = rng.choice([0, prefetch, *sizes])
        state = rng.randint(0, 1000)
        # sharded gradients given back in backward, and a reduce-scatter input: of a sharded choice
        # (its size one of the block's) or none (replicated)
        reduce = rng.choice([0, *sizes])
        return ChoiceCost(name, state, rng.randint(0, 500) if rng.random() < 0.5 else 0,
                          rng.randint(0, 1500), rng.uniform(0.0, 1.0), rng.uniform(0.0, 1.0), prefetch,
                          activation_bytes=rng.randint(0, 800),
                          forward_bytes=rng.randint(0, 2000) if rng.random() < 0.6 else None,
                          backward_prefetch_bytes=backward, late_grad_bytes=rng.randint(0, state) if reduce else 0,
                          reduce_bytes=reduce)

    def other() -> list[ChoiceCost]:
        return [choice(f"o{i}", [rng.randint(1, 1500)]) for i in range(2)]

    block = []
    for i in range(2):  # a family and its recomputing variant: the same buffers, other bytes and seconds
        base = choice(f"c{i}", gathered)
        block += [base, dataclasses.replace(base, choice=f"c{i}+ckpt", activation_bytes=rng.randint(0, 100),
                                            transient_bytes=base.transient_bytes + rng.randint(0, 800),
                                            compute_s=base.compute_s + rng.uniform(0.0, 0.5))]
    before, run, after = rng.randint(0, 2), rng.randint(2, 4), rng.randint(0, 1)
    units = [other() for _ in range(before)] + [block] * run + [other() for _ in range(after)]
    overlap = rng.uniform(0.0, 0.6)
    overlaps = [rng.uniform(0.0, 0.6) for _ in range(before)] + [overlap] * run + [0.0] * after
    spans = [rng.random() < 0.3 for _ in range(before)] + [False] * (run + after)
    return make_table(units, overlaps, rng.randint(0, 1000), rng.randint(0, 1000), spans)


def relaxed_peak(table: ChoiceTable, plan: tuple[str, ...]) -> int:
    """The peak the relaxation prices (each neighbour's own buffers, nothing carried)."""
    costs = chosen(table, plan)
    moments = moment_peak(parts_of(list(costs)), [u.spans_step for u in table.units], through=False)
    return sum(c.state_bytes for c in costs) + moments + table.activation_bytes + table.fixed_bytes


@pytest.mark.parametrize("carry", [True, False])
def test_every_forbidden_order_swaps_to_no_larger_peak(carry: bool) -> None:
    peak = peak_bytes if carry else relaxed_peak
    found = 0
    for seed in SEEDS:
        table = blocks_table(seed)
        forbidden = forbidden_orders(table, [list(u.choices) for u in table.units], carry)
        for plan in itertools.product(*([c.choice for c in u.choices] for u in table.units)):
            for u, pairs in forbidden.items():
                if (plan[u], plan[u + 1]) in pairs:
                    found += 1
                    swapped = (*plan[:u], plan[u + 1], plan[u], *plan[u + 2:])
                    assert peak(table, swapped) <= peak(table, plan), (seed, plan, u)
                    assert step_seconds(table, swapped) == pytest.approx(step_seconds(table, plan), rel=1e-12)
            ordered = sorted_plan(plan, forbidden)
            assert sorted(ordered) == sorted(plan) and peak(table, ordered) <= peak(table, plan)
            assert not any((ordered[u], ordered[u + 1]) in pairs for u, pairs in forbidden.items())
    assert found > (500 if carry else 100)  # the tables exercise the rule


@functools.cache
def brute_force(seed: int) -> tuple[ChoiceTable, list[tuple[int, float, tuple[ChoiceCost, ...]]]]:
    table = blocks_table(seed)
    return table, [(*evaluate(table, combo), combo) for combo in itertools.product(*(u.choices for u in table.units))]


@pytest.mark.parametrize("seed, solver", [(seed, "highs") for seed in SEEDS] + [(seed, "cbc") for seed in SEEDS[::4]])
def test_ilp_with_order_rows_matches_brute_force(seed: int, solver: str) -> None:
    table, results = brute_force(seed)
    peaks = sorted({r[0] for r in results})
    assert smallest_feasible_budget(table, solver=solver) == peaks[0]
    for budget in peaks[:: max(1, len(peaks) // 12)]:
        solution = solve_choice_table(table, budget, solver=solver)
        assert solution.status == OPTIMAL and solution.peak_bytes <= budget
        assert solution.step_s == pytest.approx(best_step(results, budget), rel=1e-9)
