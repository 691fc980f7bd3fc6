"""SplitLinear under FSDP2 on 2 gloo ranks: training, checkpoints and memory.

Run as a script (it spawns its own 2 ranks unless a launcher started them):
    python split_fsdp_check.py [--out result.json]

1. losses of a model with two split Linears (mixed sharded/replicated slices, uneven rows)
   match a single-process plain-Linear reference (relative difference < 1e-4);
2. its canonical checkpoint (full and sharded, plain ``state_dict`` and DCP's state-dict API)
   loads into the plain model and back, giving the same outputs;
3. FSDPMemTracker: bytes added on top of the start of a step (held plus transient) of one large
   Linear as zero3 and as split plans, against ``split_choice_cost`` (within 15%).
Rank 0 writes the numbers as JSON; any failed check raises (non-zero exit code).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from gloo_checks import main
from torch import nn

# NOTE: osdp_lightning is imported inside the functions that need it: importing the package
# imports Lightning (seconds), and only the two spawned ranks need it, not the launching parent.

WORLD = 2
REL_TOL = 1e-4
MEM_TOL = 0.15
HIDDEN = 1024  # the large Linear of the memory check: 4 MiB of fp32 weight


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 48), nn.Tanh(), nn.Linear(48, 7))


def shard_small_model(model: nn.Module, meshes: tuple) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    from osdp_lightning.runtime.split import shard_split_linear, split_linear_in_module

    shard, replicate = meshes
    # Layer 2: 4 slices, 2 sharded and 2 replicated; layer 4: 7 rows, uneven over 2 ranks.
    shard_split_linear(split_linear_in_module(model, "2", 4), 2, shard, replicate)
    shard_split_linear(split_linear_in_module(model, "4", 2), 1, shard, replicate)
    fully_shard(model[0], mesh=shard)
    fully_shard(model, mesh=shard)  # takes the split layers' biases
    return model


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8 * WORLD, 16, generator=generator), torch.randn(8 * WORLD, 7, generator=generator))
            for _ in range(steps)]


def train_losses(model: nn.Module, data: list, rank: int | None) -> list[float]:
    """Adam steps; with ``rank`` each rank takes its half of every batch and losses are averaged."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for x, y in data:
        if rank is not None:
            x, y = x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().clone()
        if rank is not None:
            dist.all_reduce(value)
            value /= WORLD
        losses.append(value.item())
    return losses


def check_training(rank: int, meshes: tuple) -> dict:
    data = batches(5)
    reference = train_losses(small_model(), data, None)
    model = shard_small_model(small_model(), meshes)
    losses = train_losses(model, data, rank)
    rel = max(abs(a - b) / max(abs(a), 1e-8) for a, b in zip(reference, losses, strict=True))
    assert rel < REL_TOL, f"split losses {losses} differ from reference {reference} (rel {rel:.2e})"
    return {"reference_losses": reference, "split_losses": losses, "max_rel_diff": rel}


def check_checkpoints(rank: int, meshes: tuple) -> dict:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    full = StateDictOptions(full_state_dict=True)
    model = shard_small_model(small_model(), meshes)
    train_losses(model, batches(2), rank)  # move away from the initial weights
    x = torch.randn(5, 16)
    expected = model(x).detach()
    plain = small_model()
    # Full checkpoint of the split model -> plain model (what a user exports).
    saved = get_model_state_dict(model, options=full)
    assert list(saved) == list(plain.state_dict()), f"keys {list(saved)}"
    plain.load_state_dict(saved)
    assert torch.allclose(plain(x), expected, atol=1e-6), "plain model loaded from split checkpoint differs"
    # nn.Module.state_dict() of the sharded model: canonical keys, DTensors; full_tensor() agrees.
    sharded = {k: v.full_tensor() for k, v in model.state_dict().items()}
    assert all(torch.equal(sharded[k], saved[k]) for k in saved)
    # Plain (unsplit) checkpoint -> split sharded model, through DCP's full-state-dict API.
    fresh = shard_small_model(small_model(), meshes)
    set_model_state_dict(fresh, plain.state_dict(), options=full)
    assert torch.allclose(fresh(x), expected, atol=1e-6), "split model loaded from plain checkpoint differs"
    # Sharded round trip (what torch.distributed.checkpoint saves and loads).
    shards = {k: v.clone() for k, v in get_model_state_dict(model).items()}
    other = shard_small_model(small_model(), meshes)
    set_model_state_dict(other, shards)
    assert torch.allclose(other(x), expected, atol=1e-6), "sharded state dict round trip differs"
    return {"keys": list(saved)}


