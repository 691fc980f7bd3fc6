"""osdp on 2 real gloo ranks against Lightning's own DDP: same losses, same plan on every rank,
measured peak under the budget and close to the prediction."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from conftest import SCRIPTS  # noqa: E402
from toy_models import MODELS  # noqa: E402

from osdp_lightning.cost.budget import PLAN_HEADROOM_FRACTION  # noqa: E402
from osdp_lightning.cost.cluster import ClusterSpec  # noqa: E402
from osdp_lightning.plan.choice_table import build_choice_table  # noqa: E402
from osdp_lightning.plan.measure import profile_lightning_module  # noqa: E402
from osdp_lightning.solve import peak_bytes, smallest_feasible_budget  # noqa: E402

pytestmark = pytest.mark.multiprocess
REL_TOL = 1e-4
PEAK_TOL = 0.15
# NOTE: these tests are about sharding mixes. Whether the solver also checkpoints a unit depends on
# calibrated timings, and checkpointed units are predicted high (an upper bound, tested in
# test_checkpointing.py), so a solved mix is kept to sharding choices for a deterministic check.
SHARDING_ONLY = ("--activation-checkpointing", "never")


def budget_forcing_a_mix(model_name: str) -> int:
    """Half-way between uniform zero3's and uniform zero2's peaks (2 ranks): with the headroom kept,
    no uniform plan but zero3 fits, and whatever the timings, a plan that replicates or ZeRO-2-shards
    a unit that still fits (the root always does) is priced faster than uniform zero3: a mix. (Up
    to all-replicate's peak uniform zero2 fits too, and the timings decide whether it wins.)"""
    model = MODELS[model_name]()
    batch = next(iter(model.train_dataloader()))
    profile = profile_lightning_module(model, batch, optimizer=model.configure_optimizers())
    cluster = ClusterSpec(world_size=2, memory_budget_bytes=2**40, collective_latency_s=1e-4,
                          bandwidth_bytes_per_s=1e9)
    table = build_choice_table(profile, cluster)
    zero2, zero3 = (peak_bytes(table, [choice] * len(table.units)) for choice in ("zero2", "zero3"))
    budget = (zero2 + zero3) // 2
    assert smallest_feasible_budget(table) == zero3 <= (1 - PLAN_HEADROOM_FRACTION) * budget < zero2
    return budget


def assert_same_losses(reference: list[dict], candidate: list[dict]) -> None:
    for ref, got in zip(reference, candidate, strict=True):
        assert len(ref["losses"]) == len(got["losses"]) > 0
        for a, b in zip(ref["losses"], got["losses"], strict=True):
            assert abs(a - b) <= REL_TOL * max(abs(a), 1e-8), (ref["losses"], got["losses"])


def assert_plan_and_memory(result: list[dict]) -> dict:
    plans = [r["plan"] for r in result]
    assert all(p == plans[0] for p in plans), "ranks applied different plans"
    plan, summary = plans[0], result[0]["summary"]
    assert summary["peak_bytes"] <= plan["memory_budget_bytes"]
    error = abs(summary["peak_bytes"] - plan["predicted_peak_bytes"]) / summary["peak_bytes"]
    assert error <= PEAK_TOL, f"measured {summary['peak_bytes']} vs predicted {plan['predicted_peak_bytes']}"
    return plan


def test_mlp_matches_ddp_for_replicate_zero3_and_mixed_plans(train, tmp_path: Path) -> None:
    ddp = train("ddp", "--model", "mlp", "--strategy", "ddp")
    for uniform in ("replicate", "zero3"):
        osdp = train(uniform, "--model", "mlp", "--uniform", uniform)
        assert_same_losses(ddp, osdp)
        plan = assert_plan_and_memory(osdp)
        assert {u["choice"] for u in plan["units"]} == {uniform}
    budget = budget_forcing_a_mix("mlp")
    mixed = train("mixed", "--model", "mlp", "--budget", str(budget), "--split-factors", "", *SHARDING_ONLY)
    assert_same_losses(ddp, mixed)
    plan = assert_plan_and_memory(mixed)
    assert len({u["choice"] for u in plan["units"]}) >= 2, plan["units"]
    # the budget bounds the tensors here (budget_covers="tensors"); the process's own figure is still reported
    assert plan["untracked_bytes"] == 0 and plan["predicted_peak_bytes"] + plan["headroom_bytes"] <= budget
    assert 0 < mixed[0]["summary"]["process_above_fixed_bytes"] < mixed[0]["summary"]["process_peak_bytes"]
    # the saved plan is applied as it is: no profiling, same choices, same losses
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan))
    again = train("again", "--model", "mlp", "--plan", str(plan_file))
    assert_same_losses(ddp, again)
    assert [u["choice"] for u in again[0]["plan"]["units"]] == [u["choice"] for u in plan["units"]]
    assert again[0]["plan"]["source"].startswith("loaded:")


