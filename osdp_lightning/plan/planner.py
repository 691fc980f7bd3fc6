"""One planner: profile -> cost -> solve -> :class:`~osdp_lightning.plan.plan.Plan`.

The Trainer strategy, the Fabric strategy, ``osdp-plan`` and the dry run all plan through
:class:`Planner`; nothing else builds a choice space or calls the solver. They differ only in
where the profile and the cluster come from:

- the profile: measured on this machine (:func:`osdp_lightning.plan.pipeline.profile_model`, whole or
  from shapes), or estimated on fake tensors for a cluster description
  (:func:`osdp_lightning.profiling.estimate.estimate_profile`);
- the cluster: a function from a budget in bytes to a :class:`ClusterSpec` (the live process
  group's links and step terms, or a cluster config's), or one fixed spec.

A budget given as a share of a baseline's peak (``"60%ddp"``) is resolved here, once the profile
is known: the uniform baseline is priced on the cluster, and the cluster is asked again at the
share of its peak.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from osdp_lightning.choices import BASELINES, ChoiceOptions, choice_space, resolve
from osdp_lightning.cost.budget import MemoryBudget
from osdp_lightning.cost.cluster import ClusterSpec
from osdp_lightning.plan.plan import InfeasibleBudgetError, Plan, baseline_peak_bytes, make_plan
from osdp_lightning.profiling.records import ModelProfile

AUTO_BATCH_FACTORS = (0.25, 0.5, 1, 2, 4, 8)
"""``micro_batch_size="auto"`` tries the profiled size times each of these."""

ClusterSource = Callable[[int | None], ClusterSpec]
"""The cluster at a budget in bytes per rank (``None``: the source's own budget)."""


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """What the planner searches."""

    choice_options: ChoiceOptions = ChoiceOptions()
    """Split factors, checkpointing mode, group sizes: the choices each unit may take."""
    uniform_choice: str | None = None
    """Every unit this choice (a baseline), priced instead of solved."""
    micro_batch_size: int | str | tuple[int, ...] | None = None
    """``None``: the profiled size; an int; several (the fastest); ``"auto"``: the fastest of
    :data:`AUTO_BATCH_FACTORS` times the profiled size."""
    time_limit_s: float | None = 60.0
    """Stop the solver after this long with the best plan found (the plan gives the gap)."""
    accumulation_steps: int = 1
    """Micro-batches per optimizer step (``accumulate_grad_batches``)."""


def batch_candidates(profile: ModelProfile, micro_batch_size: int | str | tuple[int, ...] | None
                     ) -> tuple[int, ...] | None:
    """Micro-batch sizes to plan for: ``None`` (the profiled one), ``"auto"`` (several), or those given."""
    if micro_batch_size is None:
        return None
    if micro_batch_size == "auto":
        return tuple(sorted({max(1, int(profile.micro_batch_size * f)) for f in AUTO_BATCH_FACTORS}))
    if isinstance(micro_batch_size, tuple):
        return tuple(sorted(set(micro_batch_size)))
    return (int(micro_batch_size),)


class Planner:
    """Plans one model on one cluster under one budget; see the module docstring.

    ``profile``: the profile, or a function that measures or estimates it (called once, when first
    needed). ``cluster``: a :data:`ClusterSource`, or one spec (its budget is the budget; a share
    budget cannot be resolved against it). ``budget``: as the user gave it (``None``: the cluster's).
    """

    def __init__(self, profile: ModelProfile | Callable[[], ModelProfile], cluster: ClusterSource | ClusterSpec,
                 budget: MemoryBudget | None = None, options: PlanOptions = PlanOptions()) -> None:
        self._profile_source = profile
        self._cluster_source: ClusterSource = (cluster if callable(cluster)
                                               else lambda budget_bytes: _with_budget(cluster, budget_bytes))
        self.budget, self.options = budget, options

    @functools.cached_property
    def profile(self) -> ModelProfile:
        source = self._profile_source
        return source if isinstance(source, ModelProfile) else source()

    @functools.cached_property
    def baseline_peak_bytes(self) -> int | None:
        """The predicted peak of the baseline a share budget (``"60%ddp"``) is taken of; ``None``
        for any other budget."""
        if self.budget is None or not self.budget.needs_profile:
            return None
        assert self.budget.baseline is not None
        return baseline_peak_bytes(self.profile, self._cluster_source(None), self.budget.baseline)

    @functools.cached_property
    def cluster(self) -> ClusterSpec:
        """The cluster at the resolved budget."""
        if self.baseline_peak_bytes is None:
            return self._cluster_source(None)
        assert self.budget is not None
        return self._cluster_source(self.budget.of_peak(self.baseline_peak_bytes))

    def plan(self) -> Plan:
        """The fastest plan that fits (or the uniform one asked for); raises
        :class:`~osdp_lightning.plan.plan.InfeasibleBudgetError` when nothing fits."""
        options = self.options
        return make_plan(self.profile, self.cluster, uniform_choice=options.uniform_choice,
                         micro_batch_sizes=batch_candidates(self.profile, options.micro_batch_size),
                         choices=choice_space(self.cluster, options.choice_options),
                         time_limit_s=options.time_limit_s, accumulation_steps=options.accumulation_steps)

    def baseline(self, name: str) -> Plan:
        """The uniform ``name`` layout (``ddp``, ``zero2``, ``zero3``) at the fastest of the micro-batch
        sizes that fits the budget (the smallest when none fits): what a user would otherwise run."""
        choice = str(resolve(name))
        sizes = batch_candidates(self.profile, self.options.micro_batch_size) or (self.profile.micro_batch_size,)
        plans = [make_plan(self.profile, self.cluster, uniform_choice=choice, micro_batch_sizes=(b,),
                           accumulation_steps=self.options.accumulation_steps) for b in sorted(sizes)]
        fitting = [p for p in plans if p.bounded_peak_bytes <= self.cluster.usable_bytes]
        return max(fitting, key=lambda p: p.predicted_throughput) if fitting else plans[0]

    def plan_with_baselines(self) -> dict[str, Plan | str]:
        """The osdp plan (or the text of why nothing fits) and each baseline, by name."""
        plans: dict[str, Plan | str] = {}
        try:
            plans["osdp"] = self.plan()
        except InfeasibleBudgetError as err:
            plans["osdp"] = str(err)
        plans.update({name: self.baseline(name) for name in BASELINES})
        return plans


def check_choice_options(options: ChoiceOptions) -> None:
    """Raise now, not at setup, when ``options`` cannot make a choice space."""
    choice_space(ClusterSpec(2, 1, 0.0, 1.0), options)


def _with_budget(cluster: ClusterSpec, budget_bytes: int | None) -> ClusterSpec:
    return cluster if budget_bytes is None else dataclasses.replace(cluster, memory_budget_bytes=budget_bytes)
