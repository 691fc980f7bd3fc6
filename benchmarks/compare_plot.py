"""The figure of :mod:`benchmarks.compare`: throughput against budget, peaks against budget, and
predicted against measured peak."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MIB = 2**20
COLORS = {"ddp": "tab:blue", "osdp-replicate": "tab:cyan", "osdp-default": "tab:olive", "zero2": "tab:orange",
          "zero3": "tab:red", "fsdp2": "tab:purple", "fsdp2-ckpt": "tab:pink", "osdp": "tab:green"}
"""One colour per method of ``compare.BASELINES`` and osdp; a test keeps them in step."""


def _base(method_label: str) -> str:
    return method_label.split(" @ ")[0]


def _throughput_panel(ax: Any, rows: list[dict[str, Any]], budgets_mib: list[float]) -> None:
    """osdp as a line over its budgets; a baseline as a flat line from its own peak (where it first fits)."""
    right = max(budgets_mib + [r["peak_bytes"] / MIB for r in rows if r["status"] == "ok"]) * 1.15
    for r in rows:
        if r["status"] != "ok" or r["fraction"] is not None:
            continue
        peak = r["peak_bytes"] / MIB
        ax.hlines(r["tokens_per_s"], peak, right, colors=COLORS[r["method"]], label=f"{r['method']} (fits from its peak)")
        ax.plot([peak], [r["tokens_per_s"]], "|", color=COLORS[r["method"]], markersize=14)
    osdp = sorted((r for r in rows if r["fraction"] is not None and r["status"] == "ok"),
                  key=lambda r: r["budget_bytes"])
    if osdp:
        ax.plot([r["budget_bytes"] / MIB for r in osdp], [r["tokens_per_s"] for r in osdp], "o-",
                color=COLORS["osdp"], label="osdp (at its budget)")
    for budget in budgets_mib:
        ax.axvline(budget, color="grey", linestyle=":", linewidth=0.8)
    misses = [r["budget_bytes"] / MIB for r in rows if r["fraction"] is not None and r["status"] != "ok"]
    if misses:
        ax.plot(misses, [0] * len(misses), "x", color=COLORS["osdp"], markersize=9, clip_on=False,
                label="osdp: no plan fits this budget")
    ax.set_xlabel("memory budget per rank (MiB); dotted: budgets tried")
    ax.set_ylabel("tokens / s (all ranks)")
    ax.set_title("throughput at equal budgets")
    ax.set_xlim(left=0, right=right)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="lower right")


def _peak_panel(ax: Any, rows: list[dict[str, Any]], budgets_mib: list[float]) -> None:
    """Measured and predicted peak of every osdp budget, with the budget line (peak = budget)."""
    osdp = sorted((r for r in rows if r["fraction"] is not None and r["status"] == "ok"),
                  key=lambda r: r["budget_bytes"])
    top = max(budgets_mib + [r["peak_bytes"] / MIB for r in rows if r["status"] == "ok"]) * 1.05
    bottom = 0.3 * top  # below every peak: the interesting corner, larger
    ax.plot([0, top], [0, top], "k--", linewidth=1, label="budget line (peak = budget)")
    if osdp:
        x = [r["budget_bytes"] / MIB for r in osdp]
        ax.plot(x, [r["peak_bytes"] / MIB for r in osdp], "o-", color=COLORS["osdp"], label="osdp measured peak")
        ax.plot(x, [r["predicted_peak_bytes"] / MIB for r in osdp], "x:", color=COLORS["osdp"],
                label="osdp predicted peak")
    for r in rows:
        if r["status"] == "ok" and r["fraction"] is None:
            ax.axhline(r["peak_bytes"] / MIB, color=COLORS[r["method"]], linewidth=0.8, label=f"{r['method']} peak")
    ax.set_xlabel("memory budget per rank (MiB)")
    ax.set_ylabel("peak per rank (MiB)")
    ax.set_title("osdp stays under its budget")
    ax.set_xlim(bottom, top)
    ax.set_ylim(bottom, top)
    ax.legend(fontsize=7, loc="lower right")


def _prediction_panel(ax: Any, runs: list[dict]) -> None:
    """Predicted against measured peak of every run, with the +-10% band."""
    ok = [r for r in runs if r["status"] == "ok" and r["summary"].get("predicted_peak_bytes") is not None]
    if not ok:
        return
    top = max(max(r["summary"]["peak_bytes"], r["summary"]["predicted_peak_bytes"]) for r in ok) / MIB * 1.1
    bottom = 0.3 * top
    ax.plot([0, top], [0, top], "k-", linewidth=1, label="exact")
    ax.fill_between([0, top], [0, 0.9 * top], [0, 1.1 * top], color="grey", alpha=0.2, label="+-10%")
    for method in COLORS:
        mine = [r for r in ok if r["method"] == method]
        if mine:
            ax.plot([r["summary"]["peak_bytes"] / MIB for r in mine],
                    [r["summary"]["predicted_peak_bytes"] / MIB for r in mine], "o", color=COLORS[method],
                    label=method, alpha=0.7)
    ax.set_xlabel("measured peak per rank (MiB)")
    ax.set_ylabel("predicted peak per rank (MiB)")
    ax.set_title("memory prediction, every run")
    ax.set_xlim(bottom, top)
    ax.set_ylim(bottom, top)
    ax.legend(fontsize=7, loc="upper left")


def plot_results(path: Path, rows: list[dict[str, Any]], runs: list[dict], machine: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets_mib = sorted(r["budget_bytes"] / MIB for r in rows if r.get("budget_bytes"))
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    _throughput_panel(axes[0], rows, budgets_mib)
    _peak_panel(axes[1], rows, budgets_mib)
    _prediction_panel(axes[2], runs)
    device = machine.get("gpu") or f"{machine.get('devices')} CPU ranks ({machine.get('cpu')})"
    fig.suptitle(f"GPT {machine.get('param_count', 0) / 1e6:.2f}M parameters, {device}; "
                 f"medians of {machine.get('rounds')} round(s)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
