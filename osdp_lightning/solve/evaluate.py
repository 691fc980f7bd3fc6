"""Evaluating an assignment (a choice per unit of a :class:`~osdp_lightning.cost.cost.ChoiceTable`) under the
model the ILP uses: its exact peak bytes per rank (:func:`peak_bytes`, :func:`moment_bytes`) and step
seconds (:func:`step_seconds`), and the bounds no assignment passes (:func:`peak_lower_bound`,
:func:`step_lower_bound`). The ILP's rows (:mod:`osdp_lightning.solve.model`) are the linear form of
:func:`moment_peak`; every plan a solver returns is evaluated again here, in integer bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from osdp_lightning.cost.cost import ChoiceCost, ChoiceTable, UnitCosts
from osdp_lightning.solve.solvers import FEASIBLE, OPTIMAL, TIME_LIMIT


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


def chosen_costs(table: ChoiceTable, choices: tuple[str, ...] | list[str]) -> list[ChoiceCost]:
    if len(choices) != len(table.units):
        raise ValueError(f"{len(choices)} choices for {len(table.units)} units")
    return [unit.cost_of(choice) for unit, choice in zip(table.units, choices, strict=True)]


def carried_bytes(prefetches: list[int], through: bool = True) -> list[int]:
    """Per unit, the all-gathered bytes alive there from the nearest unit at or before it that
    all-gathers (``prefetches > 0``). ``through=False``: each unit's own, nothing carried."""
    carried, last = [], 0
    for held in prefetches:
        last = held if held or not through else last
        carried.append(last)
    return carried


MEMORY_PARTS: dict[str, Callable[[ChoiceCost], int]] = {
    "live": lambda c: c.live_bytes, "forward": lambda c: c.forward_peak_bytes,
    "transient": lambda c: c.transient_bytes, "prefetch": lambda c: c.prefetch,
    "backward": lambda c: c.backward_prefetch, "late": lambda c: c.late_grad_bytes,
    "reduce": lambda c: c.reduce_bytes, "end": lambda c: c.forward_end_bytes}
"""The parts of a choice's memory the moment rows read (:func:`moment_peak`)."""


def parts_of(costs: list[ChoiceCost]) -> tuple[list[int], ...]:
    """Each part of :data:`MEMORY_PARTS` (live, forward, transient, prefetch, backward, late, reduce,
    end), unit by unit."""
    return tuple([size(c) for c in costs] for size in MEMORY_PARTS.values())


def reduced_after(reduce: list[int], spans: list[bool], through: bool = True) -> list[int]:
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


def moment_peak(parts: tuple[list[int], ...], spans: list[bool], through: bool = True) -> int:
    """Largest bytes alive at once besides the state: the peak over every unit's forward and backward.

    At unit ``u``'s forward: the live bytes (held parameters, activations) of the units before it,
    its own forward bytes and the buffer of the nearest unit before it that all-gathers, or, when
    its forward ends, the live bytes up to it and its own bytes still gathered (``end``); at its
    backward: the live bytes up to it and its transient beside the backward gather of the nearest
    unit before it, plus a reduce-scatter input (:func:`reduced_after`), less the sharded
    gradients (``late``) of the units up to it and of those spanning the step: not made yet, as
    Lightning sets the gradients to ``None`` between forward and backward. Units after ``u`` have
    not run yet (forward) or are through backward and resharded, their gathers freed (backward).
    A unit that ``spans`` the step counts in every moment, and its own moments count every unit
    (alive only before the first reduce-scatter: none is added) and the backward gather on either
    side of it, and give back nothing. ``parts``: the lists of :func:`parts_of` (bounds pass each
    unit's least, and its most ``late``).

    FSDP2 keeps the last forward all-gather's buffer until the next one (``prefetch``) and, once a
    unit's backward starts, prefetches the all-gather of the unit before it in forward order
    (``backward_prefetch``; zero2 gathers nothing then): units that gather nothing (replicated, on
    DDP's reducer) end neither, so a replicated run between two sharded units leaves the far
    one's buffer alive (measured with FSDPMemTracker, docs/design.md section 4).
    ``through=False``: neighbours only (a lower bound).
    """
    return max((max(moment) for moment in _moments(parts, spans, through)), default=0)


