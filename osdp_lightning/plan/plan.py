"""The Plan: what every unit does, and what that is predicted to cost.

A frozen, JSON-serialisable record produced by :func:`make_plan` (batch-size loop around the
solver) and consumed by :func:`osdp_lightning.apply.apply.apply_plan`. It prints as a table, saves and
loads, and can be handed back to the strategy to skip profiling and solving.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from torch import nn

from osdp_lightning.choices import (
    BASE_CHOICES,
    REPLICATE,
    Choice,
    is_known,
    kept_share,
    known_names,
    parse,
    resolve,
)
from osdp_lightning.cost.budget import format_budget, format_bytes
from osdp_lightning.cost.cluster import ClusterSpec
from osdp_lightning.cost.cost import ChoiceTable
from osdp_lightning.plan.choice_table import bounded_table, build_choice_table
from osdp_lightning.profiling.records import ModelProfile, with_parts
from osdp_lightning.profiling.units import ROOT, UnitSpec, unit_param_counts
from osdp_lightning.solve import (
    choice_step_s,
    peak_bytes,
    peak_lower_bound,
    smallest_feasible_budget,
    solve_choice_table,
    step_lower_bound,
    step_seconds,
)

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
    # Per-unit breakdown of the chosen cost (the plan picture draws these; 0 in plans saved before).
    state_bytes: int = 0
    held_bytes: int = 0
    transient_bytes: int = 0
    activation_bytes: int = 0
    """Activations this unit's choice keeps (the choice-independent rest is ``Plan.activation_bytes``)."""
    compute_s: float = 0.0
    comm_s: float = 0.0
    """Communication seconds the step pays for this unit: what neighbouring compute does not hide."""
    optimizer_s: float = 0.0
    overhead_s: float = 0.0


