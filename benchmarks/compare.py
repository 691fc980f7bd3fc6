"""Throughput of osdp against DDP / ZeRO-2 / ZeRO-3 at equal memory budgets, and how true its predictions are.

    ./dev bench compare                             # the default: GPT on 2 CPU ranks, ~10 minutes
    python -m benchmarks.compare --rounds 3 --out-dir bench_out/compare
    python -m benchmarks.compare --accelerator cuda --devices 1 --preset cuda

Every run is a separate multi-process launch of :mod:`benchmarks.compare_worker` with the same
model, data and seed. ``ddp`` is Lightning's own ``strategy="ddp"`` (torch DDP), what users would
otherwise run: every "x ddp" ratio is against it. ``osdp-replicate`` (osdp's uniform replicate) goes
first; its measured peak per rank sets the osdp budgets (``--fractions`` of it). Those budgets bound
the tensors the plan prices (``--budget-covers tensors``, the default), so a run's process uses more;
with ``--budget-covers process`` they are fractions of what the all-replicate process itself used
above the fixed cost it measured at setup (its ``own_above_fixed_bytes``), and bound osdp's whole
process above its own fixed cost; every run then allocates large tensors from mmap
(:data:`PROCESS_ENV`), so that freed ones leave the resident set. Each method then runs once per round, the order rotated one place
each round, and rows report medians over rounds, so that drift of a shared machine does not favour
one method. Writes ``compare.md`` (tables), ``compare.csv`` (one row per method),
``compare_runs.csv`` (one row per run), ``compare_runs.json`` and ``compare.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.distributed import _suggested_max_num_threads
from osdp_lightning.recipes.text import python_docs_corpus

from benchmarks import compare_report
from benchmarks.launch import run_ranks
from benchmarks.runs_file import read_runs
from osdp_lightning.calibrate import CACHE_DRAWS
from osdp_lightning.calibrate.bench import rotated

BASELINES = ("ddp", "fsdp2", "fsdp2-ckpt", "osdp-replicate", "zero2", "zero3", "osdp-default")
"""Runs without a budget: Lightning's DDP, osdp's uniform plans, osdp at its default budget (all fits)."""
PEAK_METHOD = "osdp-replicate"
"""Its measured peak (the all-replicate peak) sets the osdp budgets."""
DEFAULT_FRACTIONS = (1.0, 0.85, 0.7, 0.55, 0.4)
HAND_FSDP2 = "fsdp2"
"""FSDP2 as Lightning documents it (``fully_shard`` per block, then the root); osdp runs at
``--fsdp2-fractions`` of its measured peak as ``osdp-at-fsdp2``."""
DEFAULT_FSDP2_FRACTIONS = (1.0,)
PRESETS: dict[str, dict[str, int]] = {
    # NOTE: parameters dominate the peak (short sequences, small micro-batch), so sharding pays:
    # all-replicate holds 20 bytes per parameter (fp32 AdamW, plus FSDP2's unsharded copy).
    "cpu": {"n_layer": 4, "n_embd": 384, "n_head": 6, "seq_len": 64, "batch_size": 2, "steps": 20},
    "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 4, "seq_len": 32, "batch_size": 2, "steps": 6},
    "cuda": {"n_layer": 12, "n_embd": 1024, "n_head": 16, "seq_len": 256, "batch_size": 8, "steps": 30},
}
WARM_STEPS = 3
"""Steps of a warm-up launch (:func:`warm_calibrations`): it is there for its calibration."""
MODEL_ARGS = ("n_layer", "n_embd", "n_head", "seq_len", "batch_size", "steps")
CORPUS_FILE = "corpus.txt"
PROCESS_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
"""Every run's environment under ``--budget-covers process``: freed large tensors go back to the system,
as a process budget needs (osdp_lightning.integration.callbacks). With glibc's default, growing mmap
threshold they stay on the heap: osdp's sharded plans on the default shape then held 1.9x their
budget above the fixed cost (tracked peak 0.90-0.94x), the all-replicate run 0.73x its tracked peak."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="osdp-bench", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="model size (default: cuda with --accelerator cuda, else cpu)")
    for name in MODEL_ARGS:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help="overrides the preset")
    parser.add_argument("--fractions", default=None,
                        help="osdp budgets as fractions of the measured all-replicate peak (--budget-covers "
                             "process: of its own memory above its fixed cost) (default "
                             f"{','.join(str(f) for f in DEFAULT_FRACTIONS)}; one device: 1.25)")
    parser.add_argument("--methods", default=None,
                        help="default ddp,osdp-replicate,zero2,zero3,osdp-default,osdp (one device: ddp,osdp-replicate,osdp)")
    parser.add_argument("--fsdp2-fractions", default=",".join(str(f) for f in DEFAULT_FSDP2_FRACTIONS),
                        help="osdp-at-fsdp2 budgets as fractions of the hand-written FSDP2's measured peak "
                             "(needs fsdp2 and osdp in --methods)")
    parser.add_argument("--budget-covers", choices=("tensors", "process"), default="tensors",
                        help="what osdp's budgets bound (OSDPConfig.budget_covers). tensors: fractions of the "
                             "all-replicate run's tracked tensor peak, bounding the tensors the plan prices; process: "
                             "fractions of its own memory above its fixed cost, bounding the process above its own "
                             "(every run with MALLOC_MMAP_THRESHOLD_=65536)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--precision", default="32-true", choices=("32-true", "bf16-mixed"),
                        help="every run's Trainer precision; the hand FSDP2 gathers bf16 and reduces fp32 under bf16-mixed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--meta", action="store_true",
                        help="build the model on the meta device (osdp and the hand FSDP2; Lightning's ddp cannot)")
    add_run_arguments(parser, "compare", run_timeout_s=900.0)
    return parser


