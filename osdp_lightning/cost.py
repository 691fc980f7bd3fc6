"""Stage 2: the choice table.

For every unit of a :class:`~osdp_lightning.profile.ModelProfile` and every allowed choice, the
per-rank bytes and seconds that choice costs. Pure functions of the profile and a
:class:`ClusterSpec`: no process group is needed, so tables can be built for clusters you do not
have and unit-tested exactly.

Memory terms (design.md section 3), P = parameters of the unit, W = ranks that share it:

- ``state_bytes``: persistent parameter, gradient and optimizer-state bytes (sharded or not);
- ``held_bytes``: unsharded parameters kept from forward to backward (zero2);
- ``transient_bytes``: unsharded parameters and gradients that exist only while the unit runs;
  ``prefetch_bytes`` of it (the gathered parameters) already exist while its neighbour runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from osdp_lightning.profile import ModelProfile, UnitProfile

REPLICATE = "replicate"
ZERO2 = "zero2"
ZERO3 = "zero3"
BASE_CHOICES: tuple[str, ...] = (REPLICATE, ZERO2, ZERO3)
_SPLIT_RE = re.compile(r"^split\(k=(\d+), sharded=(\d+)\)$")


def split_choice(k: int, sharded: int) -> str:
    """The choice name of a Linear cut into ``k`` slices of which ``sharded`` are zero3."""
    return f"split(k={k}, sharded={sharded})"


def parse_split_choice(choice: str) -> tuple[int, int] | None:
    """``(k, sharded)`` for a split choice name, ``None`` for any other choice."""
    match = _SPLIT_RE.match(choice)
    return (int(match.group(1)), int(match.group(2))) if match else None


_HSDP_RE = re.compile(r"^hsdp\(g=(\d+)\)$")
_ZERO3_RESHARD_RE = re.compile(r"^zero3\(reshard=(\d+)\)$")


def hsdp_choice(group: int) -> str:
    """The choice name of sharding inside groups of ``group`` consecutive ranks, replicating across."""
    return f"hsdp(g={group})"


def parse_hsdp_choice(choice: str) -> int | None:
    """The group size of an ``hsdp(g=G)`` choice name, ``None`` for any other choice."""
    match = _HSDP_RE.match(choice)
    return int(match.group(1)) if match else None


def zero3_reshard_choice(group: int) -> str:
    """The choice name of zero3 that reshards after forward only down to groups of ``group`` ranks."""
    return f"zero3(reshard={group})"


def parse_zero3_reshard_choice(choice: str) -> int | None:
    """The group size of a ``zero3(reshard=G)`` choice name, ``None`` for any other choice."""
    match = _ZERO3_RESHARD_RE.match(choice)
    return int(match.group(1)) if match else None


def is_known_choice(choice: str) -> bool:
    return (choice in BASE_CHOICES or parse_split_choice(choice) is not None
            or parse_hsdp_choice(choice) is not None or parse_zero3_reshard_choice(choice) is not None)


def split_choices_for(factors: tuple[int, ...]) -> tuple[str, ...]:
    """Every ``split(k, j)`` with ``k`` in ``factors`` and 1 <= j <= k sharded slices.

    (j = 0 would be ``replicate`` plus the cost of splitting, never better, so it is left out.)
    """
    return tuple(split_choice(k, j) for k in factors for j in range(1, k + 1))


@dataclass(frozen=True)
class ClusterSpec:
    """What the cost model needs to know about the ranks that train together."""

    world_size: int
    """Ranks in the data-parallel group."""
    memory_budget_bytes: int
    """Per-rank memory limit the plan must respect."""
    collective_latency_s: float
    """Fixed cost of one collective call (alpha)."""
    bandwidth_bytes_per_s: float
    """Bus bandwidth of a collective inside the group (bytes moved per second per rank)."""
    overlap_efficiency: float = 0.0
    """Share of neighbouring compute that really hides a collective (about 0 on CPU/gloo)."""
    headroom_bytes: int = 0
    """Part of the budget plans must leave free (allocator slack, temporaries the model does not
    see); plans are solved against ``memory_budget_bytes - headroom_bytes``."""
    ranks_per_node: int | None = None
    """Ranks that share a node; ``None`` means all of them (one node)."""
    inter_node_bandwidth_bytes_per_s: float | None = None
    """Bus bandwidth per rank of a collective whose group spans nodes; ``None``: as inside a node."""
    inter_node_latency_s: float | None = None
    """Alpha of a collective whose group spans nodes; ``None``: as inside a node."""
    peak_flops_per_s: float | None = None
    """Per-device peak FLOP/s (dry-run planning turns counted FLOPs into seconds with it)."""

    @property
    def local_world_size(self) -> int:
        return self.ranks_per_node or self.world_size

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // self.local_world_size)

    def crosses_nodes(self, group: int) -> bool:
        """Whether a group of ``group`` consecutive ranks spans more than one node."""
        return self.num_nodes > 1 and group > self.local_world_size

    def link(self, crosses_nodes: bool) -> tuple[float, float]:
        """``(latency_s, bandwidth_bytes_per_s)`` of a collective inside one node or across nodes."""
        if not crosses_nodes:
            return self.collective_latency_s, self.bandwidth_bytes_per_s
        latency = self.inter_node_latency_s if self.inter_node_latency_s is not None else self.collective_latency_s
        bandwidth = self.inter_node_bandwidth_bytes_per_s or self.bandwidth_bytes_per_s
        return latency, bandwidth

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.bandwidth_bytes_per_s <= 0:
            raise ValueError(f"bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s}")
        if not 0.0 <= self.overlap_efficiency <= 1.0:
            raise ValueError(f"overlap_efficiency must be in [0, 1], got {self.overlap_efficiency}")


@dataclass(frozen=True)
class ChoiceCost:
    """Bytes and seconds of one choice for one unit, per rank, per optimizer step."""

    choice: str
    state_bytes: int
    held_bytes: int
    transient_bytes: int
    """Unsharded bytes alive while this unit runs (its gathered parameters and gradients)."""
    compute_s: float
    comm_s: float
    prefetch_bytes: int | None = None
    """Bytes this unit already holds while a neighbour runs (FSDP2 prefetches the next all-gather,
    not its gradients); ``None`` means the whole transient."""
    exposed_s: float = 0.0
    """Part of ``comm_s`` no overlap hides: one launch latency per collective call."""
    activation_bytes: int = 0
    """Activations this unit keeps from forward to backward under this choice (per-unit, per-choice
    part of the activation term, e.g. only the input when checkpointed); activations that no
    choice changes stay in :attr:`ChoiceTable.activation_bytes`."""
    optimizer_s: float = 0.0
    """Seconds of the optimizer step over this unit's parameters as this choice stores them."""
    overhead_s: float = 0.0
    """Seconds per step of the machinery that applies the choice (FSDP2's per-unit copy-in/out,
    unshard allocation and hooks, a reducer's bucketing), besides compute and collectives."""

    @property
    def prefetch(self) -> int:
        return self.transient_bytes if self.prefetch_bytes is None else self.prefetch_bytes

    @property
    def persistent_bytes(self) -> int:
        """Bytes alive through the whole step or from this unit's forward to its backward."""
        return self.state_bytes + self.held_bytes + self.activation_bytes