@dataclass(frozen=True)
class BaselinePrediction:
    """A uniform plan (every unit ``choice``) priced on the same choice table as the plan."""

    choice: str
    peak_bytes: int
    step_s: float
    fits: bool
    """Within the budget less the headroom plans keep free."""


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
    fixed_bytes: int = 0
    """Bytes every plan pays besides units and activations (the input batch)."""
    baselines: tuple[BaselinePrediction, ...] = ()
    """The replicate (ddp) / zero2 / zero3 uniform plans at the same micro-batch and budget."""
    predicted_compute_s: float = 0.0
    """Parts of ``predicted_step_s``: the units' profiled forward and backward,"""
    predicted_optimizer_s: float = 0.0
    """the optimizer step over the parameters as the plan stores them,"""
    predicted_overhead_s: float = 0.0
    """the machinery that applies the choices (FSDP2's per-unit work, a reducer's),"""
    predicted_exposed_comm_s: float = 0.0
    """the communication no compute hides,"""
    predicted_loop_s: float = 0.0
    """and the training loop's own constant."""
    step_terms_source: str = ""
    """Where the step terms besides compute came from (measured at setup, a cache, a cluster config)."""
    accumulation_steps: int = 1
    """Micro-batches per optimizer step the plan was solved for; the predictions are per micro-step."""
    headroom_bytes: int = 0
    """Bytes of the budget the plan was solved to leave free, and the rule that set them:"""
    headroom_reason: str = ""
    kind_headroom_bytes: int = 0
    """The part of ``headroom_bytes`` kept by kind (each chosen choice's bytes grown by its kind's
    measured share; 0 under a flat rule): with the predicted peak, what the usable budget bounds."""
    untracked_bytes: int = 0
    """Bytes of the budget kept free for what the process needs beside the priced tensors, and
    where they were measured (:attr:`~osdp_lightning.cost.cluster.ClusterSpec.untracked_bytes`)."""
    untracked_reason: str = ""
    rebuild_bytes: int = 0
    """Replicated gradient bytes DDP's reducer allocates a second time when it rebuilds its buckets
    (once, at the second step's forward), where the budget counts that moment
    (:attr:`~osdp_lightning.cost.cluster.ClusterSpec.bucket_rebuild_counted`): the predicted peak
    counts it; 0 where it is not counted or nothing is replicated."""
    param_dtype: str = ""
    """The dtype its sharded units gather in and the dtype they reduce gradients in, as priced and as
    applied (FSDP2's ``MixedPrecisionPolicy``; ``bf16-mixed``: ``"bfloat16"``, ``"float32"``);
    ``""``: the parameters' own dtype (:mod:`osdp_lightning.profiling.precision`)."""
    reduce_dtype: str = ""

    @property
    def bounded_peak_bytes(self) -> int:
        """The peak the usable budget (the budget less what a flat headroom and the untracked bytes
        keep free) bounds: the predicted peak and the headroom kept by kind."""
        return self.predicted_peak_bytes + self.kind_headroom_bytes

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
            data["baselines"] = tuple(BaselinePrediction(**b) for b in data.get("baselines", ()))
            plan = cls(**data)
        except FileNotFoundError:
            raise
        except (ValueError, TypeError, KeyError) as err:
            raise ValueError(f"{path} is not a valid osdp plan JSON ({type(err).__name__}: {err}); "
                             "write plans with Plan.save() or delete the file to re-plan") from err
        unknown = sorted({u.choice for u in plan.units if not is_known(u.choice)})
        if unknown:
            raise ValueError(f"{path} names unknown choices {unknown}; known choices are {known_names()}")
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
    def choice_counts(self) -> dict[str, int]:
        """How many units take each choice, by choice name."""
        return dict(sorted(Counter(u.choice for u in self.units).items()))

    def choices_text(self) -> str:
        """The units' choices counted on one line (:func:`choices_text`): ``replicate x2, zero3 x1``."""
        return choices_text(u.choice for u in self.units)

    def format_table(self) -> str:
        width = max([len(u.name or "<root>") for u in self.units] + [4])
        lines = [f"{'unit':<{width}}  {'params':>12}  {'choice':<27}  {'bytes/rank':>12}  {'comm s':>9}"]
        lines.append("-" * len(lines[0]))
        for u in self.units:
            lines.append(f"{u.name or '<root>':<{width}}  {u.param_count:>12,}  {u.choice:<27}  "
                         f"{format_bytes(u.predicted_bytes):>12}  {u.predicted_comm_s:>9.4f}")
        lines += [
            "-" * len(lines[0]),
            f"choices: {self.choices_text()}",
            f"predicted peak per rank: {format_bytes(self.predicted_peak_bytes)} of budget "
            f"{format_bytes(self.memory_budget_bytes)} "
            f"({100 * self.predicted_peak_bytes / self.memory_budget_bytes:.1f}%)"
            + (f"; headroom kept free {format_bytes(self.headroom_bytes)} "
               f"({100 * self.headroom_bytes / self.memory_budget_bytes:.1f}%: {self.headroom_reason or 'as given'})"
               if self.headroom_bytes else "")
            + (f"; untracked kept free {format_bytes(self.untracked_bytes)} ({self.untracked_reason})"
               if self.untracked_bytes else "")
            + (f"; DDP's bucket rebuild at the second step counted ({format_bytes(self.rebuild_bytes)} of "
               "gradients again)" if self.rebuild_bytes else ""),
            f"predicted step: {self.predicted_step_s:.4f} s at micro-batch {self.micro_batch_size} x "
            f"{self.world_size} ranks = {self.predicted_throughput:.1f} samples/s",
            f"  = compute {self.predicted_compute_s:.4f} + optimizer {self.predicted_optimizer_s:.4f} + FSDP "
            f"overhead {self.predicted_overhead_s:.4f} + exposed communication {self.predicted_exposed_comm_s:.4f} "
            f"+ loop {self.predicted_loop_s:.4f} s (terms: {self.step_terms_source or 'none'})",
            f"collectives: latency {1e6 * self.collective_latency_s:.0f} us, bandwidth "
            f"{self.bandwidth_bytes_per_s / 1e9:.2f} GB/s, overlap efficiency {self.overlap_efficiency:.2f}"
            + (f"; sharded units gather {self.param_dtype or 'as stored'}, reduce {self.reduce_dtype or 'as computed'}"
               if self.param_dtype or self.reduce_dtype else ""),
            f"solver: {self.solver_status}" + (f" (gap {self.gap:.2%})" if self.gap else "")
            + f", solve {self.solve_s:.3f} s, profile {self.profile_s:.3f} s, source {self.source}",
        ]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format_table()


