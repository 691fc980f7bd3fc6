"""A prototype of the step-time terms the cost model lacks, fitted on the baselines, checked on osdp.

The plan predicts ``step = profiled fwd+bwd + collectives``. The measured step also holds

- FSDP2's own work per unit (copy-in/out around every all-gather and reduce-scatter, allocating
  and freeing the unsharded parameters, hooks), which depends on the unit's choice;
- the optimizer step (AdamW over DTensors: full size for replicate, 1/W for sharded units);
- the loop's fixed cost (Lightning, data, logging), the same for every plan.

From the three uniform runs (all-replicate, all-zero2, all-zero3) this module takes, per choice,
seconds per parameter of the first two (``fwd + bwd - profiled - predicted comm`` and the
optimizer phase, each divided by the parameter count) and the fixed remainder; then it predicts
each osdp run from its own plan, unit by unit. The osdp runs play no part in the fit, so their
errors say how much of the gap such per-choice terms, if measured at calibration, would close.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.compare_report import label_of
from osdp_lightning.choices import BASELINES, parse, resolve

# NOTE: the uniform replicate run is osdp-replicate; "ddp" is Lightning's own DDP (no plan, no profile).
_UNIFORM = {("osdp-replicate" if name == "ddp" else name): str(resolve(name)) for name in BASELINES}


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _has_phases(run: dict) -> bool:
    return {"forward_s", "backward_s", "optimizer_s"} <= set(run.get("phases", {}))


def _plan_params(run: dict) -> int:
    return sum(u["param_count"] for u in run["plan"]["units"])


def fit_terms(runs: list[dict]) -> dict[str, Any] | None:
    """Per-choice seconds per parameter (FSDP2 own work, optimizer) and the fixed per-step rest."""
    own, opt, rest = {}, {}, []
    for method, choice in _UNIFORM.items():
        mine = [r for r in runs if r["method"] == method and r["status"] == "ok" and _has_phases(r)]
        if not mine:
            return None
        own[choice] = _median([(r["phases"]["forward_s"] + r["phases"]["backward_s"] - r["profile_step_s"]
                                - sum(u["predicted_comm_s"] for u in r["plan"]["units"])) / _plan_params(r)
                               for r in mine])
        opt[choice] = _median([r["phases"]["optimizer_s"] / _plan_params(r) for r in mine])
        rest += [r["summary"]["step_s"] - sum(r["phases"].values()) for r in mine]
    return {"own_s_per_param": own, "optimizer_s_per_param": opt, "fixed_s": _median(rest)}


def choice_mix(choice: str) -> dict[str, float]:
    """Shares of a unit's parameters under each base choice (a split's sharded slices are zero3)."""
    if choice in _UNIFORM.values():
        return {choice: 1.0}
    parsed = parse(choice)
    if parsed.kind == "split":
        k, sharded = parsed["k"], parsed["sharded"]
        return {"zero3": sharded / k, "replicate": (k - sharded) / k}
    return {"zero3": 1.0}  # hsdp and the like: the closest base choice


def corrected_step_s(run: dict, terms: dict[str, Any]) -> float:
    """The run's plan priced with the fitted terms added to its own profile and collectives."""
    step = run["profile_step_s"] + terms["fixed_s"]
    for unit in run["plan"]["units"]:
        step += unit["predicted_comm_s"]
        for choice, share in choice_mix(unit["choice"]).items():
            rate = terms["own_s_per_param"][choice] + terms["optimizer_s_per_param"][choice]
            step += rate * share * unit["param_count"]
    return step


def _priced_rows(runs: list[dict], terms: dict[str, Any], methods: tuple[str, ...]) -> list[str]:
    groups: dict[str, list[dict]] = {}
    for run in runs:
        if run["method"] in methods and run["status"] == "ok" and _has_phases(run):
            groups.setdefault(label_of(run["method"], run["fraction"]), []).append(run)
    lines = []
    for label, mine in groups.items():
        measured = _median([r["summary"]["step_s"] for r in mine])
        planned = _median([r["summary"]["predicted_step_s"] for r in mine])
        corrected = _median([corrected_step_s(r, terms) for r in mine])
        lines.append(f"| {label} | {measured:.4f} | {planned:.4f} ({100 * (planned / measured - 1):+.1f}%) "
                     f"| {corrected:.4f} ({100 * (corrected / measured - 1):+.1f}%) |")
    return lines


def describe_terms(terms: dict[str, Any]) -> str:
    return ("fitted on the uniform runs (ns per parameter per step): "
            + ", ".join(f"{c}: FSDP2 own {1e9 * terms['own_s_per_param'][c]:.1f}, optimizer "
                        f"{1e9 * terms['optimizer_s_per_param'][c]:.1f}" for c in _UNIFORM.values())
            + f"; fixed {1e3 * terms['fixed_s']:.1f} ms per step")


def fit_table(runs: list[dict]) -> str:
    """Markdown: the fitted terms, then plan-predicted vs corrected step error for every osdp row."""
    terms = fit_terms(runs)
    if terms is None:
        return "(no fit: the ddp, zero2 and zero3 runs are all needed)"
    head = ["| method | measured step s | plan's prediction s (err) | with fitted terms s (err) |", "|---|---|---|---|"]
    return "\n".join([describe_terms(terms), "", *head, *_priced_rows(runs, terms, ("osdp",))])


def transfer_table(fit_runs: list[dict], check_runs: list[dict]) -> str:
    """Terms fitted on one benchmark's uniform runs, priced on every run of another (another model size)."""
    terms = fit_terms(fit_runs)
    if terms is None:
        return "(no fit: the ddp, zero2 and zero3 runs are all needed)"
    head = ["| method | measured step s | plan's prediction s (err) | with transferred terms s (err) |",
            "|---|---|---|---|"]
    return "\n".join([describe_terms(terms), "", *head,
                      *_priced_rows(check_runs, terms, (*_UNIFORM, "osdp"))])


def main() -> None:
    """``python -m benchmarks.compare_fit FIT/compare_runs.json CHECK/compare_runs.json``."""
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("fit_runs", type=Path)
    parser.add_argument("check_runs", type=Path)
    args = parser.parse_args()
    print(transfer_table(json.loads(args.fit_runs.read_text())["runs"], json.loads(args.check_runs.read_text())["runs"]))


if __name__ == "__main__":
    main()
