"""Hugging Face models under osdp on 2 CPU ranks: training against Lightning's DDP, planning from
shapes against the whole profile, and a model whose DDP state does not fit its budget.

    ./dev bench hf_models [--families llama,gpt2,neox,bert,t5] [--layers 4 --width 256 --seq-len 128
                          --batch-size 4] [--rounds 1] [--parts train,paths,large] [--out-dir DIR]
    ./dev bench hf_models --report-only DIR/hf_models_runs.json[.gz] --out-dir DIR   # tables again, no runs

Three parts, each optional (``--parts``):

- ``train``: per family (:mod:`benchmarks.hf_worker`), one launch at 5%ddp names the smallest
  budget osdp finds a plan for; then Lightning's ``strategy="ddp"`` and osdp at ``60%ddp`` and at
  5% above that smallest budget, each built eagerly and on the meta device, once per round (the
  order rotated each round). Every launch starts both ranks at once (:mod:`benchmarks.launch`).
- ``paths``: per family, in this process: the whole profile against the profile from shapes,
  ``--path-rounds`` of each alternating (:mod:`benchmarks.hf_paths`).
- ``large``: the config ``model=hf_llama_110m`` built on meta at ``50%ddp`` through osdp-train
  (:mod:`benchmarks.hwm_train`), then a 1 x 16 Llama through the same command for the fixed cost
  (interpreter, torch, gloo, Lightning), with ``MALLOC_MMAP_THRESHOLD_=65536``: each rank's
  resident high-water mark above that fixed cost, against the budget.

Writes ``hf_models.md`` (tables and verdicts, :mod:`benchmarks.hf_models_report`) and
``hf_models_runs.json`` (every record) into ``--out-dir``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import hf_models_report
from benchmarks.compare import describe_machine, load_average
from benchmarks.hf_worker import FAMILIES, Shape
from benchmarks.launch import run_ranks
from benchmarks.runs_file import read_runs
from osdp_lightning.calibrate.bench import rotated

PROBE_BUDGET = "5%ddp"
"""A budget no plan fits: osdp's error names the smallest that would (and it calibrates the cache)."""
ABOVE_SMALLEST = 1.05
SHARE_BUDGET = "60%ddp"
LARGE_OVERRIDES = ("model=hf_llama_110m", "meta_init=true", "cluster.memory_budget=50%ddp")
TINY_LLAMA = ("model.hf_config.num_hidden_layers=1", "model.hf_config.hidden_size=16",
              "model.hf_config.num_attention_heads=2", "model.hf_config.num_key_value_heads=2",
              "model.hf_config.intermediate_size=32", "model.hf_config.vocab_size=384",
              "model.hf_config.tie_word_embeddings=false")
