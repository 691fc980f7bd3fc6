"""What both entry points share: where the configs are, the cluster config, the run's identity."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from osdp_lightning.cost.budget import (
    UNMEASURED_HEADROOM_FRACTION,
    PlanHeadroom,
    device_memory_bytes,
    parse_memory_budget,
    plan_headroom,
)
from osdp_lightning.cost.cluster import ClusterSpec, cluster_spec_from_config
from osdp_lightning.integration.config import OSDPConfig

CONFIG_PATH = "pkg://osdp_lightning.conf"
"""The configs ship as the ``conf`` package, so installed console scripts find them anywhere."""


class ClusterMismatchError(SystemExit):
    """The chosen cluster cannot run on this machine (exits with the message, no traceback)."""


def strategy_config(strategy: DictConfig) -> OSDPConfig:
    """The :class:`OSDPConfig` of a ``conf/strategy`` entry (what ``OSDPStrategy`` is made with)."""
    fields = OmegaConf.to_container(strategy, resolve=True)
    return OSDPConfig().with_options(**{k: v for k, v in fields.items() if k != "_target_"})


def cluster_world_size(cluster: DictConfig) -> int:
    return int(cluster.devices_per_node) * int(cluster.nodes)


def cluster_spec(cluster: DictConfig, budget_bytes: int | None = None, live: bool = False) -> ClusterSpec:
    """The cost model's view of a ``conf/cluster`` entry (see :mod:`osdp_lightning.cost.cluster`).

    ``budget_bytes`` overrides the config's budget (a resolved ``"95%ddp"``). With ``live`` (the
    cluster is this machine), ``"70%"`` is a share of this machine's device as the strategy takes
    it; otherwise of the config's ``memory_per_device``.

    NOTE: plans keep at least the strategy's default headroom free (:func:`default_headroom`), so that
    a plan made here is the plan ``osdp-train`` solves for the same budget.
    """
    config = OmegaConf.to_container(cluster, resolve=True)
    budget = parse_memory_budget(config.get("memory_budget") or config.get("memory_per_device") or 0)
    device = torch.device("cuda" if config.get("accelerator") == "gpu" else "cpu")
    if budget_bytes is None and live and budget.share is not None and not budget.needs_profile:
        budget_bytes = budget.of_device(device_memory_bytes(device, int(config["devices_per_node"])))
    spec = cluster_spec_from_config(config, memory_budget=budget_bytes)
    # The config's headroom bytes or the strategy's default share, whichever is larger (as a rule,
    # not a figure: the smallest budget that fits is found under the same rule).
    default = default_headroom(device, int(config["devices_per_node"]) if live else 1)
    reason = "the larger of the config's cluster.headroom and " if spec.headroom_bytes else ""
    return dataclasses.replace(spec, headroom_bytes=max(spec.headroom_bytes, default.bytes),
                               headroom_fraction=max(spec.headroom_fraction, default.share),
                               headroom_by_kind=default.by_kind, headroom_reason=reason + default.reason)


def default_headroom(device: torch.device, ranks_per_node: int) -> PlanHeadroom:
    """The strategy's default headroom on ``device`` (CPU: as it keeps it; a GPU's before training
    measures the allocator's fragmentation: its base share)."""
    if device.type == "cuda":
        return PlanHeadroom(0, UNMEASURED_HEADROOM_FRACTION, "the strategy's default share on a GPU, before "
                            "training measures the allocator's fragmentation")
    return plan_headroom(None, device, ranks_per_node=ranks_per_node)


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
