"""Stage 3: choose one choice per unit (docs/design.md, section 4).

The integer program, for one :class:`~osdp_lightning.cost.ChoiceTable` (all bytes per rank):

- ``x[u,c]`` binary, ``sum_c x[u,c] = 1`` for every unit ``u``;
- memory: ``sum(state + live) x + T + activation_bytes + fixed_bytes <= budget``, with
  ``live = held + activation`` (kept from a unit's forward to its backward) and ``T`` the peak of
  every unit's forward and backward moments (:func:`_moment_peak`) *less* the live bytes of all
  units, since each moment's row gives back those not alive there: ``T >= forward[u] + Cf[u-1] -
  live[u] - S[u]`` (forward) and ``T >= transient[u] + Cb[u-1] - S[u]``, ``T >= transient[u] +
  Ca[u+1] - S[u]`` (backward), where ``S[u] <= S[next] + live[next]`` sums the units after ``u``
  (units that span the step are never given back). The memory row stays one knapsack row over
  every binary, which solvers cut well; a running sum in every row instead was 5-25x slower.
  ``Cf[u]`` is the forward all-gather buffer (``prefetch``) of the nearest unit at or before
  ``u`` that all-gathers, ``Cb[u]`` / ``Ca[u]`` the backward gather (``backward_prefetch``) of
  the nearest one before / after: FSDP2 keeps the last all-gather's buffer until the next
  (forward) and prefetches the next (backward), and replicated units between do neither
  (``_carry_variables``; ``C >= pf[u]``, ``C >= C[prev] - M * gathers[u]``);
- minimise ``fixed_step_s + sum(compute + optimizer + overhead) x + sum_u e[u]`` with
  ``e[u] = max(exposed[u,c], comm[u,c] - overlap[u])`` of the chosen ``c`` (``exposed``: the latency
  no overlap hides). Because exactly one ``x[u,c]`` is 1, that max is the linear term
  ``sum_c max(exposed, comm[u,c] - overlap[u]) x[u,c]``: the ``e >= ...`` rows are folded into the
  objective, which is exact and gives the solver a tighter relaxation than separate ``e`` variables.

Solved by HiGHS, or CBC without ``highspy`` (:mod:`osdp_lightning.solvers`), to the proven optimum
unless a gap or a time limit is given, or HiGHS has run :data:`SETTLE_AFTER_S` and has a plan
proven within :data:`SETTLE_GAP` (status ``Feasible`` and that gap). Before any solver runs: the
plan of each unit's fastest choice is the answer when it fits (it reaches the lower bound), and the
knapsack plan (:func:`knapsack_dp`, which always fits) is handed to the solver as its first incumbent.

Exact to the byte although solvers work in floating point: bytes enter it divided by a power of
ten (which, unlike a power of two, survives PuLP's 13-digit MPS file exactly) to keep a model's
bytes below 1e7; the solver sees the budget plus a slack of 1e-9 of the peak, above its own
tolerance, so it never rejects a plan that fits and its "Infeasible" is proof; every plan it
returns is re-evaluated in integer bytes by :func:`peak_bytes`, and one over the real budget is
cut off (with every plan at least as heavy in every unit) before the solver runs again.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from osdp_lightning import solvers
from osdp_lightning.cost import ChoiceCost, ChoiceTable, UnitCosts
from osdp_lightning.solvers import (
    FEASIBLE,
    INFEASIBLE,
    NOT_SOLVED,
    OPTIMAL,
    TIME_LIMIT,
    SolverSettings,
    SolverUnavailableError,
    pick_solver,
    run,
)
from osdp_lightning.symmetry import Forbidden, forbidden_orders, sorted_plan

# NOTE: PuLP comes through solvers.py, whose import guard says how to install it when it is missing.
pulp = solvers.pulp

__all__ = ["FEASIBLE", "INFEASIBLE", "NOT_SOLVED", "OPTIMAL", "TIME_LIMIT", "Solution", "SolverUnavailableError",
           "knapsack_dp", "next_best_solutions", "peak_bytes", "peak_lower_bound", "smallest_feasible_budget",
           "solve_choice_table", "step_lower_bound", "step_seconds"]
_MAX_SCALED = 1e7
_SLACK_RELATIVE = 1e-9
_MAX_CUTS = 20
_TIGHTEN_TRIES = 8
_MAX_DP_CELLS = 5 * 10**8
_FORWARD, _BEFORE, _AFTER, _REDUCE = "f", "b", "a", "r"
"""Tags of the carry variables (``Cf_u``: forward buffers from before; ``Cb_u`` / ``Ca_u``: backward
gathers from before / after; ``Cr_u``: the reduce-scatter input from after): the solver's seed sets
them by name."""
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


def _carried(prefetches: list[int], through: bool = True) -> list[int]:
    """Per unit, the all-gathered bytes alive there from the nearest unit at or before it that
    all-gathers (``prefetches > 0``). ``through=False``: each unit's own, nothing carried."""
    carried, last = [], 0
    for held in prefetches:
        last = held if held or not through else last
        carried.append(last)
    return carried


