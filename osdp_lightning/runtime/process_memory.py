"""What a rank's process holds beside its tensors: the figures a budget that is a real limit needs.

A budget bounds what the process uses on its device, not only the tensors of one tracked step:

- CPU: the resident set (``VmRSS``, its high-water ``VmHWM``) above the **fixed cost**, which osdp
  measures on every rank once calibration has run (interpreter, torch, Lightning, gloo and osdp's
  own machinery warmed up, less the model's tensors then: :func:`fixed_cost_bytes`);
- CUDA: the caching allocator's reserved bytes (``max_memory_reserved``), which FSDP2's
  per-parameter shards fragment: :func:`prefer_expandable_segments` turns on
  ``expandable_segments:True`` where the user has not configured the allocator.

Beside the tensors the memory model tracks, the process's own memory grows by what no tracker
sees (malloc's and autograd's bookkeeping, caches); osdp measures that growth where it does real
work at setup (:func:`untracked_growth_bytes`) and plans keep it free. Code pages loaded on first
use are file pages shared with every process that maps the same library: a memory limit (a cgroup,
as containers and SLURM hold a job) reclaims them before it ends a process, and the growth plans
keep free does not count them. The resident high-water does: :class:`CodePagesAtPeak` bounds how
much of it they were, so that a run can report its own memory's high-water (resident set less
file pages) above its fixed cost as well.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterable

import torch

CUDA_ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def process_status_bytes(*fields: str) -> dict[str, int]:
    """Fields of ``/proc/self/status`` given in kB (``VmHWM``, ``VmRSS``, ``VmData``, ...) in bytes;
    ``{}`` without /proc."""
    try:
        with open("/proc/self/status") as status:
            lines = status.read().splitlines()
    except OSError:
        return {}
    found = (line.partition(":") for line in lines)
    return {key: int(value.split()[0]) * 1024 for key, _, value in found if key in fields}


def resident_bytes() -> int:
    """The process's resident set now (0 where /proc is missing: nothing to measure)."""
    return process_status_bytes("VmRSS").get("VmRSS", 0)


def anonymous_bytes() -> int:
    """The anonymous part of the resident set (``RssAnon``: heap and private mappings, no code or
    files; 0 where /proc is missing): the process's own memory. Code pages loaded on first use are
    shared files, and pages reserved but never touched take no memory."""
    return process_status_bytes("RssAnon").get("RssAnon", 0)


def file_bytes() -> int:
    """The file-backed part of the resident set (``RssFile``: code pages and mapped files; 0 where
    /proc is missing)."""
    return process_status_bytes("RssFile").get("RssFile", 0)


def high_water_bytes() -> int:
    """The resident set's high-water mark (``VmHWM``; ``ru_maxrss`` where /proc is missing)."""
    status = process_status_bytes("VmHWM")
    if "VmHWM" in status:
        return status["VmHWM"]
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def tensor_bytes(tensors: Iterable[torch.Tensor | None], device_type: str = "cpu") -> int:
    """Bytes of the distinct storages behind ``tensors`` on ``device_type`` (a DTensor: its local
    shard; views of one storage counted once; meta tensors and ``None`` are nothing)."""
    storages: dict[int, int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        local = getattr(tensor, "_local_tensor", tensor)
        if local.device.type != device_type:
            continue
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def module_tensor_bytes(module: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> int:
    """Bytes the module's parameters, gradients and buffers and the optimizers' state hold on the CPU."""
    def tensors() -> Iterable[torch.Tensor | None]:
        for parameter in module.parameters():
            yield parameter
            yield parameter.grad
        yield from module.buffers()
        for optimizer in optimizers:
            for state in optimizer.state.values():
                yield from (value for value in state.values() if isinstance(value, torch.Tensor))
    return tensor_bytes(tensors())


def fixed_cost_bytes(module: torch.nn.Module) -> int:
    """The process's resident set less the module's CPU tensors: what it holds whatever the model
    (0 where /proc is missing)."""
    resident = resident_bytes()
    return max(resident - module_tensor_bytes(module), 0) if resident else 0


def untracked_growth_bytes(anonymous_before: int, anonymous_after: int, tensors_before: int = 0,
                           tensors_after: int = 0) -> int:
    """The process's own memory's growth over a stretch of real work (:func:`anonymous_bytes` before
    and after) beyond the tensors it left alive: what the process keeps that no tensor tracker
    counts (never negative; 0 where nothing was measured)."""
    if not (anonymous_before and anonymous_after):
        return 0
    return max((anonymous_after - anonymous_before) - (tensors_after - tensors_before), 0)


class CodePagesAtPeak:
    """A lower bound of the file pages resident when the resident set last reached its high-water
    mark, from samples of ``VmHWM`` and ``RssFile`` (:meth:`sample`, e.g. at every step's start and
    end). File pages only grow while nothing reclaims them, so those resident at the start of the
    interval in which the high-water last rose were resident at its peak too: the high-water less
    them bounds the process's own memory at its peak from above.

    ``file_bytes_then``: the file pages when sampling starts (at the fixed cost's measurement).
    """

    def __init__(self, file_bytes_then: int) -> None:
        self.start_bytes = self.floor_bytes = self._last_file_bytes = file_bytes_then
        self._last_high_water_bytes = 0

    def sample(self) -> None:
        status = process_status_bytes("VmHWM", "RssFile")
        if not status:
            return
        if status["VmHWM"] > self._last_high_water_bytes:  # it rose since the last sample: after that one's pages
            self.floor_bytes, self._last_high_water_bytes = self._last_file_bytes, status["VmHWM"]
        self._last_file_bytes = status["RssFile"]

    @property
    def loaded_before_peak_bytes(self) -> int:
        """File pages loaded since sampling started that were resident at the high-water's peak (a
        lower bound; never negative)."""
        return max(self.floor_bytes - self.start_bytes, 0)


def prefer_expandable_segments() -> bool:
    """Set ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` when the user has not configured the
    CUDA allocator and CUDA is not initialised yet (the allocator reads it once, at its first use):
    FSDP2's authors recommend it against the fragmentation its per-parameter shards cause. Returns
    whether it was set here."""
    if os.environ.get(CUDA_ALLOC_CONF) is not None or torch.cuda.is_initialized():
        return False
    os.environ[CUDA_ALLOC_CONF] = EXPANDABLE_SEGMENTS
    return True
