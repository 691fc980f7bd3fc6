"""A clean interpreter exit: no process group is left for Python's finalization to destroy.

Under Lightning's DDP, ``destroy_process_group()`` frees the gloo groups at once: Lightning drops
its DDP wrapper at teardown, so the groups' only references are in ``torch.distributed``'s maps.
Under osdp, FSDP2's per-unit state inside the user's module, the device meshes and the replicated
parameters' DDP reducer keep the group objects alive after ``destroy_process_group()`` (their gloo
worker and TCP loop threads, and on rank 0 the TCP store's thread, were still running at exit).
They were then destroyed during interpreter finalization, in whatever order it frees objects;
gloo work objects that still hold tensors need the GIL there, and some runs ended in
"terminate called without an active exception" (SIGABRT, exit -6/134) after a successful fit
(see pytorch/pytorch#179291 and #190489 for the same crash without ``destroy_process_group()``).

:func:`release_at_exit` registers one ``atexit`` handler that runs while the interpreter is fully
alive: it destroys the default group if the user did not, drops the strategy's own references to
meshes and the sharded model, and collects garbage, so that the group objects of a finished
``Trainer`` are freed there and not during finalization.
"""

from __future__ import annotations

import atexit
import gc
import weakref
from typing import Any

import torch.distributed as dist

_STRATEGIES: weakref.WeakSet = weakref.WeakSet()
_registered = False


def release_at_exit(strategy: Any | None = None) -> None:
    """Release ``strategy``'s process-group holders at exit (``strategy.release_process_groups()``).

    Without a strategy (``apply_plan``, ``apply_replicate``: scripts that shard a model themselves), only
    the garbage collection and the group's teardown, so that FSDP2 states and DDP reducers left in
    reference cycles are freed while the interpreter is alive.
    """
    global _registered
    if strategy is not None:
        _STRATEGIES.add(strategy)
    if not _registered:
        atexit.register(release_now)
        _registered = True


def release_now() -> None:
    """Release every registered strategy's process-group holders and the default group, now."""
    for strategy in list(_STRATEGIES):
        strategy.release_process_groups()
    if dist.is_available() and dist.is_initialized():
        # NOTE: local teardown only (no collective): safe whichever rank gets here first.
        dist.destroy_process_group()
    gc.collect()
