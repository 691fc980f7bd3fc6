"""Stage 1: measure the model.

Runs the real training computation (``training_step`` plus backward on one real batch) a few
times on the unwrapped module and records, per unit in execution order, the parameter counts,
forward and backward seconds (median over repeats) and the bytes saved for backward. Leaves no
trace: weights, buffers, gradients and RNG state are restored, ``self.log`` calls are dropped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from osdp_lightning.profiling.forward_rise import forward_rises
from osdp_lightning.profiling.hook_cycles import multi_grad_hooks_released
from osdp_lightning.profiling.recorder import StepRecorder
from osdp_lightning.profiling.records import UnitProfile, with_measured_parts
from osdp_lightning.profiling.units import ROOT, UnitSpec, owned_params
from osdp_lightning.runtime.compile import is_compiled
from osdp_lightning.runtime.guards import preserved_state


# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _StepSample:
    forward_s: dict[str, float]
    backward_s: dict[str, float]
    saved_bytes: dict[str, int]
    input_bytes: dict[str, int]
    order: list[str]
    step_s: float
    interleaved: frozenset[str] = frozenset()
    root_tail_bytes: int = 0
    cast_bytes: dict[str, int] = dataclasses.field(default_factory=dict)


def _synchronized_now(device: torch.device) -> float:
    """The clock once ``device`` has finished what was queued on it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _measure_step(root: nn.Module, specs: list[UnitSpec], run_loss: Callable[[], torch.Tensor],
                  device: torch.device) -> _StepSample:
    def now() -> float:
        return _synchronized_now(device)

    rec = StepRecorder(root, specs, clock=now)
    with rec.installed():
        start = now()
        loss = run_loss()
        forward_end = now()
        loss.backward()
        end = now()
    # Backward of a unit ends when its last gradient is accumulated; the time since the previous
    # unit's gradients finished is its backward (ops between units are charged to the later one).
    backward_s: dict[str, float] = {}
    previous = forward_end
    for name, t in sorted(rec.grad_done_t.items(), key=lambda kv: kv[1]):
        backward_s[name] = max(t - previous, 0.0)
        previous = t
    backward_s[ROOT] = max(end - previous, 0.0)
    forward_s = dict(rec.forward_s)
    forward_s[ROOT] = max(forward_end - start - sum(rec.forward_s.values()), 0.0)
    return _StepSample(forward_s, backward_s, dict(rec.saved_bytes), dict(rec.input_bytes), rec.order, end - start,
                       frozenset(rec.interleaved), rec.root_tail_bytes, dict(rec.cast_bytes))


def measure_units(root: nn.Module, specs: list[UnitSpec], run_loss: Callable[[], torch.Tensor],
                  device: torch.device, repeats: int = 3, activation_peak: bool = True,
                  ) -> tuple[list[UnitProfile], int, float]:
    """Profile ``run_loss`` (forward returning a loss) plus backward ``repeats`` times.

    Returns the unit profiles in execution order (root last), the activation bytes (saved for
    backward, or the measured peak of activations and temporaries if larger) and the median step
    seconds; one more forward with nothing saved gives each unit's forward rise
    (:func:`forward_rises`). Gradients, buffers and RNG state are restored afterwards.
    ``activation_peak=False`` skips the tracked step that measures the activation peak and the
    backward and forward rises (a caller that has its bytes from elsewhere; on CPU, ``MemTracker``
    keeps the tensors of the step it tracked alive).
    """
    # A block and its parts: one run. NOTE: a compiled unit runs as one graph: its parts have no
    # time of their own, and hooks inside it would recompile it at every step.
    nested = [*specs, *(part for s in specs if not _is_compiled_unit(root, s) for part in s.parts)]
    with preserved_state(root):
        warmup = _measure_step(root, nested, run_loss, device)  # also: allocator, lazy init, caches
        root.zero_grad(set_to_none=True)
        # NOTE: a module whose forward is never called (nn.MultiheadAttention reads out_proj.weight
        # directly) cannot be its own FSDP unit: its hooks would never gather the weight.
        nested = [s for s in nested if s.name in warmup.order]
        samples = []
        for _ in range(repeats):
            samples.append(_measure_step(root, nested, run_loss, device))
            root.zero_grad(set_to_none=True)
        if device.type == "cuda":
            samples = _rescaled_to_free_steps(samples, root, run_loss, device, repeats)
        peak_bytes, rises = measure_activation_peak(root, run_loss, device) if activation_peak else (0, {})
        root.zero_grad(set_to_none=True)
        forward = forward_rises(root, nested, run_loss) if activation_peak else {}
    first = samples[0]
    by_name = {s.name: s for s in nested}
    owned = owned_params(root, nested)
    own = {n: _unit_profile(n, by_name[n].module_names, owned[n], root, samples, rises, forward.get(n))
           for n in first.order if n in by_name}
    units = [with_measured_parts(own[s.name], [own[p.name] for p in s.parts if p.name in own], first.order)
             for s in sorted((s for s in specs if s.name in own), key=lambda s: first.order.index(s.name))]
    units.append(_unit_profile(ROOT, (ROOT,), owned[ROOT], root, samples, {}, None))
    activation_bytes = max(sum(first.saved_bytes.values()), peak_bytes)
    return units, activation_bytes, statistics.median(s.step_s for s in samples)


