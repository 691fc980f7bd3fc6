"""The pretrained-load benchmark's report logic, in-process on a tiny recorded input (no launches)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks import pretrained_load
from benchmarks import pretrained_load_report as report
from benchmarks import pretrained_load_worker as worker

MIB = 2**20
INFEASIBLE_LOG = ("osdp_lightning.plan.plan.InfeasibleBudgetError: no plan fits the memory budget of 64.00 KiB per rank "
                  "...; the smallest budget that fits is 2.41 MiB (2526014 bytes, of which 61.67 KiB headroom")


def _write_run(run_dir: Path, losses: list[float], choices: list[str], strategy: str = "osdp") -> None:
    (run_dir / "csv").mkdir(parents=True)
    rows = ["epoch,osdp/peak_error,step,train/loss", "0,0.01,,"]  # a row without a loss is skipped
    rows += [f"0,,{step},{loss}" for step, loss in reversed(list(enumerate(losses)))]
    (run_dir / "csv" / "metrics.csv").write_text("\n".join(rows) + "\n")
    (run_dir / "summary.json").write_text(json.dumps({"strategy": strategy, "step_s": 0.1, "peak_bytes": 9 * MIB,
                                                      "memory_budget_bytes": 10 * MIB}))
    (run_dir / "plan.json").write_text(json.dumps({"units": [{"choice": c} for c in choices], "source": "solved"}))
    for rank in range(2):
        (run_dir / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "hwm_after_steps_bytes": 500 * MIB}))


def test_a_launch_reads_back_its_losses_in_step_order_its_plan_and_each_rank(tmp_path: Path) -> None:
    _write_run(tmp_path, [5.5, 5.25, 5.0], ["zero3", "zero2+ckpt", "zero3", "split(k=4, sharded=2)"])
    record = report.read_run(tmp_path, "", 0)
    assert record["status"] == "ok" and record["losses"] == [5.5, 5.25, 5.0]
    assert record["choices"] == {"zero3": 2, "zero2+ckpt": 1, "split(k=4, sharded=2)": 1}
    assert [r["rank"] for r in record["ranks"]] == [0, 1]
    failed = report.read_run(tmp_path / "absent", INFEASIBLE_LOG, 1)
    assert failed["status"] == "infeasible" and failed["smallest_feasible_bytes"] == 2526014
    assert report.read_run(tmp_path / "absent", "Traceback: boom", 1)["status"] == "error"


def _osdp(label: str, load_s: tuple[float, float], above_mib: int, choices: dict[str, int], cache: str = "warm",
          fixed: int = 450) -> dict:
    ranks = [{"rank": r, "setup_hwm_bytes": 900 * MIB, "hwm_after_steps_bytes": (fixed + above_mib + r) * MIB,
              "page_cache": {"resident_before": 0.25 * r, "state": cache},
              "load": {"load_s": load_s[r], "bytes_read": 220 * MIB, "file_bytes": 400 * MIB}} for r in range(2)]
    return {"label": label, "status": "ok", "ranks": ranks, "choices": choices, "wall_s": 60, "load_average": "2.0",
            "summary": {"memory_budget_bytes": 1000 * MIB, "peak_bytes": 900 * MIB, "step_s": 5.0},
            "overrides": ["data.seq_len=64", "cluster.memory_budget=70%ddp"]}


def _matrix(case: str, run: str, losses: list[float], status: str = "ok", **extra: object) -> dict:
    summary = {"memory_budget_bytes": 2 * MIB, "peak_bytes": 3 * MIB // 2, "step_s": 0.1}
    return {"case": case, "family": case.split()[0], "run": run, "status": status, "losses": losses,
            "summary": summary, "choices": extra.pop("choices", {}), **extra}


def _saved() -> dict:
    fixed = {kind: {"label": f"fixed_{kind}", "status": "ok", "summary": {"peak_bytes": MIB, "step_s": 0.05},
                    "ranks": [{"rank": r, "setup_hwm_bytes": 440 * MIB, "hwm_after_steps_bytes": hwm * MIB}
                              for r in range(2)]} for kind, hwm in (("solve", 550), ("plan", 450))}
    load = {"model": {"type": "LlamaForCausalLM", "param_count": 109_529_856, "file_bytes": 438_131_648},
            "command": "MALLOC_MMAP_THRESHOLD_=65536 ./dev train ...",
            "probe": {"status": "infeasible", "overrides": ["cluster.memory_budget=50%ddp"],
                      "smallest_feasible_bytes": 1302006785},
            "osdp": [{**_osdp("osdp_0", (0.30, 0.25), 950, {"zero3": 9, "replicate+ckpt": 2}), "fixed_kind": "solve"},
                     {**_osdp("osdp_1", (0.20, 0.15), 1150, {"zero3": 9, "replicate+ckpt": 2}), "fixed_kind": "plan"},
                     {**_osdp("osdp_2", (0.12, 0.10), 900, {"zero3": 9, "replicate+ckpt": 2}), "fixed_kind": "plan"},
                     {**_osdp("osdp_cold", (0.5, 0.4), 900, {"zero3": 9}, cache="cold"), "fixed_kind": "plan"}],
            "from_pretrained": [{"call_s": [0.05, 0.1, 0.2], "read_s": [1.0, 1.0, 1.0], "page_cache": "warm"}] * 3
            + [{"call_s": [0.3, 0.1, 0.1], "read_s": [0.8, 0.5, 0.6], "page_cache": "cold"}], "fixed": fixed}
    long = {"command": "MALLOC_MMAP_THRESHOLD_=65536 ./dev train ... data.seq_len=1024 ...",
            "osdp": [{**_osdp("long", (0.2, 0.2), 1050, {"zero3+ckpt": 9}, cache="as found", fixed=550),
                      "fixed_kind": "solve", "overrides": ["data.seq_len=1024", "cluster.memory_budget=50%ddp"],
                      "losses": [10.4, 10.1, 9.9]}],
            "fixed": {"solve": fixed["solve"]}}
    base = [5.9, 5.5, 5.1]
    matrix = [_matrix("llama 2x64", "probe", [], "infeasible", smallest_feasible_bytes=2526014),
              _matrix("llama 2x64", "ddp", base),
              _matrix("llama 2x64", "osdp 60%ddp meta", base, choices={"zero2": 2, "zero3+ckpt": 1, "replicate": 1}),
              _matrix("llama 2x64", "osdp +5% meta", [5.9, 5.5, 5.2], choices={"split(k=4, sharded=4)": 1}),
              _matrix("llama 2x64", "osdp 60%ddp eager-load", [], "infeasible", smallest_feasible_bytes=3 * MIB)]
    export = {"status": "ok", "equal": True, "tensors": 111, "wall_s": 12.5, "file_bytes": 418 * MIB,
              "checkpoint_bytes": 1300 * MIB, "from_pretrained_s": 0.1, "load_average": "2.0",
              "command": "osdp-export CKPT OUT --config DIR"}
    return {"load": load, "long": long, "matrix": matrix, "export": export,
            "machine": {"command": "./dev bench pretrained_load"}}


def test_each_target_gets_its_verdict_and_figure(tmp_path: Path) -> None:
    saved = _saved()
    text = "\n".join(report.verdicts(saved))
    # osdp_1 rank 1: 1601 MiB, 1151 above its fixed cost (from a saved plan) and a 1000 MiB budget
    assert "its budget (seq_len=64 memory_budget=70%ddp): **no** (worst 1.15x)" in text
    # the long launch's rank 1: 1601 MiB, 1051 above the 550 MiB of its fixed cost (solving)
    assert "its budget (seq_len=1024 memory_budget=50%ddp): **holds** (worst 1.05x)" in text
    # the slower rank over the median call of the same page cache: 0.30, 0.20, 0.12 over 0.1 (warm); 0.5 over 0.1 (cold)
    assert ("from_pretrained's time, each timed under the same page cache: **no** (median 2.50x, worst 5.00x "
            "(osdp_cold) over 4 launches: 3.00x (warm) / 2.00x (warm) / 1.20x (warm) / 5.00x (cold); 0.25x "
            "from_pretrained followed by reading every weight once)") in text
    assert ("from a cold page cache (osdp_cold): osdp 0.500 s, from_pretrained 0.100 s (5.00x), from_pretrained "
            "followed by reading every weight once 0.600 s (0.83x)") in text
    changed = _saved()
    changed["load"]["from_pretrained"][3]["call_s"] = [0.3, 0.3, 0.3]  # cold: 0.5 / 0.3
    assert "cache: **holds by the median** (median 1.83x, worst 3.00x (osdp_0)" in "\n".join(report.verdicts(changed))
    changed["load"]["osdp"][0]["ranks"][0]["load"].update(load_s=0.19)
    changed["load"]["osdp"][0]["ranks"][1]["load"].update(load_s=0.1)
    assert "cache: **holds** (median 1.78x, worst 2.00x (osdp_1)" in "\n".join(report.verdicts(changed))
    assert "of Lightning's ddp (relative): **no** (1 of 2 launches hold; not: llama 2x64 osdp +5% meta)" in text
    assert "plans used replicate, zero2, zero3, split, +ckpt" in text
    assert "bit for bit: **holds** (111 tensors; osdp-export 12.5 s, 418 MiB)" in text
    written = report.write_outputs(tmp_path, saved)
    assert (tmp_path / "pretrained_load.md").read_text() == written + "\n"
    assert json.loads((tmp_path / "pretrained_load_runs.json").read_text())["export"]["equal"] is True
    assert "the smallest budget osdp names is 1242 MiB (1302006785 bytes)" in written
    assert ("| osdp_0 | 0% / 25% held, then warm | 0.300 / 0.250 | 220 MiB (55%) / 220 MiB (55%) | 0.100 (0.050) | "
            "1.000 | 3.0x | 0.30x |") in written
    assert "| osdp_cold | 0% / 25% held, then cold | 0.500 / 0.400 |" in written
    assert "## A budget DDP's state does not fit, at a long sequence" in written and "losses 10.400 / 10.100" in written
    assert "| llama 2x64 | osdp 60%ddp eager-load | | no plan fits; smallest 3.00 MiB |" in written
    assert "| 900 / 900 | 1400 / 1401 | - | solve | 850 / 851 | 0.85 / 0.85 | 900 | 5.00 | 60 |" in written


def test_matrix_cases_and_jobs() -> None:
    assert pretrained_load.parse_matrix("llama:2x64,gpt2:1x32") == [("llama", 2, 64), ("gpt2", 1, 32)]
    jobs = pretrained_load.matrix_jobs(1000, "model.pretrained=D", "+strategy.pretrained=D")
    assert [name for name, _ in jobs] == [f"osdp {b} {k}" for b in ("60%ddp", "+5%")
                                          for k in ("meta", "eager-load", "eager-from_pretrained")]
    assert jobs[3][1] == ["cluster.memory_budget=1050B", "meta_init=true", "model.pretrained=D"]
    assert len(pretrained_load.matrix_jobs(None, "a", "b")) == 3  # no smallest named: 60%ddp only


def test_the_worker_puts_the_weight_files_in_the_page_cache_asked_for(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(os.urandom(1 << 20))
    (tmp_path / "config.json").write_text("{}")
    assert worker.weight_files(tmp_path) == [tmp_path / "model.safetensors"]
    assert worker.set_page_cache(tmp_path, "warm")["state"] == "warm"
    assert worker.resident_share([tmp_path / "model.safetensors"]) == 1.0
    assert worker.set_page_cache(tmp_path / "model.safetensors", "")["resident_before"] == 1.0
    with pytest.raises(ValueError, match="warm, cold or unset"):
        worker.set_page_cache(tmp_path, "hot")
