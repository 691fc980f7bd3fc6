"""Memory budgets: the forms people say, and the documented defaults.

Accepted forms of ``memory_budget`` (per rank), in Python and in conf alike:

- bytes: a size with a unit, taken at its word (``"6GiB"``, ``"512MB"``, ``"1.5G"`` with G = GiB,
  ``"900KiB"``, ``"883732B"``), or a bare number of bytes of at least 1 MiB (a bare ``70`` is refused
  as ambiguous: a forgotten ``%`` or unit is likelier than a 70-byte budget);
- ``"70%"``: a share of the device (CUDA: its total memory; CPU: the process's share of physical
  memory, i.e. physical memory over the processes of this node), at most 100%;
- ``"95%ddp"`` (or ``%replicate``, ``%zero2``, ``%zero3``): a share of the predicted peak of that
  uniform plan for this model at the profiled micro-batch size, resolved after profiling. Plans
  keep their headroom inside this budget too, so ``"100%ddp"`` is a budget ddp itself exceeds.

Defaults (when ``memory_budget`` is not given):

- CUDA: the device's total memory minus :data:`CUDA_HEADROOM_FRACTION` (8%) for the CUDA
  context, NCCL buffers and allocator fragmentation, which the cost model does not see.
- CPU: :data:`CPU_SHARE_FRACTION` (80%) of the machine's physical memory, shared evenly by the
  processes of this node.

Within the budget, plans keep a headroom free for what the memory model misses
(:func:`plan_headroom`; ``headroom=`` on the strategy, ``strategy.headroom`` in conf). It is sized
from measurement: the tracked peak of one plan is the same from launch to launch when every rank
has a core of its own (the GPT benchmarks' 2 gloo ranks on 2 cores: every plan measured twice or
more, identical to the byte), so what is left is the model's own miss:

- CPU: by kind (:class:`PlanHeadroom` ``by_kind``): each choice's bytes grow by what the model
  was measured to miss on plans of its kind, its spread over launches and :data:`MISS_MARGIN`
  (:class:`osdp_lightning.choices.base.MemoryMiss`, declared by each family and modifier), and
  :data:`SMALL_MODEL_MISS_BYTES` (96 KiB) beside them for what the model misses in bytes on a tiny
  model; a kind never measured keeps :data:`PLAN_HEADROOM_FRACTION` (2.5%), the model's largest
  miss under any measured peak (:data:`LARGEST_MEASURED_MISS`, 1.9% on a Hugging Face BERT) and the
  margin;
- CPU with more ranks on a node than it has cores: :data:`SHARED_CORES_HEADROOM_FRACTION` (4%):
  time-sliced ranks free buffers in another order from launch to launch (uniform zero3 on 4 ranks
  sharing 2 cores peaked 1.0% apart) and the largest miss measured so was 2.0%;
- CUDA: :data:`UNMEASURED_HEADROOM_FRACTION` (4%, the model's misses were never measured on a GPU)
  plus the caching allocator's fragmentation measured while profiling (reserved over allocated
  bytes at the peak, at most 10%), else :data:`CUDA_PLAN_HEADROOM_FRACTION` (5%).

A plan says which rule set its headroom (:class:`PlanHeadroom`). Beside it, plans under a budget in
bytes or a share of the device (a real limit) keep free what the process grows by beyond its
tensors, measured at setup (``ClusterSpec.untracked_bytes``, :mod:`osdp_lightning.runtime.process_memory`);
a share of a baseline's peak, or a given ``headroom=``, bounds the priced tensors only.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

import torch

from osdp_lightning.cost.aliases import ALIASES, BASELINES

CUDA_HEADROOM_FRACTION = 0.08
CPU_SHARE_FRACTION = 0.80
PLAN_HEADROOM_FRACTION = 0.025
LARGEST_MEASURED_MISS = 0.019
"""The memory model's largest miss under a measured step peak on CPU (the tracked peak, 2 gloo
ranks): a Hugging Face BERT with checkpointed sharded layers, 1.9% under
(docs/benchmarks/hf_models); on the GPT benchmarks (every plan of the recorded runs files priced by
today's model, ``python -m benchmarks.reprice_memory``) a mix of zero2, zero3 and replicated leaf
units on the GPT 2 x 512, 1.3% under. The default headroom lies above it."""
MISS_MARGIN = PLAN_HEADROOM_FRACTION - LARGEST_MEASURED_MISS
"""What a headroom keeps above a measured miss (0.6 points): for the shapes and models that were
not measured. Headroom by kind keeps each kind's measured miss and spread plus this."""
SMALL_MODEL_MISS_BYTES = 96 * 1024
"""Bytes headroom by kind keeps free beside the shares: the model's largest miss in bytes on a tiny
model, which no share of its bytes covers (a GPT 2 x 64 with a checkpointed part of a block, 2 gloo
ranks: 2.51 MiB measured against 2.42 predicted, about 0.1 MB or 3.7%; on the larger GPTs a share is
far more)."""
SHARED_CORES_HEADROOM_FRACTION = 0.04
UNMEASURED_HEADROOM_FRACTION = 0.04
CUDA_PLAN_HEADROOM_FRACTION = 0.05
MAX_FRAGMENTATION = 0.10

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_SHARE_RE = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+)\s*%\s*([a-zA-Z0-9_]*)\s*$")
_BASELINE_CHOICES = {name: ALIASES.get(name, name) for name in BASELINES}
BUDGET_BASELINES = {**_BASELINE_CHOICES, **{choice: choice for choice in _BASELINE_CHOICES.values()}}
"""Baselines a budget may be a share of (``"95%ddp"``, ``"95%replicate"``), and the uniform choice each one is."""
MIN_BYTES_BUDGET = 2**20
ACCEPTED_FORMS = ("a size with a unit such as '8GiB', '512MB', '900KiB' or '883732B', bytes as a bare number "
                  "(>= 1 MiB, e.g. 8589934592), a share of the device such as '70%', or a share of a baseline's "
                  "predicted peak such as '95%ddp' (ddp, zero2, zero3)")


