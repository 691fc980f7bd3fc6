"""The figure of :mod:`benchmarks.regret`: predicted against measured step time, every candidate, per shape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.regret_report import spearman

COLORS = {"osdp": "tab:green", "uniform": "tab:blue", "next-best": "tab:orange", "random": "tab:grey"}


def _panel(ax: Any, shape: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    ok = [r for r in rows if r["runs_ok"]]
    if not ok:
        return
    smallest = min(shape["budgets"].values())
    for kind, color in COLORS.items():
        mine = [r for r in ok if r["kind"] == kind]
        if not mine:
            continue
        fits = [r for r in mine if r["fit_bytes"] <= smallest]
        rest = [r for r in mine if r["fit_bytes"] > smallest]
        for group, face in ((fits, color), (rest, "none")):
            if group:
                ax.scatter([r["predicted_step_s"] for r in group], [r["step_s"] for r in group], s=40,
                           facecolors=face, edgecolors=color, label=kind if group is fits or not fits else None)
    for r in ok:
        if r["kind"] in ("osdp", "uniform"):
            names = [n.replace("osdp @ ", "osdp ") for n in [r["name"], *r["aliases"]] if n.startswith("osdp")]
            ax.annotate(" / ".join(names) or r["name"], (r["predicted_step_s"], r["step_s"]), fontsize=7,
                        xytext=(4, 3), textcoords="offset points")
    low = min(min(r["predicted_step_s"], r["step_s"]) for r in ok) * 0.9
    high = max(max(r["predicted_step_s"], r["step_s"]) for r in ok) * 1.05
    ax.plot([low, high], [low, high], "k--", linewidth=0.8, label="predicted = measured")
    rho = spearman([r["predicted_step_s"] for r in ok], [r["step_s"] for r in ok])
    ax.set_title(f"{shape['shape']} (seq {shape['settings']['seq_len']}): {len(ok)} plans, Spearman "
                 + ("-" if rho is None else f"{rho:.2f}"), fontsize=9)
    ax.set_xlabel("predicted step s")
    ax.set_ylabel("measured step s (median over rounds)")
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    ax.legend(fontsize=7, loc="lower right", title=f"filled: fits {min(shape['budgets'], key=shape['budgets'].get)}",
              title_fontsize=7)


def plot_regret(path: Path, per_shape: list[tuple[dict[str, Any], list[dict[str, Any]]]],
                machine: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(per_shape), figsize=(6.5 * len(per_shape), 5.5), squeeze=False)
    for ax, (shape, rows) in zip(axes[0], per_shape, strict=True):
        _panel(ax, shape, rows)
    fig.suptitle(f"plan regret: {machine.get('devices')} CPU ranks, medians of {machine.get('rounds')} round(s)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
