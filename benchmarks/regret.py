"""Plan regret: how far osdp's plan is from the fastest plan that really runs at the same budget.

    python -m benchmarks.regret                          # both shapes, budgets 100/85/70%, 20 random plans
    ./dev bench regret --shapes default --fractions 1.0,0.7 --random 4 --next-best 2 --rounds 3

Per model shape (``--shapes``: the benchmark's default GPT, and the same with 128-token sequences):

1. a planning launch: the strategy profiles and solves at a budget everything fits (the worker's
   default); its profile and measured collective figures price every candidate of the shape;
2. round 0 starts with the all-replicate plan, whose measured peak sets the budgets
   (``--fractions`` of it; ``--budget-covers process``: of its own memory above its fixed cost,
   each run with ``compare.PROCESS_ENV``, and a run fits when its own memory does); then the
   candidates of every budget are drawn
   (:mod:`benchmarks.regret_candidates`): osdp's plan, the uniform baselines, the ``--next-best``
   best plans that are not osdp's, and ``--random`` random plans that fit;
3. every distinct plan is trained once per round (``--plan``, so setup does not profile or solve
   and the plan is the only difference), on the same data and seed, the order rotated one place
   each round (:func:`osdp_lightning.calibrate.bench.rotated`); rows report medians over rounds;
4. with ``--confirm-rounds``, osdp's plan and the ``--confirm-top`` fastest others that fit each
   budget are trained that many rounds more, rotated, for a regret measured apart from the rounds
   that picked them (:mod:`benchmarks.regret_report`).

Reports per shape and budget (:mod:`benchmarks.regret_report`): osdp's throughput over the best
measured candidate whose measured peak fits (the regret ratio), osdp's rank, the Spearman
correlation of predicted and measured step times, and a scatter plot of the two.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from osdp_lightning.recipes.text import python_docs_corpus

from benchmarks import compare, regret_report
from benchmarks.regret_candidates import (
    Candidate,
    Pricing,
    next_best_candidates,
    osdp_candidate,
    random_candidates,
    uniform_candidates,
)
from benchmarks.runs_file import read_runs
from osdp_lightning.calibrate.bench import rotated

SHAPES: dict[str, dict[str, int]] = {
    "default": {}, "seq128": {"seq_len": 128},
    "5x320_seq96": {"n_layer": 5, "n_embd": 320, "n_head": 5, "seq_len": 96},
}
"""Model shapes: overrides of the preset. ``5x320_seq96`` is held out: no cost-model term was tuned on it."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.regret", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(compare.PRESETS), default="cpu")
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default: the preset's)")
    parser.add_argument("--shapes", default="default,seq128", help=f"comma-separated, of {sorted(SHAPES)}")
    parser.add_argument("--fractions", default="1.0,0.85,0.7",
                        help="budgets as fractions of the measured all-replicate peak")
    parser.add_argument("--random", type=int, default=20, help="random feasible plans per budget")
    parser.add_argument("--next-best", type=int, default=3, help="next-best solver plans per budget")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--confirm-rounds", type=int, default=0,
                        help="rounds of the finalists after the screening rounds (0: none)")
    parser.add_argument("--confirm-top", type=int, default=2,
                        help="finalists per budget besides osdp's plan: the fastest that fit, by the screening")
    parser.add_argument("--seed", type=int, default=0, help="training seed; random plans use it too")
    parser.add_argument("--budget-covers", choices=("tensors", "process"), default="tensors",
                        help="tensors: budgets are fractions of the all-replicate run's tracked peak, and a run fits "
                             "when its tracked peak does; process: of its own memory above its fixed cost, and a run "
                             "fits when its own memory does (the candidates are priced as the strategy prices a "
                             "budget in bytes that covers the same: OSDPConfig.budget_covers)")
    compare.add_run_arguments(parser, "regret", run_timeout_s=600.0)
    return parser


def budget_label(fraction: float) -> str:
    return f"{100 * fraction:.0f}%"


