"""The fake training step of a dry run: a model on fake tensors and what one step of it does.

Every tensor has a shape, dtype and device but no storage (``FakeTensorMode``), so a
1.5B-parameter model costs no memory. One fake step gives, per unit (``recorder.StepRecorder``,
the same hooks as the measured profile): execution order, saved-for-backward and input bytes,
output size, and FLOPs (``FlopCounterMode``), plus the step's activation peak.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import os
import traceback
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.utils._pytree import tree_map_only
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from osdp_lightning.profiling.hook_cycles import multi_grad_hooks_released
from osdp_lightning.profiling.profile import logging_disabled, loss_runner
from osdp_lightning.profiling.recorder import (
    LiveStorageBytes,
    StepRecorder,
    flat_tensors,
    storage_key,
)
from osdp_lightning.profiling.units import ROOT, UnitSpec
from osdp_lightning.runtime.guards import preserved_rng

MIXED_PRECISION_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}

ModelSource = nn.Module | Callable[[], nn.Module]
"""A module (copied without its data, never touched), or a function that builds one (called on the
meta device, so nothing is allocated)."""

_aten = torch.ops.aten
# NOTE: the fused CPU attention kernel has no FLOP formula in torch; it does what flash attention does.
_CPU_SDPA_FLOPS = {
    _aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v),
    _aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda grad, q, k, v, *args, out_shape=None, **kwargs: sdpa_backward_flop_count(grad, q, k, v),
}


class FakeStepError(ValueError):
    """The training step cannot run on fake tensors (it reads a tensor's values, or an operator has
    no shape-only implementation), so its bytes cannot be counted without running it for real."""


@contextlib.contextmanager
def fake_step_errors() -> Iterator[None]:
    """Within the block, the fake-tensor errors of an operation that needs data become a
    :class:`FakeStepError` saying which operation, and where in the model's code it ran."""
    try:
        yield
    except (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException) as err:
        raise FakeStepError(f"the training step cannot run on fake tensors: {type(err).__name__} in "
                            f"{err.func if hasattr(err, 'func') else err} at {_caller_outside_torch(err)} "
                            "(an operation whose result depends on tensor values)") from err


def _caller_outside_torch(err: BaseException) -> str:
    """The innermost frame of the traceback that is not torch's own machinery (a model's code, or
    the torch module that read the values)."""
    internals = os.sep + os.path.join("torch", "")
    frames = traceback.extract_tb(err.__traceback__)
    inner = [f for f in frames if internals not in f.filename or os.sep + "nn" + os.sep in f.filename]
    frame = (inner or frames)[-1]
    return f"{frame.filename}:{frame.lineno} ({frame.name})"


# ---------------------------------------------------------------------------------------------
# Fake model and batch
# ---------------------------------------------------------------------------------------------
def fake_mode() -> FakeTensorMode:
    # NOTE: real inputs (a real batch, index tensors made at init) are accepted as constants.
    return FakeTensorMode(allow_non_fake_inputs=True)


def build_fake_module(model: ModelSource, mode: FakeTensorMode) -> nn.Module:
    """``model`` with fake parameters and buffers: built (or copied) on the meta device, then given
    fake storage.

    NOTE: not built under FakeTensorMode directly: modules that deep-copy fake tensors
    (nn.TransformerEncoder clones its layer) get views that do not share their base's fake storage,
    and every byte count that dedupes storages would count them twice.
    """
    module = build_meta_module(model)
    with mode:
        to_empty_keeping_ties(module, "cpu")
    return module


def to_empty_keeping_ties(module: nn.Module, device: torch.device | str) -> None:
    """``module.to_empty(device=device)``, with tied parameters tied again afterwards.

    NOTE: to_empty gives each holder of a tied parameter its own new one (meta and fake tensors
    cannot share a set_data).
    """
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for owner in module.modules():
        for name, param in owner._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((owner, name))
    module.to_empty(device=device)
    for (first, first_name), *others in holders.values():
        for owner, name in others:
            owner._parameters[name] = first._parameters[first_name]


