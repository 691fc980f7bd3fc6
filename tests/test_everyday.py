"""Everyday Lightning under a mixed plan: gradient clipping and accumulation equal DDP's,
bad input gets Lightning's own answer, the profiling flag."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn

from osdp_lightning.choices import choice_cost
from osdp_lightning.cost.cluster import ClusterSpec
from osdp_lightning.cost.cost import CostContext
from osdp_lightning.plan.plan import InfeasibleBudgetError, make_plan
from osdp_lightning.profiling.profile import _profiling
from osdp_lightning.profiling.records import ModelProfile, UnitProfile
from osdp_lightning.runtime.accumulate import check_accumulation
from osdp_lightning.runtime.clip import clip_grad_norm_, total_grad_norm, with_sharded_clipping

P = 100_000
UNITS = tuple(UnitProfile(f"b{i}", (f"b{i}",), P, 0, forward_s=0.01, backward_s=0.02, activation_bytes=1_000)
              for i in range(4)) + (UnitProfile("", ("",), 100, 0, 0.001, 0.001, 100),)
PROFILE = ModelProfile(UNITS, micro_batch_size=4, param_bytes_per_element=4, grad_bytes_per_element=4,
                       compute_bytes_per_element=4, reduce_bytes_per_element=4, optimizer_bytes_per_param=8,
                       activation_bytes=5_000)
CLUSTER = ClusterSpec(world_size=2, memory_budget_bytes=2**30, collective_latency_s=1e-4, bandwidth_bytes_per_s=1e8)

REL_TOL = 1e-4
# Every kind of mesh at once: plain replicated tensors, a split Linear (a sharded and a replicated
# slice), hsdp on a (W/g, g) mesh, zero3 on the shard mesh (the unit left out), a zero2 root.
MIXED = "net.0=replicate;net.2=split(k=2, sharded=1);net.4=hsdp(g=1);<root>=zero2"


def _close(reference: list[float], candidate: list[float]) -> None:
    assert len(reference) == len(candidate) > 0
    for a, b in zip(reference, candidate, strict=True):
        assert abs(a - b) <= REL_TOL * max(abs(a), 1e-8), (reference, candidate)


def _assert_same_run(reference: list[dict], candidate: list[dict]) -> None:
    for ref, got in zip(reference, candidate, strict=True):
        _close(ref["losses"], got["losses"])
        _close(ref["grad_norms"], got["grad_norms"])


def _grads(seed: int) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.zeros(n)) for n in (7, 130, 1)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    return params


def test_clipping_of_plain_tensors_equals_torch() -> None:
    ours, theirs = _grads(0), _grads(0)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 0.5)
    got = clip_grad_norm_(ours, 0.5)
    assert torch.allclose(got, expected)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.allclose(a.grad, b.grad)
    assert torch.allclose(total_grad_norm(_grads(1), float("inf")),
                          max(p.grad.abs().max() for p in _grads(1)))


@pytest.mark.parametrize("clip_val", [0, 0.0, -1.0])
def test_clip_values_that_lightning_ignores_leave_gradients_alone(clip_val: float) -> None:
    """Lightning turns clipping off for gradient_clip_val <= 0 (no error); so do we, on any mesh."""
    params = _grads(2)
    before = [p.grad.clone() for p in params]
    plugin = with_sharded_clipping(Precision())
    optimizer = torch.optim.SGD(params, lr=0.1)
    plugin.clip_gradients(optimizer, clip_val, GradClipAlgorithmType.NORM)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, params, strict=True))
    assert isinstance(plugin, Precision) and type(plugin).__name__ == "ShardedPrecision"


def test_a_clip_value_that_is_not_a_number_gets_lightnings_error() -> None:
    import lightning as L

    with pytest.raises(TypeError, match="gradient_clip_val"):
        L.Trainer(strategy="osdp", accelerator="cpu", devices=1, gradient_clip_val="0.5")


@pytest.mark.multiprocess
def test_gradient_clipping_by_norm_and_value_equals_ddp_under_a_mixed_plan(train) -> None:
    # clip 0.01: the gradient norm of this MLP is about 1, so clipping binds at every step
    for algorithm in ("norm", "value"):
        args = ("--model", "mlp", "--clip", "0.01", "--clip-algorithm", algorithm)
        ddp = train(f"ddp-{algorithm}", *args, "--strategy", "ddp")
        osdp = train(f"mixed-{algorithm}", *args, "--choices", MIXED)
        _assert_same_run(ddp, osdp)
        assert all(norm > 0.01 for norm in osdp[0]["grad_norms"]), osdp[0]["grad_norms"]
        assert len({u["choice"] for u in osdp[0]["plan"]["units"]}) == 5
        # the hand-made plan profiled training_step before fit: flagged, and never a real step
        assert osdp[0]["step_calls"]["real"] == ddp[0]["step_calls"]["real"] == 6
        assert osdp[0]["step_calls"]["profiling"] > 0 == ddp[0]["step_calls"]["profiling"]


def test_accumulation_keeps_unsharded_gradients_and_reduces_once_per_optimizer_step() -> None:
    once, twice = CostContext(PROFILE, CLUSTER), CostContext(PROFILE, CLUSTER, accumulation_steps=2)
    grads = 4 * P
    for name in ("zero2", "zero3", "split(k=2, sharded=1)"):
        unit = UNITS[0] if not name.startswith("split") else UnitProfile(
            "lin", ("lin",), P, 0, 0.01, 0.02, 1_000, linear_shape=(100, 1000), split_overhead_s=((2, 0.0),))
        a, b = choice_cost(unit, name, once), choice_cost(unit, name, twice)
        kept = grads if not name.startswith("split") else grads // 2  # the sharded slice's gradient
        assert b.state_bytes == a.state_bytes + kept, name
        assert b.comm_s < a.comm_s and b.optimizer_s <= a.optimizer_s, name
        if not name.startswith("split"):  # sharded gradients live through the step when accumulating
            assert a.late_grad_bytes == grads // CLUSTER.world_size and b.late_grad_bytes == 0, name
    a, b = choice_cost(UNITS[0], "replicate", once), choice_cost(UNITS[0], "replicate", twice)
    assert b.persistent_bytes == a.persistent_bytes  # DDP's no-sync adds into the same buckets
    assert b.comm_s == pytest.approx(a.comm_s / 2)


def test_the_plan_is_solved_for_the_trainers_accumulation() -> None:
    zero3 = make_plan(PROFILE, CLUSTER, uniform_choice="zero3")
    zero3_accumulating = make_plan(PROFILE, CLUSTER, uniform_choice="zero3", accumulation_steps=2)
    assert zero3_accumulating.accumulation_steps == 2
    # four units keep their unsharded gradients (one of them was transient anyway)
    assert zero3_accumulating.predicted_peak_bytes - zero3.predicted_peak_bytes >= 3 * 4 * P
    assert zero3_accumulating.predicted_step_s < zero3.predicted_step_s  # one reduce-scatter per 2 micro-batches
    # a budget the smallest plan fits without accumulation is too small with it
    tight = ClusterSpec(world_size=2, memory_budget_bytes=zero3.predicted_peak_bytes * 101 // 95,
                        collective_latency_s=1e-4, bandwidth_bytes_per_s=1e8,
                        headroom_bytes=zero3.predicted_peak_bytes * 101 // 95 - zero3.predicted_peak_bytes)
    assert make_plan(PROFILE, tight).predicted_peak_bytes <= zero3.predicted_peak_bytes
    with pytest.raises(InfeasibleBudgetError):
        make_plan(PROFILE, tight, accumulation_steps=2)


@pytest.mark.parametrize("value", [1.5, 0, -2, True, "2"])
def test_an_accumulation_that_is_not_a_positive_int_gets_lightnings_error(value: object) -> None:
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException, match="Accumulation factor should be an int greater than 0"):
        check_accumulation(value)
    assert check_accumulation(3) == 3


def test_the_profiling_flag() -> None:
    from osdp_lightning import OSDPStrategy, is_profiling

    strategy = OSDPStrategy()
    assert not strategy.profiling and not is_profiling()
    with _profiling():
        assert strategy.profiling and is_profiling()
    assert not strategy.profiling


@pytest.mark.multiprocess
def test_accumulation_equals_ddp_without_reductions_on_micro_steps(train) -> None:
    ddp = train("ddp-acc", "--model", "mlp", "--strategy", "ddp", "--accumulate", "2", "--steps", "3")
    osdp = train("mixed-acc", "--model", "mlp", "--choices", MIXED, "--accumulate", "2", "--steps", "3")
    _assert_same_run(ddp, osdp)
    for rank in osdp:
        reductions = rank["reductions_per_batch"]
        assert len(reductions) == 6 and reductions[0::2] == [0, 0, 0], reductions  # micro-steps: none
        assert all(n > 0 for n in reductions[1::2]), reductions  # the optimizer step's micro-batch reduces
        assert rank["step_calls"]["real"] == 6  # profiling calls are told apart (the flag)
