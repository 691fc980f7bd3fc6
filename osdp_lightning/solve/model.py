"""The integer program for one :class:`~osdp_lightning.cost.cost.ChoiceTable` (all bytes per rank).

- ``x[u,c]`` binary, ``sum_c x[u,c] = 1`` for every unit ``u``;
- memory: ``sum(state + live) x + T + activation_bytes + fixed_bytes <= budget``, with
  ``live = held + activation`` (kept from a unit's forward to its backward) and ``T`` the peak of
  every unit's forward and backward moments (:func:`~osdp_lightning.solve.evaluate.moment_peak`)
  *less* the live bytes of all units, since each moment's row gives back those not alive there:
  ``T >= forward[u] + Cf[u-1] - live[u] - S[u]`` (forward), ``T >= end[u] - S[u]`` (the end of its
  forward, its parameters still gathered) and ``T >= transient[u] + Cb[u-1] - S[u]`` (backward; a
  unit that spans the step also ``T >= transient[u] + Ca[u+1] - S[u]``), where
  ``S[u] <= S[next] + live[next]`` sums the units after ``u`` (units that span the step are never
  given back), and ``T >= optimizer - activations - sum(live)`` (the optimizer step: no unit's live
  bytes are alive then). The memory row stays one knapsack row over every binary, which solvers
  cut well; a running sum in every row instead was 5-25x slower. ``Cf[u]`` is the forward
  all-gather buffer (``prefetch``) of the nearest unit at or before ``u`` that all-gathers,
  ``Cb[u]`` / ``Ca[u]`` the backward gather (``backward_prefetch``) of the nearest one before /
  after: FSDP2 keeps the last all-gather's buffer until the next (forward), prefetches the one of
  the unit before in backward (the unit after is resharded by then), and replicated units between
  do neither (``_carry_variables``; ``C >= pf[u]``, ``C >= C[prev] - M * gathers[u]``);
- minimise ``fixed_step_s + sum(compute + optimizer + overhead) x + sum_u e[u]`` with
  ``e[u] = max(exposed[u,c], comm[u,c] - overlap[u])`` of the chosen ``c`` (``exposed``: the latency
  no overlap hides). Because exactly one ``x[u,c]`` is 1, that max is the linear term
  ``sum_c max(exposed, comm[u,c] - overlap[u]) x[u,c]``: the ``e >= ...`` rows are folded into the
  objective, which is exact and gives the solver a tighter relaxation than separate ``e`` variables.

Exact to the byte although solvers work in floating point: bytes enter it divided by a power of
ten (which, unlike a power of two, survives PuLP's 13-digit MPS file exactly) to keep a model's
bytes below 1e7; the solver sees the budget plus a slack of 1e-9 of the peak, above its own
tolerance, so it never rejects a plan that fits and its "Infeasible" is proof
(:mod:`osdp_lightning.solve.search` re-evaluates every plan in integer bytes).
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from osdp_lightning.cost.cost import ChoiceCost, ChoiceTable
from osdp_lightning.solve import solvers
from osdp_lightning.solve.evaluate import (
    MEMORY_PARTS,
    buffer_bytes,
    carried_bytes,
    check_table,
    choice_step_s,
    chosen_costs,
    memory_key,
    moment_peak,
    optimizer_moment_bytes,
    own_moment_bytes,
    parts_of,
    rebuild_moment_bytes,
    reduced_after,
    transient_ceiling,
    undominated,
)
from osdp_lightning.solve.symmetry import Forbidden, forbidden_orders, sorted_plan

# NOTE: PuLP comes through solvers.py, whose import guard says how to install it when it is missing.
pulp = solvers.pulp

_MAX_SCALED = 1e7
_SLACK_RELATIVE = 1e-9
_FORWARD, _BEFORE, _AFTER, _REDUCE = "f", "b", "a", "r"
"""Tags of the carry variables (``Cf_u``: forward buffers from before; ``Cb_u`` / ``Ca_u``: backward
gathers from before / after, the latter only beside units that span the step; ``Cr_u``: the
reduce-scatter input from after): the solver's seed sets them by name."""