class Pool:
    """Distinct plans in the order they were added; a plan found twice keeps its first name."""

    def __init__(self) -> None:
        self.by_key: dict[tuple, Candidate] = {}
        self.aliases: dict[str, list[str]] = {}

    def add(self, cand: Candidate) -> None:
        first = self.by_key.setdefault(cand.key, cand)
        self.aliases.setdefault(first.name, [])
        if first is not cand:
            self.aliases[first.name].append(cand.name)

    def candidates(self) -> list[Candidate]:
        return list(self.by_key.values())

    def records(self) -> list[dict[str, Any]]:
        return [{**c.as_dict(), "aliases": self.aliases[c.name]} for c in self.candidates()]


def draw_candidates(pool: Pool, pricing: Pricing, budgets: dict[str, int], args: argparse.Namespace) -> None:
    """osdp's plan, the next-best plans and the random plans of every budget, into ``pool``."""
    for label, budget in budgets.items():
        osdp = osdp_candidate(pricing, budget, label)
        if osdp is None:
            print(f"  {label}: no plan fits {budget / 2**20:.2f} MiB", flush=True)
            continue
        pool.add(osdp)
        for cand in next_best_candidates(pricing, budget, osdp, args.next_best, label):
            pool.add(cand)
        for cand in random_candidates(pricing, budget, args.random, args.seed + budget, label):
            pool.add(cand)


def train(cand: Candidate, round_index: int, settings: dict[str, int], args: argparse.Namespace, work: Path,
          shape: str, stage: str = regret_report.SCREEN) -> dict[str, Any]:
    """One 2-rank run of one candidate, applied from its saved plan; its record, without the bulky plan."""
    safe = "".join(ch if ch.isalnum() else "_" for ch in cand.name)
    label, plan_path = f"{shape}_{stage}{round_index}_{safe}", work / f"{shape}_plan_{safe}.json"
    if not plan_path.exists():
        cand.plan.save(plan_path)
    record = compare.launch("osdp", None, settings, args, work, label, ("--plan", str(plan_path)))
    for key in ("plan", "profile", "cluster"):
        record.pop(key, None)
    record.update(candidate=cand.name, round=round_index, stage=stage, load_average=compare.load_average())
    print(regret_report.progress_line(record, cand), flush=True)
    return record


def plan_shape(shape: str, settings: dict[str, int], args: argparse.Namespace, work: Path) -> Pricing:
    """The planning launch: the strategy's profile and cluster figures, at a budget everything fits
    (under process budgets a real limit: its cluster keeps free the untracked growth it measured and
    counts DDP's bucket rebuild, and so does every candidate priced on it)."""
    covers = ("--budget-covers", getattr(args, "budget_covers", "tensors"))
    planning = compare.launch("osdp", None, settings, args, work, f"{shape}_planning", covers)
    pickled = work / f"{shape}_planning.pkl"
    if planning.get("status") != "ok" or not pickled.exists():
        raise SystemExit(f"the planning run of {shape} failed:\n{planning.get('message')}")
    pricing = Pricing.load(pickled, [u["name"] for u in planning["plan"]["units"]])
    # NOTE: the table is rebuilt as the strategy builds it; a drift between the two shows here.
    repriced = pricing.candidate("planning", "osdp", tuple(u["choice"] for u in planning["plan"]["units"]),
                                 pricing.cluster.memory_budget_bytes)
    print(f"  planning run: {len(pricing.table.units)} units; its plan's step {planning['plan']['predicted_step_s']:.4f} s, "
          f"re-priced {repriced.plan.predicted_step_s:.4f} s", flush=True)
    return pricing


