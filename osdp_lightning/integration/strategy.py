"""Lightning glue: ``Trainer(strategy="osdp")``.

At ``setup`` (after the process group exists, before the optimizer is built) the strategy hands
the shared setup (:mod:`osdp_lightning.integration.setup_core`) what only the Trainer knows: the first
training batch, the module's ``training_step`` and ``configure_optimizers``, the precision plugin's
step context and ``accumulate_grad_batches``. The core calibrates, plans on rank 0, broadcasts the
plan and applies it; the strategy then lets Lightning build the optimizer on the sharded
parameters. Checkpoints hold the unwrapped LightningModule's keys (:mod:`osdp_lightning.state.checkpoint`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from osdp_lightning.apply.apply import step_groups_apart
from osdp_lightning.calibrate import CollectiveTimings
from osdp_lightning.cost.cluster import ClusterSpec
from osdp_lightning.integration.config import OSDPConfig
from osdp_lightning.integration.lightning_compat import (
    TrainerScriptLauncher,
    default_pg_timeout,
    optimizers_to_device,
)
from osdp_lightning.integration.setup_core import OSDPSetup, Ranks, RootWrapper, StepInputs
from osdp_lightning.integration.setup_inputs import current_batch_size, first_training_batch, set_batch_size
from osdp_lightning.integration.strategy_view import ConfigOptions, SetupView
from osdp_lightning.plan.plan import Plan
from osdp_lightning.profiling.optim_state import configured_optimizer
from osdp_lightning.profiling.precision import sharded_precision
from osdp_lightning.report.report import format_comparison, log_plan
from osdp_lightning.runtime.accumulate import check_accumulation, no_gradient_sync
from osdp_lightning.runtime.clip import with_sharded_clipping
from osdp_lightning.runtime.faults import init_elastic_process_group
from osdp_lightning.runtime.guards import preserved_rng
from osdp_lightning.runtime.process_memory import prefer_expandable_segments
from osdp_lightning.runtime.shutdown import release_at_exit
from osdp_lightning.state import checkpoint as checkpoint_io

__all__ = ["OSDPStrategy", "RootWrapper"]


class OSDPStrategy(ConfigOptions, SetupView, ModelParallelStrategy):
    """Optimal Sharded Data Parallel: per-module replicate / zero2 / zero3 / split, chosen by an ILP
    under a per-rank memory budget and applied with FSDP2.

    Args:
        config: The options (:class:`~osdp_lightning.integration.config.OSDPConfig`: budget, plan, choices,
            units, profiling, solver, headroom, pretrained weights); default: every field's default.
        **options: Fields of :class:`~osdp_lightning.integration.config.OSDPConfig` that replace the config's
            (``OSDPStrategy(memory_budget="6GiB", split_factors=())``).
        save_distributed_checkpoint: Sharded (default) or one consolidated checkpoint file.
        process_group_backend / timeout: As Lightning's ``ModelParallelStrategy``.
    """

    strategy_name = "osdp"
    # NOTE: FSDPStrategy keeps this list at class level and checks it for a GPU; ours is separate.
    _registered_strategies: list[str] = []

    def __init__(self, config: OSDPConfig | None = None, *, save_distributed_checkpoint: bool = True,
                 process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout,
                 **options: Any) -> None:
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.config = (config or OSDPConfig()).with_options(**options)
        prefer_expandable_segments()  # before CUDA starts: FSDP2's shards fragment the allocator less
        self._core: OSDPSetup | None = None
        self._root: RootWrapper | None = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description="Optimal Sharded Data Parallel")
            cls._registered_strategies.append(cls.strategy_name)

    # -- properties that raise a clear error when used too early ------------------------------
    @property
    def plan(self) -> Plan:
        if self._plan is None:
            raise RuntimeError("the osdp plan exists only after setup: access `trainer.strategy.plan` after "
                               "`trainer.fit()` has started (or pass plan= to the strategy)")
        return self._plan

    @property
    def _plan(self) -> Plan | None:
        """The plan, or ``None`` before setup (what the training summary reads of any strategy)."""
        return self._core.plan if self._core is not None else None

    _profile_whole = SetupView.profiled_whole

    @property
    def timings(self) -> CollectiveTimings:
        if self._core is None or self._core.timings is None:
            raise RuntimeError("collective timings are measured at setup; they are not available yet")
        return self._core.timings

    @property
    def setup_s(self) -> dict[str, float]:
        """Seconds spent at setup: calibrate, profile, solve, apply (rank 0's figures)."""
        return self._core.setup_s if self._core is not None else {}

    def cluster_spec(self, budget: int | None = None) -> ClusterSpec:
        """The cluster plans are priced on: this run's links, step terms and headroom, at ``budget``
        bytes per rank (default: the strategy's budget of the device)."""
        if self._core is None:
            raise RuntimeError("the osdp cluster spec is measured at setup; it is not available yet")
        return self._core.cluster_spec(budget)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def release_process_groups(self) -> None:
        """Drop the strategy's references to what holds process groups (the meshes, the sharded
        root and its reducer); called at interpreter exit (:mod:`osdp_lightning.runtime.shutdown`)."""
        if self._core is not None:
            self._core.release_process_groups()
        self._root = None
        self.model = None

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning's accumulation micro-steps: no reduce-scatter or all-reduce (accumulate.py)."""
        with no_gradient_sync(self.model):
            yield

    # -- processes ------------------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        # NOTE: ModelParallelStrategy builds no launcher in a process it did not start (rank 1..,
        # every rank under torchrun), so those ranks never got the thread count DDPStrategy's
        # launcher sets on every rank (a share of the cores, _set_num_threads_if_needed): on 2 CPU
        # cores rank 1 ran two threads beside rank 0's one, and osdp's backward was 8-10 ms slower
        # than DDP's (GPT 6 x 256, seq 128: 0.91x Lightning ddp). As DDPStrategy: a launcher on
        # every rank, which starts processes only where nothing started them.
        assert self.cluster_environment is not None
        self._launcher = TrainerScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        # NOTE: skip ModelParallelStrategy's (dp, tp) mesh; our meshes are built per plan in setup.
        self._setup_distributed()
        self._device_mesh = None
        # From here on, whatever holds the group (calibration, FSDP2 units, the reducer) is released
        # at exit while the interpreter is alive, also after a failed setup (shutdown.py).
        release_at_exit(self)

    @override
    def _setup_distributed(self) -> None:
        # NOTE: under torchrun, each restart attempt needs its own keys in the shared store (faults.py).
        self.set_world_ranks()
        init_elastic_process_group(self._get_process_group_backend(), self.global_rank, self.world_size,
                                   self._timeout)
        super()._setup_distributed()

    # -- setup: plan and apply, then Lightning's optimizers -------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        check_accumulation(trainer.accumulate_grad_batches)  # Lightning's own error, before any collective
        sharded_precision(str(trainer.precision), self.config.reduce_dtype)  # refused here, on every rank
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if self._root is not None and self._root.module is module:
            self.model = self._root  # a later stage (validate/test after fit): already sharded
        else:
            self.model = self.precision_plugin.convert_module(self.model)
            self._core = OSDPSetup(self.config, Ranks(self.root_device, self.world_size, self.num_processes,
                                                      self.num_nodes, self.global_rank))
            step = self._step_inputs(trainer, module)
            # NOTE: planning and applying draw random numbers on some or all ranks (taking the batch,
            # calibration seeds the generator and fills tensors, profiling runs the user's step with
            # its dropout, SplitLinear initialises its slices); the first training step must draw what
            # it draws under DDP, so every rank leaves with the random states it came with.
            with preserved_rng():
                if self._core.decide_whole_profile(module, step):
                    self.model_to_device()
                self._plan_and_apply(trainer, module, step)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._step_groups_apart()
        # NOTE: Lightning clips through the precision plugin; its clipping must handle mixed meshes.
        self.precision_plugin = with_sharded_clipping(self.precision_plugin)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)

    def _plan_and_apply(self, trainer: pl.Trainer, module: pl.LightningModule, step: StepInputs) -> None:
        """Calibrate, profile and solve (or take the given plan), then shard ``module`` by the plan; sets
        the module's batch size the plan chose (``micro_batch_size="auto"``)."""
        assert self._core is not None
        plan = self._core.decide_plan(module, step)
        if self.config.plan is None and plan.micro_batch_size != current_batch_size(
                trainer, module, plan.micro_batch_size):
            set_batch_size(trainer, module, plan.micro_batch_size)
            rank_zero_info(f"osdp: micro-batch size set to {plan.micro_batch_size} (micro_batch_size='auto')")
        rank_zero_info(f"osdp plan ({self.world_size} ranks):\n{plan.format_table()}\n{format_comparison(plan)}")
        log_plan(trainer, plan)
        self._root = RootWrapper(module)
        self._core.apply(module, self._root)
        self.model = self._root

    def _step_inputs(self, trainer: pl.Trainer, module: pl.LightningModule) -> StepInputs:
        """What planning takes from the Trainer: its batch and optimizer; sets the module's batch size
        for ``micro_batch_size=N`` first (the batch is taken at that size)."""
        config = self.config
        if config.plan is not None:
            return StepInputs(batch=lambda: None, optimizer=None, precision=str(trainer.precision))
        if config.micro_batch_size not in (None, "auto"):
            set_batch_size(trainer, module, int(config.micro_batch_size))
        return StepInputs(
            batch=lambda: first_training_batch(trainer, module, self), optimizer=configured_optimizer(module),
            precision=str(trainer.precision), step_context=self.precision_plugin.train_step_context,
            accumulation_steps=check_accumulation(trainer.accumulate_grad_batches),
            micro_batch_size="auto" if config.micro_batch_size == "auto" else None)

    # -- checkpoints: keys of the unwrapped LightningModule (osdp_lightning/state/checkpoint.py) ---------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Canonical model state: DTensor shards, or whole tensors on rank 0 when consolidating."""
        return checkpoint_io.model_state(self.lightning_module, full=not self._save_distributed_checkpoint)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        return checkpoint_io.optimizer_state(self.lightning_module, optimizer,
                                             full=not self._save_distributed_checkpoint)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("OSDPStrategy.save_checkpoint(..., storage_options=...) is not supported: the osdp "
                            "strategy writes its checkpoints itself (torch.distributed.checkpoint), not via CheckpointIO")
        path = Path(self.broadcast(str(filepath)))
        plan = self._plan
        info = {"plan": {u.name: u.choice for u in plan.units} if plan is not None else None}
        checkpoint_io.save_checkpoint(checkpoint, path, sharded=self._save_distributed_checkpoint, info=info)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        loaded = checkpoint_io.load_checkpoint(path, self.lightning_module, self._bare_optimizers(),
                                               strict=self.lightning_module.strict_loading, weights_only=weights_only)
        self._step_groups_apart()  # loading restores the groups' saved flags
        return loaded

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        # NOTE: load_checkpoint already loaded the tensors and removed them from what it returned;
        # a dict that still holds whole tensors (e.g. torch.load of a .ckpt file) is loaded here.
        if "state_dict" in checkpoint:
            checkpoint_io.load_full_model_state(self.lightning_module, checkpoint["state_dict"], strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        for optimizer, state in zip(self._bare_optimizers(), checkpoint.get("optimizer_states", []), strict=False):
            checkpoint_io.load_full_optimizer_state(self.lightning_module, optimizer, state)
        self._step_groups_apart()

    def _bare_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers, without Lightning's wrappers."""
        return [getattr(opt, "_optimizer", opt) for opt in self.optimizers]

    def _step_groups_apart(self) -> None:
        changed = step_groups_apart(self._bare_optimizers())
        if changed and self.root_device.type == "cuda":
            rank_zero_info(f"osdp: {', '.join(changed)} mixes sharded and replicated parameters, which the "
                           "multi-tensor (foreach / fused) step cannot take together: it steps them one by one")
