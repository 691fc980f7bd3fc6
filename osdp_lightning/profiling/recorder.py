"""One step recorder for the measured profile (``profile.py``) and the estimated one (``dryrun.py``).

Hooks on every unit's modules record, during one forward and backward, per unit:

- the execution order (first forward call), and which units run again after another unit
  started (tied modules such as an embedding and its head: their activations may be alive
  at any moment of the step, docs/design.md section 4);
- its own forward seconds (a nested unit's time is charged to it, not to the unit around it);
- the bytes saved for backward while it is the innermost running unit (each storage once,
  parameters excluded): what the unit keeps from forward to backward; of those, autocast's
  copies of parameters (what a unit gathered in the compute dtype does not keep);
- the bytes of its tensor inputs (parameters excluded): what it keeps when checkpointed;
- the elements of its tensor output (a split Linear sums ``k`` partial outputs of that size);
- when its last gradient was accumulated (the end of its backward).

Storages are told apart by the identity of the storage object of a tensor's base, which works for
real tensors and for fake ones (whose data pointers are all 0).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

from osdp_lightning.profiling.units import ROOT, UnitSpec, owned_params


def storage_of(t: torch.Tensor) -> torch.UntypedStorage:
    # NOTE: a view is keyed by its base: a fake view's storage object is not always its base's.
    return (t._base if t._base is not None else t).untyped_storage()


def storage_key(t: torch.Tensor) -> int:
    return storage_of(t)._cdata


def flat_tensors(obj: object) -> list[torch.Tensor]:
    """Every tensor inside ``obj`` (any pytree: tuples, dicts, dataclasses torch knows)."""
    found: list[torch.Tensor] = []
    tree_map_only(torch.Tensor, found.append, obj)
    return found


class LiveStorageBytes(TorchDispatchMode):
    """Bytes of the storages operations made under it that are still alive (``current``), those in
    ``existing`` (parameters, buffers, the batch) left out; on any device and on fake tensors.
    Subclasses read the figure after each operation (:meth:`after_op`)."""

    def __init__(self, existing: set[int]) -> None:
        super().__init__()
        self.existing = existing
        """Storage keys that are not the run's own (views of them cost nothing)."""
        self.live: dict[int, int] = {}
        self.current = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for tensor in flat_tensors(out):
            storage = storage_of(tensor)
            key = storage._cdata
            if key not in self.live and key not in self.existing:
                self.live[key] = storage.nbytes()
                self.current += self.live[key]
                weakref.finalize(storage, self.forget, key)
        self.after_op()
        return out

    def after_op(self) -> None:
        """Called after every operation, with ``current`` up to date."""

    def forget(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)


