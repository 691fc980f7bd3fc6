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

import contextlib
import copy
import dataclasses
import time
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from osdp_lightning.cost import BASE_CHOICES, ClusterSpec, group_choices_for, split_choices_for
from osdp_lightning.plan import Plan, make_plan
from osdp_lightning.profile import (
    ModelProfile,
    UnitProfile,
    _logging_disabled,
    _loss_runner,
    _tensor_bytes,
    batch_size_of,
    optimizer_state_bytes_per_param,
    preserved_rng,
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
MIXED_PRECISION_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}

ModelSource = nn.Module | Callable[[], nn.Module]
"""A module (copied without its data, never touched), or a function that builds one (called on the
meta device, so nothing is allocated)."""

_aten = torch.ops.aten
# NOTE: the fused CPU attention kernel has no FLOP formula in torch; it does what flash attention does.
_CPU_SDPA_FLOPS = {
    _aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v),
    _aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda grad, q, k, v, *args, out_shape=None, **kwargs: sdpa_backward_flop_count(grad, q, k, v),
}


# ---------------------------------------------------------------------------------------------
# Fake model and batch
# ---------------------------------------------------------------------------------------------
def fake_mode() -> FakeTensorMode:
    # NOTE: real inputs (a real batch, index tensors made at init) are accepted as constants.
    return FakeTensorMode(allow_non_fake_inputs=True)


def build_fake_module(model: ModelSource, mode: FakeTensorMode) -> nn.Module:
    """``model`` with fake parameters and buffers: built (or copied) on the meta device, then given
    fake storage.

    NOTE: not built under FakeTensorMode directly: modules that deep-copy fake tensors
    (nn.TransformerEncoder clones its layer) get views that do not share their base's fake storage,
    and every byte count that dedupes storages would count them twice.
    """
    module = build_meta_module(model)
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for owner in module.modules():
        for name, param in owner._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((owner, name))
    with mode:
        module.to_empty(device="cpu")
    # NOTE: to_empty gives each holder of a tied parameter its own new one (meta and fake tensors
    # cannot share a set_data); tie them again.
    for (first, first_name), *others in holders.values():
        for owner, name in others:
            setattr(owner, name, getattr(first, first_name))
    return module


def build_meta_module(model: ModelSource) -> nn.Module:
    """``model`` on the meta device (shapes only; FSDP2 can shard it, ``to_empty`` fills it).

    A factory runs under ``torch.device("meta")``; a module is copied with meta tensors in place of
    its parameters and buffers (its data is never copied, the caller's module is left as it is).
    """
    if not isinstance(model, nn.Module):
        with torch.device("meta"):
            return model()
    memo: dict[int, torch.Tensor] = {
        id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for p in model.parameters()}
    memo.update({id(b): torch.empty_like(b, device="meta") for b in model.buffers()})
    return copy.deepcopy(model, memo)


