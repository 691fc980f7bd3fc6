"""Activation checkpointing as a per-unit choice (``<choice>+ckpt``): names, cost terms, profile,
plans, a 2-rank run against DDP with dropout, units whose recomputation does not replay their
forward (found while profiling, never checkpointed), and Hugging Face models under "always"."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from toy_models import DropoutMLP, HuggingFaceLM, MemoMLP  # noqa: E402

from osdp_lightning.choices import ChoiceOptions, choice_cost, choice_space, parse  # noqa: E402
from osdp_lightning.choices.checkpointing import checkpoint_module, refusal_message  # noqa: E402
from osdp_lightning.cost.cluster import ClusterSpec  # noqa: E402
from osdp_lightning.cost.cost import CostContext  # noqa: E402
from osdp_lightning.plan.choice_table import build_choice_table  # noqa: E402
from osdp_lightning.plan.measure import profile_lightning_module  # noqa: E402
from osdp_lightning.plan.plan import InfeasibleBudgetError, make_plan  # noqa: E402
from osdp_lightning.profiling.records import ModelProfile, UnitProfile  # noqa: E402

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


HF_BLOCKS = ("T5Block", "GPT2Block", "BertLayer")
BLOCK_NAME = re.compile(r"^(.*?\.(?:block|h|layer)\.\d+)(?:\.|$)")
"""A unit inside a T5, GPT-2 or BERT block, or the block itself: group 1 is the block's name."""


@pytest.mark.parametrize("kind", ["t5", "gpt2", "bert"])
def test_checkpointed_hugging_face_blocks_replay_their_forward(kind: str) -> None:
    """T5's decoder blocks write a cache in training (cross-attention keys once, read back after):
    checkpointed by hooks, the recompute read the keys instead of computing them and backward
    raised CheckpointError (48 tensors saved against 52). Through the layers' own switch the cache
    is dropped and gradients equal the plain model's."""
    torch.manual_seed(0)
    reference = HuggingFaceLM(kind)
    checkpointed = HuggingFaceLM(kind)
    checkpointed.load_state_dict(reference.state_dict())
    for module in checkpointed.modules():
        if type(module).__name__ in HF_BLOCKS:
            checkpoint_module(module)
    batch = next(iter(reference.train_dataloader()))
    grads = []
    for model in (reference, checkpointed):
        model.compute_loss(batch).backward()
        grads.append({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=name)


def test_a_unit_whose_recomputation_does_not_replay_is_never_checkpointed() -> None:
    model = MemoMLP()
    batch = next(iter(model.train_dataloader()))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    profile = profile_lightning_module(model, batch, optimizer=model.configure_optimizers(), repeats=1)
    refused = {u.name: u.checkpoint_refusal for unit in profile.units for u in (unit, *unit.parts)}
    assert refused.keys() >= {"blocks.0", "blocks.1", "blocks.0.proj", "blocks.1.mix"}
    for name in ("blocks.0", "blocks.1"):  # the recompute found the memo filled: one Linear fewer
        assert refused[name].startswith("CheckpointError: ") and "different number of tensors" in refused[name]
    assert not any(reason for name, reason in refused.items() if name not in ("blocks.0", "blocks.1"))
    message = refusal_message(profile.units)
    assert message is not None and "blocks.0: CheckpointError" in message and "blocks.1: CheckpointError" in message
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the trial left no trace
    assert all(p.grad is None for p in model.parameters())
    # "always": the refused blocks keep their choices without +ckpt, their parts are checkpointed
    always = choice_space(CLUSTER, ChoiceOptions(activation_checkpointing="always"))
    table = build_choice_table(profile, CLUSTER, choices=always)
    offered = {u.name: [c.choice for c in u.choices] for u in table.units}
    assert offered["blocks.0"] == offered["blocks.1"] == ["replicate", "zero2", "zero3"]
    plan = make_plan(profile, CLUSTER, choices=always)
    assert not any("ckpt" in u.choice for u in plan.units)
    unchecked = profile_lightning_module(model, batch, repeats=1, choices=ChoiceOptions(activation_checkpointing="never"))
    assert refusal_message(unchecked.units) is None


def test_always_on_a_model_that_cannot_checkpoint_a_unit_trains_and_says_why_before_training() -> None:
    import lightning as L

    from osdp_lightning import OSDPStrategy

    model = MemoMLP()
    trainer = L.Trainer(strategy=OSDPStrategy(activation_checkpointing="always"), accelerator="cpu", devices=1,
                        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    with pytest.warns(UserWarning, match=r"cannot be checkpointed[\s\S]*blocks\.0: CheckpointError"):
        trainer.fit(model)
    assert len(model.losses) == 2
    assert trainer.strategy.profile.units[0].checkpoint_refusal
    assert {u.name: u.choice for u in trainer.strategy.plan.units if u.name.startswith("blocks.")} == {
        "blocks.0": "replicate", "blocks.1": "replicate"}


def _assert_same_losses(ddp: list[dict], osdp: list[dict]) -> None:
    for ref, got in zip(ddp, osdp, strict=True):
        assert len(got["losses"]) == len(ref["losses"]) > 1
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-4)
    assert len(set(ddp[0]["losses"])) > 1  # it trained


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["t5", "gpt2", "bert"])
def test_hugging_face_models_train_like_ddp_with_every_unit_checkpointed(train, kind: str) -> None:
    """``always`` on 2 ranks: every unit but the root checkpointed, each block whole or through its
    parts (the plan picks); the DDP reference is test_granularity's (same arguments: run once)."""
    ddp = train("ddp", "--model", f"hf_{kind}", "--strategy", "ddp")
    osdp = train("always", "--model", f"hf_{kind}", "--activation-checkpointing", "always")
    choices = {u["name"]: u["choice"] for u in osdp[0]["plan"]["units"]}
    assert all(choice.endswith("+ckpt") for name, choice in choices.items() if name), choices  # all but the root
    blocks = {match.group(1) for name in choices if (match := BLOCK_NAME.match(name))}  # whole or by parts
    assert len(blocks) == (4 if kind == "t5" else 2), choices
    _assert_same_losses(ddp, osdp)


@pytest.mark.multiprocess
def test_t5_blocks_checkpointed_whole_under_fsdp2_and_ddp_train_like_ddp(train) -> None:
    """The layout that failed in the first backward on both ranks (CheckpointError, 52 tensors
    against 48): T5's decoder blocks checkpointed whole, under FSDP2 (zero3, zero2) and DDP."""
    ddp = train("ddp", "--model", "hf_t5", "--strategy", "ddp")
    choices = ("net.encoder.block.1=replicate+ckpt;net.decoder.block.0=zero3+ckpt;"
               "net.decoder.block.1=zero2+ckpt")
    osdp = train("t5_whole_blocks", "--model", "hf_t5", "--split-factors", "", "--choices", choices)
    applied = {u["name"]: u["choice"] for u in osdp[0]["plan"]["units"]}
    assert all(applied[item.split("=")[0]] == item.split("=")[1] for item in choices.split(";")), applied
    _assert_same_losses(ddp, osdp)
