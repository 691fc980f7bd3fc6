"""Planning without the hardware: a ModelProfile estimated from FLOPs and tensor sizes.

The model is built on fake tensors (``FakeTensorMode``): every tensor has a shape, dtype and
device but no storage, so a 1.5B-parameter model costs no memory and one fake training step
takes seconds. From that step:

- units: :func:`~osdp_lightning.units.select_units` and ``owned_params``, as in the measured
  profile, so a dry-run plan applies to the real model unchanged;
- activation bytes: as in the measured profile, the larger of the bytes saved for backward and
  the peak of activations plus backward temporaries (sizes are known without data); a second
  fake step at twice the micro-batch separates what grows with it from fixed bytes;
- compute seconds: FLOPs counted per unit by ``torch.utils.flop_counter.FlopCounterMode``,
  forward and backward apart, divided by the device's peak FLOP/s times ``compute_efficiency``
  (:data:`DEFAULT_COMPUTE_EFFICIENCY`);
- communication: from the cluster description's bandwidths and latencies (the cost model).

Every time in a dry-run plan is an estimate from a cluster description, and the plan says so.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from osdp_lightning.choices import ChoiceOptions, choice_space
from osdp_lightning.cluster import ClusterSpec
from osdp_lightning.fakestep import (
    MIXED_PRECISION_DTYPES,
    FakeStep,
    ModelSource,
    activation_bytes_of,
    activation_peak,
    build_fake_module,
    doubled_batch,
    fake_batch,
    fake_mode,
    run_fake_step,
    step_runner,
)
from osdp_lightning.plan import Plan, make_plan
from osdp_lightning.profile import (
    ModelProfile,
    UnitProfile,
    _tensor_bytes,
    assemble_unit,
    batch_size_of,
    configured_optimizer,
    linear_shape_of,
    optimizer_state_bytes_per_param,
)
from osdp_lightning.units import DEFAULT_MIN_UNIT_PARAMS, ROOT, UnitSpec, owned_params, select_units

DEFAULT_COMPUTE_EFFICIENCY = 0.4
"""Share of the device's peak FLOP/s a training step achieves on the FLOPs FlopCounterMode
counts (matmuls and attention). 0.4 is a typical model-FLOPs utilisation of transformer training
with FSDP on A100/H100; it also absorbs the uncounted memory-bound ops (norms, softmax, GELU)."""
PEAK_FLOPS_PER_MEMORY_BYTE = 150.0
"""Peak FLOP/s over memory bytes/s (A100: 312 TFLOP/s / 2 TB/s); prices the memory-bound sum of
a split Linear's ``k`` partial outputs (the only cost of splitting the FLOP count does not see)."""
KERNEL_LAUNCH_S = 1e-5
"""Fixed seconds of one extra kernel (a split Linear runs ``k`` matmuls per pass instead of one)."""