def _is_compiled_unit(root: nn.Module, spec: UnitSpec) -> bool:
    return any(is_compiled(root.get_submodule(name)) for name in spec.module_names if name != ROOT)


def _rescaled_to_free_steps(samples: list[_StepSample], root: nn.Module, run_loss: Callable[[], torch.Tensor],
                            device: torch.device, repeats: int) -> list[_StepSample]:
    """``samples`` with every unit's time scaled so that the step takes what it takes unobserved.

    NOTE: on CUDA the clock synchronizes at every unit boundary, so the host cannot queue a unit's
    kernels while the previous unit runs: GPT 12 x 1024 on an H200 profiled 0.072 s of forward and
    backward against 0.047 s in training. A step without hooks, synchronized only at its ends, sets
    the total; the split between units stays the measured one."""
    free = []
    for _ in range(repeats):
        start = _synchronized_now(device)
        run_loss().backward()
        free.append(_synchronized_now(device) - start)
        root.zero_grad(set_to_none=True)
    observed = statistics.median(s.step_s for s in samples)
    ratio = min(statistics.median(free) / observed, 1.0) if observed > 0 else 1.0
    return [dataclasses.replace(s, forward_s={k: v * ratio for k, v in s.forward_s.items()},
                                backward_s={k: v * ratio for k, v in s.backward_s.items()}, step_s=s.step_s * ratio)
            for s in samples]


class _NoHook:
    def remove(self) -> None:
        pass


_MODULE_STATES = {"PRE_FW": "forward_start", "BEF_PRE_FW": "forward_start", "PEAK_FW": "forward_peak",
                  "PRE_BW": "backward_start", "BEF_PRE_BW": "backward_start", "PEAK_BW": "backward_peak",
                  "POST_FW_AC": "recomputed"}
"""Tracker states kept per module, by state name: ``MemTracker``'s ``_ModState`` and
``FSDPMemTracker``'s ``_FSDPModState`` (whose starts are before FSDP2's pre-hooks)."""


def module_snapshots(tracker: object) -> dict[str, dict[str, int]]:
    """Bytes of this rank at each state of :data:`_MODULE_STATES` per module a CPU tracker
    followed (the largest, for a module that ran twice), by name relative to the tracked model
    (``""``: the model itself); ``{}`` for the CUDA allocator, which keeps no such record."""
    tracking = getattr(tracker, "memory_tracking", None)
    # NOTE: the trackers name the tracked model by its class
    return {stat.mod_fqn.partition(".")[2]: _state_bytes(stat) for stat in tracking.values()} if tracking else {}


def _state_bytes(stat: object) -> dict[str, int]:
    """One module's tracker record as bytes per state label of :data:`_MODULE_STATES`."""
    return {label: max(sum(dev.get("Total", 0) for dev in snap.values()) for snap in snaps)
            for state, snaps in stat.snapshots.items()
            if snaps and (label := _MODULE_STATES.get(getattr(state, "name", "")))}