@dataclass(frozen=True)
class UnitCosts:
    """All allowed choices of one unit, plus the compute that can hide its collectives."""

    name: str
    choices: tuple[ChoiceCost, ...]
    overlap_s: float

    def cost_of(self, choice: str) -> ChoiceCost:
        for cost in self.choices:
            if cost.choice == choice:
                return cost
        raise KeyError(f"unit {self.name!r} has no choice {choice!r}; it has {[c.choice for c in self.choices]}")


@dataclass(frozen=True)
class ChoiceTable:
    """The solver's whole input: units in execution order and the choice-independent bytes."""

    units: tuple[UnitCosts, ...]
    activation_bytes: int
    """Bytes saved for backward at this micro-batch size (independent of the choices)."""
    fixed_bytes: int
    """Bytes every plan pays besides units and activations (the input batch)."""
    micro_batch_size: int
    fixed_step_s: float = 0.0
    """Seconds every step pays whatever the choices (the training loop's own constant)."""


# NOTE: all-gather and reduce-scatter move (g-1)/g of the data per rank; all-reduce twice that.
# A ring is as fast as its slowest link: a group that spans nodes is charged the inter-node link
# (``crosses_nodes=None``: a group of consecutive ranks, which spans nodes when larger than a node).
def all_gather_s(nbytes: float, group: int, cluster: ClusterSpec, crosses_nodes: bool | None = None) -> float:
    if group <= 1 or nbytes <= 0:
        return 0.0
    latency, bandwidth = cluster.link(cluster.crosses_nodes(group) if crosses_nodes is None else crosses_nodes)
    return latency + nbytes * (group - 1) / group / bandwidth