def choices_text(choices: Iterable[str]) -> str:
    """How many units take each choice, on one line (:func:`counts_text`)."""
    return counts_text(Counter(choices))


def counts_text(counts: Mapping[str, int]) -> str:
    """Choice counts on one line, most common first (ties by name): ``replicate x2, zero3 x1``."""
    return ", ".join(f"{c} x{n}" for c, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def make_plan(profile: ModelProfile, cluster: ClusterSpec, *, uniform_choice: Choice | str | None = None,
              micro_batch_sizes: tuple[int, ...] | None = None,
              choices: tuple[Choice | str, ...] = BASE_CHOICES, time_limit_s: float | None = None,
              accumulation_steps: int = 1) -> Plan:
    """Solve for every candidate micro-batch size and keep the highest throughput.

    ``accumulation_steps``: micro-batches per optimizer step (``Trainer(accumulate_grad_batches)``);
    the predictions stay per micro-step (see :class:`~osdp_lightning.cost.cost.CostContext`).

    ``choices``: what the solver may pick (:func:`osdp_lightning.choices.choice_space`). With
    ``uniform_choice`` (a choice or an alias such as ``"ddp"``) every unit gets that choice, or
    replicate where it cannot take it (the baselines), and the plan only carries the predictions.
    Raises :class:`InfeasibleBudgetError` when nothing fits.
    """
    candidates = tuple(sorted(set(micro_batch_sizes or (profile.micro_batch_size,))))
    if uniform_choice is not None:
        uniform = resolve(str(uniform_choice))
        uniform_choice, choices = str(uniform), (uniform, uniform.base, REPLICATE)  # _uniform_plan's fallbacks
    # Coarsest unit set first, then smaller micro-batches: a later table must be strictly faster to win.
    descents = [()] if uniform_choice else unit_sets(profile)
    tables = [_priced(units, build_choice_table(units, cluster, batch, choices=choices,
                                                accumulation_steps=accumulation_steps), cluster)
              for units in (with_parts(profile, d, folded) for folded in root_folds(profile) for d in descents)
              for batch in candidates]
    if uniform_choice is not None:
        best = max((_uniform_plan(priced, cluster, uniform_choice) for priced in tables),
                   key=lambda plan: plan.predicted_throughput)  # the first of equals
    else:
        best = _best_solved_plan(tables, cluster, time_limit_s)
    if best is None:
        raise _infeasible(tables, cluster, time_limit_s)
    return dataclasses.replace(best, accumulation_steps=accumulation_steps)


class PricedTable(NamedTuple):
    """A unit set's choice table, and the table its plans' peaks are bounded on (:func:`bounded_table`)."""

    units: ModelProfile
    table: ChoiceTable
    bounded: ChoiceTable


def _priced(units: ModelProfile, table: ChoiceTable, cluster: ClusterSpec) -> PricedTable:
    return PricedTable(units, table, bounded_table(table, cluster))


def fixed_plan(profile: ModelProfile, cluster: ClusterSpec, assignment: tuple[str, ...] | list[str], *,
               source: str = "fixed") -> Plan:
    """The plan of ``assignment`` (a choice per unit of ``profile``, root last), priced, not solved:
    exactly ``profile``'s units (hand-made plans and benchmarks' candidates; :func:`make_plan` also
    searches unit sets)."""
    table = build_choice_table(profile, cluster, profile.micro_batch_size, choices=tuple(sorted(set(assignment))))
    return assemble_plan(table, profile, cluster, tuple(assignment), status="Fixed", solve_s=0.0, gap=None, source=source)


def _best_solved_plan(tables: list[PricedTable], cluster: ClusterSpec,
                      time_limit_s: float | None) -> Plan | None:
    """The highest-throughput plan of all ``tables`` (the first of equals), solving as few as it can.

    No plan of a table beats every unit at its fastest choice, and none fits when even the least
    bytes of every unit exceed the usable budget: tables are solved most promising first, and one
    whose bound cannot beat the plan in hand is skipped (the answer is the same as solving all).
    """
    bounds = [_throughput(p.table, cluster, step_lower_bound(p.table))
              if peak_lower_bound(p.bounded) <= cluster.usable_bytes else -1.0 for p in tables]
    best, best_key = None, (0.0, 0)
    for index in sorted(range(len(tables)), key=lambda i: (-bounds[i], i)):
        if bounds[index] < 0 or (best is not None and (bounds[index], -index) <= best_key):
            continue
        plan = _solved_plan(tables[index], cluster, time_limit_s)
        if plan is not None and (best is None or (plan.predicted_throughput, -index) > best_key):
            best, best_key = plan, (plan.predicted_throughput, -index)
    return best


def _throughput(table: ChoiceTable, cluster: ClusterSpec, step_s: float) -> float:
    """Samples per second over all ranks."""
    return table.micro_batch_size * cluster.world_size / step_s if step_s > 0 else 0.0


def _infeasible(tables: list[PricedTable], cluster: ClusterSpec,
                time_limit_s: float | None) -> InfeasibleBudgetError:
    """The error naming the least budget for which a plan would be found, under the same headroom rule.

    That is the least usable bytes any table fits (its least exact peak), turned into a budget by
    :meth:`~osdp_lightning.cost.cluster.ClusterSpec.smallest_budget_for`: at it a plan is found, one
    byte less and none is (exact unless ``time_limit_s`` stopped a solve: then a budget that fits).
    """
    need = None
    for table in sorted((p.bounded for p in tables), key=peak_lower_bound):
        if need is not None and peak_lower_bound(table) >= need:
            break  # no table from here on can need less
        least = smallest_feasible_budget(table, time_limit_s=time_limit_s)
        need = least if need is None else min(need, least)
    smallest = cluster.smallest_budget_for(need)
    budget, batch = cluster.memory_budget_bytes, min(p.table.micro_batch_size for p in tables)
    headroom = cluster.headroom_for(budget)
    kept_untracked = cluster.kept_untracked_bytes
    rule = _headroom_rule(cluster) + (f" and {format_bytes(kept_untracked)} untracked ({cluster.untracked_reason})"
                                      if kept_untracked else "")
    untracked = (f"{format_bytes(cluster.named_untracked_bytes)} untracked, half again what this launch "
                 "measured: the next measures its own" if cluster.untracked_bytes else "")
    tensors_only = ", or bound only the priced tensors (budget_covers='tensors')" if kept_untracked else ""
    if cluster.headroom_by_kind:
        kept = "its headroom by kind included" + (f", of which {untracked}" if untracked else "")
    else:
        kept = f"of which {format_bytes(cluster.headroom_for(smallest))} headroom" + (f" and {untracked}" if untracked else "")
    fix = (f"the smallest budget that fits is {format_bytes(smallest)} ({smallest} bytes, {kept}; "
           f"memory_budget={format_budget(smallest)!r})")
    if cluster.usable_bytes <= 0:
        return InfeasibleBudgetError(
            f"the memory budget of {format_bytes(budget)} per rank is not more than the headroom plans keep free, "
            f"{format_bytes(headroom)}{rule}: nothing fits. At micro-batch "
            f"{batch} on {cluster.world_size} ranks {fix}. Raise memory_budget, or lower the headroom "
            f"(cluster.headroom in the cluster config, or the strategy's headroom=){tensors_only}")
    return InfeasibleBudgetError(
        f"no plan fits the memory budget of {format_bytes(budget)} per rank, less {format_bytes(headroom)} "
        f"headroom{rule}: {format_bytes(cluster.usable_bytes)} usable (micro-batch {batch}, {cluster.world_size} "
        f"ranks); {fix}: raise memory_budget, lower the headroom (cluster.headroom / the strategy's headroom=) "
        f"or the micro-batch size, or add ranks{tensors_only}")


def _headroom_rule(cluster: ClusterSpec) -> str:
    """How the headroom is set, when not plain bytes (``" (the larger of 2.00 GiB and 5% of the budget)"``).

    NOTE: no "(<n> bytes" here: scripts read the smallest budget as the first one in the message.
    """
    if cluster.headroom_by_kind:
        return " (and each choice's bytes grown by the share its kind keeps: headroom by kind)"
    if not cluster.headroom_fraction:
        return ""
    share = f"{100 * cluster.headroom_fraction:.4g}% of the budget"
    if not cluster.headroom_bytes:
        return f" ({share})"
    return f" (the larger of {format_bytes(cluster.headroom_bytes)} and {share})"


def unit_sets(profile: ModelProfile) -> list[tuple[str, ...]]:
    """The unit sets :func:`make_plan` solves, as the blocks to descend into (coarsest first):
    none, the first ``k`` in execution order for ``k`` = 1, 2, 4, ..., and all of them.

    Blocks of one stack cost alike, so which ``k`` are descended matters little; how many does
    (fewer units: less per-unit work and latency; finer units: smaller transients, per-part
    choices, splits). See docs/design.md, "Unit granularity".
    """
    blocks = [u.name for u in profile.units if u.parts]
    counts = sorted({0, len(blocks), *(2**i for i in range(len(blocks).bit_length()) if 2**i < len(blocks))})
    return [tuple(blocks[:k]) for k in counts]


def root_folds(profile: ModelProfile) -> list[tuple[str, ...]]:
    """The units outside the blocks (embeddings, heads) that :func:`make_plan` also tries leaving
    to the root, as hand-written FSDP2 does (``fully_shard`` per block, then on the model): first
    all of them, then none. Each unit of its own costs FSDP2's per-group work and a collective
    launch per call (about 4 ms per step each on a 2-core CPU: 5% of the GPT bench preset's zero3
    step); left to the root it takes the root's choice, and stays gathered all step as the root
    does. A model without blocks, or with units the user named, keeps its units.
    """
    if not any(u.parts or u.part_of for u in profile.units):
        return [()]
    loose = tuple(u.name for u in profile.units[:-1] if not u.parts and not u.part_of)
    return [loose, ()] if loose else [()]


def _uniform_plan(priced: PricedTable, cluster: ClusterSpec, choice: str) -> Plan:
    # NOTE: one rank, or a unit the choice does not fit: the choice without its modifiers (the root
    # is never checkpointed), else replicate (a split on a non-Linear).
    fallbacks = (choice, str(parse(choice).base), str(REPLICATE))
    assignment = tuple(next(c for c in fallbacks if c in {o.choice for o in unit.choices}) for unit in priced.table.units)
    return assemble_plan(priced.table, priced.units, cluster, assignment, status="Fixed", solve_s=0.0, gap=None,
                         source=f"uniform:{choice}", bounded=priced.bounded)


def _solved_plan(priced: PricedTable, cluster: ClusterSpec, time_limit_s: float | None) -> Plan | None:
    solution = solve_choice_table(priced.bounded, cluster.usable_bytes, time_limit_s=time_limit_s)
    if not solution.feasible:
        return None
    return assemble_plan(priced.table, priced.units, cluster, solution.choices, status=solution.status,
                         solve_s=solution.solve_s, gap=solution.gap, source="solved", bounded=priced.bounded)


def assemble_plan(table: ChoiceTable, profile: ModelProfile, cluster: ClusterSpec, assignment: tuple[str, ...],
                  *, status: str, solve_s: float, gap: float | None, source: str,
                  bounded: ChoiceTable | None = None) -> Plan:
    """The Plan of ``assignment`` on ``table``; ``bounded``: :func:`bounded_table` of it, when the
    caller has it already."""
    bounded = bounded_table(table, cluster) if bounded is None else bounded
    units = []
    for unit_costs, unit_profile, choice in zip(table.units, profile.units, assignment, strict=True):
        cost = unit_costs.cost_of(choice)
        # NOTE: the communication the step pays is what the solver charges, less the other terms.
        paid_comm_s = choice_step_s(unit_costs, cost) - cost.compute_s - cost.optimizer_s - cost.overhead_s
        units.append(UnitPlan(
            name=unit_profile.name, module_names=unit_profile.module_names,
            param_count=unit_profile.param_count + unit_profile.frozen_param_count, choice=choice,
            predicted_bytes=cost.state_bytes + cost.held_bytes + cost.transient_bytes,
            predicted_comm_s=cost.comm_s, state_bytes=cost.state_bytes, held_bytes=cost.held_bytes,
            transient_bytes=cost.transient_bytes, activation_bytes=cost.activation_bytes,
            compute_s=cost.compute_s, comm_s=paid_comm_s, optimizer_s=cost.optimizer_s,
            overhead_s=cost.overhead_s))
    step_s = step_seconds(table, assignment)
    peak = peak_bytes(table, assignment)
    kind_headroom = peak_bytes(bounded, assignment) - peak if cluster.headroom_by_kind else 0
    return Plan(
        units=tuple(units), world_size=cluster.world_size, micro_batch_size=table.micro_batch_size,
        memory_budget_bytes=cluster.memory_budget_bytes, predicted_peak_bytes=peak,
        predicted_step_s=step_s,
        predicted_throughput=_throughput(table, cluster, step_s),
        activation_bytes=table.activation_bytes, solver_status=status, solve_s=solve_s,
        profile_s=profile.profile_s, gap=gap, source=source,
        collective_latency_s=cluster.collective_latency_s, bandwidth_bytes_per_s=cluster.bandwidth_bytes_per_s,
        overlap_efficiency=cluster.overlap_efficiency, fixed_bytes=table.fixed_bytes,
        baselines=uniform_baselines(table, cluster, bounded),
        predicted_compute_s=sum(u.compute_s for u in units), predicted_optimizer_s=sum(u.optimizer_s for u in units),
        predicted_overhead_s=sum(u.overhead_s for u in units), predicted_exposed_comm_s=sum(u.comm_s for u in units),
        predicted_loop_s=table.fixed_step_s,
        step_terms_source=cluster.step_terms.source if cluster.step_terms is not None else "",
        headroom_bytes=cluster.headroom_for(cluster.memory_budget_bytes) + kind_headroom,
        headroom_reason=cluster.headroom_reason + (f" ({kind_shares_text(assignment)})" if cluster.headroom_by_kind else ""),
        kind_headroom_bytes=kind_headroom,
        untracked_bytes=cluster.kept_untracked_bytes,
        untracked_reason=cluster.untracked_reason if cluster.kept_untracked_bytes else "",
        rebuild_bytes=sum(unit.cost_of(choice).rebuild_bytes for unit, choice in zip(table.units, assignment, strict=True)),
        param_dtype=profile.param_dtype, reduce_dtype=profile.reduce_dtype)


def kind_shares_text(assignment: Iterable[str]) -> str:
    """The share of its bytes each choice of ``assignment`` keeps under headroom by kind, largest
    first: ``zero3+ckpt 2.5%, replicate 1.2%``."""
    shares = {choice: kept_share(choice) for choice in assignment}
    return ", ".join(f"{choice} {100 * share:.1f}%" for choice, share in sorted(shares.items(), key=lambda kv: (-kv[1], kv[0])))


def uniform_baselines(table: ChoiceTable, cluster: ClusterSpec,
                      bounded: ChoiceTable | None = None) -> tuple[BaselinePrediction, ...]:
    """replicate (ddp) / zero2 / zero3 for every unit, priced on ``table``; those a unit cannot take are
    left out. Each fits when its peak on ``bounded`` (default: :func:`bounded_table`) is usable."""
    usable, bounded = cluster.usable_bytes, bounded_table(table, cluster) if bounded is None else bounded
    baselines = []
    for choice in map(str, BASE_CHOICES):
        if not all(any(c.choice == choice for c in unit.choices) for unit in table.units):
            continue  # e.g. one rank: only replicate
        assignment = tuple(choice for _ in table.units)
        baselines.append(BaselinePrediction(choice, peak_bytes(table, assignment), step_seconds(table, assignment),
                                            peak_bytes(bounded, assignment) <= usable))
    return tuple(baselines)


def baseline_peak_bytes(profile: ModelProfile, cluster: ClusterSpec, choice: Choice | str) -> int:
    """Predicted peak per rank of the uniform ``choice`` plan at the profiled micro-batch size
    (what a budget such as ``"95%ddp"`` is a share of): the plan the baselines are (the faster
    of the unit sets with and without the root's folds)."""
    return make_plan(profile, cluster, uniform_choice=choice, micro_batch_sizes=(profile.micro_batch_size,)
                     ).predicted_peak_bytes


def _has_module(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True