def parse_bytes(value: int | float | str) -> int:
    """Bytes from an int or a string such as ``"8GiB"``, ``"512MB"``, ``"1.5G"`` (G = GiB).

    Raises ``ValueError`` naming the bad value and the accepted forms.
    """
    if isinstance(value, bool):
        raise ValueError(f"memory budget must be a size, got {value!r}")
    if isinstance(value, (int, float)):
        number = float(value)
    else:
        match = _BYTES_RE.match(str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"cannot read memory budget {value!r}: use bytes (e.g. 8589934592) or a number with a "
                f"unit such as '8GiB', '512MiB', '6GB' (units: {', '.join(u for u in _UNITS if u)})")
        number = float(match.group(1)) * _UNITS[unit]
    if not number > 0:
        raise ValueError(f"memory budget must be positive, got {value!r}")
    return int(number)


def format_budget(nbytes: int) -> str:
    """Exactly ``nbytes`` as a budget :func:`parse_memory_budget` accepts as written, whatever its size:
    the largest binary unit that divides it (``"8GiB"``), else bytes with their unit (``"883732B"``).

    Messages that name a budget to use name it in this form: a bare number below 1 MiB is refused,
    and a rounded size (``"863.02 KiB"``) can fall a few bytes short of the budget it names.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"a budget is a positive whole number of bytes, got {nbytes!r}")
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if nbytes % _UNITS[unit.lower()] == 0:
            return f"{nbytes // _UNITS[unit.lower()]}{unit}"
    return f"{nbytes}B"


def format_bytes(n: float) -> str:
    """Human-readable binary size: ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def device_memory_bytes(device: torch.device, local_world_size: int) -> int:
    """What ``"100%"`` means: a CUDA device's total memory, or on CPU this process's share of the
    machine's physical memory (shared evenly by the ``local_world_size`` processes of the node)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(physical / max(local_world_size, 1))


def default_memory_budget(device: torch.device, local_world_size: int) -> int:
    """The documented default budget for ``device`` (see the module docstring)."""
    share = 1 - CUDA_HEADROOM_FRACTION if device.type == "cuda" else CPU_SHARE_FRACTION
    return int(device_memory_bytes(device, local_world_size) * share)


@dataclass(frozen=True)
class MemoryBudget:
    """A per-rank budget as it was said: bytes, a share of the device, or a share of a baseline's peak.

    Exactly one of ``bytes`` and ``share`` is set; ``baseline`` is set only with ``share``.
    """

    text: str
    """The budget as given (``"6GiB"``, ``"70%"``, ``"95%ddp"``), for messages and logs."""
    bytes: int | None = None
    """An absolute budget in bytes."""
    share: float | None = None
    """A fraction (0.7 for ``"70%"``) of the device or of ``baseline``'s predicted peak."""
    baseline: str | None = None
    """The uniform choice (``"replicate"``, ``"zero2"``, ``"zero3"``) whose peak ``share`` scales."""

    @property
    def needs_profile(self) -> bool:
        """Whether the budget is known only after profiling (a share of a baseline's peak)."""
        return self.baseline is not None

    def of_device(self, device_bytes: int) -> int:
        """The budget in bytes on a device of ``device_bytes`` (a baseline share: the device, for now)."""
        if self.bytes is not None:
            return self.bytes
        return device_bytes if self.baseline is not None else int(self.share * device_bytes)

    def of_peak(self, baseline_peak_bytes: int) -> int:
        """The budget in bytes once the baseline's predicted peak is known."""
        if self.baseline is None:
            raise ValueError(f"memory budget {self.text!r} is not a share of a baseline's peak")
        return int(self.share * baseline_peak_bytes)