reduce_scatter_s = all_gather_s


def all_reduce_s(nbytes: float, group: int, cluster: ClusterSpec, crosses_nodes: bool | None = None) -> float:
    if group <= 1 or nbytes <= 0:
        return 0.0
    latency, bandwidth = cluster.link(cluster.crosses_nodes(group) if crosses_nodes is None else crosses_nodes)
    return latency + 2 * nbytes * (group - 1) / group / bandwidth


def base_choice_cost(unit: UnitProfile, profile: ModelProfile, cluster: ClusterSpec, choice: str,
                     batch_scale: float = 1.0) -> ChoiceCost:
    """Cost of ``replicate``, ``zero2`` or ``zero3`` for one unit (design.md section 3)."""
    world = cluster.world_size
    trainable, frozen = unit.param_count, unit.frozen_param_count
    # Per-parameter bytes: stored parameter, gradient, optimizer state, and the gathered copy
    # used for compute (smaller than the stored one under bf16 FSDP mixed precision).
    stored = (trainable + frozen) * profile.param_bytes_per_element
    grads = trainable * profile.grad_bytes_per_element
    optim = trainable * profile.optimizer_bytes_per_param
    gathered = (trainable + frozen) * profile.compute_bytes_per_element
    compute_s = (unit.forward_s + unit.backward_s) * batch_scale
    latency = cluster.link(cluster.crosses_nodes(world))[0] if world > 1 else 0.0
    if choice == REPLICATE:
        # NOTE: FSDP2 on a (W, 1) mesh copies the parameters into an unsharded buffer while the
        # unit runs (resharded after forward and backward, so the copy is transient; measured with
        # FSDPMemTracker). The copy is local: the only collective is the gradient all-reduce.
        return ChoiceCost(choice, stored + grads + optim, 0, gathered, compute_s,
                          all_reduce_s(grads, world, cluster), prefetch_bytes=gathered, exposed_s=latency)
    sharded_state = _ceil_div(stored + grads + optim, world)
    reduce_s = reduce_scatter_s(trainable * profile.reduce_bytes_per_element, world, cluster)
    if choice == ZERO2:
        return ChoiceCost(choice, sharded_state, gathered, grads, compute_s,
                          all_gather_s(gathered, world, cluster) + reduce_s, exposed_s=2 * latency)
    if choice == ZERO3:
        return ChoiceCost(choice, sharded_state, 0, gathered + grads, compute_s,
                          2 * all_gather_s(gathered, world, cluster) + reduce_s, prefetch_bytes=gathered,
                          exposed_s=3 * latency)
    raise ValueError(f"unknown base choice {choice!r}; expected one of {BASE_CHOICES}")


