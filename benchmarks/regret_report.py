"""Tables, the regret verdicts and the scatter plot of :mod:`benchmarks.regret`.

A candidate belongs to a budget when its peak as the strategy bounds it (the predicted peak and its
headroom by kind) fits the part of the budget the strategy may plan (the shape's ``usable_bytes``;
every plan drawn for a budget does), or, for a uniform baseline, when its measured peak fits the
budget (runs files without those figures were drawn under a flat 2.5% headroom and are read so).
It *fits* when its measured peak (max over rounds) is at or under the budget (under process budgets,
a shape's ``budget_covers``: its own memory above its fixed cost); the best candidate is
the fastest that fits. Throughput ratios are taken round by round (osdp's run of
round r against the best candidate's run of round r), then the median, so that a slow round slows
both sides alike.

Spearman's correlation of predicted and measured steps is given twice: over every candidate, and
beyond the run's noise, where measured steps closer than the noise count as tied (the targets use
the latter: an order that launches of one plan do not repeat cannot be predicted). The run's noise
at a budget is the median over its candidates of the spread of each one's rounds ((slowest -
fastest) / median of its steps).

Confirmation (``--confirm-rounds``): the fastest candidate of a few rounds is partly the luckiest
(of twenty candidates with single rounds 10% apart, the one measured fastest was also lucky), so the
regret above leans low. After the rounds that rank every candidate (the screening), osdp's plan and
the ``--confirm-top`` fastest other candidates that fit each budget are trained again for
``--confirm-rounds`` rounds, rotated, and the confirmed regret (:func:`confirmed_row`) pairs those
rounds only: finalists are picked on the screening, their speed is measured afresh.

Where a shape's prediction errors come from (:func:`error_sources`): one profile and one
calibration price every candidate of a shape, so part of the error is shared by all of them (the
tilt; it leaves the order alone), part follows the plans' families (one calibration's per-family
terms: it reorders plans of different families), and the rest is each plan's own; set beside the
standard error of a candidate's measured step, that rest says how much of the misordering is the
cost model's and how much the measurement's.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.compare_report import OWN, measured_text
from osdp_lightning.choices import parse
from osdp_lightning.cost.budget import PLAN_HEADROOM_FRACTION
from osdp_lightning.plan.plan import choices_text

MIB = 2**20
REGRET_TARGET, SPEARMAN_TARGET = 0.97, 0.9
FIT_FIGURE = {"tensors": "peak_bytes", "process": OWN}
"""What fits a shape's budgets, by its ``budget_covers``: each run's summary figure
(:func:`benchmarks.compare.budget_base` takes the same of the all-replicate run for the budgets)."""
SCREEN, CONFIRM = "screen", "confirm"
"""A run's stage: the rounds that rank every candidate, or the later rounds of the finalists."""


def progress_line(record: dict[str, Any], cand: Any) -> str:
    head = f"    round {record['round']}  {record['candidate']:<22}"
    if record["status"] != "ok":
        return f"{head} ERROR ({(record.get('message') or '').strip()[-300:]})"
    return f"{head} {measured_text(record, cand.plan.predicted_step_s, cand.plan.predicted_peak_bytes)}"


def average_ranks(values: list[float]) -> list[float]:
    """1-based ranks; ties share the mean of their ranks."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation (Pearson's of the average ranks); ``None`` below 3 points or no spread."""
    if len(xs) < 3:
        return None
    rx, ry = average_ranks(xs), average_ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else None


def noise_share(rows: list[dict[str, Any]]) -> float | None:
    """The run's noise: the median over candidates with two or more rounds of their steps' spread
    ((slowest - fastest) / median); ``None`` when no candidate has two."""
    spreads = [(max(r["steps"]) - min(r["steps"])) / statistics.median(r["steps"])
               for r in rows if len(r.get("steps", ())) >= 2]
    return statistics.median(spreads) if spreads else None


def tie_classes(values: list[float], share: float) -> list[float]:
    """Each value's class, in order of value: a class starts at its smallest value and takes every
    value within ``share`` of that one (closer values count as tied)."""
    classes, start, index = [0.0] * len(values), None, -1
    for i in sorted(range(len(values)), key=values.__getitem__):
        if start is None or values[i] > start * (1 + share):
            start, index = values[i], index + 1
        classes[i] = float(index)
    return classes