_SIZES: dict[str, Callable[[ChoiceCost], int]] = {
    "live": lambda c: c.live_bytes, "forward": lambda c: c.forward_peak_bytes,
    "transient": lambda c: c.transient_bytes, "prefetch": lambda c: c.prefetch,
    "backward": lambda c: c.backward_prefetch, "late": lambda c: c.late_grad_bytes,
    "reduce": lambda c: c.reduce_bytes}
"""The parts of a choice's memory the moment rows read (:func:`_moment_peak`)."""


def _parts_of(costs: list[ChoiceCost]) -> tuple[list[int], ...]:
    """Each part of :data:`_SIZES` (live, forward, transient, prefetch, backward, late, reduce),
    unit by unit."""
    return tuple([size(c) for c in costs] for size in _SIZES.values())


def _reduced_after(reduce: list[int], spans: list[bool], through: bool = True) -> list[int]:
    """Per unit, the reduce-scatter input alive at its backward: FSDP2 keeps that of the nearest unit
    after it that reduce-scatters until the next post-backward (units that span the step reduce at
    its end, after every other unit's backward). Priced as the largest of the units after it (an
    upper bound, exact for identical blocks, and linear without big-M rows); ``through=False``:
    the next unit's own (a lower bound)."""
    sizes = [0 if spanning else r for r, spanning in zip(reduce, spans, strict=True)]
    if not through:
        return [*sizes[1:], 0]
    after, largest = [], 0
    for size in reversed(sizes):
        after.append(largest)
        largest = max(largest, size)
    return after[::-1]


def _moment_peak(parts: tuple[list[int], ...], spans: list[bool], through: bool = True) -> int:
    """Largest bytes alive at once besides the state: the peak over every unit's forward and backward.

    At unit ``u``'s forward: the live bytes (held parameters, activations) of the units before it,
    its own forward bytes and the buffer of the nearest unit before it that all-gathers; at its
    backward: the live bytes up to it and its transient beside that buffer or the one of the
    nearest unit after it, plus a reduce-scatter input (:func:`_reduced_after`), less the sharded
    gradients (``late``) of the units up to it and of those spanning the step: not made yet, as
    Lightning sets the gradients to ``None`` between forward and backward. Units after ``u`` have
    not run yet (forward) or are through backward (backward). A unit that ``spans`` the step
    counts in every moment, and its own moments count every unit (alive only before the first
    reduce-scatter: none is added) and give back nothing. ``parts``: the lists of
    :func:`_parts_of` (bounds pass each unit's least, and its most ``late``).

    FSDP2 keeps the last forward all-gather's buffer until the next one (``prefetch``) and
    prefetches the next all-gather in backward (``backward_prefetch``; zero2 gathers nothing
    then): units that gather nothing (replicated, on DDP's reducer) end neither, so a replicated
    run between two sharded units leaves the far one's buffer alive (measured with
    FSDPMemTracker, docs/design.md section 4). ``through=False``: neighbours only (a lower bound).
    """
    return max((max(moment) for moment in _moments(parts, spans, through)), default=0)


