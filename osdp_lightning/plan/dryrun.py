"""Planning without the hardware: a plan for a cluster description, from a ModelProfile estimated
on fake tensors (:func:`osdp_lightning.profiling.estimate.estimate_profile`: FLOPs and tensor sizes) and the
cluster's peak FLOP/s, bandwidths and latencies (the cost model).

Every time in a dry-run plan is an estimate from a cluster description, and the plan says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import nn

from osdp_lightning.choices import ChoiceOptions
from osdp_lightning.cost.cluster import ClusterSpec
from osdp_lightning.plan.plan import Plan
from osdp_lightning.plan.planner import Planner, PlanOptions
from osdp_lightning.profiling.estimate import DEFAULT_COMPUTE_EFFICIENCY, estimate_profile
from osdp_lightning.profiling.fakestep import ModelSource
from osdp_lightning.profiling.records import ModelProfile

__all__ = ["DEFAULT_COMPUTE_EFFICIENCY", "DRY_RUN_SOURCE", "estimate_profile", "dry_run_plan", "format_dry_run", "compose_config",
           "recipe_model_and_batch", "wants_dry_run", "estimate_recipe_profile", "mark_dry_run"]


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------
DRY_RUN_SOURCE = "dry-run estimate from a cluster description (nothing measured)"


def dry_run_plan(model: ModelSource, batch: object, cluster: ClusterSpec, *,
                 micro_batch_sizes: Sequence[int] | None = None, uniform_choice: str | None = None,
                 split_factors: Sequence[int] = (2, 4, 8), group_sizes: Sequence[int] | None = None,
                 compute_efficiency: float = DEFAULT_COMPUTE_EFFICIENCY, precision: str = "32-true",
                 profile: ModelProfile | None = None, time_limit_s: float | None = None,
                 activation_checkpointing: str = "auto",
                 **unit_options: object) -> Plan:
    """Solve the plan of ``model`` for ``cluster`` from an estimated profile (no GPU, no process group).

    Choices: replicate / zero2 / zero3 (each also ``+ckpt`` per ``activation_checkpointing``), ``split`` by
    ``split_factors``, and on several nodes
    ``hsdp(g=G)`` / ``zero3(reshard=G)`` for ``group_sizes`` (default: the ranks of one node).
    ``uniform_choice`` prices a baseline instead of solving. Pass ``profile`` (from
    :func:`estimate_profile`) to plan several clusters or baselines from one fake step.
    Raises :class:`~osdp_lightning.plan.plan.InfeasibleBudgetError` when nothing fits.
    """
    if profile is None:
        if not cluster.peak_flops_per_s:
            raise ValueError("dry-run planning needs the cluster's peak_flops_per_s (per-device peak FLOP/s)")
        profile = estimate_profile(model, batch, peak_flops_per_s=cluster.peak_flops_per_s,
                                   compute_efficiency=compute_efficiency, precision=precision, **unit_options)  # type: ignore[arg-type]
    options = ChoiceOptions(split_factors=tuple(split_factors),
                            group_sizes=tuple(group_sizes) if group_sizes is not None else None,
                            activation_checkpointing=activation_checkpointing)
    sizes = tuple(micro_batch_sizes) if micro_batch_sizes else None
    plan = Planner(profile, cluster, options=PlanOptions(options, uniform_choice, sizes, time_limit_s)).plan()
    kind = f"uniform:{uniform_choice}" if uniform_choice else plan.source
    return dataclasses.replace(plan, source=f"{kind}; {DRY_RUN_SOURCE}")


def format_dry_run(plan: Plan, cluster: ClusterSpec, compute_efficiency: float = DEFAULT_COMPUTE_EFFICIENCY,
                   cluster_name: str | None = None) -> str:
    """The plan's table under a header that says what its figures are: estimates, not measurements."""
    from osdp_lightning.cost.cluster import describe_cluster

    name = f" {cluster_name}" if cluster_name else ""
    peak = f"{cluster.peak_flops_per_s / 1e12:.3g} TFLOP/s" if cluster.peak_flops_per_s else "?"
    header = [
        f"DRY RUN for cluster{name}: {describe_cluster(cluster)}.",
        "No GPU and no process group were used. All times below are ESTIMATES from the cluster description:",
        f"  compute = FLOPs counted on fake tensors / (peak {peak} x efficiency {compute_efficiency:g});",
        "  communication = latency + bytes / bandwidth of the cluster's intra- and inter-node links;",
        "  optimizer, FSDP2's per-unit work and the loop's constant = the config's step_model (or the",
        "  documented defaults of its device kind, osdp_lightning/cost/step_terms.py).",
        "Bytes per rank are computed from tensor sizes; the activations were recorded on fake tensors.",
        "",
    ]
    return "\n".join(header) + plan.format_table()


