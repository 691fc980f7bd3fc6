"""Train a toy model on two "nodes" of torchrun ranks and write what happened as JSON.

Started once per node by ``torchrun`` (see ``tests/test_hsdp_multinode.py``)::

    python -m torch.distributed.run --nnodes=2 --nproc-per-node=2 --node-rank=0 \\
        --master-addr=127.0.0.1 --master-port=29533 hsdp_train.py --out r \
        --runs '[{"name": "hsdp", "strategy": "osdp", "plan": "plan.json"}, {"name": "ddp", "strategy": "ddp"}]'

Lightning sees torchrun's environment (``num_nodes=2``, ``devices=2``). The runs train one after
another in the one process group of the launch (starting 6 interpreters costs more than a run).
With ``"strategy": "osdp"`` the given plan is applied (it may hold ``hsdp(g=2)`` and
``zero3(reshard=2)`` units), or without one the strategy times the links inside and across the
nodes and solves its own; with ``"ddp"`` Lightning's own DDP trains the same model on the same data
as the reference. Rank 0 writes every rank's losses, its node, the ranks its hsdp shard group holds,
and the collective timings measured inside and across the nodes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).parent))
from toy_models import MODELS  # noqa: E402

from osdp_lightning import OSDPStrategy  # noqa: E402
from osdp_lightning.choices import parse  # noqa: E402
from osdp_lightning.cost.cluster import environment_topology, live_cluster_spec, measure_node_collectives  # noqa: E402


def hsdp_shard_groups(module: torch.nn.Module, plan_units: list[dict]) -> dict[str, list[int]]:
    """For each hsdp unit, the global ranks of this rank's shard group (read from its DTensor mesh)."""
    groups = {}
    for unit in plan_units:
        if parse(unit["choice"]).kind != "hsdp":
            continue
        param = next(module.get_submodule(unit["module_names"][0]).parameters())
        assert isinstance(param, DTensor), f"{unit['name']} is not sharded"
        groups[unit["name"]] = dist.get_process_group_ranks(param.device_mesh.get_group("shard"))
    return groups


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", required=True,
                        help='JSON list of runs, each {"name", "strategy": "osdp"|"ddp", "plan"?, "budget"?, '
                             '"model"?, "steps"?}, trained one after another in one process group')
    parser.add_argument("--out", required=True, help="rank 0 writes <out>.<name>.json for each run")
    args = parser.parse_args()
    for run in json.loads(args.runs):
        gathered = fit(run)
        if dist.get_rank() == 0:
            Path(f"{args.out}.{run['name']}.json").write_text(json.dumps(gathered, indent=1))
    dist.destroy_process_group()


def fit(run: dict) -> list[dict]:
    """Train one run (the process group of an earlier run is reused); every rank's result."""
    L.seed_everything(0, workers=True)
    osdp = run["strategy"] == "osdp"
    strategy = OSDPStrategy(plan=run.get("plan"), memory_budget=run.get("budget")) if osdp else "ddp"
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, num_nodes=2, max_steps=run.get("steps", 5),
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, deterministic=True)
    with trainer.init_module(empty_init=run.get("meta", False)):  # "meta": built on the meta device
        model = MODELS[run.get("model", "mlp")]()
    trainer.fit(model)
    world_size, ranks_per_node = environment_topology()
    timings = measure_node_collectives(torch.device("cpu"), ranks_per_node)
    spec = live_cluster_spec(world_size=world_size, ranks_per_node=ranks_per_node, memory_budget_bytes=2**30,
                             timings=None, node_timings=timings)
    plan = getattr(trainer.strategy, "_plan", None)
    result = {"rank": trainer.global_rank, "node_rank": trainer.node_rank, "losses": model.losses,
              "shard_groups": hsdp_shard_groups(model, plan.to_dict()["units"]) if plan else {},
              "plan": plan.to_dict() if plan else None,
              "strategy_measured_nodes": isinstance(trainer.strategy, OSDPStrategy)
              and trainer.strategy.cluster_spec().inter_node_bandwidth_bytes_per_s is not None,
              "num_nodes": spec.num_nodes, "local_world_size": spec.local_world_size,
              "intra_bandwidth_bytes_per_s": timings.intra_bandwidth_bytes_per_s,
              "inter_bandwidth_bytes_per_s": timings.inter_bandwidth_bytes_per_s,
              "inter_latency_s": timings.inter_latency_s}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if trainer.global_rank == 0 and plan is not None:
        print(plan.format_table())
    return gathered


if __name__ == "__main__":
    main()
