"""Price recorded ``osdp-bench`` runs again with the step model of a cluster config (issue 10).

    python -m benchmarks.reprice docs/benchmarks/compare_runs.json [--cluster cpu_2]

Each run's own profiled compute (``profile_step_s``) and plan (units, parameter counts, choices)
are priced by the cost model (``build_choice_table`` / ``step_seconds``) with the config's step
terms: collectives by kind, FSDP2's per-group work, the optimizer step, the loop's constant.
Nothing is fitted to the runs; the table shows how far the model is from each measured step.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.compare_report import label_of
from osdp_lightning.cluster import load_cluster_spec
from osdp_lightning.cost import build_choice_table
from osdp_lightning.profile import ModelProfile, UnitProfile
from osdp_lightning.solve import step_seconds


def predicted_step_s(run: dict, cluster_name: str) -> float:
    """The run's plan priced with the config's terms (units' compute: the profiled step, spread
    over the units by parameters; only the total matters to the step)."""
    plan_units = run["plan"]["units"]
    total = sum(u["param_count"] for u in plan_units) or 1
    units = tuple(UnitProfile(u["name"], tuple(u["module_names"]), u["param_count"], 0,
                              run["profile_step_s"] * u["param_count"] / total, 0.0, 0) for u in plan_units)
    profile = ModelProfile(units=units, micro_batch_size=run["plan"]["micro_batch_size"], param_bytes_per_element=4,
                           grad_bytes_per_element=4, compute_bytes_per_element=4, reduce_bytes_per_element=4,
                           optimizer_bytes_per_param=8, activation_bytes=0)
    cluster = load_cluster_spec(cluster_name, memory_budget=2**40)
    choices = [u["choice"] for u in plan_units]
    return step_seconds(build_choice_table(profile, cluster, choices=sorted(set(choices))), choices)


def reprice_table(runs: list[dict], cluster_name: str) -> str:
    groups: dict[str, list[tuple[float, float, float]]] = {}
    for run in runs:
        if run["status"] == "ok" and run.get("plan") and run.get("profile_step_s"):
            groups.setdefault(label_of(run["method"], run["fraction"]), []).append(
                (run["summary"]["step_s"], run["summary"]["predicted_step_s"], predicted_step_s(run, cluster_name)))
    lines = ["| run | measured step s | recorded prediction (err) | with the step terms (err) |", "|---|---|---|---|"]
    errors = []
    for label, values in groups.items():
        measured, recorded, priced = (statistics.median(v) for v in zip(*values, strict=True))
        errors.append(abs(priced / measured - 1))
        lines.append(f"| {label} | {measured:.4f} | {recorded:.4f} ({100 * (recorded / measured - 1):+.1f}%) "
                     f"| {priced:.4f} ({100 * (priced / measured - 1):+.1f}%) |")
    lines.append(f"\nmedian |error| with the step terms: {100 * statistics.median(errors):.1f}%" if errors else "")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+")
    parser.add_argument("--cluster", default="cpu_2")
    args = parser.parse_args()
    for path in args.runs:
        print(f"{path}\n{reprice_table(json.loads(path.read_text())['runs'], args.cluster)}\n")


if __name__ == "__main__":
    main()
