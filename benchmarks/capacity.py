"""The largest GPT each strategy trains under one enforced per-rank memory limit, and how fast.

    ./dev bench capacity [--limit 480MiB] [--layers 2,3,4,5,6,8,10] [--methods ddp,fsdp2,fsdp2-ckpt,osdp]
    ./dev bench capacity --methods fsdp2-ckpt,osdp --paired 3,5 --rounds 3    # speed where both train

For one width (``--n-embd``, default 768) and more and more layers, every method trains a few
steps on 2 ranks (:mod:`benchmarks.compare_worker`), each rank held to the limit plus the method's
fixed cost (gloo, calibration, the training loop: what a 1-layer, 64-wide GPT trained the same way
needs, measured first). ``--enforce cgroup`` (the default where a writable memory cgroup exists:
:mod:`benchmarks.memory_limit`) puts each rank in a memory cgroup of its own, as containers and
SLURM limit a job: past the limit the kernel ends the rank. ``--enforce rlimit-data`` sets
``RLIMIT_DATA`` instead, which also counts address space reserved but never touched: an allocation
past it fails. Either way the run fails. Methods: Lightning's ``strategy="ddp"``, FSDP2 by hand on every
block (``fsdp2``) and with activation checkpointing on every block (``fsdp2-ckpt``), and osdp with
``--osdp-budget-fraction`` of the limit as its budget; the hand FSDP2 and osdp build the model on
the meta device (Lightning's way for large models), DDP cannot. A method stops at its first size that fails. Writes
``capacity.md`` and ``capacity.json`` into ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import memory_limit
from benchmarks.compare import load_average, source_commit
from benchmarks.launch import run_ranks
from osdp_lightning.calibrate.bench import rotated
from osdp_lightning.cost.budget import format_bytes, parse_bytes

METHODS = ("ddp", "fsdp2", "fsdp2-ckpt", "osdp")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", default="480MiB", help="per-rank memory limit")
    parser.add_argument("--osdp-budget-fraction", type=float, default=1.0,
                        help="osdp's memory_budget as a share of the limit (its plans keep free, inside the budget, "
                             "their headroom and the process's untracked growth measured at setup)")
    parser.add_argument("--layers", default="2,3,4,5,6,8,10", help="sizes to try, ascending")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--n-head", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--run-timeout-s", type=float, default=900.0)
    parser.add_argument("--out-dir", default="bench_out/capacity")
    parser.add_argument("--paired", default=None, metavar="SIZES",
                        help="instead: throughput of the methods at these layer counts, --rounds rounds in rotated "
                             "order, paired ratios to the first method (no RLIMIT_DATA; osdp at the same budget)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--enforce", choices=("cgroup", "rlimit-data"), default=None,
                        help="how the limit is held (default: cgroup where available, else rlimit-data)")
    args = parser.parse_args(argv)
    args.enforce = args.enforce or ("cgroup" if memory_limit.available() else "rlimit-data")
    return args


def worker(method: str, layers: int, n_embd: int, n_head: int, args: argparse.Namespace, work: Path,
           limit: int | None, budget: int | None) -> dict[str, Any]:
    """One run on 2 ranks; its record (``status`` ok, infeasible, or failed with the log's tail)."""
    name = f"{method}_{layers}x{n_embd}"
    out = work / f"{name}.json"
    cmd = [sys.executable, "-m", "benchmarks.compare_worker", "--method", method, "--n-layer", str(layers),
           "--n-embd", str(n_embd), "--n-head", str(n_head), "--seq-len", str(args.seq_len),
           "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--meta", "--out", str(out)]
    cmd += ["--budget", str(budget), "--budget-covers", "process"] if budget is not None and method == "osdp" else []
    if args.enforce == "cgroup":  # NOTE: 0 measures the cgroup's peak without a limit
        cmd += ["--cgroup-limit", str(limit or 0)]
    elif limit is not None:
        cmd += ["--rlimit-data", str(limit)]
    # NOTE: large tensors from mmap (MALLOC_MMAP_THRESHOLD_) go back to the system when freed; from the heap
    # they would stay in the data segment that RLIMIT_DATA counts.
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OSDP_LIGHTNING_CACHE_DIR": str(work / "calibration"),
           "MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "65536"}
    start = time.monotonic()
    code = run_ranks(cmd, work / f"{name}.log", args.run_timeout_s, env=env)
    wall_s = time.monotonic() - start
    if args.enforce == "cgroup":
        memory_limit.remove_finished()
    if code == 0 and out.exists():
        return {**json.loads(out.read_text()), "wall_s": wall_s}
    tail = (work / f"{name}.log").read_text()[-1500:]
    return {"status": "failed", "code": code, "log_tail": tail, "wall_s": wall_s}


def fixed_cost(method: str, args: argparse.Namespace, work: Path) -> dict[str, int]:
    """The data segment (``VmData``), resident high-water (``VmHWM``) and what the limit adds to
    (``limit``: under ``--enforce cgroup`` the anonymous memory its cgroup holds at the end, else the
    data segment) of a process that trains a tiny GPT with ``method``: what each of its ranks needs
    besides the model (torch, Lightning, gloo, the method's own machinery)."""
    record = worker(method, 1, 64, 4, args, work, None, None)
    if record.get("status") != "ok":
        raise RuntimeError(f"the fixed-cost run ({method}) failed: {record.get('log_tail', record)}")
    process = record["process"]
    # NOTE: file pages the cgroup charged are reclaimed past the limit: its anonymous memory is the fixed cost
    limit = process["cgroup_anonymous"] if args.enforce == "cgroup" else process["VmData"]
    return {"VmData": int(process["VmData"]), "VmHWM": int(process["VmHWM"]), "limit": int(limit)}


def paired(args: argparse.Namespace, work: Path) -> str:
    """Tokens/s of each method at each size, rounds in rotated order; ratios to the first method
    paired round by round (a slow round slows both), medians over rounds."""
    methods = args.methods.split(",")
    budget = int(args.osdp_budget_fraction * parse_bytes(args.limit))
    lines = [f"| layers | {methods[0]} tok/s (median) | " + " | ".join(f"{m} x {methods[0]} (rounds)" for m in methods[1:])
             + " |", "|" + "---|" * len(methods) + "---|"]
    for layers in (int(x) for x in args.paired.split(",")):
        speed: dict[str, list[float]] = {m: [] for m in methods}
        for r in range(args.rounds):
            for method in rotated(methods, r):
                record = worker(method, layers, args.n_embd, args.n_head, args, work, None, budget)
                speed[method].append(record["summary"]["tokens_per_s"] if record.get("status") == "ok" else float("nan"))
                print(f"round {r} {method} {layers} layers: {describe(record)}", flush=True)
        ratios = {m: [a / b for a, b in zip(speed[m], speed[methods[0]], strict=True)] for m in methods[1:]}
        lines.append(f"| {layers} | {statistics.median(speed[methods[0]]):.0f} | " + " | ".join(
            f"**{statistics.median(v):.3f}x** ({', '.join(f'{x:.2f}' for x in v)})" for v in ratios.values()) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.out_dir)
    work.mkdir(parents=True, exist_ok=True)
    if args.paired:
        table = paired(args, work)
        (work / "paired.md").write_text(f"commit {source_commit()}, load average {load_average()}\n\n{table}\n")
        print(table)
        return 0
    limit = parse_bytes(args.limit)
    sizes = [int(x) for x in args.layers.split(",")]
    results: dict[str, dict[int, dict[str, Any]]] = {}
    fixed: dict[str, dict[str, int]] = {}
    for method in args.methods.split(","):
        fixed[method] = fixed_cost(method, args, work)
        print(f"{method}: fixed cost (a tiny run's, {args.enforce}) {format_bytes(fixed[method]['limit'])}, "
              f"limit per rank {format_bytes(limit + fixed[method]['limit'])}", flush=True)
        results[method] = {}
        for layers in sizes:
            budget = int(args.osdp_budget_fraction * limit)
            record = worker(method, layers, args.n_embd, args.n_head, args, work, limit + fixed[method]["limit"],
                            budget)
            results[method][layers] = record
            print(f"{method:11s} {layers:3d} layers: {describe(record)}", flush=True)
            if record.get("status") != "ok":
                break
    report = {"limit_bytes": limit, "fixed_cost_bytes": fixed, "args": vars(args), "commit": source_commit(),
              "load_average": load_average(), "results": results}
    (work / "capacity.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (work / "capacity.md").write_text(format_report(report, sizes))
    print(format_report(report, sizes))
    return 0


def describe(record: dict[str, Any]) -> str:
    if record.get("status") == "ok":
        s, plan = record["summary"], record.get("plan") or {}
        kept = (f", plan {format_bytes(plan['predicted_peak_bytes'])} + untracked {format_bytes(plan['untracked_bytes'])}"
                if plan.get("untracked_bytes") else "")
        cgroup = record["process"].get("cgroup_peak")
        return (f"{s['tokens_per_s']:.0f} tokens/s, tracked peak {format_bytes(s['peak_bytes'])}{kept}, "
                f"process HWM {format_bytes(record['process']['VmHWM'])}, data {format_bytes(record['process']['VmData'])}"
                + (f", cgroup peak {format_bytes(cgroup)}" if cgroup else ""))
    if record.get("status") == "infeasible":
        return "no plan fits (osdp refused before training)"
    lines = [line for line in record.get("log_tail", "").splitlines() if "Error" in line or "error" in line]
    return f"failed ({lines[-1].strip()[:120] if lines else record.get('code')})"


def used_share(report: dict[str, Any], method: str, record: dict[str, Any]) -> str:
    """What the ranks used above their fixed cost, over the limit: osdp's own figures (the largest
    rank's resident high-water above the fixed cost it measured at setup, and its own memory's:
    less the code pages loaded since, which a limit reclaims), else rank 0's resident high-water
    (``VmHWM``) above the method's 1 x 64 run's."""
    above, own = (record["summary"].get(key) for key in ("process_above_fixed_bytes", "own_above_fixed_bytes"))
    if above:
        return (f"above its fixed cost {above / report['limit_bytes']:.3f}x"
                + (f", own memory {own / report['limit_bytes']:.3f}x" if own else ""))
    fixed, process = report["fixed_cost_bytes"][method], record["process"]
    return f"HWM {(process['VmHWM'] - fixed['VmHWM']) / report['limit_bytes']:.2f}x"


def format_report(report: dict[str, Any], sizes: list[int]) -> str:
    results = report["results"]
    header = "| layers | params | " + " | ".join(results) + " |"
    rows = [header, "|" + "---|" * (len(results) + 2)]
    for layers in sizes:
        params = next((r[layers]["param_count"] for r in results.values() if layers in r and "param_count" in r[layers]),
                      None)
        cells = []
        for method in results:
            record = results[method].get(layers)
            if record is None:
                cells.append("-")
            elif record.get("status") == "ok":
                cells.append(f"{record['summary']['tokens_per_s']:.0f} tok/s ({used_share(report, method, record)})")
            else:
                cells.append("infeasible" if record.get("status") == "infeasible" else "fails")
        rows.append(f"| {layers} | {params / 1e6:.1f}M | " + " | ".join(cells) + " |" if params else
                    f"| {layers} | ? | " + " | ".join(cells) + " |")
    largest = {m: max((n for n, r in res.items() if r.get("status") == "ok"), default=0) for m, res in results.items()}
    return "\n".join([
        f"# Capacity at {format_bytes(report['limit_bytes'])} per rank", "",
        f"osdp's memory_budget: {report['args']['osdp_budget_fraction']:.0%} of the limit", "",
        f"held by {report['args']['enforce']}: per rank the limit + the method's fixed cost (a 1 x 64 GPT run's "
        + ("cgroup's anonymous memory" if report["args"]["enforce"] == "cgroup" else "data segment") + "): "
        + ", ".join(f"{m} {format_bytes(b['limit'])}" for m, b in report["fixed_cost_bytes"].items()), "",
        f"commit {report['commit']}, load average {report['load_average']}, args {report['args']}", "",
        *rows, "", "largest trained: " + ", ".join(f"{m} {n} layers" for m, n in largest.items()),
        "throughput: median step after warm-up, one run per cell (tokens/s over both ranks); in brackets what "
        "the process used over the limit: osdp's largest rank's resident high-water above the fixed cost it measured at "
        "setup, and its own memory's (less the code pages loaded since, which a limit reclaims before it ends a process), "
        "else rank 0's resident high-water above the method's 1 x 64 run's", ""])


if __name__ == "__main__":
    sys.exit(main())
