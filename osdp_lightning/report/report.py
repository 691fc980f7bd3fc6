"""What a run tells people about its plan: the baseline comparison and Lightning's logger.

- :func:`format_comparison`: at the plan's budget, which uniform baselines (ddp / zero2 / zero3)
  fit and their predicted peak and step against osdp's, from :attr:`Plan.baselines`.
- :func:`log_plan`: the plan and its predictions as hyperparameters of every logger of the
  trainer (CSV: ``hparams.yaml``; TensorBoard: the HPARAMS tab), at setup.
- :func:`log_measured`: predicted against measured peak and step, and their errors, as metrics
  at the end of training, so ``metrics.csv`` and a sweep's summary show them side by side.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from osdp_lightning.cost.aliases import baseline_name
from osdp_lightning.cost.budget import format_bytes
from osdp_lightning.plan.plan import Plan

PREFIX = "osdp/"


def format_comparison(plan: Plan) -> str:
    """osdp and the uniform baselines at the plan's budget and micro-batch, one line each."""
    if not plan.baselines:
        return "baselines: not priced (a plan saved by an older osdp_lightning)"
    lines = [f"at this budget ({format_bytes(plan.memory_budget_bytes)} per rank, micro-batch "
             f"{plan.micro_batch_size}), predicted:",
             f"  {'':<6} {'fits':<5} {'peak/rank':>11} {'step s':>9} {'throughput vs osdp':>19}",
             f"  {'osdp':<6} {'yes':<5} {format_bytes(plan.predicted_peak_bytes):>11} "
             f"{plan.predicted_step_s:>9.4f} {'1.00x':>19}"]
    for base in plan.baselines:
        speed = plan.predicted_step_s / base.step_s if base.step_s > 0 else float("nan")
        lines.append(f"  {baseline_name(base.choice):<6} {'yes' if base.fits else 'NO':<5} "
                     f"{format_bytes(base.peak_bytes):>11} {base.step_s:>9.4f} {speed:>18.2f}x")
    fitting = [b for b in plan.baselines if b.fits]
    if fitting:
        best = min(fitting, key=lambda b: b.step_s)
        name = baseline_name(best.choice)
        lines.append(f"  best baseline that fits: {name}; osdp is predicted {best.step_s / plan.predicted_step_s:.2f}x "
                     f"its throughput")
    else:
        lines.append("  no uniform baseline fits this budget")
    return "\n".join(lines)


def plan_hyperparameters(plan: Plan) -> dict[str, Any]:
    """The plan as flat hyperparameters (str / int / float), keys prefixed ``osdp/``."""
    params: dict[str, Any] = {
        "choices": plan.choices_text(), "units": len(plan.units),
        "world_size": plan.world_size, "micro_batch_size": plan.micro_batch_size,
        "memory_budget_bytes": plan.memory_budget_bytes, "predicted_peak_bytes": plan.predicted_peak_bytes,
        "predicted_step_s": plan.predicted_step_s, "predicted_samples_per_s": plan.predicted_throughput,
        "solver_status": plan.solver_status, "source": plan.source,
    }
    for base in plan.baselines:
        name = baseline_name(base.choice)
        params.update({f"{name}_predicted_peak_bytes": base.peak_bytes, f"{name}_predicted_step_s": base.step_s,
                       f"{name}_fits": base.fits})
    return {PREFIX + key: value for key, value in params.items()}


def prediction_errors(summary: dict[str, Any]) -> dict[str, float]:
    """``peak_error`` and ``step_error``: predicted / measured - 1 (positive: the prediction was
    higher), as the training summary prints them."""
    errors = {}
    for kind, measured_key in (("peak", "peak_bytes"), ("step", "step_s")):
        predicted, measured = summary.get(f"predicted_{measured_key}"), summary.get(measured_key)
        if predicted is not None and measured and measured == measured:
            errors[f"{kind}_error"] = predicted / measured - 1
    return errors


def log_plan(trainer: pl.Trainer, plan: Plan) -> None:
    """Every logger of ``trainer`` records the plan as hyperparameters (rank 0 writes)."""
    params = plan_hyperparameters(plan)
    for logger in trainer.loggers:
        logger.log_hyperparams(params)


def log_measured(trainer: pl.Trainer, summary: dict[str, Any]) -> None:
    """Every logger records predicted and measured peak and step, and the errors, as metrics."""
    metrics = {key: float(summary[key]) for key in ("predicted_peak_bytes", "predicted_step_s")
               if summary.get(key) is not None}
    metrics.update({"measured_peak_bytes": float(summary["peak_bytes"]), "measured_step_s": float(summary["step_s"])})
    metrics.update(prediction_errors(summary))
    for logger in trainer.loggers:
        logger.log_metrics({PREFIX + key: value for key, value in metrics.items()}, step=trainer.global_step)
        logger.save()
