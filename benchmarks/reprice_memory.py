"""Price the memory of recorded ``osdp-bench`` runs again with today's memory model.

    python -m benchmarks.reprice_memory docs/benchmarks/compare_default/compare_runs.json.gz [more runs files]

Each osdp run's own profile and plan (units, choices, micro-batch, world size) are priced by the
cost model and the ILP's evaluator (``build_choice_table`` / ``peak_bytes``) and set beside the
peak FSDPMemTracker measured in that run and the prediction the run itself made. Nothing is
trained; a change to the memory model shows here on every plan ever measured. Profiles recorded
before ``UnitProfile.interleaved`` existed mark tied units (a name with ``+``) as interleaved, as
the profiler now does.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path
from typing import Any

from benchmarks.runs_file import read_runs
from osdp_lightning.cost.cluster import ClusterSpec
from osdp_lightning.cost.cost import ChoiceTable
from osdp_lightning.plan.choice_table import build_choice_table
from osdp_lightning.plan.plan import choices_text
from osdp_lightning.profiling.records import ModelProfile, UnitProfile, with_units
from osdp_lightning.solve import peak_bytes


def profile_from_dict(data: dict[str, Any]) -> ModelProfile:
    """The inverse of ``dataclasses.asdict`` for a profile read back from JSON (lists to tuples)."""
    return ModelProfile(**{**data, "units": tuple(_unit_from_dict(u) for u in data["units"])})


def _unit_from_dict(u: dict[str, Any]) -> UnitProfile:
    return UnitProfile(**{**u, "module_names": tuple(u["module_names"]),
                          "linear_shape": tuple(u["linear_shape"]) if u.get("linear_shape") else None,
                          "split_overhead_s": tuple(tuple(x) for x in u.get("split_overhead_s", ())),
                          "param_dtypes": tuple(u.get("param_dtypes", ())),
                          "parts": tuple(_unit_from_dict(p) for p in u.get("parts", ()))})


def cluster_of(plan: dict[str, Any]) -> ClusterSpec:
    """The cluster a recorded plan (a plan dict of a runs file) was made for: its ranks, budget and links."""
    return ClusterSpec(world_size=plan["world_size"], memory_budget_bytes=plan["memory_budget_bytes"],
                       collective_latency_s=plan["collective_latency_s"],
                       bandwidth_bytes_per_s=plan["bandwidth_bytes_per_s"],
                       overlap_efficiency=plan["overlap_efficiency"])


def _profile_of(run: dict[str, Any]) -> ModelProfile | None:
    """The run's profile over the units of its plan (``None`` when it has no such unit set)."""
    profile = profile_from_dict(run["profile"])
    units = tuple(dataclasses.replace(u, interleaved=u.interleaved or "+" in u.name) for u in profile.units)
    try:
        return with_units(dataclasses.replace(profile, units=units), [u["name"] for u in run["plan"]["units"]])
    except ValueError:
        return None


def priced_plan(run: dict[str, Any]) -> tuple[ChoiceTable, tuple[str, ...]] | None:
    """The run's plan priced by today's cost model: its choice table (on the run's own profile and
    cluster) and its choices, or ``None`` when its profile does not fit it."""
    plan, profile = run["plan"], _profile_of(run)
    if profile is None:
        return None
    choices = tuple(u["choice"] for u in plan["units"])
    table = build_choice_table(profile, cluster_of(plan), plan["micro_batch_size"], choices=sorted(set(choices)),
                               accumulation_steps=plan.get("accumulation_steps", 1))
    return table, choices


def repriced_bytes(run: dict[str, Any]) -> int | None:
    """Today's predicted peak of the run's plan, or ``None`` when its profile does not fit it."""
    priced = priced_plan(run)
    return None if priced is None else peak_bytes(*priced)


def table_of(path: Path) -> str:
    """One markdown table: every distinct (method, budget, plan) of a runs file, medians over rounds."""
    data = read_runs(path)
    rows: dict[tuple, list[tuple[int, int, int | None]]] = {}
    for run in data["runs"]:
        if run.get("status") == "ok" and run.get("plan") and run.get("profile"):
            key = (run["method"], run.get("fraction"), tuple(u["choice"] for u in run["plan"]["units"]))
            # NOTE: rounds of one plan share their prediction: priced once
            now = rows[key][0][2] if key in rows else repriced_bytes(run)
            rows.setdefault(key, []).append((run["summary"]["peak_bytes"], run["plan"]["predicted_peak_bytes"], now))
    lines = [f"{path} (GPT {data['machine'].get('model')})", "",
             "| method | budget | plan | measured MiB | run's prediction | today's model |", "|---|---|---|---|---|---|"]
    errors = []
    for (method, fraction, choices), values in rows.items():
        measured = statistics.median(v[0] for v in values)
        then, now = values[0][1], values[0][2]
        mix = choices_text(choices)
        now_text = "-" if now is None else f"{now / 2**20:.2f} ({now / measured - 1:+.1%})"
        if now is not None:
            errors.append(now / measured - 1)
        lines.append(f"| {method} | {fraction or '-'} | {mix} | {measured / 2**20:.2f} | "
                     f"{then / 2**20:.2f} ({then / measured - 1:+.1%}) | {now_text} |")
    if errors:
        lines += ["", f"today's model: worst under {min(errors):+.1%}, worst over {max(errors):+.1%}, "
                      f"median |error| {statistics.median(abs(e) for e in errors):.1%}"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+", help="compare_runs.json(.gz) files of osdp-bench")
    args = parser.parse_args()
    print("\n\n".join(table_of(path) for path in args.runs))


if __name__ == "__main__":
    main()
