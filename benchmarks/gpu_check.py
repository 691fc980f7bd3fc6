"""The CUDA path, in one short script for a lent GPU (also runs on CPU for a dry check here).

1. Predicted peak bytes per rank against the CUDA allocator's peak (``max_memory_allocated``)
   for several plans of a GPT recipe: all-replicate, all-zero2, all-zero3 and an ILP plan under a
   tight budget, at world sizes 2 and 8. One GPU stands for every rank through PyTorch's ``fake``
   process group: collectives do nothing, but every FSDP2 buffer is really allocated.
2. A real ``Trainer(strategy="osdp", accelerator="cuda", devices=1)`` run against the same run
   with Lightning's default single-device strategy: per-step losses and peak memory.

    python -m benchmarks.gpu_check [--device cuda] [--layers 8 --hidden 1024]
"""

from __future__ import annotations

import argparse
import copy
import time

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies.strategy import _ForwardRedirection
from osdp_lightning.recipes.gpt import GPT, GPTConfig, GPTLitModule

import osdp_lightning  # noqa: F401
from osdp_lightning import ClusterSpec, OSDPStrategy, TrainingSummary, format_bytes, make_plan
from osdp_lightning.apply import apply_plan, build_meshes
from osdp_lightning.choices import BASE_CHOICES
from osdp_lightning.measure import profile_lightning_module
from osdp_lightning.plan import InfeasibleBudgetError, Plan
from osdp_lightning.strategy import RootWrapper


def build_module(layers: int, hidden: int, seq: int) -> GPTLitModule:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=384, block_size=seq, n_layer=layers, n_head=max(hidden // 64, 1),
                       n_embd=hidden, dropout=0.0)
    return GPTLitModule(GPT(config), lr=1e-4)


def batch_for(seq: int, batch: int, device: torch.device) -> dict:
    """One real batch of the GPT recipe's default data."""
    from lightning.fabric.utilities.apply_func import move_data_to_device
    from osdp_lightning.recipes.gpt import GPTDataModule

    data = GPTDataModule(seq_len=seq, batch_size=batch)
    data.setup("fit")
    return move_data_to_device(next(iter(data.train_dataloader())), device)


def measured_peak(module: GPTLitModule, plan: Plan, batch: dict, device: torch.device) -> int:
    """Apply ``plan`` under the fake process group, train 3 steps, return the steady-state peak."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    module.log = lambda *a, **k: None  # no Trainer here
    root = RootWrapper(module)
    apply_plan(module, root, plan, build_meshes(device.type, plan.world_size))
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)

    def step() -> None:
        loss = _ForwardRedirection()(root, module, "training_step", batch, 0)  # as Lightning calls it
        loss = loss["loss"] if isinstance(loss, dict) else loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # optimizer state exists from here on: the steady state starts at step 2
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() - _model_and_optimizer_bytes(module, optimizer)
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    tracker = FSDPMemTracker(root, optimizer)
    with tracker:
        step()
    return int(max(v["Total"] for v in tracker.get_tracker_snapshot("peak").values()))


def _model_and_optimizer_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters and optimizer state now allocated (local shards): what is 'ours'."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t
    tensors = [local(p) for p in module.parameters()]
    tensors += [local(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def check_predictions(args: argparse.Namespace, device: torch.device) -> list[str]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    rows = ["| world | plan | predicted peak | measured peak | error |", "|---:|---|---:|---:|---:|"]
    module = build_module(args.layers, args.hidden, args.seq).to(device)
    batch = batch_for(args.seq, args.batch, device)
    profile = profile_lightning_module(module, batch, optimizer=module.configure_optimizers()["optimizer"])
    for world in args.worlds:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        cluster = ClusterSpec(world, 2**50, 20e-6, 100e9)
        plans = {str(c): make_plan(profile, cluster, uniform_choice=c) for c in BASE_CHOICES}
        tight = (plans["replicate"].predicted_peak_bytes + plans["zero3"].predicted_peak_bytes) // 2
        try:
            plans["ilp@mid"] = make_plan(profile, ClusterSpec(world, tight, 20e-6, 100e9))
        except InfeasibleBudgetError as err:
            print(err)
        for name, plan in plans.items():
            fresh = copy.deepcopy(build_module(args.layers, args.hidden, args.seq)).to(device)
            measured = measured_peak(fresh, plan, batch, device)
            error = (plan.predicted_peak_bytes - measured) / measured
            rows.append(f"| {world} | {name} | {format_bytes(plan.predicted_peak_bytes)} | "
                        f"{format_bytes(measured)} | {error:+.1%} |")
            del fresh
            if device.type == "cuda":
                torch.cuda.empty_cache()
        dist.destroy_process_group()
    return rows


def compare_single_device(args: argparse.Namespace) -> list[str]:
    """osdp on one GPU against Lightning's default strategy: same losses, predicted vs measured."""
    from osdp_lightning.recipes.gpt import GPTDataModule

    results = {}
    for name, strategy in (("auto", "auto"), ("osdp", OSDPStrategy())):
        L.seed_everything(0)
        module = build_module(args.layers, args.hidden, args.seq)
        data = GPTDataModule(seq_len=args.seq, batch_size=args.batch)
        summary = TrainingSummary()
        losses: list[float] = []
        recorder = _LossRecorder(losses)
        trainer = L.Trainer(strategy=strategy, accelerator="cuda", devices=1, max_steps=args.steps,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            callbacks=[summary, recorder])
        start = time.perf_counter()
        trainer.fit(module, data)
        results[name] = (losses, summary.summary, time.perf_counter() - start, getattr(trainer.strategy, "_plan", None))
    (ref, ref_sum, _, _), (got, got_sum, _, plan) = results["auto"], results["osdp"]
    worst = max(abs(a - b) / max(abs(a), 1e-8) for a, b in zip(ref, got, strict=True))
    return [f"single GPU, {args.steps} steps: max relative loss difference osdp vs auto = {worst:.2e}",
            f"auto: peak {format_bytes(ref_sum['peak_bytes'])}, {ref_sum['tokens_per_s']:.0f} tokens/s",
            f"osdp: peak {format_bytes(got_sum['peak_bytes'])} (predicted "
            f"{format_bytes(plan.predicted_peak_bytes)}), {got_sum['tokens_per_s']:.0f} tokens/s",
            plan.format_table()]


class _LossRecorder(L.Callback):
    def __init__(self, losses: list[float]) -> None:
        self.losses = losses

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 8])
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# osdp GPU check on {name}, torch {torch.__version__}\n")
    print("\n".join(check_predictions(args, device)))
    if device.type == "cuda":
        print()
        print("\n".join(compare_single_device(args)))


if __name__ == "__main__":
    main()
