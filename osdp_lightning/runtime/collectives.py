"""The reduce-scatter FSDP2 runs on gloo: an all-reduce in place, then a copy of this rank's chunk.

gloo's own reduce-scatter copies its whole input into a buffer of the same size, all-reduces that
and copies the chunk out; the buffer belongs to the collective's work object, which gloo's worker
thread releases after the call has returned, sometimes only once the next unit's backward has
gathered its parameters. A plan's peak then held one more unsharded unit of gradients in some
launches and not in others (4 of 12 launches of a zero3 plan beside another 2-rank gloo job: one
GPT block, +6.77 MiB; ``benchmarks/peak_spread.py``). Reducing in the input FSDP2 already made (it
is not read again) leaves no buffer to release late and saves the copy; a whole step measured as
fast as with gloo's collective (docs/benchmarks/hand_fsdp2_in_place_reduce/compare.md). NCCL reduce-scatters without such a
buffer; FSDP2 keeps its own collective there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None,
                   op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
    """The reduce-scatter FSDP2 runs under osdp (what calibration times): :func:`reduce_in_place`
    on gloo, torch's ``reduce_scatter_single`` elsewhere."""
    group = group or dist.group.WORLD
    if dist.get_backend(group) == "gloo":
        reduce_in_place(output, input, group, op)
    else:  # reduce_scatter_tensor is the older name
        (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(output, input, op=op, group=group)


def reduce_in_place(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup,
                    op: dist.ReduceOp.RedOpType) -> None:
    """A reduce-scatter of a flat ``input`` of ``group.size()`` chunks as an all-reduce of ``input``
    in place (its contents are lost) and a copy of this rank's chunk into ``output``."""
    dist.all_reduce(input, op=op, group=group)
    output.copy_(input.view(group.size(), -1)[group.rank()].view_as(output))


class InPlaceReduceScatter:
    """FSDP2's reduce-scatter as :func:`reduce_in_place` (``FSDPModule.set_custom_reduce_scatter``).

    It has the two methods FSDP2 calls on its ``ReduceScatter`` interface, which torch does not
    export (``torch.distributed.fsdp._fully_shard._fsdp_api``)."""

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: dist.ReduceOp.RedOpType, async_op: bool = False) -> dist.Work | None:
        if async_op:  # FSDP2 waits on the call itself; an in-place reduce has no work to hand back
            raise NotImplementedError("InPlaceReduceScatter runs synchronously")
        reduce_in_place(output_tensor, input_tensor, group, op)
        return None


def reduce_in_place_on_gloo(root: nn.Module, group: dist.ProcessGroup) -> int:
    """Give every FSDP2 module under ``root`` :class:`InPlaceReduceScatter` when ``group``'s backend
    is gloo; the number of modules changed (0 elsewhere, or where torch cannot set a custom one)."""
    if dist.get_backend(group) != "gloo":
        return 0
    modules = [m for m in root.modules() if isinstance(m, FSDPModule) and hasattr(m, "set_custom_reduce_scatter")]
    for module in modules:
        module.set_custom_reduce_scatter(InPlaceReduceScatter())
    return len(modules)