def measure_activation_peak(root: nn.Module, run_loss: Callable[[], torch.Tensor], device: torch.device
                            ) -> tuple[int, dict[str, int]]:
    """Peak bytes of one forward+backward that are neither parameters nor gradients, and per module
    (by qualified name) the most bytes its backward added above what was alive when it started
    (MemTracker's ``PEAK_BW - PRE_BW``, the accounting of the trackers that measure training;
    ``{}`` on CUDA, whose allocator keeps no per-module record).

    Saved-for-backward bytes miss the temporaries of backward (the gradient of the logits, of
    softmax, ...), which can exceed the parameters of a small model. PyTorch's own trackers see
    them: the CUDA allocator's peak on GPUs, ``MemTracker`` (its categories) on CPU.
    """
    grad_bytes = sum(p.numel() * p.element_size() for p in root.parameters() if p.requires_grad)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run_loss().backward()
        torch.cuda.synchronize(device)
        return max(torch.cuda.max_memory_allocated(device) - before - grad_bytes, 0), {}
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(root)
    # NOTE: MemTracker hooks the gradient of every parameter and raises on frozen ones (torch 2.13);
    # give those a no-op handle so that it skips them.
    for param in root.parameters():
        if not param.requires_grad:
            tracker._param_to_grad_hook_handles[param] = (_NoHook(), _NoHook())
    with tracker, multi_grad_hooks_released():
        run_loss().backward()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()), {})
    active = sum(v for k, v in peak.items() if str(k).rsplit(".", 1)[-1] in ("ACT", "TEMP", "INP", "OTH"))
    # NOTE: TEMP includes the weight gradient autograd is producing at that moment; the cost model
    # already counts each unit's unsharded gradient, so one (the largest) is taken back out.
    largest_grad = max((p.numel() * p.element_size() for p in root.parameters() if p.requires_grad), default=0)
    # NOTE: by module, not by the tracker's names (relative to the first module it saw run)
    names = {id(module): name for name, module in root.named_modules()}
    rises = {names[id(module)]: states["backward_peak"] - states["backward_start"]
             for module, stat in tracker.memory_tracking.items() if id(module) in names
             and {"backward_peak", "backward_start"} <= (states := _state_bytes(stat)).keys()}
    return max(active - largest_grad, 0), rises


def _unit_profile(name: str, module_names: tuple[str, ...], params: list[nn.Parameter], root: nn.Module,
                  samples: list[_StepSample], rises: dict[str, int], forward_rise: int | None) -> UnitProfile:
    measured = [rises[m] for m in module_names if m in rises]  # by module name
    leaves = [rise for m, rise in rises.items() if _is_layer_within(root, m, module_names)]
    return assemble_unit(
        root, name, module_names, params,
        forward_s=statistics.median(s.forward_s.get(name, 0.0) for s in samples),
        backward_s=statistics.median(s.backward_s.get(name, 0.0) for s in samples),
        activation_bytes=samples[0].saved_bytes.get(name, 0), input_bytes=samples[0].input_bytes.get(name, 0),
        interleaved=name in samples[0].interleaved, backward_rise_bytes=max(measured) if measured else None,
        leaf_backward_rise_bytes=max(leaves) if leaves else None,
        tail_activation_bytes=samples[0].root_tail_bytes if name == ROOT else 0,
        cast_param_bytes=samples[0].cast_bytes.get(name, 0), forward_rise_bytes=forward_rise)


def _is_layer_within(root: nn.Module, name: str, module_names: tuple[str, ...]) -> bool:
    """``name`` is a module with parameters and no children at or below one of ``module_names``.

    NOTE: a module without parameters (a dropout, an activation) can pass its input through: the
    tracker's window of its backward then spans everything up to that input's gradient."""
    if not any(name == m or name.startswith(f"{m}.") for m in module_names if m != ROOT):
        return False
    module = root.get_submodule(name)
    return next(module.children(), None) is None and next(module.parameters(recurse=False), None) is not None


def linear_shape_of(root: nn.Module, name: str, module_names: tuple[str, ...]) -> tuple[int, int] | None:
    """``(out_features, in_features)`` when the unit is one ``nn.Linear`` (a split candidate)."""
    linear = root.get_submodule(module_names[0]) if len(module_names) == 1 and name != ROOT else None
    return (linear.out_features, linear.in_features) if type(linear) is nn.Linear else None


