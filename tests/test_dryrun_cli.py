"""``osdp-plan`` for a cluster this machine does not have: a dry run that says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import CliHere


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: osdp-plan profiles for real")
def test_osdp_plan_dry_runs_a_two_node_gpu_cluster(tmp_path: Path, cli_here: CliHere) -> None:
    proc = cli_here("plan", "model=gpt_small", "cluster=h100_80g_x8x2", "cluster.memory_budget=4GiB",
                    f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "DRY RUN: estimated from the cluster description, no GPU used" in out
    assert "DRY RUN for cluster h100_80g_x8x2: 2 node(s) x 8 ranks" in out and "ESTIMATES" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["world_size"] == 16 and "dry-run estimate" in plan["source"]
    assert plan["predicted_peak_bytes"] <= 4 * 2**30
    rows = json.loads((tmp_path / "comparison.json").read_text())["rows"]
    assert [r["strategy"] for r in rows] == ["osdp", "ddp", "zero2", "zero3"]
