"""Stage 2, the cost model's records: what every choice family prices its choices with.

For every unit of a :class:`~osdp_lightning.profiling.records.ModelProfile` and every allowed choice, the
per-rank bytes and seconds that choice costs. Pure functions of the profile and a
:class:`~osdp_lightning.cost.cluster.ClusterSpec`: no process group is needed, so tables can be built
for clusters you do not have and unit-tested exactly. Each choice family prices its own choices
(``osdp_lightning/choices/<family>.py``) from one :class:`CostContext`; this module holds what they
share: the records (:class:`ChoiceCost`, :class:`UnitCosts`, :class:`ChoiceTable`) and the
collective times. :func:`osdp_lightning.plan.choice_table.build_choice_table` asks the families for a
whole table. The terms are explained in ``docs/design.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

from osdp_lightning.cost.cluster import ClusterSpec
from osdp_lightning.cost.step_terms import ALL_GATHER, ALL_REDUCE, PLAIN, REDUCE_SCATTER
from osdp_lightning.profiling.records import ModelProfile, UnitProfile


@dataclass(frozen=True)
class CostContext:
    """Everything a choice family's cost function may read besides the unit itself.

    One argument that grows: add a field (with a default) rather than a parameter to every
    family's cost function.
    """

    profile: ModelProfile
    cluster: ClusterSpec
    batch_scale: float = 1.0
    """Micro-batch size of the table over the profiled one (compute and activations scale with it)."""
    accumulation_steps: int = 1
    """Micro-batches per optimizer step (``Trainer(accumulate_grad_batches)``). Costs stay per
    micro-step: what happens once per optimizer step (reducing gradients, the optimizer step) is
    divided by it, and a unit that reduces its gradients keeps them unsharded between micro-steps
    (no reduction before the last one: ``osdp_lightning/runtime/accumulate.py``)."""

    def compute_s(self, unit: UnitProfile) -> float:
        """The unit's forward and backward seconds at the table's micro-batch size."""
        return (unit.forward_s + unit.backward_s) * self.batch_scale

    def once_per_step_s(self, seconds: float) -> float:
        """Per micro-step share of ``seconds`` paid once per optimizer step (a gradient reduction)."""
        return seconds / self.accumulation_steps

    def kept_grad_bytes(self, unsharded_grad_bytes: int) -> int:
        """Unsharded gradient bytes a unit that reduces them keeps from the first micro-step's
        backward to the last one's: all of them when accumulating, none otherwise."""
        return unsharded_grad_bytes if self.accumulation_steps > 1 else 0

    def rebuilt_grad_bytes(self, replicated_grad_bytes: int) -> int:
        """What DDP's bucket rebuild allocates for ``replicated_grad_bytes`` of gradients on its
        reducer: all of them again, where the cluster counts that moment and there is a reducer
        (more than one rank); else 0."""
        cluster = self.cluster
        return replicated_grad_bytes if cluster.bucket_rebuild_counted and cluster.world_size > 1 else 0

    def overhead_s(self, kind: str, groups: float, nbytes: float) -> float:
        """Seconds per step of ``groups`` FSDP2 groups (or a reducer) of ``kind`` holding ``nbytes``
        of parameters: the machinery besides compute and collectives (0 without step terms)."""
        terms = self.cluster.step_terms
        return terms.overhead_s(kind, groups, nbytes) if terms is not None and self.cluster.world_size > 1 else 0.0

    def optimizer_s(self, kind: str, tensors: float, nbytes: float) -> float:
        """Seconds of the optimizer step over ``tensors`` parameter tensors of ``nbytes`` (whole,
        unsharded) laid out as ``kind`` stores them (0 without step terms)."""
        terms = self.cluster.step_terms
        if terms is None or not self.profile.optimizer_bytes_per_param:
            return 0.0
        return self.once_per_step_s(terms.optimizer_s(kind if self.cluster.world_size > 1 else PLAIN, tensors, nbytes))

    def machinery_s(self, unit: UnitProfile, kind: str) -> tuple[float, float]:
        """``(overhead_s, optimizer_s)`` of the whole ``unit`` as one group of ``kind`` (nothing for a
        unit without parameters: calibration counts the root's own work in the units' constants)."""
        b = UnitBytes.of(unit, self.profile)
        if not b.stored:
            return 0.0, 0.0
        trainable = unit.param_count * self.profile.param_bytes_per_element
        return self.overhead_s(kind, 1, b.stored), self.optimizer_s(kind, tensor_count(unit), trainable)

    def activation_bytes(self, unit: UnitProfile, *, sharded: bool = False) -> int:
        """Bytes the unit saves for backward at the table's micro-batch size; ``sharded``: as FSDP2
        runs it, which under ``bf16-mixed`` gathers its parameters and casts its inputs to bf16
        (its matmuls save the gathered parameters, no autocast copy; a residual stream is bf16)."""
        copies = unit.cast_param_bytes  # NOTE: one per parameter, whatever the micro-batch
        if not (sharded and self.profile.param_dtype):
            return int((unit.activation_bytes - copies) * self.batch_scale) + copies
        if unit.sharded_activation_bytes is not None:
            return int(unit.sharded_activation_bytes * self.batch_scale)
        return int((unit.activation_bytes - copies) * self.batch_scale)

    def unsaved_forward_bytes(self, unit: UnitProfile) -> int:
        """The most bytes of its own (its input included) the unit's forward holds at once when it
        saves nothing for backward, at the table's micro-batch size; 0 when not measured."""
        if unit.forward_rise_bytes is None:
            return 0
        return int((unit.forward_rise_bytes + unit.input_bytes) * self.batch_scale)

    def world_latency_s(self) -> float:
        """Launch latency of a collective over all ranks (0 with one rank: there is none)."""
        cluster = self.cluster
        return cluster.link(cluster.crosses_nodes(cluster.world_size))[0] if cluster.world_size > 1 else 0.0


