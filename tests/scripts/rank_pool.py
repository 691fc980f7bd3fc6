"""Launch once, run many: long-lived rank processes that run 2-rank test scripts one after another.

A 2-rank test used to start two fresh interpreters, and most of its 10-20 s went to importing torch,
Lightning and osdp_lightning in each. :class:`RankPool` starts the ranks once; each scenario (a
script and its arguments, as a fresh launch would run it) then runs in them as ``__main__``, with its
own ``MASTER_PORT`` and process group, cwd, environment, ``sys.argv`` and output file, and with the
process-wide state a fresh interpreter would have (RNG states, thread count, deterministic mode,
``torch.distributed``'s attributes, warning filters) restored before and after it.

A scenario that times out or kills a rank may leave the group broken (the other rank waiting in a
collective): the pool kills its ranks and starts new ones, so that it never reaches the next
scenario. One that fails on every rank (each raised or exited) keeps the ranks, put back to the fresh
state as after any scenario. Scripts that measure their process's memory high-water mark, or that
test how processes are started and stopped, keep launches of their own (``isolated=True`` in
``ckpt_launch.run_ranks``).

Each rank is ``rank_worker.py``: it reads one JSON command per line on stdin and answers each by
writing a JSON file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).parent
ROOT = SCRIPTS.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.launch import DIST_ENV, free_port, rank_env  # noqa: E402


class RankPool:
    """``ranks`` worker processes; :meth:`run` runs one scenario on all of them at once."""

    def __init__(self, log_dir: Path, ranks: int = 2) -> None:
        self.log_dir, self.ranks = log_dir, ranks
        self._procs: list[subprocess.Popen] = []
        self._launches = 0

    def run(self, argv: list[str], log_path: Path, timeout_s: float, cwd: Path, env: dict[str, str],
            grace_s: float = 30.0, alone: bool = False) -> int | str:
        """Run ``python <argv>`` on every rank; return 0, the first failing rank's code, or ``"timeout"``.

        ``log_path`` gets every rank's output, rank 0's first (as :func:`benchmarks.launch.run_ranks`).
        ``alone``: rank 0 runs it as a single process would (no process-group variables); the
        other ranks wait.
        """
        if not self._alive():
            self._start()
        port, used = free_port(), 1 if alone else self.ranks
        logs = [log_path.with_name(f"{log_path.name}.rank{r}") for r in range(used)]
        replies = [log_path.with_name(f"{log_path.name}.reply{r}") for r in range(used)]
        for rank, proc in enumerate(self._procs[:used]):
            replies[rank].unlink(missing_ok=True)
            scenario_env = ({k: v for k, v in env.items() if k not in DIST_ENV} if alone
                            else rank_env(env, rank, self.ranks, port))
            command = {"argv": argv, "cwd": str(cwd), "env": scenario_env,
                       "log": str(logs[rank]), "reply": str(replies[rank])}
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(command) + "\n")
            proc.stdin.flush()
        codes = self._wait(replies, timeout_s, grace_s)
        log_path.write_text("".join(f"[rank {r}]\n{_read(path)}" for r, path in enumerate(logs)))
        for path in (*logs, *replies):
            path.unlink(missing_ok=True)
        if any(code is None for code in codes):
            # NOTE: a rank that did not answer may be left in a collective or dead: fresh ranks for the
            # next scenario. Ranks that all answered, failed or not, ended their scenario and are put
            # back to the fresh state like after any other.
            self.close()
            self._start()
        failed = next((code for code in codes if code), None)  # a rank left waiting for it is no timeout
        if failed is None and any(code is None for code in codes):
            return "timeout"
        return failed or 0

    def close(self) -> None:
        """Kill every rank (and what it started)."""
        for proc in self._procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if proc.stdin is not None:
                proc.stdin.close()
        self._procs = []

    def _alive(self) -> bool:
        return len(self._procs) == self.ranks and all(p.poll() is None for p in self._procs)

    def _start(self) -> None:
        self.close()
        self._launches += 1
        base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        for rank in range(self.ranks):
            log = self.log_dir / f"pool{self._launches}.rank{rank}.log"
            with log.open("w") as handle:
                self._procs.append(subprocess.Popen(
                    [sys.executable, str(SCRIPTS / "rank_worker.py")], stdin=subprocess.PIPE, stdout=handle, stderr=subprocess.STDOUT,
                    env={**base, "PYTHONUNBUFFERED": "1"}, cwd=SCRIPTS, text=True, start_new_session=True))

    def _wait(self, replies: list[Path], timeout_s: float, grace_s: float) -> list[int | None]:
        """Each rank's exit code; ``None`` for a rank that did not answer in time (or died)."""
        codes: list[int | None] = [None] * len(replies)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(code is None for code in codes):
            for rank, path in enumerate(replies):
                if codes[rank] is None and path.exists():
                    codes[rank] = json.loads(path.read_text())["code"]
                    if codes[rank]:  # the others may wait in a collective for this one
                        deadline = min(deadline, time.monotonic() + grace_s)
                elif codes[rank] is None and self._procs[rank].poll() is not None:
                    codes[rank] = self._procs[rank].returncode or 1
                    deadline = min(deadline, time.monotonic() + grace_s)
            time.sleep(0.05)
        return codes


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else "(no output)\n"
