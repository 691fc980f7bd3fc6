"""Replicated parameters with DDP's own machinery, beside FSDP2's sharded units.

Every parameter a plan replicates (``replicate`` units, the root when it is ``replicate``, the
replicated slices of ``split(k, j)`` layers) stays a plain ``torch.Tensor`` on every rank and is
handed to ONE ``torch.nn.parallel.DistributedDataParallel`` built over an ``nn.ParameterList`` of
them. DDP's C++ reducer then does what Lightning's ``strategy="ddp"`` does: gradients are copied
into ~25 MiB buckets as autograd produces them and each full bucket is all-reduced asynchronously,
overlapped with the rest of backward; the last bucket is waited for at the end of backward. No
parameter is copied or re-allocated per step (FSDP2 on a (W, 1) mesh copies every unit into an
all-gather buffer and back and all-reduces per unit: 0.61x Lightning's DDP on the bench preset).

The DDP module is never called: like torch's composable ``replicate`` (which cannot be used here:
it skips every parameter below a ``fully_shard`` module, and the FSDP2 root is above everything),
forward hooks on the outermost module run DDP's ``_pre_forward`` / ``_post_forward`` around the
whole forward. Sharded units keep ``fully_shard``; the FSDP2 root is given the replicated
parameters as ``ignored_params`` so that it neither shards them nor reduces their gradients.

Gradients are bucket views (``gradient_as_bucket_view=True``): the reducer's buckets are the
gradients, so replication costs parameter + gradient + optimizer state and no second gradient
copy (DDP's default, which Lightning uses, keeps both).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from osdp_lightning.runtime.shutdown import release_at_exit

BUCKET_CAP_MB = 25
"""DDP's default bucket size (Lightning's ``strategy="ddp"`` uses it too)."""
_ATTRIBUTE = "_osdp_replicate"
_MARK = "_osdp_replicated"


class ReplicateReducer:
    """DDP's bucketed, overlapped gradient all-reduce for a set of plain parameters.

    Build it with :func:`apply_replicate`; find it again with :func:`replicate_reducer`.
    """

    def __init__(self, params: list[nn.Parameter], process_group: dist.ProcessGroup | None = None,
                 bucket_cap_mb: float = BUCKET_CAP_MB, gradient_as_bucket_view: bool = True) -> None:
        self.params = params
        """The replicated parameters (plain tensors, the same on every rank), in model order."""
        # NOTE: DDP broadcasts rank 0's values at construction (a collective: every rank builds it).
        self.ddp = DistributedDataParallel(
            nn.ParameterList(params), process_group=process_group, bucket_cap_mb=bucket_cap_mb,
            gradient_as_bucket_view=gradient_as_bucket_view, forward_sync_buffers=False)
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self._handles: list[Any] = []

    @property
    def requires_gradient_sync(self) -> bool:
        return bool(self.ddp.require_backward_grad_sync)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """Whether the next forward's backward all-reduces; ``False`` accumulates locally (no-sync).

        As with DDP's ``no_sync()``, set it before the forward of a micro-batch: the reducer
        decides at the end of forward. The first synced backward after local ones all-reduces the
        accumulated gradients.
        """
        self.ddp.require_backward_grad_sync = requires_gradient_sync

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's ``no_sync()`` for these parameters: forwards and backwards inside skip the all-reduce."""
        previous = self.requires_gradient_sync
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(previous)

    def attach(self, root: nn.Module) -> None:
        """Run DDP's per-forward bookkeeping around ``root``'s forward (the outermost module)."""
        self._handles = [root.register_forward_pre_hook(self._pre_forward, prepend=True),
                         root.register_forward_hook(self._post_forward)]
        root.__dict__[_ATTRIBUTE] = self  # a plain attribute: DDP must not become a submodule

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        self.ddp._pre_forward()

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self.ddp._post_forward(output)


def replicated_parameters(modules: Iterable[nn.Module], extra: Iterable[nn.Parameter] = ()) -> list[nn.Parameter]:
    """Unique parameters of ``modules`` (their subtrees) and ``extra``, in order; tied ones once."""
    seen: dict[int, nn.Parameter] = {}
    for module in modules:
        for param in module.parameters():
            seen.setdefault(id(param), param)
    for param in extra:
        seen.setdefault(id(param), param)
    return list(seen.values())