@dataclass(frozen=True)
class Model:
    problem: pulp.LpProblem
    variables: tuple[tuple[tuple[ChoiceCost, pulp.LpVariable], ...], ...]
    """Per unit, its candidate choices and their binaries."""
    memory: pulp.LpAffineExpression
    """Scaled, choice-dependent bytes (state, live and ``T``: the peak) minus their constant part."""
    memory_row: pulp.LpConstraint
    """``memory <= budget``; its right-hand side is set per solve (see :func:`set_budget`)."""
    memory_offset_bytes: int
    """Bytes of the peak that no choice changes (least state and live bytes, activations, fixed)."""
    max_peak_bytes: int
    """Peak of the heaviest choices everywhere: budgets above it constrain nothing."""
    scale: int
    objective_unit_s: float
    """Seconds per unit of the step objective (:func:`step_objective`)."""
    forbidden: Forbidden
    """Orders of identical neighbours the model rules out (:mod:`osdp_lightning.solve.symmetry`)."""
    columns: tuple[pulp.LpVariable, ...]
    """Every variable (``T``, the suffix and carry variables, the binaries), so the solver need not
    collect them from the rows."""


def _memory_scale(table: ChoiceTable) -> int:
    """Power of ten that brings a whole model's bytes to at most ``_MAX_SCALED``."""
    total = sum(max(c.persistent_bytes + c.forward_peak_bytes + 2 * c.transient_bytes for c in u.choices)
                for u in table.units)
    return 10 ** max(0, math.ceil(math.log10(max(total, 1) / _MAX_SCALED)))


def _new_variable(problem: pulp.LpProblem, name: str, category: str) -> pulp.LpVariable:
    # NOTE: PuLP 3.3 deprecates free-standing LpVariable in favour of add_variable (absent in 2.x).
    if hasattr(problem, "add_variable"):
        return problem.add_variable(name, lowBound=0, cat=category)
    return pulp.LpVariable(name, lowBound=0, cat=category)


def _differences(pairs: list[tuple[ChoiceCost, pulp.LpVariable]], size: Callable[[ChoiceCost], int], scale: int,
                 sign: float) -> tuple[int, list[tuple[pulp.LpVariable, float]]]:
    """The least ``size`` of the choices, and each choice's excess over it as scaled row terms."""
    least = min(size(c) for c, _ in pairs)
    return least, [(x, sign * (size(c) - least) / scale) for c, x in pairs if size(c) > least]


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off meanwhile: a model's tens of thousands of new objects (PuLP
    variables, rows, terms) make it rescan every live object again and again (half the build on
    1,000 units), and building one leaves no cycles to collect."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@_gc_paused()
