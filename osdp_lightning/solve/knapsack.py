"""The OSDP authors' knapsack dynamic program: the baseline the ILP is compared with, and the
seed the ILP's search starts from (its plans always fit)."""

from __future__ import annotations

import math
import time

import numpy as np

from osdp_lightning.cost.cost import ChoiceTable
from osdp_lightning.solve.evaluate import (
    Solution,
    buffer_bytes,
    check_table,
    choice_step_s,
    own_moment_bytes,
    peak_bytes,
    step_seconds,
    transient_ceiling,
)
from osdp_lightning.solve.solvers import INFEASIBLE, OPTIMAL

_MAX_DP_CELLS = 5 * 10**8


def knapsack_dp(table: ChoiceTable, budget_bytes: int, resolution_bytes: int = 2**20) -> Solution:
    """Baseline: the OSDP authors' knapsack dynamic program over integer memory units.

    What a one-dimensional knapsack can express, kept conservative so its plan always fits:

    - persistent bytes (state, held, activations) of each choice are rounded *up* to ``resolution_bytes``
      and all counted at once (as if every unit's moment came when all are alive);
    - the prefetch-pair maximum depends on two neighbouring choices, which an additive knapsack
      cannot see, so it reserves the worst pair over all choices of every consecutive pair (the
      larger of each choice's forward and transient bytes beside the largest other buffer), or
      the optimizer step's own bytes where they are more;
    - step seconds are additive per unit, so the objective is the same as the ILP's.

    Its plans are therefore feasible for the ILP too, and the ILP is never slower.
    """
    check_table(table)
    start = time.perf_counter()
    units = table.units
    worst = [max(map(own_moment_bytes, unit.choices)) for unit in units]
    worst_prefetch = [max(map(buffer_bytes, unit.choices)) for unit in units]
    worst_reduce = [max(c.reduce_bytes for c in unit.choices) for unit in units]
    # NOTE: the optimizer step's moment (state, fixed and its own bytes) lies below persistent + its own
    # bytes; DDP's bucket rebuild's (state, fixed and the replicated gradients again) below persistent +
    # the most any plan's rebuild allocates
    rebuild = sum(max(c.rebuild_bytes for c in unit.choices) for unit in units)
    reserve = max(transient_ceiling(worst, worst_prefetch, worst_reduce) + table.activation_bytes,
                  table.optimizer_step_bytes, rebuild) + table.fixed_bytes
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
            candidate = best[: capacity + 1 - w] + choice_step_s(unit, cost)
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
