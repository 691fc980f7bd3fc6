"""Memory budgets: parsing ``"8GiB"`` / ``"512MB"`` / ints, and the documented defaults.

Defaults (when ``memory_budget`` is not given):

- CUDA: the device's total memory minus :data:`CUDA_HEADROOM_FRACTION` (8%) for the CUDA
  context, NCCL buffers and allocator fragmentation, which the cost model does not see.
- CPU: :data:`CPU_SHARE_FRACTION` (80%) of the machine's physical memory, shared evenly by the
  processes of this node.

Within the budget, plans keep :data:`PLAN_HEADROOM_FRACTION` (5%) free for what the cost model
does not see (allocator slack, gradient temporaries, the loss computation).
"""

from __future__ import annotations

import os
import re

import torch

CUDA_HEADROOM_FRACTION = 0.08
CPU_SHARE_FRACTION = 0.80
PLAN_HEADROOM_FRACTION = 0.05

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str) -> int:
    """Bytes from an int or a string such as ``"8GiB"``, ``"512MB"``, ``"1.5G"`` (G = GiB).

    Raises ``ValueError`` naming the bad value and the accepted forms.
    """
    if isinstance(value, bool):
        raise ValueError(f"memory budget must be a size, got {value!r}")
    if isinstance(value, (int, float)):
        number = float(value)
    else:
        match = _BYTES_RE.match(str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"cannot read memory budget {value!r}: use bytes (e.g. 8589934592) or a number with a "
                f"unit such as '8GiB', '512MiB', '6GB' (units: {', '.join(u for u in _UNITS if u)})")
        number = float(match.group(1)) * _UNITS[unit]
    if not number > 0:
        raise ValueError(f"memory budget must be positive, got {value!r}")
    return int(number)


def format_bytes(n: float) -> str:
    """Human-readable binary size: ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def default_memory_budget(device: torch.device, local_world_size: int) -> int:
    """The documented default budget for ``device`` (see the module docstring)."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return int(total * (1 - CUDA_HEADROOM_FRACTION))
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(physical * CPU_SHARE_FRACTION / max(local_world_size, 1))
