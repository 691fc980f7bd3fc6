"""A scenario for the rank pool's own test: report the process state a scenario starts with, and
optionally change it, fail on one rank, or hang.

    python pool_probe.py --out state.json [--mutate | --fail | --hang | --alone]

Every rank writes ``<out>.rank<r>.json``: its pid, the environment variable ``PROBE_VAR``, the thread
count, the first number torch's generator draws, whether a process group is up, whether
``torch.distributed.all_reduce`` is torch's own, and ``osdp_lightning.calibrate.CACHE_DRAWS``.
``--mutate`` then changes each of them (and leaves its process group up); ``--fail`` raises on rank
1 while rank 0 waits for it in a barrier; ``--hang`` sleeps; ``--alone`` (one process, no
process-group variables) reports and ends.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from osdp_lightning import calibrate

TORCH_ALL_REDUCE = dist.distributed_c10d.all_reduce


def state() -> dict:
    return {"pid": os.getpid(), "probe_var": os.environ.get("PROBE_VAR"), "threads": torch.get_num_threads(),
            "first_draw": torch.rand(1).item(), "group_up": dist.is_initialized(), "rank_var": os.environ.get("RANK"),
            "all_reduce_is_torchs": dist.all_reduce is TORCH_ALL_REDUCE, "cache_draws": calibrate.CACHE_DRAWS}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--mutate", action="store_true")
    what.add_argument("--fail", action="store_true")
    what.add_argument("--hang", action="store_true")
    what.add_argument("--alone", action="store_true")
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(state()))
    print(f"probe on rank {rank}")
    if args.hang:
        time.sleep(3600)
    if args.alone:
        return
    dist.init_process_group("gloo")
    if args.fail:
        if rank == 1:
            raise RuntimeError("the probe fails on rank 1")
        dist.barrier()
    if args.mutate:
        os.environ["PROBE_VAR"] = "changed"
        torch.set_num_threads(1 if torch.get_num_threads() > 1 else 2)
        torch.manual_seed(1234)
        dist.all_reduce = lambda *a, **k: None
        calibrate.CACHE_DRAWS = 99
        return  # the process group stays up, as in a script that forgets to destroy it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
