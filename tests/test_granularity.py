"""Unit granularity: repeated blocks found automatically, each a unit whole or split into its parts."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.demos import Transformer as LightningDemoTransformer

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from osdp_lightning.recipes.bert.model import Bert, BertConfig  # noqa: E402
from osdp_lightning.recipes.gpt.model import GPT, GPTConfig  # noqa: E402
from osdp_lightning.recipes.t5.model import T5, T5Config  # noqa: E402
from test_core_multiprocess import assert_plan_and_memory, assert_same_losses  # noqa: E402
from toy_models import MLP, HuggingFaceLM, TiedLM, TorchTransformer  # noqa: E402

from osdp_lightning.cost.cluster import ClusterSpec  # noqa: E402
from osdp_lightning.plan.choice_table import build_choice_table  # noqa: E402
from osdp_lightning.plan.measure import profile_lightning_module  # noqa: E402
from osdp_lightning.plan.plan import fixed_plan, make_plan, root_folds, unit_sets  # noqa: E402
from osdp_lightning.profiling.records import with_parts, with_units  # noqa: E402
from osdp_lightning.profiling.units import ROOT, find_blocks, select_units, unit_param_counts  # noqa: E402
from osdp_lightning.solve import smallest_feasible_budget  # noqa: E402

CLUSTER = ClusterSpec(world_size=2, memory_budget_bytes=2**40, collective_latency_s=1e-4, bandwidth_bytes_per_s=1e9)


def _parts(model: torch.nn.Module) -> dict[str, list[str]]:
    return {s.name: [p.name for p in s.parts] for s in select_units(model)}


def test_recipe_blocks_are_units_with_their_linears_as_parts() -> None:
    gpt = _parts(GPT(GPTConfig(vocab_size=64, block_size=64, n_layer=2, n_head=2, n_embd=32)))
    assert list(gpt) == ["wte+lm_head", "wpe", "h.0", "h.1"]  # tied embedding and head: one unit
    assert gpt["h.0"] == ["h.0.attn.c_attn", "h.0.attn.c_proj", "h.0.mlp.c_fc", "h.0.mlp.c_proj"]
    bert = _parts(Bert(BertConfig(vocab_size=64, hidden=32, n_layer=2, n_head=2, intermediate=64, max_seq_len=16)))
    assert [n for n in bert if n.startswith("layers.")] == ["layers.0", "layers.1"]
    assert "layers.0.intermediate" in bert["layers.0"] and "word_embeddings+mlm_head.decoder" in bert
    t5 = _parts(T5(T5Config()))
    assert [n for n in t5 if "coder." in n] == ["encoder.0", "encoder.1", "decoder.0", "decoder.1"]
    assert "decoder.0.cross_attn.q" in t5["decoder.0"] and "shared+lm_head" in t5


def test_torch_and_lightning_transformer_layers_are_blocks() -> None:
    torch_blocks = _parts(TorchTransformer())
    # nn.MultiheadAttention's out_proj (never called) stays inside its attention part
    assert torch_blocks["encoder.layers.0"] == ["encoder.layers.0.self_attn", "encoder.layers.0.linear1",
                                                "encoder.layers.0.linear2"]
    demo = LightningDemoTransformer(vocab_size=50, ninp=32, nhead=2, nhid=64, nlayers=2)
    assert find_blocks(demo) == ["transformer.encoder.layers.0", "transformer.encoder.layers.1",
                                 "transformer.decoder.layers.0", "transformer.decoder.layers.1"]


def test_without_blocks_or_with_explicit_units_nothing_changes() -> None:
    assert [s.name for s in select_units(MLP())] == ["net.0", "net.2", "net.4", "net.6"]
    explicit = select_units(TorchTransformer(), unit_module_types=["Linear"])
    assert all(not s.parts for s in explicit) and "encoder.layers.0.linear1" in [s.name for s in explicit]


def _profile(model: torch.nn.Module):  # noqa: ANN202
    batch = next(iter(model.train_dataloader()))
    return profile_lightning_module(model, batch, optimizer=model.configure_optimizers(), repeats=1)


def test_a_profile_splits_into_parts_without_losing_anything() -> None:
    model = TiedLM()
    profile = _profile(model)
    blocks = [u.name for u in profile.units if u.parts]
    assert blocks == ["blocks.layers.0", "blocks.layers.1"] and profile.units[0].name == "embed+head"
    assert unit_sets(profile) == [(), ("blocks.layers.0",), tuple(blocks)]
    fine = with_parts(profile, blocks[:1])
    assert [u.name for u in fine.units][1:5] == ["blocks.layers.0.self_attn", "blocks.layers.0.linear1",
                                                 "blocks.layers.0.linear2", "blocks.layers.1"]
    for key in ("param_count", "forward_s", "backward_s", "activation_bytes"):
        total = sum(getattr(u, key) for u in profile.units)
        assert sum(getattr(u, key) for u in fine.units) == pytest.approx(total)
    # the block's norms (not in any part) go to the root, as FSDP2 gives them when it wraps only the parts
    specs = [part for s in select_units(model) for part in (s.parts if s.name == "blocks.layers.0" else (s,))]
    counts = unit_param_counts(model, specs)
    assert {u.name: u.param_count for u in fine.units} == {n: counts[n] for n in counts}
    assert fine.units[-1].name == ROOT


def test_the_plan_descends_into_blocks_only_when_whole_blocks_do_not_fit() -> None:
    profile = _profile(TiedLM())
    whole = smallest_feasible_budget(build_choice_table(profile, CLUSTER))
    finest = smallest_feasible_budget(build_choice_table(with_parts(profile, unit_sets(profile)[-1]), CLUSTER))
    assert finest < whole  # smaller units, smaller transients
    roomy = make_plan(profile, dataclasses.replace(CLUSTER, memory_budget_bytes=4 * whole))
    assert any(u.name == "blocks.layers.0" for u in roomy.units)
    tight = make_plan(profile, dataclasses.replace(CLUSTER, memory_budget_bytes=(whole + finest) // 2))
    assert "blocks.layers.0" not in [u.name for u in tight.units]
    assert "blocks.layers.0.linear1" in [u.name for u in tight.units]
    assert tight.predicted_peak_bytes <= tight.memory_budget_bytes


def test_units_outside_the_blocks_may_be_left_to_the_root_as_hand_written_fsdp2_does() -> None:
    profile = _profile(TiedLM())
    assert root_folds(profile) == [("embed+head",), ()]  # fewer units first: it wins ties
    assert root_folds(with_parts(profile, ["blocks.layers.0"])) == [("embed+head",), ()]  # parts stay units
    folded = with_parts(profile, (), ("embed+head",))
    assert [u.name for u in folded.units] == ["blocks.layers.0", "blocks.layers.1", ROOT]
    for key in ("param_count", "tensor_count", "forward_s", "backward_s", "activation_bytes"):
        assert sum(getattr(u, key) for u in folded.units) == pytest.approx(sum(getattr(u, key) for u in profile.units))
    both = with_parts(profile, ("blocks.layers.0",), ("embed+head",))
    assert [u.name for u in both.units][:3] == ["blocks.layers.0.self_attn", "blocks.layers.0.linear1",
                                                "blocks.layers.0.linear2"]
    block = profile.units[1]  # its norms (in no part) and the embedding both go to the root
    assert both.units[-1].param_count - folded.units[-1].param_count == \
        block.param_count - sum(p.param_count for p in block.parts) > 0
    # one unit less: one gather and one reduce-scatter launch less per step, at the same peak
    steps = {}
    for units in (profile, folded):
        plan = fixed_plan(units, CLUSTER, ["zero3"] * len(units.units))
        steps[len(plan.units)] = (plan.predicted_step_s, plan.predicted_peak_bytes)
    assert steps[3][0] < steps[4][0] and steps[3][1] == steps[4][1]
    assert [u.name for u in make_plan(profile, CLUSTER, uniform_choice="zero3").units] == [u.name for u in folded.units]
    # a model without blocks, or with units the user named, keeps its units
    assert root_folds(_profile(MLP())) == [()]
    # a plan's units give back the unit set it was solved on (the regret benchmark prices candidates there)
    for units in (folded, both, profile):
        assert with_units(profile, [u.name for u in units.units]) == units
    with pytest.raises(ValueError, match="no unit set"):
        with_units(profile, ["blocks.layers.0.linear1", ROOT])  # a part without its block's other parts


@pytest.mark.multiprocess
def test_a_mixed_granularity_plan_trains_like_ddp(train, tmp_path: Path) -> None:
    """Block 0 split into parts (one part split in two slices), block 1 whole: DDP's losses."""
    profile = with_parts(_profile(TiedLM()), ["blocks.layers.0"])
    plan = make_plan(profile, CLUSTER, uniform_choice="zero3")
    mixed = {"blocks.layers.0.self_attn": "replicate", "blocks.layers.0.linear1": "split(k=2, sharded=1)",
             "blocks.layers.0.linear2": "zero2", "blocks.layers.1": "zero2"}
    plan = dataclasses.replace(plan, units=tuple(dataclasses.replace(u, choice=mixed.get(u.name, u.choice))
                                                 for u in plan.units))
    plan.save(tmp_path / "mixed.json")
    ddp = train("ddp", "--model", "tied_lm", "--strategy", "ddp")
    osdp = train("mixed", "--model", "tied_lm", "--plan", str(tmp_path / "mixed.json"))
    assert_same_losses(ddp, osdp)
    applied = {u["name"]: u["choice"] for u in osdp[0]["plan"]["units"]}
    assert all(applied[name] == choice for name, choice in mixed.items())
    zero3 = train("zero3", "--model", "tied_lm", "--uniform", "zero3")  # automatic block units
    assert_same_losses(ddp, zero3)
    # the blocks, and the tied embedding and head left to the root (one unit less per step)
    assert [u["name"] for u in assert_plan_and_memory(zero3)["units"]] == ["blocks.layers.0", "blocks.layers.1", ROOT]


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["gpt2", "bert", "t5"])
def test_hugging_face_blocks_are_units_and_a_mixed_plan_over_them_trains_like_ddp(train, tmp_path: Path,
                                                                                 kind: str) -> None:
    """HF ``GPT2Block`` / ``BertLayer`` / ``T5Block`` found as units (models built from configs)."""
    profile = _profile(HuggingFaceLM(kind))
    blocks = [u.name for u in profile.units if u.parts]
    assert len(blocks) == (4 if kind == "t5" else 2)
    plan = make_plan(profile, CLUSTER, uniform_choice="zero3")
    mixed = {**{name: ("replicate", "zero3")[i % 2] for i, name in enumerate(blocks)}, ROOT: "zero2"}
    plan = dataclasses.replace(plan, units=tuple(dataclasses.replace(u, choice=mixed.get(u.name, u.choice))
                                                 for u in plan.units))
    plan.save(tmp_path / "mixed.json")
    ddp = train("ddp", "--model", f"hf_{kind}", "--strategy", "ddp")
    osdp = train("mixed", "--model", f"hf_{kind}", "--plan", str(tmp_path / "mixed.json"))
    assert_same_losses(ddp, osdp)
    applied = {u["name"]: u["choice"] for u in osdp[0]["plan"]["units"]}
    assert applied == {u.name: mixed.get(u.name, "zero3") for u in plan.units}
