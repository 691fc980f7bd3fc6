"""Collective timings measured on the live process group (part of the cost stage).

A few timed collectives give latency (alpha), bandwidth and how much of a collective really
hides behind compute. Every rank takes part in the collectives, but only rank 0's numbers are
used: they are broadcast, because plans derived from per-rank timings would differ and deadlock.
"""

from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class CollectiveTimings:
    latency_s: float
    """Median time of a one-element all-reduce."""
    bandwidth_bytes_per_s: float
    """All-gather bus bandwidth: bytes moved per rank ((W-1)/W of the output) per second."""
    overlap_efficiency: float
    """Share of an all-gather that ran hidden behind a concurrent matmul (0..1)."""
    calibrate_s: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up (connection set-up, allocator)
    samples = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure_collectives(device: torch.device, payload_bytes: int = 8 * 2**20, repeats: int = 5,
                        group: dist.ProcessGroup | None = None) -> CollectiveTimings:
    """Time collectives on ``group`` and return rank 0's figures on every rank."""
    start = time.perf_counter()
    world = dist.get_world_size(group)
    tiny = torch.zeros(1, device=device)
    shard = torch.ones(payload_bytes // 4 // world, device=device)
    gathered = torch.empty(shard.numel() * world, device=device)
    a = torch.randn(512, 512, device=device)

    def all_gather(async_op: bool = False):
        with warnings.catch_warnings():  # renamed in newer torch; the old name works from 2.6 on
            warnings.simplefilter("ignore", FutureWarning)
            return dist.all_gather_into_tensor(gathered, shard, group=group, async_op=async_op)

    def both() -> None:
        work = all_gather(async_op=True)
        for _ in range(4):
            a @ a
        work.wait()

    latency = _timed(lambda: dist.all_reduce(tiny, group=group), device, repeats)
    gather_s = _timed(all_gather, device, repeats)
    compute_s = _timed(lambda: [a @ a for _ in range(4)], device, repeats)
    both_s = _timed(both, device, repeats)
    moved = gathered.numel() * 4 * (world - 1) / world
    bandwidth = moved / max(gather_s - latency, 1e-9)
    hidden = gather_s + compute_s - both_s
    overlap = min(max(hidden / max(min(gather_s, compute_s), 1e-9), 0.0), 1.0)
    figures = torch.tensor([latency, bandwidth, overlap], dtype=torch.float64, device=device)
    dist.broadcast(figures, src=0, group=group)
    latency, bandwidth, overlap = (float(x) for x in figures.tolist())
    return CollectiveTimings(latency, bandwidth, overlap, time.perf_counter() - start)
