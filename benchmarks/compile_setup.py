"""``compile="units"`` against uncompiled in the main job: setup, compile time, step and losses.

    python -m benchmarks.compile_setup --rounds 3 --steps 8 --out-dir docs/benchmarks/compile_units

Each round launches the main job (``python -m osdp_lightning.cli.train``, gpt_tiny on 2 CPU ranks at
its default budget ``100%ddp``, ``trainer=smoke trainer.max_steps=STEPS``) three ways, in an order
rotated per round (the cold launch always before the warm one):

- ``eager``: no ``strategy.compile``;
- ``compiled cold``: ``strategy.compile=units`` with ``TORCHINDUCTOR_CACHE_DIR`` a fresh directory;
- ``compiled warm``: the same, on the directory the cold launch filled.

and times the units compiled alone, outside osdp: two processes at once (as the two ranks do), each
one thread, build the gpt_tiny GPT, compile its blocks as osdp does
(:func:`osdp_lightning.runtime.compile.compile_unit`) and run one forward and backward on a batch of
the main job's shape; Dynamo's compile seconds of rank 0, on a fresh cache and on that cache again.

Each launch's record: the setup breakdown the strategy prints (calibrate, profile, compile, solve,
apply), the launch's wall seconds, the median step and the per-step losses of ``csv/metrics.csv``.
The report holds the medians per configuration, the losses' largest relative difference from the
eager launch of the same round, and the target
``setup(compiled) <= 1.5 x (compile alone + setup(eager))``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SETUP_RE = re.compile(r"osdp setup: (.*)")
PHASE_RE = re.compile(r"(\w+) ([\d.]+) s")
CONFIGS = ("eager", "compiled cold", "compiled warm")
PHASES = ("calibrate", "profile", "compile", "solve", "apply")


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def launch(label: str, compiled: bool, cache_dir: Path, steps: int, out_dir: Path) -> dict[str, Any]:
    """One main-job launch; its setup breakdown, wall seconds, median step and losses."""
    run_dir = out_dir / label
    cmd = [sys.executable, "-m", "osdp_lightning.cli.train", "trainer=smoke", f"trainer.max_steps={steps}",
           f"hydra.run.dir={run_dir}", "logger=csv"] + (["strategy.compile=units"] if compiled else [])
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "PYTHONWARNINGS": "ignore"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    (out_dir / f"{label}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return {"label": label, "status": "error", "rc": proc.returncode, "tail": (proc.stdout + proc.stderr)[-2000:]}
    match = SETUP_RE.search(proc.stdout + proc.stderr)
    setup = {k: float(v) for k, v in PHASE_RE.findall(match.group(1))} if match else {}
    summary = json.loads((run_dir / "summary.json").read_text())
    losses = {}
    with (run_dir / "csv" / "metrics.csv").open() as f:
        for row in csv.DictReader(f):
            if row.get("train/loss"):
                losses[int(row["step"])] = float(row["train/loss"])
    return {"label": label, "status": "ok", "compiled": compiled, "wall_s": wall, "setup_s": setup,
            "setup_total_s": sum(setup.values()), "step_s": summary["step_s"],
            "predicted_step_s": summary["predicted_step_s"], "losses": [losses[k] for k in sorted(losses)],
            "load_average": load_average()}


def alone_worker(out: Path) -> None:
    """One process: the gpt_tiny blocks compiled as osdp compiles them, one forward and backward."""
    import torch
    from osdp_lightning.recipes.gpt import GPT, GPTConfig

    from osdp_lightning.runtime.compile import compile_seconds, compile_unit

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = GPT(GPTConfig(vocab_size=384, block_size=128, n_layer=2, n_head=4, n_embd=64, dropout=0.0))
    for i, block in enumerate(net.h):
        compile_unit(block, f"net.h.{i}")
    idx = torch.randint(0, 384, (8, 128))
    times = []
    for _ in range(4):
        start = time.perf_counter()
        logits = net(idx)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten()).backward()
        times.append(time.perf_counter() - start)
    out.write_text(json.dumps({"compile_s": compile_seconds(), "first_step_s": times[0],
                               "later_step_s": statistics.median(times[1:])}))


def alone(cache_dir: Path, out_dir: Path, label: str) -> dict[str, Any]:
    """Two alone workers at once on ``cache_dir``; rank 0's record (and rank 1's compile seconds)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "PYTHONWARNINGS": "ignore",
           "OMP_NUM_THREADS": "1"}
    outs = [out_dir / f"{label}_{r}.json" for r in range(2)]
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.compile_setup", "--alone-worker", str(o)], env=env)
             for o in outs]
    if any(p.wait() != 0 for p in procs):
        return {"label": label, "status": "error"}
    records = [json.loads(o.read_text()) for o in outs]
    return {"label": label, "status": "ok", **records[0], "rank1_compile_s": records[1]["compile_s"]}


