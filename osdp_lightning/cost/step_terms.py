"""The step-time terms besides compute (design.md section 4): what each collective, FSDP2's own
per-unit work, the optimizer step and the training loop cost.

Measured on the live process group at setup (:mod:`osdp_lightning.calibrate`), or read from a
cluster description for a dry run (``step_model:`` in ``conf/cluster/<name>.yaml``; defaults per
device kind below). Every term is affine: a constant per call (collective), per FSDP2 group
(unit or slice), per parameter tensor (optimizer), plus a rate per byte. Measured on this
project's machine (2 gloo ranks on a 2-core Xeon VM): leaving these out made predicted steps
42-68% short, and the per-unit constants are what a per-parameter rate alone misses.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE = "all_gather", "reduce_scatter", "all_reduce"
COLLECTIVES: tuple[str, ...] = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE)
PLAIN = "plain"
"""Parameters no FSDP2 call touched (one rank): the optimizer over plain tensors."""
DEVICE_KINDS: tuple[str, ...] = ("cpu", "gpu")
"""The device kinds with default step terms (:data:`DEFAULT_TERMS`)."""


@dataclass(frozen=True)
class Affine:
    """``seconds = constant_s * count + per_byte_s * bytes``."""

    constant_s: float
    per_byte_s: float

    def seconds(self, count: float, nbytes: float) -> float:
        return self.constant_s * count + self.per_byte_s * nbytes

    def is_valid(self) -> bool:
        return all(math.isfinite(x) and x >= 0 for x in (self.constant_s, self.per_byte_s))

    @classmethod
    def fit(cls, points: Sequence[tuple[float, float]], count: float) -> Affine:
        """``y = constant * count + rate * x``, least squares through ``(x, y)`` points; both parts at least 0."""
        mean_x = statistics.fmean(x for x, _ in points)
        mean_y = statistics.fmean(y for _, y in points)
        spread = sum((x - mean_x) ** 2 for x, _ in points)
        rate = max(sum((x - mean_x) * (y - mean_y) for x, y in points) / spread, 0.0)
        return cls(max((mean_y - rate * mean_x) / count, 0.0), rate)


@dataclass(frozen=True)
class GroupTerms:
    """A kind of parameter group the step model prices apart (an FSDP2 group, a share of DDP's
    reducer, a split's replicated slice), with its default figures per device kind."""

    kind: str
    overhead: Mapping[str, tuple[float, float]]
    """Per device kind (:data:`DEVICE_KINDS`): ``(seconds per group, seconds per byte)`` of the machinery."""
    optimizer: Mapping[str, tuple[float, float]]
    """Per device kind: ``(seconds per tensor, seconds per byte)`` of the optimizer step."""


GROUP_TERMS: dict[str, GroupTerms] = {}
"""Every group kind priced apart, in registration order. Each choice family brings its own
(``ChoiceFamily.group_terms``, registered with the family by ``osdp_lightning/choices``), so this
module names no family; a family whose groups cost what another's do prices them as that kind."""


def register_group_terms(terms: GroupTerms) -> None:
    if terms.kind in GROUP_TERMS or terms.kind == PLAIN:
        raise ValueError(f"step terms of group kind {terms.kind!r} are registered twice")
    if set(terms.overhead) != set(DEVICE_KINDS) or set(terms.optimizer) != set(DEVICE_KINDS):
        raise ValueError(f"group kind {terms.kind!r} needs default terms for each of {DEVICE_KINDS}")
    GROUP_TERMS[terms.kind] = terms


@dataclass(frozen=True)
class StepTerms:
    """Everything the step model adds to the profiled compute, for one kind of cluster."""

    collectives: Mapping[str, Affine]
    """Per kind: seconds per call, and per byte moved on a ring link (``bytes * (g-1)/g`` of the
    unsharded tensor). Each kind is measured for itself: gloo's reduce-scatter costs about an
    all-reduce, not an all-gather."""
    overhead: Mapping[str, Affine]
    """Per group kind (:data:`GROUP_TERMS`): seconds per group per step (hooks, unshard
    allocation, copy-in/out) and per byte of the group's whole parameters; collectives excluded."""
    optimizer: Mapping[str, Affine]
    """Per parameter layout (choice kinds and :data:`PLAIN`): seconds of one optimizer step per
    parameter tensor and per byte of the whole (unsharded) parameters. Sharding does not shrink the
    per-tensor part (DTensor dispatch)."""
    loop_step_s: float
    """Seconds every step pays whatever the plan (the training loop itself)."""
    source: str = "defaults"
    """Where the figures come from: measured at setup, a cache file, a cluster config."""
    calibrate_s: float = 0.0
    """Wall seconds the measurement took (0 when read from a cache or a config)."""
    extra: Mapping[str, float] = field(default_factory=dict)
    """Raw measurements kept for reports (not used by the cost model)."""

    def collective_s(self, kind: str, nbytes: float, group: int, link_scale: float = 1.0,
                     latency_s: float | None = None) -> float:
        """Seconds of one ``kind`` collective of ``nbytes`` (unsharded) over ``group`` ranks.

        ``link_scale`` and ``latency_s`` re-price it for a slower link (a group that spans nodes):
        per-byte seconds times ``link_scale``, the measured constant replaced by ``latency_s``.
        """
        if group <= 1 or nbytes <= 0:
            return 0.0
        cost = self.collectives[kind]
        constant = cost.constant_s if latency_s is None else latency_s
        return constant + cost.per_byte_s * link_scale * nbytes * (group - 1) / group

    def overhead_s(self, kind: str, groups: float, nbytes: float) -> float:
        return self.overhead[kind].seconds(groups, nbytes)

    def optimizer_s(self, kind: str, tensors: float, nbytes: float) -> float:
        return self.optimizer[kind].seconds(tensors, nbytes)

    def is_valid(self) -> bool:
        terms = [*self.collectives.values(), *self.overhead.values(), *self.optimizer.values()]
        return (set(COLLECTIVES) <= set(self.collectives) and set(GROUP_TERMS) <= set(self.overhead)
                and set(GROUP_TERMS) | {PLAIN} <= set(self.optimizer)
                and all(t.is_valid() for t in terms) and math.isfinite(self.loop_step_s) and self.loop_step_s >= 0)

    # -- persistence (the calibration cache, cluster configs) -----------------------------------
    def to_dict(self) -> dict[str, Any]:
        def table(terms: Mapping[str, Affine]) -> dict[str, list[float]]:
            return {k: [v.constant_s, v.per_byte_s] for k, v in terms.items()}
        return {"collectives": table(self.collectives), "overhead": table(self.overhead),
                "optimizer": table(self.optimizer), "loop_step_s": self.loop_step_s,
                "source": self.source, "calibrate_s": self.calibrate_s, "extra": dict(self.extra)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str | None = None) -> StepTerms:
        """Inverse of :meth:`to_dict`; raises ``ValueError`` on anything missing or malformed."""
        try:
            def table(raw: Mapping[str, Any]) -> dict[str, Affine]:
                return {str(k): Affine(float(v[0]), float(v[1])) for k, v in raw.items()}
            terms = cls(collectives=table(data["collectives"]), overhead=table(data["overhead"]),
                        optimizer=table(data["optimizer"]), loop_step_s=float(data["loop_step_s"]),
                        source=source or str(data.get("source", "?")),
                        calibrate_s=float(data.get("calibrate_s", 0.0)),
                        extra={str(k): float(v) for k, v in dict(data.get("extra") or {}).items()})
        except (KeyError, TypeError, IndexError, ValueError, AttributeError) as err:
            raise ValueError(f"malformed step terms ({type(err).__name__}: {err})") from err
        if not terms.is_valid():
            raise ValueError("step terms are incomplete, negative or not finite")
        return terms


# ---------------------------------------------------------------------------------------------
# Defaults per device kind (dry runs; a cluster config's ``step_model:`` overrides any of them)
# ---------------------------------------------------------------------------------------------
# NOTE: CPU figures are this project's machine on a quiet day (2 gloo ranks, one thread each, fp32
# AdamW; a timed step taken apart phase by phase, load 0.6; docs/design.md section 7): gloo all-gather 0.48 GB/s of bus
# bytes, reduce-scatter and all-reduce about 2x slower per byte; FSDP2's own work 1.5-2.5 ms per
# group plus 0.8-1.8 ns per byte; AdamW 5.1 ns per parameter on plain tensors, 4.7 ns per whole
# parameter sharded; the loop about 5 ms. GPU figures are estimates, not measurements (no GPU was
# available): FSDP2's per-group work is a few hundred microseconds of host time, fused/foreach
# AdamW reads and writes about 7 bytes per parameter byte at HBM speed.
# The per-group figures of each kind are its family's (GroupTerms, e.g. osdp_lightning/choices/zero3.py).
DEFAULT_TERMS: dict[str, dict[str, Any]] = {
    "cpu": {
        # gloo has no native reduce-scatter: it costs about an all-reduce (measured per byte here)
        "collective_byte_factors": {ALL_GATHER: 1.0, REDUCE_SCATTER: 2.4, ALL_REDUCE: 1.9},
        "optimizer": {PLAIN: [3.0e-5, 1.3e-9]},
        "loop_step_s": 5.0e-3,
    },
    "gpu": {
        "collective_byte_factors": {ALL_GATHER: 1.0, REDUCE_SCATTER: 1.0, ALL_REDUCE: 2.0},
        "optimizer": {PLAIN: [5.0e-6, 3.5e-12]},
        "loop_step_s": 2.0e-3,
    },
}


def step_terms_from_config(config: Mapping[str, Any]) -> StepTerms:
    """The step terms of a cluster description: its ``step_model:`` entries over the defaults of its
    ``accelerator``. Collectives not given there cost the intra-node latency plus bytes over the
    intra-node bandwidth times the device kind's factor per kind (``collective_byte_factors``)."""
    kind = "gpu" if str(config.get("accelerator", "cpu")) in ("gpu", "cuda") else "cpu"
    defaults = DEFAULT_TERMS[kind]
    given = dict(config.get("step_model") or {})
    latency = float(config["intra_node_latency_s"])
    per_byte = 1.0 / float(config["intra_node_bandwidth_bytes_per_s"])
    link = {k: [latency, f * per_byte] for k, f in defaults["collective_byte_factors"].items()}
    overhead = {k: list(t.overhead[kind]) for k, t in GROUP_TERMS.items()}
    optimizer = {**defaults["optimizer"], **{k: list(t.optimizer[kind]) for k, t in GROUP_TERMS.items()}}
    data = {
        "collectives": {**link, **dict(given.get("collectives") or {})},
        "overhead": {**overhead, **dict(given.get("overhead") or {})},
        "optimizer": {**optimizer, **dict(given.get("optimizer") or {})},
        "loop_step_s": given.get("loop_step_s", defaults["loop_step_s"]),
    }
    return StepTerms.from_dict(data, source=f"cluster config {config.get('name', '?')!r} ({kind} defaults "
                                            "where it gives none)")


def default_loop_step_s(device_type: str) -> float:
    """The loop's per-step constant of a device kind (see :data:`DEFAULT_TERMS`)."""
    return float(DEFAULT_TERMS["gpu" if device_type == "cuda" else "cpu"]["loop_step_s"])
