"""What a 2-rank check script shares: a gloo process group around its checks, rank 0's JSON.

A script defines ``checks(rank) -> dict`` at module level and ends with ``main(checks)``: under a
launcher (the test suite's rank pool, torchrun: ``RANK`` is set) it runs on this rank, otherwise it
spawns its own ranks. ``--out FILE``: rank 0 also writes the result there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.launch import free_port  # noqa: E402

Checks = Callable[[int], dict[str, Any]]


def run_checks(rank: int, checks: Checks, port: int, out: str | None, world: int) -> None:
    """``checks(rank)`` inside a gloo group of ``world`` ranks, one thread each; rank 0 prints the result."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        result = checks(rank)
        if rank == 0:
            print(json.dumps(result, indent=1))
            if out:
                Path(out).write_text(json.dumps(result, indent=1))
    finally:
        dist.destroy_process_group()


def main(checks: Checks, world: int = 2) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if "RANK" in os.environ:
        run_checks(int(os.environ["RANK"]), checks, int(os.environ["MASTER_PORT"]), args.out, world)
    else:
        mp.spawn(run_checks, args=(checks, free_port(), args.out, world), nprocs=world)
