"""Stage 2: the choice table, every unit's allowed choices priced by their families.

:func:`build_choice_table` asks each choice family (:mod:`osdp_lightning.choices`) what each unit's
choices cost, from the records of :mod:`osdp_lightning.cost.cost`, and adds what the families do not
see: the activations no choice changes, the root's own moments, the compute that can hide each
unit's collectives. The solver (:mod:`osdp_lightning.solve`) reads nothing else.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from osdp_lightning.choices import (
    BASE_CHOICES,
    REPLICATE,
    as_choice,
    choice_cost,
    family_of,
    is_allowed,
    kept_share,
)
from osdp_lightning.cost.cluster import ClusterSpec
from osdp_lightning.cost.cost import ChoiceCost, ChoiceTable, CostContext, UnitCosts
from osdp_lightning.profiling.records import ModelProfile
from osdp_lightning.profiling.units import ROOT


def build_choice_table(profile: ModelProfile, cluster: ClusterSpec, micro_batch_size: int | None = None,
                       choices: Iterable[object] | None = None, accumulation_steps: int = 1) -> ChoiceTable:
    """The choice table for ``profile`` on ``cluster`` at ``micro_batch_size``.

    ``choices``: :class:`~osdp_lightning.choices.Choice` values or their names (default: the base
    choices replicate, zero2, zero3). Compute seconds and activation bytes are scaled linearly
    from the profiled micro-batch size. With one rank only replicate is offered (sharding over
    one rank saves nothing), with whatever modifiers the choices carry. ``accumulation_steps``:
    micro-batches per optimizer step (the table stays per micro-step, see :class:`CostContext`).
    """
    batch = micro_batch_size or profile.micro_batch_size
    ctx = CostContext(profile, cluster, batch / profile.micro_batch_size, accumulation_steps=accumulation_steps)
    allowed = [as_choice(c) for c in (BASE_CHOICES if choices is None else choices)]
    for choice in allowed:
        family_of(choice)  # an unknown family fails here, not silently per unit
    if cluster.world_size == 1:
        allowed = [c for c in allowed if c.kind == REPLICATE.kind] or [REPLICATE]
    allowed = list(dict.fromkeys(allowed))
    # Every choice's cost holds its unit's activations; the table keeps the rest of the peak
    # (backward temporaries; negative when the dry run counts part of the saved bytes as fixed).
    copies = sum(unit.cast_param_bytes for unit in profile.units)  # NOTE: autocast's, which do not grow with it
    rest = (int((profile.activation_bytes - copies) * ctx.batch_scale) + copies
            - sum(ctx.activation_bytes(unit) for unit in profile.units))
    # NOTE: with every unit's own backward temporaries measured (its rise), the rest is the loss's,
    # alive at the root's own moments only, as is what the root saved after the last unit.
    measured = ctx.batch_scale == 1 and all(u.backward_rise_bytes is not None for u in profile.units if u.name != ROOT)
    at_root = max(rest, 0) if measured else 0
    units = []
    for index, unit in enumerate(profile.units):
        offered = [c for c in allowed if is_allowed(unit, c, ctx)]
        # NOTE: a unit that can take none of them (the root under "always checkpoint") takes them
        # without their modifiers.
        offered = offered or [c for c in dict.fromkeys(c.base for c in allowed) if is_allowed(unit, c, ctx)]
        costs = tuple(choice_cost(unit, choice, ctx) for choice in offered)
        if unit.name == ROOT:
            tail = int(unit.tail_activation_bytes * ctx.batch_scale)
            costs = tuple(_at_root_moments(cost, tail, at_root) for cost in costs)
        units.append(UnitCosts(unit.name, costs, _overlap_s(profile, index, cluster) * ctx.batch_scale,
                               spans_step=unit.interleaved or unit.name == ROOT))
    return ChoiceTable(
        units=tuple(units),
        activation_bytes=rest - at_root,
        fixed_bytes=profile.fixed_bytes,
        micro_batch_size=batch,
        fixed_step_s=cluster.step_terms.loop_step_s if cluster.step_terms is not None else 0.0,
        optimizer_step_bytes=profile.optimizer_step_bytes,
    )


CHOICE_BYTE_FIELDS = ("state_bytes", "held_bytes", "transient_bytes", "prefetch_bytes", "activation_bytes",
                      "forward_bytes", "backward_prefetch_bytes", "late_grad_bytes", "reduce_bytes",
                      "unsaved_forward_bytes", "rebuild_bytes")
"""Every byte field of a :class:`ChoiceCost`: what the memory rows and moments are made of."""


def kept_free_table(table: ChoiceTable) -> ChoiceTable:
    """``table`` as headroom by kind prices it: each choice's bytes grown by its kind's share
    (:func:`~osdp_lightning.choices.kept_share`), and the bytes no choice changes (activations,
    the batch, the optimizer step's) by the largest share offered. Every moment of a plan grows by
    at least the least share of its choices; its peak on this table, within the usable budget, is
    what the plan keeps: the predicted peak and its headroom."""
    shares = {cost.choice: kept_share(cost.choice) for unit in table.units for cost in unit.choices}
    largest = max(shares.values(), default=0.0)

    def grown(cost: ChoiceCost) -> ChoiceCost:
        return dataclasses.replace(cost, **{name: _grown(getattr(cost, name), shares[cost.choice])
                                            for name in CHOICE_BYTE_FIELDS})
    units = tuple(dataclasses.replace(unit, choices=tuple(map(grown, unit.choices))) for unit in table.units)
    return dataclasses.replace(table, units=units, activation_bytes=_grown(table.activation_bytes, largest),
                               fixed_bytes=_grown(table.fixed_bytes, largest),
                               optimizer_step_bytes=_grown(table.optimizer_step_bytes, largest))


def bounded_table(table: ChoiceTable, cluster: ClusterSpec) -> ChoiceTable:
    """The table a plan's peak is bounded on within ``cluster.usable_bytes``: :func:`kept_free_table`
    under headroom by kind, else ``table`` itself (its headroom is already off the usable bytes)."""
    return kept_free_table(table) if cluster.headroom_by_kind else table


def _grown(size: int | None, share: float) -> int | None:
    """``size`` grown by ``share``, rounded up; a negative size (bytes a moment gives back) and
    ``None`` ("as another field") stay as they are."""
    return math.ceil(size * (1 + share)) if size is not None and size > 0 else size


def _at_root_moments(cost: ChoiceCost, tail: int, more: int) -> ChoiceCost:
    """The root's cost with its ``tail`` activations and ``more`` bytes alive in its own moments
    (the end of forward, the start of backward) instead of from its forward to its backward."""
    head = tail + more
    return dataclasses.replace(cost, activation_bytes=cost.activation_bytes - tail,
                               transient_bytes=cost.transient_bytes + head,
                               forward_bytes=None if cost.forward_bytes is None else cost.forward_bytes + head)


def _overlap_s(profile: ModelProfile, index: int, cluster: ClusterSpec) -> float:
    """Neighbouring compute that can hide this unit's collectives.

    Forward all-gathers are prefetched during the previous unit's forward; backward all-gathers
    during the next unit's backward; reduce-scatters run during the previous unit's backward.
    """
    units = profile.units
    before = units[index - 1] if index > 0 else None
    after = units[index + 1] if index + 1 < len(units) else None
    hidden = 0.0
    if before is not None:
        hidden += before.forward_s + before.backward_s
    if after is not None:
        hidden += after.backward_s
    return cluster.overlap_efficiency * hidden
