"""What both strategies show as attributes: the fields of their :class:`OSDPConfig` (settable
before setup, checked as the config checks them) and the figures of their setup
(:class:`~osdp_lightning.integration.setup_core.OSDPSetup`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from osdp_lightning.choices import ChoiceOptions
from osdp_lightning.cost.budget import MemoryBudget
from osdp_lightning.integration.config import OSDPConfig
from osdp_lightning.profiling.profile import is_profiling
from osdp_lightning.profiling.records import ModelProfile

if TYPE_CHECKING:
    from osdp_lightning.integration.setup_core import OSDPSetup


class ConfigField:
    """A strategy attribute that is one field of its ``config`` (an :class:`OSDPConfig`): read it, or
    set it before setup (``strategy.pretrained = "llama/"``), checked as the config checks it."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, strategy: Any, owner: type | None = None) -> Any:
        return self if strategy is None else getattr(strategy.config, self.name)

    def __set__(self, strategy: Any, value: Any) -> None:
        strategy.config = strategy.config.with_options(**{self.name: value})


class SetupView:
    """What both strategies show of their setup (``_core``: the :class:`OSDPSetup`, ``None`` before it)."""

    _core: OSDPSetup | None

    @property
    def profiling(self) -> bool:
        """``True`` while the strategy runs the step to measure it, not to train (see README)."""
        return is_profiling()

    @property
    def profile(self) -> ModelProfile | None:
        """The measured profile (``None`` before setup and when the plan was given)."""
        return self._core.profile if self._core is not None else None

    @property
    def profiled_whole(self) -> bool:
        """Whether setup profiled the whole model (``False``: from shapes, as a meta-built model is)."""
        return self._core.profile_whole if self._core is not None else True

    @property
    def fixed_cost_bytes(self) -> int:
        """This rank's fixed cost a CPU budget is counted above (0: not measured: CUDA, no /proc, a
        given plan)."""
        return self._core.fixed_cost_bytes if self._core is not None else 0

    @property
    def fixed_file_bytes(self) -> int:
        """The file pages (code, mapped files) of this rank's resident set when its fixed cost was
        measured (0: not measured)."""
        return self._core.fixed_file_bytes if self._core is not None else 0


class ConfigOptions:
    """The options both strategies show as attributes: the fields of their ``config``, and what follows."""

    config: OSDPConfig
    micro_batch_size = ConfigField()
    uniform_choice = ConfigField()
    split_factors = ConfigField()
    overlap_efficiency = ConfigField()
    solver_time_limit_s = ConfigField()
    headroom = ConfigField()
    calibration_cache = ConfigField()
    pretrained = ConfigField()
    compile = ConfigField()
    budget_covers = ConfigField()

    @property
    def memory_budget(self) -> MemoryBudget | None:
        return self.config.budget

    @property
    def memory_budget_bytes(self) -> int | None:
        """The budget in bytes when it is given as a size (a share is known only on the device)."""
        budget = self.config.budget
        return budget.bytes if budget is not None else None

    @property
    def choice_options(self) -> ChoiceOptions:
        return self.config.choice_options
