"""Stage 3: choose one choice per unit (design.md section 4).

The integer program, for one :class:`~osdp_lightning.cost.ChoiceTable` (all bytes per rank):

- ``x[u,c]`` binary, ``sum_c x[u,c] = 1`` for every unit ``u``;
- ``T >= tr[u] + pf[u+1]`` and ``T >= pf[u] + tr[u+1]`` for every consecutive pair in execution
  order (``tr[u] = sum_c transient[u,c] x[u,c]``, ``pf`` likewise with ``prefetch``): FSDP2
  prefetches a neighbour's all-gather while a unit runs, in forward and in backward;
- memory: ``sum(state + held) x + T + activation_bytes + fixed_bytes <= budget``;
- minimise ``sum(compute) x + sum_u e[u]`` with ``e[u] = max(exposed[u,c], comm[u,c] - overlap[u])``
  of the chosen ``c`` (``exposed``: the latency no overlap hides). Because exactly one ``x[u,c]``
  is 1, that max is the linear term ``sum_c max(exposed, comm[u,c] - overlap[u]) x[u,c]``: the ``e >= ...`` rows are folded into the
  objective, which is exact and gives CBC a tighter relaxation than separate ``e`` variables.

Exact to the byte although CBC works in floating point: bytes enter it divided by a power of ten
(which, unlike a power of two, survives PuLP's 13-digit MPS file exactly) to keep a model's bytes
below 1e7; CBC sees the budget plus a slack of 1e-9 of the peak, above its own tolerance, so it
never rejects a plan that fits and its "Infeasible" is proof; every plan it returns is re-evaluated
in integer bytes by :func:`peak_bytes`, and one over the real budget is cut off (with every plan at
least as heavy in every unit) before CBC runs again.
"""

from __future__ import annotations

import math
import re
import tempfile
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

try:
    import pulp
except ImportError as _err:  # say how to get it rather than a bare ModuleNotFoundError
    raise ImportError("osdp_lightning solves its plans with PuLP, which is not installed: run "
                      "`pip install pulp` (it bundles the CBC solver)") from _err

from osdp_lightning.cost import ChoiceCost, ChoiceTable, UnitCosts

OPTIMAL = "Optimal"
INFEASIBLE = "Infeasible"
TIME_LIMIT = "Time limit"
"""Stopped by the time limit with a feasible, not proven optimal, assignment."""
NOT_SOLVED = "Not Solved"
"""Stopped (time limit) before any feasible assignment was found."""
FEASIBLE = "Feasible"
"""Fits, but optimality is not proven (see :attr:`Solution.gap`)."""
_MAX_SCALED = 1e7
_SLACK_RELATIVE = 1e-9
_MAX_CUTS = 20
_TIGHTEN_TRIES = 8
_MAX_DP_CELLS = 5 * 10**8


@dataclass(frozen=True)
class Solution:
    """One assignment of choices to units and how it was found."""

    choices: tuple[str, ...]
    """One choice name per unit, aligned with ``table.units``; empty when nothing was found."""
    status: str
    """``Optimal``, ``Infeasible``, ``Time limit`` or ``Feasible`` (fits, unproven; see ``gap``) or
    ``Not Solved`` (nothing found)."""
    step_s: float
    """Predicted seconds per step of ``choices`` (``inf`` when there are none)."""
    peak_bytes: int
    """Predicted peak bytes per rank of ``choices``, evaluated exactly (0 when there are none)."""
    solve_s: float
    """Wall seconds spent building and solving."""
    gap: float | None = None
    """Relative gap to the best bound when optimality is not proven; 0.0 when optimal."""

    @property
    def feasible(self) -> bool:
        return bool(self.choices) and self.status in (OPTIMAL, TIME_LIMIT, FEASIBLE)


def _chosen(table: ChoiceTable, choices: tuple[str, ...] | list[str]) -> list[ChoiceCost]:
    if len(choices) != len(table.units):
        raise ValueError(f"{len(choices)} choices for {len(table.units)} units")
    return [unit.cost_of(choice) for unit, choice in zip(table.units, choices, strict=True)]


def _transient_peak(transients: list[int], prefetches: list[int] | None = None) -> int:
    """Largest transient bytes alive at once: one running unit, plus what its neighbour in
    execution order already holds (FSDP2 prefetches the next all-gather, forward and backward)."""
    prefetches = transients if prefetches is None else prefetches
    singles = max(transients, default=0)
    pairs = max((max(transients[u] + prefetches[u + 1], prefetches[u] + transients[u + 1])
                 for u in range(len(transients) - 1)), default=0)
    return max(singles, pairs)