def spearman_beyond_noise(predicted: list[float], steps: list[float], share: float | None) -> float | None:
    """Spearman's correlation with measured steps within ``share`` of each other tied (:func:`tie_classes`)."""
    return spearman(predicted, steps if share is None else tie_classes(steps, share))


def measured(shape: dict[str, Any], stage: str = SCREEN) -> list[dict[str, Any]]:
    """One row per candidate: its predictions and the medians of its successful runs of ``stage``."""
    rows, runs = [], [r for r in shape["runs"] if r.get("stage", SCREEN) == stage]
    fit_figure = FIT_FIGURE[shape.get("budget_covers", "tensors")]
    for cand in shape["candidates"]:
        ok = [r for r in runs if r["candidate"] == cand["name"] and r["status"] == "ok"]
        row = {**cand, "runs_ok": len(ok),
               "runs_failed": sum(1 for r in runs if r["candidate"] == cand["name"] and r["status"] != "ok")}
        if ok:
            row.update(step_s=statistics.median(r["summary"]["step_s"] for r in ok),
                       tokens_per_s=statistics.median(r["summary"]["tokens_per_s"] for r in ok),
                       peak_bytes=max(r["summary"]["peak_bytes"] for r in ok),
                       fit_bytes=max(r["summary"].get(fit_figure, 0) for r in ok),
                       own_bytes=max(r["summary"].get(OWN) or 0 for r in ok),
                       by_round={r["round"]: r["summary"]["tokens_per_s"] for r in ok},
                       steps=[r["summary"]["step_s"] for r in ok])
        rows.append(row)
    return rows


def _plan_shares(choices: list[str]) -> dict[str, float]:
    """The share of a plan's units of each family and of each modifier (``+ckpt``)."""
    parsed = [parse(c) for c in choices]
    shares: dict[str, float] = {}
    for c in parsed:
        for key in (c.kind, *(f"+{m}" for m in c.modifiers)):
            shares[key] = shares.get(key, 0.0) + 1 / len(parsed)
    return shares


