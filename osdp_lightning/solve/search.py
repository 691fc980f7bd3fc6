"""Searching the integer program (:mod:`osdp_lightning.solve.model`): the fastest plan within a budget,
the k best plans, and the smallest budget any plan fits.

Solved by HiGHS, or CBC without ``highspy`` (:mod:`osdp_lightning.solve.solvers`), to the proven optimum
unless a gap or a time limit is given, or HiGHS has run :data:`SETTLE_AFTER_S` and has a plan
proven within :data:`SETTLE_GAP` (status ``Feasible`` and that gap). Before any solver runs: the
plan of each unit's fastest choice is the answer when it fits (it reaches the lower bound), and the
knapsack plan (:func:`~osdp_lightning.solve.knapsack.knapsack_dp`, which always fits) is handed to
the solver as its first incumbent. Every plan it returns is re-evaluated in integer bytes by
:func:`~osdp_lightning.solve.evaluate.peak_bytes`, and one over the real budget is cut off (with
every plan at least as heavy in every unit) before the solver runs again.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

from osdp_lightning.cost.cost import ChoiceTable
from osdp_lightning.solve import solvers
from osdp_lightning.solve.evaluate import (
    Solution,
    check_table,
    choice_step_s,
    fastest_plan,
    memory_key,
    peak_bytes,
    step_seconds,
)
from osdp_lightning.solve.knapsack import knapsack_dp
from osdp_lightning.solve.model import (
    Model,
    build_model,
    exclude,
    objective_unit_s,
    read_choices,
    seed_values,
    set_budget,
    slack_bytes,
    slowest_s,
    step_objective,
)
from osdp_lightning.solve.solvers import (
    FEASIBLE,
    INFEASIBLE,
    NOT_SOLVED,
    OPTIMAL,
    TIME_LIMIT,
    SolverSettings,
    pick_solver,
    run,
)

pulp = solvers.pulp

_MAX_CUTS = 20
_TIGHTEN_TRIES = 8
SETTLE_GAP = 1e-4
"""Relative gap a solve without ``gap`` settles for once proving the optimum has taken
:data:`SETTLE_AFTER_S` (HiGHS only). Units that all differ in size make the memory row a strongly
correlated knapsack (the seconds a choice saves grow with the bytes it costs): HiGHS is within
2e-5 of the optimum at its root node, then may take a minute proving the last few millionths, far
below what the cost model predicts to."""
SETTLE_AFTER_S = 0.5
"""Seconds a HiGHS run tries to prove the optimum before it settles for :data:`SETTLE_GAP`: uniform
stacks and real models' block tables prove theirs well within it."""
_WARM_DP_CELLS = 4096
"""Memory cells per unit of the knapsack run that seeds the solver (coarse: it only has to fit)."""


def _relative_gap(objective: float, status: str, bound: float | None) -> float | None:
    if status == OPTIMAL:
        return 0.0
    if bound is None or not math.isfinite(bound):  # stopped before any bound was proven
        return None
    return max(0.0, objective - bound) / max(abs(objective), 1e-12)


def _remaining_s(time_limit_s: float | None, start: float) -> float | None:
    return None if time_limit_s is None else max(time_limit_s - (time.perf_counter() - start), 0.1)


def _run_once(model: Model, settings: SolverSettings, start: float, warm: dict[str, float] | None = None
              ) -> tuple[str, float | None, tuple[str, ...]]:
    """The solver's status, bound (when not proven) and plan (empty when it has none)."""
    settings = replace(settings, time_limit_s=_remaining_s(settings.time_limit_s, start))
    result = run(model.problem, settings, warm, model.columns)
    found = result.status in (OPTIMAL, TIME_LIMIT, FEASIBLE)
    # NOTE: in seconds, as the step objective's bound (smallest_feasible_budget's bytes bound is not read)
    bound = None if result.bound is None else result.bound * model.objective_unit_s
    return result.status, bound, read_choices(model) if found else ()


def _settings(table: ChoiceTable, time_limit_s: float | None, gap: float | None, msg: bool,
              solver: str | None) -> SolverSettings:
    if gap is not None and not 0.0 <= gap < 1.0:
        raise ValueError(f"gap must be a relative gap in [0, 1), got {gap!r}")
    # Prune only branches that cannot beat the incumbent by a billionth of the slowest plan.
    tie = 1e-9 * max(slowest_s(table), 1e-12) / objective_unit_s(table)
    settle = SETTLE_GAP if gap is None else 0.0
    return SolverSettings(pick_solver(solver), time_limit_s, gap, tie, msg, settle, SETTLE_AFTER_S)


