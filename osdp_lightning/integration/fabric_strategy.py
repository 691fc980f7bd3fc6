"""Lightning Fabric glue: ``Fabric(strategy="osdp")``.

``fabric.setup(model, optimizer)`` (or ``fabric.setup_module(model)``) plans and applies: the
shared setup (:mod:`osdp_lightning.integration.setup_core`) calibrates, profiles one step on rank 0, solves,
broadcasts the plan and shards the model in place; the optimizer's groups are then pointed at the
sharded parameters. What profiling runs comes from the strategy's ``example_batch`` and
``loss_fn`` (:mod:`osdp_lightning.integration.fabric_inputs`). A model built under
``fabric.init_module(empty_init=True)`` is planned from shapes and materialized unit by unit.

``fabric.no_backward_sync`` turns every unit's gradient reduction off (:mod:`osdp_lightning.runtime.accumulate`),
``fabric.clip_gradients`` clips across meshes (:mod:`osdp_lightning.runtime.clip`), and ``fabric.save`` /
``fabric.load`` write and read the Trainer strategy's checkpoints (:mod:`osdp_lightning.integration.fabric_checkpoint`).
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from osdp_lightning.apply.apply import step_groups_apart
from osdp_lightning.cost.cluster import ClusterSpec
from osdp_lightning.integration import fabric_checkpoint
from osdp_lightning.integration.config import OSDPConfig
from osdp_lightning.integration.fabric_inputs import (
    LossFn,
    as_lightning_step,
    default_optimizer,
    example_batch_of,
    parameter_names,
    rebind_optimizer,
)
from osdp_lightning.integration.lightning_compat import (
    BackwardSyncControl,
    FabricScriptLauncher,
    default_pg_timeout,
)
from osdp_lightning.integration.setup_core import OSDPSetup, Ranks, RootWrapper, StepInputs
from osdp_lightning.integration.strategy_view import ConfigOptions, SetupView
from osdp_lightning.plan.plan import Plan
from osdp_lightning.profiling.optim_state import configured_optimizer
from osdp_lightning.report.report import format_comparison
from osdp_lightning.runtime.accumulate import check_accumulation, no_gradient_sync
from osdp_lightning.runtime.clip import clip_grad_norm_, clip_grad_value_
from osdp_lightning.runtime.faults import init_elastic_process_group
from osdp_lightning.runtime.guards import preserved_rng
from osdp_lightning.runtime.process_memory import prefer_expandable_segments
from osdp_lightning.runtime.shutdown import release_at_exit


class OSDPFabricStrategy(ConfigOptions, SetupView, ModelParallelStrategy):
    """Optimal Sharded Data Parallel for Lightning Fabric: the Trainer strategy's plans, for your own loop.

    Args:
        config: The options (:class:`~osdp_lightning.integration.config.OSDPConfig`), as for ``OSDPStrategy``.
        example_batch: One batch of the size each forward sees (a micro-batch when accumulating), on
            any device: rank 0 profiles the step on it at ``fabric.setup``. Default: the model's
            ``example_input_array``.
        loss_fn: ``loss_fn(model, batch) -> loss``, one step's loss as your loop computes it.
            Default: the model's ``training_step(batch, 0)`` when it has one, else the sum of its outputs.
        accumulate_grad_batches: Micro-batches per optimizer step in your loop (``no_backward_sync``):
            the plan is solved for it (sharded units then keep whole gradients between micro-batches).
        save_distributed_checkpoint: Sharded (default) or one consolidated checkpoint file.
        process_group_backend / timeout: As Fabric's ``ModelParallelStrategy``.
        **options: Fields of :class:`~osdp_lightning.integration.config.OSDPConfig` that replace the config's.
    """

    strategy_name = "osdp"

    def __init__(self, config: OSDPConfig | None = None, *, example_batch: Any = None, loss_fn: LossFn | None = None,
                 accumulate_grad_batches: int = 1, save_distributed_checkpoint: bool = True,
                 process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout,
                 **options: Any) -> None:
        super().__init__(parallelize_fn=_parallelized_by_the_plan, save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.config = _without_auto_batch_size((config or OSDPConfig()).with_options(**options))
        prefer_expandable_segments()  # before CUDA starts: FSDP2's shards fragment the allocator less
        self.example_batch = example_batch
        """The batch profiling runs on (settable until ``fabric.setup``)."""
        self.loss_fn = loss_fn
        """``loss_fn(model, batch) -> loss`` (settable until ``fabric.setup``)."""
        self.accumulate_grad_batches = check_accumulation(accumulate_grad_batches)
        self._backward_sync_control = _NoGradientSync()
        self._core: OSDPSetup | None = None
        self._root: RootWrapper | None = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description="Optimal Sharded Data Parallel")

    # -- properties that raise a clear error when used too early ------------------------------
    @property
    def plan(self) -> Plan:
        if self._core is None or self._core.plan is None:
            raise RuntimeError("the osdp plan exists only after setup: access `fabric.strategy.plan` after "
                               "`fabric.setup(model, ...)` (or pass plan= to the strategy)")
        return self._core.plan

    @property
    def module(self) -> nn.Module:
        """The model set up by this strategy, sharded by the plan (without Fabric's wrapper)."""
        if self._root is None:
            raise RuntimeError("the osdp strategy has no model yet: call `fabric.setup(model, ...)` first")
        return self._root.module

    @property
    def setup_s(self) -> dict[str, float]:
        """Seconds spent at setup: calibrate, profile, solve, apply (rank 0's figures)."""
        return self._core.setup_s if self._core is not None else {}

    def cluster_spec(self, budget: int | None = None) -> ClusterSpec:
        """The cluster plans are priced on, at ``budget`` bytes per rank (see ``OSDPStrategy.cluster_spec``)."""
        if self._core is None:
            raise RuntimeError("the osdp cluster spec is measured at setup; it is not available yet")
        return self._core.cluster_spec(budget)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def release_process_groups(self) -> None:
        """Drop what holds process groups (the meshes, the sharded root); see :mod:`osdp_lightning.runtime.shutdown`."""
        if self._core is not None:
            self._core.release_process_groups()
        self._root = None

    # -- processes ------------------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        # NOTE: as OSDPStrategy: a launcher on every rank, so that ranks started by torchrun (or any
        # launcher) get their share of the cores as threads, as under Fabric's DDP.
        assert self.cluster_environment is not None
        self._launcher = FabricScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        # NOTE: skip ModelParallelStrategy's (dp, tp) mesh; the plan's meshes are built at setup.
        assert self.accelerator is not None
        self.accelerator.setup_device(self.root_device)
        self._setup_distributed()
        release_at_exit(self)

    @override
    def _setup_distributed(self) -> None:
        # NOTE: under torchrun, each restart attempt needs its own keys in the shared store (faults.py).
        self._set_world_ranks()
        init_elastic_process_group(self._get_process_group_backend(), self.global_rank, self.world_size,
                                   self._timeout)
        super()._setup_distributed()

    # -- setup: plan and apply ----------------------------------------------------------------------
    @override
    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[torch.optim.Optimizer],
                                    scheduler: Any = None) -> tuple[nn.Module, list[torch.optim.Optimizer], Any]:
        names = parameter_names(module)
        root = self._plan_and_apply(module, optimizers[0] if optimizers else None)
        for optimizer in optimizers:
            rebind_optimizer(optimizer, names, module)
        return root, [self.setup_optimizer(optimizer) for optimizer in optimizers], scheduler

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        return self._plan_and_apply(module, None)

    @override
    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        step_groups_apart([optimizer])  # NOTE: a mixed plan's groups hold DTensors and plain tensors
        return optimizer

    def _plan_and_apply(self, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> nn.Module:
        """Plan ``module`` (or take the given plan) and shard it in place; returns the root around it."""
        if self._root is not None:
            raise RuntimeError("the osdp strategy sets up one model; set up other models with another Fabric")
        self._core = core = OSDPSetup(self.config, Ranks(self.root_device, self.world_size, self.num_processes,
                                                         self.num_nodes, self.global_rank))
        step = self._step_inputs(module, optimizer)
        # NOTE: planning and applying draw random numbers on some or all ranks; the first step must
        # draw what it draws under DDP, so every rank leaves with the random states it came with.
        with preserved_rng():
            with as_lightning_step(module, step.optimizer, self.loss_fn, self.example_batch is not None):
                if core.decide_whole_profile(module, step):
                    module.to(self.root_device)
                plan = core.decide_plan(module, step)
            rank_zero_info(f"osdp plan ({self.world_size} ranks):\n{plan.format_table()}\n{format_comparison(plan)}")
            self._root = RootWrapper(module)
            core.apply(module, self._root)
        self.barrier()
        return self._root

    def _step_inputs(self, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> StepInputs:
        if self.config.plan is not None:
            return StepInputs(batch=lambda: None, optimizer=None, precision=str(self.precision.precision))
        if optimizer is None:
            optimizer = _configured_or_default_optimizer(module)
        batch = example_batch_of(module, self.example_batch)  # NOTE: on every rank: a missing batch fails everywhere
        size = _without_auto_batch_size(self.config).micro_batch_size
        return StepInputs(batch=lambda: self.batch_to_device(batch), optimizer=optimizer,
                          precision=str(self.precision.precision), step_context=self.precision.forward_context,
                          accumulation_steps=self.accumulate_grad_batches,
                          micro_batch_size=int(size) if size is not None else None)

    # -- gradients ------------------------------------------------------------------------------
    @override
    def clip_gradients_norm(self, module: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float | int,
                            norm_type: float | int = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        """As DDP clips: one norm over every gradient, whatever mesh it lives on (clip.py)."""
        self.precision.unscale_gradients(optimizer)
        return clip_grad_norm_(self.precision.main_params(optimizer), float(max_norm), float(norm_type),
                               error_if_nonfinite=error_if_nonfinite)

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: torch.optim.Optimizer, clip_val: float | int) -> None:
        self.precision.unscale_gradients(optimizer)
        clip_grad_value_(self.precision.main_params(optimizer), float(clip_val))

    # -- checkpoints: the Trainer strategy's format (canonical keys of the model) ------------------------
    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict[str, Any] | None = None) -> None:
        if storage_options is not None:
            raise TypeError("OSDPFabricStrategy.save_checkpoint(..., storage_options=...) is not supported: osdp "
                            "writes its checkpoints itself (torch.distributed.checkpoint), not via CheckpointIO")
        if filter is not None:
            raise NotImplementedError("fabric.save(..., filter=...) is not supported by the osdp strategy: its "
                                      "checkpoints hold the whole model, which any plan or world size can load")
        plan = self._core.plan if self._core is not None else None
        fabric_checkpoint.save(self.broadcast(str(path)), state, self._root, sharded=self._save_distributed_checkpoint,
                               plan=plan)

    @override
    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        if state is None or (isinstance(state, dict) and not state):
            raise ValueError(f"Got {type(self).__name__}.load_checkpoint(..., state={state!r}) but a state with at "
                             "least the model set up by `fabric.setup` is required: "
                             "`fabric.load(path, {'model': model, 'optimizer': optimizer, ...})`")
        return fabric_checkpoint.load(self.broadcast(str(path)), state, self._root, strict=strict,
                                      weights_only=weights_only)


def _without_auto_batch_size(config: OSDPConfig) -> OSDPConfig:
    if config.micro_batch_size == "auto":
        raise ValueError("micro_batch_size='auto' is for the Trainer, which owns the dataloader; under Fabric your "
                         "loop sets the batch size: give an int (the size the plan is for) or None (the example "
                         "batch's size)")
    return config


def _configured_or_default_optimizer(module: nn.Module) -> torch.optim.Optimizer:
    """What the plan prices without an optimizer at ``fabric.setup``: the module's
    ``configure_optimizers()`` (a LightningModule's), else AdamW."""
    try:
        optimizer = configured_optimizer(module)
    except Exception as err:  # noqa: BLE001  (e.g. one that reads self.trainer, which Fabric does not attach)
        rank_zero_info(f"osdp: {type(module).__name__}.configure_optimizers() failed outside a Trainer ({err})")
        optimizer = None
    optimizer = optimizer or default_optimizer(module)
    rank_zero_info(f"osdp: no optimizer given to `fabric.setup`: the plan prices {type(optimizer).__name__}'s state "
                   "(pass yours: `fabric.setup(model, optimizer)`)")
    return optimizer


def _parallelized_by_the_plan(module: nn.Module, _mesh: Any) -> nn.Module:
    """ModelParallelStrategy's ``parallelize_fn``, never called: the plan decides (``setup_module``)."""
    raise AssertionError("OSDPFabricStrategy applies its plan in setup_module")


class _NoGradientSync(BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: no reduce-scatter or all-reduce in any unit (accumulate.py)."""

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        return no_gradient_sync(module) if enabled else contextlib.nullcontext()
