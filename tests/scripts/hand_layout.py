"""The layout a user writes by hand for a plan: FSDP2 on its sharded units, DDP on its replicated ones.

What osdp's applied plans are checked against (tests/test_precision.py), set up as Lightning documents
FSDP2 (``ModelParallelStrategy`` and ``configure_model``): each ``zero2`` / ``zero3`` unit of a saved
plan gets ``fully_shard(unit, reshard_after_forward=..., mp_policy=...)`` (torchtitan's
``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`` under bf16-mixed),
each ``replicate`` unit is wrapped in its parent by ``DistributedDataParallel``, and the model's
top-level modules get one ``fully_shard`` around them all (the root), which leaves the DDP units alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

BF16_POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def hand_layout_model(model_class: type[L.LightningModule], plan_path: str, precision: str) -> L.LightningModule:
    """An instance of ``model_class`` whose ``configure_model`` lays out the plan in ``plan_path`` by hand."""
    plan = json.loads(Path(plan_path).read_text())
    policy = BF16_POLICY if precision == "bf16-mixed" else MixedPrecisionPolicy()

    def configure_model(self: L.LightningModule) -> None:
        mesh = self.device_mesh["data_parallel"]
        replicated: set[nn.Parameter] = set()
        for unit in plan["units"]:
            if unit["name"] == "":
                continue  # the root: below
            modules = [self.get_submodule(name) for name in unit["module_names"]]
            if unit["choice"] == "replicate":
                for name, module in zip(unit["module_names"], modules, strict=True):
                    parent, _, child = name.rpartition(".")
                    setattr(self.get_submodule(parent), child, DistributedDataParallel(module))
                    replicated.update(module.parameters())
            elif unit["choice"] in ("zero2", "zero3"):
                fully_shard(modules if len(modules) > 1 else modules[0], mesh=mesh,
                            reshard_after_forward=unit["choice"] == "zero3", mp_policy=policy)
            else:
                raise ValueError(f"the hand layout has no {unit['choice']!r} (unit {unit['name']!r})")
        tops = [m for m in self.children() if any(True for _ in m.parameters())]
        fully_shard(tops if len(tops) > 1 else tops[0], mesh=mesh, ignored_params=replicated, mp_policy=policy)

    hand_class = type(f"Hand{model_class.__name__}", (model_class,), {"configure_model": configure_model})
    return hand_class()


def hand_layout_strategy(devices: int) -> ModelParallelStrategy:
    return ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
