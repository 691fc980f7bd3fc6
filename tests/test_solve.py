"""Stage 3 (osdp_lightning.solve): the ILP against brute force, the knapsack baseline and its own limits."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import random

import pulp
import pytest

from osdp_lightning import solve
from osdp_lightning.cost.cost import ChoiceCost, ChoiceTable, UnitCosts
from osdp_lightning.plan.choice_table import build_choice_table
from osdp_lightning.solve import (
    FEASIBLE,
    INFEASIBLE,
    OPTIMAL,
    TIME_LIMIT,
    knapsack_dp,
    model,
    peak_bytes,
    search,
    smallest_feasible_budget,
    solve_choice_table,
    step_seconds,
)

SEEDS = range(60)
REL_TOL = 1e-8


def make_table(units: list[list[tuple | ChoiceCost]], overlaps: list[float] | None = None, activation: int = 0,
               fixed: int = 0, spans: list[bool] | None = None, optimizer: int = 0) -> ChoiceTable:
    """``units[u]`` lists ``(name, state, held, transient, compute_s, comm_s[, prefetch])`` (or a
    ``ChoiceCost``) per choice; ``spans[u]``: the unit's live bytes count in every moment;
    ``optimizer``: the optimizer step's own bytes."""
    overlaps = overlaps or [0.0] * len(units)
    spans = spans or [False] * len(units)
    return ChoiceTable(
        units=tuple(UnitCosts(f"u{u}", tuple(c if isinstance(c, ChoiceCost) else ChoiceCost(*c) for c in choices),
                              overlap, spans_step=spanning)
                    for u, (choices, overlap, spanning) in enumerate(zip(units, overlaps, spans, strict=True))),
        activation_bytes=activation, fixed_bytes=fixed, micro_batch_size=1, optimizer_step_bytes=optimizer)


def random_table(seed: int) -> ChoiceTable:
    """Up to 8 units x 3 choices; bytes from a few hundred to TB (exactness must hold at scale), seconds
    up to 1 or, as a dry run on a fast device gives them, up to 1e-5 (the solvers' tolerances are absolute)."""
    rng = random.Random(seed)
    factor = rng.choice((1, 1, 1_000_003, 2**30 + 7))
    second = random.Random(-seed).choice((1.0, 1.0, 1e-5))

    def choice(name: str) -> tuple:
        held = rng.randint(0, 500 * factor) if rng.random() < 0.5 else 0
        transient = rng.randint(0, 1500 * factor)
        # Half the choices prefetch only part of their transient (zero3: parameters, not gradients).
        # A quarter gather nothing (replicated): a farther unit's buffer passes them.
        prefetch = rng.choice((rng.randint(0, transient), 0)) if rng.random() < 0.5 else None
        comm = rng.uniform(0.0, second)
        exposed = rng.uniform(0.0, comm) if rng.random() < 0.5 else 0.0  # latency overlap cannot hide
        # Activations (live until the unit's backward) and a forward moment of its own, or none.
        activation = rng.randint(0, 800 * factor) if rng.random() < 0.6 else 0
        forward = rng.randint(0, 2000 * factor) if rng.random() < 0.6 else None
        # What it gathers for backward: as in forward, or nothing (zero2), or another size.
        backward = rng.choice((None, 0, rng.randint(0, 1500 * factor)))
        # Sharded gradients made only at its post-backward (part of the state), and a reduce-scatter
        # input kept through the backward before it: both, either or neither (replicated).
        state = rng.randint(0, 1000 * factor)
        late = rng.randint(0, state) if rng.random() < 0.5 else 0
        reduce = rng.randint(0, 1500 * factor) if rng.random() < 0.5 else 0
        return ChoiceCost(name, state, held, transient, rng.uniform(0.0, second), comm,
                          prefetch, exposed, activation_bytes=activation, forward_bytes=forward,
                          backward_prefetch_bytes=backward, late_grad_bytes=late, reduce_bytes=reduce)

    units = []
    for _ in range(rng.randint(1, 8)):
        choices = [choice(f"c{i}") for i in range(rng.randint(1, 3))]
        if len(choices) < 3 and rng.random() < 0.2:
            choices.append(dataclasses.replace(choices[0], choice=f"dup{len(choices)}"))  # a tie under another name
        units.append(choices)
    # Replicated choices DDP's bucket rebuild allocates for again (their own stream: the other draws
    # stay as they were)
    rebuilds = random.Random(seed + 15485863)
    units = [[dataclasses.replace(c, rebuild_bytes=rebuilds.randint(0, 1500 * factor)) if rebuilds.random() < 0.3
              else c for c in choices] for choices in units]
    overlaps = [rng.uniform(0.0, 0.6 * second) for _ in units]  # hides some, not all, of the collectives
    spans = [rng.random() < 0.2 for _ in units]  # the root, a tied embedding and head
    twins = random.Random(seed + 7919)  # repeated blocks: a unit the same as the one before it
    for u in range(1, len(units)):
        if twins.random() < 0.4:
            units[u], overlaps[u] = units[u - 1], overlaps[u - 1]
    # An optimizer step that allocates beside the state (its own stream: the other draws stay as they were)
    steps = random.Random(seed + 104729)
    optimizer = steps.randint(0, 4000 * factor) if steps.random() < 0.4 else 0
    return make_table(units, overlaps, rng.randint(0, 1000 * factor), rng.randint(0, 1000 * factor), spans, optimizer)


