"""``osdp-train``: train a recipe with a strategy on a cluster, then print the plan and a summary.

    osdp-train model=gpt_tiny cluster=cpu_2 strategy=osdp
    osdp-train -m model=gpt_tiny,bert_tiny strategy=osdp,zero3 cluster=cpu_2
    osdp-train experiment=cpu_meta_gpt      # meta_init=true: built on the meta device, sharded, then materialized

One run: Hydra composes the config; Lightning's subprocess launcher starts the other ranks by
re-running this command line with the same ``hydra.run.dir``. Each rank writes into that
directory; rank 0 writes ``csv/metrics.csv`` (CSV logger), ``plan.json`` and ``summary.json``.

A sweep (``-m``): the ranks of a job cannot be started by re-running a multirun command line
(every child would start the whole sweep again), so each job of the sweep runs as a fresh
single-run ``osdp-train`` process with the job's overrides and the job's directory as its run
directory (:mod:`osdp_lightning.cli.sweep`); the sweep ends with a summary table.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import hydra
import lightning.pytorch as pl
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.callbacks import TQDMProgressBar
from omegaconf import DictConfig

import osdp_lightning  # noqa: F401  (registers strategy="osdp")
from osdp_lightning.cli import sweep
from osdp_lightning.cli.common import (
    CONFIG_PATH,
    check_cluster_runs_here,
    choice_names,
    destroy_process_group,
    output_dir,
    write_json,
)
from osdp_lightning.cost.budget import absolute_budget_bytes
from osdp_lightning.integration.callbacks import TrainingSummary
from osdp_lightning.integration.strategy import OSDPStrategy
from osdp_lightning.report.plot import try_plot_plan
from osdp_lightning.report.report import format_comparison, prediction_errors
from osdp_lightning.state.pretrained import PretrainedWeights


def train(cfg: DictConfig) -> dict[str, Any]:
    """Fit ``cfg.model`` on ``cfg.data`` with ``cfg.strategy``; rank 0 returns the summary row."""
    check_cluster_runs_here(cfg.cluster, "osdp-train")
    pl.seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data)
    strategy = instantiate(cfg.strategy, _convert_="all")
    meta_init = bool(cfg.get("meta_init", False))
    if meta_init and not isinstance(strategy, OSDPStrategy):
        raise ValueError(f"meta_init=true builds the model on the meta device, which only strategy=osdp "
                         f"materializes; got strategy {type(strategy).__name__} (use meta_init=false)")
    summary = TrainingSummary(tokens_per_sample=datamodule.tokens_per_sample)
    loggers = [instantiate(logger) for logger in cfg.get("logger", {}).values()]
    # NOTE: Lightning switches to its rich progress bar when `rich` is installed (transformers, a test
    # dependency, pulls it in; it shows "Epoch 0/-2" for max_epochs=-1): the tqdm bar either way.
    bar = [TQDMProgressBar()] if cfg.trainer.get("enable_progress_bar", True) else []
    trainer = instantiate(cfg.trainer, strategy=strategy, callbacks=[summary, *bar], logger=loggers or False)
    # Lightning's way to build a model too large for one device: on the meta device, materialized by osdp
    with trainer.init_module(empty_init=True) if meta_init else contextlib.nullcontext():
        module = instantiate(cfg.model)
    pretrained = getattr(module, "pretrained", None)  # a recipe's model.pretrained=DIR
    if meta_init and pretrained is not None and strategy.pretrained is None:
        # NOTE: built on the meta device, the model took only the directory's config; each rank reads
        # its shards of the weights once the plan is applied.
        strategy.pretrained = PretrainedWeights(str(pretrained))
    try:
        trainer.fit(module, datamodule=datamodule)
        return report(trainer, summary, cfg) if trainer.is_global_zero else {}
    finally:
        destroy_process_group()


def report(trainer: pl.Trainer, summary: TrainingSummary, cfg: DictConfig) -> dict[str, Any]:
    """Print the plan and the summary; write ``plan.json`` and ``summary.json``; return the row."""
    out = output_dir()
    plan = trainer.strategy.plan
    plan.save(out / "plan.json")
    names = choice_names()
    picture = try_plot_plan(plan, out / "plan.png", title=f"osdp-train: {names['model']} on {names['cluster']}, "
                            f"budget {cfg.cluster.memory_budget}")
    row = {**names, "memory_budget": str(cfg.cluster.memory_budget),
           **summary.summary, **prediction_errors(summary.summary), "output_dir": str(out)}
    row["memory_budget_bytes"] = row.get("memory_budget_bytes") or absolute_budget_bytes(cfg.cluster.memory_budget)
    write_json(out / "summary.json", row)
    print(f"\n== osdp-train: {names['model']} on {names['cluster']}, strategy {names['strategy']}, "
          f"memory budget {cfg.cluster.memory_budget} ==")
    print(plan.format_table())
    print()
    print(format_comparison(plan))
    print()
    print(summary.format())
    print(picture)
    print(f"outputs: {out} (csv/metrics.csv, plan.json, plan.png, summary.json)")
    return row


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="train")
def _hydra_main(cfg: DictConfig) -> dict[str, Any]:
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        return sweep.run_job(cfg)
    return train(cfg)


def main() -> None:
    """Console script ``osdp-train``; exits non-zero when a sweep job failed."""
    _hydra_main()
    if sweep.FAILED_JOBS:
        sys.exit(f"{len(sweep.FAILED_JOBS)} sweep job(s) failed: {', '.join(sweep.FAILED_JOBS)}")


if __name__ == "__main__":
    main()

