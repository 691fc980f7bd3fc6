"""Small LightningModules the osdp strategy was not written for (used by multi-process tests)."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import osdp_lightning

VOCAB, SEQ = 64, 16


class LossRecorder(L.LightningModule):
    """Shared training logic: records the per-step loss, plain Adam (``optimizer_foreach``: Adam's
    ``foreach`` flag; ``None`` is torch's default, the per-tensor path on CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.optimizer_foreach: bool | None = None
        self.losses: list[float] = []
        self.batch_size = 8
        self.step_calls = {"real": 0, "profiling": 0}

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        # a user's side effect: osdp's profiling steps must be distinguishable from real ones
        # (osdp_lightning.is_profiling() is also trainer.strategy.profiling; it works without a Trainer)
        self.step_calls["profiling" if osdp_lightning.is_profiling() else "real"] += 1
        loss = self.compute_loss(batch)
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.losses.append(float(outputs["loss"]))

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.Adam(self.parameters(), lr=1e-3, foreach=self.optimizer_foreach)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1234)
        data = self.make_data(g)
        return DataLoader(TensorDataset(*data), batch_size=self.batch_size, shuffle=True,
                          generator=torch.Generator().manual_seed(7))


class Regression(LossRecorder):
    """Data and loss of the MLPs: regress the sum of the first 4 of ``width`` inputs."""

    width: int

    def make_data(self, g: torch.Generator) -> tuple[torch.Tensor, ...]:
        x = torch.randn(256, self.width, generator=g)
        return x, x[:, :4].sum(dim=1, keepdim=True)

    def compute_loss(self, batch) -> torch.Tensor:  # noqa: ANN001
        x, y = batch
        return nn.functional.mse_loss(self.predict(x), y)


class MLP(Regression):
    def __init__(self, width: int = 256, depth: int = 4) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, 1))
        self.width = width

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class TorchTransformer(LossRecorder):
    """A classifier built from torch.nn's own attention modules."""

    def __init__(self, d_model: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        block = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(block, num_layers=layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 2)

    def make_data(self, g: torch.Generator) -> tuple[torch.Tensor, ...]:
        x = torch.randint(0, VOCAB, (256, SEQ), generator=g)
        return x, (x[:, 0] > VOCAB // 2).long()

    def compute_loss(self, batch) -> torch.Tensor:  # noqa: ANN001
        x, y = batch
        h = self.encoder(self.embed(x))  # (B, T, C)
        return nn.functional.cross_entropy(self.head(h.mean(dim=1)), y)


class TiedLM(LossRecorder):
    """A causal language model whose output head is tied to its embedding."""

    def __init__(self, d_model: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Parameter(torch.zeros(SEQ, d_model))
        block = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model, dropout=0.0,
                                           batch_first=True)
        self.blocks = nn.TransformerEncoder(block, num_layers=layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ - 1))

    def make_data(self, g: torch.Generator) -> tuple[torch.Tensor, ...]:
        start = torch.randint(0, VOCAB, (256, 1), generator=g)
        return ((start + torch.arange(SEQ)) % VOCAB,)  # counting sequences: learnable

    def compute_loss(self, batch) -> torch.Tensor:  # noqa: ANN001
        (tokens,) = batch
        x, y = tokens[:, :-1], tokens[:, 1:]
        h = self.embed(x) + self.pos[: x.shape[1]]  # (B, T, C)
        h = self.norm(self.blocks(h, mask=self.mask, is_causal=True))
        return nn.functional.cross_entropy(self.head(h).reshape(-1, VOCAB), y.reshape(-1))


class DropoutMLP(Regression):
    """Blocks of Linear, ReLU and dropout: a checkpointed block must redraw the same dropout masks."""

    def __init__(self, width: int = 256, depth: int = 4, p: float = 0.2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Dropout(p))
                                    for _ in range(depth))
        self.head = nn.Linear(width, 1)
        self.width = width

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)  # (B, width)
        return self.head(x)


