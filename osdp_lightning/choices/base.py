"""What a choice is, what a family of choices provides, and the one registry of families.

A :class:`Choice` is a kind plus integer parameters plus modifiers: ``zero3``,
``split(k=4, sharded=3)``, ``hsdp(g=8)``, ``zero3(reshard=8)``, ``zero3+ckpt``. Its ``str()`` is
the name plans, tables and configs use; :func:`parse` reads a name back. A family
(:class:`ChoiceFamily`) is identified by its kind and parameter names (``zero3`` and
``zero3(reshard=G)`` are two families) and says what the choice costs and how it is applied,
and, through hooks that do nothing by default, what else the pipeline does for it: what it needs
measured on the profiled model, what is done once every unit is applied, which step terms its
machinery adds and how calibration measures them. A modifier (:class:`ChoiceModifier`, ``+ckpt``) combines with any family's choice: it adjusts
the cost of the choice it modifies and transforms the module before the family applies it.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from osdp_lightning.cost.budget import MISS_MARGIN
from osdp_lightning.cost.step_terms import Affine, GroupTerms, register_group_terms
from osdp_lightning.runtime.replicate import ignored_for

if TYPE_CHECKING:  # NOTE: annotations only: apply.py imports this package
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from osdp_lightning.cost.cluster import ClusterSpec
    from osdp_lightning.cost.cost import ChoiceCost, CostContext
    from osdp_lightning.profiling.records import ModelProfile, UnitProfile
    from osdp_lightning.runtime.meshes import Meshes

_NAME_RE = re.compile(r"^(?P<kind>[a-z][a-z0-9_]*)(?:\((?P<params>[^()]*)\))?(?P<mods>(?:\+[a-z][a-z0-9_]*)*)$")
_PARAM_RE = re.compile(r"^\s*([a-z_]+)\s*=\s*(\d+)\s*$")


@dataclass(frozen=True)
class Choice:
    """One way to run a unit. ``str()`` gives its name; :func:`parse` reads the name back."""

    kind: str
    """The family's kind: ``replicate``, ``zero2``, ``zero3``, ``split``, ``hsdp``."""
    params: tuple[tuple[str, int], ...] = ()
    """``(name, value)`` pairs in the family's order, e.g. ``(("k", 4), ("sharded", 3))``."""
    modifiers: tuple[str, ...] = ()
    """Modifier names in registry order, e.g. ``("ckpt",)``."""

    def __str__(self) -> str:
        text = self.kind
        if self.params:
            text += "(" + ", ".join(f"{name}={value}" for name, value in self.params) + ")"
        return text + "".join(f"+{m}" for m in self.modifiers)

    def __getitem__(self, name: str) -> int:
        for key, value in self.params:
            if key == name:
                return value
        raise KeyError(f"choice {self} has no parameter {name!r}")

    @property
    def signature(self) -> tuple[str, tuple[str, ...]]:
        """What identifies the family: the kind and the parameter names."""
        return self.kind, tuple(name for name, _ in self.params)

    @property
    def base(self) -> Choice:
        """This choice without its modifiers."""
        return Choice(self.kind, self.params)

    def with_modifier(self, name: str) -> Choice:
        return Choice(self.kind, self.params, _ordered_modifiers({*self.modifiers, name}))


@dataclass(frozen=True)
class ChoiceOptions:
    """What the strategy (or a dry run, or ``osdp-plan``) lets the solver choose from."""

    split_factors: tuple[int, ...] = ()
    """Slice counts ``k`` a Linear may be split into; ``()`` turns splitting off."""
    group_sizes: tuple[int, ...] | None = None
    """Group sizes of ``hsdp(g=G)`` / ``zero3(reshard=G)``; ``None``: one node's ranks on several nodes."""
    activation_checkpointing: str = "auto"
    """``auto``: the ILP decides per unit; ``never``; ``always``: every unit that can (``+ckpt``)."""


_SESSION: contextvars.ContextVar[dict[str, dict] | None] = contextvars.ContextVar("osdp_measure_session", default=None)


@contextlib.contextmanager
def measurement_session() -> Iterator[None]:
    """Measure hooks called inside it may reuse what they measured before in it (:func:`session_memo`):
    one model's units measured one kind at a time share their Linear layers' timings."""
    token = _SESSION.set({}) if _SESSION.get() is None else None
    try:
        yield
    finally:
        if token is not None:
            _SESSION.reset(token)


def session_memo(owner: str) -> dict:
    """``owner``'s memo for the current :func:`measurement_session` (a fresh dict outside one)."""
    session = _SESSION.get()
    return {} if session is None else session.setdefault(owner, {})


