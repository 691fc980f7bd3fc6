"""The entry points end to end, as a user runs them: a fresh process in a temporary directory.

``osdp-train`` and a sweep start 2 gloo ranks each (marked ``multiprocess``): the sweep as a user's
command does (Lightning's launcher), one training run as torchrun does (both ranks together).
``osdp-plan`` and the configuration errors run their ``main()`` in this process (``cli_here``):
starting an interpreter for them would only import torch again.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_launch import run_ranks
from conftest import CliHere, CliRun

from osdp_lightning.cli import sweep
from osdp_lightning.cost.budget import PLAN_HEADROOM_FRACTION

REPO = Path(__file__).resolve().parents[1]


def run_cli(command: str, *args: str, cwd: Path, timeout_s: float = 600) -> subprocess.CompletedProcess:
    """``python -m osdp_lightning.cli.<command> args`` in ``cwd`` (what the console scripts run)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", f"osdp_lightning.cli.{command}", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout_s)


def only_dir(parent: Path) -> Path:
    (found,) = [p for p in parent.iterdir() if p.is_dir()]
    return found


def check_ok(proc: subprocess.CompletedProcess | CliRun) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"


def plan_gpt_tiny(cli_here: CliHere, cwd: Path, *overrides: str) -> tuple[CliRun, Path]:
    """``osdp-plan model=gpt_tiny cluster=cpu_2 ...`` (in this process); the run and its output directory."""
    run = cli_here("plan", "model=gpt_tiny", "cluster=cpu_2", *overrides, "hydra.run.dir=plan_run", cwd=cwd)
    check_ok(run)
    return run, cwd / "plan_run"


@pytest.mark.multiprocess
def test_osdp_train_under_a_budget_ddp_exceeds(tmp_path: Path, cli_here: CliHere) -> None:
    """Plan first to learn the ddp and zero3 peaks, then train with a budget between them."""
    _, plan_dir = plan_gpt_tiny(cli_here, tmp_path, "strategy.split_factors=[]")
    peaks = {r["strategy"]: r["predicted_peak_bytes"] for r in json.loads((plan_dir / "comparison.json").read_text())["rows"]}
    assert peaks["zero3"] < peaks["ddp"]
    # Plans keep a share of the budget free (the CPU default headroom): a budget whose usable part
    # lies between the two peaks.
    budget = int((peaks["zero3"] + peaks["ddp"]) / 2 / (1 - PLAN_HEADROOM_FRACTION))
    # NOTE: both ranks started together, as torchrun starts them (Lightning's own launcher is the
    # main job's and the sweep's); they share the run directory they are given, as under torchrun.
    run_dir = tmp_path / "train_run"
    done = run_ranks(["-m", "osdp_lightning.cli.train", "model=gpt_tiny", "cluster=cpu_2", "trainer=smoke",
                      f"cluster.memory_budget={budget}", f"hydra.run.dir={run_dir}"], tmp_path / "train.log", 240,
                     cwd=tmp_path)
    assert done.returncode == 0, done.log[-6000:]
    assert "predicted peak per rank" in done.log and "choices:" in done.log  # the plan table
    assert "tokens/s" in done.log and "measured peak per rank" in done.log  # the summary
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["model"] == "gpt_tiny" and summary["strategy"] == "osdp" and summary["steps"] == 5
    assert summary["memory_budget_bytes"] == budget
    assert summary["peak_bytes"] > 0 and summary["tokens_per_s"] > 0
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["world_size"] == 2 and plan["predicted_peak_bytes"] <= budget
    assert {u["choice"] for u in plan["units"]} != {"replicate"}  # the budget forces some sharding
    rows = list(csv.DictReader((run_dir / "csv" / "metrics.csv").open()))
    assert len([r for r in rows if r.get("train/loss")]) == 5


