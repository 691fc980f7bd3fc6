"""How high each unit's forward climbs when it keeps nothing for backward.

A checkpointed unit keeps only its input from forward to backward, but its forward still makes
every intermediate tensor, each freed once the next operation has used it: at its highest it holds
a few of them at once (BERT's layer: the MLP's 4x-wide input and its GELU output, 4.5 MiB at 4 x
128 x 256, beside 0.5 MiB kept). :func:`forward_rises` runs one forward with every saved tensor
dropped, as torch's non-reentrant checkpointing runs it (grad mode on, a saved-tensor hook that
keeps nothing), and records per unit the most bytes alive at once above what was alive when its
forward started. It counts storages as a dispatch mode sees them made and freed, so it runs on
any device and on fake tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from osdp_lightning.profiling.recorder import LiveStorageBytes, storage_key
from osdp_lightning.profiling.units import ROOT, UnitSpec


class _LiveForwardBytes(LiveStorageBytes):
    """The live bytes of the forward's own storages, and per open unit call the total when it
    started and the most since."""

    def __init__(self, existing: set[int]) -> None:
        super().__init__(existing)
        self.open: list[list[int]] = []
        """Per unit call in progress: [bytes at its start, most bytes since]."""

    def after_op(self) -> None:
        for call in self.open:
            call[1] = max(call[1], self.current)


def forward_rises(root: nn.Module, specs: Sequence[UnitSpec], run_loss: Callable[[], torch.Tensor]
                  ) -> dict[str, int]:
    """Per unit of ``specs`` (not the root), the most bytes its forward added at once above what was
    alive when it started (its output included), with nothing saved for backward; a unit called
    more than once (a tied embedding and head) keeps its highest call. Runs ``run_loss`` once
    without backward; the caller restores RNG and buffers."""
    existing = {storage_key(t) for t in [*root.parameters(), *root.buffers()]}
    tracker = _LiveForwardBytes(existing)
    rises: dict[str, int] = {}

    def started(_module: nn.Module, _args: object) -> None:
        tracker.open.append([tracker.current, tracker.current])

    def ended(name: str) -> Callable[[nn.Module, object, object], None]:
        def hook(_module: nn.Module, _args: object, _out: object) -> None:
            start, most = tracker.open.pop()
            rises[name] = max(rises.get(name, 0), most - start)
        return hook

    handles = []
    for spec in specs:
        for module_name in spec.module_names if spec.name != ROOT else ():
            module = root.get_submodule(module_name)
            handles += [module.register_forward_pre_hook(started), module.register_forward_hook(ended(spec.name))]
    try:
        # NOTE: a pack hook that keeps nothing, as non-reentrant checkpointing's forward: the same
        # kernels as training (grad mode on), each intermediate freed once used.
        with torch.autograd.graph.saved_tensors_hooks(lambda _t: None, lambda _x: None), tracker:
            loss = run_loss()
        del loss
    finally:
        for handle in handles:
            handle.remove()
    return rises
