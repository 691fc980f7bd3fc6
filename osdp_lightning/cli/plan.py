"""``osdp-plan``: profile a recipe and solve its plan without training; compare with the baselines.

    osdp-plan model=gpt_small cluster=cpu_2 cluster.memory_budget=2GiB

One process, no process group: the recipe's real ``training_step`` is profiled on one real
batch on this machine, the cluster config supplies bandwidth, latency and the budget, and the
same cost model and ILP as the strategy give the osdp plan. The ddp / zero2 / zero3 baselines
are priced by the same model, so the four columns compare on equal terms. Writes
``plan.json`` (the osdp plan, reusable as ``strategy.plan=...``), ``plan_<baseline>.json``
and ``comparison.md`` / ``comparison.json`` into the output directory.
"""

from __future__ import annotations

from typing import Any

import hydra
import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from osdp_lightning.cli.common import (
    CONFIG_PATH,
    check_cluster_runs_here,
    choice_names,
    cluster_spec,
    output_dir,
    strategy_config,
    write_json,
)
from osdp_lightning.cost.budget import format_bytes, parse_memory_budget
from osdp_lightning.plan import dryrun
from osdp_lightning.plan.pipeline import profile_model
from osdp_lightning.plan.plan import Plan
from osdp_lightning.plan.planner import Planner, PlanOptions
from osdp_lightning.profiling.optim_state import configured_optimizer
from osdp_lightning.profiling.records import ModelProfile
from osdp_lightning.report.plot import try_plot_plan


def profile_recipe(cfg: DictConfig) -> tuple[ModelProfile, int]:
    """Profile ``cfg.model`` on one real batch of ``cfg.data`` (split overheads included).

    Returns the profile and the data's tokens per sample.
    """
    datamodule = instantiate(cfg.data)
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    module = instantiate(cfg.model)
    # NOTE: the strategy's own options (e.g. +strategy.unit_name_patterns=[...]).
    options = strategy_config(cfg.strategy).profile_options("32-true", split=True)
    profile = profile_model(module, batch, torch.device("cpu"), options, whole=True,
                            optimizer=configured_optimizer(module))
    return profile, datamodule.tokens_per_sample


def recipe_planner(profile: ModelProfile, cfg: DictConfig, live: bool) -> Planner:
    """The planner of ``profile`` on ``cfg.cluster`` under its budget, with ``cfg.strategy``'s options."""
    budget = parse_memory_budget(cfg.cluster.get("memory_budget") or cfg.cluster.memory_per_device)
    config = strategy_config(cfg.strategy)
    options = PlanOptions(choice_options=config.choice_options, micro_batch_size=config.micro_batch_size,
                          time_limit_s=config.solver_time_limit_s)
    return Planner(profile, lambda budget_bytes: cluster_spec(cfg.cluster, budget_bytes=budget_bytes, live=live),
                   budget, options)


