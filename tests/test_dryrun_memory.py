"""The dry run's per-rank memory against FSDPMemTracker under a fake process group (8 and 64
ranks, one process, FakeTensorMode): the check of docs/design.md section 6, on a 3.3M-parameter GPT.

Every plan's prediction must lie within 10% of the tracked peak, except that a plan may be over
by the whole gradients of its replicated units on top: all-replicate is predicted +13.5% here (its
transient is one gradient tensor now; the rest of the error is the dry run's estimated
activations, which a measured profile does not have: -0.7% on 2 real ranks), a conservative
error. Sharded plans are within 0-2.2% since the model holds the reduce-scatter input, gives back
the sharded gradients not made yet and prices each unit's measured backward rise (zero3+ckpt
was +4.5% / +0.7% before that, right for the wrong reasons)."""

from __future__ import annotations

import json
from pathlib import Path

from ckpt_launch import run_alone

SCRIPT = Path(__file__).parent / "scripts" / "dryrun_memcheck.py"


def test_dry_run_memory_matches_fsdp_mem_tracker(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    done = run_alone([str(SCRIPT), "--model", "toy_gpt", "--world-sizes", "8", "64", "--out", str(out)],
                     tmp_path / "log", 600, cwd=tmp_path)
    assert done.returncode == 0, done.log[-9000:]
    rows = json.loads(out.read_text())
    plans = {(r["world_size"], r["plan"]) for r in rows}
    assert {(64, "hsdp(g=8)"), (64, "zero3(reshard=8)"), (8, "solved"), (64, "solved")} <= plans
    assert {(8, "zero3+ckpt"), (64, "solved, ckpt")} <= plans
    for row in rows:
        predicted, tracked = row["predicted_bytes"], row["tracked_bytes"]
        label = f"{row['plan']} at {row['world_size']} ranks: predicted {predicted}, tracked {tracked}"
        if row["plan"] == "zero3+ckpt":  # every block checkpointed: within 5%
            assert abs(predicted - tracked) <= 0.05 * tracked, label
        if row["plan"] == "solved, ckpt":  # a mix of zero2+ckpt: the recompute is an upper bound there
            assert tracked <= predicted <= 1.3 * tracked, label
            continue
        assert predicted >= 0.9 * tracked, label  # never more than 10% under
        assert predicted <= 1.1 * tracked + row["replicate_grad_bytes"], label
        if not row["replicate_grad_bytes"]:
            assert abs(predicted - tracked) <= 0.1 * tracked, label