def build_choice_table(profile: ModelProfile, cluster: ClusterSpec, micro_batch_size: int | None = None,
                       choices: tuple[str, ...] = BASE_CHOICES) -> ChoiceTable:
    """The choice table for ``profile`` on ``cluster`` at ``micro_batch_size``.

    Compute seconds and activation bytes are scaled linearly from the profiled micro-batch size.
    With one rank only ``replicate`` is offered (sharding over one rank saves nothing).
    """
    batch = micro_batch_size or profile.micro_batch_size
    scale = batch / profile.micro_batch_size
    allowed = (REPLICATE,) if cluster.world_size == 1 else choices
    units = []
    for index, unit in enumerate(profile.units):
        costs = tuple(_choice_cost(unit, profile, cluster, choice, scale)
                      for choice in allowed if _allowed_for(unit, choice))
        units.append(UnitCosts(unit.name, costs, _overlap_s(profile, index, cluster) * scale))
    return ChoiceTable(
        units=tuple(units),
        activation_bytes=int(profile.activation_bytes * scale),
        fixed_bytes=profile.fixed_bytes,
        micro_batch_size=batch,
    )


def _allowed_for(unit: UnitProfile, choice: str) -> bool:
    """Split choices only for a Linear whose ``in_features`` ``k`` divides, with measured overhead."""
    split = parse_split_choice(choice)
    if split is None:
        return True
    measured = dict(unit.split_overhead_s)
    return unit.linear_shape is not None and unit.linear_shape[1] % split[0] == 0 and split[0] in measured


def _choice_cost(unit: UnitProfile, profile: ModelProfile, cluster: ClusterSpec, choice: str,
                 scale: float) -> ChoiceCost:
    if parse_hsdp_choice(choice) is not None or parse_zero3_reshard_choice(choice) is not None:
        return group_choice_cost(unit, profile, cluster, choice, scale)
    split = parse_split_choice(choice)
    if split is None:
        return base_choice_cost(unit, profile, cluster, choice, scale)
    return split_choice_cost(unit, profile, cluster, split[0], split[1], scale)


