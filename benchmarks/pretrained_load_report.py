"""Records and report of :mod:`benchmarks.pretrained_load`: one launch's files read back, tables, verdicts.

Pure functions of the saved records (``pretrained_load_runs.json``), so that a report renders again
without running anything (``--report-only``).
"""

from __future__ import annotations

import csv
import json
import re
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

MIB = 2**20
SMALLEST_RE = re.compile(r"\((\d+) bytes")
"""The smallest budget osdp names in its InfeasibleBudgetError: ``... that fits is 1.21 GiB (1302006785 bytes``."""
MEMORY_TARGET = 1.10
"""Every rank's resident high-water mark above the fixed cost, at most this times its budget."""
LOAD_TARGET = 2.0
"""osdp's load at most this times ``from_pretrained``'s."""
FIRST_LOSS_RTOL, LOSSES_RTOL = 1e-6, 1e-4


# -- one launch ------------------------------------------------------------------------------------
def read_losses(metrics_csv: Path) -> list[float]:
    """``train/loss`` of every logged step of a CSVLogger's ``metrics.csv``, in step order."""
    if not metrics_csv.is_file():
        return []
    with metrics_csv.open() as handle:
        rows = [r for r in csv.DictReader(handle) if r.get("train/loss")]
    return [float(r["train/loss"]) for r in sorted(rows, key=lambda r: int(r["step"]))]


def choice_counts(plan: dict[str, Any]) -> dict[str, int]:
    return dict(Counter(unit["choice"] for unit in plan.get("units", [])).most_common())


def read_run(run_dir: Path, log: str, code: int | str) -> dict[str, Any]:
    """What one 2-rank osdp-train launch left in ``run_dir`` (summary, plan, losses, each rank's record)."""
    record: dict[str, Any] = {"returncode": code,
                              "ranks": [json.loads(p.read_text()) for p in sorted(run_dir.glob("rank*.json"))]}
    if (run_dir / "summary.json").is_file():
        record["summary"] = json.loads((run_dir / "summary.json").read_text())
    if (run_dir / "plan.json").is_file() and record.get("summary", {}).get("strategy", "osdp") == "osdp":
        plan = json.loads((run_dir / "plan.json").read_text())
        record.update(choices=choice_counts(plan), plan_source=plan.get("source"),
                      solver_status=plan.get("solver_status"))
    record["losses"] = read_losses(run_dir / "csv" / "metrics.csv")
    if code == 0 and "summary" in record:
        record["status"] = "ok"
    elif "InfeasibleBudgetError" in log and (match := SMALLEST_RE.search(log)):
        record.update(status="infeasible", smallest_feasible_bytes=int(match.group(1)))
    else:
        record.update(status="error", message=log[-3000:])
    return record


def progress_line(record: dict[str, Any]) -> str:
    s = record.get("summary") or {}
    loads = [r["load"]["load_s"] for r in record.get("ranks", []) if "load" in r]
    parts = [f"{record.get('label', '?')}: {record['status']}"]
    if record["status"] == "infeasible":
        parts.append(f"smallest budget {record['smallest_feasible_bytes'] / MIB:.1f} MiB")
    if s:
        parts.append(f"step {s['step_s']:.3f} s, peak {s['peak_bytes'] / MIB:.1f} MiB")
    if loads:
        cache = [r["page_cache"] for r in record.get("ranks", []) if "page_cache" in r]
        parts.append("load " + " / ".join(f"{x:.3f}" for x in loads) + " s"
                     + (f" ({cache[0]['state']}; {100 * cache[0]['resident_before']:.0f}% held before)" if cache else ""))
    if record.get("choices"):
        parts.append(choices_text(record["choices"]))
    return "; ".join(parts) + f" [{record.get('wall_s', 0):.0f} s, load {record.get('load_average', '?')}]"


def choices_text(choices: dict[str, int]) -> str:
    return ", ".join(f"{c} x{n}" for c, n in choices.items())


# -- load time and memory ---------------------------------------------------------------------------
def hwm_above_fixed(record: dict[str, Any], fixed: dict[str, Any] | None) -> list[int | None]:
    """Per rank: the high-water mark after the last step less the fixed cost's on the same rank."""
    fixed_by_rank = {r["rank"]: r.get("hwm_after_steps_bytes") for r in (fixed or {}).get("ranks", [])}
    out: list[int | None] = []
    for rank in record.get("ranks", []):
        base = fixed_by_rank.get(rank["rank"])
        hwm = rank.get("hwm_after_steps_bytes")
        out.append(hwm - base if hwm is not None and base is not None else None)
    return out


