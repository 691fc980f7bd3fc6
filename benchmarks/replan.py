"""Re-solve osdp's plans with the step-time terms the cost model lacks, and train them beside the old ones.

    python -m benchmarks.replan docs/benchmarks/compare_runs.json --out-dir bench_out/replan

Input: a finished :mod:`benchmarks.compare` run. The per-choice terms (FSDP2's own seconds and the
optimizer's, per parameter; :mod:`benchmarks.compare_fit`) are fitted on its uniform runs. For each
osdp budget, one run's own profile and calibration are priced again with those terms added to
every choice's compute seconds, and the same ILP is solved (same bytes, budget and headroom).
Then, in rounds (order reversed every other round): ddp, zero3, and for each budget the plan the
strategy chose and the re-solved plan, both applied from a saved plan (``plan=``), so that the
plans are the only difference. This is the experiment behind "what it would take" in
docs/benchmarks.md: a prototype of measuring these terms at calibration, without changing the core.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from osdp_lightning.recipes.text import python_docs_corpus

from benchmarks import compare, compare_report
from benchmarks.compare_fit import choice_mix, describe_terms, fit_terms
from osdp_lightning.budget import PLAN_HEADROOM_FRACTION
from osdp_lightning.choices import ChoiceOptions, choice_space
from osdp_lightning.cluster import ClusterSpec
from osdp_lightning.cost import ChoiceTable, build_choice_table
from osdp_lightning.profile import ModelProfile, UnitProfile
from osdp_lightning.solve import solve_choice_table, step_seconds

SPLIT_FACTORS = (2, 4, 8)  # the strategy's default


def profile_from_dict(data: dict[str, Any]) -> ModelProfile:
    """The inverse of ``dataclasses.asdict`` for a profile read back from JSON (lists to tuples)."""
    return ModelProfile(**{**data, "units": tuple(_unit_from_dict(u) for u in data["units"])})


def _unit_from_dict(u: dict[str, Any]) -> UnitProfile:
    return UnitProfile(**{**u, "module_names": tuple(u["module_names"]),
                          "linear_shape": tuple(u["linear_shape"]) if u.get("linear_shape") else None,
                          "split_overhead_s": tuple(tuple(x) for x in u.get("split_overhead_s", ())),
                          "parts": tuple(_unit_from_dict(p) for p in u.get("parts", ()))})


def cluster_of(plan: dict[str, Any], headroom_bytes: int = 0) -> ClusterSpec:
    """The cluster a recorded plan (a plan dict of a runs file) was made for: its ranks, budget and links."""
    return ClusterSpec(world_size=plan["world_size"], memory_budget_bytes=plan["memory_budget_bytes"],
                       collective_latency_s=plan["collective_latency_s"],
                       bandwidth_bytes_per_s=plan["bandwidth_bytes_per_s"],
                       overlap_efficiency=plan["overlap_efficiency"], headroom_bytes=headroom_bytes)


def priced_table(table: ChoiceTable, profile: ModelProfile, terms: dict[str, Any]) -> ChoiceTable:
    """``table`` with each choice's FSDP2 and optimizer seconds added to its compute seconds."""
    units = []
    for unit_costs, unit in zip(table.units, profile.units, strict=True):
        params = unit.param_count + unit.frozen_param_count
        costs = tuple(dataclasses.replace(cost, compute_s=cost.compute_s + params * sum(
            share * (terms["own_s_per_param"][c] + terms["optimizer_s_per_param"][c])
            for c, share in choice_mix(cost.choice).items())) for cost in unit_costs.choices)
        units.append(dataclasses.replace(unit_costs, choices=costs))
    return dataclasses.replace(table, units=tuple(units))


