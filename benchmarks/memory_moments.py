"""Where a step peaks, unit by unit: the memory model's moments beside FSDPMemTracker's.

    python -m benchmarks.memory_moments docs/benchmarks/hand_fsdp2_default/compare_runs.json.gz
    python -m benchmarks.memory_moments run.json --method osdp     (a compare_worker output)
    python -m benchmarks.memory_moments docs/benchmarks/hf_models/hf_models_runs.json.gz   (hf_models' runs)

For every osdp run of an ``osdp-bench`` or ``hf_models`` runs file (or one worker record) that kept its
per-module memory (``TrainingSummary(module_memory=True)``, which the benchmark's worker sets),
each unit of its plan gets the bytes per rank the model the ILP uses predicts at the unit's
forward and at its backward moment (``solve.moment_bytes``, priced on the run's own profile and
plan) beside the tracker's peak during that unit's forward and backward, on the rank that peaked
highest (for the root: the whole forward and backward). The tracker's bytes when the unit's
backward starts, and after a checkpointed unit's recompute, show what the peak is made of. Nothing
is trained: a change to the memory model shows here moment by moment.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from benchmarks.reprice_memory import priced_plan
from benchmarks.runs_file import read_runs
from osdp_lightning.solve import moment_bytes

MIB = 2**20


def runs_of(path: Path, method: str | None = None) -> list[dict[str, Any]]:
    """The runs of a runs file, or the one record of a worker output, that kept module memory."""
    data = read_runs(path)
    if isinstance(data, dict):  # NOTE: osdp-bench keeps its runs under "runs", hf_models under "train"
        runs = data.get("runs") or data.get("train") or [data]
    else:
        runs = data
    return [r for r in runs if r.get("status") == "ok" and r.get("plan") and r.get("profile")
            and r.get("summary", {}).get("module_memory") and (method is None or r["method"] == method)]


def measured_of(module_memory: dict[str, dict[str, int]], module_names: list[str]) -> dict[str, int]:
    """The tracker's figures for a unit: the largest over its modules (a tracked name ends with
    the unit's module name; the root unit, ``""``, is the tracked model itself)."""
    names = [n for n in module_memory if any(n == m or n.endswith("." + m) for m in module_names if m)]
    names = names or ([""] if not any(module_names) and "" in module_memory else [])
    figures: dict[str, int] = {}
    for name in names:
        for label, value in module_memory[name].items():
            figures[label] = max(figures.get(label, 0), value)
    return figures


def unit_rows(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Per unit of the run's plan: its choice, the predicted moments and the tracker's figures."""
    priced = priced_plan(run)
    if priced is None:
        return []
    memory = run["summary"]["module_memory"]
    rows = []
    for unit, (forward, backward) in zip(run["plan"]["units"], moment_bytes(*priced), strict=True):
        names = list(unit.get("module_names") or [unit["name"]])
        rows.append({"unit": unit["name"] or "(root)", "choice": unit["choice"], "forward": forward,
                     "backward": backward, **measured_of(memory, names)})
    return rows


def _cell(predicted: int, measured: int | None) -> str:
    if not measured:
        return f"{predicted / MIB:.2f} / -"
    return f"{predicted / MIB:.2f} / {measured / MIB:.2f} ({predicted / measured - 1:+.1%})"


def table_of(run: dict[str, Any]) -> str:
    rows = unit_rows(run)
    summary, plan = run["summary"], run["plan"]
    budget = f" at {plan['memory_budget_bytes'] / MIB:.2f} MiB" if plan.get("memory_budget_bytes") else ""
    name = " ".join(str(run[k]) for k in ("family", "run", "round") if k in run) or run["method"]
    rank = summary.get("module_memory_rank", 0)
    lines = [f"{name}{budget}: measured peak {summary['peak_bytes'] / MIB:.2f} MiB, predicted "
             f"{plan['predicted_peak_bytes'] / MIB:.2f}; modules of rank {rank}", "",
             "| unit | choice | forward: predicted / measured peak | backward: predicted / measured peak | "
             "measured at backward start | measured after recompute |", "|---|---|---|---|---|---|"]
    for r in rows:
        start, recomputed = r.get("backward_start"), r.get("recomputed")
        lines.append(f"| {r['unit']} | {r['choice']} | {_cell(r['forward'], r.get('forward_peak'))} | "
                     f"{_cell(r['backward'], r.get('backward_peak'))} | "
                     f"{f'{start / MIB:.2f}' if start else '-'} | {f'{recomputed / MIB:.2f}' if recomputed else '-'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+", help="compare_runs.json(.gz) files or compare_worker outputs")
    parser.add_argument("--method", default=None, help="only runs of this method (e.g. osdp, zero3)")
    args = parser.parse_args()
    tables = [table_of(run) for path in args.runs for run in runs_of(path, args.method)]
    print("\n\n".join(tables) if tables else "no run kept its per-module memory (TrainingSummary(module_memory=True))")


if __name__ == "__main__":
    main()