def tensor_count(unit: UnitProfile) -> int:
    """Trainable parameter tensors of ``unit`` (a profile that did not count them: a Linear's 2)."""
    return unit.tensor_count or (2 if unit.param_count else 0)


@dataclass(frozen=True)
class UnitBytes:
    """A whole unit's bytes per kind, unsharded (``P`` times bytes per element)."""

    stored: int
    """Parameters as stored (trainable and frozen)."""
    grads: int
    optimizer: int
    gathered: int
    """Parameters as gathered for compute."""
    gathered_grads: int
    """Gradients as a sharded unit computes them, unsharded (in the gathered parameters' dtype)."""
    reduced: int
    """Gradients as reduced."""
    largest_grad: int
    """The largest single gradient tensor (the whole unit's gradients when not known)."""

    @classmethod
    def of(cls, unit: UnitProfile, profile: ModelProfile) -> UnitBytes:
        params = unit.param_count + unit.frozen_param_count
        return cls(stored=params * profile.param_bytes_per_element,
                   grads=unit.param_count * profile.grad_bytes_per_element,
                   optimizer=unit.param_count * profile.optimizer_bytes_per_param,
                   gathered=params * profile.compute_bytes_per_element,
                   gathered_grads=unit.param_count * profile.compute_bytes_per_element,
                   reduced=unit.param_count * profile.reduce_bytes_per_element,
                   largest_grad=(unit.largest_tensor_count or unit.param_count) * profile.grad_bytes_per_element)

    @property
    def state(self) -> int:
        """Parameters, gradients and optimizer state: what sharding divides."""
        return self.stored + self.grads + self.optimizer


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
    """Bytes of its forward all-gather's output, alive while a neighbour runs (FSDP2 keeps it until
    the next all-gather's copy-out); ``None`` means the whole transient."""
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

    forward_bytes: int | None = None
    """Its own bytes alive when its forward starts, besides what earlier units keep: FSDP2 copies
    the gathered parameters out of the all-gather's output, so both (zero2's held copy included).
    ``None``: as in its backward (held, activations and transient; never the larger moment)."""

    backward_prefetch_bytes: int | None = None
    """Bytes all-gathered for its backward, which FSDP2 prefetches while the unit after it runs
    backward; ``None``: :attr:`prefetch` (zero2 gathers nothing then: 0)."""

    late_grad_bytes: int = 0
    """Part of :attr:`state_bytes` that exists only from this unit's post-backward to the optimizer
    step: FSDP2's sharded gradients, which Lightning's ``zero_grad(set_to_none=True)`` drops
    between the forward and the backward (kept through the step when accumulating: 0)."""

    reduce_bytes: int = 0
    """Its reduce-scatter's input (the unsharded gradients as reduced), which FSDP2 keeps until the
    next unit's post-backward: alive through the backward of the unit before it."""

    unsaved_forward_bytes: int = 0
    """The most bytes of its own (its input included) its forward holds at once when it saves
    nothing for backward (:meth:`CostContext.unsaved_forward_bytes`). A forward that keeps fewer
    activations than that (a checkpointed one: only its input) still climbs to it while its
    parameters are gathered: :attr:`forward_end_bytes` counts the difference."""

    rebuild_bytes: int = 0
    """Bytes DDP's reducer allocates for this unit's gradients a second time when it rebuilds its
    buckets (replicated gradients), where the cluster counts that moment
    (:attr:`~osdp_lightning.cost.cluster.ClusterSpec.bucket_rebuild_counted`; else 0)."""

    @property
    def prefetch(self) -> int:
        return self.transient_bytes if self.prefetch_bytes is None else self.prefetch_bytes

    @property
    def backward_prefetch(self) -> int:
        return self.prefetch if self.backward_prefetch_bytes is None else self.backward_prefetch_bytes

    @property
    def live_bytes(self) -> int:
        """Bytes alive from this unit's forward to its backward (held parameters, activations)."""
        return self.held_bytes + self.activation_bytes

    @property
    def forward_peak_bytes(self) -> int:
        """Its own bytes at its forward moment (:attr:`forward_bytes`, or its backward's when unknown)."""
        return self.live_bytes + self.transient_bytes if self.forward_bytes is None else self.forward_bytes

    @property
    def forward_end_bytes(self) -> int:
        """Its own bytes beside its live bytes as its forward ends: the parameters as gathered
        (FSDP2 reshards them after the forward, which has made its activations by then) and the
        all-gather's output (kept until the next all-gather; 0 when :attr:`forward_bytes` is not
        known), plus the intermediates of a forward that keeps less than it makes
        (:attr:`unsaved_forward_bytes` above its activations).

        NOTE: the intermediates peak after the previous unit's all-gather buffer is freed (FSDP2
        frees it at this unit's copy-out): this moment, not its start. A BERT plan with every layer
        zero2+ckpt peaked 5.1% above the model without them (the MLP's 4x-wide input beside its
        GELU output in the last layer's forward), 0.8% under with them."""
        gathered = 0 if self.forward_bytes is None else max(self.forward_bytes - self.held_bytes, 0)
        return gathered + max(self.unsaved_forward_bytes - self.activation_bytes, 0)

    @property
    def persistent_bytes(self) -> int:
        """Bytes alive through the whole step or from this unit's forward to its backward."""
        return self.state_bytes + self.live_bytes