def _moments(parts: tuple[list[int], ...], spans: list[bool], through: bool = True) -> list[tuple[int, int]]:
    """Each unit's forward and backward moment of :func:`moment_peak`, besides the state."""
    live, forward, transients, prefetches, backward, late, reduce, end = parts
    buffer = [0, *carried_bytes(prefetches, through)[:-1]]
    before = [0, *carried_bytes(backward, through)[:-1]]
    after = [*carried_bytes(backward[::-1], through)[::-1][1:], 0]
    reduced = reduced_after(reduce, spans, through)
    total = sum(live)
    below = sum(b for b, spanning in zip(live, spans, strict=True) if spanning)
    absent = sum(g for g, spanning in zip(late, spans, strict=True) if spanning)  # NOTE: reduced last
    moments = []
    for u, spanning in enumerate(spans):
        upto = total if spanning else below + live[u]
        absent = absent if spanning else absent + late[u]
        start = (total if spanning else below) + forward[u] + buffer[u]
        # NOTE: the unit after u in forward order ran its backward and resharded before u's started;
        # a spanning unit's backward runs at another place in the order than its forward.
        beside = max(before[u], after[u]) if spanning else before[u]
        moments.append((start if spanning else max(start, upto + end[u]),
                        upto + transients[u] + beside + (0 if spanning else reduced[u] - absent)))
        below = below if spanning else upto
    return moments


def transient_ceiling(transients: list[int], prefetches: list[int], reduces: Sequence[int] = ()) -> int:
    """Bytes no plan's transient peak exceeds when each unit's transient, prefetch and reduce-scatter
    input are at most these (the largest input beside any unit: an upper bound)."""
    reduce = max(reduces, default=0)
    if len(transients) < 2:
        return max(transients, default=0) + reduce
    top = sorted(range(len(prefetches)), key=prefetches.__getitem__)[-2:]  # the two largest prefetches
    return max(t + prefetches[top[-1] if top[-1] != u else top[0]] for u, t in enumerate(transients)) + reduce


def peak_bytes(table: ChoiceTable, choices: tuple[str, ...] | list[str]) -> int:
    """Exact per-rank peak of an assignment under the model the ILP uses: every unit's moments and
    the optimizer step's (the state, the fixed bytes and the step's own, :func:`optimizer_moment_bytes`)."""
    costs = chosen_costs(table, choices)
    moments = moment_peak(parts_of(costs), [unit.spans_step for unit in table.units])
    return (sum(cost.state_bytes for cost in costs) + table.activation_bytes + table.fixed_bytes
            + max(moments, optimizer_moment_bytes(table), rebuild_moment_bytes(table, costs)))


def optimizer_moment_bytes(table: ChoiceTable) -> int:
    """The optimizer step's moment besides the state, the activations and the fixed bytes, in the
    terms of :func:`moment_peak` (which counts the activations in every moment; by the optimizer
    step backward has freed them): negative when no plan peaks there."""
    return table.optimizer_step_bytes - table.activation_bytes


def rebuild_moment_bytes(table: ChoiceTable, costs: Sequence[ChoiceCost]) -> int:
    """DDP's bucket rebuild's moment besides the state, the activations and the fixed bytes, in the
    terms of :func:`moment_peak`: the replicated gradients a second time (:attr:`ChoiceCost.rebuild_bytes`)
    as a forward starts, no activation alive yet; negative when no plan peaks there."""
    return sum(cost.rebuild_bytes for cost in costs) - table.activation_bytes


def moment_bytes(table: ChoiceTable, choices: tuple[str, ...] | list[str]) -> list[tuple[int, int]]:
    """Per unit, the bytes per rank the model the ILP uses predicts at its forward and at its
    backward moment (docs/design.md section 4); :func:`peak_bytes` is the largest of these and the
    optimizer step's."""
    costs = chosen_costs(table, choices)
    below = sum(cost.state_bytes for cost in costs) + table.activation_bytes + table.fixed_bytes
    moments = _moments(parts_of(costs), [unit.spans_step for unit in table.units])
    return [(below + forward, below + backward) for forward, backward in moments]


def choice_step_s(unit: UnitCosts, cost: ChoiceCost) -> float:
    # Only the part of a collective that neighbouring compute cannot hide costs time, and never
    # less than its exposed part (one launch latency per collective call).
    return (cost.compute_s + cost.optimizer_s + cost.overhead_s
            + max(cost.exposed_s, cost.comm_s - unit.overlap_s))


