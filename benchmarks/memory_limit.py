"""A hard per-process memory limit the way containers and SLURM enforce one: a cgroup (v1) of its own.

    enter_memory_cgroup(limit_bytes)   # this process from now on; past the limit the kernel's OOM killer ends it
    cgroup_peak_bytes()                # what the cgroup has charged at most (memory.max_usage_in_bytes)
    cgroup_anonymous_bytes()           # its anonymous memory now (memory.stat rss)
    remove_finished()                  # the cgroups of processes that have ended (the killed ones stay)

The cgroup charges what the process allocates after it entered (its anonymous memory, and file
pages it reads first); past the limit the kernel reclaims file pages, and anonymous memory it
cannot give back ends the process. Unlike
``RLIMIT_DATA`` it does not count address space reserved but never touched. Needs a writable
cgroup v1 memory hierarchy (:func:`available`); :mod:`benchmarks.capacity` falls back to
``RLIMIT_DATA`` without one.
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path

_ROOT = Path("/sys/fs/cgroup/memory")
_mine: Path | None = None


def own_memory_cgroup() -> Path | None:
    """This process's memory cgroup directory (v1), or ``None`` where there is none to write to."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            folder = _ROOT / path.lstrip("/")
            return folder if os.access(folder, os.W_OK) else None
    return None


def available() -> bool:
    return own_memory_cgroup() is not None


def enter_memory_cgroup(limit_bytes: int | None) -> Path:
    """Move this process into a new child cgroup limited to ``limit_bytes`` (``None``: no limit, to
    measure its peak); it is removed at exit."""
    global _mine
    parent = own_memory_cgroup()
    if parent is None:
        raise RuntimeError("no writable memory cgroup (v1) here; use RLIMIT_DATA instead")
    child = parent / f"osdp_bench_{os.getpid()}"
    child.mkdir()
    if limit_bytes is not None:
        (child / "memory.limit_in_bytes").write_text(str(int(limit_bytes)))
        if (child / "memory.memsw.limit_in_bytes").exists():  # with swap on, memory and swap together
            (child / "memory.memsw.limit_in_bytes").write_text(str(int(limit_bytes)))
    (child / "cgroup.procs").write_text(str(os.getpid()))
    _mine = child

    def leave() -> None:  # back to the parent, so that the child can be removed
        try:
            (parent / "cgroup.procs").write_text(str(os.getpid()))
            child.rmdir()
        except OSError:
            pass
    atexit.register(leave)
    return child


def remove_finished() -> int:
    """Remove the cgroups :func:`enter_memory_cgroup` made for processes that have ended (a process
    the kernel killed never leaves its own); how many were removed."""
    parent = own_memory_cgroup()
    removed = 0
    for child in parent.glob("osdp_bench_*") if parent is not None else ():
        try:
            if not (child / "cgroup.procs").read_text().strip():
                child.rmdir()
                removed += 1
        except OSError:
            pass  # NOTE: still in use, or removed by its own process meanwhile
    return removed


def cgroup_peak_bytes() -> int | None:
    """The most this process's cgroup has charged since it entered, file pages it read included
    (``None`` outside one)."""
    return int((_mine / "memory.max_usage_in_bytes").read_text()) if _mine is not None else None


def cgroup_anonymous_bytes() -> int | None:
    """The anonymous memory the cgroup holds now (``memory.stat``'s ``rss``): what the kernel cannot
    reclaim past the limit, unlike file pages (``None`` outside one)."""
    if _mine is None:
        return None
    stat = dict(line.split() for line in (_mine / "memory.stat").read_text().splitlines())
    return int(stat["rss"])