def peak_bytes(table: ChoiceTable, choices: tuple[str, ...] | list[str]) -> int:
    """Exact per-rank peak of an assignment under the model the ILP uses."""
    costs = _chosen(table, choices)
    persistent = sum(cost.persistent_bytes for cost in costs)
    transient = _transient_peak([cost.transient_bytes for cost in costs], [cost.prefetch for cost in costs])
    return persistent + transient + table.activation_bytes + table.fixed_bytes


def _choice_step_s(unit: UnitCosts, cost: ChoiceCost) -> float:
    # Only the part of a collective that neighbouring compute cannot hide costs time, and never
    # less than its exposed part (one launch latency per collective call).
    return (cost.compute_s + cost.optimizer_s + cost.overhead_s
            + max(cost.exposed_s, cost.comm_s - unit.overlap_s))


def step_seconds(table: ChoiceTable, choices: tuple[str, ...] | list[str]) -> float:
    """Exact predicted step seconds of an assignment under the model the ILP uses."""
    costs = _chosen(table, choices)
    return table.fixed_step_s + sum(_choice_step_s(unit, cost) for unit, cost in zip(table.units, costs, strict=True))


def _memory_scale(table: ChoiceTable) -> int:
    """Power of ten that brings a whole model's bytes to at most ``_MAX_SCALED``."""
    total = sum(max(c.persistent_bytes + 2 * c.transient_bytes for c in u.choices)
                for u in table.units)
    return 10 ** max(0, math.ceil(math.log10(max(total, 1) / _MAX_SCALED)))


def _candidates(unit: UnitCosts) -> list[ChoiceCost]:
    """Choices not dominated in (persistent, transient, prefetch bytes, seconds) by another one.

    Dropping them keeps the optimum exact: swapping a dominated choice for its dominator never
    raises the peak or the step time. Ties keep the first listed choice.
    """
    keys = [(c.persistent_bytes, c.transient_bytes, c.prefetch, _choice_step_s(unit, c))
            for c in unit.choices]
    kept = []
    for i, key in enumerate(keys):
        dominated = any(all(o <= k for o, k in zip(other, key, strict=True)) and (other != key or j < i)
                        for j, other in enumerate(keys) if j != i)
        if not dominated:
            kept.append(unit.choices[i])
    return kept


@dataclass(frozen=True)
class _Model:
    problem: pulp.LpProblem
    variables: tuple[tuple[tuple[ChoiceCost, pulp.LpVariable], ...], ...]
    """Per unit, its candidate choices and their binaries."""
    memory: pulp.LpAffineExpression
    """Scaled, choice-dependent bytes (persistent + T) minus their constant part."""
    memory_offset_bytes: int
    """Bytes of the peak that no choice changes (minima, activations, fixed)."""
    max_peak_bytes: int
    """Peak of the heaviest choices everywhere: budgets above it constrain nothing."""
    scale: int


def _new_variable(problem: pulp.LpProblem, name: str, category: str) -> pulp.LpVariable:
    # NOTE: PuLP 3.3 deprecates free-standing LpVariable in favour of add_variable (absent in 2.x).
    if hasattr(problem, "add_variable"):
        return problem.add_variable(name, lowBound=0, cat=category)
    return pulp.LpVariable(name, lowBound=0, cat=category)


def _check_table(table: ChoiceTable) -> None:
    if not table.units or any(not unit.choices for unit in table.units):
        raise ValueError("the choice table needs at least one unit, and every unit at least one choice")