def add_run_arguments(parser: argparse.ArgumentParser, name: str, run_timeout_s: float) -> None:
    """Launch and output options of the benchmarks that launch :func:`launch` runs (compare,
    regret); ``name`` names the output folder and the runs file."""
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--warm-calibrations", type=int, default=CACHE_DRAWS - 1,
                        help="short launches that only fill the run's calibration cache first, so that the "
                             f"measured runs are priced with the median of {CACHE_DRAWS} calibrations")
    parser.add_argument("--run-timeout-s", type=float, default=run_timeout_s)
    parser.add_argument("--out-dir", type=Path, default=Path(f"bench_out/{name}"))
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--report-only", type=Path, default=None, metavar="RUNS_JSON",
                        help=f"re-render the tables and plot of an earlier {name}_runs.json (or .json.gz) into --out-dir")


def resolve_defaults(args: argparse.Namespace) -> None:
    """Methods and budgets; one device has nothing to shard across, so every plan is all-replicate
    there: only ddp, and osdp at a budget above its peak (the CUDA path's check of the predictions)."""
    single = args.devices == 1
    if args.methods is None:
        args.methods = "ddp,osdp-replicate,osdp" if single else "ddp,osdp-replicate,zero2,zero3,osdp-default,osdp"
    if args.fractions is None:
        args.fractions = "1.25" if single else ",".join(str(f) for f in DEFAULT_FRACTIONS)


def model_settings(args: argparse.Namespace) -> dict[str, int]:
    preset = args.preset or ("cuda" if args.accelerator == "cuda" else "cpu")
    settings = dict(PRESETS[preset])
    settings.update({k: getattr(args, k) for k in MODEL_ARGS if getattr(args, k) is not None})
    return settings