# ---------------------------------------------------------------------------------------------
# Recipes (conf/model + conf/data), for osdp-plan and the benchmarks
# ---------------------------------------------------------------------------------------------
def compose_config(overrides: Sequence[str] = (), config_name: str = "plan") -> object:
    """The Hydra config ``osdp-plan <overrides>`` would see (``model=gpt_xl cluster=...``)."""
    from hydra import compose, initialize_config_dir

    from osdp_lightning.cost.cluster import cluster_config_dir

    with initialize_config_dir(str(cluster_config_dir().parent), version_base="1.3"):
        return compose(config_name, overrides=list(overrides))


def recipe_model_and_batch(cfg: object) -> tuple[Callable[[], nn.Module], object, int]:
    """A factory for ``cfg.model`` (nothing built yet), one real batch of ``cfg.data``, tokens per sample."""
    from hydra.utils import instantiate

    datamodule = instantiate(cfg.data)  # type: ignore[attr-defined]
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    return (lambda: instantiate(cfg.model)), batch, datamodule.tokens_per_sample  # type: ignore[attr-defined]


def wants_dry_run(cfg: object) -> bool:
    """``osdp-plan``'s mode: ``dry_run=true|false``, or (default ``auto``) whenever the cluster's
    accelerator is a GPU this machine does not have."""
    choice = str(cfg.get("dry_run", "auto")).lower()  # type: ignore[attr-defined]
    if choice in ("true", "false"):
        return choice == "true"
    return cfg.cluster.accelerator == "gpu" and not torch.cuda.is_available()  # type: ignore[attr-defined]


def estimate_recipe_profile(cfg: object, cluster: ClusterSpec) -> tuple[ModelProfile, int]:
    """The dry-run profile of ``cfg.model`` on a batch of ``cfg.data`` for ``cluster``, and the
    tokens per sample. ``precision`` (default ``bf16-mixed`` on GPU clusters, else ``32-true``) and
    ``compute_efficiency`` are read from the top level of ``cfg`` when present; sharded units are
    priced as that precision runs them (``bf16-mixed``: gathered in bf16, reduced in the strategy's
    ``reduce_dtype``, fp32 by default)."""
    from omegaconf import OmegaConf

    if not cluster.peak_flops_per_s:
        raise ValueError("a dry run needs the cluster config's peak_flops_per_s")
    factory, batch, tokens_per_sample = recipe_model_and_batch(cfg)
    default_precision = "bf16-mixed" if cfg.cluster.accelerator == "gpu" else "32-true"  # type: ignore[attr-defined]
    strategy = OmegaConf.to_container(cfg.strategy, resolve=True)  # type: ignore[attr-defined]
    units = {k: strategy[k] for k in ("unit_module_types", "unit_name_patterns", "min_unit_params")
             if strategy.get(k) is not None}
    profile = estimate_profile(
        factory, batch, peak_flops_per_s=cluster.peak_flops_per_s,
        compute_efficiency=float(cfg.get("compute_efficiency", DEFAULT_COMPUTE_EFFICIENCY)),  # type: ignore[attr-defined]
        precision=str(cfg.get("precision", default_precision)),  # type: ignore[attr-defined]
        reduce_dtype=str(strategy.get("reduce_dtype") or "float32"),
        optimizer_foreach=True if cfg.cluster.accelerator == "gpu" else None, **units)  # type: ignore[attr-defined]
    return profile, tokens_per_sample


def mark_dry_run(plan: Plan) -> Plan:
    """``plan`` with its source saying that its figures are estimates from a cluster description."""
    return plan if DRY_RUN_SOURCE in plan.source else dataclasses.replace(plan, source=f"{plan.source}; {DRY_RUN_SOURCE}")