def _build_model(table: ChoiceTable) -> _Model:
    """Variables, one-choice rows and prefetch-pair rows; objective and budget are set later."""
    _check_table(table)
    scale = _memory_scale(table)
    problem = pulp.LpProblem("osdp", pulp.LpMinimize)
    peak_t = _new_variable(problem, "T", pulp.LpContinuous)
    variables, persistent_terms, transient_terms, prefetch_terms = [], [], [], []
    offset = table.activation_bytes + table.fixed_bytes
    min_transients, min_prefetches = [], []
    for u, unit in enumerate(table.units):
        candidates = _candidates(unit)
        xs = [_new_variable(problem, f"x_{u}_{i}", pulp.LpBinary) for i in range(len(candidates))]
        variables.append(tuple(zip(candidates, xs, strict=True)))
        problem += pulp.lpSum(xs) == 1, f"one_{u}"
        # NOTE: per-unit minima move to constants, so the rows only carry the differences.
        min_persistent = min(c.persistent_bytes for c in candidates)
        min_transient = min(c.transient_bytes for c in candidates)
        offset += min_persistent
        min_transients.append(min_transient)
        persistent_terms += [(x, (c.persistent_bytes - min_persistent) / scale)
                             for c, x in zip(candidates, xs, strict=True) if c.persistent_bytes > min_persistent]
        transient_terms.append([(x, -(c.transient_bytes - min_transient) / scale)
                                for c, x in zip(candidates, xs, strict=True) if c.transient_bytes > min_transient])
        min_prefetch = min(c.prefetch for c in candidates)
        min_prefetches.append(min_prefetch)
        prefetch_terms.append([(x, -(c.prefetch - min_prefetch) / scale)
                               for c, x in zip(candidates, xs, strict=True) if c.prefetch > min_prefetch])
    if len(table.units) == 1:
        row = pulp.LpAffineExpression([(peak_t, 1.0), *transient_terms[0]])
        problem += row >= min_transients[0] / scale, "single_0"
    # T >= running unit's transient + what its neighbour already holds, both orders of each pair.
    for u in range(len(table.units) - 1):
        for run, held, tag in ((u, u + 1, "f"), (u + 1, u, "b")):
            row = pulp.LpAffineExpression([(peak_t, 1.0), *transient_terms[run], *prefetch_terms[held]])
            problem += row >= (min_transients[run] + min_prefetches[held]) / scale, f"pair_{tag}{u}"
    memory = pulp.LpAffineExpression([*persistent_terms, (peak_t, 1.0)])
    max_peak = offset + round(sum(coef for _, coef in persistent_terms) * scale) + _transient_peak(
        [max(c.transient_bytes for c, _ in pairs) for pairs in variables],
        [max(c.prefetch for c, _ in pairs) for pairs in variables])
    return _Model(problem, tuple(variables), memory, offset, max_peak, scale)


class SolverUnavailableError(RuntimeError):
    """The CBC solver is missing or failed to run."""


def _solve_or_explain(problem: pulp.LpProblem, solver: pulp.LpSolver) -> None:
    hint = ("reinstall PuLP, which bundles CBC (`pip install --force-reinstall pulp`), or skip the solver "
            "with OSDPStrategy(plan=<saved plan>) or uniform_choice=")
    if not solver.available():
        raise SolverUnavailableError(f"the CBC solver is not available ({solver.path}); {hint}")
    try:
        problem.solve(solver)
    except pulp.PulpSolverError as err:
        raise SolverUnavailableError(f"the CBC solver failed: {err}; {hint}") from err


def _run_cbc(problem: pulp.LpProblem, time_limit_s: float | None, msg: bool,
             increment: float | None = None) -> tuple[str, float | None]:
    """Solve with CBC; our status, and CBC's best bound when a time limit stopped it."""
    # NOTE: CBC's default cutoff increment (1e-5, absolute) and gaps can stop short of the
    # optimum on small objectives; ask for the exact optimum unless a time limit says otherwise.
    options = ["allow 0", "ratio 0"] + ([f"increment {increment!r}"] if increment else [])
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "cbc.log"
        with warnings.catch_warnings():
            # PuLP 3.3 deprecates its bundled CBC for PuLP 4.0; it is still the one that ships.
            warnings.filterwarnings("ignore", "PULP_CBC_CMD is deprecated", DeprecationWarning)
            solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, options=options,
                                       logPath=str(log_path))
        _solve_or_explain(problem, solver)
        log = log_path.read_text() if log_path.exists() else ""
    if msg:
        print(log)
    # NOTE: PuLP reports "Optimal" for a time-limited incumbent too; sol_status tells them apart.
    if problem.sol_status == pulp.LpSolutionOptimal:
        return OPTIMAL, None
    if problem.sol_status == pulp.LpSolutionIntegerFeasible:
        return TIME_LIMIT, _parse_bound(log)
    if problem.status == pulp.LpStatusInfeasible:
        return INFEASIBLE, None
    return NOT_SOLVED, None


def _parse_bound(log: str) -> float | None:
    # The progress lines print the bound with more digits than the final "Lower bound:" line.
    found = re.findall(r"best possible ([-+0-9.eE]+)", log)
    return float(found[-1]) if found else None


def _relative_gap(objective: float, status: str, bound: float | None) -> float | None:
    if status == OPTIMAL:
        return 0.0
    if bound is None:
        return None
    return max(0.0, objective - bound) / max(abs(objective), 1e-12)


def _read_choices(model: _Model) -> tuple[str, ...]:
    # argmax, not "== 1": CBC's integer tolerance leaves values like 0.9999999.
    return tuple(max(pairs, key=lambda pair: pair[1].varValue or 0.0)[0].choice
                 for pairs in model.variables)


