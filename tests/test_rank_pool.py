"""The rank pool the 2-rank tests run in: each scenario starts from a fresh interpreter's state, and
a failed or hung scenario never reaches the next one (tests/scripts/rank_pool.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from ckpt_launch import pool, script  # noqa: E402
from rank_pool import RankPool  # noqa: E402

pytestmark = pytest.mark.multiprocess


def probe(ranks: RankPool, tmp_path: Path, name: str, *flags: str, timeout_s: float = 120,
          alone: bool = False) -> tuple[object, list[dict]]:
    out = tmp_path / name
    code = ranks.run([script("pool_probe.py"), "--out", str(out), *flags], tmp_path / f"{name}.log", timeout_s,
                    cwd=tmp_path, env={"PATH": "/usr/bin:/bin"}, grace_s=5, alone=alone)
    states = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)
              if Path(f"{out}.rank{r}.json").exists()]
    return code, states


def test_scenarios_start_fresh_and_hung_ones_restart_the_ranks(tmp_path: Path) -> None:
    """The session's own pool (the one every 2-rank test runs in)."""
    ranks = pool()
    code, first = probe(ranks, tmp_path, "first")
    assert code == 0 and "probe on rank 1" in (tmp_path / "first.log").read_text()
    assert [s["probe_var"] for s in first] == [None, None] and not any(s["group_up"] for s in first)
    assert probe(ranks, tmp_path, "mutate", "--mutate")[0] == 0

    code, after = probe(ranks, tmp_path, "after")
    assert code == 0
    assert after == first  # the same processes, in the state they had before the first scenario
    code, alone = probe(ranks, tmp_path, "alone", "--alone", alone=True)  # rank 0 as a single process
    assert code == 0 and alone == [{**first[0], "rank_var": None}]
    assert [s["rank_var"] for s in first] == ["0", "1"]

    code, _ = probe(ranks, tmp_path, "fail", "--fail")  # every rank answers: the ranks stay, put back
    assert code == 1 and "the probe fails on rank 1" in (tmp_path / "fail.log").read_text()
    assert probe(ranks, tmp_path, "after_fail") == (0, first)

    code, _ = probe(ranks, tmp_path, "hang", "--hang", timeout_s=2)  # no answer: fresh ranks
    assert code == "timeout"
    code, restarted = probe(ranks, tmp_path, "restarted")
    assert code == 0 and {s["pid"] for s in restarted}.isdisjoint(s["pid"] for s in first)
    # fresh interpreters seed torch's generator each their own way: all but the draw as at first
    assert [{**s, "pid": 0, "first_draw": 0} for s in restarted] == [{**s, "pid": 0, "first_draw": 0} for s in first]
