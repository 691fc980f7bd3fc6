"""Activation checkpointing as a per-unit choice (``<choice>+ckpt``): names, cost terms, profile,
plans, and a 2-rank run against DDP with dropout."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from toy_models import DropoutMLP  # noqa: E402

from osdp_lightning.choices import ChoiceOptions, choice_cost, choice_space, parse  # noqa: E402
from osdp_lightning.cluster import ClusterSpec  # noqa: E402
from osdp_lightning.cost import CostContext, build_choice_table  # noqa: E402
from osdp_lightning.plan import InfeasibleBudgetError, make_plan  # noqa: E402
from osdp_lightning.profile import ModelProfile, UnitProfile, profile_lightning_module  # noqa: E402

P = 10_000
UNIT = UnitProfile("block", ("block",), P, 0, forward_s=0.01, backward_s=0.02, activation_bytes=50_000,
                   input_bytes=4_000)
ROOT_UNIT = UnitProfile("", ("",), 100, 0, 0.001, 0.001, 1_000)
PROFILE = ModelProfile((UNIT, ROOT_UNIT), micro_batch_size=4, param_bytes_per_element=4, grad_bytes_per_element=4,
                       compute_bytes_per_element=4, reduce_bytes_per_element=4, optimizer_bytes_per_param=8,
                       activation_bytes=60_000)
CLUSTER = ClusterSpec(world_size=2, memory_budget_bytes=2**30, collective_latency_s=1e-4, bandwidth_bytes_per_s=1e9)


def test_names_round_trip_with_every_family() -> None:
    for name in ("zero3+ckpt", "replicate+ckpt", "split(k=4, sharded=3)+ckpt", "hsdp(g=8)+ckpt"):
        assert str(parse(name)) == name and parse(name).modifiers == ("ckpt",)
    assert parse("zero3+ckpt").base == parse("zero3")
    with pytest.raises(ValueError):
        parse("zero3+ckpt+ckpt")
    with pytest.raises(ValueError):
        parse("zero3+offload")


def test_the_option_sets_the_choice_space() -> None:
    names = {mode: [str(c) for c in choice_space(CLUSTER, ChoiceOptions(activation_checkpointing=mode))]
             for mode in ("never", "always", "auto")}
    assert names["never"] == ["replicate", "zero2", "zero3"]
    assert names["always"] == ["replicate+ckpt", "zero2+ckpt", "zero3+ckpt"]
    assert names["auto"] == names["never"] + names["always"]
    with pytest.raises(ValueError, match="activation_checkpointing"):
        choice_space(CLUSTER, ChoiceOptions(activation_checkpointing="sometimes"))


def test_cost_terms_by_hand() -> None:
    ctx = CostContext(PROFILE, CLUSTER, batch_scale=2.0)
    plain, ckpt = choice_cost(UNIT, "zero3", ctx), choice_cost(UNIT, "zero3+ckpt", ctx)
    assert plain.activation_bytes == 100_000  # saved for backward, twice the profiled batch
    assert ckpt.choice == "zero3+ckpt"
    assert ckpt.activation_bytes == 8_000  # only the input is kept from forward to backward
    assert ckpt.transient_bytes == plain.transient_bytes + 100_000  # recomputed during its backward
    assert ckpt.prefetch == plain.prefetch == 4 * P  # a neighbour overlaps the parameters, not the recompute
    assert ckpt.compute_s == pytest.approx(plain.compute_s + 0.02)  # the forward runs again
    assert (ckpt.state_bytes, ckpt.held_bytes, ckpt.comm_s) == (plain.state_bytes, plain.held_bytes, plain.comm_s)
    assert ckpt.persistent_bytes == plain.persistent_bytes - 92_000


def test_table_keeps_only_the_activations_no_choice_changes() -> None:
    table = build_choice_table(PROFILE, CLUSTER, choices=choice_space(CLUSTER, ChoiceOptions()))
    assert table.activation_bytes == 60_000 - 50_000 - 1_000  # temporaries beyond the saved tensors
    # the root cannot be checkpointed: under "always" it keeps its choices without the modifier
    always = build_choice_table(PROFILE, CLUSTER, choices=choice_space(CLUSTER, ChoiceOptions(
        activation_checkpointing="always")))
    assert [c.choice for c in always.units[0].choices] == ["replicate+ckpt", "zero2+ckpt", "zero3+ckpt"]
    assert [c.choice for c in always.units[1].choices] == ["replicate", "zero2", "zero3"]


def test_the_profile_records_a_blocks_input_and_saved_bytes() -> None:
    model = DropoutMLP(width=64, depth=2)
    batch = next(iter(model.train_dataloader()))
    profile = profile_lightning_module(model, batch, optimizer=model.configure_optimizers(), repeats=1)
    blocks = [u for u in profile.units if u.name.startswith("blocks.")]
    assert [u.name for u in blocks] == ["blocks.0", "blocks.1"]
    for unit in blocks:
        assert unit.input_bytes == 8 * 64 * 4  # the block's input x: (B, width) fp32
        # Linear input, ReLU output, dropout mask and output: the block saves more than its input
        assert unit.activation_bytes >= 3 * unit.input_bytes


def _block_profile(blocks: int = 4) -> ModelProfile:
    unit = dataclasses.replace(UNIT, activation_bytes=400_000, input_bytes=20_000)
    units = tuple(dataclasses.replace(unit, name=f"b{i}", module_names=(f"b{i}",)) for i in range(blocks))
    return dataclasses.replace(PROFILE, units=(*units, ROOT_UNIT), activation_bytes=blocks * 400_000 + 1_000)


def test_auto_checkpoints_only_where_memory_needs_it() -> None:
    profile, space = _block_profile(), choice_space(CLUSTER, ChoiceOptions())
    roomy = make_plan(profile, CLUSTER, choices=space)
    assert not any("ckpt" in u.choice for u in roomy.units)
    never = choice_space(CLUSTER, ChoiceOptions(activation_checkpointing="never"))
    smallest = make_plan(profile, CLUSTER, uniform_choice="zero3").predicted_peak_bytes
    tight = dataclasses.replace(CLUSTER, memory_budget_bytes=int(0.7 * smallest))
    with pytest.raises(InfeasibleBudgetError):
        make_plan(profile, tight, choices=never)
    plan = make_plan(profile, tight, choices=space)
    assert plan.predicted_peak_bytes <= tight.memory_budget_bytes
    assert 0 < sum("ckpt" in u.choice for u in plan.units) < len(plan.units)  # some blocks, not the root


def _train_args(name: str) -> tuple[str, ...]:
    return ("--model", "dropout_mlp", "--steps", "4", *(() if name == "ddp" else ("--split-factors", "")))


@pytest.mark.multiprocess
def test_mixed_plan_with_checkpointed_blocks_and_dropout_matches_ddp(train) -> None:
    ddp = train("ddp", *_train_args("ddp"), "--strategy", "ddp")
    choices = "blocks.0=replicate+ckpt;blocks.1=zero3+ckpt;blocks.2=zero2+ckpt;blocks.3=zero3"
    osdp = train("ckpt", *_train_args("ckpt"), "--choices", choices)
    assert {u["choice"] for u in osdp[0]["plan"]["units"]} >= {"replicate+ckpt", "zero3+ckpt", "zero2+ckpt"}
    for ref, got in zip(ddp, osdp, strict=True):
        assert len(ref["losses"]) == len(got["losses"]) == 4
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-4)
    assert len(set(ddp[0]["losses"])) > 1  # it trained
    # checkpointed units are priced as an upper bound (recomputed activations counted at the peak)
    predicted, measured = osdp[0]["plan"]["predicted_peak_bytes"], osdp[0]["summary"]["peak_bytes"]
    assert measured <= predicted <= 1.15 * measured, (predicted, measured)


def test_checkpointing_does_not_change_the_loss_of_one_process() -> None:
    """Recomputation with dropout draws the same masks (torch restores the RNG state)."""
    from torch.distributed._composable import checkpoint

    torch.manual_seed(0)
    reference, checkpointed = DropoutMLP(width=32, depth=2), DropoutMLP(width=32, depth=2)
    checkpointed.load_state_dict(reference.state_dict())
    for block in checkpointed.blocks:
        checkpoint(block)
    batch = next(iter(reference.train_dataloader()))
    grads = []
    for model in (reference, checkpointed):
        torch.manual_seed(1)
        model.compute_loss(batch).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)
    assert isinstance(checkpointed.blocks[0], nn.Sequential)  # checkpointed in place: same names and keys