def memory_table(load: dict[str, Any]) -> tuple[list[str], float | None]:
    """One row per 110M launch and per fixed-cost launch; and the worst ratio of any osdp launch's
    rank (above its fixed cost / budget)."""
    budget = next((r["summary"]["memory_budget_bytes"] for r in load.get("osdp", []) if r["status"] == "ok"), None)
    lines = ["| launch | plan | after setup (plan applied, weights in), rank 0 / 1 (MiB) | after the steps (MiB) | "
             "file-backed, rank 0 (MiB) | fixed cost | above it (MiB) | x budget | tracked peak (MiB) | step s | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    worst: float | None = None
    fixed = load.get("fixed") or {}
    named = [(r["label"], r) for r in load.get("osdp", [])]
    named += [(name, load[name]) for name in ("eager", "ddp") if load.get(name)]
    named += [(f"fixed ({kind})", record) for kind, record in fixed.items()]
    for name, record in named:
        if record["status"] != "ok":
            lines.append(f"| {name} | {record['status']} | | | | | | | | | {record.get('wall_s', 0):.0f} |")
            continue
        kind = record.get("fixed_kind")
        above = hwm_above_fixed(record, fixed.get(kind)) if kind else []
        ratios = [a / budget for a in above if a is not None and budget]
        if any(record is r for r in load.get("osdp", [])) and ratios:
            worst = max([worst or 0.0, *ratios])
        hwm = " / ".join(f"{r['hwm_after_steps_bytes'] / MIB:.0f}" for r in record["ranks"])
        setup = " / ".join(f"{r['setup_hwm_bytes'] / MIB:.0f}" for r in record["ranks"])
        file_backed = record["ranks"][0].get("resident_after_steps", {}).get("RssFile")
        s = record["summary"]
        lines.append(f"| {name} | {choices_text(record.get('choices', {})) or 'ddp'} | {setup} | {hwm} | "
                     f"{f'{file_backed / MIB:.0f}' if file_backed is not None else '-'} | {kind or '-'} | {' / '.join(f'{a / MIB:.0f}' for a in above if a is not None) or '-'} | "
                     f"{' / '.join(f'{x:.2f}' for x in ratios) or '-'} | {s['peak_bytes'] / MIB:.0f} | "
                     f"{s['step_s']:.2f} | {record.get('wall_s', 0):.0f} |")
    return lines, worst


def memory_verdict(load: dict[str, Any]) -> list[str]:
    """The memory target over a part's osdp launches, at their budget and sequence."""
    first = load["osdp"][0]
    where = " ".join(o.split(".")[-1] for o in first.get("overrides", []) if "memory_budget" in o or "seq_len" in o)
    _, worst = memory_table(load)
    if worst is None:
        smallest = first.get("smallest_feasible_bytes")
        what = f"no plan fits; the smallest budget osdp names is {smallest / MIB:.0f} MiB" if smallest else first["status"]
        return [f"- every rank's high-water mark above the fixed cost <= {MEMORY_TARGET:.2f}x its budget ({where}): "
                f"**not measured** ({what})"]
    return [f"- every rank's high-water mark above the fixed cost <= {MEMORY_TARGET:.2f}x its budget ({where}): "
            f"{'**holds**' if worst <= MEMORY_TARGET else '**no**'} (worst {worst:.2f}x)"]


def budget_text(load: dict[str, Any]) -> str:
    budget = next((r["summary"]["memory_budget_bytes"] for r in load.get("osdp", []) if r["status"] == "ok"), None)
    return f"{budget / MIB:.0f} MiB per rank" if budget else "no osdp launch trained"


def page_cache_of(record: dict[str, Any], timed: dict[str, Any]) -> tuple[str, str]:
    """The page cache a launch loaded from (``warm``, ``cold`` or ``as found``), and its table cell."""
    found = [r["page_cache"] for r in record.get("ranks", []) if "page_cache" in r]
    state = found[0]["state"] if found else timed.get("page_cache", "as found")
    held = " / ".join(f"{100 * f['resident_before']:.0f}%" for f in found)
    return state, f"{held} held, then {state}" if held else state


def load_rows(load: dict[str, Any]) -> list[dict[str, Any]]:
    """Per osdp launch that loaded: its slower rank's seconds against from_pretrained timed just before it."""
    rows = []
    for record, timed in zip(load.get("osdp", []), load.get("from_pretrained", []), strict=False):
        reports = [r["load"] for r in record.get("ranks", []) if "load" in r]
        if not reports:
            continue
        slow = max(r["load_s"] for r in reports)
        call, read = statistics.median(timed["call_s"]), statistics.median(timed["read_s"])
        cache, cell = page_cache_of(record, timed)
        rows.append({"label": record["label"], "cache": cache, "cache_cell": cell, "reports": reports, "slow_s": slow,
                     "call_s": call, "first_call_s": timed["call_s"][0], "read_s": read, "ratio": slow / call,
                     "read_ratio": slow / read, "load_average": record.get("load_average", "?")})
    return rows


def load_table(load: dict[str, Any]) -> list[str]:
    """Per osdp launch: the page cache, each rank's load seconds and bytes read, beside from_pretrained."""
    lines = ["| launch | page cache at the load (of the file; rank 0 / 1) | osdp load s, rank 0 / 1 | bytes read, "
             "rank 0 / 1 (of the file) | from_pretrained s, median of 3 (first call) | + reading every weight s | "
             "osdp (slower rank) x from_pretrained | x from_pretrained + reading | load average |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in load_rows(load):
        share = " / ".join(f"{r['bytes_read'] / MIB:.0f} MiB ({100 * r['bytes_read'] / r['file_bytes']:.0f}%)"
                           for r in row["reports"])
        seconds = " / ".join(f"{r['load_s']:.3f}" for r in row["reports"])
        lines.append(f"| {row['label']} | {row['cache_cell']} | {seconds} | {share} | {row['call_s']:.3f} "
                     f"({row['first_call_s']:.3f}) | {row['read_s']:.3f} | {row['ratio']:.1f}x | "
                     f"{row['read_ratio']:.2f}x | {row['load_average']} |")
    return lines


def load_verdicts(load: dict[str, Any]) -> list[str]:
    """The time target over every launch, each against from_pretrained timed under the same page cache
    (median, and the worst launch); the cold launch's figures apart."""
    rows = load_rows(load)
    if not rows:
        return []
    median, worst = statistics.median(r["ratio"] for r in rows), max(rows, key=lambda r: r["ratio"])
    held = ("**holds**" if worst["ratio"] <= LOAD_TARGET else "**holds by the median**" if median <= LOAD_TARGET
            else "**no**")
    each = " / ".join(f"{r['ratio']:.2f}x ({r['cache']})" for r in rows)
    lines = [f"- osdp's load (its slower rank) <= {LOAD_TARGET:.0f}x from_pretrained's time, each timed under the "
             f"same page cache: {held} (median {median:.2f}x, worst {worst['ratio']:.2f}x ({worst['label']}) over "
             f"{len(rows)} launches: {each}; {statistics.median(r['read_ratio'] for r in rows):.2f}x from_pretrained "
             "followed by reading every weight once)"]
    for r in (r for r in rows if r["cache"] == "cold"):
        lines.append(f"- from a cold page cache ({r['label']}): osdp {r['slow_s']:.3f} s, from_pretrained "
                     f"{r['call_s']:.3f} s ({r['ratio']:.2f}x), from_pretrained followed by reading every weight once "
                     f"{r['read_s']:.3f} s ({r['read_ratio']:.2f}x)")
    return lines


# -- correctness matrix ------------------------------------------------------------------------------
def rel_diffs(losses: list[float], reference: list[float]) -> list[float]:
    return [abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=False)]


def matrix_table(matrix: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """One row per osdp launch against its case's ddp; and the launches that miss a tolerance or fail.
    A budget no plan fits is a row, not a miss."""
    lines = ["| case | launch | budget (MiB) | plan | tracked peak x budget | first loss | rel. diff, first | "
             "rel. diff, worst step | holds |", "|---|---|---|---|---|---|---|---|---|"]
    misses: list[str] = []
    ddp = {r["case"]: r.get("losses", []) for r in matrix if r.get("run") == "ddp" and r["status"] == "ok"}
    for record in matrix:
        case, run = record["case"], record["run"]
        if run == "ddp":
            lines.append(f"| {case} | Lightning ddp (from_pretrained) | | | | {_first(record)} | | | reference |")
            continue
        if record["status"] != "ok":
            smallest = record.get("smallest_feasible_bytes")
            what = f"no plan fits; smallest {smallest / MIB:.2f} MiB" if smallest else record["status"]
            lines.append(f"| {case} | {run} | | {what} | | | | | |")
            if record["status"] == "error":
                misses.append(f"{case} {run}: error")
            continue
        diffs = rel_diffs(record["losses"], ddp.get(case, []))
        steps_match = len(record["losses"]) == len(ddp.get(case, [])) and diffs
        holds = bool(steps_match) and diffs[0] <= FIRST_LOSS_RTOL and max(diffs) <= LOSSES_RTOL
        if not holds:
            misses.append(f"{case} {run}")
        s = record["summary"]
        lines.append(f"| {case} | {run} | {s['memory_budget_bytes'] / MIB:.2f} | "
                     f"{choices_text(record.get('choices', {}))} | {s['peak_bytes'] / s['memory_budget_bytes']:.2f} | "
                     f"{_first(record)} | {diffs[0] if diffs else float('nan'):.1e} | "
                     f"{max(diffs) if diffs else float('nan'):.1e} | {'yes' if holds else '**no**'} |")
    return lines, misses


def _first(record: dict[str, Any]) -> str:
    return f"{record['losses'][0]:.6f}" if record.get("losses") else "-"


def matrix_choices(matrix: list[dict[str, Any]]) -> list[str]:
    """The kinds of choice (replicate, zero2, zero3, split, +ckpt) the matrix's plans used."""
    kinds: set[str] = set()
    for record in matrix:
        for choice in record.get("choices", {}):
            base, _, ckpt = choice.partition("+")
            kinds.add(base.split("(")[0].split(":")[0])
            if ckpt:
                kinds.add("+" + ckpt)
    order = ["replicate", "zero2", "zero3", "split", "+ckpt"]
    return sorted(kinds, key=lambda k: (order.index(k) if k in order else len(order), k))


# -- verdicts and the report ---------------------------------------------------------------------
def verdicts(saved: dict[str, Any]) -> list[str]:
    """One line per target: held or not, with its figure."""
    lines: list[str] = []
    for part in ("load", "long"):
        load = saved.get(part) or {}
        if load.get("osdp"):
            lines += memory_verdict(load)
        if part == "load" and load.get("osdp"):
            lines += load_verdicts(load)
    if saved.get("matrix"):
        _, misses = matrix_table(saved["matrix"])
        runs = [r for r in saved["matrix"] if r.get("run") not in ("probe", "ddp") and r["status"] != "infeasible"]
        lines.append(f"- first loss within {FIRST_LOSS_RTOL:g} and every step within {LOSSES_RTOL:g} of Lightning's "
                     f"ddp (relative): {'**holds**' if not misses else '**no**'} ({len(runs) - len(misses)} of "
                     f"{len(runs)} launches hold{'; not: ' + ', '.join(misses) if misses else ''}); plans used "
                     f"{', '.join(matrix_choices(saved['matrix']))}")
    export = saved.get("export") or {}
    if export.get("status") == "ok":
        lines.append(f"- the export loads with from_pretrained bit for bit: {'**holds**' if export['equal'] else '**no**'}"
                     f" ({export['tensors']} tensors; osdp-export {export['wall_s']:.1f} s, "
                     f"{export['file_bytes'] / MIB:.0f} MiB)")
    elif export:
        lines.append(f"- export: {export.get('status')} ({export.get('message', '')[:200]})")
    return lines


def load_section(load: dict[str, Any]) -> list[str]:
    model = load["model"]
    out = ["## Load time and memory", "",
           f"{model['type']} of {model['param_count'] / 1e6:.1f}M parameters, `model.safetensors` "
           f"{model['file_bytes'] / 1e6:.0f} MB (fp32). osdp launches: `{load['command']}` (the first solves "
           "the plan; the others train from it with `strategy.plan=`, `osdp_cold` too). `eager`: the same plan, "
           "built by `from_pretrained` on every rank (`meta_init=false`). `ddp`: Lightning's `strategy=ddp` from "
           "the same directory. `fixed (solve | plan | ddp)`: a 1 x 16 Llama through the same command as the "
           "launches it is subtracted from (solving its plan, which calibrates; from a saved plan; Lightning's "
           "ddp).", ""]
    probe = load.get("probe")
    if probe:
        smallest = probe.get("smallest_feasible_bytes")
        out += [f"At `{' '.join(o for o in probe['overrides'] if 'memory_budget' in o)}`: {probe['status']}"
                + (f"; the smallest budget osdp names is {smallest / MIB:.0f} MiB ({smallest} bytes)."
                   if smallest else "."), ""]
    out += ["Loading, each launch beside `from_pretrained` timed in a fresh process just before it under the "
            "same page cache: the file read once before each call and before osdp's load (`warm`), or its "
            "pages dropped (`posix_fadvise(DONTNEED)`, `cold`); the share of the file the page cache held "
            "when the load began (`mincore`; this VM pages out a file left unread for a minute), then what "
            "the benchmark made of it:", "", *load_table(load), ""]
    return out + memory_section(load)


def long_section(long: dict[str, Any]) -> list[str]:
    out = ["## A budget DDP's state does not fit, at a long sequence", "",
           f"`{long['command']}`, then the 1 x 16 Llama through the same command (solving its plan) for the "
           "fixed cost.", ""]
    first = long["osdp"][0]
    if first["status"] != "ok":
        smallest = first.get("smallest_feasible_bytes")
        return out + [f"{first['status']}: " + (f"the smallest budget osdp names is {smallest / MIB:.0f} MiB."
                                                if smallest else first.get("message", "")[-1500:]), ""]
    s = first["summary"]
    loads = " / ".join(f"{r['load']['load_s']:.3f}" for r in first["ranks"] if "load" in r)
    losses = " / ".join(f"{x:.3f}" for x in first.get("losses", []))
    return out + [f"Plan: {choices_text(first.get('choices', {}))}; tracked peak {s['peak_bytes'] / MIB:.0f} MiB; "
                  f"step {s['step_s']:.1f} s; losses {losses}; each rank's load {loads} s.", "",
                  *memory_section(long)]


def render(saved: dict[str, Any]) -> str:
    m = saved.get("machine", {})
    out = ["# Pretrained weights on 2 CPU ranks", "",
           f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, {m.get('memory_gib', '?')} GiB; torch "
           f"{m.get('torch', '?')}, Python {m.get('python', '?')}; {m.get('date', '?')}, commit {m.get('commit', '?')}; "
           f"load average {m.get('load_average_start', '?')} at the start, {m.get('load_average_end', '?')} at the end; "
           f"{m.get('total_wall_s', 0) / 60:.0f} minutes.", "", f"`{m.get('command', '')}`", "",
           *(["**The run stopped part-way: what follows is what it measured.**", ""] if m.get("complete") is False
             else []), *[line for note in saved.get("notes", []) for line in (note, "")], "## Verdicts", "",
           *verdicts(saved), ""]
    if saved.get("load"):
        out += load_section(saved["load"])
    if (saved.get("long") or {}).get("osdp"):
        out += long_section(saved["long"])
    if saved.get("matrix"):
        lines, _ = matrix_table(saved["matrix"])
        out += ["## Correctness: osdp against Lightning's ddp from the same weights", "",
                "Builds: `meta` (meta_init=true, osdp loads), `eager-load` (random weights, then osdp loads: "
                "`+strategy.pretrained=DIR`), `eager-from_pretrained` (every rank builds by from_pretrained). "
                "Relative differences of `train/loss` per step (csv/metrics.csv).", "", *lines, ""]
    export = saved.get("export")
    if export and export.get("status") == "ok":
        out += ["## Export", "", f"`{export['command']}`: {export['wall_s']:.1f} s wall (load average "
                f"{export['load_average']}); {export['file_bytes'] / MIB:.0f} MiB of safetensors from a "
                f"{export['checkpoint_bytes'] / MIB:.0f} MiB sharded checkpoint (weights and Adam state); "
                f"from_pretrained of it {export['from_pretrained_s']:.2f} s; equal to the checkpoint's weights bit "
                f"for bit: {export['equal']}.", ""]
    return "\n".join(out)


def memory_section(load: dict[str, Any]) -> list[str]:
    lines, _ = memory_table(load)
    return ["Resident high-water mark (`VmHWM`, `MALLOC_MMAP_THRESHOLD_=65536`) after setup and after the last "
            "step (before any checkpoint is written), each rank less its fixed cost's same rank, against the "
            f"budget ({budget_text(load)}):", "", *lines, ""]


def write_outputs(out_dir: Path, saved: dict[str, Any]) -> str:
    text = render(saved)
    (out_dir / "pretrained_load.md").write_text(text + "\n")
    (out_dir / "pretrained_load_runs.json").write_text(json.dumps(saved, indent=1, default=str) + "\n")
    return text
