"""In-process tests of the core stages: budget parsing, registration, cost formulas, profiling
without a trace, unit selection, plan round trip and mismatch errors."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import math
import random
import re
import sys
import weakref
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from toy_models import MLP, TiedLM, TorchTransformer  # noqa: E402

import osdp_lightning  # noqa: E402
from osdp_lightning import (  # noqa: E402
    OSDPStrategy,
    Plan,
    PlanMismatchError,
    make_plan,
    parse_bytes,
)
from osdp_lightning.choices import choice_cost  # noqa: E402
from osdp_lightning.cost.cluster import ClusterSpec  # noqa: E402
from osdp_lightning.cost.cost import CostContext, all_reduce_s  # noqa: E402
from osdp_lightning.plan.choice_table import build_choice_table  # noqa: E402
from osdp_lightning.plan.measure import profile_lightning_module  # noqa: E402
from osdp_lightning.plan.plan import InfeasibleBudgetError, choices_text  # noqa: E402
from osdp_lightning.profiling import optim_state  # noqa: E402
from osdp_lightning.profiling.fakestep import (  # noqa: E402
    build_fake_module,
    fake_batch,
    fake_mode,
    peak_new_bytes,
    step_runner,
)
from osdp_lightning.profiling.forward_rise import forward_rises  # noqa: E402
from osdp_lightning.profiling.hook_cycles import multi_grad_hooks_released  # noqa: E402
from osdp_lightning.profiling.optim_state import optimizer_state_bytes_per_param, optimizer_step_bytes  # noqa: E402
from osdp_lightning.profiling.profile import _measure_step, _rescaled_to_free_steps, loss_runner  # noqa: E402
from osdp_lightning.profiling.records import ModelProfile, UnitProfile  # noqa: E402
from osdp_lightning.profiling.units import select_units  # noqa: E402

CLUSTER = ClusterSpec(world_size=2, memory_budget_bytes=2**40, collective_latency_s=1e-4,
                      bandwidth_bytes_per_s=1e9)


# -- budget ------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("8GiB", 8 * 2**30), ("512MB", 512 * 10**6), ("1.5G", int(1.5 * 2**30)), (4096, 4096), ("100", 100),
    (" 2 MiB ", 2 * 2**20)])
def test_parse_bytes_accepts_sizes(text, expected) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["-1GiB", "0", 0, -5, "eight gigs", "8 parsecs", "", True])
def test_parse_bytes_refuses_nonsense_with_a_clear_message(bad) -> None:
    with pytest.raises(ValueError, match="memory budget"):
        parse_bytes(bad)


def test_strategy_refuses_a_bad_budget_at_construction() -> None:
    with pytest.raises(ValueError, match="cannot read memory budget"):
        OSDPStrategy(memory_budget="lots")


# -- registration ------------------------------------------------------------------------------
def test_import_registers_osdp_once_and_cpu_is_allowed() -> None:
    from lightning.pytorch.strategies import FSDPStrategy, StrategyRegistry

    importlib.reload(osdp_lightning)  # importing twice is harmless
    assert StrategyRegistry.available_strategies().count("osdp") == 1
    assert "osdp" not in FSDPStrategy.get_registered_strategies()
    trainer = L.Trainer(strategy="osdp", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, OSDPStrategy)
    trainer = L.Trainer(strategy=OSDPStrategy(memory_budget="1GiB"), accelerator="cpu", devices=2, logger=False)
    assert trainer.strategy.memory_budget_bytes == 2**30


def test_plan_property_raises_before_setup() -> None:
    with pytest.raises(RuntimeError, match="only after setup"):
        _ = OSDPStrategy().plan


# -- cost formulas -----------------------------------------------------------------------------
def _profile(params: int = 1000, world_units: int = 1) -> ModelProfile:
    unit = UnitProfile("lin", ("lin",), params, 0, forward_s=0.01, backward_s=0.02, activation_bytes=100)
    root = UnitProfile("", ("",), 10, 0, forward_s=0.0, backward_s=0.0, activation_bytes=0)
    return ModelProfile(units=(unit, root), micro_batch_size=4, param_bytes_per_element=4,
                        grad_bytes_per_element=4, compute_bytes_per_element=4, reduce_bytes_per_element=4,
                        optimizer_bytes_per_param=8, activation_bytes=100)


def test_cost_formulas_by_hand() -> None:
    profile, p = _profile(), 1000
    unit = profile.units[0]
    rep, z2, z3 = (choice_cost(unit, c, CostContext(profile, CLUSTER)) for c in ("replicate", "zero2", "zero3"))
    # replicate (DDP's reducer): param + grad (bucket views) + Adam (2 states); the fresh gradient
    # before its copy into the bucket is transient (one tensor at a time: the largest, the whole
    # unit when the profile does not know it), nothing is prefetched; one all-reduce of the grads
    assert rep.state_bytes == p * (4 + 4 + 8) and rep.transient_bytes == 4 * p and rep.prefetch_bytes == 0
    known = dataclasses.replace(unit, largest_tensor_count=600)
    assert choice_cost(known, "replicate", CostContext(profile, CLUSTER)).transient_bytes == 4 * 600
    # measured: a layer's weight gradient beside its input's gradient; the part above the largest
    # gradient grows with the micro-batch (2x here)
    layer = dataclasses.replace(known, leaf_backward_rise_bytes=4 * 600 + 1000)
    assert choice_cost(layer, "replicate", CostContext(profile, CLUSTER)).transient_bytes == 4 * 600 + 1000
    assert choice_cost(layer, "replicate", CostContext(profile, CLUSTER, 2.0)).transient_bytes == 4 * 600 + 2000
    assert math.isclose(rep.comm_s, 1e-4 + 2 * 4 * p * (1 / 2) / 1e9)
    assert math.isclose(rep.comm_s, all_reduce_s(4 * p, 2, CLUSTER))
    # zero2: state / W, gathered params held forward->backward; all-gather + reduce-scatter
    assert z2.state_bytes == p * 16 // 2 and z2.held_bytes == 4 * p
    assert math.isclose(z2.comm_s, 2 * (1e-4 + 4 * p / 2 / 1e9))
    # zero3: nothing held, params + grads transient; two all-gathers + reduce-scatter
    assert z3.state_bytes == z2.state_bytes and z3.held_bytes == 0 and z3.transient_bytes == 8 * p
    assert z3.prefetch_bytes == 4 * p  # a prefetched neighbour holds parameters, not gradients
    assert math.isclose(z3.comm_s, 3 * (1e-4 + 4 * p / 2 / 1e9))
    assert rep.compute_s == z3.compute_s == pytest.approx(0.03)


def test_a_checkpointed_forward_climbs_above_its_input_at_the_end_of_its_forward() -> None:
    """A unit saves 100 bytes for backward; saving nothing, its forward holds at most 60 of its own
    at once, its 8-byte input included. Not checkpointed it keeps more than that: its end of
    forward is its gathered parameters as before. Checkpointed it keeps its input and climbs 52
    above it while its parameters are gathered (twice that at twice the micro-batch); not
    measured, nothing is added."""
    profile, p = _profile(), 1000
    unit = dataclasses.replace(profile.units[0], input_bytes=8, forward_rise_bytes=52)
    ctx = CostContext(profile, CLUSTER)
    assert choice_cost(unit, "zero2", ctx).forward_end_bytes == 4 * p  # the all-gather's output
    assert choice_cost(unit, "zero3", ctx).forward_end_bytes == 8 * p  # and the unsharded parameters
    assert choice_cost(unit, "zero2+ckpt", ctx).forward_end_bytes == 4 * p + 52
    assert choice_cost(unit, "zero3+ckpt", CostContext(profile, CLUSTER, 2.0)).forward_end_bytes == 8 * p + 104
    assert choice_cost(unit, "replicate+ckpt", ctx).forward_end_bytes == 52
    unmeasured = dataclasses.replace(unit, forward_rise_bytes=None)
    assert choice_cost(unmeasured, "zero2+ckpt", ctx).forward_end_bytes == 4 * p


def test_one_rank_offers_only_replicate() -> None:
    table = build_choice_table(_profile(), ClusterSpec(1, 2**30, 0.0, 1e9))
    assert all([c.choice for c in u.choices] == ["replicate"] for u in table.units)
    assert all(c.comm_s == 0 for u in table.units for c in u.choices)


def test_optimizer_state_is_read_from_the_optimizer() -> None:
    p = [nn.Parameter(torch.zeros(3))]
    assert optimizer_state_bytes_per_param(torch.optim.AdamW(p), torch.float32) == 8
    assert optimizer_state_bytes_per_param(torch.optim.SGD(p, lr=0.1, momentum=0.9), torch.float32) == 4
    assert optimizer_state_bytes_per_param(torch.optim.SGD(p, lr=0.1), torch.float32) == 0


@pytest.mark.parametrize("foreach", [False, True])
def test_the_optimizer_steps_own_bytes_are_measured_on_scaled_stand_ins(foreach: bool,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe's stand-ins, 16x smaller than the parameters, price the real step's temporaries: torch's
    per-tensor AdamW holds two of a tensor's size beside the previous one's (matrices of one group
    follow each other: three 64 KiB matrices), the foreach path about the whole group."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(128, 128)) for _ in range(3)] + [nn.Parameter(torch.randn(128))]
    groups = [{"params": params[:3], "weight_decay": 0.1}, {"params": params[3:], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=1e-3, foreach=foreach)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()  # the state
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    real = peak_new_bytes(optimizer.step, [*params, *(p.grad for p in params), *state])
    monkeypatch.setattr(optim_state, "PROBE_BYTES", 2**14)  # about a sixteenth of the parameters
    probed = optimizer_step_bytes(optimizer, torch.device("cpu"))
    assert real >= (3 if not foreach else 1) * 128 * 128 * 4 * 0.99
    assert probed == pytest.approx(real, rel=0.02)
    assert optimizer_step_bytes(torch.optim.LBFGS(params), torch.device("cpu")) == 0  # its step needs a closure


def test_the_optimizer_probe_allocates_less_than_the_parameters() -> None:
    """Setup stays inside the budget: a model under the probe's size is stepped on smaller stand-ins,
    not on a copy of itself (whose gradients, Adam state and temporaries would be 5-6 times it)."""
    params = [nn.Parameter(torch.randn(256, 256)) for _ in range(4)]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    probed = peak_new_bytes(lambda: optimizer_step_bytes(optimizer, torch.device("cpu")), params)
    assert 0 < probed < sum(p.numel() * p.element_size() for p in params)


# -- units and profiling -----------------------------------------------------------------------
class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.drop, self.down = nn.Linear(64, 512), nn.Dropout(0.0), nn.Linear(512, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.relu(self.up(x))))


class _Blocks(MLP):
    def __init__(self) -> None:
        super().__init__(width=64, depth=1)
        self.net = nn.Sequential(_Block(), _Block(), nn.Linear(64, 1))


def test_the_profile_measures_a_layers_backward_and_a_forward_that_saves_nothing() -> None:
    """The most one layer with parameters adds in its backward: ``down``'s weight gradient (128 KiB)
    beside the gradient of its 32 x 512 input (64 KiB), not what the dropout after it spans in the
    tracker (it owns no parameters and passes its input through: 250 KiB here). With nothing saved
    for backward (a checkpointed forward) the block still holds ``up``'s 32 x 512 output beside
    the ReLU's: its forward rise. Saving, it keeps less than that (the ReLU keeps its output, not
    its input): a forward climbs above what it keeps, checkpointed or not."""
    torch.manual_seed(0)
    model = _Blocks()
    profile = profile_lightning_module(model, (torch.randn(32, 64), torch.randn(32, 1)),
                                       optimizer=torch.optim.Adam(model.parameters()), repeats=1,
                                       unit_module_types=[_Block])
    block = next(u for u in profile.units if u.name == "net.0")
    weight, inputs = 512 * 64 * 4, 32 * 512 * 4
    assert weight + inputs <= block.leaf_backward_rise_bytes <= 1.05 * (weight + inputs)
    assert block.backward_rise_bytes > block.leaf_backward_rise_bytes
    rows = 32 * 64 * 4  # the block's input, output and residual sum
    assert 2 * inputs <= block.forward_rise_bytes <= 2 * inputs + 2 * rows
    assert block.activation_bytes == inputs + rows < block.forward_rise_bytes
    assert profile.units[-1].forward_rise_bytes is None  # the root's forward is the whole step

def test_a_forward_rise_is_the_same_on_fake_tensors() -> None:
    """The forward rise counts storages as a dispatch mode sees them made and freed: on fake tensors
    (the fake step of a dry run or of a profile from shapes) it is what the real forward gives."""
    torch.manual_seed(0)
    model = _Blocks()
    batch = (torch.randn(32, 64), torch.randn(32, 1))
    specs = select_units(model, [_Block])
    real = forward_rises(model, specs, loss_runner(model, batch, contextlib.nullcontext))
    mode = fake_mode()
    fake = build_fake_module(model, mode)
    with mode:
        faked = forward_rises(fake, specs, step_runner(fake, fake_batch(batch, mode)))
    assert faked == real and set(real) == {"net.0", "net.1"} and real["net.0"] >= 2 * 32 * 512 * 4


def test_unit_times_are_scaled_to_the_step_timed_without_a_clock_per_unit() -> None:
    """On CUDA the profile's clock synchronizes at every unit boundary, which the step in training
    does not: unit times are scaled so that they add up to a step timed with no hooks. A sample
    1000x slower than the step comes back scaled by one factor for every unit and phase; one
    faster than the step is left as it is (only what the clock added is taken out)."""
    torch.manual_seed(0)
    model = _Blocks()
    run_loss = loss_runner(model, (torch.randn(32, 64), torch.randn(32, 1)), contextlib.nullcontext)
    cpu = torch.device("cpu")
    sample = _measure_step(model, select_units(model, [_Block]), run_loss, cpu)
    model.zero_grad(set_to_none=True)
    slow = dataclasses.replace(sample, forward_s={k: 1000 * v for k, v in sample.forward_s.items()},
                               backward_s={k: 1000 * v for k, v in sample.backward_s.items()},
                               step_s=1000 * sample.step_s)
    (scaled,) = _rescaled_to_free_steps([slow], model, run_loss, cpu, repeats=3)
    ratio = scaled.step_s / slow.step_s
    assert ratio < 0.1
    for phase in ("forward_s", "backward_s"):
        before, after = getattr(slow, phase), getattr(scaled, phase)
        assert after.keys() == before.keys() and len(after) >= 3
        assert all(after[k] == pytest.approx(ratio * before[k]) for k in before)
    fast = dataclasses.replace(sample, step_s=sample.step_s / 1000)
    assert _rescaled_to_free_steps([fast], model, run_loss, cpu, repeats=1) == [fast]
    assert all(p.grad is None for p in model.parameters())


def test_tied_modules_form_one_unit_and_small_modules_stay_with_the_root() -> None:
    names = [s.name for s in select_units(TiedLM())]
    assert "embed+head" in names
    assert not any("norm" in n for n in names)  # 2*64 parameters: below the unit threshold


def test_unit_patterns_that_match_nothing_are_refused() -> None:
    with pytest.raises(ValueError, match="match no module"):
        select_units(MLP(), unit_name_patterns=["decoder.*"])


def test_profiling_leaves_no_trace() -> None:
    model = TorchTransformer()
    batch = next(iter(model.train_dataloader()))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(3)
    random.seed(3)
    expected_draw = (torch.rand(3), random.random())
    torch.manual_seed(3)
    random.seed(3)
    profile = profile_lightning_module(model, batch, optimizer=model.configure_optimizers())
    assert (torch.rand(3), random.random())[1] == expected_draw[1]
    torch.manual_seed(3)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert "log" not in vars(model)  # self.log patched only while profiling
    # execution order, root last; blocks are units, MHA (whose out_proj forward never runs) one part
    names = [u.name for u in profile.units]
    assert names == ["embed", "encoder.layers.0", "encoder.layers.1", ""]
    parts = [p.name for p in profile.units[1].parts]
    assert "encoder.layers.0.self_attn" in parts and "encoder.layers.0.self_attn.out_proj" not in parts
    assert profile.optimizer_bytes_per_param == 8 and profile.micro_batch_size == 8
    assert sum(u.param_count for u in profile.units) == sum(p.numel() for p in model.parameters())
    block = model.get_submodule("encoder.layers.0")
    assert profile.units[1].largest_tensor_count == max(p.numel() for p in block.parameters())
    assert all(u.forward_s >= 0 and u.backward_s >= 0 for u in profile.units)
    assert profile.activation_bytes > 0


def test_a_whole_profile_keeps_no_parameter_alive() -> None:
    """Once the module lets go of its parameters (as FSDP2 does when it shards them), nothing the
    whole profile ran still holds them: torch's module tracker would, for the rest of the process,
    without :func:`~osdp_lightning.profiling.hook_cycles.multi_grad_hooks_released`."""
    model = TorchTransformer()
    batch = next(iter(model.train_dataloader()))
    profile_lightning_module(model, batch, optimizer=model.configure_optimizers())
    held = [weakref.ref(p) for p in model.parameters()]
    for module in model.modules():
        module._parameters.update({name: nn.Parameter(p.detach().clone())
                                   for name, p in module._parameters.items() if p is not None})
    gc.collect()
    assert [tuple(ref().shape) for ref in held if ref() is not None] == []


def test_releasing_the_trackers_hooks_leaves_the_users_own() -> None:
    from torch.distributed._tools.mod_tracker import ModTracker

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.randn(4, 8, requires_grad=True)
    seen: list[torch.Tensor] = []
    x.register_hook(seen.append)
    with ModTracker(), multi_grad_hooks_released():
        model(x).sum().backward()
    assert len(seen) == 1 and list(x._backward_hooks.values()) == [seen.append]


def test_profiling_draws_no_random_numbers() -> None:
    model = MLP()
    batch = next(iter(model.train_dataloader()))
    torch.manual_seed(11)
    expected = torch.rand(4)
    torch.manual_seed(11)
    profile_lightning_module(model, batch)
    assert torch.equal(torch.rand(4), expected)


def test_model_without_trainable_parameters_is_refused() -> None:
    model = MLP().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        profile_lightning_module(model, next(iter(model.train_dataloader())))


# -- plans -------------------------------------------------------------------------------------
def _mlp_plan(budget: int = 2**40) -> tuple[MLP, Plan]:
    model = MLP()
    profile = profile_lightning_module(model, next(iter(model.train_dataloader())),
                                       optimizer=model.configure_optimizers())
    cluster = ClusterSpec(2, budget, 1e-4, 1e9)
    return model, make_plan(profile, cluster)


def test_plan_round_trips_through_json(tmp_path: Path) -> None:
    model, plan = _mlp_plan()
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded.units == plan.units and loaded.predicted_peak_bytes == plan.predicted_peak_bytes
    assert loaded.source.startswith("loaded:")
    table = plan.format_table()
    assert "net.0" in table and "predicted peak per rank" in table and "solver: Optimal" in table
    assert f"choices: {plan.choices_text()}" in table
    loaded.check_matches(model, 2)


def test_choice_counts_read_most_common_first() -> None:
    assert choices_text(["zero3", "replicate", "zero2", "zero3", "replicate", "zero2+ckpt", "zero3"]) == (
        "zero3 x3, replicate x2, zero2 x1, zero2+ckpt x1")


def test_plan_for_another_model_or_world_size_says_what_differs(tmp_path: Path) -> None:
    _, plan = _mlp_plan()
    with pytest.raises(PlanMismatchError, match="world size: plan 2, run 4"):
        plan.check_matches(MLP(), 4)
    with pytest.raises(PlanMismatchError, match="parameters"):
        plan.check_matches(MLP(width=128), 2)
    with pytest.raises(PlanMismatchError, match="does not have"):
        plan.check_matches(TiedLM(), 2)


def test_corrupt_or_unknown_plans_are_refused(tmp_path: Path) -> None:
    _, plan = _mlp_plan()
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a valid osdp plan"):
        Plan.load(tmp_path / "bad.json")
    plan.save(tmp_path / "p.json")
    text = (tmp_path / "p.json").read_text().replace('"replicate"', '"zero9"')
    (tmp_path / "p.json").write_text(text)
    with pytest.raises(ValueError, match="unknown choices"):
        Plan.load(tmp_path / "p.json")


def test_infeasible_budget_names_the_smallest_that_fits() -> None:
    _, loose = _mlp_plan()
    with pytest.raises(InfeasibleBudgetError, match=r"smallest budget that fits is .* \((\d+) bytes") as err:
        _mlp_plan(budget=loose.predicted_peak_bytes // 4)
    smallest = int(re.search(r"\((\d+) bytes", str(err.value)).group(1))
    _, fits = _mlp_plan(budget=smallest)
    assert fits.predicted_peak_bytes <= smallest
