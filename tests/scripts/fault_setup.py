"""A rank raises during osdp setup; every rank must exit with that error, none may hang.

    python fault_setup.py --fail profile --out DIR   # rank 0's profiling raises
    python fault_setup.py --fail apply --out DIR     # rank 1's apply_plan raises

Each process writes ``DIR/pid-<pid>`` at start and ``DIR/rank<r>.json`` (the error it exited
with, the seconds since it started and its thread count) before exiting with status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

START_S = time.monotonic()

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from ckpt_plans import MIXED, fixed_plan  # noqa: E402
from toy_models import MLP  # noqa: E402

import osdp_lightning.integration.setup_core as setup_core  # noqa: E402
from osdp_lightning import OSDPStrategy  # noqa: E402

INJECTED = "injected failure for the fail-fast test"


def inject(stage: str) -> None:
    if stage == "profile":
        def failing_profile(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            raise RuntimeError(f"{INJECTED} (profiling on rank {dist.get_rank()})")
        # NOTE: the name the strategy calls; a rename must fail here, not leave the fault uninjected
        assert hasattr(setup_core, "profile_model"), "the osdp setup no longer profiles through profile_model"
        setup_core.profile_model = failing_profile
    elif stage == "apply":
        assert hasattr(setup_core, "apply_plan"), "the osdp setup no longer applies plans through apply_plan"
        real_apply = setup_core.apply_plan

        def apply_failing_on_rank_1(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if dist.get_rank() == 1:
                raise RuntimeError(f"{INJECTED} (applying the plan on rank 1)")
            return real_apply(*args, **kwargs)
        setup_core.apply_plan = apply_failing_on_rank_1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail", choices=["profile", "apply"], required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"pid-{os.getpid()}").write_text("")
    inject(args.fail)

    model = MLP(width=64)
    plan = fixed_plan(model, 2, MIXED) if args.fail == "apply" else None
    strategy = OSDPStrategy(plan=plan, memory_budget="1GiB")
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    try:
        trainer.fit(model)
    except Exception as err:  # noqa: BLE001  (recorded, then the process exits with status 1)
        report = {"rank": trainer.global_rank, "type": type(err).__name__, "error": str(err),
                  "elapsed_s": time.monotonic() - START_S, "threads": torch.get_num_threads()}
        (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(1)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({"rank": trainer.global_rank, "error": None}))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
