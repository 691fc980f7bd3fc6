"""Step-term calibration on 2 real gloo ranks, the cache keeping 2 calibrations: measured and cached,
measured again and taken with the cached one, read back, then measured with the busy threshold above
any share of a core (so that it is not cached); then within the room of one pair of benches at a
time (its resident high-water's growth recorded, and the link probe's), within the room of stacks of
4, 16 and 32 (not cached), and within 1 KiB (refused); last, the room a budget leaves beside a model
each rank holds at its own size.

Run as a script (it spawns its own 2 ranks unless a launcher started them):
    python calibrate_check.py --out result.json
The cache directory comes from ``OSDP_LIGHTNING_CACHE_DIR`` (the test points it at a temporary
directory). Every rank writes its terms of the five calls to ``<out>.rank<r>.json``, the cache
files there after the first and the fourth, the fifth's room and high-water growth, the sixth's error, and
the room beside its own model with that model's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.launch import free_port  # noqa: E402

WORLD = 2


def run(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        from osdp_lightning import calibrate
        from osdp_lightning.calibrate.bench import bench_specs
        from osdp_lightning.calibrate.room import candidate_layouts
        from osdp_lightning.integration.config import OSDPConfig
        from osdp_lightning.integration.setup_core import OSDPSetup, Ranks
        from osdp_lightning.runtime.meshes import build_meshes
        from osdp_lightning.runtime.process_memory import module_tensor_bytes, process_status_bytes

        device = torch.device("cpu")
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        meshes = build_meshes("cpu", WORLD)

        def cached() -> list[str]:
            dist.barrier()  # rank 0 writes the cache
            return sorted(path.name for path in calibrate.cache_dir().glob("step_terms_*.json"))

        def calibrated(room_bytes: int | None = None) -> dict:
            terms = calibrate.calibrate_step_terms(device, optimizer, meshes, ranks_per_node=WORLD, loop_step_s=1e-3,
                                                   room_bytes=room_bytes)
            return terms.to_dict()

        calibrate.CACHE_DRAWS = 2  # two calls fill the cache (5 by default)
        calibrate.BENCH_ROUNDS_S = 0.3  # the fewest rounds: this checks caching and valid terms, not accuracy
        first = calibrated()
        after_first = cached()
        second, third = calibrated(), calibrated()
        if rank == 0:
            for path in calibrate.cache_dir().glob("step_terms_*.json"):
                path.unlink()
        calibrate.BUSY_CPU_SHARE = 2.0  # every measurement now counts as made on a busy machine
        fourth = calibrated()
        after_fourth = cached()
        layouts = candidate_layouts(bench_specs(optional=True), 8, WORLD)  # AdamW: 8 B of state per parameter
        least = layouts[2].peak_bytes  # one pair of benches at a time
        with open("/proc/self/clear_refs", "w") as refs:  # the high-water mark from the resident set now
            refs.write("5")
        before = process_status_bytes("VmRSS")["VmRSS"]
        fifth = calibrated(least)
        grown = process_status_bytes("VmHWM")["VmHWM"] - before
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        before = process_status_bytes("VmRSS")["VmRSS"]
        calibrate.measure_collectives(device)
        probe_grown = process_status_bytes("VmHWM")["VmHWM"] - before
        narrowest = calibrated(layouts[6].peak_bytes)  # stacks of 4, 16 and 32 beside 1 MiB collectives
        try:
            calibrated(1024)
            refused = ""
        except calibrate.CalibrationRoomError as err:
            refused = str(err)
        # ranks holding models of different sizes lay calibration out for the least room of any
        held = torch.nn.Linear(64 * (rank + 1), 64)  # rank 1's is about twice rank 0's
        setup = OSDPSetup(OSDPConfig(memory_budget=2**26), Ranks(device, WORLD, WORLD, 1, rank))
        room = setup.calibration_room_bytes(held)
        held_bytes = module_tensor_bytes(held)
        result = {"first": first, "second": second, "third": third, "fourth": fourth, "fifth": fifth,
                  "cached_after_first": after_first, "cached_after_fourth": after_fourth, "least_room": least,
                  "fifth_grown": grown, "probe_grown": probe_grown, "sixth_refused": refused, "narrowest": narrowest,
                  "cached_after_narrowest": cached(), "room": room, "held_bytes": held_bytes}
        Path(f"{out}.rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if "RANK" in os.environ:  # started by a launcher (the test suite's rank pool, torchrun)
        run(int(os.environ["RANK"]), int(os.environ["MASTER_PORT"]), args.out)
    else:
        mp.spawn(run, args=(free_port(), args.out), nprocs=WORLD)


if __name__ == "__main__":
    main()
