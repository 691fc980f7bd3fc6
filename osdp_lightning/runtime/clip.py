"""Gradient clipping under a mixed plan: what DDP clips to, with gradients on different meshes.

``torch.nn.utils.clip_grad_norm_`` stacks the per-gradient norms, which DTensor refuses when the
gradients live on different meshes (zero3 on the 1-D shard mesh, replicate on the (W, 1) mesh,
hsdp on a (W/g, g) mesh), and plain tensors (replicated units reduced outside FSDP2) cannot be
mixed with DTensors at all. Here every gradient contributes the p-th power of its local norm,
divided by how many ranks hold the same local tensor (the mesh dimensions it is replicated on,
or the whole world for a plain tensor), and one all-reduce over the world sums the
contributions: the total norm of the averaged gradients, as DDP computes it. Scaling and value
clipping act on the local tensors (elementwise, so no communication).

Lightning routes ``gradient_clip_val`` / ``LightningModule.clip_gradients`` /
``configure_gradient_clipping`` through the precision plugin's ``clip_grad_by_norm`` and
``clip_grad_by_value``; :func:`with_sharded_clipping` gives the strategy's plugin these two.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from torch.distributed.tensor import DTensor, Replicate

# NOTE: the same epsilon as torch.nn.utils.clip_grads_with_norm_, so the coefficient equals DDP's.
_EPS = 1e-6


def _grads(parameters: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in parameters if p.grad is not None]


def _local(grad: torch.Tensor) -> torch.Tensor:
    # NOTE: under no_grad, DTensor.to_local() returns the stored local tensor itself (in-place safe).
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _copies(grad: torch.Tensor, world_size: int) -> int:
    """How many ranks hold this rank's local tensor of ``grad``."""
    if not isinstance(grad, DTensor):
        return world_size  # a plain tensor: reduced, whole and equal on every rank
    mesh = grad.device_mesh
    return math.prod(mesh.size(dim) for dim, p in enumerate(grad.placements) if isinstance(p, Replicate))


def total_grad_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all gradients together, on every rank (one all-reduce when distributed)."""
    grads = _grads(parameters)
    norm_type = float(norm_type)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if not grads:
        return torch.tensor(0.0)
    device = _local(grads[0]).device
    if math.isinf(norm_type):
        total = torch.stack([_local(g).detach().abs().max() if _local(g).numel() else torch.zeros((), device=device)
                             for g in grads]).max().float()
        if world > 1:
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
        return total
    total = torch.zeros((), dtype=torch.float32, device=device)
    for grad in grads:
        local = _local(grad).detach()
        total += torch.linalg.vector_norm(local, norm_type).float() ** norm_type / _copies(grad, world)
    if world > 1:
        dist.all_reduce(total)
    return total ** (1.0 / norm_type)


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0, *,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for gradients on any mix of meshes; returns the total norm."""
    parameters = list(parameters)
    total = total_grad_norm(parameters, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):  # NOTE: torch's check and message, before scaling
        raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, "
                           "so it cannot be clipped. To disable this error and scale the gradients by the non-finite "
                           "norm anyway, set `error_if_nonfinite=False`")
    coefficient = torch.clamp(max_norm / (total + _EPS), max=1.0)
    with torch.no_grad():
        for grad in _grads(parameters):
            local = _local(grad)
            local.mul_(coefficient.to(local.device, local.dtype))
    return total


def clip_grad_value_(parameters: Iterable[torch.Tensor], clip_value: float) -> None:
    """``torch.nn.utils.clip_grad_value_`` for gradients on any mix of meshes (elementwise, local)."""
    with torch.no_grad():
        for grad in _grads(parameters):
            _local(grad).clamp_(min=-clip_value, max=clip_value)


class _ShardedClipping:
    """Precision-plugin methods that Lightning's clipping calls, for gradients on mixed meshes."""

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        clip_grad_norm_(self.main_params(optimizer), clip_val)  # type: ignore[attr-defined]

    def clip_grad_by_value(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        clip_grad_value_(self.main_params(optimizer), clip_val)  # type: ignore[attr-defined]


_CLASSES: dict[type, type] = {}


def with_sharded_clipping(plugin: Precision) -> Precision:
    """``plugin`` itself, its class extended so that clipping works on mixed meshes.

    The class keeps every other behaviour (and ``isinstance`` checks) of the user's or Lightning's
    plugin; only the two clipping methods change.
    """
    cls = type(plugin)
    if issubclass(cls, _ShardedClipping):
        return plugin
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Sharded{cls.__name__}", (_ShardedClipping, cls), {"__module__": __name__})
    plugin.__class__ = _CLASSES[cls]
    return plugin