class StepRecorder:
    """Per-unit order, forward seconds, saved / input bytes, output size and gradient times of a step."""

    def __init__(self, root: nn.Module, specs: Sequence[UnitSpec], clock: Callable[[], float] = time.perf_counter,
                 ) -> None:
        self.root, self.specs, self.clock = root, list(specs), clock
        self.order: list[str] = []
        self.interleaved: set[str] = set()
        self._modules = {s.name: s.module_names for s in self.specs}
        self.forward_s: dict[str, float] = {}
        self.grad_done_t: dict[str, float] = {}
        self.saved_bytes: dict[str, int] = {s.name: 0 for s in self.specs} | {ROOT: 0}
        self.cast_bytes: dict[str, int] = {}
        """Of ``saved_bytes``, autocast's low-precision copies of parameters."""
        self.root_tail_bytes = 0
        """Of the root's saved bytes, those saved after the last unit's forward (the loss's)."""
        self.input_bytes: dict[str, int] = {}
        self.output_numel: dict[str, int] = {}
        self._stack: list[list] = []  # [unit, start, seconds of units nested in it]
        self._seen: set[int] = set()
        self._param_keys = {storage_key(p) for p in root.parameters()}

    @contextlib.contextmanager
    def installed(self) -> Iterator[StepRecorder]:
        """The hooks, for one forward and backward inside the block."""
        handles = []
        owned = owned_params(self.root, self.specs)
        for spec in self.specs:
            for mod_name in spec.module_names:
                mod = self.root.get_submodule(mod_name)
                handles.append(mod.register_forward_pre_hook(self._pre(spec.name), with_kwargs=True))
                handles.append(mod.register_forward_hook(self._post(spec.name)))
            handles += [p.register_post_accumulate_grad_hook(self._grad_done(spec.name))
                        for p in owned[spec.name] if p.requires_grad]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
        finally:
            for handle in handles:
                handle.remove()

    def _pre(self, name: str) -> Callable:
        def hook(_mod: nn.Module, args: tuple, kwargs: dict) -> None:
            if name not in self.order:
                self.order.append(name)
            elif any(not self.nested(later, name) for later in self.order[self.order.index(name) + 1:]):
                self.interleaved.add(name)
            self.input_bytes[name] = self.input_bytes.get(name, 0) + self._tensor_bytes((args, kwargs))
            self._stack.append([name, self.clock(), 0.0])
        return hook

    def nested(self, inner: str, outer: str) -> bool:
        """Whether unit ``inner``'s modules lie inside unit ``outer``'s (a block's parts)."""
        return all(any(m.startswith(f"{o}.") or not o for o in self._modules.get(outer, ()))
                   for m in self._modules.get(inner, ()))

    def _post(self, name: str) -> Callable:
        def hook(_mod: nn.Module, _args: object, out: object) -> None:
            unit, start, nested_s = self._stack.pop()
            if not self._stack:
                self.root_tail_bytes = 0  # what the root saved so far came before a unit
            elapsed = self.clock() - start
            self.forward_s[unit] = self.forward_s.get(unit, 0.0) + elapsed - nested_s
            if self._stack:
                self._stack[-1][2] += elapsed
            if isinstance(out, torch.Tensor):
                self.output_numel[name] = self.output_numel.get(name, 0) + out.numel()
        return hook

    def _grad_done(self, name: str) -> Callable:
        def hook(_p: torch.Tensor) -> None:
            self.grad_done_t[name] = self.clock()
        return hook

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = storage_key(tensor)
        if key not in self._param_keys and key not in self._seen:
            self._seen.add(key)
            nbytes = storage_of(tensor).nbytes()
            unit = self._stack[-1][0] if self._stack else ROOT
            self.saved_bytes[unit] += nbytes
            if self._is_parameter_copy(tensor):
                self.cast_bytes[unit] = self.cast_bytes.get(unit, 0) + nbytes
            self.root_tail_bytes += 0 if self._stack else nbytes
        return tensor

    def _is_parameter_copy(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (or its base) is a cast of a parameter (autocast's ``_to_copy``)."""
        fn = (tensor._base if tensor._base is not None else tensor).grad_fn
        if fn is None or fn.name() != "ToCopyBackward0":
            return False
        source = getattr(fn.next_functions[0][0], "variable", None)
        return source is not None and storage_key(source) in self._param_keys

    def _tensor_bytes(self, obj: object) -> int:
        """Bytes of the distinct non-parameter storages of the tensors in ``obj``."""
        storages = {storage_key(t): storage_of(t).nbytes() for t in tree_flatten(obj)[0]
                    if isinstance(t, torch.Tensor)}
        return sum(nbytes for key, nbytes in storages.items() if key not in self._param_keys)


@contextlib.contextmanager
def gathered_in(root: nn.Module, specs: Sequence[UnitSpec], dtype: torch.dtype) -> Iterator[None]:
    """``root`` as FSDP2 runs it when every unit is sharded and gathers in ``dtype`` (``bf16-mixed``):
    its floating-point parameters in ``dtype`` and each unit's floating-point inputs cast to it
    (``MixedPrecisionPolicy.cast_forward_inputs``; not the root's, whose inputs are the batch). The
    parameters are themselves again afterwards; their gradients are dropped.

    NOTE: what a unit saves for backward depends on it: in ``dtype`` its matmuls save the parameters
    themselves (no autocast copy), and an embedding, a residual stream, a norm's input are ``dtype``
    too where autocast would have kept them in fp32 (GPT 2 x 64: zero3 predicted 9% high without it).
    """
    originals = {p: p.data for p in root.parameters() if p.is_floating_point()}

    def cast(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, (args, kwargs))

    handles = [root.get_submodule(name).register_forward_pre_hook(cast, with_kwargs=True)
               for spec in specs if spec.name != ROOT for name in spec.module_names]
    try:
        for param, data in originals.items():
            param.data = data.to(dtype)
        yield
    finally:
        for handle in handles:
            handle.remove()
        root.zero_grad(set_to_none=True)
        for param, data in originals.items():
            param.data = data


def sharded_saved_bytes(root: nn.Module, specs: Sequence[UnitSpec], run_loss: Callable[[], torch.Tensor],
                        dtype: torch.dtype) -> dict[str, int]:
    """Bytes each unit saves for backward (as :class:`StepRecorder` counts them) in one forward and
    backward of ``run_loss`` with every unit run as FSDP2 gathering in ``dtype`` runs it
    (:func:`gathered_in`)."""
    with gathered_in(root, specs, dtype):
        recorder = StepRecorder(root, specs)  # NOTE: after the cast: the parameters' storages are the new ones
        with recorder.installed():
            loss = run_loss()
            loss.backward()
    return dict(recorder.saved_bytes)