def parse_memory_budget(value: int | float | str | MemoryBudget) -> MemoryBudget:
    """A :class:`MemoryBudget` from any accepted form (see the module docstring).

    Raises ``ValueError`` naming the bad value and the accepted forms.
    """
    if isinstance(value, MemoryBudget):
        return value
    text = str(value).strip()
    if isinstance(value, str) and "%" in text:
        return _parse_share(text, _SHARE_RE.match(text))
    if isinstance(value, str) and text.startswith("-"):
        raise ValueError(f"memory budget {value!r} must be positive; accepted forms: {ACCEPTED_FORMS}")
    try:
        number = parse_bytes(value)
    except ValueError as err:
        reason = str(err).split(":")[0]  # "cannot read memory budget 'x'" or "... must be positive ..."
        raise ValueError(f"{reason}; accepted forms: {ACCEPTED_FORMS}") from None
    # NOTE: a bare number below 1 MiB is more likely a forgotten "%" or unit than bytes; a size that
    # says its unit is taken at its word, however small (a small model's smallest plan can need less).
    if number < MIN_BYTES_BUDGET and not _has_unit(value):
        raise ValueError(f"memory budget {value!r} is {number} bytes, too small to hold a model: did you mean "
                         f"{_forgotten_unit(text, number)}? For {number} bytes say '{number}B'. "
                         f"Accepted forms: {ACCEPTED_FORMS}")
    return MemoryBudget(text=text, bytes=number)


def _forgotten_unit(text: str, number: int) -> str:
    """The forms a bare ``number`` plausibly meant: a share of the device up to 100, else a size."""
    if number <= 100:
        return f"'{text}%' or '{text}GiB'"
    return f"'{text}GiB' or '{text}MiB'" if number <= 4096 else f"'{text}MiB'"


def _has_unit(value: int | float | str) -> bool:
    """Whether ``value`` (already read by :func:`parse_bytes`) names its unit, as ``"900KiB"`` does."""
    match = _BYTES_RE.match(value) if isinstance(value, str) else None
    return bool(match and match.group(2))


