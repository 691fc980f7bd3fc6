"""Soak test: a long osdp run on 2 CPU ranks with periodic checkpoints; is anything leaking?

    ./dev bench soak --steps 1000 --budget 1MiB --out soak.json

Every rank samples its resident memory (RSS) after every step and reports, per 100-step window,
the window's peak RSS, open file descriptors and threads. After warm-up (the first two windows)
the peak must not grow, and descriptors and threads must stay flat. The run checkpoints every
``--ckpt-every`` steps (sharded, atomic; only the newest kept, plus ``last.ckpt``) and must end
with exit status 0.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import lightning as L
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from benchmarks.toy import MLP  # noqa: E402
from osdp_lightning import OSDPStrategy  # noqa: E402

WINDOW = 100
WARMUP_WINDOWS = 2
GROWTH_TOLERANCE_MIB = 2.0


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def threads() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


class LeakWatch(Callback):
    """Per-window peak RSS, file descriptors and threads of this rank; optionally where Python
    memory grew between the end of warm-up and the end (``tracemalloc``, slow)."""

    def __init__(self, trace: bool = False) -> None:
        self.windows: list[dict[str, Any]] = []
        self.growth: list[str] = []
        self._peak = 0.0
        self._start = time.monotonic()
        self._trace, self._baseline = trace, None
        if trace:
            tracemalloc.start(8)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._peak = max(self._peak, rss_mib())
        if trainer.global_step % WINDOW == 0:
            self.windows.append({"step": trainer.global_step, "peak_rss_mib": round(self._peak, 2),
                                 "fds": open_fds(), "threads": threads(),
                                 "s_per_step": round((time.monotonic() - self._start) / WINDOW, 4)})
            self._peak, self._start = 0.0, time.monotonic()
            if self._trace and len(self.windows) == WARMUP_WINDOWS:
                self._baseline = tracemalloc.take_snapshot()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._baseline is not None:
            diff = tracemalloc.take_snapshot().compare_to(self._baseline, "traceback")
            self.growth = [f"{d.size_diff / 1024:+.1f} KiB in {d.count_diff:+d} blocks:\n    "
                           + "\n    ".join(d.traceback.format()[-6:]) for d in diff[:8]]


def verdict(windows: list[dict[str, Any]]) -> dict[str, Any]:
    settled = windows[WARMUP_WINDOWS - 1:]
    growth = max(w["peak_rss_mib"] for w in settled[1:]) - settled[0]["peak_rss_mib"] if len(settled) > 1 else 0.0
    return {"rss_growth_after_warmup_mib": round(growth, 2),
            "fd_change": windows[-1]["fds"] - settled[0]["fds"],
            "thread_change": windows[-1]["threads"] - settled[0]["threads"],
            "ok": growth <= GROWTH_TOLERANCE_MIB and windows[-1]["fds"] <= settled[0]["fds"]
            and windows[-1]["threads"] <= settled[0]["threads"]}


def format_table(rank: int, windows: list[dict[str, Any]]) -> str:
    lines = [f"rank {rank}:  {'step':>5}  {'peak RSS MiB':>12}  {'fds':>4}  {'threads':>7}  {'s/step':>7}"]
    lines += [f"         {w['step']:>5}  {w['peak_rss_mib']:>12.2f}  {w['fds']:>4}  {w['threads']:>7}  "
              f"{w['s_per_step']:>7.4f}" for w in windows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--budget", default="1MiB", help="per-rank budget; small enough to mix choices")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--ckpt-every", type=int, default=100)
    parser.add_argument("--ckpt-dir", default=None, help="default: a temporary directory")
    parser.add_argument("--out", default="soak.json")
    parser.add_argument("--trace", action="store_true", help="report where Python memory grew (slow)")
    args = parser.parse_args()
    ckpt_dir = args.ckpt_dir or os.environ.setdefault("OSDP_SOAK_CKPT_DIR", tempfile.mkdtemp(prefix="osdp_soak_"))

    L.seed_everything(0)
    watch = LeakWatch(trace=args.trace)
    saver = ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=args.ckpt_every,
                            save_top_k=1, save_last=True)
    trainer = L.Trainer(strategy=OSDPStrategy(memory_budget=args.budget), accelerator="cpu", devices=2,
                        max_steps=args.steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[watch, saver])
    started = time.monotonic()
    trainer.fit(MLP(width=args.width))
    report = {"rank": trainer.global_rank, "windows": watch.windows, "verdict": verdict(watch.windows),
              "wall_s": round(time.monotonic() - started, 1), "python_growth": watch.growth}
    reports: list[Any] = [None] * trainer.world_size
    dist.all_gather_object(reports, report)
    if trainer.global_rank == 0:
        for r in reports:
            print(format_table(r["rank"], r["windows"]))
            print(f"rank {r['rank']}: {r['verdict']}, wall {r['wall_s']} s")
            if r["python_growth"]:
                print("\n".join(r["python_growth"]))
        print(f"checkpoints in {ckpt_dir}: {sorted(p.name for p in Path(ckpt_dir).iterdir())}")
        Path(args.out).write_text(json.dumps({"plan": {u.name: u.choice for u in trainer.strategy.plan.units},
                                              "ranks": reports}, indent=1))
    dist.destroy_process_group()
    if trainer.global_rank == 0:
        print("soak: ended cleanly" if all(r["verdict"]["ok"] for r in reports) else "soak: LEAK SUSPECTED")


if __name__ == "__main__":
    main()
