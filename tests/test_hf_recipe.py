"""The Hugging Face recipe (conf/model/hf_*): transformers causal LMs built from configs, nothing downloaded.

In-process: every tiny config trains a step from the GPT recipe's batches with a loss of about
ln(vocab) at initialisation, builds on the meta device (Lightning's ``init_module(empty_init=True)``)
with shapes only, and ``model.pretrained=DIR`` reads back the weights a model saved. One 2-rank run
of ``osdp-train model=hf_llama_tiny strategy=ddp`` end to end.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from ckpt_launch import run_ranks
from hydra import compose, initialize_config_module
from hydra.utils import instantiate
from omegaconf import DictConfig
from osdp_lightning.recipes.hf import HFCausalLMModule
from osdp_lightning.recipes.hf.model import build_causal_lm

pytest.importorskip("transformers")

TINY = ["hf_llama_tiny", "hf_gpt2_tiny", "hf_neox_tiny"]
NET_CLASS = {"hf_llama_tiny": "LlamaForCausalLM", "hf_gpt2_tiny": "GPT2LMHeadModel",
             "hf_neox_tiny": "GPTNeoXForCausalLM"}


def compose_model(model: str, *overrides: str) -> DictConfig:
    with initialize_config_module("osdp_lightning.conf", version_base="1.3"):
        return compose("train", overrides=[f"model={model}", "output_dir=/tmp/unused", *overrides])


def random_batch(cfg: DictConfig, batch_size: int = 4) -> dict[str, torch.Tensor]:
    """A batch as the GPT recipe's data makes it (labels are the inputs shifted one left), of random bytes."""
    datamodule = instantiate(cfg.data)
    windows = [torch.randint(0, 256, (datamodule.window_len,)) for _ in range(batch_size)]
    return datamodule.collate(windows)


@pytest.mark.parametrize("model", TINY)
def test_tiny_config_trains_a_step_from_a_loss_near_ln_vocab(model: str) -> None:
    cfg = compose_model(model)
    torch.manual_seed(0)
    module = instantiate(cfg.model)
    assert isinstance(module, HFCausalLMModule) and type(module.net).__name__ == NET_CLASS[model]
    assert module.net.config.vocab_size == cfg.model.hf_config.vocab_size == 384
    batch = random_batch(cfg)
    assert batch["input_ids"].shape == (4, cfg.data.seq_len)
    loss = module.compute_loss(batch)
    assert abs(loss.item() - math.log(384)) < 0.3, loss
    # The labels are taken as given (already shifted), not shifted once more by transformers.
    logits = module.net(input_ids=batch["input_ids"]).logits  # (B, T, V)
    assert torch.allclose(loss, F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()), atol=1e-5)
    loss.backward()
    grads = [p.grad for p in module.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(g.abs().sum() for g in grads) > 0


@pytest.mark.parametrize("model", [*TINY, "hf_llama_110m"])
def test_builds_on_the_meta_device_with_shapes_only(model: str, tmp_path: Path) -> None:
    cfg = compose_model(model)
    with torch.device("meta"):
        module = instantiate(cfg.model)
    tensors = [*module.parameters(), *module.buffers()]
    assert tensors and all(t.is_meta for t in tensors)
    if model == "hf_llama_110m":  # the count its header states
        assert abs(sum(p.numel() for p in module.parameters()) / 1e6 - 109.5) < 0.05
        assert module.net.lm_head.weight is module.net.model.embed_tokens.weight


def test_lightning_init_module_builds_it_on_the_meta_device(tmp_path: Path) -> None:
    """What ``meta_init=true`` runs: the model is built inside the strategy's ``init_module`` context."""
    cfg = compose_model("hf_llama_tiny", "trainer=smoke", f"output_dir={tmp_path}")
    trainer = instantiate(cfg.trainer, strategy=instantiate(cfg.strategy, _convert_="all"), logger=False)
    with trainer.init_module(empty_init=True):
        module = instantiate(cfg.model)
    assert all(t.is_meta for t in [*module.parameters(), *module.buffers()])


def test_pretrained_directory_gives_back_the_saved_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a local directory: nothing may be fetched
    cfg = compose_model("hf_llama_tiny")
    torch.manual_seed(0)
    saved = instantiate(cfg.model).net
    saved.save_pretrained(tmp_path / "llama")
    torch.manual_seed(1)  # a different draw: only the files can make the weights equal
    loaded = instantiate(cfg.model, pretrained=str(tmp_path / "llama"))
    assert loaded.pretrained == str(tmp_path / "llama")
    assert loaded.net.training  # from_pretrained returns eval mode: dropout and checkpointing would be off
    expected = saved.state_dict()
    assert loaded.net.state_dict().keys() == expected.keys()
    assert all(torch.equal(t, expected[k]) for k, t in loaded.net.state_dict().items())
    # On the meta device the directory gives the architecture only; its weights are the strategy's.
    with torch.device("meta"):
        meta = instantiate(cfg.model, pretrained=str(tmp_path / "llama"), hf_config={"num_hidden_layers": 7})
    assert meta.net.config.num_hidden_layers == 2 and all(p.is_meta for p in meta.parameters())


def test_without_transformers_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"osdp_lightning\[hf\]"):
        build_causal_lm("llama", {})


def _train(tmp_path: Path, name: str, *overrides: str) -> tuple[dict, list[float]]:
    """``osdp-train model=hf_llama_tiny ...`` on 2 ranks started together (as torchrun does): the
    summary and the logged losses."""
    run_dir = tmp_path / name
    done = run_ranks(["-m", "osdp_lightning.cli.train", "model=hf_llama_tiny", "cluster=cpu_2", "trainer=smoke",
                      "trainer.max_steps=8", f"hydra.run.dir={run_dir}", *overrides],
                     tmp_path / f"{name}.log", 240, cwd=tmp_path)
    assert done.returncode == 0, done.log[-6000:]
    with (run_dir / "csv" / "metrics.csv").open() as f:
        losses = [float(row["train/loss"]) for row in csv.DictReader(f) if row.get("train/loss")]
    return json.loads((run_dir / "summary.json").read_text()), losses


@pytest.mark.multiprocess
def test_osdp_train_fine_tunes_hf_llama_tiny_from_a_saved_directory(tmp_path: Path) -> None:
    """``model.pretrained=DIR``: Lightning's DDP loads it eagerly; osdp builds the model on the meta
    device under a budget DDP does not fit and reads each rank's shards: the same losses."""
    torch.manual_seed(3)
    instantiate(compose_model("hf_llama_tiny").model).net.save_pretrained(tmp_path / "pretrained")
    pretrained = f"model.pretrained={tmp_path / 'pretrained'}"
    ddp, ddp_losses = _train(tmp_path, "ddp", "strategy=ddp", pretrained)
    assert ddp["model"] == "hf_llama_tiny" and ddp["strategy"] == "ddp" and ddp["steps"] == 8
    assert ddp["final_loss"] < math.log(384) - 0.2, ddp["final_loss"]
    osdp, osdp_losses = _train(tmp_path, "osdp", "meta_init=true", "cluster.memory_budget=60%ddp", pretrained)
    plan = json.loads((tmp_path / "osdp" / "plan.json").read_text())
    assert plan["world_size"] == 2 and {u["choice"] for u in plan["units"]} != {"replicate"}
    assert len(osdp_losses) == len(ddp_losses) == 8
    assert osdp_losses[0] == pytest.approx(ddp_losses[0], rel=1e-6)
    assert osdp_losses == pytest.approx(ddp_losses, rel=1e-4)
