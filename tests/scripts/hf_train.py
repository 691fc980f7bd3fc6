"""Train a small Hugging Face model (built from a config: random weights, nothing downloaded) on 2 gloo
ranks, eagerly or on the meta device, and write what happened as JSON (one file per rank).

    python hf_train.py --family llama --strategy osdp --budget 60%ddp --out r.json
    python hf_train.py --family llama --strategy ddp --out ddp.json
    python hf_train.py --family gpt2 --meta --budget 60%ddp --out meta.json
    python hf_train.py --family llama --choices 'net.model.layers.0=zero2+ckpt' --out mixed.json  # others zero3
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import transformers as hf
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import osdp_lightning  # noqa: F401  (registers "osdp")
from osdp_lightning import OSDPStrategy
from osdp_lightning.cost.cluster import ClusterSpec
from osdp_lightning.plan.plan import Plan, fixed_plan
from osdp_lightning.profiling.estimate import estimate_profile
from osdp_lightning.profiling.records import with_parts

VOCAB, SEQ, BATCH = 256, 32, 4
SMALL = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def hf_model(family: str) -> torch.nn.Module:
    """A two-block model of each family that osdp plans from shapes."""
    if family == "llama":  # rotary, grouped-query attention, RMSNorm
        return hf.LlamaForCausalLM(hf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2,
                                                  max_position_embeddings=SEQ, **SMALL))
    if family == "gpt2":
        return hf.GPT2LMHeadModel(hf.GPT2Config(n_positions=SEQ, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                                                embd_pdrop=0.0, attn_pdrop=0.0, **SMALL))
    if family == "neox":
        return hf.GPTNeoXForCausalLM(hf.GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                      num_attention_heads=4, max_position_embeddings=SEQ,
                                                      hidden_dropout=0.0, attention_dropout=0.0, **SMALL))
    if family == "bert":
        return hf.BertForMaskedLM(hf.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                intermediate_size=128, max_position_embeddings=SEQ,
                                                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **SMALL))
    if family == "t5":
        return hf.T5ForConditionalGeneration(hf.T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                                         dropout_rate=0.0, decoder_start_token_id=0, **SMALL))
    if family == "lightning_demo":  # not Hugging Face: Lightning's demo, whose encoder reads its mask's values
        from lightning.pytorch.demos import Transformer

        return Transformer(vocab_size=VOCAB, ninp=32, nhead=2, nhid=64, nlayers=2)
    raise ValueError(f"unknown family {family!r}")


class HFModule(L.LightningModule):
    """A Hugging Face model as ``self.net``, trained as its own training path runs it (cache off)."""

    def __init__(self, family: str) -> None:
        super().__init__()
        self.family = family
        self.net = hf_model(family)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        (tokens,) = batch
        if self.family == "lightning_demo":
            out = self.net(tokens[:, :-1], tokens[:, 1:])  # (B * (SEQ - 1), VOCAB) log-probabilities
            return torch.nn.functional.nll_loss(out, tokens[:, 1:].reshape(-1))
        extra = {} if self.family in ("bert", "t5") else {"use_cache": False}
        return self.net(input_ids=tokens, labels=tokens, **extra).loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.losses.append(float(outputs["loss"]))

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1234)
        start = torch.randint(0, VOCAB, (128, 1), generator=g)
        tokens = (start + torch.arange(SEQ) * torch.randint(1, 4, (128, 1), generator=g)) % VOCAB
        return DataLoader(TensorDataset(tokens), batch_size=BATCH, shuffle=False)


def hand_made_plan(family: str, choices: str, world_size: int) -> Plan:
    """``name=choice;...`` (other units zero3) priced on the dry-run profile of the same model."""
    wanted = dict(item.split("=", 1) for item in choices.split(";") if item)
    batch = torch.zeros(BATCH, SEQ, dtype=torch.long)
    profile = estimate_profile(lambda: HFModule(family), (batch,), peak_flops_per_s=1e12,
                               with_parts=True)
    # a block whose parts are named is planned by its parts
    profile = with_parts(profile, [u.name for u in profile.units if any(p.name in wanted for p in u.parts)])
    cluster = ClusterSpec(world_size=world_size, memory_budget_bytes=2**40, collective_latency_s=1e-4,
                          bandwidth_bytes_per_s=1e9)
    return fixed_plan(profile, cluster, [wanted.get(u.name, "zero3") for u in profile.units], source="hand-made")


def tensor_stats(module: torch.nn.Module) -> dict[str, dict]:
    """Per parameter and buffer, over the whole tensor (gathered): mean, std, and whether finite."""
    out = {}
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        whole = t.full_tensor() if isinstance(t, DTensor) else t
        whole = whole.detach().double()
        out[name] = {"mean": float(whole.mean()), "std": float(whole.std()) if whole.numel() > 1 else 0.0,
                     "finite": bool(torch.isfinite(whole).all()), "numel": whole.numel()}
    return out


class Record(L.Callback):
    def __init__(self) -> None:
        self.stats: dict = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.stats = tensor_stats(pl_module.net)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="llama")
    parser.add_argument("--strategy", default="osdp")
    parser.add_argument("--meta", action="store_true")
    parser.add_argument("--budget", default=None)
    parser.add_argument("--choices", default=None, help="a hand-made plan instead of solving")
    parser.add_argument("--split-factors", default="2")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    L.seed_everything(0)
    if args.strategy == "osdp":
        plan = hand_made_plan(args.family, args.choices, 2) if args.choices else None
        strategy = OSDPStrategy(memory_budget=args.budget, plan=plan,
                                split_factors=tuple(int(k) for k in args.split_factors.split(",") if k))
    else:
        strategy = args.strategy
    record = Record()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[record], deterministic=True)
    with trainer.init_module(empty_init=args.meta):
        model = HFModule(args.family)
    try:
        trainer.fit(model)
        osdp = isinstance(trainer.strategy, OSDPStrategy)
        result = {"losses": model.losses, "stats": record.stats,
                  "plan": {u.name: u.choice for u in trainer.strategy.plan.units} if osdp else {},
                  "profiled_whole": bool(getattr(trainer.strategy, "profiled_whole", True))}
    except Exception as err:  # the test reads which error every rank raised
        result = {"error": f"{type(err).__name__}: {err}"}
    rank = dist.get_rank() if dist.is_initialized() else 0
    Path(f"{args.out}.rank{rank}").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
