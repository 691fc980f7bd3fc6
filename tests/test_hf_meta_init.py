"""Hugging Face models built on the meta device come alive as Hugging Face initialises them.

In one process, tiny Llama (GQA, rotary, tied embeddings), GPT-2, GPT-NeoX (partial rotary), BERT
and T5 configs are built under ``torch.device("meta")``, materialized unit by unit (each block a
unit, the rest the root's) and compared with an eager build of the same config, tensor by tensor.
The 2-rank run trains a meta-built Llama under a fixed plan (``tests/scripts/hf_meta_train.py``).
"""

from __future__ import annotations

import copy
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from ckpt_launch import SCRIPTS, run_ranks  # noqa: E402

from osdp_lightning.profiling.fakestep import build_meta_module  # noqa: E402
from osdp_lightning.profiling.hf_init import hugging_face_owner, is_hugging_face_model  # noqa: E402
from osdp_lightning.profiling.materialize import (  # noqa: E402
    UninitializedModuleError,
    has_meta_tensors,
    initialise_post_order,
    materialize,
)

hf = pytest.importorskip("transformers")

SMALL = dict(vocab_size=256, bos_token_id=0, eos_token_id=0, pad_token_id=0)
MODELS: dict[str, Callable[[], nn.Module]] = {
    "llama": lambda: hf.LlamaForCausalLM(hf.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=True, **SMALL)),
    "gpt2": lambda: hf.GPT2LMHeadModel(hf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, **SMALL)),
    "gpt_neox": lambda: hf.GPTNeoXForCausalLM(hf.GPTNeoXConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, **SMALL)),
    "bert": lambda: hf.BertForMaskedLM(hf.BertConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, **SMALL)),
    "t5": lambda: hf.T5ForConditionalGeneration(hf.T5Config(
        d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0, **SMALL)),
}
BLOCKS = ("GPT2Block", "LlamaDecoderLayer", "GPTNeoXLayer", "BertLayer", "T5Block")


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach() for n, t in (*model.named_parameters(), *model.named_buffers())}


def _tied_groups(model: nn.Module) -> list[list[str]]:
    holders: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(p), []).append(name)
    return sorted(sorted(names) for names in holders.values() if len(names) > 1)


def _meta_materialized(make: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    with torch.device("meta"):
        model = make()
    units = [(name,) for name, m in model.named_modules() if type(m).__name__ in BLOCKS] + [("",)]
    materialize(model, model, build_meta_module(model), units, torch.device("cpu"), seed=seed)
    return model


def _assert_initialised_alike(meta: nn.Module, eager: nn.Module) -> None:
    """Buffers and constant parameters (norm weights, biases) exactly equal; random parameters of the
    same mean and standard deviation, within what their number of elements allows."""
    got_all, params = _tensors(meta), dict(eager.named_parameters())
    assert got_all.keys() == _tensors(eager).keys()
    for name, want in _tensors(eager).items():
        got = got_all[name]
        assert not got.is_meta and got.dtype == want.dtype and got.shape == want.shape, name
        if name not in params or want.numel() == 1 or float(want.std()) == 0.0:
            assert torch.equal(got, want), f"{name}: {got.flatten()[:6]} != {want.flatten()[:6]}"
            continue
        assert bool(torch.isfinite(got).all()), name
        std, n = float(want.std()), want.numel()
        assert float(got.std()) == pytest.approx(std, rel=max(0.15, 3 / math.sqrt(n))), name
        assert float(got.mean()) == pytest.approx(float(want.mean()), abs=6 * std / math.sqrt(n)), name


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_meta_built_hugging_face_model_is_initialised_as_an_eager_one(kind: str) -> None:
    torch.manual_seed(0)
    eager = MODELS[kind]()
    meta = _meta_materialized(MODELS[kind])
    assert not has_meta_tensors(meta)
    _assert_initialised_alike(meta, eager)
    assert _tied_groups(meta) == _tied_groups(eager)
    again = _meta_materialized(MODELS[kind])  # every rank alike: the same seed, the same values
    assert all(torch.equal(a, b) for a, b in zip(_tensors(meta).values(), _tensors(again).values(), strict=True))


def test_meta_built_rotary_tables_equal_the_eager_ones_exactly() -> None:
    eager, meta = MODELS["llama"](), _meta_materialized(MODELS["llama"])
    for name in ("inv_freq", "original_inv_freq"):
        want = getattr(eager.model.rotary_emb, name)
        assert torch.equal(getattr(meta.model.rotary_emb, name), want) and want.numel() == 8
    assert meta.lm_head.weight is meta.model.embed_tokens.weight


def test_a_copy_of_one_block_is_initialised_by_its_hugging_face_owner() -> None:
    """What the unit bench does with the one copy it measures: GPT-2's residual projections scaled
    by ``1/sqrt(2 * n_layer)``, its norms at 1, its biases at 0."""
    with torch.device("meta"):
        model = MODELS["gpt2"]()
    owner = hugging_face_owner(model, "transformer.h.1")
    assert owner is model.transformer and is_hugging_face_model(owner)
    assert hugging_face_owner(nn.Sequential(nn.Linear(2, 2)), "0") is None
    block = copy.deepcopy(model.transformer.h[1]).to_empty(device="cpu")
    torch.manual_seed(0)
    initialise_post_order(block, owner)
    block.requires_grad_(False)
    std = model.config.initializer_range
    assert float(block.mlp.c_fc.weight.std()) == pytest.approx(std, rel=0.1)
    assert float(block.mlp.c_proj.weight.std()) == pytest.approx(std / math.sqrt(2 * 2), rel=0.1)
    assert block.ln_1.weight.eq(1).all() and block.ln_1.bias.eq(0).all() and block.attn.c_attn.bias.eq(0).all()


def test_a_parameter_the_hugging_face_init_misses_is_named() -> None:
    class ScaledLlama(hf.LlamaForCausalLM):
        """A parameter of its own that neither ``_init_weights`` nor a ``reset_parameters`` covers."""

        def __init__(self, config: hf.LlamaConfig) -> None:
            super().__init__(config)
            self.scale = nn.Parameter(torch.ones(8))

    with pytest.raises(UninitializedModuleError, match=r"ScaledLlama \(ScaledLlama: scale\).*_init_weights"):
        _meta_materialized(lambda: ScaledLlama(MODELS["llama"]().config))


# -- 2 ranks ----------------------------------------------------------------------------------
def test_a_meta_built_llama_trains_under_a_fixed_plan_on_two_ranks(tmp_path: Path) -> None:
    out = tmp_path / "llama.json"
    done = run_ranks([str(SCRIPTS / "hf_meta_train.py"), "--out", str(out)], tmp_path / "log", timeout_s=240)
    assert done.returncode == 0, done.log[-3000:]
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]
    for rank in ranks:
        assert "error" not in rank, rank
        losses = rank["losses"]
        assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
        assert losses[0] == pytest.approx(math.log(rank["vocab_size"]), rel=0.05)
        assert losses[-1] < losses[0] - 0.05
        assert rank["rotary_exact"] and rank["tied"] and rank["norms_one"] and not rank["meta_left"], rank
        assert rank["plan"] == ranks[0]["plan"] and len(set(rank["plan"].values())) > 1
