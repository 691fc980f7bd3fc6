"""Where a training step's seconds go under each FSDP2 layout, against what the cost model adds up.

    python -m benchmarks.step_anatomy [--n-embd 384 --n-layer 4 --seq-len 64 --batch-size 2 --steps 12]

One 2-rank gloo job builds the benchmark GPT of :mod:`benchmarks.compare` four times (unsharded and
local, all-replicate, all-zero2, all-zero3, each with its own AdamW) and times forward, backward and
optimizer step of each, one step of each in turn (so that load on a shared machine hits all alike).
It also times the bare collectives each layout issues (the same sizes, one call per unit, with
plain ``torch.distributed`` calls), so that

    measured fwd+bwd = local fwd+bwd + bare collectives + FSDP2's own cost (hooks, copy-in/out)

and prints it beside the plan's predicted step (profiled compute + modelled collectives). Rank 0
profiles and calibrates exactly as the strategy does.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from benchmarks.split_bench import free_port  # noqa: E402

WORLD = 2
LAYOUTS = ("replicate", "zero2", "zero3")


class _Root(nn.Module):
    """FSDP2's root, as the strategy's wrapper: its forward computes the loss."""

    def __init__(self, module: nn.Module, batch: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.module, self.batch = module, batch

    def forward(self) -> torch.Tensor:
        return self.module.compute_loss(self.batch)


def make_module(args: argparse.Namespace) -> nn.Module:
    from osdp_lightning.recipes.gpt import GPT, GPTConfig, GPTLitModule

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=384, block_size=args.seq_len, n_layer=args.n_layer, n_head=args.n_head,
                       n_embd=args.n_embd)
    return GPTLitModule(GPT(config))


def model_parser(description: str) -> argparse.ArgumentParser:
    """A command line with the GPT's shape and micro-batch (what :func:`make_module` and
    :func:`rank_batch` read); the benchmark adds its own options."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=384)
    parser.add_argument("--n-head", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=2)
    return parser


def spawn(bench: Callable[[int, int, argparse.Namespace], None], args: argparse.Namespace) -> None:
    """``bench(rank, port, args)`` on every rank of the job."""
    mp.spawn(bench, args=(free_port(), args), nprocs=WORLD)


def join_group(rank: int, port: int) -> None:
    """This process as one rank of the gloo job, one thread (the ranks share the machine's cores)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)


def rank_batch(rank: int, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """A micro-batch of random tokens, its own on every rank."""
    tokens = torch.randint(0, 256, (args.batch_size, args.seq_len + 1),
                           generator=torch.Generator().manual_seed(rank))
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}


def timed_step(root: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[float, float, float]:
    """(forward, backward, optimizer) seconds of one step."""
    t0 = time.perf_counter()
    loss = root()
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def bare_collectives(layout: str, unit_params: list[int]) -> Callable[[], None]:
    """The collectives ``layout`` issues per step, one call per unit, fp32, without FSDP2."""
    shards = [torch.zeros(-(-n // WORLD)) for n in unit_params]
    fulls = [torch.zeros(s.numel() * WORLD) for s in shards]

    def run() -> None:
        for shard, full in zip(shards, fulls, strict=True):
            if layout == "replicate":
                dist.all_reduce(full)
                continue
            for _ in range(1 if layout == "zero2" else 2):
                dist.all_gather_into_tensor(full, shard)
            dist.reduce_scatter_tensor(shard, full)
    return run


def plan_and_profile(module: nn.Module, batch: dict, args: argparse.Namespace) -> tuple[dict, list[int], dict]:
    """Rank 0's profile, calibration and uniform-plan predictions, shared with every rank."""
    from osdp_lightning.calibrate import measure_collectives
    from osdp_lightning.cluster import ClusterSpec
    from osdp_lightning.plan import make_plan
    from osdp_lightning.profile import profile_lightning_module

    timings = measure_collectives(torch.device("cpu"))
    result: list = [None]
    if dist.get_rank() == 0:
        optimizer = module.configure_optimizers()["optimizer"]
        profile = profile_lightning_module(module, batch, optimizer=optimizer)
        cluster = ClusterSpec(world_size=WORLD, memory_budget_bytes=2**40, collective_latency_s=timings.latency_s,
                              bandwidth_bytes_per_s=timings.bandwidth_bytes_per_s, overlap_efficiency=0.0)
        plans = {c: make_plan(profile, cluster, uniform_choice=c) for c in LAYOUTS}
        result[0] = ({c: (p.predicted_step_s, sum(u.predicted_comm_s for u in p.units)) for c, p in plans.items()},
                     [u.param_count for u in plans["replicate"].units],
                     {"local_fwd_bwd_s": profile.step_s, "latency_us": timings.latency_s * 1e6,
                      "bandwidth_gb_s": timings.bandwidth_bytes_per_s / 1e9, "plans": plans["replicate"]})
    dist.broadcast_object_list(result, src=0)
    return result[0]


