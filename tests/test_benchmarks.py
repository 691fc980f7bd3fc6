"""The comparison, setup-overhead, memory-repricing and peak-spread benchmarks: report logic in-process, tiny 2-rank smoke runs."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from ckpt_launch import run_ranks_in_pool
from conftest import child_env

from benchmarks import compare, compare_report, peak_spread, setup_overhead
from benchmarks.compare_worker import _SMALLEST_RE
from osdp_lightning import InfeasibleBudgetError, make_plan
from osdp_lightning.cost.cluster import ClusterSpec
from osdp_lightning.profiling.records import ModelProfile, UnitProfile

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def _run(round_: int, method: str, fraction: float | None, tokens: float, peak: int, *, budget: int | None = None,
         predicted_peak: int | None = None, step_s: float = 0.1, predicted_step_s: float = 0.1) -> dict:
    return {"round": round_, "method": method, "fraction": fraction, "budget_bytes": budget, "status": "ok",
            "summary": {"tokens_per_s": tokens, "step_s": step_s, "predicted_step_s": predicted_step_s,
                        "peak_bytes": peak, "predicted_peak_bytes": predicted_peak or peak},
            "choices": {method if fraction is None else "zero2": 3}, "phases": {"forward_s": 0.03, "backward_s": 0.05, "optimizer_s": 0.01},
            "profile_step_s": 0.05, "setup_s": {"calibrate_s": 0.5, "profile_s": 1.0},
            "plan": {"units": [{"predicted_comm_s": 0.01, "param_count": 100, "choice": "zero2"}]}, "wall_s": 1.0, "load_average": "0.1"}


def _synthetic_runs() -> list[dict]:
    runs = []
    for r, drift in ((0, 1.0), (1, 0.5)):  # round 1 is twice as slow for everyone: ratios must not move
        runs += [_run(r, "ddp", None, 1000 * drift, 100 * MIB), _run(r, "zero3", None, 600 * drift, 60 * MIB),
                 _run(r, "osdp", 1.0, 980 * drift, 90 * MIB, budget=100 * MIB, predicted_peak=93 * MIB),
                 _run(r, "osdp", 0.7, 720 * drift, 69 * MIB, budget=70 * MIB, step_s=0.1, predicted_step_s=0.07)]
    runs.append({"round": 0, "method": "osdp", "fraction": 0.4, "budget_bytes": 40 * MIB, "status": "infeasible",
                 "smallest_feasible_bytes": 55 * MIB, "message": "no plan fits", "wall_s": 1.0})
    return runs


def test_aggregate_takes_paired_ratios_and_checks_budgets() -> None:
    rows = {r["method"]: r for r in compare_report.aggregate(_synthetic_runs(), 100 * MIB)}
    assert rows["osdp @ 100%"]["x_ddp"] == pytest.approx(0.98)
    assert rows["osdp @ 70%"]["x_zero3"] == pytest.approx(1.2)
    assert rows["osdp @ 70%"]["best_fitting"] == "zero3"  # ddp (100 MiB) does not fit 70 MiB
    assert rows["osdp @ 100%"]["within_budget"] and rows["osdp @ 70%"]["within_budget"]
    assert rows["osdp @ 100%"]["mem_error_worst"] == pytest.approx(93 / 90 - 1)
    assert rows["osdp @ 70%"]["step_error"] == pytest.approx(-0.3)
    assert rows["osdp @ 40%"]["status"] == "does not fit (smallest: 55.00 MiB)"


def test_verdicts_name_each_target() -> None:
    runs = _synthetic_runs()
    text = "\n".join(compare_report.verdicts(compare_report.aggregate(runs, 100 * MIB), runs))
    assert "never exceeds its budget (measured peak): MET" in text
    assert "0.95x ddp throughput: MET (0.980x)" in text
    assert "1.10x zero3 throughput: MET (1.200x)" in text
    assert "step-time prediction error <= 20% in every run: MISSED (worst -30.0%" in text


def test_outputs_are_written(tmp_path: Path) -> None:
    runs = _synthetic_runs()
    rows = compare_report.aggregate(runs, 100 * MIB)
    machine = {"cpu": "test", "devices": 2, "rounds": 2, "param_count": 1e6}
    text = compare_report.write_outputs(tmp_path, machine, rows, runs, plot=True)
    assert "| osdp @ 70% | 70.00 | 540 |" in text
    assert (tmp_path / "compare.png").stat().st_size > 10_000
    assert "| osdp @ 70% | 0.1000 |" in text  # its row of the step breakdown
    assert "prototype" not in text and "terms the plan lacks" not in text  # no experimental fit in the report
    with (tmp_path / "compare.csv").open() as handle:
        assert [r["method"] for r in csv.DictReader(handle)][:3] == ["ddp", "zero3", "osdp @ 100%"]
    assert len(json.loads((tmp_path / "compare_runs.json").read_text())["runs"]) == len(runs)


def _process_run(round_: int, fraction: float | None, own: int, process: int, peak: int,
                 budget: int | None = None) -> dict:
    run = _run(round_, "osdp-replicate" if fraction is None else "osdp", fraction, 1000, peak, budget=budget)
    run["summary"].update(own_above_fixed_bytes=own, process_above_fixed_bytes=process)
    return run if budget is None else {**run, "budget_covers": "process"}


def test_process_budgets_report_own_and_resident_memory_over_the_budget(tmp_path: Path) -> None:
    runs = [_process_run(0, None, own=200 * MIB, process=210 * MIB, peak=120 * MIB),
            _process_run(0, 1.0, own=190 * MIB, process=204 * MIB, peak=118 * MIB, budget=200 * MIB),
            _process_run(0, 0.7, own=141 * MIB, process=150 * MIB, peak=90 * MIB, budget=140 * MIB)]
    rows = {r["method"]: r for r in compare_report.aggregate(runs, 120 * MIB)}
    assert rows["osdp @ 100%"]["own_over_budget"] == pytest.approx(0.95)
    assert rows["osdp @ 100%"]["process_over_budget"] == pytest.approx(1.02)
    # A process budget bounds the own memory: 141 MiB over 140 is out, though the tracked peak is well in.
    assert rows["osdp @ 100%"]["within_budget"] and not rows["osdp @ 70%"]["within_budget"]
    # osdp-replicate fits a process budget by its own memory (200 MiB), not its tracked peak (120 MiB).
    assert rows["osdp @ 100%"]["best_fitting"] == "osdp-replicate" and "best_fitting" not in rows["osdp @ 70%"]
    machine = {"cpu": "test", "devices": 2, "rounds": 1, "budget_covers": "process"}
    text = compare_report.write_outputs(tmp_path, machine, list(rows.values()), runs, plot=False)
    assert "| of budget: peak / own / process |" in text
    assert "| yes (own) | 59.0% / 95.0% / 102.0% |" in text
    assert "| **NO** (own) | 64.3% / 100.7% / 107.1% |" in text
    assert ("own memory above its fixed cost never exceeds its process budget: MISSED (2 runs, highest own/budget "
            "100.7%; resident above the fixed cost, code pages loaded since setup included: highest process/budget "
            "107.1%)") in text
    assert "of budget: 64.3% / 100.7% / 107.1%" in compare_report.progress_line({**runs[2], "load_average": "0.1"})
    with (tmp_path / "compare_runs.csv").open() as handle:
        last = list(csv.DictReader(handle))[-1]
    assert (last["budget_covers"], last["own_above_fixed_bytes"]) == ("process", str(141 * MIB))


def test_older_runs_without_process_figures_still_report(tmp_path: Path) -> None:
    runs = _synthetic_runs()  # no budget_covers, no own or resident figures: budgets bound tensors
    text = compare_report.write_outputs(tmp_path, {"cpu": "test"}, compare_report.aggregate(runs, 100 * MIB), runs,
                                        plot=False)
    assert "| yes | 90.0% / - / - |" in text and "| 69.00 | 69.00 | +0.0% | yes | 98.6% / - / - |" in text
    assert "process budget" not in text
    assert "| osdp @ 40% | 40.00 | does not fit (smallest: 55.00 MiB) |" in text


def test_process_budgets_are_fractions_of_the_replicate_runs_own_memory(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    launched = []

    def fake_launch(method, budget, settings, args, work, label, extra=()):  # noqa: ANN001, ANN202
        launched.append((method, budget, tuple(extra)))
        return _process_run(0, None, own=200 * MIB, process=210 * MIB, peak=120 * MIB, budget=budget)

    monkeypatch.setattr(compare, "launch", fake_launch)
    args = compare.build_parser().parse_args(["--methods", "osdp-replicate,osdp", "--fractions", "1.0,0.5",
                                              "--rounds", "1", "--budget-covers", "process"])
    runs, replicate_peak, base = compare.run_all(args, {}, tmp_path)
    assert (replicate_peak, base) == (120 * MIB, 200 * MIB)
    assert launched[1:] == [("osdp", 200 * MIB, ("--budget-covers", "process")),
                            ("osdp", 100 * MIB, ("--budget-covers", "process"))]
    assert [r.get("budget_covers") for r in runs] == [None, "process", "process"]
    assert compare.build_parser().parse_args([]).budget_covers == "tensors"  # the default keeps tensor budgets
    assert compare.budget_base({"peak_bytes": 120 * MIB, "own_above_fixed_bytes": 200 * MIB}, "tensors") == 120 * MIB
    with pytest.raises(SystemExit, match="no own memory above its fixed cost"):
        compare.budget_base({"peak_bytes": 120 * MIB, "own_above_fixed_bytes": 0}, "process")


def test_process_budgets_run_with_large_tensors_from_mmap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    envs = []

    def fake_run_ranks(cmd, log, timeout_s, env, ranks):  # noqa: ANN001, ANN202
        envs.append(env)
        log.write_text("not run")
        return 1

    monkeypatch.setattr(compare, "run_ranks", fake_run_ranks)
    for covers in ("tensors", "process"):
        args = compare.build_parser().parse_args(["--budget-covers", covers])
        assert compare.launch("osdp", 1, {}, args, tmp_path, covers)["status"] == "error"
    assert [env.get("MALLOC_MMAP_THRESHOLD_") for env in envs] == [None, "65536"]


def test_round_order_starts_with_ddp_and_puts_every_run_in_every_position() -> None:
    first = compare.run_order((1.0, 0.5), ("ddp", "zero3", "osdp"), 0)
    assert first == [("ddp", None), ("zero3", None), ("osdp", 1.0), ("osdp", 0.5)]
    assert compare.run_order((1.0, 0.5), ("ddp", "zero3", "osdp"), 1) == first[1:] + first[:1]
    rounds = [compare.run_order((1.0, 0.5), ("ddp", "zero3", "osdp"), r) for r in range(4)]
    for job in first:
        assert sorted(order.index(job) for order in rounds) == [0, 1, 2, 3]
    hand = compare.run_order((), ("fsdp2", "zero3", "osdp"), 0)
    assert hand.index(("fsdp2", None)) < hand.index(("osdp-at-fsdp2", 1.0))  # its peak sets that budget


def test_one_device_runs_ddp_and_osdp_above_its_peak() -> None:
    args = compare.build_parser().parse_args(["--accelerator", "cuda", "--devices", "1"])
    compare.resolve_defaults(args)
    assert (args.methods, args.fractions) == ("ddp,osdp-replicate,osdp", "1.25")
    assert compare.model_settings(args) == compare.PRESETS["cuda"]
    args = compare.build_parser().parse_args(["--n-embd", "128"])
    compare.resolve_defaults(args)
    assert args.methods == "ddp,osdp-replicate,zero2,zero3,osdp-default,osdp"
    assert compare.model_settings(args)["n_embd"] == 128


def test_precision_reaches_every_worker_and_the_hand_fsdp2_policy() -> None:
    import torch

    from benchmarks import compare_worker

    args = compare.build_parser().parse_args(["--precision", "bf16-mixed"])
    compare.resolve_defaults(args)
    cmd = compare.worker_command("fsdp2", None, compare.model_settings(args), args, Path("/tmp/run.json"))
    assert cmd[cmd.index("--precision") + 1] == "bf16-mixed"
    policy = compare_worker.HAND_POLICIES["bf16-mixed"]
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert compare_worker.HandFSDP2GPT.mp_policy.param_dtype is None  # 32-true: FSDP2's default policy
    assert compare_worker.build_parser().parse_args(["--method", "fsdp2", "--out", "x"]).precision == "32-true"


def test_worker_reads_the_smallest_budget_from_the_strategy_error() -> None:
    unit = UnitProfile(name="a", module_names=("a",), param_count=1000, frozen_param_count=0, forward_s=1e-3,
                       backward_s=2e-3, activation_bytes=100)
    profile = ModelProfile(units=(unit,), micro_batch_size=1, param_bytes_per_element=4, grad_bytes_per_element=4,
                           compute_bytes_per_element=4, reduce_bytes_per_element=4, optimizer_bytes_per_param=8,
                           activation_bytes=100)
    cluster = ClusterSpec(world_size=2, memory_budget_bytes=1000, collective_latency_s=1e-4,
                          bandwidth_bytes_per_s=1e9, headroom_bytes=50)
    with pytest.raises(InfeasibleBudgetError) as err:
        make_plan(profile, cluster)
    match = _SMALLEST_RE.search(str(err.value))
    assert match and int(match.group(1)) > 1000


def test_setup_overhead_share() -> None:
    row = setup_overhead.overhead_row({"model": "m", "params": 10, "units": 3, "step_s": 0.1,
                                       "setup_s": {"calibrate_s": 1.0, "profile_s": 0.5, "solve_s": 0.5}})
    assert row["run_200_s"] == pytest.approx(22.0) and row["share"] == pytest.approx(2 / 22)
    assert "| m | 0.00M | 3 | 1.00 | 0.50 | 0.50 | 0.00 | 2.00 | 0.1000 | 22.0 | 9.1% |" in setup_overhead.format_table([row])


@pytest.mark.multiprocess
def test_compare_smoke_two_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch that only calibrates, then Lightning's ddp, osdp's uniform replicate, osdp at 90% of
    the latter's measured peak; tiny GPT, one round (four 2-rank launches, in the test suite's ranks)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(compare, "run_ranks", run_ranks_in_pool)
    code = compare.main(["--preset", "tiny", "--steps", "5", "--rounds", "1", "--methods", "ddp,osdp-replicate,osdp",
                         "--fractions", "0.9", "--warm-calibrations", "1", "--out-dir", str(tmp_path), "--no-plot"])
    assert code == 0
    saved = json.loads((tmp_path / "compare_runs.json").read_text())
    # The warm-up calibrated into the empty cache the measured runs share; it is not a measured run.
    assert [(c["status"], c["step_terms_source"]) for c in saved["machine"]["calibrations"]] == [
        ("ok", "measured at setup")]
    runs = saved["runs"]
    assert [(r["method"], r["fraction"], r["status"]) for r in runs] == [
        ("ddp", None, "ok"), ("osdp-replicate", None, "ok"), ("osdp", 0.9, "ok")]
    assert runs[0]["plan"] is None and runs[0]["choices"] == {"Lightning strategy=ddp": 1}
    osdp = runs[2]
    assert osdp["budget_bytes"] == int(0.9 * runs[1]["summary"]["peak_bytes"])
    assert osdp["summary"]["peak_bytes"] <= osdp["budget_bytes"]
    assert "| osdp @ 90% |" in (tmp_path / "compare.md").read_text()
    # Where the step peaks, unit by unit: the model's moments beside the tracker's per-module peaks.
    from benchmarks.memory_moments import runs_of, table_of, unit_rows

    assert [r["method"] for r in runs_of(tmp_path / "compare_runs.json")] == ["osdp-replicate", "osdp"]
    rows = unit_rows(osdp)
    assert [r["unit"] for r in rows] == [u["name"] or "(root)" for u in osdp["plan"]["units"]]
    assert max(max(r["forward"], r["backward"]) for r in rows) == osdp["plan"]["predicted_peak_bytes"]
    measured = [r[key] for r in rows for key in ("forward_peak", "backward_peak") if key in r]
    assert measured and max(measured) <= osdp["summary"]["peak_bytes"]
    assert all(r["backward_peak"] >= r["backward_start"] for r in rows if "backward_peak" in r)
    assert "| unit | choice |" in table_of(osdp) and osdp["summary"]["module_memory_rank"] in (0, 1)


def test_peak_spread_counts_each_peak_and_the_launches_over_the_prediction() -> None:
    lines = peak_spread.spread_lines([100 * MIB, 103 * MIB, 100 * MIB], 101 * MIB)
    assert lines == ["100.00 MiB (-1.0% of predicted): 2 of 3", "103.00 MiB (+2.0% of predicted): 1 of 3",
                     "spread 3.00% of the least; over the prediction: 1 of 3"]


@pytest.mark.multiprocess
def test_peak_spread_launches_one_plan_again_and_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    """A planning launch, then a hand-made plan of the tiny GPT trained twice from its saved file."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(compare, "run_ranks", run_ranks_in_pool)
    assert peak_spread.main(["--preset", "tiny", "--choices", "zero3+ckpt,zero2,zero3", "--launches", "2"]) == 0
    out = capsys.readouterr().out
    assert "plan zero3+ckpt, zero2, zero3 on default, 2 launches:" in out
    launches = [line for line in out.splitlines() if line.startswith("launch ")]
    assert len(launches) == 2 and all(" MiB (rank " in line for line in launches)
    counts = [int(line.split(": ")[-1].split(" of ")[0]) for line in out.splitlines() if "% of predicted): " in line]
    assert sum(counts) == 2 and "spread " in out


