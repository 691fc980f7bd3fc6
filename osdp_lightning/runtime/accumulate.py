"""Gradient accumulation without communication on the micro-steps that do not step the optimizer.

Lightning runs every micro-step but the last of ``accumulate_grad_batches=k`` inside the
strategy's ``block_backward_sync()`` (for its own DDP strategy: ``DistributedDataParallel.no_sync``).
Here that turns off FSDP2's gradient reduction on every sharded unit
(``FSDPModule.set_requires_gradient_sync(False)``: no reduce-scatter, no HSDP all-reduce; each unit
keeps its whole, unsharded gradient and adds the next micro-batch's to it) and DDP's all-reduce of
the replicated parameters (:mod:`osdp_lightning.runtime.replicate`). The last micro-step reduces the sum
once. The price is memory: a sharded unit holds its unsharded gradient from the first micro-step
to the last one's backward (the cost model charges it when ``accumulate_grad_batches > 1``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.distributed.fsdp import FSDPModule

from osdp_lightning.runtime.replicate import replicate_reducer


def check_accumulation(value: object) -> int:
    """``value`` as the number of micro-batches per optimizer step, or Lightning's own error.

    ``Trainer(accumulate_grad_batches=...)`` takes any value; Lightning's accumulation scheduler
    refuses a factor that is not an int > 0 with this message, and so does the strategy (a
    fractional factor would step the optimizer at irregular micro-steps).
    """
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise MisconfigurationException(f"Accumulation factor should be an int greater than 0. Got {value!r}.")


def set_gradient_sync(root: nn.Module, sync: bool) -> None:
    """Turn gradient reduction of every FSDP2 unit and of the replicated parameters on or off."""
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(sync, recurse=False)
    reducer = replicate_reducer(root)
    if reducer is not None:
        reducer.set_requires_gradient_sync(sync)


@contextlib.contextmanager
def no_gradient_sync(root: nn.Module) -> Iterator[None]:
    """Forwards and backwards inside accumulate gradients locally; the sync is back on afterwards."""
    set_gradient_sync(root, False)
    try:
        yield
    finally:
        set_gradient_sync(root, True)
