"""Step terms measured on the live process group at setup (part of the cost stage, above the
pipeline it prices: it applies tiny plans and prices them with the cost model and the solver).

:func:`calibrate_step_terms`: every step-time term besides compute
(:class:`~osdp_lightning.cost.step_terms.StepTerms`): each collective kind at four sizes, FSDP2's own work
and the optimizer step per choice from tiny plans (:mod:`~osdp_lightning.calibrate.bench`, fitted by
:mod:`~osdp_lightning.calibrate.fit`), cached per machine (:mod:`~osdp_lightning.calibrate.cache`).
The link figures (latency, bandwidth, overlap) are :mod:`osdp_lightning.cost.links`'; they are imported
from here too.

Every rank takes part in the collectives, but only rank 0's numbers are used: they are
broadcast, because plans derived from per-rank timings would differ and deadlock.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from osdp_lightning.calibrate.bench import (
    BENCH_ROUNDS_S,
    COLLECTIVE_REPEATS,
    LOCAL,
    STACK_WIDTHS,
    BenchSpec,
    bench_specs,
    time_collective_sizes,
)
from osdp_lightning.calibrate.cache import (
    CACHE_DRAWS,
    CACHE_ENV,
    CACHE_FORMAT,
    CACHE_MAX_AGE_S,
    DRAWS_ENV,
    cache_dir,
    cache_draws,
    cache_file,
    calibration_key,
    median_terms,
    read_cache,
    write_cache,
)
from osdp_lightning.calibrate.fit import fit_terms, plain_optimizer_term
from osdp_lightning.calibrate.room import (
    CalibrationLayout,
    CalibrationRoomError,
    calibration_layout,
    link_payload_bytes,
    time_bench_groups,
)
from osdp_lightning.cost.budget import format_bytes
from osdp_lightning.cost.links import CollectiveTimings, least_time_s, measure_collectives
from osdp_lightning.cost.step_terms import COLLECTIVES, GROUP_TERMS, PLAIN, Affine, StepTerms
from osdp_lightning.profiling.optim_state import clone_optimizer, optimizer_state_bytes_per_param
from osdp_lightning.runtime.meshes import Meshes

QUIET_CPU_SHARE = 0.80
"""Share of a core each of 2 gloo ranks got during a calibration on this project's quiet 2-core VM
(0.78-0.82: the rest is waiting in collectives)."""
BUSY_CPU_SHARE = 0.65
"""Below this share a calibration is used but not cached (:func:`busy_reason`). Beside one busy
process on those 2 cores the ranks got 0.52-0.55 of a core and zero3's per-group constant rose from
5.8 to 8.1 ms; beside two, 0.40-0.44 and 14.5 ms (means of 3-4 calibrations). A cache written then
over-priced sharding in every later launch (docs/design.md section 7)."""


def _state_bytes_per_param(optimizer: torch.optim.Optimizer | None) -> int:
    return optimizer_state_bytes_per_param(optimizer, torch.float32) if optimizer is not None else 0


def _log_layout(layout: CalibrationLayout, room_bytes: int | None) -> None:
    if len(layout.groups) > 1:
        narrower = "" if layout.standard else f", stacks up to {max(layout.widths)} wide"
        rank_zero_info(f"osdp: calibrating within {format_bytes(room_bytes or 0)} (the memory budget less the "
                       f"model's bytes): its benches in {len(layout.groups)} groups{narrower}, each freed before the next")


def measure_step_terms(device: torch.device, optimizer: torch.optim.Optimizer | None, meshes: Meshes, *,
                       split: bool = True, loop_step_s: float = 0.0, repeats: int = 5,
                       overlap_efficiency: float = 0.0, room_bytes: int | None = None) -> StepTerms:
    """Time collectives and tiny plans on every rank; fit the terms from rank 0's timings.

    ``split``: also run the benches families mark optional (split's); without them those families'
    terms are fitted from the others' (faster, and the cache keeps the two apart).
    ``overlap_efficiency``: what plans will assume (0 on CPU), so that the terms price only what it leaves.
    ``room_bytes``: what calibration may hold at once (a real limit less the model's bytes;
    :mod:`~osdp_lightning.calibrate.room`), checked before anything is allocated."""
    start, start_cpu = time.perf_counter(), time.process_time()
    specs = bench_specs(optional=split)
    layout = calibration_layout(specs, room_bytes, _state_bytes_per_param(optimizer), dist.get_world_size())
    _log_layout(layout, room_bytes)
    collective_s = time_collective_sizes(device, COLLECTIVE_REPEATS, layout.collective_bytes)
    benches = time_bench_groups(layout, specs, device, meshes, optimizer, repeats, BENCH_ROUNDS_S)
    raw: list[Any] = [(collective_s, {k: (b.step_s, b.optimizer_s, b.forward_s) for k, b in benches.items()})]
    dist.broadcast_object_list(raw, src=0)
    collective_s = raw[0][0]
    for key, (step_s, optimizer_s, forward_s) in raw[0][1].items():
        benches[key].step_s, benches[key].optimizer_s, benches[key].forward_s = step_s, optimizer_s, forward_s
    collectives, overhead, optimizer_terms = fit_terms(collective_s, benches, meshes.shard.size(), split,
                                                       overlap_efficiency)
    extra = {f"{c}@{w}_step_s": statistics.median(b.step_s) for (c, w), b in benches.items()}
    extra.update({f"{c}@{w}_forward_s": statistics.median(b.forward_s) for (c, w), b in benches.items()})
    extra.update({f"{c}@{w}_optimizer_s": statistics.median(b.optimizer_s) for (c, w), b in benches.items()
                  if b.optimizer_s})
    extra.update({f"{k}_s": v for k, v in collective_s.items()})
    # NOTE: CPU seconds of this process say what the wall time would be on an idle machine; the
    # least share of a core any rank got says how busy the machine was (busy_reason).
    elapsed = [(time.perf_counter() - start, time.process_time() - start_cpu)] * dist.get_world_size()
    dist.all_gather_object(elapsed, elapsed[0])
    extra["calibrate_cpu_s"] = elapsed[0][1]
    extra["calibrate_cpu_share"] = min(cpu_s / max(wall_s, 1e-9) for wall_s, cpu_s in elapsed)
    extra["calibrate_groups"], extra["calibrate_widest"] = len(layout.groups), max(layout.widths)
    return StepTerms(collectives, overhead, optimizer_terms, loop_step_s, source="measured at setup",
                     calibrate_s=elapsed[0][0], extra=extra)


def measure_one_process_terms(device: torch.device, optimizer: torch.optim.Optimizer | None, *,
                              loop_step_s: float, repeats: int = 5, room_bytes: int | None = None) -> StepTerms:
    """The step terms of a run in one process: no collectives and no sharding machinery (nothing is
    sharded), the optimizer step on plain tensors timed on the plain stacks, and the loop.

    NOTE: without these two a one-GPU step is predicted 6-16% short (AdamW 4.8 ms and the loop
    1.2 ms of a 56 ms step, GPT 12 x 1024 on an H200)."""
    start, zero = time.perf_counter(), Affine(0.0, 0.0)
    optimizer_s: dict[tuple[str, int], float] = {}
    if optimizer is not None:
        optimizer_s = _time_plain_optimizer(device, optimizer, repeats, room_bytes)
    plain = plain_optimizer_term(optimizer_s) if optimizer_s else zero
    return StepTerms(collectives={k: zero for k in COLLECTIVES}, overhead={k: zero for k in GROUP_TERMS},
                     optimizer={PLAIN: plain, **{k: plain for k in GROUP_TERMS}}, loop_step_s=loop_step_s,
                     source="measured at setup (one process: the optimizer step and the loop)",
                     calibrate_s=time.perf_counter() - start,
                     extra={f"{c}@{w}_optimizer_s": v for (c, w), v in optimizer_s.items()})


def _time_plain_optimizer(device: torch.device, optimizer: torch.optim.Optimizer, repeats: int,
                          room_bytes: int | None) -> dict[tuple[str, int], float]:
    """The optimizer step's median seconds on the plain stacks, keyed like the benches; none where
    not even the narrowest fits ``room_bytes`` (one process's plan does not depend on them)."""
    specs = [BenchSpec(LOCAL)]
    try:
        layout = calibration_layout(specs, room_bytes, _state_bytes_per_param(optimizer), 1)
    except CalibrationRoomError as err:
        rank_zero_info(f"osdp: the optimizer step is not timed: {err}")
        return {}
    _log_layout(layout, room_bytes)
    benches = time_bench_groups(layout, specs, device, None, optimizer, repeats, BENCH_ROUNDS_S)
    return {k: statistics.median(b.optimizer_s) for k, b in benches.items()}


def busy_reason(terms: StepTerms, device: torch.device) -> str | None:
    """Why freshly measured ``terms`` must not be cached (the machine was busy), or ``None``.

    On CPU a rank that waits for a core, or for a rank that does, gets less of one: the terms then
    price sharding for a busier machine than the next launch may find, and a cache would carry
    them into every later launch. On CUDA the ranks wait for the device, not for cores: no check.
    """
    share = terms.extra.get("calibrate_cpu_share")
    if device.type != "cpu" or share is None or share >= BUSY_CPU_SHARE:
        return None
    return (f"the machine was busy while they were measured (a rank got {100 * share:.0f}% of a core; "
            f"{100 * QUIET_CPU_SHARE:.0f}% on a quiet machine)")


def narrow_reason(terms: StepTerms) -> str | None:
    """Why freshly measured ``terms`` must not be cached (stacks narrower than the usual, to fit a
    small budget: :mod:`~osdp_lightning.calibrate.room`), or ``None``."""
    widest = terms.extra.get("calibrate_widest", max(STACK_WIDTHS))
    if widest == max(STACK_WIDTHS):
        return None
    return f"the memory budget left room only for stacks up to {widest:.0f} wide (usually {max(STACK_WIDTHS)})"


def calibrate_step_terms(device: torch.device, optimizer: torch.optim.Optimizer | None, meshes: Meshes, *,
                         ranks_per_node: int, split: bool = True, loop_step_s: float = 0.0,
                         use_cache: bool = True, room_bytes: int | None = None) -> StepTerms:
    """The step terms of this process group: the median of the cached calibrations once there are
    :data:`CACHE_DRAWS` (or :data:`DRAWS_ENV`) of them that rank 0 trusts; else measured within
    ``room_bytes`` (:func:`measure_step_terms`), added to the cache and taken with the cached ones
    (every rank must call this; every rank returns rank 0's terms)."""
    key = calibration_key(device, dist.get_world_size(), ranks_per_node, optimizer, split)
    path, wanted = cache_file(key), cache_draws(CACHE_DRAWS)
    found: list[Any] = [[]]
    if use_cache and dist.get_rank() == 0:
        found[0] = [draw.to_dict() for draw in read_cache(path, key) or []][-wanted:]
    dist.broadcast_object_list(found, src=0)
    draws = [StepTerms.from_dict(draw) for draw in found[0]]
    if len(draws) == wanted:
        terms = median_terms(draws, source=f"cache {path} (median of {len(draws)} calibrations)")
        return replace(terms, loop_step_s=loop_step_s, calibrate_s=0.0)
    measured = measure_step_terms(device, optimizer, meshes, split=split, loop_step_s=loop_step_s,
                                  room_bytes=room_bytes)
    busy = narrow_reason(measured) or busy_reason(measured, device)  # the same on every rank
    if busy is not None:  # used for this launch only: they stand for now, not for later launches
        if use_cache and dist.get_rank() == 0:
            rank_zero_info(f"osdp: step terms not cached: {busy}; the next launch measures again")
        return measured
    if use_cache and dist.get_rank() == 0:
        write_cache(path, key, [*draws, measured], keep=wanted)
    if not draws:
        return measured
    terms = median_terms([*draws, measured], source=f"measured at setup, median with {len(draws)} cached")
    return replace(terms, loop_step_s=loop_step_s, calibrate_s=measured.calibrate_s)


__all__ = ["BUSY_CPU_SHARE", "CACHE_DRAWS", "CACHE_ENV", "CACHE_FORMAT", "CACHE_MAX_AGE_S", "DRAWS_ENV",
           "QUIET_CPU_SHARE", "CalibrationRoomError", "CollectiveTimings", "busy_reason", "cache_dir", "cache_draws",
           "cache_file", "calibrate_step_terms", "calibration_key", "clone_optimizer", "least_time_s",
           "link_payload_bytes", "measure_collectives", "measure_one_process_terms", "measure_step_terms",
           "median_terms", "narrow_reason", "read_cache", "write_cache"]