class MemoBlock(nn.Module):
    """Computes a projection of the step's context once and keeps it in a ``memo`` the step passes in,
    as T5's decoder keeps its cross-attention keys in a cache: recomputed in backward, it finds the
    projection there and skips it, so checkpointing it cannot replay its forward."""

    def __init__(self, width: int, index: int) -> None:
        super().__init__()
        self.index = index
        self.proj = nn.Linear(width, width)
        self.mix = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, context: torch.Tensor, memo: dict[int, torch.Tensor]) -> torch.Tensor:
        if self.index not in memo:
            memo[self.index] = self.proj(context)  # (B, width)
        return x + torch.relu(self.mix(x)) * memo[self.index]


class MemoMLP(Regression):
    """Blocks that share a per-step memo (:class:`MemoBlock`): profiling refuses to checkpoint them."""

    def __init__(self, width: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MemoBlock(width, i) for i in range(depth))
        self.head = nn.Linear(width, 1)
        self.width = width

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        memo: dict[int, torch.Tensor] = {}
        h = x
        for block in self.blocks:
            h = block(h, x, memo=memo)  # (B, width)
        return self.head(h)


class HuggingFaceLM(LossRecorder):
    """A Hugging Face ``transformers`` model built from a config: random weights, nothing downloaded.

    Its blocks (``GPT2Block``, ``BertLayer``, ``T5Block``, ``LlamaDecoderLayer``) are found by the default unit selection,
    as an FSDP user's auto-wrap policy finds them.
    """

    def __init__(self, kind: str) -> None:
        super().__init__()
        import transformers as hf

        small = dict(vocab_size=VOCAB, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        if kind == "gpt2":
            self.net = hf.GPT2LMHeadModel(hf.GPT2Config(n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                                        embd_pdrop=0.0, attn_pdrop=0.0, **small))
        elif kind == "bert":
            self.net = hf.BertForMaskedLM(hf.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                        intermediate_size=64, max_position_embeddings=SEQ,
                                                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                                        **small))
        elif kind == "llama":  # rotary position tables, grouped-query attention, RMSNorm
            self.net = hf.LlamaForCausalLM(hf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                          num_attention_heads=4, num_key_value_heads=2,
                                                          max_position_embeddings=SEQ, **small))
        else:
            self.net = hf.T5ForConditionalGeneration(hf.T5Config(d_model=32, d_kv=16, d_ff=64, num_layers=2,
                                                                 num_heads=2, dropout_rate=0.0,
                                                                 decoder_start_token_id=0, **small))

    def make_data(self, g: torch.Generator) -> tuple[torch.Tensor, ...]:
        start = torch.randint(0, VOCAB, (256, 1), generator=g)
        return ((start + torch.arange(SEQ)) % VOCAB,)

    def compute_loss(self, batch) -> torch.Tensor:  # noqa: ANN001
        (tokens,) = batch
        return self.net(input_ids=tokens, labels=tokens).loss


MODELS = {"mlp": MLP, "transformer": TorchTransformer, "tied_lm": TiedLM, "dropout_mlp": DropoutMLP, "memo_mlp": MemoMLP,
          **{f"hf_{kind}": (lambda kind=kind: HuggingFaceLM(kind)) for kind in ("gpt2", "bert", "t5", "llama")}}


class DropoutGPT2(LossRecorder):
    """Hugging Face GPT-2 (3 blocks x 64) with dropout 0.1 everywhere, random weights, nothing downloaded:
    its masks in the first step must be DDP's whatever setup drew while planning."""

    def __init__(self) -> None:
        super().__init__()
        import transformers as hf

        self.net = hf.GPT2LMHeadModel(hf.GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=3, n_head=4, resid_pdrop=0.1, embd_pdrop=0.1,
            attn_pdrop=0.1, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0))

    make_data = HuggingFaceLM.make_data
    compute_loss = HuggingFaceLM.compute_loss


MODELS["hf_gpt2_dropout"] = DropoutGPT2