def fake_batch(batch: object, mode: FakeTensorMode) -> object:
    """``batch`` with every tensor fake; meta tensors stand for shapes (values are never read)."""
    def convert(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "meta":
            with mode:
                return torch.zeros(t.shape, dtype=t.dtype)
        return mode.from_tensor(t)
    return tree_map_only(torch.Tensor, convert, batch)


def step_runner(module: nn.Module, batch: object, precision: str = "32-true") -> Callable[[], torch.Tensor]:
    """A function computing the training loss: ``training_step(batch, 0)`` or the summed outputs."""
    autocast = MIXED_PRECISION_DTYPES.get(precision)

    def context() -> contextlib.AbstractContextManager:
        return torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext()

    if hasattr(module, "training_step"):
        return _loss_runner(module, batch, context)

    def run_forward() -> torch.Tensor:
        with context():
            out = module(*batch) if isinstance(batch, tuple) else module(batch)
        return sum(t.float().sum() for t in _flat_tensors(out))
    return run_forward


def _flat_tensors(obj: object) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    tree_map_only(torch.Tensor, found.append, obj)
    return found


# ---------------------------------------------------------------------------------------------
# One fake step: unit order, saved bytes, FLOPs
# ---------------------------------------------------------------------------------------------
def _storage_of(t: torch.Tensor) -> torch.UntypedStorage:
    # NOTE: a view is keyed by its base: a fake view's storage object is not always its base's.
    return (t._base if t._base is not None else t).untyped_storage()


def _storage_key(t: torch.Tensor) -> int:
    # NOTE: fake tensors have no data pointer (0 for all); the storage object's identity tells them apart.
    return _storage_of(t)._cdata


class _FakeStepRecorder:
    """Unit execution order, saved-for-backward bytes per unit, and each Linear unit's output size."""

    def __init__(self, root: nn.Module, specs: Sequence[UnitSpec]) -> None:
        self.root, self.specs = root, specs
        self.order: list[str] = []
        self.saved_bytes: dict[str, int] = {s.name: 0 for s in specs} | {ROOT: 0}
        self.output_numel: dict[str, int] = {}
        self._stack: list[str] = []
        self._seen: set[int] = set()
        self._param_keys = {_storage_key(p) for p in root.parameters()}
        self._handles: list = []

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        for spec in self.specs:
            for mod_name in spec.module_names:
                mod = self.root.get_submodule(mod_name)
                self._handles.append(mod.register_forward_pre_hook(self._pre(spec.name)))
                self._handles.append(mod.register_forward_hook(self._post(spec.name)))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield
        finally:
            for handle in self._handles:
                handle.remove()

    def _pre(self, name: str) -> Callable:
        def hook(_mod: nn.Module, _args: object) -> None:
            if name not in self.order:
                self.order.append(name)
            self._stack.append(name)
        return hook

    def _post(self, name: str) -> Callable:
        def hook(_mod: nn.Module, _args: object, out: object) -> None:
            self._stack.pop()
            if isinstance(out, torch.Tensor):
                self.output_numel[name] = self.output_numel.get(name, 0) + out.numel()
        return hook

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in self._param_keys and key not in self._seen:
            self._seen.add(key)
            self.saved_bytes[self._stack[-1] if self._stack else ROOT] += _storage_of(tensor).nbytes()
        return tensor


def _unit_flops(root: nn.Module, specs: Sequence[UnitSpec], counts: dict[str, dict]) -> dict[str, int]:
    """FLOPs each unit's own modules ran (root: everything else) from FlopCounterMode's counts.

    FlopCounterMode counts a module's whole subtree under ``<root>.<qualified name>`` (see
    :func:`_name_modules_for`); a module's own FLOPs are its count minus its children's, and go to
    the innermost unit holding it.
    """
    prefix = _FLOP_ROOT
    inclusive = {name[len(prefix) + 1:]: sum(ops.values()) for name, ops in counts.items()
                 if name.startswith(prefix + ".")}
    owner: dict[str, str] = {}
    for spec in sorted(specs, key=lambda s: min(n.count(".") for n in s.module_names)):  # inner units last
        for mod_name in spec.module_names:
            for sub_name, _ in root.get_submodule(mod_name).named_modules(prefix=mod_name):
                owner[sub_name] = spec.name
    flops = {s.name: 0 for s in specs}
    for name, module in root.named_modules():
        if name in owner:
            children = sum(inclusive.get(f"{name}.{child}", 0) for child, _ in module.named_children())
            flops[owner[name]] += max(inclusive.get(name, 0) - children, 0)
    total = sum(counts.get("Global", {}).values())
    flops[ROOT] = max(total - sum(flops.values()), 0)
    return flops


_FLOP_ROOT = "<root>"


def _name_modules_for(counter: FlopCounterMode, root: nn.Module) -> None:
    """Make FlopCounterMode name every module ``<root>.<qualified name>``.

    NOTE: its module tracker names the first module it sees after its class and that module's
    children after it, so a LightningModule whose ``training_step`` calls ``self.net`` would be
    counted as ``GPT.h.0...`` and two top-level modules of one class would share a name.
    """
    known = getattr(getattr(counter, "mod_tracker", None), "_known_modules", None)
    if known is None:
        raise RuntimeError("this torch's FlopCounterMode has no module tracker: per-unit FLOPs are unavailable")
    for name, module in root.named_modules():
        known[module] = f"{_FLOP_ROOT}.{name}" if name else _FLOP_ROOT


@dataclasses.dataclass(frozen=True)
class _FakeStep:
    order: list[str]
    saved_bytes: dict[str, int]
    output_numel: dict[str, int]
    forward_flops: dict[str, int]
    backward_flops: dict[str, int]


def _run_fake_step(module: nn.Module, specs: Sequence[UnitSpec], run_loss: Callable[[], torch.Tensor]) -> _FakeStep:
    recorder = _FakeStepRecorder(module, specs)
    with preserved_rng(), _logging_disabled(module), recorder.installed():
        with FlopCounterMode(display=False, custom_mapping=_CPU_SDPA_FLOPS) as counter:
            _name_modules_for(counter, module)
            loss = run_loss()
            forward_counts = counter.get_flop_counts()
            loss.backward()
            total_counts = counter.get_flop_counts()
    forward = _unit_flops(module, specs, forward_counts)
    total = _unit_flops(module, specs, total_counts)
    backward = {name: max(total[name] - forward[name], 0) for name in total}
    return _FakeStep(recorder.order, recorder.saved_bytes, recorder.output_numel, forward, backward)


class _LiveBytes(TorchDispatchMode):
    """Bytes of the tensors a step creates, apart from parameter gradients once accumulated, at the
    moment the step's memory (those bytes plus the gradients) peaks.

    The quantity :func:`osdp_lightning.profile.measure_activation_peak` reads from MemTracker's
    peak snapshot (activations, temporaries, inputs), without MemTracker's per-module snapshots,
    which take tens of seconds on a 1.5B-parameter model.
    """

    def __init__(self, existing: set[int]) -> None:
        super().__init__()
        self.existing = existing
        """Storage keys that are not the step's (parameters, buffers: views of them cost nothing)."""
        self.live: dict[int, int] = {}
        self.current = self.grads = self.peak_total = self.at_peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for tensor in _flat_tensors(out):
            storage = _storage_of(tensor)
            key = storage._cdata
            if key not in self.live and key not in self.existing:
                self.live[key] = storage.nbytes()
                self.current += self.live[key]
                weakref.finalize(storage, self.forget, key)
        self._update_peak()
        return out

    def forget(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def mark_gradient(self, key: int) -> None:
        """A parameter's gradient: counted in the total from now on, no longer as the step's own."""
        nbytes = self.live.pop(key, 0)
        self.current -= nbytes
        self.grads += nbytes
        self.existing.add(key)
        self._update_peak()

    def _update_peak(self) -> None:
        if self.current + self.grads >= self.peak_total:
            self.peak_total, self.at_peak = self.current + self.grads, self.current


def _activation_peak(module: nn.Module, run_loss: Callable[[], torch.Tensor]) -> int:
    """Bytes of one fake forward+backward that are neither parameters nor gradients at the step's
    peak, less the largest gradient (the one in flight), as the measured profile counts them."""
    tracker = _LiveBytes({_storage_key(t) for t in [*module.parameters(), *module.buffers()]})
    params = [p for p in module.parameters() if p.requires_grad]
    handles = [p.register_post_accumulate_grad_hook(lambda p: tracker.mark_gradient(_storage_key(p.grad)))
               for p in params]
    try:
        with preserved_rng(), _logging_disabled(module), tracker:
            run_loss().backward()
    finally:
        for handle in handles:
            handle.remove()
    module.zero_grad(set_to_none=True)
    largest_grad = max((p.numel() * p.element_size() for p in params), default=0)
    return max(tracker.at_peak - largest_grad, 0)


def _activation_bytes(module: nn.Module, specs: Sequence[UnitSpec], run_loss: Callable[[], torch.Tensor]) -> int:
    """What the measured profile calls activation bytes: those saved for backward, or the peak of
    activations and backward temporaries if that is larger."""
    recorder = _FakeStepRecorder(module, specs)
    with preserved_rng(), _logging_disabled(module), recorder.installed():
        run_loss()
    return max(sum(recorder.saved_bytes.values()), _activation_peak(module, run_loss))


def _doubled_batch(batch: object, micro_batch: int) -> object:
    """``batch`` with twice the samples (tensors whose first dimension is the micro-batch size)."""
    def double(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t]) if t.dim() > 0 and t.shape[0] == micro_batch else t
    return tree_map_only(torch.Tensor, double, batch)


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
        step = _run_fake_step(module, specs, run_loss)
        module.zero_grad(set_to_none=True)
        single = max(sum(step.saved_bytes.values()), _activation_peak(module, run_loss))
        doubled = _activation_bytes(module, specs, step_runner(module, _doubled_batch(inputs, micro_batch), precision))
    # NOTE: the cost model scales activations with the micro-batch. Bytes that do not grow with it
    # (autocast's low-precision weight copies, position embeddings) are fixed bytes instead.
    per_batch_bytes = min(max(doubled - single, 0), single)
    seconds_per_flop = 1.0 / (peak_flops_per_s * compute_efficiency)
    elem = trainable[0].element_size()
    units = _unit_profiles(module, specs, step, seconds_per_flop, elem, tuple(split_factors))
    if optimizer_bytes_per_param is None:
        optimizer_bytes_per_param = _optimizer_bytes_per_param(module, trainable[0].dtype)
    return ModelProfile(
        units=units, micro_batch_size=micro_batch, param_bytes_per_element=elem,
        grad_bytes_per_element=elem, compute_bytes_per_element=elem, reduce_bytes_per_element=elem,
        optimizer_bytes_per_param=optimizer_bytes_per_param, activation_bytes=per_batch_bytes,
        fixed_bytes=_tensor_bytes(batch) + single - per_batch_bytes,
        step_s=(sum(step.forward_flops.values()) + sum(step.backward_flops.values())) * seconds_per_flop,
        profile_s=time.perf_counter() - start)


def _unit_profiles(module: nn.Module, specs: Sequence[UnitSpec], step: _FakeStep, seconds_per_flop: float,
                   elem: int, split_factors: tuple[int, ...]) -> tuple[UnitProfile, ...]:
    """Units in execution order (never-called units go to the root, as in the measured profile)."""
    by_name = {s.name: s for s in specs}
    called = [by_name[name] for name in step.order if name in by_name]
    owned = owned_params(module, called)
    units = []
    for spec in [*called, UnitSpec(ROOT, (ROOT,))]:
        params = owned[spec.name]
        linear = module.get_submodule(spec.module_names[0]) if len(spec.module_names) == 1 and spec.name else None
        shape = (linear.out_features, linear.in_features) if type(linear) is nn.Linear else None
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
        units.append(UnitProfile(
            name=spec.name, module_names=spec.module_names,
            param_count=sum(p.numel() for p in params if p.requires_grad),
            frozen_param_count=sum(p.numel() for p in params if not p.requires_grad),
            forward_s=flops[0] * seconds_per_flop, backward_s=flops[1] * seconds_per_flop,
            activation_bytes=saved, linear_shape=shape, split_overhead_s=overheads))
    return tuple(units)


def _split_overhead_s(k: int, output_bytes: int, seconds_per_flop: float) -> float:
    """Extra seconds of a Linear cut into ``k`` slices: ``k - 1`` more kernels in each of the three
    passes, and summing ``k`` partial outputs (memory-bound: two reads and a write per element)."""
    seconds_per_byte = seconds_per_flop * PEAK_FLOPS_PER_MEMORY_BYTE
    return (k - 1) * (3 * KERNEL_LAUNCH_S + 3 * output_bytes * seconds_per_byte)


def _optimizer_bytes_per_param(module: nn.Module, dtype: torch.dtype) -> int:
    """State bytes per parameter of the optimizer ``configure_optimizers`` builds (Adam if none)."""
    optimizer = None
    if hasattr(module, "configure_optimizers"):
        optimizer = _first_optimizer(module.configure_optimizers())
    if optimizer is None:
        return 2 * torch.empty((), dtype=dtype).element_size()
    return optimizer_state_bytes_per_param(optimizer, dtype)


def _first_optimizer(configured: object) -> torch.optim.Optimizer | None:
    if isinstance(configured, torch.optim.Optimizer) or configured is None:
        return configured
    if isinstance(configured, dict):
        return _first_optimizer(configured.get("optimizer"))
    if isinstance(configured, (list, tuple)) and configured:
        return _first_optimizer(configured[0])
    return None


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------
DRY_RUN_SOURCE = "dry-run estimate from a cluster description (nothing measured)"


def dry_run_plan(model: ModelSource, batch: object, cluster: ClusterSpec, *,
                 micro_batch_sizes: Sequence[int] | None = None, uniform_choice: str | None = None,
                 split_factors: Sequence[int] = (2, 4, 8), group_sizes: Sequence[int] | None = None,
                 compute_efficiency: float = DEFAULT_COMPUTE_EFFICIENCY, precision: str = "32-true",
                 profile: ModelProfile | None = None, time_limit_s: float | None = None,
                 **unit_options: object) -> Plan:
    """Solve the plan of ``model`` for ``cluster`` from an estimated profile (no GPU, no process group).

    Choices: replicate / zero2 / zero3, ``split`` by ``split_factors``, and on several nodes
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
    choices = (BASE_CHOICES + split_choices_for(tuple(split_factors))
               + group_choices_for(cluster, tuple(group_sizes) if group_sizes is not None else None))
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
        "  communication = latency + bytes / bandwidth of the cluster's intra- and inter-node links.",
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
