"""The candidate plans of the regret benchmark (:mod:`benchmarks.regret`), and their predictions.

All candidates of one model shape are priced with one profile and one cluster: those of one osdp
run of the strategy (its planning launch; :mod:`benchmarks.compare_worker` pickles them), with the
choice table the strategy builds from them. For a budget, the candidates are osdp's own plan (what
the strategy solves from that profile), the uniform baselines, the next-best plans of the same ILP
(each the best plan different from all earlier ones) and random assignments that fit. Every plan
fits as the strategy's own plans must: the planning run's headroom rule at the candidate's budget,
its peak priced on the table the strategy bounds (``bounded_table``: under headroom by kind, each
choice's bytes grown by its kind's share) within the usable bytes, so all compete for the same bytes.
"""

from __future__ import annotations

import dataclasses
import pickle
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from osdp_lightning.choices import ChoiceOptions, choice_space
from osdp_lightning.cost.cluster import ClusterSpec
from osdp_lightning.cost.cost import ChoiceTable
from osdp_lightning.plan.choice_table import bounded_table, build_choice_table
from osdp_lightning.plan.plan import InfeasibleBudgetError, Plan, assemble_plan, make_plan
from osdp_lightning.profiling.records import ModelProfile, with_units
from osdp_lightning.solve import next_best_solutions, peak_bytes

UNIFORM = ("replicate", "zero2", "zero3")
SPLIT_FACTORS = (2, 4, 8)
"""The strategy's default, which the benchmark worker uses."""
_PASSES = 2


@dataclass(frozen=True)
class Candidate:
    """One plan to train, with the predictions of the shape's cost model."""

    name: str
    """How it was found, e.g. ``osdp @ 70%``, ``next-best 2 @ 70%``, ``random 3 @ 85%``, ``zero3``."""
    kind: str
    """``osdp``, ``uniform``, ``next-best``, ``random`` (or ``slow``, the test's)."""
    plan: Plan

    @property
    def key(self) -> tuple[tuple[str, str], ...]:
        """What makes two candidates the same plan: each unit's choice."""
        return tuple((u.name, u.choice) for u in self.plan.units)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "choices": [u.choice for u in self.plan.units],
                "units": [u.name for u in self.plan.units], "predicted_step_s": self.plan.predicted_step_s,
                "predicted_peak_bytes": self.plan.predicted_peak_bytes,
                "bounded_peak_bytes": self.plan.bounded_peak_bytes}


@dataclass(frozen=True)
class Pricing:
    """What prices the candidates of one shape: the planning run's profile and cluster, and its table.

    ``units``: the unit set the table prices, that of the planning run's plan (the strategy's units at a
    budget everything fits: the blocks, with the embeddings and head left to the root), so that the
    uniform, next-best and random candidates use the units the strategy's own baselines use; osdp's
    candidates are solved from ``profile``, over every unit set, as the strategy solves them.
    ``bounded``: ``table`` as the strategy bounds a plan's peak on it under ``cluster``'s headroom rule.
    """

    profile: ModelProfile
    cluster: ClusterSpec
    table: ChoiceTable
    units: ModelProfile
    bounded: ChoiceTable

    @classmethod
    def load(cls, path: Path, unit_names: list[str] | None = None) -> Pricing:
        saved = pickle.loads(path.read_bytes())
        return cls.of(saved["profile"], saved["cluster"], unit_names)

    @classmethod
    def of(cls, profile: ModelProfile, cluster: ClusterSpec, unit_names: list[str] | None = None) -> Pricing:
        units = with_units(profile, unit_names) if unit_names is not None else profile
        table = build_choice_table(units, cluster, profile.micro_batch_size, choices=strategy_choices(cluster))
        return cls(profile, cluster, table, units, bounded_table(table, cluster))

    def cluster_at(self, budget_bytes: int) -> ClusterSpec:
        """The cluster at another budget, with the planning run's headroom rule (by kind, a share, bytes)."""
        return dataclasses.replace(self.cluster, memory_budget_bytes=budget_bytes)

    def usable_bytes(self, budget_bytes: int) -> int:
        """What a plan's peak on :attr:`bounded` may reach at ``budget_bytes``."""
        return self.cluster_at(budget_bytes).usable_bytes

    def candidate(self, name: str, kind: str, choices: tuple[str, ...], budget_bytes: int) -> Candidate:
        # NOTE: plan.assemble_plan is how make_plan turns an assignment into a Plan; reused, not copied.
        plan = assemble_plan(self.table, self.units, self.cluster_at(budget_bytes), tuple(choices), status="Fixed",
                             solve_s=0.0, gap=None, source=f"regret:{name}", bounded=self.bounded)
        return Candidate(name, kind, plan)


