"""The osdp setup both strategies share: calibrate, plan on rank 0, broadcast, apply.

The Trainer strategy (:mod:`osdp_lightning.integration.strategy`) and the Fabric strategy
(:mod:`osdp_lightning.integration.fabric_strategy`) differ only in where the training step, its batch, the
optimizer and the precision come from (:class:`StepInputs`); the rest happens here, on the live
process group, in a fixed order that is the same on every rank:

1. decide whether rank 0 profiles the model whole or from shapes (:meth:`OSDPSetup.decide_whole_profile`);
2. time a few collectives, the node links and the step-time terms (every rank; rank 0's figures);
3. on rank 0: profile the step and solve (:class:`~osdp_lightning.plan.planner.Planner`); the Plan, or
   the error, is broadcast so that every rank applies the same one or raises the same error;
4. apply the plan (:meth:`OSDPSetup.apply`): meshes, FSDP2 units, a meta-built model initialised
   unit by unit, pretrained weights, then DDP's reducer for the replicated parameters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from osdp_lightning.apply.apply import apply_plan, connect_plan
from osdp_lightning.calibrate import (
    CollectiveTimings,
    calibrate_step_terms,
    link_payload_bytes,
    measure_collectives,
    measure_one_process_terms,
)
from osdp_lightning.choices.checkpointing import refusal_message
from osdp_lightning.cost.budget import (
    default_memory_budget,
    device_memory_bytes,
    format_bytes,
    plan_headroom,
)
from osdp_lightning.cost.cluster import ClusterSpec, NodeTimings, live_cluster_spec, measure_node_collectives
from osdp_lightning.cost.links import NODE_PAYLOAD_BYTES
from osdp_lightning.cost.step_terms import StepTerms, default_loop_step_s
from osdp_lightning.integration.config import OSDPConfig
from osdp_lightning.plan.pipeline import (
    ProfileOptions,
    budget_floor_bytes,
    check_setup_fits,
    profile_model,
    whole_profile_fits,
    whole_profile_peak_bytes,
)
from osdp_lightning.plan.plan import Plan
from osdp_lightning.plan.planner import Planner, PlanOptions
from osdp_lightning.profiling.fakestep import FakeStepError, build_meta_module
from osdp_lightning.profiling.materialize import has_meta_tensors, materialize
from osdp_lightning.profiling.precision import check_plan_precision
from osdp_lightning.profiling.records import ModelProfile
from osdp_lightning.profiling.units import select_units
from osdp_lightning.runtime.compile import (
    compile_seconds,
    compile_unit,
    compiled_once,
    recompile_user_compiled,
)
from osdp_lightning.runtime.faults import (
    all_gather_object,
    all_ranks_succeed,
    broadcast_object,
    portable_error,
)
from osdp_lightning.runtime.meshes import Meshes, build_meshes
from osdp_lightning.runtime.process_memory import (
    anonymous_bytes,
    file_bytes,
    fixed_cost_bytes,
    module_tensor_bytes,
    untracked_growth_bytes,
)
from osdp_lightning.state.pretrained import load_pretrained


class RootWrapper(nn.Module):
    """The outermost module around the user's. FSDP2 makes it the root and the replicated
    parameters' reducer hooks its forward, so both run around whatever the framework calls through
    it (Lightning's ``training_step``, Fabric's forward and the methods it redirects through forward)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class Ranks:
    """Where this process runs: its device, and the ranks around it."""

    device: torch.device
    world_size: int
    ranks_per_node: int
    num_nodes: int
    rank: int


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """What planning needs from the framework: the step profiling runs and what the plan is for.

    The step is the module's ``training_step(batch, 0)`` (or, without a batch, its forward on
    ``example_input_array``), run on rank 0 only.
    """

    batch: Callable[[], Any]
    """The batch profiling runs on, on the device; called on rank 0 only, once the batch size is set."""
    optimizer: torch.optim.Optimizer | None
    """The optimizer training uses (its state per parameter and its step are priced), or ``None``."""
    precision: str = "32-true"
    """Lightning's precision flag."""
    step_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    """The precision's context around a step (autocast)."""
    accumulation_steps: int = 1
    """Micro-batches per optimizer step."""
    micro_batch_size: int | str | None = None
    """What the planner searches: ``None`` (the profiled size), an int, or ``"auto"`` (see PlanOptions)."""