def memory_profile(k: int) -> tuple:
    from osdp_lightning.profiling.records import ModelProfile, UnitProfile

    unit = UnitProfile("2", ("2",), HIDDEN * HIDDEN + HIDDEN, 0, 0.0, 0.0, 0,
                       linear_shape=(HIDDEN, HIDDEN), split_overhead_s=((k, 0.0),))
    profile = ModelProfile((unit,), 4, 4, 4, 4, 4, 8, 0)
    return unit, profile


def measure_step_bytes(meshes: tuple, k: int, sharded: int) -> int:
    """Peak minus start-of-step bytes of one forward+backward (gradients preallocated)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from osdp_lightning.runtime.replicate import build_replicate_reducer, finish_replicate
    from osdp_lightning.runtime.split import shard_split_linear, split_linear_in_module

    shard, _replicate = meshes
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                          nn.Linear(HIDDEN, 8))
    if k == 1:
        fully_shard(model[2], mesh=shard, reshard_after_forward=True)
    else:  # as plans apply it: replicated slices on DDP's reducer (what the cost prices)
        shard_split_linear(split_linear_in_module(model, "2", k), sharded, shard, None)
    for index in (0, 4):
        fully_shard(model[index], mesh=shard)
    finish_replicate(model, shard)  # the root's fully_shard, replicated slices left to the reducer
    if not isinstance(model, FSDPModule):
        fully_shard(model, mesh=shard)
    build_replicate_reducer(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(4, 32)
    for _ in range(2):  # optimizer state and gradient shards exist before the measured step
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    tracker = FSDPMemTracker(model, optimizer)
    tracker.track_inputs((x,))
    with tracker:
        start = tracker.get_tracker_snapshot()
        model(x).sum().backward()
    device = next(iter(start))
    return tracker.get_tracker_snapshot("peak")[device]["Total"] - start[device]["Total"]


def check_memory(rank: int, meshes: tuple) -> list[dict]:
    from osdp_lightning.choices import choice_cost, split_choice
    from osdp_lightning.cost.cluster import ClusterSpec
    from osdp_lightning.cost.cost import CostContext

    cluster = ClusterSpec(world_size=WORLD, memory_budget_bytes=2**40, collective_latency_s=1e-4,
                          bandwidth_bytes_per_s=1e9)
    rows = []
    for k, sharded in ((1, 0), (2, 2), (4, 4), (8, 8), (4, 2), (4, 1)):
        unit, profile = memory_profile(max(k, 2))
        cost = choice_cost(unit, "zero3" if k == 1 else split_choice(k, sharded), CostContext(profile, cluster))
        rows.append({"k": k, "sharded": sharded, "measured_bytes": measure_step_bytes(meshes, k, sharded),
                     "predicted_bytes": cost.held_bytes + cost.transient_bytes})
    for row in rows:
        row["error"] = row["predicted_bytes"] / row["measured_bytes"] - 1
        if row["k"] > 1:
            assert abs(row["error"]) <= MEM_TOL, f"split memory off by more than {MEM_TOL:.0%}: {row}"
    # Splitting must cut what the zero3 unit adds on top of the step start as 2/k predicts.
    zero3 = rows[0]["measured_bytes"]
    for row in rows[1:4]:
        assert row["measured_bytes"] < zero3 * (2.0 / row["k"] + MEM_TOL), row
    return rows


def checks(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    meshes = (init_device_mesh("cpu", (WORLD,)),
              init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("replicate", "shard")))
    return {"training": check_training(rank, meshes), "checkpoints": check_checkpoints(rank, meshes),
            "memory": check_memory(rank, meshes)}


if __name__ == "__main__":
    main(checks, WORLD)