@dataclass(frozen=True)
class UnitCosts:
    """All allowed choices of one unit, plus the compute that can hide its collectives."""

    name: str
    choices: tuple[ChoiceCost, ...]
    overlap_s: float
    spans_step: bool = False
    """Its live bytes may be alive at any moment of the step (the root, whose own operations run
    all through it; an interleaved unit, ``UnitProfile.interleaved``), not only from its place in
    the execution order to its backward."""

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
    optimizer_step_bytes: int = 0
    """Bytes the optimizer step allocates beside the state (:attr:`ModelProfile.optimizer_step_bytes`):
    its moment is the state, the fixed bytes and these, after backward has freed every activation."""


# NOTE: with step terms (measured at setup, or a cluster config's) each kind costs what it was
# measured to cost per call and per byte moved ((g-1)/g of the data per rank). Without them: the
# link's latency plus bytes over its bandwidth, all-reduce twice the bytes. A ring is as fast as
# its slowest link: a group that spans nodes is charged the inter-node link (``crosses_nodes=None``:
# a group of consecutive ranks, which spans nodes when larger than a node).
def collective_s(kind: str, nbytes: float, group: int, cluster: ClusterSpec, crosses_nodes: bool | None = None) -> float:
    """Seconds of one ``kind`` collective (``all_gather``, ``reduce_scatter``, ``all_reduce``) of
    ``nbytes`` (unsharded) over ``group`` consecutive ranks."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    crosses = cluster.crosses_nodes(group) if crosses_nodes is None else crosses_nodes
    latency, bandwidth = cluster.link(crosses)
    terms = cluster.step_terms
    if terms is None:
        return latency + (2 if kind == ALL_REDUCE else 1) * nbytes * (group - 1) / group / bandwidth
    if not crosses:
        return terms.collective_s(kind, nbytes, group)
    return terms.collective_s(kind, nbytes, group, link_scale=cluster.bandwidth_bytes_per_s / bandwidth,
                              latency_s=latency)


def all_gather_s(nbytes: float, group: int, cluster: ClusterSpec, crosses_nodes: bool | None = None) -> float:
    return collective_s(ALL_GATHER, nbytes, group, cluster, crosses_nodes)


def reduce_scatter_s(nbytes: float, group: int, cluster: ClusterSpec, crosses_nodes: bool | None = None) -> float:
    return collective_s(REDUCE_SCATTER, nbytes, group, cluster, crosses_nodes)


def all_reduce_s(nbytes: float, group: int, cluster: ClusterSpec, crosses_nodes: bool | None = None) -> float:
    return collective_s(ALL_REDUCE, nbytes, group, cluster, crosses_nodes)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