def build_meta_module(model: ModelSource) -> nn.Module:
    """``model`` on the meta device (shapes only; FSDP2 can shard it, ``to_empty`` fills it).

    A factory runs under ``torch.device("meta")``; a module is copied with meta tensors in place of
    its parameters and buffers (its data is never copied, the caller's module is left as it is).
    """
    if not isinstance(model, nn.Module):
        with torch.device("meta"):
            return model()
    memo: dict[int, torch.Tensor] = {
        id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for p in model.parameters()}
    memo.update({id(b): torch.empty_like(b, device="meta") for b in model.buffers()})
    # NOTE: a LightningModule attached to a Trainer keeps referring to it, not to a copy of it.
    memo.update({id(owner): owner for owner in (getattr(model, "_trainer", None),) if owner is not None})
    return copy.deepcopy(model, memo)


def fake_batch(batch: object, mode: FakeTensorMode) -> object:
    """``batch`` with every tensor fake, on the CPU like the fake module (:func:`build_fake_module`):
    meta and GPU tensors stand for shapes (values are never read)."""
    def convert(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu":
            with mode:
                return torch.zeros(t.shape, dtype=t.dtype)
        return mode.from_tensor(t)
    return tree_map_only(torch.Tensor, convert, batch)


def step_runner(module: nn.Module, batch: object, precision: str = "32-true") -> Callable[[], torch.Tensor]:
    """A function computing the training loss: ``training_step(batch, 0)`` or the summed outputs."""
    autocast = MIXED_PRECISION_DTYPES.get(precision)

    def context() -> contextlib.AbstractContextManager:
        return torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext()

    if hasattr(module, "training_step"):
        return loss_runner(module, batch, context)

    def run_forward() -> torch.Tensor:
        with context():
            out = module(*batch) if isinstance(batch, tuple) else module(batch)
        return sum(t.float().sum() for t in flat_tensors(out))
    return run_forward


# ---------------------------------------------------------------------------------------------
# One fake step: unit order, saved bytes, FLOPs
# ---------------------------------------------------------------------------------------------
def _unit_flops(root: nn.Module, specs: Sequence[UnitSpec], counts: dict[str, dict]) -> dict[str, int]:
    """FLOPs each unit's own modules ran (root: everything else) from FlopCounterMode's counts.

    FlopCounterMode counts a module's whole subtree under ``<root>.<qualified name>`` (see
    :func:`_name_modules_for`); a module's own FLOPs are its count minus its children's, and go to
    the innermost unit holding it.
    """
    prefix = _FLOP_ROOT
    inclusive = {name[len(prefix) + 1:]: sum(ops.values()) for name, ops in counts.items()
                 if name.startswith(prefix + ".")}
    owner: dict[str, str] = {}
    for spec in sorted(specs, key=lambda s: min(n.count(".") for n in s.module_names)):  # inner units last
        for mod_name in spec.module_names:
            for sub_name, _ in root.get_submodule(mod_name).named_modules(prefix=mod_name):
                owner[sub_name] = spec.name
    flops = {s.name: 0 for s in specs}
    for name, module in root.named_modules():
        if name in owner:
            children = sum(inclusive.get(f"{name}.{child}", 0) for child, _ in module.named_children())
            flops[owner[name]] += max(inclusive.get(name, 0) - children, 0)
    total = sum(counts.get("Global", {}).values())
    flops[ROOT] = max(total - sum(flops.values()), 0)
    return flops


_FLOP_ROOT = "<root>"


def _name_modules_for(counter: FlopCounterMode, root: nn.Module) -> None:
    """Make FlopCounterMode name every module ``<root>.<qualified name>``.

    NOTE: its module tracker names the first module it sees after its class and that module's
    children after it, so a LightningModule whose ``training_step`` calls ``self.net`` would be
    counted as ``GPT.h.0...`` and two top-level modules of one class would share a name.
    """
    known = getattr(getattr(counter, "mod_tracker", None), "_known_modules", None)
    if known is None:
        raise RuntimeError("this torch's FlopCounterMode has no module tracker: per-unit FLOPs are unavailable")
    for name, module in root.named_modules():
        known[module] = f"{_FLOP_ROOT}.{name}" if name else _FLOP_ROOT


@dataclasses.dataclass(frozen=True)
class FakeStep:
    order: list[str]
    saved_bytes: dict[str, int]
    input_bytes: dict[str, int]
    output_numel: dict[str, int]
    forward_flops: dict[str, int]
    backward_flops: dict[str, int]
    interleaved: frozenset[str] = frozenset()
    root_tail_bytes: int = 0
    cast_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    """Of ``saved_bytes``, autocast's low-precision copies of parameters (:class:`StepRecorder`)."""


def run_fake_step(module: nn.Module, specs: Sequence[UnitSpec], run_loss: Callable[[], torch.Tensor]) -> FakeStep:
    recorder = StepRecorder(module, specs)
    with preserved_rng(), logging_disabled(module), recorder.installed():
        with FlopCounterMode(display=False, custom_mapping=_CPU_SDPA_FLOPS) as counter:
            _name_modules_for(counter, module)
            with _BackwardFlops(module, specs, counter.get_total_flops, recorder.nested).calls() as backward:
                loss = run_loss()
            forward_counts = counter.get_flop_counts()
            with backward.timed():
                loss.backward()
    forward = _unit_flops(module, specs, forward_counts)
    return FakeStep(recorder.order, recorder.saved_bytes, recorder.input_bytes, recorder.output_numel, forward,
                    backward.flops, frozenset(recorder.interleaved), recorder.root_tail_bytes, dict(recorder.cast_bytes))


class _BackwardFlops:
    """Backward FLOPs per unit: those counted while it is the innermost unit whose backward runs.

    A unit call's backward starts when the gradient of its output is complete and ends when the
    gradients of its inputs are, counting only inputs no other unit call took. NOTE: FlopCounterMode's
    own module tracker waits for every input, and an input that many units share (T5's position bias,
    a learned tensor every block adds) is complete only at the end of the step; GPT's blocks stayed
    open too. Each block was charged the backward of every block before it (block k about k + 1 times
    its own). A call with no input of its own ends when a unit outside it starts. ``clock``: the FLOPs
    counted so far.
    """

    def __init__(self, root: nn.Module, specs: Sequence[UnitSpec], clock: Callable[[], int],
                 nested: Callable[[str, str], bool]) -> None:
        self.root, self.specs, self.clock, self.nested = root, specs, clock, nested
        self.flops: dict[str, int] = {s.name: 0 for s in specs} | {ROOT: 0}
        self._calls: list[tuple[str, list[torch.Tensor], list[torch.Tensor]]] = []  # unit, outputs, inputs
        self._stack: list[int] = []  # calls whose backward runs, innermost last
        self._ends: dict[int, int] = {}  # call -> input gradients still to come
        self._last = 0

    @contextlib.contextmanager
    def calls(self) -> Iterator[_BackwardFlops]:
        """Records every unit call's tensor inputs and outputs that need gradients, during forward."""
        handles = [self.root.get_submodule(mod_name).register_forward_hook(self._record(spec.name), with_kwargs=True)
                   for spec in self.specs for mod_name in spec.module_names]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _record(self, name: str) -> Callable:
        def hook(_mod: nn.Module, args: tuple, kwargs: dict, out: object) -> None:
            needing = [[t for t in flat_tensors(obj) if t.requires_grad] for obj in (out, (args, kwargs))]
            self._calls.append((name, *needing))
        return hook

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        """Tensor hooks that mark each call's start and end, around the backward."""
        takers: dict[int, int] = {}
        for _, _, inputs in self._calls:
            for t in {id(t): t for t in inputs}.values():
                takers[id(t)] = takers.get(id(t), 0) + 1
        handles = []
        for call, (_, outputs, inputs) in enumerate(self._calls):
            own = [t for t in {id(t): t for t in inputs}.values() if takers[id(t)] == 1]
            self._ends[call] = len(own)
            handles += [t.register_hook(self._started(call)) for t in outputs]
            handles += [t.register_hook(self._ended(call)) for t in own]
        self._last = self.clock()
        try:
            yield
            self._charge()
        finally:
            for handle in handles:
                handle.remove()

    def _charge(self) -> None:
        now = self.clock()
        self.flops[self._calls[self._stack[-1]][0] if self._stack else ROOT] += now - self._last
        self._last = now

    def _started(self, call: int) -> Callable:
        def hook(_grad: torch.Tensor) -> None:
            if call in self._stack:  # another of its outputs
                return
            self._charge()
            name = self._calls[call][0]
            while self._stack and not self._ends[self._stack[-1]] and \
                    not self.nested(name, self._calls[self._stack[-1]][0]):
                self._stack.pop()  # no input of its own to end it
            self._stack.append(call)
        return hook

    def _ended(self, call: int) -> Callable:
        def hook(_grad: torch.Tensor) -> None:
            self._ends[call] -= 1
            if not self._ends[call] and call in self._stack:
                self._charge()
                self._stack.remove(call)
        return hook


class _LiveBytes(LiveStorageBytes):
    """Bytes of the tensors a step creates, apart from parameter gradients once accumulated, at the
    moment the step's memory (those bytes plus the gradients) peaks.

    The quantity :func:`osdp_lightning.profiling.profile.measure_activation_peak` reads from MemTracker's
    peak snapshot (activations, temporaries, inputs), without MemTracker's per-module snapshots,
    which take tens of seconds on a 1.5B-parameter model; and, per unit whose backward it is told
    of, the most bytes that backward added above its start (what the measured profile reads as
    MemTracker's ``PEAK_BW - PRE_BW``, but ended at the unit's last gradient, not at MemTracker's
    mark, which waits for every input's gradient).
    """

    def __init__(self, existing: set[int]) -> None:
        super().__init__(existing)
        self.grads = self.peak_total = self.at_peak = 0
        self.open: dict[str, tuple[int, int]] = {}
        """Units in backward: the total at its start and the most since."""
        self.rises: dict[str, int] = {}

    def backward_started(self, name: str) -> None:
        if name not in self.open:  # NOTE: a tied unit's second module starts inside its open backward
            total = self.current + self.grads
            self.open[name] = (total, total)

    def backward_ended(self, name: str) -> None:
        if name in self.open:
            start, most = self.open.pop(name)
            self.rises[name] = max(self.rises.get(name, 0), most - start)

    def mark_gradient(self, key: int) -> None:
        """A parameter's gradient: counted in the total from now on, no longer as the step's own."""
        nbytes = self.live.pop(key, 0)
        self.current -= nbytes
        self.grads += nbytes
        self.existing.add(key)
        self.after_op()

    def after_op(self) -> None:
        total = self.current + self.grads
        if total >= self.peak_total:
            self.peak_total, self.at_peak = total, self.current
        for name, (start, most) in self.open.items():
            if total > most:
                self.open[name] = (start, total)


def peak_new_bytes(run: Callable[[], object], existing: Sequence[torch.Tensor]) -> int:
    """The most bytes of the storages ``run`` creates (not those of ``existing``) alive at once."""
    tracker = _LiveBytes({storage_key(t) for t in existing})
    with tracker:
        run()
    return tracker.peak_total


def step_peak_bytes(model: ModelSource, batch: object, precision: str = "32-true") -> int:
    """The most bytes one training step of ``model`` on ``batch`` creates beside its parameters and
    buffers (gradients, activations, temporaries) at once, from a fake step on a fake copy
    (``model`` itself is not touched); raises :class:`FakeStepError` where the step needs values."""
    try:
        return _fake_step_peak_bytes(model, batch, precision)
    finally:
        release_fake_machinery()  # NOTE: once the fake copy is out of scope


def _fake_step_peak_bytes(model: ModelSource, batch: object, precision: str) -> int:
    mode = fake_mode()
    with fake_step_errors():
        module = build_fake_module(model, mode)
        inputs = fake_batch(batch, mode)
        with mode, preserved_rng(), logging_disabled(module):
            run_loss = step_runner(module, inputs, precision)
            return peak_new_bytes(lambda: run_loss().backward(), [*module.parameters(), *module.buffers()])


def release_fake_machinery() -> None:
    """Free what fake steps leave in reference cycles: their FakeTensorMode, its converters and
    tens of thousands of closures and tuples (43k objects, about 8 MiB of a profile from shapes of
    the GPT 4 x 384). Python's collector frees them at some later moment, which on rank 0 falls
    within the stretch whose growth setup measures (12.5-19.5 MiB from launch to launch)."""
    gc.collect()


def activation_peak(module: nn.Module, run_loss: Callable[[], torch.Tensor], specs: Sequence[UnitSpec] = ()
                    ) -> tuple[int, dict[str, int]]:
    """Bytes of one fake forward+backward that are neither parameters nor gradients at the step's
    peak, less the largest gradient (the one in flight), as the measured profile counts them; and
    per unit of ``specs`` the most bytes its backward added above what was alive when it started."""
    with preserved_rng(), logging_disabled(module):
        tracker = _tracked_step(module, run_loss, specs)
    largest_grad = max((p.numel() * p.element_size() for p in module.parameters() if p.requires_grad), default=0)
    return max(tracker.at_peak - largest_grad, 0), tracker.rises


def _tracked_step(module: nn.Module, run_loss: Callable[[], torch.Tensor], specs: Sequence[UnitSpec]) -> _LiveBytes:
    """One forward+backward under :class:`_LiveBytes`, with each unit's backward marked by torch's
    module tracker; the gradients are dropped afterwards."""
    from torch.distributed._tools.mod_tracker import ModTracker

    tracker = _LiveBytes({storage_key(t) for t in [*module.parameters(), *module.buffers()]})
    names = {id(module.get_submodule(m)): spec.name for spec in specs if spec.name != ROOT for m in spec.module_names}
    # NOTE: a unit's backward ends with its last parameter's gradient, as the profiler times it; torch's
    # module tracker ends it when every input's gradient is complete, which an input many units share
    # (T5's position bias) is only at the end of the step, and before the gradients of its first layer.
    pending = {spec.name: {id(p) for m in spec.module_names for p in module.get_submodule(m).parameters()
                           if p.requires_grad} for spec in specs if spec.name != ROOT}

    def accumulated(param: torch.Tensor) -> None:
        tracker.mark_gradient(storage_key(param.grad))
        for name, waiting in pending.items():
            if id(param) in waiting:
                waiting.discard(id(param))
                if not waiting:
                    tracker.backward_ended(name)

    handles = [p.register_post_accumulate_grad_hook(accumulated) for p in module.parameters() if p.requires_grad]

    def marker(mark: Callable[[str], None]) -> Callable[[nn.Module | None, object], None]:
        def hook(mod: nn.Module | None, _grads: object) -> None:
            if mod is not None and id(mod) in names:
                mark(names[id(mod)])
        return hook

    modules = ModTracker()  # NOTE: torch's own per-module backward start, as MemTracker uses it
    modules.register_user_hooks(pre_bw_hook=marker(tracker.backward_started))
    try:
        with tracker, modules, multi_grad_hooks_released():
            run_loss().backward()
    finally:
        for handle in handles:
            handle.remove()
    for name in list(tracker.open):  # units without trainable parameters end with the step
        tracker.backward_ended(name)
    module.zero_grad(set_to_none=True)
    return tracker


def activation_bytes_of(module: nn.Module, specs: Sequence[UnitSpec], run_loss: Callable[[], torch.Tensor]) -> int:
    """What the measured profile calls activation bytes: those saved for backward, or the peak of
    activations and backward temporaries if that is larger."""
    recorder = StepRecorder(module, specs)
    with preserved_rng(), logging_disabled(module), recorder.installed():
        run_loss()
    return max(sum(recorder.saved_bytes.values()), activation_peak(module, run_loss)[0])


def doubled_batch(batch: object, micro_batch: int) -> object:
    """``batch`` with twice the samples (tensors whose first dimension is the micro-batch size)."""
    def double(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t]) if t.dim() > 0 and t.shape[0] == micro_batch else t
    return tree_map_only(torch.Tensor, double, batch)
