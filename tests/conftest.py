"""Shared test helpers: running 2-rank training scripts in a subprocess."""

from __future__ import annotations

import copy
import importlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks.launch import DIST_ENV
from osdp_lightning.plan.plan import Plan
from osdp_lightning.solve import SETTLE_GAP

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
from ckpt_launch import run_ranks  # noqa: E402


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a fresh launch: no process-group variables, unbuffered output."""
    inherited = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    return {**inherited, "PYTHONUNBUFFERED": "1", **extra}


def run_script(script: str, *args: str, cwd: Path, timeout_s: float = 240,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``tests/scripts/<script>`` with Python; Lightning's launcher starts the other ranks."""
    full_env = child_env(**(env or {}))
    proc = subprocess.run([sys.executable, str(SCRIPTS / script), *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout_s)
    return proc


def proven_within_settle_gap(plan: Plan) -> bool:
    """The plan's solve proved the optimum, or stopped at a plan proven within the gap a default solve
    settles for once proving takes long (how long depends on the machine's load)."""
    if plan.solver_status == "Optimal":
        return True
    return plan.solver_status == "Feasible" and plan.gap is not None and plan.gap <= SETTLE_GAP


@dataclass(frozen=True)
class CliRun:
    """What an entry point's ``main()`` did in this process, in the terms of a finished process."""
    returncode: int | str | None
    stdout: str
    stderr: str


CliHere = Callable[..., CliRun]


@pytest.fixture
def cli_here(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> CliHere:
    """``cli_here(command, *args, cwd=...)`` runs ``osdp_lightning.cli.<command>.main()`` with those
    arguments in this process and returns its exit code and output; Hydra's logging set-up is undone."""

    def _run(command: str, *args: str, cwd: Path) -> CliRun:
        module = importlib.import_module(f"osdp_lightning.cli.{command}")
        monkeypatch.chdir(cwd)
        monkeypatch.setattr(sys, "argv", [f"osdp-{command}", *args])
        root = logging.getLogger()
        handlers, level = list(root.handlers), root.level
        code: int | str | None = 0
        try:
            module.main()
        except SystemExit as exit_:
            code = exit_.code
        finally:
            root.handlers[:] = handlers
            root.setLevel(level)
        out = capsys.readouterr()
        # a SystemExit with a message prints it to stderr when the interpreter exits: here, as if it did
        return CliRun(code, out.out, out.err + (code if isinstance(code, str) else ""))

    return _run


# Lightning DDP reference runs of this session by argument list: several tests compare their plans
# with the same DDP run (same model, seed and data), which is deterministic, so it runs once.
_DDP_REFERENCES: dict[tuple[str, ...], list[dict]] = {}


def _is_ddp_reference(args: tuple[str, ...]) -> bool:
    return "--strategy" in args and args[args.index("--strategy") + 1] == "ddp"


@pytest.fixture
def train(tmp_path: Path):
    """``train(name, *args)`` runs train_compare.py on 2 ranks and returns the per-rank results.

    The ranks start together, as under torchrun (:func:`ckpt_launch.run_ranks`);
    ``lightning_launcher=True`` starts rank 0 only and lets Lightning's launcher start rank 1, as a
    user's ``python train.py`` does (the CLI and main-job tests always go that way). A Lightning
    DDP run started together runs once per session per argument list (``_DDP_REFERENCES``).
    """

    def _train(name: str, *args: str, lightning_launcher: bool = False) -> list[dict]:
        reference = not lightning_launcher and _is_ddp_reference(args)
        if reference and args in _DDP_REFERENCES:
            return copy.deepcopy(_DDP_REFERENCES[args])
        out = tmp_path / f"{name}.json"
        if lightning_launcher:
            proc = run_script("train_compare.py", *args, "--out", str(out), cwd=tmp_path)
            ok, log = proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        else:
            done = run_ranks([str(SCRIPTS / "train_compare.py"), *args, "--out", str(out)], tmp_path / f"{name}.log",
                             240, cwd=tmp_path)
            ok, log = done.returncode == 0, done.log[-9000:]
        assert ok, f"{name} failed:\n{log}"
        result = json.loads(out.read_text())
        if reference:
            _DDP_REFERENCES[args] = copy.deepcopy(result)
        return result

    return _train


@pytest.fixture(autouse=True, scope="session")
def _calibration_cache_in_a_temporary_directory(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Step-term calibrations of this session (every 2-rank run inherits the variables) are cached in
    a temporary directory: a test neither reads nor leaves the machine's ``~/.cache/osdp_lightning``.
    The first quiet calibration of each key is trusted (three by default): every later launch that
    plans reads it instead of spending 3 s measuring (tests of the cache itself set their own)."""
    os.environ["OSDP_LIGHTNING_CACHE_DIR"] = str(tmp_path_factory.mktemp("osdp_calibration"))
    os.environ["OSDP_LIGHTNING_CALIBRATION_DRAWS"] = "1"


@pytest.fixture(autouse=True)
def _no_process_group_outlives_a_test():
    """A test that trains in this process (``Trainer(devices=1)``) leaves Lightning's process group, its
    TCPStore listening on MASTER_PORT, the MASTER_* variables and the thread count behind; later 2-rank launches would
    inherit that port (EADDRINUSE) and later in-process groups would find one already initialised.
    Lightning's own test suite tears the group down after each test the same way."""
    import torch
    import torch.distributed as dist

    # NOTE: Lightning's launcher also sets OMP_NUM_THREADS (and torch's thread count) in the process
    # it runs in: left behind, every later 2-rank launch inherited 2 threads per rank on 2 cores.
    before = {k: os.environ.get(k) for k in (*DIST_ENV, "OMP_NUM_THREADS")}
    threads = torch.get_num_threads()
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    torch.set_num_threads(threads)
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
