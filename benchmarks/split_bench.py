"""Operator-splitting benchmark (issue 3, item 6) on 2 CPU ranks: figures printed, not asserted.

A model whose largest Linear dominates the peak (``WideLayerModel``: 64 -> H -> H -> H/2 -> 16;
the H x H layer holds two thirds of the parameters, the H x H/2 one most of the rest). One 2-rank gloo job runs the strategy's own stages
(profile, collective calibration, ``make_plan``, ``apply_plan``) and then

(a) asks the cost model for the smallest feasible per-rank budget with and without splitting
    (the ILP minimising the peak) and measures the peak of both plans;
(b) solves at budgets where both are feasible with splitting on and off and compares measured
    throughput (the ILP should pick a split only where it does not lose more than 5%);
(c) prints predicted against measured peak of every plan with split units, including the
    smallest-peak plan for each single k.

NOTE: the plans are trained side by side in one job, one step of each in turn, so that the load
of a shared machine hits all of them alike (separate runs differed by up to 50% here for the
same plan). Peaks come from FSDPMemTracker over one whole step, as in ``TrainingSummary``.

Run from the repository root: ``python -m benchmarks.split_bench [--hidden 2048] [--steps 20]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD = 2
BATCH = 16


def make_model(hidden: int):  # noqa: ANN201  (a LightningModule; Lightning is imported lazily)
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    class WideLayerModel(L.LightningModule):
        """64 -> hidden -> hidden -> hidden/2 -> 16 MLP regression; the hidden x hidden Linear dominates."""

        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                     nn.Linear(hidden, hidden // 2), nn.ReLU(), nn.Linear(hidden // 2, 16))

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> DataLoader:
            x = torch.randn(8 * BATCH, 64, generator=torch.Generator().manual_seed(0))
            return DataLoader(TensorDataset(x, x[:, :16].clone()), batch_size=BATCH)

    torch.manual_seed(0)
    return WideLayerModel()


class _Root(nn.Module):
    """FSDP2's root: its forward runs the training step (as the strategy's wrapper does)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.module.training_step(batch, 0)


class PlanRun:
    """One model sharded by one plan, with its optimizer and this rank's batch."""

    def __init__(self, plan, meshes, hidden: int, rank: int) -> None:  # noqa: ANN001
        from osdp_lightning.apply import apply_plan

        self.plan = plan
        self.module = make_model(hidden)
        x, y = next(iter(self.module.train_dataloader()))
        self.batch = (x.chunk(WORLD)[rank], y.chunk(WORLD)[rank])
        self.root = _Root(self.module)
        apply_plan(self.module, self.root, plan, meshes)
        self.optimizer = self.module.configure_optimizers()
        self.step_s: list[float] = []
        self.peak_bytes = 0

    def step(self) -> float:
        start = time.perf_counter()
        self.root(self.batch).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return time.perf_counter() - start

    def track_peak(self) -> None:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        tracker = FSDPMemTracker(self.root, self.optimizer)
        with tracker:
            self.step()
        self.peak_bytes = max(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())


def splits_of(plan) -> str:  # noqa: ANN001
    return ", ".join(f"{u.name}: {u.choice}" for u in plan.units if u.choice.startswith("split")) or "none"


def choices_of(plan) -> str:  # noqa: ANN001
    return ", ".join(f"{u.name or '<root>'}={u.choice}" for u in plan.units)


def mib(n: float) -> str:
    return f"{n / 2**20:7.2f} MiB"


def solve_plans(profile, cluster, factors: tuple[int, ...]) -> tuple[dict, dict]:  # noqa: ANN001
    """Rank 0: smallest feasible peaks and the plans to run, by label."""
    from osdp_lightning.choices import (
        BASE_CHOICES,
        REPLICATE,
        ZERO3,
        ChoiceOptions,
        choice_space,
        split_choice,
    )
    from osdp_lightning.cost import build_choice_table
    from osdp_lightning.plan import make_plan
    from osdp_lightning.solve import smallest_feasible_budget

    with_split = choice_space(cluster, ChoiceOptions(split_factors=factors))
    choice_sets = {"no split": BASE_CHOICES, "split": with_split, "all replicate": (REPLICATE,)}
    choice_sets.update({f"only k={k}": (ZERO3, split_choice(k, k)) for k in factors})
    peaks = {label: smallest_feasible_budget(build_choice_table(profile, cluster, choices=choices))
             for label, choices in choice_sets.items()}

    def plan_at(budget: int, choices: tuple):  # noqa: ANN202
        return make_plan(profile, dataclasses.replace(cluster, memory_budget_bytes=budget), choices=choices)

    plans = {f"smallest, {label}": plan_at(peaks[label], choice_sets[label])
             for label in ("no split", "split", *(f"only k={k}" for k in factors))}
    low, high = peaks["no split"], peaks["all replicate"]
    for fraction in (0.0, 0.5, 0.95):  # budgets where both are feasible
        budget = int(low + fraction * (high - low))
        plans[f"split on  @ {mib(budget)}"] = plan_at(budget, with_split)
        plans[f"split off @ {mib(budget)}"] = plan_at(budget, BASE_CHOICES)
    return peaks, plans


