"""The reduce-scatter osdp gives FSDP2 on gloo (osdp_lightning/collectives.py), on 2 real gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ckpt_launch import run_ranks, script


@pytest.mark.multiprocess
def test_the_in_place_reduce_scatter_matches_gloos_and_leaves_no_buffer_behind(tmp_path: Path) -> None:
    out = tmp_path / "reduce.json"
    done = run_ranks([script("reduce_check.py"), "--out", str(out)], tmp_path / "log", 240, cwd=tmp_path)
    assert done.returncode == 0, done.log[-9000:]
    result = json.loads(out.read_text())
    assert result["results"]["ops"] == ["sum", "max"]
    assert result["memory"]["in_place_rise_bytes"] == 0
    assert len(result["training"]["losses"]) == 4
