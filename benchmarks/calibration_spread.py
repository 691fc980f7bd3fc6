"""How far one step-term calibration strays, against the median of three (the calibration cache's rule).

    python -m benchmarks.calibration_spread --launches 9 [--out draws.jsonl]

Each launch is a fresh 2-rank gloo process group that calibrates once (``measure_step_terms``, as
the first launch on a machine does); its terms are priced on one transformer block of the default
GPT (4 x 384) and of the third shape (2 x 512) as FSDP2's own work plus the block's collectives.
Printed: the range of single calibrations, of the medians of every three of them
(``calibrate.median_terms``), and how often each strays more than 15% from the median of all.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.launch import free_port
from osdp_lightning.step_terms import ALL_GATHER, REDUCE_SCATTER, StepTerms

BLOCK_BYTES = {"4 x 384 block": 4 * 1_774_464, "2 x 512 block": 4 * 3_152_384}
"""fp32 parameter bytes of one GPT block (attention and MLP Linears, two LayerNorms)."""
FAR = 0.15


def _calibrate(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from osdp_lightning.apply import build_meshes
        from osdp_lightning.calibrate import measure_step_terms

        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        terms = measure_step_terms(torch.device("cpu"), optimizer, build_meshes("cpu", 2))
        if rank == 0:
            with open(out, "a") as f:
                f.write(json.dumps(terms.to_dict()) + "\n")
    finally:
        dist.destroy_process_group()


def block_s(terms: StepTerms, kind: str, nbytes: int) -> float:
    """One block's FSDP2 work and collectives per step on 2 ranks (zero3 gathers twice)."""
    gathers = 2 if kind == "zero3" else 1
    return (terms.overhead_s(kind, 1, nbytes) + gathers * terms.collective_s(ALL_GATHER, nbytes, 2)
            + terms.collective_s(REDUCE_SCATTER, nbytes, 2))


def report(draws: list[StepTerms]) -> list[str]:
    from osdp_lightning.calibrate import median_terms

    triples = [median_terms(list(c), source="triple") for c in itertools.combinations(draws, 3)]
    lines = [f"{len(draws)} calibrations, {len(triples)} medians of 3",
             "| one block, per step | single calibrations | medians of 3 | more than 15% off the median of all: "
             "single / median of 3 |", "|---|---|---|---|"]
    for name, nbytes in BLOCK_BYTES.items():
        for kind in ("zero3", "zero2"):
            single = [block_s(t, kind, nbytes) for t in draws]
            median = [block_s(t, kind, nbytes) for t in triples]
            center = statistics.median(single)

            def far(xs: list[float], center: float = center) -> str:
                return f"{sum(abs(x / center - 1) > FAR for x in xs) / len(xs):.0%}"

            def span(xs: list[float]) -> str:
                return f"{1e3 * min(xs):.1f}-{1e3 * max(xs):.1f} ms ({max(xs) / min(xs):.2f}x)"

            lines.append(f"| {name}, {kind} | {span(single)} | {span(median) if median else '-'} | "
                         f"{far(single)} / {far(median) if median else '-'} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=9)
    parser.add_argument("--out", type=Path, default=Path("calibration_draws.jsonl"),
                        help="one line of terms per launch (appended; an existing file's draws count too)")
    args = parser.parse_args()
    for _ in range(args.launches):
        mp.spawn(_calibrate, args=(free_port(), str(args.out)), nprocs=2)
    draws = [StepTerms.from_dict(json.loads(line)) for line in args.out.read_text().splitlines() if line.strip()]
    print("\n".join(report(draws)))


if __name__ == "__main__":
    main()