def build_model(table: ChoiceTable, prune: bool = True, carry: bool = True) -> Model:
    """Variables, one-choice rows, the rows of every unit's forward and backward moments and the
    memory row; the objective is set later.

    ``prune``: leave out dominated choices (exact for the optimum, not for the k best plans).
    ``carry``: buffers carried past units that gather nothing (exact); without, each unit's
    neighbours' own prefetch only: a relaxation (its peaks are never above the exact ones) that
    solves several times faster on large tables.
    """
    check_table(table)
    scale = _memory_scale(table)
    problem = pulp.LpProblem("osdp", pulp.LpMinimize)
    peak_t = _new_variable(problem, "T", pulp.LpContinuous)
    variables, kept_terms, lives, lates, rebuilds = [], [], [], [], []
    sizes: dict[str, list[_Level]] = {key: [] for key in MEMORY_PARTS if key not in ("live", "late")}
    offset = table.activation_bytes + table.fixed_bytes
    kept: dict[tuple, list[ChoiceCost]] = {}  # identical units (same costs) are pruned once
    for u, unit in enumerate(table.units):
        key = (unit.choices, unit.overlap_s)
        if key not in kept:
            kept[key] = undominated(unit) if prune else list(unit.choices)
        pairs = [(c, _new_variable(problem, f"x_{u}_{i}", pulp.LpBinary)) for i, c in enumerate(kept[key])]
        variables.append(tuple(pairs))
        problem += pulp.LpAffineExpression([(x, 1.0) for _, x in pairs]) == 1, f"one_{u}"
        # NOTE: per-unit minima move to constants, so the rows only carry the differences.
        # The memory row counts every unit's live bytes (a knapsack row, as solvers like them); each
        # moment's row gives back those not alive there.
        for size in (lambda c: c.state_bytes, MEMORY_PARTS["live"]):
            least, terms = _differences(pairs, size, scale, 1.0)
            offset += least
            kept_terms += terms
        lives.append((-least, terms))  # the live bytes, to give back
        least, terms = _differences(pairs, MEMORY_PARTS["late"], scale, 1.0)
        lates.append((-least, terms))  # the sharded gradients, given back in backward
        rebuilds.append(_differences(pairs, lambda c: c.rebuild_bytes, scale, -1.0))
        for name in sizes:
            sizes[name].append(_differences(pairs, MEMORY_PARTS[name], scale, -1.0))
    levels, suffix_vars = _absent_levels(problem, table, lives)
    gone, prefix_vars = _late_levels(problem, table, lates)
    levels = [(below, upto, late) for (below, upto), late in zip(levels, gone, strict=True)]
    spans = [unit.spans_step for unit in table.units]
    carries = _peak_rows(problem, peak_t, variables, levels, sizes, scale, carry, spans)
    if table.optimizer_step_bytes:
        # T >= the optimizer step's moment less every unit's live bytes (none is alive there)
        row = _summed([(peak_t, 1.0), *(term for _, terms in lives for term in terms)])
        problem += row >= (optimizer_moment_bytes(table) + sum(constant for constant, _ in lives)) / scale, "optimizer"
    if any(terms or least for least, terms in rebuilds):
        # T >= DDP's bucket rebuild's moment less every unit's live bytes (none is alive there)
        row = _summed([(peak_t, 1.0), *(term for _, terms in lives for term in terms),
                       *(term for _, terms in rebuilds for term in terms)])
        least = sum(least for least, _ in rebuilds) - table.activation_bytes
        problem += row >= (least + sum(constant for constant, _ in lives)) / scale, "rebuild"
    forbidden = _order_rows(problem, table, variables, carry) if prune else {}
    memory = _summed([*kept_terms, (peak_t, 1.0)])
    largest = [[max(map(size, (c for c, _ in pairs))) for pairs in variables] for size in (
        own_moment_bytes, buffer_bytes, MEMORY_PARTS["reduce"])]
    max_peak = (offset + round(sum(coef for _, coef in kept_terms) * scale)
                + max(transient_ceiling(*largest), optimizer_moment_bytes(table),
                      sum(max(c.rebuild_bytes for c, _ in pairs) for pairs in variables) - table.activation_bytes))
    memory_row = memory <= (max_peak + 1 - offset) / scale  # constrains nothing until a budget is set
    problem += memory_row, "memory"
    columns = (peak_t, *suffix_vars, *prefix_vars, *carries, *(x for pairs in variables for _, x in pairs))
    return Model(problem, tuple(variables), memory, memory_row, offset, max_peak, scale,
                  objective_unit_s(table), forbidden, columns)


def _order_rows(problem: pulp.LpProblem, table: ChoiceTable, variables: list, carry: bool) -> Forbidden:
    """``x[u,d] + sum(x[u+1,c]) <= 1`` over the ``c`` that may not follow ``d`` (identical neighbours;
    exact for the optimum, not for the k best plans, which include the swapped ones)."""
    forbidden = forbidden_orders(table, [[c for c, _ in pairs] for pairs in variables], carry)
    for u, pairs in forbidden.items():
        here, there = ({c.choice: x for c, x in variables[v]} for v in (u, u + 1))
        for i, first in enumerate(sorted({d for d, _ in pairs})):
            row = [(here[first], 1.0), *((there[c], 1.0) for d, c in sorted(pairs) if d == first)]
            problem += pulp.LpAffineExpression(row) <= 1, f"order_{u}_{i}"
    return forbidden


_Level = tuple[int, list[tuple[pulp.LpVariable, float]]]
"""Bytes as ``(constant, [(variable, -coefficient)])``: a ``T >= ...`` row's terms moved to its left."""


def _absent_levels(problem: pulp.LpProblem, table: ChoiceTable, lives: list[_Level]
                   ) -> tuple[list[tuple[_Level, _Level]], list[pulp.LpVariable]]:
    """Per unit, the live bytes *not* alive at its forward and at its backward (see
    :func:`moment_peak`) as ``(-constant, [(variable, +coefficient)])`` (``lives``: each unit's
    live bytes so), and the suffix variables: ``S[u] <= live[u] + S[next]`` sums the units from
    ``u`` on (those that span the step excepted). Exact: for a plan the largest ``S`` these allow
    is the sum, and a smaller one only raises ``T``."""
    absent: list[tuple[_Level, _Level]] = [((0, []), (0, []))] * len(table.units)
    after: _Level = (0, [])  # the live bytes of the units after the current one
    created: list[pulp.LpVariable] = []
    given_back = [u for u, unit in enumerate(table.units) if not unit.spans_step]
    for u in reversed(given_back):
        absent[u] = ((lives[u][0] + after[0], lives[u][1] + after[1]), after)
        if u == given_back[0]:  # no unit before it reads its suffix
            break
        suffix = _new_variable(problem, f"S_{u}", pulp.LpContinuous)
        created.append(suffix)
        # S[u] <= live[u] + S[next] (the constants stay out of the variables)
        row = [(suffix, -1.0), *lives[u][1], *after[1]]
        problem.addConstraint(_summed(row) >= 0, f"suffix_{u}")
        after = (lives[u][0] + after[0], [(suffix, 1.0)])
    return absent, created[::-1]