def error_sources(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What a shape's prediction errors are made of, over its candidates measured twice or more
    (``None`` below four): errors are ``log(predicted / measured step)``; ``tilt_share`` is their
    median; ``family_tilts`` are least-squares coefficients of the errors on each plan's share of
    units per family and modifier, against a whole plan of the reference family (replicate where
    a candidate has it); ``residual_share`` is the standard deviation of what the tilt and
    the family tilts leave; ``measured_share`` is the standard error of a candidate's measured step
    (the median over candidates of the standard deviation of its rounds over their mean, over the
    square root of their count); ``own_share`` is the residual beyond that measurement noise."""
    timed = [r for r in rows if len(r.get("steps", ())) >= 2]
    if len(timed) < 4:
        return None
    errors = [math.log(r["predicted_step_s"] / statistics.median(r["steps"])) for r in timed]
    shares = [_plan_shares(r["choices"]) for r in timed]
    # NOTE: families before modifiers, each most common first; the reference is replicate where any plan has it
    kinds = sorted({k for s in shares for k in s},
                   key=lambda k: (k.startswith("+"), -sum(s.get(k, 0.0) for s in shares), k))
    reference = "replicate" if "replicate" in kinds else kinds[0]
    terms = [k for k in kinds if k != reference][: len(timed) - 2]  # at least one degree of freedom left
    x = torch.tensor([[1.0, *(s.get(k, 0.0) for k in terms)] for s in shares], dtype=torch.float64)
    y = torch.tensor(errors, dtype=torch.float64).unsqueeze(1)
    coef = torch.linalg.lstsq(x, y, driver="gelsd").solution.squeeze(1)
    left = (y.squeeze(1) - x @ coef).tolist()
    residual = math.sqrt(sum(e * e for e in left) / (len(timed) - x.shape[1]))
    measured_noise = statistics.median(statistics.stdev(r["steps"]) / statistics.fmean(r["steps"]) / math.sqrt(len(r["steps"]))
                                       for r in timed)
    return {"candidates": len(timed), "tilt_share": math.expm1(statistics.median(errors)), "reference": reference,
            "family_tilts": {k: math.expm1(float(c)) for k, c in zip(terms, coef[1:].tolist(), strict=True)},
            "residual_share": residual, "measured_share": measured_noise,
            "own_share": math.sqrt(max(0.0, residual**2 - measured_noise**2))}


def error_sources_table(per_shape: list[tuple[dict[str, Any], list[dict[str, Any]]]]) -> str:
    lines = ["| shape | candidates | tilt (all) | family tilts (against a whole plan of the reference) "
             "| residual | measured step's standard error | residual beyond it |", "|" + "---|" * 7]
    for shape, rows in per_shape:
        src = error_sources(rows)
        if src is None:
            lines.append(f"| {shape['shape']} | too few candidates measured twice | | | | | |")
            continue
        tilts = ", ".join(f"{k} {v:+.1%}" for k, v in src["family_tilts"].items())
        lines.append(f"| {shape['shape']} | {src['candidates']} | {src['tilt_share']:+.1%} "
                     f"| {tilts} (reference {src['reference']}) | {src['residual_share']:.1%} "
                     f"| {src['measured_share']:.1%} | {src['own_share']:.1%} |")
    return "\n".join(lines)


def usable_bytes(shape: dict[str, Any], label: str) -> int:
    """The part of the budget ``label`` the shape's plans were drawn against (the module docstring)."""
    budget = shape["budgets"][label]
    return shape.get("usable_bytes", {}).get(label, budget - int(budget * PLAN_HEADROOM_FRACTION))


def members(rows: list[dict[str, Any]], budget: int, usable: int) -> list[dict[str, Any]]:
    """The candidates of a budget (see the module docstring), those that trained."""
    return [r for r in rows if r["runs_ok"] and (r.get("bounded_peak_bytes", r["predicted_peak_bytes"]) <= usable
                                                 or (r["kind"] == "uniform" and r["fit_bytes"] <= budget))]


def _paired_ratio(mine: dict[str, Any], best: dict[str, Any]) -> float:
    rounds = sorted(set(mine["by_round"]) & set(best["by_round"]))
    return statistics.median(mine["by_round"][r] / best["by_round"][r] for r in rounds)


def osdp_row(rows: list[dict[str, Any]], label: str) -> dict[str, Any] | None:
    """The row of osdp's plan at the budget ``label`` (under its own name or found first as another)."""
    return next((r for r in rows if f"osdp @ {label}" in [r["name"], *r["aliases"]]), None)


def fitting_rows(rows: list[dict[str, Any]], budget: int, usable: int) -> list[dict[str, Any]]:
    """The candidates of a budget whose measured peak fits it, fastest first."""
    return sorted((r for r in members(rows, budget, usable) if r["fit_bytes"] <= budget),
                  key=lambda r: -r["tokens_per_s"])


def budget_row(shape: dict[str, Any], rows: list[dict[str, Any]], label: str, budget: int) -> dict[str, Any]:
    """Regret ratio, osdp's rank and the Spearman correlation at one budget."""
    usable = usable_bytes(shape, label)
    mine = members(rows, budget, usable)
    fitting = fitting_rows(rows, budget, usable)
    osdp = osdp_row(rows, label)
    row: dict[str, Any] = {"shape": shape["shape"], "budget": label, "budget_bytes": budget,
                           "candidates": len(mine), "fitting": len(fitting),
                           "over_budget": [r["name"] for r in mine if r["fit_bytes"] > budget],
                           "most_of_budget": max((r["fit_bytes"] / budget for r in mine), default=None)}
    predicted, steps = [r["predicted_step_s"] for r in mine], [r["step_s"] for r in mine]
    row["noise"] = noise_share(mine)
    row["spearman"] = spearman(predicted, steps)
    row["spearman_beyond_noise"] = spearman_beyond_noise(predicted, steps, row["noise"])
    if osdp is None or not osdp["runs_ok"] or not fitting:
        row["status"] = "no osdp plan fits" if osdp is None else "no result"
        return row
    best = fitting[0]
    row.update(status="ok", osdp=osdp["name"], osdp_tokens_per_s=osdp["tokens_per_s"],
               osdp_fits=osdp["fit_bytes"] <= budget, best=best["name"], best_tokens_per_s=best["tokens_per_s"],
               regret_ratio=_paired_ratio(osdp, best) if best is not osdp else 1.0,
               osdp_rank=1 + sum(1 for r in fitting if r is not osdp and r["tokens_per_s"] > osdp["tokens_per_s"]),
               osdp_choices=choices_text(osdp["choices"]))
    return row


def finalists(shape: dict[str, Any], top: int) -> dict[str, list[str]]:
    """Per budget, osdp's plan and the ``top`` fastest other candidates that fit it, by the screening
    medians (budgets whose osdp plan did not train have none)."""
    rows = measured(shape)
    chosen: dict[str, list[str]] = {}
    for label, budget in shape["budgets"].items():
        osdp = osdp_row(rows, label)
        if osdp is not None and osdp["runs_ok"]:
            fitting = fitting_rows(rows, budget, usable_bytes(shape, label))
            chosen[label] = [osdp["name"], *[r["name"] for r in fitting if r is not osdp][:top]]
    return chosen


def confirmed_row(shape: dict[str, Any], label: str, budget: int) -> dict[str, Any] | None:
    """The regret at one budget over the confirmation rounds only: osdp's plan against the fastest
    finalist whose measured peak (every run, both stages) fits, round by round; osdp's paired ratio
    against every finalist. ``None`` without confirmation rounds at that budget."""
    names = shape.get("confirm", {}).get("finalists", {}).get(label)
    if not names:
        return None
    screened = {r["name"]: r for r in measured(shape)}
    rows = {r["name"]: r for r in measured(shape, CONFIRM) if r["runs_ok"]}
    fitting = [rows[n] for n in names if n in rows and max(rows[n]["peak_bytes"], screened[n]["peak_bytes"]) <= budget]
    row: dict[str, Any] = {"shape": shape["shape"], "budget": label, "finalists": names,
                           "rounds": min((r["runs_ok"] for r in rows.values()), default=0)}
    osdp = rows.get(names[0])
    if osdp is None or osdp not in fitting:
        return {**row, "status": "osdp did not train" if osdp is None else "osdp over budget"}
    best = max(fitting, key=lambda r: r["tokens_per_s"])
    versus = {r["name"]: _paired_ratio(osdp, r) for r in fitting if r is not osdp}
    return {**row, "status": "ok", "osdp_tokens_per_s": osdp["tokens_per_s"], "best": best["name"],
            "best_tokens_per_s": best["tokens_per_s"], "versus": versus,
            "regret_ratio": 1.0 if best is osdp else versus[best["name"]]}


def confirmed_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| shape | budget | rounds | osdp tokens/s | fastest finalist | its tokens/s | confirmed regret ratio "
             "| osdp against each finalist (paired medians) |", "|" + "---|" * 8]
    for r in rows:
        head = f"| {r['shape']} | {r['budget']} | {r['rounds']} "
        if r["status"] != "ok":
            lines.append(head + f"| {r['status']} | | | | |")
            continue
        versus = ", ".join(f"{name} {ratio:.3f}" for name, ratio in r["versus"].items()) or "-"
        lines.append(head + f"| {r['osdp_tokens_per_s']:.0f} | {r['best']} | {r['best_tokens_per_s']:.0f} "
                     f"| {r['regret_ratio']:.3f} | {versus} |")
    return "\n".join(lines)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else f"{value:{spec}}"