def order(round_index: int) -> list[str]:
    """Rotated launch order; the warm launch always follows its round's cold one."""
    base = ["eager", "compiled cold"]
    seq = base[round_index % 2:] + base[:round_index % 2]
    seq.insert(seq.index("compiled cold") + 1, "compiled warm")
    return seq


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(runs: list[dict], alones: list[dict], meta: dict) -> str:
    ok = [r for r in runs if r["status"] == "ok"]
    lines = [f"# compile=\"units\" against uncompiled: gpt_tiny main job, 2 CPU ranks, {meta['steps']} steps", "",
             f"Reproduce with `{meta['command']}`.", "",
             f"machine: {json.dumps({k: v for k, v in meta.items() if k != 'command'})}", "",
             "## Medians per configuration", "",
             "| configuration | launches | calibrate s | profile s | compile s | solve s | apply s | setup s | launch wall s | median step s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    medians: dict[str, dict[str, float]] = {}
    for config in CONFIGS:
        rs = [r for r in ok if r["config"] == config]
        m = {p: med([r["setup_s"].get(p, 0.0) for r in rs]) for p in PHASES}
        m.update(setup=med([r["setup_total_s"] for r in rs]), wall=med([r["wall_s"] for r in rs]),
                 step=med([r["step_s"] for r in rs]))
        medians[config] = m
        lines.append(f"| {config} | {len(rs)} | " + " | ".join(f"{m[p]:.3f}" for p in PHASES)
                     + f" | {m['setup']:.3f} | {m['wall']:.1f} | {m['step']:.4f} |")
    a_ok = [a for a in alones if a["status"] == "ok"]
    alone_m = {kind: med([a["compile_s"] for a in a_ok if a["kind"] == kind]) for kind in ("cold", "warm")}
    lines += ["", "## The units compiled alone (2 processes at once, rank 0)", "",
              "| cache | runs | compile s (Dynamo) | first step s | later step s |", "|---|---:|---:|---:|---:|"]
    for kind in ("cold", "warm"):
        rs = [a for a in a_ok if a["kind"] == kind]
        lines.append(f"| {kind} | {len(rs)} | {alone_m[kind]:.3f} | {med([a['first_step_s'] for a in rs]):.3f} | "
                     f"{med([a['later_step_s'] for a in rs]):.4f} |")
    lines += ["", "## Target: setup(compiled) <= 1.5 x (compile alone + setup(eager))", "",
              "| cache | setup compiled s | compile alone s | setup eager s | ratio | verdict |", "|---|---:|---:|---:|---:|---|"]
    for kind in ("cold", "warm"):
        compiled = medians[f"compiled {kind}"]["setup"]
        base = alone_m[kind] + medians["eager"]["setup"]
        ratio = compiled / base
        lines.append(f"| {kind} | {compiled:.3f} | {alone_m[kind]:.3f} | {medians['eager']['setup']:.3f} | "
                     f"{ratio:.2f}x | {'MET' if ratio <= 1.5 else 'MISSED'} |")
    lines += ["", "## Losses against the eager launch of the same round (target: within 1e-4 relative)", "",
              "| round | configuration | steps | largest relative difference | losses |", "|---|---|---:|---:|---|"]
    for r in sorted({r["round"] for r in ok}):
        eager = next((x for x in ok if x["round"] == r and x["config"] == "eager"), None)
        for x in (x for x in ok if x["round"] == r):
            diff = (max(abs(a - b) / abs(b) for a, b in zip(x["losses"], eager["losses"], strict=True))
                    if eager and len(eager["losses"]) == len(x["losses"]) else float("nan"))
            lines.append(f"| {r} | {x['config']} | {len(x['losses'])} | {diff:.2e} | "
                         + " ".join(f"{v:.6f}" for v in x["losses"]) + " |")
    lines += ["", "## Every launch", "", "| round | configuration | setup | setup s | wall s | step s | load average after |",
              "|---|---|---|---:|---:|---:|---|"]
    for x in runs:
        if x["status"] != "ok":
            lines.append(f"| {x['round']} | {x['config']} | error rc {x.get('rc')} | | | | |")
            continue
        setup = ", ".join(f"{k} {v:.3f}" for k, v in x["setup_s"].items())
        lines.append(f"| {x['round']} | {x['config']} | {setup} | {x['setup_total_s']:.3f} | {x['wall_s']:.1f} | "
                     f"{x['step_s']:.4f} | {x['load_average']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out-dir", type=Path, default=Path("bench_out/compile_setup"))
    parser.add_argument("--alone-worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.alone_worker is not None:
        alone_worker(args.alone_worker)
        return
    args.out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python -m benchmarks.compile_setup " + " ".join(sys.argv[1:]), "steps": args.steps,
            "cores": os.cpu_count(), "load_average_start": load_average()}
    import torch
    meta["torch"] = torch.__version__
    runs, alones = [], []
    with tempfile.TemporaryDirectory(prefix="osdp_compile_setup_") as tmp:
        work = Path(tmp)
        for r in range(args.rounds):
            cache = work / f"inductor_r{r}"
            for config in order(r):
                label = f"r{r}_{config.replace(' ', '_')}"
                record = launch(label, config != "eager", work / "inductor_eager" if config == "eager" else cache,
                                args.steps, work)
                record.update(round=r, config=config)
                runs.append(record)
                print(f"{label}: {record['status']} setup {record.get('setup_s')} wall {record.get('wall_s', 0):.1f} s "
                      f"step {record.get('step_s', 0):.4f} load {load_average()}", flush=True)
            alone_cache = work / f"alone_r{r}"
            for kind in ("cold", "warm"):
                a = alone(alone_cache, work, f"alone_r{r}_{kind}")
                a.update(round=r, kind=kind)
                alones.append(a)
                print(f"alone r{r} {kind}: {a}", flush=True)
    meta["load_average_end"] = load_average()
    (args.out_dir / "compile_runs.json").write_text(json.dumps({"meta": meta, "runs": runs, "alone": alones}, indent=1) + "\n")
    (args.out_dir / "compile.md").write_text(report(runs, alones, meta))
    print(report(runs, alones, meta))


if __name__ == "__main__":
    main()