def apply_replicate(root: nn.Module, params: list[nn.Parameter],
                    process_group: dist.ProcessGroup | None = None,
                    gradient_as_bucket_view: bool = True) -> ReplicateReducer | None:
    """Give ``params`` DDP's reducer, driven by ``root``'s forward; ``None`` when none needs a gradient.

    Every rank must call it with the same parameters in the same order. ``params`` must be plain
    tensors: apply it before any ``fully_shard`` that could take them, and pass them to the
    enclosing ``fully_shard`` as ``ignored_params``.
    """
    if any(isinstance(p, DTensor) for p in params):
        raise ValueError("replicated parameters must be plain tensors; one is already a DTensor (fully_shard "
                         "took it): apply replicate before fully_shard and pass them as ignored_params")
    if replicate_reducer(root) is not None:
        raise RuntimeError("replicate is already applied to this module")
    trainable = [p for p in params if p.requires_grad]
    if not trainable or not dist.is_initialized() or dist.get_world_size(process_group) == 1:
        return None  # nothing to all-reduce
    if dist.get_backend(process_group) == "fake":
        # NOTE: memory checks of dry runs (a fake group, meta/fake tensors) cannot build DDP's C++
        # reducer; without it the gradients take the same bytes (bucket views or plain tensors).
        return None
    reducer = ReplicateReducer(trainable, process_group, gradient_as_bucket_view=gradient_as_bucket_view)
    reducer.attach(root)
    release_at_exit()  # the reducer holds the group: freed before finalization (shutdown.py)
    return reducer


def replicate_reducer(root: nn.Module) -> ReplicateReducer | None:
    """The reducer :func:`apply_replicate` attached to ``root`` (``None``: nothing is replicated)."""
    return root.__dict__.get(_ATTRIBUTE)


def is_replicated(param: torch.Tensor, root: nn.Module) -> bool:
    """Whether ``param`` is one of ``root``'s DDP-replicated parameters (a plain, all-reduced tensor)."""
    reducer = replicate_reducer(root)
    return reducer is not None and any(param is p for p in reducer.params)


# -- applying a plan: units are marked one by one, the reducer is built once at the end ----------
def mark_replicated(module: nn.Module) -> None:
    """Record that ``module``'s parameters (its subtree's, less what a nested unit takes) are replicated."""
    module.__dict__[_MARK] = True


def marked_parameters(root: nn.Module) -> list[nn.Parameter]:
    """Plain parameters under modules marked by :func:`mark_replicated`, in model order, each once.

    Parameters a nested ``fully_shard`` unit took are DTensors by then and left out.
    """
    seen: dict[int, nn.Parameter] = {}
    for module in root.modules():
        if module.__dict__.get(_MARK):
            for param in module.parameters():
                if not isinstance(param, DTensor):
                    seen.setdefault(id(param), param)
    order = {id(p): i for i, p in enumerate(root.parameters())}
    return sorted(seen.values(), key=lambda p: order.get(id(p), len(order)))


def finish_replicate(root: nn.Module, shard_mesh: Any, mp_policy: Any = None) -> None:
    """Give ``root`` the ``fully_shard`` replicated units need around them; local to this rank.

    When some unit is sharded but ``root`` itself is not (its choice is ``replicate``), ``root``
    gets a ``fully_shard`` that owns no parameter: FSDP2 needs a root above its units (the root
    drives their prefetch and resharding; a unit that became a root of its own would keep its
    parameters unsharded after forward), and the replicated parameters are ignored by it.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    params = marked_parameters(root)
    sharded = any(isinstance(m, FSDPModule) for m in root.modules())
    if params and sharded and not isinstance(root, FSDPModule):
        extra = {} if mp_policy is None else {"mp_policy": mp_policy}
        fully_shard(root, mesh=shard_mesh, ignored_params=set(params), **extra)


def build_replicate_reducer(root: nn.Module) -> ReplicateReducer | None:
    """Build DDP's reducer for every marked parameter; the last step of applying a plan.

    DDP's constructor checks the parameters across ranks with a collective, so every rank must call
    this, and only once every rank applied the rest of the plan (a rank that failed before would
    leave the others blocked in that collective).
    """
    params = marked_parameters(root)
    return apply_replicate(root, params) if params else None


def ignored_for(target: nn.Module | list[nn.Module]) -> set[nn.Parameter]:
    """What a ``fully_shard(target)`` must leave alone: the replicated parameters below it."""
    modules = target if isinstance(target, list) else [target]
    return {p for module in modules for p in marked_parameters(module)}