def _step_objective(table: ChoiceTable, model: _Model) -> pulp.LpAffineExpression:
    return table.fixed_step_s + pulp.lpSum(_choice_step_s(unit, c) * x for unit, pairs in
                                           zip(table.units, model.variables, strict=True) for c, x in pairs)


def _exclude(model: _Model, choices: tuple[str, ...], index: int) -> None:
    """Cut off a plan that is over budget, with every plan at least as heavy in every unit.

    The peak only grows with each unit's persistent and transient bytes, so all of those are
    over budget too: the cut removes no plan that fits.
    """
    heavier = []
    for pairs, choice in zip(model.variables, choices, strict=True):
        mine = next(c for c, _ in pairs if c.choice == choice)
        heavier += [x for c, x in pairs if c.persistent_bytes >= mine.persistent_bytes
                    and c.transient_bytes >= mine.transient_bytes and c.prefetch >= mine.prefetch]
    model.problem.addConstraint(pulp.lpSum(heavier) <= len(choices) - 1, f"exclude_{index}")


def _remaining_s(time_limit_s: float | None, start: float) -> float | None:
    return None if time_limit_s is None else max(time_limit_s - (time.perf_counter() - start), 0.1)


def _run_once(model: _Model, time_limit_s: float | None, msg: bool, increment: float
              ) -> tuple[str, float | None, tuple[str, ...]]:
    """CBC's status, bound (time limit only) and plan (empty when it has none)."""
    status, bound = _run_cbc(model.problem, time_limit_s, msg, increment)
    return status, bound, _read_choices(model) if status in (OPTIMAL, TIME_LIMIT) else ()


def solve_choice_table(table: ChoiceTable, budget_bytes: int, time_limit_s: float | None = None,
                       msg: bool = False) -> Solution:
    """The fastest assignment whose exact peak fits ``budget_bytes`` (see module docstring).

    Infeasible budgets give ``status == "Infeasible"`` and no choices; they never raise.
    ``time_limit_s`` bounds the whole call (all CBC runs together).
    """
    start = time.perf_counter()
    model = _build_model(table)
    model.problem.setObjective(_step_objective(table, model))
    # Prune only branches that cannot beat the incumbent by a billionth of the slowest plan.
    slowest_s = sum(max(_choice_step_s(u, c) for c in u.choices) for u in table.units)
    increment = 1e-9 * max(slowest_s, 1e-12)
    if budget_bytes >= model.max_peak_bytes:  # every assignment fits: no memory row
        status, bound, choices = _run_once(model, time_limit_s, msg, increment)
        return _solution(table, choices, status, bound, start)
    # NOTE: CBC decides feasibility only to about 1e-8 of the row (presolve included). It gets a
    # slightly larger budget, so it never rejects a plan that fits; "Infeasible" is then proof.
    # A plan it returns over the budget is cut off (with every heavier plan) and CBC runs again.
    memory = model.memory <= (budget_bytes + _slack_bytes(model) - model.memory_offset_bytes) / model.scale
    model.problem.addConstraint(memory, "memory")
    lower_bound: float | None = None
    for index in range(_MAX_CUTS):
        status, bound, choices = _run_once(model, _remaining_s(time_limit_s, start), msg, increment)
        if not choices or peak_bytes(table, choices) <= budget_bytes:
            return _solution(table, choices, status, bound, start)
        _exclude(model, choices, index)
        # The relaxed problem's optimum bounds the true one from below.
        lower_bound = pulp.value(model.problem.objective) if status == OPTIMAL else bound
    return _solve_tightened(table, model, memory, budget_bytes, lower_bound, (time_limit_s, msg, increment),
                            start)


def _solve_tightened(table: ChoiceTable, model: _Model, memory: pulp.LpConstraint, budget_bytes: int,
                     lower_bound: float | None, run: tuple[float | None, bool, float], start: float
                     ) -> Solution:
    """Many plans just over the budget (symmetric units): shrink CBC's budget until one fits.

    The plan found then fits for sure; it is proven optimal only if it reaches ``lower_bound``.
    """
    time_limit_s, msg, increment = run
    margin = _slack_bytes(model)
    for _ in range(_TIGHTEN_TRIES):
        memory.changeRHS((budget_bytes - margin - model.memory_offset_bytes) / model.scale)
        status, bound, choices = _run_once(model, _remaining_s(time_limit_s, start), msg, increment)
        if not choices:  # plans between the shrunk budget and the real one may still fit
            break
        if peak_bytes(table, choices) <= budget_bytes:
            solution = _solution(table, choices, status, bound, start)
            gap = _relative_gap(solution.step_s, FEASIBLE, lower_bound)
            proven = status == OPTIMAL and gap is not None and gap <= 1e-9
            return solution if proven else replace(solution, status=FEASIBLE, gap=gap)
        margin *= 4
    return Solution((), NOT_SOLVED, math.inf, 0, time.perf_counter() - start)