def assemble_unit(root: nn.Module, name: str, module_names: tuple[str, ...], params: list[nn.Parameter], *,
                  forward_s: float, backward_s: float, activation_bytes: int, input_bytes: int,
                  output_bytes: int = 0, interleaved: bool = False,
                  backward_rise_bytes: int | None = None, leaf_backward_rise_bytes: int | None = None,
                  tail_activation_bytes: int = 0, cast_param_bytes: int = 0,
                  sharded_activation_bytes: int | None = None, forward_rise_bytes: int | None = None,
                  ) -> UnitProfile:
    """One unit's profile from its parameters and its figures (measured or estimated)."""
    dtypes = tuple(sorted({str(p.dtype).removeprefix("torch.") for p in params if p.requires_grad}))
    return UnitProfile(
        name=name, module_names=module_names,
        param_count=sum(p.numel() for p in params if p.requires_grad),
        frozen_param_count=sum(p.numel() for p in params if not p.requires_grad),
        forward_s=forward_s, backward_s=backward_s, activation_bytes=activation_bytes, input_bytes=input_bytes,
        linear_shape=linear_shape_of(root, name, module_names), output_bytes=output_bytes,
        tensor_count=sum(1 for p in params if p.requires_grad),
        largest_tensor_count=max((p.numel() for p in params if p.requires_grad), default=0),
        interleaved=interleaved, backward_rise_bytes=backward_rise_bytes,
        leaf_backward_rise_bytes=leaf_backward_rise_bytes, tail_activation_bytes=tail_activation_bytes,
        cast_param_bytes=cast_param_bytes, param_dtypes=dtypes, sharded_activation_bytes=sharded_activation_bytes,
        forward_rise_bytes=forward_rise_bytes)


# ---------------------------------------------------------------------------------------------
# LightningModule entry point
# ---------------------------------------------------------------------------------------------
def loss_runner(module: nn.Module, batch: object | None,
                 step_context: Callable[[], contextlib.AbstractContextManager]) -> Callable[[], torch.Tensor]:
    if batch is None:
        example = getattr(module, "example_input_array", None)
        if example is None:
            raise ValueError("profiling needs a training batch or `example_input_array` on the module")

        def run_forward() -> torch.Tensor:
            with step_context(), _profiling():
                args = example if isinstance(example, tuple) else (example,)
                out = module(*args)
            return sum(t.float().sum() for t in tensors_in(out))
        return run_forward

    def run_training_step() -> torch.Tensor:
        with step_context(), _profiling():
            out = module.training_step(batch, 0)
        loss = out["loss"] if isinstance(out, dict) else out
        if not isinstance(loss, torch.Tensor):
            raise ValueError(
                f"{type(module).__name__}.training_step returned {type(out).__name__}, not a loss tensor; "
                "the osdp strategy profiles automatic optimization (return the loss or {'loss': ...}).")
        return loss
    return run_training_step


_PROFILING = False


def is_profiling() -> bool:
    """Whether osdp is running the user's ``training_step`` (or forward) to measure it.

    Profiling steps run before training starts, on rank 0, with ``self.log`` dropped and the
    weights, gradients and RNG restored afterwards; anything else ``training_step`` does (a counter,
    a list it appends to) also happens for them. Skip such side effects while this is ``True``
    (also ``trainer.strategy.profiling``), or do them in ``on_train_batch_end``, which only real
    steps reach.
    """
    return _PROFILING


@contextlib.contextmanager
def _profiling() -> Iterator[None]:
    global _PROFILING
    previous, _PROFILING = _PROFILING, True
    try:
        yield
    finally:
        _PROFILING = previous


@contextlib.contextmanager
def logging_disabled(module: nn.Module) -> Iterator[None]:
    """Drop ``self.log`` calls made while profiling (the metrics must not see profiling steps)."""
    patched = [name for name in ("log", "log_dict") if hasattr(module, name)]
    for name in patched:
        setattr(module, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for name in patched:
            delattr(module, name)


def tensors_in(obj: object) -> list[torch.Tensor]:
    """Every tensor inside ``obj`` (nested dicts, lists and tuples)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_in(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_in(v)]
    return []


def tensor_bytes(obj: object) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_in(obj))


def batch_size_of(batch: object) -> int:
    """Samples in ``batch``: the first dimension of its first tensor (1 when there is none)."""
    tensors = tensors_in(batch)
    return int(tensors[0].shape[0]) if tensors and tensors[0].dim() > 0 else 1
