"""The profile records the cost model reads: :class:`UnitProfile` (one unit's parameters, seconds
and bytes) and :class:`ModelProfile` (every unit of one model at one micro-batch size), and the
views of a profile at other unit granularities (:func:`with_parts`, :func:`with_units`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass


@dataclass(frozen=True)
class UnitProfile:
    """One unit: the module(s) that get one ``fully_shard`` call, or the root ("")."""

    name: str
    """Qualified module name; tied modules are joined with '+'; the root is ''."""
    module_names: tuple[str, ...]
    param_count: int
    """Trainable parameters owned by this unit (not by a unit inside it)."""
    frozen_param_count: int
    forward_s: float
    backward_s: float
    activation_bytes: int
    """Bytes saved for backward while this unit's forward ran."""
    linear_shape: tuple[int, int] | None = None
    """``(out_features, in_features)`` when the unit is one ``nn.Linear`` (a split candidate)."""
    split_overhead_s: tuple[tuple[int, float], ...] = ()
    """Measured extra forward+backward seconds of splitting into ``k`` slices, as ``(k, s)``."""
    output_bytes: int = 0
    """Bytes of its tensor output (recorded by the fake step; 0: not recorded)."""
    parts: tuple[UnitProfile, ...] = ()
    """Finer units inside this one (a block's large leaf modules), in execution order, measured in
    the same run; this unit's figures include theirs. :func:`with_parts` plans with them instead."""
    input_bytes: int = 0
    """Bytes of the tensors its forward receives (what it keeps from forward to backward when
    checkpointed); 0: not recorded."""
    tensor_count: int = 0
    """Trainable parameter tensors owned (the optimizer step costs a constant per tensor); 0: not known,
    priced as 2 (a Linear's weight and bias)."""
    largest_tensor_count: int = 0
    """Elements of its largest trainable parameter tensor (a replicated unit's gradients arrive one
    tensor at a time); 0: not known, priced as the whole unit."""
    interleaved: bool = False
    """Its forward runs again after another unit's started (tied embedding and head): its
    activations and held bytes may be alive at any moment of the step, not only between its
    place in the execution order and its backward."""
    backward_rise_bytes: int | None = None
    """Most bytes its backward added at once above what was alive when it started, unsharded:
    its gradients and temporaries less the saved activations it had freed by then (measured
    with the profiled micro-batch); ``None``: not measured (priced as its whole gradients)."""
    leaf_backward_rise_bytes: int | None = None
    """Most bytes the backward of any one layer inside it (a module with parameters and no children)
    added above what was alive when that layer's backward started (a Linear: its weight's gradient
    beside its input's), measured with the profiled micro-batch; ``None``: not measured (priced as
    its largest gradient)."""
    tail_activation_bytes: int = 0
    """Of :attr:`activation_bytes`, those saved after the last unit's forward (the root's: the
    loss's), which backward frees before any unit's backward starts."""
    part_of: str = ""
    """The block this unit is a part of (``''``: a unit of its own: a block, an embedding, the root)."""
    checkpoint_refusal: str = ""
    """Why it cannot be checkpointed: the error its checkpointed forward and backward raised when
    profiled (its recomputation did not replay its forward); ``''``: it replayed, or was not tried."""
    cast_param_bytes: int = 0
    """Of :attr:`activation_bytes`, autocast's low-precision copies of parameters saved for backward
    (``bf16-mixed``: 2 bytes per Linear weight). They do not grow with the micro-batch, and a unit
    whose parameters FSDP2 gathers in that dtype saves the gathered parameters instead (no copy)."""
    sharded_activation_bytes: int | None = None
    """Bytes it saves for backward as FSDP2 runs it gathering in the profile's ``param_dtype``
    (parameters and inputs cast to bf16 under ``bf16-mixed``: no autocast copies, a bf16 residual
    stream), measured with every unit so; ``None``: not measured (:attr:`activation_bytes` less the
    copies)."""
    param_dtypes: tuple[str, ...] = ()
    """The dtypes of its trainable parameters (``()``: not recorded). FSDP2 shards a group of one
    dtype: a unit with several (:attr:`mixed_dtypes`) can only be replicated."""
    forward_rise_bytes: int | None = None
    """Most bytes its forward added at once above what was alive when it started (its output
    included) when nothing is saved for backward, as a checkpointed forward runs (each intermediate
    freed once used; :mod:`osdp_lightning.profiling.forward_rise`), measured with the profiled
    micro-batch; ``None``: not measured."""

    @property
    def mixed_dtypes(self) -> bool:
        return len(self.param_dtypes) > 1


