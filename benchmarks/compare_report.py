"""Tables, CSV files, target verdicts and the plot of :mod:`benchmarks.compare`.

Rows aggregate the rounds of one method (and budget): medians of throughput and step seconds,
the largest measured peak (a budget must hold in every run), the worst memory-prediction error,
and throughput ratios taken round by round (run r of osdp against run r of ddp), so that a slow
round slows both sides of a ratio alike.

A run with a budget shows, beside its tracked peak over the budget, its own memory above its fixed
cost (``own_above_fixed_bytes``) and its resident high-water above it (``process_above_fixed_bytes``)
over the budget, where the summary reports them (osdp on CPU). A budget that covers the process
(``budget_covers`` of the run record, ``--budget-covers process``) bounds the own memory: that is what
"within budget" and its target check there. Records without these fields report as before.
"""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path
from typing import Any

from osdp_lightning.plan.plan import counts_text

MIB = 2**20
MEM_ERROR_TARGET, STEP_ERROR_TARGET = 0.05, 0.20
STEP_MEDIAN_ERROR_TARGET = 0.10
"""Target of the step model: median |step-time error| over all methods and budgets (15% on other shapes
than the default)."""


def label_of(method: str, fraction: float | None) -> str:
    return method if fraction is None else f"{method} @ {100 * fraction:.0f}%"


def progress_line(record: dict[str, Any]) -> str:
    head = f"  round {record['round']}  {label_of(record['method'], record['fraction']):<12}"
    if record["status"] == "infeasible":
        return f"{head} does not fit (smallest {_mib(record.get('smallest_feasible_bytes'))} MiB)"
    if record["status"] != "ok":
        return f"{head} ERROR ({record['message'].splitlines()[0] if record['message'] else ''})"
    s = record["summary"]
    measured = measured_text(record, s["predicted_step_s"], s["predicted_peak_bytes"])
    shares = budget_shares_text(record_shares(record))
    return f"{head} {s['tokens_per_s']:8.0f} tokens/s  {measured}" + (f"  of budget: {shares}" if shares else "")


OWN, PROCESS = "own_above_fixed_bytes", "process_above_fixed_bytes"
"""The summary's process figures above the fixed cost measured at setup (osdp on CPU; 0 or absent elsewhere)."""


def _reported(summary: dict[str, Any], key: str) -> int | None:
    value = summary.get(key)
    return int(value) if value else None


def covers_process(record: dict[str, Any]) -> bool:
    """Whether the run's budget bounds its process above its fixed cost (older records: tensors)."""
    return record.get("budget_covers") == "process"


def record_shares(record: dict[str, Any]) -> dict[str, float | None]:
    """A trained run's tracked peak, own memory and resident high-water above its fixed cost over its
    budget (``None`` where it has no budget or the summary does not report the figure)."""
    budget, s = record.get("budget_bytes"), record.get("summary") or {}
    if not budget or record.get("status") != "ok":
        return {}
    figures = {"peak": s.get("peak_bytes"), "own": _reported(s, OWN), "process": _reported(s, PROCESS)}
    return {k: None if v is None else v / budget for k, v in figures.items()}


def budget_shares_text(shares: dict[str, float | None]) -> str:
    """``peak / own / process`` over the budget, in percent (``-`` for a figure not reported)."""
    if not shares:
        return ""
    return " / ".join(_fmt(None if shares.get(k) is None else 100 * shares[k], ".1f", "%")
                      for k in ("peak", "own", "process"))


def bounded_bytes(record: dict[str, Any]) -> int:
    """What the run's budget bounds: its own memory above its fixed cost where it covers the process
    (and the summary reports it), else its tracked peak."""
    s = record["summary"]
    return (_reported(s, OWN) if covers_process(record) else None) or int(s["peak_bytes"])


