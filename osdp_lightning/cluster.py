"""Where a :class:`~osdp_lightning.cost.ClusterSpec` comes from.

Two sources, one result:

- a cluster description (``conf/cluster/<name>.yaml``, or any mapping with the same keys) for a
  cluster you plan for but may not have: :func:`cluster_spec_from_config`, :func:`load_cluster_spec`;
- the live process group of the run itself: :func:`measure_node_collectives` times collectives
  inside a node and across nodes, :func:`live_cluster_spec` combines them with the topology
  (world size, ranks per node) that Lightning or torchrun reports.

Links are modelled as two tiers. Inside a node (NVLink, PCIe, loopback) a collective runs at
``intra_node_*``; a collective whose group spans nodes runs at the slower ``inter_node_*`` link
(see :func:`osdp_lightning.cost.all_gather_s`).
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from osdp_lightning.budget import parse_bytes
from osdp_lightning.calibrate import CollectiveTimings
from osdp_lightning.cost import ClusterSpec

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
        memory_budget_bytes=parse_bytes(budget),
        collective_latency_s=float(config["intra_node_latency_s"]),
        bandwidth_bytes_per_s=float(config["intra_node_bandwidth_bytes_per_s"]),
        overlap_efficiency=float(config.get("overlap_efficiency") or 0.0),
        headroom_bytes=parse_bytes(headroom) if headroom else 0,
        ranks_per_node=devices,
        inter_node_bandwidth_bytes_per_s=_optional_float(config.get("inter_node_bandwidth_bytes_per_s")),
        inter_node_latency_s=_optional_float(config.get("inter_node_latency_s")),
        peak_flops_per_s=_optional_float(config.get("peak_flops_per_s")),
    )


def cluster_config_dir() -> Path:
    """The ``conf/cluster`` directory (the installed ``conf`` package, else the source tree's)."""
    spec = importlib.util.find_spec("conf")
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
@dataclass(frozen=True)
class NodeTimings:
    """Collective timings measured inside one node and across nodes (rank 0's figures)."""

    intra_latency_s: float
    """Median seconds of a one-element all-reduce among the ranks of one node."""
    intra_bandwidth_bytes_per_s: float
    """All-gather bus bandwidth among the ranks of one node."""
    inter_latency_s: float
    """Median seconds of a one-element all-reduce among one rank of each node."""
    inter_bandwidth_bytes_per_s: float
    """All-gather bus bandwidth among one rank of each node."""
    measure_s: float
    """Wall seconds the measurement took."""


def environment_topology() -> tuple[int, int]:
    """``(world_size, ranks_per_node)`` of the running job (torchrun / SLURM / Lightning variables)."""
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE")
    return world, int(local) if local else world


def _median_s(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    fn()  # warm-up: connection set-up, allocator
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _time_group(group: dist.ProcessGroup, device: torch.device, payload_bytes: int,
                repeats: int) -> tuple[float, float]:
    """``(latency_s, bandwidth_bytes_per_s)`` of ``group``: a tiny all-reduce and a large all-gather."""
    size = dist.get_world_size(group)
    tiny = torch.zeros(1, device=device)
    shard = torch.ones(max(payload_bytes // 4 // size, 1), device=device)
    gathered = torch.empty(shard.numel() * size, device=device)
    latency = _median_s(lambda: dist.all_reduce(tiny, group=group), device, repeats)
    gather_s = _median_s(lambda: dist.all_gather_into_tensor(gathered, shard, group=group), device, repeats)
    moved = gathered.numel() * 4 * (size - 1) / size
    return latency, moved / max(gather_s - latency, 1e-9)


def measure_node_collectives(device: torch.device, ranks_per_node: int, payload_bytes: int = 4 * 2**20,
                             repeats: int = 3) -> NodeTimings:
    """Time collectives inside each node and across nodes; every rank must call it.

    Ranks ``n * ranks_per_node ... (n + 1) * ranks_per_node - 1`` form node ``n`` (how torchrun,
    SLURM and Lightning number them). Rank 0's figures are broadcast: plans made from per-rank
    timings could differ and deadlock.
    """
    from torch.distributed.device_mesh import init_device_mesh

    start = time.perf_counter()
    world = dist.get_world_size()
    if world % ranks_per_node:
        raise ValueError(f"world size {world} is not a multiple of {ranks_per_node} ranks per node")
    mesh = init_device_mesh(device.type, (world // ranks_per_node, ranks_per_node),
                            mesh_dim_names=("node", "local"))
    intra = (0.0, float("inf"))
    if ranks_per_node > 1:
        intra = _time_group(mesh.get_group("local"), device, payload_bytes, repeats)
    inter = _time_group(mesh.get_group("node"), device, payload_bytes, repeats)
    figures = torch.tensor([*intra, *inter], dtype=torch.float64, device=device)
    dist.broadcast(figures, src=0)
    values = [float(x) for x in figures.tolist()]
    return NodeTimings(*values, measure_s=time.perf_counter() - start)


def live_cluster_spec(*, world_size: int, ranks_per_node: int, memory_budget_bytes: int,
                      timings: CollectiveTimings | None, node_timings: NodeTimings | None = None,
                      overlap_efficiency: float | None = None, headroom_bytes: int = 0) -> ClusterSpec:
    """The ClusterSpec of the running job.

    ``timings`` come from :func:`osdp_lightning.calibrate.measure_collectives` on the whole world;
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
                       overlap_efficiency=overlap, headroom_bytes=headroom_bytes, ranks_per_node=ranks_per_node,
                       inter_node_bandwidth_bytes_per_s=inter_bandwidth, inter_node_latency_s=inter_latency)
