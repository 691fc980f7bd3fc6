"""One training run of a Hugging Face model for :mod:`benchmarks.hf_models`, on every rank.

Run as a script on every rank (:func:`benchmarks.launch.run_ranks` starts them together)::

    python -m benchmarks.hf_worker --family llama --method osdp --budget 60%ddp --out run.json
    python -m benchmarks.hf_worker --family t5 --method osdp --budget 12345678 --meta --out run.json
    python -m benchmarks.hf_worker --family gpt2 --method ddp --out run.json

Builds one of five ``transformers`` families from a config (random weights, nothing downloaded):
Llama, GPT-2 and GPT-NeoX causal LMs, BERT masked LM, T5 encoder-decoder, ``--layers`` blocks of
``--width`` (T5: that many in the encoder and in the decoder), on synthetic token sequences
(arithmetic progressions modulo the vocabulary: learnable, the same in every run), and trains it
with osdp (eagerly or on the meta device) or Lightning's ``strategy="ddp"``. Rank 0 writes JSON:
the loss of every step, the training summary (measured peak, median step), the plan's
predictions and choices, setup seconds, per-unit profiled seconds, or the smallest budget osdp
names when nothing fits. An osdp record keeps the whole plan, the profile and the tracked step's
bytes per module (``TrainingSummary(module_memory=True)``): ``python -m benchmarks.memory_moments``
sets them beside the memory model's moments.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import osdp_lightning  # noqa: F401  (registers strategy="osdp")
from benchmarks.compare_worker import _SMALLEST_RE, PhaseTimer
from osdp_lightning import InfeasibleBudgetError, OSDPStrategy, TrainingSummary
from osdp_lightning.runtime.process_memory import process_status_bytes
from osdp_lightning.runtime.shutdown import release_at_exit

FAMILIES = ("llama", "gpt2", "neox", "bert", "t5")


@dataclasses.dataclass(frozen=True)
class Shape:
    """The size of every family's model and of its micro-batch."""

    layers: int = 4
    width: int = 256
    seq_len: int = 128
    batch_size: int = 4
    """Micro-batch per rank."""
    vocab_size: int = 384

    @property
    def heads(self) -> int:
        return max(1, self.width // 64)


def hf_model(family: str, shape: Shape) -> nn.Module:
    """``family``'s model at ``shape``: MLPs 4x the width, no dropout, token id 0 as pad/bos/eos."""
    import transformers as hf

    w, n, heads = shape.width, shape.layers, shape.heads
    ids = dict(vocab_size=shape.vocab_size, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if family == "llama":  # rotary, grouped-query attention (half as many key/value heads), RMSNorm, SwiGLU
        return hf.LlamaForCausalLM(hf.LlamaConfig(hidden_size=w, intermediate_size=4 * w, num_hidden_layers=n,
                                                  num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                                                  max_position_embeddings=shape.seq_len, **ids))
    if family == "gpt2":  # learned positions, Conv1D, head tied to the token embedding
        return hf.GPT2LMHeadModel(hf.GPT2Config(n_positions=shape.seq_len, n_embd=w, n_layer=n, n_head=heads,
                                                n_inner=4 * w, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **ids))
    if family == "neox":  # partial rotary, parallel attention and MLP, untied head
        return hf.GPTNeoXForCausalLM(hf.GPTNeoXConfig(hidden_size=w, intermediate_size=4 * w, num_hidden_layers=n,
                                                      num_attention_heads=heads, max_position_embeddings=shape.seq_len,
                                                      hidden_dropout=0.0, attention_dropout=0.0, **ids))
    if family == "bert":  # post-norm encoder, masked-LM head tied to the word embedding
        return hf.BertForMaskedLM(hf.BertConfig(hidden_size=w, num_hidden_layers=n, num_attention_heads=heads,
                                                intermediate_size=4 * w, max_position_embeddings=shape.seq_len,
                                                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **ids))
    if family == "t5":  # encoder-decoder, relative position buckets, shared embedding
        return hf.T5ForConditionalGeneration(hf.T5Config(d_model=w, d_kv=64, d_ff=4 * w, num_layers=n,
                                                         num_heads=heads, dropout_rate=0.0,
                                                         decoder_start_token_id=0, **ids))
    raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")


def token_sequences(shape: Shape, count: int, seed: int = 1234) -> torch.Tensor:
    """``(count, seq_len)`` arithmetic progressions modulo the vocabulary, steps 1-3."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, shape.vocab_size, (count, 1), generator=g)
    return (start + torch.arange(shape.seq_len) * torch.randint(1, 4, (count, 1), generator=g)) % shape.vocab_size


class HFBenchModule(L.LightningModule):
    """A Hugging Face model as ``self.net``, trained on its own loss with the batch as labels (causal
    LMs shift them; BERT predicts each token; T5's decoder reads them shifted right); AdamW."""

    def __init__(self, family: str, shape: Shape, steps: int = 12, lr: float = 1e-3) -> None:
        super().__init__()
        self.family, self.shape, self.steps, self.lr = family, shape, steps, lr
        self.net = hf_model(family, shape)
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch  # (B, T)
        extra = {} if self.family in ("bert", "t5") else {"use_cache": False}
        return self.net(input_ids=tokens, labels=tokens, **extra).loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        world = self.trainer.world_size if self._trainer is not None else 1
        tokens = token_sequences(self.shape, self.steps * self.shape.batch_size * world)
        return DataLoader(TensorDataset(tokens), batch_size=self.shape.batch_size, shuffle=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=FAMILIES, required=True)
    parser.add_argument("--method", choices=("osdp", "ddp"), required=True, help="ddp: Lightning's strategy='ddp'")
    parser.add_argument("--budget", default=None, help="osdp's memory_budget: bytes or a share such as 60%%ddp")
    parser.add_argument("--meta", action="store_true", help="build under trainer.init_module(empty_init=True)")
    for field in dataclasses.fields(Shape):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=int, default=field.default)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    return parser


def shape_of(args: argparse.Namespace) -> Shape:
    return Shape(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Shape)})


