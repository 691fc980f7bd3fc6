"""The CUDA path, in one short script for a lent GPU (also runs on CPU as a dry check here).

1. **Memory.** Predicted peak bytes per rank against the measured peak of a real training step
   (the CUDA allocator's ``max_memory_allocated``; on CPU, MemTracker) for plans of a GPT recipe at
   world sizes 2 and 8: all-replicate, all-zero2, all-zero3, all-zero3 with checkpointing, and the
   ILP's plans under a budget between replicate and zero3 and one between zero3 and checkpointed
   zero3. Both profiles are checked: the whole model measured on the device, and the profile from
   shapes (the model on the meta device, one unit at a time on the device). One GPU stands for
   every rank through PyTorch's ``fake`` process group: collectives do nothing, but every FSDP2
   buffer is really allocated.
2. **Training.** ``Trainer(strategy="osdp", accelerator="cuda", devices=1)`` against the same run
   under Lightning's ``strategy="ddp"`` (the same sampler, so the same batches): per-step losses,
   peaks (predicted and measured) and tokens per second; osdp also under a budget halfway between
   all-replicate's and all-checkpointed's predicted peaks (only checkpointing saves memory on one
   device) and with the model built on the meta device (Lightning's ``init_module``).
3. **bf16-mixed.** The plans of a profile made under bf16 autocast (sharded units gathered in bf16,
   reduced in fp32) against FSDP2 written by hand with the same ``MixedPrecisionPolicy``, under the
   fake process group: peaks predicted and measured, bytes all-gathered per step (2 per element),
   step seconds (``benchmarks/gpu_precision.py``).
4. **Compile.** ``OSDPStrategy(compile="units")`` against the same run uncompiled: per-step losses,
   setup seconds with the compile time apart, tokens per second, the plan.

    python -m benchmarks.gpu_check [--device cuda] [--layers 8 --hidden 1024] [--skip memory training bf16 compile]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import time
from collections.abc import Callable

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.strategies.strategy import _ForwardRedirection
from osdp_lightning.recipes.gpt import GPT, GPTConfig, GPTDataModule, GPTLitModule
from torch.distributed._tools.mem_tracker import MemTracker
from torch.testing._internal.distributed.fake_pg import FakeStore

from osdp_lightning import ClusterSpec, OSDPStrategy, TrainingSummary, format_bytes, make_plan
from osdp_lightning.apply.apply import apply_plan, step_groups_apart
from osdp_lightning.choices import BASE_CHOICES
from osdp_lightning.integration.strategy import RootWrapper
from osdp_lightning.plan.pipeline import ProfileOptions, profile_model
from osdp_lightning.plan.plan import InfeasibleBudgetError, Plan
from osdp_lightning.profiling.profile import logging_disabled
from osdp_lightning.profiling.records import ModelProfile
from osdp_lightning.runtime.meshes import build_meshes

UNIFORM = ("replicate", "zero2", "zero3", "zero3+ckpt")


def module_factory(args: argparse.Namespace) -> Callable[[], GPTLitModule]:
    config = GPTConfig(vocab_size=384, block_size=args.seq, n_layer=args.layers, n_head=max(args.hidden // 64, 1),
                       n_embd=args.hidden, dropout=0.0)
    return lambda: GPTLitModule(GPT(config), lr=1e-4)


def real_batch(args: argparse.Namespace, device: torch.device) -> dict:
    """One batch of the GPT recipe's default data."""
    data = GPTDataModule(seq_len=args.seq, batch_size=args.batch)
    data.setup("fit")
    return move_data_to_device(next(iter(data.train_dataloader())), device)


def profiles(args: argparse.Namespace, device: torch.device) -> dict[str, ModelProfile]:
    """The whole model's profile on ``device`` and the profile from shapes (meta module)."""
    factory, batch = module_factory(args), real_batch(args, device)
    options = ProfileOptions()
    torch.manual_seed(0)
    module = factory().to(device)
    found = {"whole": profile_model(module, batch, device, options, whole=True,
                                    optimizer=module.configure_optimizers()["optimizer"])}
    del module
    with torch.device("meta"):
        meta = factory()
    found["from shapes"] = profile_model(meta, batch, device, options, whole=False)
    _release(device)
    return found


