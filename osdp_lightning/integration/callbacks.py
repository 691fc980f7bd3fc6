"""A training summary: throughput, measured peak memory per rank, final loss.

Peak bytes come from PyTorch's own trackers on CPU (``FSDPMemTracker`` for models all of whose
parameters FSDP2 manages, ``MemTracker`` otherwise) over one whole training step (forward,
backward, optimizer), and from the CUDA allocator on GPUs. Throughput is the median step time
after warm-up; the tracked step is left out of it because the tracker slows every operation down.

Beside the step's tensors, the high-water mark of the whole process is kept twice: when setup
ends (calibration, profiling, sharding, materializing) and when training ends: on CUDA the
allocator's most reserved bytes, on CPU the resident set's high-water mark (``VmHWM``: it also
counts the interpreter, torch, Lightning and gloo; run with ``MALLOC_MMAP_THRESHOLD_=65536`` so
that freed large tensors leave the set). Under the osdp strategy on CPU the summary also gives the
largest rank's high-water above the fixed cost osdp measured at setup
(``process_above_fixed_bytes``), and that figure less the code pages loaded after setup that were
resident at the high-water's peak (``own_above_fixed_bytes``: the process's own memory, what a
memory limit ends a process for; file pages it reclaims first): what its budget bounds
(:mod:`osdp_lightning.runtime.process_memory`).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from osdp_lightning.cost.budget import format_bytes
from osdp_lightning.profiling.profile import module_snapshots
from osdp_lightning.report.report import log_measured
from osdp_lightning.runtime.process_memory import CodePagesAtPeak, high_water_bytes

WARMUP_STEPS = 2


STEADY_STEP = 2
"""The step whose memory is tracked by default: the optimizer's state exists, nothing runs once."""
REBUILD_STEP = 1
"""The step whose forward DDP's reducer rebuilds its buckets in (once per training)."""