def solve_choice_table(table: ChoiceTable, budget_bytes: int, time_limit_s: float | None = None,
                       msg: bool = False, *, gap: float | None = None, solver: str | None = None) -> Solution:
    """The fastest assignment whose exact peak fits ``budget_bytes`` (see module docstring).

    Infeasible budgets give ``status == "Infeasible"`` and no choices; they never raise.
    ``time_limit_s`` bounds the whole call (all solver runs together); ``gap`` (relative) stops
    the solver once its plan is proven within that share of the optimum (status ``Feasible`` and
    the gap, unless it is proven optimal anyway). Without ``gap``, HiGHS proves the optimum or,
    once a run has taken :data:`SETTLE_AFTER_S`, stops within :data:`SETTLE_GAP` (said as with
    ``gap``); ``gap=0`` proves it however long that takes. ``solver``: ``"highs"`` or ``"cbc"``
    (default: :func:`~osdp_lightning.solve.solvers.pick_solver`).
    """
    start = time.perf_counter()
    check_table(table)
    settings = _settings(table, time_limit_s, gap, msg, solver)
    fastest = fastest_plan(table)
    if peak_bytes(table, fastest) <= budget_bytes:  # it reaches the lower bound: nothing to search
        return _solution(table, fastest, OPTIMAL, None, start)
    # The relaxation first (buffers of neighbours only): its plan, when it fits exactly, is the
    # true optimum (or within the gap its bound proves: the relaxation's bound holds for the true
    # problem too); most plans put no replicated unit between two sharded ones. Else the exact model.
    relaxed = build_model(table, carry=False)
    relaxed.problem.setObjective(step_objective(table, relaxed))
    warm = _warm_start(table, relaxed, budget_bytes)
    set_budget(relaxed, budget_bytes)
    status, bound, choices = _run_once(relaxed, settings, start, warm[1] if warm else None)
    if status == INFEASIBLE or (choices and peak_bytes(table, choices) <= budget_bytes):
        return _solution(table, choices, status, bound, start)
    model = build_model(table)  # NOTE: the same choices and variable names: the seed carries over
    model.problem.setObjective(step_objective(table, model))
    return _solve_within(table, model, budget_bytes, settings, start, warm and seed_values(table, model, warm[0]))


def _solve_within(table: ChoiceTable, model: Model, budget_bytes: int, settings: SolverSettings, start: float,
                  warm: tuple[tuple[str, ...], dict[str, float]] | None = None) -> Solution:
    """The best plan of ``model`` (its objective as set) that fits ``budget_bytes`` exactly.

    NOTE: solvers decide feasibility only to about 1e-8 of the row (presolve included). They get
    a slightly larger budget, so they never reject a plan that fits; "Infeasible" is then proof.
    A plan over the budget is cut off (with every heavier plan) and the solver runs again.
    """
    set_budget(model, budget_bytes)
    lower_bound: float | None = None
    for _ in range(_MAX_CUTS):
        status, bound, choices = _run_once(model, settings, start, warm[1] if warm else None)
        if not choices and warm and status == NOT_SOLVED:  # stopped before its first plan: the seed fits
            return _solution(table, warm[0], TIME_LIMIT, None, start)
        if not choices or peak_bytes(table, choices) <= budget_bytes:
            return _solution(table, choices, status, bound, start)
        exclude(model, choices)
        # The relaxed problem's optimum bounds the true one from below.
        lower_bound = pulp.value(model.problem.objective) * model.objective_unit_s if status == OPTIMAL else bound
    return _solve_tightened(table, model, budget_bytes, lower_bound, settings, start)


def _solve_tightened(table: ChoiceTable, model: Model, budget_bytes: int, lower_bound: float | None,
                     settings: SolverSettings, start: float) -> Solution:
    """Many plans just over the budget (symmetric units): shrink the solver's budget until one fits.

    The plan found then fits for sure; it is proven optimal only if it reaches ``lower_bound``.
    """
    margin = slack_bytes(model)
    for _ in range(_TIGHTEN_TRIES):
        set_budget(model, budget_bytes - 2 * margin)
        status, bound, choices = _run_once(model, settings, start)
        if not choices:  # plans between the shrunk budget and the real one may still fit
            break
        if peak_bytes(table, choices) <= budget_bytes:
            solution = _solution(table, choices, status, bound, start)
            gap = _relative_gap(solution.step_s, FEASIBLE, lower_bound)
            proven = status == OPTIMAL and gap is not None and gap <= 1e-9
            return solution if proven else replace(solution, status=FEASIBLE, gap=gap)
        margin *= 4
    return Solution((), NOT_SOLVED, math.inf, 0, time.perf_counter() - start)