def test_a_recorded_profile_reads_back_for_repricing() -> None:
    """The memory tools price a run again from its JSON record: the profile reads back as it was
    saved, and the plan's cluster is the one it was made for."""
    import dataclasses

    from benchmarks.reprice_memory import cluster_of, profile_from_dict

    unit = UnitProfile(name="a", module_names=("a",), param_count=1000, frozen_param_count=0, forward_s=1e-3,
                       backward_s=2e-3, activation_bytes=100, linear_shape=(10, 100), split_overhead_s=((2, 1e-4),))
    profile = ModelProfile(units=(unit,), micro_batch_size=1, param_bytes_per_element=4, grad_bytes_per_element=4,
                           compute_bytes_per_element=4, reduce_bytes_per_element=4, optimizer_bytes_per_param=8,
                           activation_bytes=100)
    assert profile_from_dict(json.loads(json.dumps(dataclasses.asdict(profile)))) == profile
    plan = {"world_size": 2, "memory_budget_bytes": 10**6, "collective_latency_s": 1e-4,
            "bandwidth_bytes_per_s": 1e9, "overlap_efficiency": 0.0}
    cluster = cluster_of(plan)
    assert (cluster.world_size, cluster.memory_budget_bytes, cluster.headroom_bytes) == (2, 10**6, 0)