def _moments(parts: tuple[list[int], ...], spans: list[bool], through: bool = True) -> list[tuple[int, int]]:
    """Each unit's forward and backward moment of :func:`_moment_peak`, besides the state."""
    live, forward, transients, prefetches, backward, late, reduce = parts
    buffer = [0, *_carried(prefetches, through)[:-1]]
    before = [0, *_carried(backward, through)[:-1]]
    after = [*_carried(backward[::-1], through)[::-1][1:], 0]
    reduced = _reduced_after(reduce, spans, through)
    total = sum(live)
    below = sum(b for b, spanning in zip(live, spans, strict=True) if spanning)
    absent = sum(g for g, spanning in zip(late, spans, strict=True) if spanning)  # NOTE: reduced last
    moments = []
    for u, spanning in enumerate(spans):
        upto = total if spanning else below + live[u]
        absent = absent if spanning else absent + late[u]
        moments.append(((total if spanning else below) + forward[u] + buffer[u],
                        upto + transients[u] + max(before[u], after[u]) + (0 if spanning else reduced[u] - absent)))
        below = below if spanning else upto
    return moments


def _transient_ceiling(transients: list[int], prefetches: list[int], reduces: Sequence[int] = ()) -> int:
    """Bytes no plan's transient peak exceeds when each unit's transient, prefetch and reduce-scatter
    input are at most these (the largest input beside any unit: an upper bound)."""
    reduce = max(reduces, default=0)
    if len(transients) < 2:
        return max(transients, default=0) + reduce
    top = sorted(range(len(prefetches)), key=prefetches.__getitem__)[-2:]  # the two largest prefetches
    return max(t + prefetches[top[-1] if top[-1] != u else top[0]] for u, t in enumerate(transients)) + reduce


def peak_bytes(table: ChoiceTable, choices: tuple[str, ...] | list[str]) -> int:
    """Exact per-rank peak of an assignment under the model the ILP uses."""
    moments = moment_bytes(table, choices)
    return max(max(moment) for moment in moments) if moments else table.activation_bytes + table.fixed_bytes


def moment_bytes(table: ChoiceTable, choices: tuple[str, ...] | list[str]) -> list[tuple[int, int]]:
    """Per unit, the bytes per rank the model the ILP uses predicts at its forward and at its
    backward moment (docs/design.md section 4); :func:`peak_bytes` is the largest."""
    costs = _chosen(table, choices)
    below = sum(cost.state_bytes for cost in costs) + table.activation_bytes + table.fixed_bytes
    moments = _moments(_parts_of(costs), [unit.spans_step for unit in table.units])
    return [(below + forward, below + backward) for forward, backward in moments]


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
    total = sum(max(c.persistent_bytes + c.forward_peak_bytes + 2 * c.transient_bytes for c in u.choices)
                for u in table.units)
    return 10 ** max(0, math.ceil(math.log10(max(total, 1) / _MAX_SCALED)))


def _candidates(unit: UnitCosts) -> list[ChoiceCost]:
    """Choices not dominated in memory (:func:`_memory_key`) and seconds by another one.

    Dropping them keeps the optimum exact: swapping a dominated choice for its dominator never
    raises the peak or the step time. Ties keep the first listed choice.
    """
    # NOTE: float64 holds bytes exactly up to 2**53 (8 PiB); all pairs at once, with numpy.
    keys = np.array([_memory_key(c) + (_choice_step_s(unit, c),) for c in unit.choices], dtype=np.float64)
    no_worse = (keys[:, None, :] <= keys[None, :, :]).all(axis=2)  # [j, i]: j is no worse than i anywhere
    equal = (keys[:, None, :] == keys[None, :, :]).all(axis=2)
    order = np.arange(len(keys))
    earlier = order[:, None] < order[None, :]  # [j, i]: j listed before i
    dominates = no_worse & (~equal | earlier)
    np.fill_diagonal(dominates, False)
    return [c for c, dominated in zip(unit.choices, dominates.any(axis=0), strict=True) if not dominated]


def _memory_key(cost: ChoiceCost) -> tuple[int, ...]:
    """State, live, forward, transient, prefetch and backward prefetch bytes, whether it gathers
    nothing in forward / in backward, the sharded gradients it gives back (more is better) and its
    reduce-scatter input (priced as the largest after a unit: less is never worse)."""
    # NOTE: the peak grows with each of these (_moment_peak). Gathering nothing (prefetch 0) lets a
    # farther unit's buffer through: worse in that respect than gathering a little, a key of its own.
    return (cost.state_bytes, cost.live_bytes, cost.forward_peak_bytes, cost.transient_bytes, cost.prefetch,
            cost.backward_prefetch, int(cost.prefetch == 0), int(cost.backward_prefetch == 0),
            -cost.late_grad_bytes, cost.reduce_bytes)


