"""Calibration within a memory limit: which benches are alive at once, and how large.

Calibration's benches are sized for the machine, not for a budget: all of them alive at once
hold about 90-105 MiB above the resident set on 2 CPU ranks with AdamW. Under a budget that is a
real limit, the room calibration may use (the budget less what the model already holds) decides
its layout (:func:`calibration_layout`), the first that fits of:

1. every bench at once;
2. one stack width at a time;
3. each bench beside the one it is timed against, one pair at a time;
4. pairs of narrower stacks, with smaller collectives: the widths and sizes halved until they fit
   (a model whose budget leaves so little has units smaller than the usual stacks anyway), down to
   about 0.4 MiB with AdamW.

Each group is built, timed (its order rotated each round,
:func:`~osdp_lightning.calibrate.bench.time_benches`) and freed before the next; a bench timed in
several groups (the plain stack) keeps every round's figures. Where not even the narrowest layout
fits, the launch is refused before anything is allocated, naming the budget it needs.

The bytes are upper bounds from the stacks' shapes: every bench counted unsharded (a sharded one
holds less), and one step's transients on top of its group (only one bench steps at a time).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from osdp_lightning.calibrate.bench import (
    COLLECTIVE_BYTES,
    STACK_DEPTH,
    STACK_ROWS,
    STACK_WIDTHS,
    Bench,
    BenchSpec,
    build_bench,
    release_benches,
    stack_unit_params,
    time_benches,
)
from osdp_lightning.cost.budget import format_bytes
from osdp_lightning.cost.links import LINK_PAYLOAD_BYTES, all_gather_held_bytes, link_probe_bytes
from osdp_lightning.runtime.meshes import Meshes

BenchKey = tuple[str, int]
"""A bench's spec name and stack width."""

STEP_ACTIVATIONS = 6
"""Tensors of a stack block's width and rows a bench's step holds per block (the norm's output, the
two Linears', the activation's, the residual and its gradient)."""
WIDTH_HALVINGS = 4
"""How often the narrower layouts halve the stacks' widths (down to 4, 16 and 32)."""
SIZE_HALVINGS = 8
"""How often they halve the collectives' sizes (the largest down to 64 KiB), as long as that makes
the layout smaller."""


MIN_LINK_PAYLOAD_BYTES = 64 * 2**10
"""The least payload the link probe is halved to."""


class CalibrationRoomError(MemoryError):
    """Calibration would take the process past its memory budget (raised before anything is allocated)."""


@dataclass(frozen=True)
class CalibrationLayout:
    """Which benches calibration builds and times together, at which widths, and the collectives' sizes."""

    groups: tuple[tuple[BenchKey, ...], ...]
    """Built, timed and freed in turn."""
    collective_bytes: tuple[int, ...] = COLLECTIVE_BYTES
    """Unsharded bytes of the timed sizes of each collective."""
    peak_bytes: int = 0
    """At most what it holds at once (the largest group's or the collectives')."""

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(sorted({width for group in self.groups for _, width in group}))

    @property
    def standard(self) -> bool:
        """Whether it times the usual widths and sizes (what a cached calibration must have timed)."""
        return self.widths == STACK_WIDTHS and self.collective_bytes == COLLECTIVE_BYTES


def bench_held_bytes(width: int, state_bytes_per_param: int) -> int:
    """At most what one bench holds between its steps: its stack's fp32 parameters and gradients and
    the optimizer's state, all unsharded."""
    return STACK_DEPTH * stack_unit_params(width, None) * (2 * 4 + state_bytes_per_param)


def bench_step_bytes(width: int) -> int:
    """At most what one step of a bench allocates and frees: the whole stack gathered and its
    unsharded gradients (a sharded bench), the optimizer step's temporaries (as large again: a
    foreach step over the group) and the activations."""
    params_bytes = STACK_DEPTH * stack_unit_params(width, None) * 4
    return 3 * params_bytes + STACK_DEPTH * STEP_ACTIVATIONS * STACK_ROWS * width * 4


def collective_peak_bytes(world: int, sizes: Sequence[int] = COLLECTIVE_BYTES) -> int:
    """What the timed collectives hold at once: the largest size's all-gather (each size is timed and
    freed before the next; 40 MiB measured at 16 MiB)."""
    return all_gather_held_bytes(max(sizes), world) if world > 1 else 0


def group_peak_bytes(group: Sequence[BenchKey], state_bytes_per_param: int) -> int:
    """At most what ``group``'s benches hold while one of them steps."""
    return (sum(bench_held_bytes(width, state_bytes_per_param) for _, width in group)
            + max(bench_step_bytes(width) for _, width in group))


