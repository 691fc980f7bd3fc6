"""Lightning glue: ``Trainer(strategy="osdp")``.

At ``setup`` (after the process group exists, before the optimizer is built) the strategy:

1. times a few collectives on the live process group (every rank; rank 0's figures broadcast);
2. on rank 0: profiles the real ``training_step`` on one real batch, builds the choice table and
   solves the ILP; the Plan (or the error) is broadcast so that every rank applies the same one;
3. applies the plan with FSDP2 and lets Lightning build the optimizer on the sharded parameters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from osdp_lightning import checkpoint as checkpoint_io
from osdp_lightning.accumulate import check_accumulation, no_gradient_sync
from osdp_lightning.apply import Meshes, apply_plan, build_meshes, connect_plan, step_groups_apart
from osdp_lightning.budget import (
    default_memory_budget,
    device_memory_bytes,
    format_bytes,
    parse_memory_budget,
    plan_headroom,
)
from osdp_lightning.calibrate import (
    CollectiveTimings,
    calibrate_step_terms,
    measure_collectives,
    measure_one_process_terms,
)
from osdp_lightning.choices import ChoiceOptions, choice_space
from osdp_lightning.choices.checkpointing import refusal_message
from osdp_lightning.clip import with_sharded_clipping
from osdp_lightning.cluster import ClusterSpec, NodeTimings, live_cluster_spec, measure_node_collectives
from osdp_lightning.fakestep import build_meta_module
from osdp_lightning.faults import all_ranks_succeed, init_elastic_process_group, portable_error
from osdp_lightning.guards import preserved_rng
from osdp_lightning.materialize import has_meta_tensors, materialize
from osdp_lightning.optim_state import configured_optimizer
from osdp_lightning.pipeline import (
    ProfileOptions,
    SolveOptions,
    budget_floor_bytes,
    check_setup_fits,
    profile_model,
    resolved_cluster,
    solve_plan,
    whole_profile_fits,
)
from osdp_lightning.plan import Plan
from osdp_lightning.pretrained import PretrainedWeights, load_pretrained
from osdp_lightning.profile import ModelProfile, is_profiling
from osdp_lightning.report import format_comparison, log_plan
from osdp_lightning.setup_inputs import (
    check_headroom,
    check_micro_batch_size,
    check_split_factors,
    check_uniform_choice,
    current_batch_size,
    first_training_batch,
    set_batch_size,
)
from osdp_lightning.shutdown import release_at_exit
from osdp_lightning.step_terms import StepTerms, default_loop_step_s
from osdp_lightning.units import DEFAULT_MIN_UNIT_PARAMS


class RootWrapper(nn.Module):
    """The outermost module. FSDP2 makes it the root, so its hooks run around ``training_step``
    (Lightning redirects ``*_step`` calls through the wrapper's forward)."""

    def __init__(self, module: pl.LightningModule) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class OSDPStrategy(ModelParallelStrategy):
    """Optimal Sharded Data Parallel: per-module replicate / zero2 / zero3 / split, chosen by an ILP
    under a per-rank memory budget and applied with FSDP2.

    Args:
        memory_budget: Per-rank budget: bytes (an int, or ``"6GiB"``), a share of the device
            (``"70%"``), or a share of a baseline's predicted peak (``"95%ddp"``, ``"120%zero3"``,
            resolved after profiling); see :mod:`osdp_lightning.budget`. Default: the device's
            memory minus 8% on CUDA (``"92%"``), 80% of RAM shared by the node's ranks on CPU (``"80%"``).
        plan: A :class:`Plan` or a path to a saved plan JSON; skips profiling and solving.
        micro_batch_size: ``None`` keeps the user's; an int sets the module's or datamodule's
            ``batch_size``; ``"auto"`` searches sizes for the highest predicted throughput.
        uniform_choice: Give every unit this choice instead of solving (baselines: ``"ddp"`` /
            ``"replicate"``, ``"zero2"``, ``"zero3"``).
        split_factors: Slice counts the ILP may split Linear layers into; ``()`` turns it off.
        activation_checkpointing: ``"auto"``: the ILP decides per unit whether to recompute its
            activations in backward (``zero3+ckpt``); ``"never"``; ``"always"``: every unit that
            can be: a unit whose recomputation does not replay its forward (found while profiling)
            keeps its choice without ``+ckpt``, with a warning before training naming it and why.
        unit_module_types / unit_name_patterns: Which modules are units (default: leaf modules
            with at least ``min_unit_params`` parameters).
        overlap_efficiency: Share of communication hidden by compute. Default: measured at setup on
            CUDA; 0 on CPU (gloo competes with compute for the same cores).
        solver_time_limit_s: Stop the ILP after this long and use the best plan found (the plan
            says "Time limit" and gives the gap); ``None`` always proves the optimum. Small
            models solve to optimality in well under a second, 1,000-2,000 units in seconds
            with HiGHS (the default); CBC (used without ``highspy``) can take minutes there.
        headroom: Part of the budget plans keep free for what the memory model misses: a share
            (``0.05``) or bytes (``"256MiB"``). Default: 2.5% on CPU (over a point above the model's
            largest measured miss), 4% with more ranks than cores, on CUDA 4% plus the allocator's
            fragmentation measured while profiling (:func:`osdp_lightning.budget.plan_headroom`).
        calibration_cache: Reuse the step-time terms measured earlier on this machine: the median of
            its last five calibrations (``$OSDP_LIGHTNING_CALIBRATION_DRAWS`` to change how many); the
            first launches each measure and add theirs (``~/.cache/osdp_lightning``, or
            ``$OSDP_LIGHTNING_CACHE_DIR``; one file per process group and optimizer); ``False`` measures anew.
        save_distributed_checkpoint: Sharded (default) or one consolidated checkpoint file.
        pretrained: Weights to start from, loaded once the plan is applied: a Hugging Face model
            directory, a ``.safetensors`` file or a ``torch.save`` state dict, or a
            :class:`~osdp_lightning.pretrained.PretrainedWeights` (key prefix, ``strict``). Each rank
            reads only the tensors and rows it keeps; names and shapes must match (strict).
    """

    strategy_name = "osdp"
    # NOTE: FSDPStrategy keeps this list at class level and checks it for a GPU; ours is separate.
    _registered_strategies: list[str] = []

    def __init__(self, memory_budget: int | str | None = None, plan: Plan | str | Path | None = None,
                 micro_batch_size: int | Literal["auto"] | None = None, uniform_choice: str | None = None,
                 split_factors: Sequence[int] = (2, 4, 8),
                 activation_checkpointing: Literal["auto", "never", "always"] = "auto",
                 unit_module_types: Sequence[str | type] | None = None,
                 unit_name_patterns: Sequence[str] | None = None,
                 min_unit_params: int = DEFAULT_MIN_UNIT_PARAMS, profile_repeats: int = 3,
                 overlap_efficiency: float | None = None, solver_time_limit_s: float | None = 60.0,
                 headroom: float | int | str | None = None, calibration_cache: bool = True,
                 save_distributed_checkpoint: bool = True, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout,
                 pretrained: str | Path | PretrainedWeights | None = None) -> None:
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.memory_budget = parse_memory_budget(memory_budget) if memory_budget is not None else None
        self.memory_budget_bytes = self.memory_budget.bytes if self.memory_budget is not None else None
        self._plan_source = plan if isinstance(plan, Plan) else (Plan.load(plan) if plan is not None else None)
        self.micro_batch_size = check_micro_batch_size(micro_batch_size)
        self.uniform_choice = check_uniform_choice(uniform_choice)
        self.split_factors = check_split_factors(split_factors)
        self.choice_options = ChoiceOptions(split_factors=self.split_factors,
                                            activation_checkpointing=activation_checkpointing)
        choice_space(ClusterSpec(2, 1, 0.0, 1.0), self.choice_options)  # a bad option fails here, not at setup
        self.unit_module_types, self.unit_name_patterns = unit_module_types, unit_name_patterns
        self.min_unit_params, self.profile_repeats = min_unit_params, profile_repeats
        self.overlap_efficiency, self.solver_time_limit_s = overlap_efficiency, solver_time_limit_s
        self.headroom, self.calibration_cache = check_headroom(headroom), calibration_cache
        self._step_terms: StepTerms | None = None
        self._fragmentation: float | None = None
        self._plan: Plan | None = None
        self._profile_whole = True
        self._profile: ModelProfile | None = None
        self._timings: CollectiveTimings | None = None
        self._node_timings: NodeTimings | None = None
        self._meshes: Meshes | None = None
        self._root: RootWrapper | None = None
        self.pretrained = PretrainedWeights(str(pretrained)) if isinstance(pretrained, (str, Path)) else pretrained
        self.setup_s: dict[str, float] = {}
        """Seconds spent at setup: calibrate, profile, solve, apply (rank 0's figures)."""

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
    def profiling(self) -> bool:
        """``True`` while the strategy runs ``training_step`` to measure it, not to train (see README)."""
        return is_profiling()

    @property
    def profile(self) -> ModelProfile | None:
        """The measured profile (``None`` when the plan was given)."""
        return self._profile

    @property
    def timings(self) -> CollectiveTimings:
        if self._timings is None:
            raise RuntimeError("collective timings are measured at setup; they are not available yet")
        return self._timings

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def release_process_groups(self) -> None:
        """Drop the strategy's references to what holds process groups (the meshes, the sharded
        root and its reducer); called at interpreter exit (:mod:`osdp_lightning.shutdown`)."""
        self._meshes = None
        self._root = None
        self.model = None

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning's accumulation micro-steps: no reduce-scatter or all-reduce (accumulate.py)."""
        with no_gradient_sync(self.model):
            yield

    @override
    def _configure_launcher(self) -> None:
        # NOTE: ModelParallelStrategy builds no launcher in a process it did not start (rank 1..,
        # every rank under torchrun), so those ranks never got the thread count DDPStrategy's
        # launcher sets on every rank (a share of the cores, _set_num_threads_if_needed): on 2 CPU
        # cores rank 1 ran two threads beside rank 0's one, and osdp's backward was 8-10 ms slower
        # than DDP's (GPT 6 x 256, seq 128: 0.91x Lightning ddp). As DDPStrategy: a launcher on
        # every rank, which starts processes only where nothing started them.
        assert self.cluster_environment is not None
        self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

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

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        check_accumulation(trainer.accumulate_grad_batches)  # Lightning's own error, before any collective
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if self._root is not None and self._root.module is module:
            self.model = self._root  # a later stage (validate/test after fit): already sharded
        else:
            self.model = self.precision_plugin.convert_module(self.model)
            # NOTE: a model built on the meta device, or too large to profile whole, is planned from
            # shapes and never placed whole on the device (pipeline.py): only its shards are.
            self._profile_whole = self.broadcast(self._can_profile_whole(module))
            if self._profile_whole:
                self.model_to_device()
            # NOTE: planning and applying draw random numbers on some or all ranks (calibration seeds
            # the generator and fills tensors, profiling runs the user's step with its dropout,
            # SplitLinear initialises its slices); the first training step must draw what it draws
            # under DDP, so every rank leaves with the random states it came with.
            with preserved_rng():
                self._plan_and_apply(trainer, module)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._step_groups_apart()
        # NOTE: Lightning clips through the precision plugin; its clipping must handle mixed meshes.
        self.precision_plugin = with_sharded_clipping(self.precision_plugin)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _plan_and_apply(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """Calibrate, profile and solve (or take the given plan), then shard ``module`` by the plan."""
        self._plan = self._decide_plan(trainer, module)
        rank_zero_info(f"osdp plan ({self.world_size} ranks):\n{self._plan.format_table()}\n"
                       f"{format_comparison(self._plan)}")
        log_plan(trainer, self._plan)
        apply_start = time.perf_counter()
        self._meshes = self._meshes or build_meshes(self.root_device.type, self.world_size)
        self._root = RootWrapper(module)
        # NOTE: every rank built the same model, so every rank takes this branch alike (the broadcast
        # is a collective): the unsharded layout, for initialising, and one seed for every rank's values.
        template = build_meta_module(module) if has_meta_tensors(module) else None
        seed = self.broadcast(int(torch.randint(2**62, ()).item())) if template is not None else 0
        with all_ranks_succeed("applying the osdp plan"):  # no rank waits for a failed one
            apply_plan(module, self._root, self._plan, self._meshes, build_reducer=False)
            if template is not None:
                materialize(self._root, module, template, [u.module_names for u in self._plan.units],
                            self.root_device, seed)
            elif not self._profile_whole:
                self._root.to(self.root_device)  # what no unit's fully_shard moved (replicated units)
        if self.pretrained is not None:  # NOTE: its own all_ranks_succeed: no rank waits for a failed one
            load_pretrained(module, self.pretrained)  # after init, so the file's values win
        connect_plan(self._root)  # a collective (replicate: DDP's reducer): once every rank applied its part
        self.model = self._root
        self.setup_s = {
            "calibrate_s": (self._timings.calibrate_s if self._timings else 0.0)
            + (self._step_terms.calibrate_s if self._step_terms else 0.0),
            "profile_s": self._plan.profile_s, "solve_s": self._plan.solve_s,
            "apply_s": time.perf_counter() - apply_start}
        rank_zero_info("osdp setup: " + ", ".join(f"{k[:-2]} {v:.3f} s" for k, v in self.setup_s.items()))

    # -- deciding the plan (inside setup's preserved_rng: it may draw random numbers freely) -----
    def _decide_plan(self, trainer: pl.Trainer, module: pl.LightningModule) -> Plan:
        if self.world_size == 1:
            rank_zero_info("osdp: one process, nothing to shard across; every unit is replicated "
                           "(a single-device plan).")
        if self._plan_source is not None:
            self._plan_source.check_matches(module, self.world_size)
            if self.world_size > 1:
                # NOTE: a saved plan skips calibration, whose collectives also warm the process group
                # up: without them the same all-replicate plan ran 0.15 s a step instead of 0.11 for
                # the whole run (GPT 4 x 384, 2 gloo ranks; a tiny all-reduce and an all-gather suffice).
                self._timings = measure_collectives(self.root_device)
            return self._plan_source
        if self.micro_batch_size not in (None, "auto"):
            set_batch_size(trainer, module, int(self.micro_batch_size))
        self._timings = measure_collectives(self.root_device) if self.world_size > 1 else None
        if self.num_nodes > 1 and self.world_size > 1:  # every rank: intra- and inter-node links apart
            self._node_timings = measure_node_collectives(self.root_device, self.num_processes)
        if self.world_size > 1:  # every rank; rank 0's terms (or its cache) on all
            self._meshes = build_meshes(self.root_device.type, self.world_size)
            self._step_terms = calibrate_step_terms(
                self.root_device, configured_optimizer(module), self._meshes, ranks_per_node=self.num_processes,
                split=True,  # NOTE: one cache entry per machine, whatever this run may choose
                loop_step_s=default_loop_step_s(self.root_device.type), use_cache=self.calibration_cache)
        else:
            self._step_terms = measure_one_process_terms(self.root_device, configured_optimizer(module),
                                                         loop_step_s=default_loop_step_s(self.root_device.type))
        rank_zero_info(f"osdp: step terms {self._step_terms.source}"
                       + (f" ({self._step_terms.calibrate_s:.2f} s)" if self._step_terms.calibrate_s else ""))
        outcome: list[Any] = [None]
        failure: Exception | None = None
        if self.global_rank == 0:
            try:
                outcome[0] = self._profile_and_solve(trainer, module)
            except Exception as err:  # every rank must learn of the failure, not wait forever
                failure, outcome[0] = err, portable_error(err)
        if dist.is_initialized() and self.world_size > 1:
            dist.broadcast_object_list(outcome, src=0)
        if failure is not None:
            raise failure
        if isinstance(outcome[0], Exception):
            raise outcome[0]
        profile, plan = outcome[0]
        self._profile = profile
        if plan.micro_batch_size != current_batch_size(trainer, module, plan.micro_batch_size):
            set_batch_size(trainer, module, plan.micro_batch_size)
            rank_zero_info(f"osdp: micro-batch size set to {plan.micro_batch_size} (micro_batch_size='auto')")
        return plan

    def _can_profile_whole(self, module: pl.LightningModule) -> bool:
        """Whether the whole-model profile fits the budget (decided before anything is placed)."""
        if has_meta_tensors(module):
            return False
        device_bytes = device_memory_bytes(self.root_device, self.num_processes)
        budget = (budget_floor_bytes(module, self.memory_budget, device_bytes, self.world_size)
                  if self.memory_budget is not None else default_memory_budget(self.root_device, self.num_processes))
        return whole_profile_fits(module, budget)

    def _profile_and_solve(self, trainer: pl.Trainer, module: pl.LightningModule) -> tuple[ModelProfile, Plan]:
        batch = first_training_batch(trainer, module, self)
        if self.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.root_device)
        options = ProfileOptions(
            unit_module_types=self.unit_module_types, unit_name_patterns=self.unit_name_patterns,
            min_unit_params=self.min_unit_params, repeats=self.profile_repeats,
            split_factors=self.split_factors if self.uniform_choice is None and self.world_size > 1 else (),
            check_checkpointing=self.choice_options.activation_checkpointing != "never",
            precision=str(trainer.precision))
        if not self._profile_whole and not (self.memory_budget is not None and self.memory_budget.needs_profile):
            check_setup_fits(module, options, self.cluster_spec().memory_budget_bytes)
        profile = profile_model(module, batch, self.root_device, options, whole=self._profile_whole,
                                optimizer=configured_optimizer(module),
                                step_context=self.precision_plugin.train_step_context)
        if not self._profile_whole:
            rank_zero_info(f"osdp: profiled from shapes (fake step, one real copy of each kind of unit) in "
                           f"{profile.profile_s:.2f} s; the model is placed on the device only as its shards")
        if (refused := refusal_message(profile.units)) is not None:  # before training: which units, and why
            always = self.choice_options.activation_checkpointing == "always"
            (rank_zero_warn if always else rank_zero_info)(refused)
        if self.root_device.type == "cuda":  # the caching allocator's slack at the profiled peak
            allocated = torch.cuda.max_memory_allocated(self.root_device)
            self._fragmentation = torch.cuda.max_memory_reserved(self.root_device) / allocated - 1 if allocated else None
        cluster, baseline_peak = resolved_cluster(profile, self.cluster_spec, self.memory_budget)
        if baseline_peak is not None and self.memory_budget is not None:  # e.g. "95%ddp"
            rank_zero_info(f"osdp: memory budget {self.memory_budget.text} = "
                           f"{format_bytes(cluster.memory_budget_bytes)} per rank (the uniform "
                           f"{self.memory_budget.baseline} plan's predicted peak: {format_bytes(baseline_peak)})")
        plan = solve_plan(profile, cluster, SolveOptions(
            choice_options=self.choice_options, uniform_choice=self.uniform_choice,
            micro_batch_size="auto" if self.micro_batch_size == "auto" else None,
            time_limit_s=self.solver_time_limit_s, accumulation_steps=check_accumulation(trainer.accumulate_grad_batches)))
        if plan.predicted_peak_bytes > cluster.memory_budget_bytes:
            rank_zero_warn(f"osdp: the {plan.source} plan is predicted to exceed the memory budget "
                           f"({plan.predicted_peak_bytes} > {cluster.memory_budget_bytes} bytes)")
        return profile, plan

    def cluster_spec(self, budget: int | None = None) -> ClusterSpec:
        """The cluster plans are priced on: this run's links, step terms and headroom, at ``budget``
        bytes per rank (default: the strategy's budget of the device)."""
        if budget is None and self.memory_budget is not None:
            budget = self.memory_budget.of_device(device_memory_bytes(self.root_device, self.num_processes))
        budget = budget or default_memory_budget(self.root_device, self.num_processes)
        overlap = self.overlap_efficiency
        if overlap is None and self.root_device.type != "cuda":
            # NOTE: on CPU, gloo's collectives compete with compute for the same cores and the
            # measured figure is noise on a shared machine: CPU plans assume no overlap.
            overlap = 0.0
        headroom = plan_headroom(self.headroom, self.root_device, self._fragmentation, self.num_processes)
        spec = live_cluster_spec(
            world_size=self.world_size, ranks_per_node=self.num_processes, memory_budget_bytes=budget,
            timings=self._timings, node_timings=self._node_timings, overlap_efficiency=overlap,
            headroom_bytes=headroom.bytes, headroom_fraction=headroom.share)
        return dataclasses.replace(spec, step_terms=self._step_terms, headroom_reason=headroom.reason)

    # -- checkpoints: keys of the unwrapped LightningModule (osdp_lightning/checkpoint.py) ---------
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
        info = {"plan": {u.name: u.choice for u in self._plan.units} if self._plan is not None else None}
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