class TrainingSummary(Callback):
    """Collects ``summary``: tokens/s, samples/s, peak bytes per rank, budget, final loss.

    Args:
        tokens_per_sample: Tokens in one sample; by default the second dimension of the first
            tensor in the batch (``(B, T)`` token ids), else 1.
        track_memory_step: Index of the step whose memory is tracked, after the optimizer has
            created its state; ``None``: the third (2), or the second (1) where the osdp plan counts
            DDP's bucket rebuild (``Plan.rebuild_bytes``), which happens in that step's forward.
        module_memory: Also keep, in ``summary["module_memory"]``, the bytes per tracked module at
            the start and peak of its forward and backward (CPU trackers only) of the rank whose
            step peaked highest (``summary["module_memory_rank"]``): where in the step memory
            peaks, to set beside the cost model's moments (``python -m benchmarks.memory_moments``).
    """

    def __init__(self, tokens_per_sample: int | None = None, track_memory_step: int | None = None,
                 module_memory: bool = False) -> None:
        self.tokens_per_sample = tokens_per_sample
        self.track_memory_step = track_memory_step
        self.module_memory = module_memory
        self._module_memory: dict[str, dict[str, int]] = {}
        self.summary: dict[str, Any] = {}
        self._step_starts: list[float] = []
        self._tracked_index: int | None = None
        self._tracker: contextlib.AbstractContextManager | None = None
        self._peak_bytes = 0
        self._samples_per_step = 0
        self._tokens_per_sample = 1
        self._last_loss: float | None = None
        self._setup_peak_bytes = 0
        self._process_peak_bytes = 0
        self._code_pages: CodePagesAtPeak | None = None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.track_memory_step is None:
            rebuilt = getattr(getattr(trainer.strategy, "_plan", None), "rebuild_bytes", 0)
            self.track_memory_step = REBUILD_STEP if rebuilt else STEADY_STEP
        self._setup_peak_bytes = process_peak_bytes(trainer.strategy.root_device)
        if (file_then := getattr(trainer.strategy, "fixed_file_bytes", 0)) and trainer.strategy.root_device.type == "cpu":
            self._code_pages = CodePagesAtPeak(file_then)
            self._code_pages.sample()

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._step_starts.append(time.perf_counter())
        if self._code_pages is not None:
            self._code_pages.sample()
        if not self._samples_per_step:
            first = _first_tensor(batch)
            self._samples_per_step = (int(first.shape[0]) if first is not None and first.dim() else 1)
            self._tokens_per_sample = self.tokens_per_sample or (
                int(first.shape[1]) if first is not None and first.dim() >= 2 else 1)
        if trainer.global_step == self.track_memory_step and self._tracker is None:
            self._tracked_index = len(self._step_starts) - 1
            # NOTE: the CUDA tracker resets the allocator's peak: keep what came before it.
            self._process_peak_bytes = process_peak_bytes(trainer.strategy.root_device)
            self._tracker = _start_tracking(trainer)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._code_pages is not None:
            self._code_pages.sample()
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self._last_loss = float(loss.detach())
        if self._tracker is not None and self._tracked_index == len(self._step_starts) - 1:
            self._peak_bytes = _stop_tracking(self._tracker, trainer)
            if self.module_memory:
                self._module_memory = module_snapshots(self._tracker)
            self._tracker = None
            # NOTE: NaN replaces the next start, so neither the tracked step nor the gap after it is timed.
            self._step_starts.append(float("nan"))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._step_starts.append(time.perf_counter())
        strategy = trainer.strategy
        steps = [b - a for a, b in zip(self._step_starts, self._step_starts[1:], strict=False)
                 if a == a and b == b]  # NaN marks the gap around the tracked step
        timed = steps[WARMUP_STEPS:] or steps
        step_s = statistics.median(timed) if timed else float("nan")
        world = trainer.world_size
        peak = strategy.reduce(torch.tensor(float(self._peak_bytes), device=strategy.root_device), reduce_op="max")
        process = max(self._setup_peak_bytes, self._process_peak_bytes, process_peak_bytes(strategy.root_device))
        fixed = getattr(strategy, "fixed_cost_bytes", 0)
        # NOTE: each rank above its own fixed cost, the largest: what a per-rank budget bounds on CPU
        above = process - fixed if fixed and strategy.root_device.type == "cpu" else 0
        if self._code_pages is not None:
            self._code_pages.sample()
        own = above - self._code_pages.loaded_before_peak_bytes if above and self._code_pages is not None else 0
        setup_peak, process_peak, above_fixed, own_above_fixed = (
            int(strategy.reduce(torch.tensor(float(b), device=strategy.root_device), reduce_op="max").item())
            for b in (self._setup_peak_bytes, process, above, own))
        loss = strategy.reduce(torch.tensor(self._last_loss if self._last_loss is not None else float("nan"),
                                            device=strategy.root_device), reduce_op="mean")
        plan = getattr(strategy, "_plan", None)
        budget = getattr(plan, "memory_budget_bytes", None)
        samples_per_s = self._samples_per_step * world / step_s if step_s == step_s and step_s > 0 else 0.0
        self.summary = {
            "steps": trainer.global_step, "step_s": step_s,
            "samples_per_s": samples_per_s, "tokens_per_s": samples_per_s * self._tokens_per_sample,
            "peak_bytes": int(peak.item()), "memory_budget_bytes": budget,
            "setup_peak_bytes": setup_peak, "process_peak_bytes": process_peak,
            "process_above_fixed_bytes": above_fixed, "own_above_fixed_bytes": own_above_fixed,
            "predicted_peak_bytes": getattr(plan, "predicted_peak_bytes", None),
            "predicted_step_s": getattr(plan, "predicted_step_s", None),
            "final_loss": float(loss.item()), "world_size": world, "micro_batch_size": self._samples_per_step,
            "process_peak_kind": "cuda" if strategy.root_device.type == "cuda" else "resident",
        }
        if self.module_memory:
            self.summary["module_memory_rank"], self.summary["module_memory"] = self._peak_rank_modules(trainer)
        log_measured(trainer, self.summary)  # predicted against measured, to every logger

    def _peak_rank_modules(self, trainer: pl.Trainer) -> tuple[int, dict[str, dict[str, int]]]:
        """The module memory of the rank whose tracked step peaked highest (ranks differ: which
        buffers outlive a unit's backward varies from launch to launch), and that rank."""
        mine = (self._peak_bytes, trainer.global_rank, self._module_memory)
        if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            every: list[Any] = [None] * trainer.world_size
            torch.distributed.all_gather_object(every, mine)
            mine = max(every, key=lambda entry: (entry[0], -entry[1]))
        return mine[1], mine[2]

    def format(self) -> str:
        s = self.summary
        if not s:
            return "no training summary (training did not run)"
        lines = [
            f"steps: {s['steps']}   median step: {s['step_s']:.4f} s   world size: {s['world_size']}",
            f"throughput: {s['tokens_per_s']:.1f} tokens/s ({s['samples_per_s']:.2f} samples/s)",
            f"measured peak per rank: {format_bytes(s['peak_bytes'])}",
            f"final loss: {s['final_loss']:.4f}",
        ]
        if s.get("process_peak_bytes"):
            what = "CUDA reserved" if s.get("process_peak_kind") == "cuda" else "process resident set, interpreter included"
            lines.insert(3, f"high-water mark per rank ({what}): after setup {format_bytes(s['setup_peak_bytes'])}, "
                            f"after training {format_bytes(s['process_peak_bytes'])}"
                            + (f"; above the fixed cost measured at setup {format_bytes(s['process_above_fixed_bytes'])}"
                               if s.get("process_above_fixed_bytes") else "")
                            + (f" ({format_bytes(s['own_above_fixed_bytes'])} without the code pages loaded since)"
                               if s.get("own_above_fixed_bytes") else ""))
        if s["memory_budget_bytes"]:
            ratio = s["peak_bytes"] / s["memory_budget_bytes"]
            lines[2] += f" of budget {format_bytes(s['memory_budget_bytes'])} ({100 * ratio:.1f}%)"
        if s["predicted_peak_bytes"]:
            error = s["predicted_peak_bytes"] / s["peak_bytes"] - 1 if s["peak_bytes"] else float("nan")
            lines[2] += f"; predicted {format_bytes(s['predicted_peak_bytes'])} (error {100 * error:+.1f}%)"
        if s["predicted_step_s"]:
            error = s["predicted_step_s"] / s["step_s"] - 1 if s["step_s"] == s["step_s"] and s["step_s"] else float("nan")
            lines[0] += f"; predicted {s['predicted_step_s']:.4f} s (error {100 * error:+.1f}%)"
        return "\n".join(lines)


