"""A picture of a :class:`~osdp_lightning.plan.plan.Plan`: where the memory budget goes and where the step time goes.

Top panel: memory per rank as a waterfall in execution order. The first bar holds what every plan
pays (the input batch, activations no choice changes); each unit then adds what it keeps (state,
held parameters, its own activations), stacked on what came before, so the bars climb towards the
predicted peak. A unit's transient bytes sit on top of its bar without adding to the next (they
exist only while it runs); the last bar reaches the predicted peak (empty when the peak comes at a
moment when some units' activations are not alive yet or any more, so the bars stand above it).
Colours are choices, hatches are kinds; horizontal lines are the budget, the usable part (less
headroom) and the peaks of the uniform baselines. Bottom panel: predicted seconds per unit.

Large plans stay readable: consecutive units of one block (``net.h.3.*``) form one bar, and runs
of identical blocks (same unit names and choices) one bar each, labelled ``net.h.0-11 (x12)``.

matplotlib is an optional extra (``pip install osdp_lightning[plot]``): :func:`plot_plan` raises
:class:`PlotUnavailableError` without it, and :func:`try_plot_plan` says so in one line instead.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from osdp_lightning.cost.aliases import baseline_name
from osdp_lightning.cost.budget import format_bytes

if TYPE_CHECKING:
    from osdp_lightning.plan.plan import Plan, UnitPlan

MAX_BARS = 48
"""Above this many units, units are grouped by block (and runs of identical blocks merged)."""
INSTALL_HINT = "pip install 'osdp_lightning[plot]'  (matplotlib)"
BYTE_KINDS = ("state", "held", "activation")
TIME_KINDS = ("compute", "comm", "optimizer", "overhead")
_HATCH = {"state": "", "held": "///", "activation": "...", "transient": "xxx"}
_TIME_COLORS = {"compute": "tab:gray", "comm": "tab:red", "optimizer": "tab:purple", "overhead": "tab:olive"}
_TIME_LABELS = {"compute": "compute", "comm": "communication (not hidden)", "optimizer": "optimizer step",
                "overhead": "FSDP overhead"}
_CHOICE_COLORS = {"replicate": "tab:blue", "zero2": "tab:orange", "zero3": "tab:red"}
_OTHER_COLORS = ("tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan",
                 "darkgreen", "navy", "gold", "teal", "salmon", "slategray")
_INDEX_RE = re.compile(r"\.(\d+)(?=\.|$)")


class PlotUnavailableError(ImportError):
    """matplotlib is not installed; the message says how to get the picture."""


@dataclass
class Bar:
    """One bar of the picture: one unit, one block, or a run of identical blocks."""

    label: str
    bytes_by: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    """(choice, kind) -> bytes per rank that this bar keeps (kinds: state, held, activation)."""
    transient_by: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """choice -> transient bytes (the largest of one unit, not a sum)."""
    seconds_by: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """kind -> predicted seconds per step (compute, comm, optimizer, overhead)."""
    count: int = 1
    """Units in this bar."""

    @property
    def kept_bytes(self) -> int:
        return sum(self.bytes_by.values())


def _block_of(name: str) -> str:
    """``net.h.3.attn.c_attn`` -> ``net.h.3``; a name without an index is its own block."""
    match = _INDEX_RE.search(name)
    return name[:match.end()] if match else name


def _unit_bar(unit: UnitPlan, label: str) -> Bar:
    bar = Bar(label)
    _add_unit(bar, unit)
    return bar


def _add_unit(bar: Bar, unit: UnitPlan) -> None:
    for kind in BYTE_KINDS:
        value = getattr(unit, f"{kind}_bytes", 0)
        if value:
            bar.bytes_by[(unit.choice, kind)] += value
    if unit.transient_bytes:
        bar.transient_by[unit.choice] = max(bar.transient_by[unit.choice], unit.transient_bytes)
    for kind in TIME_KINDS:
        bar.seconds_by[kind] += getattr(unit, f"{kind}_s", 0.0)


def _signature(units: list[UnitPlan], block: str) -> tuple:
    return tuple((u.name[len(block):], u.choice, u.param_count) for u in units)


def group_units(plan: Plan, max_bars: int = MAX_BARS) -> list[Bar]:
    """The bars of the picture: one per unit, or (above ``max_bars`` units) one per run of identical blocks."""
    units = list(plan.units)
    if len(units) <= max_bars:
        return [_unit_bar(u, u.name or "<root>") for u in units]
    bars = []
    for first, last, members in _runs_of_identical_blocks(_blocks(units)):
        label = first if len(members) == 1 else f"{first}-{last.rsplit('.', 1)[-1]} (x{len(members)})"
        bar = Bar(label, count=sum(len(block_units) for block_units in members))
        for unit in (u for block_units in members for u in block_units):
            _add_unit(bar, unit)
        bars.append(bar)
    return bars if len(bars) <= 2 * max_bars else _chunk(units, max_bars)


def _blocks(units: list[UnitPlan]) -> list[tuple[str, list[UnitPlan]]]:
    """Consecutive units of one block (``net.h.3.*``), in execution order."""
    blocks: list[tuple[str, list[UnitPlan]]] = []
    for unit in units:
        block = _block_of(unit.name) if unit.name else "<root>"
        if blocks and blocks[-1][0] == block:
            blocks[-1][1].append(unit)
        else:
            blocks.append((block, [unit]))
    return blocks


def _runs_of_identical_blocks(blocks: list[tuple[str, list[UnitPlan]]]) -> list[tuple[str, str, list[list[UnitPlan]]]]:
    """``(first block, last block, members)`` for each run of consecutive blocks of one stack
    (same name but the index) whose units have the same names, choices and sizes."""
    runs: list[tuple[str, str, list[list[UnitPlan]]]] = []
    for block, members in blocks:
        if runs:
            first, last, previous = runs[-1]
            if (_INDEX_RE.sub("", block) == _INDEX_RE.sub("", last)
                    and _signature(previous[-1], last) == _signature(members, block)):
                previous.append(members)
                runs[-1] = (first, block, previous)
                continue
        runs.append((block, block, [members]))
    return runs


def _chunk(units: list[UnitPlan], max_bars: int) -> list[Bar]:
    """Contiguous ranges of units when blocks do not repeat (many distinct blocks)."""
    size = -(-len(units) // max_bars)
    bars = []
    for start in range(0, len(units), size):
        part = units[start:start + size]
        bar = Bar(f"{part[0].name or '<root>'} .. ({len(part)} units)", count=len(part))
        for unit in part:
            _add_unit(bar, unit)
        bars.append(bar)
    return bars


def choice_colors(plan: Plan) -> dict[str, str]:
    """A colour per choice of the plan: the uniform baselines fixed, the others in order of appearance."""
    colors = dict(_CHOICE_COLORS)
    others = iter(_OTHER_COLORS * 4)
    for unit in plan.units:
        if unit.choice not in colors:
            colors[unit.choice] = next(others)
    return colors


def _import_pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as err:
        raise PlotUnavailableError(f"the plan picture needs matplotlib: {INSTALL_HINT}") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _memory_panel(ax: Any, plan: Plan, bars: list[Bar], colors: dict[str, str]) -> None:
    mib = 2**20
    shared = plan.activation_bytes + getattr(plan, "fixed_bytes", 0)
    ax.bar(0, shared / mib, color="lightgray", edgecolor="black", linewidth=0.3)
    level = shared
    for x, bar in enumerate(bars, start=1):
        bottom = level
        for (choice, kind), value in sorted(bar.bytes_by.items(), key=lambda kv: BYTE_KINDS.index(kv[0][1])):
            ax.bar(x, value / mib, bottom=bottom / mib, color=colors[choice], hatch=_HATCH[kind],
                   edgecolor="black", linewidth=0.3)
            bottom += value
        for choice, value in bar.transient_by.items():
            ax.bar(x, value / mib, bottom=bottom / mib, color=colors[choice], alpha=0.35, hatch=_HATCH["transient"],
                   edgecolor="black", linewidth=0.3)
        level = bottom
    top = plan.predicted_peak_bytes
    ax.bar(len(bars) + 1, max(top - level, 0) / mib, bottom=level / mib, color="white", hatch=_HATCH["transient"],
           edgecolor="black", linewidth=0.5)
    ax.axhline(plan.memory_budget_bytes / mib, color="black", linewidth=1.5)
    ax.text(0.005, plan.memory_budget_bytes / mib, f"budget {format_bytes(plan.memory_budget_bytes)}",
            transform=ax.get_yaxis_transform(), va="bottom", fontsize=8)
    if plan.headroom_bytes:  # what the plan was solved to leave free
        ax.axhline((plan.memory_budget_bytes - plan.headroom_bytes) / mib, color="black", linestyle="--", linewidth=0.8)
    previous, x = None, 0.995
    for base in sorted(getattr(plan, "baselines", ()), key=lambda b: -b.peak_bytes):
        name, color = baseline_name(base.choice), _CHOICE_COLORS.get(base.choice, "gray")
        ax.axhline(base.peak_bytes / mib, color=color, linestyle=":", linewidth=1.2)
        # NOTE: labels of peaks close together step left instead of overprinting each other.
        close = previous is not None and previous - base.peak_bytes < 0.04 * plan.memory_budget_bytes
        x = x - 0.2 if close else 0.995
        previous = base.peak_bytes
        ax.text(x, base.peak_bytes / mib, f"{name} peak {format_bytes(base.peak_bytes)}", color=color,
                transform=ax.get_yaxis_transform(), ha="right", va="bottom", fontsize=7)
    peaks = [b.peak_bytes for b in getattr(plan, "baselines", ())] + [plan.memory_budget_bytes, top]
    ceiling = max(peaks) * 1.04
    # NOTE: when what no choice changes is most of the peak, the axis starts near its top so the
    # units' part (what the plan decides) is visible; the shared bar says its full size.
    floor = max(0.0, shared - 0.25 * (ceiling - shared)) if shared > 0.4 * top else 0.0
    ax.set_ylim(floor / mib, ceiling / mib)
    ax.text(0, max(shared, floor) / mib, format_bytes(shared), ha="center", va="bottom", fontsize=7)
    if floor:
        ax.set_ylabel(f"MiB per rank (cumulative; axis from {format_bytes(floor)})")
    ax.set_xlim(-0.6, len(bars) + 1.6)
    if not floor:
        ax.set_ylabel("MiB per rank (cumulative)")
    ax.set_title(f"memory: predicted peak {format_bytes(top)} of budget {format_bytes(plan.memory_budget_bytes)}",
                 fontsize=10)


def _memory_legend(ax: Any, plan: Plan, colors: dict[str, str]) -> None:
    from matplotlib.patches import Patch

    counts: dict[str, int] = defaultdict(int)
    for unit in plan.units:
        counts[unit.choice] += 1
    handles = [Patch(facecolor=colors[c], label=f"{c} x{n}") for c, n in counts.items()]
    handles += [Patch(facecolor="white", edgecolor="black", hatch=_HATCH[k] or None, label=k)
                for k in ("state", "held", "activation", "transient")]
    handles += [Patch(facecolor="lightgray", label="batch + activations no choice changes")]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0), framealpha=0.9)


def _time_panel(ax: Any, plan: Plan, bars: list[Bar]) -> None:
    xs = range(1, len(bars) + 1)
    bottoms = [0.0] * len(bars)
    for kind in TIME_KINDS:
        values = [1e3 * bar.seconds_by[kind] for bar in bars]
        if any(values):
            ax.bar(xs, values, bottom=bottoms, color=_TIME_COLORS[kind], label=_TIME_LABELS[kind],
                   edgecolor="black", linewidth=0.3)
            bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    ax.set_xlim(-0.6, len(bars) + 1.6)
    ax.set_ylabel("ms per step")
    loop_s = getattr(plan, "predicted_loop_s", 0.0)
    ax.set_title(f"time: predicted step {plan.predicted_step_s:.4f} s at micro-batch {plan.micro_batch_size} "
                 f"x {plan.world_size} ranks" + (f" (units, plus the loop's {loop_s:.4f} s)" if loop_s else ""),
                 fontsize=10)
    if any(bottoms):
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0))


def plot_plan(plan: Plan, path: str | Path, title: str | None = None) -> Path:
    """Write the picture of ``plan`` to ``path`` (PNG); raises :class:`PlotUnavailableError` without matplotlib."""
    plt = _import_pyplot()
    bars = group_units(plan)
    colors = choice_colors(plan)
    width = min(max(9.0, 0.32 * len(bars) + 6), 26.0)
    fig, (mem_ax, time_ax) = plt.subplots(2, 1, figsize=(width, 8.5), sharex=True,
                                          gridspec_kw={"height_ratios": [3, 1.4]})
    _memory_panel(mem_ax, plan, bars, colors)
    _memory_legend(mem_ax, plan, colors)
    _time_panel(time_ax, plan, bars)
    labels = ["shared"] + [bar.label for bar in bars] + ["transient peak"]
    time_ax.set_xticks(range(len(labels)))
    time_ax.set_xticklabels(labels, rotation=90, fontsize=7 if len(labels) < 40 else 6)
    fig.suptitle(title or f"osdp plan: {len(plan.units)} units, {plan.world_size} ranks ({plan.source})",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def try_plot_plan(plan: Plan, path: str | Path, title: str | None = None) -> str:
    """:func:`plot_plan`, never raising: returns the line to print (where the picture is, or how to get it)."""
    try:
        return f"plan picture: {plot_plan(plan, path, title)}"
    except PlotUnavailableError:
        return f"plan picture: not drawn, matplotlib is missing: {INSTALL_HINT}"
    except Exception as err:  # a picture must never fail a training run
        return f"plan picture: not drawn ({type(err).__name__}: {err})"