def _late_levels(problem: pulp.LpProblem, table: ChoiceTable, lates: list[_Level]
                 ) -> tuple[list[_Level], list[pulp.LpVariable]]:
    """Per unit, the sharded gradients *not* made yet at its backward (see :func:`_moments`): its
    own, those of the units before it and of the units that span the step (``lates``: each unit's
    as ``(-constant, [(variable, +coefficient)])``; none for a unit that spans the step), and the
    prefix variables: ``P[u] <= late[prev] + P[prev]``. Exact, as the suffix variables are."""
    gone: list[_Level] = [(0, [])] * len(table.units)
    before: _Level = (0, [])
    created: list[pulp.LpVariable] = []
    spanning = [u for u, unit in enumerate(table.units) if unit.spans_step]
    given_back = [u for u, unit in enumerate(table.units) if not unit.spans_step]
    for u in spanning:  # NOTE: spanning units reduce at the step's end: absent in every other backward
        before = (lates[u][0] + before[0], lates[u][1] + before[1])
    for u in given_back:
        gone[u] = (lates[u][0] + before[0], lates[u][1] + before[1])
        if u == given_back[-1] or not gone[u][1]:  # no unit after reads it / nothing varies: a constant
            before = (gone[u][0], gone[u][1])
            continue
        prefix = _new_variable(problem, f"P_{u}", pulp.LpContinuous)
        created.append(prefix)
        problem.addConstraint(_summed([(prefix, -1.0), *gone[u][1]]) >= 0, f"prefix_{u}")
        before = (gone[u][0], [(prefix, 1.0)])
    return gone, created


def _peak_rows(problem: pulp.LpProblem, peak_t: pulp.LpVariable, variables: list, levels: list,
               sizes: dict[str, list[_Level]], scale: int, carry: bool, spans: list[bool]) -> list[pulp.LpVariable]:
    """``T >=`` each unit's forward moment (its forward bytes, the forward buffer before it, less
    the live bytes not alive there), the end of its forward (its bytes still gathered, less the
    live bytes of the units after it) and backward moment (its transient, the backward gather of
    the unit before it (on either side, for a unit that spans the step) and the reduce-scatter
    input after it, less the same and the sharded gradients not made yet), buffers carried from
    the nearest unit that gathers (``carry``) or its neighbour's own; the carry variables. ``T`` is
    the peak less every unit's live bytes, which the memory row counts."""
    reduce = [(0, []) if spanning else level for level, spanning in zip(sizes["reduce"], spans, strict=True)]
    chained = ((_FORWARD, "prefetch", False), (_BEFORE, "backward", False),
               *([(_AFTER, "backward", True)] if any(spans[:-1]) else []))  # NOTE: only spanning units read Ca
    if carry:
        chains = {tag: _carry_variables(problem, variables, sizes[size], MEMORY_PARTS[size], scale, tag, reverse)
                  for tag, size, reverse in chained}
        chains[_REDUCE] = _suffix_max_variables(problem, reduce, scale, _REDUCE)
        carried = {tag: [(0, [(c, -1.0)]) for c in chain] for tag, chain in chains.items()}
    else:
        chains, carried = {}, {_FORWARD: sizes["prefetch"], _BEFORE: sizes["backward"], _AFTER: sizes["backward"],
                               _REDUCE: reduce}
    empty: _Level = (0, [])
    for u, (below, upto, late) in enumerate(levels):  # NOTE: what is not alive at the forward / backward
        # NOTE: in u's backward the unit after it is resharded; a spanning unit's backward runs
        # elsewhere in the order than its forward
        steps = ((_BEFORE, -1), (_AFTER, 1)) if spans[u] else ((_BEFORE, -1),)
        sides = [(tag, carried[tag][u + step]) for tag, step in steps if 0 <= u + step < len(levels)] or [("single", empty)]
        reduced = carried[_REDUCE][u + 1] if u + 1 < len(levels) and not spans[u] else empty
        moments = [("w", (below,), sizes["forward"][u], carried[_FORWARD][u - 1] if u else empty),
                   *([] if spans[u] else [("e", (upto,), sizes["end"][u], empty)]),
                   *((tag, (upto, late, reduced), sizes["transient"][u], side) for tag, side in sides)]
        for tag, parts, own, side in moments:
            parts = (*parts, own, side)
            row = _summed([(peak_t, 1.0), *(term for part in parts for term in part[1])])
            problem += row >= sum(part[0] for part in parts) / scale, f"pair_{tag}{u}"
    return [c for chain in chains.values() for c in chain]


