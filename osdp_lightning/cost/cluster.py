"""The cluster the plan is for: :class:`ClusterSpec`, and where one comes from.

Two sources, one result:

- a cluster description (``conf/cluster/<name>.yaml``, or any mapping with the same keys) for a
  cluster you plan for but may not have: :func:`cluster_spec_from_config`, :func:`load_cluster_spec`;
- the live process group of the run itself: :mod:`osdp_lightning.cost.links` times collectives on the
  whole world, inside a node and across nodes; :func:`live_cluster_spec` combines those timings
  with the topology (world size, ranks per node) that Lightning or torchrun reports.

Links are modelled as two tiers. Inside a node (NVLink, PCIe, loopback) a collective runs at
``intra_node_*``; a collective whose group spans nodes runs at the slower ``inter_node_*`` link
(see :func:`osdp_lightning.cost.cost.all_gather_s`).
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from osdp_lightning.cost.budget import parse_bytes, parse_memory_budget
from osdp_lightning.cost.links import CollectiveTimings, NodeTimings, measure_node_collectives
from osdp_lightning.cost.step_terms import StepTerms, step_terms_from_config

UNTRACKED_LAUNCH_SPREAD = 0.5
"""How much more untracked growth a launch may measure than another of the same model: 15.4 and
18.4 MiB for one Mistral built from its config, 16.5-23.8 MiB for the GPT 4-6 x 768 (at most 1.44x).
Training's own growth differs from what setup measured by as much: the same all-replicate plan of
the GPT 4 x 384 used 140.4-142.6 MiB of its own memory in three launches."""


@dataclass(frozen=True)
class ClusterSpec:
    """What the cost model needs to know about the ranks that train together."""

    world_size: int
    """Ranks in the data-parallel group."""
    memory_budget_bytes: int
    """Per-rank memory limit the plan must respect."""
    collective_latency_s: float
    """Fixed cost of one collective call (alpha)."""
    bandwidth_bytes_per_s: float
    """Bus bandwidth of a collective inside the group (bytes moved per second per rank)."""
    overlap_efficiency: float = 0.0
    """Share of neighbouring compute that really hides a collective (about 0 on CPU/gloo)."""
    headroom_bytes: int = 0
    """Bytes of the budget plans must leave free (allocator slack, temporaries the model does not
    see); with :attr:`headroom_fraction` too, the larger of the two (:meth:`headroom_for`)."""
    headroom_fraction: float = 0.0
    """Share of the budget plans must leave free (``0.05``: 5%); plans are solved against
    :attr:`usable_bytes`."""
    headroom_reason: str = ""
    """Which rule set the headroom (``budget.PlanHeadroom.reason``); plans print it beside the figure."""
    headroom_by_kind: bool = False
    """Plans keep headroom by kind (``budget.PlanHeadroom.by_kind``): each choice's bytes grown by
    its kind's measured share, priced beside the peak within :attr:`usable_bytes`, on top of
    :attr:`headroom_bytes` / :attr:`headroom_fraction` (then usually 0)."""
    untracked_bytes: int = 0
    """Bytes the process needs beside the tensors the memory model prices (measured at setup:
    :mod:`osdp_lightning.runtime.process_memory`); plans keep them free on top of the headroom where
    :attr:`untracked_counted`, and a budget named in bytes (a real limit) always counts them."""
    untracked_reason: str = ""
    """Where :attr:`untracked_bytes` was measured; plans print it beside the figure."""
    untracked_counted: bool = True
    """Whether this budget counts :attr:`untracked_bytes`: a real limit does; a share of a
    baseline's predicted peak (``"70%ddp"``) bounds the priced tensors only."""
    bucket_rebuild_counted: bool = False
    """Whether plans are priced for DDP's bucket rebuild: once, at the second step's forward, the
    reducer allocates its buckets again before it frees the first ones, the replicated gradients
    twice beside the whole state. A real limit on the process counts it; a budget that bounds the
    tensors of one tracked step (a later one) does not."""
    ranks_per_node: int | None = None
    """Ranks that share a node; ``None`` means all of them (one node)."""
    inter_node_bandwidth_bytes_per_s: float | None = None
    """Bus bandwidth per rank of a collective whose group spans nodes; ``None``: as inside a node."""
    inter_node_latency_s: float | None = None
    """Alpha of a collective whose group spans nodes; ``None``: as inside a node."""
    peak_flops_per_s: float | None = None
    """Per-device peak FLOP/s (dry-run planning turns counted FLOPs into seconds with it)."""
    step_terms: StepTerms | None = None
    """What each collective, FSDP2's per-unit work, the optimizer step and the loop cost
    (:mod:`osdp_lightning.cost.step_terms`): measured at setup, or from the cluster config's
    ``step_model``. ``None``: collectives from latency and bandwidth alone, nothing else priced."""

    @property
    def local_world_size(self) -> int:
        return self.ranks_per_node or self.world_size

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // self.local_world_size)

    def crosses_nodes(self, group: int) -> bool:
        """Whether a group of ``group`` consecutive ranks spans more than one node."""
        return self.num_nodes > 1 and group > self.local_world_size

    def link(self, crosses_nodes: bool) -> tuple[float, float]:
        """``(latency_s, bandwidth_bytes_per_s)`` of a collective inside one node or across nodes."""
        if not crosses_nodes:
            return self.collective_latency_s, self.bandwidth_bytes_per_s
        latency = self.inter_node_latency_s if self.inter_node_latency_s is not None else self.collective_latency_s
        bandwidth = self.inter_node_bandwidth_bytes_per_s or self.bandwidth_bytes_per_s
        return latency, bandwidth

    def headroom_for(self, budget_bytes: int) -> int:
        """Bytes a plan keeps free of ``budget_bytes``: the larger of the bytes and the share."""
        return max(self.headroom_bytes, int(budget_bytes * self.headroom_fraction))

    def kept_free_bytes(self, budget_bytes: int) -> int:
        """Bytes a plan keeps free of ``budget_bytes``: its headroom and :attr:`kept_untracked_bytes`."""
        return self.headroom_for(budget_bytes) + self.kept_untracked_bytes

    @property
    def kept_untracked_bytes(self) -> int:
        """What plans keep free for the untracked growth: :attr:`named_untracked_bytes` where the
        budget counts it (:attr:`untracked_counted`), else nothing."""
        return self.named_untracked_bytes if self.untracked_counted else 0

    @property
    def usable_bytes(self) -> int:
        """What a plan may fill: the budget less what it keeps free (not positive: nothing fits)."""
        return self.memory_budget_bytes - self.kept_free_bytes(self.memory_budget_bytes)

    @property
    def named_untracked_bytes(self) -> int:
        """The untracked bytes a budget that counts them keeps free: what this launch measured and
        :data:`UNTRACKED_LAUNCH_SPREAD` of it again, since training's own growth, and the next
        launch's measure, differ from it."""
        return math.ceil(self.untracked_bytes * (1 + UNTRACKED_LAUNCH_SPREAD))

    def smallest_budget_for(self, usable_bytes: int) -> int:
        """The least budget in bytes (a real limit: :attr:`named_untracked_bytes` kept free) whose
        usable bytes (budget less what plans keep free) reach ``usable_bytes``.

        Exact for any headroom rule that grows by at most one byte per byte of budget (bytes, a
        share below 1, the larger of both): usable bytes never fall as the budget grows, so the
        least budget is found by bisection on whole bytes.
        """
        def usable(budget: int) -> int:
            return budget - self.headroom_for(budget) - self.named_untracked_bytes

        low, high = usable_bytes, max(usable_bytes, 1)  # usable(low) <= low: too small or just right
        while usable(high) < usable_bytes:
            low, high = high, 2 * high
        while low < high:  # invariant: usable(high) >= usable_bytes
            middle = (low + high) // 2
            low, high = (low, middle) if usable(middle) >= usable_bytes else (middle + 1, high)
        return high

    def __post_init__(self) -> None:
        if self.headroom_bytes < 0 or self.untracked_bytes < 0 or not 0.0 <= self.headroom_fraction < 1.0:
            raise ValueError(f"headroom must be >= 0 bytes and a share in [0, 1), untracked bytes >= 0; got "
                             f"{self.headroom_bytes} bytes, {self.headroom_fraction} and {self.untracked_bytes}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.bandwidth_bytes_per_s <= 0:
            raise ValueError(f"bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s}")
        if not 0.0 <= self.overlap_efficiency <= 1.0:
            raise ValueError(f"overlap_efficiency must be in [0, 1], got {self.overlap_efficiency}")



_REQUIRED_KEYS = ("devices_per_node", "nodes", "intra_node_bandwidth_bytes_per_s", "intra_node_latency_s")


# ---------------------------------------------------------------------------------------------
# From a cluster description
# ---------------------------------------------------------------------------------------------
def cluster_spec_from_config(config: Mapping[str, Any], memory_budget: int | str | None = None) -> ClusterSpec:
    """The cost model's view of a ``conf/cluster`` entry (a dict or an OmegaConf node).

    ``memory_budget`` overrides the config's ``memory_budget`` (itself defaulting to
    ``memory_per_device``). Missing inter-node figures mean the inter-node link is as fast as
    the intra-node one (harmless on one node).
    """
    missing = [k for k in _REQUIRED_KEYS if config.get(k) is None]
    if missing:
        raise ValueError(f"cluster config {config.get('name', '?')!r} lacks {missing}")
    budget = memory_budget if memory_budget is not None else config.get("memory_budget")
    budget = budget if budget is not None else config.get("memory_per_device")
    if budget is None:
        raise ValueError(f"cluster config {config.get('name', '?')!r} has no memory_budget or memory_per_device")
    devices, nodes = int(config["devices_per_node"]), int(config["nodes"])
    headroom = config.get("headroom")
    return ClusterSpec(
        world_size=devices * nodes,
        memory_budget_bytes=config_budget_bytes(budget, config),
        collective_latency_s=float(config["intra_node_latency_s"]),
        bandwidth_bytes_per_s=float(config["intra_node_bandwidth_bytes_per_s"]),
        overlap_efficiency=float(config.get("overlap_efficiency") or 0.0),
        headroom_bytes=parse_bytes(headroom) if headroom else 0,
        ranks_per_node=devices,
        inter_node_bandwidth_bytes_per_s=_optional_float(config.get("inter_node_bandwidth_bytes_per_s")),
        inter_node_latency_s=_optional_float(config.get("inter_node_latency_s")),
        peak_flops_per_s=_optional_float(config.get("peak_flops_per_s")),
        step_terms=step_terms_from_config(config),
    )


def config_budget_bytes(budget: int | str, config: Mapping[str, Any]) -> int:
    """Bytes of a budget in a cluster config: ``"70%"`` is a share of ``memory_per_device``.

    A share of a baseline's peak (``"95%ddp"``) is known only after profiling: until the caller
    resolves it (``osdp-plan`` does, with :func:`osdp_lightning.plan.plan.baseline_peak_bytes`), the
    device's whole memory stands in.
    """
    parsed = parse_memory_budget(budget)
    if parsed.bytes is not None:
        return parsed.bytes
    device = config.get("memory_per_device")
    if device is None:
        raise ValueError(f"memory budget {parsed.text!r} is a share, but cluster config {config.get('name', '?')!r} "
                         "has no memory_per_device to take it of")
    return parsed.of_device(parse_bytes(device))


def cluster_config_dir() -> Path:
    """The ``conf/cluster`` directory (the installed ``conf`` package, else the source tree's)."""
    spec = importlib.util.find_spec("osdp_lightning.conf")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))) / "cluster"
    return Path(__file__).resolve().parents[1] / "conf" / "cluster"


