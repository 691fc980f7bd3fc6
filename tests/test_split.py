"""SplitLinear in one process: same function, canonical checkpoints, the split cost model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ckpt_launch import run_gloo_checks
from torch import nn

from osdp_lightning.choices import choice_cost, split_choice
from osdp_lightning.cost.cluster import ClusterSpec
from osdp_lightning.cost.cost import CostContext
from osdp_lightning.profiling.records import ModelProfile, UnitProfile
from osdp_lightning.runtime.split import (
    SplitLinear,
    measure_split_overhead_s,
    split_linear_in_module,
    valid_split_factors,
)


def make_linear(in_features: int = 64, out_features: int = 24, bias: bool = True,
                dtype: torch.dtype = torch.float32) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(in_features, out_features, bias=bias, dtype=dtype)


def forward_backward(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list]:
    x = x.detach().requires_grad_(True)
    out = module(x)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape))
    return out.detach(), x.grad, [p.grad for p in module.parameters()]


def split_grads_as_linear(split: SplitLinear) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight_grad = torch.cat([piece.weight.grad for piece in split.slices], dim=1)
    return weight_grad, None if split.bias is None else split.bias.grad


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_gradients_match_linear(k: int, bias: bool, dtype: torch.dtype, atol: float) -> None:
    linear = make_linear(bias=bias, dtype=dtype)
    split = SplitLinear.from_linear(linear, k)
    x = torch.randn(3, 5, 64, dtype=dtype)  # (B, T, in): leading dimensions pass through
    out_ref, x_grad_ref, (w_grad_ref, *b_grad_ref) = forward_backward(linear, x)
    out, x_grad, _ = forward_backward(split, x)
    w_grad, b_grad = split_grads_as_linear(split)
    assert out.dtype == dtype and all(p.dtype == dtype for p in split.parameters())
    torch.testing.assert_close(out, out_ref, atol=atol, rtol=atol)
    torch.testing.assert_close(x_grad, x_grad_ref, atol=atol, rtol=atol)
    torch.testing.assert_close(w_grad, w_grad_ref, atol=atol, rtol=atol)
    if bias:
        torch.testing.assert_close(b_grad, b_grad_ref[0], atol=atol, rtol=atol)


def test_bias_is_added_once() -> None:
    linear = make_linear()
    with torch.no_grad():
        linear.weight.zero_()
    split = SplitLinear.from_linear(linear, 4)
    torch.testing.assert_close(split(torch.randn(2, 64)), linear.bias.expand(2, -1))


def test_bad_k_error_names_the_valid_factors() -> None:
    with pytest.raises(ValueError, match=r"k=5 .*valid k for in_features=96: 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96"):
        SplitLinear.from_linear(make_linear(96), 5)
    with pytest.raises(ValueError, match="k=1"):
        SplitLinear(64, 8, 1)
    assert valid_split_factors(96, (2, 3, 4, 5, 8, 64)) == (2, 3, 4, 8)
    assert valid_split_factors(10) == (2,)


def test_state_dict_is_canonical() -> None:
    linear = make_linear()
    split = SplitLinear.from_linear(linear, 4)
    reference = linear.state_dict()
    state = split.state_dict()
    assert list(state) == list(reference) == ["weight", "bias"]
    for key in reference:
        assert state[key].shape == reference[key].shape and torch.equal(state[key], reference[key])
    torch.testing.assert_close(split.weight, linear.weight.detach())
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), make_linear())
    keys = list(model.state_dict())
    split_linear_in_module(model, "2", 8)
    assert list(model.state_dict()) == keys
    assert not any("slices" in key for key in model.state_dict())


def test_checkpoints_load_both_ways(tmp_path: Path) -> None:
    plain = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), make_linear())
    split_model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), make_linear())
    split_linear_in_module(split_model, "2", 4)
    with torch.no_grad():  # make the two models differ before loading
        for param in split_model.parameters():
            param.add_(1.0)
    x = torch.randn(4, 8)
    torch.save(plain.state_dict(), tmp_path / "plain.pt")
    split_model.load_state_dict(torch.load(tmp_path / "plain.pt"))
    torch.testing.assert_close(split_model(x), plain(x))
    with torch.no_grad():
        for param in split_model.parameters():
            param.mul_(0.5)
    torch.save(split_model.state_dict(), tmp_path / "split.pt")
    plain.load_state_dict(torch.load(tmp_path / "split.pt"))
    torch.testing.assert_close(plain(x), split_model(x))
    hidden = torch.randn(4, 64)
    torch.testing.assert_close(split_model[2].to_linear()(hidden), plain[2](hidden))


def test_loading_reports_canonical_names() -> None:
    model = nn.Sequential(make_linear())
    split_linear_in_module(model, "0", 2)
    result = model.load_state_dict({"0.bias": torch.zeros(24)}, strict=False)
    assert result.missing_keys == ["0.weight"]
    with pytest.raises(RuntimeError, match=r"size mismatch for 0.weight"):
        model.load_state_dict({"0.weight": torch.zeros(24, 32), "0.bias": torch.zeros(24)})


def test_split_linear_in_module_refuses_what_it_cannot_split() -> None:
    attention = nn.MultiheadAttention(16, 2)
    with pytest.raises(TypeError, match="only nn.Linear"):
        split_linear_in_module(attention, "out_proj", 2)
    tied = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    tied[1].weight = tied[0].weight
    with pytest.raises(ValueError, match="shares its weight"):
        split_linear_in_module(tied, "1", 2)
    with pytest.raises(ValueError, match="root"):
        split_linear_in_module(tied, "", 2)


def test_split_model_trains_like_the_plain_one() -> None:
    def losses(split: bool) -> list[float]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
        if split:
            split_linear_in_module(model, "2", 4)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        generator = torch.Generator().manual_seed(1)
        result = []
        for _ in range(5):
            loss = model(torch.randn(16, 8, generator=generator)).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            result.append(loss.item())
        return result

    for a, b in zip(losses(False), losses(True), strict=True):
        assert abs(a - b) <= 1e-5 * abs(a)


def test_measure_split_overhead_leaves_the_linear_alone() -> None:
    linear = make_linear(256, 256)
    overhead = measure_split_overhead_s(linear, torch.randn(32, 256), 4, repeats=3)
    assert isinstance(overhead, float) and overhead >= 0.0
    assert linear.weight.grad is None


def cost_inputs() -> tuple[UnitProfile, ModelProfile, ClusterSpec]:
    unit = UnitProfile("fc", ("fc",), 64 * 128 + 64, 0, 0.01, 0.02, 0, linear_shape=(64, 128),
                       split_overhead_s=((4, 0.005), (8, 0.008)))
    profile = ModelProfile((unit,), 8, 4, 4, 4, 4, 8, 0)  # fp32 Adam: 4 + 4 + 8 bytes per parameter
    cluster = ClusterSpec(world_size=2, memory_budget_bytes=2**30, collective_latency_s=1e-3,
                          bandwidth_bytes_per_s=1e6)
    return unit, profile, cluster


def split_cost(unit: UnitProfile, profile: ModelProfile, cluster: ClusterSpec, k: int, sharded: int,
               batch_scale: float = 1.0):  # noqa: ANN201
    return choice_cost(unit, split_choice(k, sharded), CostContext(profile, cluster, batch_scale))


def test_split_choice_cost_hand_computed() -> None:
    unit, profile, cluster = cost_inputs()
    cost = split_cost(unit, profile, cluster, 4, 3, batch_scale=2.0)
    # A slice: 64 x 32 = 2048 parameters: 8 KiB gathered, 8 KiB of gradient, 32 KiB of state.
    assert cost.choice == str(split_choice(4, 3)) == "split(k=4, sharded=3)"
    assert cost.state_bytes == 3 * 32768 // 2 + 32768 + 64 * 16
    assert cost.held_bytes == 0  # the replicated slice is a plain tensor on DDP's reducer: no copy
    # Two sharded slices in flight, the replicated slice's gradient twice (autograd's and the
    # bucket's), one reduce-scatter output shard, the bias gradient.
    assert cost.transient_bytes == 2 * (8192 + 8192) + 2 * 8192 + 4096 + 256
    all_gather = 1e-3 + 8192 * 0.5 / 1e6
    all_reduce = 1e-3 + 2 * 8192 * 0.5 / 1e6
    # the replicated slice's gradient rides in DDP's buckets (bytes, no launch of its own)
    assert cost.comm_s == pytest.approx(3 * 3 * all_gather + all_reduce - 1e-3 + 256 / 1e6)
    assert cost.compute_s == pytest.approx((0.01 + 0.02 + 0.005) * 2.0)


def test_split_transient_falls_with_k() -> None:
    unit, profile, cluster = cost_inputs()
    zero3 = choice_cost(unit, "zero3", CostContext(profile, cluster)).transient_bytes
    weight_zero3 = 2 * 64 * 128 * 4  # gathered weight and its gradient
    transients = []
    for k in (4, 8):
        transients.append(split_cost(unit, profile, cluster, k, k).transient_bytes)
        # Two slices in flight (FSDP2 backward prefetch) plus a reduce-scatter output shard:
        # about 2/k of zero3's gathered weight and gradient.
        assert transients[-1] == weight_zero3 * (2 + 0.25) / k + 256
    assert zero3 > transients[0] > transients[1]
    one = split_cost(unit, profile, cluster, 4, 1)
    # one sharded slice in flight; three replicated slices' gradients, each twice until the bucket's all-reduce
    assert one.transient_bytes == (8192 + 8192) + 3 * 2 * 8192 + 4096 + 256
    with pytest.raises(ValueError, match="no measured split overhead"):
        split_cost(unit, profile, cluster, 2, 1)
    with pytest.raises(ValueError, match="does not split"):
        split_cost(unit, profile, cluster, 3, 1)


@pytest.mark.multiprocess
def test_split_linear_under_fsdp2_on_two_ranks(tmp_path: Path) -> None:
    result = run_gloo_checks("split_fsdp_check.py", tmp_path)
    assert result["training"]["max_rel_diff"] < 1e-4
    assert result["checkpoints"]["keys"] == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    assert all(abs(row["error"]) <= 0.15 for row in result["memory"] if row["k"] > 1)