@pytest.mark.multiprocess
def test_sweep_runs_every_recipe_with_osdp_and_summarises(tmp_path: Path, cli_here: CliHere,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A multirun over the BERT and T5 recipes at tiny size, built on the meta device
    (``meta_init=true``): one row per job. The sweep runs in this process; each job is a fresh
    process on one device (the 2-rank runs of these recipes are the next test; Lightning's launcher
    starting a job's ranks is the main job's test)."""
    monkeypatch.setattr(sweep, "FAILED_JOBS", [])
    proc = cli_here("train", "-m", "model=bert_tiny,t5_tiny", "strategy=osdp", "cluster=cpu_2",
                    "cluster.devices_per_node=1", "trainer=smoke", "cluster.memory_budget=1GiB", "meta_init=true",
                    cwd=tmp_path)
    check_ok(proc)
    sweep_dir = only_dir(tmp_path / "multirun")
    rows = list(csv.DictReader((sweep_dir / "sweep_summary.csv").open()))
    assert [r["model"] for r in rows] == ["bert_tiny", "t5_tiny"]
    for row in rows:
        assert row["status"] == "ok" and row["strategy"] == "osdp" and row["steps"] == "5"
        assert float(row["tokens_per_s"]) > 0 and int(row["peak_bytes"]) > 0
        assert int(row["memory_budget_bytes"]) == 2**30 and float(row["final_loss"]) < 6.5
    markdown = (sweep_dir / "sweep_summary.md").read_text()
    assert markdown.count("| ok |") == 2 and "sweep summary: 2 jobs" in proc.stdout
    for job in ("0", "1"):
        assert (sweep_dir / job / "csv" / "metrics.csv").exists() and (sweep_dir / job / "plan.json").exists()


@pytest.mark.multiprocess
@pytest.mark.parametrize("model", ["bert_tiny", "t5_tiny"])
def test_osdp_train_plans_a_meta_built_recipe_from_shapes_on_two_ranks(tmp_path: Path, model: str) -> None:
    """``osdp-train model=... meta_init=true``, both ranks started together (as torchrun starts them):
    the model is built on the meta device, planned from shapes, materialized as its shards, trained."""
    run_dir = tmp_path / "run"
    done = run_ranks(["-m", "osdp_lightning.cli.train", f"model={model}", "strategy=osdp", "cluster=cpu_2",
                      "trainer=smoke", "cluster.memory_budget=1GiB", "meta_init=true", f"hydra.run.dir={run_dir}"],
                     tmp_path / "train.log", 240, cwd=tmp_path)
    assert done.returncode == 0, done.log[-6000:]
    assert "profiled from shapes" in done.log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["model"] == model and summary["steps"] == 5 and summary["final_loss"] < 6.5
    assert json.loads((run_dir / "plan.json").read_text())["world_size"] == 2


def test_osdp_plan_compares_osdp_with_the_baselines(tmp_path: Path, cli_here: CliHere) -> None:
    proc, run_dir = plan_gpt_tiny(cli_here, tmp_path)
    for name in ("| osdp |", "| ddp |", "| zero2 |", "| zero3 |", "predicted peak per rank"):
        assert name in proc.stdout
    rows = {r["strategy"]: r for r in json.loads((run_dir / "comparison.json").read_text())["rows"]}
    assert set(rows) == {"osdp", "ddp", "zero2", "zero3"}
    assert rows["osdp"]["fits"]
    # Every uniform plan that fits is a feasible point of the ILP: osdp is at least as fast.
    for name in ("ddp", "zero2", "zero3"):
        if rows[name]["fits"]:
            assert rows["osdp"]["samples_per_s"] >= rows[name]["samples_per_s"] * (1 - 1e-3)
    for name in ("plan.json", "plan_ddp.json", "plan_zero2.json", "plan_zero3.json", "comparison.md", "plan.png"):
        assert (run_dir / name).exists()


def test_unknown_model_lists_the_available_ones(tmp_path: Path, cli_here: CliHere) -> None:
    run = cli_here("train", "model=gpt_huge", cwd=tmp_path)
    assert run.returncode != 0
    assert "Could not find 'model/gpt_huge'" in run.stderr
    assert "gpt_tiny" in run.stderr and "t5_large" in run.stderr


def test_meta_init_with_a_strategy_that_cannot_materialize_is_refused(tmp_path: Path) -> None:
    """Every strategy of conf/ is osdp; one a user names instead cannot build on the meta device."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from osdp_lightning.cli.train import train

    with initialize_config_module("osdp_lightning.conf", version_base="1.3"):
        cfg = compose("train", overrides=["meta_init=true", "trainer=smoke", f"output_dir={tmp_path}"])
    OmegaConf.set_struct(cfg, False)
    cfg.strategy = {"_target_": "lightning.pytorch.strategies.DDPStrategy"}
    with pytest.raises(ValueError, match="meta_init=true builds the model on the meta device, which only "
                                         "strategy=osdp materializes; got strategy DDPStrategy"):
        train(cfg)


def test_unknown_cluster_lists_the_available_ones(tmp_path: Path, cli_here: CliHere) -> None:
    run = cli_here("plan", "cluster=tpu_v5", cwd=tmp_path)
    assert run.returncode != 0
    assert "Could not find 'cluster/tpu_v5'" in run.stderr and "h100_80g_x8x2" in run.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("command", ["train", "plan"])
def test_a_gpu_cluster_is_refused_here_with_a_clear_message(command: str, tmp_path: Path,
                                                            cli_here: CliHere) -> None:
    # NOTE: osdp-plan plans a GPU cluster it does not have as a dry run unless told not to.
    extra = ["dry_run=false"] if command == "plan" else []
    run = cli_here(command, "model=gpt_tiny", "cluster=a100_40g_x8", *extra, cwd=tmp_path)
    assert run.returncode != 0
    assert "cluster=a100_40g_x8 is 8 GPUs" in run.stderr and "cluster=cpu_2" in run.stderr


def test_sweep_jobs_keep_the_config_flags_of_the_command_line() -> None:
    from osdp_lightning.cli.sweep import _config_flags

    argv = ["-m", "-cd", "/my/conf", "model=gpt_tiny,bert_tiny", "--config-name=train"]
    assert _config_flags(argv) == ["--config-dir=/my/conf", "--config-name=train"]
    assert _config_flags(["-m", "model=gpt_tiny"]) == []


def test_sweep_table_has_a_row_per_job_failed_ones_included(tmp_path: Path) -> None:
    from osdp_lightning.cli.sweep import format_markdown, write_csv

    rows = [{"job": 0, "model": "gpt_tiny", "strategy": "osdp", "cluster": "cpu_2", "tokens_per_s": 12345.6,
             "peak_bytes": 15 * 2**20, "memory_budget_bytes": 2**30, "final_loss": 3.0, "steps": 5, "status": "ok"},
            {"job": 1, "model": "bert_tiny", "strategy": "zero3", "status": "failed (exit 1, see x)"}]
    table = format_markdown(rows).splitlines()
    assert len(table) == 4 and "| 12,346 | 15.00 MiB |" in table[2] and "failed (exit 1" in table[3]
    write_csv(rows, tmp_path / "s.csv")
    parsed = list(csv.DictReader((tmp_path / "s.csv").open()))
    assert [r["status"] for r in parsed] == ["ok", "failed (exit 1, see x)"] and parsed[0]["peak_bytes"] == str(15 * 2**20)


def test_the_wheel_installs_one_top_level_package_with_its_configs_and_recipes(tmp_path: Path) -> None:
    """``pip install .`` must not put generic ``conf`` / ``recipes`` / ``benchmarks`` into site-packages."""
    import shutil
    import zipfile

    source = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "outputs", "multirun")
    for name in ("osdp_lightning", "conf", "recipes", "benchmarks"):
        shutil.copytree(REPO / name, source / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=600)
    check_ok(proc)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {name.split("/")[0] for name in names} == {"osdp_lightning", "osdp_lightning-0.1.0.dist-info"}
    assert {"osdp_lightning/conf/train.yaml", "osdp_lightning/conf/cluster/cpu_2.yaml",
            "osdp_lightning/conf/model/gpt_tiny.yaml", "osdp_lightning/recipes/gpt/model.py"} <= names
    # every subpackage of the source tree ships (pyproject.toml lists them by name)
    inits = {init.relative_to(REPO).as_posix() for init in (REPO / "osdp_lightning").rglob("__init__.py")}
    assert inits <= names, sorted(inits - names)
    entry_points = zipfile.ZipFile(wheel).read("osdp_lightning-0.1.0.dist-info/entry_points.txt").decode()
    assert "osdp-train" in entry_points and "osdp-plan" in entry_points and "benchmarks" not in entry_points
