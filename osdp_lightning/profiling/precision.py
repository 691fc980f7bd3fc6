"""Lightning's ``precision=`` flag as FSDP2 runs it, and as the cost model prices it.

Under ``"bf16-mixed"`` the sharded units run the way hand-written FSDP2 does (torchtitan's default):
``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``. Their fp32
shards stay the master weights (the optimizer steps them, in fp32), all-gathers move bf16 (half
the bytes), the gathered parameters are bf16 (half the memory; autocast then makes no copy of
them) and gradients are computed in bf16, cast to fp32 and reduce-scattered in fp32. Replicated
units keep fp32 parameters under Lightning's autocast and all-reduce fp32 gradients (DDP's
reducer). ``"bf16-true"``, ``"16-true"``, ``"32-true"`` and ``"64-true"`` gather and reduce in the
parameters' own dtype (FSDP2's default policy). ``"16-mixed"`` is refused: its gradient scaler
would have to see every rank's shards to skip a step on all of them alike.

:class:`ShardedPrecision` is what a profile is priced with and a plan is applied with (both record
its two dtype names; ``""`` means FSDP2's default, the parameters' own dtype).
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from osdp_lightning.profiling.records import ModelProfile

SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-true", "64-true")
"""Lightning precision flags the osdp strategy trains with (``"32"``, ``"64"``: their short names)."""
REDUCE_DTYPES = ("float32", "bfloat16")
"""``reduce_dtype`` values under ``bf16-mixed``: fp32 (torchtitan's default) or bf16 (half the bytes)."""
_SHORT_NAMES = {"32": "32-true", "64": "64-true", "bf16": "bf16-mixed", "16": "16-mixed"}


@dataclasses.dataclass(frozen=True)
class ShardedPrecision:
    """The dtypes sharded units gather and reduce in (FSDP2's ``MixedPrecisionPolicy``)."""

    param_dtype: str = ""
    """All-gathers and the gathered parameters (``"bfloat16"``); ``""``: the parameters' own dtype."""
    reduce_dtype: str = ""
    """Gradient reduce-scatters (``"float32"``); ``""``: the dtype the gradients were computed in."""

    def policy(self, *, cast_forward_inputs: bool = True) -> MixedPrecisionPolicy:
        """FSDP2's policy; ``cast_forward_inputs=False`` for the root, whose inputs are the batch (a
        float target stays what the loss compares with; each unit casts its own inputs)."""
        return MixedPrecisionPolicy(param_dtype=self.gather_dtype, reduce_dtype=_dtype(self.reduce_dtype),
                                    cast_forward_inputs=cast_forward_inputs)

    @property
    def gather_dtype(self) -> torch.dtype | None:
        """The dtype of the gathered parameters, ``None`` as stored."""
        return _dtype(self.param_dtype)

    def gather_bytes_per_element(self, stored_bytes_per_element: int) -> int:
        return _element_bytes(self.param_dtype, stored_bytes_per_element)

    def reduce_bytes_per_element(self, stored_bytes_per_element: int) -> int:
        return _element_bytes(self.reduce_dtype or self.param_dtype, stored_bytes_per_element)

    def describe(self) -> str:
        """``"gather bfloat16, reduce float32"``, or ``"as stored"`` (FSDP2's default policy)."""
        if not (self.param_dtype or self.reduce_dtype):
            return "as stored"
        return f"gather {self.param_dtype or 'as stored'}, reduce {self.reduce_dtype or 'as computed'}"


def sharded_precision(precision: str | None, reduce_dtype: str = "float32") -> ShardedPrecision:
    """How sharded units run under Lightning's ``precision`` flag; ``reduce_dtype`` applies to
    ``bf16-mixed`` only. Raises ``ValueError`` naming what works for ``16-mixed`` and unknown flags."""
    flag = _SHORT_NAMES.get(str(precision), str(precision)) if precision is not None else "32-true"
    if reduce_dtype not in REDUCE_DTYPES:
        raise ValueError(f"reduce_dtype must be one of {list(REDUCE_DTYPES)}, got {reduce_dtype!r}")
    if flag == "bf16-mixed":
        return ShardedPrecision("bfloat16", reduce_dtype)
    if flag in SUPPORTED_PRECISIONS:
        return ShardedPrecision()
    if flag == "16-mixed":
        raise ValueError("the osdp strategy does not train with precision='16-mixed': fp16's gradient scaler "
                         "would have to check every rank's gradient shards to skip a step on all ranks alike "
                         "(Lightning's ModelParallelStrategy refuses it too). Use precision='bf16-mixed' "
                         f"(no scaler); supported: {list(SUPPORTED_PRECISIONS)}")
    raise ValueError(f"precision {precision!r} is not supported by the osdp strategy; supported: "
                     f"{list(SUPPORTED_PRECISIONS)}")


def with_precision(profile: ModelProfile, precision: ShardedPrecision) -> ModelProfile:
    """``profile`` priced for sharded units that run under ``precision``: the bytes per element of
    gathered parameters and reduced gradients, and the dtypes a plan from it is applied with."""
    stored = profile.param_bytes_per_element
    return dataclasses.replace(
        profile, param_dtype=precision.param_dtype, reduce_dtype=precision.reduce_dtype,
        compute_bytes_per_element=precision.gather_bytes_per_element(stored),
        reduce_bytes_per_element=precision.reduce_bytes_per_element(profile.grad_bytes_per_element))


def plan_precision(plan: object) -> ShardedPrecision:
    """The precision a plan (:class:`~osdp_lightning.plan.plan.Plan`) was priced for and is applied with."""
    return ShardedPrecision(getattr(plan, "param_dtype", ""), getattr(plan, "reduce_dtype", ""))


def check_plan_precision(plan: object, precision: str | None, reduce_dtype: str = "float32") -> str | None:
    """Refuse a saved plan priced for sharded units in another dtype than this run's precision runs
    them in (applied as saved, a bf16 plan without autocast would compute its sharded units in
    bf16). A plan that names no dtype (saved before plans recorded one, or made under ``32-true``)
    is applied as it was priced, FSDP2's default policy: the note saying so is returned, else ``None``."""
    wanted, planned = sharded_precision(precision, reduce_dtype), plan_precision(plan)
    if wanted == planned:
        return None
    if planned.param_dtype or planned.reduce_dtype:
        raise ValueError(f"the plan was made for sharded units that {planned.describe()}, but this run's "
                         f"precision={precision!r} runs them {wanted.describe()}: plan again under this "
                         "precision, or train with the precision the plan was made for")
    return (f"the saved plan names no precision: its sharded units gather and reduce in their parameters' "
            f"dtype, as it was priced (precision={precision!r} would {wanted.describe()}; plan again for that)")


def _dtype(name: str) -> torch.dtype | None:
    return getattr(torch, name) if name else None


def _element_bytes(name: str, default: int) -> int:
    return torch.empty((), dtype=getattr(torch, name)).element_size() if name else default