def strategy_choices(cluster: ClusterSpec) -> tuple[Any, ...]:
    """The choices the strategy offers the solver (``OSDPStrategy._profile_and_solve``)."""
    return choice_space(cluster, ChoiceOptions(split_factors=SPLIT_FACTORS))


def osdp_candidate(pricing: Pricing, budget_bytes: int, label: str) -> Candidate | None:
    """The plan the strategy makes from this profile at ``budget_bytes`` (``None``: nothing fits)."""
    cluster = pricing.cluster_at(budget_bytes)
    try:
        plan = make_plan(pricing.profile, cluster, choices=strategy_choices(cluster))
    except InfeasibleBudgetError:
        return None
    return Candidate(f"osdp @ {label}", "osdp", plan)


def uniform_candidates(pricing: Pricing, budget_bytes: int) -> list[Candidate]:
    """The uniform baselines; which of them fit a budget is decided by their measured peak."""
    units = pricing.table.units
    return [pricing.candidate(name, "uniform", tuple(name for _ in units), budget_bytes) for name in UNIFORM
            if all(any(c.choice == name for c in unit.choices) for unit in units)]


def next_best_candidates(pricing: Pricing, budget_bytes: int, osdp: Candidate, count: int,
                         label: str) -> list[Candidate]:
    """The ``count`` best plans of the ILP that are not osdp's (the solver's k-best enumeration)."""
    found = [s.choices for s in next_best_solutions(pricing.bounded, pricing.usable_bytes(budget_bytes), count + 1)]
    mine = tuple(u.choice for u in osdp.plan.units)
    others = [c for c in found if c != mine][:count]
    return [pricing.candidate(f"next-best {i + 1} @ {label}", "next-best", c, budget_bytes)
            for i, c in enumerate(others)]


def _families(unit_choices: list[str]) -> dict[str, list[str]]:
    """Choices grouped by family (``split(k=4, sharded=3)`` -> ``split``), so each family is drawn alike."""
    families: dict[str, list[str]] = {}
    for choice in unit_choices:
        families.setdefault(choice.split("(")[0], []).append(choice)
    return families


def random_assignments(table: ChoiceTable, usable: int, count: int, seed: int) -> list[tuple[str, ...]]:
    """``count`` random assignments whose peak on ``table`` (the bounded table) fits ``usable``,
    their peaks spread from the lightest plan up to it.

    Each draws a target peak (stratified over the range, so they spread), starts from all-zero3 (or
    every unit's lightest choice when that does not fit) and, unit by unit in a random order, twice
    over, proposes a random family and a random choice of it, kept when the plan stays under the
    target. Family first, so that the many split variants do not crowd out the rest.
    """
    rng = random.Random(seed)
    names = [[c.choice for c in unit.choices] for unit in table.units]
    start = ["zero3" if "zero3" in n else n[0] for n in names]
    if peak_bytes(table, start) > usable:
        start = [min(unit.choices, key=lambda c: (c.persistent_bytes, c.transient_bytes)).choice
                 for unit in table.units]
    low = peak_bytes(table, start)
    if low > usable:
        return []
    families = [_families(n) for n in names]
    found: list[tuple[str, ...]] = []
    for i in range(count):
        target = low + (i + rng.random()) / count * (usable - low)
        plan = list(start)
        for _ in range(_PASSES):
            for u in rng.sample(range(len(plan)), len(plan)):
                proposal = rng.choice(families[u][rng.choice(sorted(families[u]))])
                trial = plan[:u] + [proposal] + plan[u + 1:]
                if peak_bytes(table, trial) <= target:
                    plan = trial
        if tuple(plan) not in found:
            found.append(tuple(plan))
    return found


def random_candidates(pricing: Pricing, budget_bytes: int, count: int, seed: int, label: str) -> list[Candidate]:
    return [pricing.candidate(f"random {i + 1} @ {label}", "random", choices, budget_bytes)
            for i, choices in enumerate(random_assignments(pricing.bounded, pricing.usable_bytes(budget_bytes),
                                                           count, seed))]
