"""Machinery for replicated units, side by side: which one runs at DDP's speed (issue 17).

    ./dev bench replicate_candidates [--rounds 3 --steps 10 --n-layer 4 --n-embd 384 --seq-len 64 --batch-size 2]

One 2-rank gloo job (one thread per rank) builds the benchmark GPT of :mod:`benchmarks.compare`
once per candidate, each with its own AdamW, and times whole steps (forward, backward, optimizer
step, ``zero_grad(set_to_none=True)``) one step of each candidate in turn, in a fresh random order
every step (the same on both ranks), so that load on a shared machine hits all alike. ``--rounds`` rounds of
``--steps`` timed steps (after 2 warm-up steps); a candidate's figure is the median over rounds of
its per-round median step, and its fastest step (on a loaded machine noise only adds). Candidates, all on the strategy's own units (``select_units``):

- ``torch-ddp``: ``DistributedDataParallel(model)`` as Lightning's ``strategy="ddp"`` builds it;
- ``fsdp2-w1``: today's osdp replicate, ``fully_shard`` per unit on the (W, 1) mesh, resharded
  after forward;
- ``fsdp2-w1-keep``: the same with ``reshard_after_forward=False`` (holds unsharded copies);
- ``fsdp2-replicate``: torch's FSDP2-based ``replicate`` (``_composable.replicate_with_fsdp``) per unit;
- ``composable-replicate``: torch's DDP-based composable ``replicate`` on the root;
- ``reducer``: one DDP reducer for all replicated parameters (``osdp_lightning.replicate``), with
  gradients as bucket views; ``reducer-copy``: the same with DDP's default second gradient copy;
- ``mixed *``: the same mixed plan (blocks 1 and 3 zero3, the rest replicate) with the replicated
  units as ``fsdp2-w1`` (today) / ``reducer`` / ``torch-ddp-ignore`` (torch DDP around the FSDP2
  root, the sharded parameters ignored via ``_set_params_and_buffers_to_ignore_for_model``).

Peak bytes per rank: ``MemTracker`` over one whole step (steady state: gradients of the step
before exist when it starts), plus DDP's bucket copy of the gradients where the tracker cannot see
it (``torch-ddp``, ``composable-replicate`` and ``reducer-copy``: their buckets live in C++).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.step_anatomy import WORLD, _Root, join_group, make_module, model_parser, rank_batch, spawn

MIXED_ZERO3 = ("net.h.1", "net.h.3")
"""The units the mixed plan shards (zero3); every other unit, and the root, is replicated."""
Builder = Callable[[nn.Module, nn.Module], nn.Module]


def _units(module: nn.Module) -> tuple[list, dict[str, list[nn.Parameter]]]:
    from osdp_lightning.units import owned_params, select_units

    specs = select_units(module)
    return specs, owned_params(module, specs)


def _target(module: nn.Module, spec) -> nn.Module | list[nn.Module]:  # noqa: ANN001
    modules = [module.get_submodule(n) for n in spec.module_names]
    return modules[0] if len(modules) == 1 else modules


def _is_sharded(spec, mixed: bool) -> bool:  # noqa: ANN001
    return mixed and spec.name in MIXED_ZERO3


def fsdp2_w1(reshard: bool, mixed: bool = False) -> Builder:
    def build(module: nn.Module, root: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        from osdp_lightning.apply import build_meshes

        meshes = build_meshes("cpu", WORLD)
        for spec in _units(module)[0]:
            sharded = _is_sharded(spec, mixed)
            fully_shard(_target(module, spec), mesh=meshes.shard if sharded else meshes.replicate,
                        reshard_after_forward=True if sharded else reshard)
        fully_shard(root, mesh=meshes.replicate, reshard_after_forward=reshard)
        return root
    return build


def fsdp2_replicate(module: nn.Module, root: nn.Module) -> nn.Module:
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("replicate",))
    for spec in _units(module)[0]:
        replicate(_target(module, spec), mesh=mesh)
    replicate(root, mesh=mesh)
    return root


def torch_ddp(module: nn.Module, root: nn.Module) -> nn.Module:
    return nn.parallel.DistributedDataParallel(root)  # Lightning's DDPStrategy on CPU: no device_ids


def composable_replicate(module: nn.Module, root: nn.Module) -> nn.Module:
    from torch.distributed._composable.replicate import replicate

    return replicate(root)


def reducer(bucket_view: bool, mixed: bool = False) -> Builder:
    def build(module: nn.Module, root: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        from osdp_lightning.apply import build_meshes
        from osdp_lightning.replicate import apply_replicate

        specs, owned = _units(module)
        sharded = [s for s in specs if _is_sharded(s, mixed)]
        replicated = [p for s in specs if s not in sharded for p in owned[s.name]] + owned[""]
        apply_replicate(root, replicated, gradient_as_bucket_view=bucket_view)
        if sharded:
            meshes = build_meshes("cpu", WORLD)
            for spec in sharded:
                fully_shard(_target(module, spec), mesh=meshes.shard, reshard_after_forward=True)
            fully_shard(root, mesh=meshes.shard, ignored_params=set(replicated))
        return root
    return build


def torch_ddp_ignore(module: nn.Module, root: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    from osdp_lightning.apply import build_meshes

    specs, owned = _units(module)
    sharded = [s for s in specs if _is_sharded(s, True)]
    meshes = build_meshes("cpu", WORLD)
    names = [f"module.{n}" for n, p in module.named_parameters()
             if any(p is q for s in sharded for q in owned[s.name])]
    replicated = {p for n, p in module.named_parameters() if f"module.{n}" not in names}
    for spec in sharded:
        fully_shard(_target(module, spec), mesh=meshes.shard, reshard_after_forward=True)
    fully_shard(root, mesh=meshes.shard, ignored_params=replicated)
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(root, names)
    return nn.parallel.DistributedDataParallel(root)


CANDIDATES: dict[str, Builder] = {
    "torch-ddp": torch_ddp,
    "fsdp2-w1": fsdp2_w1(reshard=True),
    "fsdp2-w1-keep": fsdp2_w1(reshard=False),
    "fsdp2-replicate": fsdp2_replicate,
    "composable-replicate": composable_replicate,
    "reducer": reducer(bucket_view=True),
    "reducer-copy": reducer(bucket_view=False),
    "mixed fsdp2-w1": fsdp2_w1(reshard=True, mixed=True),
    "mixed reducer": reducer(bucket_view=True, mixed=True),
    "mixed torch-ddp-ignore": torch_ddp_ignore,
}
_HIDDEN_BUCKETS = ("torch-ddp", "composable-replicate", "reducer-copy")


def step(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[float, float]:
    """(seconds, loss) of one whole step."""
    start = time.perf_counter()
    loss = model()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start, loss.item()


def peak_bytes(name: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    model().backward()  # steady state: this step's gradients exist when the tracked one starts
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step(model, optimizer)
    peak = max(v.get("Total", 0) for v in tracker.get_tracker_snapshot("peak").values())
    if name in _HIDDEN_BUCKETS:  # DDP's buckets: one more copy of every gradient, outside the tracker
        peak += sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return int(peak)


def build_all(args: argparse.Namespace, batch: dict) -> dict[str, tuple[nn.Module, torch.optim.Optimizer]]:
    built = {}
    for name, builder in CANDIDATES.items():
        if args.only and name not in args.only.split(","):
            continue
        module = make_module(args)
        try:
            model = builder(module, _Root(module, batch))
            built[name] = (model, module.configure_optimizers()["optimizer"])
        except Exception as err:  # noqa: BLE001  (a candidate that cannot be built is reported, not fatal)
            if dist.get_rank() == 0:
                print(f"{name}: cannot be built: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
    return built


def bench(rank: int, port: int, args: argparse.Namespace) -> None:
    join_group(rank, port)
    try:
        built = build_all(args, rank_batch(rank, args))
        losses = {name: [step(*pair)[1] for _ in range(2)] for name, pair in built.items()}  # warm-up
        rounds: dict[str, list[float]] = {name: [] for name in built}
        best: dict[str, float] = {name: float("inf") for name in built}
        for r in range(args.rounds):
            samples: dict[str, list[float]] = {name: [] for name in built}
            for index in range(args.steps):
                # NOTE: a fresh order every step, the same on both ranks: with a fixed or merely
                # reversed order the candidates at the ends run twice in a row (warm caches, no
                # rank skew left by another candidate) and come out up to 30% faster.
                names = list(built)
                random.Random(r * args.steps + index).shuffle(names)
                for name in names:
                    samples[name].append(step(*built[name])[0])
            for name, values in samples.items():
                rounds[name].append(statistics.median(values))
                best[name] = min(best[name], *values)
        peaks = {name: peak_bytes(name, *pair) for name, pair in built.items()}
        if rank == 0:
            report(rounds, best, peaks, losses, args)
    finally:
        dist.destroy_process_group()


def report(rounds: dict[str, list[float]], best: dict[str, float], peaks: dict[str, int],
           losses: dict[str, list[float]], args: argparse.Namespace) -> None:
    """Medians, and the fastest step: on a loaded machine noise only adds, so the minimum is the
    steadier estimate of what the machinery itself costs."""
    base = statistics.median(rounds["torch-ddp"]) if "torch-ddp" in rounds else None
    base_best = best.get("torch-ddp")
    print(f"GPT {args.n_layer} x {args.n_embd}, seq {args.seq_len}, micro-batch {args.batch_size}, {WORLD} gloo "
          f"ranks x 1 thread; {args.rounds} rounds x {args.steps} interleaved steps; load {os.getloadavg()[0]:.2f}\n")
    print("| candidate | step s (median of rounds) | per-round medians s | x torch-ddp | fastest step s "
          "| x torch-ddp (fastest) | peak MiB | first losses |")
    print("|---|---|---|---|---|---|---|---|")
    for name, values in rounds.items():
        median = statistics.median(values)
        ratio = f"{base / median:.2f}" if base else "-"
        ratio_best = f"{base_best / best[name]:.2f}" if base_best else "-"
        print(f"| {name} | {median:.4f} | {' / '.join(f'{v:.4f}' for v in values)} | {ratio} "
              f"| {best[name]:.4f} | {ratio_best} | {peaks[name] / 2**20:.1f} | {' '.join(f'{x:.5f}' for x in losses[name])} |")


def main() -> None:
    parser = model_parser(__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--only", default=None, help="comma-separated candidate names")
    spawn(bench, parser.parse_args())


if __name__ == "__main__":
    main()
