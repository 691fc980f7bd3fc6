"""Sweeps: each job of ``osdp-train -m ...`` as its own process, and a summary table at the end.

Lightning starts a job's other ranks by re-running the current command line. Under ``-m`` that
line is the whole sweep, so the children would each start the sweep again. Instead the sweep
process (Hydra's basic launcher, one job after another) runs every job as a fresh single-run
``python -m osdp_lightning.cli.train <job overrides> hydra.run.dir=<job dir>``; inside it
Lightning launches the ranks as in any single run. The job's ``summary.json`` becomes a row of
``sweep_summary.md`` / ``sweep_summary.csv`` in the sweep directory.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from osdp_lightning.cli.common import choice_names
from osdp_lightning.cost.budget import absolute_budget_bytes, format_bytes

FAILED_JOBS: list[str] = []
"""Jobs of this process's sweep that failed (``osdp-train`` exits non-zero when any did)."""

COLUMNS = ("job", "model", "strategy", "cluster", "memory_budget", "tokens_per_s", "peak_bytes",
           "memory_budget_bytes", "predicted_peak_bytes", "peak_error", "step_s", "predicted_step_s", "step_error",
           "final_loss", "steps", "status", "overrides")
# Hydra overrides that describe the sweep itself, not the job: never passed on to a job.
_SWEEP_ONLY = ("hydra.mode", "hydra.sweep", "hydra.run", "hydra.launcher", "hydra.sweeper", "hydra.job.num")


def _config_flags(argv: list[str]) -> list[str]:
    """``--config-dir`` / ``--config-name`` / ``--config-path`` of this command line, to pass on."""
    parser = argparse.ArgumentParser(add_help=False)
    for short, long in (("-cd", "--config-dir"), ("-cn", "--config-name"), ("-cp", "--config-path")):
        parser.add_argument(short, long)
    known, _ = parser.parse_known_args(argv)
    flags = []
    for name in ("config_dir", "config_name", "config_path"):
        value = getattr(known, name)
        if value is not None:
            flags.append(f"--{name.replace('_', '-')}={value}")
    return flags


def job_command(job_dir: Path) -> list[str]:
    """The single-run command line of the current sweep job."""
    hydra_cfg = HydraConfig.get()
    passed_on = [o for o in hydra_cfg.overrides.hydra if not o.startswith(_SWEEP_ONLY)]
    return [sys.executable, "-m", "osdp_lightning.cli.train", *_config_flags(sys.argv[1:]),
            *hydra_cfg.overrides.task, *passed_on, f'hydra.run.dir="{job_dir}"', "hydra.output_subdir=null"]


def run_job(cfg: DictConfig) -> dict[str, Any]:
    """Run the current sweep job in its own process; return its summary row."""
    hydra_cfg = HydraConfig.get()
    job_dir = Path(hydra_cfg.runtime.output_dir)
    overrides = " ".join(hydra_cfg.overrides.task)
    print(f"\n== sweep job {hydra_cfg.job.num}: {overrides} ==", flush=True)
    completed = subprocess.run(job_command(job_dir), check=False)
    row: dict[str, Any] = {"job": hydra_cfg.job.num, **choice_names(),
                           "memory_budget": str(cfg.cluster.memory_budget),
                           "memory_budget_bytes": absolute_budget_bytes(cfg.cluster.memory_budget), "overrides": overrides}
    summary_path = job_dir / "summary.json"
    if completed.returncode == 0 and summary_path.exists():
        return {**row, **json.loads(summary_path.read_text()), "job": row["job"], "status": "ok"}
    FAILED_JOBS.append(f"#{row['job']} ({overrides})")
    return {**row, "status": f"failed (exit {completed.returncode}, see {job_dir})"}


def _cell(row: dict[str, Any], column: str) -> str:
    value = row.get(column)
    if value is None or value == "":
        return "-"
    if column.endswith("bytes"):
        return format_bytes(value)
    if column == "tokens_per_s":
        return f"{value:,.0f}"
    if column in ("final_loss", "step_s", "predicted_step_s"):
        return f"{value:.4f}"
    if column.endswith("_error"):
        return f"{value:+.1%}"
    return str(value)


def format_markdown(rows: list[dict[str, Any]]) -> str:
    """The sweep as a markdown table (sizes in KiB/MiB/GiB)."""
    columns = [c for c in COLUMNS if c not in ("memory_budget", "overrides")]
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(_cell(row, c) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    """The sweep as CSV (raw numbers, bytes as integers)."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


class SweepSummaryCallback(Callback):
    """Collects each sweep job's row and writes ``sweep_summary.md`` and ``.csv`` at the end."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.rows = []

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if job_return.hydra_cfg is None or job_return.hydra_cfg.hydra.mode != RunMode.MULTIRUN:
            return
        if job_return.status == JobStatus.COMPLETED and isinstance(job_return.return_value, dict):
            self.rows.append(job_return.return_value)
            return
        overrides = " ".join(job_return.overrides or [])
        FAILED_JOBS.append(f"({overrides})")
        self.rows.append({"job": len(self.rows), "status": f"failed: {job_return._return_value!r}",
                          "overrides": overrides})

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        table = format_markdown(self.rows)
        (sweep_dir / "sweep_summary.md").write_text(table + "\n")
        write_csv(self.rows, sweep_dir / "sweep_summary.csv")
        print(f"\n== sweep summary: {len(self.rows)} jobs ==\n{table}\n"
              f"written: {sweep_dir / 'sweep_summary.md'}, {sweep_dir / 'sweep_summary.csv'}", flush=True)