CostFn = Callable[["UnitProfile", Choice, "CostContext"], "ChoiceCost"]
ApplyFn = Callable[[nn.Module, tuple[str, ...], Choice, "Meshes", "MixedPrecisionPolicy"], None]
StepContext = Callable[[], contextlib.AbstractContextManager]
MeasureFn = Callable[[nn.Module, object, "ModelProfile", ChoiceOptions, StepContext], "ModelProfile"]
FinishFn = Callable[[nn.Module, "Meshes", "MixedPrecisionPolicy"], None]
ConnectFn = Callable[[nn.Module], None]
TermsFit = tuple[dict[str, Affine], dict[str, Affine]]


@dataclass(frozen=True)
class StackTimings:
    """What calibration measured of one family's bench: a stack of small pre-norm MLP blocks (two
    fp32 ``nn.Linear(width, width)`` with bias each, a real block's compute between their
    collectives), whose units are the blocks, or each Linear (``FamilyCalibration.linear_units``),
    under the family's bench choice, per stack width."""

    excess_s: Mapping[int, float]
    """Seconds per unit and step beyond what the cost model gives the stack (its measured compute,
    the model's collectives and overlap)."""
    optimizer_s: Mapping[int, float]
    """Seconds of the optimizer step per unit."""
    unit_bytes: Mapping[int, int]
    """fp32 bytes of one unit's parameters per width: the x-axis of the per-byte fits."""
    unit_tensors: int
    """Parameter tensors per unit (the optimizer costs a constant per tensor)."""

    def points(self, seconds: Mapping[int, float]) -> list[tuple[float, float]]:
        """``(unit bytes, seconds)`` per width, for :meth:`Affine.fit`."""
        return [(self.unit_bytes[w], s) for w, s in seconds.items()]


@dataclass(frozen=True)
class FamilyCalibration:
    """How calibration (``osdp_lightning/calibrate/``) measures a family's group terms: block
    stacks whose every unit takes ``bench``, timed against the same stacks unsharded."""

    bench: str
    """The choice every unit of the stack takes."""
    fit: Callable[[StackTimings | None, Mapping[str, Affine], Mapping[str, Affine]], TermsFit]
    """``(overhead, optimizer)`` terms of the family's group kinds from its bench (``None`` when it
    was not benched) and the overhead and optimizer terms of the families registered before it."""
    root: str = ""
    """The stack's root's choice (``""``: ``bench``)."""
    reference: Callable[[nn.Module, str], None] | None = None
    """Transforms each unit (by name) of the unsharded stack the bench is timed against, so that the
    difference is the family's machinery alone (``None``: the plain stack)."""
    optional: bool = False
    """Benched only when calibration is asked for every family; else ``fit`` gets ``None``."""
    linear_units: bool = False
    """Each of the blocks' Linears is a unit (the rest of a block runs in the root's group) instead
    of each block (a split cuts one Linear)."""


def whole_unit_calibration(kind: str) -> FamilyCalibration:
    """The calibration of a family that runs each unit as one group of ``kind``: its per-group and
    per-byte terms fitted over the stack's widths."""
    def fit(timings: StackTimings | None, _overhead: Mapping[str, Affine], _optimizer: Mapping[str, Affine]
            ) -> TermsFit:
        assert timings is not None, f"{kind} is always benched"
        return ({kind: Affine.fit(timings.points(timings.excess_s), 1)},
                {kind: Affine.fit(timings.points(timings.optimizer_s), timings.unit_tensors)})
    return FamilyCalibration(bench=kind, fit=fit)


def _always(_unit: UnitProfile, _choice: Choice, _ctx: CostContext) -> bool:
    return True


def _no_groups(_choice: Choice) -> tuple[int, ...]:
    return ()


def _profile_unchanged(_module: nn.Module, _batch: object, profile: ModelProfile, _options: ChoiceOptions,
                       _step_context: StepContext) -> ModelProfile:
    return profile


def _nothing_to_finish(_root: nn.Module, _meshes: Meshes, _mp_policy: MixedPrecisionPolicy) -> None:
    return None


def _nothing_to_connect(_root: nn.Module) -> None:
    return None


@dataclass(frozen=True)
class MemoryMiss:
    """How far the memory model was measured to miss the tracked peak of plans of one kind of
    choice (CPU, 2 gloo ranks): what that kind keeps free under headroom by kind
    (:func:`osdp_lightning.choices.kept_share`)."""

    under_share: float
    """The largest under-prediction measured: measured peak over predicted, less 1 (0 if none was under)."""
    spread_share: float
    """The largest spread of one plan's peak over its launches, as a share of its least."""
    basis: str
    """Which plans and launches were measured."""

    @property
    def kept_share(self) -> float:
        """The share of its bytes the kind keeps free: its miss and spread, and the margin every
        measured figure keeps (:data:`~osdp_lightning.cost.budget.MISS_MARGIN`)."""
        return self.under_share + self.spread_share + MISS_MARGIN