def load_cluster_config(name_or_path: str | Path) -> dict[str, Any]:
    """A cluster description by name (``"h100_80g_x8x2"``) or YAML path, interpolations resolved."""
    from omegaconf import OmegaConf

    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = cluster_config_dir() / f"{name_or_path}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in cluster_config_dir().glob("*.yaml"))
        raise FileNotFoundError(f"no cluster config {name_or_path!r} ({path}); known: {known}")
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)  # type: ignore[return-value]


def load_cluster_spec(name_or_path: str | Path, memory_budget: int | str | None = None) -> ClusterSpec:
    """:func:`cluster_spec_from_config` of :func:`load_cluster_config`."""
    return cluster_spec_from_config(load_cluster_config(name_or_path), memory_budget)


def describe_cluster(cluster: ClusterSpec) -> str:
    """One line naming what the plan assumes about the cluster."""
    inter_latency, inter_bandwidth = cluster.link(crosses_nodes=True)
    text = (f"{cluster.num_nodes} node(s) x {cluster.local_world_size} ranks, intra-node "
            f"{cluster.bandwidth_bytes_per_s / 1e9:.3g} GB/s + {cluster.collective_latency_s * 1e6:.3g} us")
    if cluster.num_nodes > 1:
        text += f", inter-node {inter_bandwidth / 1e9:.3g} GB/s + {inter_latency * 1e6:.3g} us"
    if cluster.peak_flops_per_s:
        text += f", peak {cluster.peak_flops_per_s / 1e12:.3g} TFLOP/s per device"
    return text


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


