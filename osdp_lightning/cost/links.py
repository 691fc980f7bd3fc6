"""Timing the links of the live process group: what the cluster's link figures are measured by.

- :func:`measure_collectives`: latency (alpha), all-gather bandwidth and how much of a collective
  hides behind compute, on the whole world;
- :func:`measure_node_collectives`: the same inside one node and across nodes.

Every rank takes part in the collectives, but only rank 0's numbers are used: they are broadcast,
because plans derived from per-rank timings would differ and deadlock. The results are plain data
that :func:`osdp_lightning.cost.cluster.live_cluster_spec` turns into a cluster spec.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


@dataclass(frozen=True)
class CollectiveTimings:
    latency_s: float
    """Least time of a one-element all-reduce (of 5, after a warm-up)."""
    bandwidth_bytes_per_s: float
    """All-gather bus bandwidth: bytes moved per rank ((W-1)/W of the output) per second."""
    overlap_efficiency: float
    """Share of an all-gather that ran hidden behind a concurrent matmul (0..1)."""
    calibrate_s: float


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def least_time_s(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Least seconds of ``repeats`` calls of ``fn`` after one warm-up call."""
    fn()  # warm-up (connection set-up, allocator)
    samples = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        samples.append(time.perf_counter() - start)
    # NOTE: the least, as for the step terms' collectives: delays are one-sided (the other rank still
    # busy at setup). The median of 5 one-element all-reduces once read 3.8 ms instead of about 0.15
    # (the main job on a fresh clone), and zero2 / zero3 were priced 50-80% slower for it.
    return min(samples)


LINK_PAYLOAD_BYTES = 8 * 2**20
"""Bytes of the all-gather :func:`measure_collectives` times (gathered)."""
NODE_PAYLOAD_BYTES = 4 * 2**20
"""Bytes of the all-gathers :func:`measure_node_collectives` times (gathered)."""
OVERLAP_MATRIX = 512
"""Side of the fp32 matrix whose products the overlap probe runs beside the all-gather."""


def all_gather_held_bytes(gathered_bytes: int, world: int) -> int:
    """At most what timing an all-gather into one tensor of ``gathered_bytes`` holds at once: the
    gathered tensor, its shard, and gloo's own buffer as large as the gathered one (it gathers into
    that first) twice: gloo's thread releases it after the call returns, so the next call's may
    already be there (:mod:`osdp_lightning.runtime.collectives`)."""
    return 3 * gathered_bytes + math.ceil(gathered_bytes / world)


def link_probe_bytes(payload_bytes: int, world: int) -> int:
    """At most what :func:`measure_collectives` holds at once: its all-gather's bytes, the matrix
    and one product."""
    return all_gather_held_bytes(payload_bytes, world) + 2 * OVERLAP_MATRIX**2 * 4


def measure_collectives(device: torch.device, payload_bytes: int = LINK_PAYLOAD_BYTES, repeats: int = 5,
                        group: dist.ProcessGroup | None = None) -> CollectiveTimings:
    """Time collectives on ``group`` and return rank 0's figures on every rank (holding at most
    :func:`link_probe_bytes`)."""
    start = time.perf_counter()
    world = dist.get_world_size(group)
    tiny = torch.zeros(1, device=device)
    shard = torch.ones(payload_bytes // 4 // world, device=device)
    gathered = torch.empty(shard.numel() * world, device=device)
    a = torch.randn(OVERLAP_MATRIX, OVERLAP_MATRIX, device=device,
                    generator=torch.Generator(device).manual_seed(0))  # not the user's

    def all_gather(async_op: bool = False):
        with warnings.catch_warnings():  # renamed in newer torch; the old name works from 2.6 on
            warnings.simplefilter("ignore", FutureWarning)
            return dist.all_gather_into_tensor(gathered, shard, group=group, async_op=async_op)

    def compute() -> None:
        for _ in range(4):
            a @ a

    def both() -> None:
        work = all_gather(async_op=True)
        compute()
        work.wait()

    latency = least_time_s(lambda: dist.all_reduce(tiny, group=group), device, repeats)
    gather_s = least_time_s(all_gather, device, repeats)
    compute_s = least_time_s(compute, device, repeats)
    both_s = least_time_s(both, device, repeats)
    moved = gathered.numel() * 4 * (world - 1) / world
    bandwidth = moved / max(gather_s - latency, 1e-9)
    hidden = gather_s + compute_s - both_s
    overlap = min(max(hidden / max(min(gather_s, compute_s), 1e-9), 0.0), 1.0)
    figures = torch.tensor([latency, bandwidth, overlap], dtype=torch.float64, device=device)
    dist.broadcast(figures, src=0, group=group)
    latency, bandwidth, overlap = (float(x) for x in figures.tolist())
    return CollectiveTimings(latency, bandwidth, overlap, time.perf_counter() - start)


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


def _time_group(group: dist.ProcessGroup, device: torch.device, payload_bytes: int,
                repeats: int) -> tuple[float, float]:
    """``(latency_s, bandwidth_bytes_per_s)`` of ``group``: a tiny all-reduce and a large all-gather."""
    size = dist.get_world_size(group)
    tiny = torch.zeros(1, device=device)
    shard = torch.ones(max(payload_bytes // 4 // size, 1), device=device)
    gathered = torch.empty(shard.numel() * size, device=device)
    latency = least_time_s(lambda: dist.all_reduce(tiny, group=group), device, repeats)
    gather_s = least_time_s(lambda: dist.all_gather_into_tensor(gathered, shard, group=group), device, repeats)
    moved = gathered.numel() * 4 * (size - 1) / size
    return latency, moved / max(gather_s - latency, 1e-9)


def measure_node_collectives(device: torch.device, ranks_per_node: int, payload_bytes: int = NODE_PAYLOAD_BYTES,
                             repeats: int = 3) -> NodeTimings:
    """Time collectives inside each node and across nodes; every rank must call it.

    Ranks ``n * ranks_per_node ... (n + 1) * ranks_per_node - 1`` form node ``n`` (how torchrun,
    SLURM and Lightning number them). Rank 0's figures are broadcast: plans made from per-rank
    timings could differ and deadlock.
    """
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