def plans_for(profile: ModelProfile, world: int) -> dict[str, Plan]:
    """Uniform plans, and the ILP's under budgets between them (it must pick a mixed plan there)."""
    def cluster(budget_bytes: int) -> ClusterSpec:
        return ClusterSpec(world, budget_bytes, 2e-5, 1e11, headroom_fraction=0.02)

    plans = {c: make_plan(profile, cluster(2**50), uniform_choice=c) for c in UNIFORM}
    for name, (a, b) in {"ilp: replicate..zero3": ("replicate", "zero3"),
                         "ilp: zero3..ckpt": ("zero3", "zero3+ckpt")}.items():
        budget = (plans[a].predicted_peak_bytes + plans[b].predicted_peak_bytes) // 2
        try:
            # NOTE: both ends' choices: below uniform zero3 only a plan that checkpoints some units fits
            plans[name] = make_plan(profile, cluster(budget), choices=(*BASE_CHOICES, b))
        except InfeasibleBudgetError as err:
            print(f"{name}: {err}")
    return plans


def measured_peak_bytes(args: argparse.Namespace, plan: Plan, device: torch.device) -> tuple[int, int]:
    """Apply ``plan`` under a fake process group of its world size, train two steps and return the
    second step's peak (the optimizer state exists from there on), from what was allocated before,
    and the caching allocator's reserved peak from what was reserved before (CPU: the peak twice)."""
    _release(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    base_reserved = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=plan.world_size)
    try:
        torch.manual_seed(0)
        module = module_factory(args)().to(device)
        batch = real_batch(args, device)
        root = RootWrapper(module)
        apply_plan(module, root, plan, build_meshes(device.type, plan.world_size))
        optimizer = module.configure_optimizers()["optimizer"]
        step_groups_apart([optimizer])  # as the strategy does after Lightning made the optimizers

        def step() -> None:
            out = _ForwardRedirection()(root, module, "training_step", batch, 0)  # as Lightning calls it
            (out["loss"] if isinstance(out, dict) else out).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        with logging_disabled(module):
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                step()
                torch.cuda.synchronize(device)
                return (torch.cuda.max_memory_allocated(device) - base,
                        torch.cuda.max_memory_reserved(device) - base_reserved)
            tracker = MemTracker()
            tracker.track_external(root, optimizer, *batch.values())
            with tracker:
                step()
            peak = int(max(v["Total"] for v in tracker.get_tracker_snapshot("peak").values()))
            return peak, peak
    finally:
        dist.destroy_process_group()


def check_memory(args: argparse.Namespace, device: torch.device, found: dict[str, ModelProfile]) -> None:
    """Print one table row per plan as it is measured."""
    print("| profile | world | plan | choices | predicted peak | measured peak | error | reserved peak | "
          "budget | reserved / budget |\n|---|---:|---|---|---:|---:|---:|---:|---:|---:|", flush=True)
    for kind, profile in found.items():
        for world in args.worlds:
            for name, plan in plans_for(profile, world).items():
                measured, reserved = measured_peak_bytes(args, plan, device)
                error = plan.predicted_peak_bytes / measured - 1
                print(f"| {kind} | {world} | {name} | {plan.choices_text()} | {format_bytes(plan.predicted_peak_bytes)} | "
                      f"{format_bytes(measured)} | {error:+.1%} | {format_bytes(reserved)} | "
                      f"{format_bytes(plan.memory_budget_bytes)} | {reserved / plan.memory_budget_bytes:.2f} |",
                      flush=True)


class _LossRecorder(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))


def train(args: argparse.Namespace, strategy: str | OSDPStrategy, meta: bool = False) -> dict:
    """One ``Trainer.fit`` on one GPU: losses, the TrainingSummary and the plan (osdp)."""
    _release(torch.device(args.device))
    L.seed_everything(0)
    summary, recorder = TrainingSummary(), _LossRecorder()
    trainer = L.Trainer(strategy=strategy, accelerator=args.device, devices=1, max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[summary, recorder])
    with trainer.init_module(empty_init=True) if meta else contextlib.nullcontext():
        module = module_factory(args)()
    start = time.perf_counter()
    trainer.fit(module, GPTDataModule(seq_len=args.seq, batch_size=args.batch))
    plan = getattr(trainer.strategy, "_plan", None)
    return {"losses": recorder.losses, "summary": summary.summary, "fit_s": time.perf_counter() - start, "plan": plan}