@dataclass(frozen=True)
class ModelProfile:
    """Everything the cost model needs to know about one model at one micro-batch size."""

    units: tuple[UnitProfile, ...]
    """Execution order (first forward use); the root unit last."""
    micro_batch_size: int
    param_bytes_per_element: int
    grad_bytes_per_element: int
    compute_bytes_per_element: int
    """Bytes per element of gathered parameters (as stored; autocast casts after gathering)."""
    reduce_bytes_per_element: int
    """Bytes per element of gradients as sharded units reduce them (``reduce_dtype``)."""
    optimizer_bytes_per_param: int
    activation_bytes: int
    """All bytes saved for backward in one training step at ``micro_batch_size``."""
    fixed_bytes: int = 0
    """Bytes every plan pays besides units and activations (the input batch)."""
    step_s: float = 0.0
    """Measured forward+backward seconds of the whole step (unwrapped model)."""
    optimizer_step_bytes: int = 0
    """Bytes one step of the model's optimizer allocates beside parameters, gradients and state (its
    temporaries; :func:`osdp_lightning.profiling.optim_state.optimizer_step_bytes`), with every parameter
    whole: the price of every plan (an upper bound where units are sharded); 0: not known."""
    profile_s: float = 0.0
    """Wall seconds the profiling took."""
    seconds_per_flop: float = 0.0
    """What one FLOP of the fake step's count costs where the units' seconds are priced from counted
    FLOPs (dry runs); 0: the seconds were measured."""
    param_dtype: str = ""
    """The dtype sharded units gather their parameters in (FSDP2's ``MixedPrecisionPolicy``, e.g.
    ``"bfloat16"`` under ``bf16-mixed``: :mod:`osdp_lightning.profiling.precision`); ``""``: as stored."""
    reduce_dtype: str = ""
    """The dtype sharded units reduce their gradients in; ``""``: as computed."""

    @property
    def param_count(self) -> int:
        return sum(u.param_count + u.frozen_param_count for u in self.units)


def with_measured_parts(block: UnitProfile, parts: list[UnitProfile], order: list[str]) -> UnitProfile:
    """A block's own figures (what its parts do not hold) plus its parts': the whole block."""
    parts = sorted((dataclasses.replace(p, part_of=block.name) for p in parts), key=lambda p: order.index(p.name))
    return dataclasses.replace(
        block, param_count=block.param_count + sum(p.param_count for p in parts),
        frozen_param_count=block.frozen_param_count + sum(p.frozen_param_count for p in parts),
        forward_s=block.forward_s + sum(p.forward_s for p in parts),
        backward_s=block.backward_s + sum(p.backward_s for p in parts),
        activation_bytes=block.activation_bytes + sum(p.activation_bytes for p in parts),
        cast_param_bytes=block.cast_param_bytes + sum(p.cast_param_bytes for p in parts),
        sharded_activation_bytes=_sum_known([block.sharded_activation_bytes, *(p.sharded_activation_bytes for p in parts)]),
        param_dtypes=tuple(sorted({d for u in (block, *parts) for d in u.param_dtypes})),
        tensor_count=block.tensor_count + sum(p.tensor_count for p in parts),
        largest_tensor_count=max([block.largest_tensor_count, *(p.largest_tensor_count for p in parts)]),
        linear_shape=None if parts else block.linear_shape,
        parts=tuple(parts) if len(parts) > 1 else ())  # one part: nothing to choose between


