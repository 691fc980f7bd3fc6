"""Start a multi-process test script safely from pytest: output to a file, bounded time, no orphans.

Output goes to a log file rather than a pipe (a rank that outlives the launcher would keep a pipe
open and block the reader), and the script runs in its own session so that on timeout every
process it started is killed with it. :func:`run_ranks` runs every rank at once, as torchrun does,
in ranks started once for the whole test session (:mod:`rank_pool`).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rank_pool import RankPool

from benchmarks import launch

SCRIPTS = Path(__file__).parent


@dataclass
class Finished:
    returncode: int
    elapsed_s: float
    log: str
    leftovers: list[int]
    """Processes of the script's session still running (not zombies) ``grace_s`` after the launcher exited."""


def run_logged(args: list[str], log_path: Path, timeout_s: float, cwd: Path | None = None,
               env: dict[str, str] | None = None, grace_s: float = 15.0) -> Finished:
    """Run ``python <args>`` (a script under tests/scripts or ``-m ...``); kill its session on timeout.

    Processes of the session still alive ``grace_s`` after the launcher exited are reported in
    ``leftovers`` (then killed).
    """
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, *args], cwd=cwd or SCRIPTS, env=full_env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            returncode = -9
            log.write(f"\n[ckpt_launch] killed after {timeout_s} s\n")
    elapsed = time.monotonic() - start
    deadline = time.monotonic() + grace_s  # ranks still tearing down on their own may finish
    while (leftovers := session_members(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in leftovers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return Finished(returncode, elapsed, log_path.read_text(), leftovers)


def run_ranks(args: list[str], log_path: Path, timeout_s: float, cwd: Path | None = None,
              env: dict[str, str] | None = None, ranks: int = 2, isolated: bool = False) -> Finished:
    """Run ``python <args>`` on ``ranks`` ranks started together.

    Two ranks run in the session's :class:`rank_pool.RankPool` (started once, reused by every
    scenario); ``isolated=True`` (a script that measures its process's memory, or whose env must be
    there at interpreter start) or another rank count starts fresh processes
    (:func:`benchmarks.launch.run_ranks`), and so does every launch under ``OSDP_TEST_POOL=0``.
    """
    if ranks == 2 and not isolated and _pool_enabled():
        return _in_pool(args, log_path, timeout_s, cwd, env, alone=False)
    start = time.monotonic()
    code = launch.run_ranks([sys.executable, *args], log_path, timeout_s, env={**os.environ, **(env or {})},
                            ranks=ranks, cwd=cwd or SCRIPTS)
    return Finished(-9 if code == "timeout" else int(code), time.monotonic() - start, log_path.read_text(), [])


def run_alone(args: list[str], log_path: Path, timeout_s: float, cwd: Path | None = None,
              env: dict[str, str] | None = None) -> Finished:
    """Run ``python <args>`` as one process (no process group from the launch): in rank 0 of the
    session's pool, or a fresh process (:func:`run_logged`) under ``OSDP_TEST_POOL=0``."""
    if not _pool_enabled():
        return run_logged(args, log_path, timeout_s, cwd=cwd, env=env)
    return _in_pool(args, log_path, timeout_s, cwd, env, alone=True)


def _pool_enabled() -> bool:
    return os.environ.get("OSDP_TEST_POOL", "1") != "0"


def _in_pool(args: list[str], log_path: Path, timeout_s: float, cwd: Path | None, env: dict[str, str] | None,
             alone: bool) -> Finished:
    start = time.monotonic()
    code = pool().run(list(args), log_path, timeout_s, cwd=cwd or SCRIPTS, env={**os.environ, **(env or {})},
                      alone=alone)
    return Finished(-9 if code == "timeout" else int(code), time.monotonic() - start, log_path.read_text(), [])


def run_ranks_in_pool(cmd: list[str], log_path: Path, timeout_s: float, env: Mapping[str, str] | None = None,
                      ranks: int = 2, cwd: Path | None = None, grace_s: float = 30.0) -> int | str:
    """:func:`benchmarks.launch.run_ranks` (same arguments and result), its 2 ranks in the pool: what a
    test patches into a benchmark so that its runs skip starting interpreters."""
    assert cmd[0] == sys.executable and ranks == 2, (cmd[:3], ranks)
    return pool().run(cmd[1:], log_path, timeout_s, cwd=cwd or Path.cwd(), env=dict(env or os.environ),
                      grace_s=grace_s)


_POOL: RankPool | None = None


def pool() -> RankPool:
    """This process's pool of 2 ranks, started on first use and killed at exit."""
    global _POOL
    if _POOL is None:
        _POOL = RankPool(Path(tempfile.mkdtemp(prefix="osdp-rank-pool-")))
        atexit.register(_POOL.close)
    return _POOL


def session_members(session_id: int) -> list[int]:
    """Live (non-zombie) processes whose session is ``session_id``."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, session = fields[0], int(fields[3])  # after "(comm)": state ppid pgrp session
        if session == session_id and state not in ("Z", "X"):
            members.append(int(stat.parent.name))
    return members


def script(name: str) -> str:
    return str(SCRIPTS / name)


def run_gloo_checks(name: str, tmp_path: Path, timeout_s: float = 240) -> dict[str, Any]:
    """A ``gloo_checks`` script (``tests/scripts/NAME``) on 2 ranks: rank 0's JSON result; fails with
    the log's tail if the script did."""
    out = tmp_path / f"{Path(name).stem}.json"
    done = run_ranks([script(name), "--out", str(out)], tmp_path / "log", timeout_s, cwd=tmp_path)
    assert done.returncode == 0, done.log[-9000:]
    return json.loads(out.read_text())