@dataclass(frozen=True)
class _Model:
    problem: pulp.LpProblem
    variables: tuple[tuple[tuple[ChoiceCost, pulp.LpVariable], ...], ...]
    """Per unit, its candidate choices and their binaries."""
    memory: pulp.LpAffineExpression
    """Scaled, choice-dependent bytes (state, live and ``T``: the peak) minus their constant part."""
    memory_row: pulp.LpConstraint
    """``memory <= budget``; its right-hand side is set per solve (see :func:`_set_budget`)."""
    memory_offset_bytes: int
    """Bytes of the peak that no choice changes (least state and live bytes, activations, fixed)."""
    max_peak_bytes: int
    """Peak of the heaviest choices everywhere: budgets above it constrain nothing."""
    scale: int
    objective_unit_s: float
    """Seconds per unit of the step objective (:func:`_step_objective`)."""
    forbidden: Forbidden
    """Orders of identical neighbours the model rules out (:mod:`osdp_lightning.symmetry`)."""
    columns: tuple[pulp.LpVariable, ...]
    """Every variable (``T``, the suffix and carry variables, the binaries), so the solver need not
    collect them from the rows."""


def _new_variable(problem: pulp.LpProblem, name: str, category: str) -> pulp.LpVariable:
    # NOTE: PuLP 3.3 deprecates free-standing LpVariable in favour of add_variable (absent in 2.x).
    if hasattr(problem, "add_variable"):
        return problem.add_variable(name, lowBound=0, cat=category)
    return pulp.LpVariable(name, lowBound=0, cat=category)


def _check_table(table: ChoiceTable) -> None:
    if not table.units or any(not unit.choices for unit in table.units):
        raise ValueError("the choice table needs at least one unit, and every unit at least one choice")


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
def _build_model(table: ChoiceTable, prune: bool = True, carry: bool = True) -> _Model:
    """Variables, one-choice rows, the rows of every unit's forward and backward moments and the
    memory row; the objective is set later.

    ``prune``: leave out dominated choices (exact for the optimum, not for the k best plans).
    ``carry``: buffers carried past units that gather nothing (exact); without, each unit's
    neighbours' own prefetch only: a relaxation (its peaks are never above the exact ones) that
    solves several times faster on large tables.
    """
    _check_table(table)
    scale = _memory_scale(table)
    problem = pulp.LpProblem("osdp", pulp.LpMinimize)
    peak_t = _new_variable(problem, "T", pulp.LpContinuous)
    variables, kept_terms, lives, lates = [], [], [], []
    sizes: dict[str, list[_Level]] = {key: [] for key in _SIZES if key not in ("live", "late")}
    offset = table.activation_bytes + table.fixed_bytes
    kept: dict[tuple, list[ChoiceCost]] = {}  # identical units (same costs) are pruned once
    for u, unit in enumerate(table.units):
        key = (unit.choices, unit.overlap_s)
        if key not in kept:
            kept[key] = _candidates(unit) if prune else list(unit.choices)
        pairs = [(c, _new_variable(problem, f"x_{u}_{i}", pulp.LpBinary)) for i, c in enumerate(kept[key])]
        variables.append(tuple(pairs))
        problem += pulp.LpAffineExpression([(x, 1.0) for _, x in pairs]) == 1, f"one_{u}"
        # NOTE: per-unit minima move to constants, so the rows only carry the differences.
        # The memory row counts every unit's live bytes (a knapsack row, as solvers like them); each
        # moment's row gives back those not alive there.
        for size in (lambda c: c.state_bytes, _SIZES["live"]):
            least, terms = _differences(pairs, size, scale, 1.0)
            offset += least
            kept_terms += terms
        lives.append((-least, terms))  # the live bytes, to give back
        least, terms = _differences(pairs, _SIZES["late"], scale, 1.0)
        lates.append((-least, terms))  # the sharded gradients, given back in backward
        for name in sizes:
            sizes[name].append(_differences(pairs, _SIZES[name], scale, -1.0))
    levels, suffix_vars = _absent_levels(problem, table, lives)
    gone, prefix_vars = _late_levels(problem, table, lates)
    levels = [(below, upto, late) for (below, upto), late in zip(levels, gone, strict=True)]
    spans = [unit.spans_step for unit in table.units]
    carries = _peak_rows(problem, peak_t, variables, levels, sizes, scale, carry, spans)
    forbidden = _order_rows(problem, table, variables, carry) if prune else {}
    memory = _summed([*kept_terms, (peak_t, 1.0)])
    largest = [[max(map(size, (c for c, _ in pairs))) for pairs in variables] for size in (
        _moment_bytes, _buffer_bytes, _SIZES["reduce"])]
    max_peak = (offset + round(sum(coef for _, coef in kept_terms) * scale)
                + _transient_ceiling(*largest))
    memory_row = memory <= (max_peak + 1 - offset) / scale  # constrains nothing until a budget is set
    problem += memory_row, "memory"
    columns = (peak_t, *suffix_vars, *prefix_vars, *carries, *(x for pairs in variables for _, x in pairs))
    return _Model(problem, tuple(variables), memory, memory_row, offset, max_peak, scale,
                  _objective_unit_s(table), forbidden, columns)


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