# ---------------------------------------------------------------------------------------------
# The profile
# ---------------------------------------------------------------------------------------------
def estimate_profile(model: ModelSource, batch: object, *, peak_flops_per_s: float,
                     compute_efficiency: float = DEFAULT_COMPUTE_EFFICIENCY, precision: str = "32-true",
                     optimizer_bytes_per_param: int | None = None,
                     unit_module_types: Sequence[str | type] | None = None,
                     unit_name_patterns: Sequence[str] | None = None,
                     min_unit_params: int = DEFAULT_MIN_UNIT_PARAMS,
                     split_factors: Sequence[int] = (2, 4, 8)) -> ModelProfile:
    """A :class:`ModelProfile` of ``model`` on ``batch`` without running it for real.

    ``model`` is a module (copied onto fake tensors) or a function that builds one (a
    LightningModule's ``training_step`` is the step, else the sum of ``forward``'s outputs).
    ``batch`` is one real batch or the same structure of meta tensors (shapes and dtypes only).
    Optimizer state bytes come from ``configure_optimizers`` when the module has it, else pass
    ``optimizer_bytes_per_param`` (default: Adam's two states).
    """
    start = time.perf_counter()
    if peak_flops_per_s <= 0 or not 0 < compute_efficiency <= 1:
        raise ValueError(f"need peak_flops_per_s > 0 and 0 < compute_efficiency <= 1, got "
                         f"{peak_flops_per_s} and {compute_efficiency}")
    if precision != "32-true" and precision not in MIXED_PRECISION_DTYPES:
        raise ValueError(f"precision {precision!r}: dry runs support '32-true' and {list(MIXED_PRECISION_DTYPES)}")
    mode = fake_mode()
    module = build_fake_module(model, mode)
    trainable = [p for p in module.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError(f"{type(module).__name__} has no trainable parameters: there is nothing to shard")
    inputs = fake_batch(batch, mode)
    specs = select_units(module, unit_module_types, unit_name_patterns, min_unit_params)
    micro_batch = batch_size_of(batch)
    with mode:
        run_loss = step_runner(module, inputs, precision)
        step = run_fake_step(module, specs, run_loss)
        module.zero_grad(set_to_none=True)
        peak, rises = activation_peak(module, run_loss, [*specs, *(part for s in specs for part in s.parts)])
        single = max(sum(step.saved_bytes.values()), peak)
        doubled = activation_bytes_of(module, specs, step_runner(module, doubled_batch(inputs, micro_batch), precision))
    # NOTE: the cost model scales activations with the micro-batch. Bytes that do not grow with it
    # (autocast's low-precision weight copies, position embeddings) are fixed bytes instead.
    per_batch_bytes = min(max(doubled - single, 0), single)
    seconds_per_flop = 1.0 / (peak_flops_per_s * compute_efficiency)
    elem = trainable[0].element_size()
    units = _unit_profiles(module, specs, step, seconds_per_flop, elem, tuple(split_factors), rises)
    if optimizer_bytes_per_param is None:
        optimizer_bytes_per_param = _optimizer_bytes_per_param(module, trainable[0].dtype)
    return ModelProfile(
        units=units, micro_batch_size=micro_batch, param_bytes_per_element=elem,
        grad_bytes_per_element=elem, compute_bytes_per_element=elem, reduce_bytes_per_element=elem,
        optimizer_bytes_per_param=optimizer_bytes_per_param, activation_bytes=per_batch_bytes,
        fixed_bytes=_tensor_bytes(batch) + single - per_batch_bytes,
        step_s=(sum(step.forward_flops.values()) + sum(step.backward_flops.values())) * seconds_per_flop,
        profile_s=time.perf_counter() - start)


def _unit_profiles(module: nn.Module, specs: Sequence[UnitSpec], step: FakeStep, seconds_per_flop: float,
                   elem: int, split_factors: tuple[int, ...], rises: dict[str, int]) -> tuple[UnitProfile, ...]:
    """Units in execution order (never-called units go to the root, as in the measured profile)."""
    by_name = {s.name: s for s in specs}
    called = [by_name[name] for name in step.order if name in by_name]
    owned = owned_params(module, called)
    units = []
    for spec in [*called, UnitSpec(ROOT, (ROOT,))]:
        shape = linear_shape_of(module, spec.name, spec.module_names)
        flops = (step.forward_flops.get(spec.name, 0), step.backward_flops.get(spec.name, 0))
        if spec.name == ROOT:  # FLOPs and bytes of units that never ran belong to the root
            flops = (flops[0] + sum(f for n, f in step.forward_flops.items() if n not in owned),
                     flops[1] + sum(f for n, f in step.backward_flops.items() if n not in owned))
        saved = step.saved_bytes.get(spec.name, 0) + (
            sum(b for n, b in step.saved_bytes.items() if n not in owned) if spec.name == ROOT else 0)
        overheads = ()
        if shape is not None:
            out_bytes = step.output_numel.get(spec.name, 0) * elem
            overheads = tuple((k, _split_overhead_s(k, out_bytes, seconds_per_flop))
                              for k in split_factors if shape[1] % k == 0)
        units.append(assemble_unit(
            module, spec.name, spec.module_names, owned[spec.name],
            forward_s=flops[0] * seconds_per_flop, backward_s=flops[1] * seconds_per_flop,
            activation_bytes=saved, input_bytes=step.input_bytes.get(spec.name, 0), split_overhead_s=overheads,
            interleaved=spec.name in step.interleaved,
            backward_rise_bytes=rises.get(spec.name),
            tail_activation_bytes=step.root_tail_bytes if spec.name == ROOT else 0))
    return tuple(units)


def _split_overhead_s(k: int, output_bytes: int, seconds_per_flop: float) -> float:
    """Extra seconds of a Linear cut into ``k`` slices: ``k - 1`` more kernels in each of the three
    passes, and summing ``k`` partial outputs (memory-bound: two reads and a write per element)."""
    seconds_per_byte = seconds_per_flop * PEAK_FLOPS_PER_MEMORY_BYTE
    return (k - 1) * (3 * KERNEL_LAUNCH_S + 3 * output_bytes * seconds_per_byte)


def _optimizer_bytes_per_param(module: nn.Module, dtype: torch.dtype) -> int:
    """State bytes per parameter of the optimizer ``configure_optimizers`` builds (Adam if none)."""
    optimizer = configured_optimizer(module)
    if optimizer is None:
        return 2 * torch.empty((), dtype=dtype).element_size()
    return optimizer_state_bytes_per_param(optimizer, dtype)


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------
DRY_RUN_SOURCE = "dry-run estimate from a cluster description (nothing measured)"


def dry_run_plan(model: ModelSource, batch: object, cluster: ClusterSpec, *,
                 micro_batch_sizes: Sequence[int] | None = None, uniform_choice: str | None = None,
                 split_factors: Sequence[int] = (2, 4, 8), group_sizes: Sequence[int] | None = None,
                 compute_efficiency: float = DEFAULT_COMPUTE_EFFICIENCY, precision: str = "32-true",
                 profile: ModelProfile | None = None, time_limit_s: float | None = None,
                 activation_checkpointing: str = "auto",
                 **unit_options: object) -> Plan:
    """Solve the plan of ``model`` for ``cluster`` from an estimated profile (no GPU, no process group).

    Choices: replicate / zero2 / zero3 (each also ``+ckpt`` per ``activation_checkpointing``), ``split`` by
    ``split_factors``, and on several nodes
    ``hsdp(g=G)`` / ``zero3(reshard=G)`` for ``group_sizes`` (default: the ranks of one node).
    ``uniform_choice`` prices a baseline instead of solving. Pass ``profile`` (from
    :func:`estimate_profile`) to plan several clusters or baselines from one fake step.
    Raises :class:`~osdp_lightning.plan.InfeasibleBudgetError` when nothing fits.
    """
    if profile is None:
        if not cluster.peak_flops_per_s:
            raise ValueError("dry-run planning needs the cluster's peak_flops_per_s (per-device peak FLOP/s)")
        profile = estimate_profile(model, batch, peak_flops_per_s=cluster.peak_flops_per_s,
                                   compute_efficiency=compute_efficiency, precision=precision,
                                   split_factors=split_factors, **unit_options)  # type: ignore[arg-type]
    options = ChoiceOptions(split_factors=tuple(split_factors),
                            group_sizes=tuple(group_sizes) if group_sizes is not None else None,
                            activation_checkpointing=activation_checkpointing)
    choices = choice_space(cluster, options)
    plan = make_plan(profile, cluster, uniform_choice=uniform_choice,
                     micro_batch_sizes=tuple(micro_batch_sizes) if micro_batch_sizes else None,
                     choices=choices, time_limit_s=time_limit_s)
    kind = f"uniform:{uniform_choice}" if uniform_choice else plan.source
    return dataclasses.replace(plan, source=f"{kind}; {DRY_RUN_SOURCE}")


def format_dry_run(plan: Plan, cluster: ClusterSpec, compute_efficiency: float = DEFAULT_COMPUTE_EFFICIENCY,
                   cluster_name: str | None = None) -> str:
    """The plan's table under a header that says what its figures are: estimates, not measurements."""
    from osdp_lightning.cluster import describe_cluster

    name = f" {cluster_name}" if cluster_name else ""
    peak = f"{cluster.peak_flops_per_s / 1e12:.3g} TFLOP/s" if cluster.peak_flops_per_s else "?"
    header = [
        f"DRY RUN for cluster{name}: {describe_cluster(cluster)}.",
        "No GPU and no process group were used. All times below are ESTIMATES from the cluster description:",
        f"  compute = FLOPs counted on fake tensors / (peak {peak} x efficiency {compute_efficiency:g});",
        "  communication = latency + bytes / bandwidth of the cluster's intra- and inter-node links;",
        "  optimizer, FSDP2's per-unit work and the loop's constant = the config's step_model (or the",
        "  documented defaults of its device kind, osdp_lightning/step_terms.py).",
        "Bytes per rank are computed from tensor sizes; the activations were recorded on fake tensors.",
        "",
    ]
    return "\n".join(header) + plan.format_table()


# ---------------------------------------------------------------------------------------------
# Recipes (conf/model + conf/data), for osdp-plan and the benchmarks
# ---------------------------------------------------------------------------------------------
def compose_config(overrides: Sequence[str] = (), config_name: str = "plan") -> object:
    """The Hydra config ``osdp-plan <overrides>`` would see (``model=gpt_xl cluster=...``)."""
    from hydra import compose, initialize_config_dir

    from osdp_lightning.cluster import cluster_config_dir

    with initialize_config_dir(str(cluster_config_dir().parent), version_base="1.3"):
        return compose(config_name, overrides=list(overrides))


def recipe_model_and_batch(cfg: object) -> tuple[Callable[[], nn.Module], object, int]:
    """A factory for ``cfg.model`` (nothing built yet), one real batch of ``cfg.data``, tokens per sample."""
    from hydra.utils import instantiate

    datamodule = instantiate(cfg.data)  # type: ignore[attr-defined]
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    return (lambda: instantiate(cfg.model)), batch, datamodule.tokens_per_sample  # type: ignore[attr-defined]


def wants_dry_run(cfg: object) -> bool:
    """``osdp-plan``'s mode: ``dry_run=true|false``, or (default ``auto``) whenever the cluster's
    accelerator is a GPU this machine does not have."""
    choice = str(cfg.get("dry_run", "auto")).lower()  # type: ignore[attr-defined]
    if choice in ("true", "false"):
        return choice == "true"
    return cfg.cluster.accelerator == "gpu" and not torch.cuda.is_available()  # type: ignore[attr-defined]


def estimate_recipe_profile(cfg: object, cluster: ClusterSpec) -> tuple[ModelProfile, int]:
    """The dry-run profile of ``cfg.model`` on a batch of ``cfg.data`` for ``cluster``, and the
    tokens per sample. ``precision`` (default ``bf16-mixed`` on GPU clusters, else ``32-true``) and
    ``compute_efficiency`` are read from the top level of ``cfg`` when present."""
    from omegaconf import OmegaConf

    if not cluster.peak_flops_per_s:
        raise ValueError("a dry run needs the cluster config's peak_flops_per_s")
    factory, batch, tokens_per_sample = recipe_model_and_batch(cfg)
    default_precision = "bf16-mixed" if cfg.cluster.accelerator == "gpu" else "32-true"  # type: ignore[attr-defined]
    strategy = OmegaConf.to_container(cfg.strategy, resolve=True)  # type: ignore[attr-defined]
    units = {k: strategy[k] for k in ("unit_module_types", "unit_name_patterns", "min_unit_params")
             if strategy.get(k) is not None}
    profile = estimate_profile(
        factory, batch, peak_flops_per_s=cluster.peak_flops_per_s,
        compute_efficiency=float(cfg.get("compute_efficiency", DEFAULT_COMPUTE_EFFICIENCY)),  # type: ignore[attr-defined]
        precision=str(cfg.get("precision", default_precision)),  # type: ignore[attr-defined]
        split_factors=tuple(strategy.get("split_factors") or ()), **units)
    return profile, tokens_per_sample


def mark_dry_run(plan: Plan) -> Plan:
    """``plan`` with its source saying that its figures are estimates from a cluster description."""
    return plan if DRY_RUN_SOURCE in plan.source else dataclasses.replace(plan, source=f"{plan.source}; {DRY_RUN_SOURCE}")
