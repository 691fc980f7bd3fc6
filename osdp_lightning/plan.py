"""The Plan: what every unit does, and what that is predicted to cost.

A frozen, JSON-serialisable record produced by :func:`make_plan` (batch-size loop around the
solver) and consumed by :func:`osdp_lightning.apply.apply_plan`. It prints as a table, saves and
loads, and can be handed back to the strategy to skip profiling and solving.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from osdp_lightning.budget import format_bytes
from osdp_lightning.cost import (
    BASE_CHOICES,
    ChoiceTable,
    ClusterSpec,
    build_choice_table,
    is_known_choice,
)
from osdp_lightning.profile import ModelProfile
from osdp_lightning.solve import peak_bytes, smallest_feasible_budget, solve_choice_table, step_seconds
from osdp_lightning.units import ROOT, UnitSpec, unit_param_counts

PLAN_FORMAT_VERSION = 1


class InfeasibleBudgetError(ValueError):
    """No plan fits the memory budget; the message names the smallest budget that would."""


class PlanMismatchError(ValueError):
    """A saved plan does not describe this model or this world size."""


@dataclass(frozen=True)
class UnitPlan:
    name: str
    module_names: tuple[str, ...]
    param_count: int
    choice: str
    predicted_bytes: int
    """This unit's persistent + held + transient bytes per rank."""
    predicted_comm_s: float


@dataclass(frozen=True)
class Plan:
    units: tuple[UnitPlan, ...]
    world_size: int
    micro_batch_size: int
    memory_budget_bytes: int
    """The per-rank budget; plans leave ``headroom_bytes`` of it free."""
    predicted_peak_bytes: int
    predicted_step_s: float
    predicted_throughput: float
    """Samples per second over all ranks."""
    activation_bytes: int
    solver_status: str
    solve_s: float = 0.0
    profile_s: float = 0.0
    gap: float | None = None
    source: str = "solved"
    """'solved', 'uniform:<choice>' for baselines, or 'loaded:<path>'."""
    collective_latency_s: float = 0.0
    bandwidth_bytes_per_s: float = 0.0
    overlap_efficiency: float = 0.0
    """The cluster figures the predictions used (measured at setup, or from a cluster config)."""

    def choice_of(self, unit_name: str) -> str:
        return next(u.choice for u in self.units if u.name == unit_name)

    # -- persistence -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format_version": PLAN_FORMAT_VERSION, **dataclasses.asdict(self)}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        try:
            data = json.loads(Path(path).read_text())
            data.pop("format_version", None)
            data["units"] = tuple(
                UnitPlan(**{**u, "module_names": tuple(u["module_names"])}) for u in data["units"])
            plan = cls(**data)
        except FileNotFoundError:
            raise
        except (ValueError, TypeError, KeyError) as err:
            raise ValueError(f"{path} is not a valid osdp plan JSON ({type(err).__name__}: {err}); "
                             "write plans with Plan.save() or delete the file to re-plan") from err
        unknown = sorted({u.choice for u in plan.units if not is_known_choice(u.choice)})
        if unknown:
            raise ValueError(f"{path} names unknown choices {unknown}; known choices are {list(BASE_CHOICES)} "
                             "and 'split(k=K, sharded=J)'")
        return dataclasses.replace(plan, source=f"loaded:{path}")

    def check_matches(self, model: nn.Module, world_size: int) -> None:
        """Refuse a plan made for another model or world size, saying what differs."""
        problems = []
        if self.world_size != world_size:
            problems.append(f"world size: plan {self.world_size}, run {world_size}")
        planned = {u.name: u.param_count for u in self.units}
        absent = sorted(m for u in self.units for m in u.module_names if m != ROOT and not _has_module(model, m))
        if absent:
            raise PlanMismatchError(f"the plan names modules this model does not have: {absent[:8]}")
        specs = [UnitSpec(u.name, u.module_names) for u in self.units if u.name != ROOT]
        actual = unit_param_counts(model, specs)
        missing, extra = sorted(set(actual) - set(planned)), sorted(set(planned) - set(actual))
        if missing:
            problems.append(f"units in the model but not in the plan: {missing[:8]}")
        if extra:
            problems.append(f"units in the plan but not in the model: {extra[:8]}")
        for name in sorted(set(planned) & set(actual)):
            if planned[name] != actual[name]:
                problems.append(f"unit {name or '<root>'!r}: plan has {planned[name]} parameters, "
                                f"model has {actual[name]}")
        if problems:
            raise PlanMismatchError("the plan does not match this run:\n  " + "\n  ".join(problems[:12]))

    # -- printing ----------------------------------------------------------------------------
    def format_table(self) -> str:
        width = max([len(u.name or "<root>") for u in self.units] + [4])
        lines = [f"{'unit':<{width}}  {'params':>12}  {'choice':<22}  {'bytes/rank':>12}  {'comm s':>9}"]
        lines.append("-" * len(lines[0]))
        for u in self.units:
            lines.append(f"{u.name or '<root>':<{width}}  {u.param_count:>12,}  {u.choice:<22}  "
                         f"{format_bytes(u.predicted_bytes):>12}  {u.predicted_comm_s:>9.4f}")
        counts = {c: sum(1 for u in self.units if u.choice == c) for c in sorted({u.choice for u in self.units})}
        lines += [
            "-" * len(lines[0]),
            f"choices: {', '.join(f'{c} x{n}' for c, n in counts.items())}",
            f"predicted peak per rank: {format_bytes(self.predicted_peak_bytes)} of budget "
            f"{format_bytes(self.memory_budget_bytes)} "
            f"({100 * self.predicted_peak_bytes / self.memory_budget_bytes:.1f}%)",
            f"predicted step: {self.predicted_step_s:.4f} s at micro-batch {self.micro_batch_size} x "
            f"{self.world_size} ranks = {self.predicted_throughput:.1f} samples/s",
            f"collectives: latency {1e6 * self.collective_latency_s:.0f} us, bandwidth "
            f"{self.bandwidth_bytes_per_s / 1e9:.2f} GB/s, overlap efficiency {self.overlap_efficiency:.2f}",
            f"solver: {self.solver_status}" + (f" (gap {self.gap:.2%})" if self.gap else "")
            + f", solve {self.solve_s:.3f} s, profile {self.profile_s:.3f} s, source {self.source}",
        ]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format_table()