def _slack_bytes(model: _Model) -> float:
    return max(0.5, _SLACK_RELATIVE * model.max_peak_bytes)


def _solution(table: ChoiceTable, choices: tuple[str, ...], status: str, bound: float | None,
              start: float) -> Solution:
    if not choices:
        return Solution((), status, math.inf, 0, time.perf_counter() - start)
    step_s = step_seconds(table, choices)
    return Solution(choices, status, step_s, peak_bytes(table, choices), time.perf_counter() - start,
                    _relative_gap(step_s, status, bound))


def smallest_feasible_budget(table: ChoiceTable, time_limit_s: float | None = None) -> int:
    """The smallest per-rank budget any assignment fits: the minimum exact peak bytes.

    Stopped by ``time_limit_s``, it is the peak of the best plan found: a budget that fits.
    """
    model = _build_model(table)
    model.problem.setObjective(model.memory)
    # Peaks are whole bytes, so any better assignment is at least one byte (1/scale) better.
    status, _ = _run_cbc(model.problem, time_limit_s, False, increment=0.5 / model.scale)
    if status not in (OPTIMAL, TIME_LIMIT):
        raise RuntimeError(f"minimising the peak failed: {status}")
    return peak_bytes(table, _read_choices(model))


def knapsack_dp(table: ChoiceTable, budget_bytes: int, resolution_bytes: int = 2**20) -> Solution:
    """Baseline: the OSDP authors' knapsack dynamic program over integer memory units.

    What a one-dimensional knapsack can express, kept conservative so its plan always fits:

    - persistent bytes (state + held) of each choice are rounded *up* to ``resolution_bytes``;
    - the prefetch-pair maximum depends on two neighbouring choices, which an additive knapsack
      cannot see, so it reserves the worst pair over all choices of every consecutive pair;
    - step seconds are additive per unit, so the objective is the same as the ILP's.

    Its plans are therefore feasible for the ILP too, and the ILP is never slower.
    """
    import numpy as np  # NOTE: local import: only this baseline needs numpy.

    _check_table(table)
    start = time.perf_counter()
    units = table.units
    worst = [max(c.transient_bytes for c in unit.choices) for unit in units]
    worst_prefetch = [max(c.prefetch for c in unit.choices) for unit in units]
    reserve = _transient_peak(worst, worst_prefetch) + table.activation_bytes + table.fixed_bytes
    weights = [[-(-c.persistent_bytes // resolution_bytes) for c in u.choices] for u in units]
    capacity = (budget_bytes - reserve) // resolution_bytes - sum(min(w) for w in weights)
    if capacity < 0:
        return Solution((), INFEASIBLE, math.inf, 0, time.perf_counter() - start, None)
    # NOTE: every unit pays its lightest choice anyway; the table only spans the differences.
    extra = [[w - min(ws) for w in ws] for ws in weights]
    capacity = min(capacity, sum(max(ws) for ws in extra))
    if len(units) * (capacity + 1) > _MAX_DP_CELLS:
        raise ValueError(f"knapsack_dp needs {len(units)} x {capacity + 1} cells at {resolution_bytes} "
                         "bytes per unit of memory; pass a coarser resolution_bytes")
    best = np.zeros(capacity + 1)  # best[m]: least seconds of the units so far within m units
    picks = np.zeros((len(units), capacity + 1), dtype=np.int8 if max(map(len, extra)) < 128 else np.int16)
    for u, unit in enumerate(units):
        new = np.full(capacity + 1, np.inf)
        for i, (cost, w) in enumerate(zip(unit.choices, extra[u], strict=True)):
            if w > capacity:
                continue
            candidate = best[: capacity + 1 - w] + _choice_step_s(unit, cost)
            better = candidate < new[w:]
            np.copyto(new[w:], candidate, where=better)
            np.copyto(picks[u, w:], i, where=better)
        best = new
    choices, room = [], capacity
    for u in reversed(range(len(units))):
        pick = int(picks[u, room])
        choices.append(units[u].choices[pick].choice)
        room -= extra[u][pick]
    choices = tuple(reversed(choices))
    return Solution(choices, OPTIMAL, step_seconds(table, choices), peak_bytes(table, choices),
                    time.perf_counter() - start, 0.0)
