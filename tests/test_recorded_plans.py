"""Plans solved from recorded profiles stay what they were: the planner (unit sets, micro-batches,
the ILP, the knapsack baseline, k-best and the smallest budget) checked against answers saved in
tests/fixtures/recorded_plans.json, so that a refactor that changes a plan shows here.

The inputs, tests/fixtures/recorded_profiles.json, are profiles of ``osdp-bench`` runs (GPT shapes
on 2 and 4 gloo ranks) with the link figures they were planned with, and two cluster configs.
After a change that is meant to change plans, write the answers again and review the diff:

    .venv/bin/python tests/test_recorded_plans.py --write
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.reprice_memory import profile_from_dict  # noqa: E402
from osdp_lightning.choices import BASE_CHOICES, ChoiceOptions, choice_space  # noqa: E402
from osdp_lightning.cost.cluster import ClusterSpec, cluster_spec_from_config  # noqa: E402
from osdp_lightning.plan.choice_table import build_choice_table  # noqa: E402
from osdp_lightning.plan.plan import InfeasibleBudgetError, Plan, baseline_peak_bytes, make_plan  # noqa: E402
from osdp_lightning.profiling.records import ModelProfile  # noqa: E402
from osdp_lightning.solve import (  # noqa: E402
    Solution,
    knapsack_dp,
    moment_bytes,
    next_best_solutions,
    peak_lower_bound,
    search,
    smallest_feasible_budget,
    solve_choice_table,
    step_lower_bound,
)

FIXTURES = Path(__file__).parent / "fixtures"
INPUTS = FIXTURES / "recorded_profiles.json"
ANSWERS = FIXTURES / "recorded_plans.json"
RELATIVE = 1e-12
"""Seconds may differ in the last bits (a sum in another order); bytes and choices may not."""
FRACTIONS = (1.05, 0.8, 0.62, 0.3)
"""Budgets as shares of the uniform ddp plan's peak: roomy, tight, near the smallest, and infeasible."""


def _inputs() -> dict[str, Any]:
    return json.loads(INPUTS.read_text())


def _clusters(name: str, record: dict[str, Any], configs: dict[str, Any]) -> dict[str, ClusterSpec]:
    """The clusters a profile is planned for: its own recorded links, and for the default shape the
    configs (2 ranks on CPU with step terms; 16 H100s on 2 nodes, with 4% headroom) at a placeholder budget."""
    links = record["links"]
    clusters = {"recorded": ClusterSpec(memory_budget_bytes=2**40, **links)}
    if name == "gpt_4x384_w2":  # NOTE: the configs for one profile: each proven solve costs seconds
        clusters["cpu_2"] = cluster_spec_from_config(configs["cpu_2"])
        clusters["h100_x8x2"] = dataclasses.replace(cluster_spec_from_config(configs["h100_80g_x8x2"]),
                                                    headroom_bytes=0, headroom_fraction=0.04)
    return clusters


def _plan_answer(plan: Plan) -> dict[str, Any]:
    return {"units": [[u.name, u.choice] for u in plan.units], "micro_batch_size": plan.micro_batch_size,
            "predicted_peak_bytes": plan.predicted_peak_bytes, "predicted_step_s": plan.predicted_step_s,
            "solver_status": plan.solver_status,
            "baselines": [[b.choice, b.peak_bytes, b.step_s, b.fits] for b in plan.baselines]}


def _solution_answer(solution: Solution) -> dict[str, Any]:
    return {"choices": list(solution.choices), "status": solution.status,
            "step_s": solution.step_s if math.isfinite(solution.step_s) else None,
            "peak_bytes": solution.peak_bytes}


def _planned(profile: ModelProfile, cluster: ClusterSpec, choices: tuple, budget: int) -> dict[str, Any]:
    """The plan at ``budget`` (micro-batch as profiled or twice that), or the smallest budget named."""
    cluster = dataclasses.replace(cluster, memory_budget_bytes=budget)
    batches = (profile.micro_batch_size, 2 * profile.micro_batch_size)
    try:
        return _plan_answer(make_plan(profile, cluster, micro_batch_sizes=batches, choices=choices))
    except InfeasibleBudgetError as err:
        return {"infeasible": str(err)}


