"""The main job (``./dev train``): a mixed plan, the comparison at its budget, the picture, the logger.

One real 2-rank run of the main job's config, shortened to a few steps (``trainer=smoke``).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml
from test_cli import check_ok, only_dir, run_cli


@pytest.mark.multiprocess
def test_main_job_shows_a_mixed_plan_its_comparison_picture_and_logged_predictions(tmp_path: Path) -> None:
    proc = run_cli("train", "trainer=smoke", cwd=tmp_path)  # the main job's defaults: 100%ddp
    check_ok(proc)
    run_dir = only_dir(tmp_path / "outputs" / "train")
    plan = json.loads((run_dir / "plan.json").read_text())
    assert len({u["choice"] for u in plan["units"]}) >= 2, plan["units"]  # a mix, not a baseline
    fits = {b["choice"]: b["fits"] for b in plan["baselines"]}
    assert fits["replicate"] is False and plan["predicted_peak_bytes"] <= plan["memory_budget_bytes"]
    out = proc.stdout
    assert "memory budget 100%ddp" in out and "at this budget" in out and "ddp    NO" in out
    assert f"plan picture: {run_dir / 'plan.png'}" in out
    assert (run_dir / "plan.png").read_bytes()[:4] == b"\x89PNG"

    # the logger: the plan as hyperparameters, predicted against measured as metrics, side by side
    hparams = yaml.safe_load((run_dir / "csv" / "hparams.yaml").read_text())
    assert hparams["osdp/memory_budget_bytes"] == plan["memory_budget_bytes"]
    assert hparams["osdp/ddp_fits"] is False and len(hparams["osdp/choices"].split(", ")) >= 2  # a mixed plan
    rows = list(csv.DictReader((run_dir / "csv" / "metrics.csv").open()))
    logged = next(r for r in rows if r.get("osdp/measured_peak_bytes"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert float(logged["osdp/predicted_peak_bytes"]) == plan["predicted_peak_bytes"]
    assert float(logged["osdp/measured_peak_bytes"]) == summary["peak_bytes"] > 0
    assert float(logged["osdp/measured_step_s"]) == pytest.approx(summary["step_s"])
    assert float(logged["osdp/peak_error"]) == pytest.approx(plan["predicted_peak_bytes"] / summary["peak_bytes"] - 1)
    assert float(logged["osdp/step_error"]) == pytest.approx(summary["step_error"])
    # the process's high-water marks beside the tracked step: after setup, then over the whole run
    assert summary["process_peak_bytes"] >= summary["setup_peak_bytes"] > summary["peak_bytes"]
    assert "high-water mark per rank (process resident set, interpreter included): after setup" in out
    # and above the fixed cost osdp measured at setup (what a CPU budget bounds): less than the whole process
    assert 0 < summary["process_above_fixed_bytes"] < summary["process_peak_bytes"]
    assert "above the fixed cost measured at setup" in out
    # its own memory (less the code pages loaded since setup, resident at the peak): at most that
    assert 0 < summary["own_above_fixed_bytes"] <= summary["process_above_fixed_bytes"]