def report(peaks: dict, runs: dict[str, PlanRun]) -> None:
    saving = 1 - peaks["split"] / peaks["no split"]
    print("\n(a) smallest feasible peak per rank (cost model; measured peak of that plan)")
    for label in ("no split", "split"):
        run = runs[f"smallest, {label}"]
        print(f"  {label:<9} predicted {mib(peaks[label])}, measured {mib(run.peak_bytes)}; splits: {splits_of(run.plan)}")
    measured = 1 - runs["smallest, split"].peak_bytes / runs["smallest, no split"].peak_bytes
    print(f"  splitting lowers the smallest feasible budget by {saving:.1%} predicted, {measured:.1%} measured "
          f"(target >= 25%); all replicate needs {mib(peaks['all replicate'])}")
    print("\n(b) throughput where both are feasible (median step, plans trained side by side)")
    for label, on in runs.items():
        if not label.startswith("split on"):
            continue
        off = runs[label.replace("split on ", "split off")]
        on_s, off_s = statistics.median(on.step_s), statistics.median(off.step_s)
        if on is off:
            print(f"  budget {label[12:]}: the same plan either way ({BATCH / on_s:.1f} samples/s); no split chosen")
            continue
        print(f"  budget {label[12:]}: on {BATCH / on_s:7.1f} vs off {BATCH / off_s:7.1f} samples/s (2 ranks), "
              f"on/off {off_s / on_s:.3f}; on: {choices_of(on.plan)}; off: {choices_of(off.plan)}")
    split_run, plain_run = runs["smallest, split"], runs["smallest, no split"]
    if split_run is not plain_run:
        # Both fit the no-split minimum; the ILP preferred the plain plan there. Was it right?
        predicted = plain_run.plan.predicted_step_s / split_run.plan.predicted_step_s
        measured = statistics.median(plain_run.step_s) / statistics.median(split_run.step_s)
        print(f"  smallest-peak split plan vs no-split plan, both fit {mib(peaks['no split'])}: split/plain "
              f"throughput predicted {predicted:.3f}, measured {measured:.3f}")
    print("\n(c) predicted vs measured peak of plans with split units")
    for label, run in runs.items():
        if splits_of(run.plan) != "none":
            error = run.plan.predicted_peak_bytes / run.peak_bytes - 1
            print(f"  {label:<22} predicted {mib(run.plan.predicted_peak_bytes)}, measured {mib(run.peak_bytes)} "
                  f"({error:+.1%}); {splits_of(run.plan)}")


def bench(rank: int, port: int, hidden: int, steps: int, factors: tuple[int, ...]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        from osdp_lightning.apply import build_meshes
        from osdp_lightning.calibrate import measure_collectives
        from osdp_lightning.cluster import ClusterSpec
        from osdp_lightning.profile import measure_split_overheads, profile_lightning_module

        timings = measure_collectives(torch.device("cpu"))
        cluster = ClusterSpec(world_size=WORLD, memory_budget_bytes=2**40, collective_latency_s=timings.latency_s,
                              bandwidth_bytes_per_s=timings.bandwidth_bytes_per_s,
                              overlap_efficiency=timings.overlap_efficiency)
        solved: list = [None]
        if rank == 0:
            model = make_model(hidden)
            batch = next(iter(model.train_dataloader()))
            batch = (batch[0][: BATCH // WORLD], batch[1][: BATCH // WORLD])  # one rank's micro-batch
            profile = profile_lightning_module(model, batch, optimizer=model.configure_optimizers())
            profile = measure_split_overheads(model, batch, profile, factors)
            overheads = {u.name: (u.forward_s + u.backward_s, u.split_overhead_s)
                         for u in profile.units if u.split_overhead_s}
            solved[0] = (*solve_plans(profile, cluster, factors), overheads)
        dist.broadcast_object_list(solved, src=0)
        peaks, plans, overheads = solved[0]
        meshes = build_meshes("cpu", WORLD)
        runs: dict[str, PlanRun] = {}
        by_choices: dict[tuple[str, ...], PlanRun] = {}
        for label, plan in plans.items():  # a plan solved twice is built and timed once
            key = tuple(u.choice for u in plan.units)
            runs[label] = by_choices.setdefault(key, None) or PlanRun(plan, meshes, hidden, rank)
            by_choices[key] = runs[label]
        for run in by_choices.values():
            run.step()  # warm-up: optimizer state exists before the tracked step
            run.track_peak()
        order = list(by_choices.values())
        for index in range(steps):
            for run in order if index % 2 == 0 else reversed(order):
                run.step_s.append(run.step())
        if rank == 0:
            print(f"WideLayerModel 64 -> {hidden} -> {hidden} -> {hidden // 2} -> 16, micro-batch {BATCH // WORLD} per rank, "
                  f"{WORLD} CPU ranks (gloo), Adam fp32, split factors {factors}; collectives: latency "
                  f"{timings.latency_s * 1e6:.0f} us, {timings.bandwidth_bytes_per_s / 1e9:.2f} GB/s")
            for name, (compute_s, measured) in overheads.items():
                print(f"  {name}: forward+backward {compute_s * 1e3:.2f} ms, split overhead "
                      + ", ".join(f"k={k} +{s * 1e3:.2f} ms" for k, s in measured))
            report(peaks, runs)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--factors", default="2,4,8")
    args = parser.parse_args()
    factors = tuple(int(k) for k in args.factors.split(",") if k)
    mp.spawn(bench, args=(free_port(), args.hidden, args.steps, factors), nprocs=WORLD)


if __name__ == "__main__":
    main()