def worker_command(method: str, budget: int | None, settings: dict[str, int], args: argparse.Namespace,
                   out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "benchmarks.compare_worker", "--method", method, "--out", str(out),
           "--accelerator", args.accelerator, "--devices", str(args.devices), "--seed", str(args.seed),
           "--precision", getattr(args, "precision", "32-true")]
    cmd += [arg for k, v in settings.items() for arg in (f"--{k.replace('_', '-')}", str(v))]
    cmd += ["--text-file", str(out.parent / CORPUS_FILE)] + (["--meta"] if getattr(args, "meta", False) else [])
    return cmd + (["--budget", str(budget)] if budget is not None else [])


def launch(method: str, budget: int | None, settings: dict[str, int], args: argparse.Namespace,
           work: Path, label: str, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """One multi-process training run; its rank-0 record, or an ``error`` record with the log tail."""
    out, log = work / f"{label}.json", work / f"{label}.log"
    cmd = [*worker_command(method, budget, settings, args, out), *extra]
    # NOTE: one calibration cache per benchmark (in its temporary directory, shared by its runs): its
    # first calibrating launches each measure, every later one is priced with the median of those
    # (calibrate.CACHE_DRAWS of them), and none comes from another session's cache.
    # Every method's ranks get the thread count Lightning's DDP launcher sets (a share of the cores):
    # ModelParallelStrategy (the hand-written FSDP2) sets none on the ranks it did not start.
    threads = os.environ.get("OMP_NUM_THREADS") or str(_suggested_max_num_threads(args.devices))
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OSDP_LIGHTNING_CACHE_DIR": str(work / "calibration"),
           "OMP_NUM_THREADS": threads, **(PROCESS_ENV if getattr(args, "budget_covers", "tensors") == "process" else {})}
    start = time.perf_counter()
    code = run_ranks(cmd, log, args.run_timeout_s, env=env, ranks=args.devices)  # all ranks at once (launch.py)
    wall_s = time.perf_counter() - start
    if code == 0 and out.exists():
        record = json.loads(out.read_text())
    else:
        tail = log.read_text()[-3000:]
        record = {"method": method, "budget_bytes": budget, "status": "error", "message": f"exit {code}: {tail}"}
    record["wall_s"] = wall_s
    return record


def run_order(fractions: tuple[float, ...], methods: tuple[str, ...], round_index: int,
              hand_fractions: tuple[float, ...] = DEFAULT_FSDP2_FRACTIONS) -> list[tuple[str, float | None]]:
    """The runs of one round: the baselines in ``BASELINES`` order, osdp at each fraction, then osdp at
    fractions of the hand FSDP2's peak, which round 0's fsdp2 run measures before them (osdp-replicate,
    whose peak sets the other budgets, is launched before any round). Later rounds rotate this order."""
    jobs = [(m, None) for m in BASELINES if m in methods]
    jobs += [("osdp", f) for f in fractions] if "osdp" in methods else []
    return rotated(jobs + hand_fsdp2_jobs(methods, hand_fractions), round_index)


