"""The device meshes every choice applies to: a 1-D shard mesh, a 2-D (W, 1) replicate mesh and a
2-D (W/g, g) mesh per hsdp group size. Built in the same order on every rank (a different mesh on
one rank would deadlock the first collective)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class Meshes:
    shard: DeviceMesh
    """1-D mesh over all ranks: zero2/zero3 shard parameters across it."""
    replicate: DeviceMesh
    """2-D (W, 1) mesh: FSDP2 on it keeps whole parameters and all-reduces gradients (DDP).
    Resharding after forward there frees the local unsharded copy (no collective: one rank)."""
    groups: dict[int, DeviceMesh] = field(default_factory=dict)
    """2-D (W/g, g) meshes by group size g, for ``hsdp(g=G)``: a row is g consecutive ranks (one
    node when g is the ranks per node), sharded inside the row and replicated across rows."""


def build_meshes(device_type: str, world_size: int, group_sizes: tuple[int, ...] = ()) -> Meshes:
    # NOTE: fully_shard refuses a 2-D mesh without mesh_dim_names (torch 2.13).
    return Meshes(
        shard=init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",)),
        replicate=init_device_mesh(device_type, (world_size, 1), mesh_dim_names=("replicate", "shard")),
        groups={g: group_mesh(device_type, world_size, g) for g in sorted(set(group_sizes))},
    )


def group_mesh(device_type: str, world_size: int, group: int) -> DeviceMesh:
    if world_size % group:
        raise ValueError(f"hsdp group size {group} does not divide the world size {world_size}")
    return init_device_mesh(device_type, (world_size // group, group), mesh_dim_names=("replicate", "shard"))