def run(args: argparse.Namespace) -> tuple[L.Trainer, dict[str, Any]]:
    """Train once; return the trainer and this rank's record."""
    L.seed_everything(args.seed, workers=True)
    budget = int(args.budget) if args.budget and args.budget.isdigit() else args.budget
    # NOTE: its budgets are shares of predicted peaks or 5% above the smallest named: they bound the priced tensors
    strategy = OSDPStrategy(memory_budget=budget, budget_covers="tensors") if args.method == "osdp" else "ddp"
    summary, phases = TrainingSummary(module_memory=args.method == "osdp"), PhaseTimer()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=args.steps, precision="32-true",
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        callbacks=[summary, phases], deterministic=True)
    meta = args.meta and args.method == "osdp"  # NOTE: Lightning's DDP cannot start from the meta device
    with trainer.init_module(empty_init=True) if meta else contextlib.nullcontext():
        module = HFBenchModule(args.family, shape_of(args), steps=args.steps)
    record: dict[str, Any] = {"family": args.family, "method": args.method, "meta": meta, "budget": args.budget,
                              "param_count": sum(p.numel() for p in module.parameters())}
    start = time.perf_counter()
    try:
        trainer.fit(module)
    except InfeasibleBudgetError as err:  # raised on every rank (rank 0's error is broadcast)
        match = _SMALLEST_RE.search(str(err))
        record.update(status="infeasible", message=str(err),
                      smallest_feasible_bytes=int(match.group(1)) if match else None)
        return trainer, record
    record.update(status="ok", fit_s=time.perf_counter() - start, losses=module.losses,
                  summary=summary.summary, phases=phases.medians())
    if isinstance(trainer.strategy, OSDPStrategy):
        record.update(osdp_record(trainer.strategy))
    else:
        record["summary"]["peak_bytes"] += ddp_bucket_bytes(trainer)
    return trainer, record


def osdp_record(strategy: OSDPStrategy) -> dict[str, Any]:
    """What osdp planned and predicted, and how it profiled."""
    plan = strategy.plan
    units = strategy.profile.units if strategy.profile is not None else ()
    return {"setup_s": strategy.setup_s, "profiled_whole": bool(strategy._profile_whole),
            "choices": plan.choice_counts(), "unit_choices": {u.name or "<root>": u.choice for u in plan.units},
            "plan": plan.to_dict(),
            "profile": dataclasses.asdict(strategy.profile) if strategy.profile is not None else None,
            "baselines": {b.choice: {"step_s": b.step_s, "peak_bytes": b.peak_bytes, "fits": b.fits}
                          for b in plan.baselines},
            "units": [{"name": u.name or "<root>", "param_count": u.param_count, "forward_s": u.forward_s,
                       "backward_s": u.backward_s, "activation_bytes": u.activation_bytes} for u in units],
            "profile_step_s": strategy.profile.step_s if strategy.profile is not None else None}


def ddp_bucket_bytes(trainer: L.Trainer) -> int:
    """DDP's gradient buckets (allocated in C++, invisible to the tracker): a second copy of every
    gradient unless they are views (as benchmarks.compare_worker counts them)."""
    model = trainer.strategy.model
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) and not model.gradient_as_bucket_view:
        return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return 0


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    release_at_exit()  # NOTE: destroys the process group at exit while the interpreter is alive (shutdown.py)
    trainer, record = run(args)
    record["process"] = process_status_bytes("VmHWM", "VmData")
    if trainer.global_rank == 0:
        Path(args.out).write_text(json.dumps(record, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
