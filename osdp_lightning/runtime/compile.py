"""``compile="units"``: each plan unit's forward compiled with ``torch.compile``.

The unit's ``forward`` is replaced by one compiled function per module class (bound to the
module), so its hooks stay eager around the compiled code: FSDP2's all-gathers, the composable
checkpoint's recompute and the profile's timers run as they do uncompiled, in any order they were
applied. The planner applies it after a unit's ``+ckpt`` and before its ``fully_shard``, as
torchtitan does per block. Units of one class and input shapes share the compiled code (Dynamo's
cache on the function's code, inductor's on-disk cache across ranks): a stack of blocks compiles
once.

- Leaf modules (a Linear, an Embedding: one kernel each, and the split Linear units) stay eager:
  there is nothing to fuse.
- A module the user compiled (``block.compile()`` or ``torch.compile(block)`` in
  ``configure_model``) is compiled this way too (:func:`recompile_user_compiled`): a compiled
  ``_call_impl`` takes the profile's hooks into its graph and recompiles for each profiled step.
- A call under a dispatch mode (the fake step's ``FakeTensorMode``, ``FlopCounterMode``, the memory
  tracker) or on meta tensors runs the eager forward.
- A unit whose forward cannot be compiled runs eagerly from then on, with a warning naming it.
- Inside :func:`compiled_once` (setup's profile) a class compiled once runs its cached code where
  it fits and eager code otherwise (``torch.compiler.set_stance("eager_on_recompile")``): profiling
  under autocast, ``no_grad`` or a memory tracker does not compile again.
"""

from __future__ import annotations

import contextlib
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule
from torch.utils._python_dispatch import _get_current_dispatch_mode

COMPILE_MODES = ("units",)
"""Values of the ``compile`` option besides ``None`` (off)."""

BACKEND: str | Callable[..., Any] = "inductor"
"""``torch.compile``'s backend for units."""

_NAME_ATTR = "_osdp_compiled_unit"
_COMPILED: dict[type, Callable[..., Any]] = {}
"""One compiled forward per module class (Dynamo caches by code and guards: one compile a kind)."""
_RAN: set[type] = set()
"""Classes whose compiled forward has run (compiled) once."""
_ONCE = [False]


def check_compile(value: object) -> str | None:
    """The ``compile`` option: ``None`` (off) or ``"units"``; anything else is refused, naming them."""
    if value is None or value in COMPILE_MODES:
        return value  # type: ignore[return-value]
    raise ValueError(f"compile must be None (off) or one of {list(COMPILE_MODES)}; got {value!r}")


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module``'s forward is a compiled unit's (:func:`compile_unit`)."""
    return _NAME_ATTR in module.__dict__


def compilable(module: nn.Module) -> bool:
    """Whether :func:`compile_unit` compiles ``module``: one with submodules (a block), not a leaf."""
    return next(module.children(), None) is not None


def compile_unit(module: nn.Module, name: str) -> bool:
    """Compile ``module``'s forward in place (named ``name`` in warnings); ``False`` where it stays
    eager (a leaf module). Idempotent."""
    if is_compiled(module):
        return True
    if not compilable(module):
        return False
    cls = type(module)
    if cls not in _COMPILED:
        _COMPILED[cls] = _compiled_forward(cls)
    module.__dict__[_NAME_ATTR] = name
    module.forward = types.MethodType(_COMPILED[cls], module)
    return True


def recompile_user_compiled(root: nn.Module) -> list[str]:
    """Modules under ``root`` the user compiled (``module.compile()`` in place, or a
    ``torch.compile(module)`` wrapper), compiled as :func:`compile_unit` compiles them instead (the
    hooks outside the graph); their names. A wrapper stays in the tree (the state dict's keys do not
    change) and calls the module it wraps eagerly."""
    names = []
    for name, module in root.named_modules():
        if isinstance(module, OptimizedModule):
            inner = module._orig_mod
            if not is_compiled(inner) and compile_unit(inner, name or type(inner).__name__):
                module.forward = inner.__call__  # NOTE: its own compiled call would trace hooks on the parts inside
                names.append(name)
            continue
        if getattr(module, "_compiled_call_impl", None) is not None and not is_compiled(module):
            module._compiled_call_impl = None
            if compile_unit(module, name or type(module).__name__):
                names.append(name)
    return names


def compile_seconds() -> float:
    """Seconds this process spent compiling so far (Dynamo's frames, inductor's backward graphs)."""
    metrics = getattr(torch._dynamo.utils, "compilation_time_metrics", {})
    return sum(sum(metrics.get(key, ())) for key in ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler"))


@contextlib.contextmanager
def compiled_once() -> Iterator[None]:
    """Within it, a class's compiled forward that has run once compiles nothing more."""
    before, _ONCE[0] = _ONCE[0], True
    try:
        yield
    finally:
        _ONCE[0] = before


def _compiled_forward(cls: type) -> Callable[..., Any]:
    eager = cls.forward
    compiled = torch.compile(eager, backend=BACKEND)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if _NAME_ATTR not in self.__dict__ or _eager_call(args, kwargs):
            return eager(self, *args, **kwargs)
        stance = (torch.compiler.set_stance("eager_on_recompile") if _ONCE[0] and cls in _RAN
                  else contextlib.nullcontext())
        try:
            with stance:
                out = compiled(self, *args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as err:
            # NOTE: only compile errors (a user's own error, traced, the eager forward raises again);
            # others pass, such as the checkpoint's signal that stops a recompute early.
            _fall_back(self, err)
            return eager(self, *args, **kwargs)
        _RAN.add(cls)
        return out
    forward.__name__ = forward.__qualname__ = f"compiled_{cls.__name__}_forward"
    return forward


def _eager_call(args: tuple, kwargs: dict) -> bool:
    if _get_current_dispatch_mode() is not None:
        return True
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    return any(t.is_meta for t in tensors)


def _fall_back(module: nn.Module, err: Exception) -> None:
    name = module.__dict__.pop(_NAME_ATTR, type(module).__name__)
    module.__dict__.pop("forward", None)
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    warnings.warn(f"osdp: unit {name!r} ({type(module).__name__}) cannot be compiled and runs uncompiled: "
                  f"{type(err).__name__}: {first}", stacklevel=3)