def evaluate(table: ChoiceTable, combo: tuple[ChoiceCost, ...], pair_term: bool = True,
             overlap: bool = True) -> tuple[int, float]:
    """Independent oracle: peak bytes and step seconds, straight from the formulas.

    Every unit's forward moment (live bytes of the units before it, its forward bytes, the forward
    buffer of the nearest unit before it that gathers), the end of its forward (live bytes up to it
    and its forward bytes less those it holds to backward, when it has forward bytes; not for a unit
    that spans the step) and backward moment (live bytes up to it, its
    transient, the backward gather of the nearest gathering unit before it (on either side for a
    unit that spans the step: its backward runs elsewhere in the order), the largest
    reduce-scatter input of the units after it that do not span the step, less the sharded
    gradients of the units up to it and of those spanning the step); units that span the step are
    alive in every moment and see every unit in theirs, with no reduce-scatter input and nothing
    given back. The optimizer step: the state, the fixed bytes and its own, nothing else. DDP's
    bucket rebuild: the state, the fixed bytes and every choice's rebuild bytes.
    """
    transients = [c.transient_bytes for c in combo]
    held = [c.transient_bytes if c.prefetch_bytes is None else c.prefetch_bytes for c in combo]
    regathered = [held[u] if c.backward_prefetch_bytes is None else c.backward_prefetch_bytes
                  for u, c in enumerate(combo)]
    live = [c.held_bytes + c.activation_bytes for c in combo]
    forward = [live[u] + transients[u] if c.forward_bytes is None else c.forward_bytes for u, c in enumerate(combo)]
    spans = [unit.spans_step for unit in table.units]
    reduces = [0 if spans[u] else c.reduce_bytes for u, c in enumerate(combo)]

    def nearest_gathering(units: range, buffers: list[int]) -> int:  # units that gather nothing let it through
        return next((buffers[v] for v in units if buffers[v]), 0)

    def alive(u: int, upto: bool) -> int:
        return sum(live[v] for v in range(len(combo)) if spans[u] or spans[v] or v < u or (upto and v == u))

    n = len(combo)
    moments = []
    for u in range(n):
        before = nearest_gathering(range(u - 1, -1, -1), held) if pair_term else 0
        sides = [range(u - 1, -1, -1), *([range(u + 1, n)] if spans[u] else [])]  # the unit after u is resharded
        beside = max(nearest_gathering(side, regathered) for side in sides) if pair_term else 0
        reduced = max((reduces[v] for v in range(u + 1, n)), default=0) if pair_term else 0
        not_made = sum(combo[v].late_grad_bytes for v in range(n) if spans[v] or v <= u)
        extra = 0 if spans[u] else reduced - not_made
        ended = 0 if combo[u].forward_bytes is None or spans[u] else max(combo[u].forward_bytes - combo[u].held_bytes, 0)
        moments += [alive(u, False) + forward[u] + before, alive(u, True) + ended,
                    alive(u, True) + transients[u] + beside + extra]
    state = sum(c.state_bytes for c in combo)
    rebuild = sum(c.rebuild_bytes for c in combo)
    peak = max(state + max(moments) + table.activation_bytes, state + table.optimizer_step_bytes,
               state + rebuild) + table.fixed_bytes
    step = sum(c.compute_s + max(c.exposed_s, c.comm_s - (u.overlap_s if overlap else 0.0))
               for u, c in zip(table.units, combo, strict=True))
    return peak, step