def _plan_answers(name: str, record: dict[str, Any], configs: dict[str, Any]) -> dict[str, Any]:
    profile = profile_from_dict(record["profile"])
    answers = {}
    for cluster_name, cluster in _clusters(name, record, configs).items():
        ddp_bytes = baseline_peak_bytes(profile, cluster, "ddp")
        spaces = {"base": BASE_CHOICES,
                  "space": choice_space(cluster, ChoiceOptions(split_factors=(2,), activation_checkpointing="auto"))}
        for space_name, choices in spaces.items():
            for fraction in FRACTIONS:
                key = f"{cluster_name}/{space_name}/{fraction}"
                answers[key] = _planned(profile, cluster, choices, int(fraction * ddp_bytes))
    return answers


def _solver_answers(record: dict[str, Any]) -> dict[str, Any]:
    """The solver's functions on the profile's own units with every choice of its recorded cluster."""
    profile = profile_from_dict(record["profile"])
    cluster = ClusterSpec(memory_budget_bytes=2**40, **record["links"])
    table = build_choice_table(profile, cluster, choices=choice_space(
        cluster, ChoiceOptions(split_factors=(2, 4), activation_checkpointing="auto")))
    least = smallest_feasible_budget(table)
    fastest = solve_choice_table(table, 2**40)
    answers: dict[str, Any] = {"smallest_budget": least, "peak_lower_bound": peak_lower_bound(table),
                               "step_lower_bound": step_lower_bound(table), "fastest": _solution_answer(fastest)}
    for share in (1.0, 0.8, 0.6):
        budget = least + int(share * (fastest.peak_bytes - least))
        best = solve_choice_table(table, budget)
        knapsack = knapsack_dp(table, budget, resolution_bytes=2**16)
        answers[f"solve/{share}"] = _solution_answer(best)
        answers[f"moments/{share}"] = [list(m) for m in moment_bytes(table, best.choices)]
        answers[f"knapsack/{share}"] = _solution_answer(knapsack)
        answers[f"next_best/{share}"] = [_solution_answer(s) for s in next_best_solutions(table, budget, 3)]
    return answers


def _all_answers() -> dict[str, Any]:
    inputs = _inputs()
    return {name: {"plans": _plan_answers(name, record, inputs["clusters"]), "solver": _solver_answers(record)}
            for name, record in inputs["profiles"].items()}


def _same(now: Any, saved: Any, where: str) -> list[str]:
    """Where ``now`` differs from ``saved``: floats to :data:`RELATIVE`, everything else exactly."""
    if isinstance(saved, dict) and isinstance(now, dict):
        if set(now) != set(saved):
            return [f"{where}: keys {sorted(set(now) ^ set(saved))} differ"]
        return [d for k in saved for d in _same(now[k], saved[k], f"{where}/{k}")]
    if isinstance(saved, list) and isinstance(now, (list, tuple)):
        if len(now) != len(saved):
            return [f"{where}: {len(now)} items, saved {len(saved)}"]
        return [d for i, (n, s) in enumerate(zip(now, saved, strict=True)) for d in _same(n, s, f"{where}[{i}]")]
    if isinstance(saved, float) and isinstance(now, float):
        return [] if math.isclose(now, saved, rel_tol=RELATIVE, abs_tol=0.0) else [f"{where}: {now!r}, saved {saved!r}"]
    return [] if now == saved and type(now) is type(saved) else [f"{where}: {now!r}, saved {saved!r}"]


@pytest.mark.parametrize("name", sorted(_inputs()["profiles"]))
def test_plans_of_recorded_profiles_are_unchanged(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE: every solve proves its optimum: one that settles at a gap (after a time a loaded machine
    # reaches sooner) may say Feasible, or stop at another plan as good within the gap.
    monkeypatch.setattr(search, "SETTLE_GAP", 0.0)
    inputs = _inputs()
    record = inputs["profiles"][name]
    now = json.loads(json.dumps(
        {"plans": _plan_answers(name, record, inputs["clusters"]), "solver": _solver_answers(record)}))
    saved = json.loads(ANSWERS.read_text())[name]
    differences = _same(now, {**saved, "plans": {k: v for k, v in saved["plans"].items() if k in now["plans"]}}, name)
    assert len(now["plans"]) >= 8, sorted(now["plans"])
    assert not differences, "\n".join(differences[:20])


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    ANSWERS.write_text(json.dumps(_all_answers(), indent=1) + "\n")
    print(f"wrote {ANSWERS}")
