"""What both entry points share: where the configs are, the cluster config, the run's identity."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from osdp_lightning.budget import PLAN_HEADROOM_FRACTION
from osdp_lightning.cluster import cluster_spec_from_config
from osdp_lightning.cost import ClusterSpec

CONFIG_PATH = "pkg://conf"
"""The configs ship as the ``conf`` package, so installed console scripts find them anywhere."""


class ClusterMismatchError(SystemExit):
    """The chosen cluster cannot run on this machine (exits with the message, no traceback)."""


def cluster_world_size(cluster: DictConfig) -> int:
    return int(cluster.devices_per_node) * int(cluster.nodes)


def cluster_spec(cluster: DictConfig) -> ClusterSpec:
    """The cost model's view of a ``conf/cluster`` entry (see :mod:`osdp_lightning.cluster`).

    NOTE: plans keep at least the strategy's headroom free (5% of the budget), so that a plan
    made here is the plan ``osdp-train`` solves for the same budget.
    """
    spec = cluster_spec_from_config(OmegaConf.to_container(cluster, resolve=True))
    headroom = max(spec.headroom_bytes, int(spec.memory_budget_bytes * PLAN_HEADROOM_FRACTION))
    return dataclasses.replace(spec, headroom_bytes=headroom)


def check_cluster_runs_here(cluster: DictConfig, what: str) -> None:
    """Refuse, with a message that says why and what to do, a cluster this machine is not."""
    if cluster.accelerator == "gpu" and not torch.cuda.is_available():
        raise ClusterMismatchError(
            f"{what}: cluster={cluster.name} is {cluster_world_size(cluster)} GPUs "
            f"({cluster.devices_per_node} per node x {cluster.nodes} nodes) and this machine has no GPU. "
            "Use cluster=cpu_2 here; to plan for a cluster you do not have, run osdp-plan (a dry run).")


def choice_names() -> dict[str, str]:
    """The config group options of this run, e.g. ``{"model": "gpt_tiny", "strategy": "osdp"}``."""
    choices = HydraConfig.get().runtime.choices
    return {group: str(choices.get(group)) for group in ("model", "data", "cluster", "strategy")}


def output_dir() -> Path:
    return Path(HydraConfig.get().runtime.output_dir)


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def destroy_process_group() -> None:
    """End the process group (without it, multi-process runs abort at exit with -6)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
