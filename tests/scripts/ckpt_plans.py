"""Hand-made osdp plans for the toy MLP, so that checkpoint tests control every unit's choice.

A plan only needs the units (names, modules, parameter counts) to be applied; the predictions
are placeholders. ``fixed_plan(MLP(width=64), 2, {"net.4": "split(k=2, sharded=1)"})``.
"""

from __future__ import annotations

from torch import nn

from osdp_lightning.plan.plan import Plan, UnitPlan
from osdp_lightning.profiling.units import ROOT, select_units, unit_param_counts

# One of each choice on 2 ranks (MLP units: net.0, net.2, net.4, net.6; net.8 stays with the root).
MIXED = {"net.0": "replicate", "net.2": "zero3", "net.4": "split(k=2, sharded=1)", "net.6": "zero2", ROOT: "zero3"}
# Another plan for the same model: what was split is whole and the other way round.
OTHER = {"net.0": "zero3", "net.2": "split(k=4, sharded=2)", "net.4": "replicate", "net.6": "zero3",
         ROOT: "replicate"}


def fixed_plan(model: nn.Module, world_size: int, choices: dict[str, str], default: str = "zero3") -> Plan:
    specs = select_units(model)
    counts = unit_param_counts(model, specs)
    units = [UnitPlan(s.name, s.module_names, counts[s.name], choices.get(s.name, default), 0, 0.0) for s in specs]
    units.append(UnitPlan(ROOT, (ROOT,), counts[ROOT], choices.get(ROOT, default), 0, 0.0))
    return Plan(units=tuple(units), world_size=world_size, micro_batch_size=8, memory_budget_bytes=2**30,
                predicted_peak_bytes=0, predicted_step_s=0.0, predicted_throughput=0.0, activation_bytes=0,
                solver_status="Fixed", source="fixed")