class OSDPSetup:
    """One model's osdp setup on the live process group; see the module docstring.

    Built once the process group exists; every method that communicates is called on every rank.
    """

    def __init__(self, config: OSDPConfig, ranks: Ranks) -> None:
        self.config, self.ranks = config, ranks
        self.plan: Plan | None = None
        self.profile: ModelProfile | None = None
        """The measured profile (``None`` when the plan was given)."""
        self.profile_whole = True
        """Whether rank 0 profiled the whole model (placed whole on the device) or from shapes."""
        self.timings: CollectiveTimings | None = None
        self.node_timings: NodeTimings | None = None
        self.step_terms: StepTerms | None = None
        self.meshes: Meshes | None = None
        self.setup_s: dict[str, float] = {}
        """Seconds spent at setup: calibrate, profile, solve, apply (rank 0's figures)."""
        self._fragmentation: float | None = None
        self.fixed_cost_bytes = 0
        """This rank's resident set once calibrated, less the model's CPU tensors: what the process
        holds whatever the model; a CPU budget bounds the resident set above it (0: not measured)."""
        self.fixed_file_bytes = 0
        """The file pages (code, mapped files) of that resident set."""
        self._untracked_bytes = 0
        self.compile_s = 0.0
        """Seconds this rank spent compiling units while profiling (``compile="units"``)."""
        self._batch: tuple[Any] | None = None

    # -- 1. whole or from shapes --------------------------------------------------------------
    def decide_whole_profile(self, module: nn.Module, step: StepInputs | None = None) -> bool:
        """Whether the whole-model profile fits the budget, rank 0's answer on every rank (a
        collective). A model built on the meta device, or too large to profile whole, is planned from
        shapes and never placed whole on the device (:mod:`osdp_lightning.plan.pipeline`): only its
        shards are. Under a real limit rank 0 also runs ``step``'s batch through a fake step."""
        self.profile_whole = bool(self._on_rank_zero(lambda: self._can_profile_whole(module, step)))
        return self.profile_whole

    def _can_profile_whole(self, module: nn.Module, step: StepInputs | None) -> bool:
        if has_meta_tensors(module):
            return False
        budget, ranks = self.config.budget, self.ranks
        device_bytes = device_memory_bytes(ranks.device, ranks.ranks_per_node)
        budget_bytes = (budget_floor_bytes(module, budget, device_bytes, ranks.world_size)
                        if budget is not None else default_memory_budget(ranks.device, ranks.ranks_per_node))
        if not whole_profile_fits(module, budget_bytes):
            return False
        if step is None or self.config.plan is not None or not self.budget_is_real_limit:
            return True
        try:
            peak = whole_profile_peak_bytes(module, self._step_batch(step), step.precision)
        except FakeStepError as err:
            rank_zero_info(f"osdp: the model is profiled whole; whether that fits the budget is not known: {err}")
            return True
        if peak <= budget_bytes:
            return True
        rank_zero_info(f"osdp: profiling the whole model would hold about {format_bytes(peak)} at once (model, a "
                       f"saved copy, its step twice), more than the budget of {format_bytes(budget_bytes)}: "
                       "it is profiled from shapes")
        return False

    @property
    def budget_is_real_limit(self) -> bool:
        """Whether the budget bounds the process (bytes or a share of the device, ``budget_covers=
        "process"``, no headroom given) rather than the priced tensors of a baseline's share."""
        budget = self.config.budget
        return self._budget_covers_process and (budget is None or not budget.needs_profile)

    @property
    def _budget_covers_process(self) -> bool:
        """Whether a budget in bytes or a share of the device bounds the process (``budget_covers=
        "process"``, no headroom given): its untracked growth is measured and named."""
        return self.config.budget_covers == "process" and self.config.headroom is None

    def _step_batch(self, step: StepInputs) -> Any:
        """``step.batch()``, taken once (rank 0) for both the choice above and the profile."""
        if self._batch is None:
            self._batch = (step.batch(),)
        return self._batch[0]

    # -- 2, 3. calibrate, then profile and solve on rank 0 --------------------------------------
    def decide_plan(self, module: nn.Module, step: StepInputs) -> Plan:
        """The given plan, or one profiled and solved on rank 0; the same Plan on every rank.

        Draws random numbers on some or all ranks: callers keep the user's random states
        (:func:`osdp_lightning.runtime.guards.preserved_rng`).
        """
        ranks, given = self.ranks, self.config.plan
        if ranks.world_size == 1:
            rank_zero_info("osdp: one process, nothing to shard across; every unit is replicated "
                           "(a single-device plan).")
        if given is not None:
            given.check_matches(module, ranks.world_size)
            if (note := check_plan_precision(given, step.precision, self.config.reduce_dtype)) is not None:
                rank_zero_info(f"osdp: {note}")
            if ranks.world_size > 1:
                # NOTE: a saved plan skips calibration, whose collectives also warm the process group
                # up: without them the same all-replicate plan ran 0.15 s a step instead of 0.11 for
                # the whole run (GPT 4 x 384, 2 gloo ranks; a tiny all-reduce and an all-gather suffice).
                self.timings = measure_collectives(
                    ranks.device, link_payload_bytes(self.calibration_room_bytes(module), ranks.world_size))
            self.measure_fixed_cost(module)
            self.plan = given
            return given
        self.check_setup_fits(module, step)  # NOTE: before calibrating, whose own refusal names less
        self.calibrate(step.optimizer, self.calibration_room_bytes(module))
        self.measure_fixed_cost(module)
        self.compile_for_profile(module)
        start_s = compile_seconds()
        with compiled_once():  # NOTE: each kind of unit compiles in the profile's first step, and only there
            self.profile, self.plan = self._on_rank_zero(lambda: self._profile_and_solve(module, step))
        self.compile_s = compile_seconds() - start_s
        return self.plan

    def compile_for_profile(self, module: nn.Module) -> None:
        """Units compiled as the plan will run them (``compile="units"``), and any module the user
        compiled in place compiled the same way, so that profiling measures compiled code and
        recompiles nothing per profiled step (:mod:`osdp_lightning.runtime.compile`)."""
        user = recompile_user_compiled(module)
        if user:
            rank_zero_info(f"osdp: modules compiled with .compile() run their hooks outside the graph: {user}")
        if self.config.compile != "units":
            return
        config = self.config
        for spec in select_units(module, config.unit_module_types, config.unit_name_patterns, config.min_unit_params):
            for name in spec.module_names:
                compile_unit(module.get_submodule(name), name)

    def calibration_room_bytes(self, module: nn.Module) -> int | None:
        """What calibration may hold at once under a real limit: the budget less what the model holds
        on the device now (CUDA: all the allocator reserved), the least of any rank's, so that every
        rank lays calibration out alike (a collective); ``None`` otherwise."""
        if not self.budget_is_real_limit:
            return None
        device = self.ranks.device
        held = (module_tensor_bytes(module) if device.type == "cpu"
                else torch.cuda.memory_reserved(device) if device.type == "cuda" else 0)
        return min(all_gather_object(self.cluster_spec().memory_budget_bytes - held))

    def calibrate(self, optimizer: torch.optim.Optimizer | None, room_bytes: int | None = None) -> None:
        """Collective timings, node links and step terms; every rank, rank 0's figures (or its cache) on
        all; a calibration that measures holds at most ``room_bytes`` at once, or is refused
        (:mod:`osdp_lightning.calibrate.room`)."""
        ranks, device = self.ranks, self.ranks.device
        loop_step_s = default_loop_step_s(device.type)
        if ranks.world_size == 1:
            self.step_terms = measure_one_process_terms(device, optimizer, loop_step_s=loop_step_s,
                                                        room_bytes=room_bytes)
        else:
            payload = link_payload_bytes(room_bytes, ranks.world_size)  # before anything is allocated
            self.timings = measure_collectives(device, payload)
            if ranks.num_nodes > 1:  # intra- and inter-node links apart
                self.node_timings = measure_node_collectives(device, ranks.ranks_per_node,
                                                             min(payload, NODE_PAYLOAD_BYTES))
            self.meshes = build_meshes(device.type, ranks.world_size)
            self.step_terms = calibrate_step_terms(
                device, optimizer, self.meshes, ranks_per_node=ranks.ranks_per_node,
                split=True,  # NOTE: one cache entry per machine, whatever this run may choose
                loop_step_s=loop_step_s, use_cache=self.config.calibration_cache, room_bytes=room_bytes)
        terms = self.step_terms
        rank_zero_info(f"osdp: step terms {terms.source}"
                       + (f" ({terms.calibrate_s:.2f} s)" if terms.calibrate_s else ""))

    def measure_fixed_cost(self, module: nn.Module) -> None:
        """The fixed cost a CPU budget is counted above: this rank's resident set once calibration has
        warmed up torch, gloo and osdp's machinery, less the model's tensors (every rank its own)."""
        if self.ranks.device.type == "cpu":
            self.fixed_cost_bytes, self.fixed_file_bytes = fixed_cost_bytes(module), file_bytes()

    def _profile_options(self, step: StepInputs) -> ProfileOptions:
        config = self.config
        return config.profile_options(step.precision, split=config.uniform_choice is None and self.ranks.world_size > 1)

    def check_setup_fits(self, module: nn.Module, step: StepInputs) -> None:
        """Refuse, on every rank alike, a budget that cannot hold the profile from shapes itself
        (:func:`~osdp_lightning.plan.pipeline.check_setup_fits`)."""
        budget = self.config.budget
        if not self.profile_whole and not (budget is not None and budget.needs_profile):
            check_setup_fits(module, self._profile_options(step), self.cluster_spec().memory_budget_bytes)

    def _on_rank_zero(self, work: Callable[[], Any]) -> Any:
        """``work()`` on rank 0, its result on every rank; its error raised on every rank (also one
        that cannot be pickled: :func:`~osdp_lightning.runtime.faults.portable_error`), none left waiting."""
        outcome: list[Any] = [None]
        failure: Exception | None = None
        if self.ranks.rank == 0:
            try:
                outcome[0] = work()
            except Exception as err:  # every rank must learn of the failure, not wait forever
                failure, outcome[0] = err, portable_error(err)
        if dist.is_initialized() and self.ranks.world_size > 1:
            dist.broadcast_object_list(outcome, src=0)
        if failure is not None:
            raise failure
        if isinstance(outcome[0], Exception):
            raise outcome[0]
        return outcome[0]

    def _profile_and_solve(self, module: nn.Module, step: StepInputs) -> tuple[ModelProfile, Plan]:
        config, device = self.config, self.ranks.device
        batch = self._step_batch(step)
        self._batch = None  # NOTE: the profile holds it as long as it needs it
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        options = self._profile_options(step)
        optimizers = [step.optimizer] if step.optimizer is not None else []
        start = anonymous_bytes(), module_tensor_bytes(module, optimizers)

        def untracked() -> int:  # NOTE: what rank 0's work leaves in its own memory stays through training
            return untracked_growth_bytes(start[0], anonymous_bytes(), start[1], module_tensor_bytes(module, optimizers))

        profile = profile_model(module, batch, device, options, whole=self.profile_whole,
                                optimizer=step.optimizer, step_context=step.step_context)
        if device.type == "cpu":
            self._untracked_bytes = untracked()
        if not self.profile_whole:
            rank_zero_info(f"osdp: profiled from shapes (fake step, one real copy of each kind of unit) in "
                           f"{profile.profile_s:.2f} s; the model is placed on the device only as its shards")
        if (refused := refusal_message(profile.units)) is not None:  # before training: which units, and why
            always = config.choice_options.activation_checkpointing == "always"
            (rank_zero_warn if always else rank_zero_info)(refused)
        if device.type == "cuda":  # the caching allocator's slack at the profiled peak
            allocated = torch.cuda.max_memory_allocated(device)
            self._fragmentation = torch.cuda.max_memory_reserved(device) / allocated - 1 if allocated else None
        return profile, self._solve_within_untracked(profile, step, untracked)

    def _solve_within_untracked(self, profile: ModelProfile, step: StepInputs, untracked: Callable[[], int]) -> Plan:
        """The plan, once what the solve itself leaves in the process is counted too (CPU, measured
        by ``untracked()`` from before profiling): solving again when the first plan no longer fits
        with it (the second solve reuses that memory)."""
        plan = self._solve(profile, step)
        if self.ranks.device.type != "cpu" or (grown := untracked()) <= self._untracked_bytes:
            return plan
        self._untracked_bytes = grown
        cluster = self.cluster_spec(plan.memory_budget_bytes)
        if plan.bounded_peak_bytes > cluster.usable_bytes:
            return self._solve(profile, step)
        kept = cluster.kept_untracked_bytes
        return dataclasses.replace(plan, untracked_bytes=kept, untracked_reason=cluster.untracked_reason if kept else "")

    def _solve(self, profile: ModelProfile, step: StepInputs) -> Plan:
        config, budget = self.config, self.config.budget
        planner = Planner(profile, self.cluster_spec, budget, PlanOptions(
            choice_options=config.choice_options, uniform_choice=config.uniform_choice,
            micro_batch_size=step.micro_batch_size, time_limit_s=config.solver_time_limit_s,
            accumulation_steps=step.accumulation_steps))
        cluster = planner.cluster
        if planner.baseline_peak_bytes is not None and budget is not None:  # e.g. "95%ddp"
            rank_zero_info(f"osdp: memory budget {budget.text} = {format_bytes(cluster.memory_budget_bytes)} per "
                           f"rank (the uniform {budget.baseline} plan's predicted peak: "
                           f"{format_bytes(planner.baseline_peak_bytes)})")
        plan = planner.plan()
        if plan.predicted_peak_bytes > cluster.memory_budget_bytes:
            rank_zero_warn(f"osdp: the {plan.source} plan is predicted to exceed the memory budget "
                           f"({plan.predicted_peak_bytes} > {cluster.memory_budget_bytes} bytes)")
        return plan

    def cluster_spec(self, budget: int | None = None) -> ClusterSpec:
        """The cluster plans are priced on: this run's links, step terms and headroom, at ``budget``
        bytes per rank (default: the configured budget of the device)."""
        config, ranks = self.config, self.ranks
        if budget is None and config.budget is not None:
            budget = config.budget.of_device(device_memory_bytes(ranks.device, ranks.ranks_per_node))
        budget = budget or default_memory_budget(ranks.device, ranks.ranks_per_node)
        overlap = config.overlap_efficiency
        if overlap is None and ranks.device.type != "cuda":
            # NOTE: on CPU, gloo's collectives compete with compute for the same cores and the
            # measured figure is noise on a shared machine: CPU plans assume no overlap.
            overlap = 0.0
        headroom = plan_headroom(config.headroom, ranks.device, self._fragmentation, ranks.ranks_per_node)
        spec = live_cluster_spec(
            world_size=ranks.world_size, ranks_per_node=ranks.ranks_per_node, memory_budget_bytes=budget,
            timings=self.timings, node_timings=self.node_timings, overlap_efficiency=overlap,
            headroom_bytes=headroom.bytes, headroom_fraction=headroom.share, headroom_by_kind=headroom.by_kind)
        # NOTE: a share of a baseline's predicted peak ("70%ddp") bounds the priced tensors; a budget in
        # bytes or a share of the device is a real limit, which the process's untracked growth counts in.
        real_limit = self.budget_is_real_limit
        untracked = self._untracked_bytes if self._budget_covers_process else 0  # NOTE: a budget named in bytes counts it
        return dataclasses.replace(spec, step_terms=self.step_terms, headroom_reason=headroom.reason,
                                   untracked_bytes=untracked, untracked_counted=real_limit,
                                   bucket_rebuild_counted=real_limit, untracked_reason=(
                                       "what rank 0's own memory grew by beyond tensors while it profiled and "
                                       "solved, and half again: training's own growth differs" if untracked else ""))

    # -- 4. apply ------------------------------------------------------------------------------
    def apply(self, module: nn.Module, root: nn.Module) -> None:
        """Shard ``module`` by the plan in place; ``root`` is the outermost module (``module`` itself
        or a wrapper whose forward runs first). Every rank calls it, after :meth:`decide_plan`."""
        assert self.plan is not None, "decide_plan comes first"
        plan, device = self.plan, self.ranks.device
        start = time.perf_counter()
        self.meshes = self.meshes or build_meshes(device.type, self.ranks.world_size)
        # NOTE: every rank built the same model, so every rank takes this branch alike (the broadcast
        # is a collective): the unsharded layout, for initialising, and one seed for every rank's values.
        template = build_meta_module(module) if has_meta_tensors(module) else None
        seed = broadcast_object(int(torch.randint(2**62, ()).item())) if template is not None else 0
        with all_ranks_succeed("applying the osdp plan"):  # no rank waits for a failed one
            apply_plan(module, root, plan, self.meshes, build_reducer=False, compile=self.config.compile)
            if template is not None:
                materialize(root, module, template, [u.module_names for u in plan.units], device, seed)
            elif not self.profile_whole:
                root.to(device)  # what no unit's fully_shard moved (replicated units)
        if self.config.pretrained is not None:  # NOTE: its own all_ranks_succeed: no rank waits for a failed one
            load_pretrained(module, self.config.pretrained)  # after init, so the file's values win
        connect_plan(root)  # a collective (replicate: DDP's reducer): once every rank applied its part
        self.setup_s = {
            "calibrate_s": (self.timings.calibrate_s if self.timings else 0.0)
            + (self.step_terms.calibrate_s if self.step_terms else 0.0),
            "profile_s": max(plan.profile_s - self.compile_s, 0.0), **self._compile_breakdown(),
            "solve_s": plan.solve_s, "apply_s": time.perf_counter() - start}
        rank_zero_info("osdp setup: " + ", ".join(f"{k[:-2]} {v:.3f} s" for k, v in self.setup_s.items()))

    def _compile_breakdown(self) -> dict[str, float]:
        """Setup's compile seconds (rank 0's, within profiling), where anything was compiled."""
        return {"compile_s": self.compile_s} if self.config.compile or self.compile_s else {}

    def release_process_groups(self) -> None:
        """Drop the meshes (they hold process groups); see :mod:`osdp_lightning.runtime.shutdown`."""
        self.meshes = None
