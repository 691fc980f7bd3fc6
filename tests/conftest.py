"""Shared test helpers: running 2-rank training scripts in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "scripts"


def run_script(script: str, *args: str, cwd: Path, timeout_s: float = 240,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``tests/scripts/<script>`` with Python; Lightning's launcher starts the other ranks."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run([sys.executable, str(SCRIPTS / script), *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout_s)
    return proc


@pytest.fixture
def train(tmp_path: Path):
    """``train(name, *args)`` runs train_compare.py and returns the per-rank results."""

    def _train(name: str, *args: str) -> list[dict]:
        out = tmp_path / f"{name}.json"
        proc = run_script("train_compare.py", *args, "--out", str(out), cwd=tmp_path)
        assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        return json.loads(out.read_text())

    return _train


@pytest.fixture(autouse=True, scope="session")
def _calibration_cache_in_a_temporary_directory(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Step-term calibrations of this session (every 2-rank run inherits the variable) are cached in
    a temporary directory: a test neither reads nor leaves the machine's ``~/.cache/osdp_lightning``."""
    os.environ["OSDP_LIGHTNING_CACHE_DIR"] = str(tmp_path_factory.mktemp("osdp_calibration"))