def build_variants(module: nn.Module, batch: dict, plan) -> dict[str, tuple[nn.Module, torch.optim.Optimizer]]:  # noqa: ANN001
    import dataclasses

    from osdp_lightning.apply import apply_plan, build_meshes

    meshes = build_meshes("cpu", WORLD)
    variants = {}
    for layout in ("local", *LAYOUTS):
        copy_module = copy.deepcopy(module)
        root = _Root(copy_module, batch)
        if layout != "local":
            units = tuple(dataclasses.replace(u, choice=layout) for u in plan.units)
            apply_plan(copy_module, root, dataclasses.replace(plan, units=units), meshes)
        variants[layout] = (root, copy_module.configure_optimizers()["optimizer"])
    return variants


def bench(rank: int, port: int, args: argparse.Namespace) -> None:
    join_group(rank, port)
    try:
        module = make_module(args)
        batch = rank_batch(rank, args)
        predicted, unit_params, info = plan_and_profile(module, batch, args)
        variants = build_variants(module, batch, info.pop("plans"))
        bare = {layout: bare_collectives(layout, unit_params) for layout in LAYOUTS}
        samples: dict[str, list[tuple[float, ...]]] = {name: [] for name in (*variants, *(f"bare {x}" for x in LAYOUTS))}
        for index in range(args.steps + 2):
            names = list(variants) if index % 2 == 0 else list(variants)[::-1]
            for name in names:
                sample = timed_step(*variants[name])
                if index >= 2:  # warm-up: optimizer state, allocator
                    samples[name].append(sample)
            for layout, run in bare.items():
                start = time.perf_counter()
                run()
                if index >= 2:
                    samples[f"bare {layout}"].append((time.perf_counter() - start,))
        if rank == 0:
            report(samples, predicted, info, args)
    finally:
        dist.destroy_process_group()


def report(samples: dict, predicted: dict, info: dict, args: argparse.Namespace) -> None:
    med = {name: [statistics.median(col) for col in zip(*rows, strict=True)] for name, rows in samples.items()}
    local_fb = med["local"][0] + med["local"][1]
    print(f"GPT {args.n_layer} layers x {args.n_embd}, micro-batch {args.batch_size} x {args.seq_len} tokens per rank, "
          f"{WORLD} gloo ranks, 1 thread each; medians of {args.steps} interleaved steps. Calibrated: latency "
          f"{info['latency_us']:.0f} us, bandwidth {info['bandwidth_gb_s']:.2f} GB/s; profiled local fwd+bwd "
          f"{info['local_fwd_bwd_s']:.4f} s.\n")
    print("| layout | forward s | backward s | optimizer s | step s | bare collectives s | FSDP2 own cost s "
          "| predicted comm s | predicted step s | step err |")
    print("|" + "---|" * 10)
    fwd, bwd, opt = med["local"]
    print(f"| local (no FSDP, no comm) | {fwd:.4f} | {bwd:.4f} | {opt:.4f} | {fwd + bwd + opt:.4f} | - | - | - | - | - |")
    for layout in LAYOUTS:
        fwd, bwd, opt = med[layout]
        step, bare = fwd + bwd + opt, med[f"bare {layout}"][0]
        own = fwd + bwd - local_fb - bare
        pred_step, pred_comm = predicted[layout]
        print(f"| {layout} | {fwd:.4f} | {bwd:.4f} | {opt:.4f} | {step:.4f} | {bare:.4f} | {own:.4f} "
              f"| {pred_comm:.4f} | {pred_step:.4f} | {100 * (pred_step / step - 1):+.1f}% |")


def main() -> None:
    parser = model_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    spawn(bench, parser.parse_args())


if __name__ == "__main__":
    main()
