"""osdp-train, plus each rank's resident high-water mark at exit (for :mod:`benchmarks.hf_models`).

    MALLOC_MMAP_THRESHOLD_=65536 python -m benchmarks.hwm_train model=hf_llama_110m meta_init=true \
        cluster.memory_budget=50%ddp hydra.run.dir=DIR

Runs ``osdp_lightning.cli.train`` unchanged (Lightning's launcher re-runs this module for rank 1);
at exit every rank writes ``DIR/hwm.rank<N>.json``: ``VmHWM`` and ``VmData`` of its process.
osdp-train's ``summary.json`` keeps the largest over ranks; this keeps each.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from pathlib import Path

from osdp_lightning.runtime.process_memory import process_status_bytes


def run_dir(argv: list[str]) -> Path | None:
    """The ``hydra.run.dir=...`` override of ``argv`` (Lightning's launcher quotes it for rank 1)."""
    found = [a.split("=", 1)[1].strip("\"'") for a in argv if a.startswith("hydra.run.dir=")]
    return Path(found[-1]) if found else None


def write_high_water(directory: Path) -> None:
    rank = os.environ.get("LOCAL_RANK", "0")
    record = {"rank": int(rank), **process_status_bytes("VmHWM", "VmData")}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"hwm.rank{rank}.json").write_text(json.dumps(record) + "\n")


def main() -> None:
    directory = run_dir(sys.argv[1:])
    if directory is not None:
        atexit.register(write_high_water, directory)
    from osdp_lightning.cli.train import main as train_main

    train_main()


if __name__ == "__main__":
    main()
