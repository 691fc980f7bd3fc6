"""Identical neighbours in a fixed order: rows that spare the solver symmetric branching.

Repeated blocks (24 T5 or BERT layers) are units with the same costs, so a plan and the same plan
with two neighbours' choices swapped take the same step time; the solver branches over which block
gets which choice (bert_large at +10% of its smallest budget: 6 s, most of it proving that swaps
gain nothing). A swap of neighbours ``u``, ``u + 1`` changes nothing outside the pair when the
buffers the pair leaves its other neighbours are the same either way (:func:`_neutral`); inside it,
only the two units' own moments (:func:`~osdp_lightning.solve.evaluate.moment_peak`) change. When putting ``c`` first is
never worse than ``d`` first, whatever the rest of the plan (:func:`_first_is_no_worse`, checked
over every buffer the other units can leave), the order ``d, c`` is forbidden: any plan can be
sorted into the allowed order by such swaps without a larger peak, so the optimum stays. Swaps
follow one fixed order of the choices, so sorting ends.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from osdp_lightning.cost.cost import ChoiceCost, ChoiceTable

Forbidden = dict[int, frozenset[tuple[str, str]]]
"""Per unit ``u``: the pairs ``(choice at u, choice at u + 1)`` not allowed there."""

_Term = tuple[int, str, int, tuple[str, int], bool]
"""Bytes of one moment besides what both orders share: ``constant + value(kind, k)`` plus the
reduce-scatter input beside it (``("k", bytes)``; ``("R", 0)``: the largest after the pair;
``("R|k", bytes)``: the larger of the two),
the kind telling what the rest of the plan adds (``X``: the forward buffer from before the pair,
``A``: the backward gather from before it, ``k``: nothing but ``k``; :func:`_value`), and whether it
is a backward moment (less the sharded gradients the units before the pair give back)."""


def forbidden_orders(table: ChoiceTable, candidates: Sequence[Sequence[ChoiceCost]], carry: bool) -> Forbidden:
    """The orders of identical neighbours a model may forbid (``candidates``: each unit's choices in
    the model; ``carry``: buffers carried past units that gather nothing, as the model prices them)."""
    reach = (*(max((size(c) for cs in candidates for c in cs), default=0)
               for size in (lambda c: c.prefetch, lambda c: c.backward_prefetch, lambda c: c.reduce_bytes)),
             sum(max((c.late_grad_bytes for c in cs), default=0) for cs in candidates))
    forbidden: Forbidden = {}
    cache: dict[tuple, frozenset[tuple[str, str]]] = {}
    units = table.units
    for u in range(len(units) - 1):
        same = (units[u].choices, units[u].overlap_s) == (units[u + 1].choices, units[u + 1].overlap_s)
        if not same or units[u].spans_step or units[u + 1].spans_step or candidates[u] != candidates[u + 1]:
            continue
        key = tuple(candidates[u])
        if key not in cache:
            cache[key] = _pairs(key, reach, carry)
        if cache[key]:
            forbidden[u] = cache[key]
    return forbidden


def _pairs(choices: tuple[ChoiceCost, ...], reach: tuple[int, ...], carry: bool) -> frozenset[tuple[str, str]]:
    """``(d, c)`` for every ``c`` that comes before ``d`` in one fixed order and is never worse first."""
    better = {(c.choice, d.choice) for c, d in itertools.permutations(choices, 2)
              if _neutral(c, d, carry) and _first_is_no_worse(c, d, reach, carry)}
    # NOTE: one fixed order of the choices (those that go first most often, first), so that the
    # swaps that sort a plan never cycle.
    rank = {c.choice: (-sum((c.choice, d.choice) in better for d in choices), i) for i, c in enumerate(choices)}
    return frozenset((d, c) for c, d in better if rank[c] < rank[d])


def _neutral(c: ChoiceCost, d: ChoiceCost, carry: bool) -> bool:
    """Whether swapping ``c`` and ``d`` leaves the pair's other neighbours the same buffers.

    With carrying, a neighbour sees the nearest of the two that gathers (or what passes both), the
    same in either order when both gather as much or one gathers nothing; without, it sees the
    adjacent one's own. A unit before the pair sees the largest reduce-scatter input after it
    (the same in either order; without carrying, the adjacent one's). The sharded gradients the
    pair gives back are the same sum in either order."""
    def same(a: int, b: int) -> bool:
        return a == b or (carry and min(a, b) == 0)
    return (same(c.prefetch, d.prefetch) and same(c.backward_prefetch, d.backward_prefetch)
            and (carry or c.reduce_bytes == d.reduce_bytes))


def _moments(first: ChoiceCost, second: ChoiceCost, carry: bool) -> list[_Term]:
    """The two units' forward (start and end) and backward moments with ``first`` at ``u`` and ``second`` after it,
    less the live bytes before ``u`` and plus the sharded gradients of the units before it: ``X``
    is the forward buffer from before ``u``, ``A`` the backward gather from before ``u`` (a unit's
    backward sees the gather of the unit before it only), ``R`` the reduce-scatter input from
    after ``u + 1`` (0 where there is no such unit)."""
    def passed(own: int, other: str) -> tuple[str, int]:
        return (other, 0) if carry and own == 0 else ("k", own)
    forward_buffer = passed(first.prefetch, "X")
    before_second = passed(first.backward_prefetch, "A")  # the backward gather beside ``second``
    late = first.late_grad_bytes  # NOTE: given back at a backward: the unit's own and those before
    none = ("k", 0)
    return [(first.forward_peak_bytes, "X", 0, none, False),
            (first.live_bytes + first.forward_end_bytes, "k", 0, none, False),
            (first.live_bytes + second.live_bytes + second.forward_end_bytes, "k", 0, none, False),
            (first.live_bytes + first.transient_bytes - late, "A", 0,
             ("R|k" if carry else "k", second.reduce_bytes), True),
            (first.live_bytes + second.forward_peak_bytes, *forward_buffer, none, False),
            (first.live_bytes + second.live_bytes + second.transient_bytes - late - second.late_grad_bytes,
             *before_second, ("R", 0), True)]


def _value(term: _Term, x: int, a: int, r: int, g: int) -> int:
    """A term's bytes at buffers ``x``, ``a``, reduce-scatter input ``r`` from after the pair and
    sharded gradients ``g`` given back before it."""
    constant, kind, k, (reduce_kind, reduce), backward = term
    extra = {"R": r, "k": reduce, "R|k": max(r, reduce)}[reduce_kind]
    return constant + {"X": x, "A": a, "k": k}[kind] + extra - (g if backward else 0)


def _first_is_no_worse(c: ChoiceCost, d: ChoiceCost, reach: tuple[int, ...], carry: bool) -> bool:
    """Whether the larger moment of ``c, d`` is never above that of ``d, c``: every moment of the
    first order is at most one moment of the second at every buffer the other units can leave
    (a sufficient test; exact on the corners and breakpoints of these piecewise-linear terms)."""
    ours, theirs = _moments(c, d, carry), _moments(d, c, carry)
    ks = {term[2] for term in ours + theirs}
    xs = (0, reach[0])
    az = sorted({0, reach[1], *(k for k in ks if k <= reach[1])})
    rs = sorted({0, reach[2], *(term[3][1] for term in ours + theirs if term[3][1] <= reach[2])})
    points = [(x, a, r, g) for x in xs for a in az for r in rs for g in (0, reach[3])]
    return all(any(all(_value(mine, *p) <= _value(other, *p) for p in points) for other in theirs)
               for mine in ours)


def sorted_plan(choices: Sequence[str], forbidden: Forbidden) -> tuple[str, ...]:
    """``choices`` with forbidden neighbours swapped until none is left (no larger peak, same step)."""
    plan = list(choices)
    changed = True
    while changed:
        changed = False
        for u, pairs in forbidden.items():
            if (plan[u], plan[u + 1]) in pairs:
                plan[u], plan[u + 1] = plan[u + 1], plan[u]
                changed = True
    return tuple(plan)
