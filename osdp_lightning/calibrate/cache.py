"""The per-machine cache of calibrated step terms (``~/.cache/osdp_lightning/``): the last
:data:`CACHE_DRAWS` calibrations of one machine, process group and optimizer, whose per-term median
a launch uses (:func:`median_terms`)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from osdp_lightning.cost.step_terms import Affine, StepTerms

CACHE_ENV = "OSDP_LIGHTNING_CACHE_DIR"
"""Directory of the per-machine calibration cache (default ``~/.cache/osdp_lightning``; tests
point it at a temporary directory)."""
CACHE_FORMAT = 5
"""5: gloo's reduce-scatter timed as FSDP2 runs it under osdp, an all-reduce in place
(``osdp_lightning/runtime/collectives.py``; 4: gloo's own reduce-scatter); 4 and after: FSDP2's terms from
stacks of blocks with their compute between the collectives (3: bare Linear
stacks, which over-priced zero3; 2: one calibration, not the last :data:`CACHE_DRAWS`; 1: collectives
at two sizes); an older format is stale."""
CACHE_DRAWS = 5
"""Calibrations the cache keeps; a launch uses their per-term median. On this project's 2-core VM
one calibration prices a whole plan of zero2 or zero3 against one of replicate with a standard
deviation of 11-15% (12 launches; GPT 4 x 384 and 5 x 320), the median of three 7-9%, the median of
five 5-7%: within a run that tilt moves every sharded plan against the replicated ones together,
and it is what misorders plans most (docs/design.md section 7). So the first launches on a machine
each measure and add theirs until there are this many."""
DRAWS_ENV = "OSDP_LIGHTNING_CALIBRATION_DRAWS"
"""Overrides :data:`CACHE_DRAWS` (a positive integer): 1 trusts the first quiet calibration of a
machine (the test suite does: its launches price plans, they do not judge the terms)."""
CACHE_MAX_AGE_S = 7 * 24 * 3600.0
"""A cache older than this is stale (machines change: drivers, load, other tenants)."""


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "osdp_lightning")


def calibration_key(device: torch.device, world_size: int, ranks_per_node: int,
                    optimizer: torch.optim.Optimizer | None, split: bool) -> dict[str, Any]:
    """What the cached terms were measured for; any difference makes a cache foreign."""
    flags = {k: optimizer.defaults.get(k) for k in ("foreach", "fused", "amsgrad", "capturable")} if optimizer else {}
    return {"format": CACHE_FORMAT, "host": platform.node(), "torch": torch.__version__,
            "backend": dist.get_backend() if dist.is_initialized() else None, "device": device.type,
            "world_size": world_size, "ranks_per_node": ranks_per_node, "split": split,
            # NOTE: on CPU the intra-op threads set compute and gloo's copies alike (8 MiB all-gather:
            # 0.5 GB/s with two threads on rank 1, 0.16 GB/s with one on each rank, 2 cores)
            "threads": torch.get_num_threads(),
            "optimizer": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}" if optimizer else None,
            "optimizer_flags": {k: repr(v) for k, v in flags.items()}}


def cache_draws(default: int = CACHE_DRAWS) -> int:
    """Calibrations a launch takes the median of: ``default`` unless :data:`DRAWS_ENV` says otherwise."""
    value = os.environ.get(DRAWS_ENV, "").strip()
    if not value:
        return default
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{DRAWS_ENV}={value!r}: expected a positive number of calibrations (default {default})")
    return int(value)


def cache_file(key: dict[str, Any]) -> Path:
    """One file per key: runs with another optimizer or thread count keep calibrations of their own
    instead of replacing each other's (a suite alternating SGD and Adam never reached three draws)."""
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:8]
    return cache_dir() / f"step_terms_{key['device']}_w{key['world_size']}_r{key['ranks_per_node']}_{digest}.json"


def read_cache(path: Path, key: dict[str, Any], max_age_s: float = CACHE_MAX_AGE_S) -> list[StepTerms] | None:
    """The cached calibrations (oldest first), or ``None`` with one line saying why a cache that
    exists is not trusted."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("key"), dict):
            raise ValueError("no key")
        if data["key"].get("format") != CACHE_FORMAT:
            reason = f"stale (format {data['key'].get('format')}, now {CACHE_FORMAT})"
        elif data["key"] != key:
            differ = sorted(k for k in set(key) | set(data["key"]) if key.get(k) != data["key"].get(k))
            reason = f"foreign (measured for another {', '.join(differ)})"
        elif not time.time() - float(data["written_at"]) <= max_age_s:
            reason = f"stale (older than {max_age_s / 86400:g} days)"
        elif not isinstance(data["draws"], list) or not data["draws"]:
            raise ValueError("no calibrations")
        else:
            return [StepTerms.from_dict(draw, source=f"cache {path}") for draw in data["draws"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        reason = f"corrupt ({type(err).__name__}: {err})"
    rank_zero_info(f"osdp: ignoring the calibration cache {path}: {reason}; measuring again")
    return None


def write_cache(path: Path, key: dict[str, Any], draws: list[StepTerms], keep: int = CACHE_DRAWS) -> None:
    """The last ``keep`` of ``draws`` to ``path``, atomically (a failure to write is said, not raised)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        data = {"key": key, "written_at": time.time(), "draws": [d.to_dict() for d in draws[-keep:]]}
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)  # atomic: a reader never sees half a file
    except OSError as err:
        rank_zero_info(f"osdp: could not write the calibration cache {path} ({err})")


def median_terms(draws: list[StepTerms], source: str) -> StepTerms:
    """The per-term median of several calibrations: each constant and each rate on its own (one
    calibration's outlier moves neither), the raw figures of the latest kept for reports."""
    def table(part: str) -> dict[str, Affine]:
        latest: Mapping[str, Affine] = getattr(draws[-1], part)
        return {k: Affine(statistics.median(getattr(d, part)[k].constant_s for d in draws),
                          statistics.median(getattr(d, part)[k].per_byte_s for d in draws)) for k in latest}
    return replace(draws[-1], collectives=table("collectives"), overhead=table("overhead"),
                   optimizer=table("optimizer"), source=source,
                   extra={**draws[-1].extra, "calibration_draws": float(len(draws))})