def format_comparison(plans: dict[str, Plan | str], tokens_per_sample: int, usable: int) -> str:
    """osdp and the baselines side by side, as a markdown table; ``fits`` means within ``usable``."""
    header = ("| strategy | micro-batch | predicted peak/rank | of budget | fits | step s | samples/s "
              "| tokens/s | vs zero3 |")
    lines = [header, "|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    reference = plans.get("zero3")
    for name, plan in plans.items():
        if isinstance(plan, str):
            lines.append(f"| {name} | - | - | - | no plan fits | - | - | - | - |")
            continue
        fits = plan.bounded_peak_bytes <= usable
        speedup = plan.predicted_throughput / reference.predicted_throughput if isinstance(reference, Plan) else 1.0
        lines.append(
            f"| {name} | {plan.micro_batch_size} | {format_bytes(plan.predicted_peak_bytes)} | "
            f"{100 * plan.predicted_peak_bytes / plan.memory_budget_bytes:.0f}% | {'yes' if fits else 'NO'} | "
            f"{plan.predicted_step_s:.4f} | {plan.predicted_throughput:.2f} | "
            f"{plan.predicted_throughput * tokens_per_sample:,.0f} | {speedup:.2f}x |")
    return "\n".join(lines)


def comparison_rows(plans: dict[str, Plan | str], tokens_per_sample: int, usable: int) -> list[dict[str, Any]]:
    rows = []
    for name, plan in plans.items():
        if isinstance(plan, str):
            rows.append({"strategy": name, "error": plan})
            continue
        rows.append({"strategy": name, "micro_batch_size": plan.micro_batch_size,
                     "predicted_peak_bytes": plan.predicted_peak_bytes,
                     "memory_budget_bytes": plan.memory_budget_bytes,
                     "fits": plan.bounded_peak_bytes <= usable,
                     "predicted_step_s": plan.predicted_step_s, "samples_per_s": plan.predicted_throughput,
                     "tokens_per_s": plan.predicted_throughput * tokens_per_sample})
    return rows


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="plan")
def main(cfg: DictConfig) -> None:
    """Console script ``osdp-plan``."""
    dry = dryrun.wants_dry_run(cfg)  # a GPU cluster this machine does not have, or dry_run=true
    if not dry:
        check_cluster_runs_here(cfg.cluster, "osdp-plan")
    pl.seed_everything(cfg.seed, verbose=False)
    names = choice_names()
    cluster = cluster_spec(cfg.cluster, live=not dry)
    budget = parse_memory_budget(cfg.cluster.get("memory_budget") or cfg.cluster.memory_per_device)
    how = "DRY RUN: estimated from the cluster description, no GPU used" if dry else "profiling on this machine"
    shown = budget.text if budget.needs_profile else format_bytes(cluster.memory_budget_bytes)
    print(f"== osdp-plan: {names['model']} on {names['cluster']} ({cluster.world_size} ranks, budget "
          f"{shown} per rank); {how} ==", flush=True)
    profile, tokens_per_sample = dryrun.estimate_recipe_profile(cfg, cluster) if dry else profile_recipe(cfg)
    planner = recipe_planner(profile, cfg, live=not dry)
    cluster = planner.cluster
    if planner.baseline_peak_bytes is not None:  # e.g. "95%ddp": a share of that baseline's predicted peak
        print(f"memory budget {budget.text} = {format_bytes(cluster.memory_budget_bytes)} per rank (the uniform "
              f"{budget.baseline} plan's predicted peak: {format_bytes(planner.baseline_peak_bytes)})")
    plans = planner.plan_with_baselines()
    if dry:
        plans = {name: dryrun.mark_dry_run(plan) if isinstance(plan, Plan) else plan for name, plan in plans.items()}
    out = output_dir()
    osdp = plans["osdp"]
    if isinstance(osdp, Plan):
        print(dryrun.format_dry_run(osdp, cluster, cluster_name=names["cluster"]) if dry else osdp.format_table())
    else:
        print(f"osdp: {osdp}")
    for name, plan in plans.items():
        if isinstance(plan, Plan):
            plan.save(out / ("plan.json" if name == "osdp" else f"plan_{name}.json"))
    picture = try_plot_plan(osdp, out / "plan.png", title=f"osdp-plan: {names['model']} on {names['cluster']}, "
                            f"budget {budget.text}") if isinstance(osdp, Plan) else "plan picture: no plan"
    table = format_comparison(plans, tokens_per_sample, cluster.usable_bytes)
    (out / "comparison.md").write_text(table + "\n")
    write_json(out / "comparison.json", {**names, "world_size": cluster.world_size,
                                         "tokens_per_sample": tokens_per_sample,
                                         "usable_bytes": cluster.usable_bytes,
                                         "rows": comparison_rows(plans, tokens_per_sample, cluster.usable_bytes)})
    print(f"\npredicted per optimizer step ({profile.param_count:,} parameters, {tokens_per_sample} tokens/sample;"
          f" fits: within the budget less {format_bytes(cluster.headroom_for(cluster.memory_budget_bytes))} headroom"
          + (", its headroom by kind priced beside the peak" if cluster.headroom_by_kind else "") + "):")
    print(table)
    print(picture)
    print(f"outputs: {out} (plan.json, plan.png, plan_<baseline>.json, comparison.md, comparison.json)")


if __name__ == "__main__":
    main()