def _solution(table: ChoiceTable, choices: tuple[str, ...], status: str, bound: float | None,
              start: float) -> Solution:
    if not choices:
        return Solution((), status, math.inf, 0, time.perf_counter() - start)
    step_s = step_seconds(table, choices)
    gap = _relative_gap(step_s, status, bound)
    if status == FEASIBLE and gap is not None and gap <= 1e-9:  # stopped at a gap, but the optimum anyway
        status, gap = OPTIMAL, 0.0
    return Solution(choices, status, step_s, peak_bytes(table, choices), time.perf_counter() - start, gap)


def _warm_start(table: ChoiceTable, model: Model, budget_bytes: int
                ) -> tuple[tuple[str, ...], dict[str, float]] | None:
    """A coarse knapsack plan (it always fits) as the solver's first incumbent, by variable name.

    Dominated choices it picks are swapped for a kept choice that dominates them (never heavier
    nor slower), so the seed is a point of the model and at least as good as the knapsack plan.
    """
    span = sum(max(c.persistent_bytes for c in u.choices) - min(c.persistent_bytes for c in u.choices)
               for u in table.units)
    seed = knapsack_dp(table, budget_bytes, resolution_bytes=max(1, -(-span // _WARM_DP_CELLS)))
    if not seed.feasible:
        return None
    choices = []
    for unit, pairs, choice in zip(table.units, model.variables, seed.choices, strict=True):
        mine = unit.cost_of(choice)
        key = memory_key(mine) + (choice_step_s(unit, mine),)
        choices.append(next(c.choice for c, _ in pairs if c.choice == choice or all(
            o <= k for o, k in zip(memory_key(c) + (choice_step_s(unit, c),), key, strict=True))))
    return seed_values(table, model, choices)


def next_best_solutions(table: ChoiceTable, budget_bytes: int, count: int, time_limit_s: float | None = None,
                        solver: str | None = None) -> list[Solution]:
    """The ``count`` fastest distinct assignments that fit ``budget_bytes``, best first.

    Each next one is the best plan different from all before it (every choice is a candidate,
    dominated ones included, so this is the true k-best list). Fewer when fewer plans fit, or
    when ``time_limit_s`` (all solves together) runs out; a plan not proven the next best says so
    in its ``status``.
    """
    start = time.perf_counter()
    settings = _settings(table, time_limit_s, 0.0, False, solver)  # NOTE: exact: the list's order must hold
    model = build_model(table, prune=False)
    model.problem.setObjective(step_objective(table, model))
    found: list[Solution] = []
    while len(found) < count:
        solution = _solve_within(table, model, budget_bytes, settings, start)
        if not solution.feasible:
            break
        found.append(solution)
        exclude(model, solution.choices, heavier_too=False)
        if time_limit_s is not None and time.perf_counter() - start >= time_limit_s:
            break
    return found


def smallest_feasible_budget(table: ChoiceTable, time_limit_s: float | None = None,
                             solver: str | None = None) -> int:
    """The smallest per-rank budget any assignment fits: the minimum exact peak bytes.

    Checked: after the least-peak solve, a solve at one byte less must be infeasible (else its
    plan is lighter and the check repeats). Stopped by ``time_limit_s``, it is the peak of the
    best plan found: a budget that fits.
    """
    start = time.perf_counter()
    check_table(table)
    model = build_model(table)
    model.problem.setObjective(model.memory)
    # Peaks are whole bytes, so any better assignment is at least one byte (1/scale) better.
    settings = SolverSettings(pick_solver(solver), time_limit_s, None, 0.5 / model.scale)
    status, _, choices = _run_once(model, settings, start)
    if not choices:
        raise RuntimeError(f"minimising the peak failed: {status}")
    smallest = peak_bytes(table, choices)
    while status == OPTIMAL:
        lighter = _solve_within(table, model, smallest - 1, settings, start)
        if not lighter.feasible:
            break
        smallest, status = lighter.peak_bytes, lighter.status
    return smallest