def _parse_share(text: str, match: re.Match | None) -> MemoryBudget:
    base = match.group(2).lower() if match else None
    if match is None or (base and base not in BUDGET_BASELINES):
        raise ValueError(f"cannot read memory budget {text!r}; accepted forms: {ACCEPTED_FORMS}")
    percent = float(match.group(1))
    if not (percent > 0 and math.isfinite(percent)):
        raise ValueError(f"memory budget {text!r} must be positive; accepted forms: {ACCEPTED_FORMS}")
    if not base and percent > 100:
        raise ValueError(f"memory budget {text!r} is more than the whole device: a share of the device lies in "
                         f"(0%, 100%]; for more than a baseline's peak say e.g. '120%zero3'")
    return MemoryBudget(text=text, share=percent / 100, baseline=BUDGET_BASELINES[base] if base else None)


def absolute_budget_bytes(value: int | float | str | None) -> int | None:
    """Bytes of a budget given in bytes or as a size; ``None`` for shares and missing values."""
    if value is None:
        return None
    budget = parse_memory_budget(value)
    return budget.bytes


@dataclass(frozen=True)
class PlanHeadroom:
    """The headroom rule: a plan keeps the larger of ``bytes`` and ``share`` of the budget free
    (``ClusterSpec.headroom_bytes`` / ``headroom_fraction``; a budget at or below it is refused by
    :func:`osdp_lightning.plan.plan.make_plan`, naming both figures), and why (a plan prints it)."""

    bytes: int
    share: float
    reason: str
    by_kind: bool = False
    """Headroom by kind instead of the share: each choice's bytes grown by its kind's measured miss
    (:func:`osdp_lightning.choices.kept_share`, :func:`osdp_lightning.plan.choice_table.kept_free_table`)."""


def plan_headroom(headroom: float | int | str | None, device: torch.device,
                  fragmentation: float | None = None, ranks_per_node: int = 1) -> PlanHeadroom:
    """The headroom rule of a strategy's ``headroom``: a share of the budget (a float below 1, e.g.
    ``0.05``), bytes (an int or a size such as ``"256MiB"``), or ``None`` for the default of the device
    (module docstring), where ``fragmentation`` is the CUDA allocator's
    ``max_memory_reserved / max_memory_allocated - 1`` and ``ranks_per_node`` the processes that
    share this node's cores.
    """
    if headroom is not None:
        given = "as the strategy's headroom= says"
        if isinstance(headroom, float) and 0 <= headroom < 1:
            return PlanHeadroom(0, headroom, given)
        return PlanHeadroom(0, 0.0, given) if headroom in (0, "0") else PlanHeadroom(parse_bytes(headroom), 0.0, given)
    if device.type != "cuda":
        cores = usable_cores()
        if ranks_per_node > cores:
            return PlanHeadroom(0, SHARED_CORES_HEADROOM_FRACTION, f"the CPU default for {ranks_per_node} ranks "
                                f"sharing {cores} cores: peaks move between launches (1.0% measured) and the "
                                "memory model missed by up to 2.0% there")
        return PlanHeadroom(SMALL_MODEL_MISS_BYTES, 0.0, f"the CPU default, by kind: {SMALL_MODEL_MISS_BYTES // 1024} "
                            "KiB, and each choice's bytes grown by its kind's largest measured miss, spread over "
                            "launches and a margin", by_kind=True)
    if fragmentation is None:
        return PlanHeadroom(0, CUDA_PLAN_HEADROOM_FRACTION,
                            "the CUDA default (the allocator's fragmentation was not measured)")
    measured = min(max(fragmentation, 0.0), MAX_FRAGMENTATION)
    return PlanHeadroom(0, UNMEASURED_HEADROOM_FRACTION + measured,
                        f"{100 * UNMEASURED_HEADROOM_FRACTION:.0f}% (the memory model's misses were not measured on "
                        f"a GPU) plus the CUDA allocator's fragmentation measured while profiling ({100 * measured:.1f}%)")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
