"""The step terms fitted to the benches' timings (:mod:`osdp_lightning.calibrate.bench`): collectives
by least squares over their sizes, and what FSDP2's and a reducer's machinery and the optimizer step
cost per group and per byte, as what the stacks took beyond what the cost model itself gives them:
their measured compute, its collectives and its overlap of the two."""

from __future__ import annotations

import statistics

from osdp_lightning.calibrate.bench import (
    LOCAL,
    STACK_DEPTH,
    STACK_ROWS,
    Bench,
    calibrated_families,
    reference_name,
    stack_timings,
    stack_unit_names,
    stack_unit_params,
    stack_unit_tensors,
)
from osdp_lightning.choices.base import FamilyCalibration
from osdp_lightning.cost.cluster import ClusterSpec
from osdp_lightning.cost.step_terms import (
    ALL_GATHER,
    ALL_REDUCE,
    COLLECTIVES,
    GROUP_TERMS,
    PLAIN,
    Affine,
    StepTerms,
)
from osdp_lightning.plan.choice_table import build_choice_table
from osdp_lightning.profiling.records import ModelProfile, UnitProfile
from osdp_lightning.profiling.units import ROOT
from osdp_lightning.solve import step_seconds


def _collective_fit(points: list[tuple[float, float]]) -> Affine:
    """Rate: the least-squares slope through every size; constant: the smallest size's time less its
    bytes at that rate (a launch's latency, measured, not an intercept extrapolated from 16 MiB)."""
    rate = Affine.fit(points, 1).per_byte_s
    nbytes, seconds = points[0]
    return Affine(max(seconds - rate * nbytes, 0.0), rate)


def _stack_model_s(collectives: dict[str, Affine], calibration: FamilyCalibration, width: int, world: int,
                   compute_s: tuple[float, float], overlap_efficiency: float) -> float:
    """Seconds the cost model itself gives a family's bench stack: its measured ``compute_s``
    (forward, backward: the unsharded reference's), the model's collectives and their overlap with
    that compute, no machinery and no optimizer (so that what is left of the measurement is exactly
    what the model lacks, as in real use)."""
    names = stack_unit_names(calibration)
    params, linear = stack_unit_params(width, calibration), calibration.linear_units
    forward_s, backward_s = (seconds / len(names) for seconds in compute_s)
    units = [UnitProfile(name, (name,), params, 0, forward_s, backward_s, 0,
                         linear_shape=(width, width) if linear else None,
                         split_overhead_s=((2, 0.0),) if linear else (), tensor_count=stack_unit_tensors(calibration))
             for name in names]
    units.append(UnitProfile(ROOT, (ROOT,), 0, 0, 0.0, 0.0, 0, tensor_count=0))
    profile = ModelProfile(units=tuple(units), micro_batch_size=STACK_ROWS, param_bytes_per_element=4,
                           grad_bytes_per_element=4, compute_bytes_per_element=4, reduce_bytes_per_element=4,
                           optimizer_bytes_per_param=0, activation_bytes=0)
    zero = Affine(0.0, 0.0)
    comm_only = StepTerms(collectives=collectives, overhead={k: zero for k in GROUP_TERMS},
                          optimizer={k: zero for k in (*GROUP_TERMS, PLAIN)}, loop_step_s=0.0)
    cluster = ClusterSpec(world_size=world, memory_budget_bytes=2**40,
                          collective_latency_s=collectives[ALL_REDUCE].constant_s,
                          bandwidth_bytes_per_s=1.0 / max(collectives[ALL_GATHER].per_byte_s, 1e-15),
                          overlap_efficiency=overlap_efficiency, step_terms=comm_only)
    choice, root_choice = calibration.bench, calibration.root or calibration.bench
    table = build_choice_table(profile, cluster, choices=(choice, root_choice))
    return step_seconds(table, [choice] * len(names) + [root_choice])


def plain_optimizer_term(optimizer_s: dict[tuple[str, int], float]) -> Affine:
    """The optimizer step on plain tensors, per tensor and per byte, from the plain stacks' median
    ``optimizer_s`` (keyed like the benches)."""
    plain = stack_timings(None, {}, {w: seconds / STACK_DEPTH for (name, w), seconds in optimizer_s.items()
                                     if name == LOCAL})
    return Affine.fit(plain.points(plain.optimizer_s), plain.unit_tensors)


def fit_terms(collective_s: dict[str, float], benches: dict[tuple[str, int], Bench], world: int,
              optional: bool, overlap_efficiency: float = 0.0
              ) -> tuple[dict[str, Affine], dict[str, Affine], dict[str, Affine]]:
    """Collectives (from their least times), then the group terms of each family in registry order
    (``FamilyCalibration.fit``, from the benches' medians; a family whose optional bench was not
    run when ``optional`` is false fits from the terms before it); see the module docstring.
    ``overlap_efficiency``: the share of a collective plans take as hidden by neighbouring compute
    (0 on CPU)."""
    ring = (world - 1) / world
    moved = [(kind, int(nbytes) * ring, seconds) for key, seconds in collective_s.items()
             for kind, nbytes in [key.split("@")]]
    collectives = {kind: _collective_fit(sorted((x, t) for k, x, t in moved if k == kind)) for kind in COLLECTIVES}
    step = {k: statistics.median(b.step_s) for k, b in benches.items()}
    forward = {k: statistics.median(b.forward_s) if b.forward_s else 0.0 for k, b in benches.items()}
    opt = {k: statistics.median(b.optimizer_s) if b.optimizer_s else 0.0 for k, b in benches.items()}
    overhead: dict[str, Affine] = {}
    optimizer: dict[str, Affine] = {PLAIN: plain_optimizer_term(opt)}
    benched, widths = calibrated_families(optional), sorted({w for _, w in benches})
    for family in calibrated_families(optional=True):
        calibration, timings = family.calibration, None
        if family in benched:
            bench, reference, n = calibration.bench, reference_name(family), len(stack_unit_names(calibration))
            compute = {w: (forward[reference, w], step[reference, w] - forward[reference, w]) for w in widths}
            model = {w: _stack_model_s(collectives, calibration, w, world, compute[w], overlap_efficiency)
                     for w in widths}
            timings = stack_timings(calibration, {w: (step[bench, w] - model[w]) / n for w in widths},
                                    {w: opt[bench, w] / n for w in widths})
        family_overhead, family_optimizer = calibration.fit(timings, overhead, optimizer)
        overhead.update(family_overhead)
        optimizer.update(family_optimizer)
    return collectives, overhead, optimizer