def measured_text(record: dict[str, Any], predicted_step_s: float | None,
                  predicted_peak_bytes: int | None) -> str:
    """A finished run's step and peak beside their predictions, its wall time and the load
    (the progress lines of compare and regret)."""
    s = record["summary"]
    return (f"step {s['step_s']:.4f} s (predicted {_fmt(predicted_step_s, '.4f')})  "
            f"peak {_mib(s['peak_bytes'])} MiB (predicted {_mib(predicted_peak_bytes)})  "
            f"[{record['wall_s']:.0f} s, load {record['load_average']}]")


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MIB:.2f}"


def _error(predicted: float | None, measured: float) -> float:
    return predicted / measured - 1 if measured and predicted is not None else float("nan")


def _median(values: list[float | None]) -> float | None:
    """Median of the values that exist (Lightning's own strategies predict nothing: ``None``)."""
    present = [v for v in values if v is not None and v == v]
    return statistics.median(present) if present else None


def _worst(errors: list[float]) -> float:
    present = [e for e in errors if e == e]
    return max(present, key=abs) if present else float("nan")


def _paired_ratio(runs: list[dict], by_round: dict[int, dict]) -> float | None:
    ratios = [r["summary"]["tokens_per_s"] / by_round[r["round"]]["summary"]["tokens_per_s"]
              for r in runs if r["round"] in by_round]
    return statistics.median(ratios) if ratios else None


def _ok_by_round(runs: list[dict], method: str) -> dict[int, dict]:
    return {r["round"]: r for r in runs if r["method"] == method and r["fraction"] is None and r["status"] == "ok"}


def _choices_text(runs: list[dict]) -> str:
    texts = [counts_text(r["choices"]) for r in runs]
    common = max(set(texts), key=texts.count)
    return common + (f" (plans differed across rounds: {len(set(texts))})" if len(set(texts)) > 1 else "")


def _row_of(group: list[dict], runs: list[dict], baseline_peaks: dict[str, int],
            baseline_owns: dict[str, int] | None = None) -> dict[str, Any]:
    first = group[0]
    row: dict[str, Any] = {"method": label_of(first["method"], first["fraction"]), "fraction": first["fraction"],
                           "budget_bytes": first.get("budget_bytes"), "runs": len(group)}
    ok = [r for r in group if r["status"] == "ok"]
    if not ok:
        row["status"] = ("does not fit (smallest: " + _mib(first.get("smallest_feasible_bytes")) + " MiB)"
                         if first["status"] == "infeasible" else "error")
        return row
    summaries = [r["summary"] for r in ok]
    mem_errors = [_error(s["predicted_peak_bytes"], s["peak_bytes"]) for s in summaries]
    step_errors = [_error(s["predicted_step_s"], s["step_s"]) for s in summaries]
    row.update(
        status="ok", choices=_choices_text(ok),
        tokens_per_s=statistics.median(s["tokens_per_s"] for s in summaries),
        step_s=statistics.median(s["step_s"] for s in summaries),
        predicted_step_s=_median([s["predicted_step_s"] for s in summaries]),
        step_error=_median(step_errors), step_error_worst=_worst(step_errors),
        peak_bytes=max(s["peak_bytes"] for s in summaries),
        predicted_peak_bytes=_median([s["predicted_peak_bytes"] for s in summaries]),
        mem_error_worst=_worst(mem_errors),
        x_ddp=_paired_ratio(ok, _ok_by_round(runs, "ddp")), x_zero3=_paired_ratio(ok, _ok_by_round(runs, "zero3")),
        x_fsdp2=_paired_ratio(ok, _ok_by_round(runs, "fsdp2")))
    if first["fraction"] is not None:
        row["within_budget"] = all(bounded_bytes(r) <= first["budget_bytes"] for r in ok)
        row["budget_covers"] = "process" if covers_process(first) else "tensors"
        for key in ("peak", "own", "process"):  # the worst run's share of the budget
            shares = [record_shares(r).get(key) for r in ok]
            row[f"{key}_over_budget"] = max(shares) if shares and None not in shares else None
        # NOTE: against a process budget a baseline fits by its own memory where it reports it
        # (osdp's uniform plans on CPU); Lightning's strategies report none: by their tracked peak.
        sizes = {m: (baseline_owns or {}).get(m, peak) if covers_process(first) else peak
                 for m, peak in baseline_peaks.items()}
        fitting = [m for m, size in sizes.items() if size <= first["budget_bytes"]]
        ratios = {m: _paired_ratio(ok, _ok_by_round(runs, m)) for m in fitting}
        ratios = {m: x for m, x in ratios.items() if x is not None}
        if ratios:  # the fastest baseline that fits this budget is the one to beat
            best = min(ratios, key=ratios.get)
            row.update(best_fitting=best, x_best_fitting=ratios[best])
    for key in ("forward_s", "backward_s", "optimizer_s"):
        values = [r["phases"][key] for r in ok if key in r.get("phases", {})]
        row[key] = statistics.median(values) if values else None
    row["profile_step_s"] = _median([r["profile_step_s"] for r in ok])
    row["predicted_comm_s"] = _median([sum(u["predicted_comm_s"] for u in r["plan"]["units"]) if r.get("plan") else None
                                       for r in ok])
    for key in ("calibrate_s", "profile_s", "solve_s", "apply_s"):
        row[key] = statistics.median(r["setup_s"].get(key, 0.0) for r in ok)
    for key in STEP_PARTS:
        row[key] = _median([r["plan"].get(key) if r.get("plan") else None for r in ok])
    return row


