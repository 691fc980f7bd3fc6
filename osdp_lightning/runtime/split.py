"""Operator splitting (OSDP, arXiv 2209.13258): a Linear cut along ``in_features`` into ``k`` slices.

``y = x W^T + b`` equals ``sum_i x_i W_i^T + b`` where ``x_i`` and ``W_i`` are the i-th column
blocks of ``x`` and ``W``. Each block is its own ``nn.Linear`` child, so FSDP2 can give every
slice its own ``fully_shard`` call (its own all-gather group): a sharded slice materialises only
``out * in / k`` parameters while it runs, and slices may be sharded or replicated independently.

Checkpoints stay canonical: ``state_dict()`` has ``weight`` ``[out, in]`` and ``bias`` ``[out]``
exactly like the ``nn.Linear`` it replaces, and loading a canonical checkpoint cuts ``weight``
into the slices. Slice names never reach a checkpoint, also when the slices are FSDP2 DTensors on
different meshes (see :func:`merge_slice_weights`).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from osdp_lightning.runtime.replicate import mark_replicated

DEFAULT_SPLIT_FACTORS: tuple[int, ...] = (2, 4, 8)


class SplitLinear(nn.Module):
    """``nn.Linear`` computed as ``k`` column slices whose outputs are summed, bias added once.

    Children ``slices.{i}`` are ``nn.Linear(in_features // k, out_features, bias=False)``; the
    bias is a parameter of this module (under FSDP2 it belongs to the enclosing ``fully_shard``).
    """

    def __init__(self, in_features: int, out_features: int, k: int, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        check_split_factor(in_features, k)
        self.in_features, self.out_features, self.k = in_features, out_features, k
        self.slice_in_features = in_features // k
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.slices = nn.ModuleList(
            nn.Linear(self.slice_in_features, out_features, bias=False, **factory) for _ in range(k))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()
        self._load_prefix = ""
        self.register_state_dict_post_hook(_canonical_state_dict_hook)
        self.register_load_state_dict_pre_hook(_split_loaded_weight_hook)
        self.register_load_state_dict_post_hook(_canonical_missing_keys_hook)

    @classmethod
    def from_linear(cls, linear: nn.Linear, k: int) -> SplitLinear:
        """A ``SplitLinear`` with ``linear``'s weights (copied), dtype, device and requires_grad."""
        if isinstance(linear.weight, DTensor):
            raise ValueError("split a Linear before fully_shard is applied to it (its weight is a DTensor)")
        weight = linear.weight
        split = cls(linear.in_features, linear.out_features, k, bias=linear.bias is not None,
                    device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            for piece, block in zip(split.slices, weight.split(split.slice_in_features, dim=1), strict=True):
                piece.weight.copy_(block)
                piece.weight.requires_grad_(weight.requires_grad)
            if linear.bias is not None:
                split.bias.copy_(linear.bias)
                split.bias.requires_grad_(linear.bias.requires_grad)
        return split.train(linear.training)

    def reset_parameters(self) -> None:
        # NOTE: the same distribution as nn.Linear (kaiming_uniform with a=sqrt(5) reduces to
        # U(-1/sqrt(fan_in), 1/sqrt(fan_in))), with fan_in of the whole layer, not of one slice.
        bound = 1.0 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
        with torch.no_grad():
            for piece in self.slices:
                piece.weight.uniform_(-bound, bound)
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"SplitLinear expects last dimension {self.in_features}, got {tuple(x.shape)}")
        pieces = x.split(self.slice_in_features, dim=-1)  # k views (..., in/k), no copy
        out = self.slices[0](pieces[0])  # (..., out)
        for piece, x_i in zip(list(self.slices)[1:], pieces[1:], strict=True):
            # NOTE: out of place: FSDP2 hooks the slice outputs for its backward; keep them intact.
            out = out + piece(x_i)
        return out if self.bias is None else out + self.bias

    @property
    def weight(self) -> torch.Tensor:
        """The ``[out, in]`` weight, for reading: a detached copy concatenated from the slices.

        Writing to it does not change the layer. Under FSDP2 it is a DTensor sharded like the
        sharded slices (see :func:`merge_slice_weights`), read through each slice's
        ``state_dict()`` so that FSDP2 hands over its stored (sharded) parameters even between
        forward and backward, when the registered ones are compute-dtype copies.
        """
        with torch.no_grad():
            return merge_slice_weights([piece.state_dict()["weight"] for piece in self.slices])

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` with the merged weights (gathers DTensor slices: a collective)."""
        weight = self.weight
        if isinstance(weight, DTensor):
            weight = weight.full_tensor()
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(weight)
            if self.bias is not None:
                bias = self.bias.full_tensor() if isinstance(self.bias, DTensor) else self.bias
                linear.bias.copy_(bias)
        return linear.train(self.training)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, k={self.k}, "
                f"bias={self.bias is not None}")

    def slice_keys(self, prefix: str = "") -> list[str]:
        """The slices' own state-dict keys (``{prefix}slices.{i}.weight``), which checkpoints never show."""
        return [f"{prefix}slices.{i}.weight" for i in range(self.k)]


def _canonical_state_dict_hook(module: SplitLinear, state_dict: dict[str, Any], prefix: str,
                               local_metadata: dict[str, Any]) -> None:
    """Replace ``slices.{i}.weight`` by one ``weight`` and keep nn.Linear's key order."""
    keys = module.slice_keys(prefix)
    if not all(key in state_dict for key in keys):
        return  # a custom state_dict that dropped them; nothing canonical to build
    with torch.no_grad():
        weight = merge_slice_weights([state_dict.pop(key) for key in keys])
    bias = state_dict.pop(prefix + "bias", None)
    state_dict[prefix + "weight"] = weight
    if bias is not None:
        state_dict[prefix + "bias"] = bias


def _split_loaded_weight_hook(module: SplitLinear, state_dict: dict[str, Any], prefix: str,
                              local_metadata: dict[str, Any], strict: bool, missing_keys: list[str],
                              unexpected_keys: list[str], error_msgs: list[str]) -> None:
    """Cut a canonical ``weight`` into the slices' keys, in each slice's current layout."""
    module._load_prefix = prefix
    key = prefix + "weight"
    if key not in state_dict:
        return
    weight = state_dict.pop(key)
    expected = (module.out_features, module.in_features)
    if tuple(weight.shape) != expected:
        error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(weight.shape)} "
                          f"from checkpoint, the shape in current model is {torch.Size(expected)}.")
        return
    for piece in module.slices:
        # NOTE: FSDP2 registers unsharded params between forward and backward; load into the
        # sharded layout, as FSDP2's own load pre-hook would.
        if hasattr(piece, "reshard"):
            piece.reshard()
    with torch.no_grad():
        pieces = split_canonical_weight(weight, [piece.weight for piece in module.slices])
    state_dict.update(zip(module.slice_keys(prefix), pieces, strict=True))


def _canonical_missing_keys_hook(module: SplitLinear, incompatible_keys: Any) -> None:
    """Report a missing ``weight`` instead of missing slice keys."""
    missing = incompatible_keys.missing_keys
    slice_keys = set(module.slice_keys(module._load_prefix))
    if slice_keys.intersection(missing):
        missing[:] = [key for key in missing if key not in slice_keys]
        missing.append(module._load_prefix + "weight")

# --- canonical weight <-> slices, for plain tensors and FSDP2 DTensors ---------------------------
# NOTE: FSDP2 shards dim 0 (out_features) with torch.chunk semantics and every slice has the same
# rows, so a rank's row block of the canonical [out, in] weight is the column-wise concatenation
# of its row blocks of the slices: no communication when the slices share a layout.


def _row_layout(t: DTensor) -> bool:
    """Whether ``t`` only replicates or shards dim 0 (the FSDP2 and HSDP layouts)."""
    return all(isinstance(p, Replicate) or (type(p) is Shard and p.dim == 0) for p in t.placements)


def _same_layout(t: torch.Tensor, mesh: Any, placements: tuple[Placement, ...]) -> bool:
    return isinstance(t, DTensor) and t.device_mesh == mesh and tuple(t.placements) == tuple(placements)


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor; a collective only when the local tensor is not already the whole."""
    if not isinstance(t, DTensor):
        return t
    mesh = t.device_mesh
    if all(isinstance(p, Replicate) or mesh.size(dim) == 1 for dim, p in enumerate(t.placements)):
        return t.to_local()
    return t.full_tensor()


def _in_layout_of(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``full`` laid out like ``target`` (every rank holds ``full``, so no communication)."""
    if not isinstance(target, DTensor):
        return full
    return distribute_tensor(full.detach(), target.device_mesh, target.placements, src_data_rank=None)


def merge_slice_weights(weights: list[torch.Tensor]) -> torch.Tensor:
    """The canonical ``[out, in]`` weight from the slices' ``[out, in/k]`` weights.

    Plain tensors are concatenated. With DTensors the result is a DTensor laid out like the first
    sharded slice (a sharded state dict stays sharded: each rank holds its rows), built from local
    blocks; a slice with another layout (a replicated slice on the (W, 1) mesh, or an unsharded
    parameter between forward and backward) contributes the rows this rank owns, cut from its
    local tensor, which is the whole slice: no communication. Layouts other than FSDP2's (not
    sharded on dim 0) are gathered and give a plain tensor.
    """
    dtensors = [w for w in weights if isinstance(w, DTensor)]
    if not dtensors:
        return torch.cat(weights, dim=1)
    target = next((w for w in dtensors if any(p.is_shard() for p in w.placements)), dtensors[0])
    if not _row_layout(target):
        return torch.cat([_full(w) for w in weights], dim=1)
    mesh, placements = target.device_mesh, tuple(target.placements)
    local = [w.to_local() if _same_layout(w, mesh, placements) else _in_layout_of(_full(w), target).to_local()
             for w in weights]
    rows, cols = weights[0].shape[0], sum(w.shape[1] for w in weights)
    return DTensor.from_local(torch.cat(local, dim=1), mesh, placements, run_check=False,
                              shape=torch.Size((rows, cols)), stride=(cols, 1))


def split_canonical_weight(weight: torch.Tensor, targets: list[torch.Tensor]) -> list[torch.Tensor]:
    """Cut a canonical ``[out, in]`` weight into one tensor per slice, laid out like ``targets[i]``.

    ``targets`` are the slices' current parameters (plain tensors or DTensors). A DTensor weight in
    a slice's own layout is cut locally; anything else is gathered once (a collective when the
    weight is sharded) and laid out like the slice without further communication.
    """
    width = weight.shape[1] // len(targets)
    local_ok = isinstance(weight, DTensor) and _row_layout(weight)
    local_blocks = weight.to_local().split(width, dim=1) if local_ok else None
    full_blocks = None
    pieces = []
    for index, target in enumerate(targets):
        if local_ok and _same_layout(target, weight.device_mesh, tuple(weight.placements)):
            pieces.append(DTensor.from_local(local_blocks[index].contiguous(), weight.device_mesh,
                                             weight.placements, run_check=False, shape=target.shape,
                                             stride=target.stride()))
            continue
        if full_blocks is None:
            full_blocks = _full(weight).split(width, dim=1)
        pieces.append(_in_layout_of(full_blocks[index].contiguous(), target))
    return pieces


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]


def check_split_factor(in_features: int, k: int) -> None:
    """Raise a ``ValueError`` naming the factors that would work when ``k`` cannot split ``in_features``."""
    if isinstance(k, int) and k >= 2 and in_features % k == 0:
        return
    divisors = _divisors(in_features)
    shown = ", ".join(map(str, divisors[:24])) + (", ..." if len(divisors) > 24 else "")
    hint = f"valid k for in_features={in_features}: {shown}" if divisors else "no k >= 2 divides it"
    raise ValueError(f"cannot split in_features={in_features} into k={k} equal slices "
                     f"(k must be an integer >= 2 that divides in_features); {hint}")


def valid_split_factors(in_features: int, candidates: tuple[int, ...] = DEFAULT_SPLIT_FACTORS) -> tuple[int, ...]:
    """The candidates that split ``in_features`` into equal slices, ascending (``k = 1`` is no split)."""
    return tuple(sorted({k for k in candidates if k >= 2 and in_features % k == 0}))


def split_linear_in_module(root: nn.Module, qualified_name: str, k: int) -> SplitLinear:
    """Replace the ``nn.Linear`` at ``qualified_name`` inside ``root`` by a ``SplitLinear``; return it.

    Only exact ``nn.Linear`` modules are split: subclasses (for example attention's ``out_proj``)
    may read ``.weight`` directly, which a split layer only offers as a copy. A Linear whose weight
    is shared with another module is refused: splitting would untie it.
    """
    if not qualified_name:
        raise ValueError("cannot split the root module in place; split a Linear inside it")
    parent_name, _, child_name = qualified_name.rpartition(".")
    parent = root.get_submodule(parent_name)
    linear = getattr(parent, child_name)
    if type(linear) is not nn.Linear:
        raise TypeError(f"{qualified_name!r} is {type(linear).__name__}, only nn.Linear can be split")
    uses = sum(param is linear.weight for _, param in root.named_parameters(remove_duplicate=False))
    if uses > 1:
        raise ValueError(f"{qualified_name!r} shares its weight with another module; splitting would untie it")
    split = SplitLinear.from_linear(linear, k)
    setattr(parent, child_name, split)
    return split


def shard_split_linear(split: SplitLinear, sharded: int, shard_mesh: Any, replicate_mesh: Any | None,
                       mp_policy: Any = None) -> None:
    """Apply FSDP2 to each slice of ``split``: the first ``sharded`` slices zero3, the rest replicated.

    ``shard_mesh`` is a 1-D mesh over all ranks. ``replicate_mesh``: a (W, 1) mesh with
    ``mesh_dim_names`` puts the replicated slices on FSDP2 (pure replication); ``None`` marks them
    for DDP's reducer (``osdp_lightning.runtime.replicate``, what plans use: no copies, bucketed
    all-reduce), which the caller then builds with ``finish_replicate``. The bias is left to the
    enclosing ``fully_shard`` call, which the caller must make afterwards (as for any FSDP2
    model). Every rank must make the same calls (same ``sharded``), or collectives deadlock.
    """
    if not 0 <= sharded <= split.k:
        raise ValueError(f"sharded must be in [0, {split.k}], got {sharded}")
    if shard_mesh.ndim != 1:
        raise ValueError(f"shard_mesh must be 1-D, got {shard_mesh.ndim}-D")
    if replicate_mesh is not None and (replicate_mesh.ndim != 2 or replicate_mesh.mesh_dim_names is None):
        raise ValueError("replicate_mesh must be a 2-D (W, 1) mesh with mesh_dim_names")
    extra = {} if mp_policy is None else {"mp_policy": mp_policy}
    for index, piece in enumerate(split.slices):
        if index < sharded:
            fully_shard(piece, mesh=shard_mesh, reshard_after_forward=True, **extra)
        elif replicate_mesh is None:
            mark_replicated(piece)
        else:
            fully_shard(piece, mesh=replicate_mesh, reshard_after_forward=False, **extra)


def _forward_backward_s(module: nn.Module, x: torch.Tensor, grad_out: torch.Tensor | None) -> float:
    sync = torch.cuda.synchronize if x.device.type == "cuda" else (lambda: None)
    inputs = [x] + [p for p in module.parameters() if p.requires_grad]
    sync()
    start = time.perf_counter()
    out = module(x)
    if grad_out is not None and out.requires_grad:
        torch.autograd.grad(out, [t for t in inputs if t.requires_grad], grad_out)
    sync()
    return time.perf_counter() - start


def measure_split_overhead_s(linear: nn.Linear, example_input: torch.Tensor, k: int, repeats: int = 5,
                             min_total_s: float = 0.05, max_repeats: int = 100) -> float:
    """Median extra forward+backward seconds of ``SplitLinear.from_linear(linear, k)`` over ``linear``.

    Runs both on ``example_input`` (a real input of the unit's shape), alternating so that drift
    hits both alike, and takes the median of the paired differences; never negative. At least
    ``repeats`` pairs, more (up to ``max_repeats``) until the plain layer has run ``min_total_s``:
    small layers take a fraction of a millisecond, where five samples are mostly noise.
    Gradients are returned by ``torch.autograd.grad``, so ``linear``'s ``.grad`` is left
    untouched. The input is treated as requiring grad (a Linear inside a network also computes
    its input gradient).
    """
    split = SplitLinear.from_linear(linear, k)
    x = example_input.detach().requires_grad_(example_input.is_floating_point())
    with torch.no_grad():
        out = linear(x)
    grad_out = torch.ones_like(out) if x.requires_grad or any(p.requires_grad for p in linear.parameters()) else None
    for module in (linear, split):  # warm-up: allocator and kernel selection
        _forward_backward_s(module, x, grad_out)
    differences: list[float] = []
    plain_total_s = 0.0
    while len(differences) < max(1, repeats) or (plain_total_s < min_total_s and len(differences) < max_repeats):
        plain_s = _forward_backward_s(linear, x, grad_out)
        differences.append(_forward_backward_s(split, x, grad_out) - plain_s)
        plain_total_s += plain_s
    return max(0.0, statistics.median(differences))