def _summed(terms: list[tuple[pulp.LpVariable, float]]) -> pulp.LpAffineExpression:
    """One expression from terms that may name a variable twice (a unit's live and own bytes).

    NOTE: ``LpAffineExpression`` built from a list keeps the last coefficient of a repeated variable.
    """
    summed: dict[str, list] = {}
    for var, coef in terms:
        summed.setdefault(var.name, [var, 0.0])[1] += coef
    return pulp.LpAffineExpression([(var, coef) for var, coef in summed.values() if coef])


def _suffix_max_variables(problem: pulp.LpProblem, sizes: list[_Level], scale: int, tag: str
                          ) -> list[pulp.LpVariable]:
    """Per unit, ``M[u]``: the largest ``sizes`` from ``u`` on: ``M[u] >= size[u]``, ``M[u] >= M[u+1]``.
    Exact: the least ``M`` these allow is that maximum, and a larger one only raises ``T``."""
    maxima: list[pulp.LpVariable] = []
    for u in range(len(sizes) - 1, -1, -1):
        largest = _new_variable(problem, f"C{tag}_{u}", pulp.LpContinuous)
        least, terms = sizes[u]
        problem += pulp.LpAffineExpression([(largest, 1.0), *terms]) >= least / scale, f"own_{tag}{u}"
        if maxima:
            problem += pulp.LpAffineExpression([(largest, 1.0), (maxima[-1], -1.0)]) >= 0, f"max_{tag}{u}"
        maxima.append(largest)
    return maxima[::-1]


def _carry_variables(problem: pulp.LpProblem, variables: list, buffers: list[_Level],
                     size: Callable[[ChoiceCost], int], scale: int, tag: str, reverse: bool) -> list[pulp.LpVariable]:
    """Per unit, ``C[u]``: the all-gathered bytes (``size``) alive there from the nearest unit that
    gathers, scanning forward (or from the end with ``reverse``): ``C[u] >= size[u]``, and
    ``C[u] >= C[prev] - M * (u gathers)`` (``M``: the largest buffer that can reach ``u``). Exact:
    for a given plan the least ``C`` these allow is the carried buffer, and a larger one only
    raises ``T``."""
    order = range(len(variables) - 1, -1, -1) if reverse else range(len(variables))
    carries: list[pulp.LpVariable] = []
    reach = 0.0
    for u in order:
        carry = _new_variable(problem, f"C{tag}_{u}", pulp.LpContinuous)
        least, terms = buffers[u]
        problem += pulp.LpAffineExpression([(carry, 1.0), *terms]) >= least / scale, f"own_{tag}{u}"
        gathers = [(x, reach) for c, x in variables[u] if size(c) > 0]
        if carries and len(gathers) < len(variables[u]):  # some choice lets the buffer through
            problem += pulp.LpAffineExpression([(carry, 1.0), (carries[-1], -1.0), *gathers]) >= 0, f"pass_{tag}{u}"
        reach = max(reach, max(size(c) for c, _ in variables[u]) / scale)
        carries.append(carry)
    return carries[::-1] if reverse else carries


def set_budget(model: Model, budget_bytes: float) -> None:
    """What the solver sees as the budget: ``budget_bytes`` plus the slack (see module docstring)."""
    rhs = min(budget_bytes, model.max_peak_bytes) + slack_bytes(model) - model.memory_offset_bytes
    model.memory_row.changeRHS(rhs / model.scale)


def slack_bytes(model: Model) -> float:
    return max(0.5, _SLACK_RELATIVE * model.max_peak_bytes)


def read_choices(model: Model) -> tuple[str, ...]:
    # argmax, not "== 1": the solvers' integer tolerance leaves values like 0.9999999.
    return tuple(max(pairs, key=lambda pair: pair[1].varValue or 0.0)[0].choice
                 for pairs in model.variables)