"""Overrides of ``model=hf_llama_110m`` that leave a 1 x 16 Llama: the fixed cost of the same command."""
MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
"""glibc serves large blocks by mmap and gives them back on free: the resident set follows the tensors."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf_models", description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    for field in dataclasses.fields(Shape):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=int, default=field.default)
    parser.add_argument("--steps", type=int, default=12, help="training steps per launch")
    parser.add_argument("--rounds", type=int, default=1, help="launches of each training run")
    parser.add_argument("--parts", default="train,paths,large")
    parser.add_argument("--path-rounds", type=int, default=3)
    parser.add_argument("--large-steps", type=int, default=6)
    parser.add_argument("--large-seq-len", type=int, default=None,
                        help="data.seq_len of the large model (default: its config's 1024, ~20 s a step here)")
    parser.add_argument("--run-timeout-s", type=float, default=900.0)
    parser.add_argument("--out-dir", type=Path, default=Path("bench_out/hf_models"))
    parser.add_argument("--report-only", type=Path, default=None, metavar="RUNS_JSON",
                        help="render the report of an earlier hf_models_runs.json (or .json.gz) into --out-dir")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.family_list = [f for f in args.families.split(",") if f]
    unknown = sorted(set(args.family_list) - set(FAMILIES))
    if unknown:
        raise SystemExit(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    args.part_list = [p for p in args.parts.split(",") if p]
    if set(args.part_list) - {"train", "paths", "large"}:
        raise SystemExit(f"--parts takes train, paths, large; got {args.parts!r}")
    args.shape = Shape(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Shape)})
    return args


def run_env(work: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """One calibration cache for the benchmark's launches, one thread per rank (as Lightning's DDP sets)."""
    return {**os.environ, "PYTHONWARNINGS": "ignore", "OSDP_LIGHTNING_CACHE_DIR": str(work / "calibration"),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(extra or {})}


def launch(family: str, method: str, budget: str | None, meta: bool, args: argparse.Namespace, work: Path,
           label: str) -> dict[str, Any]:
    """One 2-rank launch of :mod:`benchmarks.hf_worker`; its rank-0 record, or an ``error`` record."""
    out, log = work / f"{label}.json", work / f"{label}.log"
    cmd = [sys.executable, "-m", "benchmarks.hf_worker", "--family", family, "--method", method, "--out", str(out),
           "--steps", str(args.steps)]
    cmd += [a for f in dataclasses.fields(Shape) for a in (f"--{f.name.replace('_', '-')}", str(getattr(args.shape, f.name)))]
    cmd += (["--budget", budget] if budget else []) + (["--meta"] if meta else [])
    start = time.perf_counter()
    code = run_ranks(cmd, log, args.run_timeout_s, env=run_env(work), cwd=Path(__file__).resolve().parents[1])
    if code == 0 and out.exists():
        record = json.loads(out.read_text())
    else:
        record = {"family": family, "method": method, "meta": meta, "budget": budget, "status": "error",
                  "message": f"exit {code}: {log.read_text()[-3000:]}"}
    record.update(wall_s=time.perf_counter() - start, load_average=load_average())
    return record


def family_jobs(smallest: int | None) -> list[tuple[str, str | None, bool, str]]:
    """(method, budget, meta, run label) of one round: DDP, then osdp at each budget, eager and meta."""
    budgets = [(SHARE_BUDGET, SHARE_BUDGET)]
    if smallest is not None:
        budgets.append((str(int(smallest * ABOVE_SMALLEST)), f"+{round(100 * (ABOVE_SMALLEST - 1))}%"))
    jobs: list[tuple[str, str | None, bool, str]] = [("ddp", None, False, "ddp")]
    for budget, name in budgets:
        jobs += [("osdp", budget, meta, f"osdp {name} {'meta' if meta else 'eager'}") for meta in (False, True)]
    return jobs


def train_family(family: str, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    probe = launch(family, "osdp", PROBE_BUDGET, False, args, work, f"{family}_probe")
    probe.update(run="probe", round=0)
    print(hf_models_report.progress_line(probe), flush=True)
    smallest = probe.get("smallest_feasible_bytes")
    records = [probe]
    for r in range(args.rounds):
        for method, budget, meta, name in rotated(family_jobs(smallest), r):
            record = launch(family, method, budget, meta, args, work, f"{family}_r{r}_{name.replace(' ', '_')}")
            record.update(run=name, round=r, smallest_feasible_bytes=smallest)
            print(hf_models_report.progress_line(record), flush=True)
            records.append(record)
    return records


def train_cli(overrides: list[str], work: Path, label: str, timeout_s: float) -> dict[str, Any]:
    """osdp-train with ``overrides`` (:mod:`benchmarks.hwm_train`: each rank's high-water mark at exit too)."""
    run_dir = work / label
    cmd = [sys.executable, "-m", "benchmarks.hwm_train", *overrides, "logger=none", f"hydra.run.dir={run_dir}"]
    env = {k: v for k, v in run_env(work, MMAP_ENV).items() if k not in ("OMP_NUM_THREADS",)}
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    (work / f"{label}.log").write_text(done.stdout + done.stderr)
    record: dict[str, Any] = {"label": label, "overrides": overrides, "returncode": done.returncode,
                              "wall_s": time.perf_counter() - start, "load_average": load_average()}
    if (run_dir / "summary.json").exists():
        record["summary"] = json.loads((run_dir / "summary.json").read_text())
        record["plan"] = json.loads((run_dir / "plan.json").read_text())
    record["ranks"] = [json.loads(p.read_text()) for p in sorted(run_dir.glob("hwm.rank*.json"))]
    if done.returncode:
        record["message"] = (done.stdout + done.stderr)[-3000:]
    return record


def large_model(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    common = [f"trainer.max_steps={args.large_steps}"]
    common += [f"data.seq_len={args.large_seq_len}"] if args.large_seq_len else []
    big = train_cli([*LARGE_OVERRIDES, *common], work, "large", 3 * args.run_timeout_s)
    print(hf_models_report.large_progress(big, "hf_llama_110m"), flush=True)
    # NOTE: the large model's budget in bytes (a share of a tiny model's DDP peak fits nothing);
    # 1 GiB when it did not run, which a 1 x 16 Llama fits many times over.
    budget = (big.get("summary") or {}).get("memory_budget_bytes") or 2**30
    tiny = train_cli([*LARGE_OVERRIDES, *common, *TINY_LLAMA, f"cluster.memory_budget={budget}"], work, "fixed_cost",
                     args.run_timeout_s)
    print(hf_models_report.large_progress(tiny, "1 x 16 Llama (fixed cost)"), flush=True)
    return {"large": big, "fixed": tiny, "command": " ".join(["MALLOC_MMAP_THRESHOLD_=65536 ./dev train",
                                                              *LARGE_OVERRIDES, *common])}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.report_only is not None:
        saved = read_runs(args.report_only)
        print(hf_models_report.write_outputs(args.out_dir, saved))
        return 0
    start, load_start = time.perf_counter(), load_average()
    print(f"hf_models: {', '.join(args.family_list)} at {args.shape}; parts {args.parts}; load average {load_start}",
          flush=True)
    saved: dict[str, Any] = {"train": [], "paths": [], "large": None}
    with tempfile.TemporaryDirectory(prefix="osdp-hf-models-") as tmp:
        work = Path(tmp)
        if "train" in args.part_list:
            for family in args.family_list:
                saved["train"] += train_family(family, args, work)
        if "paths" in args.part_list:
            from benchmarks import hf_paths

            saved["paths"] = hf_paths.compare_paths(args.family_list, args.shape, args.path_rounds)
        if "large" in args.part_list:
            saved["large"] = large_model(args, work)
    machine = describe_machine(argparse.Namespace(accelerator="cpu", devices=2, rounds=args.rounds),
                               dataclasses.asdict(args.shape), None)
    machine.update(command=" ".join(["./dev bench hf_models", *(argv if argv is not None else sys.argv[1:])]),
                   families=args.family_list, steps=args.steps, load_average_start=load_start,
                   load_average_end=load_average(), total_wall_s=round(time.perf_counter() - start, 1))
    saved["machine"] = machine
    text = hf_models_report.write_outputs(args.out_dir, saved)
    print(text)
    errors = [r for r in saved["train"] if r["status"] == "error"]
    return 1 if errors or (saved["large"] and saved["large"]["large"]["returncode"]) else 0


if __name__ == "__main__":
    sys.exit(main())
