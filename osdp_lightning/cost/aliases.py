"""The names users know from Lightning's strategies for osdp's choices: the one alias table.

The choice registry resolves them (:func:`osdp_lightning.choices.resolve`, which re-exports this
table), budgets name a baseline by them (``"95%ddp"``, :mod:`osdp_lightning.cost.budget`), and reports
and plots label the uniform baselines with them. A leaf module, below the choices package: budgets
are read while cluster configs are, and the choice families price their choices on a cluster.
"""

from __future__ import annotations

ALIASES: dict[str, str] = {"ddp": "replicate", "fsdp": "zero3"}
"""The one table of names users know from Lightning's strategies."""
BASELINES: tuple[str, ...] = ("ddp", "zero2", "zero3")
"""The uniform plans osdp is compared with (``osdp-plan``, the benchmarks, budgets such as ``"95%ddp"``)."""


def baseline_name(choice: str) -> str:
    """The name a uniform baseline of ``choice`` goes by (``"replicate"``: ``"ddp"``), else ``choice``."""
    return next((name for name in BASELINES if ALIASES.get(name, name) == choice), choice)
