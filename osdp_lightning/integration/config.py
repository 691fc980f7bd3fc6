"""The osdp strategy's options, one object: the fields of ``conf/strategy/osdp.yaml``.

The Trainer strategy (``OSDPStrategy``), the Fabric strategy (``OSDPFabricStrategy``) and the
command-line tools take an :class:`OSDPConfig`; each strategy also takes its fields as keyword
arguments (``OSDPStrategy(memory_budget="6GiB")``), which override the config's. Every value is
checked when the config is made, so a bad option fails where it is written, not at setup.

Environment variables osdp reads (everything else is a field below):

- ``OSDP_LIGHTNING_CACHE_DIR``: where calibrations are cached (default ``~/.cache/osdp_lightning``);
- ``OSDP_LIGHTNING_CALIBRATION_DRAWS``: how many cached calibrations a plan takes the median of (5);
- ``OSDP_SOLVER``: the ILP back-end, ``highs`` or ``cbc`` (default: HiGHS where ``highspy`` is installed);
- ``OSDP_MEMORY_BREAKDOWN``: set, the training summary prints the tracker's peak by category.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from osdp_lightning.choices import ALIASES, ChoiceOptions, known_names, resolve
from osdp_lightning.cost.budget import MemoryBudget, parse_bytes, parse_memory_budget
from osdp_lightning.plan.pipeline import ProfileOptions
from osdp_lightning.plan.plan import Plan
from osdp_lightning.plan.planner import check_choice_options
from osdp_lightning.profiling.precision import sharded_precision
from osdp_lightning.profiling.units import DEFAULT_MIN_UNIT_PARAMS
from osdp_lightning.runtime.compile import check_compile
from osdp_lightning.state.pretrained import PretrainedWeights


@dataclasses.dataclass(frozen=True)
class OSDPConfig:
    """What osdp plans for and how; see the README's table of options."""

    memory_budget: int | str | None = None
    """Per-rank budget: bytes (an int, or ``"6GiB"``), a share of the device (``"70%"``), or a share
    of a baseline's predicted peak (``"95%ddp"``, ``"120%zero3"``, resolved after profiling); see
    :mod:`osdp_lightning.cost.budget`. ``None``: the device's memory minus 8% on CUDA (``"92%"``), 80% of
    RAM shared by the node's ranks on CPU (``"80%"``)."""
    plan: Plan | str | Path | None = None
    """A :class:`Plan` or a saved plan's JSON path: skip profiling and solving."""
    micro_batch_size: int | Literal["auto"] | None = None
    """``None`` keeps the user's; an int sets the module's or datamodule's ``batch_size``; ``"auto"``
    searches sizes for the highest predicted throughput."""
    uniform_choice: str | None = None
    """Every unit this choice instead of solving (the baselines: ``"ddp"`` / ``"replicate"``,
    ``"zero2"``, ``"zero3"``)."""
    split_factors: Sequence[int] = (2, 4, 8)
    """Slice counts the ILP may split Linear layers into; ``()`` turns splitting off."""
    activation_checkpointing: Literal["auto", "never", "always"] = "auto"
    """``"auto"``: the ILP decides per unit whether to recompute its activations in backward
    (``zero3+ckpt``); ``"never"``; ``"always"``: every unit that can be (a unit whose recomputation
    does not replay its forward keeps its choice without ``+ckpt``, with a warning naming it)."""
    unit_module_types: Sequence[str | type] | None = None
    """Module classes (or their names) that are units; default: found (blocks, large leaves)."""
    unit_name_patterns: Sequence[str] | None = None
    """Regular expressions of module names that are units."""
    min_unit_params: int = DEFAULT_MIN_UNIT_PARAMS
    """Modules with fewer parameters are not units of their own."""
    profile_repeats: int = 3
    """Timed training steps per profile (their median)."""
    overlap_efficiency: float | None = None
    """Share of communication hidden by compute; ``None``: measured at setup on CUDA, 0 on CPU
    (gloo competes with compute for the same cores)."""
    solver_time_limit_s: float | None = 60.0
    """Stop the ILP after this long with the best plan found (the plan says "Time limit" and gives
    the gap); ``None`` always proves the optimum."""
    headroom: float | int | str | None = None
    """Part of the budget plans keep free for what the memory model misses: a share (``0.05``) or
    bytes (``"256MiB"``); ``None``: on CPU by kind of choice (each choice's bytes grown by its kind's
    measured miss, 1.2-2.5%, and 96 KiB; 4% of the budget with more ranks than cores), on CUDA 4%
    plus the allocator's fragmentation measured while profiling. Given, it is all plans keep free."""
    budget_covers: Literal["process", "tensors"] = "process"
    """What a budget in bytes or a share of the device bounds: ``"process"``, what the rank's process
    uses (plans also keep free half again what it grew by beyond tensors while osdp profiled and
    solved, CPU, and count DDP's bucket rebuild at the second step), or ``"tensors"``, only the
    tensors the memory model prices in a steady step, as a share of a baseline's peak (``"95%ddp"``)
    always does."""
    calibration_cache: bool = True
    """Reuse the step-time terms measured earlier on this machine (the median of the last
    ``OSDP_LIGHTNING_CALIBRATION_DRAWS`` calibrations); ``False`` measures anew."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Under ``precision="bf16-mixed"``, the dtype sharded units reduce-scatter their gradients in
    (FSDP2's ``MixedPrecisionPolicy.reduce_dtype``; they gather in bf16 either way): ``"float32"``,
    torchtitan's default, or ``"bfloat16"``, half the bytes at bf16's rounding of the sum.
    Replicated units all-reduce fp32 gradients (DDP's reducer); other precisions reduce in the
    parameters' dtype."""
    compile: Literal["units"] | None = None
    """``"units"``: ``torch.compile`` each plan unit (blocks; leaves such as a Linear or an Embedding
    stay eager) after its checkpointing and before its sharding, as torchtitan does per block;
    profiling then measures the compiled units, each kind compiled once (setup's ``compile`` time).
    A unit that cannot be compiled runs uncompiled, with a warning naming it
    (:mod:`osdp_lightning.runtime.compile`). ``None``: off."""
    pretrained: str | Path | PretrainedWeights | None = None
    """Weights to start from, loaded once the plan is applied: a Hugging Face model directory, a
    ``.safetensors`` file, a ``torch.save`` state dict, or :class:`PretrainedWeights` (key prefix,
    ``strict``). Each rank reads only the tensors and rows it keeps."""

    def __post_init__(self) -> None:
        fix = _setter(self)
        if self.memory_budget is not None:
            parse_memory_budget(self.memory_budget)  # raises, naming the accepted forms
        if self.plan is not None and not isinstance(self.plan, Plan):
            fix("plan", Plan.load(self.plan))
        fix("micro_batch_size", check_micro_batch_size(self.micro_batch_size))
        fix("uniform_choice", check_uniform_choice(self.uniform_choice))
        fix("split_factors", check_split_factors(self.split_factors))
        fix("headroom", check_headroom(self.headroom))
        if self.budget_covers not in ("process", "tensors"):
            raise ValueError(f"budget_covers={self.budget_covers!r}: use 'process' (what the rank's process uses) or "
                             "'tensors' (the tensors the memory model prices)")
        check_compile(self.compile)
        sharded_precision("bf16-mixed", self.reduce_dtype)  # raises, naming the accepted dtypes
        if isinstance(self.pretrained, (str, Path)):
            fix("pretrained", PretrainedWeights(str(self.pretrained)))
        check_choice_options(self.choice_options)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def with_options(self, **options: Any) -> OSDPConfig:
        """This config with some fields replaced; an unknown name is an error listing the known ones."""
        unknown = sorted(set(options) - set(self.field_names()))
        if unknown:
            raise TypeError(f"unknown osdp option(s) {unknown}; the options are {list(self.field_names())}")
        return dataclasses.replace(self, **options) if options else self

    @property
    def budget(self) -> MemoryBudget | None:
        return parse_memory_budget(self.memory_budget) if self.memory_budget is not None else None

    @property
    def choice_options(self) -> ChoiceOptions:
        return ChoiceOptions(split_factors=tuple(self.split_factors),
                             activation_checkpointing=self.activation_checkpointing)

    def profile_options(self, precision: str, split: bool) -> ProfileOptions:
        """How to profile under Lightning's ``precision``; ``split``: measure split overheads too."""
        return ProfileOptions(unit_module_types=self.unit_module_types, unit_name_patterns=self.unit_name_patterns,
                              min_unit_params=self.min_unit_params, repeats=self.profile_repeats,
                              choices=self.choice_options if split else dataclasses.replace(self.choice_options,
                                                                                              split_factors=()),
                              precision=precision, reduce_dtype=self.reduce_dtype)