def grouping_levels(specs: Sequence[BenchSpec], widths: Sequence[int] = STACK_WIDTHS
                    ) -> list[list[list[BenchKey]]]:
    """The ways to group the benches at ``widths``, from the fastest (all at once) to the leanest
    (each bench beside the one it is timed against, one width at a time)."""
    keys = [(spec.name, width) for width in widths for spec in specs]
    by_width = [[key for key in keys if key[1] == width] for width in widths]
    benched = [spec for spec in specs if spec.calibration is not None and not spec.reference]
    pairs = [[(spec.against, width), (spec.name, width)] for width in widths for spec in benched]
    alone = [[(spec.name, width)] for width in widths for spec in specs
             if spec not in benched and not any(spec.name == b.against for b in benched)]
    return [[keys], by_width, pairs + alone if pairs else by_width]


def candidate_layouts(specs: Sequence[BenchSpec], state_bytes_per_param: int, world: int) -> list[CalibrationLayout]:
    """Every layout :func:`calibration_layout` may take, fastest first."""
    layouts: list[CalibrationLayout] = []
    for halvings in range(SIZE_HALVINGS + 1):
        widths = tuple(w >> min(halvings, WIDTH_HALVINGS) for w in STACK_WIDTHS)
        sizes = tuple(n >> halvings for n in COLLECTIVE_BYTES)
        collectives = collective_peak_bytes(world, sizes)
        levels = grouping_levels(specs, widths)
        for groups in levels if halvings == 0 else levels[-1:]:
            peak = max(max(group_peak_bytes(g, state_bytes_per_param) for g in groups), collectives)
            if not layouts or peak < layouts[-1].peak_bytes:
                layouts.append(CalibrationLayout(tuple(tuple(g) for g in groups), sizes, peak))
    return layouts


def calibration_layout(specs: Sequence[BenchSpec], room_bytes: int | None, state_bytes_per_param: int,
                       world: int) -> CalibrationLayout:
    """The fastest layout that fits ``room_bytes`` (``None``: no limit, every bench at once).

    Raises :class:`CalibrationRoomError` where not even the narrowest fits."""
    layouts = candidate_layouts(specs, state_bytes_per_param, world)
    if room_bytes is None:
        return layouts[0]
    for layout in layouts:
        if layout.peak_bytes <= room_bytes:
            return layout
    raise _room_error("calibrating the step terms", layouts[-1].peak_bytes, room_bytes)


def _room_error(work: str, needed_bytes: int, room_bytes: int) -> CalibrationRoomError:
    return CalibrationRoomError(
        f"{work} needs at least {format_bytes(needed_bytes)} ({needed_bytes} bytes) beside what the model "
        f"holds, and the memory budget leaves {format_bytes(max(room_bytes, 0))}: give a memory budget at "
        f"least {format_bytes(needed_bytes - room_bytes)} larger")


def link_payload_bytes(room_bytes: int | None, world: int) -> int:
    """The link probe's payload (:func:`~osdp_lightning.cost.links.measure_collectives`, which every
    launch runs, a cached calibration or not): the usual, or halved until the probe fits ``room_bytes``.

    Raises :class:`CalibrationRoomError` where not even 64 KiB fits."""
    payload = LINK_PAYLOAD_BYTES
    while room_bytes is not None and link_probe_bytes(payload, world) > room_bytes:
        if payload <= MIN_LINK_PAYLOAD_BYTES:
            raise _room_error("timing the links", link_probe_bytes(payload, world), room_bytes)
        payload //= 2
    return payload


def time_bench_groups(layout: CalibrationLayout, specs: Sequence[BenchSpec], device: torch.device,
                      meshes: Meshes | None, optimizer: torch.optim.Optimizer | None, repeats: int,
                      budget_s: float) -> dict[BenchKey, Bench]:
    """Build, time and free each of the layout's groups in turn (the rounds' seconds shared by the
    groups' sizes); every key's timings from every group it was in (its bench itself freed)."""
    by_name = {spec.name: spec for spec in specs}
    total = sum(len(group) for group in layout.groups)
    timed: dict[BenchKey, Bench] = {}
    for group in layout.groups:
        benches = {(name, width): build_bench(by_name[name], width, device, meshes, optimizer)
                   for name, width in group}
        try:
            time_benches(benches, device, repeats, budget_s * len(group) / total)
        finally:
            release_benches(benches)
        for key, bench in benches.items():
            record = timed.setdefault(key, Bench(None, None, [], []))
            record.step_s += bench.step_s
            record.optimizer_s += bench.optimizer_s
            record.forward_s += bench.forward_s
    return timed