def aggregate(runs: list[dict], replicate_peak: int) -> list[dict[str, Any]]:
    """One row per method (and osdp budget), in the order the methods were first run."""
    groups: dict[tuple[str, float | None], list[dict]] = {}
    for run in sorted(runs, key=lambda r: r["round"]):
        groups.setdefault((run["method"], run["fraction"]), []).append(run)
    # NOTE: osdp at its default budget is osdp, not a baseline to beat.
    baselines = {m: [r for r in g if r["status"] == "ok"] for (m, f), g in groups.items()
                 if f is None and m != "osdp-default"}
    baseline_peaks = {m: max(r["summary"]["peak_bytes"] for r in ok) for m, ok in baselines.items() if ok}
    baseline_owns = {m: max(owns) for m, ok in baselines.items()
                     if ok and None not in (owns := [_reported(r["summary"], OWN) for r in ok])}
    return [_row_of(group, runs, baseline_peaks, baseline_owns) for group in groups.values()]


def _fmt(value: Any, spec: str = ".2f", suffix: str = "") -> str:
    if value is None or value != value:
        return "-"
    return f"{value:{spec}}{suffix}"


def _pct(error: float | None) -> str:
    return _fmt(None if error is None else 100 * error, "+.1f", "%")


def results_table(rows: list[dict[str, Any]]) -> str:
    head = ("| method | budget MiB | tokens/s | x ddp | x zero3 | x best baseline that fits | peak MiB (measured) "
            "| peak MiB (predicted) | mem err | within budget | of budget: peak / own / process | step s "
            "| step s (predicted) | step err | plan |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        budget = _mib(r["budget_bytes"])
        if r["status"] != "ok":
            lines.append(f"| {r['method']} | {budget} | {r['status']} |" + " |" * 12)
            continue
        best = (f"{r['x_best_fitting']:.2f} ({r['best_fitting']})" if r.get("best_fitting")
                else ("none fits" if r["fraction"] is not None else "-"))
        within = {True: "yes", False: "**NO**", None: "-"}[r.get("within_budget")]
        within += " (own)" if r.get("budget_covers") == "process" and r.get("own_over_budget") is not None else ""
        shares = budget_shares_text({k: r.get(f"{k}_over_budget") for k in ("peak", "own", "process")}
                                    if r["fraction"] is not None else {}) or "-"
        lines.append(
            f"| {r['method']} | {budget} | {r['tokens_per_s']:.0f} | {_fmt(r['x_ddp'])} | {_fmt(r['x_zero3'])} "
            f"| {best} | {_mib(r['peak_bytes'])} | {_mib(r['predicted_peak_bytes'])} "
            f"| {_pct(r['mem_error_worst'])} | {within} | {shares} | {r['step_s']:.4f} "
            f"| {_fmt(r['predicted_step_s'], '.4f')} | {_pct(r['step_error'])} | {r['choices']} |")
    return "\n".join(lines)


def breakdown_table(rows: list[dict[str, Any]]) -> str:
    """Where the measured step goes, against what the cost model adds up."""
    lines = ["| method | measured step s | forward s | backward s | optimizer s | other s | profiled fwd+bwd s "
             "(unsharded) | predicted comm s | predicted step s | setup: calibrate / profile / solve / apply s |",
             "|" + "---|" * 10]
    for r in rows:
        if r["status"] != "ok":
            continue
        phases = [r["forward_s"], r["backward_s"], r["optimizer_s"]]
        other = r["step_s"] - sum(phases) if None not in phases else None
        setup = " / ".join(f"{r[k]:.2f}" for k in ("calibrate_s", "profile_s", "solve_s", "apply_s"))
        lines.append(f"| {r['method']} | {r['step_s']:.4f} | " + " | ".join(_fmt(p, '.4f') for p in phases)
                     + f" | {_fmt(other, '.4f')} | {_fmt(r['profile_step_s'], '.4f')} "
                     f"| {_fmt(r['predicted_comm_s'], '.4f')} | {_fmt(r['predicted_step_s'], '.4f')} | {setup} |")
    return "\n".join(lines)


STEP_PARTS = ("predicted_compute_s", "predicted_optimizer_s", "predicted_overhead_s", "predicted_exposed_comm_s",
              "predicted_loop_s")


def step_parts_table(rows: list[dict[str, Any]]) -> str:
    """The predicted step by part, beside the measured step and optimizer phase."""
    lines = ["| method | measured step s | predicted step s (err) | compute s | optimizer s (measured) | FSDP overhead s "
             "| exposed comm s | loop s |", "|" + "---|" * 8]
    for r in rows:
        if r["status"] != "ok" or r.get("predicted_compute_s") is None:
            continue
        err = _error(r["predicted_step_s"], r["step_s"])
        lines.append(f"| {r['method']} | {r['step_s']:.4f} | {_fmt(r['predicted_step_s'], '.4f')} ({100 * err:+.1f}%) "
                     f"| {r['predicted_compute_s']:.4f} | {_fmt(r['predicted_optimizer_s'], '.4f')} "
                     f"({_fmt(r['optimizer_s'], '.4f')}) | {_fmt(r['predicted_overhead_s'], '.4f')} "
                     f"| {_fmt(r['predicted_exposed_comm_s'], '.4f')} | {_fmt(r['predicted_loop_s'], '.4f')} |")
    return "\n".join(lines)


def verdicts(rows: list[dict[str, Any]], runs: list[dict]) -> list[str]:
    """The benchmark's targets, each with the numbers behind its verdict."""
    by_fraction = {r["fraction"]: r for r in rows if r["fraction"] is not None and r["status"] == "ok"
                   and r["method"].startswith("osdp @")}
    osdp_runs = [r for r in runs if r["method"] == "osdp" and r["status"] == "ok"]
    over = [r for r in osdp_runs if r["summary"]["peak_bytes"] > r["budget_bytes"]]
    worst = max((r["summary"]["peak_bytes"] / r["budget_bytes"] for r in osdp_runs), default=float("nan"))
    verdict = "n/a (no osdp run trained)" if not osdp_runs else ("MET" if not over else "MISSED")
    lines = [f"- osdp never exceeds its budget (measured peak): {verdict} "
             f"({len(osdp_runs)} runs, highest peak/budget {100 * worst:.1f}%)"]
    lines += _process_budget_verdicts(osdp_runs)
    for fraction, key, target, name in ((1.0, "x_ddp", 0.95, "ddp"), (0.7, "x_zero3", 1.10, "zero3")):
        row = by_fraction.get(fraction)
        value = row.get(key) if row else None
        verdict = "n/a (not run or no plan fits)" if value is None else ("MET" if value >= target else "MISSED")
        lines.append(f"- at {100 * fraction:.0f}% budget osdp >= {target:.2f}x {name} throughput: {verdict}"
                     + (f" ({value:.3f}x)" if value is not None else ""))
    lines += _ddp_verdicts(rows) + _hand_fsdp2_verdicts(rows)
    ok = [r for r in runs if r["status"] == "ok" and r["summary"].get("predicted_peak_bytes") is not None]
    for key, measured, target, name in (("predicted_peak_bytes", "peak_bytes", MEM_ERROR_TARGET, "memory"),
                                        ("predicted_step_s", "step_s", STEP_ERROR_TARGET, "step-time")):
        errors = [_error(r["summary"][key], r["summary"][measured]) for r in ok]
        worst_error = max(errors, key=abs) if errors else float("nan")
        met = all(abs(e) <= target for e in errors)
        lines.append(f"- {name} prediction error <= {100 * target:.0f}% in every run: {'MET' if met else 'MISSED'} "
                     f"(worst {100 * worst_error:+.1f}%, median |error| "
                     f"{100 * statistics.median(abs(e) for e in errors) if errors else float('nan'):.1f}%)")
    step_errors = [abs(_error(r["summary"]["predicted_step_s"], r["summary"]["step_s"])) for r in ok
                   if r["summary"].get("predicted_step_s")]
    median = statistics.median(step_errors) if step_errors else float("nan")
    lines.append(f"- step-time prediction median |error| <= {100 * STEP_MEDIAN_ERROR_TARGET:.0f}% (other shapes: "
                 f"15%): {'MET' if median <= STEP_MEDIAN_ERROR_TARGET else 'MISSED'} ({100 * median:.1f}% over "
                 f"{len(step_errors)} runs)")
    return lines


def _process_budget_verdicts(osdp_runs: list[dict]) -> list[str]:
    """Where osdp's budgets cover the process: its own memory above its fixed cost never exceeds the
    budget, with the highest resident high-water above it (code pages loaded since setup included)."""
    covered = [r for r in osdp_runs if covers_process(r)]
    if not covered:
        return []
    shares = [record_shares(r) for r in covered]
    missing = sum(s["own"] is None for s in shares)
    own = [s["own"] for s in shares if s["own"] is not None]
    over = [x for x in own if x > 1]
    verdict = "n/a (no run reports it)" if not own else ("MISSED" if over else "MET")

    def highest(key: str) -> str:
        values = [s[key] for s in shares if s[key] is not None]
        return f"{100 * max(values):.1f}%" if values else "-"

    return [f"- osdp's own memory above its fixed cost never exceeds its process budget: {verdict} "
            f"({len(own)} runs{f', {missing} without the figure' if missing else ''}, highest own/budget "
            f"{highest('own')}; resident above the fixed cost, code pages loaded since setup included: highest "
            f"process/budget {highest('process')})"]


def _ddp_verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """Where everything fits, osdp runs at the speed of Lightning's ``strategy="ddp"``."""
    by_method = {r["method"]: r for r in rows if r["fraction"] is None and r["status"] == "ok"}
    lines = []
    for method, target, name in (("osdp-default", 0.97, "osdp at its default budget (everything fits)"),
                                 ("osdp-replicate", 0.97, "osdp uniform replicate (within 3%)")):
        value = by_method.get(method, {}).get("x_ddp")
        verdict = "n/a (not run)" if value is None else ("MET" if value >= target else "MISSED")
        lines.append(f"- {name} >= {target:.2f}x Lightning ddp throughput: {verdict}"
                     + (f" ({value:.3f}x)" if value is not None else ""))
    return lines


def _hand_fsdp2_verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """Against FSDP2 as Lightning documents it (``fsdp2``: one unit per block)."""
    hand = next((r for r in rows if r["method"] == "fsdp2" and r["status"] == "ok"), None)
    if hand is None:
        return ["- osdp against the hand-written FSDP2: n/a (fsdp2 not run)"]
    lines = []
    at_peak = [r for r in rows if r["method"].startswith("osdp-at-fsdp2 @ 100%")]
    value = at_peak[0].get("x_fsdp2") if at_peak and at_peak[0]["status"] == "ok" else None
    verdict = "n/a (not run or no plan fits)" if value is None else ("MET" if value >= 1.10 else "MISSED")
    lines.append(f"- osdp at the hand FSDP2's measured peak >= 1.10x hand FSDP2: {verdict}"
                 + (f" ({value:.3f}x)" if value is not None else ""))
    fitting = [r for r in rows if r["method"].startswith("osdp") and r["fraction"] is not None and r["status"] == "ok"
               and r["budget_bytes"] >= hand["peak_bytes"] and r.get("x_fsdp2") is not None]
    below = [f"{r['method']} {r['x_fsdp2']:.3f}x" for r in fitting if r["x_fsdp2"] < 1.0]
    verdict = "n/a (no osdp budget at or above its peak)" if not fitting else ("MISSED" if below else "MET")
    lines.append(f"- osdp never below hand FSDP2 where both fit: {verdict} ({len(fitting)} budgets"
                 + (f"; below: {', '.join(below)}" if below else "") + ")")
    zero3 = next((r for r in rows if r["method"] == "zero3" and r["status"] == "ok"), None)
    value = zero3.get("x_fsdp2") if zero3 else None
    verdict = "n/a (not run)" if value is None else ("MET" if value >= 0.97 else "MISSED")
    lines.append(f"- uniform zero3 (block units) within 3% of hand FSDP2: {verdict}"
                 + (f" ({value:.3f}x; peak {_mib(zero3['peak_bytes'])} vs {_mib(hand['peak_bytes'])} MiB, "
                    f"predicted {_mib(zero3['predicted_peak_bytes'])})" if value is not None else ""))
    return lines


_RUN_FIELDS = ("round", "method", "fraction", "status", "budget_bytes", "tokens_per_s", "step_s", "predicted_step_s",
               "peak_bytes", "predicted_peak_bytes", "forward_s", "backward_s", "optimizer_s", "choices",
               "smallest_feasible_bytes", "load_average", "wall_s", "budget_covers", OWN, PROCESS)


def _run_csv_row(run: dict) -> dict[str, Any]:
    row = {k: run.get(k) for k in _RUN_FIELDS}
    row.update({k: v for k, v in run.get("summary", {}).items() if k in _RUN_FIELDS})
    row.update(run.get("phases", {}))
    row["choices"] = json.dumps(run.get("choices")) if run.get("choices") else None
    return row


def write_csv(path: Path, rows: list[dict[str, Any]], fields: list[str] | tuple[str, ...]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(fields), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def write_outputs(out_dir: Path, machine: dict[str, Any], rows: list[dict[str, Any]], runs: list[dict],
                  plot: bool = True) -> str:
    """Write compare.md / .csv / _runs.csv / _runs.json (and compare.png); return the markdown."""
    fields = sorted({k for r in rows for k in r}, key=lambda k: (k != "method", k))
    write_csv(out_dir / "compare.csv", rows, fields)
    write_csv(out_dir / "compare_runs.csv", [_run_csv_row(r) for r in runs], _RUN_FIELDS)
    # NOTE: compact: a run records its profile, plan and per-module memory, and reports are kept in docs/
    (out_dir / "compare_runs.json").write_text(json.dumps({"machine": machine, "runs": runs}, separators=(",", ":"),
                                                          default=str) + "\n")
    parts = [f"machine: {json.dumps(machine, default=str)}", "", results_table(rows), "",
             breakdown_table(rows), "", step_parts_table(rows), "", "targets:", *verdicts(rows, runs)]
    if plot:
        from benchmarks.compare_plot import plot_results

        plot_results(out_dir / "compare.png", rows, runs, machine)
        parts.append(f"plot: {out_dir / 'compare.png'}")
    text = "\n".join(parts)
    (out_dir / "compare.md").write_text(text + "\n")
    return text
