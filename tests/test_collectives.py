"""The reduce-scatter osdp gives FSDP2 on gloo (osdp_lightning/runtime/collectives.py), on 2 real gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from ckpt_launch import run_gloo_checks


@pytest.mark.multiprocess
def test_the_in_place_reduce_scatter_matches_gloos_and_leaves_no_buffer_behind(tmp_path: Path) -> None:
    result = run_gloo_checks("reduce_check.py", tmp_path)
    assert result["results"]["ops"] == ["sum", "max"]
    assert result["memory"]["in_place_rise_bytes"] == 0
    assert len(result["training"]["losses"]) == 4
