"""Start a training command on every rank of one node at once, as torchrun does.

Lightning sees ``LOCAL_RANK`` in the environment and starts no process itself
(``creates_processes_externally``), but its launcher still gives each rank its share of the cores.
Started together, the ranks import torch and Lightning side by side (about 10 s each on this
project's 2-core VM). Started by Lightning's own launcher, rank 1 begins only once rank 0 has
reached ``trainer.fit``, so every 2-rank launch paid the import twice in a row (a toy MLP's run: 19.3
s against 10.5 s). The benchmarks and the test suite launch hundreds of runs. The CLI and the
main-job tests keep Lightning's launcher: that is how a user's ``python train.py`` runs.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE",
            "GROUP_RANK", "TORCHELASTIC_RUN_ID")
"""Set by torch.distributed / Lightning for a process group; a fresh launch must pick its own."""


def free_port() -> int:
    """A TCP port nobody listens on now (the OS picks it), for a launch's ``MASTER_PORT``."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_env(base: Mapping[str, str], rank: int, ranks: int, port: int) -> dict[str, str]:
    """``base`` without another launch's process-group variables, plus this rank's (one node)."""
    inherited = {k: v for k, v in base.items() if k not in DIST_ENV}
    return {**inherited, "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "WORLD_SIZE": str(ranks), "RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0"}


def run_ranks(cmd: list[str], log_path: Path, timeout_s: float, env: Mapping[str, str] | None = None,
              ranks: int = 2, cwd: Path | None = None, grace_s: float = 30.0) -> int | str:
    """Run ``cmd`` once per rank; return 0, the first failing rank's exit code, or ``"timeout"``.

    ``log_path`` gets every rank's output, rank 0's first. When a rank fails, the others get
    ``grace_s`` to end on their own (they may wait in a collective for it) and are then killed, so a
    failure costs seconds, not ``timeout_s``. Each rank runs in its own session: a kill takes the
    processes it started with it.
    """
    port, base = free_port(), dict(os.environ if env is None else env)
    logs = [log_path.with_name(f"{log_path.name}.rank{r}") for r in range(ranks)]
    procs = []
    for rank, path in enumerate(logs):
        with path.open("w") as handle:  # the child keeps its own descriptor
            procs.append(subprocess.Popen(cmd, cwd=cwd, env=rank_env(base, rank, ranks, port), stdout=handle,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    start = time.monotonic()
    deadline = start + timeout_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.returncode for p in procs if p.returncode is not None):
            deadline = min(deadline, time.monotonic() + grace_s)
        time.sleep(0.1)
    timed_out = any(p.poll() is None for p in procs) and time.monotonic() >= start + timeout_s
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log_path.write_text("".join(f"[rank {r}]\n{path.read_text()}" for r, path in enumerate(logs)))
    for path in logs:
        path.unlink()
    codes = [p.returncode for p in procs]
    return "timeout" if timed_out else next((c for c in codes if c), 0)