def run_shape(shape: str, settings: dict[str, int], args: argparse.Namespace, work: Path,
              save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Every round of every candidate of one model shape; ``save`` gets the result after every run."""
    print(f"shape {shape}: GPT {settings}; load average {compare.load_average()}", flush=True)
    pricing = plan_shape(shape, settings, args, work)
    pool = Pool()
    for cand in uniform_candidates(pricing, pricing.cluster.memory_budget_bytes):
        pool.add(cand)
    replicate = pool.candidates()[0]
    runs = [train(replicate, 0, settings, args, work, shape)]
    if runs[0]["status"] != "ok":
        raise SystemExit(f"the all-replicate run of {shape} failed; no budgets without it:\n{runs[0].get('message')}")
    replicate_peak = int(runs[0]["summary"]["peak_bytes"])
    base = compare.budget_base(runs[0]["summary"], args.budget_covers)
    budgets = {budget_label(float(f)): int(float(f) * base) for f in args.fractions.split(",") if f}
    draw_candidates(pool, pricing, budgets, args)
    jobs = pool.candidates()
    print(f"  all-replicate peak {replicate_peak / 2**20:.2f} MiB, budgets of {base / 2**20:.2f} MiB "
          f"({args.budget_covers}); {len(jobs)} distinct plans, {args.rounds} round(s)", flush=True)
    result = {"shape": shape, "settings": settings, "replicate_peak_bytes": replicate_peak, "budgets": budgets,
              "budget_covers": args.budget_covers, "budget_base_bytes": base,
              "usable_bytes": {label: pricing.usable_bytes(budget) for label, budget in budgets.items()},
              "units": len(pricing.table.units), "candidates": pool.records(), "runs": runs}
    for r in range(args.rounds):
        for cand in rotated(jobs, r):
            if r > 0 or cand is not replicate:
                runs.append(train(cand, r, settings, args, work, shape))
                save(result)
    if args.confirm_rounds > 0:
        confirm(result, jobs, settings, args, work, save)
    return result


def confirm(result: dict[str, Any], jobs: list[Candidate], settings: dict[str, int], args: argparse.Namespace,
            work: Path, save: Callable[[dict[str, Any]], None]) -> None:
    """The confirmation rounds: every budget's finalists (picked on the screening rounds), rotated."""
    chosen = regret_report.finalists(result, args.confirm_top)
    names = set().union(*chosen.values())
    finals = [cand for cand in jobs if cand.name in names]
    result["confirm"] = {"rounds": args.confirm_rounds, "top": args.confirm_top, "finalists": chosen}
    print(f"  confirming {len(finals)} finalists ({', '.join(c.name for c in finals)}), "
          f"{args.confirm_rounds} round(s)", flush=True)
    for r in range(args.confirm_rounds):
        for cand in rotated(finals, r):
            result["runs"].append(train(cand, r, settings, args, work, result["shape"], regret_report.CONFIRM))
            save(result)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.report_only is not None:
        saved = read_runs(args.report_only)
        print(regret_report.write_outputs(args.out_dir, saved["machine"], saved["shapes"], plot=not args.no_plot))
        return 0
    args.accelerator = "cpu"  # compare.launch reads it; the regret benchmark is a CPU benchmark
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; known: {sorted(SHAPES)}")
    load_start, start = compare.load_average(), time.perf_counter()
    results: list[dict[str, Any]] = []
    calibrations: list[dict[str, Any]] = []

    def machine(shapes_so_far: list[dict[str, Any]]) -> dict[str, Any]:
        described = compare.describe_machine(args, shapes_so_far[0]["settings"], None)
        described.update(command=" ".join(["python -m benchmarks.regret", *(sys.argv[1:] if argv is None else argv)]),
                         load_average_start=load_start, load_average_end=compare.load_average(),
                         total_wall_s=round(time.perf_counter() - start, 1), calibrations=calibrations)
        return described

    def save(shapes_so_far: list[dict[str, Any]]) -> None:
        # NOTE: saved after every run, so that a stopped or failed run loses nothing (--report-only).
        (args.out_dir / "regret_runs.json").write_text(json.dumps({"machine": machine(shapes_so_far), "shapes": shapes_so_far},
                                                                  default=str) + "\n")

    with tempfile.TemporaryDirectory(prefix="osdp-regret-") as tmp:
        (Path(tmp) / compare.CORPUS_FILE).write_text(python_docs_corpus(), encoding="utf-8")
        for shape in shapes:
            settings = {**compare.PRESETS[args.preset], **SHAPES[shape]}
            if args.steps is not None:
                settings["steps"] = args.steps
            if shape == shapes[0]:  # NOTE: every shape's planning launch is then priced with a median
                calibrations += compare.warm_calibrations(settings, args, Path(tmp))
            results.append(run_shape(shape, settings, args, Path(tmp), lambda partial: save([*results, partial])))
    print(regret_report.write_outputs(args.out_dir, machine(results), results, plot=not args.no_plot))
    return 1 if any(r["status"] == "error" for shape in results for r in shape["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
