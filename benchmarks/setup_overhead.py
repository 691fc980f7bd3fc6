"""Setup overhead of the osdp strategy: calibrate, profile, solve and apply seconds per recipe, as a
share of a 200-step run.

    python -m benchmarks.setup_overhead                       # gpt_tiny, bert_tiny, t5_tiny
    python -m benchmarks.setup_overhead --models gpt_small --steps 4

Each recipe trains for a few steps in its own 2-rank launch (Lightning's launcher re-runs this
command line, with ``--worker``, for the other rank) with the recipe's Hydra config
(``conf/model/<name>.yaml``, ``cluster=cpu_2``, ``strategy=osdp``). The 200-step run time is
extrapolated from the measured median step: ``setup + 200 * step_s``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RUN_STEPS = 200
DEFAULT_MODELS = ("gpt_tiny", "bert_tiny", "t5_tiny")
SETUP_KEYS = ("calibrate_s", "profile_s", "solve_s", "apply_s")


def _setup_clock():  # noqa: ANN202  (a Callback; Lightning is imported in the worker only)
    from lightning.pytorch.callbacks import Callback

    class SetupClock(Callback):
        """Wall seconds from the setup hook (before the strategy's setup) to the first training batch:
        everything the strategy does at setup, including what ``setup_s`` does not itemise."""

        def __init__(self) -> None:
            self.start = self.first_batch = None

        def setup(self, trainer, pl_module, stage) -> None:  # noqa: ANN001
            self.start = time.perf_counter()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
            self.first_batch = self.first_batch or time.perf_counter()

    return SetupClock()


def run_worker(model: str, steps: int, out: Path, accelerator: str, devices: int) -> None:
    """One training run of ``model``'s recipe (every rank); rank 0 writes the setup seconds."""
    import lightning.pytorch as pl
    import torch.distributed as dist
    from hydra import compose, initialize_config_module
    from hydra.utils import instantiate

    import osdp_lightning  # noqa: F401  (registers strategy="osdp")
    from osdp_lightning import TrainingSummary

    with initialize_config_module("osdp_lightning.conf", version_base="1.3"):
        cfg = compose("train", overrides=["output_dir=/tmp/unused", f"model={model}", "cluster=cpu_2",
                                          "strategy=osdp"])
    pl.seed_everything(cfg.seed, workers=True)
    data, module = instantiate(cfg.data), instantiate(cfg.model)
    strategy = instantiate(cfg.strategy, _convert_="all")
    summary, clock = TrainingSummary(tokens_per_sample=data.tokens_per_sample), _setup_clock()
    trainer = pl.Trainer(strategy=strategy, accelerator=accelerator, devices=devices, max_steps=steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                         callbacks=[summary, clock])
    start = time.perf_counter()
    trainer.fit(module, datamodule=data)
    fit_s = time.perf_counter() - start
    if trainer.global_rank == 0:
        plan = trainer.strategy.plan
        record = {"model": model, "params": sum(p.numel() for p in module.parameters()),
                  "units": len(plan.units), "micro_batch_size": plan.micro_batch_size,
                  "setup_s": trainer.strategy.setup_s, "step_s": summary.summary["step_s"],
                  "setup_wall_s": clock.first_batch - clock.start,
                  "steps": steps, "fit_s": fit_s, "solver_status": plan.solver_status,
                  "choices": sorted({u.choice for u in plan.units})}
        out.write_text(json.dumps(record, indent=1) + "\n")
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()  # without it, multi-process runs abort at exit (-6)


def launch(model: str, steps: int, work: Path, timeout_s: float) -> dict[str, Any]:
    out, log = work / f"{model}.json", work / f"{model}.log"
    cmd = [sys.executable, "-m", "benchmarks.setup_overhead", "--worker", "--models", model, "--steps", str(steps),
           "--out", str(out)]
    with log.open("w") as handle:
        try:
            code = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, timeout=timeout_s, check=False,
                                  env={**os.environ, "PYTHONWARNINGS": "ignore"}).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    if code != 0 or not out.exists():
        return {"model": model, "error": f"exit {code}: {log.read_text()[-2000:]}"}
    return json.loads(out.read_text())


def overhead_row(record: dict[str, Any]) -> dict[str, Any]:
    setup = record["setup_s"]
    # NOTE: the wall clock also holds what setup_s leaves out (timing split layers, building the
    # optimizer on the sharded parameters, the first data batch); never less than the itemised sum.
    total_setup = max(record.get("setup_wall_s", 0.0), sum(setup.get(k, 0.0) for k in SETUP_KEYS))
    run_s = total_setup + RUN_STEPS * record["step_s"]
    return {"model": record["model"], "params": record["params"], "units": record["units"],
            **{k: setup.get(k, 0.0) for k in SETUP_KEYS}, "setup_s": total_setup, "step_s": record["step_s"],
            "run_200_s": run_s, "share": total_setup / run_s}


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| recipe | parameters | units | calibrate s | profile s | solve s | apply s | setup s (wall) | median step s "
             f"| {RUN_STEPS}-step run s | setup share |", "|" + "---|" * 11]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | failed: {r['error'].splitlines()[0][:80]} |" + " |" * 9)
            continue
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.2f}M | {r['units']} | {r['calibrate_s']:.2f} "
                     f"| {r['profile_s']:.2f} | {r['solve_s']:.2f} | {r['apply_s']:.2f} | {r['setup_s']:.2f} "
                     f"| {r['step_s']:.4f} | {r['run_200_s']:.1f} | {100 * r['share']:.1f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--steps", type=int, default=8, help="steps per run (median step after warm-up)")
    parser.add_argument("--timeout-s", type=float, default=1200.0)
    parser.add_argument("--out", type=Path, default=None, help="worker: JSON path; driver: markdown path")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        run_worker(args.models, args.steps, args.out, "cpu", 2)
        return 0
    load_start = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average at start: {load_start}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="osdp-setup-") as tmp:
        for model in (m.strip() for m in args.models.split(",") if m.strip()):
            record = launch(model, args.steps, Path(tmp), args.timeout_s)
            rows.append(record if "error" in record else overhead_row(record))
            print(f"  {model}: {json.dumps(rows[-1], default=str)[:300]}", flush=True)
    table = format_table(rows)
    print(table)
    load_end = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average at end: {load_end}")
    if args.out:
        from benchmarks.compare import source_commit

        command = " ".join(["python -m benchmarks.setup_overhead", *(sys.argv[1:] if argv is None else argv)])
        args.out.write_text(f"# Setup cost of the osdp strategy per recipe\n\n`{command}` on {os.cpu_count()} cores, "
                            f"2 ranks; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {source_commit()}; "
                            f"load average {load_start} at start, {load_end} at the end.\n\n{table}\n")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