def step_seconds(table: ChoiceTable, choices: tuple[str, ...] | list[str]) -> float:
    """Exact predicted step seconds of an assignment under the model the ILP uses."""
    costs = chosen_costs(table, choices)
    return table.fixed_step_s + sum(choice_step_s(unit, cost) for unit, cost in zip(table.units, costs, strict=True))


def memory_key(cost: ChoiceCost) -> tuple[int, ...]:
    """State, live, forward, forward end, transient, prefetch and backward prefetch bytes, whether it gathers
    nothing in forward / in backward, the sharded gradients it gives back (more is better), its
    reduce-scatter input (priced as the largest after a unit: less is never worse) and what DDP's
    bucket rebuild allocates for it."""
    # NOTE: the peak grows with each of these (moment_peak). Gathering nothing (prefetch 0) lets a
    # farther unit's buffer through: worse in that respect than gathering a little, a key of its own.
    return (cost.state_bytes, cost.live_bytes, cost.forward_peak_bytes, cost.forward_end_bytes,
            cost.transient_bytes, cost.prefetch,
            cost.backward_prefetch, int(cost.prefetch == 0), int(cost.backward_prefetch == 0),
            -cost.late_grad_bytes, cost.reduce_bytes, cost.rebuild_bytes)


def undominated(unit: UnitCosts) -> list[ChoiceCost]:
    """Choices not dominated in memory (:func:`memory_key`) and seconds by another one.

    Dropping them keeps the optimum exact: swapping a dominated choice for its dominator never
    raises the peak or the step time. Ties keep the first listed choice.
    """
    # NOTE: float64 holds bytes exactly up to 2**53 (8 PiB); all pairs at once, with numpy.
    keys = np.array([memory_key(c) + (choice_step_s(unit, c),) for c in unit.choices], dtype=np.float64)
    no_worse = (keys[:, None, :] <= keys[None, :, :]).all(axis=2)  # [j, i]: j is no worse than i anywhere
    equal = (keys[:, None, :] == keys[None, :, :]).all(axis=2)
    order = np.arange(len(keys))
    earlier = order[:, None] < order[None, :]  # [j, i]: j listed before i
    dominates = no_worse & (~equal | earlier)
    np.fill_diagonal(dominates, False)
    return [c for c, dominated in zip(unit.choices, dominates.any(axis=0), strict=True) if not dominated]


def own_moment_bytes(cost: ChoiceCost) -> int:
    """Its largest own moment (forward, forward's end or backward): what bounds hold for every plan use."""
    return max(cost.forward_peak_bytes, cost.live_bytes + cost.forward_end_bytes, cost.transient_bytes)


def buffer_bytes(cost: ChoiceCost) -> int:
    """The larger buffer it leaves beside another unit (forward or backward all-gather)."""
    return max(cost.prefetch, cost.backward_prefetch)


def step_lower_bound(table: ChoiceTable) -> float:
    """Seconds per step no plan beats, whatever the budget: every unit at its fastest choice."""
    return step_seconds(table, fastest_plan(table))


def peak_lower_bound(table: ChoiceTable) -> int:
    """Bytes per rank below every plan's peak: each unit's least state, live, forward, transient,
    prefetch, backward prefetch and reduce-scatter bytes, and its most sharded gradients given back."""
    parts = tuple([(max if name == "late" else min)(map(size, unit.choices)) for unit in table.units]
                  for name, size in MEMORY_PARTS.items())
    # Neighbours only: with each unit's least prefetch, a carried buffer could be one no plan has.
    moments = moment_peak(parts, [unit.spans_step for unit in table.units], through=False)
    least_rebuild = sum(min(c.rebuild_bytes for c in unit.choices) for unit in table.units)
    moments = max(moments, optimizer_moment_bytes(table), least_rebuild - table.activation_bytes)
    return sum(min(c.state_bytes for c in unit.choices) for unit in table.units) + moments + table.activation_bytes + table.fixed_bytes


def fastest_plan(table: ChoiceTable) -> tuple[str, ...]:
    """Each unit's fastest choice (the lightest of equally fast ones): the plan of no budget."""
    return tuple(min(unit.choices, key=lambda c: (choice_step_s(unit, c), memory_key(c))).choice
                 for unit in table.units)


def check_table(table: ChoiceTable) -> None:
    if not table.units or any(not unit.choices for unit in table.units):
        raise ValueError("the choice table needs at least one unit, and every unit at least one choice")