def make_plan(profile: ModelProfile, cluster: ClusterSpec, *, uniform_choice: str | None = None,
              micro_batch_sizes: tuple[int, ...] | None = None,
              choices: tuple[str, ...] = BASE_CHOICES, time_limit_s: float | None = None) -> Plan:
    """Solve for every candidate micro-batch size and keep the highest throughput.

    With ``uniform_choice`` every unit gets that choice (the ddp/zero2/zero3 baselines) and the
    plan only carries the predictions. Raises :class:`InfeasibleBudgetError` when nothing fits.
    """
    candidates = micro_batch_sizes or (profile.micro_batch_size,)
    best: Plan | None = None
    for batch in sorted(set(candidates)):
        table = build_choice_table(profile, cluster, batch, choices=choices)
        if uniform_choice is not None:
            plan = _uniform_plan(table, profile, cluster, uniform_choice)
        else:
            plan = _solved_plan(table, profile, cluster, time_limit_s)
        if plan is not None and (best is None or plan.predicted_throughput > best.predicted_throughput):
            best = plan
    if best is None:
        table = build_choice_table(profile, cluster, min(candidates), choices=choices)
        fraction = cluster.headroom_bytes / cluster.memory_budget_bytes
        smallest = math.ceil(smallest_feasible_budget(table, time_limit_s=time_limit_s) / (1 - fraction))
        raise InfeasibleBudgetError(
            f"no plan fits the memory budget of {format_bytes(cluster.memory_budget_bytes)} per rank "
            f"(micro-batch {min(candidates)}, {cluster.world_size} ranks); the smallest budget that fits "
            f"is {format_bytes(smallest)} ({smallest} bytes, with {fraction:.0%} headroom): raise "
            f"memory_budget, lower the micro-batch size, or add ranks")
    return best


def _uniform_plan(table: ChoiceTable, profile: ModelProfile, cluster: ClusterSpec, choice: str) -> Plan:
    allowed = {c.choice for c in table.units[0].choices}
    effective = choice if choice in allowed else "replicate"  # one rank: every choice is replicate
    assignment = tuple(effective for _ in table.units)
    return _assemble(table, profile, cluster, assignment, status="Fixed", solve_s=0.0, gap=None,
                     source=f"uniform:{choice}")


def _solved_plan(table: ChoiceTable, profile: ModelProfile, cluster: ClusterSpec,
                 time_limit_s: float | None) -> Plan | None:
    usable = cluster.memory_budget_bytes - cluster.headroom_bytes
    solution = solve_choice_table(table, usable, time_limit_s=time_limit_s)
    if not solution.feasible:
        return None
    return _assemble(table, profile, cluster, solution.choices, status=solution.status,
                     solve_s=solution.solve_s, gap=solution.gap, source="solved")


def _assemble(table: ChoiceTable, profile: ModelProfile, cluster: ClusterSpec, assignment: tuple[str, ...],
              *, status: str, solve_s: float, gap: float | None, source: str) -> Plan:
    units = []
    for unit_costs, unit_profile, choice in zip(table.units, profile.units, assignment, strict=True):
        cost = unit_costs.cost_of(choice)
        units.append(UnitPlan(
            name=unit_profile.name, module_names=unit_profile.module_names,
            param_count=unit_profile.param_count + unit_profile.frozen_param_count, choice=choice,
            predicted_bytes=cost.state_bytes + cost.held_bytes + cost.transient_bytes,
            predicted_comm_s=cost.comm_s))
    step_s = step_seconds(table, assignment)
    return Plan(
        units=tuple(units), world_size=cluster.world_size, micro_batch_size=table.micro_batch_size,
        memory_budget_bytes=cluster.memory_budget_bytes, predicted_peak_bytes=peak_bytes(table, assignment),
        predicted_step_s=step_s,
        predicted_throughput=table.micro_batch_size * cluster.world_size / step_s if step_s > 0 else 0.0,
        activation_bytes=table.activation_bytes, solver_status=status, solve_s=solve_s,
        profile_s=profile.profile_s, gap=gap, source=source,
        collective_latency_s=cluster.collective_latency_s, bandwidth_bytes_per_s=cluster.bandwidth_bytes_per_s,
        overlap_efficiency=cluster.overlap_efficiency)


def _has_module(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True