def test_every_method_has_a_colour_in_the_plot() -> None:
    from benchmarks import compare, compare_plot

    assert set(compare.BASELINES) | {"osdp"} <= set(compare_plot.COLORS)


def test_gpu_check_runs_on_cpu() -> None:
    """The GPU check's dry run here (a GPU is lent rarely, and its minutes must not go on a script
    that no longer runs): every plan of both profiles measured at 2 fake ranks, and one-device
    Trainer runs where osdp, also checkpointing, has Lightning ddp's losses; bf16-mixed plans and
    FSDP2 by hand with the same policy under the fake process group; compiled units train as eager ones."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--layers", "2",
                           "--hidden", "128", "--seq", "64", "--batch", "4", "--steps", "3", "--worlds", "2"],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in proc.stdout.splitlines()
            if line.startswith("| ") and not line.startswith(("| profile", "| run"))]
    memory = {(r[0], r[2]) for r in rows if r[0] in ("whole", "from shapes")}
    plans = ("replicate", "zero2", "zero3", "zero3+ckpt", "ilp: replicate..zero3", "ilp: zero3..ckpt")
    assert memory == {(kind, plan) for kind in ("whole", "from shapes") for plan in plans}
    training = {r[0]: r for r in rows if len(r) == 7 and r[0] not in ("whole", "from shapes")}
    assert list(training)[0] == "ddp" and len(training) == 4, training
    tight = next(name for name in training if name.startswith("osdp at "))
    assert float(training["osdp"][1]) <= 1e-5 and float(training[tight][1]) <= 1e-5
    assert "+ckpt" in training[tight][6] and "meta init" in list(training)[3]
    # bf16-mixed: osdp's plans and FSDP2 by hand with the same policy gather 2 bytes an element
    bf16 = {r[2]: r for r in rows if r[0] == "bf16-mixed"}
    assert set(bf16) == {"hand FSDP2 (bf16 policy)", "osdp zero3", "osdp ilp: replicate..zero3"}, bf16
    assert all(r[8] == "2" and int(r[7]) > 0 for r in bf16.values())
    compiled = next(r for r in rows if r[0] == 'osdp, compile="units"')
    assert float(compiled[1]) <= 1e-4 and float(compiled[3]) > 0, compiled