def replan(run: dict[str, Any], terms: dict[str, Any]) -> dict[str, Any]:
    """The run's plan, re-solved with the terms; returned as a plan dict ``Plan.load`` accepts."""
    plan, profile = run["plan"], profile_from_dict(run["profile"])
    budget = plan["memory_budget_bytes"]
    cluster = cluster_of(plan, headroom_bytes=int(budget * PLAN_HEADROOM_FRACTION))
    table = build_choice_table(profile, cluster, plan["micro_batch_size"],
                               choices=choice_space(cluster, ChoiceOptions(split_factors=SPLIT_FACTORS)))
    priced = priced_table(table, profile, terms)
    solution = solve_choice_table(priced, budget - cluster.headroom_bytes)
    if not solution.feasible:
        raise RuntimeError(f"no re-solved plan fits {budget} bytes ({solution.status})")
    units = []
    for unit, choice, costs in zip(plan["units"], solution.choices, table.units, strict=True):
        cost = costs.cost_of(choice)
        units.append({**unit, "choice": choice, "predicted_comm_s": cost.comm_s,
                      "predicted_bytes": cost.state_bytes + cost.held_bytes + cost.transient_bytes})
    step_s = step_seconds(priced, solution.choices)
    return {**plan, "units": units, "predicted_peak_bytes": solution.peak_bytes, "predicted_step_s": step_s,
            "predicted_throughput": plan["micro_batch_size"] * plan["world_size"] / step_s,
            "solver_status": solution.status, "solve_s": solution.solve_s, "source": "replanned"}


def plans_to_run(saved: dict[str, Any], terms: dict[str, Any], work: Path,
                 fractions: tuple[float, ...] | None = None) -> list[tuple[str, float, Path]]:
    """(method, fraction, plan file) for the strategy's plan and the re-solved one, per osdp budget."""
    jobs = []
    for run in saved["runs"]:
        fraction = run["fraction"]
        if run["method"] != "osdp" or run["status"] != "ok" or run["round"] != 0 or not run.get("profile"):
            continue
        if fractions is not None and not any(abs(fraction - f) < 1e-9 for f in fractions):
            continue
        for method, plan in (("osdp", run["plan"]), ("osdp+terms", replan(run, terms))):
            path = work / f"{method}_{round(100 * fraction)}.json"
            path.write_text(json.dumps({"format_version": 1, **plan}, indent=1))
            jobs.append((method, fraction, path))
            print(f"{compare_report.label_of(method, fraction)}: "
                  + ", ".join(f"{c} x{n}" for c, n in _counts(plan).items()), flush=True)
    return jobs


def _counts(plan: dict[str, Any]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for unit in plan["units"]:
        counts[unit["choice"]] = counts.get(unit["choice"], 0) + 1
    return dict(sorted(counts.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs_json", type=Path, help="compare_runs.json of a compare benchmark")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fractions", default="1.0,0.7", help="osdp budgets to re-plan (all: 'all')")
    parser.add_argument("--out-dir", type=Path, default=Path("bench_out/replan"))
    parser.add_argument("--run-timeout-s", type=float, default=900.0)
    args = parser.parse_args(argv)
    saved = json.loads(args.runs_json.read_text())
    machine, terms = saved["machine"], fit_terms(saved["runs"])
    if terms is None:
        raise SystemExit("the compare run needs ddp, zero2 and zero3 runs to fit the terms")
    print(describe_terms(terms), flush=True)
    launch_args = argparse.Namespace(accelerator=machine["accelerator"], devices=machine["devices"], seed=0,
                                     run_timeout_s=args.run_timeout_s)
    settings, runs = machine["model"], []
    with tempfile.TemporaryDirectory(prefix="osdp-replan-") as tmp:
        work = Path(tmp)
        (work / compare.CORPUS_FILE).write_text(python_docs_corpus(), encoding="utf-8")
        fractions = None if args.fractions == "all" else tuple(float(f) for f in args.fractions.split(","))
        jobs = [("ddp", None, None), ("zero3", None, None), *plans_to_run(saved, terms, work, fractions)]
        for r in range(args.rounds):
            for method, fraction, plan in jobs if r % 2 == 0 else jobs[::-1]:
                budget = int(fraction * machine["replicate_peak_bytes"]) if fraction is not None else None
                extra = ("--plan", str(plan)) if plan is not None else ()
                label = f"r{r}_{method}_{fraction}"
                record = compare.launch("osdp" if plan else method, budget, settings, launch_args, work, label, extra)
                record.update(method=method, round=r, fraction=fraction, load_average=compare.load_average())
                runs.append(record)
                print(compare_report.progress_line(record), flush=True)
    rows = compare_report.aggregate(runs, machine["replicate_peak_bytes"])
    text = "\n".join([describe_terms(terms), "", compare_report.results_table(rows)])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "replan.md").write_text(text + "\n")
    (args.out_dir / "replan_runs.json").write_text(json.dumps({"machine": machine, "runs": runs}, default=str))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