def process_peak_bytes(device: torch.device) -> int:
    """The process's high-water mark so far: the CUDA allocator's most reserved bytes (what a CUDA
    budget bounds: allocated bytes and the fragmentation between them), or the resident set's
    (``VmHWM``; ``ru_maxrss`` where /proc is missing)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device))
    return high_water_bytes()


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else []
    for value in values:
        found = _first_tensor(value)
        if found is not None:
            return found
    return None


def _start_tracking(trainer: pl.Trainer) -> contextlib.AbstractContextManager | None:
    device = trainer.strategy.root_device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return contextlib.nullcontext()
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    model = trainer.strategy.model
    optimizer = trainer.optimizers[0] if trainer.optimizers else None
    # NOTE: ModelParallelStrategy leaves the LightningModule unwrapped; configure_model shards a
    # submodule holding all its parameters (FSDP2 as Lightning documents it): track that one.
    inner = next((m for m in model.modules() if isinstance(m, FSDPModule)), None)
    if inner is not None and sum(1 for _ in inner.parameters()) == sum(1 for _ in model.parameters()):
        model = inner
    if isinstance(model, FSDPModule) and not _has_grouped_modules(model) and not _has_plain_parameters(model):
        tracker = FSDPMemTracker(model, optimizer)
    else:
        tracker = MemTracker()
        tracker.track_external(model, *([optimizer] if optimizer else []))
    tracker.__enter__()
    return tracker


def _has_plain_parameters(model: torch.nn.Module) -> bool:
    """FSDPMemTracker counts only FSDP2's parameters: replicated ones (plain tensors on DDP's
    reducer, which the root ignores) and their gradient buckets went uncounted. GPT 2 x 512, a plan
    of replicated, zero2 and zero3 leaf units: 81.51 MiB under FSDPMemTracker, 87.69 under
    MemTracker, which registers every parameter (87.38 predicted)."""
    from torch.distributed.tensor import DTensor

    return any(not isinstance(p, DTensor) for p in model.parameters())


def _has_grouped_modules(model: torch.nn.Module) -> bool:
    """FSDPMemTracker cannot follow ``fully_shard([a, b])`` groups (tied units); MemTracker can."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    return any(len(getattr(fully_shard.state(m), "_modules", ())) > 1
               for m in model.modules() if isinstance(m, FSDPModule))


def _stop_tracking(tracker: contextlib.AbstractContextManager, trainer: pl.Trainer) -> int:
    device = trainer.strategy.root_device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    tracker.__exit__(None, None, None)
    peaks = tracker.get_tracker_snapshot("peak")
    if os.environ.get("OSDP_MEMORY_BREAKDOWN"):
        print({str(k): v for dev in peaks.values() for k, v in dev.items()}, flush=True)
    return int(max((v.get("Total", 0) for v in peaks.values()), default=0))