def _overlap_s(profile: ModelProfile, index: int, cluster: ClusterSpec) -> float:
    """Neighbouring compute that can hide this unit's collectives.

    Forward all-gathers are prefetched during the previous unit's forward; backward all-gathers
    during the next unit's backward; reduce-scatters run during the previous unit's backward.
    """
    units = profile.units
    before = units[index - 1] if index > 0 else None
    after = units[index + 1] if index + 1 < len(units) else None
    hidden = 0.0
    if before is not None:
        hidden += before.forward_s + before.backward_s
    if after is not None:
        hidden += after.backward_s
    return cluster.overlap_efficiency * hidden


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def split_choice_cost(unit: UnitProfile, profile: ModelProfile, cluster: ClusterSpec, k: int, sharded: int,
                      batch_scale: float = 1.0) -> ChoiceCost:
    """Cost of ``split(k, sharded)``: a Linear cut into ``k`` slices along ``in_features``.

    The first ``sharded`` slices are zero3 (own all-gather group each), the other ``k - sharded``
    replicated on the (W, 1) mesh with ``reshard_after_forward=False``; the bias (``out``
    parameters) stays whole, in the enclosing unit's group. Assumptions, checked with
    FSDPMemTracker on 2 gloo ranks (fp32, measured within 3% of peak minus start-of-step bytes):

    - held: each replicated slice keeps its unsharded copy from forward to backward (FSDP2 on a
      (W, 1) mesh all-gathers into a second buffer, as for ``replicate``);
    - transient: slices run one after another, but FSDP2's backward prefetch gathers the next
      slice while the current one's gradient is reduced, so two consecutive slices are in flight
      (the pair rule the ILP applies between units, applied inside the unit); a sharded slice
      costs its gathered weight and gradient, a replicated one its gradient; plus one sharded
      slice's reduce-scatter output (added into the existing gradient shard) and the bias gradient;
    - communication: one all-gather group per sharded slice (latency paid per slice: two
      all-gathers and a reduce-scatter each), one all-reduce per replicated slice, and the bias
      gradient's bytes inside the enclosing unit's collective (no extra latency);
    - compute: the unit's forward and backward plus the measured overhead of ``k`` smaller
      matmuls and their sum (``unit.split_overhead_s``), all scaled with the micro-batch.
    """
    if unit.linear_shape is None:
        raise ValueError(f"unit {unit.name!r} is not a single nn.Linear; it cannot be split")
    out_features, in_features = unit.linear_shape
    if k < 2 or in_features % k:
        raise ValueError(f"k={k} does not split in_features={in_features} of unit {unit.name!r}")
    if not 0 <= sharded <= k:
        raise ValueError(f"sharded must be in [0, {k}], got {sharded}")
    overhead = dict(unit.split_overhead_s)
    if k not in overhead:
        raise ValueError(f"unit {unit.name!r} has no measured split overhead for k={k} (has {sorted(overhead)})")
    world, replicated = cluster.world_size, k - sharded
    weight = out_features * in_features
    weight_trainable = unit.param_count >= weight
    bias = unit.param_count + unit.frozen_param_count - weight
    bias_trainable = unit.param_count - (weight if weight_trainable else 0)
    slice_params = weight // k
    slice_trainable = slice_params if weight_trainable else 0

    def state_bytes(params: int, trainable: int) -> int:
        return (params * profile.param_bytes_per_element
                + trainable * (profile.grad_bytes_per_element + profile.optimizer_bytes_per_param))

    slice_state = state_bytes(slice_params, slice_trainable)
    state = (sharded * _ceil_div(slice_state, world) + replicated * slice_state
             + state_bytes(bias, bias_trainable))
    gathered = slice_params * profile.compute_bytes_per_element
    grads = slice_trainable * profile.grad_bytes_per_element
    reduced = slice_trainable * profile.reduce_bytes_per_element
    # Per-slice transients in backward order (sharded slices first in forward, so last in backward).
    per_slice = [grads] * replicated + [gathered + grads] * sharded
    in_flight = max(a + b for a, b in zip(per_slice, per_slice[1:], strict=False))
    transient = (in_flight + (_ceil_div(reduced, world) if sharded else 0)
                 + bias_trainable * profile.grad_bytes_per_element)
    bias_s = all_reduce_s(bias_trainable * profile.grad_bytes_per_element, world, cluster)
    comm_s = (sharded * (2 * all_gather_s(gathered, world, cluster) + reduce_scatter_s(reduced, world, cluster))
              + replicated * all_reduce_s(grads, world, cluster)
              + max(0.0, bias_s - cluster.collective_latency_s))  # rides in the enclosing unit's call
    compute_s = (unit.forward_s + unit.backward_s + overhead[k]) * batch_scale
    # A neighbouring unit's run overlaps at most one prefetched slice of this one.
    return ChoiceCost(split_choice(k, sharded), state, replicated * gathered, transient, compute_s, comm_s,
                      prefetch_bytes=gathered if sharded else 0,
                      exposed_s=(3 * sharded + replicated) * cluster.collective_latency_s if world > 1 else 0.0)


# ---------------------------------------------------------------------------------------------
# Groups across nodes: the paper's "group sharding" (hsdp) and "communication with groups"
# ---------------------------------------------------------------------------------------------
def group_choices_for(cluster: ClusterSpec, group_sizes: tuple[int, ...] | None = None) -> tuple[str, ...]:
    """``hsdp(g=G)`` and ``zero3(reshard=G)`` for each group size ``G`` (default: one node's ranks).

    Only sizes that divide the world and lie strictly between 1 and it. On one node the default is
    none: a group smaller than the node saves no bandwidth, it only shards less.
    """
    if group_sizes is None:
        group_sizes = (cluster.local_world_size,) if cluster.num_nodes > 1 else ()
    valid = [g for g in group_sizes if 1 < g < cluster.world_size and cluster.world_size % g == 0]
    return tuple(choice for g in valid for choice in (hsdp_choice(g), zero3_reshard_choice(g)))