def tight_budget_bytes(profile: ModelProfile) -> int:
    """Halfway between one device's all-replicate and all-checkpointed peaks: only a plan that
    checkpoints some units fits."""
    def peak(choice: str) -> int:
        return make_plan(profile, ClusterSpec(1, 2**50, 2e-5, 1e11), uniform_choice=choice).predicted_peak_bytes
    return (peak("replicate") + peak("replicate+ckpt")) // 2


def compare_single_device(args: argparse.Namespace, profile: ModelProfile) -> None:
    """osdp on one device against Lightning's DDP; prints one table row per run as it ends."""
    tight = tight_budget_bytes(profile)
    runs = {"ddp": lambda: train(args, "ddp"), "osdp": lambda: train(args, OSDPStrategy()),
            f"osdp at {format_bytes(tight)}": lambda: train(args, OSDPStrategy(memory_budget=tight)),
            "osdp, meta init": lambda: train(args, OSDPStrategy(), meta=True)}
    rows = [f"one {args.device} device, {args.steps} steps, GPT {args.layers} x {args.hidden}, {args.seq} tokens, "
            f"micro-batch {args.batch}", "",
            "| run | max rel. loss diff vs ddp | peak | predicted peak | tokens/s | fit s | plan |",
            "|---|---:|---:|---:|---:|---:|---|"]
    ref: list[float] = []
    for name, launch in runs.items():
        run = launch()
        ref = ref or run["losses"]
        s, plan = run["summary"], run["plan"]
        diff = max(abs(a - b) / max(abs(a), 1e-8) for a, b in zip(ref, run["losses"], strict=True))
        choices = plan.choices_text() if plan else "-"
        predicted = format_bytes(plan.predicted_peak_bytes) if plan else "-"
        rows.append(f"| {name} | {diff:.2e} | {format_bytes(s['peak_bytes'])} | {predicted} | "
                    f"{s['tokens_per_s']:.0f} | {run['fit_s']:.1f} | {choices} |")
        print("\n".join(rows), flush=True)
        rows.clear()


def compare_compile(args: argparse.Namespace) -> None:
    """osdp with every unit compiled against osdp uncompiled, one device; one table row per run."""
    print(f"compile: one {args.device} device, {args.steps} steps, GPT {args.layers} x {args.hidden}, "
          f"{args.seq} tokens, micro-batch {args.batch}\n\n| run | max rel. loss diff | setup s | compile s | "
          "tokens/s | plan |\n|---|---:|---:|---:|---:|---|", flush=True)
    ref: list[float] = []
    for name, strategy in (("osdp", OSDPStrategy()), ('osdp, compile="units"', OSDPStrategy(compile="units"))):
        run = train(args, strategy)
        ref = ref or run["losses"]
        diff = max(abs(a - b) / max(abs(a), 1e-8) for a, b in zip(ref, run["losses"], strict=True))
        setup = strategy.setup_s
        print(f"| {name} | {diff:.2e} | {sum(setup.values()):.1f} | {setup.get('compile_s', 0.0):.1f} | "
              f"{run['summary']['tokens_per_s']:.0f} | {run['plan'].choices_text()} |", flush=True)


def _release(device: torch.device) -> None:
    """Free what earlier runs left before the next is measured.

    NOTE: peaks are the allocator's high-water marks: an earlier run's model and optimizer (held in
    reference cycles: trainer, strategy, FSDP2 state) must be gone, not only unreferenced. Without
    this, one H200 run measured the same plan at 1.65 and 2.03 GiB, and a Trainer run's peak held
    the previous run's 1.6 GiB of weights, gradients and optimizer state."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--skip", nargs="*", choices=("memory", "training", "bf16", "compile"), default=[])
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# osdp GPU check on {name}, torch {torch.__version__}, lightning {L.__version__}\n", flush=True)
    found = profiles(args, device)
    for kind, profile in found.items():
        print(f"{kind} profile: {profile.param_count:,} parameters, {len(profile.units)} units, "
              f"measured in {profile.profile_s:.1f} s", flush=True)
    if "memory" not in args.skip:
        check_memory(args, device, found)
    if "bf16" not in args.skip:
        from benchmarks.gpu_precision import check_bf16  # NOTE: it imports this module's helpers

        print()
        check_bf16(args, device)
    if "training" not in args.skip:
        print()
        compare_single_device(args, found["whole"])
    if "compile" not in args.skip:
        print()
        compare_compile(args)


if __name__ == "__main__":
    main()
