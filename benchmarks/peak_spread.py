"""Peak spread: does one plan peak the same in every launch?

    python -m benchmarks.peak_spread --choices zero3,zero3+ckpt,zero3,zero2,zero2 --launches 12 --load
    ./dev bench peak_spread --shape seq128 --choices zero3,zero3,zero3,zero3,zero3

A planning launch profiles the shape (as :mod:`benchmarks.regret` does), the plan of ``--choices``
(one per unit of that launch's plan, root last) is priced and saved, and then trained ``--launches``
times from the saved plan (``--plan``: no profile, no solve). Each launch's tracked peak (the
largest over the ranks, FSDPMemTracker or MemTracker as the strategy picks) is printed beside the
prediction, then the distinct peaks and their spread. ``--load`` runs a 2-rank job of gloo
collectives without pause beside every launch: a second job on the cores is when collective
timing varies most, and a peak that depends on it shows there first.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

from osdp_lightning.recipes.text import python_docs_corpus

from benchmarks import compare
from benchmarks.launch import free_port
from benchmarks.regret import SHAPES, plan_shape

LOAD_NUMEL = 1 << 20
"""Elements all-gathered and reduced per call by ``--load`` (4 MiB in fp32, a block's order)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peak_spread", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(compare.PRESETS), default="cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="default")
    parser.add_argument("--choices", required=True, help="one choice per unit, root last (comma-separated)")
    parser.add_argument("--launches", type=int, default=12)
    parser.add_argument("--load", action="store_true", help="a 2-rank gloo job beside every launch")
    parser.add_argument("--seed", type=int, default=0, help="training seed")
    parser.add_argument("--run-timeout-s", type=float, default=600.0)
    return parser


def _gloo_load(rank: int, port: int) -> None:
    """Collectives without pause until terminated (one rank of ``--load``)."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    shard, full = torch.ones(LOAD_NUMEL // 2), torch.empty(LOAD_NUMEL)
    while True:
        dist.all_gather_into_tensor(full, shard)
        dist.all_reduce(full)


def start_load() -> list[multiprocessing.Process]:
    context, port = multiprocessing.get_context("spawn"), free_port()
    ranks = [context.Process(target=_gloo_load, args=(rank, port), daemon=True) for rank in range(2)]
    for rank in ranks:
        rank.start()
    return ranks


def spread_lines(peaks: list[int], predicted: int) -> list[str]:
    """The distinct peaks (MiB, how many launches each) and the spread against the least."""
    counts = Counter(peaks)
    least = min(peaks)
    lines = [f"{value / 2**20:.2f} MiB ({100 * (value / predicted - 1):+.1f}% of predicted): {n} of {len(peaks)}"
             for value, n in sorted(counts.items())]
    lines.append(f"spread {100 * (max(peaks) / least - 1):.2f}% of the least; "
                 f"over the prediction: {sum(p > predicted for p in peaks)} of {len(peaks)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.accelerator, args.devices = "cpu", 2  # compare.launch reads them; a CPU benchmark, as the regret one
    settings = dict(compare.PRESETS[args.preset]) | SHAPES[args.shape]
    choices = tuple(c.strip() for c in args.choices.split(",") if c.strip())
    with tempfile.TemporaryDirectory(prefix="osdp-spread-") as tmp:
        work = Path(tmp)
        (work / compare.CORPUS_FILE).write_text(python_docs_corpus(), encoding="utf-8")
        pricing = plan_shape(args.shape, settings, args, work)
        names = [unit.name or "(root)" for unit in pricing.units.units]
        if len(choices) != len(names):
            raise SystemExit(f"--choices has {len(choices)} choices; the {args.shape} shape has "
                             f"{len(names)} units ({', '.join(names)}), root last")
        plan = pricing.candidate("spread", "fixed", choices, pricing.cluster.memory_budget_bytes).plan
        plan_path = work / "plan.json"
        plan.save(plan_path)
        load = start_load() if args.load else []
        peaks = []
        try:
            for index in range(args.launches):
                record = compare.launch("osdp", None, settings, args, work, f"launch{index}", ("--plan", str(plan_path)))
                if record.get("status") != "ok":
                    raise SystemExit(f"launch {index} failed:\n{record.get('message')}")
                summary = record["summary"]
                peaks.append(int(summary["peak_bytes"]))
                print(f"launch {index}: peak {peaks[-1] / 2**20:.2f} MiB (rank {summary.get('module_memory_rank', '?')}), "
                      f"predicted {plan.predicted_peak_bytes / 2**20:.2f}", flush=True)
        finally:
            for rank in load:
                rank.terminate()
    print(f"plan {', '.join(choices)} on {args.shape}, {args.launches} launches{' beside a gloo job' if load else ''}:")
    print("\n".join(spread_lines(peaks, plan.predicted_peak_bytes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