# ---------------------------------------------------------------------------------------------
# From the live environment
# ---------------------------------------------------------------------------------------------
def environment_topology() -> tuple[int, int]:
    """``(world_size, ranks_per_node)`` of the running job (torchrun / SLURM / Lightning variables)."""
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE")
    return world, int(local) if local else world


def live_cluster_spec(*, world_size: int, ranks_per_node: int, memory_budget_bytes: int,
                      timings: CollectiveTimings | None, node_timings: NodeTimings | None = None,
                      overlap_efficiency: float | None = None, headroom_bytes: int = 0,
                      headroom_fraction: float = 0.0, headroom_by_kind: bool = False) -> ClusterSpec:
    """The ClusterSpec of the running job.

    ``timings`` come from :func:`osdp_lightning.cost.links.measure_collectives` on the whole world;
    with several nodes, ``node_timings`` split them into the intra-node and inter-node link. No
    timings (one process) means communication is free, which is right: there is none.
    """
    overlap = overlap_efficiency if overlap_efficiency is not None else (timings.overlap_efficiency if timings else 0.0)
    latency = timings.latency_s if timings else 0.0
    bandwidth = timings.bandwidth_bytes_per_s if timings else 1e12
    inter_latency = inter_bandwidth = None
    if node_timings is not None and world_size > ranks_per_node:
        if ranks_per_node > 1:
            latency, bandwidth = node_timings.intra_latency_s, node_timings.intra_bandwidth_bytes_per_s
        inter_latency, inter_bandwidth = node_timings.inter_latency_s, node_timings.inter_bandwidth_bytes_per_s
    return ClusterSpec(world_size=world_size, memory_budget_bytes=memory_budget_bytes,
                       collective_latency_s=latency, bandwidth_bytes_per_s=bandwidth,
                       overlap_efficiency=overlap, headroom_bytes=headroom_bytes,
                       headroom_fraction=headroom_fraction, headroom_by_kind=headroom_by_kind,
                       ranks_per_node=ranks_per_node,
                       inter_node_bandwidth_bytes_per_s=inter_bandwidth, inter_node_latency_s=inter_latency)


# NOTE: NodeTimings and measure_node_collectives live in links.py; callers import them from here too.
__all__ = ["ClusterSpec", "NodeTimings", "cluster_config_dir", "cluster_spec_from_config", "config_budget_bytes",
           "describe_cluster", "environment_topology", "live_cluster_spec", "load_cluster_config",
           "load_cluster_spec", "measure_node_collectives"]