def hand_fsdp2_jobs(methods: tuple[str, ...], fractions: tuple[float, ...] = DEFAULT_FSDP2_FRACTIONS
                    ) -> list[tuple[str, float | None]]:
    """osdp at fractions of the hand-written FSDP2's measured peak (after the fsdp2 row in round 0)."""
    if HAND_FSDP2 not in methods or "osdp" not in methods:
        return []
    return [(f"osdp-at-{HAND_FSDP2}", f) for f in fractions]


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def warm_calibrations(settings: dict[str, int], args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """``--warm-calibrations`` short launches before the measured runs, each calibrating into the
    benchmark's cache. Without them the first runs are priced with one, then two calibrations, and
    one calibration is more than 15% off for a block's FSDP2 work in 11-33% of launches
    (docs/design.md section 7): one such draw sent a whole run's plans to leaf units. With
    ``CACHE_DRAWS - 1`` of them the first measured run makes the last draw and every later one,
    osdp's planning launches included, is priced with the median."""
    if args.devices < 2:  # one process keeps no cache: it times only its optimizer step, at setup
        return []
    short = {**settings, "steps": WARM_STEPS}
    done = []
    for i in range(args.warm_calibrations):
        record = launch(PEAK_METHOD, None, short, args, work, f"calibrate_{i}")
        source = (record.get("plan") or {}).get("step_terms_source", "")
        done.append({"status": record["status"], "wall_s": round(record["wall_s"], 1), "step_terms_source": source})
        print(f"calibration {i + 1}/{args.warm_calibrations}: {record['status']}, {source or '-'} "
              f"[{record['wall_s']:.0f} s]", flush=True)
    return done


def budget_base(summary: dict[str, Any], covers: str) -> int:
    """What osdp's budgets are fractions of, from the all-replicate run's summary: its tracked peak
    (``tensors``), or its own memory above its fixed cost (``process``: the process's resident
    high-water above the fixed cost measured at setup, less the code pages loaded since that were
    resident at the peak, the quantity a process budget bounds)."""
    if covers == "tensors":
        return int(summary["peak_bytes"])
    own = int(summary.get("own_above_fixed_bytes") or 0)
    if own <= 0:
        raise SystemExit(f"the all-replicate ({PEAK_METHOD}) run reported no own memory above its fixed cost "
                         "(a CPU run under the osdp strategy measures it): no process budgets without it")
    return own


def run_all(args: argparse.Namespace, settings: dict[str, int], work: Path) -> tuple[list[dict], int, int]:
    """Every run of every round; returns the run records, the all-replicate tracked peak and what the
    budgets are fractions of (:func:`budget_base`), in bytes."""
    fractions = tuple(float(f) for f in args.fractions.split(",") if f)
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    covers = getattr(args, "budget_covers", "tensors")
    first = launch(PEAK_METHOD, None, settings, args, work, f"r0_{PEAK_METHOD}")
    if first.get("status") != "ok":
        raise SystemExit(f"the all-replicate ({PEAK_METHOD}) run failed; no budgets without it:\n{first.get('message')}")
    replicate_peak, base = int(first["summary"]["peak_bytes"]), budget_base(first["summary"], covers)
    summary = first["summary"]
    predicted, resident = (summary.get(k) or 0 for k in ("predicted_peak_bytes", "process_above_fixed_bytes"))
    print(f"all-replicate peak per rank: {replicate_peak / 2**20:.2f} MiB (predicted {predicted / 2**20:.2f})"
          + (f"; own memory above its fixed cost {base / 2**20:.2f} MiB (resident {resident / 2**20:.2f}), "
             "the budgets' base" if covers == "process" else "") + f"; load average {load_average()}", flush=True)
    runs: list[dict] = []
    smallest: int | None = None  # the smallest feasible osdp budget, once a run has named it
    hand_peak: int | None = None  # the hand-written FSDP2's measured peak (its round-0 run)
    for r in range(args.rounds):
        hand_fractions = tuple(float(f) for f in args.fsdp2_fractions.split(",") if f)
        for method, fraction in run_order(fractions, methods, r, hand_fractions):
            budget = int(fraction * base) if fraction is not None else None
            # NOTE: only osdp's budgets from the all-replicate run's own memory bound the process; those
            # from the hand FSDP2's tracked peak (it measures no fixed cost) bound the tensors.
            run_covers = covers if method == "osdp" else "tensors"
            if method.startswith("osdp-at-"):
                if hand_peak is None:
                    continue
                budget = int(fraction * hand_peak)
            if r == 0 and method == PEAK_METHOD:
                record = first if PEAK_METHOD in methods else None
            elif smallest is not None and budget is not None and budget < smallest and run_covers == "tensors":
                # NOTE: no plan fits below the smallest feasible budget (exact bytes of the same
                # profile); it is recorded once, not launched again to hear the same answer. A process
                # budget's smallest counts the untracked growth its launch measured, which the next
                # launch measures anew: each is launched.
                if r == 0:
                    record = {"method": method, "budget_bytes": budget, "status": "infeasible",
                              "smallest_feasible_bytes": smallest, "message": "below the smallest feasible budget",
                              "wall_s": 0.0}
                else:
                    continue
            else:
                label = f"r{r}_{method}" + (f"_{round(100 * fraction)}" if fraction is not None else "")
                extra = ("--budget-covers", run_covers) if budget is not None else ()
                record = launch(method if budget is None else "osdp", budget, settings, args, work, label, extra)
                record["method"] = method
                if budget is not None:
                    record["budget_covers"] = run_covers
            if record is None:
                continue
            if method == HAND_FSDP2 and hand_peak is None and record["status"] == "ok":
                hand_peak = int(record["summary"]["peak_bytes"])
            record.update(round=r, fraction=fraction, load_average=load_average())
            runs.append(record)
            if record["status"] == "infeasible" and record.get("smallest_feasible_bytes"):
                smallest = max(smallest or 0, record["smallest_feasible_bytes"])
            print(compare_report.progress_line(record), flush=True)
    return runs, replicate_peak, base


def describe_machine(args: argparse.Namespace, settings: dict[str, int], params: int | None) -> dict[str, Any]:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = torch.cuda.get_device_name(0) if args.accelerator == "cuda" and torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(memory_gib, 1), "gpu": gpu,
            "accelerator": args.accelerator, "devices": args.devices, "precision": getattr(args, "precision", "32-true"),
            "torch": torch.__version__,
            "python": platform.python_version(), "model": settings, "param_count": params,
            "rounds": args.rounds, "command": " ".join(["osdp-bench", *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": source_commit()}


def source_commit() -> str:
    """The checkout's commit, with ``+changes`` when tracked files differ from it (``n/a`` outside git)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()

    try:
        return git("rev-parse", "--short", "HEAD") + ("+changes" if git("status", "--porcelain", "-uno") else "")
    except (OSError, subprocess.SubprocessError):
        return "n/a"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.report_only is not None:
        saved = read_runs(args.report_only)
        args.out_dir.mkdir(parents=True, exist_ok=True)
        rows = compare_report.aggregate(saved["runs"], saved["machine"]["replicate_peak_bytes"])
        print(compare_report.write_outputs(args.out_dir, saved["machine"], rows, saved["runs"], plot=not args.no_plot))
        return 0
    resolve_defaults(args)
    settings = model_settings(args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    load_start, start = load_average(), time.perf_counter()
    print(f"osdp-bench: GPT {settings} on {args.devices} x {args.accelerator}, {args.rounds} round(s); "
          f"load average {load_start}", flush=True)
    with tempfile.TemporaryDirectory(prefix="osdp-bench-") as tmp:
        # NOTE: the default corpus is parsed from the stdlib's sources (seconds per process); every
        # run reads the same text from one file instead.
        (Path(tmp) / CORPUS_FILE).write_text(python_docs_corpus(), encoding="utf-8")
        calibrations = warm_calibrations(settings, args, Path(tmp))
        runs, replicate_peak, base = run_all(args, settings, Path(tmp))
    params = next((r.get("param_count") for r in runs if r.get("param_count")), None)
    machine = describe_machine(args, settings, params)
    machine.update(load_average_start=load_start, load_average_end=load_average(),
                   total_wall_s=round(time.perf_counter() - start, 1), replicate_peak_bytes=replicate_peak,
                   budget_covers=args.budget_covers, budget_base_bytes=base,
                   **({"env": PROCESS_ENV} if args.budget_covers == "process" else {}),
                   calibrations=calibrations)
    rows = compare_report.aggregate(runs, replicate_peak)
    text = compare_report.write_outputs(args.out_dir, machine, rows, runs, plot=not args.no_plot)
    print(text)
    return 1 if any(r["status"] == "error" for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