def group_choice_cost(unit: UnitProfile, profile: ModelProfile, cluster: ClusterSpec, choice: str,
                      batch_scale: float = 1.0) -> ChoiceCost:
    """Cost of an ``hsdp(g=G)`` or ``zero3(reshard=G)`` choice."""
    group = parse_hsdp_choice(choice)
    if group is not None:
        return hsdp_choice_cost(unit, profile, cluster, group, batch_scale)
    group = parse_zero3_reshard_choice(choice)
    if group is None:
        raise ValueError(f"{choice!r} is not a group choice (hsdp(g=G) or zero3(reshard=G))")
    return zero3_reshard_choice_cost(unit, profile, cluster, group, batch_scale)


def _unit_bytes(unit: UnitProfile, profile: ModelProfile) -> tuple[int, int, int, int, int]:
    """Stored parameter, gradient, optimizer-state, gathered and reduced bytes of a whole unit."""
    params = unit.param_count + unit.frozen_param_count
    return (params * profile.param_bytes_per_element, unit.param_count * profile.grad_bytes_per_element,
            unit.param_count * profile.optimizer_bytes_per_param, params * profile.compute_bytes_per_element,
            unit.param_count * profile.reduce_bytes_per_element)


def _check_group(group: int, cluster: ClusterSpec) -> None:
    if not 1 < group < cluster.world_size or cluster.world_size % group:
        raise ValueError(f"group size {group} must divide the world size {cluster.world_size} and lie "
                         "strictly between 1 and it")


def hsdp_choice_cost(unit: UnitProfile, profile: ModelProfile, cluster: ClusterSpec, group: int,
                     batch_scale: float = 1.0) -> ChoiceCost:
    """Cost of ``hsdp(g=group)``: zero3 inside groups of ``group`` consecutive ranks, replicated across.

    FSDP2 on a 2-D (W/g, g) mesh: two all-gathers and a reduce-scatter inside the group (inside a
    node when ``g`` ranks fit in one), then an all-reduce of the 1/g gradient shard across the
    W/g groups, whose members sit on different nodes whenever there are several.
    """
    _check_group(group, cluster)
    stored, grads, optim, gathered, reduced = _unit_bytes(unit, profile)
    in_group_s = 2 * all_gather_s(gathered, group, cluster) + reduce_scatter_s(reduced, group, cluster)
    across_nodes = cluster.num_nodes > 1
    across_s = all_reduce_s(_ceil_div(reduced, group), cluster.world_size // group, cluster, crosses_nodes=across_nodes)
    compute_s = (unit.forward_s + unit.backward_s) * batch_scale
    exposed_s = 3 * cluster.link(cluster.crosses_nodes(group))[0] + cluster.link(across_nodes)[0]
    return ChoiceCost(hsdp_choice(group), _ceil_div(stored + grads + optim, group), 0, gathered + grads,
                      compute_s, in_group_s + across_s, prefetch_bytes=gathered, exposed_s=exposed_s)


def zero3_reshard_choice_cost(unit: UnitProfile, profile: ModelProfile, cluster: ClusterSpec, group: int,
                              batch_scale: float = 1.0) -> ChoiceCost:
    """Cost of ``zero3(reshard=group)``: FSDP2's ``reshard_after_forward=group``.

    Sharded over all W ranks; after forward the parameters are resharded only down to groups of
    ``group`` consecutive ranks (1/group of them held until backward), so the backward all-gather
    stays inside the group. The forward all-gather and the reduce-scatter span all W ranks.
    """
    _check_group(group, cluster)
    stored, grads, optim, gathered, reduced = _unit_bytes(unit, profile)
    world = cluster.world_size
    comm_s = (all_gather_s(gathered, world, cluster) + all_gather_s(gathered, group, cluster)
              + reduce_scatter_s(reduced, world, cluster))
    compute_s = (unit.forward_s + unit.backward_s) * batch_scale
    exposed_s = 2 * cluster.link(cluster.crosses_nodes(world))[0] + cluster.link(cluster.crosses_nodes(group))[0]
    return ChoiceCost(zero3_reshard_choice(group), _ceil_div(stored + grads + optim, world),
                      _ceil_div(gathered, group), gathered + grads, compute_s, comm_s, prefetch_bytes=gathered,
                      exposed_s=exposed_s)
