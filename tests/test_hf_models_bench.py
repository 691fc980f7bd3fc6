"""The Hugging Face benchmark (benchmarks/hf_models.py): arguments, the runs of a family, and the report
rendered from a small recorded input (no training, no timing)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks import hf_models, hf_models_report
from benchmarks.hwm_train import run_dir

MIB = 2**20


def _record(run: str, method: str, meta: bool, losses: list[float], *, peak: int = 60 * MIB,
            predicted_peak: int | None = 62 * MIB, step_s: float = 0.5, predicted_step_s: float | None = 0.45) -> dict:
    osdp = method == "osdp"
    return {"family": "llama", "method": method, "meta": meta, "run": run, "round": 0, "status": "ok",
            "budget": "60%ddp" if osdp else None, "losses": losses, "wall_s": 20.0, "load_average": "1.0",
            "summary": {"peak_bytes": peak, "predicted_peak_bytes": predicted_peak if osdp else None,
                        "step_s": step_s, "predicted_step_s": predicted_step_s if osdp else None,
                        "memory_budget_bytes": 70 * MIB if osdp else None},
            "phases": {"forward_s": 0.1, "backward_s": 0.3, "optimizer_s": 0.1},
            **({"choices": {"zero3": 2, "replicate": 1}, "setup_s": {"calibrate_s": 4.0, "profile_s": 3.0},
                "profiled_whole": False,
                "plan": {"predicted_compute_s": 0.3, "predicted_optimizer_s": 0.05, "predicted_overhead_s": 0.05,
                         "predicted_exposed_comm_s": 0.04, "predicted_loop_s": 0.01}} if osdp else {})}


def _saved() -> dict:
    ddp = [5.99, 5.9, 5.8, 5.7, 5.6, 5.5, 5.4, 5.3]
    runs = [{"family": "llama", "method": "osdp", "meta": False, "run": "probe", "round": 0, "budget": "5%ddp",
             "status": "infeasible", "smallest_feasible_bytes": 50 * MIB, "wall_s": 10.0},
            _record("ddp", "ddp", False, ddp),
            _record("osdp 60%ddp eager", "osdp", False, [x * (1 + 2e-5) for x in ddp]),
            _record("osdp 60%ddp meta", "osdp", True, [6.1, 6.0, 5.9, 5.8, 5.7, 5.6, 5.5, 5.4], step_s=0.6)]
    paths = [{"family": "llama", "rounds": 1, "threads": 1,
              "whole": {"seconds": 2.0, "step_s": 0.1, "blocks_s": 0.08, "root_s": 0.01, "other_s": 0.01,
                        "activation_bytes": 10 * MIB},
              "shapes": {"seconds": 3.0, "step_s": 0.09, "blocks_s": 0.082, "root_s": 0.0, "other_s": 0.008,
                         "activation_bytes": 10 * MIB}}]
    summary = {"steps": 6, "memory_budget_bytes": 1000 * MIB, "peak_bytes": 900 * MIB, "predicted_peak_bytes": 950 * MIB,
               "step_s": 20.0, "predicted_step_s": 15.0, "final_loss": 8.0, "process_peak_bytes": 1400 * MIB}
    large = {"command": "./dev train model=hf_llama_110m", "large": {
        "returncode": 0, "summary": summary, "plan": {"units": [{"choice": "zero3"}], "baselines": [
            {"choice": "replicate", "peak_bytes": 2000 * MIB}]},
        "ranks": [{"rank": 0, "VmHWM": 1400 * MIB}, {"rank": 1, "VmHWM": 1350 * MIB}]},
        "fixed": {"returncode": 0, "summary": {"process_peak_bytes": 450 * MIB},
                  "ranks": [{"rank": 0, "VmHWM": 450 * MIB}, {"rank": 1, "VmHWM": 400 * MIB}]}}
    machine = {"cpu": "test", "cores": 2, "families": ["llama"], "steps": 8, "rounds": 1,
               "model": {"layers": 4, "width": 256, "seq_len": 128, "batch_size": 4, "vocab_size": 384}}
    return {"machine": machine, "train": runs, "paths": paths, "large": large}


def test_arguments_and_the_runs_of_a_family() -> None:
    args = hf_models.parse_args(["--families", "llama,t5", "--width", "128", "--parts", "train"])
    assert args.family_list == ["llama", "t5"] and args.shape.width == 128 and args.part_list == ["train"]
    with pytest.raises(SystemExit):
        hf_models.parse_args(["--families", "opt"])
    jobs = hf_models.family_jobs(1000)
    assert [j[3] for j in jobs] == ["ddp", "osdp 60%ddp eager", "osdp 60%ddp meta", "osdp +5% eager", "osdp +5% meta"]
    assert jobs[3][1] == "1050" and jobs[4][2] is True
    assert len(hf_models.family_jobs(None)) == 3  # no smallest budget named: only 60%ddp
    assert run_dir(['hydra.run.dir="/tmp/x y"']) == Path("/tmp/x y")


def test_verdicts_of_a_recorded_family() -> None:
    v = hf_models_report.family_verdicts(_saved()["train"], "llama", 384)
    assert v["loss_gap"] == pytest.approx(2e-5, rel=1e-3) and v["losses_ok"]
    assert v["meta_reference"] == "ln(V)" and v["meta_gap"] == pytest.approx(6.1 / math.log(384) - 1)
    assert v["meta_ok"] and v["falling"]  # 2.5% over ln(384)
    assert v["mem_worst"] == pytest.approx(62 / 60 - 1) and v["mem_ok"]
    assert v["step_median_abs"] == pytest.approx((0.1 + 0.25) / 2) and not v["step_ok"]


def test_report_renders_every_part(tmp_path: Path) -> None:
    text = hf_models_report.write_outputs(tmp_path, _saved())
    assert "| llama | probe (5%ddp) | - | no plan fits; smallest 50.00 MiB |" in text
    assert "| llama | 2.00 | 3.00 | 1.50x |" in text
    assert "- rank 1: high-water 1350.00 MiB, fixed cost 400.00 MiB: above it 0.95x the budget" in text
    assert "- target <= 1.10x on every rank: holds" in text
    assert json.loads((tmp_path / "hf_models_runs.json").read_text())["large"]["fixed"]["returncode"] == 0