def _setter(config: OSDPConfig) -> Any:
    """A setter of a frozen dataclass's fields, for normalising them in ``__post_init__``."""
    def fix(name: str, value: Any) -> None:
        object.__setattr__(config, name, value)
    return fix


def check_micro_batch_size(value: Any) -> int | str | None:
    if value is None or value == "auto":
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise ValueError(f"micro_batch_size must be a positive int, 'auto' or None; got {value!r}")


def check_uniform_choice(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return str(resolve(value))
    except ValueError:
        raise ValueError(f"uniform_choice {value!r} is not one of {known_names()} or the aliases "
                         f"{list(ALIASES)}") from None


def check_headroom(value: float | int | str | None) -> float | int | str | None:
    """A share of the budget (a float below 1), bytes (an int or ``"256MiB"``), or None (the default)."""
    if value is None or (isinstance(value, float) and 0 <= value < 1) or value in (0, "0"):
        return value
    parse_bytes(value)  # raises, naming the accepted forms
    return value


def check_split_factors(factors: Sequence[int]) -> tuple[int, ...]:
    factors = tuple(factors or ())
    bad = [k for k in factors if not isinstance(k, int) or k < 2]
    if bad:
        raise ValueError(f"split_factors must be integers >= 2 (or () to turn splitting off); got {bad}")
    return factors
