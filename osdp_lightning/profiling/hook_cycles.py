"""Freeing what torch's module tracker would keep for the rest of the process.

``torch.distributed._tools.mod_tracker.ModTracker`` (inside ``MemTracker``, which measures a whole
profile's activation peak on CPU) registers, in every module's forward pre-hook,
``torch.autograd.graph.register_multi_grad_hook(inputs, ...)`` in its ``"all"`` mode on the inputs
that require grad. That hook's closure holds the inputs' ``grad_fn`` objects while each ``grad_fn``
holds the hook, from C++ (through its input's hook dict): a cycle Python's garbage collector cannot
see. It keeps the step's autograd graph alive, and through the graph's ``AccumulateGrad`` nodes
every parameter of the model, after the module has let go of them (torch 2.13). A whole profile
on rank 0 thus kept the unsharded weights of a GPT 4 x 384 (27.7 MiB) alive through training,
after FSDP2 had sharded them: rank 0's anonymous memory 39 MiB above rank 1's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils._pytree import tree_flatten

_MULTI_GRAD_HOOK = "register_multi_grad_hook.<locals>."
"""Qualified names of the hooks ``register_multi_grad_hook`` makes begin with this."""


def _is_multi_grad_hook(hook: object) -> bool:
    return getattr(hook, "__module__", "") == "torch.autograd.graph" and getattr(
        hook, "__qualname__", "").startswith(_MULTI_GRAD_HOOK)


@contextlib.contextmanager
def multi_grad_hooks_released() -> Iterator[None]:
    """Inside it, every module's inputs' gradient hooks are recorded; on exit those that
    ``register_multi_grad_hook`` made are removed, which breaks the cycle (the step they were for
    is over by then). Enter it inside the tracker, so that its forward pre-hook runs after the
    tracker's: ``with tracker, multi_grad_hooks_released(): ...``."""
    hook_dicts: dict[int, dict] = {}

    def record(_module: nn.Module, args: object) -> None:
        for arg in tree_flatten(args)[0]:
            hooks = getattr(arg, "_backward_hooks", None) if isinstance(arg, torch.Tensor) else None
            if hooks is not None:  # NOTE: the dict, not the tensor: nothing the step frees is kept
                hook_dicts[id(hooks)] = hooks

    handle = register_module_forward_pre_hook(record)
    try:
        yield
    finally:
        handle.remove()
        for hooks in hook_dicts.values():
            for key in [key for key, hook in hooks.items() if _is_multi_grad_hook(hook)]:
                del hooks[key]