def test_torch_transformer_matches_ddp_under_zero3(train) -> None:
    ddp = train("ddp", "--model", "transformer", "--strategy", "ddp")
    osdp = train("zero3", "--model", "transformer", "--uniform", "zero3")
    assert_same_losses(ddp, osdp)
    assert_plan_and_memory(osdp)


def test_tied_language_model_matches_ddp_with_a_solved_mix(train) -> None:
    ddp = train("ddp", "--model", "tied_lm", "--strategy", "ddp")
    budget = budget_forcing_a_mix("tied_lm")
    osdp = train("mixed", "--model", "tied_lm", "--budget", str(budget), "--split-factors", "", *SHARDING_ONLY)
    assert_same_losses(ddp, osdp)
    plan = assert_plan_and_memory(osdp)
    # the tied embedding and head: one unit, or both left to the root (never one without the other)
    tied = [u["module_names"] for u in plan["units"] if {"embed", "head"} & set(u["module_names"])]
    assert tied in ([["embed", "head"]], [])


def test_bf16_mixed_precision_matches_ddp(train) -> None:
    # NOTE: the DDP run of tests/test_precision.py (8 steps), which the session runs once
    ddp = train("ddp", "--model", "mlp", "--strategy", "ddp", "--precision", "bf16-mixed", "--steps", "8")
    osdp = train("zero3", "--model", "mlp", "--uniform", "zero3", "--precision", "bf16-mixed", "--steps", "8")
    assert_same_losses(ddp, osdp)  # bf16 gathers round the weights as autocast does


def test_auto_micro_batch_size_is_set_on_the_module_before_dataloaders(train) -> None:
    result = train("auto", "--model", "mlp", "--micro-batch", "auto", "--split-factors", "")
    plan = result[0]["plan"]
    # all-replicate fits a huge default budget: the largest candidate (8 x 8) has the best throughput
    assert plan["micro_batch_size"] == 64
    assert all(r["summary"]["micro_batch_size"] == 64 for r in result)


def _launch_external(tmp_path: Path, how: str) -> list[dict]:
    """Start both ranks from outside Lightning: torchrun, or the environment srun gives a SLURM task."""
    out = tmp_path / f"{how}.json"
    script = [str(SCRIPTS / "train_compare.py"), "--model", "mlp", "--uniform", "zero3", "--out", str(out)]
    if how == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
               "--rdzv-endpoint=127.0.0.1:0", *script]
        procs = [subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    else:
        port = str(29600 + os.getpid() % 300)
        procs = [subprocess.Popen(
            [sys.executable, *script], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": str(rank),
                 "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "SLURM_JOB_ID": "4242",
                 "SLURM_JOB_NAME": "osdp", "SLURM_NODELIST": "localhost", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": port}) for rank in range(2)]
    for proc in procs:
        output, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, output[-4000:]
    return json.loads(out.read_text())


def test_torchrun_and_slurm_launches_match_lightning_ddp(train, tmp_path: Path) -> None:
    ddp = train("ddp", "--model", "mlp", "--strategy", "ddp")
    for how in ("torchrun", "slurm"):
        result = _launch_external(tmp_path, how)
        assert_same_losses(ddp, result)
        assert_plan_and_memory(result)
