"""Step-term calibration on 2 real gloo ranks: measured, then read back from the cache.

Run as a script (it spawns its own 2 ranks):  python calibrate_check.py --out result.json
The cache directory comes from ``OSDP_LIGHTNING_CACHE_DIR`` (the test points it at a temporary
directory). Every rank writes its terms of both calls to ``<out>.rank<r>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

WORLD = 2


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        from osdp_lightning.apply import build_meshes
        from osdp_lightning.calibrate import calibrate_step_terms

        device = torch.device("cpu")
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        meshes = build_meshes("cpu", WORLD)
        first = calibrate_step_terms(device, optimizer, meshes, ranks_per_node=WORLD, loop_step_s=1e-3)
        second = calibrate_step_terms(device, optimizer, meshes, ranks_per_node=WORLD, loop_step_s=1e-3)
        Path(f"{out}.rank{rank}.json").write_text(json.dumps({"first": first.to_dict(), "second": second.to_dict()}))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    mp.spawn(run, args=(free_port(), args.out), nprocs=WORLD)


if __name__ == "__main__":
    main()
