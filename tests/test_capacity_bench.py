"""The capacity benchmark's limit and report: a memory cgroup really ends a process past its limit,
and the report says what each method trained and what osdp used of its budget."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from benchmarks import memory_limit
from benchmarks.capacity import format_report

MIB = 2**20


@pytest.mark.skipif(not memory_limit.available(), reason="no writable memory cgroup (v1) on this machine")
def test_a_memory_cgroup_ends_a_process_past_its_limit_and_measures_one_within_it() -> None:
    script = textwrap.dedent("""
        import sys
        from benchmarks.memory_limit import cgroup_anonymous_bytes, enter_memory_cgroup
        enter_memory_cgroup(int(sys.argv[1]))
        block = bytearray(int(sys.argv[2]))  # zero-filled: every page touched
        print(cgroup_anonymous_bytes())
    """)
    within = subprocess.run([sys.executable, "-c", script, str(256 * MIB), str(64 * MIB)], capture_output=True,
                            text=True, timeout=60)
    assert within.returncode == 0, within.stderr
    assert 64 * MIB <= int(within.stdout) < 128 * MIB
    past = subprocess.run([sys.executable, "-c", script, str(64 * MIB), str(256 * MIB)], capture_output=True,
                          text=True, timeout=60)
    assert past.returncode == -9  # the kernel's OOM killer, as a container's limit ends a job
    memory_limit.remove_finished()  # the killed process never left its cgroup: removed here
    left = memory_limit.own_memory_cgroup().glob("osdp_bench_*")
    assert all((child / "cgroup.procs").read_text().strip() for child in left)  # only those still in use


def test_the_report_says_what_trained_what_was_refused_and_what_osdp_used() -> None:
    ok = {"status": "ok", "param_count": 28_700_000, "process": {"VmHWM": 900 * MIB, "VmData": 800 * MIB}}
    report = {
        "limit_bytes": 480 * MIB, "commit": "abc", "load_average": "1.0",
        "args": {"osdp_budget_fraction": 1.0, "enforce": "cgroup"},
        "fixed_cost_bytes": {"fsdp2-ckpt": {"VmHWM": 430 * MIB, "VmData": 450 * MIB, "limit": 27 * MIB},
                             "osdp": {"VmHWM": 431 * MIB, "VmData": 449 * MIB, "limit": 29 * MIB}},
        "results": {"fsdp2-ckpt": {4: {**ok, "summary": {"tokens_per_s": 370.0}}, 7: {"status": "failed"}},
                    "osdp": {4: {**ok, "summary": {"tokens_per_s": 433.0, "process_above_fixed_bytes": 478 * MIB,
                                                                 "own_above_fixed_bytes": 466 * MIB}},
                             7: {"status": "infeasible"}}}}
    text = format_report(report, [4, 7])
    assert "| 4 | 28.7M | 370 tok/s (HWM 0.98x) | 433 tok/s (above its fixed cost 0.996x, own memory 0.971x) |" in text
    assert "| 7 | ? | fails | infeasible |" in text
    assert "largest trained: fsdp2-ckpt 4 layers, osdp 4 layers" in text
    assert "held by cgroup" in text and "fsdp2-ckpt 27.00 MiB, osdp 29.00 MiB" in text