def _moment_bytes(cost: ChoiceCost) -> int:
    """Its larger own moment (forward or backward): what bounds hold for every plan use."""
    return max(cost.forward_peak_bytes, cost.transient_bytes)


def _buffer_bytes(cost: ChoiceCost) -> int:
    """The larger buffer it leaves beside another unit (forward or backward all-gather)."""
    return max(cost.prefetch, cost.backward_prefetch)


_Level = tuple[int, list[tuple[pulp.LpVariable, float]]]
"""Bytes as ``(constant, [(variable, -coefficient)])``: a ``T >= ...`` row's terms moved to its left."""


def _absent_levels(problem: pulp.LpProblem, table: ChoiceTable, lives: list[_Level]
                   ) -> tuple[list[tuple[_Level, _Level]], list[pulp.LpVariable]]:
    """Per unit, the live bytes *not* alive at its forward and at its backward (see
    :func:`_moment_peak`) as ``(-constant, [(variable, +coefficient)])`` (``lives``: each unit's
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
    the live bytes not alive there) and backward moment (its transient, the backward gather beside
    it on either side and the reduce-scatter input after it, less the same and the sharded
    gradients not made yet), buffers carried from the nearest unit that gathers (``carry``) or its
    neighbour's own; the carry variables. ``T`` is the peak less every unit's live bytes, which
    the memory row counts."""
    reduce = [(0, []) if spanning else level for level, spanning in zip(sizes["reduce"], spans, strict=True)]
    if carry:
        chains = {tag: _carry_variables(problem, variables, sizes[size], _SIZES[size], scale, tag, reverse)
                  for tag, size, reverse in ((_FORWARD, "prefetch", False), (_BEFORE, "backward", False),
                                             (_AFTER, "backward", True))}
        chains[_REDUCE] = _suffix_max_variables(problem, reduce, scale, _REDUCE)
        carried = {tag: [(0, [(c, -1.0)]) for c in chain] for tag, chain in chains.items()}
    else:
        chains, carried = {}, {_FORWARD: sizes["prefetch"], _BEFORE: sizes["backward"], _AFTER: sizes["backward"],
                               _REDUCE: reduce}
    empty: _Level = (0, [])
    for u, (below, upto, late) in enumerate(levels):  # NOTE: what is not alive at the forward / backward
        sides = [(tag, carried[tag][u + step]) for tag, step in ((_BEFORE, -1), (_AFTER, 1))
                 if 0 <= u + step < len(levels)] or [("single", empty)]
        reduced = carried[_REDUCE][u + 1] if u + 1 < len(levels) and not spans[u] else empty
        moments = [("w", (below,), sizes["forward"][u], carried[_FORWARD][u - 1] if u else empty),
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


def _set_budget(model: _Model, budget_bytes: float) -> None:
    """What the solver sees as the budget: ``budget_bytes`` plus the slack (see module docstring)."""
    rhs = min(budget_bytes, model.max_peak_bytes) + _slack_bytes(model) - model.memory_offset_bytes
    model.memory_row.changeRHS(rhs / model.scale)


def _relative_gap(objective: float, status: str, bound: float | None) -> float | None:
    if status == OPTIMAL:
        return 0.0
    if bound is None or not math.isfinite(bound):  # stopped before any bound was proven
        return None
    return max(0.0, objective - bound) / max(abs(objective), 1e-12)


def _read_choices(model: _Model) -> tuple[str, ...]:
    # argmax, not "== 1": the solvers' integer tolerance leaves values like 0.9999999.
    return tuple(max(pairs, key=lambda pair: pair[1].varValue or 0.0)[0].choice
                 for pairs in model.variables)


def _slowest_s(table: ChoiceTable) -> float:
    return table.fixed_step_s + sum(max(_choice_step_s(u, c) for c in u.choices) for u in table.units)


def _objective_unit_s(table: ChoiceTable) -> float:
    """The mean unit's slowest seconds: the step objective's unit.

    NOTE: in seconds, a dry run's choices differ by 1e-5 s, near the solvers' absolute tolerances
    (reduced costs, cuts: about 1e-7). CBC then cut off t5_large's optimum at +5% of its smallest
    budget and called a plan 0.1% slower optimal.
    """
    return max(_slowest_s(table) / len(table.units), 1e-12)


def _step_objective(table: ChoiceTable, model: _Model) -> pulp.LpAffineExpression:
    """Predicted step seconds, in units of ``model.objective_unit_s``."""
    unit_s = model.objective_unit_s
    return pulp.LpAffineExpression([(x, _choice_step_s(unit, c) / unit_s) for unit, pairs in
                                    zip(table.units, model.variables, strict=True) for c, x in pairs],
                                   constant=table.fixed_step_s / unit_s)


def _exclude(model: _Model, choices: tuple[str, ...], heavier_too: bool = True) -> None:
    """Cut off one assignment; ``heavier_too``: with every plan at least as heavy in every unit.

    The peak only grows with each part of each unit's memory key (:func:`_memory_key`), so when
    ``choices`` is over budget all of those are too: the cut removes no plan that fits.
    """
    cut = []
    for pairs, choice in zip(model.variables, choices, strict=True):
        mine = next(_memory_key(c) for c, _ in pairs if c.choice == choice)
        cut += [x for c, x in pairs if c.choice == choice or (
            heavier_too and all(o >= m for o, m in zip(_memory_key(c), mine, strict=True)))]
    index = len(_constraints_of(model.problem))
    model.problem.addConstraint(pulp.LpAffineExpression([(x, 1.0) for x in cut]) <= len(choices) - 1,
                                f"exclude_{index}")


def _constraints_of(problem: pulp.LpProblem) -> list[pulp.LpConstraint]:
    found = problem.constraints
    return found() if callable(found) else list(found.values())  # PuLP 3.3 / 2.x


def _remaining_s(time_limit_s: float | None, start: float) -> float | None:
    return None if time_limit_s is None else max(time_limit_s - (time.perf_counter() - start), 0.1)


def _run_once(model: _Model, settings: SolverSettings, start: float, warm: dict[str, float] | None = None
              ) -> tuple[str, float | None, tuple[str, ...]]:
    """The solver's status, bound (when not proven) and plan (empty when it has none)."""
    settings = replace(settings, time_limit_s=_remaining_s(settings.time_limit_s, start))
    result = run(model.problem, settings, warm, model.columns)
    found = result.status in (OPTIMAL, TIME_LIMIT, FEASIBLE)
    # NOTE: in seconds, as the step objective's bound (smallest_feasible_budget's bytes bound is not read)
    bound = None if result.bound is None else result.bound * model.objective_unit_s
    return result.status, bound, _read_choices(model) if found else ()


def _settings(table: ChoiceTable, time_limit_s: float | None, gap: float | None, msg: bool,
              solver: str | None) -> SolverSettings:
    if gap is not None and not 0.0 <= gap < 1.0:
        raise ValueError(f"gap must be a relative gap in [0, 1), got {gap!r}")
    # Prune only branches that cannot beat the incumbent by a billionth of the slowest plan.
    tie = 1e-9 * max(_slowest_s(table), 1e-12) / _objective_unit_s(table)
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
    (default: :func:`~osdp_lightning.solvers.pick_solver`).
    """
    start = time.perf_counter()
    _check_table(table)
    settings = _settings(table, time_limit_s, gap, msg, solver)
    fastest = _fastest_plan(table)
    if peak_bytes(table, fastest) <= budget_bytes:  # it reaches the lower bound: nothing to search
        return _solution(table, fastest, OPTIMAL, None, start)
    # The relaxation first (buffers of neighbours only): its plan, when it fits exactly, is the
    # true optimum (or within the gap its bound proves: the relaxation's bound holds for the true
    # problem too); most plans put no replicated unit between two sharded ones. Else the exact model.
    relaxed = _build_model(table, carry=False)
    relaxed.problem.setObjective(_step_objective(table, relaxed))
    warm = _warm_start(table, relaxed, budget_bytes)
    _set_budget(relaxed, budget_bytes)
    status, bound, choices = _run_once(relaxed, settings, start, warm[1] if warm else None)
    if status == INFEASIBLE or (choices and peak_bytes(table, choices) <= budget_bytes):
        return _solution(table, choices, status, bound, start)
    model = _build_model(table)  # NOTE: the same choices and variable names: the seed carries over
    model.problem.setObjective(_step_objective(table, model))
    return _solve_within(table, model, budget_bytes, settings, start, warm and _seed(table, model, warm[0]))


def _solve_within(table: ChoiceTable, model: _Model, budget_bytes: int, settings: SolverSettings, start: float,
                  warm: tuple[tuple[str, ...], dict[str, float]] | None = None) -> Solution:
    """The best plan of ``model`` (its objective as set) that fits ``budget_bytes`` exactly.

    NOTE: solvers decide feasibility only to about 1e-8 of the row (presolve included). They get
    a slightly larger budget, so they never reject a plan that fits; "Infeasible" is then proof.
    A plan over the budget is cut off (with every heavier plan) and the solver runs again.
    """
    _set_budget(model, budget_bytes)
    lower_bound: float | None = None
    for _ in range(_MAX_CUTS):
        status, bound, choices = _run_once(model, settings, start, warm[1] if warm else None)
        if not choices and warm and status == NOT_SOLVED:  # stopped before its first plan: the seed fits
            return _solution(table, warm[0], TIME_LIMIT, None, start)
        if not choices or peak_bytes(table, choices) <= budget_bytes:
            return _solution(table, choices, status, bound, start)
        _exclude(model, choices)
        # The relaxed problem's optimum bounds the true one from below.
        lower_bound = pulp.value(model.problem.objective) * model.objective_unit_s if status == OPTIMAL else bound
    return _solve_tightened(table, model, budget_bytes, lower_bound, settings, start)


def _solve_tightened(table: ChoiceTable, model: _Model, budget_bytes: int, lower_bound: float | None,
                     settings: SolverSettings, start: float) -> Solution:
    """Many plans just over the budget (symmetric units): shrink the solver's budget until one fits.

    The plan found then fits for sure; it is proven optimal only if it reaches ``lower_bound``.
    """
    margin = _slack_bytes(model)
    for _ in range(_TIGHTEN_TRIES):
        _set_budget(model, budget_bytes - 2 * margin)
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


def _slack_bytes(model: _Model) -> float:
    return max(0.5, _SLACK_RELATIVE * model.max_peak_bytes)


def _solution(table: ChoiceTable, choices: tuple[str, ...], status: str, bound: float | None,
              start: float) -> Solution:
    if not choices:
        return Solution((), status, math.inf, 0, time.perf_counter() - start)
    step_s = step_seconds(table, choices)
    gap = _relative_gap(step_s, status, bound)
    if status == FEASIBLE and gap is not None and gap <= 1e-9:  # stopped at a gap, but the optimum anyway
        status, gap = OPTIMAL, 0.0
    return Solution(choices, status, step_s, peak_bytes(table, choices), time.perf_counter() - start, gap)


def step_lower_bound(table: ChoiceTable) -> float:
    """Seconds per step no plan beats, whatever the budget: every unit at its fastest choice."""
    return step_seconds(table, _fastest_plan(table))


def peak_lower_bound(table: ChoiceTable) -> int:
    """Bytes per rank below every plan's peak: each unit's least state, live, forward, transient,
    prefetch, backward prefetch and reduce-scatter bytes, and its most sharded gradients given back."""
    parts = tuple([(max if name == "late" else min)(map(size, unit.choices)) for unit in table.units]
                  for name, size in _SIZES.items())
    # Neighbours only: with each unit's least prefetch, a carried buffer could be one no plan has.
    moments = _moment_peak(parts, [unit.spans_step for unit in table.units], through=False)
    return sum(min(c.state_bytes for c in unit.choices) for unit in table.units) + moments + table.activation_bytes + table.fixed_bytes


def _fastest_plan(table: ChoiceTable) -> tuple[str, ...]:
    """Each unit's fastest choice (the lightest of equally fast ones): the plan of no budget."""
    return tuple(min(unit.choices, key=lambda c: (_choice_step_s(unit, c), _memory_key(c))).choice
                 for unit in table.units)


def _warm_start(table: ChoiceTable, model: _Model, budget_bytes: int
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
        key = _memory_key(mine) + (_choice_step_s(unit, mine),)
        choices.append(next(c.choice for c, _ in pairs if c.choice == choice or all(
            o <= k for o, k in zip(_memory_key(c) + (_choice_step_s(unit, c),), key, strict=True))))
    return _seed(table, model, choices)


def _seed(table: ChoiceTable, model: _Model, choices: Sequence[str]) -> tuple[tuple[str, ...], dict[str, float]]:
    """A plan of the model's choices as values of its variables, by name, put in the order its rows
    allow (swaps of identical neighbours: no larger peak, same step)."""
    choices = sorted_plan(choices, model.forbidden)
    values = {x.name: float(c.choice == choice)
              for pairs, choice in zip(model.variables, choices, strict=True) for c, x in pairs}
    costs = _chosen(table, choices)
    spans = [unit.spans_step for unit in table.units]
    values["T"] = (_moment_peak(_parts_of(costs), spans) - sum(c.live_bytes for c in costs)) / model.scale
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
               for r, after, spanning in zip(reduce, _reduced_after(reduce, spans), spans, strict=True)]
    for tag, carried in ((_FORWARD, _carried(prefetches)), (_BEFORE, _carried(backward)),
                         (_AFTER, _carried(backward[::-1])[::-1]), (_REDUCE, largest)):
        values.update({f"C{tag}_{u}": held / model.scale for u, held in enumerate(carried)})
    return tuple(choices), values


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
    model = _build_model(table, prune=False)
    model.problem.setObjective(_step_objective(table, model))
    found: list[Solution] = []
    while len(found) < count:
        solution = _solve_within(table, model, budget_bytes, settings, start)
        if not solution.feasible:
            break
        found.append(solution)
        _exclude(model, solution.choices, heavier_too=False)
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
    _check_table(table)
    model = _build_model(table)
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


def knapsack_dp(table: ChoiceTable, budget_bytes: int, resolution_bytes: int = 2**20) -> Solution:
    """Baseline: the OSDP authors' knapsack dynamic program over integer memory units.

    What a one-dimensional knapsack can express, kept conservative so its plan always fits:

    - persistent bytes (state, held, activations) of each choice are rounded *up* to ``resolution_bytes``
      and all counted at once (as if every unit's moment came when all are alive);
    - the prefetch-pair maximum depends on two neighbouring choices, which an additive knapsack
      cannot see, so it reserves the worst pair over all choices of every consecutive pair (the
      larger of each choice's forward and transient bytes beside the largest other buffer);
    - step seconds are additive per unit, so the objective is the same as the ILP's.

    Its plans are therefore feasible for the ILP too, and the ILP is never slower.
    """
    import numpy as np  # NOTE: local import: only this baseline needs numpy.

    _check_table(table)
    start = time.perf_counter()
    units = table.units
    worst = [max(map(_moment_bytes, unit.choices)) for unit in units]
    worst_prefetch = [max(map(_buffer_bytes, unit.choices)) for unit in units]
    worst_reduce = [max(c.reduce_bytes for c in unit.choices) for unit in units]
    reserve = _transient_ceiling(worst, worst_prefetch, worst_reduce) + table.activation_bytes + table.fixed_bytes
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
