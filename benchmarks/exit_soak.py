"""Exit soak: many consecutive tiny 2-rank osdp runs; does any successful run end in SIGABRT?

    ./dev bench exit_soak --runs 50

Each run is a fresh ``python -m benchmarks.exit_soak --child`` (Lightning's launcher starts rank 1)
that fits a small MLP for 2 steps under a uniform zero3 plan (the case reported in issue 13:
"terminate called without an active exception", exit -6/134 after a successful fit). Every
other run ends without ``destroy_process_group()``, as many user scripts do. Prints each run's exit
status and the failure count; exits 1 if any run failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child(destroy: bool) -> None:
    import lightning as L
    import torch.distributed as dist

    from benchmarks.toy import MLP
    from osdp_lightning import OSDPStrategy

    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(strategy=OSDPStrategy(uniform_choice="zero3", split_factors=(), profile_repeats=1),
                        accelerator="cpu", devices=2, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(MLP(width=32, depth=2, samples=64))
    if destroy and dist.is_initialized():
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-destroy", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(destroy=not args.no_destroy)
        return
    failures = []
    for run in range(args.runs):
        extra = ["--no-destroy"] if run % 2 else []
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "benchmarks.exit_soak", "--child", *extra], cwd=REPO,
                              capture_output=True, text=True, timeout=args.timeout_s)
        how = "without destroy_process_group()" if extra else "with destroy_process_group()"
        print(f"run {run + 1}/{args.runs} ({how}): exit {proc.returncode}, {time.perf_counter() - start:.1f} s",
              flush=True)
        if proc.returncode != 0:
            failures.append(run + 1)
            print(proc.stderr[-2000:], flush=True)
    print(f"failures: {len(failures)} of {args.runs} runs {failures if failures else ''}", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
