"""One rank of :class:`rank_pool.RankPool`: runs scenarios (scripts as ``__main__``) one after another.

Each command on stdin is a JSON line: ``argv`` (a script path and its arguments, or ``-m module ...``),
``cwd``, ``env`` (the whole environment of this rank for the scenario: ``MASTER_PORT`` and the rank
variables included), ``log`` (where the scenario's output goes, C-level writes included) and
``reply`` (where the exit code is written when it ends). Between scenarios this process is put back to
what a fresh interpreter would be: :class:`FreshState` records it once, after the imports.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import pkgutil
import random
import runpy
import sys
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning  # noqa: F401  (imported once here: the point of the pool)
import torch
import torch.distributed as dist

import osdp_lightning  # noqa: F401  (registers "osdp")
from osdp_lightning.runtime import shutdown

REPOSITORY = Path(__file__).resolve().parents[2]


class FreshState:
    """Process-wide state as it is before any scenario, put back with :meth:`restore`."""

    def __init__(self) -> None:
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.path = list(sys.path)
        self.modules = set(sys.modules)
        self.torch_seed = torch.initial_seed()
        self.python_random = random.getstate()
        self.threads = torch.get_num_threads()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.dtype = torch.get_default_dtype()
        self.dist_attrs = dict(vars(dist))
        self.package_modules = _package_modules()
        self.package_attrs = {name: dict(vars(module)) for name, module in self.package_modules.items()}
        self.warning_filters = list(warnings.filters)

    def restore(self, scenario_dir: str | None = None) -> None:
        os.chdir(self.cwd)
        os.environ.clear()
        os.environ.update(self.environ)
        sys.path[:] = self.path
        sys.argv = [sys.argv[0]]
        self._forget_modules_under(scenario_dir)
        torch.manual_seed(self.torch_seed)
        random.setstate(self.python_random)
        torch.set_num_threads(self.threads)
        torch.use_deterministic_algorithms(self.deterministic)
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(True)
        _put_back(dist, self.dist_attrs)  # scripts that count collectives patch these
        for name, attrs in self.package_attrs.items():  # module settings a check script changes
            _put_back(self.package_modules[name], attrs)
        warnings.filters[:] = self.warning_filters

    def _forget_modules_under(self, directory: str | None) -> None:
        """Modules a scenario imported from its own directory (a test's temporary one, not the
        checkout): another scenario may have modules of the same names there."""
        if directory is None or REPOSITORY.is_relative_to(directory) or Path(directory).is_relative_to(REPOSITORY):
            return
        for name in set(sys.modules) - self.modules:
            file = getattr(sys.modules[name], "__file__", None) or ""
            if file.startswith(directory):
                del sys.modules[name]


def _package_modules() -> dict[str, Any]:
    """Every module of osdp_lightning, imported now, so that all of them are restored alike."""
    for info in pkgutil.walk_packages(osdp_lightning.__path__, "osdp_lightning."):
        importlib.import_module(info.name)
    return {name: module for name, module in sys.modules.items()
            if name == "osdp_lightning" or name.startswith("osdp_lightning.")}


def _put_back(module: Any, attrs: dict[str, Any]) -> None:
    for name, value in attrs.items():
        if vars(module).get(name, attrs) is not value:
            setattr(module, name, value)


def run_scenario(command: dict[str, Any], fresh: FreshState) -> int:
    """Run one scenario with its output in ``command["log"]``; its exit code (a traceback is code 1)."""
    fresh.restore()
    os.environ.clear()
    os.environ.update(command["env"])
    if "OMP_NUM_THREADS" in command["env"]:  # read once at start-up by a fresh interpreter
        torch.set_num_threads(int(command["env"]["OMP_NUM_THREADS"]))
    os.chdir(command["cwd"])
    argv = command["argv"]
    code = 0
    with _output_to(command["log"]):
        try:
            if argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                sys.path.insert(0, os.getcwd())  # as ``python -m`` does
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(argv)
                sys.path.insert(0, str(Path(argv[0]).resolve().parent))
                runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        except BaseException:  # noqa: BLE001  (a scenario's failure is its exit code, as in a fresh process)
            traceback.print_exc()
            code = 1
        finally:
            shutdown.release_now()  # what a fresh process's exit handler does: free the groups and their holders
    fresh.restore(command["cwd"])
    return code


@contextlib.contextmanager
def _output_to(path: str) -> Iterator[None]:
    """Send this process's stdout and stderr (file descriptors 1 and 2 too) to ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(target, 1)
    os.dup2(target, 2)
    os.close(target)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, kept in zip((1, 2), saved, strict=True):
            os.dup2(kept, fd)
            os.close(kept)


def serve() -> None:
    """Answer commands from stdin until it closes (the pool, or pytest, went away)."""
    fresh = FreshState()
    for line in sys.stdin:
        command = json.loads(line)
        code = run_scenario(command, fresh)
        reply = Path(command["reply"])
        tmp = reply.with_name(reply.name + ".tmp")
        tmp.write_text(json.dumps({"code": code}))
        tmp.replace(reply)  # the pool reads a reply only once it is whole


if __name__ == "__main__":
    serve()