def slowest_s(table: ChoiceTable) -> float:
    return table.fixed_step_s + sum(max(choice_step_s(u, c) for c in u.choices) for u in table.units)


def objective_unit_s(table: ChoiceTable) -> float:
    """The mean unit's slowest seconds: the step objective's unit.

    NOTE: in seconds, a dry run's choices differ by 1e-5 s, near the solvers' absolute tolerances
    (reduced costs, cuts: about 1e-7). CBC then cut off t5_large's optimum at +5% of its smallest
    budget and called a plan 0.1% slower optimal.
    """
    return max(slowest_s(table) / len(table.units), 1e-12)


def step_objective(table: ChoiceTable, model: Model) -> pulp.LpAffineExpression:
    """Predicted step seconds, in units of ``model.objective_unit_s``."""
    unit_s = model.objective_unit_s
    return pulp.LpAffineExpression([(x, choice_step_s(unit, c) / unit_s) for unit, pairs in
                                    zip(table.units, model.variables, strict=True) for c, x in pairs],
                                   constant=table.fixed_step_s / unit_s)


def exclude(model: Model, choices: tuple[str, ...], heavier_too: bool = True) -> None:
    """Cut off one assignment; ``heavier_too``: with every plan at least as heavy in every unit.

    The peak only grows with each part of each unit's memory key (:func:`memory_key`), so when
    ``choices`` is over budget all of those are too: the cut removes no plan that fits.
    """
    cut = []
    for pairs, choice in zip(model.variables, choices, strict=True):
        mine = next(memory_key(c) for c, _ in pairs if c.choice == choice)
        cut += [x for c, x in pairs if c.choice == choice or (
            heavier_too and all(o >= m for o, m in zip(memory_key(c), mine, strict=True)))]
    index = len(_constraints_of(model.problem))
    model.problem.addConstraint(pulp.LpAffineExpression([(x, 1.0) for x in cut]) <= len(choices) - 1,
                                f"exclude_{index}")


def _constraints_of(problem: pulp.LpProblem) -> list[pulp.LpConstraint]:
    found = problem.constraints
    return found() if callable(found) else list(found.values())  # PuLP 3.3 / 2.x


def seed_values(table: ChoiceTable, model: Model, choices: Sequence[str]) -> tuple[tuple[str, ...], dict[str, float]]:
    """A plan of the model's choices as values of its variables, by name, put in the order its rows
    allow (swaps of identical neighbours: no larger peak, same step)."""
    choices = sorted_plan(choices, model.forbidden)
    values = {x.name: float(c.choice == choice)
              for pairs, choice in zip(model.variables, choices, strict=True) for c, x in pairs}
    costs = chosen_costs(table, choices)
    spans = [unit.spans_step for unit in table.units]
    peak = max(moment_peak(parts_of(costs), spans), optimizer_moment_bytes(table), rebuild_moment_bytes(table, costs))
    values["T"] = (peak - sum(c.live_bytes for c in costs)) / model.scale
    suffix = 0.0
    for u in range(len(costs) - 1, -1, -1):
        if not spans[u]:
            suffix = values[f"S_{u}"] = suffix + (costs[u].live_bytes - min(c.live_bytes for c, _ in model.variables[u])) / model.scale
    prefix = 0.0
    for u in sorted(range(len(costs)), key=lambda v: (not spans[v], v)):  # spanning units first
        prefix += (costs[u].late_grad_bytes - min(c.late_grad_bytes for c, _ in model.variables[u])) / model.scale
        if not spans[u]:
            values[f"P_{u}"] = prefix  # NOTE: names of variables the model did not create are ignored
    prefetches, backward = [c.prefetch for c in costs], [c.backward_prefetch for c in costs]
    reduce = [c.reduce_bytes for c in costs]
    largest = [max(0 if spanning else r, after)  # NOTE: Cr_u is the largest from u on
               for r, after, spanning in zip(reduce, reduced_after(reduce, spans), spans, strict=True)]
    for tag, carried in ((_FORWARD, carried_bytes(prefetches)), (_BEFORE, carried_bytes(backward)),
                         (_AFTER, carried_bytes(backward[::-1])[::-1]), (_REDUCE, largest)):
        values.update({f"C{tag}_{u}": held / model.scale for u, held in enumerate(carried)})
    return tuple(choices), values