def regret_table(budget_rows: list[dict[str, Any]]) -> str:
    lines = ["| shape | budget | budget MiB | candidates (fit / all) | osdp tokens/s | best candidate | best tokens/s "
             "| regret ratio | osdp rank | Spearman (pred vs measured step) | noise | Spearman beyond noise "
             "| over budget (measured) |",
             "|" + "---|" * 13]
    for r in budget_rows:
        head = f"| {r['shape']} | {r['budget']} | {r['budget_bytes'] / MIB:.2f} | {r['fitting']} / {r['candidates']} "
        over = ", ".join(r["over_budget"]) or "none"
        rhos = (f"| {_fmt(r['spearman'], '.2f')} | {_fmt(r.get('noise'), '.1%')} "
                f"| {_fmt(r.get('spearman_beyond_noise'), '.2f')} | {over} |")
        if r["status"] != "ok":
            lines.append(head + f"| {r['status']} | | | | | " + rhos)
            continue
        osdp_note = "" if r["osdp_fits"] else " (**over budget**)"
        lines.append(head + f"| {r['osdp_tokens_per_s']:.0f}{osdp_note} | {r['best']} | {r['best_tokens_per_s']:.0f} "
                     f"| {r['regret_ratio']:.3f} | {r['osdp_rank']} of {r['fitting']} " + rhos)
    return "\n".join(lines)