@dataclass(frozen=True)
class ChoiceFamily:
    """One family of choices: its name and parameters, its cost, how it is applied, and hooks for
    what the other stages do for it (each does nothing by default)."""

    kind: str
    param_names: tuple[str, ...]
    cost: CostFn
    """Per-rank bytes and seconds of a choice of this family for one unit."""
    apply: ApplyFn
    """Applies the choice to the unit's modules ``model.get_submodule(name)`` (``""``: ``model``)."""
    space: Callable[[ChoiceOptions, ClusterSpec], tuple[Choice, ...]]
    """The choices of this family the options and the cluster allow."""
    allowed: Callable[[UnitProfile, Choice, CostContext], bool] = _always
    """Whether a unit can take the choice (a split needs one Linear whose width ``k`` divides)."""
    mesh_groups: Callable[[Choice], tuple[int, ...]] = _no_groups
    """Group sizes of the extra (W/g, g) meshes the choice needs."""
    measure: MeasureFn = _profile_unchanged
    """``(module, batch, profile, options, step_context)``: the profile with what the family's
    cost needs measured on the whole model added (split: what cutting each Linear costs)."""
    finish: FinishFn = _nothing_to_finish
    """``(root, meshes, mp_policy)``, once every unit of a plan is applied, on this rank alone
    (replicate: the ``fully_shard`` its marked units need around them)."""
    connect: ConnectFn = _nothing_to_connect
    """``(root)``, the last step of applying, which may talk to the other ranks: every rank calls it
    once every rank has finished (replicate: DDP's reducer)."""
    group_terms: tuple[GroupTerms, ...] = ()
    """The group kinds its machinery is priced as, with default figures (``()``: it prices its
    groups as another family's kinds)."""
    calibration: FamilyCalibration | None = None
    """How calibration measures its ``group_terms`` (``None``: it has none of its own)."""
    memory_miss: MemoryMiss | None = None
    """The memory model's measured miss on plans of this family (``None``: not measured; its
    choices keep the flat CPU default share under headroom by kind)."""

    @property
    def signature(self) -> tuple[str, tuple[str, ...]]:
        return self.kind, self.param_names


@dataclass(frozen=True)
class ChoiceModifier:
    """A modifier combined with any family's choice (``+name``)."""

    name: str
    cost: Callable[[ChoiceCost, UnitProfile, Choice, CostContext], ChoiceCost]
    """The modified cost, from the cost of the choice without this modifier."""
    apply: ApplyFn
    """Transforms the unit's modules; runs before the family's own apply."""
    space: Callable[[ChoiceOptions, tuple[Choice, ...]], tuple[Choice, ...]]
    """The choice space with this modifier, from the options and the space without it."""
    allowed: Callable[[UnitProfile, Choice, CostContext], bool] = _always
    measure: MeasureFn = _profile_unchanged
    """As :attr:`ChoiceFamily.measure` (``+ckpt``: which units' recomputation replays their forward)."""
    memory_miss: MemoryMiss | None = None
    """As :attr:`ChoiceFamily.memory_miss`, for choices with this modifier."""


@dataclass
class _Registry:
    families: dict[tuple[str, tuple[str, ...]], ChoiceFamily] = field(default_factory=dict)
    modifiers: dict[str, ChoiceModifier] = field(default_factory=dict)


REGISTRY = _Registry()


def register(family: ChoiceFamily) -> ChoiceFamily:
    """Add ``family`` to the registry and its group kinds to the step model's."""
    if family.signature in REGISTRY.families:
        raise ValueError(f"choice family {family.signature} is registered twice")
    if (family.calibration is None) != (not family.group_terms):
        raise ValueError(f"choice family {family.signature} must calibrate exactly the group terms it brings")
    REGISTRY.families[family.signature] = family
    for terms in family.group_terms:
        register_group_terms(terms)
    return family


def register_modifier(modifier: ChoiceModifier) -> ChoiceModifier:
    if modifier.name in REGISTRY.modifiers:
        raise ValueError(f"choice modifier {modifier.name!r} is registered twice")
    REGISTRY.modifiers[modifier.name] = modifier
    return modifier


def family_of(choice: Choice | str) -> ChoiceFamily:
    choice = as_choice(choice)
    return REGISTRY.families[choice.signature]