@functools.cache
def brute_force(seed: int) -> tuple[ChoiceTable, list[tuple[int, float, tuple[ChoiceCost, ...]]]]:
    table = random_table(seed)
    combos = itertools.product(*(unit.choices for unit in table.units))
    return table, [(*evaluate(table, combo), combo) for combo in combos]


def chosen(table: ChoiceTable, choices: tuple[str, ...]) -> tuple[ChoiceCost, ...]:
    return tuple(unit.cost_of(choice) for unit, choice in zip(table.units, choices, strict=True))


def budgets_for(seed: int) -> list[int]:
    """Infeasible, exactly tight, in between and loose budgets for one random instance."""
    _, results = brute_force(seed)
    lowest, highest = min(r[0] for r in results), max(r[0] for r in results)
    rng = random.Random(1000 + seed)
    return [lowest - 1 - rng.randint(0, lowest // 4), lowest - 1, lowest,
            rng.randint(lowest, highest), highest + 1]


def best_step(results: list, budget: int) -> float | None:
    fitting = [step for peak, step, _ in results if peak <= budget]
    return min(fitting) if fitting else None


def test_peak_and_step_by_hand() -> None:
    table = make_table([[("a", 100, 10, 50, 1.0, 0.5)], [("a", 200, 0, 70, 2.0, 0.1)],
                        [("a", 300, 0, 10, 3.0, 2.0)]], overlaps=[0.2, 0.3, 1.5], activation=7, fixed=3)
    # persistent 610 + activations 7 + fixed 3 + prefetch pair (50 + 70) = 740
    assert peak_bytes(table, ["a", "a", "a"]) == 740
    # compute 6.0 + exposed comm max(0, 0.3) + max(0, -0.2) + max(0, 0.5) = 6.8
    assert step_seconds(table, ["a", "a", "a"]) == pytest.approx(6.8)
    single = make_table([[("a", 5, 0, 11, 1.0, 0.0)]])
    assert peak_bytes(single, ["a"]) == 16  # one unit: its own transient
    with pytest.raises(ValueError):
        peak_bytes(table, ["a", "a"])
    with pytest.raises(KeyError):
        step_seconds(table, ["a", "a", "nope"])
    empty = make_table([])
    with pytest.raises(ValueError):
        solve_choice_table(empty, 10)
    with pytest.raises(ValueError):
        knapsack_dp(make_table([[]]), 10)


SOLVER_CASES = [(seed, "highs") for seed in SEEDS] + [(seed, "cbc") for seed in SEEDS[::3]]


@pytest.mark.parametrize("seed, solver", SOLVER_CASES)
def test_ilp_matches_brute_force(seed: int, solver: str) -> None:
    table, results = brute_force(seed)
    lowest = min(r[0] for r in results)
    assert smallest_feasible_budget(table, solver=solver) == lowest
    for budget in budgets_for(seed):
        solution = solve_choice_table(table, budget, solver=solver)
        expected = best_step(results, budget)
        if expected is None:
            assert solution.status == INFEASIBLE and solution.choices == () and not solution.feasible
            continue
        assert solution.status == OPTIMAL and solution.feasible and solution.gap == 0.0
        oracle_peak, oracle_step = evaluate(table, chosen(table, solution.choices))
        assert solution.peak_bytes == oracle_peak <= budget
        assert solution.step_s == pytest.approx(oracle_step, rel=1e-12)
        assert solution.step_s == pytest.approx(expected, rel=REL_TOL)


@pytest.mark.parametrize("seed", SEEDS)
def test_knapsack_dp_never_beats_the_ilp(seed: int) -> None:
    table, results = brute_force(seed)
    lowest = min(r[0] for r in results)
    resolution = max(1, lowest // 5000) * random.Random(seed).choice((1, 7, 64))
    for budget in budgets_for(seed):
        dp = knapsack_dp(table, budget, resolution_bytes=resolution)
        expected = best_step(results, budget)
        if not dp.feasible:
            continue
        assert expected is not None, "the DP found a plan where none fits"
        assert dp.peak_bytes == evaluate(table, chosen(table, dp.choices))[0] <= budget
        assert dp.step_s >= expected * (1 - REL_TOL)
        assert dp.step_s >= solve_choice_table(table, budget).step_s * (1 - REL_TOL)
    # With room for its rounding, the DP must find a plan (or the checks above test nothing). It
    # counts every unit's live bytes at once: room for the heaviest plan so counted.
    roomy = model.build_model(table, prune=False).max_peak_bytes + len(table.units) * resolution
    assert knapsack_dp(table, roomy, resolution_bytes=resolution).feasible


def test_random_instances_exercise_pair_term_and_overlap() -> None:
    """Without these counts the brute-force comparison could pass on instances that never bind."""
    pair_binds = overlap_binds = 0
    for seed in SEEDS:
        table, results = brute_force(seed)
        for budget in budgets_for(seed)[2:4]:
            expected = best_step(results, budget)
            # The plan a model without the prefetch pair would pick: does it really fit?
            no_pair = min((r for r in results if evaluate(table, r[2], pair_term=False)[0] <= budget),
                          key=lambda r: r[1])
            pair_binds += no_pair[0] > budget
            # The plan picked ignoring overlap: is it slower than the optimum once overlap counts?
            no_overlap = min((r for r in results if r[0] <= budget),
                             key=lambda r: evaluate(table, r[2], overlap=False)[1])
            overlap_binds += no_overlap[1] > expected * (1 + REL_TOL)
    assert pair_binds >= 20
    assert overlap_binds >= 5


def test_a_replicated_unit_does_not_keep_sharded_units_apart() -> None:
    # Sharding a unit frees 100 bytes, but its gather (60) stays alive until the next unit that
    # gathers: a replicated unit between two sharded ones gathers nothing (FSDP2's forward keeps the
    # last all-gather's buffer; its backward prefetches the next sharded unit, past replicated ones).
    rep, z3, z3_cheap = ("rep", 100, 0, 0, 1.0, 0.0), ("z3", 0, 0, 60, 2.0, 0.0), ("z3", 0, 0, 60, 1.5, 0.0)
    table = make_table([[rep, z3], [rep, z3_cheap], [rep, z3]])
    assert peak_bytes(table, ("z3", "rep", "z3")) == 100 + 60 + 60
    # No plan with two sharded units fits 180 bytes, however they are placed: all three are sharded.
    solution = solve_choice_table(table, 180)
    assert solution.choices == ("z3", "z3", "z3") and solution.peak_bytes == 120
    assert solution.step_s == pytest.approx(5.5)
    # A middle unit that gathers a little ends the first buffer: the far pair no longer coexists.
    gathers_a_little = ("small", 100, 0, 10, 1.0, 0.0)
    table = make_table([[rep, z3], [gathers_a_little], [rep, z3]])
    assert peak_bytes(table, ("z3", "small", "z3")) == 100 + 60 + 10
    assert solve_choice_table(table, 170).choices == ("z3", "small", "z3")


def test_ilp_strictly_better_than_dp_on_pair_term() -> None:
    # Both units fast and replicated peak at 200 + 10 + 10 = 220. The DP cannot see which two
    # transients meet, so it reserves the worst pair (100 + 100) and has to shard both.
    fast, sharded = ("fast", 100, 0, 10, 1.0, 0.0), ("sharded", 10, 0, 100, 2.0, 0.0)
    table = make_table([[fast, sharded], [fast, sharded]])
    ilp, dp = solve_choice_table(table, 220), knapsack_dp(table, 220, resolution_bytes=1)
    assert ilp.choices == ("fast", "fast") and ilp.step_s == pytest.approx(2.0)
    assert dp.choices == ("sharded", "sharded") and dp.step_s == pytest.approx(4.0)


def test_ilp_strictly_better_than_dp_on_rounding() -> None:
    # 1 MiB + 1 byte rounds up to 2 MiB per unit in the DP: the exact budget no longer fits.
    fast, slow = ("fast", 2**20 + 1, 0, 0, 1.0, 0.0), ("slow", 0, 0, 0, 3.0, 0.0)
    table = make_table([[fast, slow], [fast, slow]])
    budget = 2 * (2**20 + 1)
    ilp, dp = solve_choice_table(table, budget), knapsack_dp(table, budget)
    assert ilp.choices == ("fast", "fast") and ilp.peak_bytes == budget
    assert dp.feasible and dp.step_s == pytest.approx(4.0) and ilp.step_s == pytest.approx(2.0)


def test_exactly_tight_budget_regression() -> None:
    # CBC 2.10's preprocessing called this budget (the exact minimum peak) infeasible when the
    # memory row had no slack at all.
    table = make_table(
        [[("c0", 827, 331, 1049, 0.08755058519352132, 0.15982815471181144)],
         [("c0", 448, 50, 1166, 0.33438765904821743, 0.016462352292243132),
          ("c1", 649, 157, 124, 0.4212548756059541, 0.5056412646556553)],
         [("c0", 257, 486, 1629, 0.5644738070179361, 0.9815602835504847),
          ("c1", 397, 344, 369, 0.7710510370964243, 0.324154668570523),
          ("c2", 128, 274, 1470, 0.4799945792025646, 0.642865206844139)]],
        overlaps=[0.4237856265748965, 0.5232798750588797, 0.4435749587142182], activation=401, fixed=413)
    assert smallest_feasible_budget(table) == 4348
    solution = solve_choice_table(table, 4348)
    assert solution.status == OPTIMAL and solution.choices == ("c0", "c1", "c1")
    assert solution.peak_bytes == 4348


def test_plan_just_over_budget_is_cut_off() -> None:
    # CBC sees a budget a little larger than the real one (its tolerances are ~1e-8 of 1 TB);
    # the fast plan is 1 byte over, so it must be cut off and the slow one returned as optimal.
    table = make_table([[("fast", 10**12, 0, 0, 1.0, 0.0), ("slow", 10**12 - 10, 0, 0, 2.0, 0.0)]])
    solution = solve_choice_table(table, 10**12 - 1)
    assert solution.status == OPTIMAL and solution.choices == ("slow",)
    assert solution.peak_bytes == 10**12 - 10


def test_too_many_plans_over_budget_fall_back_to_a_fitting_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(search, "_MAX_CUTS", 1)  # as if symmetric units put many plans in the slack
    table = make_table([[("fast", 10**12, 0, 0, 1.0, 0.0), ("slow", 10**12 - 10**6, 0, 0, 2.0, 0.0)]])
    solution = solve_choice_table(table, 10**12 - 1)
    # It fits, but only the relaxed bound (1.0 s, the cut-off plan) is known: not proven optimal.
    assert solution.status == FEASIBLE and solution.feasible and solution.choices == ("slow",)
    assert solution.gap == pytest.approx(0.5)


def test_infeasible_budget_does_not_raise() -> None:
    table = make_table([[("a", 100, 0, 10, 1.0, 0.0), ("b", 50, 0, 30, 2.0, 0.0)]], activation=5)
    assert smallest_feasible_budget(table) == 85
    solution = solve_choice_table(table, 84)
    assert solution.status == INFEASIBLE and solution.choices == () and not solution.feasible
    assert math.isinf(solution.step_s)
    assert knapsack_dp(table, 84, resolution_bytes=1).status == INFEASIBLE
    with pytest.raises(dataclasses.FrozenInstanceError):
        solution.status = OPTIMAL  # type: ignore[misc]


def hard_table(units: int = 300, choices: int = 4, seed: int = 0) -> ChoiceTable:
    """Strongly correlated multiple-choice knapsack: memory saved costs almost exactly its time."""
    rng = random.Random(seed)
    rows = []
    for _ in range(units):
        sizes = [rng.randint(10**6, 10**7) for _ in range(choices)]
        rows.append([(f"c{i}", w, 0, 0, 1e-7 * (10**7 - w) + rng.uniform(0, 1e-3), 0.0)
                     for i, w in enumerate(sizes)])
    return make_table(rows)


@pytest.mark.parametrize("solver", ["highs", "cbc"])
def test_time_limit_reports_status_and_gap(solver: str) -> None:
    table = hard_table(units=600)
    budget = sum(sum(c.state_bytes for c in u.choices) // len(u.choices) for u in table.units)
    # Proving this optimum takes ~18 s (HiGHS, gap=0); the knapsack seed always fits.
    solution = solve_choice_table(table, budget, time_limit_s=0.3, solver=solver)
    assert solution.status == TIME_LIMIT and solution.feasible and solution.peak_bytes <= budget
    assert solution.solve_s < 10
    dp = knapsack_dp(table, budget)
    assert solution.step_s <= dp.step_s * (1 + REL_TOL)  # never worse than its seed
    if solution.gap is not None:  # a bound was proven: no plan that fits is below it
        assert 0.0 < solution.gap <= 1.0  # 1.0: only the trivial bound 0 so far
        assert solution.step_s * (1 - solution.gap) <= dp.step_s * (1 + REL_TOL)


def test_a_gap_stops_early_and_says_so() -> None:
    table = hard_table(units=60, seed=1)
    budget = sum(sum(c.state_bytes for c in u.choices) // len(u.choices) for u in table.units)
    proven = solve_choice_table(table, budget, gap=0.0)
    loose = solve_choice_table(table, budget, gap=0.05)
    assert proven.status == OPTIMAL and proven.gap == 0.0
    assert loose.feasible and loose.peak_bytes <= budget and loose.step_s <= proven.step_s * 1.05
    if loose.status != OPTIMAL:  # stopped within the gap without proving the optimum
        assert loose.status == FEASIBLE and loose.gap is not None and 0.0 < loose.gap <= 0.05 + 1e-9
    # Without a gap, HiGHS settles for solve.SETTLE_GAP once proving takes long (here ~3 s): it says so.
    settled = solve_choice_table(table, budget)
    assert settled.status == FEASIBLE and settled.peak_bytes <= budget
    assert settled.gap is not None and 0.0 < settled.gap <= solve.SETTLE_GAP
    assert proven.step_s <= settled.step_s <= proven.step_s * (1 + solve.SETTLE_GAP)
    assert settled.step_s * (1 - settled.gap) <= proven.step_s * (1 + REL_TOL)  # the gap is a true bound
    with pytest.raises(ValueError, match="gap"):
        solve_choice_table(table, budget, gap=1.5)


def realistic_table(units: int, seed: int = 0) -> ChoiceTable:
    """Transformer-like Linear units (4h^2-ish parameters), replicate/zero2/zero3 on 8 ranks."""
    rng = random.Random(seed)
    rows, overlaps = [], []
    for u in range(units):
        params = (3, 1, 4, 4)[u % 4] * 1536**2
        compute = 6 * params * 8192 / 1e14 * rng.uniform(0.9, 1.1)
        comm = params * 4 / 50e9
        rows.append([("replicate", 16 * params, 0, 4 * params, compute, 1.75 * comm + 3e-5),
                     ("zero2", 2 * params, 4 * params, 4 * params, compute, 1.75 * comm + 6e-5),
                     ("zero3", 2 * params, 0, 8 * params, compute, 2.6 * comm + 9e-5)])
        overlaps.append(0.5 * compute * rng.uniform(0.5, 1.5))
    return make_table(rows, overlaps, activation=units * 50 * 2**20, fixed=2**30)


def test_thousand_units_solve_to_a_proven_optimum() -> None:
    table = realistic_table(1000)
    lowest = smallest_feasible_budget(table)
    widest = peak_bytes(table, ["replicate"] * 1000)
    budget = lowest + (widest - lowest) // 5
    solution = solve_choice_table(table, budget, gap=0.0)  # proven, however loaded the machine
    assert solution.status == OPTIMAL and solution.peak_bytes <= budget
    # NOTE: the 5 s target is measured by benchmarks/solver_bench.py, not asserted here.
    assert len(set(solution.choices)) > 1  # the budget really forces a mix
    dp = knapsack_dp(table, budget)
    assert dp.feasible and solution.step_s <= dp.step_s * (1 + 1e-12)


def unequal_table(units: int, seed: int, noise: float) -> ChoiceTable:
    """The solver benchmark's Linear units with every shape scaled by up to ``noise``: no two alike
    in bytes or seconds, 12 choices each (base and split), the root last."""
    from benchmarks.solver_bench import CHOICE_SETS, CLUSTER, transformer_profile

    return build_choice_table(transformer_profile(units, seed, noise), CLUSTER, choices=CHOICE_SETS[12])


def assert_within_settle_gap(settled: solve.Solution, optimum: float, budget: int) -> None:
    """A plan that fits, proven optimal or said to be within its gap (at most ``SETTLE_GAP``), truly."""
    assert settled.feasible and settled.peak_bytes <= budget
    assert optimum * (1 - REL_TOL) <= settled.step_s <= optimum * (1 + solve.SETTLE_GAP)
    if settled.status == OPTIMAL:
        assert settled.gap == 0.0 and settled.step_s == pytest.approx(optimum, rel=REL_TOL)
    else:
        assert settled.status == FEASIBLE and settled.gap is not None and 0.0 < settled.gap <= solve.SETTLE_GAP
        assert settled.step_s * (1 - settled.gap) <= optimum * (1 + REL_TOL)  # the bound it reports holds


@pytest.mark.parametrize("seed, noise", [(1, 0.05), (2, 0.1), (3, 0.2)])
def test_unequal_units_solve_to_the_brute_force_optimum(seed: int, noise: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three unequal Linear units and the root, every plan priced by the oracle: the default solve is
    the optimum, and one that settles as soon as it may stays within its gap of it."""
    table = unequal_table(4, seed, noise)
    assert [len(unit.choices) for unit in table.units] == [12, 12, 12, 3]
    results = [(*evaluate(table, combo), combo) for combo in itertools.product(*(u.choices for u in table.units))]
    lowest, highest = min(r[0] for r in results), max(r[0] for r in results)
    for fraction in (0.0, 0.05, 0.3, 0.7):
        budget = lowest + int(fraction * (highest - lowest))
        expected = best_step(results, budget)
        solution = solve_choice_table(table, budget)
        assert solution.status == OPTIMAL and solution.step_s == pytest.approx(expected, rel=REL_TOL)
        assert solution.peak_bytes == evaluate(table, chosen(table, solution.choices))[0] <= budget
        monkeypatch.setattr(search, "SETTLE_AFTER_S", 0.0)
        assert_within_settle_gap(solve_choice_table(table, budget), expected, budget)
        monkeypatch.undo()


@pytest.mark.parametrize("units", [40, 80])
def test_settling_stays_within_its_gap_of_the_proven_optimum(units: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unequal Linear units (a strongly correlated knapsack, slow to prove): HiGHS told to settle at
    once returns a plan within ``SETTLE_GAP`` of the one ``gap=0`` proves optimal, and says so."""
    monkeypatch.setattr(search, "SETTLE_AFTER_S", 0.0)
    settled_early = 0
    for seed in range(3):
        table = unequal_table(units, seed, 0.1)
        lowest, widest = smallest_feasible_budget(table), peak_bytes(table, ["replicate"] * units)
        for fraction in (0.05, 0.3):
            budget = lowest + int(fraction * (widest - lowest))
            proven = solve_choice_table(table, budget, gap=0.0)
            assert proven.status == OPTIMAL and proven.gap == 0.0
            settled = solve_choice_table(table, budget)
            assert_within_settle_gap(settled, proven.step_s, budget)
            settled_early += settled.status == FEASIBLE
    assert settled_early >= 1  # else the settling path was never taken


@pytest.mark.parametrize("solver, banner", [("cbc", "Cbc"), ("highs", "HiGHS")])
def test_msg_prints_the_solver_log(solver: str, banner: str, capfd: pytest.CaptureFixture[str]) -> None:
    table = make_table([[("a", 1, 0, 0, 1.0, 0.0), ("b", 0, 0, 0, 2.0, 0.0)]])
    assert solve_choice_table(table, 0, msg=True, solver=solver).choices == ("b",)
    assert banner in capfd.readouterr().out


def test_the_fastest_plan_needs_no_solver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(search, "run", None)  # any solver run would fail
    table, results = brute_force(3)
    widest = max(r[0] for r in results)
    solution = solve_choice_table(table, widest)
    assert solution.status == OPTIMAL and solution.gap == 0.0
    assert solution.step_s == pytest.approx(min(r[1] for r in results), rel=REL_TOL)
    assert solve.step_lower_bound(table) == pytest.approx(solution.step_s, rel=REL_TOL)
    assert solve.peak_lower_bound(table) <= min(r[0] for r in results)


@pytest.mark.parametrize("exact", [True, False])
def test_the_model_gives_every_plan_its_exact_peak(exact: bool) -> None:
    """With the binaries fixed to a plan, the least memory the rows allow is the plan's peak (the
    exact model), or at most it (the relaxation): the cut loop, which would hide a model that
    is wrong, never has to run for the exact one."""
    checked = 0
    for seed in SEEDS[:24]:
        table, results = brute_force(seed)
        if len(results) > 40:
            continue
        built = model.build_model(table, prune=False, carry=exact)
        built.problem.setObjective(built.memory)
        for peak, _, combo in results:
            for pairs, cost in zip(built.variables, combo, strict=True):
                for c, x in pairs:
                    x.lowBound = x.upBound = float(c is cost)
            status, _, _ = search._run_once(built, search._settings(table, None, None, False, "highs"), 0.0)
            least = round(pulp.value(built.memory) * built.scale) + built.memory_offset_bytes
            assert status == solve.OPTIMAL and (least == peak if exact else least <= peak), (seed, combo)
            checked += 1
    assert checked >= 100


def test_peak_bounds_hold_on_every_random_table() -> None:
    """The lower bound and the ceiling the ILP and the knapsack rely on, against every plan."""
    for seed in SEEDS:
        table, results = brute_force(seed)
        assert solve.peak_lower_bound(table) <= min(r[0] for r in results)
        ceiling = model.build_model(table, prune=False).max_peak_bytes  # from each unit's heaviest choice
        assert max(r[0] for r in results) <= ceiling


@pytest.mark.parametrize("seed", SEEDS[:20])
def test_next_best_solutions_are_the_k_best(seed: int) -> None:
    table, results = brute_force(seed)
    budget = budgets_for(seed)[3]
    fitting = sorted((step, tuple(c.choice for c in combo)) for peak, step, combo in results if peak <= budget)
    found = solve.next_best_solutions(table, budget, 4)
    assert len(found) == min(4, len(fitting))
    assert len({s.choices for s in found}) == len(found)  # distinct
    for solution, (step, _) in zip(found, fitting, strict=False):
        assert solution.peak_bytes <= budget and solution.status == OPTIMAL
        assert solution.step_s == pytest.approx(step, rel=REL_TOL)


def test_a_backward_runs_beside_the_prefetched_gather_of_the_unit_before_it_only() -> None:
    """A running unit's whole transient coexists with the prefetched part of the unit before it in
    forward order (FSDP2 prefetches it in backward); the unit after it has resharded by then."""
    from osdp_lightning.cost.cost import ChoiceCost, ChoiceTable, UnitCosts

    def unit(name: str, transient: int, prefetch: int) -> UnitCosts:
        return UnitCosts(name, (ChoiceCost("zero3", 10, 0, transient, 1.0, 0.0, prefetch_bytes=prefetch),), 0.0)

    def table(*units: UnitCosts) -> ChoiceTable:
        return ChoiceTable(units, activation_bytes=0, fixed_bytes=0, micro_batch_size=1)

    first_large, last_large = table(unit("a", 100, 40), unit("b", 70, 60)), table(unit("b", 70, 60), unit("a", 100, 40))
    # a first: max(a runs alone, b runs + a prefetched) = max(100, 70 + 40); a last: a runs + b prefetched
    assert peak_bytes(first_large, ["zero3", "zero3"]) == 20 + 110
    assert peak_bytes(last_large, ["zero3", "zero3"]) == 20 + 160
    for plan, peak in ((first_large, 130), (last_large, 180)):
        assert solve_choice_table(plan, peak).feasible
        assert not solve_choice_table(plan, peak - 1).feasible
