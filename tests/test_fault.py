"""Faults with real processes: a rank raising during setup, ranks SIGKILLed under torchrun."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from lightning.fabric.utilities.distributed import _suggested_max_num_threads

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from ckpt_launch import run_logged, run_ranks, script  # noqa: E402
from ckpt_plans import MIXED, fixed_plan  # noqa: E402
from fault_setup import INJECTED  # noqa: E402
from toy_models import MLP  # noqa: E402

pytestmark = pytest.mark.multiprocess
BOUND_S = 60  # far below the 30-minute default collective timeout


# NOTE: profiling and solving both run on rank 0 inside one try block whose outcome (plan or error)
# is broadcast; "profile" covers that path, "apply" the all-gather of a status after apply_plan. The
# first runs with both ranks started together (as torchrun starts them, in the suite's rank pool),
# the second under Lightning's launcher, whose process tree must be gone when it exits.
@pytest.mark.parametrize("stage", ["profile", "apply"])
def test_a_rank_raising_in_setup_stops_every_rank_quickly(tmp_path: Path, stage: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the launcher sets the ranks' thread count
    args = [script("fault_setup.py"), "--fail", stage, "--out", str(tmp_path)]
    if stage == "profile":
        done = run_ranks(args, tmp_path / "log", timeout_s=BOUND_S + 30, cwd=tmp_path)
    else:
        done = run_logged(args, tmp_path / "log", timeout_s=BOUND_S + 30)
    assert done.returncode == 1, done.log[-4000:]
    assert done.elapsed_s < BOUND_S, f"took {done.elapsed_s:.0f} s"
    assert done.leftovers == [], "a rank was still running 15 s after the launcher exited"
    reports = {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    assert sorted(reports) == [0, 1], done.log[-4000:]
    for report in reports.values():  # every rank exited with the injected error, none timed out
        assert INJECTED in report["error"] and report["elapsed_s"] < BOUND_S
    if stage == "apply":  # rank 0 finished applying; it learns of rank 1's failure by name
        assert reports[0]["type"] == "RankFailedError"
        assert reports[0]["error"].startswith("rank 1 failed while applying the osdp plan")
        # Lightning's launcher gives every rank its share of the cores (``_suggested_max_num_threads``,
        # what DDPStrategy sets); ModelParallelStrategy, osdp's base, set none on the ranks it did not
        # start (rank 1 ran a thread per core beside rank 0)
        assert [reports[r]["threads"] for r in (0, 1)] == [_suggested_max_num_threads(2)] * 2


def test_torchrun_restarts_killed_ranks_from_the_last_checkpoint(tmp_path: Path) -> None:
    fixed_plan(MLP(width=64), 2, MIXED).save(tmp_path / "plan.json")
    common = ["--plan", str(tmp_path / "plan.json"), "--ckpt-dir", str(tmp_path / "ckpt")]
    # attempt 0: rank 1 SIGKILLed right after writing its shard of the step-12 checkpoint;
    # attempt 1: rank 1 SIGKILLed as step 14 starts; attempt 2 finishes
    done = run_logged(["-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=2",
                       "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", "--monitor-interval=0.5",
                       script("fault_torchrun.py"), *common, "--out", str(tmp_path / "out"),
                       "--kill-mid-save-step", "12", "--kill-at-step", "14"], tmp_path / "torchrun.log", 420)
    assert done.returncode == 0, done.log[-6000:]
    attempts = [json.loads(line) for line in (tmp_path / "out" / "attempts.jsonl").read_text().splitlines()]
    assert [a["attempt"] for a in attempts] == [0, 1, 2]
    # the half-written step-12 save is recognised and refused; the step-8 checkpoint is intact
    (refusal,) = attempts[1]["partials"].values()
    assert refusal.startswith("IncompleteCheckpointError") and "unfinished save" in refusal
    assert attempts[1]["last_complete"] and attempts[1]["last_step"] == 8
    assert attempts[2]["last_step"] == 12 and attempts[2]["partials"] == {}  # re-saved, debris removed
    final = json.loads((tmp_path / "out" / "final.json").read_text())
    assert final["attempt"] == 2 and final["global_step"] == 20

    # the uninterrupted run with the same checkpointing schedule ends at the same loss and weights
    reference = run_ranks([script("ckpt_run.py"), "--steps", "20", *common[:2], "--ckpt-dir",
                           str(tmp_path / "ref_ckpt"), "--ckpt-every", "4", "--out", str(tmp_path / "ref")],
                          tmp_path / "ref.log", 240, cwd=tmp_path)
    assert reference.returncode == 0, reference.log[-6000:]
    ref_steps = [rank["steps"] for rank in json.loads((tmp_path / "ref" / "record.json").read_text())]
    for rank, losses in enumerate(final["losses"]):
        assert losses[-1] == [20, ref_steps[rank][-1]["loss"]]
    ours = torch.load(tmp_path / "out" / "final.pt", weights_only=False)["model"]
    theirs = torch.load(tmp_path / "ref" / "final.pt", weights_only=False)["model"]
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