def _ordered_modifiers(names: set[str] | Sequence[str]) -> tuple[str, ...]:
    return tuple(m for m in REGISTRY.modifiers if m in set(names))


def known_names() -> list[str]:
    """Every family and modifier as a name pattern, for error messages."""
    families = [f"{kind}({', '.join(f'{n}=N' for n in names)})" if names else kind
                for kind, names in REGISTRY.families]
    return families + [f"<choice>+{m}" for m in REGISTRY.modifiers]


def parse(text: str) -> Choice:
    """The :class:`Choice` named ``text`` (``str()`` of a Choice); ``ValueError`` if no family has it."""
    match = _NAME_RE.match(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"{text!r} is not a choice name; known choices: {known_names()}")
    params: dict[str, int] = {}
    for part in filter(None, (match.group("params") or "").split(",")):
        param = _PARAM_RE.match(part)
        if param is None or param.group(1) in params:
            raise ValueError(f"{text!r}: bad parameter {part.strip()!r}; known choices: {known_names()}")
        params[param.group(1)] = int(param.group(2))
    family = next((f for (kind, names), f in REGISTRY.families.items()
                   if kind == match.group("kind") and set(names) == set(params)), None)
    if family is None or (match.group("params") is not None and not params):
        raise ValueError(f"{text!r} names no known choice; known choices: {known_names()}")
    modifiers = [m for m in match.group("mods").split("+") if m]
    unknown = [m for m in modifiers if m not in REGISTRY.modifiers]
    if unknown or len(set(modifiers)) != len(modifiers):
        raise ValueError(f"{text!r}: unknown or repeated modifier {unknown or modifiers}; known choices: "
                         f"{known_names()}")
    return Choice(family.kind, tuple((n, params[n]) for n in family.param_names), _ordered_modifiers(modifiers))


def as_choice(choice: Choice | str) -> Choice:
    return choice if isinstance(choice, Choice) else parse(choice)


def is_known(text: str) -> bool:
    try:
        parse(text)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# Helpers the families share
# ---------------------------------------------------------------------------------------------
def unit_modules(model: nn.Module, module_names: tuple[str, ...]) -> nn.Module | list[nn.Module]:
    """The module(s) of a unit; tied modules as a list (FSDP2's list form keeps them in one group)."""
    modules = [model.get_submodule(name) for name in module_names]
    return modules[0] if len(modules) == 1 else modules


def fully_shard_apply(kwargs: Callable[[Choice, Meshes], dict]) -> ApplyFn:
    """An apply function that calls ``fully_shard`` on the unit with ``kwargs(choice, meshes)``."""
    def apply(model: nn.Module, module_names: tuple[str, ...], choice: Choice, meshes: Meshes,
              mp_policy: MixedPrecisionPolicy) -> None:
        target = unit_modules(model, module_names)
        # NOTE: replicated units below this one stay plain tensors on DDP's reducer (osdp_lightning/runtime/replicate.py).
        ignored = ignored_for(target)
        check_one_dtype(target, ignored, module_names, choice)
        extra = {"ignored_params": ignored} if ignored else {}
        fully_shard(target, **kwargs(choice, meshes), mp_policy=mp_policy, **extra)
    return apply


def check_one_dtype(target: nn.Module | list[nn.Module], ignored: set[nn.Parameter], module_names: tuple[str, ...],
                    choice: Choice) -> None:
    """Refuse to shard a unit whose trainable parameters have several dtypes, naming it and them.

    NOTE: FSDP2 needs one original dtype per group and says so only at the first forward, without
    naming the module ("FSDP expects uniform original parameter dtype"); the planner offers such
    a unit replicate only (``UnitProfile.mixed_dtypes``), so this catches saved or hand-made plans."""
    modules = target if isinstance(target, list) else [target]
    skipped = {id(p) for p in ignored}
    found: dict[str, str] = {}
    for module, name in zip(modules, module_names, strict=True):
        for param_name, param in module.named_parameters(prefix=name):
            # NOTE: a unit inside this one was sharded first: its parameters are DTensors by now.
            if param.requires_grad and id(param) not in skipped and not isinstance(param, DTensor):
                found.setdefault(str(param.dtype).removeprefix("torch."), param_name)
    if len(found) > 1:
        unit = "+".join(module_names) or "<root>"
        examples = ", ".join(f"{dtype} ({param})" for dtype, param in sorted(found.items()))
        raise ValueError(f"unit {unit!r} cannot take {choice}: its trainable parameters have several dtypes "
                         f"({examples}) and FSDP2 shards a group of one dtype. Give it replicate, or cast its "
                         "parameters to one dtype")