def candidates_table(shape: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    budgets = shape["budgets"]
    lines = [f"shape {shape['shape']} ({shape['units']} units; all-replicate peak "
             f"{shape['replicate_peak_bytes'] / MIB:.2f} MiB):", "",
             "| candidate | also found as | predicted step s | measured step s | tokens/s | predicted peak MiB "
             "| measured peak MiB | own memory MiB | fits (measured) | plan |", "|" + "---|" * 10]
    for r in sorted(rows, key=lambda r: r.get("step_s", float("inf"))):
        if not r["runs_ok"]:
            lines.append(f"| {r['name']} | {', '.join(r['aliases'])} | {r['predicted_step_s']:.4f} "
                         f"| {'failed' if r['runs_failed'] else 'not run'} | | | | | | |")
            continue
        fits = ", ".join(label for label, b in budgets.items() if r["fit_bytes"] <= b) or "none"
        lines.append(f"| {r['name']} | {', '.join(r['aliases'])} | {r['predicted_step_s']:.4f} | {r['step_s']:.4f} "
                     f"| {r['tokens_per_s']:.0f} | {r['predicted_peak_bytes'] / MIB:.2f} | {r['peak_bytes'] / MIB:.2f} "
                     f"| {_fmt(r['own_bytes'] / MIB if r['own_bytes'] else None, '.2f')} | {fits} | {choices_text(r['choices'])} |")
    return "\n".join(lines)


def _regret_verdict(what: str, ratios: list[float]) -> str:
    return (f"- {what} >= {REGRET_TARGET} at every budget: "
            + ("n/a" if not ratios else f"{'MET' if min(ratios) >= REGRET_TARGET else 'MISSED'} (lowest {min(ratios):.3f})"))


def verdicts(budget_rows: list[dict[str, Any]], confirmed: Sequence[dict[str, Any]] = ()) -> list[str]:
    ok = [r for r in budget_rows if r["status"] == "ok"]
    rhos = [r["spearman_beyond_noise"] for r in budget_rows if r.get("spearman_beyond_noise") is not None]
    lines = [_regret_verdict("regret ratio", [r["regret_ratio"] for r in ok])]
    if confirmed:
        lines.append(_regret_verdict("confirmed regret ratio", [r["regret_ratio"] for r in confirmed if r["status"] == "ok"]))
    most = [r["most_of_budget"] for r in budget_rows if r.get("most_of_budget") is not None]
    over = sum(len(r["over_budget"]) for r in budget_rows)
    lines.append("- every candidate of a budget within it (measured; own memory under process budgets): "
                 + ("n/a" if not most else f"{'MET' if not over else 'MISSED'} (highest {max(most):.1%} of its budget"
                    + (f"; {over} over)" if over else ")")))
    return [*lines,
            f"- Spearman(predicted, measured step) beyond the run's noise >= {SPEARMAN_TARGET}: "
            + ("n/a" if not rhos else f"{'MET' if min(rhos) >= SPEARMAN_TARGET else 'MISSED'} "
               f"(lowest {min(rhos):.2f}, median {statistics.median(rhos):.2f})"),
            "- osdp within its budget (measured): "
            + ("MET" if all(r["osdp_fits"] for r in ok) else "MISSED")]


def write_outputs(out_dir: Path, machine: dict[str, Any], shapes: list[dict[str, Any]], plot: bool = True) -> str:
    """Write regret.md, regret_runs.json (and regret.png); return the markdown."""
    (out_dir / "regret_runs.json").write_text(json.dumps({"machine": machine, "shapes": shapes}, separators=(",", ":"),
                                                         default=str) + "\n")
    per_shape = [(shape, measured(shape)) for shape in shapes]
    budget_rows = [budget_row(shape, rows, label, budget) for shape, rows in per_shape
                   for label, budget in shape["budgets"].items()]
    confirmed = [row for shape in shapes for label, budget in shape["budgets"].items()
                 if (row := confirmed_row(shape, label, budget)) is not None]
    parts = [f"machine: {json.dumps(machine, default=str)}", "", regret_table(budget_rows), ""]
    if confirmed:
        parts += ["confirmed (osdp and the fastest candidates of the rounds above, trained again; only these "
                  "rounds are paired):", "", confirmed_table(confirmed), ""]
    parts += ["targets:", *verdicts(budget_rows, confirmed), "",
              "where the prediction errors come from (log errors; see the module docstring):", "",
              error_sources_table(per_shape), ""]
    for shape, rows in per_shape:
        parts += [candidates_table(shape, rows), ""]
    if plot:
        from benchmarks.regret_plot import plot_regret

        plot_regret(out_dir / "regret.png", per_shape, machine)
        parts.append(f"plot: {out_dir / 'regret.png'}")
    text = "\n".join(parts)
    (out_dir / "regret.md").write_text(text + "\n")
    return text