def with_parts(profile: ModelProfile, blocks: Collection[str], into_root: Collection[str] = ()) -> ModelProfile:
    """``profile`` with each unit named in ``blocks`` replaced by its parts (in execution order), and
    each unit named in ``into_root`` left to the root (no ``fully_shard`` of its own).

    What the parts do not hold (a block's norms and biases, the compute and activations between
    its parts) goes to the root, as it does when FSDP2 wraps the parts and not the block; so does
    all of a unit left to the root, as in hand-written FSDP2 (embeddings and head in the root).
    """
    units, root = [], profile.units[-1]
    rest = dict(params=0, frozen=0, forward_s=0.0, backward_s=0.0, activation_bytes=0, cast_param_bytes=0, tensors=0,
                largest=0)
    dtypes, sharded = set(root.param_dtypes), [root.sharded_activation_bytes]
    for unit in profile.units[:-1]:
        if unit.name in into_root:
            kept: tuple[UnitProfile, ...] = ()
        elif unit.name in blocks and unit.parts:
            kept = unit.parts
        else:
            units.append(unit)
            continue
        units += kept
        left_out = unit.param_count - sum(p.param_count for p in kept)
        rest["params"] += left_out
        rest["tensors"] += unit.tensor_count - sum(p.tensor_count for p in kept)
        # NOTE: which of the block's tensors its parts leave out is not recorded: upper bounds.
        rest["largest"] = max(rest["largest"], min(unit.largest_tensor_count, left_out))
        dtypes.update(unit.param_dtypes)
        kept_sharded = _sum_known([p.sharded_activation_bytes for p in kept])
        sharded += [unit.sharded_activation_bytes, None if kept_sharded is None else -kept_sharded]
        rest["frozen"] += unit.frozen_param_count - sum(p.frozen_param_count for p in kept)
        for key in ("forward_s", "backward_s", "activation_bytes", "cast_param_bytes"):
            rest[key] += getattr(unit, key) - sum(getattr(p, key) for p in kept)
    root = dataclasses.replace(
        root, param_count=root.param_count + rest["params"], frozen_param_count=root.frozen_param_count + rest["frozen"],
        tensor_count=root.tensor_count + rest["tensors"],
        largest_tensor_count=max(root.largest_tensor_count, rest["largest"]),
        forward_s=root.forward_s + rest["forward_s"], backward_s=root.backward_s + rest["backward_s"],
        activation_bytes=root.activation_bytes + rest["activation_bytes"],
        cast_param_bytes=root.cast_param_bytes + rest["cast_param_bytes"], param_dtypes=tuple(sorted(dtypes)),
        sharded_activation_bytes=_sum_known(sharded))
    return dataclasses.replace(profile, units=(*units, root))


def with_units(profile: ModelProfile, names: Collection[str]) -> ModelProfile:
    """``profile`` over the units ``names`` (a plan's units, root included): the blocks whose parts
    are named descended into them, every other unit not named left to the root (:func:`with_parts`)."""
    named = set(names)
    blocks = [u.name for u in profile.units if u.name not in named and any(p.name in named for p in u.parts)]
    into_root = [u.name for u in profile.units[:-1] if u.name not in named and u.name not in blocks]
    regrouped = with_parts(profile, blocks, into_root)
    if {u.name for u in regrouped.units} != named:
        raise ValueError(f"no unit set of this profile has the units {sorted(named)}; its units: "
                         f"{[u.name for u in profile.units]} (parts: {[p.name for u in profile.units for p in u.parts]})")
    return regrouped


def _sum_known(values: list[int | None]) -> int | None:
    """The sum, or ``None`` when any is not known."""
    return None if any(v is None for v in values) else sum(values)  # type: ignore[arg-type]
