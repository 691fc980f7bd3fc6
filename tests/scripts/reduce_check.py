"""osdp's reduce-scatter on gloo (osdp_lightning/runtime/collectives.py) on 2 ranks: results and memory.

Run as a script (it spawns its own 2 ranks unless a launcher started them):
    python reduce_check.py [--out result.json]

1. ``reduce_in_place`` gives exactly what torch's ``dist.reduce_scatter_single`` gives (sum and max);
2. MemTracker: it allocates nothing beyond its input and output, where gloo's own collective
   makes a buffer of the input's size (recorded, not checked: that is torch's business);
3. FSDP2 modules given ``InPlaceReduceScatter`` by ``reduce_in_place_on_gloo`` train to the same
   losses and parameters as with FSDP2's own reduce-scatter.
Rank 0 writes the figures as JSON; any failed check raises (non-zero exit code).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from gloo_checks import main
from torch import nn

WORLD = 2
NUMEL = WORLD * 300_001  # odd chunks: nothing lines up by luck
TORCH_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # the newer name


def check_results(rank: int) -> dict:
    from osdp_lightning.runtime.collectives import reduce_in_place

    generator = torch.Generator().manual_seed(rank)
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
        data = torch.randn(NUMEL, generator=generator)
        expected, got = torch.empty(NUMEL // WORLD), torch.empty(NUMEL // WORLD)
        TORCH_REDUCE_SCATTER(expected, data.clone(), op=op)
        reduce_in_place(got, data.clone(), dist.group.WORLD, op)
        assert torch.equal(got, expected), f"{op}: in-place reduce differs by {(got - expected).abs().max()}"
    return {"ops": ["sum", "max"], "numel": NUMEL}


def tracked_rise_bytes(reduce) -> int:  # noqa: ANN001
    """Peak minus starting bytes MemTracker sees while ``reduce(output, input)`` runs."""
    from torch.distributed._tools.mem_tracker import MemTracker

    data, output = torch.randn(NUMEL), torch.empty(NUMEL // WORLD)
    tracker = MemTracker()
    tracker.track_external(data, output)
    with tracker:
        start = tracker.get_tracker_snapshot()
        reduce(output, data)
    peak = tracker.get_tracker_snapshot("peak")
    return max(p["Total"] - start.get(dev, {}).get("Total", 0) for dev, p in peak.items())


def check_memory() -> dict:
    from osdp_lightning.runtime.collectives import reduce_in_place

    ours = tracked_rise_bytes(lambda out, data: reduce_in_place(out, data, dist.group.WORLD, dist.ReduceOp.SUM))
    gloo = tracked_rise_bytes(lambda out, data: TORCH_REDUCE_SCATTER(out, data))
    assert ours == 0, f"the in-place reduce-scatter allocated {ours} bytes"
    return {"input_bytes": NUMEL * 4, "in_place_rise_bytes": ours, "gloo_rise_bytes": gloo}


def blocks() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(96, 96), nn.Tanh()) for _ in range(3)), nn.Linear(96, 5))


def train(in_place: bool, rank: int, mesh) -> tuple[list[float], dict[str, torch.Tensor]]:  # noqa: ANN001
    from torch.distributed.fsdp import fully_shard

    from osdp_lightning.runtime.collectives import reduce_in_place_on_gloo

    model = blocks()
    for block in model[:3]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if in_place:
        assert reduce_in_place_on_gloo(model, mesh.get_group()) == 4
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator, losses = torch.Generator().manual_seed(1), []
    for _ in range(4):
        x, y = torch.randn(8 * WORLD, 96, generator=generator), torch.randn(8 * WORLD, 5, generator=generator)
        loss = nn.functional.mse_loss(model(x.chunk(WORLD)[rank]), y.chunk(WORLD)[rank])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.full_tensor() for k, v in model.state_dict().items()}


def check_training(rank: int, mesh) -> dict:  # noqa: ANN001
    own_losses, own_params = train(False, rank, mesh)
    losses, params = train(True, rank, mesh)
    assert losses == own_losses, f"losses {losses} differ from FSDP2's own reduce-scatter's {own_losses}"
    assert all(torch.equal(params[k], own_params[k]) for k in own_params), "parameters differ"
    return {"losses": losses}


def checks(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    return {"results": check_results(rank), "memory": check_memory(), "training": check_training(rank, mesh)}


if __name__ == "__main__":
    main(checks, WORLD)
